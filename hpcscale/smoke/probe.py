"""The smoke test's entry points (`train.entry: hpcscale.smoke.probe:<name>`), run by `hpcscale launch` like a
user's: what each rank sees of its device and binding, a timed all-reduce, and a forced collective timeout.

Each rank writes RUN/smoke/rank-NNNNN.json; the front end (hpcscale.smoke.checks) reads them. Clocks are read
only after `settle` (hpcscale.parallel.device): on a GPU a collective returns once queued.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from hpcscale.util.trust import private_dir

SMOKE_DIR = "smoke"


def cpu_list(text: str) -> list[int]:
    """A kernel CPU list ("0-3,8,10-11") as numbers."""
    out: list[int] = []
    for part in text.strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def _cpu_numa_nodes(cpus: list[int]) -> list[int]:
    """The NUMA nodes the given CPUs belong to (Linux sysfs; empty where it cannot say)."""
    found = set()
    root = Path("/sys/devices/system/node")
    for node in sorted(root.glob("node[0-9]*")) if root.is_dir() else []:
        try:
            listed = set(cpu_list((node / "cpulist").read_text()))
        except (OSError, ValueError):
            continue
        if listed & set(cpus):
            found.add(int(node.name[4:]))
    return sorted(found)


def _gpu(index: int) -> dict:
    """Name, UUID, PCI address and NUMA node of GPU `index` as this process numbers it."""
    import torch

    props = torch.cuda.get_device_properties(index)
    out = {"index": index, "name": props.name, "uuid": str(getattr(props, "uuid", "")), "numa_node": None}
    bus = getattr(props, "pci_bus_id", None)
    if bus is not None:
        domain, device = getattr(props, "pci_domain_id", 0), getattr(props, "pci_device_id", 0)
        pci = f"{domain:04x}:{bus:02x}:{device:02x}.0"
        out["pci"] = pci
        try:
            numa = int(Path(f"/sys/bus/pci/devices/{pci}/numa_node").read_text())
            out["numa_node"] = numa if numa >= 0 else None
        except (OSError, ValueError):
            pass
    return out


def _allreduce(ctx, megabytes: float, iterations: int) -> dict:
    """Sum a float32 buffer of `megabytes` over every rank: checked, then timed (bus bandwidth as nccl-tests
    defines it: algorithm bandwidth x 2(n-1)/n)."""
    import torch
    import torch.distributed as dist

    from hpcscale.parallel.device import settle

    n = max(1, int(megabytes * 2**20) // 4)
    x = torch.full((n,), float(ctx.rank + 1), device=ctx.device)
    dist.all_reduce(x)
    want = ctx.world_size * (ctx.world_size + 1) / 2
    correct = bool(torch.all(x == want).item())
    dist.all_reduce(x)  # warm-up
    settle(ctx.device)
    dist.barrier()
    times = []
    for _ in range(iterations):
        settle(ctx.device)
        t0 = time.perf_counter()
        dist.all_reduce(x)
        settle(ctx.device)
        times.append(time.perf_counter() - t0)
    best = min(times)
    algbw = n * 4 / best / 1e9
    w = ctx.world_size
    return {
        "bytes": n * 4,
        "correct": correct,
        "seconds": best,
        "algbw_gbps": algbw,
        "busbw_gbps": algbw * 2 * (w - 1) / w if w > 1 else algbw,
    }


def devices(ctx) -> None:
    """What this rank runs on and how it is bound, and an all-reduce over every rank."""
    import torch

    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    gpu = _gpu(ctx.device.index if ctx.device.index is not None else 0) if ctx.device.type == "cuda" else None
    default_mb = 256.0 if ctx.device.type == "cuda" else 16.0
    report = {
        "rank": ctx.rank,
        "local_rank": ctx.local_rank,
        "node": ctx.node,
        "device": str(ctx.device),
        "backend": ctx.backend,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if ctx.backend == "nccl" else None,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "cpus": cpus,
        "cpu_numa_nodes": _cpu_numa_nodes(cpus),
        "gpu": gpu,
        "allreduce": _allreduce(
            ctx, float(ctx.params.get("allreduce_mb", default_mb)), int(ctx.params.get("iterations", 5))
        ),
    }
    out = ctx.run_dir / SMOKE_DIR
    # every rank at once; the reports judged later come only from a directory no one else could write into
    private_dir(out, below=ctx.run_dir, mode=0o755, what="smoke test's report directory")
    (out / f"rank-{ctx.rank:05d}.json").write_text(json.dumps(report, indent=1))


def stall(ctx) -> None:
    """The last rank never joins the all-reduce the others start: on NCCL their watchdog gives up after the
    job's timeout_seconds and aborts them (SIGABRT), as a rank stuck in other work or a broken link would make
    it. What `resume` then says is the check."""
    import torch
    import torch.distributed as dist

    if ctx.rank == ctx.world_size - 1:
        time.sleep(float(ctx.job.timeout_seconds) * 4 + 60)  # ended by srun or mpirun once the others abort
        return
    x = torch.ones(1024, device=ctx.device)
    dist.all_reduce(x)
    x.sum().item()  # waits for the collective on a GPU too
