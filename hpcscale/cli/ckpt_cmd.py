"""`hpcscale ckpt ls|verify|inspect|gc|export`."""

from __future__ import annotations

import sys
from datetime import datetime
from pathlib import Path

import click

from hpcscale.cli.options import console, dry_run_option, json_option, print_json
from hpcscale.errors import BadInput, VerificationFailure
from hpcscale.layout import ParallelDims

dir_arg = click.argument("path", type=click.Path(exists=True, file_okay=False, path_type=Path))


@click.group()
def ckpt() -> None:
    """Checkpoint operations."""


def _size(n: int) -> str:
    from hpcscale.ckpt.ops import size_text

    return size_text(n)


def _layout(layout: dict | None) -> str:
    """The recorded layout as `ParallelDims.text` spells it ("pp=1 dp=4 dp_shard=4 tp=1"); "?" when the record is
    not a layout (a hand-edited index: `ckpt verify` names what is wrong with it)."""
    if not layout:
        return "-"
    try:
        return ParallelDims.from_dict(layout).text()
    except BadInput:
        return "?"


def format_checkpoints(infos):
    from rich.table import Table

    table = Table(title="checkpoints")
    for col in ("step", "time", "size", "new in it", "layout", "parent", "made by", "verified"):
        table.add_column(col, justify="right" if col in ("step", "size", "new in it") else "left")
    for i in infos:
        when = datetime.fromtimestamp(i.time).strftime("%Y-%m-%d %H:%M:%S") if i.time else "-"
        layout = _layout(i.layout)
        table.add_row(
            str(i.step),
            when,
            _size(i.bytes),
            _size(i.new_bytes),
            layout,
            (i.parent or "-").removeprefix("step-").lstrip("0") or "0",
            i.origin or "-",
            "[green]ok[/green]" if i.verified == "ok" else f"[red]{i.verified}[/red]",
        )
    return table


@ckpt.command("ls")
@dir_arg
@json_option
def ls(path: Path, as_json: bool) -> None:
    """List a run's checkpoints: step, time, size, bytes new in it, layout, the parent step (the chain), what
    made it (job spec hash, code commit, * if dirty, Slurm job/restart, cross-site round), structure check.

    \b
    Example:
      hpcscale ckpt ls RUN
    """
    from dataclasses import asdict

    from hpcscale.ckpt.ops import list_checkpoints

    infos = list_checkpoints(path)
    if as_json:
        print_json({"checkpoints": [asdict(i) for i in infos]})
    else:
        console().print(format_checkpoints(infos))


def _step_dir(path: Path) -> Path:
    """A step directory as given; a run directory or checkpoints root: its newest committed checkpoint."""
    from hpcscale.ckpt.format import INDEX, committed_steps, step_dir_name
    from hpcscale.ckpt.ops import checkpoints_root

    if (path / INDEX).exists() or path.name.startswith("step-"):
        return path
    root = checkpoints_root(path)
    steps = committed_steps(root)
    if not steps:
        raise BadInput(f"{path}: no committed checkpoint under {root}")
    return root / step_dir_name(steps[0])


