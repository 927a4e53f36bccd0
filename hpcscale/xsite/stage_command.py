"""`hpcscale stage` as one library call: from what the command line gave (a manifest path, endpoint and rate
texts, a site name) to a StageResult. The command module parses, calls `run_stage_command`, and renders.

Order matters for speed, so this module imports nothing heavy at its top: ssh starts first (usually it was
already started from the raw arguments before click loaded, by `channel.prelaunch`, which this adopts), and
only then are the staging code, the site config and the manifest loaded, while the connection comes up.

Where a setting comes from, first match wins: the command line; with a site (`--site`), the site config's
`staging.jobs` and `staging.bandwidth_limit_mbps`; then the defaults (DEFAULT_JOBS streams, no cap).
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import TYPE_CHECKING

from hpcscale.errors import BadInput
from hpcscale.xsite import DEFAULT_JOBS, DEFAULT_REMOTE_PYTHON, DEFAULT_SSH
from hpcscale.xsite.channel import connect_early, parse_endpoint, take_prelaunched

if TYPE_CHECKING:
    from hpcscale.config.site import Staging
    from hpcscale.util.progress import Progress
    from hpcscale.xsite.stage import StageResult

MB = 1_000_000  # staging.bandwidth_limit_mbps counts MB of 10^6 bytes, as the summary's MB/s does

_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMG]?)(?:i?B?)?(?:/s)?\s*$", re.IGNORECASE)


def parse_rate(text: str | None) -> float | None:
    """'100M' -> bytes per second (K, M, G are powers of 1024); None for no limit."""
    if text is None:
        return None
    m = _RATE.match(text)
    if not m or float(m.group(1)) <= 0:
        raise BadInput(f"--bwlimit: '{text}' is not a rate such as 500K, 100M or 1G (bytes per second)")
    return float(m.group(1)) * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[m.group(2).upper()]


def parse_umask(text: str | None) -> int:
    """'022' -> 0o022: permission bits cleared from every file's mode at the destination; None: 0."""
    if text is None:
        return 0
    try:
        value = int(text, 8)
    except ValueError:
        value = -1
    if not 0 <= value <= 0o777:
        raise BadInput(f"--umask: '{text}' is not octal permission bits such as 022 or 077")
    return value


def site_staging(site: str | None) -> Staging | None:
    """The `staging` section of a site (a name on the site search path, or a path), None without one."""
    if site is None:
        return None
    from hpcscale.config.load import resolve_site

    return resolve_site(site).config.staging


def run_stage_command(
    manifest_path: str | Path,
    *,
    src: str,
    dst: str,
    jobs: int | None = None,
    check: str = "stat",
    bwlimit: str | None = None,
    sync: bool = False,
    ssh: str = DEFAULT_SSH,
    remote_python: str = DEFAULT_REMOTE_PYTHON,
    umask: str | None = None,
    site: str | None = None,
    dry_run: bool = False,
    progress: Progress | None = None,
) -> StageResult:
    """Stage the files the manifest at `manifest_path` (a file, or a directory holding manifest.json) lists
    from `src` to `dst`, and write that manifest at `dst` last. `jobs` and `bwlimit` (a rate such as 100M)
    left None take the site's staging settings, if `site` is given, else the defaults.

    Raises BadInput (2), VerificationFailure (3) or RuntimeFailure (1); once the transfer has begun, the
    result so far is attached to the error as `.result` (see hpcscale.xsite.stage.stage)."""
    source, dest = parse_endpoint(src, "--from"), parse_endpoint(dst, "--to")
    ssh_argv = shlex.split(ssh)
    early = take_prelaunched(source, dest, ssh_argv, remote_python)
    if early is None and not dry_run:
        early = connect_early(source, dest, ssh_argv, remote_python)

    # everything else while ssh connects
    from hpcscale.data.manifest import MANIFEST_NAME, read_manifest_text
    from hpcscale.xsite.stage import StageOptions, stage

    try:
        staging = site_staging(site)
        rate = parse_rate(bwlimit)
        if bwlimit is None and staging is not None and staging.bandwidth_limit_mbps:
            rate = staging.bandwidth_limit_mbps * MB
        if jobs is None:
            jobs = staging.jobs if staging is not None else DEFAULT_JOBS
        opts = StageOptions(
            jobs=jobs,
            check=check,
            bwlimit=rate,
            dry_run=dry_run,
            sync=sync,
            ssh=ssh_argv,
            remote_python=remote_python,
            umask=parse_umask(umask),
        )
        path = Path(manifest_path)
        if path.is_dir():
            path = path / MANIFEST_NAME
        manifest, text = read_manifest_text(path)
    except BaseException:
        if early is not None:
            early.close()
        raise
    return stage(manifest, text, source, dest, opts, progress, early)
