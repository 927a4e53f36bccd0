"""The CUDA/NCCL path, where this machine (no GPU) can prove it: which GPU a rank takes and when it refuses,
NCCL's timeout reports read back into a diagnosis, the numerics a GPU job asks for, and the RNG round trip.

What only a GPU proves (the copy stream of an async save, NCCL's eager init, clocks settled on streams) is
exercised by `hpcscale smoke` on a GPU node (docs/training.md)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hpcscale.launch.bootstrap import DeviceChoiceError, choose_gpu, duplicate_gpus
from hpcscale.launch.failure import rank_failure
from hpcscale.launch.nccl_failure import NcclTimeout, describe_nccl_timeouts, nccl_timeouts
from hpcscale.layout import ParallelDims
from hpcscale.recovery.resume import rank_nodes

# ---- which GPU a rank takes -------------------------------------------------------------------------------


def test_each_rank_takes_its_local_rank_when_it_sees_every_gpu():
    assert [choose_gpu(local_rank=r, local_size=8, visible=8, node="n1") for r in range(8)] == list(range(8))
    assert choose_gpu(local_rank=3, local_size=4, visible=8, node="n1") == 3  # fewer ranks than GPUs


def test_a_rank_bound_to_one_gpu_takes_it():
    # srun --gpus-per-task=1: CUDA_VISIBLE_DEVICES differs per rank and each sees device 0 only
    assert [choose_gpu(local_rank=r, local_size=8, visible=1, node="n1") for r in range(8)] == [0] * 8


def test_no_gpu_means_the_cpu():
    assert choose_gpu(local_rank=0, local_size=4, visible=0, node="n1") is None


def test_ranks_that_would_share_a_gpu_are_refused_with_the_fix():
    # the old rule (local_rank % device_count) put ranks 0 and 4 on GPU 0 here
    with pytest.raises(DeviceChoiceError) as e:
        choose_gpu(local_rank=5, local_size=8, visible=4, node="n7")
    assert "node n7 runs 8 ranks but each sees 4 GPUs" in str(e.value)
    assert "tasks_per_node" in str(e.value) and "--gpus-per-task=1" in str(e.value)


def test_two_ranks_on_one_gpu_uuid_are_named():
    seen = [("n1", 0, "GPU-a"), ("n1", 1, "GPU-b"), ("n2", 2, "GPU-a"), ("n2", 3, "GPU-a")]
    problem = duplicate_gpus(seen)
    assert problem is not None and "ranks 2 and 3 on node n2 both use GPU GPU-a" in problem
    assert duplicate_gpus([("n1", 0, "GPU-a"), ("n2", 1, "GPU-a"), ("n1", 2, "")]) is None  # other nodes; CPU


def test_ranks_split_between_gpus_and_the_cpu_are_refused():
    from hpcscale.launch.bootstrap import mixed_devices

    problem = mixed_devices([("n1", 0, "GPU-a"), ("n1", 1, "GPU-b"), ("n2", 2, ""), ("n2", 3, "")])
    assert problem is not None and "2 rank(s) found a GPU and 2 did not: rank(s) 2 (n2), 3 (n2) see none" in problem
    assert mixed_devices([("n1", 0, ""), ("n2", 1, "")]) is None
    assert mixed_devices([("n1", 0, "GPU-a"), ("n2", 1, "GPU-a")]) is None


def test_gloo_takes_nccls_interface_only_when_it_names_interfaces_that_exist():
    from hpcscale.launch.bootstrap import gloo_interfaces

    present = {"lo", "eth0", "ib0"}
    assert gloo_interfaces("eth0", present) == "eth0"
    assert gloo_interfaces("=ib0,eth0", present) == "ib0,eth0"
    for nccl in ("^lo,docker0", "ib", "eth1", ""):  # an exclusion, a prefix, an absent name: gloo would fail
        assert gloo_interfaces(nccl, present) is None


@given(st.lists(st.tuples(st.sampled_from(["n1", "n2"]), st.integers(0, 7), st.sampled_from(["", "u1", "u2"]))))
def test_duplicate_gpus_flags_exactly_shared_uuids(seen):
    owners: dict = {}
    for node, rank, uuid in seen:
        if uuid:
            owners.setdefault((node, uuid), set()).add(rank)
    shared = any(len(ranks) > 1 for ranks in owners.values())
    assert (duplicate_gpus(seen) is not None) == shared


# ---- a GPU job never trains on the CPU silently --------------------------------------------------------------


def _site(tmp_path, gpus: int) -> str:
    site = tmp_path / "gpusite.yaml"
    site.write_text(
        "name: gpusite\nscheduler: slurm\npartitions:\n"
        f"  - {{name: gpu, nodes: 'g[1-4]', cpus_per_node: 64, gpus_per_node: {gpus}, default: true}}\n"
        "topology: {source: file, switches: [{name: s1, nodes: 'g[1-4]'}]}\n"
        "filesystems: {scratch: /tmp/s, run_root: /tmp/r}\n"
    )
    return str(site)


def test_a_job_on_a_gpu_partition_that_requests_no_gpus_is_refused(tmp_path):
    from conftest import run_cli

    job = tmp_path / "job.yaml"
    job.write_text(f"name: j\nsite: {_site(tmp_path, 8)}\ntasks_per_node: 4\ntrain: {{entry: builtin}}\n")
    result = run_cli("config", "validate", str(job))
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"{job}:1: gpus_per_node:" in result.stderr
    assert "has 8 GPUs per node and the job requests none" in result.stderr
    job.write_text(job.read_text() + "device: cpu\n")  # on purpose: accepted
    assert run_cli("config", "validate", str(job)).returncode == 0


def test_device_cuda_on_a_cpu_partition_is_refused(tmp_path):
    from conftest import run_cli

    job = tmp_path / "job.yaml"
    job.write_text(f"name: j\nsite: {_site(tmp_path, 0)}\ndevice: cuda\ntrain: {{entry: builtin}}\n")
    result = run_cli("config", "validate", str(job))
    assert result.returncode == 2 and f"{job}:3: device: device is cuda but" in result.stderr


# ---- NCCL's watchdog aborts: read back into a diagnosis ----------------------------------------------------

# torch's ProcessGroupNCCL lines, as torch 2.x writes them (the global rank in the log prefix)
NCCL_LINE = (
    "[rank{g}]:[E1125 10:00:00.426415540 ProcessGroupNCCL.cpp:632] [PG ID 2 PG GUID 5(mesh_dp) Rank {r}] "
    "Watchdog caught collective operation timeout: WorkNCCL(SeqNum=12, OpType=ALLREDUCE, NumelIn=4096, "
    "NumelOut=4096, Timeout(ms)=300000) ran for 300081 milliseconds before timing out."
)
OLD_NCCL_LINE = (
    "[rank0]:[E1218 20:27:21.426415540 ProcessGroupNCCL.cpp:629] [Rank 0] Watchdog caught collective operation "
    "timeout: WorkNCCL(SeqNum=1, OpType=BROADCAST, NumelIn=131072000, NumelOut=131072000, Timeout(ms)=600000) "
    "ran for 600081 milliseconds before timing out."
)


def test_nccl_timeout_lines_parse_in_both_formats():
    t = NcclTimeout.parse(NCCL_LINE.format(g=3, r=1))
    assert t == NcclTimeout(rank=3, global_rank=True, group="mesh_dp", seq=12, op="ALLREDUCE", timeout_s=300.0)
    old = NcclTimeout.parse(OLD_NCCL_LINE)
    assert old is not None and (old.rank, old.group, old.op, old.timeout_s) == (0, None, "BROADCAST", 600.0)


def test_the_rank_that_never_reached_the_collective_is_blamed_with_its_node():
    # 4 ranks on n1, n2 (2 each, placement order n2 then n1), dp = 4: ranks 0, 1, 3 timed out, rank 2 never arrived
    lines = [
        "=== hpcscale: job 7 attempt (restart 0) on n[1-2] at 2026-11-25T10:00:00Z ===",
        *(NCCL_LINE.format(g=g, r=g) for g in (0, 1, 3)),
        "srun: error: n2: tasks 0-1: Aborted (core dumped)",
        "srun: error: n1: task 3: Aborted (core dumped)",
        "srun: error: n1: task 2: Terminated",
    ]
    events = [
        {"event": "begin", "job_id": "7", "nodes": ["n2", "n1"], "world_size": 4, "layout": {"pp": 1, "dp": 4, "tp": 1}}
    ]
    dims, placement = rank_nodes(events, "7")
    assert (dims.as_dict(), placement) == ({"pp": 1, "dp": 4, "tp": 1}, ["n2", "n2", "n1", "n1"])
    line, nodes = rank_failure(lines, dims=dims, placement=placement)
    assert nodes == ["n1"]
    assert line.startswith("NCCL collective timeout: rank(s) 0, 1, 3 gave up on ALLREDUCE #12 on mesh_dp after 300 s")
    assert "rank(s) 2 on node(s) n1 never reached it" in line


def test_a_timeout_in_one_tp_group_blames_only_that_groups_missing_rank():
    # 16 ranks, 2 nodes x 8, tp = 8 inside each node, dp = 2: rank 13 (node b) is stuck; its 7 tp peers time out
    # on mesh_tp and the first SIGABRT makes srun kill everything before node a's ranks write anything
    tp_line = NCCL_LINE.replace("mesh_dp", "mesh_tp")
    lines = [tp_line.format(g=g, r=g - 8) for g in (8, 9, 10, 11, 12, 14, 15)]
    dims = ParallelDims(pp=1, dp=2, tp=8)
    line, nodes = rank_failure(lines, dims=dims, placement=["a"] * 8 + ["b"] * 8)
    assert nodes == ["b"] and "rank(s) 13 on node(s) b never reached it" in line


def test_every_rank_timing_out_blames_the_network_not_a_node():
    lines = [NCCL_LINE.format(g=g, r=g) for g in range(2)]
    line, nodes = rank_failure(lines, dims=ParallelDims(pp=1, dp=2, tp=1), placement=["n1", "n2"])
    assert nodes == [] and "suspect the network between them" in line


def test_without_the_layout_or_with_an_unknown_group_no_node_is_blamed():
    lines = [NCCL_LINE.format(g=0, r=0)]
    assert rank_failure(lines, dims=None, placement=None)[1] == []
    odd = [NCCL_LINE.replace("mesh_dp", "my_group").format(g=0, r=0)]
    line, nodes = rank_failure(odd, dims=ParallelDims(pp=1, dp=2, tp=1), placement=["n1", "n2"])
    assert nodes == [] and "which rank they waited for is not in the logs" in line


def test_aborted_tasks_without_nccl_lines_are_named_and_blamed():
    line, nodes = rank_failure(
        ["srun: error: n3: task 5: Aborted (core dumped)", "srun: error: n1: task 0: Terminated"]
    )
    assert nodes == ["n3"] and "MPI task 5 on node n3 was aborted" in line


@settings(max_examples=300)
@given(st.lists(st.text(max_size=300), max_size=20))
def test_the_nccl_reader_takes_any_text(lines):
    timeouts = nccl_timeouts(lines)
    report = describe_nccl_timeouts(timeouts, dims=ParallelDims(pp=1, dp=2, tp=2), rank_nodes=["a", "b", "c", "d"])
    assert (report is None) == (not timeouts)


@given(st.integers(0, 10**6), st.integers(0, 10**6), st.integers(1, 10**9), st.sampled_from(["ALLREDUCE", "_X1"]))
def test_a_written_nccl_line_reads_back(rank, seq, ms, op):
    line = (
        f"[rank{rank}]:[E1 x.cpp:1] [Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum={seq}, "
        f"OpType={op}, NumelIn=1, NumelOut=1, Timeout(ms)={ms}) ran for {ms + 1} milliseconds before timing out."
    )
    t = NcclTimeout.parse(line)
    assert t is not None and (t.rank, t.seq, t.op, t.timeout_s) == (rank, seq, op, ms / 1000)


# ---- numerics and RNG --------------------------------------------------------------------------------------


def test_rng_states_round_trip():
    from hpcscale.ckpt.rng import restore_rng, rng_problem, rng_state

    torch.manual_seed(5)
    saved = rng_state()
    assert rng_problem(saved) is None
    expected = torch.rand(4)
    torch.rand(100)  # the generator moves on
    restore_rng(saved, torch.device("cpu"))
    assert torch.equal(torch.rand(4), expected)


def test_the_dgx_example_asks_for_the_fast_gpu_numerics_and_a_free_signal():
    import yaml
    from conftest import REPO

    spec = yaml.safe_load((REPO / "docs" / "examples" / "gpt-dgx.yaml").read_text())
    params = spec["train"]["params"]
    assert params["bf16"] and params["tf32"] and params["fused_optimizer"] and params["deterministic"] is False
    assert spec["signals"]["signal"] == "USR2"


def test_clip_sums_on_the_gradients_device_and_matches_torch():
    from hpcscale.parallel.clip import clip_grad_norm

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(7))]
    for p in params:
        p.grad = torch.randn_like(p) * 3
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for c, p in zip(copies, params, strict=True):
        c.grad = p.grad.clone()
    norm = clip_grad_norm(params, 1.0, pp_group=None, device=torch.device("cpu"))
    want = torch.nn.utils.clip_grad_norm_(copies, 1.0)
    assert abs(norm - float(want)) < 1e-5 * float(want)
    for c, p in zip(copies, params, strict=True):
        assert torch.allclose(c.grad, p.grad, rtol=1e-5)


# ---- on the real Slurm cluster -------------------------------------------------------------------------------


def test_an_nccl_abort_on_slurm_is_diagnosed_by_resume_naming_the_late_rank(local_cluster, tmp_path):
    """Slurm, srun's own report of the aborted tasks, the logs and `resume --dry-run` are real; the ranks end as
    NCCL's watchdog ends them (its line, then SIGABRT), which only a GPU can produce for real."""
    import json

    import yaml
    from conftest import REPO, run_cli, wait_for_job

    spec = {
        "name": "nccl-abort",
        "site": "localcluster",
        "nodes": 2,
        "tasks_per_node": 2,
        "timeout_seconds": 30,
        "signals": {"requeue": False},
        "environment": {"PYTHONPATH": str(REPO / "tests" / "helpers")},
        "train": {"entry": "nccl_abort_entry:main"},
    }
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec))
    run = tmp_path / "run"
    submitted = run_cli("submit", str(tmp_path / "job.yaml"), "--run-dir", str(run), "--json", env=local_cluster)
    assert submitted.returncode == 0, submitted.stderr
    job_id = json.loads(submitted.stdout)["job_id"]
    assert wait_for_job(job_id, local_cluster, timeout=180) == "FAILED"
    result = run_cli("resume", str(run), "--dry-run", "--json", env=local_cluster)
    assert result.returncode == 0, result.stdout + result.stderr
    plan = json.loads(result.stdout)
    said = plan["diagnosis"]["rank_failure"]
    begin = next(json.loads(line) for line in (run / "attempts.jsonl").read_text().splitlines())
    late_node = begin["nodes"][-1]  # rank 3: the last node in placement order
    assert said.startswith("NCCL collective timeout: rank(s) 0, 1, 2 gave up on ALLREDUCE #3 on mesh_dp after 20 s")
    assert f"rank(s) 3 on node(s) {late_node} never reached it" in said
    assert plan["diagnosis"]["failed_nodes"] == [late_node]
    assert plan["exclude"] == [late_node]


