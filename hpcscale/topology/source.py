"""The switch tree a site describes: read live from Slurm, from the site file, or flat."""

from __future__ import annotations

from hpcscale.config.site import SiteConfig
from hpcscale.slurm.client import SlurmClient
from hpcscale.topology.hostlist import expand
from hpcscale.topology.tree import SwitchTree, build_tree, flat_tree, parse_scontrol_topology
from hpcscale.util.proc import CommandFailed


def site_tree(site: SiteConfig, client: SlurmClient | None = None) -> SwitchTree:
    """The site's tree. `scontrol` sources ask the live controller (CommandFailed if it does not answer)."""
    if site.topology.source == "file":
        return build_tree(
            [
                (s.name, expand(s.nodes) if s.nodes else None, expand(s.switches) if s.switches else None)
                for s in site.topology.switches
            ]
        )
    if site.topology.source == "scontrol":
        client = client or SlurmClient.for_site(site)
        try:
            out = client.run("scontrol", "show", "topology").stdout
        except CommandFailed as e:
            raise CommandFailed(
                e.args_,
                f"cannot read the switch tree of site '{site.name}' ({e.tool_message}); "
                "run where Slurm answers, or set topology.source: file or none",
            ) from None
        return parse_scontrol_topology(out)
    return flat_tree(n for p in site.partitions for n in expand(p.nodes))
