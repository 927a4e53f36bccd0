"""The one way hpcscale runs another program (sbatch, srun, scontrol, sacct, mpirun, rsync, ssh).

It logs the command, never goes through a shell, and turns failure into an error that carries the tool's
own message, so "Slurm refused" reaches the user in Slurm's words.
"""

from __future__ import annotations

import logging
import os
import shlex
import subprocess
from collections.abc import Mapping, Sequence
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


def stream(args: Sequence[str], *, env: Mapping[str, str] | None = None, on_line=None) -> int:
    """Run `args` (no shell) passing each line of its merged stdout/stderr to `on_line`; returns the exit code.
    For long-running children whose output the user watches (mpirun)."""
    full_env = {**os.environ, **env} if env else None
    log.debug("stream: %s", shlex.join(args))
    try:
        p = subprocess.Popen(
            list(args), env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
        )
    except FileNotFoundError:
        raise CommandFailed(args, "command not found") from None
    assert p.stdout is not None
    try:
        for line in p.stdout:
            if on_line is not None:
                on_line(line)
    except KeyboardInterrupt:
        p.terminate()
        raise
    return p.wait()
