"""scripts/localcluster trusts a pid file only when the process it names is the daemon that wrote it: its name and
the files it was started with. Pid files under /var/tmp outlive a restart, and their pids come back held by
other processes, other daemons of ours among them (after a restart, local2's slurmd-n2.pid named local1's slurmd
n1: `up` took it for local2's and left local2's n2 down, and `down --cluster local2` would have stopped local1's).
Decoys stand in for the daemons (a process that names itself slurmd), under a cluster root of the test's own."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from conftest import REPO

SCRIPT = REPO / "scripts" / "localcluster"
_DECOY = "import sys, time; open('/proc/self/comm', 'w').write(sys.argv[1]); time.sleep(120)"


def _decoy(comm: str, *args: str) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", _DECOY, comm, *args])
    for _ in range(100):  # until it has taken its name
        if Path(f"/proc/{p.pid}/comm").read_text().strip() == comm:
            return p
        time.sleep(0.05)
    raise AssertionError("the decoy never renamed itself")


def _script(root: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HPCSCALE_CLUSTER_ROOT": str(root)}
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=60)


def test_a_pid_file_naming_the_other_clusters_slurmd_is_stale_and_down_leaves_that_daemon_alone(tmp_path):
    run = tmp_path / "local2" / "run"
    run.mkdir(parents=True)
    other = _decoy("slurmd", "-f", str(tmp_path / "local1" / "slurm.conf"), "-N", "n1")  # local1's n1
    ours = _decoy("slurmd", "-f", str(tmp_path / "local2" / "slurm.conf"), "-N", "n3")  # local2's own n3
    ctld = _decoy("slurmctld", "-f", str(tmp_path / "local1" / "slurm.conf"))  # local1's controller
    try:
        (run / "slurmd-n2.pid").write_text(f"{other.pid}\n")
        (run / "slurmd-n3.pid").write_text(f"{ours.pid}\n")
        (run / "slurmd-n4.pid").write_text(f"{ours.pid}\n")  # the right cluster, another node
        (run / "slurmctld.pid").write_text(f"{ctld.pid}\n")
        status = _script(tmp_path, "status", "--cluster", "local2")
        assert status.returncode == 1, status.stderr  # something is stopped, and sinfo is not asked
        assert "sinfo" not in status.stderr
        lines = status.stdout.splitlines()
        assert "slurmctld: stopped (local2)" in lines
        assert "slurmd n2: stopped" in lines and "slurmd n4: stopped" in lines
        assert "slurmd n3: running" in lines
        reaper = threading.Thread(target=ours.wait)  # a daemon's parent is init, which reaps it at once
        reaper.start()
        down = _script(tmp_path, "down", "--cluster", "local2")
        assert down.returncode == 0, down.stderr
        assert "stopped slurmd n3 of local2" in down.stderr
        assert other.poll() is None and ctld.poll() is None  # the other cluster's daemons live on
        reaper.join(timeout=15)
        assert ours.returncode == -15  # local2's own n3 was stopped, by SIGTERM
        assert not any(run.glob("*.pid"))  # stale files gone with it
    finally:
        for p in (other, ours, ctld):
            p.kill()
            p.wait()
