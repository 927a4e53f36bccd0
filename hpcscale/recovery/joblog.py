"""A Slurm job's logs in the run directory (RUN/logs/slurm-JOBID.out and .err), read for a diagnosis: bounded
tails, never a FIFO or a device, and the lines of the job's last attempt (the logs are appended to across
requeues; the batch script writes a marker line at the start of each attempt)."""

from __future__ import annotations

from hpcscale.errors import HpcscaleError
from hpcscale.rundir import LOGS, RunDir
from hpcscale.util.bounded import read_tail

LOG_TAIL = 8 << 20  # bytes read from the end of each job log: a long run's log can be large
ATTEMPT_MARKER = "=== hpcscale: job "  # the batch script's first line of each attempt (sbatch_templates/_step.j2)


def read_logs(rd: RunDir, names: list[str]) -> list[str]:
    """The last LOG_TAIL bytes of each log, as lines; a log that is missing, or is not a regular file (a FIFO,
    a device), is skipped: never waited on, never read whole."""
    lines: list[str] = []
    for name in names:
        try:
            tail = read_tail(rd.path / LOGS / name, max_bytes=LOG_TAIL, what="job log", missing_ok=True)
        except HpcscaleError:
            continue
        if tail is not None:
            lines += tail.data.decode("utf-8", "replace").splitlines()
    return lines


def last_attempt(lines: list[str]) -> list[str]:
    """The lines of the last attempt in a log appended to across requeues (from the template's marker on)."""
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith(ATTEMPT_MARKER):
            return lines[i:]
    return lines


def attempt_lines(rd: RunDir, job_id: str) -> list[str]:
    """The last attempt's lines of job `job_id`: its stderr log (srun's words), then its stdout log."""
    return [
        *last_attempt(read_logs(rd, [f"slurm-{job_id}.err"])),
        *last_attempt(read_logs(rd, [f"slurm-{job_id}.out"])),
    ]
