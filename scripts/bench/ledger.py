#!/usr/bin/env python3
"""What the communication ledger (hpcscale.launch.ledger) costs a training step, by parts, in one run.

1. The worker (mpirun -n 2, gloo): a GPT sharded with FSDP2 over both ranks (dp_shard 2, hpcscale's
   shard_model), trained with the ledger and the wait clock installed, as a job with metrics.timing_every has
   them; per step: its wall time, and the collectives the ledger counted (so the figure below uses this
   layout's own count, not a guess); per window: what StepTimes.record adds on the step that closes it (the
   window's sums, the gather of the ledger's columns and arrivals, rank 0's lateness and line).
2. In this process: the ledger's wrapper around a collective and its wait (ns, against the bare call), and rank
   0's lateness for RANKS ranks in GROUPS groups at ARRIVALS_PER_STEP arrivals a step (µs per window): the part
   that grows with the job.

overhead = (collectives per step × wrapper ns + window µs / timing_every) / step time. Target: ≤ 1 %, no host
sync and no collective of the ledger's own per step (by construction: it reads shapes; the worker checks that
the counted collectives per step do not change when the ledger is on).

    python scripts/bench/ledger.py [--steps 40] [--every 20] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _workers import mpirun_workers

REPO = Path(__file__).resolve().parents[2]
TARGET = 0.01
MODEL = {"n_layer": 4, "n_embd": 256, "n_head": 8, "seq_len": 128}
RANKS, GROUPS = 1024, 4  # rank 0's lateness at this scale, synthetic


def worker(steps: int, every: int, batch: int, model: dict) -> None:
    """One of two ranks: FSDP2 steps with the ledger on; the ledger's count and the window's cost."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from hpcscale.launch import ledger as ledger_mod
    from hpcscale.launch import waits
    from hpcscale.launch.bootstrap import bootstrap
    from hpcscale.launch.timing import StepTimes
    from hpcscale.layout import ParallelDims
    from hpcscale.parallel.fsdp import shard_model
    from hpcscale.train.model import GPT, GPTShape, lm_loss

    info = bootstrap(timeout_s=300, order_nodes=lambda nodes: nodes)
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",))
    ledger = ledger_mod.install(waits.install())
    torch.manual_seed(0)
    m = GPT(GPTShape(vocab_size=256, **model))
    shard_model(
        m,
        mesh=mesh,
        dims=ParallelDims(tp=1, pp=1, dp=2, dp_shard=2),
        device=torch.device("cpu"),
        blocks=list(m.layers.values()),
    )
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4, foreach=False)
    g = torch.Generator().manual_seed(info.rank)
    x = torch.randint(0, 256, (batch, model["seq_len"] + 1), generator=g)
    with tempfile.TemporaryDirectory() as d:
        times = StepTimes(run_dir=Path(d), every=every, rank=info.rank, node="n", pp=0, attempt=1)
        times.ledger = ledger
        step_s, closes, counts = [], [], []
        for i in range(steps):
            t = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            lm_loss(m(x[:, :-1]), x[:, 1:]).backward()
            opt.step()
            took = time.perf_counter() - t
            counted = sum(n for n, _ in ledger.current.counts.values())
            t = time.perf_counter()
            times.record(i, step_s=took)
            if (i + 1) % every == 0:
                closes.append(time.perf_counter() - t)
            else:
                step_s.append(took)
                counts.append(counted)
    if info.rank == 0:
        doc = {
            "step_s": statistics.median(step_s[every:] or step_s),
            "collectives_per_step": statistics.median(counts),
            "window_us": statistics.median(closes) * 1e6 if closes else 0.0,
            "steady": len(set(counts[1:])) <= 1,
        }
        print("RESULT " + json.dumps(doc), flush=True)


