"""Real Slurm + real MPI: a batch job of 2 nodes x 2 tasks under `srun --mpi=pmix`, where each rank starts
mpi4py and torch.distributed (gloo) and all-reduces; and the same ranks under plain mpirun."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

from conftest import REPO, wait_for_job

HELPER = REPO / "tests" / "helpers" / "allreduce_rank.py"


def _check_ranks(lines: list[str], size: int) -> list[dict]:
    ranks = sorted((json.loads(line) for line in lines if line.startswith("{")), key=lambda r: r["rank"])
    assert [r["rank"] for r in ranks] == list(range(size))
    expected = size * (size + 1) / 2
    assert all(r["gloo_sum"] == expected and r["mpi_sum"] == expected and r["size"] == size for r in ranks)
    return ranks


def test_sbatch_srun_pmix_mpi4py_and_gloo_allreduce(local_cluster, tmp_path: Path):
    out = tmp_path / "out-%j.txt"
    script = tmp_path / "job.sh"
    script.write_text(
        "#!/bin/bash\n"
        "#SBATCH --job-name=hpcscale-it\n"
        "#SBATCH --nodes=2 --ntasks-per-node=2 --time=00:05:00\n"
        f"#SBATCH --output={out}\n"
        "export OMPI_MCA_btl=self,tcp\n"
        f"srun --mpi=pmix --kill-on-bad-exit=1 {shlex.quote(sys.executable)} {shlex.quote(str(HELPER))}\n"
    )
    sub = subprocess.run(
        ["sbatch", "--parsable", str(script)],
        capture_output=True,
        text=True,
        env={**os.environ, **local_cluster},
        check=True,
    )
    job_id = sub.stdout.strip().split(";")[0]
    state = wait_for_job(job_id, local_cluster)
    log = Path(str(out).replace("%j", job_id)).read_text()
    assert state == "COMPLETED", log
    ranks = _check_ranks(log.splitlines(), 4)
    assert sorted({r["node"] for r in ranks}) in (
        ["n1", "n2"],
        ["n2", "n3"],
        ["n3", "n4"],
        ["n1", "n3"],
        ["n1", "n4"],
        ["n2", "n4"],
    )
    # each node ran two ranks
    assert sorted([r["node"] for r in ranks]).count(ranks[0]["node"]) == 2


def test_mpirun_mpi4py_and_gloo_allreduce(mpi):
    env = {
        **os.environ,
        "OMPI_MCA_btl": "self,tcp",
        "OMPI_ALLOW_RUN_AS_ROOT": "1",
        "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    }
    out = subprocess.run(
        [mpi, "-n", "3", "--oversubscribe", sys.executable, str(HELPER)],
        capture_output=True,
        text=True,
        env=env,
        timeout=180,
    )
    assert out.returncode == 0, out.stderr
    _check_ranks(out.stdout.splitlines(), 3)
