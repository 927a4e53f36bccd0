"""The progress watchdog: a rank that finishes no step for too long ends the job, and the log says which rank.

A rank that stops without dying (SIGSTOP, a deadlock, a stuck filesystem call) leaves its peers blocked in a
collective until the collective timeout (`timeout_seconds`, 300 s by default; torch's own is 10 minutes). Each
rank therefore runs a Watchdog, a daemon thread that the training loop feeds with `beat(step)` after every
finished step.

The rule. The watchdog is armed by the first beat: start-up (imports, the bootstrap, building the model,
restoring a checkpoint) is covered by the collective timeout, and its length says nothing about a step's. From
then on it fires when no beat came for

    timeout = max(min_seconds, factor × the longest interval between two consecutive beats so far)

with paused time left out of both sides. `min_seconds` (job spec `hang_timeout_seconds`) is the floor, so a
run of fast steps does not make a hiccup (a page-cache flush, a slow NFS read) fatal; the factor lets a model
whose steps legitimately take minutes run without tuning the floor, while a hang is still noticed in about ten
steps' time rather than at the time limit. The longest interval, not the mean: the watchdog must never fire on
a step the run has already shown it can take. Work that is long for a reason of its own (checkpoint saves,
evaluation) runs inside `paused(reason)`; the clock stops there, and the interval of the step it belongs to
excludes it, so one checkpoint does not raise the timeout for the rest of the run.

A pause that asks for it (`bounded=True`: the node-local tier's saves) is watched too, by a rule of its own:
once a pause of the same reason has ended in this process, the next one may last

    pause limit = max(min_seconds, factor × the longest pause of that reason so far)

(time the process did not run left out), and the watchdog fires when it lasts longer, with the same line as
for a step (its seconds count from the last finished step, the pause included). So a rank stopped in the middle
of a node-local save, whose peers then wait in the save's collectives, is named within the limit rather than at
the collective timeout. `progress()` inside a pause starts its clock again (a wait for the previous save's
background write has ended: what follows is this save's own work), as a beat does. The first pause of a reason
has no history to go by and is bounded only by the collective timeout, as is every pause that does not ask:
a shared-tier save (a parallel filesystem's speed varies too much for a rule learned from earlier saves to
tell a hang from a busy day), an evaluation, a cross-site round (it waits on other sites).

When it fires, in this order:
1. one line to stderr in the format of every rank failure (launch/failure.py), so `run --local`, the
   Slurm log readers and people parse it alike:
   `hpcscale launch: rank R (MPI rank M) on node N failed: Hang: no step finished in X s (last finished step S;
   world W) [at TIME, after losing a peer]`. Always "after losing a peer": a rank whose loop waits on a
   collective is a consequence of the stuck rank, not its cause;
2. every Python thread's stack (faulthandler), in chunks that each name the rank (mpirun forwards output in
   4096-byte reads and interleaves ranks at those boundaries, mid-line too: see _CHUNK);
3. a grace of a few seconds: the other live ranks, whose deadlines are the same to within the jitter of their
   last beat, write their lines and stacks before the job is killed;
4. `on_hang()`: launch passes MPI_Abort, so srun/mpirun end every rank at once.

Time the process did not run at all does not count: when the thread wakes more than STALL_S later than it
asked, the process was stopped (SIGSTOP, a suspended Slurm job) or starved, and the clock skips that time, with
one line saying so. A job suspended and resumed whole goes on; and a SIGSTOPped rank, which mpirun and srun
continue (SIGCONT) on their way to killing it, says it was not running instead of reporting a hang of its own.

Who is to blame (launch/failure.hung_ranks). A stopped rank's watchdog is stopped with it, and a rank stuck in C
code holding the GIL cannot run its watchdog either: the stuck ranks are those of the world that wrote no hang
line, and any that say they were not running for as long as the others waited (a live rank starved for a few
seconds on a loaded machine says so too, then fires: it waited). A deadlock in Python releases the GIL, so there
every rank writes its line and the stacks show where. Lines are read in pieces, from wherever one of ours starts on
a line: mpirun can glue one rank's line to another's unfinished one on a loaded machine.

`beat` costs one clock read and a few attribute stores, no lock: a single float (`_since`, the beat time
moved forward by paused time) carries the state the thread reads, so a torn read cannot make it fire early.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator

from hpcscale.launch.failure import hang_line, stacks_header, stall_line

GRACE_S = 5.0  # from a rank's hang line to its MPI_Abort: time for the other live ranks to write theirs
STALL_S = 3.0  # the thread woke this much later than asked: its process was not running (stopped, starved)
_POLL_S = 1.0  # the thread's longest sleep: how late a stop() or the end of a pause is noticed
# mpirun forwards a rank's output in reads of 4096 bytes and interleaves ranks at those boundaries, mid-line
# too. Writes of whole lines, at most PIPE_BUF (4096: one atomic write to a pipe) and a moment apart, come
# through whole; each chunk of stacks names its rank, so chunks of different ranks may interleave harmlessly.
_CHUNK = 4096
_CHUNK_GAP_S = 0.05


def _exit_now() -> None:
    os._exit(1)


class Watchdog:
    """One per rank; see the module docstring. Call `beat`, `paused` and `stop` from the training thread."""

    def __init__(
        self,
        *,
        rank: int,
        mpi_rank: int,
        node: str,
        world_size: int,
        min_seconds: float,
        factor: float = 10.0,
        on_hang: Callable[[], None] | None = None,
        grace_seconds: float = GRACE_S,
    ) -> None:
        self.rank, self.mpi_rank, self.node, self.world_size = rank, mpi_rank, node, world_size
        self.min_seconds, self.factor, self.grace_seconds = min_seconds, factor, grace_seconds
        self.on_hang = on_hang or _exit_now
        self.fired: str | None = None  # the hang line, once it fired
        self.longest = 0.0  # the longest interval between consecutive beats, paused time excluded
        self.last_step: int | None = None
        self._since: float | None = None  # the last beat, moved forward by the paused time since; None: unarmed
        self._paused_at: float | None = None  # when the outermost pause began
        self._pauses = 0
        self.pause_reason: str | None = None
        self.longest_pause: dict[str, float] = {}  # reason: the longest ended pause of it, time not running left out
        self._pause_from: float | None = None  # when the outermost pause began, or the last beat inside it
        self._pause_limit: float | None = None  # how long the outermost pause may last; None: unbounded
        self._not_running = 0.0  # seconds this process did not run (stalls): written by the thread alone
        self._pause_not_running = 0.0  # _not_running when _pause_from was set
        self._stop = threading.Event()
        self._poll = min(_POLL_S, max(0.01, min_seconds / 4))
        self._thread = threading.Thread(target=self._run, name=f"hpcscale-watchdog-{rank}", daemon=True)

    @property
    def timeout(self) -> float:
        return max(self.min_seconds, self.factor * self.longest)

    def start(self) -> Watchdog:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Disarm for good. A watchdog already firing goes on (its rank is about to end the job)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread() and self.fired is None:
            self._thread.join(timeout=2 * _POLL_S)

    def beat(self, step: int) -> None:
        """Step `step` finished. A clock read and a few stores: no lock, no I/O."""
        now = time.monotonic()
        paused_at = self._paused_at
        if self._since is not None:
            interval = (now if paused_at is None else paused_at) - self._since
            if interval > self.longest:
                self.longest = interval  # before _since: a reader with the old _since sees a longer timeout
        if paused_at is not None:  # a beat inside a pause: the pause counts only from here
            self._pause_not_running = self._not_running
            self._pause_from = now
            self._paused_at = now
        self.last_step = step
        self._since = now

    def progress(self) -> None:
        """Inside a pause: what it waited for has come; its clock starts again from here (module docstring)."""
        if self._paused_at is not None:
            self._pause_not_running = self._not_running
            self._pause_from = time.monotonic()

    def pause_limit(self, reason: str) -> float | None:
        """How long a pause of `reason` may last: None before one has ended (see the module docstring)."""
        longest = self.longest_pause.get(reason)
        return None if longest is None else max(self.min_seconds, self.factor * longest)

    @contextlib.contextmanager
    def paused(self, reason: str, *, bounded: bool = False) -> Iterator[None]:
        """Legitimately long work (a checkpoint save, evaluation): the step clock stops until it ends; with
        `bounded`, the pause is held to its own limit (`pause_limit`)."""
        outermost = self._pauses == 0
        if outermost:
            now = time.monotonic()
            self._pause_limit = self.pause_limit(reason) if bounded else None
            self._pause_not_running = self._not_running
            self._pause_from = now
            self._paused_at = now  # last: the thread reads the limit and clock of this pause, never the previous one's
            self.pause_reason = reason
        self._pauses += 1
        try:
            yield
        finally:
            self._pauses -= 1
            if self._pauses == 0:
                now = time.monotonic()
                if self._since is not None and self._paused_at is not None:
                    self._since += now - self._paused_at  # before un-pausing: never seen too old
                self._paused_at = None
                if outermost and self._pause_from is not None:
                    lasted = self._pause_lasted(now, self._pause_from)
                    if lasted > self.longest_pause.get(reason, -1.0):
                        self.longest_pause[reason] = lasted
                self._pause_from = self._pause_limit = None
                self.pause_reason = None

    def _pause_lasted(self, now: float, start: float) -> float:
        return now - start - (self._not_running - self._pause_not_running)

    def _run(self) -> None:
        woke_by = None  # when the last wait should have ended at the latest
        while not self._stop.is_set():
            now = time.monotonic()
            if woke_by is not None and now - woke_by > STALL_S:
                self._stalled(now - woke_by)
            since = self._since
            paused_at = self._paused_at
            if since is None:
                wait = self._poll
            elif paused_at is not None:
                limit, start = self._pause_limit, self._pause_from
                left = None if limit is None or start is None else limit - self._pause_lasted(now, start)
                if left is not None and left <= 0 and self._paused_at == paused_at:
                    self._fire(now - since)  # the seconds since the last finished step, the pause included
                    return
                wait = self._poll if left is None else min(self._poll, left)
            else:
                timeout = self.timeout
                elapsed = now - since
                if elapsed >= timeout and self._paused_at is None and since == self._since:
                    self._fire(elapsed)
                    return
                wait = min(self._poll, timeout - elapsed)
            wait = max(wait, 0.001)
            woke_by = time.monotonic() + wait
            self._stop.wait(wait)

    def _stalled(self, lost: float) -> None:
        """This process did not run for `lost` seconds (SIGSTOP and SIGCONT, a suspended job, a starved machine):
        that time is not this rank's loop being slow, so the clock skips it, and one line says so. A stopped
        rank that mpirun or srun continue only to kill it says it here, with its peers' hang lines before it."""
        if self._since is not None and self._paused_at is None:
            self._since += lost
        self._not_running += lost  # a pause is not long for the time its process did not run either
        with contextlib.suppress(OSError, ValueError):
            line = stall_line(rank=self.rank, mpi_rank=self.mpi_rank, node=self.node, seconds=lost)
            _write_all(sys.stderr.fileno(), (line + "\n").encode())

    def _fire(self, elapsed: float) -> None:
        self.fired = hang_line(
            rank=self.rank,
            mpi_rank=self.mpi_rank,
            node=self.node,
            seconds=elapsed,
            last_step=self.last_step if self.last_step is not None else -1,
            world_size=self.world_size,
        )
        with contextlib.suppress(OSError, ValueError):  # whatever goes wrong in reporting, the job must still end
            sys.stdout.flush()
            sys.stderr.flush()
            fd = sys.stderr.fileno()
            _write_all(fd, (self.fired + "\n").encode())
            try:
                stacks = _python_stacks()
            except OSError:  # no temporary file: straight to stderr, unlabelled
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
                stacks = b""
            longest = stacks_header(rank=self.rank, mpi_rank=self.mpi_rank, continued=True)
            for n, chunk in enumerate(_line_chunks(stacks, _CHUNK - len(longest) - 10)):
                header = stacks_header(rank=self.rank, mpi_rank=self.mpi_rank, continued=n > 0)
                _write_all(fd, (header + "\n").encode() + chunk)
                time.sleep(_CHUNK_GAP_S)
        time.sleep(self.grace_seconds)
        self.on_hang()


def _python_stacks() -> bytes:
    """Every thread's Python stack as faulthandler writes it (it needs a real file descriptor)."""
    with tempfile.TemporaryFile() as f:
        faulthandler.dump_traceback(file=f, all_threads=True)
        f.seek(0)
        return f.read()


def _line_chunks(data: bytes, limit: int) -> Iterator[bytes]:
    """Whole lines, at most `limit` bytes at a time (a longer line alone)."""
    chunk = b""
    for line in data.splitlines(keepends=True):
        if chunk and len(chunk) + len(line) > limit:
            yield chunk
            chunk = b""
        chunk += line
    if chunk:
        yield chunk


def _write_all(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data) :]


class NoWatchdog:
    """Stands in where no launch made a watchdog (an entry point run on its own): every call does nothing."""

    def beat(self, step: int) -> None:
        pass

    @contextlib.contextmanager
    def paused(self, reason: str, *, bounded: bool = False) -> Iterator[None]:
        yield

    def progress(self) -> None:
        pass
