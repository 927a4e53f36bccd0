"""The rank lines: their one spec, and the summary of a job's output (who failed first and how, which nodes
to blame). One owner: every rank writes them (launch/main.py for an exception, the watchdog for a hang, a stall
and its stacks), `run --local` and the Slurm diagnosis (recovery/resume.py, the requeue) read them, all through
this module.

Each kind of line is one LineSpec, a template of named FIELDS from which both its writer (format) and its reader
(parse) are made, so what is written and what is read cannot drift (tests/recovery/test_failure_spec.py: any values read
back, also glued to another rank's unfinished line or followed by slurmstepd's words; a line cut short says
less, never something else). The failure line (FAILURE): `hpcscale launch: rank R (MPI rank M) on node N failed:
Type: first line [at TIME(, after losing a peer)(, bad input)]`. TIME is UTC with microseconds (sorts as text);
the peer mark says the failure is a consequence of another rank's (a connection closed, a collective timed out),
so the rank that failed first for a reason of its own can be named; the bad-input mark says the rank refused its
input (hpcscale's BadInput: a job spec, an entry point's argument, a file it names; the rank exits 2) or its code
(an ImportError, a SyntaxError), which no node is to blame for. A hang's line is a failure line whose `Type: first
line` is HANG (`Hang: no step finished in X s (last finished step S; world W)`), always with the peer mark: a
rank waiting in a collective is not the cause. A rank that was not running (SIGSTOP, starved) writes STALL,
`... was not running for X s ...`, instead.

Which cause comes first is decided in one place, first_cause, whose docstring gives the order.
"""

from __future__ import annotations

import errno
import re
import signal
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, NamedTuple

from hpcscale.errors import STOPPED_EXIT_CODE, BadInput
from hpcscale.layout import ParallelDims

MAX_RANKS = 1 << 20  # the largest world a log's hang line is believed about (the lines are text others may write)
RANKS_SHOWN = 32  # ranks a summary names one by one; the rest are counted

# A peer that died or hung shows up in the survivors as these (gloo, MPI, sockets): consequences, not causes.
# NCCL's words for a peer or link gone (ncclRemoteError: "remote process exited or there was a network error",
# ncclSystemError) and torch's DistNetworkError are the same kind of consequence.
_PEER_LOST = re.compile(
    r"Connection (closed|reset|refused)|closed by peer|Broken pipe|ECONNRESET|EPIPE|timed? ?out|Timeout"
    r"|remote process exited|network error|ncclRemoteError|ncclSystemError|DistNetworkError",
    re.IGNORECASE,
)
BAD_INPUT_MARK = ", bad input"  # the rank refused its input or its code (NOT_THE_NODES): see shared_failure
PEER_MARK = ", after losing a peer"
# What a rank fails with that no node is to blame for: its input refused (BadInput: a job spec, an argument, a
# file it names; exit 2), or its code not valid Python (a SyntaxError), unless a node's fault is in the exception's
# chain (node_fault). An ImportError is not among them: a node whose driver or software mount is broken raises it
# too (libcuda.so.1), so it counts as shared only on two or more nodes alike (shared_failure).
NOT_THE_NODES = (BadInput, SyntaxError)
# errnos of a node's (or its file system client's, or its network's) fault, not of the input: a BadInput raised
# while reading with one of these in its chain ("cannot read the token shard (Input/output error)") is the node's
NODE_FAULT_ERRNOS = frozenset(
    getattr(errno, name)
    for name in ("EIO", "ESTALE", "ENOTCONN", "EREMOTEIO", "ETIMEDOUT", "EHOSTDOWN", "EHOSTUNREACH", "ENETDOWN",
                 "ENETUNREACH", "ECONNABORTED", "ENOMEM", "ENOSPC", "EDQUOT", "EROFS", "ENODEV", "ENXIO", "ENOLINK")
    if hasattr(errno, name)
)  # fmt: skip


