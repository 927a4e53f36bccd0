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

    w = p.weights
    shard = p.layout.dp_shard
    per_step = f"tp {w.tp:,.0f}, " + (
        f"dp_shard {w.dp_shard:,.0f}, dp_replicate {w.dp:,.0f}, " if shard > 1 else f"dp {w.dp:,.0f}, "
    )
    table = Table(
        title=f"placement: {p.method}; cost {p.cost:,.0f} vs hostname order {p.hostname_order_cost:,.0f}"
        f" (weights: {w.source}; bytes per step and neighbour: {per_step}pp {w.pp:,.0f})"
    )
    cols = ("rank", "node", "local rank", "tp", "dp", *(("dp_shard", "dp_replicate") if shard > 1 else ()), "pp")
    for col in cols:
        table.add_column(col, justify="right" if col != "node" else "left")
    for r in p.ranks():
        split = (str(r.dp % shard), str(r.dp // shard)) if shard > 1 else ()
        table.add_row(str(r.rank), r.node, str(r.local_rank), str(r.tp), str(r.dp), *split, str(r.pp))
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
    from dataclasses import asdict

    from hpcscale.config.load import load_job
    from hpcscale.slurm.allocation import place_job

    loaded = load_job(job, site=site)
    p = place_job(loaded, nodes)
    if as_json:
        print_json(
            {
                "nodes": p.nodes,
                "cost": p.cost,
                "hostname_order_cost": p.hostname_order_cost,
                "optimal": p.optimal,
                "method": p.method,
                "weights": {
                    "tp": p.weights.tp,
                    "dp": p.weights.dp,
                    "pp": p.weights.pp,
                    **({"dp_shard": p.weights.dp_shard} if p.layout.dp_shard > 1 else {}),
                    "source": p.weights.source,
                },
                "ranks": [asdict(r) for r in p.ranks()],
            }
        )
    else:
        console().print(format_placement(p))
