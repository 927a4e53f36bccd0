"""What a running job may read of the scheduler about itself: the switch tree of its site (`hpcscale topo`,
`render`/`submit` for `--switches`, and the ranks' placement) and where Slurm writes its logs. The tree comes
live from Slurm (`scontrol show topology`), from the site file, or is flat; the tree math and the placement
search themselves are pure (hpcscale.topology). The rank side imports nothing of slurm/: `hpcscale launch`
hands these two readers to the ranks (hpcscale.launch.scheduler.SchedulerView)."""

from __future__ import annotations

from hpcscale.config.site import SiteConfig
from hpcscale.slurm.client import SlurmClient
from hpcscale.topology.tree import SwitchTree, build_tree, flat_tree, parse_scontrol_topology
from hpcscale.util.hostlist import expand
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


def job_log_paths(job_id: str, client: SlurmClient | None = None) -> dict[str, str]:
    """Where Slurm writes job `job_id`'s output: {"StdOut": path, "StdErr": path} as `scontrol show job` says
    (read by hpcscale.slurm.parse: a path with spaces, `|` or ` Key=` in it comes whole); {} when scontrol does
    not know the job. CommandFailed when scontrol cannot be run."""
    shown = (client or SlurmClient()).show("job", job_id, timeout=20)
    record = next((r for r in shown if r.get("JobId") == job_id), {})
    return {k: record[k] for k in ("StdOut", "StdErr") if record.get(k)}
