"""`hpcscale report`."""

from __future__ import annotations

from pathlib import Path

import click

from hpcscale.cli.options import json_option, print_json


@click.command()
@click.argument("run", type=click.Path(file_okay=False, exists=True, path_type=Path))
@click.option(
    "-o",
    "--out",
    type=click.Path(path_type=Path),
    default=None,
    help="Directory to write the report into (created); default RUN/report.",
)
@json_option
def report(run: Path, out: Path | None, as_json: bool) -> None:
    """Plot a run and summarize it: loss and validation loss against steps and tokens, tokens/s over time, a
    per-rank step-time heatmap (restarts and checkpoints marked), and summary.md. Reads only the run
    directory; needs no torch.

    \b
    Examples:
      hpcscale report /scratch/me/runs/gpt-20261121-101500 -o report/
      hpcscale report RUN --json          # what was written, and the summary's figures
    """
    from hpcscale.observe.report import build

    result = build(run, out if out is not None else run / "report")
    if as_json:
        print_json(result)
        return
    for path in result["files"]:
        click.echo(path)
