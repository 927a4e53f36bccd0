"""Integrity of a checkpoint index: what binds every chunk to its place, and what proves the index whole.

Chunk hashes prove a chunk's bytes, not where they belong: content addressing lets one stored chunk serve two
tensors, so the data files cannot say whose a chunk is. The index says it, and two independent layers make
the index itself trustworthy; `ckpt verify` and every load (`format.read_index`) run both.

1. Structure (`structure_problems`): the tables must describe a well-formed store on their own. Every run of
   rows partitions the table below it; every dtype is a known name with a known element size; every shard
   lies inside its tensor's global shape and the shards of a tensor tile it exactly as a grid (each shard one
   cell of the grid its boundaries cut, each cell one shard; checked with sorts, O(S log S)); every shard's
   chunks are exactly its bytes, cut at `chunk_bytes` (a chunk's position in the shard is its row's position
   in the run, so no gap, overlap or reordering fits); offsets are not negative; data files are named as the
   writer names them and are not newer than the checkpoint; trainer state and layout are bounded JSON
   objects; RNG tables have one uint8 row per rank. These catch a damaged index even when its digest was
   recomputed, and they make reading safe: no negative offset reaches a read, no buffer is larger than its
   chunks, and no element of a loaded or exported tensor is left unwritten. They run only on an index whose
   root digest matches (below): an edited index without a recomputed digest is refused before any of this.

2. Root digest (`root_digest`): sha256 over a canonical serialisation of what the checkpoint holds (the
   attributes, the tensor and shard tables, every chunk's hash and length, the RNG states), recorded in the
   index (`digest`) and in the small text file `DIGEST` beside it, which a signature can cover without parsing
   HDF5. A chunk is bound to its tensor, shard and position because its row enters the digest at exactly that
   place: swapping two tensors' chunk references, or editing a dtype, a shape or the trainer state, changes it.
   Since version 3 it leaves out where the bytes are stored (the data files, each chunk's file and offset, the
   tier's previous step): the same state has the same digest on every tier and after any deduplication, and a
   chunk's location needs no authentication, because every read hashes the chunk against its recorded hash
   (a location pointing at other bytes fails that check; one pointing at the same bytes reads the same state).
   sha256 rather than xxh128: xxh128 is built for speed, not against an adversary, and anyone can construct a
   second input with a given xxh128; a digest that a signature will vouch for must be collision resistant.
   The digest covers the index only (kilobytes to a few megabytes): the chunk hashes it covers already bind
   the data bytes, so it costs nothing per byte of data.

What neither layer stops: someone who rewrites data and index consistently and recomputes the digest (and
`DIGEST`). That is what a signature over `DIGEST` stops (cross-site exchange signs it). The exact canonical
input is in docs/checkpoint-format.md ("Root digest"); keep the two in step.
"""

from __future__ import annotations

import hashlib
import math
import re
import struct
from dataclasses import dataclass, field

import numpy as np

from hpcscale.errors import BadInput
from hpcscale.layout import ParallelDims
from hpcscale.util.bounded import loads_json

DIGEST_ALGORITHM = "sha256"
# The digest's input starts with its version's domain line: no input of one version is an input of another.
_DOMAINS = {2: b"hpcscale-checkpoint-index-digest-v2\n", 3: b"hpcscale-checkpoint-index-digest-v3\n"}
MAX_JSON_BYTES = 16 << 20  # trainer state and layout: far beyond any real one, small enough to refuse fast
MAX_OFFSET = 1 << 62  # no data file is this large; keeps offset + length inside int64
_DIGEST_TEXT = re.compile(r"^sha256:[0-9a-f]{64}$")
_DATA_FILE = re.compile(r"^step-(\d{8})/data/rank-\d{5}\.bin$")
_PARENT = re.compile(r"^step-(\d{8})$")
_RNG_KEY = re.compile(r"^rng_[a-z0-9]+$")
_HEX = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)

# Element sizes of the dtypes a checkpoint may hold (torch names). Sub-byte and quantized types have no plain
# row-major bytes and are refused at save.
DTYPE_SIZES = {
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2": 1,
    "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
    "float4_e2m1fn_x2": 1,
    "uint16": 2,
    "int16": 2,
    "float16": 2,
    "bfloat16": 2,
    "uint32": 4,
    "int32": 4,
    "float32": 4,
    "complex32": 4,
    "uint64": 8,
    "int64": 8,
    "float64": 8,
    "complex64": 8,
    "complex128": 16,
}

