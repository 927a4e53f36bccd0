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

When it fires, in this order:
1. one line to stderr in the format of every rank failure (launch/main.failure_line), so `run --local`, the
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

Who is to blame (hung_ranks). A stopped rank's watchdog is stopped with it, and a rank stuck in C code holding
the GIL cannot run its watchdog either: the stuck ranks are those of the world that wrote no hang line, and
any that say they were not running for as long as the others waited (a live rank starved for a few seconds
on a loaded machine says so too, then fires: it waited). A deadlock in Python releases the GIL, so there every
rank writes its line and the stacks show where. Lines are read in pieces, from wherever one of ours starts on
a line: mpirun can glue one rank's line to another's unfinished one on a loaded machine.

`beat` costs one clock read and a few attribute stores, no lock: a single float (`_since`, the beat time
moved forward by paused time) carries the state the thread reads, so a torn read cannot make it fire early.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import re
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import NamedTuple

GRACE_S = 5.0  # from a rank's hang line to its MPI_Abort: time for the other live ranks to write theirs
STALL_S = 3.0  # the thread woke this much later than asked: its process was not running (stopped, starved)
_POLL_S = 1.0  # the thread's longest sleep: how late a stop() or the end of a pause is noticed
# mpirun forwards a rank's output in reads of 4096 bytes and interleaves ranks at those boundaries, mid-line
# too. Writes of whole lines, at most PIPE_BUF (4096: one atomic write to a pipe) and a moment apart, come
# through whole; each chunk of stacks names its rank, so chunks of different ranks may interleave harmlessly.
_CHUNK = 4096
_CHUNK_GAP_S = 0.05

# hpcscale's rank failure line (launch/main.failure_line), "hpcscale launch: rank R (MPI rank M) on node N failed:
# Type: message [at 2026-01-02T03:04:05.678901Z, after losing a peer]" (the peer mark only where it applies)
_FAILURE = re.compile(r"hpcscale launch: rank (\S+) \(MPI rank (-?\d+)\) on node (\S+) failed: (.*)$")
# Where a line of ours starts: at the start of the line, or after the unfinished last line of another rank's
# output (mpirun forwards each rank's output in reads of up to 4096 bytes: on a loaded machine one read can end
# mid-line, and the next rank's line is glued to it). A line is read as the pieces that start there.
_OURS = "hpcscale launch: rank "
# Not anchored at the end: another process writing to the same log (slurmstepd's "*** STEP ... CANCELLED") can
# append to the line before its newline; the last mark on the line is this rank's.
_FAILED_AT = re.compile(r" \[at ([^\],\s]+)(, after losing a peer)?\]")
_HANG = re.compile(r"^Hang: no step finished in ([\d.]+) s \(last finished step (-?\d+); world (\d+)\)")
_STALL = re.compile(
    r"hpcscale launch: rank (\d+) \(MPI rank -?\d+\) on node (?P<node>\S+) was not running for (?P<lost>[\d.]+) s "
    r".*\[at (?P<at>[^\]\s]+)\]"
)


def utc_stamp() -> str:
    """The time in a failure line: UTC with microseconds, as launch/main.failure_line writes it (sorts as text)."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def hang_line(*, rank: int, mpi_rank: int, node: str, seconds: float, last_step: int, world_size: int) -> str:
    return (
        f"hpcscale launch: rank {rank} (MPI rank {mpi_rank}) on node {node} failed: Hang: no step finished in "
        f"{seconds:.1f} s (last finished step {last_step}; world {world_size}) [at {utc_stamp()}, after losing a peer]"
    )


def stall_text(seconds: float) -> str:
    return (
        f" was not running for {seconds:.1f} s (stopped or starved); its hang timeout does not count that time "
        f"[at {utc_stamp()}]"
    )


class Hang(NamedTuple):
    seconds: float  # without a finished step when the watchdog fired
    last_step: int  # the last step this rank finished (-1: none)
    world_size: int


@dataclass(frozen=True, slots=True)
class FailureLine:
    """One rank's failure line, parsed. Lines from older versions may lack the time and the peer mark."""

    line: str
    time: str | None  # ISO 8601 UTC: sorts as text
    peer_lost: bool
    rank: int | None = None  # hpcscale (torch) rank; None when the rank failed before it had one ("?")
    hang: Hang | None = None  # what a watchdog's line says; None for any other failure
    node: str | None = None  # the node the rank ran on

    @classmethod
    def parse(cls, line: str) -> FailureLine | None:
        """The last failure line of ours on a physical line (see parse_all), or None."""
        found = cls.parse_all(line)
        return found[-1] if found else None

    @classmethod
    def parse_all(cls, line: str) -> list[FailureLine]:
        """Every failure line of ours on a physical line: usually one; more where mpirun glued one rank's line
        to another's unfinished one. A piece cut short by the next one has lost its end, time and peer mark
        included: it counts only if it still says which rank hung (a hang line's own words come first)."""
        pieces = _pieces(line)
        found = []
        for n, text in enumerate(pieces):
            f = cls._parse_piece(text)
            if f is not None and (n == len(pieces) - 1 or f.time is not None or f.hang is not None):
                found.append(f)
        return found

    @classmethod
    def _parse_piece(cls, text: str) -> FailureLine | None:
        if " failed: " not in text:
            return None
        at = next(reversed(list(_FAILED_AT.finditer(text))), None)
        m = _FAILURE.match(text)
        rank = int(m.group(1)) if m and m.group(1).isdigit() else None
        h = _HANG.match(m.group(4)) if m else None
        hang = Hang(float(h.group(1)), int(h.group(2)), int(h.group(3))) if h else None
        node = m.group(3) if m else None
        return cls(text, at.group(1) if at else None, bool(at and at.group(2)), rank, hang, node)


