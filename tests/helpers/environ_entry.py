"""A user entry point (`train.entry: environ_entry:main`) that reports what its rank's allocator was given:
a small model placed by ctx.parallelize (sharded at the job's parallel.dp_shard) trains `steps` AdamW steps,
then each rank writes RUN/environ.RANK: its MALLOC_MMAP_THRESHOLD_ and whether glibc's malloc served a 1 MiB
block from its heap right after a 4 MiB block was freed (it does when the mmap threshold is glibc's dynamic one,
raised by that free, or fixed above 1 MiB; a threshold fixed at 1 MiB maps it: the block goes back when freed);
and how Python's cyclic garbage collector came to the entry point (on, with the rank's start-up imports frozen)
and whether torch._dynamo was imported once the first optimizer was built.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import sys

import torch
from torch import nn


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in [
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        ]
    ]


def heap_serves_one_mib_after_a_free() -> bool:
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    libc.mallinfo2.restype = _Mallinfo2
    big = libc.malloc(4 << 20)  # over any threshold in play: mapped; freeing it raises a dynamic threshold
    libc.free(big)
    mapped = libc.mallinfo2().hblks
    block = libc.malloc(1 << 20)
    from_heap = libc.mallinfo2().hblks == mapped
    libc.free(block)
    return from_heap


def main(ctx):
    collector = {"enabled": gc.isenabled(), "frozen": gc.get_freeze_count()}
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])
    model = ctx.parallelize(model, blocks=list(model))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    collector["dynamo_after_optimizer"] = "torch._dynamo" in sys.modules
    g = torch.Generator().manual_seed(ctx.rank)
    for _ in range(int(ctx.params.get("steps", 2))):
        opt.zero_grad()
        model(torch.randn(8, 64, generator=g)).square().mean().backward()
        opt.step()
    report = {
        "MALLOC_MMAP_THRESHOLD_": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
        "heap_serves_1mib": heap_serves_one_mib_after_a_free(),
        "dp_shard": ctx.dims.dp_shard,
        "collector": collector,
    }
    (ctx.run_dir / f"environ.{ctx.rank}").write_text(json.dumps(report))
