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


def sharded_rank_state(ranks: int, tensors: int, rows: int, cols: int, dim: str):
    """A worker's start: torch.distributed up over MPI, and this rank's `tensors` random fp32 pieces of
    rows x cols as Shard(0) DTensors over a 1-D mesh of `ranks` named `dim`. Returns (rank, the mesh, the local
    tensors, {name: DTensor}, bytes on this rank)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from hpcscale.launch.bootstrap import bootstrap

    rank = bootstrap(timeout_s=600, order_nodes=lambda n: n).rank
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (ranks,), mesh_dim_names=(dim,))
    g = torch.Generator().manual_seed(rank)
    local = [torch.randn(rows, cols, generator=g) for _ in range(tensors)]
    state = {f"w{i:02d}": DTensor.from_local(t, mesh, [Shard(0)], run_check=False) for i, t in enumerate(local)}
    return rank, mesh, local, state, sum(t.numel() * 4 for t in local)