@ckpt.command()
@dir_arg
@json_option
def verify(path: Path, as_json: bool) -> None:
    """Check the checkpoint DIR (a step directory) whole: its index, then every chunk.

    The index's root digest must match its contents and the DIGEST file beside it; its structure must be sound
    (each tensor tiled by its shards, each shard exactly its chunks, dtypes known, offsets and lengths in
    range); every chunk must be in place with its recorded hash. Exits 3 naming each problem (the tensor and
    chunk, or what is wrong in the index). A pass does not prove who wrote the checkpoint: someone who rewrote
    data and index and recomputed the digest is caught only by a signature over DIGEST
    (docs/checkpoint-format.md, "What ckpt verify proves"). A pass says how many bytes of tensor data the
    checkpoint declares and how many its files hold (each distinct chunk read once): content addressing may make
    the first far larger, and a load or an export produces what is declared.

    \b
    Examples:
      hpcscale ckpt verify RUN/checkpoints/step-00001000
      hpcscale ckpt verify RUN        # its newest committed checkpoint
    """
    from hpcscale.ckpt.ops import verify as run_verify

    path = _step_dir(path)

    if as_json or not sys.stderr.isatty():
        report = run_verify(path)
    else:
        from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

        with Progress(
            "[progress.description]{task.description}",
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            console=console(stderr=True),
            transient=True,
        ) as bar:
            task = bar.add_task("verifying", total=None)
            report = run_verify(path, progress=lambda done, total: bar.update(task, completed=done, total=total))
    if as_json:
        print_json(report.to_json())
    else:
        for p in report.problems:
            click.echo(f"{report.root}/{p.path}: {p.problem}", err=True)
        if report.passed:
            click.echo(
                f"ok: step {report.details['step']}: {report.details['tensors']} tensors, {report.items} chunks, "
                f"{_declared(report.details['declared_bytes'], report.details['stored_bytes'])}, verified in "
                f"{report.seconds:.2f}s; root digest {report.details['digest']}"
            )
    if not report.passed:
        raise VerificationFailure(f"{report.target}: {len(report.problems)} problem(s); the checkpoint is damaged")


def _declared(declared: int, stored: int) -> str:
    """`24.0 TiB of tensor data in 1.0 GiB of distinct chunks (x24576 by deduplication)`: what loading or
    exporting the checkpoint produces against what its files hold (the expansion shown from 2x)."""
    text = f"{_size(declared)} of tensor data in {_size(stored)} of distinct chunks"
    if stored and declared >= 2 * stored:
        text += f" (x{declared / stored:.0f} by deduplication)"
    return text


@ckpt.command()
@dir_arg
@json_option
def inspect(path: Path, as_json: bool) -> None:
    """Show a checkpoint's metadata and tensors (names, global shapes, dtypes, shards).

    PATH is a step directory, or a run directory (or its checkpoints/) for its newest committed checkpoint;
    a path with no committed checkpoint exits 2."""
    from hpcscale.ckpt.ops import inspect as run_inspect

    doc = run_inspect(_step_dir(path))
    if as_json:
        print_json(doc)
        return
    from rich.table import Table

    state = dict(doc["trainer_state"])
    lineage = state.pop("lineage", None)
    click.echo(
        f"step {doc['step']}  world {doc['world_size']}  layout {_layout(doc['layout'])}  parent {doc['parent']}  "
        f"{_declared(doc['bytes'], doc['stored_bytes'])}  trainer state {state}"
    )
    for line in _lineage_lines(lineage):
        click.echo(line)
    table = Table()
    for col in ("tensor", "shape", "dtype", "shards", "chunks"):
        table.add_column(col)
    for t in doc["tensors"]:
        table.add_row(
            t["name"], "x".join(map(str, t["shape"])) or "scalar", t["dtype"], str(t["shards"]), str(t["chunks"])
        )
    console().print(table)


def _lineage_lines(lineage: object) -> list[str]:
    """What produced a checkpoint, one fact a line (hpcscale.ckpt.lineage); a checkpoint without: says so."""
    if not isinstance(lineage, dict):
        return ["lineage: none recorded (a checkpoint from before lineage, or not written by hpcscale)"]
    get = lambda d, k: d.get(k) if isinstance(d, dict) else None  # noqa: E731
    job, data, code = lineage.get("job"), lineage.get("data_manifest"), lineage.get("code")
    out = [f"lineage: hpcscale {lineage.get('hpcscale_version')}, parent {lineage.get('parent')}"]
    out.append(f"  job spec   {get(job, 'path')}  sha256 {get(job, 'sha256') or get(job, 'error')}")
    if data:
        out.append(f"  data       {get(data, 'path')}  sha256 {get(data, 'sha256') or get(data, 'error')}")
    if isinstance(code, dict):
        where = f"  {code['path']}" if code.get("path") else ""
        git = ""
        if code.get("git_commit"):
            git = f"  git {code['git_commit'][:12]}{' (dirty)' if code.get('dirty') else ''}"
        out.append(f"  code       {code.get('entry')}{where}{git}")
    if isinstance(lineage.get("slurm"), dict):
        s = lineage["slurm"]
        out.append(f"  slurm      job {s.get('job_id')}, restart {s.get('restart_count')}")
    if "round" in lineage:
        out.append(f"  cross-site base round {lineage['round']}")
    return out


