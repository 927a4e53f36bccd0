"""A new directory built privately and then put in place whole, in a directory others may write to.

`data prepare` writes a dataset into a directory a colleague may share (a group-writable project area). What
it must never do is write through something planted there, or leave the dataset where someone else controls
it. The promise, and how each step keeps it:

1. the build directory is made with mkdir under a random name (tempfile.mkdtemp's semantics: O_EXCL, mode
   0700, a name no one can plant in advance), relative to a descriptor of the destination's parent, and
   opened with O_NOFOLLOW|O_DIRECTORY; it must be ours (fstat). Mode 0700: no one else can add, replace or
   read an entry in it while it is built;
2. every file and subdirectory is made through descriptors (`dir_fd`), files with O_CREAT|O_EXCL|O_NOFOLLOW:
   if the build directory itself were renamed away by someone with write access to the parent, the writes
   still land in our directory, never in one put in its place;
3. `commit` gives the directory its final mode (as mkdir would under the umask), makes everything durable, and
   renames it to the final name with renameat2(RENAME_NOREPLACE): a directory, file or symbolic link at the
   final name, planted before or during the build, is never replaced and never followed; the build directory
   is removed and the caller is told (exit 2). Just before the rename the name must still lead to our
   directory (same device and inode), so a directory planted under the build name is never the one renamed.
   Where the filesystem has no RENAME_NOREPLACE (EINVAL), the final name is checked with lstat and a plain
   rename follows, which replaces at worst an empty directory or a symbolic link planted in between (never
   follows it, never removes anything with contents);
4. on any failure the build directory is removed (through descriptors, following no symbolic link), and
   nothing at the final name is touched.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
from pathlib import Path

from hpcscale.errors import BadInput
from hpcscale.portable.files import fsync_dir

RENAME_NOREPLACE = 1  # linux/fs.h


def _renameat2():
    try:
        return ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # a libc older than glibc 2.28, or not Linux
        return None


def rename_noreplace(src: str, dst: str, *, dir_fd: int) -> None:
    """Rename `src` to `dst` (names in the directory `dir_fd`) unless `dst` exists: FileExistsError then, and
    nothing changes. Falls back to lstat and rename where the kernel or filesystem lacks RENAME_NOREPLACE."""
    fn = _renameat2()
    if fn is not None:
        if fn(dir_fd, os.fsencode(src), dir_fd, os.fsencode(dst), RENAME_NOREPLACE) == 0:
            return
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOSYS):
            raise OSError(err, os.strerror(err), dst)
    try:
        os.stat(dst, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        os.rename(src, dst, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        return
    raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), dst)


def _remove_tree(name: str, *, dir_fd: int) -> None:
    """rm -r of `name` in `dir_fd`, through descriptors, following no symbolic link (shutil.rmtree takes a
    dir_fd from Python 3.11 only)."""
    fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        for entry in os.scandir(fd):
            if entry.is_dir(follow_symlinks=False):
                _remove_tree(entry.name, dir_fd=fd)
            else:
                os.unlink(entry.name, dir_fd=fd)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=dir_fd)


def _umask() -> int:
    """The process's umask, read without changing it where Linux says it (/proc/self/status): setting it to
    read it back would, for that moment, apply to files other threads create."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


class BuildDir:
    """`out`'s contents built in a private directory beside it, then renamed to `out` whole (module docstring).
    Use as a context manager: leaving it by an exception removes the build directory."""

    def __init__(self, out: Path):
        self.out = Path(out)
        self.parent_fd = os.open(self.out.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            self.name, self.fd = self._make()
        except BaseException:
            os.close(self.parent_fd)
            raise
        self.st = os.fstat(self.fd)
        self._fds: list[int] = []
        self.committed = False

    def _make(self) -> tuple[str, int]:
        for _ in range(100):
            name = f".{self.out.name}.tmp.{os.urandom(8).hex()}"
            try:
                os.mkdir(name, 0o700, dir_fd=self.parent_fd)
            except FileExistsError:
                continue
            fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self.parent_fd)
            if os.fstat(fd).st_uid != os.geteuid():  # swapped between mkdir and open
                os.close(fd)
                raise BadInput(f"{self.out.parent / name}: the build directory just made is not ours")
            os.fchmod(fd, 0o700)  # a default ACL on the parent may have widened mkdir's mode
            return name, fd
        raise FileExistsError(errno.EEXIST, "no unused temporary name", str(self.out.parent))

    def mkdir(self, rel: str) -> int:
        """A new subdirectory (one name) of the build directory; returns a descriptor on it."""
        os.mkdir(rel, 0o777, dir_fd=self.fd)
        fd = os.open(rel, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self.fd)
        self._fds.append(fd)
        return fd

    @staticmethod
    def create(name: str, *, dir_fd: int) -> int:
        """A new file `name` in the directory `dir_fd`, opened for writing (O_EXCL|O_NOFOLLOW; mode 0666 less
        the umask, as open() gives)."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        return os.open(name, flags, 0o666, dir_fd=dir_fd)

    def commit(self) -> None:
        """Give the directory mkdir's mode, make it durable and rename it to `out` (never replacing anything)."""
        os.fchmod(self.fd, 0o777 & ~_umask())
        for fd in self._fds:
            fsync_dir(fd)
        fsync_dir(self.fd)
        replaced = BadInput(
            f"{self.out.parent / self.name}: the directory being built was replaced by someone else (or moved away) "
            f"while {self.out} was prepared; nothing of this build was written to {self.out}"
        )
        try:
            here = os.stat(self.name, dir_fd=self.parent_fd, follow_symlinks=False)
        except FileNotFoundError:
            raise replaced from None
        if (here.st_dev, here.st_ino) != (self.st.st_dev, self.st.st_ino):
            raise replaced
        try:
            rename_noreplace(self.name, self.out.name, dir_fd=self.parent_fd)
        except OSError as e:
            if isinstance(e, FileExistsError) or e.errno in (errno.ENOTEMPTY, errno.ENOTDIR, errno.EEXIST):
                raise BadInput(
                    f"{self.out}: something appeared at this name while the dataset was prepared; it was left "
                    "as it is and nothing was written there (choose a new --out)"
                ) from None
            if e.errno == errno.ENOENT:  # moved away between the check and the rename
                raise replaced from None
            raise BadInput(f"{self.out}: cannot rename the finished build into place ({e.strerror})") from None
        # what was renamed may have been put in place of ours between the check and the rename: `out` must be it
        try:
            there = os.stat(self.out.name, dir_fd=self.parent_fd, follow_symlinks=False)
        except FileNotFoundError:
            raise replaced from None
        if (there.st_dev, there.st_ino) != (self.st.st_dev, self.st.st_ino):
            raise BadInput(
                f"{self.out}: what was renamed there is not the directory this build wrote (someone swapped it in "
                f"while {self.out} was prepared); do not use {self.out}: remove it and prepare again"
            )
        self.committed = True
        fsync_dir(self.parent_fd)

    def _remove(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            here = os.stat(self.name, dir_fd=self.parent_fd, follow_symlinks=False)
            if (here.st_dev, here.st_ino) == (self.st.st_dev, self.st.st_ino):  # ours, not one put in its place
                _remove_tree(self.name, dir_fd=self.parent_fd)

    def close(self) -> None:
        for fd in [*self._fds, self.fd, self.parent_fd]:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds = []

    def __enter__(self) -> BuildDir:
        return self

    def __exit__(self, *exc) -> None:
        try:
            if not self.committed:
                self._remove()
        finally:
            self.close()
