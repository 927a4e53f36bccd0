#!/usr/bin/env python3
"""Downtime of a node failure relaunched inside the allocation (restart.spare_nodes) against the same failure
through today's requeue-free path, `hpcscale resume` (a new submission), on the local Slurm cluster.

    python scripts/bench/inplace.py [--reps 5] [--json]      (scripts/localcluster up; a quiet machine)

Per repetition, one job of 2 nodes x 1 rank (a GPT of ~80 MB of model and optimizer state, node-local
checkpoints every 5 steps, shared every 25):
  1. in place: submitted with one spare node; after its first node-local save, kill -9 of the rank on its
     second node; the batch script relaunches the step on the survivor and the spare. Measured: kill -9 to the
     first training step of the new step, and its parts as `hpcscale status` shows them (detection, step
     start, load, first step: hpcscale.observe.downtime);
  2. resume: the same job without spares; the same kill; detection (until the job has left the queue), then
     `hpcscale resume RUN` and the new job up to its first step;
  3. a fresh start of the same job: its Slurm start to its first step (what any new step pays: srun, imports,
     the bootstrap, the model), the yardstick of the target below.
Medians, and the ratio resume / in place in each repetition. Target: in place <= detection + 1.2 x (a fresh
start's start-to-first-step) + the load. On this cluster the queue is empty: at a busy site the queue wait of
the resubmission adds to the resume's downtime, not to the relaunch's.
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
from resume import ENV, gone, rank_pid, rows, sacct_start, sh, wait  # noqa: E402

sys.path.insert(0, str(REPO))
from hpcscale.observe.downtime import relaunch_downtimes  # noqa: E402


def job_file(path: Path, spares: int) -> Path:
    spec = {
        "name": "bench-inplace",
        "site": "localcluster",
        "nodes": 2,
        "tasks_per_node": 1,
        "timeout_seconds": 60,
        "checkpoint": {"every_steps": 25, "local": {"every_steps": 5}},
        "restart": {"max_failures": 1 if spares else 0, "spare_nodes": spares},
        "train": {
            "entry": "builtin",
            "params": {"steps": 100000, "log_every": 100, "eval_every": 0, "global_batch": 4, "micro_batch": 2,
                       "seq_len": 32, "n_layer": 8, "n_embd": 256, "n_head": 4, "seed": 7},
        },
    }  # fmt: skip
    path.write_text(yaml.safe_dump(spec))
    return path


def events(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "attempts.jsonl").read_text().splitlines()]


def first_step(run: Path, attempt: int) -> float:
    return next(r["time"] for r in rows(run) if "loss" in r and r.get("attempt") == attempt)


def has_step(run: Path, attempt: int) -> bool:
    return any("loss" in r and r.get("attempt") == attempt for r in rows(run))


def begin_nodes(run: Path, attempt: int) -> list[str]:
    return next(e["nodes"] for e in events(run) if e["event"] == "begin" and e["attempt"] == attempt)


def kill_second(run: Path) -> float:
    # a node-local step whole on both nodes (its partner copies too): RUN/node-local.json names it
    record = run / "node-local.json"
    wait(lambda: record.exists() and json.loads(record.read_text() or "{}").get("step", 0) >= 10, 300,
         "a whole node-local checkpoint")  # fmt: skip
    victim = begin_nodes(run, 1)[-1]
    t = time.time()
    os.kill(rank_pid(run, victim), signal.SIGKILL)
    return t


def one(base: Path, rep: int) -> dict:
    # 1. in place
    run = base / f"inplace-{rep}"
    jid = json.loads(sh("hpcscale", "submit", str(job_file(base / "spare.yaml", 1)), "--run-dir", str(run),
                        "--json"))["job_id"]  # fmt: skip
    t_kill = kill_second(run)
    wait(lambda: has_step(run, 2), 300, "the relaunched step's first step")
    inplace_s = first_step(run, 2) - t_kill
    parts = relaunch_downtimes(events(run), rows(run))[1]
    restored = next((r["restored_from"] for r in rows(run) if r.get("attempt") == 2 and "restored_from" in r), None)
    sh("scancel", jid, check=False)
    wait(lambda: gone(jid), 120, "the in-place job to leave")
    # 2. resume
    run2 = base / f"resume-{rep}"
    jid = json.loads(sh("hpcscale", "submit", str(job_file(base / "plain.yaml", 0)), "--run-dir", str(run2),
                        "--json"))["job_id"]  # fmt: skip
    t_kill2 = kill_second(run2)
    wait(lambda: gone(jid), 300, "the failed job to leave the queue")
    t_gone = time.time()
    new = json.loads(sh("hpcscale", "resume", str(run2), "--json"))["submitted"]
    wait(lambda: has_step(run2, 2), 300, "the resumed job's first step")
    resume_s = first_step(run2, 2) - t_kill2
    sh("scancel", new, check=False)
    wait(lambda: gone(new), 120, "the resumed job to leave")
    # 3. a fresh start
    fresh = base / f"fresh-{rep}"
    fid = json.loads(sh("hpcscale", "submit", str(job_file(base / "plain.yaml", 0)), "--run-dir", str(fresh),
                        "--json"))["job_id"]  # fmt: skip
    wait(lambda: has_step(fresh, 1), 300, "the fresh job's first step")
    fresh_s = first_step(fresh, 1) - sacct_start(fid)
    sh("scancel", fid, check=False)
    wait(lambda: gone(fid), 120, "the fresh job to leave")
    target = (parts["detect_s"] or 0) + 1.2 * fresh_s + (parts["load_s"] or 0)
    return {
        "inplace_s": inplace_s,
        "inplace_detect_s": parts["detect_s"],
        "inplace_step_start_s": parts["start_s"],
        "inplace_load_s": parts["load_s"],
        "inplace_first_step_s": parts["first_step_s"],
        "resume_s": resume_s,
        "resume_detect_s": t_gone - t_kill2,
        "fresh_start_to_step_s": fresh_s,
        "target_s": target,
        "resume_over_inplace": resume_s / inplace_s,
        "inplace_restored_from": restored,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if subprocess.run(["sinfo", "-h"], capture_output=True, env=ENV).returncode != 0:
        raise SystemExit("the local cluster does not answer: scripts/localcluster up")
    base = Path(tempfile.mkdtemp(prefix="hpcscale-bench-inplace-", dir="/var/tmp"))
    results = [one(base, rep) for rep in range(a.reps)]
    med = {
        k: statistics.median(vals) if (vals := [r[k] for r in results if r[k] is not None]) else None
        for k in results[0]
    }
    if a.json:
        print(json.dumps({"reps": results, "median": med, "when": datetime.now().isoformat()}, indent=2))
        return
    print(f"{a.reps} repetitions; medians (s): kill -9 of one rank -> the first training step after it")
    print(f"  in place (a spare)    {med['inplace_s']:6.1f}   detection {med['inplace_detect_s']:.1f}, step start "
          f"{med['inplace_step_start_s']:.1f}, load {med['inplace_load_s']:.2f}, first step "
          f"{med['inplace_first_step_s']:.1f}")  # fmt: skip
    print(f"  hpcscale resume       {med['resume_s']:6.1f}   detection {med['resume_detect_s']:.1f} (the job gone)")
    print(f"  fresh start, Slurm start -> first step {med['fresh_start_to_step_s']:.1f}; target for in place "
          f"{med['target_s']:.1f} (detection + 1.2 x that + load)")  # fmt: skip
    print("  resume / in place, per repetition: " + " ".join(f"{r['resume_over_inplace']:.2f}" for r in results))


if __name__ == "__main__":
    main()