def wrapper_ns(n: int = 200_000) -> float:
    """The ledger's wrapper and wait attribution around a collective that returns at once, and its wait."""
    import torch

    from hpcscale.launch.ledger import Ledger, _Group
    from hpcscale.launch.waits import CollectiveWaits

    class Work:
        def wait(self) -> bool:
            return True

    group, t = object(), torch.ones(1)
    ledger = Ledger()
    ledger._groups[group] = _Group("mesh_dp", (0, 1), 2)
    clock = CollectiveWaits()
    clock.on_wait = ledger.waited

    def bare(pg, tensors):
        return Work()

    wrapped, wait = ledger._pg_method(bare, "all_reduce", 0), clock._timed(Work.wait)
    best = []
    for issue, done in ((bare, Work.wait), (wrapped, wait), (bare, Work.wait), (wrapped, wait)):
        start = time.perf_counter()
        for i in range(n):
            done(issue(group, [t]))
            if i % 4096 == 0:
                ledger.take()  # a step's end: what is counted stays a step's
        best.append((time.perf_counter() - start) / n * 1e9)
    return max(0.0, min(best[1], best[3]) - min(best[0], best[2]))


def lateness_us(every: int, ranks: int = RANKS, groups: int = GROUPS) -> float:
    """Rank 0's lateness for one window of `ranks` ranks, each in `groups` groups of 8 ranks (and the world)."""
    import random

    from hpcscale.launch.ledger import ARRIVALS_PER_STEP
    from hpcscale.launch.timing import lateness

    rnd = random.Random(0)
    arrivals = {}
    for r in range(ranks):
        mine = {}
        for k in range(groups):
            members = tuple(range(r // 8 * 8, r // 8 * 8 + 8)) if k else tuple(range(ranks))
            mine[(f"g{k}", members)] = [
                [s + i * 1e-3 + rnd.random() * 1e-4 for i in range(ARRIVALS_PER_STEP)] for s in range(every)
            ]
        arrivals[r] = mine
    start = time.perf_counter()
    lateness(arrivals, steps=every)
    return (time.perf_counter() - start) * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--every", type=int, default=20)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--n-embd", type=int, default=MODEL["n_embd"])
    ap.add_argument("--seq-len", type=int, default=MODEL["seq_len"])
    ap.add_argument("--ranks", type=int, default=RANKS, help="ranks of the synthetic lateness window")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    model = {**MODEL, "n_embd": a.n_embd, "seq_len": a.seq_len}
    if a.worker:
        worker(a.steps, a.every, a.batch, model)
        return 0
    args = ["--steps", str(a.steps), "--every", str(a.every), "--batch", str(a.batch)]
    out = mpirun_workers(__file__, 2, *args, "--n-embd", str(a.n_embd), "--seq-len", str(a.seq_len), timeout=900)
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    if out.returncode != 0 or line is None:
        raise SystemExit(f"worker failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    run = json.loads(line.removeprefix("RESULT "))
    ns = wrapper_ns()
    scale_us = lateness_us(a.every, ranks=a.ranks)
    per_step = run["collectives_per_step"] * ns * 1e-9 + run["window_us"] * 1e-6 / a.every
    overhead = per_step / run["step_s"]
    doc = {
        "worker": run,
        "wrapper_ns": ns,
        "timing_every": a.every,
        "lateness_us_at_scale": {"ranks": a.ranks, "groups": GROUPS, "us": scale_us},
        "overhead": overhead,
        "target": TARGET,
        "met": overhead <= TARGET and run["steady"],
    }
    if a.json:
        print(json.dumps(doc, indent=2))
    else:
        print(f"{'figure':<44} {'value':>14}")
        print(f"{'step (FSDP2, 2 ranks, gloo)':<44} {run['step_s'] * 1000:>11.1f} ms")
        print(f"{'collectives counted per step':<44} {run['collectives_per_step']:>14.0f}")
        print(f"{'ledger + wait attribution per collective':<44} {ns:>11.0f} ns")
        print(f"{'window close (sums, gather, lateness, line)':<44} {run['window_us']:>11.0f} µs")
        print(f"{f'lateness at {a.ranks} ranks x {GROUPS} groups, per window':<44} {scale_us / 1000:>11.1f} ms")
        print(
            f"overhead: {overhead * 100:.3f} % of the step (target ≤ {TARGET * 100:.0f} %: "
            f"{'met' if doc['met'] else 'NOT met'}); same collectives every step: {run['steady']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
