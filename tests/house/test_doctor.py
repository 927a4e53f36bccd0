"""`hpcscale doctor` against the real local cluster, healthy and with its controller stopped."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

from conftest import CLUSTER_ROOT, REPO, run_cli


def _doctor(*args: str) -> tuple[int, dict]:
    result = run_cli("doctor", "--json", *args, timeout=300)
    return result.returncode, json.loads(result.stdout)


def test_all_green_on_the_local_cluster(local_cluster):
    code, report = _doctor("--site", "localcluster")
    statuses = {c["name"]: c["status"] for c in report["checks"]}
    assert statuses == {
        name: "ok"
        for name in [
            "slurm commands",
            "slurm controller",
            "slurm stop and requeue",
            "slurm accounting",
            "mpi launcher",
            "mpi4py",
            "torch",
            "scratch",
            "flock",
            "hdf5",
        ]
    }, report
    assert code == 0 and report["ok"] is True


def test_local_site_checks_mpirun_not_slurm(mpi):
    code, report = _doctor("--site", "local")
    names = [c["name"] for c in report["checks"]]
    assert "slurm controller" not in names
    launcher = next(c for c in report["checks"] if c["name"] == "mpi launcher")
    assert launcher["status"] == "ok" and "mpirun" in launcher["detail"]
    assert code == 0, report


def test_hdf5_is_checked_the_way_checkpoints_open_it(tmp_path: Path, mpi):
    """Without locks, as the checkpoint code opens every HDF5 file, so scratch without flock works too."""
    site = (REPO / "site_configs" / "local.yaml").read_text()
    site = site.replace("/var/tmp/hpcscale/scratch", str(tmp_path / "scratch"))
    (tmp_path / "site.yaml").write_text(site)
    code, report = _doctor("--site", str(tmp_path / "site.yaml"))
    hdf5 = next(c for c in report["checks"] if c["name"] == "hdf5")
    assert hdf5["status"] == "ok" and "without file locking" in hdf5["detail"]
    flock = next(c for c in report["checks"] if c["name"] == "flock")
    assert flock["status"] == "ok" and "never" in flock["detail"]
    assert code == 0, report


def test_stopped_controller_is_reported_with_a_fix(local_cluster):
    pidfile = CLUSTER_ROOT / "local1" / "run" / "slurmctld.pid"
    pid = int(pidfile.read_text())
    os.kill(pid, signal.SIGTERM)
    try:
        for _ in range(100):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        code, report = _doctor("--site", "localcluster")
        ctld = next(c for c in report["checks"] if c["name"] == "slurm controller")
        assert ctld["status"] == "fail"
        assert "DOWN" in ctld["detail"] or "ping" in ctld["detail"].lower() or "answer" in ctld["detail"]
        assert "scripts/localcluster up" in ctld["fix"]
        assert code == 1 and report["ok"] is False
        human = run_cli("doctor", "--site", "localcluster", timeout=300)
        assert human.returncode == 1 and "FAIL" in human.stdout
    finally:
        subprocess.run([str(REPO / "scripts" / "localcluster"), "up"], check=True, capture_output=True, timeout=300)


def test_stop_check_warns_where_a_site_leaves_no_time_to_checkpoint(local_cluster):
    """The check's rules on the local cluster's real `scontrol show config` and partitions, with the preemption
    settings a site may have: suspension (no signal at all) and a GraceTime too short for a save."""
    from hpcscale.doctor import stop_check
    from hpcscale.slurm.client import SlurmClient

    client = SlurmClient(conf=local_cluster["SLURM_CONF"])
    conf, parts = client.config(), client.show("partition")
    assert parts and all("GraceTime" in p for p in parts)
    plain = stop_check(conf, parts)
    assert plain.status == "ok" and "KillWait=5 s" in plain.detail and "waits 10 s" in plain.detail
    preempting = {**conf, "PreemptType": "preempt/partition_prio"}
    suspend = stop_check({**preempting, "PreemptMode": "SUSPEND,GANG"}, parts)
    assert suspend.status == "warn" and "not signalled" in suspend.detail and suspend.fix
    short = stop_check({**preempting, "PreemptMode": "REQUEUE"}, parts)  # GraceTime=0 + KillWait 5 s
    assert short.status == "warn" and "debug 5 s" in short.detail and "GraceTime" in short.fix
    long = stop_check({**preempting, "PreemptMode": "REQUEUE"}, [{**p, "GraceTime": "300"} for p in parts])
    assert long.status == "ok" and "at least 305 s" in long.detail
