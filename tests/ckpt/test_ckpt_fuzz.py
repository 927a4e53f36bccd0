"""Property-based: mutate a real saved index (field edits, row swaps, truncated or extended tables, retyped or
deleted tables, garbage attributes, integer attributes outside int64: uint64, huge, negative) and check what
`ckpt verify` and a load make of it.

- `ckpt verify` exits 0 or 3, never with a traceback;
- a load never raises, and never needs its last-resort catch (every problem is a named check's);
- verify and load agree: what verify refuses, load refuses;
- without a recomputed digest, a checkpoint that verifies loads exactly the saved tensors;
- with the digest recomputed after the edit (someone who knows the format), whatever loads is fully written:
  loading into two differently filled targets gives the same bytes, so no element is left as it was.

In one process (a 1-rank gloo group, the checkpoint saved through the library's writer with tensors cut into
several shards of several chunks), so a few hundred mutations take well under a minute.

Crafted checkpoints (tests/helpers/ckpt_craft.py: any names, dtypes, grid shards with empty ones, chunks
deduplicated so far that a few stored bytes declare more than the disk holds; sometimes hand-edited sizes,
offsets, lengths or duplicated chunk references, resealed): `ckpt verify` and `ckpt export` never traceback and
never allocate past a bound (RLIMIT_AS), and an export holds exactly what was crafted or is refused, naming why.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
from conftest import REPO
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(REPO / "tests" / "helpers"))
from ckpt_tamper import fuzz_tensors, replace_table, reseal, save_in_process

from hpcscale.ckpt.integrity import INT_TABLES, STRING_TABLES

TABLES = [*STRING_TABLES, *INT_TABLES, "chunks", "rng_rank", "rng_cpu"]  # every table a mutation may hit
ATTRS = [
    "format",
    "version",
    "hash_algorithm",
    "chunk_bytes",
    "step",
    "world_size",
    "layout",
    "parent",
    "created",
    "trainer_state",
    "digest",
]
INTS = st.one_of(
    st.integers(-3, 3000),
    st.sampled_from([-1, 0, 1, 1023, 1024, 1025, 2**31 - 1, 2**31, 2**62, 2**63 - 1, -(2**63)]),
    st.integers(-(2**63), 2**63 - 1),
)
TEXT = st.one_of(
    st.text(max_size=40),
    st.sampled_from(
        [
            "float32",
            "int32",
            "bfloat16",
            "float16",
            "complex32",
            "int64",
            "float64",
            "bits8",
            "model/rows",
            "model/cols",
            "step-00000001/data/rank-00000.bin",
            "step-00000002/data/rank-00000.bin",
            "../../etc/passwd",
        ]
    ),
)
# Integers an h5py attribute can hold that the format's int64 cannot: uint64 (h5py stores a Python int above
# 2**63 - 1 as one), the most negative int64, and ones too large for any HDF5 integer (h5py refuses to store them).
OUT_OF_RANGE = st.sampled_from(
    [np.uint64(2**64 - 1), np.uint64(2**63), 2**64 - 1, 2**63, np.int64(-(2**63)), -1, 2**70, -(2**70)]
)
INT_ATTRS = ["version", "chunk_bytes", "step", "world_size", "created"]


ATTR_VALUES = st.one_of(
    INTS,
    OUT_OF_RANGE,
    st.floats(allow_nan=True, allow_infinity=True),
    TEXT,
    st.binary(max_size=40).map(np.bytes_),
    st.sampled_from(
        [
            '{"pp": 1, "dp": 1, "tp": 1}',
            '{"pp": 1, "dp": 2, "tp": 1}',
            '{"step": 1}',
            "[]",
            "{",
            "1e999",
            '{"a": NaN}',
            "step-00000000",
            "xxh128",
            "hpcscale-checkpoint",
        ]
    ),
)


def _mutate(f: h5py.File, data: st.DataObject) -> None:
    kind = data.draw(st.sampled_from(["cell", "swap", "truncate", "extend", "attr", "int-attr", "retype", "delete"]))
    if kind == "int-attr":
        f.attrs[data.draw(st.sampled_from(INT_ATTRS))] = data.draw(OUT_OF_RANGE)
        return
    if kind == "attr":
        name = data.draw(st.sampled_from(ATTRS))
        if data.draw(st.booleans()) and name in f.attrs:
            del f.attrs[name]
        else:
            f.attrs[name] = data.draw(ATTR_VALUES)
        return
    name = data.draw(st.sampled_from(TABLES))
    if name not in f:
        return
    arr = f[name][()]
    if kind == "delete":
        del f[name]
        return
    if kind == "retype":
        target = data.draw(st.sampled_from(["int32", "uint64", "float64", "uint8", "string"]))
        if arr.dtype.names:
            arr = arr["offset"]
        if target == "string":
            replace_table(f, name, np.array([str(x) for x in arr.reshape(-1)], dtype=h5py.string_dtype()))
        else:
            replace_table(f, name, arr.astype(target) if arr.dtype.kind in "iuf" else np.zeros(arr.shape, target))
        return
    rows = arr.shape[0] if arr.ndim else 0
    if kind == "truncate":
        replace_table(f, name, arr[: data.draw(st.integers(0, max(rows - 1, 0)))])
        return
    if kind == "extend":
        replace_table(f, name, np.concatenate([arr, arr[: data.draw(st.integers(1, max(rows, 1)))]]))
        return
    if rows == 0:
        return
    i = data.draw(st.integers(0, rows - 1))
    if kind == "swap":
        j = data.draw(st.integers(0, rows - 1))
        arr[[i, j]] = arr[[j, i]]
    elif arr.dtype.names:  # the chunk table: one field of one row
        field = data.draw(st.sampled_from(arr.dtype.names))
        if field == "hash":
            arr["hash"][i] = data.draw(st.one_of(st.binary(max_size=32), st.sampled_from(list(arr["hash"]))))
        else:
            info = np.iinfo(arr.dtype[field])
            arr[field][i] = data.draw(INTS.filter(lambda v: info.min <= v <= info.max))
    elif arr.dtype.kind in "OS":
        arr = np.array(list(arr), dtype=object)
        arr[i] = data.draw(TEXT)
        arr = np.array([x.decode("utf-8", "replace") if isinstance(x, bytes) else x for x in arr], h5py.string_dtype())
    else:
        info = np.iinfo(arr.dtype)
        value = data.draw(INTS.filter(lambda v: info.min <= v <= info.max))
        if arr.ndim == 2:
            arr[i, data.draw(st.integers(0, arr.shape[1] - 1))] = value
        else:
            arr[i] = value
    replace_table(f, name, arr)


class Store:
    def __init__(self, step: Path, pristine: dict[str, bytes], manager, log: list[str]):
        self.step, self.pristine, self.manager, self.log = step, pristine, manager, log

    def __repr__(self) -> str:  # hypothesis prints it with every falsifying example
        return f"Store({self.step})"


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    import torch.distributed as dist

    from hpcscale.ckpt.manager import CheckpointManager
    from hpcscale.layout import ParallelDims

    root = tmp_path_factory.mktemp("fuzz") / "ckpt"
    save_in_process(root, 1, fuzz_tensors())
    step = root / "step-00000001"
    pristine = {name: (step / name).read_bytes() for name in ("index.h5", "DIGEST")}
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    log: list[str] = []
    try:
        manager = CheckpointManager(root, dims=ParallelDims(pp=1, dp=1, tp=1), rank=0, log=log.append)
        yield Store(step, pristine, manager, log)
    finally:
        dist.destroy_process_group()


def _verify_exit_code(step: Path) -> int:
    from click.testing import CliRunner

    from hpcscale.cli.main import cli

    result = CliRunner().invoke(cli, ["ckpt", "verify", str(step)])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exc_info
    assert result.exit_code in (0, 3), result.output
    return result.exit_code


def _load(manager, log: list[str], fill: float):
    import torch

    targets = {k: torch.full_like(v, fill) for k, v in fuzz_tensors().items()}
    log.clear()
    restored = manager.load_latest(targets)  # raising here fails the property
    assert not any("unexpected" in line for line in log), log  # a named check caught it, not the last resort
    return restored, targets


def _bytes(t) -> bytes:
    import torch

    return bytes(t.reshape(-1).contiguous().view(torch.uint8).numpy())


def _run(store, data: st.DataObject, *, sealed: bool) -> None:
    import torch

    step, pristine, manager, log = store.step, store.pristine, store.manager, store.log
    for name, content in pristine.items():
        (step / name).write_bytes(content)
    try:
        with h5py.File(step / "index.h5", "r+", locking=False) as f:
            for _ in range(data.draw(st.integers(1, 3))):
                _mutate(f, data)
    except (TypeError, ValueError, OSError, KeyError):
        assume(False)  # h5py refused to store the mutation itself: nothing to check
    if sealed:
        assume(reseal(step))
    code = _verify_exit_code(step)
    restored, targets = _load(manager, log, 0.0)
    if code == 3:
        assert restored is None, "verify refused the checkpoint but a load accepted it"
        return
    if not sealed:
        assert restored is not None and restored.step == 1, log
        assert all(torch.equal(targets[k], v) for k, v in fuzz_tensors().items())
    elif restored is not None:
        again, others = _load(manager, log, 1.0)
        assert again is not None
        assert all(_bytes(targets[k]) == _bytes(others[k]) for k in targets), "an element was left unwritten"


FUZZ = settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@FUZZ
@given(data=st.data())
def test_mutated_index_verifies_only_if_it_loads_the_saved_tensors(store, data):
    _run(store, data, sealed=False)


@FUZZ
@given(data=st.data())
def test_mutated_index_with_a_recomputed_digest_never_loads_unwritten_memory(store, data):
    _run(store, data, sealed=True)


@settings(deadline=None, max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_index_from_ranks_columns_equals_the_index_of_the_same_records(tmp_path_factory, data):
    """A commit merges every rank's columns (format.index_of_rows) without an object per piece; it must write
    the tables that the records it stands for give (format._tables_of), up to the order of a tensor's shards,
    and read back (lazily, per tensor) as those records."""
    from hpcscale.ckpt.format import (
        INDEX,
        ChunkRef,
        Index,
        ShardRecord,
        TensorRecord,
        index_of_rows,
        read_index,
        rows_of,
        write_digest_file,
        write_index,
    )

    names = data.draw(st.lists(st.sampled_from(["model/a", "model/b.w", "optim/a/exp_avg", "z"]), unique=True))
    world = data.draw(st.integers(1, 4))
    shapes = {n: data.draw(st.lists(st.integers(0, 9), max_size=3).map(tuple)) for n in names}
    dtypes = {n: data.draw(st.sampled_from(["float32", "bfloat16", "int64"])) for n in names}
    size = {"float32": 4, "bfloat16": 2, "int64": 8}
    rows: list[list] = [[] for _ in range(world)]
    serial = 0
    for n in names:  # pieces cut along dim 0 (a scalar or an empty tensor: one piece), each one chunk
        shape = shapes[n]
        cuts = (
            sorted(set(data.draw(st.lists(st.integers(1, shape[0] - 1), max_size=3)))) if shape and shape[0] > 1 else []
        )
        bounds = [0, *cuts, shape[0]] if shape else [0, 1]
        for lo, hi in itertools.pairwise(bounds):
            rank = data.draw(st.integers(0, world - 1))
            piece = (hi - lo, *shape[1:]) if shape else ()
            length = size[dtypes[n]] * int(np.prod(piece, dtype=np.int64))
            ref = ChunkRef(f"{serial:032x}", f"step-00000001/data/rank-{rank:05d}.bin", serial * 8, length)
            serial += 1
            offset = (lo,) + (0,) * (len(shape) - 1) if shape else ()
            rows[rank].append((n, shape, dtypes[n], offset, piece, [ref]))
    gathered = [{"rank": r, "rng": {"cpu": np.full(3, r, np.uint8)}, "rows": rows_of(rows[r])} for r in range(world)]
    layout = {"pp": 1, "dp": world, "tp": 1}
    got = index_of_rows(gathered, step=1, layout=layout, parent=None, created=5.0, trainer_state={"step": 1})
    records = {
        n: TensorRecord(
            n,
            shapes[n],
            dtypes[n],
            [ShardRecord(tuple(o), tuple(s), list(c)) for r in rows for (m, _, _, o, s, c) in r if m == n],
        )
        for n in names
    }
    want = Index(
        1, world, layout, None, 5.0, records, {"step": 1}, {r: {"cpu": np.full(3, r, np.uint8)} for r in range(world)}
    )

    def key(rec):
        return sorted((s.offset, s.shape, [(c.hash, c.file, c.offset, c.length) for c in s.chunks]) for s in rec.shards)

    assert sorted(got.tensors) == sorted(names)
    assert all(key(got.tensors[n]) == key(records[n]) for n in names)
    assert got.files() == want.files() and got.total_bytes() == want.total_bytes()
    step = tmp_path_factory.mktemp("idx") / "step-00000001"
    step.mkdir()
    write_digest_file(step, write_index(step / INDEX, got))
    back = read_index(step / INDEX)
    assert sorted(back.tensors) == sorted(names)
    assert all(key(back.tensors[n]) == key(records[n]) and back.tensors[n].global_shape == shapes[n] for n in names)
    assert back.files() == want.files() and back.chunk_count() == want.chunk_count()


HEX16 = st.text("0123456789abcdef", min_size=16, max_size=16)


@settings(deadline=None, max_examples=80)
@given(
    hashes=st.lists(st.tuples(st.sampled_from(["0" * 16, "f" * 16, "0123456789abcdef"]), HEX16), max_size=30),
    gone=st.sets(st.integers(0, 2), max_size=2),
    probes=st.lists(HEX16.map(lambda h: h * 2), max_size=5),
)
def test_known_chunks_of_an_adopted_index_answer_as_a_dict_of_its_chunks(hashes, gone, probes):
    """A resumed rank deduplicates against the loaded index's chunk table, searched by hash (writer.KnownChunks),
    not one object per chunk: it must answer every hash as the dict it replaces did (first location wins;
    files retention removed are forgotten; hashes that share a prefix told apart)."""
    from hpcscale.ckpt.format import ChunkRef, index_of_rows, rows_of
    from hpcscale.ckpt.writer import KnownChunks

    refs = [ChunkRef(a + b, f"step-00000001/data/rank-0000{k % 3}.bin", 8 * k, 8) for k, (a, b) in enumerate(hashes)]
    rows = [(f"model/t{k:03d}", (2,), "float32", (0,), (2,), [r]) for k, r in enumerate(refs)]
    gathered = [{"rank": 0, "rng": {"cpu": np.zeros(1, np.uint8)}, "rows": rows_of(rows)}]
    index = index_of_rows(
        gathered, step=1, layout={"pp": 1, "dp": 1, "tp": 1}, parent=None, created=0.0, trainer_state={}
    )
    want: dict = {}
    for r in refs:  # the tensor names sort as the refs were made
        want.setdefault(r.hash, r)
    known = KnownChunks()
    known.adopt(index)
    assert len(known) == len(refs)
    assert all(known.get(h) == r for h, r in want.items())
    assert all(known.get(p) == want.get(p) for p in probes)
    dropped = {f"step-00000001/data/rank-0000{k}.bin" for k in gone}
    known.drop_files(dropped)
    assert all(known.get(h) == (None if r.file in dropped else r) for h, r in want.items())
    extra = ChunkRef("e" * 32, "step-00000002/data/rank-00000.bin", 0, 8)
    known.setdefault(extra.hash, extra)
    assert known.get(extra.hash) == extra
    known.clear()
    assert not known and all(known.get(h) is None for h in want)


# -- crafted checkpoints: whatever an index declares, verify and export stay bounded and never traceback ----------

ODD_NAMES = [
    "model/__metadata__",
    "model/",
    "model/a",
    "model/é/ü😀",
    "model/\u202eevil",
    'model/"q"\\',
    "model/line\nbreak",
    "model/" + "x" * 200,
    "optim/model/a",
    "modelx",
]
# any text that is UTF-8 (no surrogates) but NUL, which HDF5's strings cannot hold: no index can name them
UTF8 = st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00")
NAME = st.one_of(st.sampled_from(ODD_NAMES), st.text(UTF8, max_size=8).map(lambda s: "model/" + s))
HEADROOM = 128 << 20  # address space a verify or an export may add: a 64 MiB block and a 16 MiB piece fit
BIG = 160 << 20  # a deduplicated tensor larger than that: exported whole, the old export would not fit


def _vm_size() -> int:
    with open("/proc/self/status") as f:
        return int(next(x for x in f if x.startswith("VmSize")).split()[1]) * 1024


def _bounded_cli(*args: str):
    """The CLI in this process with its address space limited to what it has now plus HEADROOM: past that an
    allocation fails (MemoryError, or torch's RuntimeError), which the property counts as a failure."""
    import resource

    from click.testing import CliRunner

    from hpcscale.cli.main import cli

    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (_vm_size() + HEADROOM, hard))
    try:
        result = CliRunner().invoke(cli, list(args))
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exc_info
    return result.exit_code, result.output


