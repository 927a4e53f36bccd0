"""The rank lines' one spec, and the one order of failure causes (hpcscale.launch.failure).

Each kind of line (a failure, a hang, a stall, the header of a hung rank's stacks) is one template from which
both its writer and its reader are made: any values read back as written, also from a line glued to another
rank's unfinished one (mpirun's 4096-byte reads), followed by slurmstepd's words, or cut short (then it says
less, never something else). Every reader (describe_failure, rank_failure, `resume`, `run --local`'s summary)
takes first_cause's order; a survivor's "Connection reset by peer" is never the headline when the killed rank
is known, for real under PyPI's Open MPI 5 with the launcher starved while a rank is killed with -9.
"""

from __future__ import annotations

import os
import re
import signal
import string
import time
from datetime import datetime
from pathlib import Path

import pytest
from conftest import local_rank_pids, processes_of
from hypothesis import given
from hypothesis import strategies as st
from test_run_local_signals import _kill_run, _no_processes_left, _start, _wait_for_steps

from hpcscale.launch import failure
from hpcscale.launch.failure import (
    FAILURE,
    HANG,
    STACKS,
    STALL,
    FailureLine,
    describe_failure,
    failure_line,
    first_cause,
    hang_line,
    rank_failure,
    stall_line,
)
from hpcscale.launch.local import _Output
from hpcscale.launch.watchdog import Watchdog

pytestmark = pytest.mark.xdist_group("openmpi5")  # one worker builds the Open MPI 5 venv (openmpi5) for all

# ---- the spec: parse(format(x)) == x --------------------------------------------------------------------------
# A message's first line as failure_line writes it: stripped, no line break of any kind (str.splitlines'), and
# not our own prefix (where a line of ours starts, a piece starts)
_TEXT = st.text(st.characters(blacklist_categories=("Cc", "Cs", "Zl", "Zp")), max_size=80)
_WHAT = _TEXT.map(str.strip).filter(lambda s: "hpcscale launch: rank " not in s)
_NODE = st.text(string.ascii_letters + string.digits + ".-_", min_size=1, max_size=20)
_TIME = st.datetimes(datetime(2000, 1, 1), datetime(2999, 12, 31)).map(lambda d: d.strftime("%Y-%m-%dT%H:%M:%S.%fZ"))
_SECONDS = st.integers(0, 10**8).map(lambda n: n / 10)  # written with one decimal
_WHO = {"rank": st.none() | st.integers(0, 1 << 20), "mpi_rank": st.integers(-1, 1 << 20), "node": _NODE}
_FAILURES = st.fixed_dictionaries({**_WHO, "what": _WHAT, "time": _TIME, "peer": st.booleans(), "bad": st.booleans()})
_HANGS = st.fixed_dictionaries(
    {"seconds": _SECONDS, "last_step": st.integers(-1, 10**9), "world": st.integers(1, 4096)}
)
_STALLS = st.fixed_dictionaries({**_WHO, "rank": st.integers(0, 1 << 20), "seconds": _SECONDS, "time": _TIME})
_STACKS = st.fixed_dictionaries({**{k: _WHO[k] for k in ("rank", "mpi_rank")}, "continued": st.booleans()})
# what slurmstepd may append to a rank's line before its newline
_STEPD = st.sampled_from(["", "slurmstepd: error: *** STEP 12.0 ON n1 CANCELLED AT 2026-01-02T03:04:05 ***", " x]"])


@given(x=_FAILURES, hang=_HANGS, stall=_STALLS, stacks=_STACKS, as_hang=st.booleans())
def test_every_kind_of_line_reads_back_as_written(x, hang, stall, stacks, as_hang):
    if as_hang:
        x = {**x, "what": HANG.format(**hang)}
    assert HANG.parse(HANG.format(**hang)) == hang
    assert STALL.parse(STALL.format(**stall)) == stall
    assert STACKS.parse(STACKS.format(**stacks)) == stacks
    line = FAILURE.format(**x)
    assert FAILURE.parse(line) == x
    f = FailureLine.parse(line)
    assert f.values() == x and f.line == line and f.complete
    assert (f.hang is not None) == (as_hang and hang["world"] <= failure.MAX_RANKS)


