"""`ckpt export` is bounded by what it writes, whatever a checkpoint declares, and writes only where it is told.

- Content addressing lets a few stored bytes declare far more (a tensor of zeros is one chunk): the export holds
  at most a block of the output in memory (run here under RLIMIT_AS), refuses before reading when the output's
  filesystem cannot hold what is declared (exit 2, naming the tensor), and `ckpt verify` says declared against
  stored;
- empty shards and empty tensors export; a name or dtype the format cannot hold is exit 2, nothing written;
- the target is checked before anything is read (a missing directory, a directory, a FIFO), a symbolic link at
  the target (planted by another user in a shared run directory) is replaced, never followed, and the file's
  mode follows the umask.

Checkpoints are crafted (tests/helpers/ckpt_craft.py) with a matching root digest: only the export's own
checks stand between them and the output.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, run_cli

sys.path.insert(0, str(REPO / "tests" / "helpers"))
from ckpt_craft import DATA, Piece, Tensor, craft, zeros_tensor

MiB = 1 << 20
# The export holds a block (64 MiB) and a read piece (16 MiB) of tensor data: the limit leaves room for that
# and for what Python allocates on the way, far below the 512 MiB tensor exported under it.
HEADROOM = 256 * MiB
LIMITED = """
import resource, sys
import h5py, numpy, safetensors, torch  # imported before the limit: it is the export's own memory that counts
from torch._subclasses.fake_tensor import FakeTensorMode
import hpcscale.cli.main, hpcscale.ckpt.export
with FakeTensorMode():
    torch.empty(1)  # FakeTensorMode imports what it needs at first use
