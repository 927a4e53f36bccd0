"""Both ends of a transfer, in one self-contained file: the destination (Sink) and the source (Source).

`hpcscale stage` runs these in-process for local paths. For an ssh:// endpoint it sends this file's source text
over the ssh connection and the remote `python3` executes it (see `main`), so another site needs nothing
installed but python3 >= 3.8 (and the `xxhash` or `blake3` module for those algorithms; sha256 is in the
standard library). Hence: standard library only, no hpcscale imports, nothing newer than Python 3.8.

Guarantees the Sink keeps (docs/staging.md):
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
import errno
import json
import os
import stat
import struct
import sys
import threading
import time

STATE_DIR = ".hpcscale-stage"
RECORD = "verified.json"
PART_SUFFIX = ".hpcscale-part"
BLOCK = 4 << 20
HASH_ALGORITHMS = ("xxh128", "sha256", "blake3")


class StageError(Exception):
    """kind: 'input' (exit 2: the manifest or a path is unacceptable), 'verify' (exit 3: content does not match
    the manifest), 'missing' (a source file is not there; exit 1), 'runtime' (exit 1)."""

    def __init__(self, message, kind="runtime"):
        super().__init__(message)
        self.kind = kind


_site_lock = threading.Lock()
_site_done = []


def _site():
    """The agent runs under `python3 -S` (site-packages processing is a good part of an interpreter's start, and
    a no-op rerun needs nothing from it); the first time a third-party module is needed, load the site now.
    Under a lock, and marked done only after site.main() returns: the writer threads ask at the same time, and
    'site' is in sys.modules before its paths are."""
    if _site_done or not sys.flags.no_site:
        return
    with _site_lock:
        if not _site_done:
            import site

            site.main()
            _site_done.append(True)


def hasher(algorithm):
    """A new hash object (update/hexdigest) for a manifest's algorithm name."""
    if algorithm == "xxh128":
        _site()
        try:
            import xxhash
        except ImportError:
            raise StageError("hash algorithm xxh128 needs the xxhash module (pip install xxhash)", "input") from None
        return xxhash.xxh3_128()
    if algorithm == "sha256":
        import hashlib

        return hashlib.sha256()
    if algorithm == "blake3":
        _site()
        try:
            import blake3
        except ImportError:
            raise StageError("hash algorithm blake3 needs the blake3 module (pip install blake3)", "input") from None
        return blake3.blake3()
    raise StageError("unknown hash algorithm '{}' (known: {})".format(algorithm, ", ".join(HASH_ALGORITHMS)), "input")


def check_relpath(path):
    """None if `path` is a safe relative path ('/'-separated, normal form, inside its root), else why not.
    Substring tests rather than a split: this runs for every file of every plan."""
    if not isinstance(path, str) or not path:
        return "path must be a non-empty string"
    if "\\" in path or "\x00" in path:
        return f"path '{path}' contains a backslash or NUL"
    if path[0] == "/":
        return f"path '{path}' is absolute"
    wrapped = "/" + path + "/"
    if "/../" in wrapped:
        return f"path '{path}' contains '..'"
    if "//" in wrapped or "/./" in wrapped:
        return f"path '{path}' is not in normal form"
    return None


_tls = threading.local()
SMALL = 256 << 10  # below this, one pread of the whole rest: no buffer to fill


def blocks(fd, start=0, end=None):
    """The bytes of fd from `start` to `end` (EOF if None), as views of one reused per-thread buffer (a new
    4 MiB buffer per file would cost more than reading a small file)."""
    if end is None:
        end = os.fstat(fd).st_size
    if end - start <= SMALL:
        data = os.pread(fd, end - start, start)
        if data:
            yield data
        return
    buf = getattr(_tls, "buf", None)
    if buf is None:
        buf = _tls.buf = bytearray(BLOCK)
    view = memoryview(buf)
    pos = start
    while pos < end:
        n = os.preadv(fd, [view[: min(BLOCK, end - pos)]], pos)
        if n == 0:
            return
        yield view[:n]
        pos += n


