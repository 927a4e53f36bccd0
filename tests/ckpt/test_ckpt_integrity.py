"""A checkpoint index is checked whole: edits an attacker (or a broken tool) makes with h5py are caught by
`ckpt verify` (exit 3, naming the problem) and by every load (all ranks fall back to the previous checkpoint
together, no traceback), and `ckpt export` writes nothing from an index that does not cover its tensors.

Two kinds of edit: plain ones (the root digest no longer matches) and resealed ones (the digest and DIGEST
recomputed afterwards, as someone who knows the format would): those only the structure checks can catch."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import REPO, ckpt_job, run_cli

sys.path.insert(0, str(REPO / "tests" / "helpers"))
from ckpt_tamper import (
    edit_index,
    fuzz_tensors,
    grid,
    one_rank_manager,
    replace_table,
    reseal,
    save_in_process,
    staggered_columns,
    tensor_rows,
    tiling_tables,
)
from hypothesis import given, settings
from hypothesis import strategies as st

STEP2 = "step-00000002"


@pytest.fixture(scope="module")
def pristine(ckpt_saved_1_2) -> Path:
    return ckpt_saved_1_2


@pytest.fixture()
def saved(pristine, tmp_path) -> Path:
    root = tmp_path / "ckpt"
    shutil.copytree(pristine, root)
    return root


def _assert_fell_back(code: int, text: str, answer: str) -> None:
    """One load's outcome: exit 0, no traceback, step 2 refused, rank 0 answering step 1 with every tensor."""
    assert code == 0, text
    assert "Traceback" not in text
    assert f"refusing checkpoint {STEP2}" in text, text[-3000:]
    assert json.loads(answer) == {"step": 1, "matches": True}


def _set_row(f, table: str, row: int, value) -> None:
    data = f[table][()]
    data[row] = value
    replace_table(f, table, data)


def edit_shape(f) -> None:
    t, _, _ = tensor_rows(f, "w0")
    _set_row(f, "tensor_shape", t, [1024, 256])  # the same number of elements


def edit_dtype(f) -> None:
    t, _, _ = tensor_rows(f, "w0")
    names = [x.decode() for x in f["tensor_dtype"][()]]
    names[t] = "int32"  # the same size as float32: only the digest can tell
    import h5py

    replace_table(f, "tensor_dtype", np.array(names, dtype=h5py.string_dtype()))


def edit_shard_shape(f) -> None:
    _, shards, _ = tensor_rows(f, "w0")
    _set_row(f, "shard_shape", shards[0], [128, 1024])


def edit_negative_offset(f) -> None:
    _, _, chunks = tensor_rows(f, "w0")
    table = f["chunks"][()]
    table["offset"][chunks[0][0]] = -4096
    replace_table(f, "chunks", table)


def edit_moved_chunk(f) -> None:
    """One of w0's chunks pointed at w1's bytes of the same length: a location, which the root digest leaves
    out; the chunk's hash is what catches it."""
    _, _, q = tensor_rows(f, "w0")
    _, _, k = tensor_rows(f, "w1")
    table = f["chunks"][()]
    a, b = q[0][0], k[0][0]
    assert table["length"][a] == table["length"][b]
    table["file"][a], table["offset"][a] = table["file"][b], table["offset"][b]
    replace_table(f, "chunks", table)


def edit_swap_chunks(f) -> None:
    _, _, q = tensor_rows(f, "w0")
    _, _, k = tensor_rows(f, "w1")
    table = f["chunks"][()]
    a, b = q[0][0], k[0][0]
    table[[a, b]] = table[[b, a]]  # q's bytes now claimed by k and k's by q: every hash still matches
    replace_table(f, "chunks", table)


def edit_trainer_state(f) -> None:
    f.attrs["trainer_state"] = json.dumps({"step": 99, "loader": {"epoch": 0, "batch": 99, "seed": 1}})


