"""Rank placement: which node each rank runs on, chosen to keep heavy traffic under low switches.

Ranks are in the layout's order (hpcscale.layout: tp fastest, then dp, then pp) and fill node slots in order
(slot = rank // tasks_per_node). The search is over which physical node takes which slot.
Cost model (docs/placement.md):

    cost = sum over communicating rank pairs (a, b) of  bytes_per_step(kind) * distance(node(a), node(b))

with pairs: neighbours in each tp and dp ring (all-reduce), and consecutive stages of each pp chain
(send/recv); distance from hpcscale.topology.tree (0 same node, 1 same leaf, +1 per level further up).
With sharded data parallelism (parallel.dp_shard > 1) the dp ring is two: the shard group's ring (FSDP's
all-gathers in forward and backward and its reduce-scatter: 1.5 times a ring all-reduce's bytes of the
parameters) and the replicas' ring (an all-reduce of one reduced shard), so the placement keeps the shard group
close and lets the replicas go farther.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from hpcscale.config.load import LoadedJob
from hpcscale.config.train import model_size
from hpcscale.errors import BadInput
from hpcscale.layout import DP, JobLayout, ParallelDims, axis_named
from hpcscale.topology.tree import SwitchTree
from hpcscale.util.hostlist import sort_hosts

# Arrangements of leaf labels over slots that are searched exhaustively; covers every allocation of up to
# 8 nodes (8! = 40320), and larger ones whose nodes sit on few leaves.
EXACT_LIMIT = 50_000


@dataclass(frozen=True, kw_only=True, slots=True)
class TrafficWeights:
    """Bytes one rank exchanges per step with one neighbour, per group kind."""

    tp: float = 100.0
    dp: float = 10.0  # the dp ring; with dp_shard > 1 the replicas' ring (dp_replicate)
    pp: float = 1.0
    source: str = "default ratios (tp 100 : dp 10 : pp 1)"
    dp_shard: float = 15.0  # the shard group's ring (dp_shard > 1 only): 1.5 x a replicated all-reduce

    def of(self, axis: str) -> float | None:
        """The weight of mesh `axis`'s neighbours (None: this model gives the axis none). The data-parallel axis
        derived from the world size (dp_replicate) is the `dp` ring's other name."""
        a = axis_named(axis)
        name = DP if a is not None and a.data_parallel and a.key is None else axis
        value = getattr(self, name, None)
        return value if isinstance(value, float | int) and not isinstance(value, bool) else None

    def record(self, dims: ParallelDims) -> dict[str, Any]:
        """The weights of the job's mesh axes by field name (`dp`: the dp ring, or the replicas'), then source."""
        names = [f.name for f in fields(self) if f.name != "source"]
        return {n: getattr(self, n) for n in names if n == DP or n in dims.mesh_axes} | {"source": self.source}


