"""sbatch scripts from jinja2 templates: a pure function of a ResolvedJob (same input, same bytes).

Every user-provided value reaches the script through the `sh` filter (shlex.quote) or as a fixed-format
number, so a job name like `x; rm -rf ~` is just a name. Template variables: docs/templates.md.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

from hpcscale import __version__
from hpcscale.config.rank_env import rank_defaults, ranks_on_cpu
from hpcscale.config.render import to_plain
from hpcscale.errors import BadInput
from hpcscale.slurm.resolve import ResolvedJob
from hpcscale.util.hostlist import compress
from hpcscale.util.resources import templates_dir
from hpcscale.util.slurmtime import format_duration

BUILTIN_TEMPLATES = ("default", "container", "array")


def choose_template(job: ResolvedJob, template: str | None) -> str:
    """The built-in a spec implies (array for sweeps, container for containers), or the one asked for."""
    spec = job.spec
    name = template or ("array" if spec.sweep else "container" if spec.container else "default")
    if name == "array" and spec.sweep is None:
        raise BadInput("template 'array' needs a `sweep:` section in the job spec")
    if name == "container" and spec.container is None:
        raise BadInput("template 'container' needs a `container:` section in the job spec")
    if name in BUILTIN_TEMPLATES and spec.sweep is not None and name != "array":
        raise BadInput(f"the job spec has a `sweep:`; template '{name}' would ignore it (use --template array)")
    return name


def template_context(job: ResolvedJob, template_name: str) -> dict[str, Any]:
    spec, site, run_dir = job.spec, job.site, job.run_dir
    variables = {**site.environment.variables, **spec.environment}
    launcher = site.launcher
    # --cpus-per-task again: Slurm 22.05-23.02 steps do not inherit it from the allocation (one core per rank
    # while OMP_NUM_THREADS says cpus_per_task); binding keeps each rank on its cores, on its GPU's socket
    binding = [f"--cpu-bind={launcher.cpu_bind}", "--distribution=block:block"] if launcher.cpu_bind else []
    srun = [
        "srun",
        "--kill-on-bad-exit=1",
        f"--wait={launcher.wait_seconds}",
        f"--mpi={launcher.mpi}",
        f"--cpus-per-task={spec.cpus_per_task}",
        *binding,
        *launcher.extra_args,
    ]
    program = list(spec.command) if spec.command is not None else ["hpcscale", "launch", "--run-dir", str(run_dir)]
    gpus = spec.gpus_per_node
    gpu_request = (f"{job.partition.gpu_type}:{gpus}" if job.partition.gpu_type else str(gpus)) if gpus else None
    log_name = "slurm-%A_%a" if template_name == "array" else "slurm-%j"
    container = to_plain(spec.container) if spec.container else None
    if container is not None:
        container["mounts"] = [*container["mounts"], f"{run_dir}:{run_dir}"]
        container["workdir"] = container["workdir"] or str(run_dir)
    return {
        "version": __version__,
        "template_name": template_name,
        "run_dir": str(run_dir),
        "job": {
            "name": spec.name,
            "nodes": spec.nodes + spec.restart.spare_nodes,  # the allocation: the step's nodes and the spares
            "step_nodes": spec.nodes,
            "spare_nodes": spec.restart.spare_nodes,
            "shrink": spec.restart.shrink,
            "in_place": bool(spec.restart.spare_nodes or spec.restart.shrink),  # steps relaunched in the allocation
            "tasks_per_node": spec.tasks_per_node,
            "cpus_per_task": spec.cpus_per_task,
            "gpus_per_node": gpu_request,
            "time": format_duration(job.time_limit_s),
            "partition": job.partition.name,
            "account": spec.account,
            "qos": spec.qos,
            "switches": job.switches,
            "switches_wait": site.topology.switches_max_wait,
            "exclude": compress(list(job.excluded)) if job.excluded else None,
            "nodelist": compress(list(job.required)) if job.required else None,
            "signal": spec.signals.signal,
            "grace_seconds": spec.signals.grace_seconds,
            "requeue": spec.signals.requeue,
            "is_command": spec.command is not None,
        },
        "site": {"name": site.name},
        "logs": {"out": f"{run_dir}/logs/{log_name}.out", "err": f"{run_dir}/logs/{log_name}.err"},
        "env": {
            "modules": list(site.environment.modules),
            "source": list(site.environment.source),
            "variables": [*site.environment.variables.items(), *spec.environment.items()],
            # exported as ${NAME:-value}: a value the batch script inherits (the submitting shell's) wins
            "defaults": sorted(rank_defaults(spec, variables, on_cpu=ranks_on_cpu(spec)).items()),
        },
        "srun": srun,
        "program": program,
        "container": container,
        "sweep": {"size": spec.sweep.size, "max_parallel": spec.sweep.max_parallel} if spec.sweep else None,
    }


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def _directive_values_one_line(ctx: dict[str, Any]) -> None:
    """Refuse (BadInput) a value that goes on an `#SBATCH` line when it holds a line break or another control
    character: shlex.quote keeps a newline inside its quotes, and after it, on a line of its own, the rest is a
    command to bash (an `#SBATCH` line is a comment to it). Checked on the context, not in the `sh` filter: an
    exported variable may hold a newline; whatever template (a site's own too) puts these on directive lines.
    The excluded nodes come from files others may write (RUN/submissions.jsonl, timing.jsonl, the logs)."""
    job = ctx["job"]
    keys = ("name", "partition", "account", "qos", "exclude", "nodelist", "gpus_per_node")
    values = {f"job.{k}": job.get(k) for k in keys}
    values |= {"run_dir": ctx["run_dir"], "logs.out": ctx["logs"]["out"], "logs.err": ctx["logs"]["err"]}
    for key, value in values.items():
        text = "" if value is None else str(value)
        bad = _CONTROL.search(text)
        if bad:
            raise BadInput(
                f"refusing to render the batch script: {key} {text[:60]!r} holds the control character "
                f"{bad.group()!r}, which would end its #SBATCH line (a value from a file others could write?)"
            )


def render_script(job: ResolvedJob, template: str | None = None) -> str:
    """The sbatch script for `job` from a built-in template name or a path to the user's own template (None:
    the built-in the spec implies)."""
    return render_chosen(job, choose_template(job, template))


def render_chosen(job: ResolvedJob, name: str) -> str:
    """The sbatch script for `job` from template `name`, as choose_template returned it."""
    import jinja2

    if name in BUILTIN_TEMPLATES:
        loader: jinja2.BaseLoader = jinja2.FileSystemLoader(templates_dir())
        filename = f"{name}.sbatch.j2"
    else:
        path = Path(name).expanduser()
        if not path.is_file():
            raise BadInput(f"template '{name}' is neither a built-in ({', '.join(BUILTIN_TEMPLATES)}) nor a file")
        loader, filename = jinja2.FileSystemLoader(path.parent), path.name
    env = jinja2.Environment(
        loader=loader,
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )
    env.filters["sh"] = lambda v: shlex.quote(str(v))
    env.filters["shjoin"] = lambda vs: shlex.join(str(v) for v in vs)
    try:
        ctx = template_context(job, name)
        _directive_values_one_line(ctx)
        return env.get_template(filename).render(ctx)
    except jinja2.TemplateSyntaxError as e:
        raise BadInput(f"{e.filename or filename}:{e.lineno}: template syntax: {e.message}") from None
    except jinja2.UndefinedError as e:
        raise BadInput(f"{filename}: template uses an unknown variable: {e.message} (see docs/templates.md)") from None