def node_fault(e: BaseException) -> bool:
    """Whether the exception, or what it was raised from or during, is an OSError of a node's fault (an I/O error,
    a stale file handle, a full or read-only local disk, a network gone): not the input's."""
    seen: set[int] = set()
    cause: BaseException | None = e
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, OSError) and cause.errno in NODE_FAULT_ERRNOS:
            return True
        cause = cause.__cause__ or cause.__context__
    return False


def refused_input(e: BaseException) -> bool:
    """Whether a rank's exception is its input or code refused, which no node is to blame for (the bad-input
    mark): NOT_THE_NODES, without a node's fault in its chain."""
    return isinstance(e, NOT_THE_NODES) and not node_fault(e)


# ---- the lines' one spec: each kind is a template; its writer and its reader are both made from it ----------
@dataclass(frozen=True, slots=True)
class Field:
    """One value in a line: the regex of its text, how a value is written, how its text is read back."""

    pattern: str
    write: Callable[[Any], str] = str
    read: Callable[[str], Any] = str


def _mark(text: str) -> Field:
    """A mark that is there or not (`, after losing a peer`): True or False."""
    return Field(f"(?:{re.escape(text)})?", lambda on: text if on else "", bool)


FIELDS: dict[str, Field] = {
    # "?": a rank that failed before it had one (HPCSCALE_RANK unset); any other word is read as that too
    "rank": Field(r"\S+", lambda r: "?" if r is None else str(r), lambda s: int(s) if s.isdigit() else None),
    "mpi_rank": Field(r"-?\d+", str, int),
    "node": Field(r"\S+"),
    # `Type: first line`. Greedy: the line's last mark is its own (a message may hold `[at ` or `]`)
    "what": Field(r".*", str, str.strip),
    # UTC with microseconds (utc_stamp): sorts as text. Exact, so no `[at x]` in a message passes for the mark
    "time": Field(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z"),
    "peer": _mark(PEER_MARK),
    "bad": _mark(BAD_INPUT_MARK),
    "seconds": Field(r"\d+(?:\.\d+)?", lambda s: f"{s:.1f}", float),
    "last_step": Field(r"-?\d+", str, int),
    "world": Field(r"\d+", str, int),
    "continued": _mark(" (continued)"),
}


class LineSpec:
    """One kind of line: a template whose `{name}`s are FIELDS. format() writes a line from values; parse() reads
    them back from the start of a text, not anchored at its end (another process writing to the same log,
    slurmstepd's `*** STEP ... CANCELLED`, can append to a line before its newline); parse(text, cut=name) reads
    a line cut short (mpirun's reads end mid-line) as far as the field `name`, which takes the rest."""

    def __init__(self, kind: str, template: str) -> None:
        self.kind, self.template = kind, template
        # (literal text, the field after it or None)
        self._parts = [(m[1], m[2]) for m in re.finditer(r"([^{]*)(?:\{(\w+)\}|$)", template) if m[0]]
        self.names = tuple(name for _, name in self._parts if name)
        self._regexes: dict[str | None, re.Pattern[str]] = {}

    def regex(self, cut: str | None = None) -> re.Pattern[str]:
        if cut not in self._regexes:
            out = []
            for text, name in self._parts:
                out.append(re.escape(text))
                if name is not None:
                    out.append(f"(?P<{name}>{'.*' if name == cut else FIELDS[name].pattern})")
                    if name == cut:
                        break
            self._regexes[cut] = re.compile("".join(out))
        return self._regexes[cut]

    def format(self, **values: Any) -> str:
        if set(values) != set(self.names):
            raise TypeError(f"the {self.kind} line's fields are {', '.join(self.names)}; given {', '.join(values)}")
        return "".join(text + (FIELDS[name].write(values[name]) if name else "") for text, name in self._parts)

    def parse(self, text: str, *, cut: str | None = None) -> dict[str, Any] | None:
        found = self.match(text, cut=cut)
        return found[0] if found else None

    def match(self, text: str, *, cut: str | None = None) -> tuple[dict[str, Any], int] | None:
        """(the values, where the line ends in `text`), or None."""
        m = self.regex(cut).match(text)
        if m is None:
            return None
        return {name: FIELDS[name].read(value) for name, value in m.groupdict().items()}, m.end()


# Every line of ours starts here: at the start of a physical line, or after the unfinished last line of another
# rank's output (mpirun forwards each rank's output in reads of up to 4096 bytes: on a loaded machine one read can
# end mid-line, and the next rank's line is glued to it). A line is read as the pieces that start there.
_OURS = "hpcscale launch: rank "
_WHO = _OURS + "{rank} (MPI rank {mpi_rank}) on node {node}"
# `... failed: Type: first line [at TIME(, after losing a peer)(, bad input)]`: an exception (failure_line) or a
# hang (hang_line, whose `what` is HANG); lines of versions before the time and the marks end at `what`
FAILURE = LineSpec("failure", _WHO + " failed: {what} [at {time}{peer}{bad}]")
HANG = LineSpec("hang", "Hang: no step finished in {seconds} s (last finished step {last_step}; world {world})")
STALL = LineSpec(
    "stall",
    _WHO + " was not running for {seconds} s (stopped or starved); its hang timeout does not count that time "
    "[at {time}]",
)
# the header of each chunk of a hung rank's Python stacks (the watchdog)
STACKS = LineSpec("stacks", _OURS + "{rank} (MPI rank {mpi_rank}): Python stacks at the hang{continued}:")


def failure_line(e: BaseException, *, rank: str, mpi_rank: int, node: str) -> str:
    """`hpcscale launch: rank R (MPI rank M) on node N failed: Type: first line [at TIME(, after losing a peer)
    (, bad input)]`.

    The time (UTC, microseconds) and the peer mark let `run --local` name the rank that failed first for a
    reason of its own (first_cause), not the survivors that failed because it was gone; the bad-input mark
    tells the requeue and `resume` that no node is to blame (shared_failure)."""
    first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), "")
    return FAILURE.format(
        rank=int(rank) if str(rank).isdigit() else None,
        mpi_rank=mpi_rank,
        node=node,
        what=f"{type(e).__name__}: {first}",
        time=utc_stamp(),
        peer=lost_a_peer(e),
        bad=refused_input(e),
    )


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


