"""The training engine end to end: same seed and global batch give the same per-step losses at every layout,
through mpirun and through srun on the local Slurm cluster; a killed rank ends the job fast, named; signals
stop every rank at the same step."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from conftest import REPO, run_cli, wait_for_job
from trainjobs import PARAMS, grad_norms, job_spec, losses


def _run_local(tmp: Path, *, tp: int, pp: int, ranks: int, dp_shard: int = 1, **params) -> Path:
    run_dir = tmp / "run"
    result = run_cli(
        "run",
        str(job_spec(tmp / "job.yaml", tp=tp, pp=pp, ranks=ranks, dp_shard=dp_shard, **params)),
        "--local",
        "--run-dir",
        str(run_dir),
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return run_dir


@pytest.fixture(scope="module")
def reference_run(mpi, tmp_path_factory) -> Path:
    """One process, no parallelism: the run every layout must reproduce."""
    return _run_local(tmp_path_factory.mktemp("ref"), tp=1, pp=1, ranks=1)


@pytest.fixture(scope="module")
def reference(reference_run) -> list[float]:
    """The single process's losses."""
    ref = list_losses(reference_run)
    assert len(ref) == PARAMS["steps"]
    assert ref[-1] < ref[0] - 0.5  # it learns
    return ref


def list_losses(run: Path) -> list[float]:
    return list(losses(run).values())


def _assert_same(losses: list[float], reference: list[float]) -> None:
    assert len(losses) == len(reference)
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, reference, strict=True))
    assert worst <= 1e-5, f"max relative difference {worst:.2e}"


@pytest.mark.parametrize(
    ("tp", "pp", "ranks", "schedule", "dp_shard"),
    [
        (2, 2, 8, "1f1b", 1),
        (2, 1, 4, "1f1b", 1),
        (1, 2, 4, "1f1b", 1),
        (1, 2, 4, "gpipe", 1),
        (1, 4, 4, "1f1b", 1),
        (1, 1, 4, "1f1b", 1),
        (1, 1, 4, "1f1b", 4),
        (1, 1, 4, "1f1b", 2),
        (2, 1, 4, "1f1b", 2),
        (1, 2, 4, "1f1b", 2),
    ],
    ids=[
        "tp2-pp2-dp2",
        "tp2-dp2",
        "pp2-dp2",
        "pp2-dp2-gpipe",
        "pp4",
        "dp4",
        "dp_shard4",
        "hsdp2x2",
        "tp2-dp_shard2",
        "pp2-dp_shard2",
    ],
)
def test_layout_reproduces_single_process_losses(reference, reference_run, tmp_path, tp, pp, ranks, schedule, dp_shard):
    run = _run_local(tmp_path, tp=tp, pp=pp, ranks=ranks, schedule=schedule, dp_shard=dp_shard)
    _assert_same(list_losses(run), reference)
    # the gradients themselves, not only what AdamW and clipping make of them (both hide a constant factor:
    # pp x dp once averaged undivided micro-batch gradients, n_micro times too large)
    _assert_same(grad_norms(run), grad_norms(reference_run))


def test_srun_on_the_local_cluster_reproduces_the_losses(reference, local_cluster, tmp_path):
    """hpcscale submit -> sbatch -> srun --mpi=pmix -> hpcscale launch on 2 emulated nodes (tp=2 inside a node)."""
    job = job_spec(tmp_path / "job.yaml", tp=2, pp=1, ranks=4, site="localcluster", nodes=2)
    run_dir = tmp_path / "run"
    sub = json.loads(run_cli("submit", str(job), "--run-dir", str(run_dir), "--json").stdout)
    state = wait_for_job(sub["job_id"], local_cluster, timeout=400)
    log = "\n".join(p.read_text() for p in (run_dir / "logs").glob("*"))
    assert state == "COMPLETED", log[-3000:]
    _assert_same(list_losses(run_dir), reference)
    assert "backend gloo" in log


