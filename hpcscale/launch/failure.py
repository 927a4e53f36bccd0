"""The rank-failure line: its format, its parser, and the summary of a job's output (who failed first and how,
which nodes to blame). One owner: every rank writes it (launch/main.py for an exception, the watchdog for a
hang), `run --local` and the Slurm diagnosis (recovery/resume.py) read it, all through this module.

The line: `hpcscale launch: rank R (MPI rank M) on node N failed: Type: first line [at TIME(, after losing a
peer)(, bad input)]`. TIME is UTC with microseconds (sorts as text); the peer mark says the failure is a
consequence of another rank's (a connection closed, a collective timed out), so the rank that failed first for a
reason of its own can be named; the bad-input mark says the rank refused its input (hpcscale's BadInput: a
job spec, an entry point's argument, a file it names; the rank exits 2) or its code (an ImportError, a
SyntaxError), which no node is to blame for. A
hang's line (`Hang: no step finished in X s (last finished step S; world W)`) always carries the peer mark: a
rank waiting in a collective is not the cause. A rank that was not running (SIGSTOP, starved) writes `... was
not running for X s ...` instead.
"""

from __future__ import annotations

import re
import signal
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import NamedTuple

from hpcscale.errors import STOPPED_EXIT_CODE, BadInput
from hpcscale.layout import ParallelDims

MAX_RANKS = 1 << 20  # the largest world a log's hang line is believed about (the lines are text others may write)
RANKS_SHOWN = 32  # ranks a summary names one by one; the rest are counted

# A peer that died or hung shows up in the survivors as these (gloo, MPI, sockets): consequences, not causes.
_PEER_LOST = re.compile(
    r"Connection (closed|reset|refused)|closed by peer|Broken pipe|ECONNRESET|EPIPE|timed? ?out|Timeout", re.IGNORECASE
)


def failure_line(e: BaseException, *, rank: str, mpi_rank: int, node: str) -> str:
    """`hpcscale launch: rank R (MPI rank M) on node N failed: Type: first line [at TIME(, after losing a peer)
    (, bad input)]`.

    The time (UTC, microseconds) and the peer mark let `run --local` name the rank that failed first for a
    reason of its own (describe_failure), not the survivors that failed because it was gone; the bad-input mark
    tells the requeue and `resume` that no node is to blame (shared_failure)."""
    first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), "")
    at = utc_stamp()
    peer = ", after losing a peer" if lost_a_peer(e) else ""
    bad = BAD_INPUT_MARK if isinstance(e, NOT_THE_NODES) else ""
    return f"{_who(rank, mpi_rank, node)} failed: {type(e).__name__}: {first} [at {at}{peer}{bad}]"


def _who(rank: int | str, mpi_rank: int, node: str) -> str:
    """The start of every line of ours, the one place it is spelled: what _OURS, _FAILURE and _STALL match."""
    return f"hpcscale launch: rank {rank} (MPI rank {mpi_rank}) on node {node}"


def lost_a_peer(e: BaseException) -> bool:
    """Whether the exception, or what it was raised from or during, is the mark of another rank's failure (a
    connection closed or reset, a collective timed out)."""
    seen: set[int] = set()
    cause: BaseException | None = e
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if _PEER_LOST.search(f"{type(cause).__name__}: {cause}"):
            return True
        cause = cause.__cause__ or cause.__context__
    return False


# hpcscale's rank failure line (failure_line), "hpcscale launch: rank R (MPI rank M) on node N failed:
# Type: message [at 2026-01-02T03:04:05.678901Z, after losing a peer]" (the peer mark only where it applies)
_FAILURE = re.compile(r"hpcscale launch: rank (\S+) \(MPI rank (-?\d+)\) on node (\S+) failed: (.*)$")
# Where a line of ours starts: at the start of the line, or after the unfinished last line of another rank's
# output (mpirun forwards each rank's output in reads of up to 4096 bytes: on a loaded machine one read can end
# mid-line, and the next rank's line is glued to it). A line is read as the pieces that start there.
_OURS = "hpcscale launch: rank "
# Not anchored at the end: another process writing to the same log (slurmstepd's "*** STEP ... CANCELLED") can
# append to the line before its newline; the last mark on the line is this rank's.
BAD_INPUT_MARK = ", bad input"  # the rank refused its input or its code (NOT_THE_NODES): see shared_failure
# What a rank fails with that no node is to blame for: its input refused (BadInput: a job spec, an argument, a
# file it names; exit 2), or the program itself not loadable (an import error, a syntax error: the same code and
# environment on every node of a cluster's shared file system)
NOT_THE_NODES = (BadInput, ImportError, SyntaxError)
_FAILED_AT = re.compile(r" \[at ([^\],\s]+)(, after losing a peer)?(" + re.escape(BAD_INPUT_MARK) + r")?\]")
_HANG = re.compile(r"^Hang: no step finished in ([\d.]+) s \(last finished step (-?\d+); world (\d+)\)")
_STALL = re.compile(
    r"hpcscale launch: rank (\d+) \(MPI rank -?\d+\) on node (?P<node>\S+) was not running for (?P<lost>[\d.]+) s "
    r".*\[at (?P<at>[^\]\s]+)\]"
)