def utc_stamp() -> str:
    """The time in a failure line: UTC with microseconds, as failure_line writes it (sorts as text)."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def hang_line(*, rank: int, mpi_rank: int, node: str, seconds: float, last_step: int, world_size: int) -> str:
    """A watchdog's failure line: always with the peer mark (a rank waiting in a collective is not the cause)."""
    what = HANG.format(seconds=seconds, last_step=last_step, world=world_size)
    return FAILURE.format(
        rank=rank, mpi_rank=mpi_rank, node=node, what=what, time=utc_stamp(), peer=True, bad=False
    )  # fmt: skip


def stall_line(*, rank: int, mpi_rank: int, node: str, seconds: float) -> str:
    """`hpcscale launch: rank R (MPI rank M) on node N was not running for X s ...`: a rank's watchdog says its
    process did not run for `seconds` (stopped, starved); hung_ranks and stalled_nodes read it."""
    return STALL.format(rank=rank, mpi_rank=mpi_rank, node=node, seconds=seconds, time=utc_stamp())


def stacks_header(*, rank: int, mpi_rank: int, continued: bool) -> str:
    """The line before each chunk of a hung rank's Python stacks."""
    return STACKS.format(rank=rank, mpi_rank=mpi_rank, continued=continued)


class Hang(NamedTuple):
    seconds: float  # without a finished step when the watchdog fired
    last_step: int  # the last step this rank finished (-1: none)
    world_size: int


