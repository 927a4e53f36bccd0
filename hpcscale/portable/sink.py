"""The receiving end of a transfer: a destination root that takes a file's name only once its bytes are proven.

`hpcscale stage` runs a Sink in-process for a local destination, and the staging agent (hpcscale/xsite/
agent.py) runs it at the other site for an ssh:// one. Guarantees (docs/staging.md):
- one stage at a time: a Sink that writes holds `.hpcscale-stage/lock` (hpcscale.portable.lock) from its plan
  to its close, and extra streams of the same stage join with the lock's token; no file is written without it;
- every entry is checked before anything acts on it (hpcscale.portable.paths.check_entry): its path, its hash
  (which names its part file), its size, mtime and mode;
- a file appears under its final name only after every byte of it has been hashed and the hash matched the
  manifest (it is written to an unnamed inode or a part file, then linked or renamed), with the manifest's
  mode (minus the stage's umask) and mtime set through its descriptor first;
- nothing is written through a symlink or a foreign hard link: a destination directory or the state
  directory that is a symlink is refused; state files are opened relative to the state directory's
  descriptor with O_NOFOLLOW; a part file is created fresh with O_EXCL (a planted one is unlinked first, which
  leaves the file it was linked to untouched), and a part file with more than one link is never resumed;
- an interrupted transfer leaves `.NAME.HASH16.hpcscale-part` files that a rerun continues from where they end;
- `.hpcscale-stage/verified.json` at the destination root records what was verified there (size, mtime, ctime,
  inode and hash of each file) when a transfer completed, so a rerun trusts files whose stat is unchanged
  without reading them. Files put in place by a transfer that did not complete are journalled but not
  trusted: a rerun hashes them (a local read) before skipping them, since without the final syncfs their data
  may not have reached the disk;
- the destination's manifest and record are written last (after one syncfs if asked: --sync), and only when
  the local side has proven every listed file in place (hpcscale.xsite.stage).
"""

import contextlib
import json
import os
import stat
import threading

from hpcscale.portable import lock as dest_lock
from hpcscale.portable.errors import StageError
from hpcscale.portable.hashing import HEX_DIGITS, blocks, check_algorithm, hash_fd, hasher
from hpcscale.portable.paths import (
    INT64,
    MODE_BITS,
    RECORD,
    STATE_DIR,
    check_dir_entry,
    check_entry,
    check_relpath,
    part_name,
)
from hpcscale.portable.threads import in_background, parallel_map

_libc = None


def _syncfs(fd):
    """Flush every dirty page of the filesystem holding `fd`: one call instead of one fsync per file."""
    global _libc
    if _libc is None:
        try:
            import ctypes

            _libc = ctypes.CDLL(None, use_errno=True)
            getattr(_libc, "syncfs")  # noqa: B009 - probe: AttributeError where libc has none
        except (OSError, AttributeError):
            _libc = False
    if _libc and _libc.syncfs(fd) == 0:
        return
    os.sync()


TMPFILE_MAX = 8 << 20  # smaller files are written as unnamed O_TMPFILE inodes: nothing to resume in them
PRIVATE = 0o600  # a file in transit is readable by its owner only, whatever mode it will have
NO_FOLLOW = os.O_NOFOLLOW | os.O_NONBLOCK  # never a symlink; never block in open() on a FIFO
_HEX = "0123456789abcdef"