@given(x=_FAILURES, y=_FAILURES, cut=st.floats(0, 1, exclude_max=True), other=_TEXT, glue=st.booleans(), stepd=_STEPD)
def test_a_line_glued_to_another_ranks_unfinished_one_reads_back_whole(x, y, cut, other, glue, stepd):
    """mpirun's read of another rank's output ended mid-line (a line of ours cut short, or any other text) and
    this line followed it on the same physical line; slurmstepd may have appended its words before the newline."""
    before = FAILURE.format(**y) if glue else other.replace("hpcscale launch: rank ", "")
    before = before[: int(len(before) * cut)]
    found = FailureLine.parse_all(before + FAILURE.format(**x) + stepd)
    assert found[-1].values() == x and found[-1].line == FAILURE.format(**x)
    assert [f for f in found[:-1] if f.complete] == []  # the unfinished one proves nothing


@given(x=_FAILURES, hang=_HANGS, as_hang=st.booleans(), cut=st.floats(0, 1), after=_TEXT)
def test_a_line_cut_short_says_less_never_something_else(x, hang, as_hang, cut, after):
    """Cut short (the rest of it went on the next physical line, after another rank's output): the rank and
    node it names are its own, but no time and no mark, so it proves nothing about who failed first."""
    if as_hang:
        x = {**x, "what": HANG.format(**hang)}
    line = FAILURE.format(**x)
    n = int(len(line) * cut)
    if n == len(line):
        return
    f = FailureLine.parse(line[:n] + after.replace("hpcscale launch: rank ", "").replace("]", ""))
    if f is None:
        return
    assert (f.rank, f.mpi_rank, f.node) == (x["rank"], x["mpi_rank"], x["node"])
    assert not f.complete and f.time is None and not f.peer_lost and not f.bad_input
    assert f.hang is None or f.hang == failure.Hang(hang["seconds"], hang["last_step"], hang["world"])


def test_the_writers_write_the_spec(capfd):
    f = FailureLine.parse(
        failure_line(ConnectionResetError("Connection reset by peer"), rank="3", mpi_rank=3, node="n1")
    )
    assert (f.rank, f.node, f.what, f.peer_lost, f.complete) == (
        3,
        "n1",
        "ConnectionResetError: Connection reset by peer",
        True,
        True,
    )
    f = FailureLine.parse(failure_line(ValueError("x"), rank="?", mpi_rank=0, node="n1"))
    assert f.rank is None and f.mpi_rank == 0 and not f.peer_lost
    h = FailureLine.parse(hang_line(rank=1, mpi_rank=1, node="n", seconds=8.04, last_step=5, world_size=4))
    assert h.hang == failure.Hang(8.0, 5, 4) and h.peer_lost
    assert STALL.parse(stall_line(rank=1, mpi_rank=1, node="n", seconds=3.0))["seconds"] == 3.0
    # the watchdog's stacks header (it spelled its prefix by hand)
    wd = Watchdog(rank=2, mpi_rank=5, node="n", world_size=4, min_seconds=0.05, on_hang=lambda: None, grace_seconds=0)
    wd.start().beat(0)
    deadline = time.monotonic() + 10
    while wd.fired is None and time.monotonic() < deadline:
        time.sleep(0.05)
    wd.stop()
    time.sleep(0.3)
    err = capfd.readouterr().err.splitlines()
    assert FailureLine.parse(err[0]).hang.world_size == 4
    assert STACKS.parse(err[1]) == {"rank": 2, "mpi_rank": 5, "continued": False}, err[:2]


# ---- the one order ----------------------------------------------------------------------------------------------
AT = "2026-01-02T03:04:05.{:06d}Z"


def _fail(rank: int, what: str, n: int, *, peer: bool = False, node: str = "vm", bad: bool = False) -> str:
    return FAILURE.format(rank=rank, mpi_rank=rank, node=node, what=what, time=AT.format(n), peer=peer, bad=bad)


RESET = "RuntimeError: [gloo/transport/tcp/pair.cc:534] Connection reset by peer [127.0.0.1]:4242"
DIED5 = ["prterun noticed that process rank 2 with PID 77 on node vm exited on", "signal 9 (Killed)."]
ABORT5 = ['prterun has exited due to process rank 0 with PID 0 on node vm calling "abort".']


