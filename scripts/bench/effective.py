#!/usr/bin/env python3
"""Effective training time with a failure injected every N seconds: relaunch in the allocation (spare nodes)
against the in-job requeue, measured on the local Slurm cluster, side by side with the same job unharmed.

    python scripts/bench/effective.py [--reps 5] [--every 12] [--json]   (scripts/localcluster up; quiet machine)

Per repetition, three runs of the same job (one node of two ranks, a GPT of ~80 MB of model and optimizer
state, node-local checkpoints every 5 steps, shared every 25; a fixed number of steps):
  1. unharmed: the wall time from its first training step to its end, T0 (what the work costs);
  2. in place: `restart.spare_nodes: 3`; from its first step, every `--every` seconds a rank of the running step
     is killed with -9 (at most three times, the spares there are); each failure relaunches the step on a spare;
  3. requeue: no spares, the same kills; each failure is requeued by the batch script (backoff 0; the local
     cluster's Slurm holds a requeued job 10 s, its credential lifetime; the failed node excluded).
Effective training time = T0 / (the run's wall time from its first step to its end): the share of the wall
clock that did the work, counting the downtime and the steps redone after each failure (torchft reports
81 % with a failure every minute on its setup). The queue here is empty: at a busy site each requeue also
waits in the queue, so the requeue's figure is an upper bound there; a relaunch in place never waits.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts" / "bench"))
from resume import ENV, gone, rows, sh, wait  # noqa: E402

STEPS = 300  # about 45 s of training here at two ranks


def job_file(path: Path, *, spares: int, failures: int) -> Path:
    spec = {
        "name": "bench-effective",
        "site": "localcluster",
        "nodes": 1,
        "tasks_per_node": 2,
        "timeout_seconds": 60,
        "hang_timeout_seconds": 30,
        "checkpoint": {"every_steps": 25, "local": {"every_steps": 5}},
        # max_no_progress: attempts killed every few seconds may commit nothing new; the requeue goes on anyway
        "restart": {"max_failures": failures, "spare_nodes": spares, "failure_backoff_seconds": 0,
                    "max_no_progress": 10},
        "train": {
            "entry": "builtin",
            "params": {"steps": STEPS, "log_every": 100, "eval_every": 0, "global_batch": 4, "micro_batch": 2,
                       "seq_len": 32, "n_layer": 8, "n_embd": 256, "n_head": 4, "seed": 7},
        },
    }  # fmt: skip
    path.write_text(yaml.safe_dump(spec))
    return path


def step_times(run: Path) -> list[float]:
    return [r["time"] for r in rows(run) if "loss" in r]


def rank_pids(run: Path) -> list[int]:
    out = sh("pgrep", "-f", f"hpcscale launch --run-dir {run}", check=False)
    pids = []
    for p in out.split():
        try:
            if Path(f"/proc/{p}/comm").read_text().strip() not in ("srun", "mpirun", "slurmstepd"):
                pids.append(int(p))
        except OSError:
            continue
    return pids


def one_run(base: Path, name: str, *, spares: int, failures: int, every: float | None) -> dict:
    run = base / name
    jid = json.loads(sh("hpcscale", "submit", str(job_file(base / f"{name}.yaml", spares=spares, failures=failures)),
                        "--run-dir", str(run), "--json"))["job_id"]  # fmt: skip
    wait(lambda: bool(step_times(run)), 300, f"{name}: the first training step")
    first = step_times(run)[0]
    kills = 0
    while not gone(jid):
        if every is not None and kills < failures and time.time() >= first + every * (kills + 1):
            # a rank of the step running now (or starting: a failure during a relaunch is one too): kill -9
            pids = rank_pids(run)
            if pids:
                victim = min(pids)
                os.kill(victim, signal.SIGKILL)
                kills += 1
                wait(lambda v=victim: not Path(f"/proc/{v}").exists(), 60, "the killed rank to go")
        time.sleep(0.2)
    ends = [json.loads(line) for line in (run / "attempts.jsonl").read_text().splitlines()]
    ends = [e for e in ends if e["event"] == "end"]
    if not ends or ends[-1]["cause"] != "completed":
        raise SystemExit(f"{name}: the job did not complete: {ends[-1:] or 'no end record'}")
    times = step_times(run)
    done = {r["step"] for r in rows(run) if "loss" in r}
    if done != set(range(STEPS)):
        raise SystemExit(f"{name}: steps missing: {sorted(set(range(STEPS)) - done)[:10]}")
    return {"wall_s": max(times) - first, "failures": kills, "relaunched": sum(1 for e in ends if e.get("relaunch"))}


def one(base: Path, rep: int, every: float) -> dict:
    clean = one_run(base, f"unharmed-{rep}", spares=0, failures=0, every=None)
    inplace = one_run(base, f"inplace-{rep}", spares=3, failures=3, every=every)
    requeue = one_run(base, f"requeue-{rep}", spares=0, failures=3, every=every)
    t0 = clean["wall_s"]
    return {
        "unharmed_s": t0,
        "inplace_s": inplace["wall_s"],
        "requeue_s": requeue["wall_s"],
        "inplace_failures": inplace["failures"],
        "inplace_relaunched": inplace["relaunched"],
        "requeue_failures": requeue["failures"],
        "inplace_effective": t0 / inplace["wall_s"],
        "requeue_effective": t0 / requeue["wall_s"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--every", type=float, default=12.0, help="seconds between injected failures")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if subprocess.run(["sinfo", "-h"], capture_output=True, env=ENV).returncode != 0:
        raise SystemExit("the local cluster does not answer: scripts/localcluster up")
    base = Path(tempfile.mkdtemp(prefix="hpcscale-bench-effective-", dir="/var/tmp"))
    results = [one(base, rep, a.every) for rep in range(a.reps)]
    med = {k: statistics.median(r[k] for r in results) for k in results[0]}
    if a.json:
        print(json.dumps({"reps": results, "median": med, "every_s": a.every, "when": datetime.now().isoformat()},
                         indent=2))  # fmt: skip
        return
    print(f"{a.reps} repetitions, a kill -9 every {a.every:g} s of the run (at most 3); medians")
    print(f"  unharmed: {med['unharmed_s']:.1f} s from the first step to the end")
    print(f"  in place (3 spares): {med['inplace_s']:.1f} s, {med['inplace_failures']:.0f} failures, "
          f"effective training time {100 * med['inplace_effective']:.0f} %")  # fmt: skip
    print(f"  requeue:             {med['requeue_s']:.1f} s, {med['requeue_failures']:.0f} failures, "
          f"effective training time {100 * med['requeue_effective']:.0f} %")  # fmt: skip
    print(
        "  effective, in place / requeue, per repetition: "
        + " ".join(f"{100 * r['inplace_effective']:.0f}/{100 * r['requeue_effective']:.0f}" for r in results)
    )


if __name__ == "__main__":
    main()
