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
- nothing is written through a symlink or a foreign hard link, whoever else can write the destination and
  whenever they change it: every destination path is walked from the root's descriptor, each directory opened
  relative to its parent's with O_NOFOLLOW|O_DIRECTORY (made with mkdirat where missing), and every create,
  link, rename, chmod, utime and unlink is relative to the final directory's descriptor, never a path string
  resolved again later (Sink.dir_slot: one open per directory per stage, at most DIR_FDS kept). A symlink or
  a non-directory on the way is StageError('input') naming it; a directory swapped after this stage opened it
  is found at commit (walked again from the root), which then fails before anything vouches for its files.
  State files are opened relative to the state directory's descriptor with O_NOFOLLOW; a part file is created
  fresh with O_EXCL (a planted one is unlinked first, which leaves the file it was linked to untouched), and a
  part file with more than one link is never resumed;
- an interrupted transfer leaves `.NAME.HASH16.hpcscale-part` files that a rerun continues from where they end;
- `.hpcscale-stage/verified.json` at the destination root records what was verified there (size, mtime, ctime,
  inode and hash of each file) when a transfer completed, so a rerun trusts files whose stat is unchanged
  without reading them. Files put in place by a transfer that did not complete are journalled but not
  trusted: a rerun hashes them (a local read) before skipping them, since without the final syncfs their data
  may not have reached the disk. A record or journal vouches only if it and `.hpcscale-stage` belong to the
  user running this end (or root) and no one else can write them (`untrusted`, on the descriptors read):
  anyone else who can write the destination could forge one. Otherwise it is ignored (every file there is
  hashed) and the plan says why (info["record_ignored"]). `.hpcscale-stage` is made 0700 (one of ours that
  others could write is closed to them when found), records and journals 0600;
- the destination's manifest and record are written last (after one syncfs if asked: --sync), and only when
  the local side has proven every listed file in place (hpcscale.xsite.stage).