def test_smoke_runs_its_cpu_half_on_the_slurm_cluster_and_says_what_it_skipped(local_cluster, tmp_path):
    import json

    from conftest import REPO, run_cli

    # The emulated nodes declare 4 cores each to Slurm, and the smoke test gives each of a node's 2 ranks half of
    # them (OMP_NUM_THREADS=2); the 4 nodes share this host's cores, where 8 spinning OpenMP threads made its 4
    # steps take seconds each. Here each node has the cores of its share: one thread a rank, and the rule
    # (cpus_per_task = the node's cores / its ranks) is the same.
    site = tmp_path / "localcluster.yaml"
    text = (REPO / "site_configs" / "localcluster.yaml").read_text()
    assert "cpus_per_node: 4\n" in text
    site.write_text(text.replace("cpus_per_node: 4\n", "cpus_per_node: 2\n"))
    result = run_cli("smoke", "--site", str(site), "--run-dir", str(tmp_path / "smoke"), "--json",
                     "--steps", "4", env=local_cluster, timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(result.stdout)
    status = {c["name"]: c["status"] for c in report["checks"]}
    assert status == {
        "devices": "pass",
        "binding": "skip",
        "allreduce": "pass",
        "layout": "pass",
        "traffic": "pass",
        "checkpoint": "pass",
        "resume": "pass",
        "nccl-timeout": "skip",
    }
    assert report["passed"] and report["device"] == "cpu"
    assert report["layout"] == {"nodes": 2, "tasks_per_node": 2, "tp": 2, "pp": 2, "dp": 1}
    checks = {c["name"]: c for c in report["checks"]}
    assert "needs NCCL" in checks["nccl-timeout"]["detail"]
    assert checks["layout"]["figures"]["grad_norm_rel_diff"] <= 1e-5
    # the ledger's bytes per step: tp's all-reduces inside the blocks, the stages' activations over pp
    traffic = checks["traffic"]["figures"]
    assert traffic["mesh_tp"]["kinds"]["all_reduce"]["bytes"] > 0, checks["traffic"]
    assert traffic["mesh_pp"]["kinds"]["send"]["bytes"] > 0, checks["traffic"]
    assert "resumed at step 2" in checks["resume"]["detail"]  # the second of the run's saves (every step)
    ranks = checks["devices"]["figures"]["ranks"]
    assert sorted(r["node"] for r in ranks) == ["n1", "n1", "n2", "n2"] or len({r["node"] for r in ranks}) == 2


def test_smoke_refuses_a_layout_that_does_not_divide_the_ranks(tmp_path):
    from conftest import run_cli

    result = run_cli("smoke", "--local", "-n", "4", "--tp", "3", "--run-dir", str(tmp_path / "s"))
    assert result.returncode == 2 and "tp(3) * pp(1) = 3 does not divide the world size" in result.stderr
    assert not (tmp_path / "s").exists()


def test_a_round_zero_mismatch_in_one_tp_shard_is_refused_by_every_rank_together(mpi, tmp_path):
    """One rank finds θ(0) differs (in its shard only), its peer does not: both refuse, neither hangs in a
    collective the other left (the comparison covers every parameter on every rank, then one all-reduce)."""
    import json
    import os
    import subprocess
    import sys

    from conftest import REPO

    env = {**os.environ, "OMPI_MCA_btl": "self,tcp", "OMPI_ALLOW_RUN_AS_ROOT": "1",
           "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}  # fmt: skip
    helper = REPO / "tests" / "helpers" / "same_start_rank.py"
    out = subprocess.run(
        ["mpirun", "-n", "2", "--oversubscribe", sys.executable, str(helper), str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    lines = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in (0, 1)]
    assert sorted(r["rank"] for r in lines) == [0, 1]
    assert all(
        r["raised"] and r["raised"].startswith("BadInput: xsite.start_from: global round 0 is not") for r in lines
    )


def test_gpu_ranks_that_do_not_fill_the_node_are_warned_about_their_binding(tmp_path):
    from conftest import run_cli

    job = tmp_path / "job.yaml"
    job.write_text(
        f"name: j\nsite: {_site(tmp_path, 8)}\ntasks_per_node: 8\ngpus_per_node: 8\n"
        "train: {entry: builtin, params: {global_batch: 32}}\n"
    )
    result = run_cli("config", "validate", str(job))
    assert result.returncode == 0, result.stderr
    assert "the ranks take 8 of the 64 cores" in result.stderr and "set cpus_per_task: 8" in result.stderr
    job.write_text(job.read_text() + "cpus_per_task: 8\n")
    assert "cores" not in run_cli("config", "validate", str(job)).stderr
