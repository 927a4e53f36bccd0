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

import numpy as np
import pytest
from conftest import REPO, run_cli

sys.path.insert(0, str(REPO / "tests" / "helpers"))
from ckpt_tamper import edit_index, fuzz_tensors, replace_table, reseal, save_in_process, tensor_rows

HELPER = REPO / "tests" / "helpers" / "ckpt_job.py"
STEP2 = "step-00000002"


def _mpirun(*args: str) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "OMPI_MCA_btl": "self,tcp",
        "OMPI_ALLOW_RUN_AS_ROOT": "1",
        "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    }
    return subprocess.run(
        ["mpirun", "-n", "2", "--oversubscribe", sys.executable, str(HELPER), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


@pytest.fixture(scope="module")
def pristine(mpi, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("pristine") / "ckpt"
    out = _mpirun(str(root), "save", "1", "2")
    assert out.returncode == 0, out.stdout + out.stderr
    return root


@pytest.fixture()
def saved(pristine, tmp_path) -> Path:
    root = tmp_path / "ckpt"
    shutil.copytree(pristine, root)
    return root


def _assert_load_falls_back(root: Path) -> None:
    """Every rank refuses step 2 and loads step 1 intact; no rank raises."""
    out = _mpirun(str(root), "load")
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert "Traceback" not in text
    assert f"refusing checkpoint {STEP2}" in text
    assert json.loads(next(line for line in out.stdout.splitlines() if line.startswith("{"))) == {
        "step": 1,
        "matches": True,
    }


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
    "shard-shape": (edit_shard_shape, "do not tile"),
    "negative-offset": (edit_negative_offset, "offset -4096 is out of range"),
    "swapped-chunks": (edit_swap_chunks, "root digest mismatch"),
    "trainer-state": (edit_trainer_state, "root digest mismatch"),
}


@pytest.mark.parametrize("edit", sorted(PLAIN))
def test_edited_index_fails_verify_and_load_falls_back(saved, edit):
    fn, expected = PLAIN[edit]
    edit_index(saved / STEP2, fn)
    result = run_cli("ckpt", "verify", str(saved / STEP2))
    assert result.returncode == 3, result.stdout + result.stderr
    assert expected in result.stderr and "Traceback" not in result.stderr
    assert f"{STEP2}/index.h5:" in result.stderr  # named where to look
    _assert_load_falls_back(saved)


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
def test_edit_with_a_recomputed_digest_is_caught_by_the_structure_checks(saved, edit):
    fn, expected = RESEALED[edit]
    edit_index(saved / STEP2, fn)
    reseal(saved / STEP2)
    result = run_cli("ckpt", "verify", str(saved / STEP2), "--json")
    assert result.returncode == 3, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert not report["passed"] and any(expected in p["problem"] for p in report["problems"]), report
    assert "root digest mismatch" not in result.stdout  # the digest was recomputed: structure alone caught it
    _assert_load_falls_back(saved)


def test_unedited_checkpoint_verifies_and_its_digest_is_in_digest_file(saved):
    result = run_cli("ckpt", "verify", str(saved / STEP2), "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["passed"] and report["version"] == 2
    assert (saved / STEP2 / "DIGEST").read_text() == report["digest"] + "\n"
    assert report["digest"].startswith("sha256:") and len(report["digest"]) == 7 + 64


def test_edited_digest_file_fails_verify(saved):
    (saved / STEP2 / "DIGEST").write_text("sha256:" + "0" * 64 + "\n")
    result = run_cli("ckpt", "verify", str(saved / STEP2))
    assert result.returncode == 3 and f"{STEP2}/DIGEST: says" in result.stderr


def test_index_replayed_into_another_step_directory_is_refused(saved):
    """A valid, sealed index of step 1 copied over step 2's (a rollback): its digest is right, its place is not."""
    for name in ("index.h5", "DIGEST"):
        shutil.copy(saved / "step-00000001" / name, saved / STEP2 / name)
    result = run_cli("ckpt", "verify", str(saved / STEP2))
    assert result.returncode == 3 and "the index is of step 1, in the directory of step 2" in result.stderr
    _assert_load_falls_back(saved)


def test_version_1_index_is_refused_with_a_clear_message(saved):
    edit_index(saved / STEP2, lambda f: f.attrs.__setitem__("version", 1))
    result = run_cli("ckpt", "verify", str(saved / STEP2))
    assert result.returncode == 3 and "index version 1 (hpcscale 0.1.0) has no root digest" in result.stderr
    _assert_load_falls_back(saved)


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


def test_a_fifo_in_place_of_a_data_file_fails_verify_and_load_falls_back(saved):
    """open() on a FIFO with no writer blocks forever: every rank would hang at load."""
    data_files = sorted(p for p in (saved / STEP2 / "data").iterdir() if p.is_file())
    assert data_files, "step 2 wrote no data file of its own"
    victim = data_files[0]
    victim.unlink()
    os.mkfifo(victim)
    result = run_cli("ckpt", "verify", str(saved / STEP2), timeout=60)
    assert result.returncode == 3 and "Traceback" not in result.stderr
    _assert_load_falls_back(saved)
