"""How a rank's job ends: together after a stop or a finished run (every rank past a bounded barrier, then out
at once, skipping the interpreter's teardown), or at once after a failure or a hang (MPI_Abort, so srun or mpirun
kill every rank)."""

from __future__ import annotations

import os
import sys

from hpcscale.util.pystart import finish

__all__ = [
    "FAILED_ALIKE_GRACE_S",
    "PEER_LOST_GRACE_S",
    "STOP_BARRIER_S",
    "abort_job",
    "exit_together",
    "leave_together",
]

STOP_BARRIER_S = 30.0


def leave_together(timeout_s: float) -> bool:
    """An MPI barrier that gives up after `timeout_s` (polled: MPI's own Barrier cannot time out)."""
    from hpcscale.launch import mpiwait

    return mpiwait.arrive(timeout_s)


def exit_together(code: int) -> None:
    """Every rank is done (past the stop barrier, or the entry returned and the process group is gone): run the
    atexit handlers (a user's too), finalize MPI and exit now, skipping the interpreter's teardown. Torch's
    teardown takes a second or more, unevenly, so skipping it ends the ranks within moments of each other and
    srun's --kill-on-bad-exit finds nothing left to kill; and a gloo thread that outlives the process group and
    reaches for the interpreter while it is being torn down aborts the rank ("terminate called without an
    active exception", SIGABRT after a run that had finished). What the exit does that others see is
    hpcscale.util.pystart.finish's, as for every command."""
    finish(join_threads=False)  # a thread a user left running must not hold this rank back from the others
    os._exit(code)


# a survivor of a lost peer: from its failure line to its MPI_Abort, so srun or mpirun names the peer's death first
PEER_LOST_GRACE_S = 3.0
# any other failed rank of a job of more than one: from its failure line to its MPI_Abort, so ranks failing the
# same way at the same moment (a bad input, the program's own error) write theirs before srun or mpirun ends the
# job: that no node is to blame is read from ranks of two nodes failing alike (launch.failure.shared_failure),
# and on a loaded node a rank that raised with the others was killed before its line
FAILED_ALIKE_GRACE_S = 1.0


def abort_job() -> None:
    """The watchdog's way to end a hung job: MPI_Abort, so srun/mpirun kill every rank, the stuck one too."""
    from mpi4py import MPI

    sys.stdout.flush()
    sys.stderr.flush()
    MPI.COMM_WORLD.Abort(1)
