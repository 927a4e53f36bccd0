"""hpcscale.portable.files, the one copy of hpcscale's safe reads and atomic writes, held to its docstrings:
a planted symlink is never written through, a failed write (a full disk) leaves the old file and no
temporary, a FIFO is never waited on, a size limit holds before and while reading."""

from __future__ import annotations

import errno
import os
import stat
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hpcscale.portable import files


def _names(d):
    return sorted(os.listdir(d))


@given(old=st.binary(max_size=4096), new=st.binary(max_size=4096) | st.text(max_size=512))
@settings(max_examples=40, deadline=None)
def test_a_reader_sees_the_new_bytes_whole_and_nothing_else_is_left(tmp_path_factory, old, new):
    d = tmp_path_factory.mktemp("w")
    (d / "f").write_bytes(old)
    files.atomic_write(d / "f", new)
    want = new.encode("utf-8", "surrogateescape") if isinstance(new, str) else new
    assert (d / "f").read_bytes() == want and _names(d) == ["f"]


def test_a_symlink_planted_at_the_name_is_replaced_not_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("keep")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "f").symlink_to(victim)
    files.atomic_write(tmp_path / "d" / "f", b"new")
    assert victim.read_text() == "keep"
    assert not (tmp_path / "d" / "f").is_symlink() and (tmp_path / "d" / "f").read_bytes() == b"new"


def test_relative_to_a_directory_descriptor_and_with_an_exact_mode(tmp_path):
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    old = os.umask(0o077)
    try:
        files.atomic_write("exact", "x", dir_fd=fd, mode=0o644, exact_mode=True)
        files.atomic_write("masked", "x", dir_fd=fd, mode=0o644)
    finally:
        os.umask(old)
        os.close(fd)
    assert stat.S_IMODE((tmp_path / "exact").stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "masked").stat().st_mode) == 0o600


def test_a_write_that_fails_for_space_leaves_the_old_file_and_no_temporary(tmp_path):
    """RLIMIT_FSIZE makes write() fail with EFBIG at 1 MiB, as a full disk fails it with ENOSPC: same path."""
    (tmp_path / "f").write_text("old")
    code = (
        "import resource, signal, sys\n"
        "from hpcscale.portable import files\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))\n"
        "try:\n"
        f"    files.atomic_write({str(tmp_path / 'f')!r}, b'x' * (4 << 20))\n"
        "except OSError as e:\n"
        "    sys.exit(e.errno)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == errno.EFBIG, r.stderr
    assert (tmp_path / "f").read_text() == "old" and _names(tmp_path) == ["f"]


def test_create_makes_the_file_once_and_never_replaces_or_follows_what_is_there(tmp_path):
    """atomic_create: the first writer creates the file whole; a second, a planted symlink (dangling or not)
    and a directory at the name are left as they are; no temporary is left in any case."""
    assert files.atomic_create(tmp_path / "f", "first") is True
    assert files.atomic_create(tmp_path / "f", b"second") is False
    assert (tmp_path / "f").read_text() == "first"
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    assert files.atomic_create(tmp_path / "dangling", b"x") is False
    assert not (tmp_path / "nowhere").exists()
    (tmp_path / "dir").mkdir()
    assert files.atomic_create(tmp_path / "dir", b"x") is False
    assert _names(tmp_path) == ["dangling", "dir", "f"]


def test_reads_refuse_a_fifo_without_waiting_a_link_when_asked_and_what_is_over_the_limit(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(files.NotRegularFile):
        files.read_regular(tmp_path / "fifo", max_bytes=10)  # a blocking open would hang here
    (tmp_path / "real").write_bytes(b"0123456789")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert files.read_regular(tmp_path / "link", max_bytes=10)[0] == b"0123456789"
    with pytest.raises(OSError) as e:
        files.read_regular(tmp_path / "link", max_bytes=10, follow_symlinks=False)
    assert e.value.errno == errno.ELOOP
    with pytest.raises(files.TooLarge) as big:
        files.read_regular(tmp_path / "real", max_bytes=9)
    assert big.value.size == 10 and big.value.limit == 9
    with pytest.raises(FileNotFoundError):
        files.read_regular(tmp_path / "missing", max_bytes=9)
