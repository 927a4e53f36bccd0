"""Host memory a rank spends beside its training state: the checkpoint staging buffers (hpcscale.ckpt.writer's
StagingPool: one exact-size arena per set of shards, page-locked by registration on a GPU rank and never on a CPU
one, one set shared by both checkpoint tiers, drains never pinned) and glibc's malloc on CPU ranks (the mmap
threshold hpcscale sets by default where ranks start, so FSDP's freed blocks go back to the system).

The staging tests run in one process on a real gloo group of one rank and real files. The CUDA registration itself
needs a GPU: here the two calls that make and undo it are stood in for, and everything around them (what is
registered, exactly how much, when it is undone) is checked; scripts/experiments/gpu_path.py runs them for real."""

from __future__ import annotations

import ast
import itertools
import json
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from conftest import REPO, run_cli

from hpcscale.ckpt import nodelocal, writer
from hpcscale.ckpt.local_tier import NodeLocalManager
from hpcscale.ckpt.manager import CheckpointManager
from hpcscale.ckpt.shards import LocalShard
from hpcscale.ckpt.tier import Tier
from hpcscale.config.load import load_job
from hpcscale.launch.local import rank_env
from hpcscale.layout import ParallelDims
from hpcscale.slurm.render import render_script
from hpcscale.slurm.resolve import resolve

DIMS = ParallelDims(pp=1, dp=1, tp=1)


# ---- the staging pool -------------------------------------------------------------------------------------------
def _shard(name: str, shape: tuple, *, gpu: bool, dtype=torch.float32) -> LocalShard:
    """A shard whose tensor says it is on a GPU (or not): all the pool reads of it is its shape, dtype and place."""
    meta = torch.empty(shape, dtype=dtype, device="meta")
    fake = SimpleNamespace(shape=meta.shape, dtype=dtype, numel=meta.numel, is_cuda=gpu)
    return LocalShard(name, fake, shape, (0,) * len(shape))


@pytest.fixture()
def registrations(monkeypatch):
    """cudaHostRegister and cudaHostUnregister stood in for: what was registered (pointer, bytes) and undone."""
    calls = SimpleNamespace(pinned=[], unpinned=[], refuse=None)

    def pin(memory):
        if calls.refuse:
            return calls.refuse
        calls.pinned.append((memory.data_ptr(), memory.numel() * memory.element_size()))
        return None

    monkeypatch.setattr(writer, "_pin", pin)
    monkeypatch.setattr(writer, "_unpin", calls.unpinned.append)
    return calls


def test_staging_is_one_registered_arena_of_exact_size_per_set_and_is_unregistered_when_no_longer_used(registrations):
    gpu = [
        _shard("a", (1000,), gpu=True),
        _shard("b", (3, 7), gpu=True, dtype=torch.bfloat16),
        _shard("c", (4096,), gpu=True),
    ]
    cpu = [_shard("step", (), gpu=False)]  # an optimizer's step count stays on the CPU: never pinned
    pool = writer.StagingPool()
    bufs = pool.buffers(gpu + cpu)
    sizes = [writer.aligned_size(s.tensor.numel() * s.tensor.dtype.itemsize) for s in gpu]
    assert registrations.pinned == [(registrations.pinned[0][0], sum(sizes))]  # one registration, exactly the set
    start, n = registrations.pinned[0]
    for b, s, off in zip(bufs, gpu, [0, sizes[0], sizes[0] + sizes[1]], strict=False):
        assert b.shape == s.tensor.shape and b.dtype == s.tensor.dtype
        assert b.data_ptr() == start + off and b.data_ptr() % writer.ALIGN == 0  # inside it, ALIGN-aligned
    assert not start <= bufs[3].data_ptr() < start + n
    assert pool.pinned_bytes == sum(sizes) and pool.nbytes == sum(sizes) + writer.ALIGN

    again = pool.buffers(gpu + cpu)  # the next save: the same buffers, nothing registered again
    assert [b.data_ptr() for b in again] == [b.data_ptr() for b in bufs] and len(registrations.pinned) == 1

    grown = [_shard("a", (2000,), gpu=True), *gpu[1:]]  # one shard changed shape: a new arena for it alone
    pool.buffers(grown + cpu)
    assert registrations.pinned[1][1] == writer.aligned_size(2000 * 4) and registrations.unpinned == []
    pool.buffers(
        [_shard(s.name, (5,) * len(s.global_shape), gpu=True) for s in gpu] + cpu
    )  # none left in the first two arenas
    assert sorted(registrations.unpinned) == sorted(p for p, _ in registrations.pinned[:2])
    assert pool.pinned_bytes == 3 * writer.ALIGN
    pool.close()
    assert sorted(registrations.unpinned) == sorted(p for p, _ in registrations.pinned) and pool.pinned_bytes == 0

    registrations.refuse = "cudaHostRegister: out of memory (2)"  # the driver refuses: pageable, said, still usable
    refused = writer.StagingPool()
    (buf,) = refused.buffers(gpu[:1])
    buf.fill_(1.0)
    assert refused.pinned_bytes == 0 and refused.pin_problem == registrations.refuse


