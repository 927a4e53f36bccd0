"""docs/templates.md's hand-written batch script, as written, on the real local cluster: a failed attempt that
the job's restart budget does not requeue ends the Slurm job FAILED with the ranks' exit code, not COMPLETED 0:0
(the script's last command was the requeue decision, which exits 0 whatever it decides)."""

from __future__ import annotations

import os
import re
import subprocess

import yaml
from conftest import REPO, run_cli, wait_for_job


def _sacct(job_id: str, env: dict) -> tuple[str, str]:
    out = subprocess.run(["sacct", "-j", job_id, "-X", "-n", "-P", "-o", "State,ExitCode"], capture_output=True,
                         text=True, env=env)  # fmt: skip
    state, code = out.stdout.strip().splitlines()[0].split("|")
    return state.split()[0], code


def test_the_documented_own_script_ends_with_the_ranks_exit_code(local_cluster, tmp_path):
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "failing.py").write_text("import sys\n\ndef main(ctx):\n    sys.exit(3)\n")
    spec = {
        "name": "own-script",
        "site": "localcluster",
        "nodes": 1,
        "tasks_per_node": 1,
        "time_limit": "00:05:00",
        "environment": {"PYTHONPATH": str(mods)},
        "restart": {"max_failures": 0},  # the failure is not requeued: the job ends with it
        "train": {"entry": "failing:main"},
    }
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec))
    run = tmp_path / "run"
    r = run_cli("submit", str(tmp_path / "job.yaml"), "--dry-run", "--run-dir", str(run), env=local_cluster)
    assert r.returncode == 0, r.stderr[-2000:]
    doc = (REPO / "docs" / "templates.md").read_text()
    (block,) = [b for b in re.findall(r"```bash\n(.*?)```", doc, re.S) if "hpcscale requeue" in b]
    lines = block.replace("/path/to/RUN", str(run)).splitlines()
    last_directive = max(i for i, line in enumerate(lines) if line.startswith("#SBATCH"))
    script = ["#!/bin/bash", *lines[: last_directive + 1], f"RUN={run}", *lines[last_directive + 1 :]]
    (tmp_path / "own.sbatch").write_text("\n".join(script) + "\n")
    sub = subprocess.run(["sbatch", "--parsable", str(tmp_path / "own.sbatch")], capture_output=True, text=True,
                         env={**os.environ, **local_cluster}, cwd=tmp_path)  # fmt: skip
    assert sub.returncode == 0, sub.stderr
    job_id = sub.stdout.strip().split(";")[0]
    assert wait_for_job(job_id, local_cluster) == "FAILED"
    state, code = _sacct(job_id, {**os.environ, **local_cluster})
    assert (state, code.split(":")[0]) == ("FAILED", "3"), (state, code)
