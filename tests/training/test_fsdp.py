"""Sharded data parallelism (parallel.dp_shard: FSDP2, HSDP) for a user's own model through ctx.parallelize and
ctx.checkpoint, on 4 gloo ranks: the single process's losses at every layout, a quarter of the state per rank,
checkpoints where every rank writes only its own shard and that load into any other layout, and the rule that
picks each piece's one writer (a property over layouts).

The built-in trainer's sharded layouts are in tests/training/test_train_layouts.py (same parametrisation as the others).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from conftest import REPO, run_cli
from hypothesis import given, settings
from hypothesis import strategies as st
from trainjobs import grad_norms, losses

from hpcscale.ckpt.shards import LocalShard, _numel, _piece, writers
from hpcscale.errors import BadInput
from hpcscale.layout import ParallelDims, layout_problems
from hpcscale.parallel.pipeline import cut_stage

HELPERS = REPO / "tests" / "helpers"


def _job(
    path: Path,
    *,
    ranks: int,
    tp: int = 1,
    pp: int = 1,
    dp_shard: int = 1,
    steps: int = 12,
    meta: bool = False,
    ac: bool = False,
) -> Path:
    spec = {
        "name": f"fsdp-{ranks}-{tp}-{pp}-{dp_shard}",
        "site": "local",
        "tasks_per_node": ranks,
        "parallel": {"tp": tp, "pp": pp, "dp_shard": dp_shard, "activation_checkpointing": ac},
        "timeout_seconds": 120,
        "hang_timeout_seconds": 100,
        "environment": {"PYTHONPATH": str(HELPERS)},
        "train": {"entry": "fsdp_entry:main", "params": {"steps": steps, "meta": meta}},
        "checkpoint": {"every_steps": 4, "keep_last": 10},
    }
    path.write_text(yaml.safe_dump(spec))
    return path


def _run(tmp: Path, run: Path, *extra: str, **layout) -> str:
    name = "-".join(f"{k}{v}" for k, v in sorted(layout.items()))
    r = run_cli("run", str(_job(tmp / f"{name}.yaml", **layout)), "--local", "--run-dir", str(run), *extra, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout


def _close(got: dict[int, float], want: dict[int, float]) -> None:
    assert sorted(got) == sorted(k for k in want if k in got) and got
    worst = max(abs(got[k] - want[k]) / abs(want[k]) for k in got)
    assert worst <= 1e-5, f"max relative difference {worst:.2e}"


@pytest.fixture(scope="module")
def single(mpi, tmp_path_factory) -> Path:
    """The entry point on one process for 16 steps: what every layout must reproduce."""
    tmp = tmp_path_factory.mktemp("single")
    _run(tmp, tmp / "run", ranks=1, steps=16)
    assert len(losses(tmp / "run")) == 16
    return tmp / "run"


@pytest.fixture(scope="module")
def hsdp2x2(mpi, tmp_path_factory) -> Path:
    """The entry point at dp_shard 2 x 2 replicas (4 ranks), 12 steps, built whole: one of the layouts below,
    and the uninterrupted run the sharded-checkpoint test stops and resumes against. Read-only."""
    tmp = tmp_path_factory.mktemp("hsdp2x2")
    _run(tmp, tmp / "run", ranks=4, dp_shard=2)
    return tmp / "run"


def _state_bytes(run: Path, ranks: int) -> list[int]:
    return [int((run / f"state_bytes.{r}").read_text()) for r in range(ranks)]


@pytest.mark.parametrize(
    ("tp", "pp", "dp_shard", "meta", "ac"),
    [
        (1, 1, 4, True, False),
        (1, 1, 2, False, False),
        (2, 1, 2, True, True),
        (1, 2, 2, True, True),
    ],
    ids=["dp_shard4-meta", "hsdp2x2", "tp2-dp_shard2-meta-ac", "pp2-dp_shard2-meta-ac"],
)  # replicated dp under a pipeline: the built-in trainer's pp2-dp2 (test_train_layouts.py, test_ckpt.py)
def test_user_model_at_every_layout_gives_the_single_process_losses(
    single, request, tmp_path, tp, pp, dp_shard, meta, ac
):
    """The single process builds the model whole; `meta` layouts build it on the meta device and each rank
    materializes only its shards: the same initial weights, so the same losses. `ac`: with the job's
    parallel.activation_checkpointing (each block's forward recomputed in backward): the same losses again."""
    if (tp, pp, dp_shard, meta) == (1, 1, 2, False):
        run = request.getfixturevalue("hsdp2x2")  # shared with the sharded-checkpoint test
    else:
        run = tmp_path / "run"
        _run(tmp_path, run, ranks=4, tp=tp, pp=pp, dp_shard=dp_shard, meta=meta, ac=ac)
        if ac:  # it was applied: the entry point counts the blocks torch's checkpoint wraps
            assert (run / "ac_blocks.0").read_text() == str(4 // pp), "activation checkpointing was not applied"
    got = losses(run)
    assert len(got) == 12
    _close(got, losses(single))
    # ctx.clip_grad_norm_ gives the single process's norm at every layout (clipped at 0.5: the losses follow)
    norms = grad_norms(run)
    assert len(norms) == 12 and max(norms) > 0.5
    _close(dict(enumerate(norms)), dict(enumerate(grad_norms(single))))
    # what each rank holds of parameters, gradients and AdamW's moments: 1/dp_shard of the model's, within
    # the bound the design promises (1.2/N of replicated plus one block's full parameters)
    whole = _state_bytes(single, 1)[0]
    block = 4 * (32 * 128 + 128 + 128 * 32 + 32 + 2 * 32)  # one Block's fp32 parameters (fsdp_entry.WIDTH = 32)
    n = dp_shard * tp * pp  # the state is split over the shard group, tp and the pipeline stages alike
    for held in _state_bytes(run, 4):
        assert held <= 1.2 * whole / n + block, (held, whole)


def test_sharded_checkpoints_are_written_shard_by_shard_and_load_into_every_layout(single, hsdp2x2, tmp_path):
    """dp_shard 4 -> tp 2 x dp 2 (replicated) -> pp 2 x dp_shard 2 -> 1 rank, 4 steps each: the single process's
    losses. A stop and resume on the same sharded layout, bit for bit, is tests/training/test_gpu_defaults.py's
    (HSDP, FSDP under tp and under a pipeline, a user's tp model), at the kernels GPUs run by default."""
    run = tmp_path / "run"
    _run(tmp_path, run, ranks=4, dp_shard=4, steps=4)
    index = run / "checkpoints" / "step-00000004"
    from hpcscale.ckpt.format import read_index

    saved = read_index(index / "index.h5")
    assert saved.layout == {"pp": 1, "dp": 4, "tp": 1, "dp_shard": 4}
    assert "pp=1 dp=4 dp_shard=4 tp=1" in run_cli("ckpt", "ls", str(run)).stdout  # the listing says it is sharded
    for name in ("model/layers.0.fc.weight", "optim/layers.0.fc.weight/exp_avg"):
        shards = saved.tensors[name].shards
        # four pieces, each in the data file of the one rank that holds it: nothing gathered to one rank
        assert [s.offset for s in shards] == [(0, 0), (32, 0), (64, 0), (96, 0)]
        assert [{c.file for c in s.chunks} for s in shards] == [
            {f"step-00000004/data/rank-{r:05d}.bin"} for r in range(4)
        ]
    # the head's 50 rows shard unevenly (torch.chunk: 13, 13, 13, 11), each piece saved where it sits
    head = saved.tensors["model/head.weight"].shards
    assert [(s.offset, s.shape) for s in head] == [
        ((0, 0), (13, 32)),
        ((13, 0), (13, 32)),
        ((26, 0), (13, 32)),
        ((39, 0), (11, 32)),
    ]
    sizes = [(index / "data" / f"rank-{r:05d}.bin").stat().st_size for r in range(4)]
    assert max(sizes) <= 1.1 * min(sizes), sizes
    out = _run(tmp_path, run, "--reuse", ranks=4, tp=2, steps=8)
    assert "resumed from checkpoint step 4 (new layout: resharded)" in out
    out = _run(tmp_path, run, "--reuse", ranks=4, pp=2, dp_shard=2, steps=12)
    assert "resumed from checkpoint step 8 (new layout: resharded)" in out
    out = _run(tmp_path, run, "--reuse", ranks=1, steps=16)
    assert "resumed from checkpoint step 12 (new layout: resharded)" in out
    _close(losses(run), losses(single))

    # `ckpt export` of a sharded checkpoint is the whole model, as the single process's export is
    exported = {}
    for label, src in (
        ("sharded", hsdp2x2 / "checkpoints" / "step-00000012"),
        ("single", single / "checkpoints" / "step-00000012"),
    ):
        r = run_cli("ckpt", "export", str(src), "--format", "torch", "-o", str(tmp_path / f"{label}.pt"))
        assert r.returncode == 0, r.stdout + r.stderr
        exported[label] = torch.load(tmp_path / f"{label}.pt", weights_only=True)
    assert exported["sharded"].keys() == exported["single"].keys()
    for name, t in exported["single"].items():
        assert exported["sharded"][name].shape == t.shape, name
        torch.testing.assert_close(exported["sharded"][name], t, rtol=1e-3, atol=1e-4)


def test_a_shard_degree_that_does_not_divide_dp_is_named_with_every_factor():
    problems = layout_problems(nodes=3, tasks_per_node=2, tp=2, pp=1, dp_shard=2)
    assert [(p.key, p.message) for p in problems] == [
        (
            "parallel.dp_shard",
            "dp_shard(2) does not divide the data-parallel degree dp = nodes(3) * tasks_per_node(2) / "
            "(tp(2) * pp(1)) = 3",
        )
    ]
    dims = ParallelDims.for_world(world_size=8, tp=2, pp=1, dp_shard=2)
    assert (dims.dp, dims.dp_replicate, dims.as_dict()) == (4, 2, {"pp": 1, "dp": 4, "tp": 2, "dp_shard": 2})
    # the shard group is the faster half of dp, right after tp: ranks 0,2 shard together, 0,4 replicate
    assert [dims.mesh_index(r)["dp_shard"] for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert [dims.mesh_index(r)["dp_replicate"] for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]


# ---- who writes what: a property over layouts and placements -------------------------------------------------
def _placements(kind: str, tp: int):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    return {
        "plain": None,
        "tp-col": (("tp",), (Shard(0),)),
        "tp-row": (("tp",), (Shard(1),)),
        "tp-rep": (("tp",), (Replicate(),)),
        "fsdp": (("dp_shard",), (Shard(0),)),
        "hsdp": (("dp_replicate", "dp_shard"), (Replicate(), Shard(0))),
        "fsdp-tp-col": (("dp_shard", "tp"), (_StridedShard(0, split_factor=tp), Shard(0))),
        "fsdp-tp-row": (("dp_shard", "tp"), (Shard(0), Shard(1))),
        "fsdp-tp-rep": (("dp_shard", "tp"), (Shard(0), Replicate())),
        "hsdp-tp-col": (("dp_replicate", "dp_shard", "tp"), (Replicate(), _StridedShard(0, split_factor=tp), Shard(0))),
    }[kind]


def _fake(name: str, shape: tuple, kind: str, dims: ParallelDims) -> LocalShard:
    """A tensor as writers() sees it: its name, global shape and (for a DTensor) mesh dimension names, mesh
    shape and placements; the local data is only asked for its element size."""
    spec = _placements(kind, dims.tp)
    if spec is None:
        return LocalShard(name, torch.empty(0), shape, (0,) * len(shape), source=torch.empty(0))
    names, placements = spec
    size = {"tp": dims.tp, "dp_shard": dims.dp_shard, "dp_replicate": dims.dp_replicate}
    mesh = SimpleNamespace(mesh_dim_names=names, mesh=torch.empty([size[n] for n in names]))
    return LocalShard(
        name, torch.empty(0), shape, (0,) * len(shape), source=SimpleNamespace(device_mesh=mesh, placements=placements)
    )


@settings(max_examples=60, deadline=None)
@given(
    tp=st.sampled_from([1, 2, 4]),
    dp_shard=st.sampled_from([1, 2, 3, 4]),
    dp_replicate=st.sampled_from([1, 2]),
    tensors=st.lists(
        st.tuples(
            st.sampled_from(
                [
                    "plain",
                    "tp-col",
                    "tp-row",
                    "tp-rep",
                    "fsdp",
                    "hsdp",
                    "fsdp-tp-col",
                    "fsdp-tp-row",
                    "fsdp-tp-rep",
                    "hsdp-tp-col",
                ]
            ),
            st.lists(st.integers(0, 9), min_size=1, max_size=2),
        ),
        min_size=1,
        max_size=6,
    ),
)
def test_every_piece_has_one_writer_among_its_holders_and_the_pieces_tile_the_tensor(
    tp, dp_shard, dp_replicate, tensors
):
    dims = ParallelDims(pp=1, dp=dp_shard * dp_replicate, tp=tp, dp_shard=dp_shard)
    fakes = []
    for i, (kind, shape) in enumerate(tensors):
        if kind.endswith("row") and len(shape) < 2:  # Shard(1) needs a second dimension
            kind = kind.replace("row", "col")
        if ("hsdp" in kind and dims.dp_replicate == 1) or ("fsdp" in kind and dims.dp_shard == 1):
            kind = "plain"
        fakes.append(_fake(f"t{i}", tuple(shape), kind, dims))
    table = writers(fakes, dims, pp_rank=0)
    for s in fakes:
        mine = {off: rank for (name, off), rank in table.items() if name == s.name}
        # the pieces written tile the tensor: their element counts add up to it, and no two overlap
        boxes = []
        for r in range(dims.world_size):
            if hasattr(s.source, "device_mesh"):
                where = dims.mesh_index(r)
                coord = tuple(where[n] for n in s.source.device_mesh.mesh_dim_names)
                shape, off = _piece(
                    s.global_shape, tuple(s.source.device_mesh.mesh.shape), coord, tuple(s.source.placements)
                )
            else:
                shape, off = s.global_shape, (0,) * len(s.global_shape)
            if _numel(shape):
                assert off in mine, (s.name, off)  # every rank's non-empty piece has a writer...
                boxes.append((off, shape, r))
        writer_holds = {(off, rank) for off, _, rank in boxes}
        for off, rank in mine.items():
            assert (off, rank) in writer_holds  # ...and that writer holds it
        distinct = {(off, shape) for off, shape, _ in boxes}
        assert sum(_numel(shape) for _, shape in distinct) == _numel(s.global_shape)
        assert len({off for off, _ in distinct}) == len(distinct)


def test_a_cross_site_site_refuses_sharding_naming_the_key(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(
        "name: x\nsite: local\ntasks_per_node: 4\nparallel:\n  dp_shard: 4\n"
        "train: {entry: builtin}\nxsite: {config: /nonexistent/xsite.yaml, site: a}\n"
    )
    r = run_cli("config", "validate", str(job))
    assert r.returncode == 2
    assert (
        f"{job}:5: parallel.dp_shard: dp_shard is 4: cross-site training (xsite:) is not supported"
        in r.stdout + r.stderr
    )


def test_the_trainer_saves_after_an_evaluation_when_sharded(mpi, tmp_path):
    """An evaluation's no-grad forwards leave FSDP's last block gathered (it does not reshard after forward):
    the save that follows must still name the optimizer's shards (it reshards first)."""
    from trainjobs import job_spec

    job = job_spec(
        tmp_path / "job.yaml", tp=1, pp=1, ranks=2, dp_shard=2, steps=4, eval_every=2, checkpoint={"every_steps": 2}
    )
    r = run_cli("run", str(job), "--local", "--run-dir", str(tmp_path / "run"), timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "val_loss" in r.stdout
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step-*")) == [
        "step-00000002",
        "step-00000004",
    ]


BF16_FORWARD = """
import os, sys
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from hpcscale.layout import ParallelDims
from hpcscale.parallel.fsdp import shard_model
from hpcscale.train.model import GPT, GPTShape, lm_loss
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp_shard",))
m = GPT(GPTShape(vocab_size=64, seq_len=16, n_layer=2, n_embd=32, n_head=2))
# the policies shard_model applies, on a one-rank mesh standing for the shard group
shard_model(m, mesh=mesh, dims=ParallelDims(tp=1, pp=1, dp=2, dp_shard=2), device=torch.device("cpu"),
            blocks=list(m.layers.values()), mixed_precision="bf16")
x = torch.randint(0, 64, (2, 17))
out = m(x[:, :-1])
lm_loss(out, x[:, 1:]).backward()
print("logits", out.dtype, "block params", next(m.layers["0"].parameters()).dtype)
dist.destroy_process_group()
"""


def test_bf16_mixed_precision_runs_a_model_with_layers_after_its_blocks_without_autocast(tmp_path):
    """mixed_precision bf16 without autocast (a user's loop): the root's own layers after the blocks (a final
    norm, the head) compute in bf16 on the blocks' bf16 output, and only the logits come back fp32. With every
    unit casting its output to fp32, the final LayerNorm got fp32 input with bf16 weights and the first step
    failed (seen on an H200 with NCCL; the same on CPU: `mixed dtype (CPU)`)."""
    import subprocess
    import sys

    rendezvous = tmp_path / "rendezvous"  # a file, not a port another process could take first
    r = subprocess.run(
        [sys.executable, "-c", BF16_FORWARD, str(rendezvous)], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "logits torch.float32 block params torch.float32" in r.stdout, r.stdout


UNSHARDED_BF16 = """
import sys
import torch
from hpcscale.layout import ParallelDims
from hpcscale.parallel.fsdp import shard_model
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
seen = []
m[0].register_forward_hook(lambda mod, args, out: seen.append(out.dtype))
shard_model(m, mesh=None, dims=ParallelDims(tp=1, pp=1, dp=2), device=torch.device("cpu"),
            mixed_precision=sys.argv[1])
out = m(torch.randn(3, 8))
out.sum().backward()
print("inner", seen[0], "out", out.dtype, "param", m[0].weight.dtype, "grad", m[0].weight.grad.dtype)
import copy, io
ema = copy.deepcopy(m)  # an EMA copy runs its own weights
with torch.no_grad():
    for p in ema.parameters():
        p.zero_()
x = torch.randn(2, 8)
assert not torch.equal(m(x), ema(x)) and not ema(x).any()
plain = torch.nn.Linear(8, 4)  # without the test's own (lambda) hook: a model with hpcscale's still pickles
shard_model(plain, mesh=None, dims=ParallelDims(tp=1, pp=1, dp=2), device=torch.device("cpu"),
            mixed_precision=sys.argv[1])
torch.save(plain, io.BytesIO())
class Boom(torch.nn.Module):
    def forward(self, x):
        raise RuntimeError("boom")
b = Boom()
shard_model(b, mesh=None, dims=ParallelDims(tp=1, pp=1, dp=2), device=torch.device("cpu"), mixed_precision="bf16")
try:
    b(x)
except RuntimeError:
    pass
assert not torch.is_autocast_enabled("cpu")  # a forward that raised leaves autocast off
compiled = torch.compile(m, backend="aot_eager")  # dynamo traces the model, not the hooks' autocast
got = compiled(x)
got.sum().backward()
assert got.dtype == torch.float32 and torch.equal(got, m(x)), (got, m(x))
assert not torch.is_autocast_enabled("cpu")
print("copies, pickles, unwinds, compiles")
"""


@pytest.mark.parametrize(("setting", "inner"), [("bf16", "bfloat16"), ("fp32", "float32"), ("auto", "float32")])
def test_mixed_precision_applies_to_a_model_that_is_not_sharded(setting, inner):
    """parallel.mixed_precision at dp_shard = 1 (replicated, or one rank): bf16 computes the forward under
    autocast, the output comes back fp32 as FSDP's root gives it, parameters and gradients stay fp32 (so their
    all-reduce and the optimizer are fp32); `auto` on CPU is fp32."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", UNSHARDED_BF16, setting], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"inner torch.{inner} out torch.float32 param torch.float32 grad torch.float32" in r.stdout, r.stdout
    assert "copies, pickles, unwinds, compiles" in r.stdout, r.stdout


PIPELINE_GUARD = """
import os, sys
import torch, torch.distributed as dist
from hpcscale.parallel.grad_sync import GradSync
rank = int(sys.argv[2])
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=rank, world_size=2)
torch.manual_seed(0)
m = torch.nn.Linear(4, 2)
sync = GradSync(m, dist.group.WORLD)  # a pipeline stage's: armed per step by Pipeline.step
x = torch.full((3, 4), float(rank + 1))
try:
    m(x).sum().backward()
    print("unarmed backward passed")
except RuntimeError as e:
    print("refused:", e)
m.zero_grad()
sync.begin(1)
m(x).sum().backward()
sync.finish()
g = m.weight.grad.clone()
both = [torch.zeros_like(g) for _ in range(2)]
dist.all_gather(both, g)
print("averaged", torch.equal(both[0], both[1]), float(g[0, 0]))
dist.barrier()  # both ranks are done before either tears the group down
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)  # no interpreter teardown, where a gloo thread outliving the group aborts it (as hpcscale launch exits)
"""


def test_a_pipeline_stage_refuses_a_backward_its_replicas_would_not_average(tmp_path):
    """pp x replicated dp: a stage's gradients are averaged over its replicas around each ctx.pipeline step;
    a backward outside one raises instead of letting the replicas diverge, and inside one they agree."""
    import subprocess
    import sys

    rendezvous = tmp_path / "rendezvous"  # a file, not a port another process could take first
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", PIPELINE_GUARD, str(rendezvous), str(r)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    for p in ranks:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-3000:]
        assert "refused: hpcscale: a backward ran outside the pipeline's step" in out, out
        # x is 1s on rank 0 and 2s on rank 1: d(sum)/dW[0,0] is 3 and 6, averaged 4.5
        assert "averaged True 4.5" in out, out


class _Stack(torch.nn.Module):
    def __init__(self, n: int, kind: str):
        super().__init__()
        self.emb = torch.nn.Embedding(5, 4)
        blocks = [torch.nn.Linear(4, 4) for _ in range(n)]
        inner = torch.nn.Module()
        inner.layers = (
            torch.nn.ModuleList(blocks)
            if kind == "list"
            else torch.nn.ModuleDict({str(i): b for i, b in enumerate(blocks)})
        )
        self.model = inner  # nested, as Hugging Face decoders keep theirs: model.model.layers
        self.head = torch.nn.Linear(4, 5)

    def forward(self, x):
        if self.emb is not None:
            x = self.emb(x)
        layers = self.model.layers
        for block in layers if isinstance(layers, torch.nn.ModuleList) else layers.values():
            x = block(x)
        return self.head(x) if self.head is not None else x


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 9), data=st.data(), kind=st.sampled_from(["list", "dict"]))
def test_pipeline_stages_tile_the_blocks_under_their_global_names(n, data, kind):
    """Whatever the container (ModuleList as most models keep their blocks, or ModuleDict) and the depth, the
    stages' parameter names are the whole model's, each block on exactly one stage, in contiguous runs, and a
    cut ModuleList still runs forward: checkpoints name tensors alike at every pp."""
    from hpcscale.parallel.pipeline import cut_stage

    pp = data.draw(st.integers(1, n))
    split = None
    if data.draw(st.booleans()):  # an explicit split: a composition of n into pp positive parts
        cuts = sorted(data.draw(st.sets(st.integers(1, n - 1), min_size=pp - 1, max_size=pp - 1))) if pp > 1 else []
        split = [b - a for a, b in zip([0, *cuts], [*cuts, n], strict=True)]
    torch.manual_seed(0)
    whole = _Stack(n, kind)
    names = {name for name, _ in whole.named_parameters()}
    seen: list[str] = []
    for stage in range(pp):
        torch.manual_seed(0)
        m = cut_stage(
            _Stack(n, kind), stage=stage, pp=pp, first_stage_only=("emb",), last_stage_only=("head",),
            layers="model.layers", split=split,
        )  # fmt: skip
        mine = [name for name, _ in m.named_parameters()]
        assert set(mine) <= names
        assert (m.emb is not None) == (stage == 0) and (m.head is not None) == (stage == pp - 1)
        kept = [int(k) for k in m.model.layers._modules]
        assert kept and kept == list(range(kept[0], kept[0] + len(kept)))  # one contiguous run
        if split is not None and pp > 1:
            assert len(kept) == split[stage] and kept[0] == sum(split[:stage])
        seen += [x for x in mine if x.startswith("model.layers.")]
        x = torch.randint(0, 5, (2, 3)) if stage == 0 else torch.randn(2, 3, 4)
        assert m(x).shape[-1] == (5 if stage == pp - 1 else 4)
    assert sorted(seen) == sorted(x for x in names if x.startswith("model.layers."))  # each block once


def test_a_stage_cut_from_what_is_not_a_stack_of_blocks_is_refused_by_name():
    from hpcscale.errors import BadInput
    from hpcscale.parallel.pipeline import cut_stage

    with pytest.raises(BadInput, match="has no 'layers'"):
        cut_stage(_Stack(4, "list"), stage=0, pp=2, first_stage_only=(), last_stage_only=())
    with pytest.raises(BadInput, match="has no 'embed'"):
        cut_stage(
            _Stack(4, "list"), stage=1, pp=2, first_stage_only=("embed",), last_stage_only=(), layers="model.layers"
        )
    with pytest.raises(BadInput, match="fewer than pp = 4"):
        cut_stage(_Stack(3, "dict"), stage=0, pp=4, first_stage_only=(), last_stage_only=(), layers="model.layers")
    for split in ([1, 2], [2, 2, 0], [0, 4], [2.0, 2], [3]):
        with pytest.raises(BadInput, match=r"split=.* each of the pp = 2 stages at least one block, 4 blocks"):
            cut_stage(_Stack(4, "list"), stage=0, pp=2, first_stage_only=(), last_stage_only=(), layers="model.layers",
                      split=split)  # fmt: skip
    m = _Stack(2, "dict")
    m.model.layers = torch.nn.ModuleDict({"a": torch.nn.Linear(4, 4), "b": torch.nn.Linear(4, 4)})
    with pytest.raises(BadInput, match="not '0', '1'"):
        cut_stage(m, stage=0, pp=2, first_stage_only=(), last_stage_only=(), layers="model.layers")


def test_the_units_to_shard_are_named_by_class_by_name_or_given():
    from hpcscale.errors import BadInput
    from hpcscale.parallel.fsdp import resolve_blocks

    m = _Stack(3, "list")
    blocks = list(m.model.layers)
    assert resolve_blocks(m, None) == blocks  # by default the entries of model.layers, one level down
    assert resolve_blocks(m, torch.nn.Linear) == [*blocks, m.head]  # every Linear, in registration order
    assert resolve_blocks(m, ["model.layers.1", "head"]) == [blocks[1], m.head]
    assert resolve_blocks(m, "model.layers.2") == [blocks[2]]
    assert resolve_blocks(m, blocks[:2]) == blocks[:2]
    with pytest.raises(BadInput, match="no submodule of that class"):
        resolve_blocks(m, torch.nn.LayerNorm)
    with pytest.raises(BadInput, match=r"no submodule 'model\.layers\.7'"):
        resolve_blocks(m, ["model.layers.7"])
    with pytest.raises(BadInput, match="not submodules"):
        resolve_blocks(m, [torch.nn.Linear(1, 1)])
    with pytest.raises(BadInput, match="neither a submodule"):
        resolve_blocks(m, [3])

    class Outer(torch.nn.Module):  # a block holding a block of its own class: the outer one is the unit
        def __init__(self):
            super().__init__()
            self.inner = torch.nn.Sequential(torch.nn.Linear(2, 2))

    nest = torch.nn.Sequential(Outer(), Outer())
    nest[0].inner.append(Outer())
    assert resolve_blocks(nest, Outer) == [nest[0], nest[1]]


def _fsdp_entry():
    import importlib
    import sys

    if str(HELPERS) not in sys.path:
        sys.path.insert(0, str(HELPERS))
    return importlib.import_module("fsdp_entry")


def _whole_and_meta(factory, init, seed=3):
    from hpcscale.parallel.init import initialize, materialize

    whole = factory()
    initialize(whole, init, seed=seed)
    with torch.device("meta"):
        meta = factory()
    materialize(meta, init, seed=seed, device=torch.device("cpu"))
    return whole, meta


def test_a_model_built_on_meta_materializes_to_the_weights_it_has_built_whole():
    """Seeded by name: the reference GPT, and a user's model with a LayerNorm (its reset_parameters) and a
    buffer outside the state dict (its init), come out of materialize bitwise as they are built whole,
    whatever order modules are initialized in and whichever of them a pipeline cut removed."""
    fsdp_entry = _fsdp_entry()
    from hpcscale.train.model import GPT, GPTShape

    shape = GPTShape(vocab_size=64, seq_len=16, n_layer=3, n_embd=32, n_head=2)
    whole = GPT(shape, seed=5)
    with torch.device("meta"):
        meta = GPT(shape, seed=5)
    cut_stage(meta, stage=1, pp=2, first_stage_only=GPT.FIRST_STAGE_ONLY, last_stage_only=GPT.LAST_STAGE_ONLY)
    from hpcscale.parallel.init import materialize

    materialize(meta, meta.init_module, seed=5, device=torch.device("cpu"))
    kept = dict(meta.named_parameters())
    assert kept and set(kept) < set(dict(whole.named_parameters()))
    for name, p in whole.named_parameters():
        if name in kept:
            assert torch.equal(p, kept[name]), name
    assert not torch.equal(GPT(shape, seed=6).output.weight, whole.output.weight)  # the seed matters
    a, b = _whole_and_meta(fsdp_entry.Net, fsdp_entry.init)
    want, got = dict((*a.named_parameters(), *a.named_buffers())), dict((*b.named_parameters(), *b.named_buffers()))
    assert sorted(want) == sorted(got) and "gain" in got
    for n, x in want.items():
        assert torch.equal(x, got[n]), n


def test_a_meta_model_that_init_leaves_partly_unset_is_refused_by_name():
    fsdp_entry = _fsdp_entry()
    from hpcscale.parallel.init import materialize, on_meta

    class Scale(torch.nn.Module):  # a parameter of the user's own, with no reset_parameters
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(4))

    with torch.device("meta"):
        seq = torch.nn.Sequential(torch.nn.Linear(4, 4), Scale())
    with pytest.raises(BadInput, match=r"init left parameter 1\.w"):
        materialize(seq, None, seed=0, device=torch.device("cpu"))

    def no_buffer(m):
        if not isinstance(m, fsdp_entry.Net):
            fsdp_entry.init(m)

    with torch.device("meta"):
        net = fsdp_entry.Net()
    with pytest.raises(BadInput, match="init left buffer gain unset"):
        materialize(net, no_buffer, seed=0, device=torch.device("cpu"))
    with torch.device("meta"):
        net = fsdp_entry.Net()
    net.head = torch.nn.Linear(32, 50)  # one part built on a real device
    with pytest.raises(BadInput, match=r"partly on the meta device .* head\.weight, head\.bias are not"):
        on_meta(net)
    assert on_meta(net.layers) and not on_meta(fsdp_entry.Net())


PIPELINE_DOC = REPO / "docs" / "context-api.md"


def test_the_pages_pipelined_sharded_model_runs_as_written_and_gives_one_process_losses(mpi, tmp_path):
    """docs/context-api.md's mypipeline.py and pipeline-job.yaml as written (PYTHONPATH pointed here): built
    on meta, cut into 2 stages, each sharded over 2 ranks, through ctx.pipeline and ctx.clip_grad_norm_. Its
    losses and norms are those of one process training the whole model (initialized as the meta path does,
    torch's own clip_grad_norm_) within 1e-5; and docs/large-models.md's excerpt is this file's code."""
    import re
    import sys

    blocks = re.findall(r"```(\w+)\n(.*?)```", PIPELINE_DOC.read_text(), re.S)
    code = [b for lang, b in blocks if lang == "python" and b.startswith("# mypipeline.py")]
    job = [b for lang, b in blocks if lang == "yaml" and b.startswith("# pipeline-job.yaml")]
    assert len(code) == 1 and len(job) == 1, "the page must hold one mypipeline.py and one pipeline-job.yaml"
    (tmp_path / "mypipeline.py").write_text(code[0])
    (tmp_path / "job.yaml").write_text(job[0].replace("/path/to/mycode", str(tmp_path)))
    r = run_cli("run", str(tmp_path / "job.yaml"), "--local", "--run-dir", str(tmp_path / "run"), timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    got, norms = losses(tmp_path / "run"), grad_norms(tmp_path / "run")
    # progress with steps left, at the first step and the last (ctx.checkpoint.steps is set)
    assert "hpcscale: step 1/12 done" in r.stdout, r.stdout[-2000:]
    # the loop's logged loss beside the pace; the first step's line gives no time left (compilation, warm-up)
    assert re.search(r"step 1/12 done, loss [\d.e+-]+.*, first step [\d.e+-]+ s \(compilation", r.stdout), r.stdout
    assert re.search(r"step 12/12 done, loss [\d.e+-]+.*, [\d.e-]+ s/step, 0 steps left, about 0:00:00", r.stdout), (
        r.stdout[-2000:]
    )

    sys.path.insert(0, str(tmp_path))
    try:
        import mypipeline as m
    finally:
        sys.path.remove(str(tmp_path))
    from hpcscale.parallel.init import initialize

    model = m.Net()
    initialize(model, m.init_weights, seed=0)  # the weights materializing the meta model gives, on one process
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    want, want_norms = {}, []
    for step in range(12):
        x, y = m.batch(step)
        opt.zero_grad()
        loss = m.loss_fn(model(x), y)
        loss.backward()
        want_norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
        opt.step()
        want[step] = float(loss.detach())
    assert len(got) == 12
    _close(got, want)
    _close(dict(enumerate(norms)), dict(enumerate(want_norms)))
    # the large-model page shows an excerpt of this example: every line of it is the example's
    page = (REPO / "docs" / "large-models.md").read_text()
    excerpts = [b for lang, b in re.findall(r"```(\w+)\n(.*?)```", page, re.S) if lang == "python"]
    assert excerpts and all(line.strip() in code[0] for b in excerpts for line in b.splitlines() if line.strip())
