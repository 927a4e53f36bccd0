"""The receiving end of a transfer: a destination root that takes a file's name only once its bytes are proven.

`hpcscale stage` runs a Sink in-process for a local destination, and the staging agent (hpcscale/xsite/
agent.py) runs it at the other site for an ssh:// one. Guarantees (docs/staging.md):
- a file appears under its final name only after every byte of it has been hashed and the hash matched the
  manifest (it is written to an unnamed inode or a part file, then linked or renamed);
- the destination's manifest and record are written last, after one syncfs of the whole destination
  filesystem if asked (--sync): a destination with a manifest then holds the data durably;
- an interrupted transfer leaves `.NAME.HASH16.hpcscale-part` files that a rerun continues from where they end;
- nothing is written through a symlink: a destination directory that is a symlink is refused;
- `.hpcscale-stage/verified.json` at the destination root records what was verified there (size, mtime, ctime,
  inode and hash of each file) when a transfer completed, so a rerun trusts files whose stat is unchanged
  without reading them. Files put in place by a transfer that did not complete are journalled but not
  trusted: a rerun hashes them (a local read) before skipping them, since without the final syncfs their data
  may not have reached the disk.
"""

import contextlib
import json
import os
import stat
import threading

from hpcscale.portable.errors import StageError
from hpcscale.portable.hashing import blocks, check_algorithm, hash_fd, hasher
from hpcscale.portable.paths import RECORD, STATE_DIR, check_relpath, part_name
from hpcscale.portable.threads import parallel_map

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