def utc_stamp() -> str:
    """The time in a failure line: UTC with microseconds, as failure_line writes it (sorts as text)."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def hang_line(*, rank: int, mpi_rank: int, node: str, seconds: float, last_step: int, world_size: int) -> str:
    return (
        f"{_who(rank, mpi_rank, node)} failed: Hang: no step finished in {seconds:.1f} s "
        f"(last finished step {last_step}; world {world_size}) [at {utc_stamp()}, after losing a peer]"
    )


def stall_line(*, rank: int, mpi_rank: int, node: str, seconds: float) -> str:
    """`hpcscale launch: rank R (MPI rank M) on node N was not running for X s ...`: a rank's watchdog says its
    process did not run for `seconds` (stopped, starved); hung_ranks and stalled_nodes read it."""
    return (
        f"{_who(rank, mpi_rank, node)} was not running for {seconds:.1f} s (stopped or starved); its hang timeout "
        f"does not count that time [at {utc_stamp()}]"
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
    bad_input: bool = False  # the rank refused its input (the bad-input mark): no node is to blame
    what: str = ""  # `Type: first line`, without the mark: what two ranks' failures are compared by

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
        # a world beyond MAX_RANKS is no job's: such a line is a failure after losing a peer, not a hang to count
        # the silent ranks of (set(range(world)) would be built from it)
        hang = Hang(float(h.group(1)), int(h.group(2)), int(h.group(3))) if h and int(h.group(3)) <= MAX_RANKS else None
        node = m.group(3) if m else None
        what = (text[m.start(4) : at.start()] if at and at.start() > m.start(4) else m.group(4)) if m else ""
        return cls(
            text, at.group(1) if at else None, bool(at and at.group(2)), rank, hang, node, bool(at and at.group(3)),
            what.strip(),
        )  # fmt: skip


class HungRanks(NamedTuple):
    """What the watchdogs' lines say: the stuck ranks (see hung_ranks), of how many, after how long. A tuple
    too: `stuck, world_size, seconds = hung_ranks(lines)`."""

    stuck: list[int]
    world_size: int
    seconds: float  # the shortest wait reported: no step finished in at least this long


def hung_ranks(lines: Iterable[str], *, world_size: int | None = None) -> HungRanks | None:
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
    known = world_size is not None and 0 < world_size <= MAX_RANKS
    world = world_size if known else max(f.hang.world_size for f in hangs)
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
    stuck = (set(range(world)) - waiting) | {r for r in stopped if r < world}
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


# ---- the summary of a job's output ----
# mpirun's own words when a rank dies: "process rank 2 with PID 123 on node vm exited on signal 9 (Killed)"
# (Open MPI 4); Open MPI 5's prterun breaks the line after "exited on"
_DIED = re.compile(r"process rank (\d+) with PID \d+ on node (\S+) exited on\s*signal (\d+)(?: \(([^)]*)\))?")
# and for a rank that exited non-zero first: "Process name: [[19984,1],1]" (4) or "[prterun-vm-7274@1,1]" (5)
_EXITED = re.compile(r"Process name: \[(?:\[\d+,\d+\]|[^\]\s,]+@\d+),(\d+)\]\s+Exit code:\s+(\d+)")
# srun's words for a task that ended badly: its node, the task ids, how
_SRUN_TASK = re.compile(
    r"srun: error: (\S+): tasks? ([\d,\-]+): (Killed|Exited with exit code \d+|Terminated|Aborted|Segmentation fault)"
)


# the signal of each way srun says a task died of one of its own (not the SIGTERM --kill-on-bad-exit sends the rest)
_TASK_SIGNALS = {"Killed": signal.SIGKILL, "Aborted": signal.SIGABRT, "Segmentation fault": signal.SIGSEGV}


class SignalledTask(NamedTuple):
    node: str
    tasks: str  # as srun writes them: "3", "0-2", "1,3"
    signum: int


def signalled_task(lines: Iterable[str]) -> SignalledTask | None:
    """The first task srun saw die of a signal of its own ("srun: error: n2: task 3: Killed"): killed (the OOM
    killer, kill -9, its node gone), aborted or a segmentation fault; None if none did. srun's own exit code
    does not say so: it reports the highest wait status of its tasks, and the survivors' exit 1 (they lost a
    peer) outranks a death by signal 9. None too when a rank wrote a failure line for a reason of its own (an
    exception, not a lost peer): srun killed the others after it exited (--kill-on-bad-exit), and their "Killed"
    says nothing about them."""
    lines = list(lines)
    if any(not f.peer_lost and f.hang is None for line in lines for f in FailureLine.parse_all(line)):
        return None
    for line in lines:
        if (m := _SRUN_TASK.search(line)) and m.group(3) in _TASK_SIGNALS:
            return SignalledTask(m.group(1), m.group(2), int(_TASK_SIGNALS[m.group(3)]))
    return None


def shared_failure(lines: Iterable[str]) -> str | None:
    """One line saying the job failed alike wherever it ran, so no node is to blame; None otherwise.

    - A rank refused its input (its failure line's bad-input mark: hpcscale's BadInput, exit 2): the job spec, an
      entry point's argument, a file the job names; or its code (an ImportError, a SyntaxError). The same input on
      every node: which rank said it first is chance (srun then kills the others, which srun reports as
      "Killed", and which says nothing about their nodes).
    - Ranks on two or more nodes failed for a reason of their own (no peer mark, not a hang) with the same
      `Type: first line`: the program fails the same way everywhere (its own exception, out of memory on
      every node), not because of one node.
    - No rank wrote a failure line, and the first task srun saw end `Exited with exit code 2` before any died of a
      signal: a program that refused its input before it could write a line of ours (a `command:` job's
      argument parser).
    A failure on one node only, or different failures, stays a failure that may be a node's (rank_failure)."""
    lines = list(lines)
    failures = [f for line in lines for f in FailureLine.parse_all(line)]
    bad = [f for f in failures if f.bad_input]
    if bad:
        first = min(bad, key=lambda f: f.time or "~")
        return f"{first.line} (refused its input: the same on every node, so no node is to blame)"
    own = [f for f in failures if not f.peer_lost and f.hang is None and f.node and f.what]
    if own:
        first = min(own, key=lambda f: f.time or "~")
        nodes = sorted({f.node for f in own if f.what == first.what})
        if len(nodes) > 1 and all(f.what == first.what for f in own):
            more = f", ... ({len(nodes)} in all)" if len(nodes) > RANKS_SHOWN else ""
            shown = ", ".join(nodes[:RANKS_SHOWN]) + more
            return (
                f"{first.line}; ranks on nodes {shown} failed the same way, so no node is to blame (the program or "
                "its input)"
            )
    for line in lines if not failures else ():  # a rank's own line, where there is one, says more than srun
        if m := _SRUN_TASK.search(line):
            if m.group(3) == "Exited with exit code 2":
                return (
                    f"MPI task {m.group(2)} on node {m.group(1)} exited with code 2 (srun) before any task died: the "
                    "program refused its input, which no node is to blame for"
                )
            if m.group(3) != f"Exited with exit code {STOPPED_EXIT_CODE}":
                break
    return None


