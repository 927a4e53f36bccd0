"""The checkpoint index: one HDF5 file per checkpoint, readable with h5py alone (docs/checkpoint-format.md).

    checkpoints/
      LATEST                      "step-00000100" (replaced atomically after each commit)
      step-00000100/
        index.h5                  written last: everything below is durable before it exists
        DIGEST                    the index's root digest ("sha256:<hex>"), what a signature covers
        data/rank-00003.bin       the chunks this rank wrote for this step (new content only)
      .tmp-step-00000150-<id>/    a save in progress (or a crashed one: cleaned on the next start)

Chunks are content-addressed (xxh128): a chunk whose hash is already stored in a committed checkpoint is
referenced there, not written again. What binds a chunk to its tensor, shard and position, and what proves the
index whole (structure checks and a sha256 root digest, also written to DIGEST), is integrity.py.
Files are opened without HDF5 file locking (Lustre/GPFS without flock); only one process ever writes an
index, and only before it is renamed into place.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from hpcscale.ckpt.integrity import (
    ATTRS,
    CHUNK_DTYPE,
    DTYPE_SIZES,
    INT_TABLES,
    STRING_TABLES,
    Tables,
    parsed_layout,
    parsed_trainer_state,
    root_digest,
    structure_problems,
    valid_digest_text,
)
from hpcscale.errors import BadInput, VerificationFailure
from hpcscale.portable.files import atomic_write, open_regular
from hpcscale.portable.hashing import XXH128
from hpcscale.util.bounded import file_problem, read_bounded

FORMAT = "hpcscale-checkpoint"
# 2: root digest, DIGEST file, chunk_bytes; 3: the root digest leaves out where bytes are stored, so a state has
# one digest on every tier. Both are read; version 1 is refused (docs/checkpoint-format.md, "Versions").
VERSION = 3
READ_VERSIONS = (2, 3)
HASH_ALGORITHM = XXH128  # the same name manifests use (hpcscale.portable.hashing owns the names)
INDEX = "index.h5"
DIGEST = "DIGEST"  # beside index.h5: the root digest as one line of text, for a signature to cover
STRING_SLICE = 16  # elements of a string table read at once (the text budget is checked between slices)
MAX_TABLE_BYTES = 1 << 30  # no index table is this large; a crafted one that claims more is refused unread
LATEST = "LATEST"
CHUNK_BYTES = 16 << 20
_STEP_DIR = re.compile(r"^step-(\d{8})$")
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


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


@dataclass(frozen=True, slots=True)
class TensorView:
    """One tensor of an index as a load plans it: its shape, dtype and every shard's box as arrays, and a shard's
    record (with its chunks) built when asked for, so planning a rank's load builds only the shards it reads."""

    name: str
    global_shape: tuple[int, ...]
    dtype: str
    offsets: np.ndarray  # (S, ndim) int64
    shapes: np.ndarray  # (S, ndim) int64
    shard: Callable[[int], ShardRecord]
    # chunks(j, a, b): chunks a to b (exclusive) of shard j, built from the tables without the rest of the
    # shard's (an export reads a block of a tensor at a time: a shard may have millions of chunks)
    chunks: Callable[[int, int, int], list[ChunkRef]] | None = None

    def __len__(self) -> int:
        return len(self.offsets)


def tensor_view(index: Index, name: str) -> TensorView | None:
    """`name` in `index` as a TensorView (None: the index has no such tensor)."""
    if isinstance(index.tensors, TensorTable):
        return index.tensors.view(name)
    rec = index.tensors.get(name)
    if rec is None:
        return None
    nd = len(rec.global_shape)
    return TensorView(
        rec.name,
        tuple(rec.global_shape),
        rec.dtype,
        np.array([s.offset for s in rec.shards], dtype=np.int64).reshape(len(rec.shards), nd),
        np.array([s.shape for s in rec.shards], dtype=np.int64).reshape(len(rec.shards), nd),
        rec.shards.__getitem__,
        lambda j, a, b: rec.shards[j].chunks[a:b],
    )


