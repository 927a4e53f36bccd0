"""Placement equals the brute-force optimum on allocations of up to 8 nodes; ranks follow tp, dp, pp."""

from __future__ import annotations

import itertools
import random

import pytest

from hpcscale.config.job import ModelSize
from hpcscale.errors import BadInput
from hpcscale.layout import JobLayout
from hpcscale.topology.placement import (
    TrafficWeights,
    place,
    placement_cost,
    slot_edges,
    traffic_weights,
)
from hpcscale.topology.tree import build_tree, flat_tree


def _random_tree(rng: random.Random, hosts: list[str]):
    hosts = hosts[:]
    rng.shuffle(hosts)  # hostnames do not follow the cabling
    n_leaves = rng.randint(1, min(4, len(hosts)))
    cuts = sorted(rng.sample(range(1, len(hosts)), n_leaves - 1))
    leaves = [hosts[a:b] for a, b in zip([0, *cuts], [*cuts, len(hosts)], strict=True)]
    entries = [(f"leaf{i}", nodes, None) for i, nodes in enumerate(leaves)]
    if n_leaves >= 3 and rng.random() < 0.7:  # a three-level tree
        entries += [
            ("spineA", None, ["leaf0", "leaf1"]),
            ("spineB", None, [f"leaf{i}" for i in range(2, n_leaves)]),
            ("core", None, ["spineA", "spineB"]),
        ]
    elif n_leaves > 1:
        entries.append(("core", None, [f"leaf{i}" for i in range(n_leaves)]))
    return build_tree(entries)


def _random_layout(rng: random.Random, nodes: int) -> JobLayout:
    while True:
        tpn = rng.choice([1, 2, 4])
        tp = rng.choice([t for t in (1, 2, 4) if tpn % t == 0])
        pp = rng.choice([1, 2, 3, 4, 8])
        if (nodes * tpn) % (tp * pp) == 0:
            return JobLayout(nodes=nodes, tasks_per_node=tpn, tp=tp, pp=pp)


def test_equals_brute_force_optimum_up_to_8_nodes():
    rng = random.Random(2026)
    for trial in range(60):
        n = rng.randint(2, 8)
        hosts = [f"n{i}" for i in range(1, n + 1)]
        tree = _random_tree(rng, hosts)
        layout = _random_layout(rng, n)
        weights = TrafficWeights(tp=rng.choice([50.0, 100.0]), dp=rng.choice([5.0, 10.0]), pp=rng.choice([1.0, 3.0]))
        p = place(nodes=hosts, tree=tree, layout=layout, weights=weights)
        edges = slot_edges(layout, weights)
        brute = min(placement_cost(list(order), edges, tree) for order in itertools.permutations(hosts))
        assert p.optimal
        assert p.cost == pytest.approx(brute), (trial, layout)
        assert p.cost <= p.hostname_order_cost + 1e-9
        assert sorted(p.nodes) == sorted(hosts)


def test_large_allocation_beats_hostname_order_when_hostnames_ignore_cabling():
    rng = random.Random(5)
    hosts = [f"gpu{i:03d}" for i in range(256)]
    shuffled = hosts[:]
    rng.shuffle(shuffled)
    entries = [(f"leaf{k}", shuffled[k * 16 : (k + 1) * 16], None) for k in range(16)]
    entries += [
        ("spine0", None, [f"leaf{k}" for k in range(8)]),
        ("spine1", None, [f"leaf{k}" for k in range(8, 16)]),
        ("core", None, ["spine0", "spine1"]),
    ]
    tree = build_tree(entries)
    p = place(nodes=hosts, tree=tree, layout=JobLayout(nodes=256, tasks_per_node=8, tp=8, pp=4))
    assert not p.optimal
    assert p.cost < 0.6 * p.hostname_order_cost


def test_rank_order_is_tp_then_dp_then_pp():
    layout = JobLayout(nodes=4, tasks_per_node=2, tp=2, pp=2)  # dp = 2
    p = place(nodes=["a", "b", "c", "d"], tree=flat_tree("abcd"), layout=layout)
    coords = [(r.tp, r.dp, r.pp) for r in p.ranks()]
    assert coords == [(0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0), (0, 0, 1), (1, 0, 1), (0, 1, 1), (1, 1, 1)]
    assert [r.local_rank for r in p.ranks()] == [0, 1] * 4
    # a tp group never leaves its node
    by_group = {}
    for r in p.ranks():
        by_group.setdefault((r.dp, r.pp), set()).add(r.node)
    assert all(len(nodes) == 1 for nodes in by_group.values())


def test_tp_must_divide_tasks_per_node():
    with pytest.raises(BadInput, match=r"tp\(4\) does not divide tasks_per_node\(2\)"):
        JobLayout(nodes=2, tasks_per_node=2, tp=4, pp=1)


