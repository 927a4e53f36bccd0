"""What a rank may ask of the scheduler it runs under, handed in by the command that started it.

The rank side (launch/, parallel/, train/) imports nothing of hpcscale.slurm: `hpcscale launch` (the CLI, above
both) builds a SchedulerView from hpcscale.slurm.allocation and hpcscale.slurm.health and passes it to `launch`.
Rank 0 alone uses it: it reads the switch tree once to place the ranks (launch.main), checks where Slurm writes
the job's logs (launch.attempts), and polls the job's warning signs (launch.health). Without one (a test calling
`launch` directly), the nodes are placed as if under one switch and the rest is skipped.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from hpcscale.config.site import SiteConfig
from hpcscale.topology.tree import SwitchTree

__all__ = ["NO_SCHEDULER", "SchedulerView"]


@dataclass(frozen=True, slots=True)
class SchedulerView:
    """`switch_tree(site)`: the site's tree (HpcscaleError when it cannot be read); `log_paths(job_id)`: where
    Slurm writes job `job_id`'s output, {"StdOut": path, "StdErr": path}, {} when unknown (OSError or
    HpcscaleError when it cannot be asked). None: not available."""

    switch_tree: Callable[[SiteConfig], SwitchTree] | None = None
    log_paths: Callable[[str], dict[str, str]] | None = None
    # signs(job_id, nodes, within_s=..., now=...): warning signs of the running job, [{"kind", "node", "evidence"}]
    # (hpcscale.slurm.health.job_signs), read by rank 0 every health.poll_seconds (hpcscale.launch.health)
    signs: Callable[..., list[dict]] | None = None


NO_SCHEDULER = SchedulerView()