class TensorTable(Mapping):
    """An index's tensors, read-only, over its tables: a tensor's record (its shards and their chunks) is built
    when it is asked for, so reading an index costs its tables, not one object per piece and chunk (millions
    at thousands of ranks). Loading one rank's shards builds the records of the tensors it loads."""

    def __init__(self, t: Tables):
        self._t = t
        self._names = [x.decode() for x in t.strings["tensor_name"]]
        self._row = {n: k for k, n in enumerate(self._names)}
        self._built: dict[str, TensorRecord] = {}
        self._files = [x.decode() for x in t.strings["files"]]

    def __len__(self) -> int:
        return len(self._names)

    def __iter__(self):
        return iter(self._names)

    def __contains__(self, name) -> bool:
        return name in self._row

    def __getitem__(self, name: str) -> TensorRecord:
        rec = self._built.get(name)
        if rec is None:
            rec = self._built[name] = self._record(self._row[name])
        return rec

    def view(self, name: str) -> TensorView | None:
        """The tensor's shape, dtype and shard boxes from the tables, its shards built one at a time."""
        k = self._row.get(name)
        if k is None:
            return None
        i = self._t.ints
        nd = int(i["tensor_ndim"][k])
        a = int(i["tensor_shard_start"][k])
        b = a + int(i["tensor_shard_count"][k])
        return TensorView(
            name,
            tuple(i["tensor_shape"][k, :nd].tolist()),
            self._t.strings["tensor_dtype"][k].decode(),
            i["shard_offset"][a:b, :nd],
            i["shard_shape"][a:b, :nd],
            lambda j: self._shard(a + j, nd),
            lambda j, c0, c1: self._chunks(a + j, c0, c1),
        )

    def _shard(self, j: int, nd: int) -> ShardRecord:
        i = self._t.ints
        refs = self._chunks(j, 0, int(i["shard_chunk_count"][j]))
        return ShardRecord(tuple(i["shard_offset"][j, :nd].tolist()), tuple(i["shard_shape"][j, :nd].tolist()), refs)

    def _chunks(self, j: int, a: int, b: int) -> list[ChunkRef]:
        """Chunks a to b (exclusive, clipped to the shard's) of shard row j."""
        t, i = self._t, self._t.ints
        files = self._files
        start, count = int(i["shard_chunk_start"][j]), int(i["shard_chunk_count"][j])
        rows = t.chunks[start + max(0, a) : start + min(b, count)]
        return [
            ChunkRef(h.decode(), files[f], o, n)
            for h, f, o, n in zip(
                rows["hash"].tolist(), rows["file"].tolist(), rows["offset"].tolist(), rows["length"].tolist(),
                strict=True,
            )
        ]  # fmt: skip

    def _record(self, k: int) -> TensorRecord:
        view = self.view(self._names[k])
        return TensorRecord(view.name, view.global_shape, view.dtype, [view.shard(j) for j in range(len(view))])