def test_a_survivors_line_cut_short_is_never_the_cause():
    """The user's case: a loaded machine. A survivor's line lost its end (and its peer mark) to mpirun's
    interleaving, and mpirun heard of a survivor's MPI_Abort before the killed rank's death, so no signal is
    reported: the rank that wrote no line is named, not the survivor, and no line twice."""
    cut = _fail(0, RESET, 1, peer=True)[:-30] + '  File "train.py", line 3'  # the rest came a line later
    lines = [
        cut,
        _fail(1, RESET, 2, peer=True),
        _fail(3, RESET, 3, peer=True),
        *ABORT5,
    ]
    words = describe_failure(lines, world_size=4)
    assert words.startswith("rank 2 wrote no failure line: it ended first, without a word"), words
    assert "Connection" not in words and "ranks 0, 1, 3 failed after losing a peer" in words
    cause = first_cause(lines, world_size=4, placement=["a", "a", "b", "b"])
    assert (cause.kind, cause.ranks, cause.nodes) == ("silent", (2,), ())
    # with mpirun's own word on the death, that is the cause
    assert describe_failure([*lines, *DIED5]) == (
        "rank 2 (MPI rank 2) on node vm was killed by signal 9 (Killed); 3 other rank(s) failed after it (see the log)"
    )


def test_mpiruns_notice_split_by_a_glued_line_still_names_the_killed_rank(tmp_path):
    """`run --local`'s summary reads the ranks' lines and the tail in the order they came: prterun's notice,
    its first half glued to a survivor's unfinished line, still names the killed rank."""
    out = _Output(tmp_path / "log", echo=None, warn=None)
    out.line(_fail(0, RESET, 1, peer=True)[:-20] + DIED5[0])
    out.line(DIED5[1])
    out.line(_fail(1, RESET, 2, peer=True))
    out.close()
    words = first_cause(out.summary_lines(), world_size=4).words
    assert words.startswith("rank 2 (MPI rank 2) on node vm was killed by signal 9"), words


def test_one_order_for_every_reader():
    what = HANG.format(seconds=8.0, last_step=5, world=4)
    hang = [
        FAILURE.format(rank=r, mpi_rank=r, node="vm", what=what, time=AT.format(500), peer=True, bad=False)
        for r in (0, 1, 3)
    ]
    own_first = _fail(2, "ValueError: bad shard", 0, node="n2")
    own_late = _fail(2, "ValueError: bad shard", 999999, node="n2")
    nccl = (
        "[rank1]:[E ProcessGroupNCCL.cpp:616] [Rank 1] Watchdog caught collective operation timeout: "
        "WorkNCCL(SeqNum=7, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600100 milliseconds"
    )
    killed = "srun: error: n3: task 3: Killed"
    # 1. a hang, unless a rank failed of its own accord first
    assert first_cause([*hang, own_late], world_size=4).kind == "hang"
    assert first_cause([own_first, *hang], world_size=4).kind == "failure"
    # a node Slurm declared failed: srun then reports the other nodes' tasks Killed; the failed node is blamed
    lost = [
        "srun: error: Node failure on n2",
        "srun: error: n1: tasks 0-1: Killed",
        "srun: error: n2: tasks 2-3: Killed",
    ]
    assert first_cause(lost).kind == "node" and first_cause(lost).nodes == ("n2",)
    assert first_cause(lost[1:]).nodes == ("n1",)  # without the node's line, the first task srun saw killed
    # the stuck rank wrote nothing (stopped, then killed): its node is where the job placed it, when known
    assert first_cause(hang, world_size=4).nodes == ()
    assert first_cause(hang, placement=["n1", "n1", "n3", "n3"]).nodes == ("n3",)
    # ... and a hang where every rank waited in Python (a deadlock) blames no node, whatever srun killed after it
    deadlock = [
        *hang,
        FAILURE.format(rank=2, mpi_rank=2, node="vm", what=what, time=AT.format(501), peer=True, bad=False),
    ]
    assert rank_failure([*deadlock, killed], placement=["vm"] * 4)[1] == []
    # 2. mpirun's death by a signal beats a rank's own line (it reports only a death before any abort)
    assert first_cause([own_first, *DIED5]).kind == "signal"
    # 3. a rank's own failure beats NCCL's timeouts and srun's kills; its node is blamed
    for other in ([nccl], [killed], [*DIED5[:1], "signal 6 (Aborted)."]):
        cause = first_cause([*other, own_first])
        assert (cause.kind, cause.nodes) == ("failure", ("n2",)), other
        assert rank_failure([*other, own_first]) == (own_first, ["n2"])
    # 4. NCCL beats srun's kills and mpirun's SIGABRT
    assert first_cause([killed, nccl]).kind == "nccl"
    assert first_cause([*DIED5[:1], "signal 6 (Aborted).", nccl]).kind == "nccl"
    # 7. srun's kill beats the survivors' lines; the same rank's two lines count once
    survivor = _fail(0, RESET, 5, peer=True)
    assert rank_failure([survivor, survivor, killed]) == ("MPI task 3 on node n3 was killed (srun)", ["n3"])
    assert describe_failure([survivor, survivor]) == survivor
    # shared: the same failure on two nodes blames none
    shared = [_fail(0, "ValueError: x", 1, node="a"), _fail(1, "ValueError: x", 2, node="b")]
    assert first_cause(shared).nodes == () and rank_failure(shared)[1] == []


