"""Load and validate site configs and job specs: the library behind `config validate` and every command
that reads a job. Cross-field rules live here; each failure names file, line and key (exit code 2)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from hpcscale.config.decode import Decoder
from hpcscale.config.errors import COMMAND_LINE, ConfigError, ConfigIssue, did_you_mean
from hpcscale.config.job import JobSpec
from hpcscale.config.overrides import Override, apply_overrides, parse_overrides
from hpcscale.config.site import SiteConfig
from hpcscale.config.train import TrainConfig, train_checks
from hpcscale.config.yamlsrc import MAX_BYTES, YamlSource, load_yaml, parse_yaml
from hpcscale.errors import BadInput
from hpcscale.layout import ParallelDims, keyed_axes, layout_problems
from hpcscale.util.hostlist import expand
from hpcscale.util.resources import SITE_CONFIGS, find_shipped
from hpcscale.util.slurmtime import parse_duration
from hpcscale.util.trust import read_trusted

SITE_PATH_ENV = "HPCSCALE_SITE_PATH"


@dataclass(frozen=True, slots=True)
class LoadedSite:
    config: SiteConfig
    path: Path


@dataclass(frozen=True, slots=True)
class LoadedJob:
    spec: JobSpec
    path: Path
    site: LoadedSite
    warnings: tuple[ConfigIssue, ...] = ()  # valid but likely wrong (config validate and submit print them)
    # The command-line overrides (-p) applied to the file, and the YAML decoded (file plus overrides, with
    # where each key came from: for later checks that name a key's place).
    overrides: tuple[Override, ...] = ()
    source: YamlSource | None = None


def site_search_path() -> list[Path]:
    """Where site names are looked up, first match wins: $HPCSCALE_SITE_PATH (colon-separated absolute
    directories), ~/.config/hpcscale/sites, then the site configs shipped with hpcscale. Never the working
    directory: a site file there is used only when the user names it by its path (`site: ./site_configs/x.yaml`,
    `--site ./x.yaml`), since a site names programs, libraries and PYTHONPATH entries that every rank runs."""
    dirs = []
    for entry in (p for p in os.environ.get(SITE_PATH_ENV, "").split(":") if p):
        if not os.path.isabs(entry):
            raise BadInput(
                f"{SITE_PATH_ENV}: '{entry}' is not an absolute directory; site names are never looked up where "
                "you stand: give the directory's absolute path, or name the site file by its path"
            )
        dirs.append(Path(entry))
    dirs += [Path.home() / ".config" / "hpcscale" / "sites"]
    shipped = find_shipped(SITE_CONFIGS)  # inside the installed wheel, or the checkout's for editable installs
    dirs += [shipped] if shipped is not None else []
    return dirs


@dataclass(frozen=True, slots=True)
class FoundSite:
    path: Path
    # Found by name in a directory others may write ($HPCSCALE_SITE_PATH, ~/.config/hpcscale/sites): read only
    # from a file the user may trust. Not the shipped site configs: they belong to the installation whose code
    # runs anyway (whoever can write them can write hpcscale itself), nor a file the user named by its path.
    vet: bool


def _named_by_path(name_or_path: str) -> bool:
    return name_or_path.endswith((".yaml", ".yml")) or "/" in name_or_path


def find_site(name_or_path: str, *, relative_to: Path | None = None) -> Path | None:
    """The file for a site name (or an explicit path to a site file), or None."""
    found = _find_site(name_or_path, relative_to=relative_to)
    return found.path if found is not None else None


def _find_site(name_or_path: str, *, relative_to: Path | None = None) -> FoundSite | None:
    if _named_by_path(name_or_path):
        p = Path(name_or_path).expanduser()
        if not p.is_absolute() and relative_to is not None:
            p = relative_to / p
        return FoundSite(p, vet=False) if p.is_file() else None
    shipped = find_shipped(SITE_CONFIGS)
    for d in site_search_path():
        for ext in (".yaml", ".yml"):
            candidate = d / f"{name_or_path}{ext}"
            if candidate.is_file():
                if d == shipped:
                    return FoundSite(candidate, vet=False)
                # a symlink (a dotfiles manager's) is followed, and the file it leads to checked and read
                return FoundSite(Path(os.path.realpath(candidate)), vet=True)
    return None


def known_sites() -> list[str]:
    names: set[str] = set()
    for d in site_search_path():
        if d.is_dir():
            names.update(p.stem for p in d.glob("*.y*ml"))
    return sorted(names)


def parse_site(src: YamlSource) -> SiteConfig:
    dec = Decoder(src)
    site = dec.decode(SiteConfig, src.data)
    dec.raise_if_any()
    _check_site(site, dec)
    dec.raise_if_any()
    return site


def load_site(path: str | Path, *, vet: bool = False) -> LoadedSite:
    """The site config in `path`; with `vet`, read only from a file owned by the user or root and writable by no
    one else, checked on the descriptor read (hpcscale.util.trust, as a run directory's site.yaml)."""
    p = Path(path)
    if not vet:
        return LoadedSite(parse_site(load_yaml(p)), p)
    data = read_trusted(p, what="site config", max_bytes=MAX_BYTES)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError([ConfigIssue(str(p), None, "", f"not UTF-8 text ({e.reason})")]) from None
    return LoadedSite(parse_site(parse_yaml(text, str(p))), p)


def _load_found(found: FoundSite) -> LoadedSite:
    return load_site(found.path, vet=found.vet)


def _no_such_site(name: str) -> str:
    known = known_sites()
    return (
        f"no such site '{name}'{did_you_mean(name, known)}; known sites: {', '.join(known) or 'none'} "
        f"(search path: ${SITE_PATH_ENV}, ~/.config/hpcscale/sites, the shipped sites; a site file elsewhere, "
        "the working directory included, is named by its path: ./site_configs/NAME.yaml)"
    )


def resolve_site(name_or_path: str, *, relative_to: Path | None = None) -> LoadedSite:
    found = _find_site(name_or_path, relative_to=relative_to)
    if found is None:
        raise ConfigError([ConfigIssue(name_or_path, None, "", _no_such_site(name_or_path))])
    return _load_found(found)


def load_job(path: str | Path, *, site: str | None = None, overrides: Sequence[str] = ()) -> LoadedJob:
    """A validated job spec and its site. `site` overrides the spec's `site:` (the --site option);
    `overrides` are `-p KEY=VALUE` texts, set in the parsed file before it is decoded
    (hpcscale.config.overrides)."""
    p = Path(path)
    parsed = parse_overrides(overrides)
    src = apply_overrides(load_yaml(p), parsed)
    dec = Decoder(src)
    spec = dec.decode(JobSpec, src.data)
    dec.raise_if_any()
    resolve_paths(spec, src, job_dir=Path(os.path.abspath(p.parent)))
    if site:  # the --site option: a bad name is the option's fault, not the spec's
        loaded_site = resolve_site(site)
    else:
        found = _find_site(spec.site, relative_to=p.parent)
        if found is None:
            raise ConfigError([ConfigIssue(*src.locate(("site",)), "site", _no_such_site(spec.site))])
        loaded_site = _load_found(found)
    check_job(spec, loaded_site.config, dec)
    dec.raise_if_any()
    return LoadedJob(spec, p, loaded_site, tuple(dec.warnings), parsed, src)


# Job spec keys that name a file or directory: a relative one means the same under `run --local` (ranks start
# where you stand) and under `submit` (ranks start in the run directory) only once it is made absolute.
PATH_KEYS = (("data", "manifest"), ("xsite", "config"), ("xsite", "start_from"))


def resolve_paths(spec: JobSpec, src: YamlSource, *, job_dir: Path) -> None:
    """Make every relative path of PATH_KEYS absolute, in place: one from the job file against the job file's
    directory, one from `-p KEY=VALUE` against the working directory (where the command line was typed). A path
    starting with `~` or `$` is left for the machine that uses it to expand (a compute node's $HOME or $SCRATCH).
    The run directory's job.yaml is written from the spec, so the ranks read the absolute path."""
    for key in PATH_KEYS:
        owner = spec
        for part in key[:-1]:
            owner = getattr(owner, part, None)
            if owner is None:
                break
        value = getattr(owner, key[-1], None) if owner is not None else None
        if not value or value.startswith(("~", "$")) or Path(value).is_absolute():
            continue
        base = Path.cwd() if src.locate(key)[0] == COMMAND_LINE else job_dir
        setattr(owner, key[-1], os.path.normpath(base / value))


def load_job_source(src: YamlSource, path: Path, site: LoadedSite) -> LoadedJob:
    """A validated job spec from YAML already read (and vetted) by the caller, with its site: a run directory's
    job.yaml, parsed from the very bytes whose owner and mode were checked (hpcscale.rundir.RunDir.load_job)."""
    dec = Decoder(src)
    spec = dec.decode(JobSpec, src.data)
    dec.raise_if_any()
    check_job(spec, site.config, dec)
    dec.raise_if_any()
    return LoadedJob(spec, path, site, tuple(dec.warnings), (), src)


def detect_kind(src: YamlSource) -> str:
    """'site', 'job' or 'xsite' (a cross-site config) for a file given to `config validate` without --kind."""
    data = src.data if isinstance(src.data, dict) else {}
    if {"scheduler", "partitions", "filesystems"} & data.keys():
        return "site"
    return "xsite" if {"aggregator", "round_steps"} & data.keys() else "job"


def _check_site(site: SiteConfig, dec: Decoder) -> None:
    names = [p.name for p in site.partitions]
    for i, p in enumerate(site.partitions):
        if names.index(p.name) != i:
            dec.error(("partitions", i, "name"), f"partition '{p.name}' is defined twice")
    defaults = [i for i, p in enumerate(site.partitions) if p.default]
    for i in defaults[1:]:
        dec.error(("partitions", i, "default"), "more than one partition is the default")
    if site.scheduler == "slurm" and not site.partitions:
        dec.error(("partitions",), "a slurm site needs at least one partition")
    if site.scheduler == "local" and site.launcher.kind != "mpirun":
        dec.error(("launcher", "kind"), "a local site launches with mpirun (there is no srun without Slurm)")
    if site.topology.source == "file":
        _check_switches(site, dec)
    elif site.topology.switches:
        dec.error(
            ("topology", "switches"), f"switches are only read with source: file (source is '{site.topology.source}')"
        )


def _check_switches(site: SiteConfig, dec: Decoder) -> None:
    switches = site.topology.switches
    if not switches:
        dec.error(("topology", "switches"), "source: file needs the switches listed")
        return
    names = {s.name for s in switches}
    for i, s in enumerate(switches):
        if (s.nodes is None) == (s.switches is None):
            dec.error(("topology", "switches", i), f"switch '{s.name}' needs exactly one of nodes or switches")
        if s.switches is not None:
            unknown = [c for c in expand(s.switches) if c not in names]
            if unknown:
                dec.error(("topology", "switches", i, "switches"), f"unknown switches: {', '.join(unknown)}")
    on_leaves = {n for s in switches if s.nodes for n in expand(s.nodes)}
    for i, p in enumerate(site.partitions):
        missing = [n for n in expand(p.nodes) if n not in on_leaves]
        if missing:
            dec.error(
                ("partitions", i, "nodes"),
                f"nodes on no switch: {', '.join(missing[:5])}" + (" ..." if len(missing) > 5 else ""),
            )


def on_nodes(loaded: LoadedJob, nodes: int) -> tuple[LoadedJob, list[ConfigIssue]]:
    """Job `loaded` run on `nodes` nodes instead of its own (`hpcscale resume --nodes`, restart.shrink), and what
    is wrong with it there (the layout, the built-in trainer's batch rules; [] when it fits), each issue located
    in the job file as at load."""
    spec = replace(loaded.spec, nodes=nodes)
    dec = Decoder(loaded.source or load_yaml(loaded.path))  # -p overrides keep their "command line" place
    check_job(spec, loaded.site.config, dec)
    return LoadedJob(spec, loaded.path, loaded.site), dec.issues


def check_job(spec: JobSpec, site: SiteConfig, dec: Decoder) -> None:
    if spec.train is not None and spec.command is not None:
        dec.error(("command",), "give either train or command, not both")
    if spec.command is not None and not spec.command:
        dec.error(("command",), "must name a program")
    if spec.sweep is not None and spec.sweep.size > 100_000:
        dec.error(("sweep", "params"), f"{spec.sweep.size} combinations; Slurm arrays are far smaller")
    problems = layout_problems(nodes=spec.nodes, tasks_per_node=spec.tasks_per_node, **spec.parallel.degrees)
    for problem in problems:
        dec.error(tuple(problem.key.split(".")), problem.message)
    # The trainer's rules need dp, which exists once the mesh divides the world (an axis whose groups stay in a
    # node, tp, may still break one).
    in_node = {f"parallel.{a.key}" for a in keyed_axes() if a.in_node}
    if spec.train is not None and spec.train.entry == "builtin" and all(p.key in in_node for p in problems):
        dims = ParallelDims.for_world(world_size=spec.world_size, **spec.parallel.degrees)
        _check_train_params(spec, dec, dims=dims)
    limit_s = parse_duration(spec.time_limit)
    _check_stopping(spec, site, dec, limit_s)
    if spec.checkpoint.local.every_steps and site.filesystems.node_local is None:
        dec.error(
            ("checkpoint", "local", "every_steps"),
            f"the node-local tier needs a directory on each node: site '{site.name}' sets no filesystems.node_local",
        )
    if spec.data.manifest and not spec.data.manifest.startswith(("~", "$")):
        manifest = Path(spec.data.manifest)
        if not manifest.is_absolute():
            pass  # a run directory's job.yaml from before paths were made absolute: read where the ranks start
        elif site.scheduler == "local" and not manifest.is_file():
            dec.error(("data", "manifest"), f"{manifest}: no such file (a relative path is read from the job file's "
                      "directory, or with -p from the working directory)")  # fmt: skip
        elif site.scheduler == "slurm" and not manifest.exists():
            dec.warn(("data", "manifest"), f"{manifest} does not exist on this machine: the ranks will need it on "
                     "the compute nodes (a relative path is read from the job file's directory)")  # fmt: skip
    if spec.xsite is not None:
        _check_xsite(spec, dec)
    if spec.train is not None and spec.train.entry != "builtin":
        from hpcscale.config.entry import entry_problem

        env = {**site.environment.variables, **spec.environment}
        found = entry_problem(spec.train.entry, [p for p in env.get("PYTHONPATH", "").split(":") if p])
        if found is not None:
            (dec.error if found[0] == "error" else dec.warn)(("train", "entry"), found[1])
    in_place = [k for k in ("spare_nodes", "shrink") if getattr(spec.restart, k)]  # a relaunch in the allocation
    if in_place and (spec.command is not None or spec.sweep is not None or spec.container):
        what = "a `command:` job" if spec.command is not None else "a sweep" if spec.sweep else "a container job"
        dec.error(
            ("restart", in_place[0]),
            f"{what} cannot have restart.{in_place[0]}: only the default template relaunches a step in place",
        )
    if site.scheduler == "local":
        if spec.nodes != 1:
            dec.error(("nodes",), f"site '{site.name}' is this machine only: nodes must be 1")
        if in_place:
            dec.error(
                ("restart", in_place[0]),
                f"site '{site.name}' has no Slurm allocation to relaunch a step in (restart.{in_place[0]})",
            )
        return
    part = site.partition(spec.partition)
    if part is None:
        known = [p.name for p in site.partitions]
        what = f"no partition '{spec.partition}'" if spec.partition else "no partition given and no default"
        dec.error(
            ("partition",),
            f"{what} in site '{site.name}'{did_you_mean(spec.partition or '', known)} (partitions: {', '.join(known)})",
        )
        return
    where = f"partition '{part.name}'"
    count = len(expand(part.nodes))
    if spec.nodes > count:
        dec.error(("nodes",), f"{spec.nodes} nodes requested but {where} has {count}")
    elif spec.nodes + spec.restart.spare_nodes > count:
        dec.error(
            ("restart", "spare_nodes"),
            f"{spec.nodes} nodes and {spec.restart.spare_nodes} spares requested but {where} has {count}",
        )
    if spec.gpus_per_node > part.gpus_per_node:
        dec.error(
            ("gpus_per_node",), f"{spec.gpus_per_node} GPUs per node requested but {where} has {part.gpus_per_node}"
        )
    elif spec.gpus_per_node == 0 and part.gpus_per_node and spec.device != "cpu" and spec.command is None:
        # Slurm hides the GPUs a job did not ask for (cgroup ConstrainDevices): its ranks would see none and
        # train on the CPU with gloo, silently, on a GPU node
        dec.error(
            ("gpus_per_node",),
            f"{where} has {part.gpus_per_node} GPUs per node and the job requests none: on partitions that "
            "constrain devices the ranks would see no GPU and train on the CPU. Request them "
            f"(gpus_per_node: {part.gpus_per_node}), or set device: cpu to train on the CPUs on purpose",
        )
    if spec.device == "cuda" and not part.gpus_per_node:
        dec.error(("device",), f"device is cuda but {where} has no GPUs (its gpus_per_node is 0)")
    cores = spec.tasks_per_node * spec.cpus_per_task
    if cores > part.cpus_per_node:
        dec.error(
            ("cpus_per_task",),
            f"tasks_per_node({spec.tasks_per_node}) * cpus_per_task"
            f"({spec.cpus_per_task}) = {cores} cores, but {where} nodes have {part.cpus_per_node}",
        )
    if spec.gpus_per_node and site.launcher.cpu_bind and cores < part.cpus_per_node:
        # srun --distribution=block:block packs the ranks' cores from the first socket: only ranks that fill
        # the node are spread over the sockets the way GPUs are numbered
        dec.warn(
            ("cpus_per_task",),
            f"the ranks take {cores} of the {part.cpus_per_node} cores of {where}'s nodes: bound with "
            f"--cpu-bind={site.launcher.cpu_bind} --distribution=block:block they sit on the first socket(s), far from "
            f"the other sockets' GPUs; set cpus_per_task: {part.cpus_per_node // spec.tasks_per_node}",
        )
    if part.max_time is not None and limit_s > parse_duration(part.max_time):
        dec.error(("time_limit",), f"{spec.time_limit} is over {where}'s limit of {part.max_time}")


def _check_xsite(spec: JobSpec, dec: Decoder) -> None:
    """The cross-site config the job names must load and list the job's site."""
    from hpcscale.config.xsite import load_xsite
    from hpcscale.util.paths import expand_path

    assert spec.xsite is not None
    if spec.train is None:
        dec.error(("xsite",), "a cross-site site trains: it needs `train:` (builtin, or an entry using ctx.checkpoint)")
        return
    if spec.train.on_spike == "rollback":
        dec.error(
            ("train", "on_spike"),
            "rollback is not supported for a cross-site site (xsite:): its rounds' checkpoints are shared with "
            "the other sites; use warn",
        )
    if spec.parallel.dp_shard > 1:
        dec.error(
            ("parallel", "dp_shard"),
            f"dp_shard is {spec.parallel.dp_shard}: cross-site training (xsite:) is not supported with sharded "
            "data parallelism yet; a cross-site site trains with dp_shard: 1",
        )
    try:
        cfg = load_xsite(expand_path(spec.xsite.config))
    except ConfigError as e:
        dec.error(("xsite", "config"), f"{spec.xsite.config} is not a valid cross-site config: {e}")
        return
    except OSError as e:
        dec.error(("xsite", "config"), f"cannot read {spec.xsite.config}: {e.strerror or e}")
        return
    if cfg.site(spec.xsite.site) is None:
        names = [s.name for s in cfg.sites]
        hint = did_you_mean(spec.xsite.site, names)
        dec.error(("xsite", "site"), f"'{spec.xsite.site}' is not a site of {cfg.name}{hint}")


def _check_stopping(spec: JobSpec, site: SiteConfig, dec: Decoder, limit_s: int) -> None:
    """The stop signal and the timeouts: the mistakes a spec can make about them (docs/runbook.md, tuning);
    `limit_s`: the time limit in seconds."""
    trainer = spec.command is None
    if site.scheduler == "slurm" and spec.signals.grace_seconds >= limit_s:
        dec.error(
            ("signals", "grace_seconds"),
            f"{spec.signals.grace_seconds} s is not shorter than the time limit ({spec.time_limit}): the stop "
            "signal would come as the job starts",
        )
    if trainer and spec.signals.signal == "USR1":
        dec.warn(
            ("signals", "signal"),
            "NCCL and UCX may install their own SIGUSR1 handler, which takes the stop signal from the ranks; "
            "USR2 (the default) is free",
        )
    if trainer and spec.hang_timeout_seconds >= spec.timeout_seconds:
        dec.warn(
            ("hang_timeout_seconds",),
            f"{spec.hang_timeout_seconds} s is not below timeout_seconds ({spec.timeout_seconds} s): a hung "
            "collective times out first, without naming the stuck rank or writing the stacks",
        )


def _check_train_params(spec: JobSpec, dec: Decoder, *, dims: ParallelDims) -> None:
    """The built-in trainer's params, decoded where they stand (train.params.KEY) and checked against the layout."""
    path = ("train", "params")
    cfg = dec.decode(TrainConfig, spec.train.params, path)
    if cfg is None:
        return
    for key, message in train_checks(cfg, dims=dims):
        dec.error((*path, key), message)
