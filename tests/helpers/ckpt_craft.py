"""Crafting checkpoints by hand, as someone who knows the format would: any tensors, shards and chunk references,
with a root digest and DIGEST that match (so only the structure checks, the data and the export's own checks
stand between the index and what reads it).

craft(root, tensors, ...)  write step-N (data file, index.h5, DIGEST) under `root` from `tensors`:
                           {name: Tensor(dtype, shape, [Piece(offset, shape, data), ...])}. A piece without
                           data is zeros, stored sparsely and once per distinct chunk length, so an index may
                           declare terabytes that its data file holds in one sparse chunk (content-addressed
                           deduplication, taken as far as it goes).
zeros_tensor(dtype, shape) one piece of zeros covering `shape`
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import xxhash

DATA = "data/rank-00000.bin"


@dataclass
class Piece:
    offset: tuple[int, ...]
    shape: tuple[int, ...]
    data: bytes | None = None  # the piece's bytes, row-major; None: zeros


@dataclass
class Tensor:
    dtype: str
    shape: tuple[int, ...]
    pieces: list[Piece] = field(default_factory=list)


def zeros_tensor(dtype: str, shape: tuple[int, ...]) -> Tensor:
    return Tensor(dtype, tuple(shape), [Piece((0,) * len(shape), tuple(shape))])


_ZERO_HASH: dict[int, str] = {}


def _zero_hash(length: int) -> str:
    if length not in _ZERO_HASH:
        h = xxhash.xxh3_128()
        block = bytes(min(length, 1 << 20))
        left = length
        while left:
            n = min(left, len(block))
            h.update(block[:n])
            left -= n
        _ZERO_HASH[length] = h.hexdigest()
    return _ZERO_HASH[length]


def craft(root: Path, tensors: dict[str, Tensor], *, step: int = 1, chunk_bytes: int = 1024) -> Path:
    """Write checkpoint `step` under `root` holding `tensors`; returns its step directory."""
    from hpcscale.ckpt.format import (
        INDEX,
        ChunkRef,
        Index,
        ShardRecord,
        TensorRecord,
        step_dir_name,
        write_digest_file,
        write_index,
    )
    from hpcscale.ckpt.integrity import DTYPE_SIZES

    name = step_dir_name(step)
    step_dir = root / name
    (step_dir / "data").mkdir(parents=True)
    file = f"{name}/{DATA}"
    stored: dict[str, ChunkRef] = {}
    end = 0
    records = {}
    with open(step_dir / DATA, "wb") as fh:
        for tname, spec in sorted(tensors.items()):
            rec = TensorRecord(tname, tuple(spec.shape), spec.dtype)
            elt = DTYPE_SIZES.get(spec.dtype, 1)
            for piece in spec.pieces:
                nbytes = math.prod(piece.shape) * elt
                refs = []
                for k in range(max(1, -(-nbytes // chunk_bytes))):
                    length = min(chunk_bytes, nbytes - k * chunk_bytes)
                    if piece.data is None:
                        content, digest = None, _zero_hash(length)
                    else:
                        content = piece.data[k * chunk_bytes : k * chunk_bytes + length]
                        digest = xxhash.xxh3_128_hexdigest(content)
                    ref = stored.get(digest)
                    if ref is None:
                        ref = stored[digest] = ChunkRef(digest, file, end, length)
                        if content:
                            fh.seek(end)
                            fh.write(content)
                        end += length
                    refs.append(ref)
                rec.shards.append(ShardRecord(tuple(piece.offset), tuple(piece.shape), refs))
            records[tname] = rec
        fh.truncate(end)  # zeros past the last written byte: a hole
    rng = {0: {"cpu": np.zeros(16, dtype=np.uint8)}}
    index = Index(
        step, 1, {"pp": 1, "dp": 1, "tp": 1}, None, 0.0, records, {"step": step}, rng, chunk_bytes=chunk_bytes
    )
    digest = write_index(step_dir / INDEX, index)
    write_digest_file(step_dir, digest)
    return step_dir