def describe_failure(lines, *, world_size: int | None = None) -> str | None:
    """One line naming the rank that failed first, and how.

    A hang (watchdogs' lines, and no rank failing of its own accord before them: hung_ranks)
    names the stuck ranks, those that wrote no such line; the others were waiting on them. A rank killed by a
    signal (mpirun: "process rank 2 ... exited on signal 9") is the cause: the others fail after it with
    connection errors ("after losing a peer"), and a rank that raises calls MPI_Abort, after which mpirun
    reports no signal deaths. The exception is SIGABRT, which a rank may also die of in the aftermath (a torch
    thread's std::terminate while the process exits): it yields to a rank that raised for a reason of its own.
    Among ranks that raised, the first with a reason of its own (each failure line carries its time and the
    peer mark), else the first. Under run --local all ranks are on one node, where placement
    keeps MPI order, so MPI rank = hpcscale rank. `world_size`: the job's, where known (hung_ranks).
    """
    lines = list(lines)
    if (hung := hung_ranks(lines, world_size=world_size)) is not None:
        return _describe_hang(hung)
    failures = [f for line in lines for f in FailureLine.parse_all(line)]
    own = [f for f in failures if not f.peer_lost]
    m = _DIED.search("".join(lines))
    if m and not (int(m.group(3)) == signal.SIGABRT and own):
        rank, node, signum, name = m.groups()
        how = f"signal {signum}" + (f" ({name})" if name else "")
        others = f"; {len(failures)} other rank(s) failed after it (see the log)" if failures else ""
        return f"rank {rank} (MPI rank {rank}) on node {node} was killed by {how}{others}"
    if failures:
        first = min(failures, key=lambda f: (f.peer_lost, f.time or "~"))
        more = len(failures) - 1
        return first.line + (f"; {more} other rank(s) failed too (see the log)" if more else "")
    if m := _EXITED.search("".join(lines)):
        return f"rank {m.group(1)} (MPI rank {m.group(1)}) exited with code {m.group(2)}"
    return None


