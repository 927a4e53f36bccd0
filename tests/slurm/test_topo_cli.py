"""`hpcscale topo show|place` through the CLI, on the local cluster's live topology."""

from __future__ import annotations

import json

import yaml
from conftest import REPO, run_cli


def test_topo_show_reads_the_live_tree(local_cluster):
    result = run_cli("topo", "show", "--site", "localcluster", "--json")
    assert result.returncode == 0, result.stderr
    tree = json.loads(result.stdout)
    assert tree["spine"]["children"] == ["leaf1", "leaf2"]
    assert tree["leaf2"]["nodes"] == ["n3", "n4"]
    human = run_cli("topo", "show", "--site", "localcluster")
    assert "leaf1 (level 0): n[1-2]" in human.stdout


def test_topo_place_keeps_dp_rings_under_one_leaf(local_cluster, tmp_path):
    spec = {
        "name": "p",
        "site": "localcluster",
        "nodes": 4,
        "tasks_per_node": 2,
        "parallel": {"tp": 2, "pp": 2},
        "train": {"params": {"n_layer": 4, "n_embd": 64, "seq_len": 32, "global_batch": 8, "micro_batch": 2}},
    }
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec))
    # Hostname order interleaves the leaves: n1 (leaf1), n3 (leaf2), n2 (leaf1), n4 (leaf2).
    result = run_cli("topo", "place", str(tmp_path / "job.yaml"), "--nodes", "n[1,3,2,4]", "--json")
    assert result.returncode == 0, result.stderr
    p = json.loads(result.stdout)
    assert p["optimal"] is True
    # pp stage 0 (dp ring of 2 nodes) on one leaf, stage 1 on the other
    stage_nodes = [{r["node"] for r in p["ranks"] if r["pp"] == s} for s in (0, 1)]
    assert {frozenset(s) for s in stage_nodes} == {frozenset({"n1", "n2"}), frozenset({"n3", "n4"})}
    assert p["cost"] <= p["hostname_order_cost"]


def test_topo_place_rejects_a_wrong_allocation_size():
    result = run_cli("topo", "place", str(REPO / "docs/examples/hello-localcluster.yaml"), "--nodes", "n[1-3]")
    assert result.returncode == 2 and "asks for 2 nodes" in result.stderr


def test_topo_place_rejects_a_malformed_hostlist():
    result = run_cli("topo", "place", str(REPO / "docs/examples/hello-localcluster.yaml"), "--nodes", "n[1-")
    assert result.returncode == 2 and "bad hostlist 'n[1-'" in result.stderr