class Writer:
    """One file arriving at a Sink: bytes are hashed as they are written.

    A small new file is written to an unnamed inode (O_TMPFILE) and linked under its name once verified: one
    directory operation instead of a temporary name's create and rename (about a third less time per small
    file on ext4 here), and a killed transfer leaves nothing behind. Larger files, resumed files and
    filesystems without O_TMPFILE use `.NAME.HASH16.hpcscale-part`, renamed once verified."""

    def __init__(self, sink, entry, offset):
        self.sink = sink
        self.path, self.size, self.mtime_ns, self.hash = entry
        self.final, prefix = sink.paths(self.path, create=True)
        self.part = part_name(prefix, self.hash)
        self.h = hasher(sink.algorithm)
        self.fd = None
        self.unnamed = False
        if offset == 0 and self.size < TMPFILE_MAX and sink.tmpfile_ok:
            try:
                self.fd = os.open(os.path.dirname(self.final), os.O_TMPFILE | os.O_RDWR, 0o644)
                self.unnamed = True
            except (OSError, AttributeError):
                sink.tmpfile_ok = False  # not on this filesystem (or platform): named part files from now on
        if self.unnamed:
            pass
        elif offset > 0:  # a part file a killed transfer left: hash what is there, append the rest
            self.fd = os.open(self.part, os.O_RDWR | os.O_NOFOLLOW)
            try:
                if self._hash_prefix(offset) != offset:
                    raise StageError(f"{self.part}: part file shorter than announced", "runtime")
                os.ftruncate(self.fd, offset)
            except BaseException:
                os.close(self.fd)
                raise
        else:
            self.fd = os.open(self.part, os.O_WRONLY | os.O_NOFOLLOW | os.O_CREAT | os.O_TRUNC, 0o644)
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
            self.sink.ready(self.part, self.final, (self.path, self.size, self.mtime_ns, self.hash))

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
            out = os.open(self.part, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
            try:
                for block in blocks(self.fd, 0, self.size):
                    view = memoryview(block)
                    while view:
                        view = view[os.write(out, view) :]
                os.utime(out, ns=(self.mtime_ns, self.mtime_ns))
            finally:
                os.close(out)
        os.rename(self.part, self.final)
        return os.lstat(self.final)

    def abort(self):
        """Stop, keeping a named part file so that a rerun continues it (an unnamed one simply vanishes)."""
        with contextlib.suppress(OSError):
            os.close(self.fd)


def _lstat(path):
    try:
        return os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None


def _unlink(path):
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


class Sink:
    """The destination root: plans what must move, receives files, renames them in verified batches."""

    def __init__(self, root, algorithm, dry_run=False, sync=False, jobs=4):
        check_algorithm(algorithm)  # a missing hash module is reported when first needed
        self.algorithm = algorithm
        self.dry_run = dry_run
        self.sync = sync
        self.jobs = max(2, jobs)  # plan-time lstat and hashing threads (2 measured best here for -j 1)
        root = os.path.expanduser(root)  # ssh://host/~/data names ~/data
        if not dry_run:
            os.makedirs(root, exist_ok=True)
        self.root = os.path.realpath(root)
        self._dirs = {""}  # reldirs known to be real directories (not symlinks) under root
        self._lock = threading.Lock()
        self._journal = None
        self._root_fd = None
        self.tmpfile_ok = hasattr(os, "O_TMPFILE")

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

    # -- records ----------------------------------------------------------------------------------------
    def load_records(self, committed_only=False):
        """({path: [size, mtime_ns, ctime_ns, ino, hash]} of what this destination verified with our algorithm,
        whether journals were found). committed_only: the record of completed transfers, no journals."""
        state = os.path.join(self.root, STATE_DIR)
        records = {}
        try:
            with open(os.path.join(state, RECORD)) as f:
                doc = json.load(f)
            if doc.get("hash_algorithm") == self.algorithm:
                records.update(doc.get("files") or {})
        except (OSError, ValueError, AttributeError):
            pass
        try:
            names = [] if committed_only else sorted(os.listdir(state))
        except OSError:
            names = []
        journals = False
        for name in names:
            if name.startswith("journal-") and name.endswith(".jsonl"):
                journals = True
                with open(os.path.join(state, name)) as f:
                    for line in f:
                        try:
                            alg, path, rec = json.loads(line)
                        except ValueError:
                            continue  # a line cut short by a kill
                        if alg == self.algorithm:
                            records[path] = rec
        return records, journals

    def _record_line(self, path, st, digest):
        if self._journal is None:
            state = os.path.join(self.root, STATE_DIR)
            os.makedirs(state, exist_ok=True)
            self._journal = open(os.path.join(state, f"journal-{os.urandom(8).hex()}.jsonl"), "a")  # noqa: SIM115
        rec = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, digest]
        self._journal.write(json.dumps([self.algorithm, path, rec]) + "\n")

    # -- plan -------------------------------------------------------------------------------------------
    def plan(self, entries, check="stat"):
        """For each [path, size, mtime_ns, hash]: -1 if the destination already holds it (proven), else the
        offset to send from (0, or the length of a part file a killed transfer left).

        check='stat': trust the record when size, mtime, ctime and inode are unchanged; other files of the
        right size are hashed. check='hash': hash every file that is there.
        Returns (statuses, {"hashed": files hashed here, "hashed_bytes": n, "parts": parts completed})."""
        records = self.load_records(committed_only=True)[0] if check == "stat" else {}
        todo = []  # (index, path, kind): files to hash
        statuses = [0] * len(entries)
        absent = set()  # directories that do not exist: nothing in them to stat
        present = []  # indexes of entries whose directory exists
        finals = []
        root = self.root + "/"
        dirs = self._dirs
        for i, entry in enumerate(entries):
            rel = entry[0]
            problem = check_relpath(rel)
            if problem:
                raise StageError(problem, "input")
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
        isreg, isdir = stat.S_ISREG, stat.S_ISDIR
        for i, final, st in zip(present, finals, sts):
            rel, size, _mtime, digest = entries[i]
            if st is not None and isreg(st.st_mode) and st.st_size == size:
                rec = records.get(rel)
                if (
                    rec is not None
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
            if pst is None or not stat.S_ISREG(pst.st_mode) or pst.st_size > size:
                continue
            if pst.st_size == size:
                todo.append((i, part, "part"))
            else:
                statuses[i] = pst.st_size
        info = {"hashed": 0, "hashed_bytes": 0, "proven": 0, "parts": 0}
        if not todo:
            return statuses, info

        def prove(item):
            _i, path, _kind = item
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
            except OSError:
                return item, None, 0
            try:
                digest, n = hash_fd(fd, self.algorithm)
            finally:
                os.close(fd)
            return item, digest, n

        for (i, path, kind), digest, n in parallel_map(prove, todo, self.jobs, batch=8):
            info["hashed"] += 1
            info["hashed_bytes"] += n
            rel, size, mtime, want = entries[i]
            if digest != want:
                continue  # send it again (a stale part is overwritten from offset 0)
            statuses[i] = -1
            info["proven"] += 1
            if self.dry_run:
                continue
            final = self.paths(rel)[0]
            if kind == "part":
                os.utime(path, ns=(mtime, mtime))
                self.ready(path, final, (rel, size, mtime, want))
                info["parts"] += 1
            else:
                with self._lock:
                    self._record_line(rel, os.lstat(final), want)
        self.flush()
        return statuses, info

    # -- receive ----------------------------------------------------------------------------------------
    def begin(self, entry, offset=0):
        if self.dry_run:
            raise StageError("dry run: nothing is written", "runtime")
        return Writer(self, entry, offset)

    def ready(self, part, final, entry):
        """A verified part file: rename it into place and journal it."""
        rel, _size, _mtime, digest = entry
        os.rename(part, final)
        self.placed(rel, os.lstat(final), digest)  # stat after the rename: it moves the ctime

    def placed(self, rel, st, digest):
        with self._lock:
            self._record_line(rel, st, digest)

    def root_fd(self):
        if self._root_fd is None:
            self._root_fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
        return self._root_fd

    def flush(self):
        """Push the journal to the OS (a killed agent loses no line of a file already in place)."""
        with self._lock:
            if self._journal is not None:
                self._journal.flush()

    # -- commit -----------------------------------------------------------------------------------------
    def commit(self, manifest_text=None, name="manifest.json"):
        """syncfs; merge the journals into the record; then write the manifest last, so that a destination
        with a manifest is a complete, verified, durable copy. A rerun that changed nothing writes nothing."""
        self.flush()
        with self._lock:
            if self._journal is not None:
                self._journal.close()
                self._journal = None
        state = os.path.join(self.root, STATE_DIR)
        records, journals = self.load_records()
        if self.sync and journals:  # journals: something was put in place since the last commit
            fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
            try:
                _syncfs(fd)
            finally:
                os.close(fd)
        if journals:
            for rel in list(records):  # a journal line of an earlier, killed run may be stale: stat decides
                try:
                    st = os.lstat(os.path.join(self.root, rel))
                except OSError:
                    del records[rel]
                    continue
                if records[rel][:4] != [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]:
                    del records[rel]
        if journals or not os.path.exists(os.path.join(state, RECORD)):
            os.makedirs(state, exist_ok=True)
            _atomic_write(
                os.path.join(state, RECORD),
                json.dumps({"hash_algorithm": self.algorithm, "files": records}, separators=(",", ":")),
            )
            for n in os.listdir(state):
                if n.startswith("journal-"):
                    _unlink(os.path.join(state, n))
        if manifest_text is not None:
            final, _ = self.paths(name, create=True)
            try:
                with open(final) as f:
                    same = f.read() == manifest_text
            except OSError:
                same = False
            if not same:
                _atomic_write(final, manifest_text)

    def is_clean(self, manifest_sha256, name="manifest.json"):
        """Nothing to commit: no journal waits to be merged, and the destination's manifest is this one
        (sha256 of its text; None: no manifest is written). A no-op rerun then needs no commit round trip."""
        import hashlib

        try:
            if any(n.startswith("journal-") for n in os.listdir(os.path.join(self.root, STATE_DIR))):
                return False
        except OSError:
            return False
        if manifest_sha256 is None:
            return True
        try:
            with open(os.path.join(self.root, name), "rb") as f:
                return hashlib.sha256(f.read()).hexdigest() == manifest_sha256
        except OSError:
            return False

    def close(self):
        if self._root_fd is not None:
            os.close(self._root_fd)
            self._root_fd = None
        with self._lock:
            if self._journal is not None:
                self._journal.close()
                self._journal = None


def _atomic_write(path, text):
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dfd = os.open(os.path.dirname(path) or ".", os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
