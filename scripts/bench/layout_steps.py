#!/usr/bin/env python3
"""The built-in trainer's step time at each layout: this checkout against another one (an earlier commit's
worktree), side by side in one run.

For each layout, each repetition runs the same job (`hpcscale run --local`, no checkpoints, per-parameter AdamW,
which both checkouts run on CPU) once with each checkout, alternating which goes first, so the shared machine's
drift hits both alike. A run's figure is the median `step_time_s` of its steps after the first two (start-up and
the first step's lazy work excluded); the ratio is this checkout's over the other's, per repetition, and its
median is what the table shows.

    git worktree add /tmp/base <commit>
    python scripts/bench/layout_steps.py --base /tmp/base [--reps 5] [--steps 30] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
LAYOUTS = {  # id: (tp, pp, ranks, dp_shard)
    "dp2": (1, 1, 2, 1),
    "dp_shard2": (1, 1, 2, 2),
    "tp2": (2, 1, 2, 1),
    "pp2": (1, 2, 2, 1),
    "hsdp2x2": (1, 1, 4, 2),
}
MODEL = {"n_layer": 4, "n_embd": 128, "n_head": 4, "seq_len": 64, "global_batch": 16, "micro_batch": 2}


def job(path: Path, *, tp: int, pp: int, ranks: int, dp_shard: int, steps: int) -> Path:
    spec = {
        "name": "layout-steps",
        "site": "local",
        "tasks_per_node": ranks,
        "parallel": {"tp": tp, "pp": pp, **({"dp_shard": dp_shard} if dp_shard > 1 else {})},
        "timeout_seconds": 120,
        "train": {
            "entry": "builtin",
            "params": {**MODEL, "steps": steps, "log_every": 1000, "eval_every": 0},
        },
    }
    path.write_text(yaml.safe_dump(spec))
    return path


def step_time(checkout: Path, spec: Path, run: Path) -> float:
    env = {**os.environ, "PYTHONPATH": str(checkout)}  # that checkout's hpcscale, whatever is installed
    cmd = [sys.executable, "-m", "hpcscale", "run", str(spec), "--local", "--run-dir", str(run)]
    r = subprocess.run(cmd, env=env, cwd=checkout, capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        sys.exit(f"{checkout}: {spec} failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    times = [row["step_time_s"] for row in rows if "loss" in row and row["step"] >= 2]
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", type=Path, required=True, help="the other checkout (a git worktree)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    results = {}
    with tempfile.TemporaryDirectory(prefix="hpcscale-layout-steps-") as tmp:
        root = Path(tmp)
        for name in args.layouts.split(","):
            tp, pp, ranks, dp_shard = LAYOUTS[name]
            spec = job(root / f"{name}.yaml", tp=tp, pp=pp, ranks=ranks, dp_shard=dp_shard, steps=args.steps)
            here, base = [], []
            for rep in range(args.reps):
                order = [(REPO, here), (args.base, base)]
                for checkout, out in order if rep % 2 == 0 else reversed(order):
                    run = root / f"{name}-{rep}-{'here' if checkout == REPO else 'base'}"
                    out.append(step_time(checkout, spec, run))
            ratios = [h / b for h, b in zip(here, base, strict=True)]
            results[name] = {"here_s": here, "base_s": base, "ratios": ratios, "ratio": statistics.median(ratios)}
            if not args.json:
                print(
                    f"{name:10s} step {statistics.median(here) * 1000:7.1f} ms vs {statistics.median(base) * 1000:7.1f}"
                    f" ms: ratio {results[name]['ratio']:.3f} (each: {', '.join(f'{r:.3f}' for r in ratios)})",
                    flush=True,
                )
    if args.json:
        print(json.dumps({"base": str(args.base), "reps": args.reps, "layouts": results}))


if __name__ == "__main__":
    main()
