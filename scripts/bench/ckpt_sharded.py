#!/usr/bin/env python3
"""Checkpoints of a fully sharded (FSDP2-layout) 1 GiB state against raw I/O of the same bytes, in one run.

8 ranks (mpirun, gloo), each holding 40 tensors of 3.2 MiB as DTensor shards over the job's `dp_shard` mesh
dimension (Shard(0), as fully_shard places them) under a dp_shard = 8 layout: 128 MiB per rank, 1 GiB in all.
Every rank writes only its own shard. Five repetitions, each side by side:
  save   a full save (every tensor changed since the last, so every chunk is new) vs a raw O_DIRECT write +
         fsync of the same bytes from page-aligned memory, new files in a new directory; target >= 0.9
  load   a verified load into the same layout (each rank reads only its own shard, hashes checked) vs a raw
         sequential read of that rank's bytes, page cache dropped before each; target >= 0.8 in >= 4 of 5

    python scripts/bench/ckpt_sharded.py [--dir /var/tmp/hpcscale-bench-sharded] [--json]     (root: drops the cache)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

from _workers import sharded_rank_state, worker_result
from ckpt import drop_caches

RANKS, TENSORS, ROWS, COLS = 8, 40, 800, 1024
REPS = 5
SAVE_TARGET, LOAD_TARGET = 0.9, 0.8


def worker(base: Path) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard

    from hpcscale.ckpt.manager import CheckpointManager
    from hpcscale.ckpt.writer import aligned_empty
    from hpcscale.layout import ParallelDims

    rank, mesh, local, state, per_rank = sharded_rank_state(RANKS, TENSORS, ROWS, COLS, "dp_shard")
    dims = ParallelDims(pp=1, dp=RANKS, tp=1, dp_shard=RANKS)

    def timed(fn) -> float:
        dist.barrier()
        if rank == 0:
            os.sync()
        dist.barrier()
        t = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - t

    def barrier_drop() -> bool:
        dist.barrier()
        dropped = drop_caches() if rank == 0 else True
        dist.barrier()
        return dropped

    raw = base / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    aligned = [aligned_empty(t.shape, t.dtype) for t in local]

    def raw_write(rep: int) -> None:
        (raw / f"rep{rep}").mkdir(exist_ok=True)
        fd = os.open(raw / f"rep{rep}" / f"rank{rank}.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
        for t in aligned:
            os.write(fd, memoryview(t.view(torch.uint8).numpy()))
        os.fsync(fd)
        os.close(fd)

    manager = CheckpointManager(base / "ckpt", dims=dims, rank=rank, keep_last=100)  # no deletes in a save
    manager.save(1, state, {"step": 1}, asynchronous=False)  # the manager's one-time set-up is in no figure
    save_s, direct_s = [], []
    for rep in range(REPS):
        for t, a in zip(local, aligned, strict=True):
            t.add_(1.0)  # every tensor changed: a full save
            a.copy_(t)
        runs = [
            lambda rep=rep: direct_s.append(timed(lambda: raw_write(rep))),
            lambda rep=rep: save_s.append(
                timed(lambda: manager.save(rep + 2, state, {"step": rep + 2}, asynchronous=False))
            ),
        ]
        for run in runs if rep % 2 == 0 else runs[::-1]:
            run()
        if rank == 0:
            shutil.rmtree(raw / f"rep{rep}", ignore_errors=True)
    saved = [t.clone() for t in local]
    newest = REPS + 1
    own = base / "ckpt" / f"step-{newest:08d}" / "data" / f"rank-{rank:05d}.bin"

    def raw_read() -> None:
        fd = os.open(own, os.O_RDONLY)
        while os.read(fd, 16 << 20):
            pass
        os.close(fd)

    read_s, load_s, dropped = [], [], True
    fresh = {
        k: DTensor.from_local(torch.empty(ROWS, COLS), mesh, [Shard(0)], run_check=False) for k in state
    }  # what a restarted job loads into
    loader = CheckpointManager(base / "ckpt", dims=dims, rank=rank, keep_last=100)
    for rep in range(REPS):
        runs = [
            lambda: read_s.append(timed(raw_read)),
            lambda: load_s.append(timed(lambda: loader.load_latest(fresh, check_rng=False))),
        ]
        for run in runs if rep % 2 == 0 else runs[::-1]:
            dropped = barrier_drop() and dropped
            run()
    ok = torch.tensor([float(all(torch.equal(fresh[k].to_local(), s) for k, s in zip(state, saved, strict=True)))])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if rank == 0:
        doc = {
            "bytes_total": per_rank * RANKS,
            "save_s": save_s,
            "raw_direct_write_s": direct_s,
            "load_s": load_s,
            "raw_read_s": read_s,
            "loaded_correctly": bool(ok.item() == 1.0),
            "cache_dropped": dropped,
        }
        print("RESULT " + json.dumps(doc), flush=True)
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=Path("/var/tmp/hpcscale-bench-sharded"))
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker(a.dir)
        return 0
    r = worker_result(__file__, RANKS, a.dir, timeout=3000)
    save = [w / s for w, s in zip(r["raw_direct_write_s"], r["save_s"], strict=True)]  # speed ratios
    load = [rd / ld for rd, ld in zip(r["raw_read_s"], r["load_s"], strict=True)]
    doc = {
        "gib": r["bytes_total"] / 2**30,
        "ranks": RANKS,
        "measured": r,
        "save_vs_raw_direct_write_each": [round(x, 3) for x in save],
        "load_vs_cold_raw_read_each": [round(x, 3) for x in load],
        "save_met": sum(x >= SAVE_TARGET for x in save),
        "load_met": sum(x >= LOAD_TARGET for x in load),
        "reps": REPS,
    }
    if a.json:
        print(json.dumps(doc, indent=2))
        return 0
    print(
        f"{doc['gib']:.2f} GiB sharded over {RANKS} ranks (dp_shard {RANKS}); page cache dropped before reads: "
        f"{r['cache_dropped']}; loaded correctly: {r['loaded_correctly']}"
    )
    print(f"  {'rep':>3} {'save s':>7} {'O_DIRECT s':>10} {'ratio':>6}   {'load s':>7} {'raw read s':>10} {'ratio':>6}")
    for i in range(REPS):
        print(
            f"  {i + 1:3d} {r['save_s'][i]:7.2f} {r['raw_direct_write_s'][i]:10.2f} {save[i]:6.3f}   "
            f"{r['load_s'][i]:7.2f} {r['raw_read_s'][i]:10.2f} {load[i]:6.3f}"
        )
    print(
        f"  save vs raw O_DIRECT write: median {statistics.median(save):.3f}, >= {SAVE_TARGET} in {doc['save_met']} "
        f"of {REPS}; verified load vs cold raw read: median {statistics.median(load):.3f}, >= {LOAD_TARGET} in "
        f"{doc['load_met']} of {REPS}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
