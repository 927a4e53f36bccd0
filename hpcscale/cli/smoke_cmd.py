"""`hpcscale smoke`."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from hpcscale.cli.options import console, json_option, print_json, site_option

_STYLE = {"pass": "[green]pass[/green]", "fail": "[red]FAIL[/red]", "skip": "[dim]skip[/dim]"}


def format_smoke(report):
    """A rich Table of the smoke test's checks."""
    from rich.table import Table

    layout = report.layout
    title = (
        f"hpcscale smoke — {report.where}, {report.device}: {layout['nodes']} node(s) x {layout['tasks_per_node']} "
        f"ranks, tp={layout['tp']} pp={layout['pp']} dp={layout['dp']}"
    )
    table = Table(title=title, show_lines=False)
    for col in ("check", "result", "detail"):
        table.add_column(col, overflow="fold")
    for c in report.checks:
        table.add_row(c.name, _STYLE[c.status], c.detail)
    return table


@click.command()
@site_option
@click.option("--local", is_flag=True, help="Run on this machine through mpirun instead of a Slurm site.")
@click.option("-n", "ranks", type=click.IntRange(1), default=None, help="--local: ranks (default: one per GPU, or 4).")
@click.option("--nodes", type=click.IntRange(1), default=None, help="Slurm: nodes (default 2).")
@click.option("--partition", default=None, help="Slurm: the partition (default: the site's default).")
@click.option("--tp", type=click.IntRange(1), default=None, help="Tensor-parallel degree (default 2 where it divides).")
@click.option("--pp", type=click.IntRange(1), default=None, help="Pipeline degree (default 2 where it divides).")
@click.option("--steps", type=click.IntRange(4), default=8, show_default=True, help="Training steps of each run.")
@click.option(
    "--min-busbw",
    type=click.FloatRange(min=0),
    default=None,
    metavar="GB/S",
    help="Fail the all-reduce check below this bus bandwidth (e.g. what your fabric gives; default: report only).",
)
@click.option(
    "--run-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Where the smoke jobs' run directories go (default: <run_root>/smoke-<UTC time>).",
)
@json_option
def smoke(site, local, ranks, nodes, partition, tp, pp, steps, min_busbw, run_dir, as_json) -> None:
    """Check new GPU nodes before the first real job: devices and binding, an all-reduce and its bandwidth, a
    short bf16 run at tp x pp x dp against tp=pp=1, an asynchronous checkpoint verified and resumed bit for
    bit, and an NCCL timeout diagnosed as `resume` would. Each check is a real job (sbatch, or mpirun with
    --local); on the CPU the NCCL-only checks are skipped and say so.

    \b
    Examples:
      hpcscale smoke --site mycluster --nodes 2      # two GPU nodes, one rank per GPU
      hpcscale smoke --local                         # this machine: one rank per GPU, or 4 on the CPU
      hpcscale smoke --site localcluster --json

    Exit codes: 0 every check passed or was skipped, 1 a check failed, 2 bad input.
    """
    from hpcscale.config.load import resolve_site
    from hpcscale.rundir import default_run_dir
    from hpcscale.smoke.checks import make_plan, run_smoke
    from hpcscale.smoke.runners import LocalRunner, SlurmRunner
    from hpcscale.util.paths import expand_path

    plan = make_plan(
        site=site,
        local=local,
        ranks=ranks,
        nodes=nodes,
        partition=partition,
        tp=tp,
        pp=pp,
        steps=steps,
        min_busbw_gbps=min_busbw,
    )
    if run_dir is None:
        run_root = expand_path(resolve_site(plan.site).config.filesystems.run_root)
        run_dir = default_run_dir(run_root, "smoke")  # <run_root>/smoke-<UTC time>
    root = run_dir.resolve()
    runner = LocalRunner(root) if local else SlurmRunner(root)
    say = (lambda line: click.echo(line, err=True)) if not as_json else (lambda _line: None)
    report = run_smoke(plan, root, runner, say=say)
    if as_json:
        print_json(report.to_json())
    else:
        console().print(format_smoke(report))
        click.echo(f"run directories: {root}", err=True)
    sys.exit(0 if report.passed else 1)