vm = int(next(x for x in open("/proc/self/status") if x.startswith("VmSize")).split()[1]) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + int(sys.argv[1]), resource.RLIM_INFINITY))
from hpcscale.cli.entry import main
main(sys.argv[2:])
"""


def cli_limited(*args: str, headroom: int = HEADROOM) -> subprocess.CompletedProcess:
    """`hpcscale ARGS` with its address space limited to what it had at start plus `headroom`."""
    env = {**os.environ, "MALLOC_ARENA_MAX": "2", "OMP_NUM_THREADS": "1"}  # no per-thread heaps to reserve
    return subprocess.run(
        [sys.executable, "-c", LIMITED, str(headroom), *args], capture_output=True, text=True, env=env, cwd=REPO
    )


def columns(rows: int, cols: int, parts: int, dtype: str = "float32") -> tuple[Tensor, np.ndarray]:
    """A (rows, cols) tensor of distinct values cut into `parts` column shards (a tp save), and its values."""
    values = np.arange(rows * cols, dtype=np.float32).reshape(rows, cols)
    width = cols // parts
    pieces = [
        Piece((0, j * width), (rows, width), np.ascontiguousarray(values[:, j * width : (j + 1) * width]).tobytes())
        for j in range(parts)
    ]
    return Tensor(dtype, (rows, cols), pieces), values


def load(out: Path, fmt: str) -> dict:
    import torch

    if fmt == "torch":
        return torch.load(out, weights_only=True, mmap=True)
    from safetensors.torch import load_file

    return load_file(str(out))


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_a_deduplicated_model_exports_in_bounded_memory(tmp_path, fmt):
    """512 MiB of zeros stored as one 16 MiB chunk, beside a column-sharded tensor: exported whole under an
    address-space limit of 256 MiB above the process's start (the old export allocated each tensor whole)."""
    cols, values = columns(600, 4000, 4)
    step = craft(
        tmp_path / "ckpt",
        {"model/zeros": zeros_tensor("float32", (128 * MiB,)), "model/cols": cols},
        chunk_bytes=16 * MiB,
    )
    out = tmp_path / f"model.{fmt}"
    result = cli_limited("ckpt", "export", str(step), "-o", str(out), "--format", fmt, "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    doc = json.loads(result.stdout)
    assert doc["tensors"] == 2 and doc["bytes"] == 512 * MiB + values.nbytes
    got = load(out, fmt)
    assert np.array_equal(got["cols"].numpy(), values)
    zeros = got["zeros"]
    assert zeros.shape == (128 * MiB,) and not zeros[:: 1 << 16].any() and not zeros[-4096:].any()


def test_more_than_the_output_filesystem_holds_is_refused_before_reading_and_verify_shows_it(tmp_path):
    """24 TiB declared in a 1 GiB sparse chunk verifies (dedup is legitimate) and says so, reading the chunk a
    piece at a time (under the address-space limit); the export exits 2 naming the tensor before reading a chunk
    (the stored chunk is damaged: reading it would exit 3)."""
    step = craft(tmp_path / "ckpt", {"model/huge": zeros_tensor("float32", (6 << 40,))}, chunk_bytes=1 << 30)
    verify = cli_limited("ckpt", "verify", str(step))
    assert verify.returncode == 0, verify.stderr
    assert "24.0 TiB of tensor data in 1.0 GiB of distinct chunks" in verify.stdout
    doc = json.loads(run_cli("ckpt", "verify", str(step), "--json").stdout)
    assert doc["declared_bytes"] == 24 << 40 and doc["stored_bytes"] == 1 << 30
    with open(step / DATA, "r+b") as fh:  # the chunk no longer matches its hash
        fh.write(b"x")
    for fmt in ("safetensors", "torch"):
        out = tmp_path / "out" / f"model.{fmt}"
        out.parent.mkdir(exist_ok=True)
        result = run_cli("ckpt", "export", str(step), "-o", str(out), "--format", fmt)
        assert result.returncode == 2, result.stderr[-3000:]
        assert "model/huge" in result.stderr and "free" in result.stderr and "Traceback" not in result.stderr
        assert list(out.parent.iterdir()) == []  # nothing written, no temporary left


def test_consolidated_refuses_more_than_this_machines_memory_before_allocating(tmp_path):
    from hpcscale.ckpt.export import consolidated
    from hpcscale.errors import BadInput

    step = craft(tmp_path / "ckpt", {"model/huge": zeros_tensor("float32", (6 << 40,))}, chunk_bytes=1 << 30)
    with pytest.raises(BadInput, match="model/huge"):
        consolidated(step)


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_empty_shards_and_empty_tensors_export(tmp_path, fmt):
    """A tensor whose shards include an empty one (an uneven FSDP split), and a tensor with no elements."""
    values = np.arange(12, dtype=np.float32).reshape(4, 3)
    rows = Tensor("float32", (4, 3), [Piece((0, 0), (4, 3), values.tobytes()), Piece((4, 0), (0, 3))])
    step = craft(tmp_path / "ckpt", {"model/rows": rows, "model/none": zeros_tensor("bfloat16", (0, 5))})
    assert run_cli("ckpt", "verify", str(step)).returncode == 0
    out = tmp_path / f"m.{fmt}"
    result = run_cli("ckpt", "export", str(step), "-o", str(out), "--format", fmt)
    assert result.returncode == 0, result.stderr[-3000:]
    got = load(out, fmt)
    assert np.array_equal(got["rows"].numpy(), values) and tuple(got["none"].shape) == (0, 5)


ODD = ["__metadata__", "", " ", 'a"b\\c', "line\nbreak", "é/ü.😀", "\u202eevil", "x" * 300]


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_every_name_is_held_by_the_format_or_refused_naming_it(tmp_path, fmt):
    import torch

    tensors = {f"model/{k}": zeros_tensor("float32", (2,)) for k in ODD}
    step = craft(tmp_path / "ckpt", tensors)
    out = tmp_path / "out" / "model"
    out.parent.mkdir()
    result = run_cli("ckpt", "export", str(step), "-o", str(out), "--format", fmt)
    if fmt == "safetensors":  # safetensors reserves __metadata__: a file with it cannot be opened
        assert result.returncode == 2, result.stderr[-3000:]
        assert "tensor model/__metadata__" in result.stderr and "Traceback" not in result.stderr
        assert list(out.parent.iterdir()) == []
        del tensors["model/__metadata__"]
        step = craft(tmp_path / "ckpt2", tensors)
        result = run_cli("ckpt", "export", str(step), "-o", str(out), "--format", fmt)
    assert result.returncode == 0, result.stderr[-3000:]
    got = load(out, fmt)
    assert sorted(got) == sorted(k.removeprefix("model/") for k in tensors)
    assert all(torch.equal(t, torch.zeros(2)) for t in got.values())


@pytest.mark.parametrize("dtype", ["complex128", "complex32", "float8_e8m0fnu", "float4_e2m1fn_x2"])
def test_a_dtype_safetensors_cannot_hold_is_refused_naming_it_and_torch_exports_it(tmp_path, dtype):
    import torch

    from hpcscale.ckpt.integrity import DTYPE_SIZES

    data = bytes(range(7, 7 + 6 * DTYPE_SIZES[dtype]))
    step = craft(tmp_path / "ckpt", {"model/w": Tensor(dtype, (2, 3), [Piece((0, 0), (2, 3), data)])})
    out = tmp_path / "out" / "m.st"
    out.parent.mkdir()
    result = run_cli("ckpt", "export", str(step), "-o", str(out))
    assert result.returncode == 2 and f"tensor model/w: safetensors has no dtype {dtype}" in result.stderr
    assert list(out.parent.iterdir()) == []
    pt = tmp_path / "m.pt"
    assert run_cli("ckpt", "export", str(step), "-o", str(pt), "--format", "torch").returncode == 0
    got = torch.load(pt, weights_only=True)["w"]
    assert got.dtype == getattr(torch, dtype) and bytes(got.reshape(-1).view(torch.uint8).numpy()) == data


def test_a_safetensors_header_over_the_formats_limit_is_refused(tmp_path, monkeypatch):
    import hpcscale.ckpt.export as export
    from hpcscale.ckpt.format import read_index
    from hpcscale.errors import BadInput

    step = craft(tmp_path / "ckpt", {f"model/w{k}": zeros_tensor("float32", (2,)) for k in range(40)})
    todo = export.entries(read_index(step / "index.h5"))
    monkeypatch.setattr(export, "SAFETENSORS_MAX_HEADER", 1000)
    with pytest.raises(BadInput, match="over the format's limit of 1000"):
        export.safetensors_header(todo)


def _damaged(tmp_path: Path) -> Path:
    """A checkpoint whose DIGEST no longer matches: reading its index is exit 3."""
    step = craft(tmp_path / "ckpt", {"model/w": zeros_tensor("float32", (4,))})
    (step / "DIGEST").write_text("sha256:" + "0" * 64 + "\n")
    return step


def cli(*args: str):
    """The CLI in this process (no torch import per call): (exit code, stdout and stderr)."""
    from click.testing import CliRunner

    from hpcscale.cli.main import cli as main

    result = CliRunner().invoke(main, list(args))
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exc_info
    return result.exit_code, result.output


def test_the_target_is_checked_before_anything_is_read(tmp_path):
    """Each target problem is exit 2 although the checkpoint is damaged (reading it would be exit 3); a FIFO
    at the target is neither opened (that would wait for a reader: a process of its own here) nor replaced."""
    step = _damaged(tmp_path)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    cases = {
        tmp_path / "missing" / "m.st": "does not exist",
        tmp_path: "is a directory",
        tmp_path / "link" / "m.st": "symbolic link",
        tmp_path / "fifo" / "m.st": "not a directory",
    }
    for out, said in cases.items():
        for fmt in ("safetensors", "torch"):
            code, text = cli("ckpt", "export", str(step), "-o", str(out), "--format", fmt)
            assert code == 2 and said in text, (out, text)
    assert list(real.iterdir()) == []
    result = run_cli("ckpt", "export", str(step), "-o", str(fifo), "--format", "torch", timeout=60)
    assert result.returncode == 2 and "not a regular file" in result.stderr, result.stderr[-2000:]
    assert fifo.is_fifo()


@pytest.fixture
def shared_run(other_user) -> Path:
    """A run directory the other user (same group) can create files in, as shared project areas are; under a
    directory both users can reach (pytest's own tmp is root's alone, 0700), removed afterwards."""
    base = Path(tempfile.mkdtemp(prefix="hpcscale-test-export-"))
    base.chmod(0o755)
    run = base / "run"
    run.mkdir()
    os.chown(run, os.getuid(), other_user.gid)
    os.chmod(run, 0o2775)
    yield run
    shutil.rmtree(base)


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_a_symlink_another_user_planted_at_the_target_is_replaced_not_followed(tmp_path, other_user, shared_run, fmt):
    victim = tmp_path / "victim"  # a file of yours the colleague would have you overwrite
    victim.write_text("mine\n")
    run = shared_run
    out = run / "model.out"
    planted = other_user.run("ln", "-s", str(victim), str(out))
    assert planted.returncode == 0, planted.stderr
    step = craft(tmp_path / "ckpt", {"model/w": zeros_tensor("float32", (4,))})
    result = run_cli("ckpt", "export", str(step), "-o", str(out), "--format", fmt)
    assert result.returncode == 0, result.stderr[-3000:]
    assert victim.read_text() == "mine\n"
    assert not out.is_symlink() and out.stat().st_uid == os.getuid()
    assert tuple(load(out, fmt)["w"].shape) == (4,)
    assert sorted(p.name for p in run.iterdir()) == ["model.out"]  # no temporary left


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_the_exported_files_mode_follows_the_umask(tmp_path, fmt):
    step = craft(tmp_path / "ckpt", {"model/w": zeros_tensor("float32", (4,))})
    for umask in (0o022, 0o002, 0o077):
        out = tmp_path / f"m{umask:o}.{fmt}"
        old = os.umask(umask)
        try:
            code, text = cli("ckpt", "export", str(step), "-o", str(out), "--format", fmt)
        finally:
            os.umask(old)
        assert code == 0, text
        assert out.stat().st_mode & 0o777 == 0o666 & ~umask, oct(umask)


def test_a_file_size_limit_below_the_export_is_refused_before_reading(tmp_path):
    """`ulimit -f` counts as what the target can hold: exit 2, the old file at the target left as it was."""
    step = craft(tmp_path / "ckpt", {"model/w": zeros_tensor("float32", (1 << 20,))}, chunk_bytes=MiB)
    out = tmp_path / "out" / "m.st"
    out.parent.mkdir()
    out.write_text("old\n")

    def small_files() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))

    result = subprocess.run(
        ["hpcscale", "ckpt", "export", str(step), "-o", str(out)],
        capture_output=True,
        text=True,
        cwd=REPO,
        preexec_fn=small_files,
    )
    assert result.returncode == 2 and "file size limit" in result.stderr, result.stderr[-3000:]
    assert out.read_text() == "old\n" and sorted(p.name for p in out.parent.iterdir()) == ["m.st"]