# Root attributes in digest order, with the type each must have.
ATTRS: tuple[tuple[str, type], ...] = (
    ("format", str),
    ("version", int),
    ("hash_algorithm", str),
    ("chunk_bytes", int),
    ("step", int),
    ("world_size", int),
    ("layout", str),
    ("parent", str),
    ("created", float),
    ("trainer_state", str),
)
STRING_TABLES = ("files", "tensor_name", "tensor_dtype")
INT_TABLES = (
    "tensor_ndim",
    "tensor_shape",
    "tensor_shard_start",
    "tensor_shard_count",
    "shard_offset",
    "shard_shape",
    "shard_chunk_start",
    "shard_chunk_count",
)
CHUNK_DTYPE = np.dtype([("hash", "S32"), ("file", "<i4"), ("offset", "<i8"), ("length", "<i8")])  # packed: 52 B
# Version 3 leaves out where things are stored: these fields, and each chunk's file and offset.
LOCATION_FIELDS = frozenset({"parent", "files"})
_CHUNK_CONTENT = np.dtype([("hash", "S32"), ("length", "<i8")])  # a chunk row as version 3 digests it: 40 B


@dataclass(slots=True)
class Tables:
    """An index's contents as stored, normalised to one type per field (strings as UTF-8 bytes, integer tables
    as int64, the chunk table as CHUNK_DTYPE, RNG tables as uint8): what the digest and the checks read."""

    attrs: dict[str, str | int | float]
    strings: dict[str, list[bytes]]  # STRING_TABLES
    ints: dict[str, np.ndarray]  # INT_TABLES and rng_rank, int64
    chunks: np.ndarray  # (C,) CHUNK_DTYPE
    rng: dict[str, np.ndarray] = field(default_factory=dict)  # "rng_cpu", ... -> (W, n) uint8


def _frame(data: bytes) -> bytes:
    return struct.pack("<Q", len(data)) + data


def _array_payload(a: np.ndarray) -> bytes:
    return struct.pack("<Q", a.ndim) + struct.pack(f"<{a.ndim}Q", *a.shape) + np.ascontiguousarray(a).tobytes()


def root_digest(t: Tables) -> str:
    """ "sha256:<hex>" over the canonical serialisation of `t` for its `version` (docs/checkpoint-format.md,
    "Root digest"): version 3 over what the checkpoint holds, version 2 also over where its bytes are stored.
    Raises ValueError for any other version."""
    version = t.attrs["version"]
    if version not in _DOMAINS:
        raise ValueError(f"no root digest is defined for index version {str(version)[:40]}")
    located = version == 2
    h = hashlib.sha256(_DOMAINS[version])

    def record(name: str, payload: bytes) -> None:
        if located or name not in LOCATION_FIELDS:
            h.update(_frame(name.encode()))
            h.update(_frame(payload))

    for name, kind in ATTRS:
        value = t.attrs[name]
        if kind is str:
            record(name, value.encode())
        elif kind is int:
            record(name, struct.pack("<q", value))
        else:
            record(name, struct.pack("<d", value))
    for name in STRING_TABLES:
        record(name, b"".join(_frame(x) for x in t.strings[name]))
    for name in INT_TABLES:
        record(name, _array_payload(t.ints[name].astype("<i8", copy=False)))
    chunks = t.chunks.astype(CHUNK_DTYPE, copy=False)
    if not located:
        content = np.empty(chunks.shape, _CHUNK_CONTENT)
        content["hash"], content["length"] = chunks["hash"], chunks["length"]
        chunks = content
    record("chunks", _array_payload(chunks))
    record("rng_rank", _array_payload(t.ints["rng_rank"].astype("<i8", copy=False)))
    for name in sorted(t.rng):
        record(name, _array_payload(t.rng[name]))
    return f"{DIGEST_ALGORITHM}:{h.hexdigest()}"


def valid_digest_text(text: object) -> bool:
    return isinstance(text, str) and _DIGEST_TEXT.match(text) is not None


