"""Editing a saved checkpoint index the way an attacker (or a broken tool) would: h5py on the file itself.

edit_index(step_dir, fn)      open index.h5 read-write and call fn(f)
replace_table(f, name, data)  rewrite a table with new contents, shape or type
reseal(step_dir)              recompute the root digest and DIGEST after an edit, as an attacker who knows
                              the format would: then only the structure checks (or a signature) stand
save_in_process(root, ...)    save one checkpoint in this process through the library's writer, with tensors
                              cut into several shards and small chunks (no MPI needed)
"""

from __future__ import annotations

from collections.abc import Callable
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
            shards += [LocalShard(name, t[i : i + 32], tuple(t.shape), (i, 0), True) for i in (0, 32)]
        elif name == "model/cols":
            shards += [LocalShard(name, t[:, j : j + 16], tuple(t.shape), (0, j), True) for j in (0, 16)]
        else:
            shards.append(LocalShard(name, t, tuple(t.shape), (0,) * t.dim(), False))
    saved = writer.CHUNK_BYTES
    writer.CHUNK_BYTES = chunk_bytes
    try:
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
