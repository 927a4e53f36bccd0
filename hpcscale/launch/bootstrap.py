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
4. The rank's device (choose_gpu): GPU `local rank` when the node's ranks each see every GPU, GPU 0 when
   each sees only its own (srun --gpus-per-task / --gpu-bind), an error when ranks would share one; then the
   GPUs' UUIDs are compared across each node's ranks, so two ranks on one GPU are named before NCCL refuses
   them ("Duplicate GPU detected"). A job that requested GPUs and whose ranks see none fails here instead of
   training on the CPU (job key `device`).
5. torch.distributed starts with nccl on the GPU, gloo on the CPU, with the job's timeout, so a dead peer
   fails the job instead of hanging it until the time limit. NCCL gets `device_id`: the communicator is made
   at once (a broken fabric fails here, not at the first step) and the mesh's groups are split from it.
   RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT are exported as torchrun
   exports them, for user code and libraries that read them; GLOO_SOCKET_IFNAME follows NCCL_SOCKET_IFNAME
   when only that is set and it names interfaces present here (gloo_interfaces), so the checkpoint's gloo
   group uses the interface the site chose for NCCL rather than whatever the hostname resolves to.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from hpcscale.errors import RuntimeFailure
from hpcscale.launch import mpiwait


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
    device: Any = None  # torch.device: cuda:N or cpu
    # the MPI rank of global rank 0: placement renumbers the ranks, so MPI's rank 0 may be another global rank;
    # every MPI gather whose root must be global rank 0 (the one that writes the run's lines) roots here
    root_mpi: int = 0


class DeviceChoiceError(RuntimeFailure):
    pass


def choose_gpu(*, local_rank: int, local_size: int, visible: int, node: str) -> int | None:
    """Which of the GPUs this process sees it trains on (None: it sees none).

    Every rank of the node sees all GPUs: its local rank. Each sees exactly one (Slurm bound one GPU per task,
    CUDA_VISIBLE_DEVICES differs per rank): that one. Otherwise ranks would share a GPU: refused, naming the
    fix, because NCCL refuses two ranks on one GPU and would fail later with less to go on."""
    if visible <= 0:
        return None
    if visible >= local_size:
        return local_rank
    if visible == 1:
        return 0
    raise DeviceChoiceError(
        f"node {node} runs {local_size} ranks but each sees {visible} GPUs: ranks would share a GPU (NCCL "
        "refuses that: 'Duplicate GPU detected'). Run one rank per GPU (tasks_per_node = gpus_per_node), or bind "
        "one GPU to each task (srun --gpus-per-task=1)"
    )


def duplicate_gpus(seen: list[tuple[str, int, str]]) -> str | None:
    """seen: (node, rank, GPU UUID) of every rank. The first GPU two ranks of one node share, described."""
    owner: dict[tuple[str, str], int] = {}
    for node, rank, uuid in seen:
        if not uuid:
            continue
        other = owner.setdefault((node, uuid), rank)
        if other != rank:
            return (
                f"ranks {other} and {rank} on node {node} both use GPU {uuid}: NCCL refuses two ranks on one GPU. "
                "Check CUDA_VISIBLE_DEVICES and the GPU binding (srun --gpus-per-task / --gpu-bind)"
            )
    return None


def mixed_devices(seen: list[tuple[str, int, str]]) -> str | None:
    """seen: (node, rank, GPU UUID or "" on the CPU). Some ranks on GPUs and some not, described: NCCL and gloo
    ranks cannot form one process group (a hang or an obscure error later)."""
    cpu = sorted((rank, node) for node, rank, uuid in seen if not uuid)
    if not cpu or len(cpu) == len(seen):
        return None
    shown = ", ".join(f"{rank} ({node})" for rank, node in cpu[:8]) + (" ..." if len(cpu) > 8 else "")
    return (
        f"{len(seen) - len(cpu)} rank(s) found a GPU and {len(cpu)} did not: rank(s) {shown} see none. Every rank "
        "must train on the same kind of device: give every node GPUs (gpus_per_node), or set device: cpu"
    )


