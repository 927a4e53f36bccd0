"""The communication ledger (hpcscale.launch.ledger): what each rank sends, per step and process group, held
against the traffic each layout's model implies, and the late arrivals it names (docs/observability.md).

Real torch.distributed on gloo: two processes issuing every kind of collective through every route the ledger
must see (the Python API, batch_isend_irecv, DTensor's redistributions, another thread it must not count), and
`hpcscale run --local` jobs of the built-in trainer, whose RUN/timing.jsonl must show, per step:
 (a) dp 2, replicated: one all-reduce volume of the gradients' bytes on mesh_dp;
 (b) HSDP (dp_shard 2 of 4 ranks) with two micro-batches: the all-reduce across replicas once a step;
 (c) pp 2 × dp_shard 2: each block's parameters all-gathered once a step, not once a micro-batch;
 (d) pp 2, mixed_precision bf16: bf16 activations (and their gradients) between the stages.
The line format round-trips with the new columns (hypothesis); the lateness and its verdict are functions.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import REPO, run_cli
from hypothesis import given, settings
from hypothesis import strategies as st
from trainjobs import PARAMS, job_spec

from hpcscale.observe.timing import (
    COLUMNS,
    LATE_FLOOR_S,
    LATE_SHARE,
    MIN_SLOW,
    WINDOWS,
    judge_arrivals,
    make_line,
    parse_line,
    read_windows,
    traffic,
)

VOCAB = 256  # the built-in trainer's default corpus is byte-level


# ---- the interception, on two real gloo processes -----------------------------------------------------------------
TWO_RANKS = """
import json, os, sys, threading
import torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=int(sys.argv[1]), world_size=2)
from torch.distributed.device_mesh import init_device_mesh
from hpcscale.launch import ledger, waits
from hpcscale.parallel.mesh import group_options
clock = waits.install()
led = ledger.install(clock)
assert ledger.install() is led  # once per process
opts = {axis: ("gloo", group_options("gloo", 60)) for axis in ("dp", "tp")}
mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"), backend_override=opts)
tp = mesh.get_group("tp")
rank, peer = dist.get_rank(), 1 - dist.get_rank()
led.take()  # the mesh's own set-up is no step's
dist.all_reduce(torch.ones(10))                                                      # default_pg all_reduce 40
out = torch.empty(12); dist.all_gather_into_tensor(out, torch.ones(6), group=tp)     # all_gather 48 (output)
dist.all_gather([torch.empty(2), torch.empty(2)], torch.ones(2), group=tp)           # all_gather 16
dist.reduce_scatter_tensor(torch.empty(3), torch.ones(6), group=tp)                  # reduce_scatter 24 (input)
dist.broadcast(torch.ones(5, dtype=torch.bfloat16), src=0, group=tp)                 # broadcast 10
ops = [dist.P2POp(dist.isend, torch.ones(7), peer, tp), dist.P2POp(dist.irecv, torch.empty(7), peer, tp)]
for work in dist.batch_isend_irecv(ops):                                             # send 28, recv 28
    work.wait()
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
tp_mesh = mesh["tp"]
DTensor.from_local(torch.ones(4, 3), tp_mesh, [Shard(0)]).redistribute(tp_mesh, [Replicate()]).to_local()  # 96
DTensor.from_local(torch.ones(4, 3), tp_mesh, [Partial()]).redistribute(tp_mesh, [Replicate()]).to_local() # 48
other = threading.Thread(target=lambda: dist.all_reduce(torch.ones(1000), group=tp))  # not the training thread
other.start(); other.join()
with led.aside():  # set aside (an evaluation): not counted
    dist.all_reduce(torch.ones(100), group=tp)
