#!/usr/bin/env python3
"""What the efficiency figures (docs/observability.md#efficiency) cost a training step, two ways in one run.

1. End to end: the same 2-rank (dp=2) reference-trainer job through `hpcscale run --local` with
   `metrics.flops: count` (the default: the second step counted, `tflops` on every line) and `off`, alternated
   (A B A B ...) so the shared machine's drift hits both alike. A run's step time is its loop's wall time per
   step from metrics.jsonl's timestamps after WARMUP steps. Ratio = count / off, per pair; the median is the
   figure. The counted step itself is reported apart: how much longer it took than the median step of its run
   (once per attempt).
2. By parts: the cost of one `Efficiency.figures(step_s)` call (the memory gauges and the arithmetic, every
   step), in this process, against the step time of part 1's runs with `off`: overhead = figures / step. On a CPU
   rank the gauges are one getrusage; on a GPU two more reads of the caching allocator's host-side counters
   (not measured here: no GPU).

Target: overhead ≤ 1 % of the step time.

    python scripts/bench/efficiency.py [--reps 5] [--steps 300] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import yaml

TARGET = 0.01
WARMUP = 20
MODEL = {"n_layer": 2, "n_embd": 128, "n_head": 4, "seq_len": 64, "global_batch": 8, "micro_batch": 4}


def _job(path: Path, steps: int, flops: str) -> Path:
    spec = {
        "name": "efficiency-overhead",
        "site": "local",
        "nodes": 1,
        "tasks_per_node": 2,
        "timeout_seconds": 120,
        "checkpoint": {"every_steps": 0},
        "metrics": {"flops": flops},
        "train": {"entry": "builtin", "params": {**MODEL, "steps": steps, "eval_every": 0, "log_every": 1000}},
    }
    path.write_text(yaml.safe_dump(spec))
    return path


def _run(steps: int, flops: str) -> tuple[float, float | None]:
    """(seconds of loop wall time per step after WARMUP, how much longer the counted step took than the median
    step: None with flops off)."""
    with tempfile.TemporaryDirectory() as d:
        job = _job(Path(d) / "job.yaml", steps, flops)
        r = subprocess.run(
            ["hpcscale", "run", "--local", str(job), "--run-dir", str(Path(d) / "run")],
            capture_output=True,
            text=True,
            timeout=900,
        )
        if r.returncode != 0:
            raise SystemExit(f"run failed: {r.stderr[-2000:]}")
        rows = [json.loads(line) for line in (Path(d) / "run" / "metrics.jsonl").read_text().splitlines()]
        lines = {row["step"]: row for row in rows if "loss" in row}
        per_step = (lines[steps - 1]["time"] - lines[WARMUP - 1]["time"]) / (steps - WARMUP)
        counted = None
        if flops == "count":
            assert any("model_flops" in row for row in rows), "counting on, but no model_flops record"
            assert all("tflops" in lines[s] for s in range(1, steps)), "a line without tflops"
            median = statistics.median(lines[s]["step_time_s"] for s in range(WARMUP, steps))
            counted = lines[1]["step_time_s"] - median
        else:
            assert not any("tflops" in row for row in rows), "flops off, but tflops logged"
        return per_step, counted


def figures_ns(n: int = 200_000) -> float:
    """One Efficiency.figures() call once the FLOPs are known: the memory gauges and the arithmetic."""
    import torch

    from hpcscale.launch.efficiency import Efficiency, ModelFlops

    ctx = SimpleNamespace(device=torch.device("cpu"), world_size=2)
    eff = Efficiency(ctx, mode="off", peak_tflops={"cpu": 1.0})
    eff.flops = ModelFlops(10**12, "counted", 512)
    best = []
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(n):
            eff.figures(0.025)
        best.append((time.perf_counter() - t) / n * 1e9)
    return min(best)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    ratios, off_steps, counted_extra = [], [], []
    for _ in range(a.reps):
        with_count, extra = _run(a.steps, "count")
        without, _ = _run(a.steps, "off")
        ratios.append(with_count / without)
        off_steps.append(without)
        counted_extra.append(extra)
    step = statistics.median(off_steps)
    per_call = figures_ns()
    overhead = per_call * 1e-9 / step
    out = {
        "pairs": a.reps,
        "steps": a.steps,
        "end_to_end_ratio_median": round(statistics.median(ratios), 4),
        "end_to_end_ratios": [round(r, 4) for r in ratios],
        "step_ms_flops_off": round(step * 1000, 2),
        "counted_step_extra_ms_median": round(statistics.median(counted_extra) * 1000, 2),
        "figures_ns": round(per_call),
        "overhead_by_parts": overhead,
        "target": TARGET,
        "met": overhead <= TARGET,
    }
    if a.json:
        print(json.dumps(out))
    else:
        print(
            f"end to end, count / off over {a.reps} pairs: median {out['end_to_end_ratio_median']} "
            f"({min(ratios):.3f}-{max(ratios):.3f}); step {out['step_ms_flops_off']} ms with flops off"
        )
        print(
            f"the counted step: {out['counted_step_extra_ms_median']} ms longer than the median step, once per attempt"
        )
        print(
            f"by parts: figures() {per_call:.0f} ns per step = {overhead * 100:.4f} % of the step "
            f"(target <= {TARGET * 100:.0f} %: {'met' if out['met'] else 'NOT met'})"
        )
    return 0 if out["met"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
