"""Rank bootstrap: mpi4py gives rank, size and node; placement renumbers ranks; torch.distributed starts.

1. MPI (under srun --mpi=pmix or mpirun) gives each process its MPI rank and size; each reports its node
   (SLURMD_NODENAME under Slurm, so emulated nodes count as nodes; the hostname otherwise).
2. MPI rank 0 computes the placement on the real allocation (hpcscale.topology.placement: tp-dp-pp order,
   nodes ordered to keep traffic under low switches) and broadcasts the node order; a process's torch rank is
   (position of its node) × tasks_per_node + its local rank.
3. The process that became torch rank 0 picks the rendezvous address: 127.0.0.1 when every rank is on one
   host, otherwise its own routable address, never a loopback one. It binds torch's TCPStore there on a port
   the kernel chooses, then broadcasts address and port over MPI: jobs sharing nodes never collide, and no
   other process can take the port between choosing and binding it.
4. torch.distributed starts with nccl when CUDA is present (device = local rank), gloo otherwise, with a
   timeout, so a dead peer fails the job instead of hanging it until the time limit.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

from hpcscale.errors import RuntimeFailure


@dataclass(frozen=True, slots=True)
class RankInfo:
    rank: int  # torch.distributed rank (placement order)
    world_size: int
    local_rank: int
    node: str
    mpi_rank: int
    nodes: list[str]  # placement order
    master_addr: str
    master_port: int
    backend: str


def node_name() -> str:
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def routable_address(peer: str | None) -> str:
    """This host's address as other nodes reach it: the interface the kernel would use towards a peer, or the
    hostname's address; never a loopback address."""
    candidates = []
    if peer:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((peer, 9))  # no packet is sent for a UDP connect
                candidates.append(s.getsockname()[0])
        except OSError:
            pass
    with contextlib.suppress(OSError):
        candidates += socket.gethostbyname_ex(socket.getfqdn())[2]
    for addr in candidates:
        if not addr.startswith("127."):
            return addr
    raise RuntimeFailure(
        f"no non-loopback address found for {socket.gethostname()} to rendezvous across nodes; "
        "check the hostname resolves to the high-speed network"
    )


def bootstrap(*, timeout_s: float, order_nodes: Callable[[list[str]], list[str]]) -> RankInfo:
    """Start torch.distributed over MPI. `order_nodes(nodes)` returns the allocation's nodes in placement order
    (called on MPI rank 0 only)."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    me = (node_name(), socket.gethostname())
    everyone = comm.allgather(me)
    nodes_seen = list(dict.fromkeys(n for n, _ in everyone))
    per_node = {n: sum(1 for m, _ in everyone if m == n) for n in nodes_seen}
    if len(set(per_node.values())) != 1:
        raise RuntimeFailure(f"ranks per node differ ({per_node}); hpcscale needs the same number on every node")
    tasks_per_node = next(iter(per_node.values()))
    local_rank = sum(1 for n, _ in everyone[: comm.rank] if n == me[0])
    order = comm.bcast(order_nodes(nodes_seen) if comm.rank == 0 else None, root=0)
    if sorted(order) != sorted(nodes_seen):
        raise RuntimeFailure(f"placement returned {order} for nodes {nodes_seen}")
    rank = order.index(me[0]) * tasks_per_node + local_rank
    ranks = comm.allgather(rank)
    master_mpi = ranks.index(0)
    one_host = len({h for _, h in everyone}) == 1

    import torch
    import torch.distributed as dist

    # The rendezvous store is bound before its port is announced: the kernel picks a free port (port 0) for
    # the listening socket itself, so no other process can take it between "found free" and "bound".
    store = endpoint = None
    if comm.rank == master_mpi:
        peer = next((h for _, h in everyone if h != me[1]), None)
        addr = "127.0.0.1" if one_host else routable_address(peer)
        store = dist.TCPStore(
            addr, 0, comm.size, is_master=True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
        )
        endpoint = (addr, store.port)
    addr, port = comm.bcast(endpoint, root=master_mpi)
    if store is None:
        store = dist.TCPStore(addr, port, comm.size, is_master=False, timeout=timedelta(seconds=timeout_s))

    cuda = torch.cuda.is_available()
    backend = "nccl" if cuda and dist.is_nccl_available() else "gloo"
    if cuda:
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    dist.init_process_group(backend, store=store, rank=rank, world_size=comm.size, timeout=timedelta(seconds=timeout_s))
    return RankInfo(rank, comm.size, local_rank, me[0], comm.rank, order, addr, port, backend)
