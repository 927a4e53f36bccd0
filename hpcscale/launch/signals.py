"""Stop on request: SIGUSR1, SIGUSR2 and SIGTERM set a flag; ranks agree on it so all stop at the same step.

Slurm sends the job's `--signal` (default USR1, 120 s before the time limit) and SIGTERM on preemption or
scancel. The trainer finishes the step it is in, checkpoints (with the checkpoint issue), and the launcher
exits with STOPPED_EXIT_CODE so scripts and requeue logic can tell "stopped on request" from a failure.
"""

from __future__ import annotations

import signal

from hpcscale.errors import STOPPED_EXIT_CODE

__all__ = ["STOPPED_EXIT_CODE", "STOP_SIGNALS", "StopFlag", "StopRequested"]
STOP_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM)


class StopRequested(Exception):
    """Raised by entry points (or the trainer) to end a run cleanly after a stop request."""


class StopFlag:
    def __init__(self) -> None:
        self.signal: int | None = None

    @property
    def requested(self) -> bool:
        """Whether this rank received a stop signal (use Context.should_stop() to agree across ranks)."""
        return self.signal is not None

    def install(self) -> None:
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, signum, _frame) -> None:
        self.signal = signum
