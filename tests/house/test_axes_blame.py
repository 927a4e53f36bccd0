"""Every mesh axis, dp_shard and dp_replicate included, is rebuilt from an attempt's record and blamed right.

An NCCL timeout names its group by the mesh axis (`mesh_dp_shard`, `mesh_dp_replicate`, the flattened `mesh_dp`,
...). The late rank is a member of the reporters' groups that did not report, so the members must be the ones
torch's init_device_mesh put in that group: checked here against a brute-force enumeration of the mesh and
against the groups hpcscale.parallel.mesh.build_mesh really builds (on torch's fake process group, one rank at
a time in this process), then through crafted watchdog lines and the begin record `resume` reads.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from hpcscale.errors import BadInput
from hpcscale.launch.failure import rank_failure
from hpcscale.launch.nccl_failure import describe_nccl_timeouts, nccl_timeouts
from hpcscale.layout import ParallelDims
from hpcscale.recovery.resume import rank_nodes

layouts = st.builds(
    lambda pp, replicate, shard, tp: ParallelDims(pp=pp, dp=replicate * shard, tp=tp, dp_shard=shard),
    st.integers(1, 3),
    st.integers(1, 3),
    st.integers(1, 4),
    st.integers(1, 3),
)


def _brute_force_groups(dims: ParallelDims, rank: int) -> dict[str, list[int]]:
    """Each axis's group of `rank`, read off the mesh as init_device_mesh lays it: ranks 0..N-1 in row-major
    order over the mesh's shape (pp slowest, tp fastest); a group is the line through `rank` along its axis."""
    shape = {"pp": dims.pp, "dp_replicate": dims.dp_replicate, "dp_shard": dims.dp_shard, "tp": dims.tp}
    mesh = np.arange(dims.world_size).reshape(tuple(shape.values()))
    at = [int(i[0]) for i in np.nonzero(mesh == rank)]
    out = {}
    for k, axis in enumerate(shape):
        line = list(at)
        line[k] = slice(None)
        out[axis] = sorted(int(r) for r in mesh[tuple(line)])
    flat = mesh.reshape(dims.pp, dims.dp, dims.tp)  # dp: dp_replicate x dp_shard flattened
    out["dp"] = sorted(int(r) for r in flat[at[0], :, at[3]])
    return out


@settings(max_examples=200, deadline=None)
@given(layouts, st.data())
def test_every_axis_group_is_the_line_of_the_mesh_through_the_rank(dims, data):
    rank = data.draw(st.integers(0, dims.world_size - 1))
    want = _brute_force_groups(dims, rank)
    for axis in ("pp", "dp", "tp", *(("dp_replicate", "dp_shard") if dims.sharded else ())):
        assert dims.group(rank, axis) == want[axis], axis


