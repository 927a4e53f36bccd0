"""The destination lock: at most one `hpcscale stage` writes into a destination at a time.

Two stages into one destination would interleave: one plans, the other truncates a part file the first is
writing, and the first renames bytes it never wrote under a name its record then vouches for. So a Sink that
writes takes `.hpcscale-stage/lock` before it plans, and gives it back when it closes.

Why not flock: it is not honoured (or not shared between clients) on many NFS and Lustre mounts. Creating a
file with O_CREAT|O_EXCL is atomic on local filesystems, on NFSv3 and later and on Lustre: that one call is the
lock (plus one write of who holds it). The file names its holder: host, pid, the process's start time (so a
reused pid is not mistaken for the holder) and the boot id. A lock is stale, and is taken over, only when its
holder is on this host and provably gone (another boot, no such process, or a process started at another
time); a holder on another host cannot be checked from here, so the error names it and the file to remove
once that host's stage is known to be dead. Taking over renames the stale file to a private name first and
checks it is still the file judged stale, so two stages breaking one stale lock cannot both win.

Every operation is relative to the state directory's descriptor, opened without following symlinks
(hpcscale.portable.sink.Sink.state_fd), and nothing here follows a symlink.
"""

import contextlib
import json
import os
import time

from hpcscale.portable.errors import StageError

LOCK = "lock"
UNREADABLE_STALE_S = 60  # a lock file without a readable holder (cut short by a crash) is stale after this


def _boot_id():
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _start_time(pid):
    """The start time of process `pid` in clock ticks since boot (/proc/PID/stat field 22), or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    try:
        return int(data[data.rindex(b")") + 2 :].split()[19])
    except (ValueError, IndexError):
        return None


def process_start_time(pid):
    """The start time of process `pid` (clock ticks since boot), or None: with the pid it names one process."""
    return _start_time(pid)


def process_alive(pid, start):
    """Whether process `pid`, started at `start` (process_start_time), is still running."""
    return _alive(pid, start)


def _alive(pid, start):
    if os.path.isdir("/proc/self"):
        now = _start_time(pid)
        return now is not None and now == start
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _read(state_fd):
    """(holder dict or {}, stat) of the lock file; (None, None) if there is none."""
    try:
        fd = os.open(LOCK, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=state_fd)
    except FileNotFoundError:
        return None, None
    try:
        st = os.fstat(fd)
        data = os.read(fd, 4096)
    finally:
        os.close(fd)
    try:
        doc = json.loads(data)
    except ValueError:
        doc = {}
    return doc if isinstance(doc, dict) else {}, st


def _stale(doc, st):
    if not doc:
        return time.time() - st.st_mtime > UNREADABLE_STALE_S
    if doc.get("host") != os.uname().nodename:
        return False
    if doc.get("boot") != _boot_id():
        return True
    pid = doc.get("pid")
    if type(pid) is not int or pid <= 0:
        return True
    return not _alive(pid, doc.get("start"))


def _held(where, doc, st=None):
    if not doc:  # a lock file that names no holder: one being created right now, or cut short
        made = "" if st is None else time.strftime(" at %Y-%m-%d %H:%M:%S", time.localtime(st.st_mtime))
        return StageError(
            f"{where} is locked by a stage whose lock file names no holder yet (made{made}: one starting now, or "
            f"cut short by a crash or a full disk); it is taken over by itself {UNREADABLE_STALE_S} s after it "
            "was made: retry then",
            "runtime",
        )
    since = doc.get("since")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since)) if type(since) is int else "?"
    return StageError(
        f"{where} is locked by another hpcscale stage (host {doc.get('host', '?')}, pid {doc.get('pid', '?')}, "
        f"since {when}): two stages into one destination would interleave their files. Wait for it to end; if "
        f"that process is gone (its host crashed), remove {where}/{LOCK} by hand",
        "runtime",
    )


def acquire(state_fd, where):
    """Take the lock in the state directory `state_fd` (named `where` in messages); returns its token.
    StageError('runtime') naming the holder if another live stage holds it."""
    token = os.urandom(8).hex()
    owner = {
        "host": os.uname().nodename,
        "pid": os.getpid(),
        "start": _start_time(os.getpid()),
        "boot": _boot_id(),
        "since": int(time.time()),
        "token": token,
    }
    data = json.dumps(owner).encode()
    for _ in range(3):
        try:
            fd = os.open(LOCK, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644, dir_fd=state_fd)
        except FileExistsError:
            doc, st = _read(state_fd)
            if st is None:
                continue  # given back between our two calls: try again
            if not _stale(doc, st):
                raise _held(where, doc, st) from None
            _break(state_fd, st, where, doc)
            continue
        try:
            try:
                if os.write(fd, data) != len(data):  # cut short (a disk filling up): a holder no one could read
                    raise OSError(28, "No space left on device")
            finally:
                os.close(fd)
        except OSError as e:  # a full disk: a lock file naming no holder must not be left behind
            with contextlib.suppress(OSError):
                os.unlink(LOCK, dir_fd=state_fd)
            raise StageError(
                f"{where}/{LOCK}: cannot write the lock ({e.strerror}); nothing was done", "runtime"
            ) from None
        return token
    raise StageError(f"{where}/{LOCK}: could not take the lock (another stage keeps taking it)", "runtime")


def _break(state_fd, st, where, doc):
    """Remove the stale lock `st`, and only it: another stage may have replaced it since we looked."""
    private = f"{LOCK}.stale.{os.getpid()}.{os.urandom(4).hex()}"
    try:
        os.rename(LOCK, private, src_dir_fd=state_fd, dst_dir_fd=state_fd)
    except FileNotFoundError:
        return
    now = os.lstat(private, dir_fd=state_fd)
    if (now.st_ino, now.st_dev) != (st.st_ino, st.st_dev):  # a fresh lock of another stage: put it back
        with contextlib.suppress(FileExistsError):
            os.link(private, LOCK, src_dir_fd=state_fd, dst_dir_fd=state_fd, follow_symlinks=False)
        os.unlink(private, dir_fd=state_fd)
        raise _held(where, _read(state_fd)[0] or doc)
    os.unlink(private, dir_fd=state_fd)


def check(state_fd, token, where):
    """StageError('runtime') unless the lock is held with `token` (an extra stream joining a stage)."""
    doc, _ = _read(state_fd)
    if doc is None or doc.get("token") != token:
        raise StageError(f"{where}/{LOCK}: this stage no longer holds the destination's lock", "runtime")


def release(state_fd, token):
    """Give the lock back if it is still ours."""
    try:
        doc, _ = _read(state_fd)
        if doc is not None and doc.get("token") == token:
            os.unlink(LOCK, dir_fd=state_fd)
    except OSError:
        pass
