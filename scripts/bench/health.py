#!/usr/bin/env python3
"""From a health signal to a committed node-local checkpoint (docs/observability.md#health-signals), on the local
Slurm cluster.

    python scripts/bench/health.py [--reps 5] [--poll 5] [--json]      (scripts/localcluster up; a quiet machine)

Per repetition, one job of 2 nodes x 1 rank (a GPT of ~80 MB of model and optimizer state, the node-local tier
on with no schedule of its own, `health.poll_seconds` = --poll) trains; once it has trained 20 steps,
`scontrol update nodename=n2 state=drain` at a random moment of the poll's period (what a site's health check
does after an ECC error); measured: from
that call to the node-local checkpoint's line in metrics.jsonl (written after the save committed on every node),
and its parts: to the poll that saw the sign (rank 0's `seen` time), and from there to the committed checkpoint
(the next step, its stop check, the save). The drain is undone and the job cancelled after each repetition.
The expected figure: on average half a poll period, plus a step, plus the save's blocking time; at most a poll
period more.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts" / "bench"))
from resume import gone, rows, sh, wait  # noqa: E402


def job_file(path: Path, poll: float) -> Path:
    spec = {
        "name": "bench-health",
        "site": "localcluster",
        "nodes": 2,
        "tasks_per_node": 1,
        "timeout_seconds": 60,
        "checkpoint": {"every_steps": 100000, "async": False, "local": {"every_steps": 100000}},
        "health": {"poll_seconds": poll, "cooldown_seconds": 600},
        "train": {
            "entry": "builtin",
            "params": {"steps": 100000, "log_every": 100, "eval_every": 0, "global_batch": 4, "micro_batch": 2,
                       "seq_len": 32, "n_layer": 8, "n_embd": 256, "n_head": 4, "seed": 7},
        },
    }  # fmt: skip
    path.write_text(yaml.safe_dump(spec))
    return path


def once(tmp: Path, poll: float) -> dict:
    run = tmp / "run"
    job = json.loads(sh("hpcscale", "submit", str(job_file(tmp / "job.yaml", poll)), "--run-dir", str(run), "--json"))
    job_id = job["job_id"]
    try:
        wait(lambda: sum(1 for r in rows(run) if "loss" in r) >= 20, 300, "20 steps")
        time.sleep(random.uniform(0, poll))  # a moment of its own in the poll's period: the jobs' start is regular
        t0 = time.time()
        sh("scontrol", "update", "nodename=n2", "state=drain", "reason=bench: health signal")
        wait(lambda: any("health_checkpoint" in r for r in rows(run)), 120, "the checkpoint for the sign")
        got = rows(run)
        saved = next(r for r in got if "health_checkpoint" in r)
        step = saved["health_checkpoint"]["step"]
        committed = next(r["time"] for r in got if r.get("local_checkpoint") == step)
        seen = next(s["seen"] for r in got if "health" in r for s in r["health"])
        step_s = statistics.median(r["step_time_s"] for r in got if "step_time_s" in r)
        return {
            "total_s": committed - t0,
            "to_poll_s": seen - t0,
            "poll_to_commit_s": committed - seen,
            "save_blocking_s": saved["health_checkpoint"]["blocking_s"],
            "step_s": step_s,
        }
    finally:
        sh("scancel", job_id, check=False)
        sh("scontrol", "update", "nodename=n2", "state=resume", check=False)
        wait(lambda: gone(job_id), 120, "the job to leave")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--poll", type=float, default=5.0)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    reps = []
    for _ in range(a.reps):
        with tempfile.TemporaryDirectory(dir="/var/tmp") as d:
            reps.append(once(Path(d), a.poll))
    med = {k: round(statistics.median(r[k] for r in reps), 3) for k in reps[0]}
    out = {"poll_seconds": a.poll, "reps": [{k: round(v, 3) for k, v in r.items()} for r in reps], "median": med}
    if a.json:
        print(json.dumps(out))
    else:
        for i, r in enumerate(out["reps"], 1):
            print(f"rep {i}: drain to committed node-local checkpoint {r['total_s']:.2f} s "
                  f"(to the poll {r['to_poll_s']:.2f} s, then {r['poll_to_commit_s']:.2f} s; save blocking "
                  f"{r['save_blocking_s']:.2f} s, step {r['step_s'] * 1000:.0f} ms)")  # fmt: skip
        print(f"median over {a.reps}: {med['total_s']:.2f} s with poll_seconds {a.poll:g} "
              f"(to the poll {med['to_poll_s']:.2f} s, poll to commit {med['poll_to_commit_s']:.2f} s)")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
