"""Which nodes a failure blames, and which nodes of an allocation a job's step runs on.

The node health and rank placement that `hpcscale resume` and the batch script's decision both read (`unhealthy`,
`rank_nodes`, srun's node-failure line), and the choice of the step's nodes in an allocation with spares
(`restart.spare_nodes`, docs/runbook.md "Spare nodes"):

- the first step takes the fewest leaf switches that hold it, the fullest leaves first (in the tree's order on a
  tie), and within a leaf its nodes in hostname order; the rest of the allocation are the spares;
- a relaunch keeps the previous step's nodes but the failed ones, each replaced by the spare nearest to it in the
  switch tree (under its own leaf switch first; hostname order on a tie), so the ranks that talk most stay as
  close as they were. Where fewer spares remain than nodes failed there is no relaunch (None). A spare Slurm
  does not have up is none; a node of the step that showed a warning sign of its own during the attempt (a
  suspect) is replaced too while spares are left after the failed ones;
- unless the job may shrink (`restart.shrink`): then the next step runs on as many of the nodes left (the
  previous step's survivors and the spares still free) as the job's layout and batch rules allow, chosen
  among them as a first step's nodes are, suspects last (only as many as the count needs).
"""

from __future__ import annotations

from collections.abc import Callable, Collection

from hpcscale.errors import BadInput
from hpcscale.launch.failure import MAX_RANKS, NODE_FAILURE
from hpcscale.layout import ParallelDims
from hpcscale.slurm.client import SlurmClient
from hpcscale.topology.tree import SwitchTree
from hpcscale.util.hostlist import sort_hosts

__all__ = [
    "NODE_FAILURE",
    "UNHEALTHY",
    "first_step_nodes",
    "rank_nodes",
    "relaunch_nodes",
    "shrink_nodes",
    "unhealthy",
]

UNHEALTHY = ("DOWN", "DRAIN", "FAIL", "NOT_RESPONDING", "UNKNOWN", "MAINT", "REBOOT", "POWER")


def unhealthy(client: SlurmClient, nodes: list[str]) -> list[str]:
    """Those of `nodes` that are not up now (down, drained, failing, not responding)."""
    if not nodes:
        return []
    out = client.run("sinfo", "-h", "-N", "-n", ",".join(nodes), "-o", "%N %T", check=False, timeout=30)
    bad = []
    for line in out.stdout.splitlines():
        name, _, state = line.partition(" ")
        if any(u in state.upper() for u in UNHEALTHY) and name not in bad:
            bad.append(name)
    return bad


def rank_nodes(events: list[dict], job_id: str | None) -> tuple[ParallelDims | None, list[str] | None]:
    """(the layout, the node of each global rank) of the job's last attempt, from its begin record (nodes in
    placement order, ranks filling each node in turn); None for what it does not record usably. Every degree
    the record holds is kept, dp_shard included: a timeout in a shard or replicate group is blamed on that
    group's late ranks only when its members can be worked out."""
    begins = [e for e in events if e.get("event") == "begin" and (job_id is None or e.get("job_id") == job_id)]
    if not begins:
        return None, None
    nodes, world, layout = begins[-1].get("nodes"), begins[-1].get("world_size"), begins[-1].get("layout")
    try:
        dims = ParallelDims.from_dict(layout)
    except BadInput:
        dims = None
    if dims is not None and dims.world_size != world:
        dims = None
    if type(world) is not int or world > MAX_RANKS:  # the record is a file others may write: a world of 10^12
        return None, None  # ranks is neither listed here nor enumerated by the failure diagnosis (its groups)
    if not isinstance(nodes, list) or not nodes or world % len(nodes):
        return dims, None
    per_node = world // len(nodes)
    return dims, [str(nodes[r // per_node]) for r in range(world)]


def first_step_nodes(allocation: list[str], n: int, tree: SwitchTree) -> list[str]:
    """The `n` nodes of `allocation` the job's first step runs on (the module's rule); BadInput when the
    allocation holds fewer."""
    if len(allocation) < n:
        raise BadInput(f"the allocation has {len(allocation)} nodes and the step needs {n}")
    by_leaf = tree.restricted_to(sort_hosts(allocation))
    order = {leaf: i for i, leaf in enumerate(by_leaf)}
    chosen: list[str] = []
    for leaf in sorted(by_leaf, key=lambda k: (-len(by_leaf[k]), order[k])):
        chosen += by_leaf[leaf][: n - len(chosen)]
        if len(chosen) == n:
            break
    return sort_hosts(chosen)


def relaunch_nodes(
    previous: list[str],
    failed: list[str],
    allocation: list[str],
    excluded: list[str],
    tree: SwitchTree,
    *,
    suspects: Collection[str] = (),
) -> list[str] | None:
    """The nodes of the step after one on `previous` failed with `failed` to blame: the failed nodes out, each
    replaced by the nearest spare (the module's rule). Spares: the allocation's nodes in no step, not `excluded`
    (every node this job blamed before, and spares Slurm does not have up). None when too few spares remain.
    `suspects`: nodes of `previous` that showed a warning sign of their own (drained, failing, in maintenance:
    hpcscale.slurm.status.signed_nodes) without being blamed: each replaced as well while a spare is left after
    the failed ones, kept otherwise (a suspect node is better than no relaunch)."""
    out = set(failed) | set(excluded)
    spares = [h for h in sort_hosts(allocation) if h not in out and h not in previous]
    keep = [h for h in previous if h not in out]
    leaving = sort_hosts([h for h in previous if h in out])
    for node in leaving:
        if not spares:
            return None
        keep.append(_nearest(node, spares, tree))
    for node in sort_hosts([h for h in suspects if h in keep and h in previous]):
        if not spares:
            break
        keep.remove(node)
        keep.append(_nearest(node, spares, tree))
    return sort_hosts(keep)


def _nearest(node: str, spares: list[str], tree: SwitchTree) -> str:
    """The spare nearest to `node` (the first of the nearest, in hostname order), taken out of `spares`."""
    best = min(spares, key=lambda s: tree.distance(node, s))
    spares.remove(best)
    return best


def shrink_nodes(
    previous: list[str],
    failed: list[str],
    allocation: list[str],
    excluded: list[str],
    tree: SwitchTree,
    fits: Callable[[int], bool],
    *,
    suspects: Collection[str] = (),
) -> list[str] | None:
    """restart.shrink, when too few spares remain for `failed`: the next step's nodes, as many of those left (the
    allocation's nodes neither `failed` nor `excluded`) as `fits(n)` allows, n at most the previous step's count,
    chosen as `first_step_nodes` chooses among the nodes without a warning sign (`suspects`, as for
    relaunch_nodes); suspects only where those are too few, the fewest needed. None when no count fits."""
    out = set(failed) | set(excluded)
    left = [h for h in sort_hosts(allocation) if h not in out]
    signed = set(suspects)
    healthy = [h for h in left if h not in signed]
    for n in range(min(len(left), len(previous)), 0, -1):
        if fits(n):
            if len(healthy) >= n:
                return first_step_nodes(healthy, n, tree)
            return sort_hosts(healthy + [h for h in left if h in signed][: n - len(healthy)])
    return None