@dataclass(slots=True)
class Index:
    step: int
    world_size: int
    layout: dict  # {"pp": .., "dp": .., "tp": ..}
    parent: str | None
    created: float
    tensors: Mapping[str, TensorRecord]  # a dict, or a TensorTable over `tables` (an index read or committed)
    trainer_state: dict  # JSON-able: step, loader position, ...
    rng: dict[int, dict[str, np.ndarray]]  # rank -> {"cpu": uint8 array, ...}
    chunk_bytes: int = CHUNK_BYTES  # where shards were cut into chunks: all but a shard's last are this long
    digest: str = ""  # the root digest of what was read ("sha256:<hex>"); "" for an index not yet written
    tables: Tables | None = None  # the tables it was read from or built as (what is written and digested)

    @property
    def version(self) -> int:
        return self.tables.attrs["version"] if self.tables is not None else VERSION

    def files(self) -> set[str]:
        if self.tables is not None:
            names = self.tables.strings["files"]
            return {names[k].decode() for k in np.unique(self.tables.chunks["file"]).tolist()}
        return {c.file for t in self.tensors.values() for s in t.shards for c in s.chunks}

    def total_bytes(self) -> int:
        if self.tables is not None:
            return int(self.tables.chunks["length"].sum())
        return sum(c.length for t in self.tensors.values() for s in t.shards for c in s.chunks)

    def stored_bytes(self) -> int:
        """The bytes of its distinct chunk locations (file, offset, length): what its data files hold for it. A
        chunk referenced by several shards (identical content: content addressing stores it once) counts once,
        so this is at most total_bytes(), and far less when deduplication expands the checkpoint."""
        if self.tables is None:
            return sum(n for _, _, n in {(c.file, c.offset, c.length) for t in self.tensors.values()
                                         for s in t.shards for c in s.chunks})  # fmt: skip
        c = self.tables.chunks
        if not len(c):
            return 0
        order = np.lexsort((c["length"], c["offset"], c["file"]))
        f, o, n = c["file"][order], c["offset"][order], c["length"][order]
        new = np.ones(len(c), dtype=bool)
        new[1:] = (f[1:] != f[:-1]) | (o[1:] != o[:-1]) | (n[1:] != n[:-1])
        return int(n[new].sum())

    def chunk_count(self) -> int:
        if self.tables is not None:
            return len(self.tables.chunks)
        return sum(len(s.chunks) for t in self.tensors.values() for s in t.shards)


def _padded(rows, maxd: int) -> np.ndarray:
    """Rows of up to maxd ints, padded with -1: filled per row length from one flat iterator (a list per row
    cost 4 of a 7 s commit at 128 ranks of a sharded 70 B model)."""
    out = np.full((len(rows), maxd), -1, dtype=np.int64)
    lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    for k in np.unique(lengths).tolist():
        if k:
            at = np.flatnonzero(lengths == k)
            same = rows if len(at) == len(rows) else [rows[i] for i in at.tolist()]
            flat = np.fromiter(itertools.chain.from_iterable(same), dtype=np.int64, count=len(at) * k)
            out[at, :k] = flat.reshape(len(at), k)
    return out


def _attrs(step, world_size, layout, parent, created, trainer_state, chunk_bytes) -> dict:
    return {
        "format": FORMAT,
        "version": VERSION,
        "hash_algorithm": HASH_ALGORITHM,
        "chunk_bytes": chunk_bytes,
        "step": step,
        "world_size": world_size,
        "layout": json.dumps(layout),
        "parent": parent or "",
        "created": float(created),
        "trainer_state": json.dumps(trainer_state),
    }


