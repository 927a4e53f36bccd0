"""Editing a saved checkpoint index the way an attacker (or a broken tool) would: h5py on the file itself.

edit_index(step_dir, fn)      open index.h5 read-write and call fn(f)
replace_table(f, name, data)  rewrite a table with new contents, shape or type
reseal(step_dir)              recompute the root digest and DIGEST after an edit, as an attacker who knows
                              the format would: then only the structure checks (or a signature) stand
save_in_process(root, ...)    save one checkpoint in this process through the library's writer, with tensors
                              cut into several shards and small chunks (no MPI needed)
one_rank_manager(root, log)   a CheckpointManager of a 1-rank run in this process (its own gloo group)
tiling_tables(gshape, boxes)  the tables of a one-tensor index whose shards are `boxes` (structure checks alone)
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import h5py


def edit_index(step_dir: Path, fn: Callable[[h5py.File], None]) -> None:
    with h5py.File(step_dir / "index.h5", "r+", locking=False) as f:
        fn(f)


def replace_table(f: h5py.File, name: str, data) -> None:
    del f[name]
    f.create_dataset(name, data=data)


def reseal(step_dir: Path) -> bool:
    """Recompute the digest of whatever the index now holds; False when it can no longer be parsed."""
    from hpcscale.ckpt.format import _Damaged, _read_tables
    from hpcscale.ckpt.integrity import root_digest

    try:
        with h5py.File(step_dir / "index.h5", "r+", locking=False) as f:
            digest = root_digest(_read_tables(f))
            f.attrs["digest"] = digest
    except (_Damaged, OSError, KeyError, ValueError, TypeError):
        return False
    (step_dir / "DIGEST").write_text(digest + "\n")
    return True


def tensor_rows(f: h5py.File, name: str) -> tuple[int, range, list[range]]:
    """(tensor row, its shard rows, each shard's chunk rows) of tensor `name`."""
    names = [x.decode() if isinstance(x, bytes) else x for x in f["tensor_name"][()]]
    t = names.index(name)
    first, count = int(f["tensor_shard_start"][t]), int(f["tensor_shard_count"][t])
    shards = range(first, first + count)
    starts, counts = f["shard_chunk_start"][()], f["shard_chunk_count"][()]
    return t, shards, [range(int(starts[s]), int(starts[s] + counts[s])) for s in shards]


def fuzz_tensors() -> dict:
    import torch

    g = torch.Generator().manual_seed(7)
    return {
        "model/rows": torch.randn(64, 32, generator=g),  # two row shards
        "model/cols": torch.randn(64, 32, generator=g),  # two column shards, same size as rows: swappable
        "model/ints": torch.arange(300, dtype=torch.int64),
        "model/half": torch.randn(40, generator=g).to(torch.bfloat16),
        "optim/zeros": torch.zeros(16, 32),  # its chunks are deduplicated with zeros_too's
        "optim/zeros_too": torch.zeros(16, 32),
        "optim/scalar": torch.tensor(3.5),
        "optim/empty": torch.zeros(0, 3),
    }


def save_in_process(root: Path, step: int, tensors: dict, *, chunk_bytes: int = 1024) -> None:
    """Save `tensors` as rank 0 of a 1-rank run, cutting model/rows by rows and model/cols by columns into two
    shards each (as a tp=2 save would) and every shard into chunks of `chunk_bytes`."""
    import hpcscale.ckpt.writer as writer
    from hpcscale.ckpt.shards import LocalShard

    shards = []
    for name, t in tensors.items():
        if name == "model/rows":
            shards += [LocalShard(name, t[i : i + 32], tuple(t.shape), (i, 0)) for i in (0, 32)]
        elif name == "model/cols":
            shards += [LocalShard(name, t[:, j : j + 16], tuple(t.shape), (0, j)) for j in (0, 16)]
        else:
            shards.append(LocalShard(name, t, tuple(t.shape), (0,) * t.dim()))
    saved = writer.CHUNK_BYTES
    writer.CHUNK_BYTES = chunk_bytes
    try:
        root.mkdir(parents=True, exist_ok=True)  # a CheckpointManager's part (made private there), not the writer's
        w = writer.ShardWriter(root, rank=0, group=None, direct_io=False)
        rows, _ = w.write(step, w.snapshot(shards, copy=False))
        writer.commit(
            root,
            step,
            [{"rank": 0, "rows": rows, "rng": writer.rng_state()}],
            layout={"pp": 1, "dp": 1, "tp": 1},
            parent=None,
            trainer_state={"step": step, "loader": {"epoch": 0, "batch": step, "seed": 1}},
            keep_last=10,
            keep_every=0,
        )
    finally:
        writer.CHUNK_BYTES = saved


def tiling_tables(gshape: tuple[int, ...], boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]):
    """The tables of a one-tensor float32 index (step 1, one rank) whose shards are `boxes` (offset, shape),
    each one chunk: for timing and probing the structure checks without writing anything."""
    import math

    import numpy as np

    from hpcscale.ckpt.format import ChunkRef, Index, ShardRecord, TensorRecord, _tables_of

    file = "step-00000001/data/rank-00000.bin"
    rec = TensorRecord("model/w", tuple(gshape), "float32")
    pos = 0
    for off, shape in boxes:
        n = 4 * math.prod(shape)
        rec.shards.append(ShardRecord(tuple(off), tuple(shape), [ChunkRef("0" * 32, file, pos, n)]))
        pos += n
    rng = {0: {"cpu": np.zeros(16, dtype=np.uint8)}}
    index = Index(1, 1, {"pp": 1, "dp": 1, "tp": 1}, None, 0.0, {"model/w": rec}, {}, rng, chunk_bytes=1 << 30)
    return _tables_of(index)


def staggered_columns(columns: int) -> tuple[tuple[int, int], list]:
    """A real tiling that is no grid: column j of a (columns + 2, columns) tensor cut into two shards at row
    1 + j, every cut at a different row (the pairwise overlap sweep was quadratic in it)."""
    rows = columns + 2
    boxes = []
    for j in range(columns):
        boxes += [((0, j), (1 + j, 1)), ((1 + j, j), (rows - 1 - j, 1))]
    return (rows, columns), boxes


def grid(rows: int, columns: int, cell: tuple[int, int] = (3, 5)) -> tuple[tuple[int, int], list]:
    """A rows x columns grid of cells (the shards of a 2-D mesh's Shard(0), Shard(1) placements)."""
    boxes = [((r * cell[0], c * cell[1]), cell) for r in range(rows) for c in range(columns)]
    return (rows * cell[0], columns * cell[1]), boxes


@contextmanager
def one_rank_manager(root: Path, log: list[str]):
    """A CheckpointManager of a 1-rank (pp, dp, tp) = (1, 1, 1) run over `root`, in this process: a gloo group
    of its own, torn down on exit. Its log lines go to `log`."""
    import torch.distributed as dist

    from hpcscale.ckpt.manager import CheckpointManager
    from hpcscale.layout import ParallelDims

    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield CheckpointManager(root, dims=ParallelDims(pp=1, dp=1, tp=1), rank=0, log=log.append)
    finally:
        dist.destroy_process_group()
