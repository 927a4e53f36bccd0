"""Site config schema: one file per cluster (site_configs/<name>.yaml). Reference: docs/config-reference.md."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from hpcscale.config.fields import setting
from hpcscale.util.hostlist import check_hostlist
from hpcscale.util.slurmtime import check_duration

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def check_name(value: str) -> str | None:
    if not _NAME.match(value):
        return f"'{value}' is not a name (letters, digits, '.', '_', '-'; starting with a letter or digit)"
    return None


def check_env_names(variables: dict[str, str]) -> str | None:
    bad = [k for k in variables if not _ENV_NAME.match(k)]
    return f"not environment variable names: {', '.join(map(repr, bad))}" if bad else None


def check_abs_path(value: str) -> str | None:
    if not (value.startswith("/") or value.startswith("~") or value.startswith("$")):
        return f"'{value}' must be an absolute path (or start with ~ or $VAR)"
    return None


@dataclass(kw_only=True, slots=True)
class Partition:
    """A Slurm partition jobs may be placed in."""

    name: str = setting("Partition name as Slurm knows it (sbatch --partition).", check=check_name)
    nodes: str = setting("Its nodes as a Slurm hostlist, e.g. `gpu[001-064]`.", check=check_hostlist)
    cpus_per_node: int = setting("CPU cores per node usable by jobs.", min=1)
    gpus_per_node: int = setting("GPUs per node (0 for CPU partitions).", default=0, min=0)
    gpu_type: str | None = setting("GPU model, e.g. `a100`, used in `--gres=gpu:<type>:N` when set.", default=None)
    max_time: str | None = setting(
        "Longest time limit the partition allows (Slurm time).", default=None, check=check_duration
    )
    default: bool = setting("Jobs that name no partition go here.", default=False)


@dataclass(kw_only=True, slots=True)
class Switch:
    """One switch of the tree: a leaf lists `nodes`, an upper switch lists `switches`."""

    name: str = setting("Switch name, unique in the site.", check=check_name)
    nodes: str | None = setting("Hostlist of the nodes on this leaf switch.", default=None, check=check_hostlist)
    switches: str | None = setting(
        "Hostlist of the child switches of this upper-level switch.", default=None, check=check_hostlist
    )


@dataclass(kw_only=True, slots=True)
class Topology:
    """Where the switch tree comes from; placement and `--switches` use it."""

    source: Literal["scontrol", "file", "none"] = setting(
        "`scontrol`: read `scontrol show topology` at render time; `file`: the `switches` below; "
        "`none`: treat every node as equally far.",
        default="scontrol",
    )
    switches: list[Switch] = setting("The tree, when `source: file`.", factory=list)
    switches_max_wait: str | None = setting(
        "Longest a job waits for the fewest leaf switches before Slurm places it anyway "
        "(`--switches=N@<this>`); unset: wait as long as Slurm's default.",
        default="00:30:00",
        check=check_duration,
    )


@dataclass(kw_only=True, slots=True)
class Launcher:
    """How ranks are started inside an allocation."""

    kind: Literal["srun", "mpirun"] = setting(
        "`srun` (Slurm sites) or `mpirun` (the local site, or sites without a PMI plugin).", default="srun"
    )
    mpi: str = setting("The srun MPI plugin (`srun --mpi=`), e.g. `pmix`, `pmix_v4`.", default="pmix", check=check_name)
    wait_seconds: int = setting(
        "`srun --wait`: after the first rank exits, seconds before the others are killed.", default=60, min=1
    )
    cpu_bind: str | None = setting(
        "`srun --cpu-bind=` for every rank, with `--distribution=block:block` so a node's ranks fill one socket "
        "before the next (local rank i on the socket of GPU i, as on DGX-style nodes, where GPUs are numbered by "
        "socket). null leaves binding to the site's defaults (clusters without task/affinity or task/cgroup).",
        default="cores",
        check=check_name,
    )
    extra_args: list[str] = setting("Extra arguments for srun or mpirun, each passed as one argument.", factory=list)


@dataclass(kw_only=True, slots=True)
class Environment:
    """What every job script sets up before the ranks start."""

    modules: list[str] = setting("Environment modules to `module load`, in order.", factory=list)
    source: list[str] = setting("Shell files to source (e.g. a site's conda or spack setup), in order.", factory=list)
    variables: dict[str, str] = setting(
        "Variables to export, e.g. NCCL settings (`NCCL_IB_HCA: mlx5`). Values are passed literally.",
        factory=dict,
        check=check_env_names,
    )


@dataclass(kw_only=True, slots=True)
class Filesystems:
    """Where runs, checkpoints and scratch data live, and what that filesystem can do."""

    scratch: str = setting("Scratch root for data and staging.", check=check_abs_path)
    run_root: str = setting("Where `hpcscale submit` creates run directories by default.", check=check_abs_path)
    checkpoint_root: str | None = setting(
        "Checkpoint root when it differs from the run directory (e.g. a burst buffer or a project filesystem). "
        "When the job starts, `RUN/checkpoints` becomes a symlink to `<checkpoint_root>/<run name>-<run id>` "
        "(array tasks: `.../sweep/NNNN`; the id is in `RUN/run-id`, so runs with the same directory name never "
        "share checkpoints); every command that takes RUN follows it. Unset: checkpoints live in RUN.",
        default=None,
        check=check_abs_path,
    )
    node_local: str | None = setting(
        "A directory on each compute node's own storage (local NVMe, a tmpfs) for the node-local checkpoint tier "
        "(job spec `checkpoint.local`). `$VARS` expand on the node, in the job's environment: "
        "`/local/$SLURM_JOB_ID`, or `$TMPDIR`. hpcscale keeps each run under `hpcscale-<run id>` in it.",
        default=None,
    )
    type: Literal["lustre", "gpfs", "beegfs", "nfs", "local"] = setting(
        "Filesystem type of scratch, as the site expects it: `hpcscale doctor` checks that scratch is mounted "
        "with this type. How files are written does not depend on it.",
        default="local",
    )


@dataclass(kw_only=True, slots=True)
class Staging:
    """How other sites reach this one's data (hpcscale stage)."""

    jobs: int = setting(
        "Parallel transfer streams of `hpcscale stage --site` (its `-j`): ssh connections or local copier "
        "processes. An explicit `-j` wins.",
        default=8,
        min=1,
        max=64,
    )
    bandwidth_limit_mbps: float | None = setting(
        "Cap on the transfer rate of `hpcscale stage --site`, in MB/s (10^6 bytes/s), all streams together "
        "(its `--bwlimit`). An explicit `--bwlimit` wins; unset or 0: no cap.",
        default=None,
        min=0,
    )


