"""`hpcscale render`, `submit`, `status`."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from hpcscale.cli.options import (
    console,
    dry_run_option,
    json_option,
    load_job_warning,
    param_option,
    print_json,
    site_option,
)

job_argument = click.argument("job", type=click.Path(dir_okay=False))
run_dir_option = click.option(
    "--run-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Run directory (default: <site run_root>/<job name>-<UTC time>).",
)
template_option = click.option(
    "--template", default=None, metavar="T", help="Built-in template (default, container, array) or a path to your own."
)


@click.command()
@job_argument
@site_option
@template_option
@run_dir_option
@param_option
def render(job: str, site: str | None, template: str | None, run_dir: Path | None, params: tuple[str, ...]) -> None:
    """Print the sbatch script for JOB; nothing is submitted or written.

    \b
    Examples:
      hpcscale render job.yaml
      hpcscale render job.yaml --site localcluster --template container > job.sbatch
      hpcscale render job.yaml -p nodes=4 -p time_limit=02:00:00
    """
    from hpcscale.slurm.submit import render_job

    text = render_job(load_job_warning(job, site, params), run_dir=run_dir, template=template)
    if sys.stdout.isatty():
        from rich.syntax import Syntax

        console().print(Syntax(text, "bash"))
    else:
        sys.stdout.write(text)


@click.command()
@job_argument
@site_option
@template_option
@run_dir_option
@click.option("--reuse", is_flag=True, help="Add this submission to an existing run directory.")
@param_option
@dry_run_option
@json_option
def submit(
    job: str,
    site: str | None,
    template: str | None,
    run_dir: Path | None,
    reuse: bool,
    params: tuple[str, ...],
    dry_run: bool,
    as_json: bool,
) -> None:
    """Render JOB, create its run directory, and submit it with sbatch; prints the job id.

    \b
    Examples:
      hpcscale submit job.yaml
      hpcscale submit job.yaml --run-dir /scratch/me/runs/exp1 --json
      hpcscale submit job.yaml --dry-run     # everything but sbatch
      hpcscale submit job.yaml -p train.params.lr=3e-4 -p nodes=4   # recorded in RUN/job.yaml

    Slurm's refusal is printed verbatim (exit 1).
    """
    from hpcscale.slurm.submit import submit_job

    loaded = load_job_warning(job, site, params)
    r = submit_job(loaded, run_dir=run_dir, template=template, dry_run=dry_run, reuse=reuse)
    if as_json:
        print_json(
            {
                "job_id": r.job_id,
                "cluster": r.cluster,
                "run_dir": str(r.run_dir),
                "script": str(r.script),
                "template": r.template,
                "switches": r.switches,
                "dry_run": r.dry_run,
            }
        )
    elif dry_run:
        click.echo(f"dry run: script written to {r.script} (not submitted)")
    else:
        click.echo(r.job_id)
        click.echo(f"run directory: {r.run_dir}", err=True)


def format_status(status):
    """A rich Table of a run's submissions and Slurm jobs."""
    from rich.table import Table

    table = Table(title=f"{status.job_name or 'run'} — {status.run_dir} (states from {status.source})")
    for col in ("#", "job id", "submitted", "reason", "state", "exit", "nodes", "elapsed"):
        table.add_column(col, overflow="fold")
    colors = {"COMPLETED": "green", "RUNNING": "cyan", "PENDING": "yellow"}
    for s in status.submissions:
        sub = s.submission
        rows = s.jobs or [None]
        for job in rows:
            state = job.state if job else "-"
            color = colors.get(state.split()[0] if state else "", "red" if job else "")
            table.add_row(
                str(sub.index),
                job.job_id if job else (sub.job_id or "dry run"),
                sub.time,
                sub.reason + (f" (excluded {','.join(sub.excluded)})" if sub.excluded else ""),
                f"[{color}]{state}[/{color}]" if color else state,
                job.exit_code if job else "",
                job.nodes if job else "",
                job.elapsed if job else "",
            )
    return table


@click.command()
@click.argument("run", type=click.Path(file_okay=False, exists=True, path_type=Path))
@json_option
def status(run: Path, as_json: bool) -> None:
    """Show a run's submissions with their Slurm states, exit codes, nodes and elapsed time.

    \b
    Example:
      hpcscale status /scratch/me/runs/gpt-20261121-101500 --json
    """
    from hpcscale.slurm.status import run_status

    st = run_status(run)
    if as_json:
        print_json(st.to_json())
        return
    out = console()
    out.print(format_status(st))
    if st.latest_checkpoint:
        c = st.latest_checkpoint
        out.print(f"latest checkpoint: step {c['step']} ({c['path']}), layout {c['layout']}, {c['verified']}")
    if st.last_metrics:
        m = st.last_metrics
        out.print(f"last step {m['step']}: loss {m['loss']:.4f}, {m.get('tokens_per_s', 0):.0f} tokens/s")
