"""MPI collectives that wait asleep.

Open MPI's blocking calls poll its progress engine while they wait: a rank in `bcast` or `allgather` for a peer
still importing torch, or for rank 0 preparing a dataset, keeps a core busy all that time (three ranks waiting 5 s
for a fourth took 2.5 to 4.9 s of CPU each here, under srun and mpirun alike; torch's gloo waits sleep). Where
ranks share cores (a CPU partition with more ranks than cores, `run --local` on a workstation) the spinning ranks
take the cores the awaited rank needs, and the start of every job is slower for it. So each MPI collective a rank
may wait in for long goes through here: a nonblocking barrier polled with short sleeps (50 µs, doubling to 5 ms),
then the collective itself, which then finds every rank there and completes at once.
"""

from __future__ import annotations

import time
from typing import Any

__all__ = ["allgather", "allreduce", "arrive", "bcast", "gather"]

POLL_FIRST_S = 50e-6
POLL_MAX_S = 0.005


def arrive(timeout_s: float | None = None) -> bool:
    """Every rank of MPI_COMM_WORLD got here (True), or `timeout_s` passed first (False); asleep meanwhile."""
    from mpi4py import MPI

    req = MPI.COMM_WORLD.Ibarrier()
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    pause = POLL_FIRST_S
    while not req.Test():
        if deadline is not None and time.monotonic() > deadline:
            return False
        time.sleep(pause)
        pause = min(2 * pause, POLL_MAX_S)
    return True


def bcast(obj: Any, root: int) -> Any:
    """MPI_COMM_WORLD.bcast(obj, root), the wait for the root spent asleep."""
    from mpi4py import MPI

    arrive()
    return MPI.COMM_WORLD.bcast(obj, root=root)


def allgather(obj: Any) -> list:
    """MPI_COMM_WORLD.allgather(obj), the wait for the last rank spent asleep."""
    from mpi4py import MPI

    arrive()
    return MPI.COMM_WORLD.allgather(obj)


def gather(obj: Any, root: int) -> list | None:
    """MPI_COMM_WORLD.gather(obj, root): the list at the root, None elsewhere; the wait spent asleep."""
    from mpi4py import MPI

    arrive()
    return MPI.COMM_WORLD.gather(obj, root=root)


def allreduce(send, recv, op) -> None:
    """MPI_COMM_WORLD.Allreduce(send, recv, op) of buffers (numpy arrays), the wait spent asleep."""
    from mpi4py import MPI

    arrive()
    MPI.COMM_WORLD.Allreduce(send, recv, op=op)
