"""A rank that stops making progress without dying ends the job within the hang timeout, named as the stuck rank,
with every live rank's Python stacks in the log (launch/watchdog.py); for real under mpirun: a SIGSTOPped rank.
Also the watchdog's timeout rule, and the reading of its lines (hung_ranks, describe_failure), on their own."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import REPO, local_rank_pids, processes_of, run_cli
from trainjobs import attempt_losses, job_spec, losses

from hpcscale.launch.failure import (
    FailureLine,
    Hang,
    HungRanks,
    describe_failure,
    failure_line,
    hang_line,
    hung_ranks,
    stall_line,
    stalled_nodes,
)
from hpcscale.launch.watchdog import Watchdog

HANG_S = 8  # the job's hang_timeout_seconds
COLLECTIVE_S = 60  # its timeout_seconds: the job must end well before a collective would time out
# the job trains 15 steps: stopped inside its save after 10, resumed from 5 to the end; each
# step a run (hung, resumed) need not take costs 0.1-0.3 s on two cores
STEPS = 15


def _wait_for_steps(
    run_dir: Path, n: int, proc: subprocess.Popen, out: Path, timeout: float = 120, poll: float = 0.2
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (run_dir / "metrics.jsonl").exists() and len(losses(run_dir)) >= n:
            return
        assert proc.poll() is None, out.read_text()[-3000:]
        time.sleep(poll)
    raise AssertionError(f"fewer than {n} steps after {timeout}s:\n{out.read_text()[-3000:]}")


def test_a_rank_stopped_inside_a_node_local_save_is_named_the_live_ranks_dump_their_stacks_and_resume_continues(
    mpi, tmp_path
):
    """Four ranks under `run --local` with the node-local tier (synchronous saves every 5 steps; from step 10
    each save's write is held back 4 s, HPCSCALE_CKPT_SLOW_WRITE): rank 2 stopped with SIGSTOP inside the save
    of step 10. Its peers wait for it in the save's collectives; their watchdogs, paused for the save, hold it
    to the pause limit (the save of step 5 went quickly) and name rank 2 within the hang timeout and a margin,
    not at the collective timeout. The stop among training steps is the in-place tests' (tests/recovery/
    test_resume.py, the three failures)."""
    site = tmp_path / "site.yaml"
    local = yaml.safe_load((REPO / "site_configs" / "local.yaml").read_text())
    local["filesystems"]["node_local"] = str(tmp_path / "node-local")
    site.write_text(yaml.safe_dump(local))
    job = job_spec(tmp_path / "job.yaml", tp=2, pp=2, ranks=4, steps=STEPS, log_every=50)
    spec = yaml.safe_load(job.read_text())
    spec |= {"hang_timeout_seconds": HANG_S, "timeout_seconds": COLLECTIVE_S, "site": str(site)}
    spec["checkpoint"] = {"every_steps": 5, "async": False, "local": {"every_steps": 5}}
    job.write_text(yaml.safe_dump(spec))
    run_dir, out = tmp_path / "run", tmp_path / "out.txt"
    with open(out, "w") as f:  # a file, not a pipe: nobody reads a pipe while the test waits
        proc = subprocess.Popen(
            ["hpcscale", "run", str(job), "--local", "--run-dir", str(run_dir)],
            stdout=f,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env={**os.environ, "HPCSCALE_CKPT_SLOW_WRITE": "4@10:node-local"},
        )
    try:
        _wait_for_steps(run_dir, 6, proc, out)  # past the first checkpoint
        ranks = local_rank_pids(run_dir)
        assert sorted(ranks) == [0, 1, 2, 3], ranks
        # step 10's line is logged before its save, whose write then waits 4 s: inside it
        _wait_for_steps(run_dir, 10, proc, out, poll=0.02)
        assert len(losses(run_dir)) == 10
        stopped_at = time.monotonic()
        os.kill(ranks[2], signal.SIGSTOP)
        code = proc.wait(timeout=COLLECTIVE_S)
        elapsed = time.monotonic() - stopped_at
        deadline = time.monotonic() + 5
        while (left := processes_of(run_dir)) and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in processes_of(run_dir):  # by command line: a pid of the run, not one reused since
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
    text = out.read_text()
    print(f"SIGSTOP to exit: {elapsed:.1f} s (hang timeout {HANG_S} s)")
    assert code == 1, text[-3000:]
    # the hang timeout (or 10× the longest step, small here), the grace for the stacks, mpirun's teardown
    assert elapsed < HANG_S + 20, f"took {elapsed:.1f}s"
    assert left == {}, f"left running: {left}"
    headline = text.splitlines()[-1]
    named = r"\(exit 1\): rank 2 stopped making progress \(no step in [\d.]+ s; ranks 0, 1, 3 waited on it\)$"
    assert re.search(named, headline), text[-3000:]
    (log,) = (run_dir / "logs").glob("local-*.out")
    logged = log.read_text()
    stuck, world, seconds = hung_ranks(logged.splitlines(keepends=True))  # as `hpcscale resume` reads a log
    assert (stuck, world) == ([2], 4) and seconds >= HANG_S
    hangs = [f for line in logged.splitlines() if (f := FailureLine.parse(line)) and f.hang]
    assert sorted(f.rank for f in hangs) == [0, 1, 3], logged[-3000:]
    assert all(f.peer_lost and f.hang.world_size == 4 and f.hang.seconds >= HANG_S for f in hangs)
    for rank in (0, 1, 3):
        assert f"hpcscale launch: rank {rank} (MPI rank {rank}): Python stacks at the hang:" in logged
    # faulthandler's dump: the training thread waits in a collective (the trainer's own frames), the watchdog runs
    assert logged.count("Current thread 0x") >= 3 and "Thread 0x" in logged
    assert 'File "' in logged and "hpcscale/train/trainer.py" in logged and "in train" in logged
    assert "hpcscale/launch/tiersaves.py" in logged and "in save_local" in logged  # they waited inside the save
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["local_checkpoint"] for r in rows if "local_checkpoint" in r] == [5]  # step 10's never finished
    # `resume` explains the hang, takes the newest checkpoint (step 5) and finishes the run as if nothing
    # happened: steps 5 to 9, trained again, give bitwise the hung attempt's losses (the weights, AdamW's moments,
    # the schedule and the data position all came back), and it trains on to the last step
    resumed = run_cli("resume", str(run_dir), timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "last job: failed: rank 2 stopped making progress" in resumed.stdout, resumed.stdout[:2000]
    first, again = attempt_losses(run_dir, 1), attempt_losses(run_dir, 2)
    assert sorted(first) == list(range(10)) and sorted(again) == list(range(5, STEPS)), (first, again)
    assert all(again[step] == first[step] for step in range(5, 10)), (first, again)


# The timeout rule, on a real thread with tiny times: on_hang records instead of ending the process.


def _watchdog(min_seconds: float, factor: float = 10.0, *, start: bool = True) -> tuple[Watchdog, list[float]]:
    hangs: list[float] = []
    wd = Watchdog(
        rank=1,
        mpi_rank=3,
        node="n1",
        world_size=4,
        min_seconds=min_seconds,
        factor=factor,
        on_hang=lambda: hangs.append(time.monotonic()),
        grace_seconds=0,
    )
    return (wd.start() if start else wd), hangs


def _wait(hangs: list[float], within: float) -> None:
    deadline = time.monotonic() + within
    while not hangs and time.monotonic() < deadline:
        time.sleep(0.01)


def test_the_watchdog_is_armed_by_the_first_beat_and_fires_after_the_floor(capfd):
    wd, hangs = _watchdog(min_seconds=0.1)
    try:
        time.sleep(0.3)  # start-up: longer than the timeout, yet not a hang
        assert hangs == [] and wd.fired is None
        wd.beat(41)
        beat_at = time.monotonic()
        _wait(hangs, within=2)
    finally:
        wd.stop()
    assert hangs and hangs[0] - beat_at >= 0.1
    f = FailureLine.parse(wd.fired)
    assert (f.rank, f.peer_lost, f.hang.last_step, f.hang.world_size) == (1, True, 41, 4) and f.hang.seconds >= 0.1
    assert wd.fired.startswith("hpcscale launch: rank 1 (MPI rank 3) on node n1 failed: Hang: no step finished in ")
    err = capfd.readouterr().err
    assert err.startswith(wd.fired + "\nhpcscale launch: rank 1 (MPI rank 3): Python stacks at the hang:\n"), err
    assert "Current thread 0x" in err and 'File "' in err and "in _fire" in err  # every thread, its own too


def test_the_timeout_is_factor_times_the_longest_step_and_pauses_do_not_count():
    wd, hangs = _watchdog(min_seconds=0.05, factor=3, start=False)
    try:
        wd.beat(0)
        time.sleep(0.1)  # the thread is not running yet: the floor alone would fire here
        wd.beat(1)
        wd.start()
        first = wd.longest
        assert 0.1 <= first < 0.3 and wd.timeout == pytest.approx(3 * first)
        with wd.paused("checkpoint"):
            time.sleep(0.4)  # longer than the timeout: a save is not a hang...
            assert hangs == []
        wd.beat(2)
        assert wd.longest == first  # ...and it does not lengthen the step it came in
        wd.beat(3)
        assert wd.longest == first  # a short step leaves the longest as it was
        assert wd.timeout == pytest.approx(3 * first)
    finally:
        wd.stop()
    assert hangs == [] and wd.fired is None


def test_a_bounded_pause_fires_past_factor_times_the_longest_of_its_reason_and_others_never_do():
    """A pause that asks to be bounded (the node-local tier's saves) has no limit the first time (nothing to go by),
    then max(min_seconds, factor x the longest of its reason); a pause of another reason, or one that does not
    ask, is never bounded; the line is a hang's, its seconds counted from the last step, the pause included."""
    wd, hangs = _watchdog(min_seconds=0.2, factor=3)
    try:
        wd.beat(0)
        assert wd.pause_limit("node-local checkpoint") is None
        with wd.paused("node-local checkpoint", bounded=True):
            time.sleep(0.35)  # the first: longer than the floor, and no limit
        first = wd.longest_pause["node-local checkpoint"]
        assert 0.35 <= first < 0.6 and wd.pause_limit("node-local checkpoint") == pytest.approx(3 * first)
        with wd.paused("evaluation"):  # not bounded: far past any limit
            time.sleep(3 * first + 0.3)
        with wd.paused("checkpoint", bounded=True):  # bounded, but the first of its reason
            time.sleep(0.5)
        wd.beat(1)
        assert hangs == [] and wd.fired is None
        beat_at = time.monotonic()
        with wd.paused("node-local checkpoint", bounded=True):
            _wait(hangs, within=3 * first + 2)
        paused_for = hangs[0] - beat_at if hangs else None
    finally:
        wd.stop()
    assert paused_for is not None and paused_for >= 3 * first, paused_for
    f = FailureLine.parse(wd.fired)
    # the line gives tenths of a second, rounded: 1.1114 s reads 1.1
    assert f.hang.last_step == 1 and f.hang.seconds + 0.05 >= 3 * first and f.peer_lost


def test_progress_inside_a_pause_starts_its_clock_again_and_the_floor_holds():
    wd, hangs = _watchdog(min_seconds=0.3, factor=2)
    try:
        wd.beat(0)
        with wd.paused("node-local checkpoint", bounded=True):
            time.sleep(0.01)  # a tiny first pause: the limit is the floor, 0.3 s
        assert wd.pause_limit("node-local checkpoint") == 0.3
        with wd.paused("node-local checkpoint", bounded=True):
            for _ in range(4):  # 0.8 s in all, never 0.3 s without progress (the save before ended, say)
                time.sleep(0.2)
                wd.progress()
        assert hangs == []
        assert wd.longest_pause["node-local checkpoint"] < 0.3  # what follows the last progress, not the wait
        wd.progress()  # outside a pause: nothing
    finally:
        wd.stop()
    assert hangs == [] and wd.fired is None


def test_time_a_stopped_process_spent_inside_a_bounded_pause_does_not_count():
    """SIGSTOPped for 1 s inside a bounded pause whose limit is 0.8 s, then the pause ends: not a hang."""
    then = """with wd.paused("node-local checkpoint", bounded=True):
    time.sleep(0.01)
with wd.paused("node-local checkpoint", bounded=True):
    time.sleep(1.4)  # SIGSTOPped for 1 s of it
wd.beat(8)"""
    out, err = _stopped_for(_watchdog_child(rank=2, min_seconds=0.8, then=then), after=0.1, seconds=1.0, timeout=10)
    assert out == "not fired\n", err
    assert " was not running for " in err


def test_a_stopped_watchdog_never_fires():
    wd, hangs = _watchdog(min_seconds=0.05)
    wd.beat(0)
    wd.stop()
    time.sleep(0.15)
    assert hangs == [] and wd.fired is None


def _watchdog_child(*, rank: int, min_seconds: float, then: str) -> str:
    """A script: a real watchdog (stall threshold 0.3 s) beats once, says "ready", runs `then`, and says whether
    it fired."""
    return f"""
import sys, time
from hpcscale.launch import watchdog
watchdog.STALL_S = 0.3
hangs = []
wd = watchdog.Watchdog(rank={rank}, mpi_rank={rank}, node="n", world_size=4, min_seconds={min_seconds},
                       on_hang=lambda: hangs.append(1), grace_seconds=0).start()
wd.beat(7)
print("ready", flush=True)
{then}
wd.stop()
print("fired" if hangs else "not fired", flush=True)
"""


def _stopped_for(script: str, *, after: float, seconds: float, timeout: float) -> tuple[str, str]:
    """Run `script`; once it is ready, wait `after`, SIGSTOP it for `seconds`, continue it: (stdout, stderr)."""
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "ready\n"
        time.sleep(after)
        child.send_signal(signal.SIGSTOP)
        time.sleep(seconds)
        child.send_signal(signal.SIGCONT)
        return child.communicate(timeout=timeout)
    finally:
        child.kill()


def test_time_the_process_was_stopped_does_not_count():
    """A rank stopped for longer than its timeout and continued (a suspended job, resumed) is not hung; it says
    it was not running, and that line is what names a SIGSTOPped rank that mpirun continues to kill it."""
    peers = [_hang(r, seconds=0.3) for r in (0, 1, 3)]  # written before its line, as when they fire
    then = "time.sleep(1.3)  # SIGSTOPped for 1 s of it\nwd.beat(8)"
    out, err = _stopped_for(_watchdog_child(rank=2, min_seconds=0.8, then=then), after=0, seconds=1.0, timeout=10)
    assert out == "not fired\n", err
    (line,) = err.splitlines()
    assert line.startswith("hpcscale launch: rank 2 (MPI rank 2) on node n was not running for "), line
    assert float(line.split(" was not running for ")[1].split()[0]) >= 0.3  # as long as the others waited
    assert hung_ranks([*peers, line + "\n"]) == ([2], 4, 0.3)
    assert hung_ranks([*peers, _hang(2), line + "\n"]) == ([2], 4, 0.3)  # whatever it wrote once continued


# Reading the lines: the ranks that wrote no hang line are the stuck ones.


def _hang(rank: int, *, world: int = 4, seconds: float = 8.4) -> str:
    return hang_line(rank=rank, mpi_rank=rank, node="a", seconds=seconds, last_step=41, world_size=world) + "\n"


def test_the_ranks_that_wrote_no_hang_line_are_the_stuck_ones():
    lines = [_hang(0, seconds=8.4), "Thread 0x00007f (most recent call first):\n", _hang(3, seconds=8.2), _hang(1)]
    assert hung_ranks(lines) == HungRanks([2], 4, 8.2)
    assert hung_ranks(lines) == ([2], 4, 8.2)  # a plain (stuck, world size, seconds) tuple too
    assert describe_failure(lines) == "rank 2 stopped making progress (no step in 8.2 s; ranks 0, 1, 3 waited on it)"
    slow = [_hang(0, world=8, seconds=130.4), _hang(3, world=8, seconds=128.6)]
    assert describe_failure(slow) == (
        "ranks 1, 2, 4, 5, 6, 7 stopped making progress (no step in 129 s; ranks 0, 3 waited on them)"
    )


def test_a_stopped_rank_continued_only_to_be_killed_is_still_the_stuck_one():
    """mpirun and srun send SIGCONT before they kill: the stopped rank then fails "after losing a peer" like a
    survivor, and says it was not running; neither makes it one of those that waited."""
    lines = [_hang(0), _hang(1), _hang(3)]
    lost = failure_line(RuntimeError("Connection reset by peer"), rank="2", mpi_rank=2, node="a") + "\n"
    stalled = stall_line(rank=2, mpi_rank=2, node="a", seconds=13.2) + "\n"
    assert hung_ranks([*lines, lost]) == ([2], 4, 8.4)
    assert hung_ranks([*lines, stalled, lost]) == ([2], 4, 8.4)
    assert describe_failure([*lines, stalled, lost]).startswith("rank 2 stopped making progress")
    # a rank that was not running long before the hang (a suspended job, resumed) is no suspect for it
    earlier = stall_line(rank=1, mpi_rank=1, node="a", seconds=60) + "\n"
    time.sleep(0.001)
    assert hung_ranks([earlier, _hang(0), _hang(1), _hang(3)]) == ([2], 4, 8.4)


def test_a_live_rank_starved_for_a_while_still_waited():
    """On a loaded machine a live rank's watchdog can wake seconds late: it says it was not running, its clock
    skips that time, and it fires as the others do. It waited like them: only a rank not running for as long as
    the others waited was stopped (the CI case: ranks 0, 3 waited, rank 1 was starved, rank 2 was stopped)."""
    then = "time.sleep(4.0)  # no further step: it waits on a stopped peer, and is itself starved for a while"
    out, err = _stopped_for(_watchdog_child(rank=1, min_seconds=1.6, then=then), after=0.3, seconds=0.9, timeout=20)
    assert out == "fired\n", err
    starved, own = err.splitlines()[:2]  # then its stacks
    assert " was not running for " in starved and FailureLine.parse(own).hang.seconds >= 1.6, err
    peers = [_hang(0, seconds=1.6), _hang(3, seconds=1.7)]
    assert hung_ranks([*peers, starved + "\n", own + "\n"]) == ([2], 4, 1.6)
    stopped = stall_line(rank=2, mpi_rank=2, node="a", seconds=5.2) + "\n"  # then continued
    assert hung_ranks([*peers, starved + "\n", own + "\n", stopped]) == ([2], 4, 1.6)
    # a stopped rank that, continued, even fires before it is killed is still the one the others waited on
    late = hang_line(rank=2, mpi_rank=2, node="a", seconds=2.0, last_step=7, world_size=4) + "\n"
    assert hung_ranks([*peers, starved + "\n", own + "\n", stopped, late]) == ([2], 4, 1.6)


def test_lines_glued_to_another_ranks_unfinished_line_are_read():
    """mpirun forwards each rank's output in reads of up to 4096 bytes; on a loaded machine a read can end mid-
    line and the next rank's line is glued to it. Our lines are read from their start on the line."""
    partial = '  File "/x/hpcscale/train/trainer.py", line 3'
    glued = [_hang(0), partial + _hang(1), "hpcscale launch: rank 0 (MPI rank 0): Python sta" + _hang(3)]
    assert hung_ranks(glued) == ([2], 4, 8.4)
    assert FailureLine.parse(partial + _hang(1)).rank == 1
    stopped = partial + stall_line(rank=2, mpi_rank=2, node="b", seconds=13.2) + "\n"
    time.sleep(0.001)  # its hang line after it was continued: it was stopped first
    assert hung_ranks([*glued, _hang(2), stopped]) == ([2], 4, 8.4)
    assert stalled_nodes([stopped]) == {2: "b"}
    assert FailureLine.parse(partial + "\n") is None and hung_ranks(["hpcscale launch: rank 1 said\n"]) is None
    # one of ours cut short by another of ours: both are read, the cut one as far as it goes
    cut = _hang(1)[:-45]  # its time and peer mark lost
    assert [f.rank for f in FailureLine.parse_all(cut + _hang(3))] == [1, 3]
    assert hung_ranks([_hang(0), cut + _hang(3)]) == ([2], 4, 8.4)
    # cut short with stack text after it: a failure line without its time proves nothing in a log that has times
    lost_end = failure_line(RuntimeError("Connection reset by peer"), rank="1", mpi_rank=1, node="a")[:60]
    assert hung_ranks([_hang(0), _hang(3), lost_end + partial + "\n"]) == ([1, 2], 4, 8.4)


def test_every_rank_waiting_in_python_is_a_deadlock_among_them():
    lines = [_hang(r) for r in range(4)]
    assert hung_ranks(lines) == ([], 4, 8.4)
    assert describe_failure(lines).startswith("every rank stopped making progress (no step in 8.4 s;")


def test_a_rank_failing_of_its_own_accord_first_is_the_story_not_the_hang():
    own = failure_line(ValueError("bad shard"), rank="2", mpi_rank=2, node="b") + "\n"
    time.sleep(0.001)  # the time stamps order the lines
    lines = [own, _hang(0), _hang(1)]
    assert hung_ranks(lines) is None
    assert describe_failure(lines).startswith("hpcscale launch: rank 2 (MPI rank 2) on node b failed: ValueError")
    assert hung_ranks(["just output\n", own]) is None


def test_a_hang_line_reads_like_every_other_failure_line():
    hang = FailureLine.parse(_hang(2))
    other = FailureLine.parse(failure_line(RuntimeError("Connection reset by peer"), rank="2", mpi_rank=2, node="a"))
    assert (hang.rank, hang.peer_lost, other.rank, other.peer_lost) == (2, True, 2, True)
    assert len(hang.time) == len(other.time) and hang.time[:4] == other.time[:4] and hang.time.endswith("Z")
    assert other.hang is None and hang.hang == Hang(seconds=8.4, last_step=41, world_size=4)
