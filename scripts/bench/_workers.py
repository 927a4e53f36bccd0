"""Run a bench script's worker mode as N local MPI ranks (the way `hpcscale run --local` starts ranks)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from hpcscale.launch.local import local_env


def mpirun_workers(script: str, ranks: int, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **local_env(), "OMP_NUM_THREADS": "1"}
    cmd = [
        "mpirun",
        "-n",
        str(ranks),
        "--oversubscribe",
        "--bind-to",
        "none",
        sys.executable,
        script,
        "--worker",
        *args,
    ]
    return subprocess.run(
        cmd, capture_output=True, text=True, env=env, cwd=Path(script).resolve().parents[2], timeout=timeout
    )


def worker_result(script: str, ranks: int, workdir: Path, *, timeout: float) -> dict:
    """Run `script --worker --dir WORKDIR` as `ranks` ranks in a fresh WORKDIR (removed afterwards) and return
    the JSON its rank 0 printed on a `RESULT ` line; exit with the output's tail when there is none."""
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    try:
        out = mpirun_workers(script, ranks, "--dir", str(workdir), timeout=timeout)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    if out.returncode != 0 or line is None:
        sys.exit(f"benchmark failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return json.loads(line.removeprefix("RESULT "))
