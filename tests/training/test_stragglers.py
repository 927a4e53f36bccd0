"""Stragglers named right in every layout: a rank that waits in a collective for a slow peer is not slow itself.

A user's own loop (tests/helpers/fsdp_entry.py: its model through ctx.parallelize, its own all-reduce of the
loss every step, ctx.clip_grad_norm_) on two ranks under `run --local`, sharded (FSDP2), tensor-parallel or
pipelined, with one rank slowed: by a slow data loader (the loop sleeps on that rank), or by a CPU hog sharing
its core (each rank pinned to a core of its own, the hog, real-time, on the slowed rank's). `hpcscale status`
must name that rank, and only it. Stop-and-continue bursts (SIGSTOP) with dp over four ranks on the Slurm
cluster: tests/house/test_observe.py. (Bursts on two ranks beside other load proved a poor test: a rank stopped while
it waits reads as waiting, and one rank's peers' median includes itself.)"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import REPO, local_rank_pids, run_cli

WINDOW = 4  # metrics.timing_every: steps per window (the verdict reads the last 5)


def _job(path: Path, layout: dict, *, steps: int, slow_ms: float = 0) -> Path:
    spec = {
        "name": "stragglers",
        "site": "local",
        "tasks_per_node": 2,
        "parallel": layout,
        "timeout_seconds": 120,
        "hang_timeout_seconds": 100,
        "environment": {"PYTHONPATH": str(REPO / "tests" / "helpers")},
        "metrics": {"timing_every": WINDOW},
        "checkpoint": {"every_steps": 0},
        "train": {"entry": "fsdp_entry:main", "params": {"steps": steps, "slow_rank": 1, "slow_ms": slow_ms}},
    }
    path.write_text(yaml.safe_dump(spec))
    return path


HOG = """
import time
while True:
    end = time.perf_counter() + 0.03
    while time.perf_counter() < end:
        pass
    time.sleep(0.01)
"""


def _verdict(run: Path) -> dict:
    status = run_cli("status", str(run), "--json")
    assert status.returncode == 0, status.stderr
    return json.loads(status.stdout)["timing"]["stragglers"]


@pytest.mark.parametrize(
    ("layout", "pattern"),
    [
        ({"dp_shard": 2}, "loader"),
        ({"tp": 2}, "loader"),
        ({"pp": 2}, "loader"),
        ({"tp": 2}, "hog"),
    ],
    ids=["fsdp-loader", "tp-loader", "pp-loader", "tp-hog"],
)
def test_the_slowed_rank_and_only_it_is_named(mpi, tmp_path, layout, pattern):
    run = tmp_path / "run"
    if pattern == "loader":  # deterministic: the loop itself sleeps on rank 1
        job = _job(tmp_path / "job.yaml", layout, steps=8 * WINDOW, slow_ms=60)
        r = run_cli("run", str(job), "--local", "--run-dir", str(run), timeout=600)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    else:  # slowed from outside once the ranks train, for the windows the verdict reads
        job = _job(tmp_path / "job.yaml", layout, steps=100000)
        cmd = [sys.executable, "-m", "hpcscale", "run", str(job), "--local", "--run-dir", str(run)]
        out = open(tmp_path / "out.txt", "w")  # noqa: SIM115 (closed below; a pipe nobody reads would stall)
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        hog = None
        try:
            deadline = time.monotonic() + 120
            while len(ranks := local_rank_pids(run)) < 2 or not (run / "timing.jsonl").exists():
                assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "out.txt").read_text()[-3000:]
                time.sleep(0.2)
            if pattern == "hog":  # a busy process on rank 1's core, each rank (every thread of it) on its own core
                for rank, pid in ranks.items():
                    subprocess.run(["taskset", "-a", "-cp", str(rank % 2), str(pid)], capture_output=True, check=True)
                # a real-time one (as an interrupt-heavy driver or a misbehaving daemon): busy 30 ms of every 40
                # whatever else wants the core. An ordinary-priority hog would not do: the kernel schedules each
                # session as a group (autogroup), so a hog outside the run's session gets a sliver of the core
                hog = subprocess.Popen(["chrt", "-f", "10", "taskset", "-c", "1", sys.executable, "-c", HOG])
            time.sleep(1.0)  # the slowing in full effect before the windows the verdict reads
            lines = len((run / "timing.jsonl").read_text().splitlines())
            while len((run / "timing.jsonl").read_text().splitlines()) < lines + 6:  # windows all slowed
                assert proc.poll() is None and time.monotonic() < deadline + 120, "too few windows"
                time.sleep(0.2)
        finally:
            if hog is not None:
                hog.kill()
            proc.send_signal(signal.SIGTERM)  # every rank stops at one step (exit 75)
            proc.wait(timeout=120)
            out.close()
    verdict = _verdict(run)
    assert verdict["slow_ranks"] == [1], verdict
    # rank 0 judged the same windows as they came: the straggler is a warning sign, once (health.stragglers)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    signs = [s for r in rows if "health" in r for s in r["health"]]
    assert [s["kind"] for s in signs] == ["straggler"] and signs[0]["evidence"].startswith("rank 1: own time"), signs
    assert not any("health_checkpoint" in r for r in rows)  # checkpoint.every_steps: 0 keeps none: logged only
