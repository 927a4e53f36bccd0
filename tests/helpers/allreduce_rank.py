"""One rank of the integration test: mpi4py, then torch.distributed (gloo) bootstrapped over MPI.

Rank 0 picks a free port and broadcasts (address, port) over MPI, the way `hpcscale launch` will; every
rank then all-reduces (rank + 1) with both MPI and gloo and prints one JSON line.
"""

import json
import os
import socket
from datetime import timedelta

from mpi4py import MPI

comm = MPI.COMM_WORLD
if comm.rank == 0:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        endpoint = ("127.0.0.1", s.getsockname()[1])  # emulated nodes share this host
else:
    endpoint = None
addr, port = comm.bcast(endpoint, root=0)

import torch  # noqa: E402 - after MPI so a broken torch cannot hang the MPI bootstrap
import torch.distributed as dist  # noqa: E402

dist.init_process_group(
    "gloo", init_method=f"tcp://{addr}:{port}", rank=comm.rank, world_size=comm.size, timeout=timedelta(seconds=60)
)
t = torch.tensor([float(comm.rank + 1)])
dist.all_reduce(t)
line = {
    "rank": comm.rank,
    "size": comm.size,
    "node": os.environ.get("SLURMD_NODENAME"),
    "gloo_sum": t.item(),
    "mpi_sum": comm.allreduce(comm.rank + 1),
}
# One write per line: print() may split a line into two writes, and ranks' output can then interleave.
os.write(1, (json.dumps(line) + "\n").encode())
dist.destroy_process_group()
