"""Safe file I/O, one copy for all of hpcscale (stdlib only: the staging agent ships it to other sites).

- `open_regular` / `read_regular`: a regular file's descriptor or bytes, never waiting on a FIFO or a device
  (O_NONBLOCK, then fstat on the descriptor opened: no window between the check and the open), optionally
  never through a symbolic link at the last component (O_NOFOLLOW), and, for reads, refused before reading
  when over a size limit (and when it grew past it while read).
- `atomic_write`: a file replaced whole or not at all.
- `atomic_create`: a file created whole or not at all, never replacing one that exists (one writer of many wins).
- `fsync_dir`: a directory's entries made durable (a rename or a create survives a power cut once it returns).
- `append_json_lines`: JSON lines appended to a log others may read while it grows (the one appender of hpcscale's
  JSON-lines files: submissions, attempts, resume decisions, timing, the sync log).

Failures are OSError, so each caller words them for its own readers: FileNotFoundError, errno ELOOP for a
symbolic link refused, `NotRegularFile` and `TooLarge` below.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat

__all__ = [
    "JsonLinesAppender",
    "NotRegularFile",
    "TooLarge",
    "append_json_lines",
    "atomic_create",
    "atomic_write",
    "fsync_dir",
    "open_regular",
    "read_regular",
]


class NotRegularFile(OSError):
    """The path names a FIFO, a device, a socket or a directory."""

    def __init__(self, path, st):
        super().__init__(errno.EINVAL, "not a regular file", str(path))
        self.stat = st


class TooLarge(OSError):
    """The file holds more than the caller's limit (`size` is what fstat said, or limit + 1 if it grew)."""

    def __init__(self, path, size, limit):
        super().__init__(errno.EFBIG, f"{size} bytes, over the limit of {limit}", str(path))
        self.size, self.limit = size, limit


