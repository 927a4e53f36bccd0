"""This start of a job's ranks in the run directory's record (RUN/attempts.jsonl): its number, where and under
which Slurm job it runs (the `begin` event rank 0 writes), its stop, and a Slurm job hpcscale did not submit
(an admin's own script calling `hpcscale launch`) taken in as a job of the run. What `status`, `resume` and the
batch script's requeue read back. A run directory that cannot take a line does not end the training: it is said.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

from hpcscale.errors import HpcscaleError
from hpcscale.portable.lock import process_start_time
from hpcscale.rundir import RunDir, Submission
from hpcscale.util.trust import clean


def attempt_event(work_dir: Path, event: str, attempt: int | None, **fields) -> None:
    """One line of RUN/attempts.jsonl; a run directory that cannot take it must not end the training."""
    try:
        RunDir(work_dir).add_attempt_event(
            {"event": event, "attempt": attempt, "time": datetime.now(timezone.utc).isoformat(), **fields}
        )
    except OSError as e:
        print(f"hpcscale launch: cannot record the attempt's {event} in {work_dir}: {e}", file=sys.stderr, flush=True)


def begin_attempt(work_dir: Path, info, dims, log_paths: Callable[[str], dict[str, str]] | None = None) -> int:
    """Number this start of the job's ranks (1, 2, ...) and record where and under which Slurm job it runs:
    every metrics line then names its attempt, so steps repeated after a requeue or resume are told apart."""
    try:
        attempt = RunDir(work_dir).next_attempt()
    except OSError:
        attempt = 0
    if os.environ.get("SLURM_JOB_ID") and not os.environ.get("SLURM_ARRAY_JOB_ID"):  # a sweep's are submitted
        adopt_job(work_dir, os.environ["SLURM_JOB_ID"], log_paths)
    attempt_event(
        work_dir,
        "begin",
        attempt,
        job_id=os.environ.get("SLURM_JOB_ID"),
        restart_count=int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0),
        nodes=info.nodes,
        world_size=info.world_size,
        device=getattr(info.device, "type", None),  # "cuda": one GPU per rank (GPU-hours in `report`)
        layout=dims.as_dict(),  # with nodes: which rank sat where, in which groups (NCCL timeout diagnosis)
        host=socket.gethostname(),
        pid=os.getpid(),
        pid_start=process_start_time(os.getpid()),  # with the pid: a reused pid is not taken for this rank
    )
    return attempt


def adopt_job(work_dir: Path, job_id: str, log_paths: Callable[[str], dict[str, str]] | None = None) -> None:
    """A Slurm job hpcscale did not submit (an admin's own script calling `hpcscale launch`) is still a job of
    the run: recorded as a submission the first time one of its attempts starts, so `status` lists it and
    `resume` diagnoses it through sacct (its nodes, its exit) and resubmits with the rendered script."""
    rd = RunDir(work_dir)
    try:
        subs = rd.submissions()
        if any(s.job_id == job_id for s in subs):
            return
        rd.record(
            Submission(
                index=len(subs) + 1,
                job_id=job_id,
                cluster=os.environ.get("SLURM_CLUSTER_NAME"),
                time=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                script="",  # the script is the admin's, not in RUN/submissions
                template="own script",
                reason="started by a script hpcscale did not submit",
            )
        )
    except (OSError, HpcscaleError) as e:  # the run goes on; status and resume will not know this job
        print(f"hpcscale launch: cannot record job {job_id} in {work_dir}: {e}", file=sys.stderr, flush=True)
        return
    if log_paths is not None:
        check_own_logs(work_dir, job_id, log_paths)


def check_own_logs(work_dir: Path, job_id: str, log_paths: Callable[[str], dict[str, str]]) -> None:
    """The failure diagnosis (`resume`, `hpcscale requeue`) reads a job's log where the rendered script puts it,
    RUN/logs/slurm-JOBID.out and .err: say so at once when an admin's script writes elsewhere. The paths come
    from `scontrol show job` read by hpcscale.slurm.parse (a path holding spaces or ` Key=` is read whole)."""
    logs = Path(os.path.realpath(work_dir)) / "logs"
    want = {"StdOut": logs / f"slurm-{job_id}.out", "StdErr": logs / f"slurm-{job_id}.err"}
    try:  # the job's own environment names its cluster's slurm.conf
        fields = log_paths(job_id)
    except (OSError, HpcscaleError):
        return
    wrong = [k for k, path in want.items() if k in fields and Path(os.path.realpath(fields[k])) != path]
    if wrong:
        print(
            f"hpcscale launch: warning: job {job_id} writes its log to {clean(fields[wrong[0]])}, not "
            f"{want[wrong[0]]}: `hpcscale resume` and `hpcscale requeue` read a failed attempt's rank, node and "
            f"signal from there; add `#SBATCH --output={work_dir}/logs/slurm-%j.out` and "
            f"`#SBATCH --error={work_dir}/logs/slurm-%j.err`",
            file=sys.stderr,
            flush=True,
        )
