#!/usr/bin/env python3
"""Downtime of a failure on the local Slurm cluster: from kill -9 of one rank to the first training step of
the job `hpcscale resume` submitted, split into detection, the resume command, scheduling, start-up and
checkpoint load, next to a fresh start of the same job; and that checkpoint load against a raw sequential
read of the same bytes, both from a cold page cache.

    python scripts/bench/resume.py [--reps 5] [--json] [--embd 512] [--env KEY=VALUE ...]
        (scripts/localcluster up; root drops caches; --env goes into the job's `environment`)

Per repetition:
  1. submit a 2-node job (one rank per node, a GPT of ~300 MB of model and optimizer state), let it save a
     checkpoint, kill -9 the rank on its second node;
  2. detection: until the job has left the queue (srun's --kill-on-bad-exit, the batch script's decision);
  3. drop the page cache; `hpcscale resume RUN --json` (its own time; it verifies the checkpoint it picks,
     reading every chunk); drop the page cache again (on a cluster the compute nodes do not share the login
     node's); then scheduling (sacct Start of the new
     job minus the resume's end; 1 s resolution), start-up (from that Start to the ranks' `begin` record, after
     imports and the bootstrap, plus what precedes the load), checkpoint load (the trainer's `restore_s`), and
     the rest up to the first step's metrics line;
  4. the raw read, 3 s after the resumed job is gone: drop the page cache, wait as long as the load waited
     after its drop, read every data file the loaded checkpoint references, in order, 16 MiB at a time; twice,
     the faster counts. On this VM a read's speed depends on how long after the drop it starts (0.13-0.15 s
     within half a second of it, 0.25-0.45 s from 2 s on, for the same 306 MB), so the yardstick waits as
     the load did; the raw read right after a drop is printed beside it.
A fresh start of the same job (submit to its first step) is measured in each repetition too. Medians.
"""

from __future__ import annotations

import argparse
import contextlib
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
ENV = {**os.environ, "SLURM_CONF": os.environ.get("SLURM_CONF", "/var/tmp/hpcscale-localcluster/local1/slurm.conf")}


def drop_caches() -> bool:
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def sh(*args: str, check: bool = True) -> str:
    p = subprocess.run(args, capture_output=True, text=True, env=ENV, cwd=REPO)
    if check and p.returncode != 0:
        raise SystemExit(f"{args[:3]} failed: {p.stderr[-2000:]}")
    return p.stdout


def job_file(path: Path, n_embd: int, environment: dict[str, str]) -> Path:
    spec = {
        "name": "bench-resume",
        "site": "localcluster",
        "nodes": 2,
        "tasks_per_node": 1,
        "timeout_seconds": 60,
        "checkpoint": {"every_steps": 5, "async": False},
        "restart": {"max_failures": 0},
        "train": {
            "entry": "builtin",
            "params": {"steps": 100000, "log_every": 100, "eval_every": 0, "global_batch": 4, "micro_batch": 2,
                       "seq_len": 32, "n_layer": 8, "n_embd": n_embd, "n_head": 4, "seed": 7},
        },
    }  # fmt: skip
    if environment:
        spec["environment"] = environment
    path.write_text(yaml.safe_dump(spec))
    return path


def rows(run: Path) -> list[dict]:
    p = run / "metrics.jsonl"
    out = []
    if p.exists():
        for line in p.read_text().splitlines():
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
    return out


