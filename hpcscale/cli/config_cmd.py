"""`hpcscale config validate|show`."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from hpcscale.cli.options import console, json_option, param_option, print_json


@click.group()
def config() -> None:
    """Site configs and job specs."""


@config.command()
@click.argument("files", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option(
    "--kind",
    type=click.Choice(["site", "job", "xsite"]),
    default=None,
    help="Treat every file as this kind (default: read it off the file's keys).",
)
@click.option("--site", default=None, metavar="SITE", help="Validate job specs against this site instead of theirs.")
@click.option(
    "--run-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    metavar="RUN",
    help="An earlier run of the job: warn when signals.grace_seconds is short of the stops and saves it measured.",
)
@param_option
@json_option
def validate(
    files: tuple[str, ...],
    kind: str | None,
    site: str | None,
    run_dir: Path | None,
    params: tuple[str, ...],
    as_json: bool,
) -> None:
    """Validate site configs and job specs; every problem is printed as FILE:LINE: KEY: MESSAGE
    (or `command line -p KEY: MESSAGE` for a key set with -p).

    \b
    Examples:
      hpcscale config validate site_configs/*.yaml
      hpcscale config validate job.yaml --site localcluster
      hpcscale config validate job.yaml --run-dir /scratch/me/runs/exp1   # grace time vs measured saves
      hpcscale config validate job.yaml -p nodes=4    # as run/submit/render would see it (job specs only)

    Warnings (valid but likely wrong: a stop signal NCCL may take, a hang timeout above the collective
    timeout) are printed and do not change the exit code. Exits 2 if any file is invalid.
    """
    from hpcscale.config.validate import validate_files

    results = validate_files(files, kind=kind, site=site, overrides=params)
    if run_dir is not None:
        _grace_against(results, run_dir)
    if as_json:
        print_json({"ok": all(r.ok for r in results), "files": [r.to_json() for r in results]})
    else:
        from hpcscale.util.trust import clean_markup as shown  # file names and values are the file's words

        out, err = console(), console(stderr=True)
        for r in results:
            if r.ok:
                out.print(f"[green]ok[/green]   {shown(r.file)} ({r.kind} '{shown(r.name)}')")
            for issue in r.issues:
                err.print(f"[red]error[/red] {shown(issue)}", markup=True, soft_wrap=True)
            for issue in r.warnings:
                err.print(f"[yellow]warn[/yellow]  {shown(issue)}", markup=True, soft_wrap=True)
    sys.exit(0 if all(r.ok for r in results) else 2)


def _grace_against(results, run_dir: Path) -> None:
    """Hold each valid job spec's grace time against the stops and saves an earlier run measured."""
    from hpcscale.config.errors import ConfigIssue
    from hpcscale.recovery.requeue import grace_advice
    from hpcscale.rundir import RunDir

    rd = RunDir.open(run_dir)
    key = ("signals", "grace_seconds")
    for r in results:
        if r.spec is not None and (advice := grace_advice(rd, r.spec.signals.grace_seconds)):
            r.warnings.append(ConfigIssue(*r.source.locate(key), "signals.grace_seconds", advice))


@config.command()
@click.argument("site")
@json_option
def show(site: str, as_json: bool) -> None:
    """Print a site's resolved configuration (every default filled in).

    \b
    Example:
      hpcscale config show localcluster --json
    """
    from hpcscale.config.load import resolve_site
    from hpcscale.config.render import to_plain

    loaded = resolve_site(site)
    doc = {"file": str(loaded.path), **to_plain(loaded.config)}
    if as_json:
        print_json(doc)
        return
    import yaml

    text = yaml.safe_dump(doc, sort_keys=False, default_flow_style=False)
    site_cfg = loaded.config
    header = [f"# {site_cfg.name}: {site_cfg.description}" if site_cfg.description else f"# {site_cfg.name}"]
    if site_cfg.example:
        header.append("# an example modelled on a public cluster: copy it to site_configs/ and adapt it")
    text = "\n".join(header) + "\n" + text
    if sys.stdout.isatty():
        from rich.syntax import Syntax

        console().print(Syntax(text, "yaml"))
    else:
        sys.stdout.write(text)