class Writer:
    """One file arriving at a Sink: bytes are hashed as they are written.

    A small new file is written to an unnamed inode (O_TMPFILE) and linked under its name once verified: one
    directory operation instead of a temporary name's create and rename (about a third less time per small
    file on ext4 here), and a killed transfer leaves nothing behind. Larger files, resumed files and
    filesystems without O_TMPFILE use `.NAME.HASH16.hpcscale-part`, renamed once verified."""

    def __init__(self, sink, entry, offset):
        problem = check_entry(entry, sink.algorithm)
        if problem:
            raise StageError(problem, "input")
        self.sink = sink
        self.path, self.size, self.mtime_ns, self.hash, mode = entry
        if type(offset) is not int or not 0 <= offset <= self.size:
            raise StageError(f"'{self.path}': offset {str(offset)[:40]} is not within its {self.size} bytes", "input")
        self.mode = sink.final_mode(mode)
        self.final, prefix = sink.paths(self.path, create=True, checked=True)
        self.part = part_name(prefix, self.hash)
        self.h = hasher(sink.algorithm)
        self.fd = None
        self.unnamed = False
        self.chmod = True
        if offset == 0 and self.size < TMPFILE_MAX and sink.tmpfile_ok:
            try:
                # An unnamed inode is invisible until verified and linked: it may be born with its final mode,
                # which saves the fchmod whenever the process umask leaves that mode alone (0644 under 022).
                self.fd = os.open(os.path.dirname(self.final), os.O_TMPFILE | os.O_RDWR, self.mode)
                self.unnamed = True
                self.chmod = sink.proc_umask is None or self.mode & sink.proc_umask != 0
            except (OSError, AttributeError):
                sink.tmpfile_ok = False  # not on this filesystem (or platform): named part files from now on
        if self.unnamed:
            pass
        elif offset > 0:  # a part file a killed transfer left: hash what is there, append the rest
            self.fd = os.open(self.part, os.O_RDWR | NO_FOLLOW)
            try:
                st = os.fstat(self.fd)
                if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
                    raise StageError(
                        f"{self.part}: not a part file of ours ({st.st_nlink} links); not resumed", "runtime"
                    )
                if self._hash_prefix(offset) != offset:
                    raise StageError(f"{self.part}: part file shorter than announced", "runtime")
                os.ftruncate(self.fd, offset)
            except BaseException:
                os.close(self.fd)
                raise
        else:
            # A fresh part file of our own: whatever has the name (another stage's leftover, a planted hard link
            # to a file elsewhere) loses the name, and is never opened.
            _unlink(self.part)
            self.fd = os.open(self.part, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, PRIVATE)
        self.n = offset

    def _hash_prefix(self, offset):
        """Feed the first `offset` bytes to the hash and seek past them; returns how many there were."""
        pos = 0
        for block in blocks(self.fd, 0, offset):
            self.h.update(block)
            pos += len(block)
        os.lseek(self.fd, pos, os.SEEK_SET)
        return pos

    def write(self, data):
        view = memoryview(data)
        self.h.update(view)
        while view:
            n = os.write(self.fd, view)
            view = view[n:]
        self.n += len(data)

    def finish(self):
        """Check size and hash, then put the file in place. StageError('verify') and nothing left on mismatch."""
        try:
            digest = self.h.hexdigest()
            if self.n != self.size or digest != self.hash:
                what = f"{self.n} bytes" if self.n != self.size else f"hash {digest}"
                raise StageError(
                    f"{self.path}: arrived with {what}, the manifest says {self.size} bytes, hash {self.hash} "
                    "(did the source change after the manifest was built?)",
                    "verify",
                )
            if self.chmod:
                os.fchmod(self.fd, self.mode)
            os.utime(self.fd, ns=(self.mtime_ns, self.mtime_ns))
            st = self._link() if self.unnamed else None
        except BaseException:
            os.close(self.fd)
            _unlink(self.part)
            raise
        if self.unnamed:
            os.close(self.fd)
            self.sink.placed(self.path, st, self.hash)
        else:
            os.close(self.fd)
            self.sink.ready(self.part, self.final, self.path, self.hash)

    def _link(self):
        """Give the verified unnamed inode its name: linkat(AT_SYMLINK_FOLLOW) on /proc/self/fd (an absolute
        source path with a src_dir_fd makes Python call linkat rather than link). A name that exists already
        is replaced atomically: link under the part name, then rename over it."""
        proc = f"/proc/self/fd/{self.fd}"
        try:
            os.link(proc, self.final, src_dir_fd=self.sink.root_fd())
            return os.fstat(self.fd)  # after the link, which moves the ctime
        except FileExistsError:
            _unlink(self.part)
            os.link(proc, self.part, src_dir_fd=self.sink.root_fd())
        except OSError:
            # no /proc, or a filesystem that refuses: copy the verified bytes to a named part file instead
            self.sink.tmpfile_ok = False
            _unlink(self.part)
            out = os.open(self.part, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, PRIVATE)
            try:
                for block in blocks(self.fd, 0, self.size):
                    view = memoryview(block)
                    while view:
                        view = view[os.write(out, view) :]
                os.fchmod(out, self.mode)
                os.utime(out, ns=(self.mtime_ns, self.mtime_ns))
            finally:
                os.close(out)
        os.rename(self.part, self.final)
        return os.lstat(self.final)

    def abort(self):
        """Stop, keeping a named part file so that a rerun continues it (an unnamed one simply vanishes)."""
        with contextlib.suppress(OSError):
            os.close(self.fd)