PLAIN = {
    "shape": (edit_shape, "root digest mismatch"),
    "same-size-dtype": (edit_dtype, "root digest mismatch"),
    "shard-shape": (edit_shard_shape, "root digest mismatch"),  # the digest first: no structure work on it
    "negative-offset": (edit_negative_offset, "offset -4096 is out of range"),  # a location: structure catches it
    "moved-chunk": (edit_moved_chunk, "does not match its hash"),
    "swapped-chunks": (edit_swap_chunks, "root digest mismatch"),
    "trainer-state": (edit_trainer_state, "root digest mismatch"),
}


@pytest.fixture(scope="module")
def edited(pristine, tmp_path_factory) -> dict[tuple[str, str], SimpleNamespace]:
    """Each PLAIN, RESEALED and DAMAGED case made on a copy of its own and `ckpt verify` run on it (`ckpt ls` too for
    the integer attributes), then every copy loaded
    by one two-rank job, one copy after another with a fresh manager each (ckpt_job.py load-each, each copy's
    output in files of its own): the ranks and torch start once, not once per edit (~6 s each)."""
    base = tmp_path_factory.mktemp("edited")
    done: dict[tuple[str, str], SimpleNamespace] = {}
    for kind, edits in (("plain", PLAIN), ("resealed", RESEALED)):
        for name, (fn, _) in sorted(edits.items()):
            root = base / kind / name
            shutil.copytree(pristine, root)
            edit_index(root / STEP2, fn)
            if kind == "resealed":
                reseal(root / STEP2)
            verify = run_cli("ckpt", "verify", str(root / STEP2), *(["--json"] if kind == "resealed" else []))
            done[kind, name] = SimpleNamespace(root=root, verify=verify)
    for name, damage in sorted(DAMAGED.items()):  # the other damage whose load must fall back, likewise
        root = base / "damaged" / name
        shutil.copytree(pristine, root)
        damage(root)
        verify = run_cli("ckpt", "verify", str(root / STEP2), timeout=60)  # a FIFO must not block it
        listing = run_cli("ckpt", "ls", str(root), "--json") if name.startswith("int-") else None
        done["damaged", name] = SimpleNamespace(root=root, verify=verify, listing=listing)
    out = base / "loads"
    out.mkdir()
    job = ckpt_job(str(out), "load-each", *(str(c.root) for c in done.values()))
    for i, case in enumerate(done.values()):
        logs = "".join(p.read_text() for p in sorted(out.glob(f"{i}.rank-*.log")))
        answer = (out / f"{i}.json").read_text() if (out / f"{i}.json").exists() else "null"
        # the job's own output (its start-up and teardown) is read with every copy's
        case.load = (job.returncode, logs + job.stdout + job.stderr, answer)
    return done


@pytest.mark.parametrize("edit", sorted(PLAIN))
def test_edited_index_fails_verify_and_load_falls_back(edited, edit):
    case, expected = edited["plain", edit], PLAIN[edit][1]
    result = case.verify
    assert result.returncode == 3, result.stdout + result.stderr
    assert expected in result.stderr and "Traceback" not in result.stderr
    # named where to look: a chunk moved to other bytes is found where it now points (w1's bytes: in step 2's
    # data file, or in step 1's when step 2 deduplicated that chunk into it)
    where = _moved_to(case.root / STEP2) if edit == "moved-chunk" else f"{STEP2}/index.h5:"
    assert where in result.stderr, result.stderr
    _assert_fell_back(*case.load)


def _moved_to(step: Path) -> str:
    """The data file w0's first chunk names in `step`'s index (after edit_moved_chunk: w1's)."""
    from hpcscale.ckpt.format import read_index

    return read_index(step / "index.h5").tensors["w0"].shards[0].chunks[0].file


def _trainer_state(text):
    def fn(f) -> None:
        f.attrs["trainer_state"] = text

    return fn


RESEALED = {
    "shape": (edit_shape, "do not tile"),
    "shard-shape": (edit_shard_shape, "do not tile"),
    "negative-offset": (edit_negative_offset, "offset -4096 is out of range"),
    "truncated-trainer-state": (_trainer_state('{"step": 2, "loader": {"epo'), "trainer_state:1: invalid JSON"),
    "garbage-trainer-state": (_trainer_state(np.bytes_(b"\xff\xfe\x00garbage")), "not UTF-8"),
    "nested-trainer-state": (_trainer_state("[" * 100_000 + "]" * 100_000), "nested too deeply"),
    "list-trainer-state": (_trainer_state("[1, 2]"), "a JSON object is required"),
}


