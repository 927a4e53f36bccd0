"""`hpcscale run --local` under signals, a killed rank and a full disk, for real (mpirun, ranks, tmpfs):
a signal to the front end stops every rank at one step with exit 75 and a checkpoint; nothing of the run
outlives the command, even when the front end is SIGKILLed; the log is written as the run goes; a rank killed
with SIGKILL is the one the headline names; a full log disk costs one warning line, not a traceback."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import REPO, local_rank_pids, need, processes_of
from trainjobs import job_spec, losses

from hpcscale.launch.failure import describe_failure

pytestmark = pytest.mark.xdist_group("openmpi5")  # one worker builds the Open MPI 5 venv (openmpi5) for all


def _start(
    tmp_path: Path, *, tp: int = 1, pp: int = 2, ranks: int = 2, reuse: bool = False, mpi5: dict | None = None, **params
):
    """The front end, its output in tmp/out.txt (a file: a pipe nobody reads would stall the run). `mpi5`: run
    under PyPI's Open MPI 5 (the openmpi5 fixture) instead of Debian's Open MPI 4."""
    run_dir = tmp_path / "run"
    job = job_spec(tmp_path / "job.yaml", tp=tp, pp=pp, ranks=ranks, **{"steps": 100000, "log_every": 1, **params})
    out = tmp_path / "out.txt"
    front = [mpi5["python"], "-m", "hpcscale"] if mpi5 else ["hpcscale"]
    env = {**os.environ, "PATH": mpi5["PATH"]} if mpi5 else None
    with open(out, "w") as f:
        args = [*front, "run", str(job), "--local", "--run-dir", str(run_dir), *(["--reuse"] if reuse else [])]
        proc = subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, env=env)
    return proc, run_dir, out


# What Open MPI 4 or 5 says when ranks exit 75 (stopped on request), and what the front end says of the helpers
# mpirun left: not failures, never shown to the user of a clean stop (the run's log keeps them).
STOP_NOISE = ("non-zero", "PMIX", "left behind", "Primary job", "Exit code")


@pytest.fixture(params=["openmpi4", "openmpi5"])
def which_mpi(request, mpi):
    """None for Debian's Open MPI 4, the openmpi5 fixture's dict for PyPI's Open MPI 5 (README.md's)."""
    return request.getfixturevalue("openmpi5") if request.param == "openmpi5" else None


def _wait_for_steps(run_dir: Path, n: int, proc: subprocess.Popen, out: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (run_dir / "metrics.jsonl").exists() and len(losses(run_dir)) >= n:
            return
        assert proc.poll() is None, out.read_text()[-3000:]
        time.sleep(0.2)
    raise AssertionError(f"fewer than {n} steps after {timeout}s:\n{out.read_text()[-3000:]}")


def _no_processes_left(run_dir: Path, within: float) -> dict[int, str]:
    deadline = time.monotonic() + within
    while (left := processes_of(run_dir)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def _kill_run(proc: subprocess.Popen, run_dir: Path) -> None:
    """Teardown after a failed assertion: the front end and anything of the run."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    for pid in processes_of(run_dir):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize(
    ("sig", "mpi5"),
    [(signal.SIGTERM, False), (signal.SIGHUP, False), (signal.SIGINT, False), (signal.SIGTERM, True)],
    ids=["TERM", "HUP", "INT", "TERM-openmpi5"],
)
def test_signal_to_the_front_end_stops_every_rank_at_one_step(mpi, tmp_path, sig, mpi5, request):
    """Every rank stops after one step with a checkpoint; the front end exits 75 and says so, with none of
    mpirun's notices about non-zero exit codes (Open MPI 4 and 5 each have their own)."""
    env5 = request.getfixturevalue("openmpi5") if mpi5 else None
    proc, run_dir, out = _start(tmp_path, mpi5=env5)  # pp=2: each rank holds half the model: a checkpoint needs both
    try:
        _wait_for_steps(run_dir, 3, proc, out)
        proc.send_signal(sig)
        code = proc.wait(timeout=60)
        left = _no_processes_left(run_dir, within=5)
    finally:
        _kill_run(proc, run_dir)
    text = out.read_text()
    assert code == 75, text[-3000:]
    assert left == {}, f"left running: {left}"
    stopped_at = int(text.split("stop requested: stopping after step")[1].split()[0])
    assert len(losses(run_dir)) == stopped_at + 1  # rank 0 logged exactly the steps every rank completed
    assert (run_dir / "checkpoints" / f"step-{stopped_at + 1:08d}" / "index.h5").is_file()  # committed by both
    assert f"stopped on {sig.name}: every rank stopped at the same step" in text.splitlines()[-1]
    after = text.split("stop requested: stopping after step")[1]
    assert not [w for w in STOP_NOISE if w in after], after
    (log,) = (run_dir / "logs").glob("local-*.out")
    logged = log.read_text()
    assert "step      2  loss" in logged and f"stopping after step {stopped_at}" in logged
    assert f"hpcscale run: {sig.name}: asking every rank to stop" in logged


