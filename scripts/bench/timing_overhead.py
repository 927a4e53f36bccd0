#!/usr/bin/env python3
"""What per-rank timing (metrics.timing_every) costs a training step, measured two ways in one run.

1. End to end: the same 2-rank (dp=2) reference-trainer job through `hpcscale run --local`, with
   `metrics.timing_every: 20` and with `0`, alternated (A B A B ...) so the shared machine's drift hits both
   alike. A run's step time is its loop's wall time per step from metrics.jsonl's timestamps (after 20 warm-up
   steps), which includes the recording and the gathers. Ratio = with / without, per pair; the median is the
   figure. On a noisy 2-core machine this ratio carries the run-to-run noise (a few %), hence part 2.
2. By parts: the cost of StepTimes.record() on a step that closes no window (ns, in this process), of the clock
   hpcscale.launch.waits puts around every collective wait (ns per wait, counted at WAITS_PER_STEP waits a
   step: more than this job makes, one gradient bucket, the stop check, the loss, the clip), and of one
   window's gather and line (µs, 2 MPI ranks), against the step time of part 1's runs without timing:
   overhead = (record + waits x wait clock + gather / timing_every) / step. This one is precise.

Target: overhead ≤ 1 % of the step time.

    python scripts/bench/timing_overhead.py [--reps 5] [--steps 300] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from _workers import mpirun_workers

REPO = Path(__file__).resolve().parents[2]
TARGET = 0.01
EVERY = 20
WARMUP = 20
WAITS_PER_STEP = 10  # a bound on the collective waits of one step of MODEL at dp = 2
MODEL = {"n_layer": 2, "n_embd": 128, "n_head": 4, "seq_len": 64, "global_batch": 8, "micro_batch": 4}


def _job(path: Path, steps: int, every: int) -> Path:
    spec = {
        "name": "timing-overhead",
        "site": "local",
        "nodes": 1,
        "tasks_per_node": 2,
        "timeout_seconds": 120,
        "checkpoint": {"every_steps": 0},
        "metrics": {"timing_every": every},
        "train": {"entry": "builtin", "params": {**MODEL, "steps": steps, "eval_every": 0, "log_every": 1000}},
    }
    path.write_text(yaml.safe_dump(spec))
    return path


def _run(steps: int, every: int) -> float:
    """Seconds of loop wall time per step of one run."""
    with tempfile.TemporaryDirectory() as d:
        job = _job(Path(d) / "job.yaml", steps, every)
        r = subprocess.run(
            ["hpcscale", "run", "--local", str(job), "--run-dir", str(Path(d) / "run")],
            capture_output=True,
            text=True,
            timeout=900,
        )
        if r.returncode != 0:
            raise SystemExit(f"run failed: {r.stderr[-2000:]}")
        rows = [json.loads(line) for line in (Path(d) / "run" / "metrics.jsonl").read_text().splitlines()]
        times = {row["step"]: row["time"] for row in rows if "loss" in row}
        if every:
            assert (Path(d) / "run" / "timing.jsonl").exists(), "timing on, but no timing.jsonl"
        return (times[steps - 1] - times[WARMUP - 1]) / (steps - WARMUP)


def record_ns(n: int = 200_000) -> float:
    from hpcscale.launch.timing import StepTimes

    with tempfile.TemporaryDirectory() as d:
        times = StepTimes(run_dir=Path(d), every=10**12, rank=0, node="n", pp=0, attempt=1)
        t = time.perf_counter()
        for i in range(n):
            times.record(i, step_s=0.05, data_s=0.001, dp_wait_s=0.01, sync_s=0.002, ckpt_s=0.0)
        return (time.perf_counter() - t) / n * 1e9


def wait_clock_ns(n: int = 200_000) -> float:
    """What hpcscale.launch.waits adds to one collective wait: its wrapper around a call that returns at once."""
    from hpcscale.launch.waits import CollectiveWaits

    def noop() -> None:
        return None

    timed = CollectiveWaits()._timed(noop)
    best = []
    for fn in (noop, timed, noop, timed):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        best.append((time.perf_counter() - t) / n * 1e9)
    return max(0.0, min(best[1], best[3]) - min(best[0], best[2]))


def worker(windows: int) -> None:
    """One of 2 MPI ranks: time whole windows' gathers (EVERY recorded steps, the gather, rank 0's line)."""
    from mpi4py import MPI

    from hpcscale.launch.timing import StepTimes

    comm = MPI.COMM_WORLD
    with tempfile.TemporaryDirectory() as d:
        run_dir = Path(comm.bcast(d if comm.rank == 0 else None, root=0))
        times = StepTimes(run_dir=run_dir, every=EVERY, rank=comm.rank, node="n", pp=0, attempt=1)
        for i in range(EVERY - 1):
            times.record(i, step_s=0.05)
        flushes = []
        for w in range(windows):
            for _ in range(EVERY - 1):
                times._rows.append((0.05, 0.04, 0.04, 0.0, 0.005, 0.005, 0.0, 0.0))
            comm.Barrier()
            t = time.perf_counter()
            times.record(w * EVERY + EVERY - 1, step_s=0.05)
            flushes.append(time.perf_counter() - t)
        comm.Barrier()
        if comm.rank == 0:
            lines = (run_dir / "timing.jsonl").read_text().splitlines()
            assert len(lines) == windows, len(lines)
            print(json.dumps({"gather_us": statistics.median(flushes) * 1e6}), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--windows", type=int, default=200, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker(a.windows)
        return 0
    pairs = []
    for rep in range(a.reps):
        order = (EVERY, 0) if rep % 2 == 0 else (0, EVERY)  # alternate who goes first
        got = {every: _run(a.steps, every) for every in order}
        pairs.append({"with_s": got[EVERY], "without_s": got[0], "ratio": got[EVERY] / got[0]})
        if not a.json:
            print(
                f"rep {rep + 1}: {got[EVERY] * 1000:.2f} ms/step with timing, {got[0] * 1000:.2f} without: "
                f"{got[EVERY] / got[0]:.4f}",
                flush=True,
            )
    ns = record_ns()
    wait_ns = wait_clock_ns()
    out = mpirun_workers(__file__, 2, "--windows", "200", timeout=600)
    if out.returncode != 0:
        raise SystemExit(f"gather worker failed: {out.stderr[-2000:]}")
    gather_us = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("{")))["gather_us"]
    step_s = statistics.median(p["without_s"] for p in pairs)
    by_parts = (ns * 1e-9 + WAITS_PER_STEP * wait_ns * 1e-9 + gather_us * 1e-6 / EVERY) / step_s
    doc = {
        "end_to_end": {
            "pairs": pairs,
            "median_ratio": statistics.median(p["ratio"] for p in pairs),
            "spread": [min(p["ratio"] for p in pairs), max(p["ratio"] for p in pairs)],
        },
        "by_parts": {
            "record_ns": ns,
            "wait_clock_ns": wait_ns,
            "waits_per_step": WAITS_PER_STEP,
            "gather_us": gather_us,
            "timing_every": EVERY,
            "step_ms": step_s * 1000,
            "overhead": by_parts,
        },
        "target": TARGET,
        "met": by_parts <= TARGET,
    }
    if a.json:
        print(json.dumps(doc, indent=2))
    else:
        e = doc["end_to_end"]
        print(
            f"end to end: with/without timing, median of {a.reps} pairs {e['median_ratio']:.4f} "
            f"(range {e['spread'][0]:.4f}-{e['spread'][1]:.4f}; run-to-run noise included)"
        )
        print(
            f"by parts: record {ns:.0f} ns/step + {WAITS_PER_STEP} waits x {wait_ns:.0f} ns + gather "
            f"{gather_us:.0f} µs every {EVERY} steps, "
            f"on a {step_s * 1000:.1f} ms step: {by_parts * 100:.3f} % (target ≤ {TARGET * 100:.0f} %: "
            f"{'met' if doc['met'] else 'NOT met'})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