@st.composite
def crafted(draw, free: int):
    """(tensors for ckpt_craft.craft, chunk_bytes): odd names, any dtype, shapes with zero extents, grid shards
    with empty ones among them, random or zero content; sometimes a deduplicated tensor of BIG bytes, or one
    declaring twice what the output's filesystem has free."""
    from ckpt_craft import Piece, Tensor

    from hpcscale.ckpt.integrity import DTYPE_SIZES

    size = draw(st.sampled_from(["small", "small", "small", "big", "beyond"]))
    chunk_bytes = draw(st.sampled_from([8, 64, 1000, 4096])) if size == "small" else 64 << 20
    tensors = {}
    for name in draw(st.lists(NAME, min_size=1, max_size=4, unique=True)):
        dtype = draw(st.sampled_from(sorted(DTYPE_SIZES)))
        elt = DTYPE_SIZES[dtype]
        shape = tuple(draw(st.lists(st.integers(0, 5), max_size=3)))
        pieces = []
        cuts = [sorted(set(draw(st.lists(st.integers(1, max(n - 1, 1)), max_size=2)))) if n > 1 else [] for n in shape]
        bounds = [list(itertools.pairwise([0, *c, n])) for c, n in zip(cuts, shape, strict=True)]
        for cell in itertools.product(*bounds):
            offset, extent = tuple(a for a, _ in cell), tuple(b - a for a, b in cell)
            n = int(np.prod(extent, dtype=np.int64)) * elt
            data = None if draw(st.booleans()) else draw(st.binary(min_size=n, max_size=n))
            pieces.append(Piece(offset, extent, data))
        if shape and draw(st.booleans()):  # an empty piece on a boundary (an uneven split's last rank)
            d = draw(st.integers(0, len(shape) - 1))
            pieces.append(Piece(tuple(shape[d] if k == d else 0 for k in range(len(shape))), tuple(
                0 if k == d else shape[k] for k in range(len(shape))
            )))  # fmt: skip
        tensors[name] = Tensor(dtype, shape, pieces)
    if size != "small":
        declared = BIG if size == "big" else 2 * free
        tensors["model/zz_deduplicated"] = Tensor("float32", (declared // 4,), [Piece((0,), (declared // 4,))])
    return tensors, chunk_bytes


def _expected(spec) -> np.ndarray:
    """The tensor's bytes as (shape..., element size) uint8, from its pieces (zeros where a piece has none)."""
    from hpcscale.ckpt.integrity import DTYPE_SIZES

    out = np.zeros((*spec.shape, DTYPE_SIZES[spec.dtype]), dtype=np.uint8)
    for p in spec.pieces:
        if p.data is not None and all(p.shape):
            box = tuple(slice(o, o + n) for o, n in zip(p.offset, p.shape, strict=True))
            out[box] = np.frombuffer(p.data, dtype=np.uint8).reshape(out[box].shape)
    return out


def _edit(f: h5py.File, data: st.DataObject) -> None:
    """One hand edit of the kind that changes what is declared or where it is: a size, a chunk's offset or
    length, a chunk reference duplicated onto another row."""
    kind = data.draw(st.sampled_from(["tensor_shape", "shard_shape", "offset", "length", "duplicate"]))
    if kind in ("tensor_shape", "shard_shape"):
        arr = f[kind][()]
        if arr.size:
            i, j = data.draw(st.integers(0, arr.shape[0] - 1)), data.draw(st.integers(0, arr.shape[1] - 1))
            arr[i, j] = data.draw(st.sampled_from([0, 1, 7, 1 << 20, 1 << 40, -1]))
            replace_table(f, kind, arr)
        return
    arr = f["chunks"][()]
    if not arr.size:
        return
    i = data.draw(st.integers(0, arr.shape[0] - 1))
    if kind == "duplicate":
        arr[data.draw(st.integers(0, arr.shape[0] - 1))] = arr[i]
    else:
        arr[kind][i] = data.draw(st.sampled_from([0, 1, 4096, 1 << 30, 1 << 61]))
    replace_table(f, "chunks", arr)


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(data=st.data())
def test_crafted_checkpoints_verify_and_export_without_traceback_within_the_memory_bound(tmp_path_factory, data):
    """Crafted (and sometimes hand-edited, resealed) indexes: `ckpt verify` exits 0 or 3 and `ckpt export`
    0, 2 or 3, never with a traceback, never allocating past HEADROOM (RLIMIT_AS); what verify refuses is never
    exported; what is exported holds exactly the crafted bytes (unedited) and loads; nothing but the output is
    ever left in its directory; declaring more than the output's filesystem holds is exit 2."""
    import shutil
    import tempfile

    import torch
    from ckpt_craft import craft
    from safetensors.torch import load_file
    from torch._subclasses.fake_tensor import FakeTensorMode

    from hpcscale.ckpt.export import SAFETENSORS_DTYPES

    with FakeTensorMode():
        torch.empty(1)  # its first use imports what it needs: not the export's memory
    shm = Path("/dev/shm")  # the output on tmpfs where there is one: written at memory speed, not counted
    out_dir = Path(tempfile.mkdtemp(dir=shm if shm.is_dir() else None))
    try:
        free = os.statvfs(out_dir).f_bavail * os.statvfs(out_dir).f_frsize
        tensors, chunk_bytes = data.draw(crafted(free))
        step = craft(tmp_path_factory.mktemp("crafted"), tensors, chunk_bytes=chunk_bytes)
        edited = data.draw(st.booleans())
        if edited:
            try:
                with h5py.File(step / "index.h5", "r+", locking=False) as f:
                    _edit(f, data)
            except (TypeError, ValueError, OSError, KeyError):
                assume(False)
            assume(reseal(step))
        verified, text = _bounded_cli("ckpt", "verify", str(step))
        assert verified in (0, 3), text
        code, text = _bounded_cli("ckpt", "inspect", str(step))  # the index alone: a bad chunk passes it
        assert code in (0, 3) and (code == 0 or verified == 3), text
        code, text = _bounded_cli("ckpt", "ls", str(step.parent), "--json")
        assert code == 0 and (json.loads(text)["checkpoints"][0]["verified"] == "ok" or verified == 3), text
        model = {k: v for k, v in tensors.items() if k.startswith("model/")}
        beyond = "model/zz_deduplicated" in tensors and tensors["model/zz_deduplicated"].shape[0] * 4 > free
        unholdable = any(k == "model/__metadata__" or v.dtype not in SAFETENSORS_DTYPES for k, v in model.items())
        got = {}
        for fmt in ("safetensors", "torch"):
            out = out_dir / f"model.{fmt}"
            code, text = _bounded_cli("ckpt", "export", str(step), "-o", str(out), "--format", fmt)
            assert code in (0, 2, 3), text
            assert sorted(p.name for p in out_dir.iterdir()) == ([out.name] if code == 0 else []), text
            if verified == 3:
                assert code != 0, "export wrote what verify refuses"
            elif not edited:  # a sound checkpoint: only what the format or the filesystem cannot hold is refused
                want = 2 if beyond or (fmt == "safetensors" and unholdable) else 0
                assert code == want, text
                if beyond and code == 2 and not (fmt == "safetensors" and unholdable):
                    assert "free" in text and "model/zz_deduplicated" in text, text
            if code == 0:
                got[fmt] = (
                    load_file(str(out)) if fmt == "safetensors" else torch.load(out, weights_only=True, mmap=True)
                )
                assert sorted(got[fmt]) == sorted(k.removeprefix("model/") for k in model)
                if not edited:
                    for name, spec in model.items():
                        t = got[fmt][name.removeprefix("model/")]
                        raw = t.reshape(-1).view(torch.uint8).numpy()
                        if raw.size > (1 << 20):  # a deduplicated tensor of zeros: sampled
                            assert spec.pieces[0].data is None and not raw[:: 1 << 12].any() and not raw[-4096:].any()
                        else:
                            assert np.array_equal(raw, _expected(spec).reshape(-1)), name
                out.unlink()
        if len(got) == 2:
            same = [torch.equal(*(got[f][k].reshape(-1).view(torch.uint8) for f in got)) for k in got["torch"]]
            assert all(same)
    finally:
        shutil.rmtree(out_dir)