def _rng_tables(rng: dict[int, dict[str, np.ndarray]]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    ranks = sorted(rng)
    return np.array(ranks, dtype=np.int64), {
        f"rng_{key}": np.stack([np.asarray(rng[r][key], dtype=np.uint8) for r in ranks])
        for key in sorted({k for states in rng.values() for k in states})
    }


def _tables_of(index: Index) -> Tables:
    """The index as the normalised tables that are written and digested (docs/checkpoint-format.md)."""
    files = sorted(index.files())
    file_id = {f: i for i, f in enumerate(files)}
    names = sorted(index.tensors)
    recs = [index.tensors[n] for n in names]
    for r in recs:
        if r.dtype not in DTYPE_SIZES:
            raise ValueError(f"tensor {r.name}: dtype {r.dtype} cannot be checkpointed (no plain element bytes)")
    maxd = max([1, *(len(r.global_shape) for r in recs)])
    shards = [s for r in recs for s in r.shards]
    shard_counts = np.array([len(r.shards) for r in recs], dtype=np.int64)
    chunk_counts = np.array([len(s.chunks) for s in shards], dtype=np.int64)
    rng_rank, rng = _rng_tables(index.rng)
    return Tables(
        attrs=_attrs(
            index.step,
            index.world_size,
            index.layout,
            index.parent,
            index.created,
            index.trainer_state,
            index.chunk_bytes,
        ),
        strings={
            "files": [f.encode() for f in files],
            "tensor_name": [n.encode() for n in names],
            "tensor_dtype": [r.dtype.encode() for r in recs],
        },
        ints={
            "tensor_ndim": np.array([len(r.global_shape) for r in recs], dtype=np.int64),
            "tensor_shape": _padded([r.global_shape for r in recs], maxd),
            "tensor_shard_start": (np.cumsum(shard_counts) - shard_counts).astype(np.int64),
            "tensor_shard_count": shard_counts,
            "shard_offset": _padded([s.offset for s in shards], maxd),
            "shard_shape": _padded([s.shape for s in shards], maxd),
            "shard_chunk_start": (np.cumsum(chunk_counts) - chunk_counts).astype(np.int64),
            "shard_chunk_count": chunk_counts,
            "rng_rank": rng_rank,
        },
        chunks=np.array(
            [(c.hash.encode(), file_id[c.file], c.offset, c.length) for sh in shards for c in sh.chunks],
            dtype=CHUNK_DTYPE,
        ),
        rng=rng,
    )


@dataclass(slots=True)
class Rows:
    """One rank's pieces of a save, column by column, as it sends them to rank 0 (a few arrays to pickle
    instead of one tuple per piece and one object per chunk). Row k is the piece `names[k]` at `offset[k]` of
    shape `shape[k]` (both padded with -1 to the rank's widest tensor), its bytes the next `counts[k]` rows of
    `chunks`, whose "file" column indexes `files`."""

    names: list[str]
    tensors: dict[str, tuple[tuple[int, ...], str]]  # name -> (global shape, dtype name)
    offset: np.ndarray  # (n, d) int64
    shape: np.ndarray  # (n, d) int64
    counts: np.ndarray  # (n,) int64
    files: list[str]
    chunks: np.ndarray  # CHUNK_DTYPE


def rows_of(rows: list[tuple]) -> Rows:
    """A rank's rows `(name, global shape, dtype, offset, shape, chunk refs)` as columns."""
    if rows:
        names, gshapes, dtypes, offsets, shapes, refs = zip(*rows, strict=True)
    else:
        names = gshapes = dtypes = offsets = shapes = refs = ()
    tensors = dict(zip(names, zip(gshapes, dtypes, strict=True), strict=True))
    d = max([1, *(len(g) for g, _ in tensors.values())])
    flat = [c for r in refs for c in r]
    files = sorted({c.file for c in flat})
    file_id = {f: i for i, f in enumerate(files)}
    chunks = np.empty(len(flat), dtype=CHUNK_DTYPE)
    chunks["hash"] = np.array([c.hash for c in flat], dtype="S32") if flat else np.empty(0, "S32")
    chunks["file"] = np.fromiter((file_id[c.file] for c in flat), dtype=np.int64, count=len(flat))
    chunks["offset"] = np.fromiter((c.offset for c in flat), dtype=np.int64, count=len(flat))
    chunks["length"] = np.fromiter((c.length for c in flat), dtype=np.int64, count=len(flat))
    return Rows(
        list(names),
        tensors,
        _padded(offsets, d),
        _padded(shapes, d),
        np.fromiter(map(len, refs), dtype=np.int64, count=len(rows)),
        files,
        chunks,
    )


def index_of_rows(
    gathered: list[dict],
    *,
    step: int,
    layout: dict,
    parent: str | None,
    created: float,
    trainer_state: dict,
    chunk_bytes: int = CHUNK_BYTES,
) -> Index:
    """The index a save commits, from every rank's Rows: tensors sorted by name, a tensor's shards in the
    order the ranks sent them. The same tables _tables_of makes from records, merged column by column without
    an object per piece or chunk (a sharded 70 B model at 4096 ranks has 7 M pieces)."""
    parts = [p["rows"] for p in gathered]
    meta: dict[str, tuple[tuple[int, ...], str]] = {}
    for part in parts:
        meta.update(part.tensors)
    tensor_names = sorted(meta)
    for n in tensor_names:
        if meta[n][1] not in DTYPE_SIZES:
            raise ValueError(f"tensor {n}: dtype {meta[n][1]} cannot be checkpointed (no plain element bytes)")
    maxd = max([1, *(len(meta[n][0]) for n in tensor_names)])
    name_id = {n: k for k, n in enumerate(tensor_names)}
    n_rows = sum(len(part.names) for part in parts)
    ids = np.fromiter(
        map(name_id.__getitem__, itertools.chain.from_iterable(part.names for part in parts)),
        dtype=np.int64,
        count=n_rows,
    )

    def stacked(column: str) -> np.ndarray:
        out = np.full((n_rows, maxd), -1, dtype=np.int64)
        at = 0
        for part in parts:
            block = getattr(part, column)
            out[at : at + len(block), : block.shape[1]] = block
            at += len(block)
        return out

    files = sorted({f for part in parts for f in part.files})
    file_id = {f: i for i, f in enumerate(files)}
    all_chunks = np.concatenate([part.chunks for part in parts]) if parts else np.empty(0, CHUNK_DTYPE)
    # each rank's file numbers into the merged file table's, through one table of every rank's
    luts = [np.array([file_id[f] for f in part.files], dtype=np.int32) for part in parts]
    lut_base = np.cumsum([0, *(len(lut) for lut in luts)])[:-1]
    if len(all_chunks):
        chunk_base = np.repeat(lut_base, [len(part.chunks) for part in parts])
        all_chunks["file"] = np.concatenate(luts)[chunk_base + all_chunks["file"]]
    counts = np.concatenate([part.counts for part in parts]) if parts else np.empty(0, np.int64)
    chunk_of = np.cumsum(counts) - counts  # where each row's chunks start, in the order received
    # tensors by name (a stable sort keeps each tensor's shards in the order received: radix for small ids)
    order = np.argsort(ids.astype(np.uint16 if len(tensor_names) <= 1 << 16 else np.int64), kind="stable")
    ids, counts = ids[order], counts[order]
    starts = np.cumsum(counts) - counts
    picks = np.repeat(chunk_of[order] - starts, counts) + np.arange(int(counts.sum()), dtype=np.int64)
    shard_counts = np.bincount(ids, minlength=len(tensor_names)).astype(np.int64)
    rng_rank, rng = _rng_tables({p["rank"]: p["rng"] for p in gathered})
    tables = Tables(
        attrs=_attrs(step, len(gathered), layout, parent, created, trainer_state, chunk_bytes),
        strings={
            "files": [f.encode() for f in files],
            "tensor_name": [n.encode() for n in tensor_names],
            "tensor_dtype": [meta[n][1].encode() for n in tensor_names],
        },
        ints={
            "tensor_ndim": np.array([len(meta[n][0]) for n in tensor_names], dtype=np.int64),
            "tensor_shape": _padded([meta[n][0] for n in tensor_names], maxd),
            "tensor_shard_start": (np.cumsum(shard_counts) - shard_counts).astype(np.int64),
            "tensor_shard_count": shard_counts,
            "shard_offset": stacked("offset")[order],
            "shard_shape": stacked("shape")[order],
            "shard_chunk_start": starts.astype(np.int64),
            "shard_chunk_count": counts,
            "rng_rank": rng_rank,
        },
        chunks=all_chunks[picks],
        rng=rng,
    )
    return Index(
        step, len(gathered), layout, parent, created, TensorTable(tables), trainer_state,
        {p["rank"]: p["rng"] for p in gathered}, chunk_bytes, tables=tables,
    )  # fmt: skip


def write_index(path: Path, index: Index) -> str:
    """Write to `path` (a temporary name) and fsync; the caller renames it into place and writes the returned
    root digest to DIGEST beside it.

    Flat tables, so the number of HDF5 objects does not grow with the model: tensors, their shards and the
    shards' chunks are rows of three tables linked by start/count columns (docs/checkpoint-format.md)."""
    import h5py

    tables = index.tables if index.tables is not None else _tables_of(index)
    digest = root_digest(tables)
    str_dt = h5py.string_dtype()
    with h5py.File(path, "w", locking=False) as f:
        f.attrs.update({**tables.attrs, "digest": digest})
        for name in STRING_TABLES:
            f.create_dataset(name, data=np.array([x.decode() for x in tables.strings[name]], dtype=str_dt))
        for name, data in tables.ints.items():
            f.create_dataset(name, data=data if name != "tensor_ndim" else data.astype(np.int32))
        f.create_dataset("chunks", data=tables.chunks)
        for name, data in tables.rng.items():
            f.create_dataset(name, data=data)
        f.flush()
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return digest


def write_digest_file(step_dir: Path, digest: str) -> None:
    """DIGEST: one line, the root digest; what a signature covers without parsing HDF5. Durable before return."""
    atomic_write(step_dir / DIGEST, digest + "\n")


class _Damaged(Exception):
    """The index cannot be parsed into tables at all."""


def _attr(f, name: str, kind: type):
    if name not in f.attrs:
        raise _Damaged(f"attribute {name} is missing")
    value = f.attrs[name]
    if kind is str:
        if isinstance(value, (bytes, np.bytes_)):
            try:
                return bytes(value).decode("utf-8")
            except UnicodeDecodeError:
                raise _Damaged(f"attribute {name} is not UTF-8 text") from None
        if isinstance(value, str):
            return value
    elif isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)):
        if not _INT64_MIN <= int(value) <= _INT64_MAX:  # e.g. a uint64: the digest packs integers as int64
            raise _Damaged(f"attribute {name} is {int(value)}, outside the signed 64-bit range")
        return int(value) if kind is int else float(value)
    elif kind is float and isinstance(value, (float, np.floating)):
        return float(value)
    raise _Damaged(f"attribute {name} is a {type(value).__name__}, not {kind.__name__}")


