"""Run a bench script's worker mode as N local MPI ranks (the way `hpcscale run --local` starts ranks)."""

from __future__ import annotations

import os
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