def _json_object(text: str, source: str) -> tuple[dict | None, str | None]:
    try:
        value = loads_json(text, source=source, max_bytes=MAX_JSON_BYTES)
    except BadInput as e:
        return None, str(e)
    if not isinstance(value, dict):
        return None, f"{source}: a JSON object is required, not {type(value).__name__}"
    return value, None


def parsed_layout(t: Tables) -> dict | None:
    return _json_object(str(t.attrs["layout"]), "layout")[0]


def parsed_trainer_state(t: Tables) -> dict | None:
    return _json_object(str(t.attrs["trainer_state"]), "trainer_state")[0]


def _runs_partition(start: np.ndarray, count: np.ndarray, total: int) -> bool:
    """True when rows [start[i], start[i] + count[i]) follow one another from 0 and cover exactly `total` rows."""
    if (count < 0).any() or (count > total).any() or int(count.sum()) != total:  # bounded first: no wrap
        return False
    return bool((start == np.concatenate(([0], np.cumsum(count)[:-1])).astype(np.int64)).all())


def _decode(raw: bytes, what: str, problems: list[str]) -> str | None:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        problems.append(f"{what} {raw[:40]!r} is not UTF-8")
        return None


def _attr_problems(t: Tables, dir_step: int | None, out: list[str]) -> None:
    a = t.attrs
    if not 1 <= a["chunk_bytes"] <= 1 << 30:
        out.append(f"chunk_bytes {a['chunk_bytes']} is out of range")
    if a["step"] < 0:
        out.append(f"step {a['step']} is negative")
    if dir_step is not None and a["step"] != dir_step:
        out.append(f"the index is of step {a['step']}, in the directory of step {dir_step} (moved or replayed)")
    if a["world_size"] < 1:
        out.append(f"world_size {a['world_size']} is not positive")
    if not math.isfinite(a["created"]):
        out.append("created is not a finite time")
    layout, problem = _json_object(a["layout"], "layout")
    if problem:
        out.append(problem)
    elif layout is not None:
        try:  # every axis of the registry, as a run records it: dp_shard and any other when it is not 1
            dims = ParallelDims.from_dict(layout)
        except BadInput as e:
            out.append(f"layout {a['layout'][:80]} is not a parallel layout: {str(e)[:200]}")
        else:
            if dims.world_size != a["world_size"]:
                out.append(f"layout {a['layout'][:80]} does not multiply to world_size {a['world_size']}")
    _, problem = _json_object(a["trainer_state"], "trainer_state")
    if problem:
        out.append(problem)
    parent = _PARENT.match(a["parent"])
    if a["parent"] and (parent is None or int(parent.group(1)) >= a["step"]):
        out.append(f"parent {a['parent'][:80]!r} is not an earlier step directory")


def _rng_problems(t: Tables, out: list[str]) -> None:
    ranks = t.ints["rng_rank"]
    w = t.attrs["world_size"]
    if ranks.ndim != 1 or ranks.shape[0] != w or not np.array_equal(np.sort(ranks), np.arange(w)):
        out.append(f"rng_rank does not list each of the {w} ranks once")
        return
    for name, table in t.rng.items():
        if not _RNG_KEY.match(name):
            out.append(f"RNG table {name[:80]!r} has an unexpected name")
        elif table.ndim != 2 or table.shape[0] != ranks.shape[0]:
            out.append(f"{name} has shape {table.shape}, not one row per rank")