def _wait_for_steps(run_dir: Path, n: int, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (run_dir / "metrics.jsonl").exists() and len(list_losses(run_dir)) >= n:
            return
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        time.sleep(0.5)
    raise AssertionError(f"fewer than {n} steps after {timeout}s")


def _rank_pids(run_dir: Path) -> list[int]:
    """The rank processes (mpirun's own command line names the same arguments: leave it out)."""
    out = subprocess.run(["pgrep", "-f", f"hpcscale launch --run-dir {run_dir}"], capture_output=True, text=True)
    pids = [int(p) for p in out.stdout.split()]
    return [p for p in pids if Path(f"/proc/{p}/comm").read_text().startswith("python")]


def _start(tmp_path: Path, **params) -> tuple[subprocess.Popen, Path]:
    run_dir = tmp_path / "run"
    job = job_spec(tmp_path / "job.yaml", tp=2, pp=2, ranks=4, steps=100000, **params)
    proc = subprocess.Popen(
        ["hpcscale", "run", str(job), "--local", "--run-dir", str(run_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=REPO,
    )
    return proc, run_dir


def test_killed_rank_ends_the_job_fast_and_is_named(mpi, tmp_path):
    proc, run_dir = _start(tmp_path)
    try:
        _wait_for_steps(run_dir, 3, proc)
        pids = _rank_pids(run_dir)
        assert len(pids) == 4
        killed_at = time.monotonic()
        os.kill(pids[2], signal.SIGKILL)
        out, _ = proc.communicate(timeout=60)  # timeout_seconds is 60: the job must not wait for it
        elapsed = time.monotonic() - killed_at
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1
    assert elapsed < 30, f"took {elapsed:.0f}s to notice"
    assert "killed by signal 9" in out or "exited on signal 9" in out, out[-2000:]
    assert "rank" in out.splitlines()[-1] or "rank" in out[-500:]


def test_signal_stops_every_rank_at_the_same_step(mpi, tmp_path):
    proc, run_dir = _start(tmp_path)
    try:
        _wait_for_steps(run_dir, 3, proc)
        os.kill(_rank_pids(run_dir)[1], signal.SIGUSR1)  # one rank only: the others must follow it
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 75, out[-2000:]
    assert "stop requested: stopping after step" in out
    last = list_losses(run_dir)
    stopped_at = int(out.split("stop requested: stopping after step")[1].split()[0])
    assert len(last) == stopped_at + 1  # rank 0 logged exactly the steps all ranks completed


def test_user_entry_point_gets_a_context(mpi, tmp_path):
    spec = {
        "name": "user",
        "site": "local",
        "tasks_per_node": 4,
        "parallel": {"tp": 2},
        "timeout_seconds": 77,
        "environment": {"PYTHONPATH": str(REPO / "tests" / "helpers"), "NCCL_SOCKET_IFNAME": "lo"},
        "train": {"entry": "user_entry:main", "params": {"anything": [1, 2]}},
    }
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec))
    result = run_cli("run", str(tmp_path / "job.yaml"), "--local", "--run-dir", str(tmp_path / "run"), timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    ranks = [json.loads((tmp_path / "run" / f"rank{r}.json").read_text()) for r in range(4)]
    assert [r["coords"] for r in ranks] == [[0, 0, 0], [0, 0, 1], [0, 1, 0], [0, 1, 1]]
    assert all(r["dims"] == [1, 2, 2] and r["mesh_dims"] == ["pp", "dp", "tp"] for r in ranks)
    assert all(r["rank_sum"] == 6.0 and r["dp_group_size"] == 2.0 for r in ranks)
    assert all(r["backend"] == "gloo" and r["device"] == "cpu" and r["stop"] is False for r in ranks)
    assert ranks[0]["params"] == {"anything": [1, 2]}
    assert [r["local_rank"] for r in ranks] == [0, 1, 2, 3]
    # every group the mesh and the checkpoints use has the job's timeout, not the backend's default (30 min)
    assert all(r["group_timeouts"] == {"pp": 77.0, "dp": 77.0, "tp": 77.0} for r in ranks)
    assert all(r["ckpt_group_timeout"] == 1800.0 for r in ranks)  # a save may wait on a slow filesystem longer
    # torchrun's variables for user code; gloo follows the interface the site chose for NCCL
    for r in ranks:
        env = r["env"]
        assert (env["RANK"], env["WORLD_SIZE"]) == (str(r["rank"]), "4")
        assert (env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == (str(r["local_rank"]), "4")
        assert env["MASTER_ADDR"] == "127.0.0.1" and int(env["MASTER_PORT"]) > 0
        assert env["GLOO_SOCKET_IFNAME"] == "lo"
