"""`hpcscale doctor`."""

from __future__ import annotations

import sys

import click

from hpcscale.cli.options import console, json_option, print_json, site_option

_STYLE = {
    "ok": "[green]ok[/green]",
    "warn": "[yellow]warn[/yellow]",
    "fail": "[red]FAIL[/red]",
    "skip": "[dim]skip[/dim]",
}


def format_report(report):
    """A rich Table of the doctor's checks."""
    from rich.table import Table

    title = f"hpcscale doctor — site {report.site}" if report.site else "hpcscale doctor"
    table = Table(title=title, show_lines=False)
    for col in ("check", "status", "detail", "how to fix"):
        table.add_column(col, overflow="fold")
    for c in report.checks:
        table.add_row(c.name, _STYLE[c.status], c.detail, c.fix)
    return table


@click.command()
@site_option
@json_option
def doctor(site: str | None, as_json: bool) -> None:
    """Check the Slurm commands and controller, accounting, MPI and mpi4py, torch and its backend, the
    scratch filesystem and HDF5 file locking; say how to fix each failure.

    \b
    Examples:
      hpcscale doctor --site localcluster
      hpcscale doctor --site local --json

    Exits 1 if any check fails.
    """
    from hpcscale.config.load import resolve_site
    from hpcscale.doctor import run_doctor

    report = run_doctor(resolve_site(site).config if site else None)
    if as_json:
        print_json(report.to_json())
    else:
        console().print(format_report(report))
    sys.exit(0 if report.ok else 1)
