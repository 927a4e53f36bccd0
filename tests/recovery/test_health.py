"""Health signals that act (docs/observability.md#health-signals), on the local Slurm cluster: a node drained
through the cluster's real scontrol while the job runs is seen by rank 0's poller, logged once with its evidence,
and every rank takes a node-local checkpoint at the next step; a maintenance reservation on another node that
comes within the cooldown is logged but takes no second checkpoint; `status` shows both."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import yaml
from conftest import REPO, run_cli, wait_for_job
from test_resume import _rank_pids
from trainjobs import job_spec

RESERVATION = "hpcscale-test-health"


def _scontrol(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["scontrol", *args], capture_output=True, text=True, env={**os.environ, **env}, timeout=30)


def _rows(run: Path) -> list[dict]:
    if not (run / "metrics.jsonl").exists():
        return []
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _wait_for(run: Path, key: str, count: int = 1, timeout: float = 120) -> list[dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [r for r in _rows(run) if key in r]
        if len(found) >= count:
            return found
        time.sleep(0.2)
    raise AssertionError(f"no {key} line after {timeout}s: {_rows(run)[-5:]}")


def _submit_paced(tmp_path: Path, run: Path, env: dict, *, health: dict | None = None, **extra) -> str:
    """A two-node job of the built-in trainer at a walking pace (0.1 s a step, steps without end) that saves
    nothing but what a sign asks for, its health polled every second; submitted, its job id."""
    job = job_spec(tmp_path / "job.yaml", tp=1, pp=1, ranks=4, site="localcluster", nodes=2, steps=100000)
    spec = yaml.safe_load(job.read_text())
    spec["checkpoint"] = {"every_steps": 100000, "async": False, "local": {"every_steps": 100000}}  # none but ours
    spec["health"] = {"poll_seconds": 1, "cooldown_seconds": 600, **(health or {})}
    spec["train"]["entry"] = "paced_entry:train"
    spec["environment"] = {"PYTHONPATH": str(REPO / "tests" / "helpers"), "PACED_STEP_S": "0.1"}
    spec.update(extra)
    job.write_text(yaml.safe_dump(spec))
    r = run_cli("submit", str(job), "--run-dir", str(run), "--json", env=env)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["job_id"]


def _wait_trained(run: Path, steps: int = 5) -> None:
    deadline = time.monotonic() + 240
    while sum(1 for r in _rows(run) if "loss" in r) < steps:
        assert time.monotonic() < deadline, "the job did not train"
        time.sleep(0.3)


def test_a_drained_node_takes_a_node_local_checkpoint_at_once_and_the_cooldown_holds_the_next(local_cluster, tmp_path):
    run = tmp_path / "run"
    job_id = _submit_paced(tmp_path, run, local_cluster, health={"warn_before_seconds": 900})
    try:
        _wait_trained(run)
        drained = time.time()
        out = _scontrol(local_cluster, "update", "nodename=n2", "state=drain", "reason=hpcscale test: ECC errors")
        assert out.returncode == 0, out.stderr
        (saved,) = _wait_for(run, "health_checkpoint")
        (signs,) = [r for r in _rows(run) if "health" in r]
        (sign,) = signs["health"]
        assert sign["kind"] == "drain" and sign["node"] == "n2", sign
        assert "DRAIN" in sign["evidence"] and "Reason=hpcscale test: ECC errors" in sign["evidence"], sign
        # the checkpoint is the state after the step the sign was acted on, on the node-local tier, on every node
        assert saved["health_checkpoint"]["tier"] == "node-local"
        assert saved["health_checkpoint"]["step"] == saved["step"] + 1 and saved["step"] >= signs["step"]
        local = [r for r in _rows(run) if r.get("local_checkpoint") == saved["health_checkpoint"]["step"]]
        assert local, "no node-local checkpoint line"
        took = local[0]["time"] - drained
        assert took < 30, took  # a poll (1 s) and a step or two: seconds, not a checkpoint interval
        print(f"from scontrol's drain to the committed node-local checkpoint: {took:.2f} s")
        # a maintenance reservation on n1 within the cooldown: a sign of its own, logged, and no second save
        out = _scontrol(
            local_cluster, "create", "reservation", f"reservationname={RESERVATION}", "starttime=now+300",
            "duration=5", "nodes=n1", "users=root", "flags=maint,ignore_jobs",
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        signs = _wait_for(run, "health", count=2)
        reservation = [s for r in signs for s in r["health"] if s["kind"] == "reservation"]
        assert reservation and reservation[0]["node"] == "n1" and RESERVATION in reservation[0]["evidence"]
        time.sleep(3)  # a few more steps: the cooldown keeps them from saving again
        assert len([r for r in _rows(run) if "health_checkpoint" in r]) == 1
        status = run_cli("status", str(run), env=local_cluster)
        assert status.returncode == 0, status.stderr
        assert "warning signs:" in status.stdout and "drain on n2" in status.stdout
        assert "reservation on n1" in status.stdout and "node-local checkpoint" in status.stdout
        # the job ends (cancelled) and n2 is back: resume still treats the nodes Slurm showed signs for as suspect
        subprocess.run(["scancel", job_id], env={**os.environ, **local_cluster}, check=True)
        assert wait_for_job(job_id, local_cluster) == "CANCELLED"
        assert _scontrol(local_cluster, "update", "nodename=n2", "state=resume").returncode == 0
        plan = run_cli("resume", str(run), "--dry-run", "--json", env=local_cluster)
        assert plan.returncode == 0, plan.stderr
        doc = json.loads(plan.stdout)
        assert "n2" in doc["exclude"], doc
        assert any("excluding n2: it showed a warning sign" in w and "ECC errors" in w for w in doc["warnings"])
    finally:
        subprocess.run(["scancel", job_id], env={**os.environ, **local_cluster}, check=False)
        _scontrol(local_cluster, "delete", f"reservation={RESERVATION}")
        _scontrol(local_cluster, "update", "nodename=n2", "state=resume")


def _events(run: Path) -> list[dict]:
    path = run / "attempts.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_a_node_that_showed_a_sign_is_left_out_of_the_relaunch_in_the_allocation(local_cluster, tmp_path):
    """restart.spare_nodes: 2, the steps on n1 and n2. n1 is drained (a warning sign, logged, a node-local save)
    and put back (the sign cleared), then a rank on n2 is killed with -9: the batch script relaunches the step in
    the allocation on the spares n3 and n4, n2 for the failure and n1 for its sign, and says so."""
    run = tmp_path / "run"
    job_id = _submit_paced(tmp_path, run, local_cluster, restart={"max_failures": 1, "spare_nodes": 2})
    try:
        _wait_trained(run)
        assert [e["nodes"] for e in _events(run) if e["event"] == "begin"] == [["n1", "n2"]]
        out = _scontrol(local_cluster, "update", "nodename=n1", "state=drain", "reason=hpcscale test: fan failing")
        assert out.returncode == 0, out.stderr
        _wait_for(run, "health_checkpoint")
        assert _scontrol(local_cluster, "update", "nodename=n1", "state=resume").returncode == 0  # the sign cleared
        (pid, *_) = _rank_pids(run, "n2")
        os.kill(pid, 9)
        deadline = time.monotonic() + 240
        while len([e for e in _events(run) if e["event"] == "begin"]) < 2:
            assert time.monotonic() < deadline, "no relaunch"
            time.sleep(0.3)
        (end,) = [e for e in _events(run) if e["event"] == "end"]
        assert end["relaunch"] == ["n3", "n4"] and end["excluded"] == ["n2", "n1"], end
        assert "n1 left out too for its warning sign (drain: " in end["why"] and "fan failing" in end["why"], end
        assert [e["nodes"] for e in _events(run) if e["event"] == "begin"][-1] == ["n3", "n4"]
    finally:
        subprocess.run(["scancel", job_id], env={**os.environ, **local_cluster}, check=False)
        _scontrol(local_cluster, "update", "nodename=n1", "state=resume")


def test_a_gpu_sign_on_another_rank_is_logged_by_rank_0_and_every_rank_saves(mpi, tmp_path):
    """health.devices: a rank's own GPU sign (here injected with HPCSCALE_DEVICE_SIGN: this machine has no GPU,
    tests/house/test_health_signs.py reads NVML's answers) reaches rank 0 through the stop check and one
    gather: logged once with that rank's node and evidence, and every rank takes the node-local checkpoint at
    the same step; status lists it."""
    site = tmp_path / "site.yaml"
    local = yaml.safe_load((REPO / "site_configs" / "local.yaml").read_text())
    local["filesystems"]["node_local"] = str(tmp_path / "node-local")
    site.write_text(yaml.safe_dump(local))
    job = job_spec(tmp_path / "job.yaml", tp=1, pp=1, ranks=2, steps=40)
    spec = yaml.safe_load(job.read_text())
    spec["site"] = str(site)
    spec["checkpoint"] = {"every_steps": 0, "local": {"every_steps": 1000}}  # none but the sign's
    spec["health"] = {"poll_seconds": 0.01}
    job.write_text(yaml.safe_dump(spec))
    run = tmp_path / "run"
    env = {"HPCSCALE_DEVICE_SIGN": "xid@10:1"}
    r = run_cli("run", "--local", str(job), "--run-dir", str(run), env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = _rows(run)
    (signs,) = [row for row in rows if "health" in row]
    (sign,) = signs["health"]
    assert sign["kind"] == "xid" and sign["evidence"] == "rank 1: injected (HPCSCALE_DEVICE_SIGN)", sign
    assert sign["node"] and signs["step"] >= 10
    (saved,) = [row for row in rows if "health_checkpoint" in row]
    assert saved["health_checkpoint"]["tier"] == "node-local" and saved["step"] == signs["step"]
    step = saved["health_checkpoint"]["step"]
    assert any(row.get("local_checkpoint") == step for row in rows), rows[-5:]
    status = run_cli("status", str(run))
    assert "warning signs:" in status.stdout and f"xid on {sign['node']}" in status.stdout, status.stdout


def test_a_gpu_sign_reaches_global_rank_0_when_placement_renumbers_the_ranks(local_cluster, mpi, tmp_path):
    """Placement orders the nodes (n1 before n2) whatever order MPI numbered them in: here MPI rank 0 runs on n2
    and becomes global rank 1. Its GPU's sign must still reach global rank 0 (MPI rank 1), the one that writes
    metrics.jsonl: the gathers root at global rank 0's MPI rank, not MPI's rank 0. Two emulated nodes under one
    mpirun (its MPMD form gives each rank its own SLURMD_NODENAME)."""
    import sys

    from hpcscale.launch.local import local_env

    job = tmp_path / "job.yaml"
    job.write_text(
        yaml.safe_dump(
            {
                "name": "renumbered",
                "site": "localcluster",
                "nodes": 2,
                "tasks_per_node": 1,
                "metrics": {"timing_every": 2},
                "health": {"poll_seconds": 0.01},
                "checkpoint": {"every_steps": 0},
                "train": {"entry": "builtin", "params": {"steps": 12}},
            }
        )
    )
    run = tmp_path / "run"
    made = run_cli("submit", str(job), "--run-dir", str(run), "--dry-run", env=local_cluster)  # the run directory
    assert made.returncode == 0, made.stderr
    env = {**os.environ, **local_cluster, **local_env(), "HPCSCALE_DEVICE_SIGN": "ecc@3:1"}
    rank = [sys.executable, "-m", "hpcscale", "launch", "--run-dir", str(run)]
    out = subprocess.run(
        [mpi, "--oversubscribe", "--bind-to", "none", "-n", "1", "-x", "SLURMD_NODENAME=n2", *rank,
         ":", "-n", "1", "-x", "SLURMD_NODENAME=n1", *rank],
        env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    (begin,) = [e for e in _events(run) if e["event"] == "begin"]
    assert begin["nodes"] == ["n1", "n2"]  # global rank 1 (the sign's) is on n2: MPI's rank 0
    # the injected sign, logged once by global rank 0; the scheduler's own signs for the cluster's nodes (a node
    # another test drained a moment ago) may be logged beside it, and are not this test's
    rows = [row for row in _rows(run) if "health" in row]
    injected = [s for row in rows for s in row["health"] if str(s.get("evidence", "")).startswith("rank 1: injected")]
    assert len(injected) == 1 and injected[0]["node"] == "n2", rows
    assert len([line for line in (run / "timing.jsonl").read_text().splitlines() if line]) == 6