def _grid_tiled(owner: np.ndarray, lo: np.ndarray, hi: np.ndarray, gshape: np.ndarray, n_t: int) -> np.ndarray:
    """Per tensor: True when its non-empty shards (rows `owner`, boxes [lo, hi), every box inside its tensor's
    `gshape`, padded dimensions given as [0, 1) of 1) form a grid that covers the tensor exactly: along each
    dimension, the distinct shard boundaries cut [0, extent) into intervals, every shard is one interval per
    dimension (one cell), and every cell is one shard. That is an exact tiling (no element twice, none left
    out), checked with sorts: O(S log S) in the number of shards. It is what a writer produces: each rank's
    piece of a DTensor is a product of contiguous ranges of its mesh's Shard placements (rows, columns or a
    grid), in any layout it was saved from."""
    s = owner.shape[0]
    counts = np.bincount(owner, minlength=n_t).astype(np.int64)
    ok = np.ones(n_t, dtype=bool)
    cells = np.ones(n_t, dtype=np.int64)  # the grid's number of cells, capped at count + 1 (no overflow)
    key = np.zeros(s, dtype=np.int64)  # each shard's cell, numbered in mixed radix
    for d in range(lo.shape[1]):
        # each tensor's distinct boundaries along d, sorted, numbered from 0 within the tensor
        pts_owner = np.concatenate((owner, owner))
        pts = np.concatenate((lo[:, d], hi[:, d]))
        order = np.lexsort((pts, pts_owner))
        so, sp = pts_owner[order], pts[order]
        new = np.ones(2 * s, dtype=bool)
        new[1:] = (so[1:] != so[:-1]) | (sp[1:] != sp[:-1])
        distinct = np.cumsum(new) - 1  # global number of each distinct (tensor, boundary)
        group_start = np.ones(2 * s, dtype=bool)
        group_start[1:] = so[1:] != so[:-1]
        first_of_owner = np.zeros(n_t, dtype=np.int64)
        first_of_owner[so[group_start]] = distinct[group_start]
        rank = np.empty(2 * s, dtype=np.int64)
        rank[order] = distinct - first_of_owner[so]
        r_lo, r_hi = rank[:s], rank[s:]
        intervals = np.zeros(n_t, dtype=np.int64)
        np.maximum.at(intervals, owner, r_hi)  # the last boundary's number = intervals along d
        # the boundaries run from 0 to the extent, and every shard spans exactly one interval
        low = np.full(n_t, np.iinfo(np.int64).max, dtype=np.int64)
        np.minimum.at(low, owner, lo[:, d])
        high = np.zeros(n_t, dtype=np.int64)
        np.maximum.at(high, owner, hi[:, d])
        present = counts > 0
        ok &= ~present | ((low == 0) & (high == gshape[:, d]))
        bad = owner[r_hi != r_lo + 1]
        ok[bad] = False
        # mixed radix: key = sum over d of r_lo[d] * prod(intervals[e] for e < d); exact where it matters
        key += r_lo * np.minimum(cells, counts + 1)[owner]
        cells = np.minimum(cells * np.maximum(intervals, 1), counts + 1)
    ok &= (counts == 0) | (cells == counts)
    # every cell held by exactly one shard: (tensor, cell) pairs are distinct
    keep = ok[owner]
    pair = np.lexsort((key[keep], owner[keep]))
    ko, kk = owner[keep][pair], key[keep][pair]
    dup = (ko[1:] == ko[:-1]) & (kk[1:] == kk[:-1])
    ok[ko[1:][dup]] = False
    return ok