@settings(max_examples=30, deadline=None)
@given(dims=layouts.filter(lambda d: d.world_size <= 24), data=st.data())
def test_the_groups_are_the_ones_build_mesh_makes(fake_backend_mesh, dims, data):
    """torch's own groups (fake backend: no communication) for one rank: members and the description NCCL's
    watchdog logs."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    rank = data.draw(st.integers(0, dims.world_size - 1))
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=dims.world_size)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's notice about slicing the flattened dp out of the root mesh
            mesh = fake_backend_mesh.build_mesh(device_type="cpu", backend="fake", dims=dims, timeout_s=60)
            for axis in (*dims.mesh_axes, "dp"):
                group = mesh[axis].get_group()
                assert group.group_desc == f"mesh_{axis}"
                assert dist.get_process_group_ranks(group) == dims.group(rank, axis), axis
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def fake_backend_mesh():
    """hpcscale.parallel.mesh with group options the fake backend takes (it has no gloo or NCCL options)."""
    import hpcscale.parallel.mesh as mesh

    mp = pytest.MonkeyPatch()
    mp.setattr(mesh, "group_options", lambda backend, timeout_s: None)
    yield mesh
    mp.undo()


@given(layouts)
def test_a_recorded_layout_reads_back_whole(dims):
    assert ParallelDims.from_dict(dims.as_dict()) == dims


@pytest.mark.parametrize(
    "record",
    [None, [1, 2], {"pp": 1, "dp": 2}, {"pp": 1, "dp": 2, "tp": "1"}, {"pp": 1, "dp": 2, "tp": 1, "dp_shard": 2.0}],
)
def test_what_is_not_a_recorded_layout_is_refused(record):
    with pytest.raises(BadInput):
        ParallelDims.from_dict(record)


# ---- watchdog lines of sharded jobs -----------------------------------------------------------------------

LINE = (
    "[rank{g}]:[E1125 10:00:00.426415540 ProcessGroupNCCL.cpp:632] [PG ID 4 PG GUID 9({group}) Rank {r}] "
    "Watchdog caught collective operation timeout: WorkNCCL(SeqNum=40, OpType={op}, NumelIn=4096, "
    "NumelOut=8192, Timeout(ms)=600000) ran for 600020 milliseconds before timing out."
)


def _line(dims: ParallelDims, rank: int, axis: str, op: str = "ALLREDUCE") -> str:
    return LINE.format(g=rank, group=f"mesh_{axis}", r=dims.group(rank, axis).index(rank), op=op)


# HSDP on 2 nodes x 4 ranks: tp = 2 inside a node, dp_shard = 2, dp_replicate = 2 (rank = dp * 2 + tp)
HSDP = ParallelDims(pp=1, dp=4, tp=2, dp_shard=2)
HSDP_NODES = ["a"] * 4 + ["b"] * 4
HSDP_BEGIN = {"event": "begin", "job_id": "9", "nodes": ["a", "b"], "world_size": 8, "layout": HSDP.as_dict()}


def test_resume_keeps_dp_shard_from_the_begin_record():
    dims, placement = rank_nodes([HSDP_BEGIN], "9")
    assert dims == HSDP and dims.dp_shard == 2 and dims.dp_replicate == 2
    assert placement == HSDP_NODES


def test_an_hsdp_timeout_blames_the_rank_missing_from_the_shard_and_replicate_groups():
    # rank 5 (node b; replica 1, shard 0, tp 1) is stuck: its shard peer 7 waits in an all-gather, its
    # replicate peer 1 (node a) in the gradient all-reduce; srun's kill reaches everyone else first
    assert HSDP.group(5, "dp_shard") == [5, 7] and HSDP.group(5, "dp_replicate") == [1, 5]
    lines = [_line(HSDP, 7, "dp_shard", "_ALLGATHER_BASE"), _line(HSDP, 1, "dp_replicate")]
    dims, placement = rank_nodes([HSDP_BEGIN], "9")
    line, nodes = rank_failure(lines, dims=dims, placement=placement)
    assert nodes == ["b"], line
    assert "rank(s) 5 on node(s) b never reached it" in line


def test_a_replicate_group_across_nodes_blames_the_other_node():
    # rank 2 (node a; replica 0, shard 1) never reaches HSDP's all-reduce: rank 6 on node b gives up
    lines = [_line(HSDP, 6, "dp_replicate")]
    report = describe_nccl_timeouts(nccl_timeouts(lines), dims=HSDP, rank_nodes=HSDP_NODES)
    assert (report.blamed_ranks, report.blamed_nodes) == ([2], ["a"])
    assert "on mesh_dp_replicate" in report.line


def test_a_zero3_job_blames_through_its_shard_group_and_the_flattened_dp():
    # pp = 2, dp = dp_shard = 4 (ZeRO-3), 4 nodes x 2 ranks: rank 3 stuck in stage 0
    dims = ParallelDims(pp=2, dp=4, tp=1, dp_shard=4)
    nodes = [n for n in "wxyz" for _ in range(2)]
    shard = [_line(dims, r, "dp_shard", "_REDUCE_SCATTER_BASE") for r in (0, 1, 2)]
    report = describe_nccl_timeouts(nccl_timeouts(shard), dims=dims, rank_nodes=nodes)
    assert (report.blamed_ranks, report.blamed_nodes) == ([3], ["x"])
    flat = [_line(dims, r, "dp") for r in (0, 1, 2)]  # the same ranks, on the flattened group
    report = describe_nccl_timeouts(nccl_timeouts(flat), dims=dims, rank_nodes=nodes)
    assert (report.blamed_ranks, report.blamed_nodes) == ([3], ["x"])


def test_a_shard_group_every_member_reported_blames_no_node():
    lines = [_line(HSDP, r, "dp_shard") for r in (4, 6)]
    report = describe_nccl_timeouts(nccl_timeouts(lines), dims=HSDP, rank_nodes=HSDP_NODES)
    assert report.blamed_nodes == [] and "suspect the network" in report.line


def test_a_shard_axis_the_job_did_not_have_blames_no_node():
    # an unsharded job's mesh has no dp_shard or dp_replicate groups: a line naming one is not hpcscale's mesh
    dims = ParallelDims(pp=1, dp=4, tp=1)
    for axis in ("dp_shard", "dp_replicate"):
        lines = [LINE.format(g=0, group=f"mesh_{axis}", r=0, op="ALLREDUCE")]
        report = describe_nccl_timeouts(nccl_timeouts(lines), dims=dims, rank_nodes=["a", "a", "b", "b"])
        assert report.blamed_nodes == [] and "not in the logs" in report.line


@settings(max_examples=200, deadline=None)
@given(layouts, st.data())
def test_the_one_missing_member_of_any_group_is_blamed(dims, data):
    axis = data.draw(st.sampled_from([*dims.mesh_axes, "dp"]))
    late = data.draw(st.integers(0, dims.world_size - 1))
    others = [r for r in dims.group(late, axis) if r != late]
    report = describe_nccl_timeouts(
        nccl_timeouts([_line(dims, r, axis) for r in others]),
        dims=dims,
        rank_nodes=[f"n{r}" for r in range(dims.world_size)],
    )
    if others:
        assert (report.blamed_ranks, report.blamed_nodes) == ([late], [f"n{late}"])
    else:
        assert report is None