def open_regular(path, *, dir_fd=None, follow_symlinks=True):
    """(descriptor, its fstat) of the regular file at `path` (relative to `dir_fd` when given), opened
    read-only, close-on-exec, without blocking. The caller closes the descriptor."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow_symlinks else os.O_NOFOLLOW)
    fd = os.open(path, flags, dir_fd=dir_fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegularFile(path, st)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def read_regular(path, *, max_bytes, dir_fd=None, follow_symlinks=True, check=None):
    """(bytes, fstat) of the regular file at `path`, of at most `max_bytes`: refused (TooLarge) before a byte
    is read when fstat says more, and when it grew past the limit while read. `check(stat)`, when given, runs
    on the fstat before any byte is read (raising refuses the file: a record whose size is already wrong).
    The bytes are read into one buffer of the size fstat gave (plus one byte, to see growth)."""
    fd, st = open_regular(path, dir_fd=dir_fd, follow_symlinks=follow_symlinks)
    try:
        if st.st_size > max_bytes:
            raise TooLarge(path, st.st_size, max_bytes)
        if check is not None:
            check(st)
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(st.st_size + 1)
            if len(data) > st.st_size:  # it grew since fstat: the rest, up to one byte past the limit
                data += f.read(max_bytes + 1 - len(data))
        if len(data) > max_bytes:
            raise TooLarge(path, len(data), max_bytes)
        return data, st
    finally:
        os.close(fd)


def fsync_dir(directory) -> None:
    """fsync a directory (a path, or a descriptor opened on one) so that the names created or renamed in it
    survive a crash of the machine."""
    if isinstance(directory, int):
        os.fsync(directory)
        return
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path, data, *, dir_fd=None, mode=0o644, exact_mode=False, durable=True) -> None:
    """Replace `path` (relative to `dir_fd` when given) with `data` (bytes, or str written as UTF-8 with
    surrogateescape) whole or not at all.

    Guarantees: a reader sees the old file or the whole new one, never a part; the temporary has a random
    name beside `path`, is created with O_CREAT|O_EXCL|O_NOFOLLOW (nothing planted under that name is written
    through) and is removed on any failure, a full disk included, leaving the old file as it was; a symbolic
    link planted at `path` is replaced by the rename, never followed. `mode` is the new file's mode less the
    umask, or exactly `mode` with `exact_mode`. `durable` (the default): the data is fsync'd before the rename
    and the directory after it, so that once this returns the new file survives a power cut; without it a
    crash may leave the old file (never a torn one on a journaling filesystem that orders data before
    renames). A kill -9 between the create and the rename may leave the temporary (`.NAME.<hex>.tmp`)."""
    head, tmp = _write_temporary(path, data, dir_fd, mode, exact_mode, durable)
    try:
        os.replace(tmp, path, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise
    if durable:
        fsync_dir(dir_fd if dir_fd is not None else head or ".")


def atomic_create(path, data, *, dir_fd=None, mode=0o644, exact_mode=False, durable=True) -> bool:
    """Create `path` (relative to `dir_fd` when given) holding `data`, whole, unless something already has
    that name: True when this call created it, False when `path` existed (a file, a directory, a symbolic
    link, dangling or not: never followed, never replaced).

    Guarantees: those of atomic_write for the temporary (random name, O_EXCL|O_NOFOLLOW, removed on every
    path, a full disk included; `mode`, `exact_mode`, `durable` alike), and the temporary is hard-linked to
    `path`, which fails instead of replacing: of several writers at once (every rank of a job) exactly one
    creates the file and the others get False, and a reader sees no file or the whole of it, never a part.
    With `durable` the data is fsync'd before the link and the directory after it. A filesystem without hard
    links fails with OSError (EPERM, EOPNOTSUPP or ENOSYS) and creates nothing. A kill -9 between the create
    and the unlink may leave the temporary (`.NAME.<hex>.tmp`)."""
    head, tmp = _write_temporary(path, data, dir_fd, mode, exact_mode, durable)
    try:
        os.link(tmp, path, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
    except FileExistsError:
        return False
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=dir_fd)
    if durable:
        fsync_dir(dir_fd if dir_fd is not None else head or ".")
    return True


def _write_temporary(path, data, dir_fd, mode, exact_mode, durable):
    """(directory part of `path`, name of a new temporary beside it holding `data`) for atomic_write and
    atomic_create; the temporary is removed again if writing it fails."""
    if isinstance(data, str):
        data = data.encode("utf-8", "surrogateescape")
    head, name = os.path.split(os.fspath(path))
    if dir_fd is not None and head:  # the directory fsync'd must be the one the name is in
        raise ValueError(f"{path!r}: with dir_fd, the path must be a name in that directory")
    tmp = os.path.join(head, f".{name}.{os.urandom(8).hex()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dir_fd)
    try:
        try:
            if exact_mode:
                os.fchmod(fd, mode)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise
    return head, tmp


MAX_LINE_BYTES = 1 << 20  # one JSON line of a log: the readers skip longer ones (a record is a few hundred bytes)


def append_json_lines(path, docs, *, dir_fd=None, mode=0o644, max_line=MAX_LINE_BYTES, durable=False, **dumps) -> int:
    """Append each of `docs` to the log at `path` (relative to `dir_fd` when given) as one JSON line; returns the
    file's size after. `dumps` are json.dumps's options (sort_keys, separators).

    Guarantees, the same for every log hpcscale appends to:
    - opened O_RDWR|O_APPEND|O_CREAT|O_NOFOLLOW|O_NONBLOCK|O_CLOEXEC (created with `mode` less the umask): a
      symbolic link planted at `path` is refused (OSError, errno ELOOP), never appended through, and a FIFO is
      never waited on; the descriptor must then be a regular file by fstat (NotRegularFile otherwise, also for
      a FIFO with no reader: ENXIO);
    - every line is encoded and checked before the file is opened: one over `max_line` bytes (newline included)
      is TooLarge and nothing is written;
    - one write(2) per line, at the end of the file whoever else appends (O_APPEND): lines of two writers never
      interleave; a line is never split over two writes unless the disk fills mid-line;
    - a full disk (ENOSPC, EDQUOT, or a short write: the kernel wrote part of a line) raises OSError(ENOSPC)
      and writes nothing more; the file may then end in a torn line, which readers skip as not JSON, and the
      next append first ends it with a newline, so a torn line never swallows the next one;
    - `durable`: fsync'd before returning (the line survives a power cut once this returns).
    JsonLinesAppender gives the same with the descriptor held, for a log written every step."""
    lines = _json_lines(path, docs, max_line, dumps)
    fd = _open_log(path, dir_fd, mode)
    try:
        return _append_lines(fd, path, lines, durable)
    finally:
        os.close(fd)


class JsonLinesAppender:
    """append_json_lines with the log's descriptor held open (a log appended to every training step: one write
    per line, no open and close, which on a parallel file system are metadata round trips). The same guarantees,
    checked when it is opened and at each append (the descriptor's file still a regular one; a torn last line
    ended first). Lines go to the file it opened, also if its name is later replaced."""

    def __init__(self, path, *, mode=0o644, max_line=MAX_LINE_BYTES):
        self.path, self.max_line = path, max_line
        self._fd: int | None = _open_log(path, None, mode)
        try:
            st = os.fstat(self._fd)
            if not stat.S_ISREG(st.st_mode):
                raise NotRegularFile(path, st)
        except BaseException:
            self.close()
            raise

    def append(self, docs, *, durable=False, **dumps) -> int:
        """Append each of `docs` as one JSON line (append_json_lines' guarantees); the file's size after."""
        if self._fd is None:
            raise ValueError(f"{self.path}: the appender is closed")
        return _append_lines(self._fd, self.path, _json_lines(self.path, docs, self.max_line, dumps), durable)

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)


def _json_lines(path, docs, max_line: int, dumps: dict) -> list[bytes]:
    """Each doc as one encoded JSON line, checked against `max_line` before anything is written."""
    lines = []
    for doc in docs:
        line = (json.dumps(doc, **dumps) + "\n").encode("utf-8", "surrogateescape")
        if len(line) > max_line:
            raise TooLarge(path, len(line), max_line)
        lines.append(line)
    return lines


def _open_log(path, dir_fd, mode: int) -> int:
    # O_RDWR, not O_WRONLY: the last byte is read to see a torn line; every write still goes to the end
    flags = os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        return os.open(path, flags, mode, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ENXIO:  # a FIFO no one reads: O_NONBLOCK refused to wait for a reader
            raise NotRegularFile(path, None) from None
        raise


def _append_lines(fd: int, path, lines: list[bytes], durable: bool) -> int:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise NotRegularFile(path, st)
    if lines and st.st_size and os.pread(fd, 1, st.st_size - 1) != b"\n":
        lines[0] = b"\n" + lines[0]  # a torn last line (a full disk, a kill): end it, keep ours whole
    for line in lines:
        try:
            written = os.write(fd, line)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise OSError(errno.ENOSPC, "disk full: the line is not written", str(path)) from None
            raise
        if written != len(line):
            raise OSError(errno.ENOSPC, f"disk full: {written} of a line's {len(line)} bytes written", str(path))
    if durable:
        os.fsync(fd)
    return os.fstat(fd).st_size