def test_no_checkpoint_code_allocates_through_torchs_caching_host_allocator():
    """`pin_memory=True` and `.pin_memory()` allocate from torch's caching host allocator: every buffer rounded
    up to a power of two, page-locked, and never given back. Checkpoint staging pins by registration only."""
    for path in sorted((REPO / "hpcscale" / "ckpt").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                pins = [k for k in node.keywords if k.arg == "pin_memory"]
                method = isinstance(node.func, ast.Attribute) and node.func.attr == "pin_memory"
                assert not pins and not method, f"{path}:{node.lineno}"


def test_a_cpu_rank_pins_nothing_and_the_first_save_that_stages_says_so_once(group, tmp_path):
    lines = []
    m = CheckpointManager(tmp_path / "ckpt", dims=DIMS, rank=0, log=lines.append)
    state = {"w": torch.randn(300, 300), "b": torch.randn(77)}
    m.save(1, state, {"step": 1}, asynchronous=False)  # synchronous: stages nothing, says nothing
    assert not [x for x in lines if "staging" in x]
    for step in (2, 3):
        m.save(step, state, {"step": step}, asynchronous=True)
        m.wait()
    said = [x for x in lines if "staging for checkpoints" in x]
    assert len(said) == 1, lines
    assert "pinned host memory per rank: rank 0 0.0 MiB" in said[0], said
    assert m.staging.pinned_bytes == 0 and m.staging.nbytes == writer.aligned_size(300 * 300 * 4) + writer.ALIGN
    m.close()


def _node_local(root: Path, **extra) -> NodeLocalManager:
    layout = nodelocal.build(["a"], 0, {}, [], "other")
    return NodeLocalManager(root, dims=DIMS, rank=0, node_local=layout, keep_last=5, **extra)


def _loaded(manager: Tier, like: dict, *, node_local: bool) -> dict:
    out = {k: torch.zeros_like(v) for k, v in like.items()}
    got = manager.load_node_local(out, at_least=None) if node_local else manager.load_latest(out)
    assert got is not None
    return out


def test_both_tiers_stage_in_one_set_of_buffers_and_take_turns_in_it(group, tmp_path, monkeypatch):
    """The shared tier's asynchronous save is still writing (slowed) when a node-local save is due: the node-local
    save waits for it before copying into the buffers they share, so each checkpoint holds its own step's values;
    and the rank holds one set of staging buffers for both tiers."""
    local = _node_local(tmp_path / "node")
    shared = CheckpointManager(tmp_path / "shared", dims=DIMS, rank=0, keep_last=5, staging=local.staging)
    assert shared.staging is local.staging
    first = {"w": torch.full((256, 64), 1.0), "v": torch.arange(1000.0)}
    monkeypatch.setenv("HPCSCALE_CKPT_SLOW_WRITE", "1.5@0:shared")  # the shared write starts 1.5 s late
    shared.save(1, first, {"step": 1}, asynchronous=True)
    second = {k: v + 1 for k, v in first.items()}
    local.save(2, second, {"step": 2}, asynchronous=True)  # the shared save's copy is still to be written
    assert local.last_stats.blocking_s >= 1.0  # it waited for the shared save's write before taking the buffers
    local.wait()
    shared.wait()
    monkeypatch.delenv("HPCSCALE_CKPT_SLOW_WRITE")
    assert all(torch.equal(_loaded(shared, first, node_local=False)[k], first[k]) for k in first)
    assert all(torch.equal(_loaded(local, first, node_local=True)[k], second[k]) for k in first)
    one_set = sum(writer.aligned_size(t.numel() * t.element_size()) for t in first.values())
    assert local.staging.nbytes == one_set  # one set of staging buffers on this rank, for both tiers
    local.close()
    shared.close()


def test_a_drain_reads_into_one_unpinned_arena_even_on_a_gpu_rank(group, tmp_path, monkeypatch):
    """A drain's buffers go from a file to a file: on a GPU rank (device cuda; this CPU build stands in for one with
    torch.cuda.set_device made a no-op) they are one page-aligned arena, never page-locked, and kept apart from
    the staging pool (a node-local save may be copying there meanwhile)."""
    monkeypatch.setattr(writer, "_pin", lambda memory: pytest.fail("a drain's buffer was page-locked"), raising=False)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    local = _node_local(tmp_path / "node")
    state = {"w": torch.randn(128, 33), "b": torch.randn(5), "h": torch.randn(4096).to(torch.bfloat16)}
    local.save(4, state, {"step": 4}, asynchronous=False)
    shared = CheckpointManager(tmp_path / "shared", dims=DIMS, rank=0, device=torch.device("cuda"))
    shared.drain(local.root, 4)
    shared.wait()
    assert shared.last_step == 4
    bufs = sorted(shared.writer._drain_buffers.values(), key=lambda b: b.data_ptr())
    for a, b in itertools.pairwise(bufs):  # back to back in one arena, each on an ALIGN boundary
        assert b.data_ptr() - a.data_ptr() == writer.aligned_size(a.numel() * a.element_size())
    assert shared.staging.nbytes == 0  # the pool was not touched
    loaded = CheckpointManager(tmp_path / "shared", dims=DIMS, rank=0)
    assert all(torch.equal(_loaded(loaded, state, node_local=False)[k], state[k]) for k in state)
    for m in (local, shared, loaded):
        m.close()


# ---- glibc's malloc on CPU ranks ------------------------------------------------------------------------------
THRESHOLD = "MALLOC_MMAP_THRESHOLD_"


def _fsdp_job(path: Path, *, site: str = "local", **extra) -> Path:
    spec = {
        "name": "host-memory",
        "site": site,
        "tasks_per_node": 2,
        "parallel": {"dp_shard": 2},
        "timeout_seconds": 120,
        "hang_timeout_seconds": 100,
        "environment": {"PYTHONPATH": str(REPO / "tests" / "helpers")},
        "train": {"entry": "environ_entry:main", "params": {"steps": 2}},
        "checkpoint": {"every_steps": 0},
    }
    for key, value in extra.items():  # a dict is merged into the section it names; None removes the key
        spec[key] = {**spec[key], **value} if isinstance(spec.get(key), dict) and value is not None else value
    spec = {k: v for k, v in spec.items() if v is not None}
    path.write_text(yaml.safe_dump(spec))
    return path


def _reports(run: Path) -> list[dict]:
    return [json.loads((run / f"environ.{r}").read_text()) for r in range(2)]


def test_cpu_ranks_of_run_local_return_freed_blocks_by_default_and_keep_a_users_own_threshold(mpi, tmp_path):
    """Two ranks at dp_shard 2 through `hpcscale run --local`: by default each rank's environment carries the
    fixed mmap threshold and glibc maps a 1 MiB block even right after freeing a bigger one (so FSDP's gathered
    blocks go back to the system); a job that sets its own value keeps it, and glibc follows it.

    The ranks' start-up ran with Python's cyclic collector paused (hpcscale.util.pystart): the entry point finds
    it on again, with the start-up's objects (torch's, mpi4py's, hpcscale's: several hundred thousand) frozen;
    torch._dynamo is imported by then, or by the entry's first optimizer (torch.optim wraps add_param_group
    with torch._disable_dynamo), after the freeze, where no collection walks torch's objects again."""
    run = tmp_path / "default"
    r = run_cli("run", str(_fsdp_job(tmp_path / "a.yaml")), "--local", "--run-dir", str(run), timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for got in _reports(run):
        collector = got.pop("collector")
        assert got == {THRESHOLD: "1048576", "heap_serves_1mib": False, "dp_shard": 2}, got
        assert collector["enabled"] and collector["frozen"] > 100_000, collector
        assert collector["dynamo_after_optimizer"], collector
    own = _fsdp_job(tmp_path / "b.yaml", environment={THRESHOLD: "2097152"})
    run = tmp_path / "own"
    r = run_cli("run", str(own), "--local", "--run-dir", str(run), timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for got in _reports(run):
        got.pop("collector")
        assert got == {THRESHOLD: "2097152", "heap_serves_1mib": True, "dp_shard": 2}, got


def test_the_default_threshold_gives_way_to_the_users_environment_and_spares_gpu_and_command_jobs(tmp_path):
    cpu = load_job(_fsdp_job(tmp_path / "cpu.yaml", device="cpu"))
    assert rank_env(cpu, environ={})[THRESHOLD] == "1048576"
    assert rank_env(cpu, environ={THRESHOLD: ""})[THRESHOLD] == "1048576"  # empty: glibc would map everything
    assert THRESHOLD not in rank_env(cpu, environ={THRESHOLD: "65536"})  # the command's own, passed on by mpirun
    own = load_job(_fsdp_job(tmp_path / "own.yaml", device="cpu", environment={THRESHOLD: "4096"}))
    assert rank_env(own, environ={THRESHOLD: "65536"})[THRESHOLD] == "4096"  # the job's wins, as for any variable
    gpu = load_job(_fsdp_job(tmp_path / "gpu.yaml", device="cuda"))
    assert THRESHOLD not in rank_env(gpu, environ={})


def _rendered(tmp_path: Path, name: str, site: str = "localcluster", **extra) -> str:
    loaded = load_job(_fsdp_job(tmp_path / f"{name}.yaml", site=site, **extra))
    return render_script(resolve(loaded, run_dir=tmp_path / name, tree=None))


def test_the_batch_script_gives_cpu_ranks_the_threshold_unless_the_job_or_the_submitting_shell_sets_one(tmp_path):
    text = _rendered(tmp_path, "cpu")
    (line,) = [x for x in text.splitlines() if THRESHOLD in x]
    assert line.index(THRESHOLD) < text.index("srun")  # exported before the ranks start
    probe = f'{line}; printf %s "${THRESHOLD}"'
    for inherited, want in ((None, "1048576"), ("", "1048576"), ("65536", "65536")):
        env = {k: v for k, v in os.environ.items() if k != THRESHOLD} | (
            {THRESHOLD: inherited} if inherited is not None else {}
        )
        assert subprocess.run(["bash", "-c", probe], env=env, capture_output=True, text=True).stdout == want
    own = _rendered(tmp_path, "own", environment={THRESHOLD: "4096"})
    assert [x for x in own.splitlines() if THRESHOLD in x] == [f"export {THRESHOLD}=4096"]
    assert THRESHOLD not in _rendered(tmp_path, "gpu", site="example-dgx-h100", gpus_per_node=2)
    command = _rendered(tmp_path, "command", train=None, command=["python3", "train.py"])
    assert THRESHOLD not in command
