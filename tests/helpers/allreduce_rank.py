"""One rank of the integration test: mpi4py, then torch.distributed (gloo) bootstrapped over MPI.

Rank 0 binds the rendezvous store and broadcasts its port over MPI, as `hpcscale launch` does; every
rank then all-reduces (rank + 1) with both MPI and gloo and prints one JSON line.
"""

import json
import os
from datetime import timedelta

from mpi4py import MPI

comm = MPI.COMM_WORLD

import torch  # noqa: E402 - after MPI so a broken torch cannot hang the MPI bootstrap
import torch.distributed as dist  # noqa: E402

# Rank 0 binds the rendezvous store on a port the kernel picks, then tells the others over MPI.
store = dist.TCPStore("127.0.0.1", 0, comm.size, is_master=True, wait_for_workers=False) if comm.rank == 0 else None
port = comm.bcast(store.port if store else None, root=0)
if store is None:
    store = dist.TCPStore("127.0.0.1", port, comm.size, is_master=False)  # emulated nodes share this host
dist.init_process_group("gloo", store=store, rank=comm.rank, world_size=comm.size, timeout=timedelta(seconds=60))
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
