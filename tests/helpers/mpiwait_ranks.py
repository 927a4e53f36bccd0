"""Ranks for tests/recovery/test_mpiwait.py: MPI rank 0 sleeps WAIT_S seconds before each collective (as a rank
still importing torch would), the others wait in it; each rank prints, as JSON, the CPU seconds its waits took:
MPI's own blocking bcast, hpcscale.launch.mpiwait's bcast, allgather, gather, allreduce, and an arrive that times
out (False) while rank 0 sleeps."""

import json
import sys
import time

import numpy as np
from mpi4py import MPI

from hpcscale.launch import mpiwait

WAIT_S = float(sys.argv[1])
comm = MPI.COMM_WORLD


def waited(call):
    if comm.rank == 0:
        time.sleep(WAIT_S)
    start = time.process_time()
    result = call()
    return time.process_time() - start, result


cpu = {}
cpu["mpi_bcast"], _ = waited(lambda: comm.bcast("x" if comm.rank == 0 else None, root=0))
cpu["bcast"], got = waited(lambda: mpiwait.bcast("x" if comm.rank == 0 else None, root=0))
assert got == "x", got
cpu["allgather"], got = waited(lambda: mpiwait.allgather(comm.rank))
assert got == list(range(comm.size)), got
cpu["gather"], got = waited(lambda: mpiwait.gather(comm.rank, root=comm.size - 1))
assert got == (list(range(comm.size)) if comm.rank == comm.size - 1 else None), got
out = np.zeros(1)
cpu["allreduce"], _ = waited(lambda: mpiwait.allreduce(np.array([comm.rank + 1.0]), out, MPI.MAX))
assert out[0] == comm.size, out
timed_out = None if comm.rank == 0 else mpiwait.arrive(timeout_s=WAIT_S / 4)  # rank 0 still asleep
if comm.rank == 0:
    time.sleep(WAIT_S / 2)
    mpiwait.arrive()  # the barrier the others gave up on (theirs completes in the background)
mpiwait.arrive()  # and one more, every rank: nothing was left out of step
print(json.dumps({"rank": comm.rank, "cpu": cpu, "timed_out": timed_out}), flush=True)