step = led.take()
print(json.dumps({
    "counts": {f"{g}.{k}": v for (g, k), v in step.counts.items()},
    "arrivals": {g: len(a) for (g, ranks), a in step.arrivals.items()},
    "members": {g: list(ranks) for (g, ranks), a in step.arrivals.items()},
    "waited": sorted(step.waited),
    "empty_after_take": not led.take().counts,
}))
dist.destroy_process_group()
"""


def test_every_route_to_a_collective_is_counted_once_under_its_group_and_kind(tmp_path):
    rendezvous = str(tmp_path / "rendezvous")  # a file, not a port another process could take first
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", TWO_RANKS, str(rank), rendezvous],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
        )
        for rank in (0, 1)
    ]
    results = [p.communicate(timeout=180) for p in procs]
    for p, (_, err) in zip(procs, results, strict=True):
        assert p.returncode == 0, err[-3000:]
    for out, _ in results:
        doc = json.loads(out.strip().splitlines()[-1])
        assert doc["counts"] == {
            "default_pg.all_reduce": [1, 40],
            "mesh_tp.all_gather": [3, 48 + 16 + 96],  # the Python API's two forms, and DTensor's Shard -> Replicate
            "mesh_tp.reduce_scatter": [1, 24],
            "mesh_tp.broadcast": [1, 10],
            "mesh_tp.send": [1, 28],
            "mesh_tp.recv": [1, 28],
            "mesh_tp.all_reduce": [1, 48],  # DTensor's Partial -> Replicate (a functional collective)
        }  # the other thread's all-reduce and the one set aside: not there; mesh_dp (one rank): moves nothing
        # arrivals at every collective of the group, none at a send or a receive
        assert doc["arrivals"] == {"default_pg": 1, "mesh_tp": 6}
        assert doc["members"] == {"default_pg": [0, 1], "mesh_tp": [0, 1]}
        assert set(doc["waited"]) <= {"default_pg", "mesh_tp"} and "mesh_tp" in doc["waited"]
        assert doc["empty_after_take"]


# ---- the line format and the verdicts, as functions -----------------------------------------------------------------
LABEL = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_-0123456789", min_size=1, max_size=12)
KIND = st.sampled_from(["all_reduce", "all_gather", "reduce_scatter", "broadcast", "send", "recv", "barrier"])
FIGURE = st.one_of(st.floats(min_value=0, max_value=1e12, allow_nan=False, allow_infinity=False), st.integers(0, 2**40))


@st.composite
def ledger_windows(draw):
    groups = draw(st.lists(LABEL, min_size=1, max_size=3, unique=True))
    names = []
    for g in groups:
        for kind in draw(st.lists(KIND, min_size=1, max_size=3, unique=True)):
            names += [f"bytes.{g}.{kind}", f"n.{g}.{kind}"]
        names += [f"wait_s.{g}", f"late_s.{g}", f"last.{g}"]
    n = draw(st.integers(1, 6))
    rows = [draw(st.lists(FIGURE, min_size=len(COLUMNS) + len(names), max_size=len(COLUMNS) + len(names)))
            for _ in range(n)]  # fmt: skip
    return names, rows


@settings(max_examples=200, deadline=None)
@given(ledger_windows(), st.integers(0, 10**6), st.integers(1, 100))
def test_a_line_with_the_ledgers_columns_round_trips(window, step, steps):
    names, rows = window
    columns = (*COLUMNS, *names)
    line = make_line(
        time=1.5, attempt=2, step=step, steps=steps, rows=rows, nodes=["n1"] * len(rows), pp=[0] * len(rows),
        columns=columns,
    )  # fmt: skip
    w = parse_line(json.loads(json.dumps(line)))
    assert w is not None and w.step == step and w.steps == steps and len(w.ranks) == len(rows)
    for row, parsed in zip(rows, w.ranks, strict=True):
        assert list(parsed) == list(columns)
        for name, v in zip(columns, row, strict=True):
            assert parsed[name] == pytest.approx(float(v), abs=1e-6, rel=1e-12)
            if float(v).is_integer() and v < 2**53:
                assert type(parsed[name]) is float and parsed[name] == float(v)  # whole bytes stay exact
    # every reader takes the window without failing
    for g in traffic(w):
        assert g.bytes <= g.bytes_max and g.ranks >= 1
    judge_arrivals([w])


def test_a_repeated_column_is_refused():
    line = make_line(
        time=1.0, attempt=1, step=1, steps=2, rows=[[0.0] * 10], nodes=["n1"], pp=[0],
        columns=(*COLUMNS, "bytes.g.all_reduce", "bytes.g.all_reduce"),
    )  # fmt: skip
    assert parse_line(line) is None


def _ledger_window(
    step: int,
    late: list[float],
    *,
    group: str = "mesh_dp",
    size: float = 4096.0,
    step_s: float = 0.02,
    ckpt_s: float = 0.0,
) -> dict:
    names = [f"bytes.{group}.all_reduce", f"n.{group}.all_reduce", f"wait_s.{group}", f"late_s.{group}"]
    rows = [[step_s, 0.01, 0.01, 0.0, 0.0, 0.0, ckpt_s, 0.01, size, 1, 0.002, v] for v in late]
    return make_line(
        time=1.0, attempt=1, step=step, steps=4, rows=rows, nodes=[f"n{i // 2}" for i in range(len(late))],
        pp=[0] * len(late), columns=(*COLUMNS, *names),
    )  # fmt: skip


def test_the_rank_the_others_keep_waiting_for_is_named_with_its_node():
    late = [0.0001, 0.0002, 0.03, 0.0001]  # rank 2 came 30 ms after the first, per step
    windows = [parse_line(_ledger_window(4 * i + 3, late)) for i in range(WINDOWS)]
    v = judge_arrivals(windows)
    assert v.slow_ranks == [2] and v.slow_nodes == ["n1"] and v.reason == ""
    assert v.ranks[2]["groups"] == ["mesh_dp"] and v.ranks[2]["late_windows"] == WINDOWS
    # late in fewer than MIN_SLOW of the windows, or by less than the floor: nobody
    mixed = windows[: MIN_SLOW - 1] + [parse_line(_ledger_window(99 + i, [0.0001] * 4)) for i in range(3)]
    assert judge_arrivals(mixed).slow_ranks == []
    small = [parse_line(_ledger_window(4 * i + 3, [0.0, 0.0, LATE_FLOOR_S / 2, 0.0])) for i in range(WINDOWS)]
    assert judge_arrivals(small).slow_ranks == []
    # two ranks: the later one only when at least LATE_RATIO times the other
    even = [parse_line(_ledger_window(4 * i + 3, [0.004, 0.005])) for i in range(WINDOWS)]
    assert judge_arrivals(even).slow_ranks == []
    # late by more than the floor and all the others, but by less than LATE_SHARE of its step: nobody
    step_s = 0.08
    for late, named in ((LATE_SHARE * step_s * 0.9, []), (LATE_SHARE * step_s * 1.1, [1])):
        assert late > LATE_FLOOR_S
        share = [parse_line(_ledger_window(4 * i + 3, [0.0, late], step_s=step_s)) for i in range(WINDOWS)]
        assert judge_arrivals(share).slow_ranks == named
    # a blocking save in the window is not the step's time: the share is of the rest (here half the step)
    late = LATE_SHARE * step_s * 1.5  # over a tenth of the step without the save, under a tenth with it
    saved = [
        parse_line(_ledger_window(4 * i + 3, [0.0, late], step_s=2 * step_s, ckpt_s=step_s)) for i in range(WINDOWS)
    ]
    assert judge_arrivals(saved).slow_ranks == [1]


def test_no_late_arrival_verdict_for_lines_without_the_ledger():
    rows = [[0.02, 0.01, 0.01, 0.0, 0.0, 0.0, 0.0, 0.01]] * 2
    old = [parse_line(make_line(time=1.0, attempt=1, step=i, steps=1, rows=rows, nodes=["a", "b"], pp=[0, 0]))
           for i in range(5)]  # fmt: skip
    v = judge_arrivals(old)
    assert v.slow_ranks == [] and "no arrival times" in v.reason
    assert traffic(old[-1]) == []


def test_traffic_per_group_is_the_median_of_the_ranks_using_it():
    w = parse_line(_ledger_window(3, [0.0, 0.0, 0.0], size=1e6))
    (g,) = traffic(w)
    assert g.group == "mesh_dp" and g.ranks == 3 and g.bytes == 1e6
    assert g.kinds == {"all_reduce": {"bytes": 1e6, "n": 1}}
    assert g.wait_s == 0.002 and g.gbps == pytest.approx(1e6 / 0.002 / 1e9)


def test_lateness_lines_up_each_groups_arrivals_across_its_ranks():
    from hpcscale.launch.timing import lateness

    key = ("mesh_tp", (0, 1))
    other = ("mesh_tp", (2, 3))
    arrivals = {
        0: {key: [[10.0, 11.0, 12.0], [20.0]]},
        1: {key: [[10.5, 11.0, 12.25], [20.1, 21.0]]},  # noted one more in step 2: compared over the fewest
        2: {other: [[5.0, 6.0]], ("default_pg", (0, 1, 2, 3)): [[1.0]]},
        3: {other: [[5.0, 6.5]]},
    }
    out = lateness(arrivals, steps=2)
    assert out[0]["late_s.mesh_tp"] == 0.0 and out[1]["late_s.mesh_tp"] == pytest.approx((0.5 + 0.25 + 0.1) / 2)
    assert out[1]["last.mesh_tp"] == 1.0 and out[0]["last.mesh_tp"] == pytest.approx(1 / 4)  # the tie at 11.0
    assert out[3]["late_s.mesh_tp"] == pytest.approx(0.25) and out[2]["late_s.mesh_tp"] == 0.0
    assert "late_s.default_pg" not in out[2]  # one member only noted it: nothing to compare


# ---- real jobs of the built-in trainer: the traffic each layout implies ----------------------------------------------
def _stage_params(pp: int, **params) -> list[int]:
    """Each pipeline stage's parameter count of the built-in trainer's GPT at `params`."""
    import torch

    from hpcscale.parallel.pipeline import cut_stage
    from hpcscale.train.model import GPT, GPTShape

    p = {**PARAMS, **params}
    shape = GPTShape(
        vocab_size=VOCAB, seq_len=p["seq_len"], n_layer=p["n_layer"], n_embd=p["n_embd"], n_head=p["n_head"]
    )
    counts = []
    for stage in range(pp):
        with torch.device("meta"):
            model = GPT(shape)
        cut_stage(model, stage=stage, pp=pp, first_stage_only=GPT.FIRST_STAGE_ONLY, last_stage_only=GPT.LAST_STAGE_ONLY)
        counts.append(sum(t.numel() for t in model.parameters()))
    return counts


def _run(tmp: Path, *, tp: int = 1, pp: int, ranks: int, dp_shard: int = 1, parallel=None, **params) -> list:
    """A `run --local` of the built-in trainer, 6 steps in windows of 2; the windows after the first (which holds
    the set-up: the pipeline's shape exchange, the restore)."""
    job = job_spec(tmp / "job.yaml", tp=tp, pp=pp, ranks=ranks, dp_shard=dp_shard, parallel=parallel,
                   **{"steps": 6, **params})  # fmt: skip
    spec = yaml.safe_load(job.read_text())
    spec["metrics"] = {"timing_every": 2}
    spec["checkpoint"] = {"every_steps": 0}
    job.write_text(yaml.safe_dump(spec))
    run = tmp / "run"
    r = run_cli("run", str(job), "--local", "--run-dir", str(run), timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    windows = read_windows(run / "timing.jsonl")
    assert [w.step for w in windows] == [1, 3, 5] and all(len(w.ranks) == ranks for w in windows)
    return windows[1:]


def _kinds(row: dict, group: str) -> dict[str, float]:
    """kind -> bytes per step of `group` in one rank's row (kinds it issued)."""
    return {c.split(".", 2)[2]: v for c, v in row.items() if c.startswith(f"bytes.{group}.") and row[f"n.{c[6:]}"] > 0}


def test_replicated_dp_all_reduces_the_gradients_once_a_step_on_mesh_dp(mpi, tmp_path):
    (total,) = _stage_params(1)
    windows = _run(tmp_path, pp=1, ranks=2)
    for w in windows:
        for row in w.ranks:
            assert _kinds(row, "mesh_dp") == {"all_reduce": 4 * total}  # fp32 gradients, every bucket, once
            assert 1 <= row["n.mesh_dp.all_reduce"] <= 2  # ~25 MB buckets: one for this model
            assert row["wait_s.mesh_dp"] > 0  # its waits are attributed to it
            assert "late_s.mesh_dp" in row and 0 <= row["last.mesh_dp"] <= 1
    status = json.loads(run_cli("status", str(tmp_path / "run"), "--json").stdout)["timing"]
    dp = next(g for g in status["traffic"] if g["group"] == "mesh_dp")
    assert dp["bytes"] == 4 * total and dp["ranks"] == 2 and dp["gbps"] is not None
    assert status["late"]["windows"] == 3
    text = run_cli("status", str(tmp_path / "run")).stdout
    assert "communication per step" in text and "mesh_dp" in text and "late arrival" in text
    r = run_cli("report", str(tmp_path / "run"), "-o", str(tmp_path / "report"), "--json")
    comm = json.loads(r.stdout)["summary"]["communication"]
    assert any(g["group"] == "mesh_dp" and g["bytes"] == 4 * total for g in comm["groups"])
    assert "traffic per step, mesh_dp" in (tmp_path / "report" / "summary.md").read_text()


def test_hsdp_all_reduces_across_replicas_once_a_step_not_once_a_micro_batch(mpi, tmp_path):
    """dp_shard 2 of 4 ranks (dp_replicate 2), global batch 16 of micro-batches of 2: two micro-batches a step.
    Each unit's reduce-scattered gradient shard (half of its fp32 gradients) is all-reduced across the replicas
    once, after the last micro-batch (FSDP2's set_requires_all_reduce)."""
    (total,) = _stage_params(1)
    windows = _run(tmp_path, pp=1, ranks=4, dp_shard=2, global_batch=16, micro_batch=2)
    for w in windows:
        for row in w.ranks:
            assert _kinds(row, "mesh_dp_replicate") == {"all_reduce": 4 * total // 2}, row
            shard = _kinds(row, "mesh_dp_shard")
            # reduce-scattered as backward produces them: a whole gradient volume per micro-batch
            assert shard["reduce_scatter"] % (4 * total) == 0 and shard["reduce_scatter"] > 0


def test_pipeline_with_fsdp_gathers_each_blocks_parameters_once_a_step(mpi, tmp_path):
    """pp 2 × dp_shard 2, four micro-batches a step: each stage's parameters (its blocks and its root's own)
    are all-gathered once a step, fp32, over the stage's shard group; kept gathered across the micro-batches."""
    stages = _stage_params(2)
    windows = _run(tmp_path, pp=2, ranks=4, dp_shard=2, global_batch=16, micro_batch=2)
    for w in windows:
        for rank, row in enumerate(w.ranks):
            gathered = _kinds(row, "mesh_dp_shard").get("all_gather")
            assert gathered == 4 * stages[w.pp[rank]], (rank, gathered / (4 * stages[w.pp[rank]]))


def test_a_bf16_pipeline_sends_bf16_activations_between_its_stages(mpi, tmp_path):
    """pp 2, parallel.mixed_precision bf16, four micro-batches of (2, 32, 32) a step: each activation sent forward
    and its gradient sent back is bf16 (2 bytes an element); only the last stage's output (the logits, kept on
    that stage for the loss) is fp32."""
    batch = {"global_batch": 8, "micro_batch": 2}
    n_micro = batch["global_batch"] // batch["micro_batch"]
    activation = batch["micro_batch"] * PARAMS["seq_len"] * PARAMS["n_embd"]
    windows = _run(tmp_path, pp=2, ranks=2, parallel={"mixed_precision": "bf16"}, **batch)
    bf16 = n_micro * activation * 2
    for w in windows:
        for row in w.ranks:  # (the stages' all-reduce of the gradient norm is mesh_pp's too: a few bytes)
            p2p = {kind: size for kind, size in _kinds(row, "mesh_pp").items() if kind in ("send", "recv")}
            assert p2p == {"send": bf16, "recv": bf16}, {k: v / bf16 for k, v in p2p.items()}


def test_status_names_the_rank_others_wait_for_at_collectives(mpi, tmp_path):
    """A user loop (tests/helpers/fsdp_entry.py) on two ranks, FSDP2, rank 1 sleeping 250 ms before each step as
    behind a slow loader: rank 0 waits for it at the first collective of every step."""
    spec = {
        "name": "late",
        "site": "local",
        "tasks_per_node": 2,
        "parallel": {"dp_shard": 2},
        "timeout_seconds": 120,
        "environment": {"PYTHONPATH": str(REPO / "tests" / "helpers")},
        "metrics": {"timing_every": 3},
        "checkpoint": {"every_steps": 0},
        "train": {"entry": "fsdp_entry:main", "params": {"steps": 18, "slow_rank": 1, "slow_ms": 250}},
    }
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(spec))
    r = run_cli("run", str(job), "--local", "--run-dir", str(tmp_path / "run"), timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    late = json.loads(run_cli("status", str(tmp_path / "run"), "--json").stdout)["timing"]["late"]
    assert late["slow_ranks"] == [1], late
    assert late["ranks"][1]["late_s"] >= 0.18 and "mesh_dp_shard" in late["ranks"][1]["groups"]