"""

import contextlib
import errno
import json
import os
import stat
import threading

from hpcscale.portable import journal as journals_
from hpcscale.portable import lock as dest_lock
from hpcscale.portable.errors import StageError
from hpcscale.portable.files import TooLarge, atomic_write, open_regular, read_regular
from hpcscale.portable.hashing import blocks, check_algorithm, hash_fd, hasher
from hpcscale.portable.paths import (
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
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW  # each level of a destination path: never a symlink
DIR_FDS = 64  # directory descriptors a Sink keeps open (one open per directory per stage, in path order)


class Writer:
    """One file arriving at a Sink: bytes are hashed as they are written.

    A small new file is written to an unnamed inode (O_TMPFILE) and linked under its name once verified: one
    directory operation instead of a temporary name's create and rename (less time per small file), and a
    killed transfer leaves nothing behind. Larger files, resumed files and
    filesystems without O_TMPFILE use `.NAME.HASH16.hpcscale-part`, renamed once verified.

    Every call is relative to the descriptor of the file's directory (Sink.dir_slot: walked from the root with
    O_NOFOLLOW at each level), held from the first byte to the name: a directory swapped for a symlink meanwhile
    is never written through. The record line is the fstat of our own descriptor after the name was given,
    never a stat of the name (which another user could have replaced in between)."""

    def __init__(self, sink, entry, offset):
        problem = check_entry(entry, sink.algorithm)
        if problem:
            raise StageError(problem, "input")
        self.sink = sink
        self.path, self.size, self.mtime_ns, self.hash, mode = entry
        if type(offset) is not int or not 0 <= offset <= self.size:
            raise StageError(f"'{self.path}': offset {str(offset)[:40]} is not within its {self.size} bytes", "input")
        self.mode = sink.final_mode(mode)
        reldir, _, self.name = self.path.rpartition("/")
        self.part = part_name("." + self.name, self.hash)  # relative to the directory's descriptor
        self.h = hasher(sink.algorithm)
        self.fd = None
        self.unnamed = False
        self.chmod = True
        self.slot = sink.dir_slot(reldir, create=True)
        try:
            self._open(offset)
        except BaseException:
            sink.release(self.slot)
            self.slot = None
            raise
        self.n = offset

    def _open(self, offset):
        sink, dfd = self.sink, self.slot[0]
        if offset == 0 and self.size < TMPFILE_MAX and sink.tmpfile_ok:
            try:
                # An unnamed inode is invisible until verified and linked: it may be born with its final mode,
                # which saves the fchmod whenever the process umask leaves that mode alone (0644 under 022).
                self.fd = os.open(".", os.O_TMPFILE | os.O_RDWR, self.mode, dir_fd=dfd)
                self.unnamed = True
                self.chmod = sink.proc_umask is None or self.mode & sink.proc_umask != 0
            except (OSError, AttributeError):
                sink.tmpfile_ok = False  # not on this filesystem (or platform): named part files from now on
        if self.unnamed:
            pass
        elif offset > 0:  # a part file a killed transfer left: hash what is there, append the rest
            self.fd = os.open(self.part, os.O_RDWR | NO_FOLLOW, dir_fd=dfd)
            try:
                st = os.fstat(self.fd)
                if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
                    raise StageError(
                        f"{self.shown(self.part)}: not a part file of ours ({st.st_nlink} links); not resumed",
                        "runtime",
                    )
                if self._hash_prefix(offset) != offset:
                    raise StageError(f"{self.shown(self.part)}: part file shorter than announced", "runtime")
                os.ftruncate(self.fd, offset)
            except BaseException:
                os.close(self.fd)
                raise
        else:
            # A fresh part file of our own: whatever has the name (another stage's leftover, a planted hard link
            # to a file elsewhere) loses the name, and is never opened.
            _unlink(self.part, dfd)
            self.fd = os.open(self.part, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, PRIVATE, dir_fd=dfd)

    def shown(self, name):
        """`name` in this file's directory, as a path for messages."""
        reldir = self.path.rpartition("/")[0]
        return f"{self.sink.root}/{reldir}/{name}" if reldir else f"{self.sink.root}/{name}"

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
        dfd = self.slot[0]
        try:
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
                if self.unnamed:
                    st = self._link(dfd)
                else:
                    os.rename(self.part, self.name, src_dir_fd=dfd, dst_dir_fd=dfd)
                    st = os.fstat(self.fd)  # after the rename, which moves the ctime; our inode, not the name's
            except BaseException as e:
                os.close(self.fd)
                _unlink(self.part, dfd)
                if isinstance(e, FileNotFoundError):  # our part file or its directory's entry went meanwhile
                    raise StageError(
                        f"{self.path}: its part file vanished while it was being placed (someone removed or "
                        "replaced it in the destination; nothing is committed)",
                        "runtime",
                    ) from None
                raise
            os.close(self.fd)
            self.sink.placed(self.path, st, self.hash, self.slot[3])
        finally:
            self._release()

    def _link(self, dfd):
        """Give the verified unnamed inode its name: linkat(AT_SYMLINK_FOLLOW) of /proc/self/fd/N (the magic
        link to our own inode; with a dir_fd Python calls linkat, which never follows the new name) into the
        directory's descriptor. A name that exists already is replaced atomically: link under the part name,
        then rename over it. Returns the fstat of our inode once named."""
        proc = f"/proc/self/fd/{self.fd}"
        try:
            os.link(proc, self.name, src_dir_fd=dfd, dst_dir_fd=dfd)
            return os.fstat(self.fd)  # after the link, which moves the ctime
        except FileExistsError:
            _unlink(self.part, dfd)
            os.link(proc, self.part, src_dir_fd=dfd, dst_dir_fd=dfd)
        except OSError:
            # no /proc, or a filesystem that refuses: copy the verified bytes to a named part file instead
            self.sink.tmpfile_ok = False
            _unlink(self.part, dfd)
            out = os.open(self.part, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, PRIVATE, dir_fd=dfd)
            try:
                for block in blocks(self.fd, 0, self.size):
                    view = memoryview(block)
                    while view:
                        view = view[os.write(out, view) :]
                os.fchmod(out, self.mode)
                os.utime(out, ns=(self.mtime_ns, self.mtime_ns))
                os.rename(self.part, self.name, src_dir_fd=dfd, dst_dir_fd=dfd)
                return os.fstat(out)
            finally:
                os.close(out)
        os.rename(self.part, self.name, src_dir_fd=dfd, dst_dir_fd=dfd)
        return os.fstat(self.fd)

    def abort(self):
        """Stop, keeping a named part file so that a rerun continues it (an unnamed one simply vanishes)."""
        with contextlib.suppress(OSError):
            os.close(self.fd)
        self._release()

    def _release(self):
        """Give the directory's descriptor back to the Sink's cache (once: finish and abort may both run)."""
        slot, self.slot = self.slot, None
        if slot is not None:
            self.sink.release(slot)


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


def _lstat_at(item):
    """lstat of (dir_fd, name); None if it is not there."""
    try:
        return os.stat(item[1], dir_fd=item[0], follow_symlinks=False)
    except (FileNotFoundError, NotADirectoryError):
        return None


def untrusted(st):
    """None if the file or directory whose fstat is `st` may vouch for content at this destination (a record,
    a journal, the state directory holding them): owned by the user running this end, or by root, and
    writable by no one else. Else why not, in words. Anyone who can write the destination could otherwise
    forge a record that makes a replaced file pass as verified."""
    me = os.geteuid()
    if st.st_uid not in (me, 0):
        return f"is owned by uid {st.st_uid}, not by this user (uid {me}) or root"
    if st.st_mode & 0o022:
        who = " and ".join(w for w, bit in (("its group", 0o020), ("others", 0o002)) if st.st_mode & bit)
        return f"is writable by {who} (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def refuse_planted_link(root):
    """DST is the destination the user named, used as it is: a directory others may write is allowed (a team's
    shared destination; what they can still do: docs/staging.md, "Trust"). But a symbolic link at DST is
    followed only when the user or root made it: one someone else planted there would send the whole stage
    wherever they chose (a directory of the user's own, say). StageError (exit 2), nothing created or written."""
    try:
        st = os.lstat(root)
    except (FileNotFoundError, NotADirectoryError):
        return
    me = os.geteuid()
    if stat.S_ISLNK(st.st_mode) and st.st_uid not in (me, 0):
        try:
            target = os.readlink(root)
        except OSError:
            target = "?"
        raise StageError(
            f"{root} is a symlink (-> {target}) owned by uid {st.st_uid}, not by this user (uid {me}) or root; "
            "hpcscale stage never writes through a symlink someone else planted. Fix: check where it leads, and "
            "stage to that directory if it is the one you mean",
            "input",
        )


