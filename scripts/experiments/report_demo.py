#!/usr/bin/env python3
"""The run behind docs/report.md: docs/images/report/job.yaml through `hpcscale run --local`, stopped by SIGTERM
at step 160 and resumed with --reuse; from step 260 one rank (MPI rank 2) is stopped and continued in turn
(SIGSTOP/SIGCONT, 30 ms each) to the end. Then `hpcscale report run -o rep` makes the plots.

    cd "$(mktemp -d)" && cp REPO/docs/images/report/job.yaml . && python REPO/scripts/experiments/report_demo.py
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

RUN = Path("run")


def steps() -> int:
    try:
        rows = [json.loads(line) for line in (RUN / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    except (OSError, ValueError):
        return -1
    return max((r["step"] for r in rows), default=-1)


def start(*extra: str) -> subprocess.Popen:
    args = ["hpcscale", "run", "--local", "job.yaml", "--run-dir", str(RUN), *extra]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for(step: int) -> None:
    while steps() < step:
        time.sleep(0.2)


def mpi_ranks() -> dict[int, int]:
    """MPI rank -> pid of the run's ranks."""
    out = subprocess.run(["pgrep", "-f", f"hpcscale launch --run-dir {RUN.resolve()}"], capture_output=True, text=True)
    ranks = {}
    for pid in out.stdout.split():
        with contextlib.suppress(OSError):
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            env = dict(kv.split(b"=", 1) for kv in environ if b"=" in kv)
            if b"OMPI_COMM_WORLD_RANK" in env:
                ranks[int(env[b"OMPI_COMM_WORLD_RANK"])] = int(pid)
    return ranks


def bursts(pid: int, done: threading.Event) -> None:
    while not done.is_set():
        try:
            os.kill(pid, signal.SIGSTOP)
            time.sleep(0.03)
            os.kill(pid, signal.SIGCONT)
            time.sleep(0.03)
        except ProcessLookupError:
            return


def main() -> None:
    first = start()
    wait_for(160)
    first.send_signal(signal.SIGTERM)  # stops every rank after one step, with a checkpoint (exit 75)
    first.communicate()
    second = start("--reuse")
    wait_for(260)
    victim = mpi_ranks()[2]
    done = threading.Event()
    thread = threading.Thread(target=bursts, args=(victim, done))
    thread.start()
    second.communicate()
    done.set()
    thread.join()
    subprocess.run(["hpcscale", "report", str(RUN), "-o", "rep"], check=True)


if __name__ == "__main__":
    main()