# ---- the user's case, for real ------------------------------------------------------------------------------
def test_a_killed_rank_is_named_when_the_launcher_hears_of_the_survivors_first(openmpi5, tmp_path):
    """`run --local` under PyPI's Open MPI 5, tp=2 x pp=2: prterun starved (SIGSTOP, as on a loaded machine)
    while rank 2 is killed with -9 and the survivors write their lines and call MPI_Abort; continued, prterun
    may hear of an abort before the death. The headline names rank 2, never a survivor's connection error, and
    no rank's line is printed twice."""
    proc, run_dir, out = _start(tmp_path, tp=2, pp=2, ranks=4, mpi5=openmpi5)
    try:
        _wait_for_steps(run_dir, 3, proc, out)
        ranks = local_rank_pids(run_dir)
        assert sorted(ranks) == [0, 1, 2, 3]
        launcher = [p for p in processes_of(run_dir) if p not in ranks.values() and p != proc.pid]
        assert launcher
        for pid in launcher:
            os.kill(pid, signal.SIGSTOP)
        try:
            os.kill(ranks[2], signal.SIGKILL)
            log = next((run_dir / "logs").glob("local-*.out"))
            deadline = time.monotonic() + 20
            while log.read_text().count(" failed: ") < 3 and time.monotonic() < deadline:
                time.sleep(0.2)
            time.sleep(4)  # the survivors' grace before MPI_Abort (launch.ending.PEER_LOST_GRACE_S)
        finally:
            for pid in launcher:
                os.kill(pid, signal.SIGCONT)
        code = proc.wait(timeout=60)
        left = _no_processes_left(run_dir, within=5)
    finally:
        _kill_run(proc, run_dir)
    text = out.read_text()
    headline = text.splitlines()[-1]
    assert code == 1 and left == {}, text[-3000:]
    # mpirun may kill a survivor before its line came (then both are named as writing none)
    assert re.search(r"(rank 2|ranks [\d, ]*\b2\b)[^;]* (was killed by signal 9|wrote no failure line)", headline), (
        headline
    )
    assert "hpcscale launch:" not in headline and "Connection" not in headline, headline
    shown = [ln for ln in text.splitlines() if " failed: " in ln and ln.startswith("hpcscale launch: rank ")]
    assert len(shown) == len(set(shown)), shown


def test_local_summary_keeps_the_ranks_lines_past_a_long_traceback(tmp_path: Path):
    out = _Output(tmp_path / "log", echo=None, warn=None)
    out.line(stall_line(rank=2, mpi_rank=2, node="vm", seconds=30.0))
    for n in range(2000):
        out.line(f'  File "x.py", line {n}')
    out.close()
    assert any(STALL.parse(ln) for ln in out.summary_lines())
