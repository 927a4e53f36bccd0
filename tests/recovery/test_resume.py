"""Requeue and `hpcscale resume`, proven by fault injection on the real local Slurm cluster (and mpirun for
local runs): each compares the losses with an uninterrupted reference run of the same job.

Faults: the preemption signal (scancel --signal) and a time limit too short for the run (requeue from inside
the job, SLURM_RESTART_COUNT in the run's history, the time-limit budget); kill -9 of one rank (resume names
it and keeps the job off its node); a node taken down (resume excludes it, on fewer nodes: resharded); a
damaged newest checkpoint (resume takes the previous one and trains past the damaged step); a job that
crashes at every start (stops at its cap); resume while the job is running, and two resumes at once.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import yaml
from conftest import REPO, cluster_root, run_cli, wait_for_job
from trainjobs import attempt_losses, job_spec, losses

from hpcscale.config.job import JobSpec, Restart, Signals
from hpcscale.recovery.requeue import classify, decide

STEPS = 200  # long enough that a fault after step 80 lands mid-run (about 35 ms a step here)


# ---- the policy, without a cluster ------------------------------------------------------------------------
def _spec(**restart) -> JobSpec:
    return JobSpec(name="t", site="local", signals=Signals(), restart=Restart(**restart))


def test_classify_tells_time_limit_from_preemption_and_failure():
    assert classify(0, False, None, 120) == "completed"
    assert classify(75, True, 150, 120) == "time_limit"  # the signal came at about grace_seconds before the end
    assert classify(143, True, 3000, 120) == "preempted"  # a stop long before the end: preemption, scancel
    assert classify(75, False, None, 120) == "preempted"
    assert classify(1, False, 100, 120) == "failed"
    assert classify(137, False, None, 120) == "failed"  # SIGKILL: the OOM killer, a node lost
    # a rank killed by the stop signal itself: it came before the rank armed its handler (Slurm sends
    # --signal up to 60 s early, so a short job can get it at start): a stop, not a failure
    assert classify(128 + signal.SIGUSR2, False, 100, 120) == "time_limit"
    assert classify(128 + signal.SIGUSR1, False, 3000, 120) == "preempted"
    # SIGTERM is also how srun ends the other ranks after one failed (--kill-on-bad-exit): a failure
    assert classify(128 + signal.SIGTERM, False, 3000, 120) == "failed"


def _end(cause: str, job: str = "7", requeue: bool = True, progress: bool = True, checkpoint: int = 10) -> dict:
    return {"event": "end", "job_id": job, "cause": cause, "requeue": requeue, "progress": progress,
            "checkpoint": checkpoint}  # fmt: skip


def test_separate_budgets_and_backoff():
    spec = _spec(max_preemptions=3, max_time_limits=1, max_failures=2, failure_backoff_seconds=5)
    begin = [{"event": "begin", "attempt": 1}]
    d = decide(spec, begin, job_id="7", cause="preempted", checkpoint=10)
    assert d.requeue and d.backoff_s == 0
    events = [*begin, _end("preempted"), _end("preempted", checkpoint=20)]
    assert decide(spec, events, job_id="7", cause="preempted", checkpoint=30).requeue
    events.append(_end("preempted", checkpoint=30))
    spent = decide(spec, events, job_id="7", cause="preempted", checkpoint=40)
    assert not spent.requeue and "budget spent" in spent.why
    # the other budgets are untouched by preemptions
    assert decide(spec, events, job_id="7", cause="time_limit", checkpoint=40).requeue
    first = decide(spec, events, job_id="7", cause="failed", checkpoint=40)
    assert first.requeue and first.backoff_s == 5
    events.append(_end("failed", checkpoint=40))
    assert decide(spec, events, job_id="7", cause="failed", checkpoint=50).backoff_s == 10  # doubled
    # a resubmission (another job id) starts with fresh budgets
    assert decide(spec, events, job_id="8", cause="preempted", checkpoint=50).requeue


def test_no_progress_stops_the_loop_but_preemptions_do_not_count():
    spec = _spec(max_failures=10, max_no_progress=2)
    events = [{"event": "begin", "attempt": 1}, _end("failed", progress=False, checkpoint=None)]
    d = decide(spec, events, job_id="7", cause="failed", checkpoint=None)
    assert not d.requeue and "no new checkpoint in 2 consecutive attempts" in d.why
    events = [_end("failed", checkpoint=10), _end("preempted", progress=False, checkpoint=10)]
    assert decide(spec, events, job_id="7", cause="failed", checkpoint=10).requeue  # the first without progress
    assert decide(_spec(), [], job_id="7", cause="preempted", checkpoint=None).requeue  # before any checkpoint


def test_requeue_off_means_no_requeue():
    spec = JobSpec(name="t", site="local", signals=Signals(requeue=False))
    assert not decide(spec, [], job_id="7", cause="preempted", checkpoint=5).requeue


# ---- helpers for the real runs -------------------------------------------------------------------------------
def _slurm_job(path: Path, *, nodes: int = 2, ranks: int = 2, steps: int = STEPS, **extra) -> Path:
    """The built-in trainer's job on the local cluster: one rank a node unless asked (every rank a test starts
    costs the suite seconds of CPU at its start: what a test proves about nodes needs one rank on each)."""
    job_spec(path, tp=1, pp=1, ranks=ranks, site="localcluster", nodes=nodes, steps=steps,
             checkpoint={"every_steps": 25})  # fmt: skip
    spec = yaml.safe_load(path.read_text())
    for key, value in extra.items():
        spec[key] = value
    path.write_text(yaml.safe_dump(spec))
    return path


@pytest.fixture(scope="module")
def reference(mpi, tmp_path_factory) -> dict[int, float]:
    """The uninterrupted run (2 ranks, dp=2, like the Slurm jobs below): the losses every resumed run must match."""
    tmp = tmp_path_factory.mktemp("ref")
    job = job_spec(tmp / "job.yaml", tp=1, pp=1, ranks=2, steps=STEPS, checkpoint={"every_steps": 25})
    r = run_cli("run", str(job), "--local", "--run-dir", str(tmp / "run"), timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    ref = losses(tmp / "run")
    assert len(ref) == STEPS
    return ref


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _assert_matches(run: Path, reference: dict[int, float], *, rel: float = 0.0) -> None:
    """Every training line of every attempt equals the reference's loss at its step; every step is there."""
    rows = [r for r in _rows(run) if "loss" in r]
    assert {r["step"] for r in rows} == set(reference), "steps missing or extra"
    for r in rows:
        want = reference[r["step"]]
        assert abs(r["loss"] - want) <= rel * abs(want), (r, want)