def _describe_hang(hung: HungRanks) -> str:
    waited = sorted(set(range(hung.world_size)) - set(hung.stuck))
    seconds = f"{hung.seconds:.0f}" if hung.seconds >= 10 else f"{hung.seconds:.1f}"
    if not hung.stuck:
        return (
            f"every rank stopped making progress (no step in {seconds} s; each one's watchdog fired, so all were "
            "waiting in Python: see every rank's stacks in the log)"
        )
    plural = len(hung.stuck) > 1
    return (
        f"{_ranks(hung.stuck)} stopped making progress (no step in {seconds} s; "
        f"{_ranks(waited) if waited else 'no rank'} waited on {'them' if plural else 'it'})"
    )


def _ranks(ranks: list[int]) -> str:
    """`rank 3`, `ranks 0, 1, 3`; past RANKS_SHOWN the first ones and how many in all (a world of 4096 ranks
    waiting on one would otherwise fill a line with 4095 numbers)."""
    shown = ", ".join(map(str, ranks[:RANKS_SHOWN]))
    if len(ranks) > RANKS_SHOWN:
        shown += f", ... ({len(ranks)} ranks in all)"
    return ("ranks " if len(ranks) > 1 else "rank ") + shown


def rank_failure(
    lines: list[str], *, dims: ParallelDims | None = None, placement: list[str] | None = None
) -> tuple[str | None, list[str]]:
    """(one line naming the rank that failed first and how, the nodes to blame) from a job's log lines.

    A failure the job shares wherever it ran (shared_failure: bad input, the same exception on several nodes)
    blames no node.
    The ranks' own failure lines come first (describe_failure): the first rank that failed
    for a reason of its own is named and its node blamed (srun then terminates the others: that blames nobody).
    Then a hang: the rank that stopped making progress, and its node from the line it writes once continued.
    Otherwise a task srun saw killed without a word (the OOM killer, kill -9, its node gone) is the cause, and
    its node is blamed."""
    from hpcscale.launch.nccl_failure import describe_nccl_timeouts, nccl_timeouts

    if (shared := shared_failure(lines)) is not None:  # the same everywhere: no node to blame
        return shared, []
    tasks = [m for line in lines if (m := _SRUN_TASK.search(line))]
    world = dims.world_size if dims is not None else (len(placement) if placement else None)
    summary = describe_failure([line + "\n" for line in lines], world_size=world)
    own = [f for line in lines for f in FailureLine.parse_all(line) if not f.peer_lost and not f.hang and f.node]
    if own:  # srun terminates the others after a rank's own failure: their "Terminated" blames nobody
        return summary, [own[0].node]
    nccl = describe_nccl_timeouts(nccl_timeouts(lines), dims=dims, rank_nodes=placement)
    if nccl is not None:  # NCCL's watchdog aborted the ranks that waited: no line of ours, srun says "Aborted"
        return nccl.line, nccl.blamed_nodes
    hung = hung_ranks(lines, world_size=world)
    if hung is not None and hung.stuck:  # the stuck rank's node, from its own line once it was continued
        where = stalled_nodes(lines)
        return summary, list(dict.fromkeys(where[r] for r in hung.stuck if r in where))
    signalled = [m for m in tasks if m.group(3) in ("Killed", "Aborted", "Segmentation fault")] or [
        m for m in tasks if m.group(3) == "Terminated"
    ]
    if signalled:  # killed without a word: the OOM killer, kill -9, its node gone
        m = signalled[0]
        return f"MPI task {m.group(2)} on node {m.group(1)} was {m.group(3).lower()} (srun)", [m.group(1)]
    failed = [m for m in tasks if m.group(3) != f"Exited with exit code {STOPPED_EXIT_CODE}"]
    if failed and summary is None:
        m = failed[0]
        return f"MPI task {m.group(2)} on node {m.group(1)}: {m.group(3).lower()} (srun)", []
    return summary, []
