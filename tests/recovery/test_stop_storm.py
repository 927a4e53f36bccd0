"""Stop signals at random moments (during start-up, during a step, during an async save), 4 times on one run,
alternating a moment in start-up with one among the steps: every stop ends with exit 75 and a durable, verifying
checkpoint of the last step the ranks finished (no older than one step before the signal), and every earlier
checkpoint still verifies."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import time

from conftest import REPO, run_cli
from trainjobs import job_spec

SIGNALS = 4


def _newest(run) -> int | None:
    steps = [int(p.name.split("-")[1]) for p in (run / "checkpoints").glob("step-*") if (p / "index.h5").exists()]
    return max(steps) if steps else None


def _losses_logged(run) -> int:
    path = run / "metrics.jsonl"
    return path.read_text().count('"loss"') if path.exists() else 0


def _wait_for_a_step(run, before: int, proc, limit_s: float = 120) -> None:
    """Until the run logs a loss it had not logged before this attempt started."""
    deadline = time.monotonic() + limit_s
    while _losses_logged(run) <= before:
        assert proc.poll() is None and time.monotonic() < deadline, "the attempt ended or took too long to step"
        time.sleep(0.05)


def test_stops_at_random_moments_each_leave_a_verified_checkpoint(mpi, tmp_path):
    job = job_spec(tmp_path / "job.yaml", tp=1, pp=1, ranks=2, steps=100000,
                   checkpoint={"every_steps": 7, "async": True, "keep_last": 2})  # fmt: skip
    run = tmp_path / "run"
    rng = random.Random(1234)
    outcomes = []
    for i in range(SIGNALS):
        before = _newest(run) if run.exists() else None
        args = ["hpcscale", "run", str(job), "--local", "--run-dir", str(run)] + (["--reuse"] if i else [])
        proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            # start-up takes ~4-6 s here: even stops land in it (or just after), odd ones among steps and saves
            # (after this attempt's first step, however long a loaded machine takes to get there)
            if i % 2 == 0:
                time.sleep(rng.uniform(0.5, 3.0))
            else:
                _wait_for_a_step(run, _losses_logged(run), proc)
                time.sleep(rng.uniform(0.0, 3.5))
            proc.send_signal(signal.SIGTERM)
            out, _ = proc.communicate(timeout=180)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert proc.returncode == 75, out[-3000:]
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        attempt = max(r.get("attempt", 0) for r in rows) if rows else 0
        done = [r["step"] for r in rows if "loss" in r and r.get("attempt") == attempt]
        newest = _newest(run)
        if done:  # the ranks finished steps in this attempt: the stop checkpointed the last of them
            assert newest == max(done) + 1, (i, newest, max(done), out[-2000:])
        else:  # stopped before its first step: what was there is kept
            assert newest == before, (i, newest, before)
        verify = run_cli("ckpt", "verify", str(run))
        assert verify.returncode == 0, verify.stdout + verify.stderr
        outcomes.append("step" if done else "start-up")
    for step_dir in sorted((run / "checkpoints").glob("step-*")):  # every kept checkpoint, not just the newest
        assert run_cli("ckpt", "verify", str(step_dir)).returncode == 0, step_dir
    assert outcomes.count("step") >= 2, outcomes