def wait(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise SystemExit(f"timed out waiting for {what}")


def gone(job: str) -> bool:
    return not sh("squeue", "-h", "-j", job, "-o", "%T", check=False).strip()


def sacct_start(job: str) -> float:
    for line in sh("sacct", "-j", job, "-X", "-n", "-P", "-o", "Start").splitlines():
        return datetime.fromisoformat(line.strip()).timestamp()
    raise SystemExit(f"no start time for job {job}")


def rank_pid(run: Path, node: str) -> int:
    out = sh("pgrep", "-f", f"hpcscale launch --run-dir {run}", check=False)
    for p in out.split():
        try:
            if Path(f"/proc/{p}/comm").read_text().strip() in ("srun", "mpirun"):
                continue
            if f"SLURMD_NODENAME={node}".encode() in Path(f"/proc/{p}/environ").read_bytes().split(b"\0"):
                return int(p)
        except OSError:
            continue
    raise SystemExit(f"no rank on {node}")


def begin_record(run: Path, attempt: int) -> dict:
    for line in (run / "attempts.jsonl").read_text().splitlines():
        e = json.loads(line)
        if e["event"] == "begin" and e["attempt"] == attempt:
            return e
    raise SystemExit("no begin record")


def begin_time(run: Path, attempt: int) -> float:
    return datetime.fromisoformat(begin_record(run, attempt)["time"]).timestamp()


RAW_BLOCK = 16 << 20


def raw_read(run: Path, step: int, after: float = 0.0, ahead: bool = False) -> tuple[float, int]:
    """Drop the page cache, wait `after` seconds, then read every data file of checkpoint `step` in order, 16 MiB
    at a time (`ahead`: announcing the next 16 MiB with POSIX_FADV_WILLNEED before each read, as the load
    does); (seconds, bytes)."""
    sys.path.insert(0, str(REPO))
    from hpcscale.ckpt.format import INDEX, read_index, step_dir_name

    root = run / "checkpoints"
    index = read_index(root / step_dir_name(step) / INDEX)
    files = sorted({c.file for t in index.tensors.values() for s in t.shards for c in s.chunks})
    drop_caches()
    time.sleep(after)
    t = time.perf_counter()
    n = 0
    for f in files:
        fd = os.open(root / f, os.O_RDONLY)
        at = 0
        while True:
            if ahead:
                os.posix_fadvise(fd, at + RAW_BLOCK, RAW_BLOCK, os.POSIX_FADV_WILLNEED)
            chunk = os.read(fd, RAW_BLOCK)
            if not chunk:
                break
            at += len(chunk)
        n += at
        os.close(fd)
    return time.perf_counter() - t, n


def one(base: Path, rep: int, n_embd: int, environment: dict[str, str]) -> dict:
    job = job_file(base / "job.yaml", n_embd, environment)
    # a fresh start, for comparison
    fresh = base / f"fresh-{rep}"
    drop_caches()
    t0 = time.time()
    fid = json.loads(sh("hpcscale", "submit", str(job), "--run-dir", str(fresh), "--json"))["job_id"]
    wait(lambda: any("loss" in r for r in rows(fresh)), 300, "the fresh job's first step")
    first = next(r["time"] for r in rows(fresh) if "loss" in r)
    fresh_total, fresh_sched = first - t0, sacct_start(fid) - t0
    sh("scancel", fid, check=False)
    # the failure and the resume
    run = base / f"run-{rep}"
    jid = json.loads(sh("hpcscale", "submit", str(job), "--run-dir", str(run), "--json"))["job_id"]
    wait(lambda: any(r.get("checkpoint") for r in rows(run)), 300, "a checkpoint")
    wait(lambda: gone(fid), 120, "the fresh job to leave")
    victim = begin_record(run, 1)["nodes"][-1]  # the job's second node (n2 or n4: either leaf switch)
    t_kill = time.time()
    os.kill(rank_pid(run, victim), signal.SIGKILL)
    wait(lambda: gone(jid), 300, "the failed job to leave the queue")
    t_gone = time.time()
    drop_caches()
    t_res = time.time()
    plan = json.loads(sh("hpcscale", "resume", str(run), "--json"))
    t_res_end = time.time()
    # resume verified the checkpoint it picked, reading every chunk: here the compute nodes share the login
    # node's page cache, on a cluster they do not. Drop it again before the new job's ranks load.
    drop_caches()
    t_dropped = time.time()
    new = plan["submitted"]
    wait(lambda: any("loss" in r and r.get("attempt") == 2 for r in rows(run)), 300, "the resumed job's first step")
    first2 = next(r["time"] for r in rows(run) if "loss" in r and r.get("attempt") == 2)
    restored = next(r for r in rows(run) if "restore_s" in r and r.get("attempt") == 2)
    restore = restored["restore_s"]
    since_drop = restored["time"] - restore - t_dropped  # how long after the cache drop the load began
    start = sacct_start(new)
    begin = begin_time(run, 2)
    sh("scancel", new, check=False)
    wait(lambda: gone(new), 120, "the resumed job to leave")
    # The raw read on a quiet machine (the cancelled ranks' teardown done), the faster of two cold reads per
    # kind: as long after the cache drop as the load began, plain and announcing the next 16 MiB as the load
    # does (the faster of these is the yardstick), and plain right after the drop. On this VM a plain read
    # right after a drop takes 0.13-0.15 s where the same read 2-5 s later takes 0.25-0.45 (docs/benchmarks.md,
    # resume bench): the load began seconds after its drop.
    time.sleep(3)
    step = plan["checkpoint"]
    (plain_s, nbytes), (plain2_s, _) = raw_read(run, step, since_drop), raw_read(run, step, since_drop)
    ahead_s = min(raw_read(run, step, since_drop, ahead=True)[0] for _ in range(2))
    raw_now_s = min(raw_read(run, step)[0], raw_read(run, step)[0])
    raw_s = min(plain_s, plain2_s, ahead_s)  # the yardstick: the fastest raw read in the load's conditions
    return {
        "detection_s": t_gone - t_kill,
        "resume_command_s": t_res_end - t_res,
        "scheduling_s": max(0.0, start - t_res_end),
        "startup_s": (begin - start) + (first2 - begin - restore),
        "checkpoint_load_s": restore,
        "total_s": first2 - t_kill,
        "fresh_start_s": fresh_total,
        "fresh_scheduling_s": max(0.0, fresh_sched),
        "load_after_drop_s": since_drop,
        "raw_read_s": raw_s,
        "raw_read_plain_s": min(plain_s, plain2_s),
        "raw_read_ahead_s": ahead_s,
        "raw_read_at_once_s": raw_now_s,
        "checkpoint_bytes": nbytes,
        "load_vs_raw": raw_s / restore if restore > 0 else 0.0,
        "load_vs_raw_at_once": raw_now_s / restore if restore > 0 else 0.0,
        "load_cold": begin > t_dropped,  # the ranks began (and so loaded) after the second drop
        "excluded": plan["exclude"],
        "killed_on": victim,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--embd", type=int, default=512, help="the GPT's width: 512 makes ~300 MB of state, 256 ~80 MB")
    ap.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="the job's `environment`")
    a = ap.parse_args()
    environment = dict(e.split("=", 1) for e in a.env)
    base = Path(tempfile.mkdtemp(prefix="hpcscale-bench-resume-", dir="/var/tmp"))
    results = [one(base, rep, a.embd, environment) for rep in range(a.reps)]
    keys = [k for k in results[0] if k not in ("excluded", "load_cold", "killed_on")]
    med = {k: statistics.median(r[k] for r in results) for k in keys}
    doc = {"reps": results, "median": med, "cold_cache": drop_caches()}
    if a.json:
        print(json.dumps(doc, indent=2))
        return
    print(f"{a.reps} repetitions; medians (s): kill -9 of one rank -> first step of the resumed job")
    for k in ("detection_s", "resume_command_s", "scheduling_s", "startup_s", "checkpoint_load_s", "total_s"):
        print(f"  {k:20s} {med[k]:7.2f}")
    print(f"  fresh start (submit -> first step) {med['fresh_start_s']:.2f} s")
    print(
        f"checkpoint load vs raw cold read of its {med['checkpoint_bytes'] / 1e6:.0f} MB, per repetition "
        f"(raw / load; the load began {med['load_after_drop_s']:.1f} s after the cache drop):"
    )
    print(
        "  the yardstick, as long after a drop: "
        + " ".join(f"{r['load_vs_raw']:.2f}" + ("" if r["load_cold"] else "(warm)") for r in results)
    )
    print("  a plain read right after a drop:     " + " ".join(f"{r['load_vs_raw_at_once']:.2f}" for r in results))
    print(f"  seconds: load {med['checkpoint_load_s']:.3f}; raw as long after a drop {med['raw_read_s']:.3f} "
          f"(plain {med['raw_read_plain_s']:.3f}, announcing ahead {med['raw_read_ahead_s']:.3f}), "
          f"right after a drop {med['raw_read_at_once_s']:.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