def hash_fd(fd, algorithm, limit=None, on_bytes=None):
    """(hex digest, bytes hashed) of the first `limit` bytes (all, if None) of an open file."""
    h = hasher(algorithm)
    n = 0
    for block in blocks(fd, 0, limit):
        h.update(block)
        n += len(block)
        if on_bytes is not None:
            on_bytes(len(block))
    return h.hexdigest(), n


def parallel_map(fn, items, jobs, batch=32):
    """[fn(x) for x in items] on `jobs` threads, each taking runs of `batch` neighbouring items (so reads stay
    near-sequential) from a shared cursor; the first exception is re-raised. Lighter than an executor's
    future per item, which costs more than hashing a small file."""
    items = list(items)
    out = [None] * len(items)
    jobs = max(1, min(jobs, (len(items) + batch - 1) // batch))
    if jobs == 1:
        return [fn(x) for x in items]
    lock = threading.Lock()
    cursor = [0]
    errors = []

    def work():
        while not errors:
            with lock:
                start = cursor[0]
                cursor[0] += batch
            if start >= len(items):
                return
            for j in range(start, min(start + batch, len(items))):
                try:
                    out[j] = fn(items[j])
                except BaseException as e:
                    errors.append(e)
                    return

    threads = [threading.Thread(target=work, daemon=True) for _ in range(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


def in_background(fn, *args):
    """Start fn(*args) on a thread; returns a function that waits for it and returns its result (or raises)."""
    box = []

    def run():
        try:
            box.append((True, fn(*args)))
        except BaseException as e:
            box.append((False, e))

    t = threading.Thread(target=run, daemon=True)
    t.start()

    def result():
        t.join()
        ok, value = box[0]
        if not ok:
            raise value
        return value

    return result


def within(path, root):
    """Whether the resolved `path` is `root` or lies under it."""
    return path == root or path.startswith(root + os.sep)


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
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as e:
            if e.errno != errno.ELOOP:
                kind = "missing" if e.errno == errno.ENOENT else "runtime"
                raise StageError(f"{os.path.join(self.root, rel)}: {e.strerror}", kind) from None
            real = os.path.realpath(path)
            if not within(real, self.root):
                raise StageError(f"'{rel}' leads through a symlink out of {self.root} (-> {real})", "input") from None
            fd = os.open(real, os.O_RDONLY)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise StageError(f"'{rel}' under {self.root} is not a regular file", "input")
        return fd


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
        self.part = sink.part_name(prefix, self.hash)
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
        if algorithm not in HASH_ALGORITHMS:  # a missing hash module is reported when first needed
            raise StageError(f"unknown hash algorithm '{algorithm}' (known: {', '.join(HASH_ALGORITHMS)})", "input")
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

    def part_name(self, part_prefix, digest):
        return f"{part_prefix}.{digest[:16]}{PART_SUFFIX}"

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
                parts.append((i, self.part_name(self.paths(rel, checked=True)[1], digest)))
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


class TokenBucket:
    """A bandwidth limit shared by threads: take(n) sleeps until n bytes fit under `rate` bytes/s."""

    def __init__(self, rate):
        self.rate = float(rate)
        self.lock = threading.Lock()
        self.t = time.monotonic()
        self.debt = 0.0

    def take(self, n):
        with self.lock:
            now = time.monotonic()
            self.debt = max(0.0, self.debt - (now - self.t) * self.rate) + n
            self.t = now
            wait = self.debt / self.rate - 0.05  # allow a 50 ms burst
        if wait > 0:
            time.sleep(wait)


# -- the wire protocol: a 4-byte big-endian header length, a JSON header, then `n` raw bytes if it says so --


def send(out, header, payload=b""):
    h = json.dumps(header, separators=(",", ":")).encode()
    out.write(struct.pack(">I", len(h)) + h)
    if payload:
        out.write(payload)


def read_exact(inp, n):
    """Exactly n bytes, as a bytes object of its own."""
    data = inp.read(n)
    if len(data) == n:
        return bytes(data)
    parts = [bytes(data)]
    got = len(data)
    while got < n:
        more = inp.read(n - got)
        if not more:
            raise EOFError(f"the stream ended {n - got} bytes short")
        parts.append(bytes(more))
        got += len(more)
    return b"".join(parts)


class Input:
    """A read buffer over a pipe that calls `before_block` (flush the replies) before it waits for input.

    read() returns views of one reused buffer (no allocation per read): use the bytes before the next read."""

    def __init__(self, fd, before_block, size=1 << 20):
        self.fd = fd
        self.before_block = before_block
        self.buf = bytearray(size)
        self.view = memoryview(self.buf)
        self.pos = self.end = 0

    def read(self, n):
        """Up to n bytes (fewer if fewer are buffered); empty at the end of the stream."""
        if self.pos >= self.end:
            self.before_block()
            self.end = os.readv(self.fd, [self.buf])
            self.pos = 0
            if not self.end:
                return b""
        start = self.pos
        self.pos = min(self.end, start + n)
        return self.view[start : self.pos]


def recv(inp):
    raw = inp.read(4)
    if not raw:
        raise EOFError("the stream ended")
    if len(raw) != 4:
        raw = bytes(raw) + read_exact(inp, 4 - len(raw))
    (n,) = struct.unpack(">I", raw)
    return json.loads(read_exact(inp, n))


def stream_file(fd, offset, size, out, bucket=None):
    """Send bytes [offset, size) of fd to out."""
    pos = offset
    for data in blocks(fd, offset, size):
        if bucket is not None:
            bucket.take(len(data))
        out.write(data)
        pos += len(data)
    if pos < size:
        raise StageError(f"file shrank while being sent ({pos} of {size} bytes)", "runtime")


def _open_end(role, root, opts):
    if role == "sink":
        return Sink(
            root,
            opts["algorithm"],
            dry_run=opts.get("dry_run", False),
            sync=opts.get("sync", False),
            jobs=opts.get("jobs", 4),
        )
    return Source(root)


def serve(role, root, inp, out):
    """The remote side of one ssh stream: hello at once (so the connection is up before the other side has
    even read its manifest), then 'init' with the options, then role 'sink': plan/put/flush/commit; role
    'source': get."""
    send(out, {"hello": 1, "python": sys.version.split()[0]})
    out.flush()
    end = None
    bucket = None
    pool = None
    while True:
        try:
            req = recv(inp)
        except EOFError:
            break
        op = req.get("op")
        try:
            if op == "init":
                opts = req.get("opts") or {}
                end = _open_end(role, root, opts)
                bucket = TokenBucket(opts["bwlimit"]) if opts.get("bwlimit") else None
                send(out, {"ready": True, "root": end.root})
                continue
            if end is None:
                raise StageError(f"'{op}' before 'init'", "runtime")
            if op == "plan":
                # Whether the destination already holds this very commit, found beside the plan's lstats (it
                # reads and hashes the destination's manifest). Meaningful only if the plan hashes nothing:
                # then nothing the plan does changes it.
                is_clean = None
                if "manifest_sha256" in req:  # None: no manifest is written, and nothing to commit can be
                    is_clean = in_background(end.is_clean, req["manifest_sha256"], req.get("name", "manifest.json"))
                statuses, info = end.plan(req["entries"], req.get("check", "stat"))
                clean = is_clean is not None and info["hashed"] == 0 and all(x < 0 for x in statuses) and is_clean()
                send(out, {"statuses": statuses, "info": info, "clean": clean})
            elif op == "put":
                if req.get("offset", 0) == 0 and req["n"] < POOL_MAX:
                    pool = pool or _WriterPool(end, out)
                    entry = (req["path"], req["size"], req["mtime_ns"], req["hash"])
                    pool.submit(entry, read_exact(inp, req["n"]))
                else:
                    _serve_put(end, req, inp, out)
            elif op == "flush":
                if pool is not None:
                    pool.drain()
                end.flush()
                send(out, {"flushed": True})
            elif op == "commit":
                if pool is not None:
                    pool.drain()
                end.commit(req.get("manifest"), req.get("name", "manifest.json"))
                send(out, {"committed": True})
            elif op == "get":
                _serve_get(end, req, out, bucket)
            elif op == "bye":
                break
            else:
                send(out, {"error": f"unknown op {op!r}", "kind": "runtime"})
        except StageError as e:
            send(out, {"error": str(e), "kind": e.kind, "path": req.get("path")})
        except OSError as e:
            send(out, {"error": f"{req.get('path') or root}: {e}", "kind": "runtime", "path": req.get("path")})
        # No flush here: replies wait in the buffer until the agent is about to block on input (Input), so
        # acks of 10k small files cost a few ssh packets, not 10k.
    if pool is not None:
        pool.close()
    out.flush()
    if role == "sink" and end is not None:
        end.flush()
        end.close()


def _serve_put(sink, req, inp, out):
    entry = (req["path"], req["size"], req["mtime_ns"], req["hash"])
    left = req["n"]
    writer = None
    error = None
    try:
        writer = sink.begin(entry, req.get("offset", 0))
    except (StageError, OSError) as e:
        error = e
    while left:
        data = inp.read(min(BLOCK, left))
        if not data:
            if writer is not None:
                writer.abort()
            raise EOFError(f"the stream ended inside {entry[0]}")
        left -= len(data)
        if writer is not None and error is None:
            try:
                writer.write(data)
            except OSError as e:
                error = e
                writer.abort()
    if error is None:
        try:
            writer.finish()
        except (StageError, OSError) as e:
            error = e
    if error is not None:
        kind = getattr(error, "kind", "runtime")
        send(out, {"path": entry[0], "error": str(error), "kind": kind})
    else:
        send(out, {"path": entry[0], "ok": True})


POOL_MAX = 1 << 20  # files below this are read off the stream whole and written by the pool


class _WriterPool:
    """Two threads that write small files while the main thread reads the next ones off the pipe: creating a
    file is system time that would otherwise stall the stream (both release the GIL). Replies go out in
    completion order; each names its file."""

    def __init__(self, sink, out, threads=2):
        import queue

        self.sink, self.out = sink, out
        self.q = queue.Queue(maxsize=64)
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(threads)]
        for t in self.threads:
            t.start()

    def submit(self, entry, data):
        self.q.put((entry, data))

    def _run(self):
        while True:
            item = self.q.get()
            try:
                if item is None:
                    return
                entry, data = item
                try:
                    w = self.sink.begin(entry, 0)
                    try:
                        w.write(data)
                    except BaseException:
                        w.abort()
                        raise
                    w.finish()
                    msg = {"path": entry[0], "ok": True}
                except (StageError, OSError) as e:
                    msg = {"path": entry[0], "error": str(e), "kind": getattr(e, "kind", "runtime")}
                send(self.out, msg)  # one write call: BufferedWriter's own lock keeps replies whole
            finally:
                self.q.task_done()

    def drain(self):
        self.q.join()

    def close(self):
        for _ in self.threads:
            self.q.put(None)
        for t in self.threads:
            t.join()


class Desync(Exception):
    """The stream cannot continue (a file changed while being sent): the agent exits; a rerun resumes."""


def _serve_get(source, req, out, bucket):
    fd = source.open(req["path"])
    try:
        size = os.fstat(fd).st_size
        offset = req.get("offset", 0)
        send(out, {"path": req["path"], "n": max(0, size - offset), "size": size})
        try:
            stream_file(fd, offset, size, out, bucket)
        except (StageError, OSError) as e:
            raise Desync("{}: {}".format(req["path"], e)) from None
    finally:
        os.close(fd)


F_SETPIPE_SZ = 1031  # fcntl.F_SETPIPE_SZ, named there only from Python 3.10


def widen_pipe(fd, size=1 << 20):
    """Grow a pipe's buffer from 64 KiB (up to /proc/sys/fs/pipe-max-size): fewer, larger hand-offs between
    this process and ssh. Not a pipe, or not allowed: nothing changes."""
    try:
        import fcntl

        fcntl.fcntl(fd, F_SETPIPE_SZ, size)
    except (OSError, ImportError):
        pass


def main(argv):
    """`python3 -c <bootstrap> ROLE ROOT`: serve one stream on stdin/stdout."""
    role, root = argv[1], argv[2]
    widen_pipe(0)
    widen_pipe(1)
    out = sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing but the protocol on stdout
    # Reading the raw fd is safe: the bootstrap read exactly its three blobs' bytes from it, unbuffered.
    inp = Input(sys.stdin.fileno(), out.flush)
    serve(role, root, inp, out)
    out.flush()
    sys.stderr.flush()
    # serve() closed everything it opened; skip the interpreter's teardown, which the other side would wait for
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv)
