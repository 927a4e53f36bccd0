"""Where the ranks go on the real allocation: rank 0 alone reads the switch tree (through the scheduler view
`hpcscale launch` hands it) and orders the nodes by the placement search; what the ranks need of the tree is
then handed to every rank (`from_mpi_root`)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import replace

from hpcscale.config.load import LoadedJob
from hpcscale.errors import HpcscaleError
from hpcscale.launch import mpiwait
from hpcscale.launch.scheduler import SchedulerView
from hpcscale.topology.placement import place_job
from hpcscale.topology.tree import flat_tree

__all__ = ["Placement", "from_mpi_root"]


class Placement:
    """Placement on the real allocation, called by rank 0 alone (bootstrap): the switch tree is read once, here,
    and what the ranks need of it (`switches`: each allocated node's leaf switch and the leaves' order, for the
    node-local tier's partner copies) is handed to every rank with the order; hostname order and one flat switch
    if the tree cannot be read. No other rank asks Slurm for it."""

    def __init__(self, loaded: LoadedJob, scheduler: SchedulerView):
        self.loaded = loaded
        self.read_tree = scheduler.switch_tree
        self.switches: tuple[dict[str, str], list[str]] | None = None  # None: one node, nothing to place

    def __call__(self, nodes: list[str]) -> list[str]:
        if len(nodes) == 1:
            return nodes
        try:
            if self.read_tree is None:
                raise HpcscaleError("no scheduler was handed to this launch")
            tree = self.read_tree(self.loaded.site.config)
        except HpcscaleError as e:  # no switches handed on: partners are then chosen as if each were elsewhere
            print(f"hpcscale launch: switch tree unavailable ({e}); placing as if flat", file=sys.stderr)
            tree = flat_tree(nodes)
        else:
            leaf_of = {n: tree.leaf_of[n] for n in nodes if n in tree.leaf_of}
            self.switches = (leaf_of, [leaf for leaf in tree.leaf_order() if leaf in set(leaf_of.values())])
        sized = LoadedJob(replace(self.loaded.spec, nodes=len(nodes)), self.loaded.path, self.loaded.site)
        return place_job(sized, nodes, tree=tree).nodes


def from_mpi_root(compute: Callable):
    """compute() on MPI rank 0, its result in every rank."""
    from mpi4py import MPI

    return mpiwait.bcast(compute() if MPI.COMM_WORLD.rank == 0 else None, root=0)