def _dataset(f, name: str):
    """The table `name`, refusing links, virtual or external storage (they would make h5py read other files),
    and any table whose reading could cost more than the file's own bytes: hpcscale writes every table
    uncompressed in one piece, so a chunked (compressed, filtered) table, or one that stores fewer bytes than it
    claims (its elements would come from a fill value), is not an index's, and is refused from its metadata,
    before a byte of it is read or expanded. The sum over tables is bounded by the file's size (_read_tables)."""
    import h5py

    link = f.get(name, getlink=True)
    if link is None:
        raise _Damaged(f"table {name} is missing")
    if not isinstance(link, h5py.HardLink) or not isinstance(f[name], h5py.Dataset):
        raise _Damaged(f"{name} is not a table stored in the index")
    ds = f[name]
    if ds.is_virtual or ds.external:
        raise _Damaged(f"table {name} refers to data outside the index")
    if ds.shape is None or ds.size * ds.dtype.itemsize > MAX_TABLE_BYTES:
        raise _Damaged(f"table {name} is {ds.shape} of {ds.dtype}: not a size an index has")
    if ds.chunks is not None or ds.compression is not None or ds.id.get_create_plist().get_nfilters():
        raise _Damaged(f"table {name} is stored chunked or compressed: an index's tables are stored whole")
    if ds.id.get_storage_size() < ds.size * ds.dtype.itemsize:
        raise _Damaged(f"table {name} claims {ds.size * ds.dtype.itemsize} bytes but stores {ds.id.get_storage_size()}")
    return ds