@pytest.mark.parametrize("edit", sorted(RESEALED))
def test_edit_with_a_recomputed_digest_is_caught_by_the_structure_checks(edited, edit):
    case, expected = edited["resealed", edit], RESEALED[edit][1]
    result = case.verify
    assert result.returncode == 3, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert not report["passed"] and any(expected in p["problem"] for p in report["problems"]), report
    assert "root digest mismatch" not in result.stdout  # the digest was recomputed: structure alone caught it
    _assert_fell_back(*case.load)


def test_unedited_checkpoint_verifies_and_its_digest_is_in_digest_file(saved):
    result = run_cli("ckpt", "verify", str(saved / STEP2), "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["passed"] and report["version"] == 3
    assert (saved / STEP2 / "DIGEST").read_text() == report["digest"] + "\n"
    assert report["digest"].startswith("sha256:") and len(report["digest"]) == 7 + 64


def test_a_version_2_index_still_verifies_and_its_digest_binds_locations(saved):
    """Checkpoints of the previous format version are read: their digest (the version-2 one) also covers where
    each chunk is stored, so an edited offset is a digest mismatch there, where version 3 leaves it to the
    structure and hash checks."""
    v3 = (saved / STEP2 / "DIGEST").read_text()
    edit_index(saved / STEP2, lambda f: f.attrs.__setitem__("version", 2))
    assert reseal(saved / STEP2)
    result = run_cli("ckpt", "verify", str(saved / STEP2), "--json")
    report = json.loads(result.stdout)
    assert result.returncode == 0 and report["version"] == 2 and report["digest"] + "\n" != v3, report
    edit_index(saved / STEP2, edit_negative_offset)
    result = run_cli("ckpt", "verify", str(saved / STEP2))
    assert result.returncode == 3 and "root digest mismatch" in result.stderr, result.stderr


def test_edited_digest_file_fails_verify(saved):
    (saved / STEP2 / "DIGEST").write_text("sha256:" + "0" * 64 + "\n")
    result = run_cli("ckpt", "verify", str(saved / STEP2))
    assert result.returncode == 3 and f"{STEP2}/DIGEST: says" in result.stderr


def _replayed(root: Path) -> None:
    """A valid, sealed index of step 1 copied over step 2's (a rollback): its digest is right, its place is not."""
    for name in ("index.h5", "DIGEST"):
        shutil.copy(root / "step-00000001" / name, root / STEP2 / name)


def test_index_replayed_into_another_step_directory_is_refused(edited):
    case = edited["damaged", "replayed"]
    result = case.verify
    assert result.returncode == 3 and "the index is of step 1, in the directory of step 2" in result.stderr
    _assert_fell_back(*case.load)


def _version_1(root: Path) -> None:
    edit_index(root / STEP2, lambda f: f.attrs.__setitem__("version", 1))


def test_version_1_index_is_refused_with_a_clear_message(edited):
    case = edited["damaged", "version-1"]
    result = case.verify
    assert result.returncode == 3 and "index version 1 (hpcscale 0.1.0) has no root digest" in result.stderr
    _assert_fell_back(*case.load)


@pytest.mark.parametrize("sealed", [False, True], ids=["plain", "resealed"])
def test_export_of_an_index_that_does_not_cover_its_tensor_exits_3_and_writes_nothing(tmp_path, sealed):
    root = tmp_path / "ckpt"
    save_in_process(root, 1, fuzz_tensors())
    step = root / "step-00000001"
    good = run_cli("ckpt", "export", str(step), "-o", str(tmp_path / "good.st"), "--json")
    assert good.returncode == 0 and json.loads(good.stdout)["tensors"] == 4, good.stderr

    def widen(f) -> None:  # the global shape doubles; the shards still cover only the old one
        t, _, _ = tensor_rows(f, "model/rows")
        _set_row(f, "tensor_shape", t, [64, 64])

    edit_index(step, widen)
    if sealed:
        assert reseal(step)
    out = tmp_path / "bad.st"
    result = run_cli("ckpt", "export", str(step), "-o", str(out))
    assert result.returncode == 3, result.stdout + result.stderr
    assert "Traceback" not in result.stderr and not out.exists()
    assert ("do not tile" if sealed else "root digest mismatch") in result.stderr


def _fifo(root: Path) -> None:
    """open() on a FIFO with no writer blocks forever: every rank would hang at load."""
    data_files = sorted(p for p in (root / STEP2 / "data").iterdir() if p.is_file())
    assert data_files, "step 2 wrote no data file of its own"
    victim = data_files[0]
    victim.unlink()
    os.mkfifo(victim)


def test_a_fifo_in_place_of_a_data_file_fails_verify_and_load_falls_back(edited):
    case = edited["damaged", "fifo"]
    result = case.verify
    assert result.returncode == 3 and "Traceback" not in result.stderr
    _assert_fell_back(*case.load)


# ---- integers outside int64 -------------------------------------------------------------------------------


OUTSIDE_INT64 = {
    "step-uint64-max": ("step", np.uint64(2**64 - 1)),
    "chunk_bytes-2^63": ("chunk_bytes", np.uint64(2**63)),
    "world_size-int-2^64-1": ("world_size", 2**64 - 1),
}


def _outside_int64(attr: str, value):
    def damage(root: Path) -> None:
        edit_index(root / STEP2, lambda f: f.attrs.__setitem__(attr, value))  # no reseal needed

    return damage


@pytest.mark.parametrize("case", sorted(OUTSIDE_INT64))
def test_integer_attribute_outside_int64_is_refused_by_verify_ls_and_every_rank(edited, case):
    """The digest packs integers as int64: a uint64 attribute once made it raise struct.error outside every
    catch, so verify and ls ended in a traceback and every rank raised while its manager was built."""
    case = edited["damaged", f"int-{case}"]
    result = case.verify
    assert result.returncode == 3, result.stdout + result.stderr
    assert "outside the signed 64-bit range" in result.stderr and "Traceback" not in result.stderr
    listing = case.listing
    assert listing.returncode == 0 and "Traceback" not in listing.stderr, listing.stderr
    rows = {row["step"]: row["verified"] for row in json.loads(listing.stdout)["checkpoints"]}
    assert rows[1] == "ok" and "outside the signed 64-bit range" in rows[2], rows
    _assert_fell_back(*case.load)  # every rank builds its manager (adopting the newest index) and falls back


# the damage (besides PLAIN and RESEALED) that the `edited` fixture makes and loads, each on a copy of its own
DAMAGED = {
    "replayed": _replayed,
    "version-1": _version_1,
    "fifo": _fifo,
    **{f"int-{name}": _outside_int64(*attr_value) for name, attr_value in OUTSIDE_INT64.items()},
}


def test_manager_built_over_a_damaged_newest_index_logs_and_skips_it(tmp_path):
    root = tmp_path / "ckpt"
    save_in_process(root, 1, fuzz_tensors())
    edit_index(root / "step-00000001", lambda f: f.attrs.__setitem__("step", np.uint64(2**64 - 1)))
    log: list[str] = []
    with one_rank_manager(root, log) as manager:
        assert manager.last_step is None and not manager.writer.known
        assert any("not deduplicating against the newest checkpoint" in line for line in log), log
        assert manager.load_latest(fuzz_tensors()) is None


# ---- the digest first, and an O(S log S) tiling check ------------------------------------------------------


def test_digest_is_checked_before_any_structure_work(tmp_path, monkeypatch):
    import hpcscale.ckpt.format as fmt

    root = tmp_path / "ckpt"
    save_in_process(root, 1, fuzz_tensors())
    step = root / "step-00000001"
    edit_index(step, edit_shard_shape_of("model/rows"))

    def boom(*args, **kwargs):
        raise AssertionError("structure checked before the digest")

    monkeypatch.setattr(fmt, "structure_problems", boom)
    exam = fmt.examine_index(step / "index.h5")
    assert exam.index is None and [p.file for p in exam.problems] == ["index.h5", "DIGEST"], exam.problems
    assert exam.problems[0].problem.startswith("root digest mismatch")


def edit_shard_shape_of(name: str):
    def fn(f) -> None:
        _, shards, _ = tensor_rows(f, name)
        _set_row(f, "shard_shape", shards[0], [16, 32])

    return fn


@pytest.mark.parametrize("shards", [4000, 40000])
def test_tiling_check_is_fast_for_tens_of_thousands_of_shards(shards):
    """The pairwise overlap sweep took 4 s at 4,000 shards of a real (staggered) tiling and minutes at 40,000,
    on every rank at every start. A grid (what writers produce) passes; a staggered tiling is no grid."""
    import time

    from hpcscale.ckpt.integrity import structure_problems

    for (gshape, boxes), ok in ((grid(shards // 100, 100), True), (staggered_columns(shards // 2), False)):
        tables = tiling_tables(gshape, boxes)
        t0 = time.perf_counter()
        problems = structure_problems(tables, dir_step=1)
        took = time.perf_counter() - t0
        assert (problems == []) is ok, problems[:3]
        assert ok or problems == [f"tensor model/w: its shards do not tile its global shape {list(gshape)}"]
        assert took < 2.0, f"{len(boxes)} shards took {took:.2f} s"


def _chunks(n: int, k: int) -> list[tuple[int, int]]:
    """torch.chunk's cut of n into k pieces (DTensor's Shard placement): (start, length), empty ones included."""
    size = -(-n // k) if n else 0
    return [(min(i * size, n), max(0, min(size, n - i * size))) for i in range(k)]


@pytest.mark.parametrize(
    "gshape, boxes",
    [
        ((10, 6), [((a, 0), (n, 6)) for a, n in _chunks(10, 4)]),  # Shard(0), uneven: 3, 3, 3, 1
        ((3, 6), [((a, 0), (n, 6)) for a, n in _chunks(3, 4)]),  # Shard(0) with an empty piece
        ((6, 9), [((0, a), (6, n)) for a, n in _chunks(9, 2)]),  # Shard(1)
        ((7, 9), [((a, b), (n, m)) for a, n in _chunks(7, 3) for b, m in _chunks(9, 2)]),  # a 2-D mesh
        ((0, 4), [((0, 0), (0, 4))]),  # an empty tensor
        ((), [((), ())]),  # a scalar
    ],
    ids=["rows-uneven", "rows-empty-piece", "columns", "grid", "empty", "scalar"],
)
def test_tilings_a_writer_produces_pass(gshape, boxes):
    from hpcscale.ckpt.integrity import structure_problems

    assert structure_problems(tiling_tables(gshape, boxes), dir_step=1) == []


BOX = st.tuples(st.integers(0, 4), st.integers(0, 4), st.integers(0, 3), st.integers(0, 3))


@settings(max_examples=400, deadline=None)
@given(boxes=st.lists(BOX, min_size=1, max_size=8), cuts=st.tuples(st.integers(1, 3), st.integers(1, 3)))
def test_tiling_check_passes_exactly_the_exact_covers(boxes, cuts):
    """Whatever passes covers every element exactly once (checked element by element); every grid passes."""
    from hpcscale.ckpt.integrity import structure_problems

    gshape = (4, 4)
    shards = [((r, c), (min(h, 4 - r), min(w, 4 - c))) for r, c, h, w in boxes if r < 4 and c < 4]
    if not shards:
        return
    cover = np.zeros(gshape, dtype=int)
    for (r, c), (h, w) in shards:
        cover[r : r + h, c : c + w] += 1
    passed = structure_problems(tiling_tables(gshape, shards), dir_step=1) == []
    assert not passed or (cover == 1).all(), (shards, cover)
    rows, cols = np.linspace(0, 4, cuts[0] + 1).astype(int), np.linspace(0, 4, cuts[1] + 1).astype(int)
    cells = [
        ((rows[i], cols[j]), (rows[i + 1] - rows[i], cols[j + 1] - cols[j]))
        for i in range(cuts[0])
        for j in range(cuts[1])
    ]
    assert structure_problems(tiling_tables(gshape, cells), dir_step=1) == []


# ---- trainer state and RNG states, checked at load --------------------------------------------------------


def _two_steps(tmp_path) -> Path:
    root = tmp_path / "ckpt"
    save_in_process(root, 1, fuzz_tensors())
    save_in_process(root, 2, fuzz_tensors())
    return root


def _verify_passes(step: Path) -> None:
    result = run_cli("ckpt", "verify", str(step))
    assert result.returncode == 0, result.stdout + result.stderr  # well formed: verify cannot know the trainer


def test_trainer_state_the_trainer_cannot_use_is_refused_on_every_rank_by_its_check(tmp_path):
    """'{"step": 1}' is a well-formed state, but the reference trainer reads state["loader"]: without a check,
    every rank raised KeyError at every restart. With the trainer's check, the checkpoint is skipped."""
    from hpcscale.data.loader import TokenLoader

    def trainer_state_problem(state):
        return TokenLoader.state_problem(state.get("loader"))

    root = _two_steps(tmp_path)
    edit_index(root / STEP2, _trainer_state('{"step": 2}'))
    assert reseal(root / STEP2)
    _verify_passes(root / STEP2)
    log: list[str] = []
    with one_rank_manager(root, log) as manager:
        restored = manager.load_latest(fuzz_tensors(), check_state=trainer_state_problem)
        assert restored is not None and restored.step == 1, log
        assert restored.trainer_state["loader"] == {"epoch": 0, "batch": 1, "seed": 1}
        refusal = f"refusing checkpoint {STEP2}: {root / STEP2}: trainer state: the state is NoneType"
        assert any(line.startswith(f"hpcscale: {refusal}") for line in log), log
        # without a check, the manager cannot know what the caller reads: it loads step 2 (documented)
        assert manager.load_latest(fuzz_tensors()).step == 2
        # a check that raises refuses the checkpoint the same way, never raising out of load_latest
        restored = manager.load_latest(fuzz_tensors(), check_state=lambda state: state["loader"] and None)
        assert restored is not None and restored.step == 1
        assert any("trainer state: unexpected KeyError" in line for line in log), log


@pytest.mark.parametrize(
    "state, problem",
    [
        ({"epoch": 0, "batch": 3, "seed": 1}, None),
        ({"epoch": 2, "batch": 0}, None),
        (None, "the state is NoneType"),
        ([0, 1], "the state is list"),
        ({"epoch": "0", "batch": 1}, "epoch is '0'"),
        ({"epoch": 0, "batch": -1}, "batch is '-1'"),
        ({"epoch": 0, "batch": True}, "batch is 'True'"),
        ({"epoch": 0.5, "batch": 1}, "epoch is '0.5'"),
        ({"epoch": 0, "batch": 1, "seed": "1"}, "seed is '1'"),
    ],
)
def test_the_loaders_state_check_names_what_it_cannot_use(state, problem):
    """The reference trainer's data position: ctx.checkpoint asks the loader before loading a checkpoint."""
    from hpcscale.data.loader import TokenLoader

    got = TokenLoader.state_problem(state)
    assert got == problem if problem is None else got is not None and got.startswith(problem), got


def _rng_cpu(data: np.ndarray):
    def fn(f) -> None:
        replace_table(f, "rng_cpu", data)

    return fn


@pytest.mark.parametrize("kind", ["short-row", "torch-refuses-contents"])
def test_rng_state_this_torch_cannot_restore_is_refused_at_load(tmp_path, kind):
    """rng_cpu reshaped to (1, 3) verified and loaded; then torch.set_rng_state raised on every rank."""
    import torch

    root = _two_steps(tmp_path)
    want = torch.get_rng_state().numel()
    data = np.arange(3, dtype=np.uint8).reshape(1, 3) if kind == "short-row" else np.full((1, want), 255, np.uint8)
    edit_index(root / STEP2, _rng_cpu(data))
    assert reseal(root / STEP2)
    _verify_passes(root / STEP2)
    before = torch.get_rng_state()
    log: list[str] = []
    with one_rank_manager(root, log) as manager:
        restored = manager.load_latest(fuzz_tensors())
    assert restored is not None and restored.step == 1, log
    assert restored.rng["cpu"].shape == (want,)
    torch.set_rng_state(torch.from_numpy(restored.rng["cpu"].copy()))  # what the trainer does with it
    expected = "the CPU RNG state has shape (3,)" if kind == "short-row" else "the CPU RNG state is refused by torch"
    assert any(f"refusing checkpoint {STEP2}" in line and expected in line for line in log), log
    torch.set_rng_state(before)


# ---- data files are opened by verify as a load opens them ---------------------------------------------------


def _data_file(root: Path) -> Path:
    return root / "step-00000001" / "data" / "rank-00000.bin"


def test_a_symlinked_data_file_fails_verify_as_load_refuses_it(tmp_path):
    """verify followed a symbolic link to a copy outside the run (exit 0); a load (O_NOFOLLOW) refused it."""
    root = tmp_path / "run" / "ckpt"
    save_in_process(root, 1, fuzz_tensors())
    victim = _data_file(root)
    outside = tmp_path / "elsewhere.bin"
    shutil.copy(victim, outside)
    victim.unlink()
    victim.symlink_to(outside)
    result = run_cli("ckpt", "verify", str(root / "step-00000001"))
    assert result.returncode == 3, result.stdout + result.stderr
    assert "is a symbolic link" in result.stderr and "Traceback" not in result.stderr
    log: list[str] = []
    with one_rank_manager(root, log) as manager:
        assert manager.load_latest(fuzz_tensors()) is None
    assert any("refusing checkpoint step-00000001" in line for line in log), log


def test_verify_reports_a_data_file_it_cannot_open_instead_of_raising(tmp_path, monkeypatch):
    """Between data_file_problem and the reads, a file can change (or be unreadable): each open and read
    error is a problem in the report, never a traceback, and a FIFO never blocks the open."""
    import hpcscale.ckpt.ops as ops

    root = tmp_path / "ckpt"
    save_in_process(root, 1, fuzz_tensors())
    victim = _data_file(root)
    victim.unlink()
    os.mkfifo(victim)
    monkeypatch.setattr(ops, "data_file_problem", lambda root, index: None)  # the gap: swapped after the check
    report = ops.verify(root / "step-00000001")
    assert not report.passed and report.ok == 0
    assert any("cannot be opened" in p.problem for p in report.problems), report.problems
    victim.unlink()
    victim.symlink_to(tmp_path / "elsewhere.bin")
    report = ops.verify(root / "step-00000001")
    assert any("cannot be opened" in p.problem for p in report.problems), report.problems


def test_an_unreadable_data_file_fails_verify_without_a_traceback(tmp_path):
    root = tmp_path / "ckpt"
    save_in_process(root, 1, fuzz_tensors())
    _data_file(root).chmod(0)
    verify = ["hpcscale", "ckpt", "verify", str(root / "step-00000001")]
    if os.geteuid() == 0:  # root reads files whatever their mode: verify as root without that capability
        verify = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", *verify]
    result = subprocess.run(verify, capture_output=True, text=True, timeout=120)
    assert result.returncode == 3 and "Traceback" not in result.stderr, result.stderr
    assert "cannot be opened (Permission denied)" in result.stderr


@pytest.mark.parametrize(
    ("how", "said"),
    [
        ("gzip", "table shard_offset is stored chunked or compressed"),
        ("fill", "table shard_offset claims 400000000 bytes but stores 0"),
    ],
)
def test_an_index_whose_tables_would_cost_more_than_its_file_is_refused_before_reading_them(saved, how, said):
    """A 2 MB index can hold gzip'd gigabytes, or claim a table it never stored (read back as a fill value):
    refused from the metadata, before a table is read or expanded (the digest cannot be checked without
    reading them)."""
    import h5py

    def craft(f: h5py.File) -> None:
        del f["shard_offset"]
        if how == "gzip":  # 200 MB of zeros in about 200 KB
            f.create_dataset("shard_offset", data=np.zeros((25_000_000, 1), np.int64), compression="gzip")
        else:  # declared, never written: every element would be the fill value
            f.create_dataset("shard_offset", shape=(50_000_000, 1), dtype=np.int64)

    edit_index(saved / STEP2, craft)
    result = run_cli("ckpt", "verify", str(saved / STEP2), "--json")
    assert result.returncode == 3, result.stdout + result.stderr
    assert said in result.stdout + result.stderr