class HungRanks(NamedTuple):
    """What the watchdogs' lines say: the stuck ranks (see hung_ranks), of how many, after how long. A tuple
    too: `stuck, world_size, seconds = hung_ranks(lines)`."""

    stuck: list[int]
    world_size: int
    seconds: float  # the shortest wait reported: no step finished in at least this long


def hung_ranks(lines: Iterable[str]) -> HungRanks | None:
    """The ranks to blame for a hang, from a job's output (a `run --local` log, a Slurm job's log); None when
    the job did not end in a hang: no watchdog line, or a rank failed for a reason of its own before the first.

    Stuck: every rank of the world that wrote no hang line, and every rank that says it was not running, when
    the hang was reported, for at least as long as the others waited (a SIGSTOPped rank that srun or mpirun
    continue on their way to killing it, which may then fail "after losing a peer" like any survivor, or even
    write a hang line of its own: neither proves anything about it). A live rank starved for less than that
    (a loaded machine) waited. Empty when every rank wrote a hang line and none was stopped: all were waiting
    in Python (a deadlock among them), and their stacks say where.
    """
    lines = list(lines)
    failures = [f for line in lines for f in FailureLine.parse_all(line)]
    hangs = [f for f in failures if f.hang is not None]
    if not hangs:
        return None
    first_hang = min((f.time for f in hangs if f.time), default=None)
    timed = any(f.time for f in failures)  # lines of a version that writes times: one without was cut short
    for f in failures:
        if f.hang is None and not f.peer_lost and (first_hang is None or f.time is None or f.time < first_hang):
            if f.time is None and timed:
                continue  # its end (time, peer mark) was lost to mpirun's interleaving: it proves nothing
            return None  # a rank failed of its own accord first: that is the story, not the hang it caused
    world = max(f.hang.world_size for f in hangs)
    waited = min(f.hang.seconds for f in hangs)
    waiting = {f.rank for f in hangs if f.rank is not None}
    # Not running, from the first hang on, for as long as the others waited: stopped, and what they waited on,
    # whatever it wrote once continued. A live rank starved for a few seconds on a loaded machine writes the
    # same kind of line, then its own hang line (its clock skips the lost time): it waited like the others.
    stopped = {
        int(m.group(1))
        for line in lines
        for m in _stalls(line)
        if (first_hang is None or m.group("at") >= first_hang) and float(m.group("lost")) >= waited
    }
    stuck = (set(range(world)) - waiting) | stopped
    return HungRanks(sorted(stuck), world, waited)


def stalled_nodes(lines: Iterable[str]) -> dict[int, str]:
    """rank -> node of every rank that says it was not running (SIGSTOPped, then continued to be killed)."""
    return {int(m.group(1)): m.group("node") for line in lines for m in _stalls(line)}


def _pieces(line: str) -> list[str]:
    """The pieces of a physical line that start where one of ours does (see _OURS), each up to the next."""
    if _OURS not in line:
        return []
    starts = [m.start() for m in re.finditer(re.escape(_OURS), line)]
    return [line[a:b].strip() for a, b in zip(starts, [*starts[1:], len(line)], strict=True)]


def _stalls(line: str) -> list[re.Match[str]]:
    return [m for text in _pieces(line) if (m := _STALL.match(text))]


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
            self._paused_at = now
        self.last_step = step
        self._since = now

    @contextlib.contextmanager
    def paused(self, reason: str) -> Iterator[None]:
        """Legitimately long work (a checkpoint save, evaluation): the clock stops until it ends."""
        if self._pauses == 0:
            self._paused_at = time.monotonic()
            self.pause_reason = reason
        self._pauses += 1
        try:
            yield
        finally:
            self._pauses -= 1
            if self._pauses == 0:
                if self._since is not None and self._paused_at is not None:
                    self._since += time.monotonic() - self._paused_at  # before un-pausing: never seen too old
                self._paused_at = None
                self.pause_reason = None

    def _run(self) -> None:
        woke_by = None  # when the last wait should have ended at the latest
        while not self._stop.is_set():
            now = time.monotonic()
            if woke_by is not None and now - woke_by > STALL_S:
                self._stalled(now - woke_by)
            since = self._since
            if since is None or self._paused_at is not None:
                wait = self._poll
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
        with contextlib.suppress(OSError, ValueError):
            _write_all(sys.stderr.fileno(), (self._who() + stall_text(lost) + "\n").encode())

    def _who(self) -> str:
        return f"hpcscale launch: rank {self.rank} (MPI rank {self.mpi_rank}) on node {self.node}"

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
            header = f"hpcscale launch: rank {self.rank} (MPI rank {self.mpi_rank}): Python stacks at the hang"
            for n, chunk in enumerate(_line_chunks(stacks, _CHUNK - len(header) - 20)):
                _write_all(fd, (header + (" (continued):\n" if n else ":\n")).encode() + chunk)
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
    def paused(self, reason: str) -> Iterator[None]:
        yield
