"""Options shared by many commands, defined once."""

from __future__ import annotations

import json
import sys
from typing import Any

import click

json_option = click.option("--json", "as_json", is_flag=True, help="Print one JSON document on stdout.")
site_option = click.option(
    "--site",
    "site",
    metavar="SITE",
    default=None,
    help="Site name (site_configs/<SITE>.yaml on the search path) or path to a site file.",
)
dry_run_option = click.option("--dry-run", is_flag=True, help="Do everything except the final action.")
param_option = click.option(
    "-p",
    "--param",
    "params",
    metavar="KEY=VALUE",
    multiple=True,
    help="Set a job spec key as if the file said so (repeatable): -p train.params.lr=3e-4 -p nodes=4. "
    "VALUE is YAML on one line; 3e-4 is a number.",
)


def print_json(doc: Any) -> None:
    sys.stdout.write(json.dumps(doc, indent=2, sort_keys=False, default=str) + "\n")
    ctx = click.get_current_context(silent=True)
    if ctx is not None:  # a command that wrote its own document (a failed verify's report) gets no second one
        ctx.find_root().meta["hpcscale.json_written"] = True


PIPED_WIDTH = 1000  # wide enough that no table is cut or folded when the output goes to a file or a pipe


def console(stderr: bool = False):
    """A rich Console (imported lazily: rich costs start-up time that `--help` should not pay). Into a pipe or
    a file (no terminal, no COLUMNS) tables are whole, not cut at rich's default 80 columns."""
    import os

    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    piped = not stream.isatty() and not os.environ.get("COLUMNS")
    return Console(stderr=stderr, highlight=False, width=PIPED_WIDTH if piped else None)


def load_job_warning(job: str, site: str | None, params: tuple[str, ...] = ()):
    """load_job (with the -p overrides), its warnings (valid but likely wrong) printed to stderr first."""
    from hpcscale.config.load import load_job

    loaded = load_job(job, site=site, overrides=params)
    for issue in loaded.warnings:
        click.echo(f"warning: {issue}", err=True)
    return loaded
