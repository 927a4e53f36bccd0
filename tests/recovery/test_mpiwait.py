"""MPI collectives that wait asleep (hpcscale.launch.mpiwait), on real MPI ranks: a rank waiting seconds for a
peer, as ranks wait for the slowest one's torch import at start, costs next to no CPU, where MPI's own blocking
call polls its progress engine the whole time; the collectives still deliver, and a bounded wait gives up."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import REPO

WAIT_S = 2.0


def test_a_rank_waiting_for_a_slow_peer_sleeps_and_the_collectives_deliver(mpi):
    env = {**os.environ, "OMPI_MCA_btl": "self,tcp", "OMPI_ALLOW_RUN_AS_ROOT": "1",
           "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}  # fmt: skip
    helper = REPO / "tests" / "helpers" / "mpiwait_ranks.py"
    out = subprocess.run(["mpirun", "-n", "2", "--oversubscribe", sys.executable, str(helper), str(WAIT_S)],
                         capture_output=True, text=True, env=env, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    reports = {r["rank"]: r for r in (json.loads(line) for line in out.stdout.splitlines() if line.startswith("{"))}
    assert sorted(reports) == [0, 1], out.stdout
    waiter = reports[1]
    assert waiter["timed_out"] is False  # arrive(timeout_s) gave up while rank 0 slept
    for call in ("bcast", "allgather", "gather", "allreduce"):
        # asleep: a few hundred polls in 2 s (about 0.02 s of CPU here); spinning takes most of the 2 s
        assert waiter["cpu"][call] < 0.25 * WAIT_S, (call, waiter["cpu"])
    # MPI's own bcast, waiting as long, polls the whole time: always more CPU, even when load leaves it less than
    # a core
    assert waiter["cpu"]["bcast"] < waiter["cpu"]["mpi_bcast"], waiter["cpu"]
