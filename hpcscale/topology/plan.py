"""Placement for a concrete job on a concrete allocation: `hpcscale topo place` and the launcher."""

from __future__ import annotations

from hpcscale.config.load import LoadedJob
from hpcscale.errors import BadInput
from hpcscale.topology.hostlist import expand
from hpcscale.topology.placement import LayoutShape, Placement, place, traffic_weights
from hpcscale.topology.source import site_tree
from hpcscale.topology.tree import SwitchTree


def place_job(loaded: LoadedJob, nodes: str | list[str], *, tree: SwitchTree | None = None) -> Placement:
    spec = loaded.spec
    hosts = expand(nodes) if isinstance(nodes, str) else list(nodes)
    if len(hosts) != spec.nodes:
        raise BadInput(f"{loaded.path}: the job asks for {spec.nodes} nodes but the allocation has {len(hosts)}")
    shape = LayoutShape(nodes=len(hosts), tasks_per_node=spec.tasks_per_node, tp=spec.parallel.tp, pp=spec.parallel.pp)
    params = spec.train.params if spec.train else None
    return place(
        nodes=hosts, tree=tree or site_tree(loaded.site.config), shape=shape, weights=traffic_weights(shape, params)
    )
