#!/usr/bin/env python3
"""Layered checkpoints: the node-local tier against the shared tier, side by side in one run, same machine.

4 ranks (mpirun, gloo) on two emulated nodes (ranks 0-1 on n0, 2-3 on n1, each node a directory of its own,
each node the other's partner), each rank holding 16 tensors of 3.2 MiB as FSDP2 places them (Shard(0) over
dp_shard 4): 51 MiB a rank, 205 MiB in all. Five repetitions, alternating which tier goes first:
  save      the loop's blocking time for a node-local save (its data file written, the index on both nodes,
            the data copied to the partner node) against a shared-tier save of the same state: synchronous,
            and asynchronous (what the loop waits for: the copy to host buffers)
  drain     an idle-CPU loop (30 steps of 0.1 s that wait as a rank waits on its GPU, then a barrier) with a
            drain of a node-local step to the shared tier started at step 1, against the same loop with no
            checkpoint, and against it with an asynchronous shared save from memory instead; target: <= 5%
  recovery  node n1 lost (its directory deleted), then: a restarted job's load from the node-local tier (n0's
            own files, n1's part from n0's partner copy, sent over the process group) against a load of the
            same step from the shared tier; page cache dropped before each; the bytes each read from the shared
            tier (the node-local load runs with the shared directory renamed away: it cannot read a byte of it)

Both tiers sit on this machine's one disk, so the measured times compare the protocols, not the storage. The
shared filesystem at scale is what is slow: the recovery figures are also given with the shared tier's read
modelled at a per-node share of 1 GB/s and of 100 MB/s (the measured time, less its bytes at this disk's cold
raw-read speed, plus its bytes at that bandwidth), and a synchronous shared save as its write alone at those
bandwidths (a node's bytes over the bandwidth: no hashing, no commit, so a floor), from the bytes measured here.

    python scripts/bench/tiers.py [--dir /var/tmp/hpcscale-bench-tiers] [--json]     (root: drops the cache)
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

RANKS, TENSORS, ROWS, COLS = 4, 16, 800, 1024
REPS = 5
IDLE_STEP_S, IDLE_STEPS = 0.1, 30
DRAIN_TARGET = 0.05
MODEL_BW = {"1 GB/s": 1e9, "100 MB/s": 1e8}


def worker(base: Path) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard

    from hpcscale.ckpt import nodelocal
    from hpcscale.ckpt.manager import CheckpointManager
    from hpcscale.layout import ParallelDims

    rank, mesh, local, state, per_rank = sharded_rank_state(RANKS, TENSORS, ROWS, COLS, "dp_shard")
    dims = ParallelDims(pp=1, dp=RANKS, tp=1, dp_shard=RANKS)
    nodes = [f"n{r // 2}" for r in range(RANKS)]
    layout = nodelocal.build(nodes, 1, {}, [], "other")
    node_dir = base / "nodes" / nodes[rank]
    shared_dir = base / "shared"

    def timed(fn) -> float:
        dist.barrier()
        t = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - t

    shared = CheckpointManager(shared_dir, dims=dims, rank=rank, keep_last=100)
    tier = CheckpointManager(node_dir, dims=dims, rank=rank, keep_last=2, node_local=layout)
    step = 1
    for m in (shared, tier):  # one-time set-up (buffers, threads) is in no figure
        m.save(step, state, {"step": step}, asynchronous=True)
        m.wait()

    def change() -> None:
        for t in local:
            t.add_(1.0)  # every tensor changed: a full save on either tier

    # ---- save: blocking time -------------------------------------------------------------------------------
    res: dict[str, list[float]] = {k: [] for k in ("local_sync", "shared_sync", "local_async", "shared_async")}
    for rep in range(REPS):
        for asynchronous in (False, True):
            kind = "async" if asynchronous else "sync"
            order = [(tier, "local"), (shared, "shared")]
            for m, name in order if rep % 2 == 0 else order[::-1]:
                change()
                step += 1
                res[f"{name}_{kind}"].append(
                    timed(lambda m=m, n=step, a=asynchronous: m.save(n, state, {"step": n}, asynchronous=a))
                )
                m.wait()

    # ---- drain: the loop's extra time while a drain runs ------------------------------------------------------
    def idle_loop(start=None) -> None:
        for s in range(IDLE_STEPS):
            time.sleep(IDLE_STEP_S)  # forward and backward on the device
            if s == 1 and start is not None:
                start()
            dist.barrier()

    loop_plain, loop_drain, loop_async = [], [], []
    for rep in range(REPS):
        change()
        step += 1
        tier.save(step, state, {"step": step}, asynchronous=False)  # the node-local step the drain reads
        n = step
        runs = [
            lambda n=n: loop_drain.append(
                timed(lambda: (idle_loop(lambda: shared.drain(tier.root, n)), shared.wait()))
            ),
            lambda n=n: loop_async.append(
                timed(lambda: (idle_loop(lambda: shared.save(n + 1, state, {}, asynchronous=True)), shared.wait()))
            ),
        ]  # in this order: the shared tier's steps only grow
        plain = lambda: loop_plain.append(timed(idle_loop))  # noqa: E731
        for run in [plain, *runs] if rep % 2 == 0 else [*runs, plain]:
            run()
        step += 1  # the async save's
    drain_stats = shared.last_stats

    # ---- recovery after losing n1 ----------------------------------------------------------------------------
    change()
    step += 1
    newest = step
    tier.save(newest, state, {"step": newest}, asynchronous=False)
    shared.save(newest, state, {"step": newest}, asynchronous=False)
    saved = [t.clone() for t in local]
    fresh = {k: DTensor.from_local(torch.empty(ROWS, COLS), mesh, [Shard(0)], run_check=False) for k in state}
    hidden = base / "shared-hidden"

    def lose_n1() -> None:
        dist.barrier()
        if rank == 2:  # n1's first rank: the node and everything on it is gone
            shutil.rmtree(node_dir, ignore_errors=True)
            node_dir.mkdir(parents=True)
        if rank == 0:
            drop_caches()
        dist.barrier()

    def recover_local() -> None:
        if rank == 0:
            shared_dir.rename(hidden)
        dist.barrier()
        try:
            r = tier.load_node_local(fresh, at_least=None)
            assert r is not None and r.step == newest, r
        finally:
            dist.barrier()
            if rank == 0:
                hidden.rename(shared_dir)

    def recover_shared() -> None:
        r = shared.load_latest(fresh, check_rng=False)
        assert r is not None and r.step == newest, r

    def raw_read() -> None:
        own = shared_dir / f"step-{newest:08d}" / "data" / f"rank-{rank:05d}.bin"
        fd = os.open(own, os.O_RDONLY)
        while os.read(fd, 16 << 20):
            pass
        os.close(fd)

    rec_local, rec_shared, raw_s, moved, dropped = [], [], [], [], True

    def cold(fn) -> float:
        nonlocal dropped
        dist.barrier()
        dropped = (drop_caches() if rank == 0 else True) and dropped
        return timed(fn)

    for rep in range(REPS):
        runs = [
            lambda: (lose_n1(), rec_local.append(timed(recover_local)), moved.append(list(tier.moved))),
            lambda: rec_shared.append(cold(recover_shared)),
            lambda: raw_s.append(cold(raw_read)),
        ]
        for run in runs if rep % 2 == 0 else runs[::-1]:
            run()
    ok = torch.tensor([float(all(torch.equal(fresh[k].to_local(), s) for k, s in zip(state, saved, strict=True)))])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    for m in (shared, tier):
        m.close()
    if rank == 0:
        doc = {
            "bytes_total": per_rank * RANKS,
            "bytes_per_node": per_rank * 2,
            **res,
            "loop_plain_s": loop_plain,
            "loop_drain_s": loop_drain,
            "loop_async_shared_s": loop_async,
            "drain_new_bytes_rank0": drain_stats.new_bytes if drain_stats else None,
            "recover_local_s": rec_local,
            "recover_shared_s": rec_shared,
            "raw_read_s": raw_s,
            "moved_files_bytes": moved,
            "loaded_correctly": bool(ok.item() == 1.0),
            "cache_dropped": dropped,
        }
        print("RESULT " + json.dumps(doc), flush=True)
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=Path("/var/tmp/hpcscale-bench-tiers"))
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker(a.dir)
        return 0
    r = worker_result(__file__, RANKS, a.dir, timeout=3000)
    med = statistics.median
    per_node = r["bytes_per_node"]
    disk_bw = per_node / 2 / med(r["raw_read_s"])  # a rank's bytes over its cold raw read
    shared_io = per_node / 2 / disk_bw  # the shared load's read at this disk's speed (each rank its own file)
    modelled = {name: [s - shared_io + per_node / bw for s in r["recover_shared_s"]] for name, bw in MODEL_BW.items()}
    doc = {
        "mib": r["bytes_total"] / 2**20,
        "ranks": RANKS,
        "nodes": 2,
        "reps": REPS,
        "measured": r,
        "local_vs_shared_blocking_sync_each": [
            round(s / lo, 3) for lo, s in zip(r["local_sync"], r["shared_sync"], strict=True)
        ],
        "local_vs_shared_blocking_async_each": [
            round(s / lo, 3) for lo, s in zip(r["local_async"], r["shared_async"], strict=True)
        ],
        "drain_extra_each": [round((d - p) / p, 4) for d, p in zip(r["loop_drain_s"], r["loop_plain_s"], strict=True)],
        "async_shared_extra_each": [
            round((d - p) / p, 4) for d, p in zip(r["loop_async_shared_s"], r["loop_plain_s"], strict=True)
        ],
        "recovery_shared_over_local_each": [
            round(s / lo, 3) for lo, s in zip(r["recover_local_s"], r["recover_shared_s"], strict=True)
        ],
        "recovery_shared_over_local_modelled": {
            name: [round(s / lo, 2) for lo, s in zip(r["recover_local_s"], xs, strict=True)]
            for name, xs in modelled.items()
        },
        "shared_bytes_read": {"node-local recovery": 0, "shared recovery": r["bytes_total"]},
        # a shared save's write alone at that bandwidth (no hashing, no commit: a floor) over the measured
        # node-local synchronous save
        "sync_save_shared_over_local_modelled": {
            name: [round(per_node / bw / lo, 2) for lo in r["local_sync"]] for name, bw in MODEL_BW.items()
        },
    }
    doc["drain_met"] = sum(x <= DRAIN_TARGET for x in doc["drain_extra_each"])
    if a.json:
        print(json.dumps(doc, indent=2))
        return 0
    print(
        f"{doc['mib']:.0f} MiB over {RANKS} ranks on 2 emulated nodes; page cache dropped: {r['cache_dropped']}; "
        f"recovered correctly: {r['loaded_correctly']}"
    )
    print(f"  {'rep':>3} {'local sync':>10} {'shared sync':>11} {'local async':>11} {'shared async':>12}")
    for i in range(REPS):
        print(
            f"  {i + 1:3d} {r['local_sync'][i]:10.3f} {r['shared_sync'][i]:11.3f} {r['local_async'][i]:11.3f} "
            f"{r['shared_async'][i]:12.3f}"
        )
    print(
        f"  blocking, shared / node-local: sync median {med(doc['local_vs_shared_blocking_sync_each']):.2f}, "
        f"async median {med(doc['local_vs_shared_blocking_async_each']):.2f}"
    )
    for name, xs in doc["sync_save_shared_over_local_modelled"].items():
        print(f"  modelled, a sync shared save's write alone at {name} a node: shared / node-local {med(xs):.2f}")
    print(
        f"  idle loop {med(r['loop_plain_s']):.2f} s; with a drain: +{100 * med(doc['drain_extra_each']):.1f}% "
        f"(<= {100 * DRAIN_TARGET:.0f}% in {doc['drain_met']} of {REPS}; each "
        f"{', '.join(f'{100 * x:.1f}%' for x in doc['drain_extra_each'])}); with an async shared save from "
        f"memory instead: +{100 * med(doc['async_shared_extra_each']):.1f}%"
    )
    print(
        f"  recovery after losing n1: node-local {med(r['recover_local_s']):.2f} s (moved "
        f"{r['moved_files_bytes'][-1][1] / 2**20:.0f} MiB between nodes, 0 bytes from the shared tier), shared "
        f"{med(r['recover_shared_s']):.2f} s ({r['bytes_total'] / 2**20:.0f} MiB from the shared tier): "
        f"shared / node-local {med(doc['recovery_shared_over_local_each']):.2f}"
    )
    for name, xs in doc["recovery_shared_over_local_modelled"].items():
        print(f"  modelled, shared tier at {name} a node: shared / node-local {med(xs):.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