@pytest.mark.parametrize("delay", [0.0, 0.3, 1.0])
def test_a_signal_during_start_up_is_held_until_the_ranks_can_stop(mpi, tmp_path, delay):
    """SIGUSR2 reaching mpirun before its handler, or a rank before its own, would kill it; the front end
    holds the stop until rank 0 says every rank is up, then every rank stops cleanly after one step.
    The clock starts when mpirun exists: before that the front end's own interpreter is still starting, and
    a SIGTERM then ends it by the default action, with nothing started that could be left behind."""
    proc, run_dir, out = _start(tmp_path)
    try:
        deadline = time.monotonic() + 30
        while not any("mpirun" in c.split(" ", 1)[0] for c in processes_of(run_dir).values()):
            assert time.monotonic() < deadline and proc.poll() is None, out.read_text()[-3000:]
            time.sleep(0.01)
        time.sleep(delay)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=120)
        left = _no_processes_left(run_dir, within=5)
    finally:
        _kill_run(proc, run_dir)
    text = out.read_text()
    assert code == 75, text[-3000:]
    assert left == {}, f"left running: {left}"
    assert "killed by signal" not in text and "exited on signal" not in text, text[-3000:]
    assert "stopped on SIGTERM: every rank stopped at the same step" in text.splitlines()[-1], text[-3000:]


def test_a_second_signal_ends_ranks_that_do_not_stop(mpi, tmp_path):
    proc, run_dir, out = _start(tmp_path)
    try:
        _wait_for_steps(run_dir, 3, proc, out)
        os.kill(local_rank_pids(run_dir)[1], signal.SIGSTOP)  # a rank that cannot finish its step
        proc.send_signal(signal.SIGTERM)
        time.sleep(1)
        assert proc.poll() is None  # waiting for the ranks to stop
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=30)
        left = _no_processes_left(run_dir, within=5)
    finally:
        _kill_run(proc, run_dir)
    text = out.read_text()
    assert code == 75, text[-3000:]
    assert left == {}, f"left running: {left}"
    assert "hpcscale run: signalled again: terminating the ranks" in text
    assert "stopped on SIGTERM: the ranks were terminated before they stopped" in text.splitlines()[-1]


def test_killing_the_front_end_leaves_nothing_running(mpi, tmp_path):
    proc, run_dir, out = _start(tmp_path)
    try:
        _wait_for_steps(run_dir, 3, proc, out)
        assert len(local_rank_pids(run_dir)) == 2
        proc.kill()  # no handler runs: the kernel's parent-death signal must end mpirun, and mpirun its ranks
        proc.wait()
        left = _no_processes_left(run_dir, within=5)
    finally:
        _kill_run(proc, run_dir)
    assert left == {}, f"left running: {left}"
    (log,) = (run_dir / "logs").glob("local-*.out")
    assert "step      2  loss" in log.read_text()  # written as it went: nothing was waiting in a buffer


