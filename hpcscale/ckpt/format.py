"""The checkpoint index: one HDF5 file per checkpoint, readable with h5py alone (docs/checkpoint-format.md).

    checkpoints/
      LATEST                      "step-00000100" (replaced atomically after each commit)
      step-00000100/
        index.h5                  written last: everything below is durable before it exists
        data/rank-00003.bin       the chunks this rank wrote for this step (new content only)
      .tmp-step-00000150-<id>/    a save in progress (or a crashed one: cleaned on the next start)

Chunks are content-addressed (xxh128): a chunk whose hash is already stored in a committed checkpoint is
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
from hpcscale.portable.hashing import XXH128

FORMAT = "hpcscale-checkpoint"
VERSION = 1
HASH_ALGORITHM = XXH128  # the same name manifests use (hpcscale.portable.hashing owns the names)
_LEGACY_HASH_NAMES = {"xxh3-128"}  # what indexes written before that called the same hash
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
    hash: str  # hex xxh128 (xxHash3, 128 bits) of the chunk's bytes
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
    """Write to `path` (a temporary name) and fsync; the caller renames it into place.

    Flat tables, so the number of HDF5 objects does not grow with the model: tensors, their shards and the
    shards' chunks are rows of three tables linked by start/count columns (docs/checkpoint-format.md)."""
    import h5py

    files = sorted(index.files())
    file_id = {f: i for i, f in enumerate(files)}
    names = sorted(index.tensors)
    recs = [index.tensors[n] for n in names]
    maxd = max([1, *(len(r.global_shape) for r in recs)])

    def padded(shape) -> list[int]:
        return list(shape) + [-1] * (maxd - len(shape))

    shards = [s for r in recs for s in r.shards]
    shard_counts = [len(r.shards) for r in recs]
    chunk_counts = [len(s.chunks) for s in shards]
    str_dt = h5py.string_dtype()
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
        f.create_dataset("files", data=np.array(files, dtype=str_dt))
        f.create_dataset("tensor_name", data=np.array(names, dtype=str_dt))
        f.create_dataset("tensor_dtype", data=np.array([r.dtype for r in recs], dtype=str_dt))
        f.create_dataset("tensor_ndim", data=np.array([len(r.global_shape) for r in recs], dtype=np.int32))
        f.create_dataset(
            "tensor_shape",
            data=np.array([padded(r.global_shape) for r in recs], dtype=np.int64).reshape(len(recs), maxd),
        )
        f.create_dataset("tensor_shard_start", data=np.cumsum([0, *shard_counts[:-1]]).astype(np.int64)[: len(recs)])
        f.create_dataset("tensor_shard_count", data=np.array(shard_counts, dtype=np.int64))
        f.create_dataset(
            "shard_offset", data=np.array([padded(s.offset) for s in shards], dtype=np.int64).reshape(len(shards), maxd)
        )
        f.create_dataset(
            "shard_shape", data=np.array([padded(s.shape) for s in shards], dtype=np.int64).reshape(len(shards), maxd)
        )
        f.create_dataset("shard_chunk_start", data=np.cumsum([0, *chunk_counts[:-1]]).astype(np.int64)[: len(shards)])
        f.create_dataset("shard_chunk_count", data=np.array(chunk_counts, dtype=np.int64))
        f.create_dataset(
            "chunks",
            data=np.array(
                [(c.hash.encode(), file_id[c.file], c.offset, c.length) for sh in shards for c in sh.chunks],
                dtype=CHUNK_DTYPE,
            ),
        )
        ranks = sorted(index.rng)
        f.create_dataset("rng_rank", data=np.array(ranks, dtype=np.int64))
        for key in sorted({k for states in index.rng.values() for k in states}):
            f.create_dataset(f"rng_{key}", data=np.stack([index.rng[r][key] for r in ranks]))
        f.flush()
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_index(path: Path) -> Index:
    """Parse an index; VerificationFailure (exit 3) if it is damaged or not an index."""
    import h5py

    def strings(ds) -> list[str]:
        return [x.decode() if isinstance(x, bytes) else x for x in ds[()]]

    try:
        with h5py.File(path, "r", locking=False) as f:
            if f.attrs.get("format") != FORMAT:
                raise VerificationFailure(f"{path}: not an hpcscale checkpoint index")
            if int(f.attrs["version"]) != VERSION:
                raise VerificationFailure(f"{path}: index version {f.attrs['version']} is not supported")
            algorithm = f.attrs.get("hash_algorithm")
            if algorithm != HASH_ALGORITHM and algorithm not in _LEGACY_HASH_NAMES:
                raise VerificationFailure(f"{path}: chunks hashed with {algorithm!r}, which this version cannot check")
            files = strings(f["files"])
            names, dtypes = strings(f["tensor_name"]), strings(f["tensor_dtype"])
            ndims, tshape = f["tensor_ndim"][()], f["tensor_shape"][()]
            t_start, t_count = f["tensor_shard_start"][()], f["tensor_shard_count"][()]
            s_off, s_shape = f["shard_offset"][()], f["shard_shape"][()]
            c_start, c_count = f["shard_chunk_start"][()], f["shard_chunk_count"][()]
            table = f["chunks"][()]
            hashes = [h.decode() for h in table["hash"]]
            c_file, c_off, c_len = table["file"].tolist(), table["offset"].tolist(), table["length"].tolist()
            tensors = {}
            for i, name in enumerate(names):
                nd = int(ndims[i])
                shards = []
                for j in range(int(t_start[i]), int(t_start[i] + t_count[i])):
                    a, b = int(c_start[j]), int(c_start[j] + c_count[j])
                    shards.append(
                        ShardRecord(
                            tuple(int(x) for x in s_off[j][:nd]),
                            tuple(int(x) for x in s_shape[j][:nd]),
                            [ChunkRef(hashes[k], files[c_file[k]], c_off[k], c_len[k]) for k in range(a, b)],
                        )
                    )
                tensors[name] = TensorRecord(name, tuple(int(x) for x in tshape[i][:nd]), dtypes[i], shards)
            ranks = f["rng_rank"][()].tolist()
            rng: dict[int, dict[str, np.ndarray]] = {r: {} for r in ranks}
            for key in f:
                if key.startswith("rng_") and key != "rng_rank":
                    data = f[key][()]
                    for row, r in enumerate(ranks):
                        rng[r][key.removeprefix("rng_")] = data[row]
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