def _proc_umask():
    """This process's umask, read without changing it (os.umask would, for every thread); None if unknown."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return None


def _lstat(path):
    try:
        return os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None


def _identity(st):
    """What changes whenever a file is replaced (rename: another inode) or written (size, mtime, ctime)."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _unlink(path, dir_fd=None):
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path, dir_fd=dir_fd)


def _read_regular(name, dir_fd, limit=None):
    """The bytes of regular file `name` under dir_fd, never following a symlink or waiting on a FIFO; None if
    it is not there or not a regular file."""
    try:
        fd = os.open(name, os.O_RDONLY | NO_FOLLOW, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None
        parts = []
        for block in blocks(fd, 0, st.st_size if limit is None else min(limit, st.st_size)):
            parts.append(bytes(block))
        return b"".join(parts)
    finally:
        os.close(fd)


class Sink:
    """The destination root: plans what must move, receives files, renames them in verified batches.

    `lock`: the token of the destination lock that another stream of the same stage took (an extra ssh stream
    joining a transfer); None: this Sink takes the lock itself when it plans."""

    def __init__(self, root, algorithm, dry_run=False, sync=False, jobs=4, umask=0, lock=None):
        check_algorithm(algorithm)  # a missing hash module is reported when first needed
        if type(umask) is not int or not 0 <= umask <= MODE_BITS:
            raise StageError(f"umask {str(umask)[:40]} is not permission bits from 0 to 0o777", "input")
        self.algorithm = algorithm
        self.dry_run = dry_run
        self.sync = sync
        self.umask = umask
        self.jobs = max(2, jobs)  # plan-time lstat and hashing threads (2 measured best here for -j 1)
        root = os.path.expanduser(root)  # ssh://host/~/data names ~/data
        if not dry_run:
            os.makedirs(root, exist_ok=True)
        self.root = os.path.realpath(root)
        self._dirs = {""}  # reldirs known to be real directories (not symlinks) under root
        self._lock = threading.Lock()
        self._fd_lock = threading.Lock()
        self._journal = None
        self._root_fd = None
        self._state_fd = None
        self.tmpfile_ok = hasattr(os, "O_TMPFILE")
        self.proc_umask = _proc_umask()
        self.lock_token = None  # the destination lock's token while this stage holds it
        self._want_dirs = None  # [(path, mode)] the manifest lists, once planned
        self._prefetch = None  # the record read ahead (prefetch_record), waited for by the plan
        self.dirs_clean = True  # every listed directory is there with its mode
        self._lock_owner = False
        if lock is not None and not dry_run:
            state = self.state_fd()
            if state is None:
                raise StageError(f"{self.state_path()}: this stage's lock is gone", "runtime")
            if type(lock) is not str:
                raise StageError(f"lock token {str(lock)[:40]} is not a string", "input")
            dest_lock.check(state, lock, self.state_path())
            self.lock_token = lock

    def final_mode(self, mode):
        """The mode a file gets here: the manifest's (0644 where it records none) minus the stage's umask."""
        return (0o644 if mode is None else mode) & ~self.umask

    # -- paths ------------------------------------------------------------------------------------------
    def _check_dir(self, reldir, create):
        if reldir in self._dirs or reldir == "":
            return True
        parent, _, _name = reldir.rpartition("/")
        if not self._check_dir(parent, create):
            return False
        path = os.path.join(self.root, reldir)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            if not create:
                return False
            with contextlib.suppress(FileExistsError):
                os.mkdir(path)
            st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode):
            raise StageError(
                f"{path} is a symlink (-> {os.readlink(path)}); "
                "hpcscale stage never writes through a symlink in the destination",
                "input",
            )
        if not stat.S_ISDIR(st.st_mode):
            raise StageError(f"{path} is in the way: the manifest needs a directory there", "input")
        with self._lock:
            self._dirs.add(reldir)
        return True

    def paths(self, rel, create=False, checked=False):
        """(final path, part prefix) of `rel`; its directories checked (and created if `create`).
        String concatenation, not os.path.join: this runs for every file of a 100k-file manifest."""
        if not checked:
            problem = check_relpath(rel)
            if problem:
                raise StageError(problem, "input")
        reldir, _, name = rel.rpartition("/")
        if reldir not in self._dirs:
            self._check_dir(reldir, create)
        base = self.root + "/" + reldir if reldir else self.root
        return base + "/" + name, base + "/." + name

    def root_fd(self):
        if self._root_fd is None:
            fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
            with self._fd_lock:  # threads may ask at once (the agent's clean check runs beside the plan)
                if self._root_fd is None:
                    self._root_fd, fd = fd, None
            if fd is not None:
                os.close(fd)
        return self._root_fd

    def state_path(self):
        return self.root + "/" + STATE_DIR

    def state_fd(self, create=False):
        """A descriptor of the state directory, opened without following a symlink (created if `create`);
        None if there is none. Every state file is opened relative to it."""
        if self._state_fd is not None:
            return self._state_fd
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
        try:
            root = self.root_fd()
        except FileNotFoundError:
            return None
        for attempt in (0, 1):
            try:
                fd = os.open(STATE_DIR, flags, dir_fd=root)
                with self._fd_lock:
                    if self._state_fd is None:
                        self._state_fd, fd = fd, None
                if fd is not None:
                    os.close(fd)
                return self._state_fd
            except FileNotFoundError:
                if not create or attempt:
                    return None
                with contextlib.suppress(FileExistsError):
                    os.mkdir(STATE_DIR, 0o755, dir_fd=root)
            except OSError:  # ELOOP: a symlink; ENOTDIR: a file
                raise StageError(
                    f"{self.state_path()} is a symlink or not a directory; "
                    "hpcscale stage never writes through a symlink in the destination",
                    "input",
                ) from None
        return None

    def take_lock(self):
        """Hold the destination lock from here to close() (nothing if held, or in a dry run)."""
        if self.dry_run or self.lock_token is not None:
            return
        self.lock_token = dest_lock.acquire(self.state_fd(create=True), self.state_path())
        self._lock_owner = True

    # -- records ----------------------------------------------------------------------------------------
    def prefetch_record(self):
        """Start reading the record of verified files on a thread (the agent calls this at 'init', while the
        plan, a megabyte for 10k files, is still on the wire). The plan uses what was read only if the record
        file is still the same file, unchanged (identity, size, times): else it reads it again, under the lock."""
        if self._prefetch is None and self.algorithm:
            self._prefetch = in_background(self._read_record)

    def _read_record(self):
        """(identity of the record file, {path: record}); (None, {}) where there is none."""
        state = self.state_fd()
        if state is None:
            return None, {}
        try:
            fd = os.open(RECORD, os.O_RDONLY | NO_FOLLOW, dir_fd=state)
        except OSError:
            return None, {}
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return None, {}
            data = b"".join(bytes(b) for b in blocks(fd, 0, st.st_size))
        finally:
            os.close(fd)
        records = {}
        try:
            doc = json.loads(data) if data else {}
            if doc.get("hash_algorithm") == self.algorithm and type(doc.get("files")) is dict:
                records = doc["files"]
        except (ValueError, AttributeError, RecursionError):
            pass
        return _identity(st), records

    def _record_now(self):
        """The record as it is now: the prefetched one if the file has not changed since, else read again."""
        if self._prefetch is not None:
            try:
                ident, records = self._prefetch()
            except Exception:  # read again below, where an error surfaces as it would have
                ident, records = None, {}
            finally:
                self._prefetch = None
            state = self.state_fd()
            if ident is not None and state is not None:
                try:
                    if _identity(os.stat(RECORD, dir_fd=state, follow_symlinks=False)) == ident:
                        return records
                except OSError:
                    pass
        return self._read_record()[1]

    def load_records(self, committed_only=False, fresh=None):
        """({path: [size, mtime_ns, ctime_ns, ino, hash]} of what this destination verified with our algorithm,
        whether journals were found). committed_only: the record of completed transfers, no journals.
        `fresh`: a set that gets the paths whose line comes from this stage's own journals (named with its lock
        token, read last so that they win): stat'ed as they were placed, under this stage's lock."""
        state = self.state_fd()
        if state is None:
            return {}, False
        records = dict(self._record_now())
        names = [] if committed_only else os.listdir(state)
        mine = f"journal-{self.lock_token}-" if self.lock_token else None
        names = sorted(names, key=lambda n: (mine is not None and n.startswith(mine), n))
        journals = False
        for name in names:
            if name.startswith("journal-") and name.endswith(".jsonl"):
                journals = True
                own = mine is not None and name.startswith(mine)
                text = (_read_regular(name, state) or b"").decode("utf-8", "replace")
                for line in _journal_lines(text):
                    try:
                        alg, path, rec = line
                    except (ValueError, TypeError):
                        continue
                    if alg == self.algorithm and type(path) is str:
                        records[path] = rec
                        if fresh is not None:
                            if own:
                                fresh.add(path)
                            else:
                                fresh.discard(path)
        return records, journals

    def _record_line(self, path, st, digest):
        if self._journal is None:
            name = f"journal-{self.lock_token}-{os.urandom(8).hex()}.jsonl"
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_APPEND
            fd = os.open(name, flags, 0o644, dir_fd=self.state_fd(create=True))
            self._journal = os.fdopen(fd, "a")
        rec = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, digest]
        self._journal.write(json.dumps([self.algorithm, path, rec]) + "\n")

    # -- plan -------------------------------------------------------------------------------------------
    def plan(self, entries, check="stat", manifest_sha256=None, name="manifest.json", dirs=None):
        """For each [path, size, mtime_ns, hash, mode]: -1 if the destination already holds it (proven, with
        its mode), else the offset to send from (0, or the length of a part file a killed transfer left).

        If anything is to be written and the destination holds another manifest than this stage's (sha256 of
        its text, `manifest_sha256`; None: this stage writes none), that manifest is removed first: it would
        vouch for files this stage is about to replace, and a destination with a manifest must be a complete
        copy of it. It comes back, the new one, at commit.

        `dirs`: [[path, mode]] of every directory the manifest lists (None: it lists none); they are created and
        given their modes (minus the umask) at commit; `dirs_clean` says whether they already are.

        Takes the destination lock first (not in a dry run). check='stat': trust the record when size, mtime,
        ctime and inode are unchanged; other files of the right size are hashed. check='hash': hash every file
        that is there. Returns (statuses, {"hashed": files hashed here, "hashed_bytes": n, "parts": parts
        completed})."""
        if type(entries) is not list:
            raise StageError("plan: entries must be a list", "input")
        locked = self._plan_dirs(dirs)
        self.take_lock()
        records = self.load_records(committed_only=True)[0] if check == "stat" else {}
        todo = []  # (index, path, kind): files to hash
        statuses = [0] * len(entries)
        absent = set()  # directories that do not exist: nothing in them to stat
        present = []  # indexes of entries whose directory exists
        finals = []
        root = self.root + "/"
        dirs = self._dirs
        digits, relpath = HEX_DIGITS[self.algorithm], check_relpath
        for i, entry in enumerate(entries):
            # every entry checked before anything acts on it; the common case in one expression (this runs for
            # every file of a no-op rerun), the message from the rule (hpcscale.portable.paths.check_entry)
            if not (
                type(entry) is list
                and len(entry) == 5
                and relpath(entry[0]) is None
                and type(entry[1]) is int
                and 0 <= entry[1] < INT64
                and type(entry[2]) is int
                and -INT64 <= entry[2] < INT64
                and type(entry[3]) is str
                and len(entry[3]) == digits
                and not entry[3].strip(_HEX)
                and (entry[4] is None or (type(entry[4]) is int and 0 <= entry[4] <= MODE_BITS))
            ):
                raise StageError(f"files[{i}]: {check_entry(entry, self.algorithm) or 'bad entry'}", "input")
            rel = entry[0]
            reldir = rel.rpartition("/")[0]
            if reldir not in dirs:
                if reldir in absent:
                    continue
                if not self._check_dir(reldir, False):
                    absent.add(reldir)
                    continue
            present.append(i)
            finals.append(root + rel)
        # lstat in parallel: on a cold metadata cache each one is a disk read, and they overlap
        sts = parallel_map(_lstat, finals, self.jobs, batch=256)
        parts = []  # (index, part path): files not there; a killed transfer may have left a part file
        isreg, isdir, imode = stat.S_ISREG, stat.S_ISDIR, stat.S_IMODE
        umask = self.umask
        for i, final, st in zip(present, finals, sts):
            rel, size, _mtime, digest, mode = entries[i]
            if st is not None and isreg(st.st_mode) and st.st_size == size:
                if mode is not None and imode(st.st_mode) != mode & ~umask:
                    continue  # another mode: sent again (a rare case: a chmod at the source)
                rec = records.get(rel)
                if (
                    type(rec) is list
                    and len(rec) == 5
                    and rec[4] == digest
                    and rec[2] == st.st_ctime_ns
                    and rec[1] == st.st_mtime_ns
                    and rec[3] == st.st_ino
                    and rec[0] == size
                ):
                    statuses[i] = -1
                else:
                    todo.append((i, final, "final"))
                continue
            if st is not None and isdir(st.st_mode):
                raise StageError(f"{final} is a directory; the manifest lists a file there", "input")
            if size >= TMPFILE_MAX:  # only such files are written under part names
                parts.append((i, part_name(self.paths(rel, checked=True)[1], digest)))
        for (i, part), pst in zip(parts, parallel_map(_lstat, [t[1] for t in parts], self.jobs, batch=256)):
            size = entries[i][1]
            if pst is None or not stat.S_ISREG(pst.st_mode) or pst.st_size > size or pst.st_nlink != 1:
                continue  # sent from 0 into a fresh part file of ours
            if pst.st_size == size:
                todo.append((i, part, "part"))
            else:
                statuses[i] = pst.st_size
        info = {"hashed": 0, "hashed_bytes": 0, "proven": 0, "parts": 0}
        if not self.dry_run and (todo or any(x != -1 for x in statuses)):
            if manifest_sha256 is not None:
                self._retire(manifest_sha256, name)
            for rel, mode in locked:  # a directory we cannot write into until commit gives it its mode again
                self._chmod_dir(rel, mode | 0o700)
        if not todo:
            return statuses, info

        def prove(item):
            i, path, kind = item
            try:
                fd = os.open(path, os.O_RDONLY | NO_FOLLOW)
            except OSError:
                return None, 0
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode) or (kind == "part" and st.st_nlink != 1):
                    return None, 0
                digest, n = hash_fd(fd, self.algorithm, limit=st.st_size)  # the size known: no second fstat
                _rel, _size, mtime, want, mode = entries[i]
                if digest == want and kind == "part" and not self.dry_run:
                    os.fchmod(fd, self.final_mode(mode))
                    os.utime(fd, ns=(mtime, mtime))
            finally:
                os.close(fd)
            return digest, n

        for (i, path, kind), (digest, n) in zip(todo, parallel_map(prove, todo, self.jobs, batch=8)):
            info["hashed"] += 1
            info["hashed_bytes"] += n
            rel, want = entries[i][0], entries[i][3]
            if digest != want:
                continue  # send it again (a stale part is replaced from offset 0)
            statuses[i] = -1
            info["proven"] += 1
            if self.dry_run:
                continue
            final = self.paths(rel)[0]
            if kind == "part":
                self.ready(path, final, rel, want)
                info["parts"] += 1
            else:
                with self._lock:
                    self._record_line(rel, os.lstat(final), want)
        self.flush()
        return statuses, info

    def _plan_dirs(self, dirs):
        """Check the listed directories; returns those that exist without owner rwx (files cannot be placed in
        them until commit sets their final mode)."""
        self.dirs_clean = True
        if dirs is None:
            return []
        if type(dirs) is not list:
            raise StageError("plan: dirs must be a list", "input")
        for i, entry in enumerate(dirs):
            problem = check_dir_entry(entry)
            if problem:
                raise StageError(f"dirs[{i}]: {problem}", "input")
        self._want_dirs = [(rel, mode & ~self.umask) for rel, mode in dirs]
        locked = []
        for (rel, mode), st in zip(self._want_dirs, parallel_map(_lstat, [self.root + "/" + r for r, _ in dirs], 2)):
            if st is None or not stat.S_ISDIR(st.st_mode) or stat.S_IMODE(st.st_mode) != mode:
                self.dirs_clean = False
            if st is not None and stat.S_ISDIR(st.st_mode) and st.st_mode & 0o700 != 0o700:
                locked.append((rel, stat.S_IMODE(st.st_mode)))
        return locked

    def _chmod_dir(self, rel, mode):
        """Give listed directory `rel` `mode`, through a descriptor opened without following a symlink."""
        fd = os.open(self.root + "/" + rel, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            if stat.S_IMODE(os.fstat(fd).st_mode) != mode:
                os.fchmod(fd, mode)
        finally:
            os.close(fd)

    def _apply_dirs(self):
        """Create every listed directory (empty ones too) and give each its mode, deepest first: a parent
        without write permission is set only after everything under it."""
        if self._want_dirs is None or self.dirs_clean:
            return
        for rel, mode in sorted(self._want_dirs, key=lambda d: -d[0].count("/")):
            try:
                self._check_dir(rel, True)
                self._chmod_dir(rel, mode)
            except OSError as e:  # ELOOP: a symlink swapped in since it was checked
                raise StageError(
                    f"{self.root}/{rel}: cannot give the directory its mode ({e.strerror})", "runtime"
                ) from None

    def _retire(self, manifest_sha256, name):
        import hashlib

        if type(name) is not str or "/" in name or check_relpath(name):
            raise StageError(f"manifest name {str(name)[:80]!r} is not a plain file name", "input")
        data = _read_regular(name, self.root_fd())
        if data is not None and hashlib.sha256(data).hexdigest() != manifest_sha256:
            _unlink(name, self.root_fd())
            os.fsync(self.root_fd())  # gone before any file it lists is replaced

    # -- receive ----------------------------------------------------------------------------------------
    def begin(self, entry, offset=0):
        if self.dry_run:
            raise StageError("dry run: nothing is written", "runtime")
        if self.lock_token is None:
            raise StageError(f"{self.root}: a file arrived before this stage took the destination's lock", "runtime")
        return Writer(self, entry, offset)

    def ready(self, part, final, rel, digest):
        """A verified part file: rename it into place and journal it."""
        os.rename(part, final)
        self.placed(rel, os.lstat(final), digest)  # stat after the rename: it moves the ctime

    def placed(self, rel, st, digest):
        with self._lock:
            self._record_line(rel, st, digest)

    def flush(self):
        """Push the journal to the OS (a killed agent loses no line of a file already in place)."""
        with self._lock:
            if self._journal is not None:
                self._journal.flush()

    # -- commit -----------------------------------------------------------------------------------------
    def commit(self, manifest_text=None, name="manifest.json"):
        """syncfs; merge the journals into the record; then write the manifest last, so that a destination
        with a manifest is a complete, verified, durable copy. A rerun that changed nothing writes nothing.
        The caller commits only once every listed file is proven in place (hpcscale.xsite.stage)."""
        if type(name) is not str or "/" in name or check_relpath(name):
            raise StageError(f"manifest name {str(name)[:80]!r} is not a plain file name", "input")
        if manifest_text is not None and type(manifest_text) is not str:
            raise StageError("the manifest to commit is not text", "input")
        if self.lock_token is None:
            raise StageError(f"{self.root}: commit without the destination's lock", "runtime")
        self.flush()
        with self._lock:
            if self._journal is not None:
                self._journal.close()
                self._journal = None
        self._apply_dirs()
        state = self.state_fd(create=True)
        fresh = set()
        records, journals = self.load_records(fresh=fresh)
        if self.sync and journals:  # journals: something was put in place since the last commit
            _syncfs(self.root_fd())
        if journals:
            # A line of an earlier, killed run, or of the record, may be stale: stat decides. This stage's own
            # lines were stat'ed as their files took their names, under this lock: a change since moves the
            # ctime, and a later plan that trusts the record compares it first.
            for rel in list(records):
                if rel in fresh:
                    continue
                rec = records[rel]
                try:
                    st = os.lstat(os.path.join(self.root, rel)) if check_relpath(rel) is None else None
                except OSError:
                    st = None
                if (
                    st is None
                    or type(rec) is not list
                    or rec[:4] != [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
                ):
                    del records[rel]
        if journals or _read_regular(RECORD, state, 0) is None:
            text = json.dumps({"hash_algorithm": self.algorithm, "files": records}, separators=(",", ":"))
            _atomic_write(state, RECORD, text)
            for n in os.listdir(state):
                if n.startswith("journal-"):
                    _unlink(n, state)
        if manifest_text is not None:
            old = _read_regular(name, self.root_fd())
            if old is None or old != manifest_text.encode("utf-8", "surrogateescape"):
                _atomic_write(self.root_fd(), name, manifest_text)

    def is_clean(self, manifest_sha256, name="manifest.json"):
        """Nothing to commit: no journal waits to be merged, and the destination's manifest is this one
        (sha256 of its text; None: no manifest is written). A no-op rerun then needs no commit round trip."""
        import hashlib

        try:
            state = self.state_fd()
            if state is None or any(n.startswith("journal-") for n in os.listdir(state)):
                return False
        except (OSError, StageError):
            return False
        if manifest_sha256 is None:
            return True
        if type(name) is not str or "/" in name:
            return False
        data = _read_regular(name, self.root_fd())
        return data is not None and hashlib.sha256(data).hexdigest() == manifest_sha256

    def close(self):
        with self._lock:
            if self._journal is not None:
                self._journal.close()
                self._journal = None
        if self._lock_owner and self._state_fd is not None:
            dest_lock.release(self._state_fd, self.lock_token)
            self._lock_owner = False
        for attr in ("_state_fd", "_root_fd"):
            fd = getattr(self, attr)
            if fd is not None:
                os.close(fd)
                setattr(self, attr, None)


_decode = json.JSONDecoder().raw_decode


def _journal_lines(text):
    """The JSON value of each whole line of a journal, skipping any other line (one a kill cut short). One
    decoder call a line, no wrapper: json.loads per line cost half again as much (10k lines: 33 ms vs 22)."""
    out = []
    i, n = 0, len(text)
    while i < n:
        end = text.find("\n", i)
        if end < 0:
            end = n
        try:
            value, stop = _decode(text, i)
            if stop == end:  # the value is this line, all of it, and no more
                out.append(value)
        except (ValueError, RecursionError):
            pass
        i = end + 1
    return out


def _atomic_write(dir_fd, name, text):
    """Write `name` under dir_fd atomically: a private temporary name (O_EXCL, never a symlink), fsync,
    rename, fsync of the directory."""
    tmp = f".{name}.tmp.{os.getpid()}.{os.urandom(4).hex()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644, dir_fd=dir_fd)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", errors="surrogateescape") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        _unlink(tmp, dir_fd)
        raise
    os.fsync(dir_fd)
