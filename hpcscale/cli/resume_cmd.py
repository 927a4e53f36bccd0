"""`hpcscale resume` (a login node's recovery) and `hpcscale requeue` (the batch script's decision)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from hpcscale.cli.options import dry_run_option, json_option, print_json
from hpcscale.errors import STOPPED_EXIT_CODE


@click.command()
@click.argument("run", type=click.Path(file_okay=False, exists=True, path_type=Path))
@click.option(
    "--exclude",
    "exclude_mode",
    type=click.Choice(["never", "failed", "all-failed"]),
    default=None,
    help="Nodes to keep the job off (default: the job's restart.exclude): none, the last failure's, or "
    "every node that failed in this run.",
)
@click.option(
    "--exclude-slow",
    is_flag=True,
    help="Also keep the job off the nodes of the stragglers `hpcscale status` names (per-rank timing of the "
    "last attempt).",
)
@click.option("--nodes", type=click.IntRange(min=1), default=None, help="Resume on N nodes (resharded on load).")
@click.option(
    "--accept-changes",
    is_flag=True,
    help="Resubmit although RUN/job.yaml or RUN/site.yaml changed since the last submission (the difference is "
    "shown); records them as they are now (not with --dry-run).",
)
@dry_run_option
@json_option
@click.option("--in-job", is_flag=True, hidden=True, help="Kept for batch scripts written for 0.1: `requeue`.")
@click.option("--exit-code", type=int, default=None, hidden=True, help="With --in-job: the ranks' exit code.")
def resume(
    run: Path,
    exclude_mode: str | None,
    exclude_slow: bool,
    nodes: int | None,
    accept_changes: bool,
    dry_run: bool,
    as_json: bool,
    in_job: bool,
    exit_code: int | None,
) -> None:
    """Resume RUN after a failure, a time limit or a preemption: explain how its last job ended, pick the
    newest checkpoint that verifies, and resubmit it away from the nodes that failed.

    \b
    Examples:
      hpcscale resume /scratch/me/runs/gpt-20261121-101500 --dry-run   # show the decision only
      hpcscale resume RUN                      # resubmit (local runs: rerun through mpirun)
      hpcscale resume RUN --nodes 3 --json     # on fewer nodes: resharded, same global batch
      hpcscale resume RUN --exclude-slow       # and away from the stragglers `status` names

    Refused (exit 2, nothing submitted) while the run's job is pending or running, when the run finished,
    while another `resume` of the same run is deciding, when RUN/job.yaml or RUN/site.yaml is not yours (owned
    by someone else, or writable by others), and when either changed since it was submitted (the difference
    is shown; --accept-changes resubmits them as they are). --dry-run shows everything it would run: the
    script, the command, the environment, the site and its SLURM_CONF.
    """
    from hpcscale.rundir import RunDir

    if in_job:  # what `hpcscale requeue` does, under the name batch scripts of hpcscale 0.1 call
        if exit_code is None:
            raise click.UsageError("--in-job needs --exit-code")
        _requeue(run, exit_code)
        return

    from hpcscale.recovery.resume import resume as resume_run

    def on_plan(plan) -> None:  # before anything is submitted or run
        if not as_json:
            _show(plan)
        elif plan.kind == "local" and not plan.dry_run:  # the ranks' output follows on stderr
            print_json(plan.to_json())

    done = resume_run(
        RunDir.open(run.resolve()),
        exclude_mode=exclude_mode,
        exclude_slow=exclude_slow,
        nodes=nodes,
        accept_changes=accept_changes,
        dry_run=dry_run,
        on_plan=on_plan,
        echo=(lambda line: click.echo(line, err=True)) if as_json else click.echo,
        warn=lambda line: click.echo(line, err=True),
    )
    plan, result = done.plan, done.local
    if result is None:  # a dry run, or submitted to Slurm
        if as_json:
            print_json(plan.to_json())
        else:
            click.echo("dry run: nothing submitted" if dry_run else f"submitted job {plan.submitted}")
        return
    if result.exit_code not in (0, STOPPED_EXIT_CODE) and result.failure:
        click.echo(f"error: the job failed (exit {result.exit_code}): {result.failure}", err=True)
    sys.exit(1 if result.exit_code not in (0, STOPPED_EXIT_CODE) else result.exit_code)


def _show(plan) -> None:
    """The decision for a person; every string that came from the run directory, its logs or Slurm is cleaned
    of control characters (hpcscale.util.trust.clean) before it reaches the terminal."""
    import shlex

    from hpcscale.util.trust import clean

    d = plan.diagnosis
    if plan.accepted_changes:
        click.echo("accepted changes since the last submission (--accept-changes):")
        for line in plan.accepted_changes:
            click.echo(f"  {line}")
    click.echo(f"last job: {clean(d.explanation)}")
    for r in plan.refused:
        click.echo(f"refused checkpoint step {r['step']}: {clean(r['problem'])}")
    for w in plan.warnings:
        click.echo(f"warning: {clean(w)}", err=True)
    click.echo(
        f"resume from: checkpoint step {plan.checkpoint}" if plan.checkpoint is not None else "resume from: the start"
    )
    if plan.tier_reason:
        click.echo(f"checkpoint tier: {plan.tier} ({clean(plan.tier_reason)})")
    if plan.kind == "slurm":
        click.echo(
            f"nodes: {plan.nodes}"
            + (f", excluding {clean(','.join(plan.exclude))}" if plan.exclude else "")
            + (f", including {clean(','.join(plan.nodelist))}" if plan.nodelist else "")
        )
    runs = plan.runs
    if not runs:
        return
    click.echo(f"site: {clean(runs['site'])} ({clean(runs['site_file'])})")
    if plan.kind == "slurm":
        conf = runs.get("slurm_conf")
        click.echo(f"SLURM_CONF: {clean(conf) if conf else '(unset: the machine default)'}")
    click.echo(f"command: {clean(shlex.join(runs['command']))}")
    env = runs["environment"]
    click.echo("environment:" + ("" if env else " (nothing set)"))
    for key, value in env.items():
        click.echo(f"  {clean(key)}={clean(shlex.quote(str(value)))}")
    for module in runs["modules"]:
        click.echo(f"module load: {clean(module)}")
    for path in runs["source"]:
        click.echo(f"source: {clean(path)}")
    if plan.dry_run and runs.get("script") is not None:
        click.echo(f"sbatch script (template {clean(runs['template'])}):")
        for line in runs["script"].splitlines():
            click.echo(f"  | {clean(line, limit=1000)}")


@click.command()
@click.argument("run", type=click.Path(file_okay=False, exists=True, path_type=Path))
@click.option("--exit-code", type=int, required=True, help="The ranks' exit code (srun's, or mpirun's).")
@click.option(
    "--in-place",
    is_flag=True,
    help="A job with restart.spare_nodes: when the failure is relaunched in this allocation, print the next "
    "step's nodes on stdout (nothing otherwise).",
)
def requeue(run: Path, exit_code: int, in_place: bool) -> None:
    """The batch script's decision after its ranks end: record how the attempt ended and requeue the job
    itself (scontrol requeue) after a stop signal, a time limit or a failure, while the job spec's restart
    budgets allow. Every built-in template calls it; a batch script of your own calls it right after srun:

    \b
      srun ... hpcscale launch --run-dir "$RUN" &
      wait $!; rc=$?
      hpcscale requeue "$RUN" --exit-code "$rc"

    It prints its decision on stderr and exits 0 whatever it decides (the job's state says the rest).
    With spare nodes (restart.spare_nodes) the default template runs its steps in a loop instead
    (docs/runbook.md, "Spare nodes"):

    \b
      nodes=$(hpcscale step-nodes "$RUN")
      while [ -n "$nodes" ]; do
        srun --overlap --nodes=N --ntasks=T --nodelist="$nodes" ... hpcscale launch --run-dir "$RUN" &
        wait $!; rc=$?
        nodes=$(hpcscale requeue "$RUN" --exit-code "$rc" --in-place)
      done
    """
    _requeue(run, exit_code, in_place=in_place)


def _requeue(run: Path, exit_code: int, *, in_place: bool = False) -> None:
    from hpcscale.recovery.requeue import after_step
    from hpcscale.util.hostlist import compress

    decision = after_step(run, exit_code, say=lambda line: click.echo(line, err=True), in_place=in_place)
    if in_place and decision.relaunch:
        click.echo(compress(decision.relaunch))


@click.command("step-nodes")
@click.argument("run", type=click.Path(file_okay=False, exists=True, path_type=Path))
def step_nodes(run: Path) -> None:
    """In a batch script with spare nodes (restart.spare_nodes): the nodes of the allocation its first step
    runs on, as a Slurm hostlist for `srun --nodelist`. The fewest leaf switches that hold the step, the fullest
    first; the other nodes are the spares (docs/runbook.md, "Spare nodes")."""
    import os

    from hpcscale.recovery.requeue import first_step
    from hpcscale.rundir import RunDir

    click.echo(first_step(RunDir.open(run), os.environ, say=lambda line: click.echo(line, err=True)))
