"""The sending end of a transfer, and what `manifest verify` reads through: files under a root, opened safely.

Invariant: `Source.open` hands out a descriptor only for a regular file whose path passes the manifest's path
rule (hpcscale.portable.paths.check_relpath) and whose resolved location lies under the root; a path that
leads through a symlink out of the root is StageError('input'), never opened. Files are opened with
O_NONBLOCK and checked with fstat: a FIFO at a listed path is refused, never waited on (a regular file's reads
ignore the flag).
"""

import errno
import os
import stat
import threading

from hpcscale.portable.errors import StageError
from hpcscale.portable.paths import check_relpath, within


class Source:
    """Reads files under `root`, refusing any that lead through a symlink out of it."""

    def __init__(self, root):
        self.root = os.path.realpath(os.path.expanduser(root))  # ssh://host/~/data names ~/data
        if not os.path.isdir(self.root):
            raise StageError(f"{root}: no such directory", "input")
        self._dirs = {}
        self._lock = threading.Lock()

    def _dir_ok(self, reldir):
        with self._lock:
            ok = self._dirs.get(reldir)
        if ok is None:
            real = os.path.realpath(os.path.join(self.root, reldir))
            ok = real if within(real, self.root) else None
            with self._lock:
                self._dirs[reldir] = ok or ""
        return ok or None

    def open(self, rel):
        """An fd for reading `rel`; StageError('input') if it is not a safe path to a regular file here."""
        problem = check_relpath(rel)
        if problem:
            raise StageError(problem, "input")
        reldir, _, name = rel.rpartition("/")
        real_dir = self._dir_ok(reldir)
        if real_dir is None:
            raise StageError(f"'{rel}' leads through a symlink out of {self.root}", "input")
        path = os.path.join(real_dir, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError as e:
            if e.errno != errno.ELOOP:
                kind = "missing" if e.errno in (errno.ENOENT, errno.ENOTDIR) else "runtime"
                raise StageError(f"{os.path.join(self.root, rel)}: {e.strerror}", kind) from None
            real = os.path.realpath(path)
            if not within(real, self.root):
                raise StageError(f"'{rel}' leads through a symlink out of {self.root} (-> {real})", "input") from None
            fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise StageError(f"'{rel}' under {self.root} is not a regular file (a FIFO, device or directory)", "input")
        return fd
