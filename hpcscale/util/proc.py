"""The one way hpcscale runs another program (sbatch, srun, scontrol, sacct, mpirun, rsync, ssh).

It logs the command, never goes through a shell, and turns failure into an error that carries the tool's
own message, so "Slurm refused" reaches the user in Slurm's words.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import shlex
import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from hpcscale.errors import RuntimeFailure

log = logging.getLogger("hpcscale.proc")


@dataclass(frozen=True, slots=True)
class Completed:
    args: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str


class CommandFailed(RuntimeFailure):
    """A program exited non-zero, was missing, or timed out. `message` is its own words."""

    def __init__(self, args: Sequence[str], message: str, returncode: int | None = None):
        self.args_ = tuple(args)
        self.returncode = returncode
        self.tool_message = message.strip()
        super().__init__(f"{args[0]}: {self.tool_message}" if self.tool_message else f"{args[0]} failed")


def run(
    args: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    timeout: float = 60,
    check: bool = True,
    input: str | None = None,
    cwd: str | None = None,
) -> Completed:
    """Run `args` (no shell). `env` entries are added to the current environment."""
    full_env = {**os.environ, **env} if env else None
    log.debug("run: %s", shlex.join(args))
    try:
        p = subprocess.run(
            list(args), env=full_env, capture_output=True, text=True, timeout=timeout, input=input, cwd=cwd, check=False
        )
    except FileNotFoundError:
        raise CommandFailed(args, "command not found") from None
    except subprocess.TimeoutExpired:
        raise CommandFailed(args, f"no answer within {timeout:g}s") from None
    done = Completed(tuple(args), p.returncode, p.stdout, p.stderr)
    if check and p.returncode != 0:
        raise CommandFailed(args, p.stderr or p.stdout or f"exit code {p.returncode}", p.returncode)
    return done


class Session:
    """A long-running program in a session of its own, its merged stdout/stderr read line by line.

    The promise: nothing it starts outlives it, and it does not outlive us.
    - setsid: a terminal's Ctrl-C or hang-up reaches only us, and we decide what the child gets. Everything the
      child starts stays in its session unless it calls setsid itself (mpirun puts each rank in a process group
      of its own, not a session), so `kill_all` reaches the whole tree.
    - PR_SET_PDEATHSIG (Linux): if we die, even by SIGKILL, the kernel sends the child `death_signal`; mpirun
      takes SIGTERM as "kill the job", so its ranks go with it. The kernel ties it to the thread that forked:
      start a Session from the main thread. Set in a preexec function, which Python runs between fork and
      exec: safe here because the caller has started no threads yet.
    - `finish` kills whatever the child left behind in its session before reaping the child: until it is
      reaped, its pid (which is also the session id) cannot be reused by another process.
    """

    def __init__(self, args: Sequence[str], *, env: Mapping[str, str] | None = None, death_signal=signal.SIGTERM):
        full_env = {**os.environ, **env} if env else None
        self.left_behind: list[str] = []  # what finish() killed, once it ran
        log.debug("session: %s", shlex.join(args))
        try:
            self._p = subprocess.Popen(
                list(args),
                env=full_env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                encoding="utf-8",
                errors="replace",  # a rank's stray bytes must not end the front end with a UnicodeDecodeError
                bufsize=1,
                start_new_session=True,
                preexec_fn=_die_with_parent(death_signal),
            )
        except FileNotFoundError:
            raise CommandFailed(args, "command not found") from None
        self.pid = self._p.pid

    def lines(self) -> Iterator[str]:
        """Its output, line by line, until every process holding the pipe has exited."""
        assert self._p.stdout is not None
        yield from self._p.stdout

    def send(self, sig: int) -> None:
        """Signal the child itself (not its session); nothing happens once it has exited."""
        if not self.exited():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill_all(self, sig: int) -> list[int]:
        """Send `sig` to every process in the child's session (the child included); returns their pids.
        Nothing once the child is reaped: its pid, the session id, may then belong to someone else."""
        if self._p.returncode is not None:
            return []
        members = session_members(self.pid)
        for pid in members:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        return members

    def exited(self) -> bool:
        """Whether the child has exited (it is not reaped: its pid stays reserved until `finish`)."""
        if self._p.returncode is not None:
            return True
        try:
            return os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
        except ChildProcessError:
            return True

    def finish(self, *, quiet: bool = False) -> int:
        """Wait for the child, kill what it left in its session, reap it; returns its exit code (128 + N for a
        signal N, as a shell reports it). What was killed is in `left_behind` (pid and command of each), and
        logged as a warning unless `quiet`."""
        if self._p.returncode is None:
            with contextlib.suppress(ChildProcessError):
                os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOWAIT)
        left = [pid for pid in session_members(self.pid) if pid != self.pid]
        names = [_describe(pid) for pid in left]
        self.kill_all(signal.SIGKILL)
        self.left_behind = names
        if left and not quiet:
            log.warning("killed what %s left behind: %s", self._p.args[0], ", ".join(names))
        code = self._p.wait()
        if self._p.stdout is not None:
            self._p.stdout.close()
        return 128 - code if code < 0 else code


def session_members(sid: int) -> list[int]:
    """Pids of the live processes in session `sid`, from /proc/PID/stat (empty where there is no /proc)."""
    members = []
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/stat", "rb") as f:
                    stat = f.read()
            except OSError:  # exited meanwhile
                continue
            # "pid (comm) state ppid pgrp session ...": comm may hold spaces and parentheses, so cut at the last ")"
            fields = stat.rpartition(b")")[2].split()
            if len(fields) > 3 and int(fields[3]) == sid and fields[0] != b"Z":  # a zombie is dead already
                members.append(int(entry.name))
    return members


def _describe(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            words = f.read().split(b"\0")
        cmdline = b" ".join(words).decode(errors="replace").strip()[:200]
        return f"{pid} ({cmdline})" if cmdline else str(pid)  # none: it was exiting already
    except OSError:
        return str(pid)


_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _die_with_parent(sig: int):
    """A preexec function: the kernel sends `sig` to the child when this process dies (Linux only)."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up before fork: the child only calls it
    parent = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:  # we died between fork and prctl: nobody would send it
            os.kill(os.getpid(), sig)

    return preexec
