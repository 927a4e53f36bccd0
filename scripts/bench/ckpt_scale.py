#!/usr/bin/env python3
"""Checkpoint index at scale, on paper: a 70 B-parameter Llama-shaped model's sharded checkpoint index, built
synthetically (no tensor data), at tp 8 x dp_shard D for growing D, on one core.

The pieces are the ones the job would save: the model's parameters and AdamW's two moments (and step counts),
tensor-parallel matrices split Megatron-style over tp (q, k, v, gate, up, embedding and output head by rows;
o and down by columns) and every tensor split again on dim 0 over the shard group as FSDP2 does (torch's own
placement rule, uneven and strided sharding included: hpcscale.ckpt.shards), each piece written by the one
rank that holds it, one chunk per piece. For each D it times, on this process alone:
- rank columns: the slowest rank turning its rows into the columns it sends rank 0 (hpcscale.ckpt.format.rows_of;
  every rank does this at once, in parallel, in a real save);
- commit: rank 0 building the index from every rank's columns and writing it (hpcscale.ckpt.writer.commit);
- verify: reading it back with its whole structure checked (hpcscale.ckpt.format.read_index);
- plan: one rank of the layout tp 8 x dp_shard D/2 working out every chunk it reads (reader.plan_reads);
and the index's size on disk. Targets at 4096 ranks (D = 512): commit <= 10 s, verify <= 30 s, plan <= 30 s,
index <= 1 GiB.

    python scripts/bench/ckpt_scale.py [--shards 64,128,256,512] [--repeat 5] [--json]
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import sys
import tempfile
import time
import zlib
from pathlib import Path

TP = 8
LAYERS, HIDDEN, FFN, KV, VOCAB = 80, 8192, 28672, 1024, 128256  # Llama 3 70B
TARGETS = {"commit_s": 10.0, "verify_s": 30.0, "plan_s": 30.0, "index_gib": 1.0}


def model_tensors() -> list[tuple[str, tuple[int, ...], str]]:
    """(name, global shape, tp split: "row" | "col" | "none") for every parameter."""
    out = [("tok_embeddings.weight", (VOCAB, HIDDEN), "row")]
    for i in range(LAYERS):
        p = f"layers.{i}."
        out += [
            (p + "attention.wq.weight", (HIDDEN, HIDDEN), "row"),
            (p + "attention.wk.weight", (KV, HIDDEN), "row"),
            (p + "attention.wv.weight", (KV, HIDDEN), "row"),
            (p + "attention.wo.weight", (HIDDEN, HIDDEN), "col"),
            (p + "feed_forward.w1.weight", (FFN, HIDDEN), "row"),
            (p + "feed_forward.w3.weight", (FFN, HIDDEN), "row"),
            (p + "feed_forward.w2.weight", (HIDDEN, FFN), "col"),
            (p + "attention_norm.weight", (HIDDEN,), "none"),
            (p + "ffn_norm.weight", (HIDDEN,), "none"),
        ]
    out += [("norm.weight", (HIDDEN,), "none"), ("output.weight", (VOCAB, HIDDEN), "row")]
    return out


def placements(split: str):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    # mesh (dp_shard, tp), as FSDP2 makes it over a tensor-parallel parameter
    return {
        "row": (_StridedShard(0, split_factor=TP), Shard(0)),
        "col": (Shard(0), Shard(1)),
        "none": (Shard(0), Replicate()),
    }[split]


def pieces(shape: tuple, split: str, shards: int) -> list[tuple[int, tuple, tuple]]:
    """(writer rank, offset, shape) of every non-empty piece; a piece held by every tp rank (a norm) is written
    by one of them, spread over tp by its shard index."""
    from hpcscale.ckpt.shards import _numel, _piece

    out = []
    pl = placements(split)
    for d in range(shards):
        for t in range(TP) if split != "none" else (d % TP,):
            local, offset = _piece(shape, (shards, TP), (d, t), pl)
            if _numel(local):
                out.append((d * TP + t, offset, local))
    return out


def build_rows(shards: int) -> list[dict]:
    """Every rank's rows as a save gathers them to rank 0 (hpcscale.ckpt.manager)."""
    import numpy as np

    from hpcscale.ckpt.format import CHUNK_BYTES, ChunkRef

    world = shards * TP
    rows: list[list] = [[] for _ in range(world)]
    at = [0] * world
    cache: dict = {}
    serial = 0
    for name, shape, split in model_tensors():
        layout = cache.get((shape, split))
        if layout is None:
            layout = cache[(shape, split)] = pieces(shape, split, shards)
        for kind in ("model", "optim_exp_avg", "optim_exp_avg_sq"):
            full = f"model/{name}" if kind == "model" else f"optim/{name}/{kind.removeprefix('optim_')}"
            for rank, offset, local in layout:
                n = 4
                for x in local:
                    n *= x
                refs = []
                for start in range(0, n, CHUNK_BYTES):  # cut as the writer cuts: CHUNK_BYTES each, the last less
                    length = min(CHUNK_BYTES, n - start)
                    refs.append(ChunkRef(f"{serial:032x}", f"step-00000001/data/rank-{rank:05d}.bin", at[rank], length))
                    serial += 1
                    at[rank] += length
                rows[rank].append((full, shape, "float32", offset, local, refs))
        rank = zlib.crc32(name.encode()) % world
        ref = ChunkRef(f"{serial:032x}", f"step-00000001/data/rank-{rank:05d}.bin", at[rank], 4)
        serial += 1
        at[rank] += 4
        rows[rank].append((f"optim/{name}/step", (), "float32", (), (), [ref]))
    rng = np.zeros(5056, dtype=np.uint8)  # torch's CPU generator state
    return [{"rank": r, "rng": {"cpu": rng}, "rows": rows[r]} for r in range(world)]