def traffic_weights(layout: JobLayout, size: Any = None) -> TrafficWeights:
    """Bytes per step from the model's size when the job declares one (`size`: a config.job.ModelSize, from the
    job's `model:` or the built-in trainer's params: config.train.model_size); the default ratios otherwise.
    Megatron-style TP all-reduces activations 4 times per layer per micro-batch (2 forward, 2 backward); DP
    all-reduces this rank's gradient shard once per step; PP sends one activation forward and one gradient back
    per micro-batch (Narayanan et al., SC'21, sec. 3)."""
    if size is None:
        if layout.dp_shard > 1:  # the replicas' ring carries one 1/dp_shard shard of the gradients
            return TrafficWeights(
                dp=10.0 / layout.dp_shard,
                source=f"default ratios (tp 100 : dp_shard 15 : dp_replicate 10/{layout.dp_shard} : pp 1)",
            )
        return TrafficWeights()
    layers, hidden, seq, micro, vocab = size.layers, size.hidden, size.seq_len, size.micro_batch, size.vocab
    global_batch = size.global_batch if size.global_batch is not None else micro * layout.dp
    elt = 2  # bytes per element in bf16
    n_micro = max(1, global_batch // (micro * layout.dp))
    act = micro * seq * hidden * elt
    params_total = size.parameters if size.parameters is not None else 12 * layers * hidden * hidden + vocab * hidden
    ring = lambda n: 2 * (n - 1) / n if n > 1 else 0.0  # noqa: E731 - bytes factor of a ring all-reduce
    slice_bytes = params_total / (layout.tp * layout.pp) * elt
    shard, replicas = layout.dp_shard, layout.dp // layout.dp_shard
    return TrafficWeights(
        tp=4 * (layers / layout.pp) * n_micro * act * ring(layout.tp),
        # replicated: the gradients' all-reduce over dp; sharded: one reduced shard's all-reduce over replicas
        dp=slice_bytes * ring(layout.dp) if shard == 1 else slice_bytes / shard * ring(replicas),
        pp=2 * n_micro * act if layout.pp > 1 else 0.0,
        source=f"model size ({layers} layers, width {hidden}, seq {seq})",
        # two all-gathers (forward, backward) and a reduce-scatter, each (n-1)/n of the slice's bytes
        dp_shard=slice_bytes * 1.5 * ring(shard),
    )


@dataclass(frozen=True, slots=True)
class RankSlot:
    rank: int
    node: str
    local_rank: int
    axes: dict[str, int]  # its index along each of the layout's coordinate_axes (tp, dp, [dp_shard, dp_replicate], pp)

    def __getattr__(self, name: str) -> int:
        if not name.startswith("_"):
            try:
                return self.axes[name]
            except KeyError:
                pass
        raise AttributeError(name)

    def record(self) -> dict[str, Any]:
        """As `topo place --json` lists it: rank, node, local_rank, then every coordinate."""
        return {"rank": self.rank, "node": self.node, "local_rank": self.local_rank, **self.axes}


@dataclass(frozen=True, slots=True)
class Placement:
    nodes: list[str]  # slot -> node: ranks [i*T, (i+1)*T) run on nodes[i]
    cost: float
    hostname_order_cost: float
    optimal: bool  # proven optimal by exhaustive search
    method: str
    weights: TrafficWeights
    layout: JobLayout

    def ranks(self) -> list[RankSlot]:
        s, dims = self.layout, self.layout.dims
        out = []
        for r in range(s.world):
            c = dims.coords(r)
            axes = {a: int(c.of(a)) for a in dims.coordinate_axes}
            out.append(RankSlot(r, self.nodes[r // s.tasks_per_node], r % s.tasks_per_node, axes))
        return out


def slot_edges(layout: JobLayout, weights: TrafficWeights) -> dict[tuple[int, int], float]:
    """(slot a, slot b) with a < b -> bytes per step between the two nodes' ranks. Same-slot pairs cost 0."""
    dims = layout.dims
    r = np.arange(layout.world)
    c = dims.coords(r)  # every rank's coordinates at once, as arrays
    pairs = []
    # Fastest axis first (tp, then dp or the shard group's ring and the replicas', then pp): the order the sums
    # below add in, kept so costs stay bit for bit what they were.
    for axis, size in reversed(list(zip(dims.mesh_axes, dims.mesh_shape, strict=True))):
        at, weight = c.of(axis), weights.of(axis)
        if size == 1 or weight is None:
            continue
        a = axis_named(axis)  # None: `dp`, the data-parallel axes as one (nothing sharded), a ring like each of them
        if a is None or a.ring:  # a ring all-reduce: the next rank along the axis, the last wrapping to the first
            pairs.append((r, dims.rank_at(c, **{axis: (at + 1) % size}), weight))
        else:  # a chain (pipeline send/recv): consecutive indexes, the last has no next
            more = at + 1 < size
            pairs.append((r[more], dims.rank_at(c, **{axis: at + 1})[more], weight))
    edges: dict[tuple[int, int], float] = defaultdict(float)
    for a, b, w in pairs:
        sa, sb = a // layout.tasks_per_node, b // layout.tasks_per_node
        lo, hi = np.minimum(sa, sb), np.maximum(sa, sb)
        cross = lo != hi
        keys, counts = np.unique(lo[cross] * layout.nodes + hi[cross], return_counts=True)
        for key, count in zip(keys.tolist(), counts.tolist(), strict=True):
            edges[divmod(key, layout.nodes)] += w * count
    return dict(edges)


def placement_cost(order: list[str], edges: dict[tuple[int, int], float], tree: SwitchTree) -> float:
    return sum(w * tree.distance(order[a], order[b]) for (a, b), w in edges.items())


def place(
    *,
    nodes: list[str],
    tree: SwitchTree,
    layout: JobLayout,
    weights: TrafficWeights | None = None,
    time_budget: float = 0.4,
) -> Placement:
    """The node order for `layout` on the allocation `nodes` that minimises the cost model."""
    if len(set(nodes)) != len(nodes):
        raise BadInput("the allocation names a node twice")
    if len(nodes) != layout.nodes:
        raise BadInput(f"the job needs {layout.nodes} nodes but the allocation has {len(nodes)}")
    weights = weights or TrafficWeights()
    edges = slot_edges(layout, weights)
    hostname_order = sort_hosts(nodes)
    by_leaf = tree.restricted_to(hostname_order)
    hostname_cost = placement_cost(hostname_order, edges, tree)
    counts = [len(v) for v in by_leaf.values()]
    arrangements = math.factorial(len(nodes)) // math.prod(math.factorial(c) for c in counts)
    if arrangements <= EXACT_LIMIT:
        order = _exact(by_leaf, edges, tree)
        return Placement(
            order,
            placement_cost(order, edges, tree),
            hostname_cost,
            True,
            f"exhaustive over {arrangements} arrangements",
            weights,
            layout,
        )
    order = _pack_stages(by_leaf, layout)
    order = _local_search(order, edges, tree, deadline=time.monotonic() + time_budget)
    return Placement(
        order, placement_cost(order, edges, tree), hostname_cost, False, "stage packing + swap search", weights, layout
    )


def place_job(loaded: LoadedJob, nodes: list[str], *, tree: SwitchTree) -> Placement:
    """The placement of job `loaded` on the allocated `nodes` under `tree`, weighed by its declared model size."""
    spec = loaded.spec
    if len(nodes) != spec.nodes:
        raise BadInput(f"{loaded.path}: the job asks for {spec.nodes} nodes but the allocation has {len(nodes)}")
    layout = JobLayout(nodes=len(nodes), tasks_per_node=spec.tasks_per_node, **spec.parallel.degrees)
    weights = traffic_weights(layout, model_size(spec))  # the job's declared model size, or the trainer's
    return place(nodes=list(nodes), tree=tree, layout=layout, weights=weights)


def _leaf_distance_matrix(leaves: list[str], tree: SwitchTree, by_leaf: dict[str, list[str]]) -> np.ndarray:
    """Distance between two different nodes, by their leaves ('' holds nodes on no switch)."""
    reps = [by_leaf[leaf][0] for leaf in leaves]
    d = np.zeros((len(leaves), len(leaves)))
    for i, j in itertools.product(range(len(leaves)), repeat=2):
        if i != j:
            d[i, j] = tree.distance(reps[i], reps[j])
        else:
            d[i, j] = 1.0 if leaves[i] else tree.height + 2
    return d


def _exact(by_leaf: dict[str, list[str]], edges: dict[tuple[int, int], float], tree: SwitchTree) -> list[str]:
    """Try every distinct arrangement of leaf labels over the slots; nodes on one leaf are interchangeable."""
    leaves = list(by_leaf)
    counts = [len(by_leaf[leaf]) for leaf in leaves]
    dist = _leaf_distance_matrix(leaves, tree, by_leaf)
    if not edges:
        return [n for leaf in leaves for n in by_leaf[leaf]]
    a = np.array([k[0] for k in edges])
    b = np.array([k[1] for k in edges])
    w = np.array(list(edges.values()))
    labels = np.array(list(_multiset_permutations(counts)), dtype=np.int64)  # (arrangements, slots)
    costs = (dist[labels[:, a], labels[:, b]] * w).sum(axis=1)
    best = labels[int(np.argmin(costs))]  # argmin takes the first minimum: leaves in tree order come first
    pools = {i: list(by_leaf[leaf]) for i, leaf in enumerate(leaves)}
    return [pools[int(lbl)].pop(0) for lbl in best]


def _multiset_permutations(counts: list[int]):
    """Every distinct sequence with counts[i] copies of label i, in lexicographic order."""
    remaining = list(counts)
    total = sum(counts)
    seq: list[int] = []

    def rec():
        if len(seq) == total:
            yield tuple(seq)
            return
        for label, left in enumerate(remaining):
            if left:
                remaining[label] -= 1
                seq.append(label)
                yield from rec()
                seq.pop()
                remaining[label] += 1

    yield from rec()


def _pack_stages(by_leaf: dict[str, list[str]], layout: JobLayout) -> list[str]:
    """Whole pipeline stages (their dp rings) on one leaf where they fit, consecutive stages on nearby leaves."""
    stage = layout.world // layout.pp  # the ranks of one pipeline stage
    block = stage // layout.tasks_per_node if stage % layout.tasks_per_node == 0 else 1
    block = max(block, 1)
    whole: list[list[str]] = []
    leftover: list[str] = []
    for hosts in by_leaf.values():
        full = len(hosts) // block * block
        whole += [hosts[i : i + block] for i in range(0, full, block)]
        leftover += hosts[full:]
    order = [h for blk in whole for h in blk] + leftover
    return order


def _local_search(
    order: list[str], edges: dict[tuple[int, int], float], tree: SwitchTree, deadline: float
) -> list[str]:
    """First-improvement swaps of two slots on different leaves, until none helps or time runs out."""
    order = list(order)
    adj: dict[int, list[tuple[int, float]]] = defaultdict(list)
    for (a, b), w in edges.items():
        adj[a].append((b, w))
        adj[b].append((a, w))
    leaf = [tree.leaf_of.get(h, "") for h in order]
    slots_by_leaf: dict[str, list[int]] = defaultdict(list)
    for i, lf in enumerate(leaf):
        slots_by_leaf[lf].append(i)

    def local(i: int, host: str, skip: int) -> float:
        return sum(w * tree.distance(host, order[j]) for j, w in adj[i] if j != skip)

    def try_swaps(i: int) -> bool:
        for target in Counter(leaf[j] for j, _ in adj[i] if leaf[j] != leaf[i]):
            for j in slots_by_leaf[target]:
                before = local(i, order[i], j) + local(j, order[j], i)
                after = local(i, order[j], j) + local(j, order[i], i)
                if after < before - 1e-9:
                    slots_by_leaf[leaf[i]].remove(i)
                    slots_by_leaf[leaf[j]].remove(j)
                    order[i], order[j] = order[j], order[i]
                    leaf[i], leaf[j] = leaf[j], leaf[i]
                    slots_by_leaf[leaf[i]].append(i)
                    slots_by_leaf[leaf[j]].append(j)
                    return True
        return False

    improved = True
    while improved and time.monotonic() < deadline:
        improved = False
        for i in range(len(order)):
            if time.monotonic() >= deadline:
                break
            if any(leaf[j] != leaf[i] for j, _ in adj[i]) and try_swaps(i):
                improved = True
    return order
