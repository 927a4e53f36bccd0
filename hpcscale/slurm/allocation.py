"""The switch tree of a site and rank placement on a concrete allocation: `hpcscale topo`, `render`/`submit`
(for `--switches`) and the launcher. The tree comes live from Slurm (`scontrol show topology`), from the site
file, or is flat; the tree math and the placement search themselves are pure (hpcscale.topology). Also what the
launcher may read of its own job: where Slurm writes its logs (`job_log_paths`)."""

from __future__ import annotations

from hpcscale.config.load import LoadedJob
from hpcscale.config.site import SiteConfig
from hpcscale.config.train import model_size
from hpcscale.errors import BadInput
from hpcscale.layout import JobLayout
from hpcscale.slurm.client import SlurmClient
from hpcscale.topology.placement import Placement, place, traffic_weights
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


def place_job(loaded: LoadedJob, nodes: str | list[str], *, tree: SwitchTree | None = None) -> Placement:
    spec = loaded.spec
    hosts = expand(nodes) if isinstance(nodes, str) else list(nodes)
    if len(hosts) != spec.nodes:
        raise BadInput(f"{loaded.path}: the job asks for {spec.nodes} nodes but the allocation has {len(hosts)}")
    layout = JobLayout(nodes=len(hosts), tasks_per_node=spec.tasks_per_node, **spec.parallel.degrees)
    weights = traffic_weights(layout, model_size(spec))  # the job's declared model size, or the trainer's
    return place(nodes=hosts, tree=tree or site_tree(loaded.site.config), layout=layout, weights=weights)


def job_log_paths(job_id: str, client: SlurmClient | None = None) -> dict[str, str]:
    """Where Slurm writes job `job_id`'s output: {"StdOut": path, "StdErr": path} as `scontrol show job` says
    (read by hpcscale.slurm.parse: a path with spaces, `|` or ` Key=` in it comes whole); {} when scontrol does
    not know the job. CommandFailed when scontrol cannot be run."""
    shown = (client or SlurmClient()).show("job", job_id, timeout=20)
    record = next((r for r in shown if r.get("JobId") == job_id), {})
    return {k: record[k] for k in ("StdOut", "StdErr") if record.get(k)}