def as_columns(gathered: list[dict]) -> float:
    """Each rank's rows as the columns it sends (hpcscale.ckpt.format.rows_of, done by every rank at once in a
    real save); returns the slowest rank's seconds."""
    from hpcscale.ckpt.format import rows_of

    slowest = 0.0
    for part in gathered:
        t = time.perf_counter()
        part["rows"] = rows_of(part["rows"])
        slowest = max(slowest, time.perf_counter() - t)
    return slowest


def plan_targets(shards: int, rank: int):
    import torch

    from hpcscale.ckpt.shards import LocalShard, _numel, _piece

    d, t = divmod(rank, TP)
    out = []
    for name, shape, split in model_tensors():
        local, offset = _piece(shape, (shards, TP), (d, t), placements(split))
        if not _numel(local):
            continue
        for full in (f"model/{name}", f"optim/{name}/exp_avg", f"optim/{name}/exp_avg_sq"):
            out.append(LocalShard(full, torch.empty(local), shape, offset))
        out.append(LocalShard(f"optim/{name}/step", torch.empty(()), (), ()))
    return out


def one(shards: int, tmp: Path, repeat: int) -> dict:
    """The median of `repeat` builds of the index at dp_shard = shards (each built, committed, read, planned)."""
    runs = [one_run(shards, tmp) for _ in range(repeat)]
    out = dict(runs[0])
    for key in ("rows_build_s", "rank_columns_s", "commit_s", "verify_s", "plan_s"):
        out[key] = sorted(r[key] for r in runs)[len(runs) // 2]
        out[f"{key}_each"] = [r[key] for r in runs]
    return out


def one_run(shards: int, tmp: Path) -> dict:
    from hpcscale.ckpt.format import INDEX, read_index
    from hpcscale.ckpt.reader import plan_reads
    from hpcscale.ckpt.writer import commit

    t = time.perf_counter()
    gathered = build_rows(shards)
    build_s = time.perf_counter() - t
    rank_s = as_columns(gathered)
    root = tmp / f"d{shards}"
    (root / ".tmp-step-00000001").mkdir(parents=True)
    gc.collect()
    t = time.perf_counter()
    commit(
        root, 1, gathered, layout={"pp": 1, "dp": shards, "tp": TP, "dp_shard": shards}, parent=None,
        trainer_state={"step": 1}, keep_last=1, keep_every=0,
    )  # fmt: skip
    commit_s = time.perf_counter() - t
    pieces_total = sum(len(g["rows"].names) for g in gathered)
    del gathered
    gc.collect()
    path = root / "step-00000001" / INDEX
    size = path.stat().st_size
    t = time.perf_counter()
    index = read_index(path)
    verify_s = time.perf_counter() - t
    target_shards = max(1, shards // 2)
    targets = plan_targets(target_shards, rank=(target_shards // 2) * TP + 3)  # a rank in the middle
    t = time.perf_counter()
    reads, _, _ = plan_reads(index, targets)
    plan_s = time.perf_counter() - t
    shutil.rmtree(root)
    return {
        "ranks": shards * TP,
        "dp_shard": shards,
        "pieces": pieces_total,
        "rows_build_s": round(build_s, 2),
        "rank_columns_s": round(rank_s, 4),
        "commit_s": round(commit_s, 2),
        "verify_s": round(verify_s, 2),
        "plan_s": round(plan_s, 2),
        "plan_chunks": len(reads),
        "index_gib": round(size / 2**30, 3),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shards", default="64,128,256,512", help="dp_shard degrees (ranks = 8 x each)")
    ap.add_argument("--dir", type=Path, default=None, help="where the indexes are written (default: a temp dir)")
    ap.add_argument("--repeat", type=int, default=5, help="builds per degree; the median is shown")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    import os

    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})  # one core
    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(dir=a.dir) as d:
        results = [one(int(s), Path(d), a.repeat) for s in a.shards.split(",")]
    largest = results[-1]
    met = {k: largest[k] <= v for k, v in TARGETS.items()}
    if a.json:
        print(json.dumps({"results": results, "targets": TARGETS, "met_at_largest": met}, indent=2))
        return 0
    print(
        f"70 B Llama-shaped index at tp {TP} x dp_shard D, one core, median of {a.repeat}; plan: one rank of "
        f"tp {TP} x dp_shard D/2"
    )
    print(
        f"  {'ranks':>6} {'pieces':>10} {'rank cols s':>11} {'commit s':>9} {'verify s':>9} {'plan s':>8} "
        f"{'index GiB':>10}"
    )
    for r in results:
        print(
            f"  {r['ranks']:6d} {r['pieces']:10d} {r['rank_columns_s']:11.3f} {r['commit_s']:9.2f} "
            f"{r['verify_s']:9.2f} {r['plan_s']:8.2f} {r['index_gib']:10.3f}"
        )
    print(
        f"targets at the largest ({largest['ranks']} ranks): "
        + ", ".join(f"{k} <= {v}: {'met' if met[k] else 'NOT met'}" for k, v in TARGETS.items())
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
