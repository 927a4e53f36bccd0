"""A Slurm job's logs in the run directory (RUN/logs/slurm-JOBID.out and .err), read for a diagnosis: bounded
tails, never a FIFO or a device, and the lines of the job's last attempt (the logs are appended to across
requeues; the batch script writes a marker line at the start of each attempt).

What the logs say blames ranks and nodes, so they are read only from a RUN/logs that the user or root made and no
one else can write (hpcscale.util.trust: opened without following a symbolic link, fstat on that descriptor, the
logs read through it): UntrustedFile (exit 2) otherwise, naming the directory, its owner and mode."""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator

from hpcscale.errors import BadInput, HpcscaleError
from hpcscale.rundir import LOGS, RunDir
from hpcscale.util.bounded import read_tail
from hpcscale.util.trust import UntrustedFile, check_dir_fd

LOG_TAIL = 8 << 20  # bytes read from the end of each job log: a long run's log can be large
ATTEMPT_MARKER = "=== hpcscale: job "  # the batch script's first line of each attempt (sbatch_templates/_step.j2)


@contextlib.contextmanager
def _logs_dir(rd: RunDir) -> Iterator[str | None]:
    """A path that reaches RUN/logs through a descriptor checked to be the user's or root's and writable by no one
    else (/proc/self/fd/N: a directory swapped in afterwards is not read); None when there is no RUN/logs."""
    path = rd.path / LOGS
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        yield None
        return
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise UntrustedFile(
                f"{path}: refusing the run's logs directory: a symbolic link or not a directory; hpcscale reads a "
                f"job's logs only from the run's own directory. Fix: check what it is, then remove {path}"
            ) from None
        raise BadInput(f"{path}: cannot open the run's logs directory ({e.strerror})") from None
    try:
        check_dir_fd(fd, path, what="run's logs directory")
        yield f"/proc/self/fd/{fd}"
    finally:
        os.close(fd)


def read_logs(rd: RunDir, names: list[str]) -> list[str]:
    """The last LOG_TAIL bytes of each log, as lines; a log that is missing, or is not a regular file (a FIFO,
    a device), is skipped: never waited on, never read whole. UntrustedFile when RUN/logs is not to be trusted."""
    lines: list[str] = []
    with _logs_dir(rd) as logs:
        for name in names if logs is not None else ():
            if "/" in name or name in ("", ".", ".."):  # a job id from a record others may write: never a path
                continue
            try:
                tail = read_tail(f"{logs}/{name}", max_bytes=LOG_TAIL, what="job log", missing_ok=True)
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