@dataclass(frozen=True, slots=True)
class FailureLine:
    """One rank's failure line, parsed (FAILURE). A line without its mark (time, peer mark) was cut short, or
    written by a version before the marks: `complete` says which it is not."""

    line: str  # the line, up to its mark (not what another process appended to it)
    time: str | None  # ISO 8601 UTC: sorts as text
    peer_lost: bool
    rank: int | None = None  # hpcscale (torch) rank; None when the rank failed before it had one ("?")
    hang: Hang | None = None  # what a watchdog's line says; None for any other failure
    node: str | None = None  # the node the rank ran on
    bad_input: bool = False  # the rank refused its input (the bad-input mark): no node is to blame
    what: str = ""  # `Type: first line`, without the mark: what two ranks' failures are compared by
    mpi_rank: int | None = None
    complete: bool = True  # the mark was read: the line was not cut short

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
            f = cls.read(text)
            if f is not None and (n == len(pieces) - 1 or f.complete or f.hang is not None):
                found.append(f)
        return found

    @classmethod
    def read(cls, text: str) -> FailureLine | None:
        """One piece: a whole line (FAILURE), or one cut short after its `what` began."""
        found = FAILURE.match(text)
        complete = found is not None
        if found is None and (found := FAILURE.match(text, cut="what")) is None:
            return None
        v, end = found
        h = HANG.parse(v["what"])
        # a world beyond MAX_RANKS is no job's: such a line is a failure after losing a peer, not a hang to count
        # the silent ranks of (set(range(world)) would be built from it)
        hang = Hang(h["seconds"], h["last_step"], h["world"]) if h and h["world"] <= MAX_RANKS else None
        return cls(
            text[:end], v.get("time"), v.get("peer", False), v["rank"], hang, v["node"], v.get("bad", False),
            v["what"], v["mpi_rank"], complete,
        )  # fmt: skip

    def values(self) -> dict[str, Any]:
        """The FAILURE fields this line was read from (a complete one's): FAILURE.format(**f.values()) == f.line."""
        return {
            "rank": self.rank, "mpi_rank": self.mpi_rank, "node": self.node, "what": self.what, "time": self.time,
            "peer": self.peer_lost, "bad": self.bad_input,
        }  # fmt: skip


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
        s["rank"]
        for line in lines
        for s in _stalls(line)
        if (first_hang is None or s["time"] >= first_hang) and s["seconds"] >= waited
    }
    stuck = (set(range(world)) - waiting) | {r for r in stopped if r < world}
    return HungRanks(sorted(stuck), world, waited)


def is_rank_report(text: str) -> bool:
    """Whether a physical line holds a rank's failure or stall line (whole or cut short): what a summary of a
    long output keeps, however many lines of tracebacks follow."""
    return bool(FailureLine.parse_all(text) or _stalls(text))


def stalled_nodes(lines: Iterable[str]) -> dict[int, str]:
    """rank -> node of every rank that says it was not running (SIGSTOPped, then continued to be killed)."""
    return {s["rank"]: s["node"] for line in lines for s in _stalls(line)}


def _pieces(line: str) -> list[str]:
    """The pieces of a physical line that start where one of ours does (see _OURS), each up to the next."""
    if _OURS not in line:
        return []
    starts = [m.start() for m in re.finditer(re.escape(_OURS), line)]
    return [line[a:b].strip() for a, b in zip(starts, [*starts[1:], len(line)], strict=True)]


def _stalls(line: str) -> list[dict[str, Any]]:
    """The stall lines (STALL) on a physical line, of ranks that had one."""
    return [s for text in _pieces(line) if (s := STALL.parse(text)) and s["rank"] is not None]


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
# srun's word for a node Slurm declared failed during the step (down, not responding): its tasks are gone, and
# Slurm then kills the step's other tasks, which srun reports as Killed on their own (healthy) nodes
NODE_FAILURE = re.compile(r"srun: error: Node failure on (\S+)")
_TASK_SIGNALS = {"Killed": signal.SIGKILL, "Aborted": signal.SIGABRT, "Segmentation fault": signal.SIGSEGV}


class SignalledTask(NamedTuple):
    node: str
    tasks: str  # as srun writes them: "3", "0-2", "1,3"
    signum: int


def _own_failures(failures: list[FailureLine]) -> list[FailureLine]:
    """The lines of ranks that failed for a reason of their own: no peer mark, not a hang, and not cut short (a
    line that lost its end lost its peer mark with it, if it had one: it proves nothing). In a log of a version
    before the marks (no line has one) a line without them is taken at its word."""
    marked = any(f.complete for f in failures)
    return [f for f in failures if not f.peer_lost and f.hang is None and (f.complete or not marked)]