def export_rank_environment(*, rank: int, world_size: int, local_rank: int, local_size: int, addr: str, port: int):
    """The variables torchrun sets, for user code and libraries that read them (Hugging Face, Lightning)."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(local_rank),
        LOCAL_WORLD_SIZE=str(local_size),
        MASTER_ADDR=addr,
        MASTER_PORT=str(port),
    )
    gloo = gloo_interfaces(os.environ.get("NCCL_SOCKET_IFNAME", ""), _interfaces())
    if gloo and "GLOO_SOCKET_IFNAME" not in os.environ:
        os.environ["GLOO_SOCKET_IFNAME"] = gloo


def _interfaces() -> set[str]:
    try:
        return {name for _, name in socket.if_nameindex()}
    except OSError:
        return set()


def gloo_interfaces(nccl_ifname: str, present: set[str]) -> str | None:
    """NCCL_SOCKET_IFNAME as gloo can take it, or None. NCCL reads prefixes (`ib`), exclusions (`^lo,docker`)
    and exact matches (`=eth0`); gloo wants exact names of interfaces that exist (it fails at start-up with
    "Unable to find address for: ^lo" otherwise). Only a plain list of names present here is passed on."""
    names = [n.strip().removeprefix("=") for n in nccl_ifname.split(",") if n.strip()]
    if not names or nccl_ifname.lstrip().startswith("^") or any(n not in present for n in names):
        return None
    return ",".join(names)


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


def bootstrap(
    *, timeout_s: float, order_nodes: Callable[[list[str]], list[str]], device: str = "auto", gpus_requested: int = 0
) -> RankInfo:
    """Start torch.distributed over MPI. `order_nodes(nodes)` returns the allocation's nodes in placement order
    (called on MPI rank 0 only). `device` and `gpus_requested` are the job's `device` and `gpus_per_node`."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    me = (node_name(), socket.gethostname())
    everyone = mpiwait.allgather(me)
    nodes_seen = list(dict.fromkeys(n for n, _ in everyone))
    per_node = {n: sum(1 for m, _ in everyone if m == n) for n in nodes_seen}
    if len(set(per_node.values())) != 1:
        raise RuntimeFailure(f"ranks per node differ ({per_node}); hpcscale needs the same number on every node")
    tasks_per_node = next(iter(per_node.values()))
    local_rank = sum(1 for n, _ in everyone[: comm.rank] if n == me[0])
    order = mpiwait.bcast(order_nodes(nodes_seen) if comm.rank == 0 else None, root=0)
    if sorted(order) != sorted(nodes_seen):
        raise RuntimeFailure(f"placement returned {order} for nodes {nodes_seen}")
    rank = order.index(me[0]) * tasks_per_node + local_rank
    ranks = mpiwait.allgather(rank)
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
    addr, port = mpiwait.bcast(endpoint, root=master_mpi)  # the others waited for its torch import
    if store is None:
        store = dist.TCPStore(addr, port, comm.size, is_master=False, timeout=timedelta(seconds=timeout_s))

    export_rank_environment(
        rank=rank, world_size=comm.size, local_rank=local_rank, local_size=tasks_per_node, addr=addr, port=port
    )
    problem, gpu = None, None
    try:
        gpu = _rank_gpu(device, gpus_requested, local_rank=local_rank, local_size=tasks_per_node, node=me[0])
    except DeviceChoiceError as e:
        problem = str(e)
    # every rank learns of any rank's problem together: one raising alone would leave the others waiting
    seen = mpiwait.allgather((me[0], rank, _gpu_uuid(gpu), problem))
    problem = (
        next((p for *_, p in seen if p), None)
        or mixed_devices([(n, r, u) for n, r, u, _ in seen])
        or duplicate_gpus([(n, r, u) for n, r, u, _ in seen])
    )
    if problem:
        raise DeviceChoiceError(problem)
    if gpu is not None:
        torch.cuda.set_device(gpu)
        where = torch.device("cuda", gpu)
        backend, extra = "nccl", {"device_id": where}
    else:
        where, backend, extra = torch.device("cpu"), "gloo", {}
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=comm.size, timeout=timedelta(seconds=timeout_s), **extra
    )
    return RankInfo(rank, comm.size, local_rank, me[0], comm.rank, order, addr, port, backend, where, master_mpi)


def _rank_gpu(device: str, gpus_requested: int, *, local_rank: int, local_size: int, node: str) -> int | None:
    """The GPU index this rank trains on, or None for the CPU, as the job's `device` says."""
    import torch
    import torch.distributed as dist

    if device == "cpu":
        return None
    visible = torch.cuda.device_count() if torch.cuda.is_available() and dist.is_nccl_available() else 0
    if visible == 0 and (device == "cuda" or gpus_requested > 0):
        asked = "asks for device cuda" if device == "cuda" else f"requests {gpus_requested} GPUs per node"
        visible_env = os.environ.get("CUDA_VISIBLE_DEVICES", "unset")
        raise DeviceChoiceError(
            f"node {node}: the job {asked} but this rank sees none (CUDA_VISIBLE_DEVICES={visible_env}):"
            " it would train on the CPU. Check the allocation's GPUs (srun --gpus-per-node), the CUDA build of torch "
            "(python -c 'import torch; print(torch.version.cuda)'), or set device: cpu"
        )
    return choose_gpu(local_rank=local_rank, local_size=local_size, visible=visible, node=node)


def _gpu_uuid(gpu: int | None) -> str:
    if gpu is None:
        return ""
    import torch

    return str(torch.cuda.get_device_properties(gpu).uuid)