def test_weights_from_model_size():
    layout = JobLayout(nodes=16, tasks_per_node=8, tp=8, pp=2)  # dp = 8
    w = traffic_weights(layout, ModelSize(layers=24, hidden=2048, seq_len=2048, micro_batch=1, global_batch=64))
    n_micro = 64 // 8
    act = 1 * 2048 * 2048 * 2  # bytes of one micro-batch's activations in bf16
    params = 12 * 24 * 2048**2 + 256 * 2048
    assert w.tp == pytest.approx(4 * (24 / 2) * n_micro * act * 2 * 7 / 8)
    assert w.dp == pytest.approx(params / 16 * 2 * 2 * 7 / 8)
    assert w.pp == pytest.approx(2 * n_micro * act)
    assert w.tp > w.dp > w.pp  # the usual order for a modest global batch
    assert traffic_weights(layout, None) == TrafficWeights()
    declared = traffic_weights(
        layout, ModelSize(layers=24, hidden=2048, seq_len=2048, global_batch=64, parameters=10**9)
    )
    assert declared.dp == pytest.approx(10**9 / 16 * 2 * 2 * 7 / 8) and declared.tp == w.tp  # a declared count wins


def test_the_traffic_model_takes_the_declared_size_and_knows_no_models_parameter_names():
    """A job's `model:` for its own entry point; the built-in trainer's size from its train.params; nothing for a
    user entry point that declares none (the default ratios), whatever its params are called."""
    from types import SimpleNamespace

    from hpcscale.config.train import model_size

    builtin = SimpleNamespace(
        model=None, train=SimpleNamespace(entry="builtin", params={"n_layer": 24, "n_embd": 2048})
    )
    size = model_size(builtin)
    assert (size.layers, size.hidden, size.seq_len, size.micro_batch, size.global_batch) == (24, 2048, 64, 4, 16)
    user = SimpleNamespace(model=None, train=SimpleNamespace(entry="mine:main", params={"n_layer": 24, "n_embd": 8}))
    assert model_size(user) is None  # its params' names mean nothing to hpcscale
    declared = ModelSize(layers=32, hidden=4096, seq_len=4096)
    assert model_size(SimpleNamespace(model=declared, train=user.train)) is declared


def test_the_shard_group_is_placed_closer_than_the_replicas():
    """HSDP on 4 nodes of 2 leaves: dp_shard = 4 over 2 nodes' ranks, replicated twice. The shard group's
    all-gathers and reduce-scatters weigh more than the replicas' all-reduce of one shard, so each shard
    group's two nodes share a leaf and the replicas cross the core."""
    layout = JobLayout(nodes=4, tasks_per_node=2, tp=1, pp=1, dp_shard=4)  # dp 8 = 2 replicas x 4 shards
    w = traffic_weights(layout, ModelSize(layers=24, hidden=2048, seq_len=2048, micro_batch=1, global_batch=64))
    total = (12 * 24 * 2048**2 + 256 * 2048) * 2
    assert w.dp_shard == pytest.approx(total * 1.5 * 2 * 3 / 4)  # 1.5 x a ring all-reduce over 4
    assert w.dp == pytest.approx(total / 4 * 2 * 1 / 2)  # one shard's all-reduce over 2 replicas
    tree = build_tree([("leafA", ["a", "c"], None), ("leafB", ["b", "d"], None), ("core", None, ["leafA", "leafB"])])
    p = place(nodes=["a", "b", "c", "d"], tree=tree, layout=layout, weights=w)
    leaf = {"a": "A", "c": "A", "b": "B", "d": "B"}
    groups: dict[int, set[str]] = {}
    for r in p.ranks():
        groups.setdefault(r.dp // 4, set()).add(leaf[r.node])
    assert all(len(leaves) == 1 for leaves in groups.values()), groups
    edges = slot_edges(layout, w)
    assert placement_cost(p.nodes, edges, tree) < placement_cost(["a", "b", "c", "d"], edges, tree)


def test_a_declared_model_size_is_checked_like_any_key(tmp_path):
    from conftest import run_cli

    job = tmp_path / "job.yaml"
    job.write_text(
        "name: m\nsite: local\ntrain:\n  entry: mine:main\nmodel:\n  layers: 0\n  hiden: 4096\n  seq_len: 2048\n"
    )
    r = run_cli("config", "validate", str(job))
    assert r.returncode == 2, r.stdout + r.stderr
    out = r.stdout + r.stderr
    assert "job.yaml:7: model.hiden: unknown key (did you mean 'hidden'?)" in out
    assert "job.yaml:6: model.layers: must be at least 1, got 0" in out