def signalled_task(lines: Iterable[str]) -> SignalledTask | None:
    """The first task srun saw die of a signal of its own ("srun: error: n2: task 3: Killed"): killed (the OOM
    killer, kill -9, its node gone), aborted or a segmentation fault; None if none did. srun's own exit code
    does not say so: it reports the highest wait status of its tasks, and the survivors' exit 1 (they lost a
    peer) outranks a death by signal 9. None too when a rank wrote a failure line for a reason of its own (an
    exception, not a lost peer): srun killed the others after it exited (--kill-on-bad-exit), and their "Killed"
    says nothing about them."""
    lines = list(lines)
    if _own_failures([f for line in lines for f in FailureLine.parse_all(line)]):
        return None
    for line in lines:
        if (m := _SRUN_TASK.search(line)) and m.group(3) in _TASK_SIGNALS:
            return SignalledTask(m.group(1), m.group(2), int(_TASK_SIGNALS[m.group(3)]))
    return None


_DIST_ERRORS = ("DistBackendError:", "DistNetworkError:", "DistStoreError:", "DistError:")


def shared_failure(lines: Iterable[str]) -> str | None:
    """One line saying the job failed alike wherever it ran, so no node is to blame; None otherwise.

    - A rank refused its input (its failure line's bad-input mark: hpcscale's BadInput, exit 2, without a node's
      fault in its chain: refused_input): the job spec, an entry point's argument, a file the job names; or its
      code (a SyntaxError). The same input on
      every node: which rank said it first is chance (srun then kills the others, which srun reports as
      "Killed", and which says nothing about their nodes).
    - Ranks on two or more nodes failed for a reason of their own (no peer mark, not a hang) with the same
      `Type: first line`: the program fails the same way everywhere (its own exception, an import error, out of
      memory on every node), not because of one node. torch.distributed's own errors are left out (a link
      between two nodes fails on both ends with one message).
    - No rank wrote a failure line, and srun saw tasks on two or more nodes end `Exited with exit code 2` before
      any died of a signal: a program that refused its input before it could write a line of ours (a
      `command:` job's argument parser).
    A failure on one node only, or different failures, stays a failure that may be a node's (rank_failure)."""
    lines = list(lines)
    failures = [f for line in lines for f in FailureLine.parse_all(line)]
    bad = [f for f in failures if f.bad_input]
    if bad:
        first = min(bad, key=lambda f: f.time or "~")
        return f"{first.line} (refused its input: the same on every node, so no node is to blame)"
    # torch.distributed's own errors are left out: a link between two nodes fails on both ends with one message
    own = [f for f in _own_failures(failures) if f.node and f.what and not f.what.startswith(_DIST_ERRORS)]
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
    exited_2: dict[str, str] = {}  # node -> its tasks that srun saw exit 2 before any task died
    for line in lines if not failures else ():  # a rank's own line, where there is one, says more than srun
        if m := _SRUN_TASK.search(line):
            if m.group(3) == "Exited with exit code 2":
                exited_2.setdefault(m.group(1), m.group(2))
            elif m.group(3) != f"Exited with exit code {STOPPED_EXIT_CODE}":
                break
    if len(exited_2) > 1:  # on one node only, it may be that node's (a mount missing there: "can't open file")
        nodes = ", ".join(sorted(exited_2)[:RANKS_SHOWN])
        return (
            f"MPI tasks on nodes {nodes} exited with code 2 (srun) before any task died: the program refused its "
            "input, which no node is to blame for"
        )
    return None


@dataclass(frozen=True, slots=True)
class Cause:
    """How a job ended, read from its output (first_cause)."""

    kind: str  # "hang", "signal", "failure", "nccl", "shared", "node", "silent", "lost_peer", "exited"
    words: str  # one line for a person: the rank that failed first, and how
    ranks: tuple[int, ...] = ()  # the ranks to blame (MPI ranks where only mpirun or srun named them)
    nodes: tuple[str, ...] = ()  # the nodes to blame: none for a failure the job shares wherever it ran
    shared: str | None = None  # why no node is to blame, where the job failed alike wherever it ran