def _read_tables(f) -> Tables:
    import h5py

    attrs = {name: _attr(f, name, kind) for name, kind in ATTRS}
    names = [*STRING_TABLES, *INT_TABLES, "rng_rank", "chunks", *sorted(k for k in f if k.startswith("rng_"))]
    claimed = sum(ds.size * ds.dtype.itemsize for ds in (_dataset(f, n) for n in dict.fromkeys(names)))
    size = f.id.get_filesize()
    if claimed > size:  # every table is stored whole in the file: together they cannot exceed it
        raise _Damaged(f"its tables claim {claimed} bytes, more than the {size}-byte file holds")
    strings = {}
    budget = size  # what the string tables' text may add up to: variable-length strings live in the file too,
    for name in STRING_TABLES:  # but many elements can name one large heap object: read a few at a time
        ds = _dataset(f, name)
        if ds.ndim != 1 or (h5py.check_string_dtype(ds.dtype) is None and ds.dtype.kind != "S"):
            raise _Damaged(f"table {name} is not a list of strings")
        values: list[bytes] = []
        for start in range(0, ds.shape[0], STRING_SLICE):
            part = [x.encode() if isinstance(x, str) else bytes(x) for x in ds[start : start + STRING_SLICE]]
            budget -= sum(len(x) for x in part)
            if budget < 0:
                raise _Damaged(f"its string tables hold more text than the {size}-byte file: not an index")
            values += part
        strings[name] = values
    ints = {}
    for name in (*INT_TABLES, "rng_rank"):
        ds = _dataset(f, name)
        if ds.dtype.kind not in "iu":
            raise _Damaged(f"table {name} holds {ds.dtype}, not integers")
        ints[name] = np.asarray(ds[()], dtype=np.int64)
    ds = _dataset(f, "chunks")
    if ds.dtype != CHUNK_DTYPE:
        raise _Damaged(f"the chunk table holds {ds.dtype}, not {CHUNK_DTYPE}")
    chunks = np.asarray(ds[()], dtype=CHUNK_DTYPE)
    rng = {}
    for name in sorted(k for k in f if k.startswith("rng_") and k != "rng_rank"):
        ds = _dataset(f, name)
        if ds.dtype != np.uint8:
            raise _Damaged(f"RNG table {name} holds {ds.dtype}, not uint8")
        rng[name] = np.asarray(ds[()])
    return Tables(attrs, strings, ints, chunks, rng)


