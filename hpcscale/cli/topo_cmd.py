"""`hpcscale topo show|place`."""

from __future__ import annotations

import click

from hpcscale.cli.options import console, json_option, print_json, site_option


@click.group()
def topo() -> None:
    """Switch trees and rank placement."""


def format_tree(tree):
    """A rich Tree of switches and their nodes."""
    from rich.tree import Tree

    from hpcscale.util.hostlist import compress

    top = Tree("[bold]topology[/bold]")

    def add(parent, name):
        sw = tree.switches[name]
        label = f"{name} [dim](level {sw.level})[/dim]"
        if not sw.children:
            label += f": {compress(list(sw.nodes))} [dim]({len(sw.nodes)} nodes)[/dim]"
        node = parent.add(label)
        for child in sw.children:
            add(node, child)

    for root in sorted(tree.roots()):
        add(top, root)
    return top


@topo.command()
@site_option
@json_option
def show(site: str | None, as_json: bool) -> None:
    """Draw the site's switch tree (from `scontrol show topology` or the site file).

    \b
    Example:
      hpcscale topo show --site localcluster
    """
    from hpcscale.config.load import resolve_site
    from hpcscale.errors import BadInput
    from hpcscale.slurm.allocation import site_tree

    if site is None:
        raise BadInput("--site is required")
    tree = site_tree(resolve_site(site).config)
    if as_json:
        print_json(
            {
                name: {"level": s.level, "children": list(s.children), "nodes": list(s.nodes)}
                for name, s in tree.switches.items()
            }
        )
    else:
        console().print(format_tree(tree))


def format_placement(p):
    from rich.table import Table

    w, dims = p.weights, p.layout.dims
    per_step = ", ".join(f"{axis} {w.of(axis):,.0f}" for axis in reversed(dims.mesh_axes) if w.of(axis) is not None)
    table = Table(
        title=f"placement: {p.method}; cost {p.cost:,.0f} vs hostname order {p.hostname_order_cost:,.0f}"
        f" (weights: {w.source}; bytes per step and neighbour: {per_step})"
    )
    for col in ("rank", "node", "local rank", *dims.coordinate_axes):
        table.add_column(col, justify="right" if col != "node" else "left")
    for r in p.ranks():
        table.add_row(str(r.rank), r.node, str(r.local_rank), *(str(i) for i in r.axes.values()))
    return table


@topo.command()
@click.argument("job", type=click.Path(dir_okay=False))
@click.option("--nodes", "nodes", required=True, metavar="HOSTLIST", help="The allocation, e.g. n[1-4].")
@site_option
@json_option
def place(job: str, nodes: str, site: str | None, as_json: bool) -> None:
    """The rank placement JOB would get on the nodes HOSTLIST, and its cost against hostname order.

    Ranks are ordered tp fastest, then dp, then pp; the node order minimises bytes x switch levels crossed
    (docs/placement.md).

    \b
    Example:
      hpcscale topo place job.yaml --nodes 'n[1-4]'
    """
    from hpcscale.config.load import load_job
    from hpcscale.slurm.allocation import site_tree
    from hpcscale.topology.placement import place_job
    from hpcscale.util.hostlist import expand

    loaded = load_job(job, site=site)
    p = place_job(loaded, expand(nodes), tree=site_tree(loaded.site.config))
    if as_json:
        print_json(
            {
                "nodes": p.nodes,
                "cost": p.cost,
                "hostname_order_cost": p.hostname_order_cost,
                "optimal": p.optimal,
                "method": p.method,
                "weights": p.weights.record(p.layout.dims),
                "ranks": [r.record() for r in p.ranks()],
            }
        )
    else:
        console().print(format_placement(p))