def _events(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "attempts.jsonl").read_text().splitlines()]


def _submit(job: Path, run: Path, env: dict) -> str:
    r = run_cli("submit", str(job), "--run-dir", str(run), "--json", env=env)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["job_id"]


def _wait_steps(run: Path, n: int, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (run / "metrics.jsonl").exists() and sum(1 for r in _rows(run) if "loss" in r) >= n:
            return
        time.sleep(0.3)
    raise AssertionError(f"fewer than {n} steps after {timeout}s")


def _log(run: Path) -> str:
    return "\n".join(p.read_text(errors="replace") for p in sorted((run / "logs").glob("*")))


def _wait_gone(job_id: str, env: dict, timeout: float = 400) -> str:
    """The job's final state once it has left the queue for good (a requeued job comes back)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        q = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True,
                           env={**os.environ, **env})  # fmt: skip
        if not q.stdout.strip():
            return wait_for_job(job_id, env, timeout=60)
        time.sleep(0.2)  # one squeue call: cheap beside the second of idle a 1 s poll cost each wait on average
    raise AssertionError(f"job {job_id} still queued after {timeout}s")


def _rank_pids(run: Path, node: str | None = None) -> list[int]:
    out = subprocess.run(["pgrep", "-f", f"hpcscale launch --run-dir {run}"], capture_output=True, text=True)
    pids = []
    for p in out.stdout.split():
        try:
            env = Path(f"/proc/{p}/environ").read_bytes().split(b"\0")
            if Path(f"/proc/{p}/comm").read_text().strip() in ("srun", "mpirun", "orterun"):
                continue  # the launchers name the same arguments; the ranks are python (`hpcscale` by its script)
        except OSError:
            continue
        if node is None or f"SLURMD_NODENAME={node}".encode() in env:
            pids.append(int(p))
    return pids


# ---- requeue from inside the job -------------------------------------------------------------------------
def test_preemption_signal_checkpoints_requeues_and_finishes_exactly(local_cluster, reference, tmp_path):
    run = tmp_path / "run"
    job_id = _submit(_slurm_job(tmp_path / "job.yaml"), run, local_cluster)
    _wait_steps(run, 60)
    subprocess.run(["scancel", "--signal=USR2", job_id], check=True, env={**os.environ, **local_cluster})
    assert _wait_gone(job_id, local_cluster) == "COMPLETED", _log(run)[-3000:]
    events = _events(run)
    ends = [e for e in events if e["event"] == "end"]
    assert [e["cause"] for e in ends] == ["preempted", "completed"], ends
    assert ends[0]["requeue"] and ends[0]["checkpoint"] > 60
    stop = next(e for e in events if e["event"] == "stop")
    assert stop["signal"] == "SIGUSR2" and stop["step"] + 1 == ends[0]["checkpoint"]  # the stop step's own save
    begins = [e for e in events if e["event"] == "begin"]
    assert [b["restart_count"] for b in begins] == [0, 1]  # SLURM_RESTART_COUNT, in the run's history
    assert {r["attempt"] for r in _rows(run)} == {1, 2}  # repeated steps are told apart
    _assert_matches(run, reference)
    log = _log(run)
    assert "=== hpcscale: job " in log and "(restart 1)" in log  # one marker per attempt in the appended logs
    assert not re.search(r"srun: error: \S+: tasks? [\d,-]+: Terminated", log)  # they left together: none killed


def test_time_limit_requeues_until_its_budget_is_spent(local_cluster, tmp_path):
    """A 2-minute limit with 40 s of grace: each attempt is stopped by the time-limit signal, checkpoints,
    and requeues itself while restart.max_time_limits allows (1 here); the second stop ends the job. Slurm sends the
    signal up to 60 s early (20-80 s into each attempt here): with a 1-minute limit it could come before the
    ranks started, and that attempt would have no checkpoint of its own. Two ranks on one node, training the
    built-in trainer's steps at a walking pace (tests/helpers/paced_entry.py): the job waits minutes for Slurm's
    signal and leaves the machine's cores to the rest of the suite meanwhile."""
    run = tmp_path / "run"
    job = _slurm_job(
        tmp_path / "job.yaml",
        nodes=1,
        ranks=2,
        steps=100000,
        time_limit="2",
        signals={"grace_seconds": 40},
        restart={"max_time_limits": 1},
        environment={"PYTHONPATH": str(REPO / "tests" / "helpers")},
    )
    spec = yaml.safe_load(job.read_text())
    spec["train"]["entry"] = "paced_entry:train"
    job.write_text(yaml.safe_dump(spec))
    job_id = _submit(job, run, local_cluster)
    _wait_gone(job_id, local_cluster, timeout=720)
    ends = [e for e in _events(run) if e["event"] == "end"]
    assert [e["cause"] for e in ends] == ["time_limit"] * 2, ends
    assert [e["requeue"] for e in ends] == [True, False]
    assert "time limit budget spent" in ends[-1]["why"]
    assert [e["restart_count"] for e in ends] == [0, 1]
    steps = [e["checkpoint"] for e in ends]
    assert steps[1] > steps[0] > 0  # each attempt checkpointed on the signal, the second further
    out = run_cli("resume", str(run), "--dry-run", "--json", env=local_cluster)
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert plan["checkpoint"] == steps[-1] and "time limit" in plan["diagnosis"]["explanation"]


# ---- hpcscale resume -------------------------------------------------------------------------------------
def test_killed_rank_is_named_and_resume_continues_off_its_node(local_cluster, reference, tmp_path):
    run = tmp_path / "run"
    job_id = _submit(_slurm_job(tmp_path / "job.yaml", restart={"max_failures": 0}), run, local_cluster)
    _wait_steps(run, 80)
    victims = _rank_pids(run, "n2")
    assert victims, "no rank on n2"
    os.kill(victims[0], signal.SIGKILL)
    assert _wait_gone(job_id, local_cluster) == "FAILED"
    # the attempt ended with the killed task's 137, not srun's 1 (the survivors' exit outranks a signal)
    ends = [e for e in map(json.loads, (run / "attempts.jsonl").read_text().splitlines()) if e["event"] == "end"]
    assert ends[-1]["exit_code"] == 137 and type(ends[-1]["srun_exit_code"]) is int, ends[-1]
    assert "ended: failed (exit 137: task " in _log(run) and " died of signal 9; srun exited " in _log(run)
    dry = run_cli("resume", str(run), "--dry-run", "--json", env=local_cluster)
    assert dry.returncode == 0, dry.stderr
    plan = json.loads(dry.stdout)
    assert plan["exclude"] == ["n2"], plan
    assert "n2" in plan["diagnosis"]["explanation"] and "killed" in plan["diagnosis"]["explanation"]
    assert plan["checkpoint"] is not None and plan["submitted"] is None
    assert len(json.loads(run_cli("status", str(run), "--json", env=local_cluster).stdout)["submissions"]) == 1
    out = run_cli("resume", str(run), "--json", env=local_cluster)
    assert out.returncode == 0, out.stderr
    new = json.loads(out.stdout)["submitted"]
    assert _wait_gone(new, local_cluster) == "COMPLETED", _log(run)[-3000:]
    subs = [json.loads(line) for line in (run / "submissions.jsonl").read_text().splitlines()]
    assert subs[-1]["excluded"] == ["n2"] and subs[-1]["reason"].startswith(f"resume from step {plan['checkpoint']}")
    assert "#SBATCH --exclude=n2" in (run / subs[-1]["script"]).read_text()
    _assert_matches(run, reference)


@pytest.mark.parametrize("lost", [("n2",), ("n1", "n2")], ids=["one-node", "both-partners"])
def test_a_lost_node_resumes_from_the_node_local_tier_with_its_partners_copy(local_cluster, reference, tmp_path, lost):
    """checkpoint.local: every 5 steps to each node's own directory (the cluster's per-node TmpFS), a partner
    copy on the other node. A rank on n2 killed and n2's directory gone (the node lost): the resume runs without
    n2, from the newest node-local step, n2's part taken from n1's partner copy and moved over the process group
    to the replacement node; nothing is read from the shared tier, and the losses are the uninterrupted run's.
    n1's copy of one of n2's files of the newest step is corrupted first (one byte): that copy is refused, so the
    newest step is not whole, and the one before it is taken, still from the node-local tier.
    The shared tier's periodic saves (every 25 steps) are drained from the node-local tier with the node-local
    step's root digest, and verify.
    both-partners: n1's directory is gone too, so no node holds n2's part: the ranks fall back to the shared
    tier's newest step, one drained from the node-local tier, and the losses are again the uninterrupted run's."""
    run = tmp_path / "run"
    job = _slurm_job(tmp_path / "job.yaml", restart={"max_failures": 0})
    spec = yaml.safe_load(job.read_text())
    spec["checkpoint"]["local"] = {"every_steps": 5}
    job.write_text(yaml.safe_dump(spec))
    job_id = _submit(job, run, local_cluster)
    node_dirs = cluster_root(local_cluster) / "tmp"
    record = run / "node-local.json"
    try:
        _wait_steps(run, 80)
        # the newest node-local step 10 past a shared save, so the step before it is newer than that save
        deadline = time.monotonic() + 120
        while not (record.exists() and json.loads(record.read_text())["step"] % 25 == 10):
            assert time.monotonic() < deadline, _log(run)[-3000:]
            time.sleep(0.05)
        os.kill(_rank_pids(run, "n2")[0], signal.SIGKILL)
        assert _wait_gone(job_id, local_cluster) == "FAILED"
        mine = f"hpcscale-{(run / 'run-id').read_text().strip()}"
        assert list((node_dirs / "n1" / mine).glob("step-*/index.h5")), _log(run)[-3000:]
        newest = json.loads(record.read_text())
        local_digests = {int(p.parent.name[5:]): p.read_text() for p in (node_dirs / "n1" / mine).glob("step-*/DIGEST")}
        if lost == ("n2",):  # n1's copy of an n2 file of the newest step, one byte flipped in its first chunk
            n2_file = next(f for f, holders in sorted(newest["holders"].items()) if holders[0] == "n2")
            with open(node_dirs / "n1" / mine / n2_file, "r+b") as f:
                f.seek(100)
                byte = f.read(1)
                f.seek(100)
                f.write(bytes([byte[0] ^ 0xFF]))
        for node in lost:  # lost with its disk
            shutil.rmtree(node_dirs / node / mine)
        dry = json.loads(run_cli("resume", str(run), "--dry-run", "--json", env=local_cluster).stdout)
        assert dry["exclude"] == ["n2"], dry
        if lost == ("n2",):
            assert dry["tier"] == "node-local" and dry["nodelist"] == ["n1"], dry
            assert (
                "#SBATCH --nodelist=n1" in dry["runs"]["script"]
                and "reads nothing from the shared tier" in dry["tier_reason"]
            )
        out = run_cli("resume", str(run), "--json", env=local_cluster)
        assert out.returncode == 0, out.stderr
        assert _wait_gone(json.loads(out.stdout)["submitted"], local_cluster) == "COMPLETED", _log(run)[-3000:]
        log = _log(run)
        # partners by the live switch tree (leaf1: n1, n2; leaf2: n3, n4), which rank 0 read at placement
        pairs = re.findall(r"(n\d) -> (n\d) \((the same|another) leaf switch\)", log)
        assert pairs, log[-3000:]
        leaf = {"n1": 1, "n2": 1, "n3": 2, "n4": 2}
        assert all((where == "the same") == (leaf[a] == leaf[b]) for a, b, where in pairs), pairs
        drained = {int(x) for x in re.findall(r"checkpoint (\d+) saved: [\d.]+ s blocking, drained", log)}
        if lost == ("n2",):
            m = re.search(r"resumed from checkpoint step (\d+) of the node-local tier \((\d+) data file", log)
            assert m and int(m.group(1)) == newest["step"] - 5 and int(m.group(2)) >= 1, log[-3000:]
            assert "nothing read from the shared tier" in log
            refused = rf"node-local copy refused: \S*/{re.escape(n2_file)}: the chunk at offset 0 "
            assert re.search(refused, log), log[-3000:]
        else:  # the node-local tier cannot make a step whole: the shared tier's newest, a drained one
            m = re.search(r"resumed from checkpoint step (\d+) of the shared tier", log)
            assert m and int(m.group(1)) in drained, log[-3000:]
        # the shared tier's saves were drained from the node-local tier, and what was drained verifies
        kept = sorted(run.glob("checkpoints/step-*"))
        assert 50 in drained and drained & {int(p.name[5:]) for p in kept}, (drained, kept)
        for step_dir in kept:
            done = run_cli("ckpt", "verify", str(step_dir))
            assert done.returncode == 0, done.stdout + done.stderr
        # a drained step has the node-local step's root digest (when n1 still holds that step)
        same = [p for p in kept if int(p.name[5:]) in local_digests]
        assert all((p / "DIGEST").read_text() == local_digests[int(p.name[5:])] for p in same), same
        _assert_matches(run, reference)
    finally:
        for node in node_dirs.glob("n*"):
            shutil.rmtree(node / f"hpcscale-{(run / 'run-id').read_text().strip()}", ignore_errors=True)


def test_under_pypis_open_mpi_5_a_killed_rank_is_named_and_its_node_excluded(local_cluster, openmpi5, tmp_path):
    """README.md installs Open MPI 5 from PyPI: a job whose PATH finds it (its ranks load its libmpi, over
    srun's PMIx) is diagnosed as under Debian's Open MPI 4: the killed task's node blamed and excluded, the
    attempt's exit code 137."""
    run = tmp_path / "run"
    job = _slurm_job(tmp_path / "job.yaml", restart={"max_failures": 0}, environment={"PATH": openmpi5["PATH"]})
    job_id = _submit(job, run, local_cluster)
    _wait_steps(run, 30)
    venv_lib = str(Path(openmpi5["python"]).parent.parent / "lib")
    for pid in _rank_pids(run):
        assert f"{venv_lib}/libmpi.so" in Path(f"/proc/{pid}/maps").read_text(), pid
    os.kill(_rank_pids(run, "n2")[0], signal.SIGKILL)
    assert _wait_gone(job_id, local_cluster) == "FAILED"
    ends = [e for e in map(json.loads, (run / "attempts.jsonl").read_text().splitlines()) if e["event"] == "end"]
    assert ends[-1]["exit_code"] == 137, ends[-1]
    plan = json.loads(run_cli("resume", str(run), "--dry-run", "--json", env=local_cluster).stdout)
    assert plan["exclude"] == ["n2"] and "killed" in plan["diagnosis"]["explanation"], plan


def _wait_attempt_steps(run: Path, attempt: int, n: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rows = _rows(run) if (run / "metrics.jsonl").exists() else []
        if sum(1 for r in rows if "loss" in r and r.get("attempt") == attempt) >= n:
            return
        time.sleep(0.3)
    raise AssertionError(f"attempt {attempt}: fewer than {n} steps after {timeout}s\n" + _log(run)[-3000:])


def _lose_node(run: Path, node: str, env: dict) -> None:
    """`node` lost with its disk: Slurm told it is down, the run's ranks on it killed with -9, its node-local
    directory gone (the caller sets the node back to resume)."""
    mine = f"hpcscale-{(run / 'run-id').read_text().strip()}"
    down = ["scontrol", "update", f"nodename={node}", "state=down", "reason=hpcscale-test"]
    subprocess.run(down, check=True, env=env)
    for pid in _rank_pids(run, node):
        os.kill(pid, signal.SIGKILL)
    shutil.rmtree(cluster_root(env) / "tmp" / node / mine, ignore_errors=True)


def test_a_failed_node_is_replaced_by_a_spare_in_the_same_allocation_twice(local_cluster, reference, tmp_path):
    """restart.spare_nodes: 2 on the four-node cluster: the steps run on two nodes (n1, n2: the fullest leaf
    switch), n3 and n4 wait. n2 lost: its ranks killed with -9, Slurm told it is down, its node-local directory
    gone. The batch script leaves n2 out and starts a step on n1 and the nearest spare, n3, in the same job (no
    requeue, no new submission), from the newest node-local checkpoint (n2's part from its partner's copy on n1).
    Then a rank on n3 killed with -9 while the drain of step 125 to the shared tier is in flight (its write held
    back 3 s): the next step runs on n1 and n4 from the node-local tier, and no half-drained step is ever taken
    for a checkpoint. The job completes in its one allocation, every shared checkpoint verifies, and every
    step's loss is the uninterrupted run's."""
    env = {**os.environ, **local_cluster}
    run = tmp_path / "run"
    job = _slurm_job(tmp_path / "job.yaml", restart={"max_failures": 2, "spare_nodes": 2})
    spec = yaml.safe_load(job.read_text())
    spec["checkpoint"]["local"] = {"every_steps": 5}  # the shared tier's saves (every 25) drained from it
    spec["hang_timeout_seconds"] = 15
    spec["environment"] = {"HPCSCALE_CKPT_SLOW_WRITE": "3@=125:shared"}
    job.write_text(yaml.safe_dump(spec))
    job_id = _submit(job, run, local_cluster)
    try:
        _wait_attempt_steps(run, 1, 80)
        _lose_node(run, "n2", env)
        _wait_attempt_steps(run, 2, 30)
        busy = run_cli("resume", str(run), "--dry-run", env=local_cluster)  # what the running job does next
        assert busy.returncode == 2, busy.stderr
        assert "spares left: n4; 1 of restart.max_failures = 2 left" in busy.stderr, busy.stderr
        deadline = time.monotonic() + 120
        while not any(r.get("checkpoint") == 125 and r.get("attempt") == 2 for r in _rows(run)):
            assert time.monotonic() < deadline, _log(run)[-3000:]  # logged as the drain starts: 3 s in flight
            time.sleep(0.1)
        os.kill(_rank_pids(run, "n3")[0], signal.SIGKILL)
        assert _wait_gone(job_id, local_cluster, timeout=600) == "COMPLETED", _log(run)[-4000:]
    finally:
        subprocess.run(["scontrol", "update", "nodename=n2", "state=resume"], env=env)
    events = _events(run)
    begins = [e for e in events if e["event"] == "begin"]
    ends = [e for e in events if e["event"] == "end"]
    assert [e["nodes"] for e in begins] == [["n1", "n2"], ["n1", "n3"], ["n1", "n4"]], begins
    assert [e["cause"] for e in ends] == ["failed", "failed", "completed"], ends
    assert [e.get("excluded") for e in ends] == [["n2"], ["n3"], None], ends
    assert [e.get("relaunch") for e in ends] == [["n1", "n3"], ["n1", "n4"], None], ends
    assert {e["job_id"] for e in events if "job_id" in e} == {job_id} and not any(e.get("requeue") for e in ends)
    assert all(e["restart_count"] == 0 for e in ends)
    log = _log(run)
    assert "relaunch 1 of restart.max_failures = 2 in this allocation: n2 left out" in log, log[-3000:]
    assert "relaunch 2 of restart.max_failures = 2 in this allocation: n3 left out" in log, log[-3000:]
    resumed = re.findall(r"resumed from checkpoint step (\d+) of the node-local tier", log)
    assert len(resumed) == 2 and "nothing read from the shared tier" in log, log[-3000:]
    status = json.loads(run_cli("status", str(run), "--json", env=local_cluster).stdout)
    (sub,) = status["submissions"]
    steps = sub["jobs"][0]["attempts"]
    assert [a["state"].split()[0] for a in steps] == ["RELAUNCHED", "RELAUNCHED", "COMPLETED"], steps
    for a in steps[:2]:  # how long training stopped, in its parts
        assert a["downtime"]["total_s"] > 0 and a["downtime"]["load_s"] > 0, a
    assert "drained from the node-local tier" in log
    shared = json.loads(run_cli("ckpt", "ls", str(run), "--json").stdout)["checkpoints"]
    assert 125 not in [c["step"] for c in shared] and max(c["step"] for c in shared) == STEPS, shared
    for c in shared:  # what the killed drain left is not a checkpoint; every one that is verifies whole
        assert run_cli("ckpt", "verify", c["path"]).returncode == 0, c
    _assert_matches(run, reference)


def test_with_no_spare_left_the_step_shrinks_in_its_allocation_and_the_losses_hold(local_cluster, reference, tmp_path):
    """restart.shrink on two nodes of one rank each (dp 2) and no spare: n2 lost (its ranks killed with -9, Slurm
    told it is down, its node-local directory gone). The batch script starts the next step on n1 alone, in the same
    allocation: dp 2, the global batch kept by two micro-batches a rank, the newest node-local checkpoint
    resharded onto it (n2's part from its partner's copy on n1). The job completes and every step's loss is the
    uninterrupted dp-4 run's (to 1e-5: the same global batch summed in another order)."""
    env = {**os.environ, **local_cluster}
    run = tmp_path / "run"
    job = _slurm_job(tmp_path / "job.yaml", restart={"max_failures": 1, "shrink": True})
    spec = yaml.safe_load(job.read_text())
    spec["checkpoint"]["local"] = {"every_steps": 5}
    job.write_text(yaml.safe_dump(spec))
    job_id = _submit(job, run, local_cluster)
    try:
        _wait_attempt_steps(run, 1, 80)
        _lose_node(run, "n2", env)
        assert _wait_gone(job_id, local_cluster, timeout=600) == "COMPLETED", _log(run)[-4000:]
    finally:
        subprocess.run(["scontrol", "update", "nodename=n2", "state=resume"], env=env)
    events = _events(run)
    begins = [e for e in events if e["event"] == "begin"]
    ends = [e for e in events if e["event"] == "end"]
    assert [(e["nodes"], e["world_size"]) for e in begins] == [(["n1", "n2"], 2), (["n1"], 1)], begins
    assert [e["cause"] for e in ends] == ["failed", "completed"] and ends[0]["relaunch"] == ["n1"], ends
    log = _log(run)
    assert "no spare left: the step shrinks from 2 to 1 node(s) (restart.shrink), the step now on n1" in log
    resharded = r"resumed from checkpoint step \d+ of the node-local tier .*\(new layout: resharded\)"
    assert re.search(resharded, log), log[-3000:]
    _assert_matches(run, reference, rel=1e-5)


def test_three_failures_in_one_allocation_one_of_them_during_a_relaunch(local_cluster, reference, tmp_path):
    """restart.spare_nodes: 3, one node a step (two ranks on it): the step runs on n1, the batch script's node,
    and n2-n4 wait. The ranks on n1 killed with -9 (the batch script lives on): the step moves to n2, the nearest
    spare. A rank of that new step killed as soon as it began, before its first step (a failure during the
    relaunch itself): the step moves to n3. A rank there stopped with SIGSTOP (a hang): the step moves to n4, and
    the job completes in its one allocation with the uninterrupted run's losses (no periodic saves here: each
    relaunch starts from the beginning)."""
    run = tmp_path / "run"
    job = _slurm_job(tmp_path / "job.yaml", nodes=1, ranks=2, restart={"max_failures": 3, "spare_nodes": 3})
    spec = yaml.safe_load(job.read_text())
    spec["hang_timeout_seconds"] = 15
    # no periodic saves: the SIGSTOP lands among training steps (a rank stopped inside a node-local save:
    # tests/recovery/test_hang.py; inside a shared-tier save the collective timeout finds it, docs/runbook.md)
    spec["checkpoint"] = {"every_steps": 0}
    job.write_text(yaml.safe_dump(spec))
    job_id = _submit(job, run, local_cluster)
    stopped: list[int] = []
    try:
        _wait_attempt_steps(run, 1, 40)
        for pid in _rank_pids(run, "n1"):
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 120  # attempt 2 began: kill one of its ranks before it trains
        while not any(e["event"] == "begin" and e["attempt"] == 2 for e in _events(run)):
            assert time.monotonic() < deadline, _log(run)[-3000:]
            time.sleep(0.05)
        assert not any(r.get("attempt") == 2 and "loss" in r for r in _rows(run))
        os.kill(_rank_pids(run, "n2")[0], signal.SIGKILL)
        _wait_attempt_steps(run, 3, 20)
        stopped = _rank_pids(run, "n3")[:1]
        os.kill(stopped[0], signal.SIGSTOP)
        assert _wait_gone(job_id, local_cluster, timeout=600) == "COMPLETED", _log(run)[-4000:]
    finally:
        for pid in stopped:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
    events = _events(run)
    assert [e["nodes"] for e in events if e["event"] == "begin"] == [["n1"], ["n2"], ["n3"], ["n4"]], events
    ends = [e for e in events if e["event"] == "end"]
    assert [e.get("excluded") for e in ends] == [["n1"], ["n2"], ["n3"], None], ends
    assert [e["cause"] for e in ends] == ["failed"] * 3 + ["completed"] and not any(e.get("requeue") for e in ends)
    _assert_matches(run, reference)


def test_node_down_is_excluded_and_the_run_finishes_on_fewer_nodes(local_cluster, reference, tmp_path):
    env = {**os.environ, **local_cluster}
    run = tmp_path / "run"
    job = _slurm_job(tmp_path / "job.yaml", nodes=4, ranks=4, signals={"requeue": False})
    job_id = _submit(job, run, local_cluster)
    try:
        _wait_steps(run, 80)
        subprocess.run(["scontrol", "update", "nodename=n3", "state=down", "reason=hpcscale-test"], check=True, env=env)
        for pid in _rank_pids(run, "n3"):
            os.kill(pid, signal.SIGKILL)
        assert _wait_gone(job_id, local_cluster) in ("NODE_FAIL", "FAILED", "CANCELLED")
        refused = run_cli("resume", str(run), "--dry-run", env=local_cluster)
        plan = json.loads(run_cli("resume", str(run), "--dry-run", "--json", env=local_cluster).stdout)
        assert "n3" in plan["exclude"], (plan, refused.stdout)
        out = run_cli("resume", str(run), "--nodes", "2", "--json", env=local_cluster)
        assert out.returncode == 0, out.stderr
        new = json.loads(out.stdout)["submitted"]
        assert _wait_gone(new, local_cluster) == "COMPLETED", _log(run)[-3000:]
    finally:
        subprocess.run(["scontrol", "update", "nodename=n3", "state=resume"], env=env)
    assert "resharded" in _log(run)
    _assert_matches(run, reference, rel=1e-5)  # dp 4, then 2: the same global batch, the same losses


def test_crash_at_every_start_stops_at_the_cap(local_cluster, tmp_path):
    run = tmp_path / "run"
    job = _slurm_job(tmp_path / "job.yaml", nodes=1, ranks=1, restart={"max_failures": 3, "failure_backoff_seconds": 0})
    spec = yaml.safe_load(job.read_text())
    spec["train"]["entry"] = "json:loads"  # there (config validate finds it), and a TypeError on a Context: every start
    job.write_text(yaml.safe_dump(spec))
    job_id = _submit(job, run, local_cluster)
    _wait_gone(job_id, local_cluster)
    ends = [e for e in _events(run) if e["event"] == "end"]
    # no checkpoint ever: the second attempt without progress ends it (restart.max_no_progress = 2)
    assert [e["requeue"] for e in ends] == [True, False], ends
    assert "no new checkpoint in 2 consecutive attempts" in ends[-1]["why"]


def test_resume_refused_while_running_and_two_resumes_submit_once(local_cluster, tmp_path):
    env = {**os.environ, **local_cluster}
    run = tmp_path / "run"
    job_id = _submit(_slurm_job(tmp_path / "job.yaml", nodes=1, ranks=1, steps=100000), run, local_cluster)
    _wait_steps(run, 5)
    busy = run_cli("resume", str(run), env=local_cluster)
    # RUNNING, or PENDING while slurmdbd has not recorded the start yet (sacct lags under load): refused either way
    assert busy.returncode == 2 and "nothing to resume while it is in the queue or running" in busy.stderr, busy.stderr
    subprocess.run(["scancel", job_id], check=True, env=env)
    _wait_gone(job_id, local_cluster)
    results: list[subprocess.CompletedProcess] = []

    def go() -> None:
        results.append(run_cli("resume", str(run), "--json", env=local_cluster))

    threads = [threading.Thread(target=go) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    codes = sorted(r.returncode for r in results)
    subs = (run / "submissions.jsonl").read_text().splitlines()
    try:
        assert codes == [0, 2], [(r.returncode, r.stderr) for r in results]
        assert len(subs) == 2  # the first submission and exactly one resume
        loser = next(r for r in results if r.returncode == 2)
        assert "another `hpcscale resume`" in loser.stderr or "PENDING" in loser.stderr or "RUNNING" in loser.stderr
    finally:
        for line in subs[1:]:
            subprocess.run(["scancel", json.loads(line)["job_id"]], env=env)


def test_an_admins_own_sbatch_script_is_a_job_of_the_run(local_cluster, tmp_path):
    """A run directory from `submit --dry-run`, then the admin's own batch script calling `hpcscale launch`
    (no exports, no requeue line) for a user's entry point that only the job spec's `environment:` makes
    importable: the ranks find it, the job is recorded as the run's, so status lists it and resume diagnoses it
    through Slurm instead of saying there is nothing to resume; its log, written outside RUN/logs, is said."""
    env = {**os.environ, **local_cluster}
    run = tmp_path / "run"
    job = _slurm_job(tmp_path / "job.yaml", nodes=1, ranks=2, steps=6)
    spec = yaml.safe_load(job.read_text())
    spec["train"] = {"entry": "fsdp_entry:main", "params": {"steps": 6}}
    spec.setdefault("environment", {})["PYTHONPATH"] = str(REPO / "tests" / "helpers")
    job.write_text(yaml.safe_dump(spec))
    dry = run_cli("submit", str(job), "--run-dir", str(run), "--dry-run", env=local_cluster)
    assert dry.returncode == 0, dry.stderr
    rendered = (run / "submissions" / "0001.sbatch").read_text()
    srun = next(line for line in rendered.splitlines() if " hpcscale launch " in line or "hpcscale', 'launch" in line)
    own = tmp_path / "own.sbatch"
    own.write_text(
        "#!/bin/bash\n#SBATCH --nodes=1\n#SBATCH --ntasks-per-node=2\n#SBATCH --cpus-per-task=1\n"
        f"#SBATCH --output={tmp_path}/own-%j.out\n{srun.removesuffix(' &')}\n"
    )
    out = subprocess.run(["sbatch", "--parsable", str(own)], capture_output=True, text=True, env=env, check=True)
    job_id = out.stdout.strip().split(";")[0]
    log = tmp_path / f"own-{job_id}.out"
    assert _wait_gone(job_id, local_cluster) == "COMPLETED", log.read_text()[-3000:]
    assert len(losses(run)) == 6  # the entry point the job's environment made importable trained
    assert f"job {job_id} writes its log to {log}, not {run}/logs/slurm-{job_id}.out" in log.read_text()
    status = json.loads(run_cli("status", str(run), "--json", env=local_cluster).stdout)
    assert [s["submission"]["job_id"] for s in status["submissions"]] == [job_id], status["submissions"]
    dry = run_cli("resume", str(run), "--dry-run", env=local_cluster)
    assert dry.returncode == 2 and "the run finished" in dry.stderr and job_id in dry.stderr, dry.stderr


# ---- local runs ------------------------------------------------------------------------------------------
def test_damaged_newest_checkpoint_resume_falls_back_and_trains_past_it(mpi, tmp_path):
    sys_path = str(REPO / "tests" / "helpers")
    import sys

    if sys_path not in sys.path:
        sys.path.insert(0, sys_path)
    job = job_spec(tmp_path / "job.yaml", tp=1, pp=1, ranks=2, steps=120, checkpoint={"every_steps": 20})
    run = tmp_path / "run"
    proc = subprocess.Popen(["hpcscale", "run", str(job), "--local", "--run-dir", str(run)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        _wait_steps(run, 70)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 75, out[-2000:]
    ckpts = sorted((run / "checkpoints").glob("step-*"))
    newest, previous = ckpts[-1], ckpts[-2]
    data = sorted((newest / "data").glob("*"))[0]
    with open(data, "r+b") as f:  # one flipped byte in the newest checkpoint's own data
        b = f.read(1)
        f.seek(0)
        f.write(bytes([b[0] ^ 0xFF]))
    dry = run_cli("resume", str(run), "--dry-run", "--json")
    assert dry.returncode == 0, dry.stderr
    plan = json.loads(dry.stdout)
    newest_step, previous_step = int(newest.name.split("-")[1]), int(previous.name.split("-")[1])
    assert [r["step"] for r in plan["refused"]] == [newest_step] and plan["checkpoint"] == previous_step
    again = run_cli("resume", str(run), timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"refused checkpoint step {newest_step}" in again.stdout
    # The refused checkpoint is set aside only if a save reaches its step (a stop-time step such as 86 is not
    # reached again from 80), collected by retention, or still there and still reported damaged: never mended
    # in place or trusted.
    aside = (run / "checkpoints" / "refused").is_dir() or not (newest / "index.h5").exists()
    assert aside or run_cli("ckpt", "verify", str(newest)).returncode == 3
    assert run_cli("ckpt", "verify", str(run)).returncode == 0
    # trained on from the previous checkpoint: the steps up to the refused one, trained again, give bitwise the
    # first attempt's losses (what was restored is what that attempt had there), and every step is there
    first, again = attempt_losses(run, 1), attempt_losses(run, 2)
    assert sorted(first) == list(range(newest_step)) and sorted(again) == list(range(previous_step, 120))
    assert all(again[step] == first[step] for step in range(previous_step, newest_step)), (first, again)
    finished = run_cli("resume", str(run))
    assert finished.returncode == 2 and "finished" in finished.stderr


def test_rank_failure_names_the_cause_not_the_ranks_srun_ended_after_it():
    """What `resume` blames, on lines as the ranks and srun write them: a rank's own failure beats srun's
    "Terminated" for the survivors it ends; a hang blames the stuck rank's node (from the line it writes once
    continued); a task killed without a word (kill -9, the OOM killer) blames its node."""
    from hpcscale.launch.failure import failure_line, hang_line, rank_failure, stall_line

    crash = [
        failure_line(ValueError("bad batch"), rank="0", mpi_rank=0, node="n1"),
        "srun: error: n2: tasks 2-3: Terminated",
        "srun: error: n1: task 0: Exited with exit code 1",
        failure_line(RuntimeError("Connection closed by peer"), rank="1", mpi_rank=1, node="n1"),
    ]
    summary, blamed = rank_failure(crash)
    assert blamed == ["n1"] and "rank 0" in summary and "bad batch" in summary, summary
    killed = [
        failure_line(RuntimeError("Connection reset by peer"), rank="0", mpi_rank=0, node="n1"),
        "srun: error: n2: task 1: Terminated",
        "srun: error: n3: task 2: Killed",
    ]
    summary, blamed = rank_failure(killed)
    assert blamed == ["n3"] and summary == "MPI task 2 on node n3 was killed (srun)"
    # slurmstepd appends to a survivor's line before its newline (seen under load in CI): still a peer loss
    glued = [killed[0] + "slurmstepd-n1: error: *** STEP 461.0 ON n1 CANCELLED AT 2026-11-23T22:23:51 ***", *killed[1:]]
    assert rank_failure(glued) == (summary, ["n3"])
    hang = [hang_line(rank=r, mpi_rank=r, node=f"n{r + 1}", seconds=130, last_step=41, world_size=4) for r in (0, 1, 3)]
    hang += [stall_line(rank=2, mpi_rank=2, node="n3", seconds=140.0), "srun: error: n1: task 0: Killed"]
    summary, blamed = rank_failure(hang)
    assert blamed == ["n3"] and "rank 2 stopped making progress" in summary, summary