def _index_of(t: Tables) -> Index:
    """The index over tables that passed `structure_problems` (so every row reference in them is in range)."""
    ranks = t.ints["rng_rank"].tolist()
    rng: dict[int, dict[str, np.ndarray]] = {r: {} for r in ranks}
    for key, data in t.rng.items():
        for row, r in enumerate(ranks):
            rng[r][key.removeprefix("rng_")] = data[row]
    a = t.attrs
    return Index(
        a["step"],
        a["world_size"],
        parsed_layout(t),
        a["parent"] or None,
        a["created"],
        TensorTable(t),
        parsed_trainer_state(t),
        rng,
        chunk_bytes=a["chunk_bytes"],
        tables=t,
    )


@dataclass(frozen=True, slots=True)
class IndexProblem:
    file: str  # INDEX or DIGEST: the file in the step directory that is wrong
    problem: str

    def __str__(self) -> str:
        return f"{self.file}: {self.problem}"


@dataclass(slots=True)
class IndexExamination:
    index: Index | None  # None when its structure is unusable: nothing it says can be followed
    problems: list[IndexProblem]
    digest: str | None = None  # the root digest of what the index holds, when it could be read


def examine_index(path: Path) -> IndexExamination:
    """Every check of an index short of reading data (integrity.py): format and version, the root digest
    against the `digest` attribute and the DIGEST file, and the structure. Never raises for a bad index."""
    import h5py

    def fail(problem: str) -> IndexExamination:
        return IndexExamination(None, [IndexProblem(INDEX, problem)])

    try:  # the index others may have replaced: a FIFO or device there is refused, never waited on (HDF5 would)
        fd = open_regular(path, follow_symlinks=False)[0]
    except OSError as e:
        return fail(f"cannot be read ({file_problem(e, 'checkpoint index')})")
    try:
        with fd_file(fd) as handle, h5py.File(handle, "r", locking=False) as f:
            if f.attrs.get("format") != FORMAT:
                return fail("not an hpcscale checkpoint index")
            version = f.attrs.get("version")
            if version == 1:
                return fail(
                    "index version 1 (hpcscale 0.1.0) has no root digest, so its structure cannot be "
                    'authenticated; this version refuses it (docs/checkpoint-format.md, "Versions")'
                )
            if not isinstance(version, (int, np.integer)) or int(version) not in READ_VERSIONS:
                return fail(
                    f"index version {str(version)[:40]} is not supported (this hpcscale reads versions "
                    f"{' and '.join(map(str, READ_VERSIONS))})"
                )
            algorithm = f.attrs.get("hash_algorithm")
            if algorithm != HASH_ALGORITHM:
                return fail(f"chunks hashed with {str(algorithm)[:40]!r}, which this version cannot check")
            stored = f.attrs.get("digest")
            tables = _read_tables(f)
    except _Damaged as e:
        return fail(f"damaged index ({e})")
    except Exception as e:  # h5py raises many types for a damaged file; each means the same here
        return fail(f"damaged index ({type(e).__name__}: {str(e)[:200]})")
    finally:
        os.close(fd)
    try:
        digest = root_digest(tables)
    except Exception as e:  # _attr bounds what the digest packs; anything else is still a damaged index
        return fail(f"damaged index ({type(e).__name__}: {str(e)[:200]})")
    # The digest first: an index edited without recomputing it is refused before any structure work (which
    # grows with the number of shards), and nothing it says is followed.
    problems = []
    if not valid_digest_text(stored):
        problems.append(IndexProblem(INDEX, "the root digest attribute is missing or malformed"))
    elif stored != digest:
        problems.append(
            IndexProblem(
                INDEX, f"root digest mismatch: recorded {stored}, contents hash to {digest} (edited or damaged)"
            )
        )
    try:  # bounded, and a FIFO or device there is refused, never waited on
        recorded = read_bounded(path.parent / DIGEST, max_bytes=256, what="digest").decode("ascii", "replace").strip()
        if recorded != digest:
            problems.append(IndexProblem(DIGEST, f"says {recorded[:80]!r}, the index's contents hash to {digest}"))
    except BadInput as e:
        problems.append(IndexProblem(DIGEST, f"cannot be read ({e})"))
    if problems:
        return IndexExamination(None, problems, digest)
    try:
        structure = structure_problems(tables, dir_step=step_of(path.parent.name))
        index = None if structure else _index_of(tables)
    except Exception as e:  # the checks never raise by design; if one did, the index is still just refused
        structure, index = [f"unexpected {type(e).__name__} while checking the structure: {str(e)[:200]}"], None
    problems += [IndexProblem(INDEX, p) for p in structure]
    if index is not None:
        index.digest = digest
    return IndexExamination(index, problems, digest)