def _tensor_and_shard_problems(t: Tables, out: list[str]) -> np.ndarray:
    """Names, dtypes and shapes of the tensors; bounds, padding and chunk counts of their shards; the tiling.
    Per tensor in Python (over lists, not numpy scalars), per shard vectorised: a pass over S shards costs
    O(S log S), so an index of tens of thousands of shards is checked in well under a second. Returns each
    shard's size in bytes (0 where its tensor or itself failed a check)."""
    s, i = t.strings, t.ints
    n_t = len(s["tensor_name"])
    shard_off, shard_shape = i["shard_offset"], i["shard_shape"]
    n_s, width = shard_off.shape[0], shard_off.shape[1]
    ndims, gshapes = i["tensor_ndim"].tolist(), i["tensor_shape"].tolist()
    names: list[str | None] = [None] * n_t
    tvalid = np.zeros(n_t, dtype=bool)
    t_nd = np.zeros(n_t, dtype=np.int64)
    t_elt = np.zeros(n_t, dtype=np.int64)  # 0: unknown dtype (reported; its shards' chunks are not counted)
    t_volume = np.zeros(n_t, dtype=np.int64)
    g_pad = np.ones((n_t, width), dtype=np.int64)  # global shapes, the padding as extent 1
    prev_name = None
    for ti in range(n_t):
        name = _decode(s["tensor_name"][ti], "tensor name", out)
        if name is None:
            continue
        names[ti] = name
        if prev_name is not None and name <= prev_name:
            out.append(f"tensor {name}: the tensor table is not in strictly ascending name order")
        prev_name = name
        dtype = s["tensor_dtype"][ti].decode("utf-8", "replace")
        elt = DTYPE_SIZES.get(dtype)
        if elt is None:
            out.append(f"tensor {name}: unknown dtype {dtype[:40]!r}")
        nd = ndims[ti]
        if not 0 <= nd <= width:
            out.append(f"tensor {name}: ndim {nd} is out of range")
            continue
        gshape = gshapes[ti]
        if any(x < 0 for x in gshape[:nd]) or any(x != -1 for x in gshape[nd:]):
            out.append(f"tensor {name}: global shape {gshape} is invalid for {nd} dimensions")
            continue
        volume = math.prod(gshape[:nd])
        if volume * (elt or 1) > MAX_OFFSET:
            out.append(f"tensor {name}: global shape {gshape[:nd]} is impossibly large")
            continue
        tvalid[ti], t_nd[ti], t_elt[ti], t_volume[ti] = True, nd, elt or 0, volume
        g_pad[ti, :nd] = gshape[:nd]

    shard_bytes = np.zeros(n_s, dtype=np.int64)
    owner = np.repeat(np.arange(n_t, dtype=np.int64), i["tensor_shard_count"])  # runs partition: in order
    checked = tvalid[owner]  # shards of a tensor that failed above are not looked at
    pad = np.arange(width, dtype=np.int64)[None, :] >= t_nd[owner][:, None]
    bad_pad = checked & (((shard_off != -1) & pad) | ((shard_shape != -1) & pad)).any(axis=1)
    lo = np.where(pad, 0, shard_off)
    ext = np.where(pad, 1, shard_shape)
    g = g_pad[owner]
    with np.errstate(over="ignore"):  # g - lo wraps only where lo < 0, which is refused on its own
        outside = checked & ~bad_pad & ((lo < 0) | (ext < 0) | (ext > g - lo)).any(axis=1)
    good = checked & ~bad_pad & ~outside
    # inside its tensor, a shard's extents multiply to at most the tensor's volume (<= MAX_OFFSET): no overflow,
    # except on the way to a product that a zero extent makes 0, where wrapping does not change the result
    with np.errstate(over="ignore"):
        n = np.where(good, np.prod(np.where(good[:, None], ext, 0), axis=1), 0)
    shard_bytes[good] = n[good] * t_elt[owner][good]
    cb = t.attrs["chunk_bytes"]
    counted = good & (t_elt[owner] > 0)
    want = np.maximum(1, -(-shard_bytes // cb)) if cb > 0 else np.full(n_s, -1, dtype=np.int64)
    bad_count = counted & (i["shard_chunk_count"] != want)

    first = i["tensor_shard_start"]
    for sj in np.flatnonzero(bad_pad | outside | bad_count).tolist():
        ti = int(owner[sj])
        nd = int(t_nd[ti])
        where = (
            f"tensor {names[ti]}: shard {sj - int(first[ti])} "
            f"(offset {shard_off[sj][:nd].tolist()}, shape {shard_shape[sj][:nd].tolist()})"
        )
        if bad_pad[sj]:
            out.append(f"{where} has {width} dimensions padded wrongly for {nd}")
        elif outside[sj]:
            out.append(f"{where} lies outside the global shape {g_pad[ti][:nd].tolist()}")
        else:
            out.append(
                f"{where}: {int(i['shard_chunk_count'][sj])} chunks for {int(shard_bytes[sj])} bytes "
                f"(cut at {cb} bytes: {int(want[sj])})"
            )

    # the tiling: every shard of the tensor sound, and its non-empty ones an exact grid over its global shape
    tiled = tvalid.copy()
    tiled[owner[checked & ~good]] = False
    nonempty = good & (n > 0)
    tiled &= _grid_tiled(owner[nonempty], lo[nonempty], (lo + ext)[nonempty], g_pad, n_t)
    has_nonempty = np.bincount(owner[nonempty], minlength=n_t) > 0
    tiled &= has_nonempty | (t_volume == 0)
    for ti in np.flatnonzero(tvalid & ~tiled).tolist():
        nd = int(t_nd[ti])
        out.append(f"tensor {names[ti]}: its shards do not tile its global shape {g_pad[ti][:nd].tolist()}")
    return shard_bytes


def structure_problems(t: Tables, *, dir_step: int | None) -> list[str]:
    """Everything wrong with the tables' structure (see the module docstring); [] when they are well formed.
    `dir_step` is the step the checkpoint's directory is named for, when it is in one. Never raises."""
    out: list[str] = []
    _attr_problems(t, dir_step, out)
    s, i = t.strings, t.ints
    n_t = len(s["tensor_name"])
    shape_t, shard_off, shard_shape = i["tensor_shape"], i["shard_offset"], i["shard_shape"]
    if (
        len(s["tensor_dtype"]) != n_t
        or any(i[k].shape != (n_t,) for k in ("tensor_ndim", "tensor_shard_start", "tensor_shard_count"))
        or shape_t.ndim != 2
        or shape_t.shape[0] != n_t
        or shape_t.shape[1] < 1
        or shard_off.ndim != 2
        or shard_off.shape[1:] != shape_t.shape[1:]
        or shard_shape.shape != shard_off.shape
        or any(i[k].shape != (shard_off.shape[0],) for k in ("shard_chunk_start", "shard_chunk_count"))
        or t.chunks.ndim != 1
    ):
        return [*out, "the tensor, shard and chunk tables do not have matching lengths"]
    n_s, n_c = shard_off.shape[0], t.chunks.shape[0]
    if not _runs_partition(i["tensor_shard_start"], i["tensor_shard_count"], n_s):
        return [*out, "the tensors' runs of shards do not partition the shard table"]
    if not _runs_partition(i["shard_chunk_start"], i["shard_chunk_count"], n_c):
        return [*out, "the shards' runs of chunks do not partition the chunk table"]

    for raw in s["files"]:
        name = _decode(raw, "data file", out)
        m = _DATA_FILE.match(name) if name is not None else None
        if m is None:
            out.append(f"data file {raw[:80]!r} is not a data file name (step-N/data/rank-R.bin)")
        elif int(m.group(1)) > t.attrs["step"]:
            out.append(f"data file {name} belongs to a later checkpoint than step {t.attrs['step']}")
    if len(set(s["files"])) != len(s["files"]):
        out.append("the file table lists a file twice")

    chunks = t.chunks
    if n_c:
        hexes = np.frombuffer(chunks["hash"].tobytes(), dtype=np.uint8).reshape(n_c, 32)
        bad = np.flatnonzero(~np.isin(hexes, _HEX).all(axis=1))
        if bad.size:
            out.append(f"chunk row {int(bad[0])}: hash {chunks['hash'][bad[0]][:40]!r} is not 32 lowercase hex digits")
        bad = np.flatnonzero((chunks["file"] < 0) | (chunks["file"] >= len(s["files"])))
        if bad.size:
            out.append(f"chunk row {int(bad[0])}: file number {int(chunks['file'][bad[0]])} is not in the file table")
        bad = np.flatnonzero((chunks["offset"] < 0) | (chunks["offset"] > MAX_OFFSET))
        if bad.size:
            out.append(f"chunk row {int(bad[0])}: offset {int(chunks['offset'][bad[0]])} is out of range")

    shard_bytes = _tensor_and_shard_problems(t, out)
    if n_c and not out and t.attrs["chunk_bytes"] >= 1:
        # every chunk's length follows from its position in its shard: the shard's bytes cut at chunk_bytes
        cb = t.attrs["chunk_bytes"]
        counts = i["shard_chunk_count"]
        pos = np.arange(n_c, dtype=np.int64) - np.repeat(i["shard_chunk_start"], counts)
        want = np.minimum(cb, np.repeat(shard_bytes, counts) - pos * cb)
        bad = np.flatnonzero(chunks["length"] != want)
        if bad.size:
            k = int(bad[0])
            shard = int(np.searchsorted(np.cumsum(counts), k, side="right"))
            out.append(
                f"chunk row {k} (shard row {shard}): length {int(chunks['length'][k])}, "
                f"but the shard's bytes cut at {cb} give {int(want[k])} there"
            )
    _rng_problems(t, out)
    return out
