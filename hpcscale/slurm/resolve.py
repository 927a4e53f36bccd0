"""A job spec made concrete for one submission: partition, run directory, topology-derived `--switches`.

Everything that needs I/O (reading the topology) happens here, so rendering stays a pure function of a
ResolvedJob.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from hpcscale.config.job import JobSpec
from hpcscale.config.load import LoadedJob
from hpcscale.config.site import Partition, SiteConfig
from hpcscale.errors import BadInput
from hpcscale.topology.tree import SwitchTree
from hpcscale.util.hostlist import expand
from hpcscale.util.slurmtime import parse_duration


@dataclass(frozen=True, kw_only=True, slots=True)
class ResolvedJob:
    spec: JobSpec
    site: SiteConfig
    partition: Partition
    run_dir: Path
    time_limit_s: int  # spec.time_limit in seconds, parsed once (resolve)
    switches: int | None = None  # fewest leaf switches that can hold the job; None: no tree or one switch is moot
    excluded: tuple[str, ...] = field(default_factory=tuple)
    required: tuple[str, ...] = field(default_factory=tuple)  # nodes the job must include (--nodelist)


def min_leaf_switches(
    tree: SwitchTree, candidates: list[str], nodes: int, required: tuple[str, ...] = ()
) -> int | None:
    """Fewest leaf switches whose candidate nodes add up to `nodes`: the leaves of the `required` nodes (the job
    must include them: --nodelist) first, then the largest others; None if even all leaves cannot hold the job
    (Slurm will then refuse it on its own terms). Without the required nodes' leaves counted, a job pinned to
    nodes under different switches asked for fewer switches than it can have, and waited `--switches`' whole
    maximum before Slurm gave up the constraint."""
    leaves = {k: v for k, v in tree.restricted_to(candidates).items() if k}
    forced = [k for k, v in leaves.items() if set(v) & set(required)]
    total, count = sum(len(leaves[k]) for k in forced), len(forced)
    if count and total >= nodes:
        return count
    for size in sorted((len(v) for k, v in leaves.items() if k not in forced), reverse=True):
        total += size
        count += 1
        if total >= nodes:
            return count
    return None


def resolve(
    loaded: LoadedJob,
    *,
    run_dir: Path,
    tree: SwitchTree | None,
    excluded: tuple[str, ...] = (),
    required: tuple[str, ...] = (),
) -> ResolvedJob:
    spec, site = loaded.spec, loaded.site.config
    if site.scheduler != "slurm":
        raise BadInput(
            f"{loaded.path}: site '{site.name}' has no Slurm (scheduler: {site.scheduler}); "
            f"run it with: hpcscale run {loaded.path} --local"
        )
    partition = site.partition(spec.partition)
    assert partition is not None  # load_job checked it
    switches = None
    if tree is not None and tree.switches:
        candidates = [n for n in expand(partition.nodes) if n not in set(excluded)]
        switches = min_leaf_switches(tree, candidates, spec.nodes + spec.restart.spare_nodes, tuple(required))
    return ResolvedJob(
        spec=spec,
        site=site,
        partition=partition,
        run_dir=run_dir,
        switches=switches,
        excluded=tuple(excluded),
        required=tuple(required),
        time_limit_s=parse_duration(spec.time_limit),
    )
