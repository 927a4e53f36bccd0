#!/usr/bin/env python3
"""Checkpoint benchmark: 1 GiB of state over 8 ranks, everything measured side by side in one run, same disk.

Each rank holds 40 tensors of 3.2 MiB as DTensor shards (Shard(0) over an 8-rank mesh): 128 MiB per rank.
  1. full save           vs raw sequential write + fsync of the same bytes (buffered, and with O_DIRECT from
                         page-aligned copies), and torch.distributed.checkpoint
  2. incremental save    every tensor touched (all re-hashed), 10% of them (4 of 40 chunks) really changed
  3. async save          extra wall time of N "training" steps (compute + in-place update of every tensor) with
                         one async save in them, over the same N steps without; against one synchronous save
  3b. async, idle CPU    the same with steps that wait with the CPU idle, as a rank waits on its GPU (40 steps
                         of 0.1 s), median of 9; and the CPU-seconds per GiB of a sync and an async save;
                         beside it the same with the writer thread at nice 19 (checkpoint.background_nice)
  4. load (resharded)    each rank loads a window shifted by half a shard (two saved shards each), verifying
                         hashes, vs a raw sequential read of the same bytes; page cache dropped before each

    python scripts/bench/ckpt.py [--dir /var/tmp/hpcscale-bench] [--json]     (root: drops the page cache)
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

from _workers import worker_result

REPO = Path(__file__).resolve().parents[2]
RANKS, TENSORS, ROWS, COLS = 8, 40, 800, 1024  # 800 x 1024 fp32 = 3.2 MiB per tensor, 128 MiB per rank
IDLE_STEP_S, IDLE_STEPS, IDLE_REPS = 0.1, 40, 9  # 3b: steps waiting on an accelerator; enough to hide a save


def drop_caches() -> bool:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def worker(base: Path) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from hpcscale.ckpt.format import INDEX, read_index
    from hpcscale.ckpt.manager import CheckpointManager
    from hpcscale.ckpt.reader import load_shards
    from hpcscale.ckpt.shards import LocalShard
    from hpcscale.ckpt.writer import aligned_empty
    from hpcscale.launch.bootstrap import bootstrap
    from hpcscale.layout import ParallelDims

    info = bootstrap(timeout_s=600, order_nodes=lambda n: n)
    rank = info.rank
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (RANKS,), mesh_dim_names=("tp",))
    g = torch.Generator().manual_seed(rank)
    local = [torch.randn(ROWS, COLS, generator=g) for _ in range(TENSORS)]
    state = {f"w{i:02d}": DTensor.from_local(t, mesh, [Shard(0)], run_check=False) for i, t in enumerate(local)}
    per_rank = sum(t.numel() * 4 for t in local)
    results: dict = {"bytes_total": per_rank * RANKS}

    def timed(fn) -> float:
        # Start every measurement with no dirty pages left by the previous one: on ext4 (data=ordered) an
        # fsync also pays for other files' unwritten data, which would bill one method for another's writes.
        dist.barrier()
        if rank == 0:
            os.sync()
        dist.barrier()
        t = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - t

    def barrier_drop() -> None:
        dist.barrier()
        if rank == 0:
            results["cache_dropped"] = drop_caches()
        dist.barrier()

    raw = base / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    aligned = [aligned_empty(t.shape, t.dtype).copy_(t) for t in local]  # O_DIRECT needs aligned memory

    def raw_write(rep: int, direct: bool) -> None:
        # new files in a new directory, as every checkpoint does (overwriting old files is a different workload)
        (raw / f"rep{rep}").mkdir(exist_ok=True)
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
        fd = os.open(raw / f"rep{rep}" / f"rank{rank}-{direct}.bin", flags, 0o644)
        for t in aligned if direct else local:
            os.write(fd, memoryview(t.view(torch.uint8).numpy()))
        os.fsync(fd)
        os.close(fd)

    dims = ParallelDims(pp=1, dp=1, tp=RANKS)

    def manager(name: str) -> CheckpointManager:
        return CheckpointManager(base / name, dims=dims, rank=rank, keep_last=100)

    # 1. full save: raw buffered, raw O_DIRECT, hpcscale, DCP, five times in rotating order; each one's median
    import torch.distributed.checkpoint as dcp

    saved_w00 = state["w00"].full_tensor().clone()  # what step 1 holds, to check the load against
    raw_s, direct_s, ours_s, dcp_s = [], [], [], []
    # One manager, as in training: every save after the first is a full one because every tensor changed
    # (outside the timing), so every chunk is new; the first save also pays the manager's one-time set-up.
    mf = manager("full")
    all_new = []
    for rep in range(5):
        if rep:
            for t in local:
                t.add_(1.0)
        runs = [
            lambda rep=rep: raw_s.append(timed(lambda: raw_write(rep, False))),
            lambda rep=rep: direct_s.append(timed(lambda: raw_write(rep, True))),
            lambda rep=rep: ours_s.append(timed(lambda: mf.save(rep + 1, state, {}, asynchronous=False))),
            lambda rep=rep: dcp_s.append(timed(lambda: dcp.save(state, checkpoint_id=str(base / f"dcp{rep}")))),
        ]
        for k in range(len(runs)):  # rotate the order: the virtual disk's speed drifts within a repetition
            runs[(rep + k) % len(runs)]()
        all_new.append(mf.last_stats.new_bytes == per_rank)  # a full save: no chunk referenced
        dist.barrier()
        if rank == 0:  # keep the disk from filling
            shutil.rmtree(raw / f"rep{rep}", ignore_errors=True)
            shutil.rmtree(base / f"dcp{rep}", ignore_errors=True)
    results["full"] = {
        "raw_write_fsync_s": statistics.median(raw_s),
        "raw_direct_write_fsync_s": statistics.median(direct_s),
        "hpcscale_s": statistics.median(ours_s),
        "dcp_s": statistics.median(dcp_s),
        "hpcscale_each_s": ours_s,
        "raw_direct_each_s": direct_s,
        "every_save_wrote_every_chunk": all(all_new),
    }

    # 2. incremental: touch every tensor (version counters move: all re-hashed), change 4 of 40
    #    Five pairs in one manager, as in training: a full save (every tensor changed), then an incremental
    #    one; each pair's ratio, and the median pair.
    m = manager("incr")
    m.save(1, state, {}, asynchronous=False)  # the manager's one-time set-up is in neither figure
    fulls, incrs = [], []
    for rep in range(5):
        for t in local:
            t.add_(1.0)
        fulls.append(timed(lambda rep=rep: m.save(10 * rep + 2, state, {}, asynchronous=False)))
        full_new = m.last_stats.new_bytes
        for i, t in enumerate(local):
            t.add_(1.0 if i % 10 == 0 else 0.0)
        incrs.append(timed(lambda rep=rep: m.save(10 * rep + 3, state, {}, asynchronous=False)))
    new = torch.tensor([float(m.last_stats.new_bytes), float(full_new)])
    dist.all_reduce(new)
    results["incremental"] = {
        "full_s": statistics.median(fulls),
        "incremental_s": statistics.median(incrs),
        "ratio_each": [i / f for i, f in zip(incrs, fulls, strict=True)],
        "full_bytes": new[1].item(),
        "incremental_bytes": new[0].item(),
    }

    # 3. async: N training-like steps (compute on activations + in-place update of every tensor)
    x = torch.randn(256, ROWS, generator=g)

    def train_steps(n: int, save_step: int | None, mgr) -> None:
        for s in range(n):
            for t in local:
                y = x @ t  # (256, COLS)
                t.add_(y.mean() * 1e-6)
            if save_step is not None and s == 1:
                mgr.save(save_step, state, {}, asynchronous=True)
            dist.barrier()
        if mgr is not None:
            mgr.wait()

    ma = manager("async")
    ma.save(1, state, {}, asynchronous=False)  # buffers allocated, chunks known: a steady-state save
    # Few steps, many repetitions: the save is done within the loop either way (wait() ends it), and a long
    # loop's own run-to-run noise would swamp a difference of a fraction of a second.
    steps = 4
    base_s, with_s, sync_s, block_s, bg_s = [], [], [], [], []
    for rep in range(7):
        base_s.append(timed(lambda: train_steps(steps, None, None)))
        with_s.append(timed(lambda rep=rep: train_steps(steps, 100 + rep, ma)))
        block_s.append(ma.last_stats.blocking_s)
        bg_s.append(ma.last_stats.background_s)
        for t in local:
            t.add_(1e-3)
        sync_s.append(timed(lambda rep=rep: ma.save(1000 + rep, state, {}, asynchronous=False)))
    results["async"] = {
        "steps": steps,
        "loop_s": statistics.median(base_s),
        "loop_with_async_save_s": statistics.median(with_s),
        "sync_save_s": statistics.median(sync_s),
        "async_call_blocking_s": statistics.median(block_s),
        "async_background_s": statistics.median(bg_s),
    }

    # 3b. async as on an accelerator: each step waits IDLE_STEP_S with the CPU idle (as a rank waits on its
    #     GPU), then meets the others (a collective); one async save starts after step 1. The extra wall time
    #     of the loop is what the save costs training there; against a synchronous save of the same state.
    #     Also the CPU-seconds a save takes (every thread of every rank), per GiB saved.
    def cpu_s() -> float:
        import resource

        r = resource.getrusage(resource.RUSAGE_SELF)  # the whole process: the writer's threads too
        return r.ru_utime + r.ru_stime

    # The same with the writer thread at nice 19 (checkpoint.background_nice), side by side
    mn = CheckpointManager(base / "async-nice", dims=dims, rank=rank, keep_last=100, background_nice=19)
    mn.save(1, state, {}, asynchronous=False)
    for t in local:  # changed tensors: the async save below copies them, allocating its staging buffers
        t.add_(1e-3)
    mn.save(2, state, {}, asynchronous=True, defer_staging=True)
    mn.wait()

    def idle_steps(n: int, save_step: int | None, mgr=ma) -> None:
        """As the reference trainer saves: the copy deferred (defer_staging), waited for only before the step
        that changes the tensors (here every step's end: on a device the optimizer step is device work)."""
        for s in range(n):
            time.sleep(IDLE_STEP_S)  # forward and backward on the device
            mgr.wait_staged()  # the optimizer step may change the saved tensors from here
            if save_step is not None and s == 1:
                mgr.save(save_step, state, {}, asynchronous=True, defer_staging=True)
            dist.barrier()
        mgr.wait()

    def cpu_of(fn) -> tuple[float, float]:
        """(wall s, CPU s of all ranks) of fn."""
        c = cpu_s()
        wall = timed(fn)
        used = torch.tensor([cpu_s() - c])
        dist.all_reduce(used)
        return wall, used.item()

    idle_base, idle_with, idle_nice, idle_sync, cpu_sync, cpu_async = [], [], [], [], [], []
    for rep in range(IDLE_REPS):  # the loop's own noise is a few % of 4 s: many repetitions, order rotated
        for t in local:  # every chunk new: a full save's work, as in the synchronous figure
            t.add_(1e-3)
        plain = lambda: cpu_of(lambda: idle_steps(IDLE_STEPS, None))  # noqa: E731
        saving = lambda rep=rep: cpu_of(lambda: idle_steps(IDLE_STEPS, 2000 + rep))  # noqa: E731
        niced = lambda rep=rep: cpu_of(lambda: idle_steps(IDLE_STEPS, 2000 + rep, mn))  # noqa: E731
        runs = {"plain": plain, "saving": saving, "niced": niced}
        order = list(runs)[rep % 3 :] + list(runs)[: rep % 3]
        got = {name: runs[name]() for name in order}
        (wall, cpu_plain), (wall_with, cpu_loop) = got["plain"], got["saving"]
        idle_base.append(wall)
        idle_with.append(wall_with)
        idle_nice.append(got["niced"][0])
        cpu_async.append(cpu_loop - cpu_plain)
        for t in local:
            t.add_(1e-3)
        wall, cpu = cpu_of(lambda rep=rep: ma.save(3000 + rep, state, {}, asynchronous=False))
        idle_sync.append(wall)
        cpu_sync.append(cpu)
    gib = per_rank * RANKS / 2**30
    results["async_idle"] = {
        "step_s": IDLE_STEP_S,
        "steps": IDLE_STEPS,
        "loop_s": statistics.median(idle_base),
        "loop_with_async_save_s": statistics.median(idle_with),
        "sync_save_s": statistics.median(idle_sync),
        "extra_over_sync_each": [(w - b) / s for w, b, s in zip(idle_with, idle_base, idle_sync, strict=True)],
        "nice19_extra_over_sync_each": [(w - b) / s for w, b, s in zip(idle_nice, idle_base, idle_sync, strict=True)],
        "sync_cpu_s_per_gib": statistics.median(cpu_sync) / gib,
        "async_cpu_s_per_gib": statistics.median(cpu_async) / gib,
    }

    # 4. load, resharded tp 8 -> tp 4: ranks 0-3 each load rows [r*2R, (r+1)*2R) of every tensor (two saved
    #    shards, whole), hashes checked; ranks 4-7 idle. The raw baseline: the same 4 ranks read the same two
    #    data files sequentially. Both from a cold page cache.
    total_rows = ROWS * RANKS
    loaders = RANKS // 2
    pieces = []
    if rank < loaders:
        pieces = [
            LocalShard(f"w{i:02d}", torch.empty(2 * ROWS, COLS), (total_rows, COLS), (2 * ROWS * rank, 0))
            for i in range(TENSORS)
        ]
    full0 = base / "full"  # its step 1
    data_files = [full0 / "step-00000001" / "data" / f"rank-{2 * rank + k:05d}.bin" for k in (0, 1)]

    def raw_read() -> None:
        if rank >= loaders:
            return
        for path in data_files:
            fd = os.open(path, os.O_RDONLY)
            while os.read(fd, 16 << 20):
                pass
            os.close(fd)

    read_s, load_s = [], []
    index_path = full0 / "step-00000001" / INDEX
    runs = [
        lambda: read_s.append(timed(raw_read)),
        lambda: load_s.append(timed(lambda: load_shards(read_index(index_path), full0, pieces) if pieces else None)),
    ]
    for rep in range(6):  # alternating order: a cold read's time on this virtual disk varies by 2x run to run
        for run in runs if rep % 2 == 0 else runs[::-1]:
            barrier_drop()
            run()
    ok = torch.tensor([1.0])
    if pieces:  # what was saved at full0 is `saved_w00` (rows of all ranks), so check rank's rows
        got = pieces[0].tensor
        ok = torch.tensor([float(torch.equal(got, saved_w00[2 * ROWS * rank : 2 * ROWS * (rank + 1)]))])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    results["load"] = {
        "raw_read_s": statistics.median(read_s),
        "load_resharded_verified_s": statistics.median(load_s),
        "bytes": per_rank * RANKS,
        "loaded_correctly": bool(ok.item() == 1.0),
    }
    if rank == 0:
        print("RESULT " + json.dumps(results), flush=True)
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=Path("/var/tmp/hpcscale-bench"))
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker(a.dir)
        return 0
    r = worker_result(__file__, RANKS, a.dir, timeout=3000)
    gib = r["bytes_total"] / 2**30
    f, i, s, ld = r["full"], r["incremental"], r["async"], r["load"]
    ratios = {
        "full_vs_raw_write": f["raw_write_fsync_s"] / f["hpcscale_s"],  # speed ratio: >= 0.9
        "full_vs_raw_direct_write": f["raw_direct_write_fsync_s"] / f["hpcscale_s"],  # >= 0.9
        "full_vs_dcp": f["dcp_s"] / f["hpcscale_s"],  # >= 1.3
        "incremental_bytes": i["incremental_bytes"] / i["full_bytes"],  # <= 0.12
        "incremental_time": statistics.median(i["ratio_each"]),  # <= 0.2, the median of 5 pairs
        "async_extra_over_sync": (s["loop_with_async_save_s"] - s["loop_s"]) / s["sync_save_s"],  # <= 0.15
        "async_call_blocking_over_sync": s["async_call_blocking_s"] / s["sync_save_s"],
        # the median over 9 repetitions of (loop with a save - loop without) / sync save: <= 0.05
        "async_idle_extra_over_sync": statistics.median(r["async_idle"]["extra_over_sync_each"]),
        "async_idle_extra_over_sync_nice19": statistics.median(r["async_idle"]["nice19_extra_over_sync_each"]),
        "load_vs_raw_read": ld["raw_read_s"] / ld["load_resharded_verified_s"],  # >= 0.8
    }
    targets = {
        "full_vs_raw_write": (">=", 0.9),
        "full_vs_raw_direct_write": (">=", 0.9),
        "full_vs_dcp": (">=", 1.3),
        "incremental_bytes": ("<=", 0.12),
        "incremental_time": ("<=", 0.2),
        "async_extra_over_sync": ("<=", 0.15),
        "async_idle_extra_over_sync": ("<=", 0.05),
        "load_vs_raw_read": (">=", 0.8),
    }
    met = {k: (ratios[k] >= v if op == ">=" else ratios[k] <= v) for k, (op, v) in targets.items()}
    doc = {
        "gib": gib,
        "ranks": RANKS,
        "measured": r,
        "ratios": {k: round(v, 3) for k, v in ratios.items()},
        "targets": {k: f"{op} {v}" for k, (op, v) in targets.items()},
        "met": met,
        "cold_cache": r.get("cache_dropped", False),
    }
    if a.json:
        print(json.dumps(doc, indent=2))
    else:
        print(f"{gib:.2f} GiB over {RANKS} ranks; page cache dropped before reads: {doc['cold_cache']}")
        print(
            f"  full save        hpcscale {f['hpcscale_s']:.2f}s  raw write+fsync {f['raw_write_fsync_s']:.2f}s  "
            f"raw O_DIRECT write+fsync {f['raw_direct_write_fsync_s']:.2f}s  "
            f"torch DCP {f['dcp_s']:.2f}s"
        )
        print(
            f"  incremental      {i['incremental_s']:.2f}s, {i['incremental_bytes'] / 2**20:.0f} MiB "
            f"(full {i['full_s']:.2f}s, {i['full_bytes'] / 2**20:.0f} MiB)"
        )
        print(
            f"  async            loop {s['loop_s']:.2f}s, with one async save {s['loop_with_async_save_s']:.2f}s, "
            f"sync save {s['sync_save_s']:.2f}s, async call blocked {s['async_call_blocking_s'] * 1000:.0f} ms"
        )
        ai = r["async_idle"]
        print(
            f"  async, idle CPU  {ai['steps']} steps of {ai['step_s']}s: loop {ai['loop_s']:.2f}s, with one async "
            f"save {ai['loop_with_async_save_s']:.2f}s, sync save {ai['sync_save_s']:.2f}s; CPU per GiB: sync "
            f"{ai['sync_cpu_s_per_gib']:.2f}s, async {ai['async_cpu_s_per_gib']:.2f}s"
        )
        print(f"  incremental/full each pair: {', '.join(f'{x:.3f}' for x in i['ratio_each'])}")
        print(
            f"  load resharded   {ld['load_resharded_verified_s']:.2f}s vs raw read {ld['raw_read_s']:.2f}s "
            f"(correct: {ld['loaded_correctly']})"
        )
        for k, v in ratios.items():
            t = targets.get(k)
            print(f"  {k:32} {v:7.3f}  " + (f"target {t[0]} {t[1]}: {'met' if met[k] else 'NOT met'}" if t else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
