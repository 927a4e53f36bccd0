"""One registry of the parallel axes (hpcscale.layout.AXES), and every consumer iterates it.

The seam is proven with a dummy axis: the `dummy_axis` fixture registers one more axis (as context parallelism
would be added: between dp_shard and tp, its degree from `parallel.dummy`) for one test, and each consumer must
carry it without being told: ParallelDims and its records, the mesh's axis names, the checkpoint index's layout
check, NCCL blame's groups, placement and the `topo place` table. Every axis, dp_shard and dp_replicate
included, also round-trips through each consumer with the registry as it is.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import REPO, run_cli
from hypothesis import given, settings
from hypothesis import strategies as st

import hpcscale.layout as layout
from hpcscale.config.job import Parallel
from hpcscale.errors import BadInput
from hpcscale.launch.nccl_failure import describe_nccl_timeouts, nccl_timeouts
from hpcscale.layout import Axis, JobLayout, ParallelDims, layout_problems
from hpcscale.topology.placement import place
from hpcscale.topology.tree import flat_tree

DUMMY = Axis(name="dummy", key="dummy", data_parallel=False)


def _with_dummy() -> tuple[Axis, ...]:
    at = [a.name for a in layout.AXES].index("tp")  # where context parallelism sits: right before tp
    return (*layout.AXES[:at], DUMMY, *layout.AXES[at:])


@pytest.fixture()
def dummy_axis(monkeypatch):
    """The registry with a dummy axis (degree 1 unless a test sets it) for this test only."""
    monkeypatch.setattr(layout, "AXES", _with_dummy())
    return DUMMY


def _nccl_line(rank: int, group: str) -> str:
    return (
        f"[rank{rank}]:[E1125 10:00:00.000 ProcessGroupNCCL.cpp:632] [PG ID 2 PG GUID 5({group}) Rank 0] Watchdog "
        "caught collective operation timeout: WorkNCCL(SeqNum=12, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, "
        "Timeout(ms)=300000) ran for 300012 milliseconds before timing out."
    )


# --- the two places that lost dp_shard -------------------------------------------------------------------------


def _saved_index(tmp_path: Path) -> Path:
    sys.path.insert(0, str(REPO / "tests" / "helpers"))
    import torch
    from ckpt_tamper import save_in_process

    save_in_process(tmp_path / "ckpt", 1, {"w": torch.arange(8, dtype=torch.float32)})
    return tmp_path / "ckpt" / "step-00000001"


def _layout_problems_after(step: Path, record: object) -> str:
    """Verify's verdict on the index with its layout attribute replaced (the digest recomputed, as an attacker
    who knows the format would): what the structure checks alone say ('' when they pass)."""
    from ckpt_tamper import edit_index, reseal

    from hpcscale.ckpt.format import read_index
    from hpcscale.errors import VerificationFailure

    def edit(f) -> None:
        f.attrs["layout"] = json.dumps(record)

    edit_index(step, edit)
    assert reseal(step)
    try:
        read_index(step / "index.h5")
    except VerificationFailure as e:
        return str(e)
    return ""


@pytest.mark.parametrize("dp_shard", [2, "2", 0])
def test_the_index_layout_check_reads_dp_shard(tmp_path, dp_shard):
    """A 1-rank checkpoint whose layout claims dp_shard 2 (or a dp_shard that is no degree) is not one this job
    could have written: verify and load refuse it, as they refuse a bad pp, dp or tp."""
    step = _saved_index(tmp_path)
    problem = _layout_problems_after(step, {"pp": 1, "dp": 1, "tp": 1, "dp_shard": dp_shard})
    assert "layout" in problem and "dp_shard" in problem, problem


def test_an_unsharded_layout_record_still_verifies(tmp_path):
    step = _saved_index(tmp_path)
    assert _layout_problems_after(step, {"pp": 1, "dp": 1, "tp": 1}) == ""


def test_topo_place_json_lists_each_ranks_dp_shard_and_dp_replicate(local_cluster, tmp_path):
    """The table shows every rank's dp_shard and dp_replicate; `--json` lists them too."""
    spec = {"name": "p", "site": "localcluster", "nodes": 4, "tasks_per_node": 2, "parallel": {"dp_shard": 4}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec))
    result = run_cli("topo", "place", str(tmp_path / "job.yaml"), "--nodes", "n[1-4]", "--json")
    assert result.returncode == 0, result.stderr
    ranks = json.loads(result.stdout)["ranks"]
    dims = ParallelDims(pp=1, dp=8, tp=1, dp_shard=4)
    for r in ranks:
        c = dims.coords(r["rank"])
        assert (r["dp"], r["dp_shard"], r["dp_replicate"]) == (c.dp, c.dp_shard, c.dp_replicate), r
    assert list(ranks[0]) == ["rank", "node", "local_rank", "tp", "dp", "dp_shard", "dp_replicate", "pp"]
    human = run_cli("topo", "place", str(tmp_path / "job.yaml"), "--nodes", "n[1-4]")
    assert "dp_shard" in human.stdout and "dp_replicate" in human.stdout