def test_a_clean_run_prints_none_of_mpiruns_notices(which_mpi, tmp_path):
    """A run that finishes prints no notice of mpirun's (Open MPI 4's or 5's) and no helper killed after it."""
    proc, run_dir, out = _start(tmp_path, steps=3, mpi5=which_mpi)
    try:
        code = proc.wait(timeout=120)
        left = _no_processes_left(run_dir, within=5)
    finally:
        _kill_run(proc, run_dir)
    text = out.read_text()
    assert code == 0 and left == {}, text[-3000:]
    assert len(losses(run_dir)) == 3
    assert not [w for w in (*STOP_NOISE, "killed what", "WARNING") if w in text], text[-3000:]


def test_killed_rank_is_named_not_a_survivor(which_mpi, tmp_path):
    """Under Open MPI 4 and 5 alike (their words differ): tp=2 x pp=2, the survivors fail too (connection
    closed or reset by the dead peer) and print first; the headline names the killed rank."""
    proc, run_dir, out = _start(tmp_path, tp=2, pp=2, ranks=4, mpi5=which_mpi)
    try:
        _wait_for_steps(run_dir, 3, proc, out)
        ranks = local_rank_pids(run_dir)
        assert sorted(ranks) == [0, 1, 2, 3]
        killed_at = time.monotonic()
        os.kill(ranks[2], signal.SIGKILL)
        code = proc.wait(timeout=30)  # timeout_seconds is 60: the job must not wait for the collective timeout
        elapsed = time.monotonic() - killed_at
        left = _no_processes_left(run_dir, within=5)
    finally:
        _kill_run(proc, run_dir)
    text = out.read_text()
    headline = text.splitlines()[-1]
    assert code == 1 and elapsed < 30, elapsed
    assert left == {}, f"left running: {left}"
    assert "rank 2 (MPI rank 2) on node " in headline and "was killed by signal 9" in headline, headline
    assert "hpcscale launch:" not in headline and "Connection" not in headline, headline
    (log,) = (run_dir / "logs").glob("local-*.out")
    assert re.search(r"exited on\s+signal 9", log.read_text())  # the full story stays in the log


def test_headline_prefers_a_rank_of_its_own_over_those_that_lost_it():
    at = "2026-01-02T03:04:05.{:06d}Z"
    lines = [
        f"hpcscale launch: rank 3 (MPI rank 3) on node a failed: RuntimeError: Connection closed by peer "
        f"[at {at.format(1)}, after losing a peer]\n",
        "Traceback (most recent call last):\n",
        f"hpcscale launch: rank 1 (MPI rank 1) on node b failed: ValueError: bad shard [at {at.format(5)}]\n",
        f"hpcscale launch: rank 0 (MPI rank 0) on node a failed: ValueError: later [at {at.format(9)}]\n",
    ]
    assert describe_failure(lines).startswith("hpcscale launch: rank 1 (MPI rank 1) on node b failed: ValueError")
    died = "mpirun noticed that process rank 2 with PID 0 on node a exited on signal 9 (Killed).\n"
    assert describe_failure([*lines, died]) == (
        "rank 2 (MPI rank 2) on node a was killed by signal 9 (Killed); 3 other rank(s) failed after it (see the log)"
    )
    aborted = "mpirun noticed that process rank 2 with PID 0 on node a exited on signal 6 (Aborted).\n"
    assert describe_failure([*lines, aborted]).startswith("hpcscale launch: rank 1 (MPI rank 1) on node b failed")
    assert describe_failure([lines[0], aborted]).startswith("rank 2 (MPI rank 2) on node a was killed by signal 6")
    # Open MPI 5's prterun breaks its line, and names a process that exited non-zero in its own way
    died5 = ["prterun noticed that process rank 2 with PID 0 on node a exited on\n", "signal 9 (Killed).\n"]
    assert describe_failure([lines[0], *died5]).startswith("rank 2 (MPI rank 2) on node a was killed by signal 9")
    exited5 = ["   Process name: [prterun-a-7274@1,3]\n", "   Exit code:    3\n"]
    assert describe_failure(exited5) == "rank 3 (MPI rank 3) exited with code 3"
    assert describe_failure(["  Process name: [[19984,1],3]\n", "  Exit code:    3\n"]) == describe_failure(exited5)


