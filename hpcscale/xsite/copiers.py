"""A local copy (both ends on this host, or on one shared filesystem) in copier processes, one per `-j`.

Why processes, not threads: every file costs a dozen short system calls (open, fadvise, read, a new inode,
write, utime, link, fstat, close), and a thread gives up the GIL at each one. With two copier threads and an
opener beside them, each of those became a hand-over between threads: dozens of futex calls per file, more CPU
than the Python work itself (docs/benchmarks.md, "Staging"). A process of its own does the same calls without
anyone to hand over to.

How: the parent plans, holds the destination lock and commits, as before (hpcscale.xsite.stage). It cuts the
files into units (each large file alone, the small ones in runs of neighbours in the manifest's order, so
that a process works in one directory at a time) and writes every unit's index into a pipe, then forks. Each
child takes the next index from that pipe whenever it needs work, so the processes finish together however
uneven the files are. It opens the files a few ahead with POSIX_FADV_WILLNEED (so cold reads overlap its
copying, as the opener thread did), and places each with the same code as every other path
(hpcscale.portable.sink.Writer: hashed as written, linked or renamed only once the hash matched), in a Sink of
its own that joins the parent's lock by its token and journals to a journal of its own. It reports to the
parent on a pipe of its own, a few times a second: files placed, bytes, and every failure with its kind.

Guarantees, as for threads:
- the parent commits (record, then manifest) only once every child has said it finished and exited 0, and
  every file was reported placed (hpcscale.xsite.stage._complete counts them);
- a child that dies fails the stage; nothing is committed (one that hangs, on a hung NFS read say, or is
  stopped with SIGSTOP, holds the stage up until it goes on, as a hung copier thread did);
- a child never outlives the parent: it asks the kernel for SIGKILL when the parent dies (PR_SET_PDEATHSIG),
  so no file is written by a stage whose lock holder is gone (a child inside an uninterruptible system call
  finishes that one call first: a write to its own part file or inode, or the link or rename of a file
  already verified); a failure of kind 'input', an interrupt or any exception in the parent kills the
  children before the error surfaces; the children are killed through pidfds where the kernel has them, and
  reaped by the parent whatever the caller's SIGCHLD disposition;
- signals are held while a child is forked: a Ctrl-C then reaches the parent's handler in the parent only,
  and the child ignores SIGINT (the parent kills it) and takes the default for the others;
- --bwlimit is one budget for all processes (a token bucket on a shared page);
- if not even one process can be forked (no memory), the copy runs in threads instead;
- a killed child leaves what a killed stage leaves: unnamed inodes that vanish, part files a rerun continues,
  journal lines that a rerun checks by stat.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import struct
import sys
import threading
import time
from collections import deque

from hpcscale.portable.errors import StageError
from hpcscale.portable.hashing import hasher
from hpcscale.portable.sink import TMPFILE_MAX, Sink
from hpcscale.portable.wire import TokenBucket, pipe_size, pump, widen_pipe

CHUNK = 32  # small files a copier process takes at a time
AHEAD = 32  # files a child keeps open ahead of the one it copies
REPORT_S = 0.1  # how often a child reports its progress
_PR_SET_PDEATHSIG = 1


def processes_for(jobs: int, files: int) -> int:
    """How many copier processes a local copy of `files` files uses with -j `jobs`; 0: copy in threads (one
    job, one file, not Linux, or not called from the main thread: the kernel ties a child's death signal to
    the thread that forked it)."""
    if jobs < 2 or files < 2 or not sys.platform.startswith("linux"):
        return 0
    if threading.current_thread() is not threading.main_thread():
        return 0
    return min(jobs, files)


def chunks(todo: list, n: int) -> list[list]:
    """`todo` ([(entry, offset)], large files first, then small ones in path order) as the units `n` copier
    processes take one at a time: each large file alone, the small ones in runs of up to CHUNK neighbours (the
    same directories, near each other on disk), shorter where there are few, so that each process gets some."""
    per = max(1, min(CHUNK, len(todo) // (4 * n)))
    out: list[list] = []
    run: list = []
    for item in todo:
        if item[0][1] - item[1] >= TMPFILE_MAX:
            out.append([item])
            continue
        run.append(item)
        if len(run) == per:
            out.append(run)
            run = []
    if run:
        out.append(run)
    return out


def open_source(source, entry, offset):
    """(fd, None), with the kernel asked to read the file ahead; or (None, (message, kind))."""
    try:
        fd = source.open(entry[0])
    except StageError as e:
        return None, (str(e), e.kind)
    except OSError as e:  # e.g. a dangling symlink: this file fails, the others go on
        return None, (str(e), "runtime")
    with contextlib.suppress(OSError, AttributeError):
        os.posix_fadvise(fd, offset, 0, os.POSIX_FADV_WILLNEED)
    return fd, None


def copy_file(sink: Sink, entry, offset: int, fd: int, bucket, on_bytes):
    """Bytes [offset, size) of the open source `fd` into place at `sink` (fd is closed). None once the file is
    verified and in place; else (message, kind), and nothing of it took its name."""
    try:
        w = sink.begin(entry, offset)
        try:
            if pump(fd, offset, entry[1], w.write, bucket, on_bytes) < entry[1]:
                raise StageError(f"{w.path}: the source shrank while being read", "verify")
        except BaseException:
            w.abort()
            raise
        w.finish()
    except StageError as e:
        return str(e), e.kind
    except OSError as e:
        return str(e), "runtime"
    except Exception as e:  # never a silent end: the file fails, and the stage with it
        return f"unexpected {type(e).__name__}: {e}", "runtime"
    finally:
        os.close(fd)
    return None


class _Report:
    """A child's messages to the parent, one JSON list a line: ["n", files placed, of them resumed, bytes],
    ["f", path, message, kind], ["d"] (done: no unit left to take, every file taken handled, the journal
    closed)."""

    def __init__(self, fd: int):
        self.fd = fd
        self.files = self.resumed = self.bytes = 0
        self.lines: list[str] = []
        self.last = time.monotonic()

    def add_bytes(self, n: int) -> None:
        self.bytes += n
        self.maybe_send()

    def placed(self, resumed: bool) -> None:
        self.files += 1
        self.resumed += resumed
        self.maybe_send()

    def failed(self, path, message: str, kind: str) -> None:
        self._counts()
        self.lines.append(json.dumps(["f", path, message, kind]))
        self.send()

    def _counts(self) -> None:
        if self.files or self.bytes:
            self.lines.append(json.dumps(["n", self.files, self.resumed, self.bytes]))
            self.files = self.resumed = self.bytes = 0

    def done(self) -> None:
        self._counts()
        self.lines.append('["d"]')
        self.send()

    def maybe_send(self) -> None:
        if time.monotonic() - self.last >= REPORT_S:
            self._counts()
            self.send()

    def send(self) -> None:
        data = memoryview("".join(line + "\n" for line in self.lines).encode())
        self.lines.clear()
        while data:
            data = data[os.write(self.fd, data) :]
        self.last = time.monotonic()


def _units(fd: int, units: list):
    """The files of the units this child takes from the work pipe, one unit (4 bytes: its index) at a time.
    Every read asks for 4 bytes of a pipe written in multiples of 4 and then closed: each index goes to exactly
    one reader, and an empty pipe is the end."""
    while True:
        b = os.read(fd, 4)
        if len(b) < 4:
            return
        yield from units[int.from_bytes(b, "little")]


def _child(units: list, work: int, source, sink: Sink, bucket, fd: int, parent: int, libc) -> None:
    """A copier process: copy the units it takes from the pipe `work`, report on `fd`, never return."""
    code = 1
    report = _Report(fd)
    try:
        # SIGKILL when the parent dies; if it died before the request, exit now
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0 or os.getppid() != parent:
            os._exit(1)
        own = Sink(sink.root, sink.algorithm, sync=False, jobs=1, umask=sink.umask, lock=sink.lock_token)
        try:
            items = _units(work, units)
            ahead: deque = deque()
            pending = 0  # bytes of the files open ahead
            stop = False
            while True:
                # a few files ahead, but never more than a large file's worth of bytes: work taken is work the
                # other processes can no longer share
                while not stop and len(ahead) < AHEAD and pending < TMPFILE_MAX:
                    item = next(items, None)
                    if item is None:
                        break
                    entry, offset = item
                    src_fd, problem = open_source(source, entry, offset)
                    if problem is not None:
                        report.failed(entry[0], *problem)
                        stop = problem[1] == "input"
                    else:
                        ahead.append((entry, offset, src_fd))
                        pending += entry[1] - offset
                if not ahead:
                    break
                entry, offset, src_fd = ahead.popleft()
                pending -= entry[1] - offset
                if stop:
                    os.close(src_fd)
                    continue
                problem = copy_file(own, entry, offset, src_fd, bucket, report.add_bytes)
                if problem is None:
                    report.placed(offset > 0)
                else:
                    report.failed(entry[0], *problem)
                    stop = problem[1] == "input"
        finally:
            own.close()  # the journal, closed: every line of a placed file is with the OS
        report.done()
        code = 0
    except BaseException as e:
        with contextlib.suppress(BaseException):
            report.failed(None, f"copier process {os.getpid()}: unexpected {type(e).__name__}: {e}", "runtime")
    finally:
        os._exit(code)  # no interpreter teardown: nothing of the parent's (buffers, atexit) runs twice


def _listen(child, run) -> None:
    """The parent's side of one child's report pipe, until the child closes it."""
    rest = b""
    try:
        while True:
            data = os.read(child.report, 1 << 16)
            if not data:
                return
            *lines, rest = (rest + data).split(b"\n")
            for line in lines:
                msg = json.loads(line)
                if msg[0] == "n":
                    _, files, resumed, nbytes = msg
                    if nbytes:
                        run.sent_bytes(nbytes)
                    for k in range(files):
                        run.ok(k < resumed)
                elif msg[0] == "f":
                    run.fail(msg[1], msg[2], msg[3])
                elif msg[0] == "d":
                    child.done = True
    except BaseException as e:  # a report we cannot read: the stage must not commit on it
        run.abort(e)


# Signals held back while a child is forked and until its pid is known (so that neither a Ctrl-C in the child's
# first microseconds runs the parent's handler there, nor one in the parent is lost in an at-fork hook), and
# while the children are killed and reaped.
_HELD = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2}


class _SharedBucket(TokenBucket):
    """--bwlimit for all copier processes together: TokenBucket with its state (t, debt) on a shared page and a
    semaphore for its lock (a 1/N share each would leave most of the rate unused while one process copies the
    last big file). A holder killed inside the few microseconds it holds the semaphore would leave it taken: a
    waiter then goes on after a second, which at worst lets a burst through."""

    def __init__(self, rate: float):
        import mmap
        import multiprocessing

        self.mem = mmap.mmap(-1, 16)  # anonymous and MAP_SHARED: the children see one page
        self.sem = multiprocessing.get_context("fork").Lock()
        super().__init__(rate)
        self.lock = self  # TokenBucket's `with self.lock`: __enter__/__exit__ below

    def __enter__(self):
        self.held = self.sem.acquire(timeout=1.0)

    def __exit__(self, *exc) -> None:
        if self.held:
            self.sem.release()

    t = property(
        lambda self: struct.unpack_from("d", self.mem, 0)[0], lambda self, v: struct.pack_into("d", self.mem, 0, v)
    )
    debt = property(
        lambda self: struct.unpack_from("d", self.mem, 8)[0], lambda self, v: struct.pack_into("d", self.mem, 8, v)
    )


class _Child:
    """A forked copier: its pid, a pidfd where the kernel has them (a signal through it can never reach
    another process that reused the pid), its report pipe and the thread that reads it."""

    def __init__(self, pid: int, report: int):
        self.pid, self.report = pid, report
        self.pidfd = None
        with contextlib.suppress(AttributeError, OSError):
            self.pidfd = os.pidfd_open(pid)
        self.reaped = False
        self.status = None  # its wait status; None if someone else reaped it (a SIGCHLD handler of the caller)
        self.done = False
        self.listener: threading.Thread | None = None

    def kill(self) -> None:
        if self.reaped:
            return
        with contextlib.suppress(ProcessLookupError, OSError):
            if self.pidfd is not None:
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
            else:
                os.kill(self.pid, signal.SIGKILL)

    def reap(self) -> None:
        if self.reaped:
            return
        with contextlib.suppress(ChildProcessError):  # reaped by someone else: its report says if it finished
            self.status = os.waitpid(self.pid, 0)[1]
        self.reaped = True

    def close(self) -> None:
        """Close the report pipe once its reader is done with it (a reader still blocked keeps it: a closed
        number could be reused by another file under the reader's feet)."""
        if self.listener is not None and self.listener.is_alive():
            self.listener.join(5)
            if self.listener.is_alive():
                return
        with contextlib.suppress(OSError):
            os.close(self.report)
        if self.pidfd is not None:
            with contextlib.suppress(OSError):
                os.close(self.pidfd)


def copy_in_processes(todo: list, source, sink: Sink, bwlimit, run, n: int) -> bool:
    """Copy `todo` with up to `n` copier processes (see the module's docstring); outcomes go to `run` as the
    copier threads' do (ok, sent_bytes, fail, abort). False, having done nothing, if not even one process could
    be forked (no memory for it): the caller copies in threads instead."""
    import ctypes  # before the fork, as the hash module: nothing is imported in a child
    import gc

    libc = ctypes.CDLL(None, use_errno=True)
    hasher(sink.algorithm)
    work, units = _work_pipe(todo, n)
    n = min(n, len(units))
    bucket = _SharedBucket(bwlimit) if bwlimit else None
    parent = os.getpid()
    children: list[_Child] = []
    # The caller's SIGCHLD disposition, SIG_IGN in particular, would let the kernel reap the children behind
    # our back; the default while they run, restored after.
    chld = signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    try:
        gc.freeze()  # what exists now is shared with the children, not copied by their collector's writes
        try:
            for _ in range(n):
                r, w = os.pipe()
                old = signal.pthread_sigmask(signal.SIG_BLOCK, _HELD)
                try:
                    pid = os.fork()
                except OSError:
                    os.close(r)
                    os.close(w)
                    signal.pthread_sigmask(signal.SIG_SETMASK, old)
                    if not children:
                        os.close(work)
                        return False
                    break  # fewer processes than asked: the ones there are share the work
                if pid == 0:
                    try:
                        os.close(r)
                        for sig in _HELD:
                            signal.signal(sig, signal.SIG_IGN if sig == signal.SIGINT else signal.SIG_DFL)
                        signal.pthread_sigmask(signal.SIG_SETMASK, old)
                        _child(units, work, source, sink, bucket, w, parent, libc)
                    finally:
                        os._exit(1)
                children.append(_Child(pid, r))
                os.close(w)
                signal.pthread_sigmask(signal.SIG_SETMASK, old)
        finally:
            gc.unfreeze()
        run.result.streams = len(children)
        for c in children:
            c.listener = threading.Thread(target=_listen, args=(c, run), daemon=True)
            c.listener.start()
        for c in children:
            while c.listener.is_alive():
                c.listener.join(0.1)
                if run.stop.is_set():
                    for k in children:
                        k.kill()
        for c in children:
            c.reap()
            if run.stop.is_set():
                continue
            if not c.done:
                run.fail(None, f"copier process {c.pid} {_ended(c.status)} before it finished its files", "runtime")
            elif c.status:
                run.fail(None, f"copier process {c.pid} {_ended(c.status)}", "runtime")
        return True
    finally:
        old = signal.pthread_sigmask(signal.SIG_BLOCK, _HELD)  # a second Ctrl-C must not leave zombies
        try:
            for c in children:
                c.kill()
            for c in children:
                c.reap()
            for c in children:
                c.close()
            with contextlib.suppress(OSError):
                os.close(work)
            if chld is not None:  # None: a handler set outside Python, which signal.signal cannot put back
                signal.signal(signal.SIGCHLD, chld)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _work_pipe(todo: list, n: int) -> tuple[int, list]:
    """(read end of a pipe holding every unit's index, closed for writing; the units). All of it is written
    before any child exists, so it must fit: the pipe is grown (F_SETPIPE_SZ), its real size read back (a user
    over the kernel's pipe limits gets 8 KiB and no growth), and where it still falls short the units are made
    longer. A write that fits an empty pipe never waits."""
    units = chunks(todo, n)
    r, w = os.pipe()
    try:
        if 4 * len(units) > pipe_size(w):
            widen_pipe(w, 4 * len(units))
        room = pipe_size(w) // 4
        if len(units) > room:
            per = -(-len(todo) // room)
            units = [todo[i : i + per] for i in range(0, len(todo), per)]
        data = memoryview(b"".join(i.to_bytes(4, "little") for i in range(len(units))))
        while data:
            data = data[os.write(w, data) :]
    except BaseException:
        os.close(r)
        raise
    finally:
        os.close(w)
    return r, units


def _ended(status) -> str:
    if status is None:
        return "ended"
    if os.WIFSIGNALED(status):
        return f"was killed by signal {os.WTERMSIG(status)}"
    return f"exited with status {os.waitstatus_to_exitcode(status)}"
