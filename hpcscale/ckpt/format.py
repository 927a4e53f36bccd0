"""The checkpoint index: one HDF5 file per checkpoint, readable with h5py alone (docs/checkpoint-format.md).

    checkpoints/
      LATEST                      "step-00000100" (replaced atomically after each commit)
      step-00000100/
        index.h5                  written last: everything below is durable before it exists
        data/rank-00003.bin       the chunks this rank wrote for this step (new content only)
      .tmp-step-00000150-<id>/    a save in progress (or a crashed one: cleaned on the next start)

Chunks are content-addressed (xxh3-128): a chunk whose hash is already stored in a committed checkpoint is
referenced there, not written again. Files are opened without HDF5 file locking (Lustre/GPFS without flock);
only one process ever writes an index, and only before it is renamed into place.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from hpcscale.errors import VerificationFailure

FORMAT = "hpcscale-checkpoint"
VERSION = 1
HASH_ALGORITHM = "xxh3-128"
INDEX = "index.h5"
LATEST = "LATEST"
CHUNK_BYTES = 16 << 20
_STEP_DIR = re.compile(r"^step-(\d{8})$")

CHUNK_DTYPE = np.dtype([("hash", "S32"), ("file", "<i4"), ("offset", "<i8"), ("length", "<i8")])


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def step_of(name: str) -> int | None:
    m = _STEP_DIR.match(name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True, slots=True)
class ChunkRef:
    hash: str  # hex xxh3-128 of the chunk's bytes
    file: str  # relative to the checkpoints root, e.g. step-00000100/data/rank-00003.bin
    offset: int
    length: int


@dataclass(frozen=True, slots=True)
class ShardRecord:
    """One stored piece of a tensor: where it sits in the global tensor and the chunks holding its bytes
    (row-major, concatenated)."""

    offset: tuple[int, ...]
    shape: tuple[int, ...]
    chunks: list[ChunkRef]


@dataclass(slots=True)
class TensorRecord:
    name: str
    global_shape: tuple[int, ...]
    dtype: str  # numpy dtype name, e.g. float32, bfloat16 is stored as "bfloat16"
    shards: list[ShardRecord] = field(default_factory=list)


@dataclass(slots=True)
class Index:
    step: int
    world_size: int
    layout: dict  # {"pp": .., "dp": .., "tp": ..}
    parent: str | None
    created: float
    tensors: dict[str, TensorRecord]
    trainer_state: dict  # JSON-able: step, loader position, ...
    rng: dict[int, dict[str, np.ndarray]]  # rank -> {"cpu": uint8 array, ...}

    def files(self) -> set[str]:
        return {c.file for t in self.tensors.values() for s in t.shards for c in s.chunks}

    def total_bytes(self) -> int:
        return sum(c.length for t in self.tensors.values() for s in t.shards for c in s.chunks)


def write_index(path: Path, index: Index) -> None:
    """Write to `path` (a temporary name) and fsync; the caller renames it into place."""
    import h5py

    files = sorted(index.files())
    file_id = {f: i for i, f in enumerate(files)}
    with h5py.File(path, "w", locking=False) as f:
        f.attrs.update(
            {
                "format": FORMAT,
                "version": VERSION,
                "hash_algorithm": HASH_ALGORITHM,
                "step": index.step,
                "world_size": index.world_size,
                "layout": json.dumps(index.layout),
                "parent": index.parent or "",
                "created": index.created,
                "trainer_state": json.dumps(index.trainer_state),
            }
        )
        f.create_dataset("files", data=np.array(files, dtype=h5py.string_dtype()))
        tensors = f.create_group("tensors")
        for name in sorted(index.tensors):
            rec = index.tensors[name]
            g = tensors.create_group(name.replace("/", "|"))
            g.attrs.update(
                {"name": name, "global_shape": np.array(rec.global_shape, dtype=np.int64), "dtype": rec.dtype}
            )
            ndim = len(rec.global_shape)
            g.create_dataset(
                "shard_offset",
                data=np.array([s.offset for s in rec.shards], dtype=np.int64).reshape(len(rec.shards), ndim),
            )
            g.create_dataset(
                "shard_shape",
                data=np.array([s.shape for s in rec.shards], dtype=np.int64).reshape(len(rec.shards), ndim),
            )
            counts = [len(s.chunks) for s in rec.shards]
            g.create_dataset("shard_chunk_start", data=np.cumsum([0, *counts[:-1]]).astype(np.int64))
            g.create_dataset("shard_chunk_count", data=np.array(counts, dtype=np.int64))
            table = np.array(
                [(c.hash.encode(), file_id[c.file], c.offset, c.length) for s in rec.shards for c in s.chunks],
                dtype=CHUNK_DTYPE,
            )
            g.create_dataset("chunks", data=table)
        rng = f.create_group("rng")
        for rank, states in sorted(index.rng.items()):
            rg = rng.create_group(f"rank-{rank:05d}")
            for key, arr in states.items():
                rg.create_dataset(key, data=arr)
        f.flush()
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_index(path: Path) -> Index:
    """Parse an index; VerificationFailure (exit 3) if it is damaged or not an index."""
    import h5py

    try:
        with h5py.File(path, "r", locking=False) as f:
            if f.attrs.get("format") != FORMAT:
                raise VerificationFailure(f"{path}: not an hpcscale checkpoint index")
            if int(f.attrs["version"]) != VERSION:
                raise VerificationFailure(f"{path}: index version {f.attrs['version']} is not supported")
            files = [x.decode() if isinstance(x, bytes) else x for x in f["files"][()]]
            tensors = {}
            for g in f["tensors"].values():
                name = g.attrs["name"]
                offsets, shapes = g["shard_offset"][()], g["shard_shape"][()]
                starts, counts, table = g["shard_chunk_start"][()], g["shard_chunk_count"][()], g["chunks"][()]
                shards = []
                for i in range(len(offsets)):
                    rows = table[starts[i] : starts[i] + counts[i]]
                    shards.append(
                        ShardRecord(
                            tuple(int(x) for x in offsets[i]),
                            tuple(int(x) for x in shapes[i]),
                            [
                                ChunkRef(r["hash"].decode(), files[r["file"]], int(r["offset"]), int(r["length"]))
                                for r in rows
                            ],
                        )
                    )
                tensors[name] = TensorRecord(
                    name, tuple(int(x) for x in g.attrs["global_shape"]), g.attrs["dtype"], shards
                )
            rng = {int(k.split("-")[1]): {key: ds[()] for key, ds in g.items()} for k, g in f["rng"].items()}
            return Index(
                int(f.attrs["step"]),
                int(f.attrs["world_size"]),
                json.loads(f.attrs["layout"]),
                f.attrs["parent"] or None,
                float(f.attrs["created"]),
                tensors,
                json.loads(f.attrs["trainer_state"]),
                rng,
            )
    except VerificationFailure:
        raise
    except (OSError, KeyError, ValueError, TypeError, IndexError) as e:
        raise VerificationFailure(f"{path}: damaged index ({type(e).__name__}: {e})") from None


def committed_steps(root: Path) -> list[int]:
    """Steps with a committed directory (index present), newest first."""
    if not root.is_dir():
        return []
    steps = [s for p in root.iterdir() if (s := step_of(p.name)) is not None and (p / INDEX).is_file()]
    return sorted(steps, reverse=True)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