def test_mpiruns_notices_of_a_stop_are_logged_not_shown(tmp_path):
    """Once the ranks stop on request, Open MPI 4's and 5's notices that a rank exited 75 go to the log only;
    the same notices for another exit code, and any notice before the stop, are shown whole."""
    from hpcscale.launch.local import MPI_RULE, _Output

    shown: list[str] = []
    out = _Output(tmp_path / "log", echo=shown.append, warn=shown.append)
    primary = [MPI_RULE, "Primary job  terminated normally, but 1 process returned",
               "a non-zero exit code. Per user-direction, the job has been aborted.", MPI_RULE]  # fmt: skip

    def detected(code: int) -> list[str]:
        return [MPI_RULE, "prterun detected that one or more processes exited with non-zero status,",
                "thus causing the job to be terminated. The first process to do so was:", "",
                "   Process name: [prterun-vm-7274@1,1]", f"   Exit code:    {code}", MPI_RULE]  # fmt: skip

    before = ["step 1", *primary, "[vm:07274] PMIX ERROR: PMIX_ERR_UNREACH in file x.c at line 3146"]
    stop = ["stop requested: stopping after step 450 (checkpoint saved)"]
    after = ["[vm:07274] PMIX ERROR: PMIX_ERR_UNREACH in file x.c at line 3146", *primary, *detected(75)]
    failed = detected(1)
    for text in [*before, *stop, *after, *failed, MPI_RULE, "cut short"]:
        out.line(text)
    out.close()
    assert shown == [*before, *stop, *failed, MPI_RULE, "cut short"]
    assert (tmp_path / "log").read_text() == "".join(
        f"{t}\n" for t in [*before, *stop, *after, *failed, MPI_RULE, "cut short"]
    )


@pytest.fixture
def full_log_disk(tmp_path):
    """A run directory whose logs/ is a 64 KiB tmpfs with about 4 KiB left (needs root to mount)."""
    run_dir = tmp_path / "run"
    logs = run_dir / "logs"
    logs.mkdir(parents=True)
    (run_dir / "submissions.jsonl").touch()  # an (empty) run directory: --reuse accepts it
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k,mode=0755", "tmpfs", str(logs)], capture_output=True
    )
    need(mounted.returncode == 0, f"mounting a tmpfs (root): {mounted.stderr.decode().strip()}")
    try:
        (logs / "filler").write_bytes(b"\0" * (60 * 1024))
        yield run_dir
    finally:
        subprocess.run(["umount", "-l", str(logs)], check=False)


def test_a_full_log_disk_is_one_warning_not_a_traceback(mpi, tmp_path, full_log_disk):
    proc, run_dir, out = _start(tmp_path, reuse=True, steps=60)
    try:
        code = proc.wait(timeout=60)
    finally:
        _kill_run(proc, run_dir)
    text = out.read_text()
    assert code == 0, text[-3000:]  # the run goes on: its output still reaches the user
    assert len(losses(run_dir)) == 60
    warnings = [line for line in text.splitlines() if "cannot write the run log" in line]
    assert len(warnings) == 1 and "No space left on device (ENOSPC)" in warnings[0], warnings
    assert "Traceback" not in text
    assert "step     59  loss" in text
    (log,) = (run_dir / "logs").glob("local-*.out")
    assert "step      0  loss" in log.read_text()  # what fitted was written


def test_a_task_srun_saw_killed_is_how_the_attempt_ended():
    """srun's words for a task that died of its own signal name it; --kill-on-bad-exit's SIGTERM to the others
    ("Terminated") and plain exit codes do not."""
    from hpcscale.launch.failure import signalled_task

    lines = [
        "srun: error: n1: tasks 0-1: Exited with exit code 1",
        "srun: error: n2: tasks 2,4: Terminated",
        "srun: error: n2: task 3: Killed",
        "srun: error: n3: task 5: Segmentation fault",
    ]
    assert signalled_task(lines) == ("n2", "3", 9)
    assert signalled_task(lines[:2]) is None
    assert signalled_task([lines[3]]).signum == 11
