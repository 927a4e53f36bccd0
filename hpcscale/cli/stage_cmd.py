"""`hpcscale manifest build|diff|verify` and `hpcscale stage`. Torch-free: these run on login and transfer nodes."""

from __future__ import annotations

from pathlib import Path

import click

from hpcscale.cli.options import console, dry_run_option, json_option, print_json, site_option
from hpcscale.errors import RuntimeFailure, VerificationFailure
from hpcscale.portable.hashing import HASH_ALGORITHMS, XXH128
from hpcscale.xsite import DEFAULT_JOBS, DEFAULT_REMOTE_PYTHON, DEFAULT_SSH

jobs_option = click.option(
    "-j", "--jobs", type=click.IntRange(1, 256), default=None, help="Parallel hashing threads or transfer streams."
)


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB"


@click.group()
def manifest() -> None:
    """Dataset manifests: every file's path, size, mtime and hash (docs/manifest-format.md)."""


@manifest.command()
@click.argument("directory", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("-o", "--out", type=click.Path(dir_okay=False, path_type=Path), help="Default: DIRECTORY/manifest.json.")
@click.option(
    "--algorithm",
    type=click.Choice(HASH_ALGORITHMS),
    default=XXH128,
    show_default=True,
    help="Hash; recorded in the manifest.",
)
@click.option("--rehash", is_flag=True, help="Hash every file, even those whose size and mtime are unchanged.")
@jobs_option
@json_option
def build(directory: Path, out: Path | None, algorithm: str, rehash: bool, jobs: int | None, as_json: bool) -> None:
    """Write DIRECTORY's manifest atomically, hashing files in parallel.

    An earlier manifest at the same place is reused for files whose size and mtime are unchanged (unless
    --rehash); a token dataset's shards keep their description, sample counts recomputed.

    \b
    Example:
      hpcscale manifest build /scratch/datasets/web-2026
    """
    from hpcscale.data.manifest_ops import build as build_manifest
    from hpcscale.util.progress import progress_for

    with progress_for("hashing", as_json) as progress:
        m, stats = build_manifest(directory, out, algorithm=algorithm, rehash=rehash, jobs=jobs, progress=progress)
    target = out or directory / "manifest.json"
    doc = {
        "manifest": str(target),
        "hash_algorithm": m.hash_algorithm,
        "files": stats.files,
        "bytes": stats.bytes,
        "hashed": stats.hashed,
        "hashed_bytes": stats.hashed_bytes,
        "reused": stats.reused,
        "not_listed": [{"path": n.path, "reason": n.reason} for n in stats.not_listed],
        "seconds": round(stats.seconds, 3),
        "mb_per_s": round(stats.hashed_bytes / 1e6 / stats.seconds, 1) if stats.seconds else 0,
    }
    if as_json:
        print_json(doc)
        return
    click.echo(
        f"{target}: {stats.files} files, {_mb(stats.bytes)}; hashed {stats.hashed} ({_mb(stats.hashed_bytes)}), "
        f"reused {stats.reused}, {stats.seconds:.2f} s ({doc['mb_per_s']} MB/s)"
    )
    for n in stats.not_listed:
        click.echo(f"not listed: {_shown(n.path)}: {n.reason}", err=True)


def _shown(text: str) -> str:
    """A name for the terminal, printable even where it is not UTF-8."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _load(path: Path):
    from hpcscale.data.manifest import MANIFEST_NAME, read_manifest

    if path.is_dir():
        path = path / MANIFEST_NAME
    return path, read_manifest(path)


@manifest.command("diff")
@click.argument("a", type=click.Path(exists=True, path_type=Path))
@click.argument("b", type=click.Path(exists=True, path_type=Path))
@json_option
def diff_cmd(a: Path, b: Path, as_json: bool) -> None:
    """What changed from manifest A to manifest B: added, removed and changed files.

    \b
    Example:
      hpcscale manifest diff old/manifest.json new/manifest.json --json
    """
    from hpcscale.data.manifest_ops import diff

    a, ma = _load(a)
    b, mb = _load(b)
    d = diff(ma, mb, str(a), str(b))
    if as_json:
        print_json(d.to_json())
        return
    from rich.table import Table

    table = Table(title=f"{a} -> {b}")
    table.add_column("change")
    table.add_column("path")
    table.add_column("size", justify="right")
    for f in d.added:
        table.add_row("[green]added[/green]", f.path, str(f.size))
    for f in d.removed:
        table.add_row("[red]removed[/red]", f.path, str(f.size))
    for old, new in d.changed:
        table.add_row("[yellow]changed[/yellow]", old.path, f"{old.size} -> {new.size}")
    out = console()
    if d.added or d.removed or d.changed:
        out.print(table)
    out.print(f"{len(d.added)} added, {len(d.removed)} removed, {len(d.changed)} changed, {d.unchanged} unchanged")


@manifest.command("verify")
@click.argument("manifest_path", metavar="MANIFEST", type=click.Path(exists=True, path_type=Path))
@click.option("--root", type=click.Path(file_okay=False, path_type=Path), help="Default: the manifest's directory.")
@jobs_option
@json_option
def verify_cmd(manifest_path: Path, root: Path | None, jobs: int | None, as_json: bool) -> None:
    """Hash every file MANIFEST lists under ROOT; exit 3 naming every missing or mismatching file, exit 1
    naming every file that is there but cannot be read (permissions: not damage).

    \b
    Example:
      hpcscale manifest verify /scratch/data/manifest.json
    """
    from hpcscale.data.manifest_ops import verify
    from hpcscale.util.progress import progress_for

    path, m = _load(manifest_path)
    root = root or path.parent
    with progress_for("verifying", as_json) as progress:
        report = verify(m, root, jobs=jobs, progress=progress, target=str(path))
    if as_json:
        print_json({"manifest": str(path), **report.to_json()})
    else:
        for p in report.problems:
            click.echo(f"{root}/{p.path}: {p.problem}", err=True)
        for u in report.details["unreadable"]:
            click.echo(f"{root}/{u['path']}: {u['problem']}", err=True)
        click.echo(f"{path}: {report.ok} of {report.items} files verified under {root} ({report.seconds:.2f} s)")
    if report.problems:
        raise VerificationFailure(f"{len(report.problems)} of {report.items} files do not match {path}")
    if report.details["unreadable"]:
        names = ", ".join(u["path"] for u in report.details["unreadable"][:5])
        raise RuntimeFailure(
            f"{len(report.details['unreadable'])} of {report.items} files could not be read ({names}): "
            "not proven damaged; check their permissions and verify again"
        )


@click.command()
@click.argument("manifest_path", metavar="MANIFEST", type=click.Path(exists=True, path_type=Path))
@click.option("--from", "src", required=True, metavar="SRC", help="Source: a path or ssh://[user@]host[:port]/path.")
@click.option("--to", "dst", required=True, metavar="DST", help="Destination: a path or ssh://[user@]host[:port]/path.")
@click.option(
    "-j",
    "--jobs",
    type=click.IntRange(1, 64),
    default=None,
    help=f"Parallel streams.  [default: the site's staging.jobs with --site, else {DEFAULT_JOBS}]",
)
@click.option(
    "--check",
    type=click.Choice(["stat", "hash"]),
    default="stat",
    show_default=True,
    help="How files already at DST are proven: 'stat' trusts DST's record of what it verified while size, "
    "mtime, ctime and inode are unchanged (files without a record are hashed); 'hash' hashes them all.",
)
@click.option(
    "--bwlimit",
    metavar="RATE",
    help="Bandwidth limit for all streams together, e.g. 100M (bytes/s).  "
    "[default: the site's staging.bandwidth_limit_mbps with --site, else none]",
)
@click.option(
    "--sync",
    is_flag=True,
    help="syncfs the destination before its manifest is written, so that a manifest there means the data is on "
    "disk even across a power loss (costs the writeback rsync leaves to the kernel).",
)
@click.option(
    "--ssh",
    "ssh_cmd",
    envvar="HPCSCALE_SSH",
    default=DEFAULT_SSH,
    show_default=True,
    help="ssh command and options, e.g. 'ssh -i ~/.ssh/dtn -o BatchMode=yes' (env HPCSCALE_SSH).",
)
@click.option(
    "--remote-python",
    envvar="HPCSCALE_REMOTE_PYTHON",
    default=DEFAULT_REMOTE_PYTHON,
    show_default=True,
    help="python3 on the ssh host (needs xxhash for xxh128) (env HPCSCALE_REMOTE_PYTHON).",
)
@click.option(
    "--umask",
    metavar="OCTAL",
    default=None,
    help="Permission bits to clear from every file's mode at DST, e.g. 022 or 077 (modes are kept as the "
    "manifest records them otherwise).",
)
@site_option
@dry_run_option
@json_option
def stage(
    manifest_path: Path,
    src: str,
    dst: str,
    jobs: int | None,
    check: str,
    bwlimit: str | None,
    sync: bool,
    ssh_cmd: str,
    remote_python: str,
    umask: str | None,
    site: str | None,
    dry_run: bool,
    as_json: bool,
) -> None:
    """Copy the files MANIFEST lists from SRC to DST: only what is missing or differs, each file written
    under a temporary name and renamed once its hash matches, MANIFEST written to DST last.

    A killed transfer leaves no partial file under a real name; rerun the same command to finish it (partial
    files continue where they stopped). One side must be local. Exit 3 if a file arrives with the wrong hash.
    With --site, -j and --bwlimit default to that site's staging settings.

    \b
    Examples:
      hpcscale stage /data/web/manifest.json --from /data/web --to /scratch/web -j 8
      hpcscale stage /data/web/manifest.json --from /data/web --to ssh://dtn.site-b.org/lustre/web --bwlimit 500M
    """
    from hpcscale.util.progress import progress_for
    from hpcscale.xsite.stage_command import run_stage_command

    error = None
    with progress_for("staging", as_json) as progress:
        try:
            result = run_stage_command(
                manifest_path,
                src=src,
                dst=dst,
                jobs=jobs,
                check=check,
                bwlimit=bwlimit,
                sync=sync,
                ssh=ssh_cmd,
                remote_python=remote_python,
                umask=umask,
                site=site,
                dry_run=dry_run,
                progress=progress,
            )
        except Exception as e:
            result = getattr(e, "result", None)
            if result is None:
                raise
            error = e
    if as_json:
        print_json(result.to_json())
    else:
        _summary(result)
    if error is not None:
        raise error


def _summary(r) -> None:
    if r.dry_run:
        for p in r.would_send[:50]:
            click.echo(f"would send {p}")
        if len(r.would_send) > 50:
            click.echo(f"... and {len(r.would_send) - 50} more")
        click.echo(f"dry run: {len(r.would_send)} of {r.files} files would be sent, {r.up_to_date} are up to date")
        return
    if r.record_ignored:
        click.echo(f"note: {r.record_ignored}", err=True)
    click.echo(
        f"{r.files} files ({_mb(r.bytes_total)}): sent {r.sent} ({r.resumed} resumed), up to date {r.up_to_date} "
        f"({r.proven_by_hash} proven by hash now), verified {r.verified}, failed {len(r.failed)}; "
        f"{_mb(r.bytes_sent)} in {r.seconds:.2f} s, {r.mb_per_s:.1f} MB/s"
    )