def first_cause(
    lines: Iterable[str],
    *,
    world_size: int | None = None,
    dims: ParallelDims | None = None,
    placement: list[str] | None = None,
) -> Cause | None:
    """The cause of a job's failure from its output (a `run --local` log, a Slurm job's logs); None when it says
    none. `world_size`, `dims` (the layout) and `placement` (the node of each rank): the job's, where known.
    The one order every reader takes (describe_failure, rank_failure, `resume`, `run --local`'s summary):

    1. A hang (watchdogs' lines: hung_ranks), unless a rank failed of its own accord before the first of them:
       the ranks that wrote no hang line (or were stopped) are named; the others waited on them.
    2. A rank mpirun saw die of a signal other than SIGABRT ("process rank 2 ... exited on signal 9"): mpirun
       reports a death only when it came before any rank's MPI_Abort, so it was first, whatever lines the
       survivors wrote after it (a connection reset by the dead peer, with or without its peer mark).
    3. A rank that failed for a reason of its own (a whole failure line without the peer mark; a line cut short
       lost that mark and proves nothing): the first by its time, and its node blamed; none blamed where the
       job failed alike wherever it ran (shared_failure: bad input, the same exception on several nodes).
    4. NCCL's collective timeouts (launch/nccl_failure.py): the rank the others waited for, and its node.
    5. A rank mpirun saw die of SIGABRT, which a rank may die of in the aftermath (a torch thread's
       std::terminate while the process exits, NCCL's watchdog): it yields to 3 and 4.
    6. A job that failed alike wherever it ran with no line of ours (srun: exit code 2 before any task died).
    7. A node Slurm declared failed during the step (srun: "Node failure on N"): its node, not the tasks srun
       saw killed after it on the other nodes.
    8. A task srun saw end by a signal (Killed, Aborted, a segmentation fault; else Terminated): its node.
       srun's lines carry no order, and its --kill-on-bad-exit kills the rest after a rank's own failure, so
       they come after 3.
    9. Only survivors wrote lines (all after losing a peer) and the world is known: the ranks that wrote none
       (fewer than wrote) ended first without a word (kill -9, the OOM killer); no node is blamed on that guess.
    10. The first line there is (whole lines before cut ones); then how srun or mpirun say a rank exited.
    """
    from hpcscale.launch.nccl_failure import describe_nccl_timeouts, nccl_timeouts

    lines = [line.rstrip("\n") for line in lines]
    text = "\n".join(lines)
    if world_size is None:
        world_size = dims.world_size if dims is not None else (len(placement) if placement else None)
    failures = [f for line in lines for f in FailureLine.parse_all(line)]
    own = _own_failures(failures)
    if (hung := hung_ranks(lines, world_size=world_size)) is not None:
        where = stalled_nodes(lines)  # a stuck rank's node as its own stall line says, else as the job placed it
        if placement is not None:
            where = {r: node for r, node in enumerate(placement)} | where
        nodes = tuple(dict.fromkeys(where[r] for r in hung.stuck if r in where))
        return Cause("hang", _describe_hang(hung), tuple(hung.stuck), nodes)
    died = _DIED.search(text)
    if died and int(died.group(3)) != signal.SIGABRT:
        return _died(died, failures)
    if own:
        first = min(own, key=lambda f: f.time or "~")
        shared = shared_failure(lines)
        ranks = (first.rank,) if first.rank is not None else ()
        return Cause("failure", _with_others(first, failures, "too"), ranks, () if shared else (first.node,), shared)
    nccl = describe_nccl_timeouts(nccl_timeouts(lines), dims=dims, rank_nodes=placement)
    if nccl is not None:  # NCCL's watchdog aborted the ranks that waited: srun says "Aborted", mpirun signal 6
        return Cause("nccl", nccl.line, tuple(nccl.blamed_ranks), tuple(nccl.blamed_nodes))
    if died:
        return _died(died, failures)
    if (shared := shared_failure(lines)) is not None:
        return Cause("shared", shared, shared=shared)
    lost = list(dict.fromkeys(m.group(1) for line in lines if (m := NODE_FAILURE.search(line))))
    if lost:  # before the tasks srun saw killed: Slurm killed the others' after it declared these nodes failed
        return Cause("node", f"node {', '.join(lost)} failed during the step (srun: Node failure)", (), tuple(lost))
    tasks = [m for line in lines if (m := _SRUN_TASK.search(line))]
    signalled = [m for m in tasks if m.group(3) in _TASK_SIGNALS] or [m for m in tasks if m.group(3) == "Terminated"]
    if signalled:  # killed without a word: the OOM killer, kill -9, its node gone
        m = signalled[0]
        return Cause(
            "signal", f"MPI task {m.group(2)} on node {m.group(1)} was {m.group(3).lower()} (srun)", (), (m[1],)
        )
    if failures and (silent := _silent(failures, world_size, placement)) is not None:
        return silent
    if failures:
        first = min(failures, key=lambda f: (not f.complete, f.time or "~"))
        return Cause("lost_peer", _with_others(first, failures, "too"))
    failed = [m for m in tasks if m.group(3) != f"Exited with exit code {STOPPED_EXIT_CODE}"]
    if failed:
        m = failed[0]
        return Cause("exited", f"MPI task {m.group(2)} on node {m.group(1)}: {m.group(3).lower()} (srun)")
    if m := _EXITED.search(text):
        return Cause("exited", f"rank {m.group(1)} (MPI rank {m.group(1)}) exited with code {m.group(2)}")
    return None


