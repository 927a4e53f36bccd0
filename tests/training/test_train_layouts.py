"""The training engine end to end: same seed and global batch give the same per-step losses at every layout,
through mpirun and through srun on the local Slurm cluster; a killed rank ends the job fast, named; signals
stop every rank at the same step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from conftest import REPO, run_cli, wait_for_job
from trainjobs import PARAMS, grad_norms, job_spec, losses

# the layout matrix trains 10 of the reference's 20 steps: a tp step costs 0.14-0.19 s of CPU per rank here
LAYOUT_STEPS = 10


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


def _assert_reproduces(run: Path, reference: list[float], reference_run: Path, *, steps: int | None = None) -> None:
    """RUN's losses are the reference's (its first `steps`, where the run trained fewer)."""
    steps = steps or len(reference)
    _assert_same(list_losses(run), reference[:steps])
    # the gradients themselves, not only what AdamW and clipping make of them (both hide a constant factor:
    # pp x dp once averaged undivided micro-batch gradients, n_micro times too large)
    _assert_same(grad_norms(run), grad_norms(reference_run)[:steps])


def test_the_shared_tp2_pp2_dp2_run_reproduces_single_process_losses(reference, reference_run, run_2x2x2):
    """tp=2, pp=2, dp=2 (8 ranks, 1F1B): the same job as the checkpoint tests' shared run, so that run is read.
    Named here as a fixture, not fetched inside the test, so that this module's tests join the worker that
    builds it (tests/conftest.py) instead of building a second one."""
    _assert_reproduces(run_2x2x2, reference, reference_run)


def test_the_shared_pp2_dp2_run_reproduces_single_process_losses(reference, reference_run, run_pp2_dp2):
    """pp=2, dp=2 (4 ranks, 1F1B): the stop-and-resume test's uninterrupted run (tests/ckpt/test_ckpt.py)."""
    _assert_reproduces(run_pp2_dp2, reference, reference_run)


@pytest.mark.parametrize(
    ("tp", "pp", "ranks", "schedule", "dp_shard"),
    [
        (2, 1, 4, "1f1b", 1),
        (1, 2, 2, "gpipe", 1),
        (1, 4, 4, "1f1b", 1),
        (1, 1, 4, "1f1b", 4),
        (1, 1, 4, "1f1b", 2),
        (2, 1, 4, "1f1b", 2),
        (1, 2, 4, "1f1b", 2),
    ],
    ids=[
        "tp2-dp2",
        "pp2-gpipe",
        "pp4",
        "dp_shard4",
        "hsdp2x2",
        "tp2-dp_shard2",
        "pp2-dp_shard2",
    ],
)
def test_layout_reproduces_single_process_losses(reference, reference_run, tmp_path, tp, pp, ranks, schedule, dp_shard):
    """The first LAYOUT_STEPS of the reference's steps: each step is the same computation (the same schedule,
    no data wrap, no evaluation in the 20), and the shared runs above compare all 20 at 8 and 4 ranks."""
    run = _run_local(tmp_path, tp=tp, pp=pp, ranks=ranks, schedule=schedule, dp_shard=dp_shard, steps=LAYOUT_STEPS)
    _assert_reproduces(run, reference, reference_run, steps=LAYOUT_STEPS)


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
