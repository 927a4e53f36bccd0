"""Hostlists (scontrol is the oracle), switch trees, SLURM_TOPOLOGY_ADDR."""

from __future__ import annotations

import os
import random
import subprocess

import pytest

from hpcscale.topology.tree import BadTopology, build_tree, parse_scontrol_topology, parse_topology_addr
from hpcscale.util.hostlist import BadHostlist, compress, expand

LOCAL_TOPOLOGY = """SwitchName=leaf1 Level=0 LinkSpeed=1 Nodes=n[1-2]
SwitchName=leaf2 Level=0 LinkSpeed=1 Nodes=n[3-4]
SwitchName=spine Level=1 LinkSpeed=1 Nodes=n[1-4] Switches=leaf[1-2]
"""


def _random_hostlist(rng: random.Random) -> str:
    parts = []
    for _ in range(rng.randint(1, 4)):
        prefix = rng.choice(["n", "gpu", "node-", "r1n", "x"])
        width = rng.choice([0, 2, 3])
        ranges = []
        for _ in range(rng.randint(1, 3)):
            lo = rng.randint(0, 50)
            hi = lo + rng.randint(0, 6)
            ranges.append(f"{lo:0{width}d}" if lo == hi else f"{lo:0{width}d}-{hi:0{width}d}")
        parts.append(f"{prefix}[{','.join(ranges)}]" if rng.random() < 0.8 else f"{prefix}{rng.randint(0, 9)}")
    return ",".join(parts)


def _scontrol_hostnames(expr: str, env: dict[str, str]) -> list[str]:
    out = subprocess.run(
        ["scontrol", "show", "hostnames", expr], capture_output=True, text=True, env={**os.environ, **env}, check=True
    )
    return out.stdout.split()


def test_expand_matches_scontrol_show_hostnames(local_cluster):
    rng = random.Random(7)
    for _ in range(40):
        expr = _random_hostlist(rng)
        oracle = _scontrol_hostnames(expr, local_cluster)
        # scontrol keeps duplicates; hpcscale removes them (a node is allocated once)
        assert expand(expr) == list(dict.fromkeys(oracle)), expr


def test_compress_round_trips_and_matches_scontrol(local_cluster):
    rng = random.Random(11)
    for _ in range(20):
        hosts = list(dict.fromkeys(expand(_random_hostlist(rng))))
        expr = compress(hosts)
        assert sorted(expand(expr)) == sorted(hosts)
        oracle = _scontrol_hostnames(expr, local_cluster)
        assert sorted(oracle) == sorted(hosts)


@pytest.mark.parametrize("expr", ["n[1-", "n[3-1]", "n[a-b]", "", "n[1-100000000]"])
def test_malformed_hostlists_are_bad_input(expr):
    with pytest.raises(BadHostlist) as e:
        expand(expr)
    assert e.value.exit_code == 2


def test_parse_live_scontrol_topology(local_cluster):
    out = subprocess.run(
        ["scontrol", "show", "topology"],
        capture_output=True,
        text=True,
        env={**os.environ, **local_cluster},
        check=True,
    ).stdout
    tree = parse_scontrol_topology(out)
    assert tree.leaf_of == {"n1": "leaf1", "n2": "leaf1", "n3": "leaf2", "n4": "leaf2"}
    assert tree.parent == {"leaf1": "spine", "leaf2": "spine"}
    assert tree.distance("n1", "n1") == 0
    assert tree.distance("n1", "n2") == 1
    assert tree.distance("n1", "n4") == 2


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("SwitchName=a Nodes=n[1-\n", "scontrol show topology:1: bad hostlist"),
        ("SwitchName=a Nodes=n1\nLevel=0 Nodes=n2\n", "scontrol show topology:2: no SwitchName"),
        ("SwitchName=a Nodes=n1\nSwitchName=b Switches=c\n", "unknown switch 'c'"),
        ("SwitchName=a Nodes=n1\nSwitchName=a Nodes=n2\n", "defined twice"),
        ("SwitchName=a Nodes=n1\nSwitchName=b Nodes=n1\n", "on two leaf switches"),
        ("", "no switches"),
    ],
)
def test_malformed_topology_names_the_position(text, fragment):
    with pytest.raises(BadTopology) as e:
        parse_scontrol_topology(text)
    assert fragment in str(e.value)
    assert e.value.exit_code == 2


def test_cycle_is_rejected():
    with pytest.raises(BadTopology):
        build_tree([("a", None, ["b"]), ("b", None, ["a"])])


def test_nodes_in_separate_trees_are_furthest_apart():
    tree = build_tree([("l1", ["a"], None), ("l2", ["b"], None), ("top", None, ["l1"])])
    assert tree.distance("a", "b") == tree.height + 2


def test_topology_addr():
    assert parse_topology_addr("spine.leaf1.n1", "switch.switch.node") == ["spine", "leaf1"]
    with pytest.raises(BadTopology):
        parse_topology_addr("spine.n1", "switch.switch.node")
    with pytest.raises(BadTopology):
        parse_topology_addr("spine..n1", "switch.switch.node")


def test_switches_count_the_leaves_of_the_nodes_a_job_must_include():
    """A resume pinned to a node-local holder (--nodelist) under a leaf whose other node is excluded: one leaf
    cannot hold the job, so it asks for two switches instead of waiting out `--switches=1@...`."""
    from hpcscale.slurm.resolve import min_leaf_switches

    tree = build_tree([("s1", ["n1", "n2"], None), ("s2", ["n3", "n4"], None), ("top", None, ["s1", "s2"])])
    assert min_leaf_switches(tree, ["n1", "n3", "n4"], 2) == 1  # free choice: both nodes under s2
    assert min_leaf_switches(tree, ["n1", "n3", "n4"], 2, ("n1",)) == 2  # n1 is a must: s1 and s2
    assert min_leaf_switches(tree, ["n1", "n2", "n3", "n4"], 2, ("n1",)) == 1  # n1 and n2 under s1
    assert min_leaf_switches(tree, ["n1", "n2", "n3", "n4"], 2, ("n1", "n3")) == 2
    assert min_leaf_switches(tree, ["n1", "n3"], 3, ("n1",)) is None