# --- every axis round-trips with the registry as it is ------------------------------------------------------------

layouts = st.builds(
    lambda pp, replicate, shard, tp: ParallelDims(pp=pp, dp=replicate * shard, tp=tp, dp_shard=shard),
    st.integers(1, 4),
    st.integers(1, 4),
    st.integers(1, 4),
    st.integers(1, 4),
)


@settings(max_examples=60, deadline=None)
@given(layouts)
def test_every_axis_round_trips_through_records_coords_and_groups(dims):
    assert ParallelDims.from_dict(json.loads(json.dumps(dims.as_dict()))) == dims
    assert set(dims.degrees) == {a.name for a in layout.AXES}
    for r in range(dims.world_size):
        c = dims.coords(r)
        assert dims.rank(**c.index) == r and dims.rank(pp=c.pp, dp=c.dp, tp=c.tp) == r
        for axis in dims.group_axes:
            group = dims.group(r, axis)
            assert r in group and len(group) == (dims.dp if axis == "dp" else dims.degrees[axis])
    assert dims.mesh_axes == (("pp", "dp_replicate", "dp_shard", "tp") if dims.sharded else ("pp", "dp", "tp"))


def test_records_written_before_the_registry_still_read():
    assert ParallelDims.from_dict({"pp": 2, "dp": 4, "tp": 2}) == ParallelDims(pp=2, dp=4, tp=2)
    assert ParallelDims(pp=1, dp=4, tp=2, dp_shard=2).as_dict() == {"pp": 1, "dp": 4, "tp": 2, "dp_shard": 2}
    assert list(ParallelDims(pp=1, dp=4, tp=2).as_dict()) == ["pp", "dp", "tp"]


def test_the_job_spec_gives_every_keyed_axis_its_degree():
    assert Parallel(tp=2, pp=3, dp_shard=4).degrees == {"pp": 3, "dp_shard": 4, "tp": 2}
    assert JobLayout(nodes=2, tasks_per_node=4, **Parallel(tp=2, dp_shard=2).degrees).dims == ParallelDims(
        pp=1, dp=4, tp=2, dp_shard=2
    )


# --- the seam: a dummy axis every consumer carries ----------------------------------------------------------------


def test_a_registered_axis_is_in_the_layout_its_records_and_the_job_spec(dummy_axis):
    dims = ParallelDims(pp=1, dp=4, tp=2, dp_shard=2)
    assert dims.dummy == 1 and list(dims.degrees) == ["pp", "dp_replicate", "dp_shard", "dummy", "tp"]
    assert dims.as_dict() == {"pp": 1, "dp": 4, "tp": 2, "dp_shard": 2}  # at 1: the record older versions read
    assert ParallelDims.from_dict(dims.as_dict()) == dims
    wide = ParallelDims(pp=1, dp=2, tp=2, dummy=3)
    assert wide.world_size == 12 and wide.as_dict() == {"pp": 1, "dp": 2, "tp": 2, "dummy": 3}
    assert ParallelDims.from_dict(json.loads(json.dumps(wide.as_dict()))) == wide
    # as a person reads it (ckpt ls and inspect, the trainer's first line): the registry's order, at 1 left out
    assert wide.text() == "pp=1 dp=2 dummy=3 tp=2" and dims.text() == "pp=1 dp=4 dp_shard=2 tp=2"
    with pytest.raises(BadInput, match="dummy"):
        ParallelDims.from_dict({"pp": 1, "dp": 2, "tp": 2, "dummy": "3"})
    assert wide.rank(**wide.coords(7).index) == 7 and wide.group(0, "dummy") == [0, 2, 4]
    assert Parallel(tp=2).degrees == {"pp": 1, "dp_shard": 1, "dummy": 1, "tp": 2}
    assert JobLayout(nodes=2, tasks_per_node=6, tp=2, dummy=3).dims == ParallelDims(pp=1, dp=2, tp=2, dummy=3)
    problems = layout_problems(nodes=1, tasks_per_node=4, tp=2, dummy=3)
    assert [p.key for p in problems] == ["parallel"] and "tp(2) * dummy(3) * pp(1)" in problems[0].message