def read_index(path: Path) -> Index:
    """Parse an index and check it whole (root digest, DIGEST file, structure); VerificationFailure (exit 3)
    naming the first problems if it is damaged, edited or not an index."""
    exam = examine_index(path)
    if exam.problems or exam.index is None:
        shown = "; ".join(str(p) for p in exam.problems[:3])
        more = f" (and {len(exam.problems) - 3} more)" if len(exam.problems) > 3 else ""
        raise VerificationFailure(f"{path.parent}: {shown}{more}")
    return exam.index


REFUSED = "refused"  # under the checkpoint root: refused checkpoints set aside at a fallback (ckpt/tier.py)


def committed_steps(root: Path) -> list[int]:
    """Steps with a committed directory (index present), newest first."""
    if not root.is_dir():
        return []
    steps = [s for p in root.iterdir() if (s := step_of(p.name)) is not None and (p / INDEX).is_file()]
    return sorted(steps, reverse=True)


@contextlib.contextmanager
def fd_file(fd: int):
    """What h5py.File opens for the file open as `fd` (the one checked): its /proc/self/fd name, the same open
    file whatever `path` leads to meanwhile; a file object of it where there is no /proc."""
    if os.path.isdir("/proc/self/fd"):
        yield f"/proc/self/fd/{fd}"
        return
    with open(fd, "rb", closefd=False) as f:
        yield f


def open_data_file(path: Path) -> int:
    """A data file opened as load and verify open it (portable.files.open_regular): never through a symbolic
    link (O_NOFOLLOW), never blocking on a FIFO (O_NONBLOCK), and only a regular file. OSError otherwise."""
    return open_regular(path, follow_symlinks=False)[0]