@ckpt.command()
@dir_arg
@click.option("--keep", type=int, required=True, help="Keep the newest K checkpoints.")
@click.option("--every", type=int, default=0, help="Also keep checkpoints whose step is a multiple of M.")
@dry_run_option
@json_option
def gc(path: Path, keep: int, every: int, dry_run: bool, as_json: bool) -> None:
    """Remove checkpoints the policy does not keep. Data a kept checkpoint references is never removed, and an
    interrupted gc never breaks a kept checkpoint. Pinned checkpoints (PINNED: a running job's cross-site start
    checkpoint) are kept. Leftovers of crashed saves go too, but never a save in progress: a .tmp-* whose writer
    may still run (on another host, or alive here) is left and listed.

    \b
    Example:
      hpcscale ckpt gc RUN --keep 3 --every 1000 --dry-run
    """
    from hpcscale.ckpt.ops import gc as run_gc
    from hpcscale.errors import BadInput

    if keep < 1:
        raise BadInput("--keep must be at least 1")
    doc = run_gc(path, keep=keep, every=every, dry_run=dry_run)
    if as_json:
        print_json(doc)
    else:
        verb = "would remove" if dry_run else "removed"
        click.echo(f"kept steps {doc['kept']}; {verb} steps {doc['removed']} ({len(doc['removed_files'])} data files)")
        for step, why in doc["pinned"].items():
            click.echo(f"pinned: step {step}: {why}")
        for left in doc["unfinished_left"]:
            click.echo(f"left a save in progress: {left}")


@ckpt.command()
@dir_arg
@click.option("--format", "fmt", type=click.Choice(["torch", "safetensors"]), default="safetensors", show_default=True)
@click.option("-o", "out", type=click.Path(dir_okay=False, path_type=Path), required=True, help="Output file.")
@json_option
def export(path: Path, fmt: str, out: Path, as_json: bool) -> None:
    """Write the model of a checkpoint (its model/ tensors, named without model/) as one file for inference.

    PATH is a step directory, or a run directory (or its checkpoints/) for its newest committed checkpoint;
    a path with no committed checkpoint exits 2. Before anything is read, the output's directory must exist
    (it is not created, and not a symbolic link). Then, before a chunk is read: the index is checked whole
    (root digest, structure: every tensor fully covered; exit 3), every tensor must fit the format (safetensors
    cannot hold a tensor named __metadata__ or some dtypes; exit 2 naming it), and what the tensors declare must
    fit the output's free space (exit 2). Every chunk's hash is checked as it is read (exit 3). On any problem
    nothing is written; the file appears whole, by rename (a symbolic link at -o is replaced, never followed),
    with the mode of any new file (0666 less the umask). It holds at most 80 MiB of tensor data at a time,
    whatever the checkpoint declares (docs/checkpoint-format.md, "Export").

    \b
    Example:
      hpcscale ckpt export RUN -o model.safetensors
    """
    from hpcscale.ckpt.export import export as run_export

    doc = run_export(_step_dir(path), fmt, out)
    if as_json:
        print_json(doc)
    else:
        click.echo(
            f"{doc['tensors']} tensors, {doc['parameters']:,} parameters, {_size(doc['bytes'])} -> {doc['out']} ({fmt})"
        )