def test_a_registered_axis_is_read_back_from_an_attempts_begin_record(dummy_axis):
    from hpcscale.recovery.resume import rank_nodes

    dims = ParallelDims(pp=1, dp=2, tp=1, dummy=2)
    begin = {"event": "begin", "job_id": "7", "nodes": ["n1", "n2"], "world_size": 4, "layout": dims.as_dict()}
    assert rank_nodes([begin], "7") == (dims, ["n1", "n1", "n2", "n2"])


def test_a_registered_axis_is_a_mesh_axis_and_its_groups_are_blamed(dummy_axis):
    one = ParallelDims(pp=1, dp=2, tp=2)
    assert one.mesh_axes == ("pp", "dp", "dummy", "tp") and one.mesh_shape == (1, 2, 1, 2)
    assert ParallelDims(pp=1, dp=2, tp=1, dp_shard=2).mesh_axes == ("pp", "dp_replicate", "dp_shard", "dummy", "tp")
    assert one.mesh_index(3) == {"pp": 0, "dp_replicate": 1, "dp_shard": 0, "dummy": 0, "tp": 1, "dp": 1}
    # degree 1: its group is the rank alone, so a timeout there blames no one (the group is known, not guessed)
    report = describe_nccl_timeouts(nccl_timeouts([_nccl_line(1, "mesh_dummy")]), dims=one, rank_nodes=None)
    assert "every rank of that group timed out" in report.line and report.blamed_ranks == []
    # degree 2 over two nodes: rank 1 timed out in its dummy group (ranks 1, 3), rank 3 on n2 never came
    two = ParallelDims(pp=1, dp=1, tp=2, dummy=2)
    report = describe_nccl_timeouts(
        nccl_timeouts([_nccl_line(1, "mesh_dummy")]), dims=two, rank_nodes=["n1", "n1", "n2", "n2"]
    )
    assert report.blamed_ranks == [3] and report.blamed_nodes == ["n2"]


def test_a_registered_axis_is_in_the_index_layout_check(dummy_axis, tmp_path):
    step = _saved_index(tmp_path)  # one rank
    assert _layout_problems_after(step, {"pp": 1, "dp": 1, "tp": 1, "dummy": 1}) == ""
    problem = _layout_problems_after(step, {"pp": 1, "dp": 1, "tp": 1, "dummy": 2})
    assert "does not multiply to world_size 1" in problem, problem


def test_a_registered_axis_is_placed_and_is_a_topo_column(dummy_axis):
    from hpcscale.cli.topo_cmd import format_placement

    nodes = ["n1", "n2"]
    p = place(nodes=nodes, tree=flat_tree(nodes), layout=JobLayout(nodes=2, tasks_per_node=2, tp=2))
    assert [r.record() for r in p.ranks()][3] == {
        "rank": 3,
        "node": p.nodes[1],
        "local_rank": 1,
        "tp": 1,
        "dummy": 0,
        "dp": 1,
        "pp": 0,
    }
    table = format_placement(p)
    assert [c.header for c in table.columns] == ["rank", "node", "local rank", "tp", "dummy", "dp", "pp"]
    wide = place(nodes=nodes, tree=flat_tree(nodes), layout=JobLayout(nodes=2, tasks_per_node=2, dummy=2))
    assert [r.dummy for r in wide.ranks()] == [0, 1, 0, 1]


MESH_SCRIPT = """
import json
import torch.distributed as dist
import hpcscale.layout as layout
at = [a.name for a in layout.AXES].index("tp")
layout.AXES = (*layout.AXES[:at], layout.Axis(name="dummy", key="dummy", data_parallel=False), *layout.AXES[at:])
from hpcscale.layout import ParallelDims
from hpcscale.parallel.mesh import build_mesh, group_timeout_s
store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)  # port 0: bound by the store itself, no one can take it first
dist.init_process_group("gloo", store=store, rank=0, world_size=1)
mesh = build_mesh(device_type="cpu", backend="gloo", dims=ParallelDims(dp=1), timeout_s=7)
out = {"names": list(mesh.mesh_dim_names), "timeout": group_timeout_s(mesh["dummy"].get_group(), "cpu")}
print(json.dumps(out))
"""


def test_a_registered_axis_is_a_dimension_of_the_built_mesh(tmp_path):
    script = MESH_SCRIPT
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out == {"names": ["pp", "dp", "dummy", "tp"], "timeout": 7.0}