def _others(failures: list[FailureLine], but: int | None) -> int:
    """How many ranks other than MPI rank `but` wrote a failure line (each counted once)."""
    return len({f.mpi_rank if f.mpi_rank is not None else id(f) for f in failures} - {but})


def _with_others(first: FailureLine, failures: list[FailureLine], how: str) -> str:
    more = _others(failures, first.mpi_rank)
    return first.line + (f"; {more} other rank(s) failed {how} (see the log)" if more else "")


def _died(m: re.Match[str], failures: list[FailureLine]) -> Cause:
    """mpirun's notice of a rank that died of a signal. Under run --local all ranks are on one node, where
    placement keeps MPI order, so MPI rank = hpcscale rank."""
    rank, node, signum, name = m.groups()
    how = f"signal {signum}" + (f" ({name})" if name else "")
    more = _others(failures, int(rank))
    others = f"; {more} other rank(s) failed after it (see the log)" if more else ""
    return Cause(
        "signal", f"rank {rank} (MPI rank {rank}) on node {node} was killed by {how}{others}", (int(rank),), (node,)
    )


def _silent(failures: list[FailureLine], world_size: int | None, placement: list[str] | None) -> Cause | None:
    """The ranks that wrote no line where every other rank failed after losing a peer (see first_cause, 8)."""
    if not (world_size and 0 < world_size <= MAX_RANKS) or not all(f.peer_lost or not f.complete for f in failures):
        return None
    wrote = {f.rank for f in failures if f.rank is not None and f.rank < world_size}
    silent = sorted(set(range(world_size)) - wrote)
    if not silent or len(silent) > len(wrote):
        return None
    on = ""
    if placement is not None and len(placement) == world_size:
        on = f" (node {', '.join(dict.fromkeys(placement[r] for r in silent))})"
    one = "it ended first" if len(silent) == 1 else "one of them ended first"
    return Cause(
        "silent",
        f"{_ranks(silent)}{on} wrote no failure line: {one}, without a word (kill -9, the OOM killer?); "
        f"{_ranks(sorted(wrote))} failed after losing a peer (see the log)",
        tuple(silent),
    )


def describe_failure(lines, *, world_size: int | None = None) -> str | None:
    """One line naming the rank that failed first, and how (first_cause's order). `world_size`: the job's,
    where known."""
    cause = first_cause(lines, world_size=world_size)
    return cause.words if cause is not None else None


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
    """(one line naming the rank that failed first and how, the nodes to blame) from a job's log lines, in
    first_cause's order; a failure the job shares wherever it ran (shared_failure) is said as such, blaming no
    node."""
    cause = first_cause(lines, dims=dims, placement=placement)
    if cause is None:
        return None, []
    return cause.shared or cause.words, list(cause.nodes)