@dataclass(kw_only=True, slots=True)
class SlurmSettings:
    """How hpcscale talks to this site's Slurm."""

    conf: str | None = setting(
        "SLURM_CONF for this site's commands; unset uses the machine's default. Set for test clusters "
        "and for login nodes that reach more than one cluster.",
        default=None,
        check=check_abs_path,
    )
    cluster: str | None = setting(
        "Cluster name for `sacct -M` when accounting holds several.", default=None, check=check_name
    )


@dataclass(kw_only=True, slots=True)
class Reliability:
    """How often this site's nodes fail: what `checkpoint.every_steps: auto` plans for."""

    node_mtbf_hours: float = setting(
        "Mean time between failures of one node, in hours (anything that ends a job running on it: hardware, "
        "kernel, interconnect). A job on N nodes fails N times as often. The default, 5 years, is of the order "
        "published for large GPU clusters; put your centre's figure here.",
        default=43800.0,
        min=0.001,
    )


def check_peaks(peaks: dict[str, float]) -> str | None:
    bad = [f"{k}: {v}" for k, v in peaks.items() if not v > 0 or v != v or v == float("inf")]
    empty = [repr(k) for k in peaks if not re.search(r"[A-Za-z0-9]", k)]
    if empty:
        return f"a device name needs a letter or digit: {', '.join(empty)}"
    return f"not a positive TFLOPS figure: {', '.join(bad)}" if bad else None


@dataclass(kw_only=True, slots=True)
class Devices:
    """What the site's accelerators can do: what MFU is measured against (docs/observability.md#efficiency)."""

    peak_tflops: dict[str, float] = setting(
        "Peak dense TFLOPS of one device, by name: a key matches when its words appear, in order, in the name torch "
        "reports (`NVIDIA H100 80GB HBM3`; `cpu` for CPU ranks), the key with most words winning. Looked at before "
        "hpcscale's table of known accelerators (bf16 dense peaks); a CPU has none unless named here.",
        factory=dict,
        check=check_peaks,
    )


@dataclass(kw_only=True, slots=True)
class SiteConfig:
    """A site: one cluster (or this machine) and how to run on it."""

    name: str = setting("Site name; job specs refer to it with `site:`.", check=check_name)
    description: str = setting("One line for people: the first line of `hpcscale config show`.", default="")
    example: bool = setting(
        "Marks a file modelled on a public cluster, shipped as an example to adapt (`config show` says so).",
        default=False,
    )
    scheduler: Literal["slurm", "local"] = setting("`slurm`, or `local` for this machine through mpirun without Slurm.")
    partitions: list[Partition] = setting("The partitions jobs may use (none for `local`).", factory=list)
    topology: Topology = setting("The switch tree.", factory=Topology)
    launcher: Launcher = setting("How ranks start.", factory=Launcher)
    environment: Environment = setting("Job environment set-up.", factory=Environment)
    filesystems: Filesystems = setting("Scratch, runs and checkpoints.")
    staging: Staging = setting("Cross-site data staging.", factory=Staging)
    slurm: SlurmSettings = setting("Slurm client settings.", factory=SlurmSettings)
    reliability: Reliability = setting("Node failure rate.", factory=Reliability)
    devices: Devices = setting("Accelerator peaks for MFU.", factory=Devices)

    def partition(self, name: str | None) -> Partition | None:
        """The partition called `name`, or the default one when `name` is None."""
        for p in self.partitions:
            if (name is None and p.default) or p.name == name:
                return p
        if name is None and len(self.partitions) == 1:
            return self.partitions[0]
        return None