def _identity(st):
    """What changes whenever a file is replaced (rename: another inode) or written (size, mtime, ctime)."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _unlink(path, dir_fd=None):
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path, dir_fd=dir_fd)


# The most read of a file this end wrote itself before it is parsed: a bigger one was not written by hpcscale
# and vouches for nothing. A manifest is at most 1 GiB (hpcscale.data.manifest.MAX_MANIFEST_BYTES, which
# portable code may not import; wire.REQUEST_MAX carries one in a commit). verified.json holds a line of about
# 150 bytes for every file ever verified at the destination (not only the last manifest's), and a journal one
# for each file a stage placed: 8 GiB is tens of millions of files.
MANIFEST_MAX = 1 << 30
RECORD_MAX = 8 << 30


class _Distrusted(OSError):
    """A state file that may not vouch for content (`untrusted`, or its state directory's): raised by a
    read_regular check before any byte of it is read."""

    def __init__(self, why):
        super().__init__(why)
        self.why = why


def _vouches(st):
    """read_regular's check for a file that vouches for content (a record, a journal): see `untrusted`."""
    why = untrusted(st)
    if why is not None:
        raise _Distrusted(why)


def _read_regular(name, dir_fd, max_bytes, check=None):
    """The bytes of regular file `name` under dir_fd (files.read_regular: never following a symlink, never
    waiting on a FIFO, at most `max_bytes`, `check` run on its fstat first); None if it is not there, not a
    regular file, unreadable, over `max_bytes` or refused by `check`."""
    try:
        return read_regular(name, max_bytes=max_bytes, dir_fd=dir_fd, follow_symlinks=False, check=check)[0]
    except OSError:  # missing, a symlink, not a regular file, unreadable, too large, _Distrusted
        return None


def _is_regular(name, dir_fd):
    """Whether `name` under dir_fd is a regular file this end can open (not a symlink, never waiting on a FIFO)."""
    try:
        fd, _st = open_regular(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return False
    os.close(fd)
    return True


UP_TO_DATE = -1  # a plan's status for a file the destination holds, proven: nothing to send


class Plan:
    """What a stage must send, and what finding out cost (Sink.plan; the agent sends it as `statuses` and
    `info`, hpcscale.xsite.stage.check_plan reads it back):
    - statuses: one per manifest entry, UP_TO_DATE or the offset to send from (0, or a part file's length);
    - hashed, hashed_bytes: files and bytes hashed at the destination to prove them (or find them stale);
    - proven: how many of the UP_TO_DATE files hashing proved (the others the record vouched for by stat);
    - parts: complete part files of a killed transfer that hashing proved and named;
    - record_ignored: why the record of verified files was not used (it could have been forged), or None."""

    __slots__ = ("hashed", "hashed_bytes", "parts", "proven", "record_ignored", "statuses")
    COUNTS = ("hashed", "hashed_bytes", "proven", "parts")

    def __init__(self, statuses, hashed=0, hashed_bytes=0, proven=0, parts=0, record_ignored=None):
        self.statuses = statuses
        self.hashed = hashed
        self.hashed_bytes = hashed_bytes
        self.proven = proven
        self.parts = parts
        self.record_ignored = record_ignored

    def info(self):
        """The wire form of everything but the statuses."""
        info = {k: getattr(self, k) for k in self.COUNTS}
        if self.record_ignored is not None:
            info["record_ignored"] = self.record_ignored
        return info

    @classmethod
    def from_wire(cls, statuses, info):
        """A Plan from a reply's statuses and info (checked by the caller: hpcscale.xsite.stage.check_plan)."""
        return cls(statuses, *(info.get(k, 0) for k in cls.COUNTS), record_ignored=info.get("record_ignored"))

    @property
    def up_to_date(self):
        return self.statuses.count(UP_TO_DATE)


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
        self.jobs = max(2, jobs)  # plan-time lstat and hashing threads; 2 even for -j 1, so I/O overlaps hashing
        root = os.path.expanduser(root)  # ssh://host/~/data names ~/data
        refuse_planted_link(root)
        if not dry_run:
            os.makedirs(root, exist_ok=True)
        self.root = os.path.realpath(root)
        self._slots = {}  # reldir -> [fd, users, retired]: directories opened by the walk (dir_slot)
        self._root_slot = [None, 0, False, None]  # the root's: never evicted
        self._dir_ids = {}  # reldir -> (st_dev, st_ino) of every directory this Sink opened
        self._planned_dirs = set()  # the directories of the files and directories the plan listed
        self._lock = threading.Lock()
        self._fd_lock = threading.RLock()  # the walk opens the root under it
        self.state_distrust = None  # why the state directory's records may not vouch for content, or None
        self.record_ignored = None  # why the record was ignored by this plan, or None (plan info record_ignored)
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
    # Every destination path is walked from the root's descriptor, one component at a time, each opened
    # relative to its parent's descriptor with O_NOFOLLOW|O_DIRECTORY (created with mkdirat where missing), and
    # every file operation is relative to the final directory's descriptor: a directory swapped for a symlink at
    # any moment is never written through, because no path string is resolved again later. The descriptors
    # are cached ("slots": [fd, users, retired, identity]), one open per directory per stage, at most DIR_FDS
    # of them kept; a slot in use (a Writer between its first byte and its name, a plan thread's lstat) is retired
    # rather than closed, and closed by its last user.

    def _open_child(self, parent_fd, name, reldir, create):
        """The descriptor of directory `name` under parent_fd (reldir: its path, for messages), created if
        `create`; None if it is not there and not `create`. StageError('input') if a symlink or a non-directory
        is in the way."""
        for attempt in (0, 1):
            try:
                return os.open(name, DIR_FLAGS, dir_fd=parent_fd)
            except FileNotFoundError:
                if not create:
                    return None
                if attempt:
                    raise StageError(f"{self.root}/{reldir}: removed as it was created", "runtime") from None
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, dir_fd=parent_fd)
            except OSError as e:
                if e.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                raise self._in_the_way(parent_fd, name, reldir) from None
        return None

    def _in_the_way(self, parent_fd, name, reldir):
        """The error for `name` under parent_fd that open(O_NOFOLLOW|O_DIRECTORY) refused: what is there now."""
        path = f"{self.root}/{reldir}"
        try:
            mode = os.stat(name, dir_fd=parent_fd, follow_symlinks=False).st_mode
            if stat.S_ISLNK(mode):
                return StageError(
                    f"{path} is a symlink (-> {os.readlink(name, dir_fd=parent_fd)}); "
                    "hpcscale stage never writes through a symlink in the destination",
                    "input",
                )
            if stat.S_ISDIR(mode):  # a directory again by now: swapped out and back while we opened it
                return StageError(
                    f"{path} was a symlink or not a directory when this stage opened it, and is a directory "
                    "again now: someone is changing the destination; hpcscale stage never writes through a "
                    "symlink in the destination",
                    "input",
                )
        except FileNotFoundError:  # gone by now: swapped out, then removed, while we opened it
            return StageError(
                f"{path} was a symlink or not a directory when this stage opened it, and was removed since: "
                "someone is changing the destination; hpcscale stage never writes through a symlink in the "
                "destination",
                "input",
            )
        except OSError:
            pass
        return StageError(f"{path} is in the way: the manifest needs a directory there", "input")

    def dir_slot(self, reldir, create=False):
        """The slot ([fd, users, retired, (st_dev, st_ino)]) of directory `reldir` ("" is the root), in use until
        release(slot); None if it is not there (and not `create`). A slot found in the cache costs a dict lookup:
        this runs for every file."""
        if reldir == "":
            if self._root_fd is None:
                try:
                    self.root_fd()
                except FileNotFoundError:  # a dry run's root that does not exist yet
                    if create:
                        raise
                    return None
            return self._root_slot
        with self._fd_lock:
            slot = self._slots.get(reldir)
            if slot is None:
                slot = self._walk(reldir, create)
                if slot is None:
                    return None
            slot[1] += 1
            return slot

    def release(self, slot):
        if slot is self._root_slot:
            return
        with self._fd_lock:
            slot[1] -= 1
            if slot[2] and slot[1] == 0:
                os.close(slot[0])

    def _walk(self, reldir, create):
        """Open `reldir` from its nearest cached ancestor (the lock held). A directory already seen by this Sink
        that is now another one was swapped under us: StageError('input')."""
        names = reldir.split("/")
        k = len(names) - 1
        while k and "/".join(names[:k]) not in self._slots:
            k -= 1
        if k:
            parent = self._slots["/".join(names[:k])][0]
        elif self.dir_slot("", create) is None:
            return None
        else:
            parent = self._root_fd
        slot = None
        for j in range(k, len(names)):
            rel = "/".join(names[: j + 1])
            fd = self._open_child(parent, names[j], rel, create)
            if fd is None:
                return None
            st = os.fstat(fd)
            seen = self._dir_ids.setdefault(rel, (st.st_dev, st.st_ino))
            if seen != (st.st_dev, st.st_ino):
                os.close(fd)
                raise StageError(
                    f"{self.root}/{rel} was replaced by another directory while this stage ran; "
                    "hpcscale stage never writes through a directory swapped under it",
                    "input",
                )
            slot = self._slots[rel] = [fd, 0, False, seen]
            parent = fd
        if len(self._slots) > DIR_FDS:
            self._evict(slot)
        return slot

    def _evict(self, keep):
        """Drop the oldest slots (in the manifest's path order: the directories done with) down to 3/4 of
        DIR_FDS; one in use is retired and closed by its last user."""
        for rel in list(self._slots)[: len(self._slots) - DIR_FDS * 3 // 4]:
            slot = self._slots[rel]
            if slot is keep:
                continue
            del self._slots[rel]
            self._retire_slot(slot)

    @staticmethod
    def _retire_slot(slot):
        slot[2] = True
        if slot[1] == 0:
            os.close(slot[0])

    def _drop_slots(self):
        """Forget every cached directory: the next walk opens each again from the root (the commit checks
        that the directories files were placed in are still there, the same ones)."""
        with self._fd_lock:
            slots, self._slots = self._slots, {}
            for slot in slots.values():
                self._retire_slot(slot)

    def stat_at(self, rel):
        """lstat of `rel` through the walk (None if it or a directory above it is not there)."""
        reldir, _, name = rel.rpartition("/")
        slot = self.dir_slot(reldir)
        if slot is None:
            return None
        try:
            return os.stat(name, dir_fd=slot[0], follow_symlinks=False)
        except (FileNotFoundError, NotADirectoryError):
            return None
        finally:
            self.release(slot)

    def root_fd(self):
        if self._root_fd is None:
            fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
            with self._fd_lock:  # threads may ask at once (the agent's clean check runs beside the plan)
                if self._root_fd is None:
                    self._root_fd, fd = fd, None
                    st = os.fstat(self._root_fd)
                    self._root_slot[0], self._root_slot[3] = self._root_fd, (st.st_dev, st.st_ino)
            if fd is not None:
                os.close(fd)
        return self._root_fd

    def state_path(self):
        return self.root + "/" + STATE_DIR

    def state_fd(self, create=False):
        """A descriptor of the state directory, opened without following a symlink (created 0700 if `create`);
        None if there is none. Every state file is opened relative to it. Whether what it holds may vouch for
        content is decided here (state_distrust)."""
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
                        self._judge_state(self._state_fd)
                if fd is not None:
                    os.close(fd)
                return self._state_fd
            except FileNotFoundError:
                if not create or attempt:
                    return None
                with contextlib.suppress(FileExistsError):
                    os.mkdir(STATE_DIR, 0o700, dir_fd=root)
            except OSError as e:
                if e.errno not in (errno.ELOOP, errno.ENOTDIR):  # EACCES: another user's private one, say
                    raise StageError(f"{self.state_path()}: cannot open ({e.strerror})", "runtime") from None
                raise StageError(
                    f"{self.state_path()} is a symlink or not a directory; "
                    "hpcscale stage never writes through a symlink in the destination",
                    "input",
                ) from None
        return None

    def _judge_state(self, fd):
        """Whether the state directory may hold records that vouch for content: owned by this user (or root)
        and writable by no one else. One that others can write is left as it is (a team may share it on
        purpose: closing it would lock the others out), and its records are never trusted: every file there
        is hashed (state_distrust says why)."""
        why = untrusted(os.fstat(fd))
        self.state_distrust = why and f"{self.state_path()} {why}"

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
        """(identity of the record file, {path: record}); (None, {}) where there is none, or where it may not
        vouch for content (`untrusted`, or a state directory others could write): then record_ignored says
        why, and the plan hashes every file that is there."""
        state = self.state_fd()
        if state is None:
            return None, {}

        def vouches(st):
            if self.state_distrust is not None:
                raise _Distrusted(self.state_distrust)
            why = untrusted(st)
            if why is not None:
                raise _Distrusted(f"{self.state_path()}/{RECORD} {why}")

        try:
            data, st = read_regular(RECORD, max_bytes=RECORD_MAX, dir_fd=state, follow_symlinks=False, check=vouches)
        except _Distrusted as e:
            self.record_ignored = f"{e.why}: the record of verified files is ignored, every file there is hashed"
            return None, {}
        except TooLarge as e:
            self.record_ignored = (
                f"{self.state_path()}/{RECORD} holds {e.size} bytes, over the {RECORD_MAX} a record may hold: "
                "it is ignored, every file there is hashed"
            )
            return None, {}
        except OSError:  # missing, a symlink, not a regular file, unreadable
            return None, {}
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
        self.record_ignored = None
        return self._read_record()[1]

    def load_records(self, committed_only=False, fresh=None):
        """({path: [size, mtime_ns, ctime_ns, ino, hash]} of what this destination verified with our algorithm,
        whether journals were found). committed_only: the record of completed transfers, no journals.
        `fresh`: a dict that gets the paths whose line comes from this stage's own journals (named with its lock
        token, read last so that they win), each with the (st_dev, st_ino) of the directory it was placed in
        (None on a line without one): fstat'ed as they were placed, under this stage's lock.
        A journal vouches for content too: one that is not `untrusted`-clean is skipped, and so is every
        journal but this stage's own where the state directory was open to others when this stage found it."""
        state = self.state_fd()
        if state is None:
            return {}, False
        records = dict(self._record_now())
        names = [] if committed_only else os.listdir(state)
        mine = journals_.own_prefix(self.lock_token)
        names = sorted(names, key=lambda n: (mine is not None and n.startswith(mine), n))
        journals = False
        for name in names:
            if journals_.is_journal(name):
                journals = True
                own = mine is not None and name.startswith(mine)
                if self.state_distrust is not None and not own:
                    continue
                data = _read_regular(name, state, RECORD_MAX, check=_vouches)
                for path, rec, where in journals_.entries((data or b"").decode("utf-8", "replace"), self.algorithm):
                    records[path] = rec
                    if fresh is not None:
                        if own:
                            fresh[path] = where
                        else:
                            fresh.pop(path, None)
        return records, journals

    # -- plan -------------------------------------------------------------------------------------------
    def plan(self, entries, check="stat", manifest_sha256=None, name="manifest.json", dirs=None):
        """What must move for `entries` ([path, size, mtime_ns, hash, mode] each): a Plan with one status per
        entry, UP_TO_DATE where the destination already holds it (proven, with its mode), else the offset to
        send from (0, or the length of a part file a killed transfer left).

        Steps, in order: every entry and listed directory is checked (StageError('input') names the first bad
        one) before anything acts on it; the destination lock is taken (not in a dry run); each file is
        classified from one lstat (`_classify`); if anything is to be written, room is made (`_make_room`);
        the files a stat could not vouch for are hashed (`_prove`).

        check='stat': trust the record when size, mtime, ctime and inode are unchanged; other files of the right
        size are hashed. check='hash': hash every file that is there.

        `manifest_sha256`: sha256 of the manifest this stage commits (None: it writes none). `dirs`: [[path,
        mode]] of every directory the manifest lists (None: it lists none); they are created and given their
        modes (minus the umask) at commit; `dirs_clean` says whether they already are. A directory on a listed
        path that is a symlink or not a directory: StageError('input')."""
        if type(entries) is not list:
            raise StageError("plan: entries must be a list", "input")
        for i, entry in enumerate(entries):
            problem = check_entry(entry, self.algorithm)
            if problem is not None:
                raise StageError(f"files[{i}]: {problem}", "input")
        locked = self._plan_dirs(dirs)
        self.take_lock()
        records = self.load_records(committed_only=True)[0] if check == "stat" else {}
        statuses, todo = self._classify(entries, records)
        plan = Plan(statuses, record_ignored=self.record_ignored if check == "stat" else None)
        if not self.dry_run and (todo or any(x != UP_TO_DATE for x in statuses)):
            self._make_room(manifest_sha256, name, locked)
        if todo:
            self._prove(entries, todo, plan)
        return plan

    def _classify(self, entries, records):
        """(statuses, todo) from one lstat of each file and of its part file: UP_TO_DATE where the record vouches
        for the file as it is (same size, mtime, ctime, inode and hash), the length of a part file to resume
        from, else 0; `todo`: (index, reldir, name, 'final' or 'part') of the files of the right size, and the
        complete part files, that only hashing them can prove. A directory where the manifest lists a file:
        StageError('input'). The lstats run in parallel: on a cold metadata cache each one is a disk read."""
        statuses = [0] * len(entries)
        todo = []
        present = []  # (index, reldir, name) of entries whose directory exists
        absent, known = set(), set()  # directories missing (nothing in them to stat) and found
        for i, entry in enumerate(entries):
            reldir, _, fname = entry[0].rpartition("/")
            if reldir not in known:
                if reldir in absent:
                    continue
                self._planned_dirs.add(reldir)
                slot = self.dir_slot(reldir)
                if slot is None:
                    absent.add(reldir)
                    continue
                self.release(slot)
                known.add(reldir)
            present.append((i, reldir, fname))
        parts = []  # (index, reldir, part name): files not there; a killed transfer may have left a part file
        isreg, isdir, imode = stat.S_ISREG, stat.S_ISDIR, stat.S_IMODE
        umask = self.umask
        for (i, reldir, fname), st in zip(present, parallel_map(self._stat_in, present, self.jobs, batch=256)):
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
                    statuses[i] = UP_TO_DATE
                else:
                    todo.append((i, reldir, fname, "final"))
                continue
            if st is not None and isdir(st.st_mode):
                raise StageError(f"{self.root}/{rel} is a directory; the manifest lists a file there", "input")
            if size >= TMPFILE_MAX:  # only such files are written under part names
                parts.append((i, reldir, part_name("." + fname, digest)))
        for (i, reldir, part), pst in zip(parts, parallel_map(self._stat_in, parts, self.jobs, batch=256)):
            size = entries[i][1]
            if pst is None or not stat.S_ISREG(pst.st_mode) or pst.st_size > size or pst.st_nlink != 1:
                continue  # sent from 0 into a fresh part file of ours
            if pst.st_size == size:
                todo.append((i, reldir, part, "part"))
            else:
                statuses[i] = pst.st_size
        return statuses, todo

    def _make_room(self, manifest_sha256, name, locked):
        """Before anything is written: a manifest of another stage goes (it would vouch for files this stage
        is about to replace, and a destination with a manifest must be a complete copy of it; this stage's
        comes back at commit), and a listed directory without owner rwx (`locked`: [(path, mode)]) is opened
        to its owner until commit gives it its mode again."""
        if manifest_sha256 is not None:
            self._retire(manifest_sha256, name)
        for rel, mode in locked:
            self._chmod_dir(rel, mode | 0o700)

    def _prove(self, entries, todo, plan):
        """Hash the files of `todo` (in parallel) and mark those that match their manifest hash UP_TO_DATE in
        `plan`; the others are sent again (a stale part file is replaced from offset 0). Then flush the journal."""
        proofs = parallel_map(lambda item: self._prove_one(entries, item), todo, self.jobs, batch=8)
        for (i, _reldir, _fname, kind), (digest, n) in zip(todo, proofs):
            plan.hashed += 1
            plan.hashed_bytes += n
            if digest != entries[i][3]:
                continue
            plan.statuses[i] = UP_TO_DATE
            plan.proven += 1
            if kind == "part" and not self.dry_run:
                plan.parts += 1
        self.flush()

    def _prove_one(self, entries, item):
        """Hash a file that is there, through its directory's descriptor; a part file that matches is named, a
        final one journalled, both with the fstat of the descriptor hashed (the file that was proven, not
        whatever has the name by then). (digest or None, bytes hashed)."""
        i, reldir, fname, kind = item
        slot = self.dir_slot(reldir)
        if slot is None:
            return None, 0
        try:
            try:
                fd = os.open(fname, os.O_RDONLY | NO_FOLLOW, dir_fd=slot[0])
            except OSError:
                return None, 0
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode) or (kind == "part" and st.st_nlink != 1):
                    return None, 0
                digest, n = hash_fd(fd, self.algorithm, limit=st.st_size)  # the size known: no second fstat
                rel, _size, mtime, want, mode = entries[i]
                if digest != want or self.dry_run:
                    return digest, n
                if kind == "part":
                    os.fchmod(fd, self.final_mode(mode))
                    os.utime(fd, ns=(mtime, mtime))
                    name = rel.rpartition("/")[2]
                    os.rename(fname, name, src_dir_fd=slot[0], dst_dir_fd=slot[0])
                after = os.fstat(fd)
                if kind == "final" and _identity(after) != _identity(st):
                    return None, n  # written while it was hashed: not proven, sent again
                self.placed(rel, after, want, slot[3])
                return digest, n
            finally:
                os.close(fd)
        finally:
            self.release(slot)

    def _stat_in(self, item):
        """lstat of item[2] in directory item[1] (through the walk); None if it is not there."""
        slot = self.dir_slot(item[1])
        if slot is None:
            return None
        try:
            return os.stat(item[2], dir_fd=slot[0], follow_symlinks=False)
        except (FileNotFoundError, NotADirectoryError):
            return None
        finally:
            self.release(slot)

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
        self._planned_dirs.update(rel for rel, _ in dirs)
        locked = []
        for (rel, mode), st in zip(self._want_dirs, parallel_map(self.stat_at, [r for r, _ in dirs], 2)):
            if st is None or not stat.S_ISDIR(st.st_mode) or stat.S_IMODE(st.st_mode) != mode:
                self.dirs_clean = False
            if st is not None and stat.S_ISDIR(st.st_mode) and st.st_mode & 0o700 != 0o700:
                locked.append((rel, stat.S_IMODE(st.st_mode)))
        return locked

    def _chmod_dir(self, rel, mode):
        """Give listed directory `rel` `mode`, through its descriptor (the walk: no symlink followed)."""
        slot = self.dir_slot(rel, create=True)
        try:
            if stat.S_IMODE(os.fstat(slot[0]).st_mode) != mode:
                os.fchmod(slot[0], mode)
        finally:
            self.release(slot)

    def _apply_dirs(self):
        """Create every listed directory (empty ones too) and give each its mode, deepest first: a parent
        without write permission is set only after everything under it."""
        if self._want_dirs is None or self.dirs_clean:
            return
        for rel, mode in sorted(self._want_dirs, key=lambda d: -d[0].count("/")):
            try:
                self._chmod_dir(rel, mode)
            except OSError as e:
                raise StageError(
                    f"{self.root}/{rel}: cannot give the directory its mode ({e.strerror})", "runtime"
                ) from None

    def _retire(self, manifest_sha256, name):
        import hashlib

        if type(name) is not str or "/" in name or check_relpath(name):
            raise StageError(f"manifest name {str(name)[:80]!r} is not a plain file name", "input")
        data = _read_regular(name, self.root_fd(), MANIFEST_MAX)
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

    def placed(self, rel, st, digest, where=None):
        """Journal a file this stage put in place: `st`, the fstat of its own descriptor once named; `where`,
        the (st_dev, st_ino) of the directory it was named in (checked at commit)."""
        with self._lock:
            if self._journal is None:
                self._journal = journals_.Journal(self.state_fd(create=True), self.lock_token, self.algorithm)
            journal = self._journal  # taken under the lock: close() may drop it meanwhile
        journal.add(rel, st, digest, where)

    def flush(self):
        """Push the journal to the OS (a killed agent loses no line of a file already in place)."""
        with self._lock:
            journal = self._journal
        if journal is not None:
            journal.flush()

    def _close_journal(self):
        with self._lock:
            journal, self._journal = self._journal, None
        if journal is not None:
            journal.close()

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
        self._close_journal()
        self._drop_slots()  # from here, every directory is walked again from the root
        self._apply_dirs()
        self._check_dirs()
        state = self.state_fd(create=True)
        fresh = {}
        records, journals = self.load_records(fresh=fresh)
        self._check_placed(fresh)
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
                    st = self.stat_at(rel) if check_relpath(rel) is None else None
                except (OSError, StageError):  # a symlink on its path now: that line vouches for nothing
                    st = None
                if (
                    st is None
                    or type(rec) is not list
                    or rec[:4] != [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
                ):
                    del records[rel]
        if journals or not _is_regular(RECORD, state):
            text = json.dumps({"hash_algorithm": self.algorithm, "files": records}, separators=(",", ":"))
            atomic_write(RECORD, text, dir_fd=state, mode=PRIVATE)
            for n in os.listdir(state):
                if n.startswith(journals_.PREFIX):
                    _unlink(n, state)
        if manifest_text is not None:
            old = _read_regular(name, self.root_fd(), MANIFEST_MAX)
            if old is None or old != manifest_text.encode("utf-8", "surrogateescape"):
                atomic_write(name, manifest_text, dir_fd=self.root_fd(), mode=0o644)

    def _check_dirs(self):
        """Every directory the plan listed (of its files, and the listed directories) is still there, a real
        directory, and, where this Sink opened it before, the same one: a directory moved away and replaced by
        a symlink or another directory while files were placed in it fails the stage before anything vouches
        for those files (StageError('input'); the files stayed in the directory they were placed in)."""
        for reldir in sorted(self._planned_dirs):
            slot = self.dir_slot(reldir)
            if slot is None:
                raise StageError(f"{self.root}/{reldir}: the directory vanished while this stage ran", "runtime")
            self.release(slot)

    def _check_placed(self, fresh):
        """Every file this stage placed (`fresh`: path -> the directory it was named in) is under its path
        still: the directory at its path now, walked from the root, is the one it went into. One walk per
        directory, a dict lookup per file. Else StageError('input'): a directory was moved away (and another one,
        or a symlink, put at its name) while the stage ran, and the files are not where the manifest says."""
        now = {}
        for rel, where in fresh.items():
            if where is None:
                continue
            reldir = rel.rpartition("/")[0]
            if reldir not in now:
                slot = self.dir_slot(reldir)
                now[reldir] = None if slot is None else list(slot[3])
                if slot is not None:
                    self.release(slot)
            if now[reldir] != where:
                raise StageError(
                    f"{self.root}/{reldir or '.'} was replaced while this stage ran ({rel} went into the directory "
                    "that was there before); nothing is committed",
                    "input",
                )

    def is_clean(self, manifest_sha256, name="manifest.json"):
        """Nothing to commit: no journal waits to be merged, and the destination's manifest is this one
        (sha256 of its text; None: no manifest is written). A no-op rerun then needs no commit round trip."""
        import hashlib

        try:
            state = self.state_fd()
            if state is None or any(n.startswith(journals_.PREFIX) for n in os.listdir(state)):
                return False
        except (OSError, StageError):
            return False
        if manifest_sha256 is None:
            return True
        if type(name) is not str or "/" in name:
            return False
        data = _read_regular(name, self.root_fd(), MANIFEST_MAX)
        return data is not None and hashlib.sha256(data).hexdigest() == manifest_sha256

    def close(self):
        self._close_journal()
        if self._lock_owner and self._state_fd is not None:
            dest_lock.release(self._state_fd, self.lock_token)
            self._lock_owner = False
        with self._fd_lock:
            slots, self._slots = self._slots, {}
            for slot in slots.values():
                with contextlib.suppress(OSError):
                    os.close(slot[0])
                slot[1], slot[2] = 0, True
        self._root_slot[0] = None
        for attr in ("_state_fd", "_root_fd"):
            fd = getattr(self, attr)
            if fd is not None:
                os.close(fd)
                setattr(self, attr, None)
