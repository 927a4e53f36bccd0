"""What produced a checkpoint: recorded in its trainer state under "lineage" (docs/checkpoint-format.md).

    {"hpcscale_version": "0.1.0",
     "job": {"path": RUN/job.yaml, "sha256": ..., "text": ...},        # the spec as run (-p overrides included),
                                                                        # environment values redacted
     "data_manifest": {"path": ..., "sha256": ...},                     # when the job names one
     "code": {"entry": "mymodel:main", "path": ..., "git_commit": ..., "dirty": false},
     "parent": "step-00000100",                                         # the checkpoint before it in this run
     "slurm": {"job_id": "1234", "restart_count": 1},                   # under Slurm
     "round": 7}                                                        # a cross-site site: its base round

`collect` runs once per process on rank 0 (the only rank whose trainer state is committed): reading the job
file, hashing the manifest and asking git are start-up costs, not per-save ones. Anything it cannot find is
left out or recorded as an error string; lineage never stops a save.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
from pathlib import Path
from typing import Any

from hpcscale.portable import files
from hpcscale.util.bounded import file_problem

MAX_JOB_TEXT = 64 * 1024  # the spec's text is kept when at most this long (its hash always)
TAG = "lineage"


MAX_JOB_BYTES = 1 << 20  # RUN/job.yaml, as the ranks read it at start (hpcscale.rundir)
MAX_MANIFEST_BYTES = 1 << 30  # a data manifest, as the loader reads it (hpcscale.data.manifest)


def _sha256_file(path: Path) -> str:
    """sha256 of the regular file at `path` of at most MAX_MANIFEST_BYTES, read from the descriptor checked (a
    FIFO or device planted there is refused, never waited on): OSError otherwise."""
    fd, st = files.open_regular(path)
    try:
        if st.st_size > MAX_MANIFEST_BYTES:
            raise files.TooLarge(path, st.st_size, MAX_MANIFEST_BYTES)
        h, done = hashlib.sha256(), 0
        while done <= MAX_MANIFEST_BYTES and (chunk := os.read(fd, 1 << 20)):
            h.update(chunk)
            done += len(chunk)
        if done > MAX_MANIFEST_BYTES:
            raise files.TooLarge(path, done, MAX_MANIFEST_BYTES)
        return h.hexdigest()
    finally:
        os.close(fd)


def _git(directory: Path, *args: str) -> str | None:
    try:
        r = subprocess.run(["git", "-C", str(directory), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def code_version(entry: str | None) -> dict[str, Any]:
    """The user's code: where the entry point's top-level package lives and, in a git checkout, its commit
    and whether tracked files differ from it. The built-in trainer is hpcscale's own code: its version says it."""
    if not entry or entry == "builtin":
        return {"entry": "builtin"}
    module = entry.split(":", 1)[0]
    out: dict[str, Any] = {"entry": entry}
    try:
        spec = importlib.util.find_spec(module.split(".")[0])
    except (ImportError, ValueError) as e:
        out["error"] = f"{type(e).__name__}: {e}"[:300]
        return out
    origin = spec.origin if spec is not None else None
    if not origin or origin in ("built-in", "frozen"):
        return out
    path = Path(origin).parent if Path(origin).name == "__init__.py" else Path(origin)
    out["path"] = str(path)
    directory = path if path.is_dir() else path.parent
    commit = _git(directory, "rev-parse", "HEAD")
    if commit is not None:
        status = _git(directory, "status", "--porcelain", "--untracked-files=no")
        out["git_commit"] = commit
        out["dirty"] = bool(status) if status is not None else None
    return out


def collect(run_dir: Path, job: Any) -> dict[str, Any]:
    from hpcscale import __version__

    out: dict[str, Any] = {"hpcscale_version": __version__}
    spec = run_dir / "job.yaml"
    try:  # others may write RUN: never a FIFO waited on, never more than a job spec's bound
        data = files.read_regular(spec, max_bytes=MAX_JOB_BYTES)[0]
        out["job"] = {
            "path": str(spec),
            "sha256": hashlib.sha256(data).hexdigest(),
            "text": _redacted(data) if len(data) <= MAX_JOB_TEXT else None,
        }
    except OSError as e:
        out["job"] = {"path": str(spec), "error": f"{spec}: {file_problem(e, 'job spec')}"}
    manifest = getattr(getattr(job, "data", None), "manifest", None)
    if manifest:
        from hpcscale.util.paths import expand_path

        path = expand_path(manifest)
        try:
            out["data_manifest"] = {"path": str(path), "sha256": _sha256_file(path)}
        except OSError as e:
            out["data_manifest"] = {"path": str(path), "error": f"{path}: {file_problem(e, 'manifest')}"}
    train = getattr(job, "train", None)
    out["code"] = code_version(getattr(train, "entry", None))
    return out


def _redacted(data: bytes) -> str | None:
    """The spec's text with `environment:` values replaced by "<redacted>" (tokens and passwords live there, and
    checkpoints travel further than run directories); the sha256 beside it is the original file's. None when
    the file does not parse as a YAML mapping."""
    import yaml

    try:
        doc = yaml.safe_load(data)
    except yaml.YAMLError:
        return None
    if not isinstance(doc, dict):
        return None
    if isinstance(doc.get("environment"), dict):
        doc["environment"] = {k: "<redacted>" for k in doc["environment"]}
    return yaml.safe_dump(doc, sort_keys=False)


def for_save(base: dict[str, Any], trainer_state: dict, parent: str | None) -> dict[str, Any]:
    """The lineage one save records: the process's, its parent checkpoint, Slurm's job and restart count, and
    a cross-site site's base round (from the trainer state's `xsite` tag)."""
    out = dict(base, parent=parent)
    job_id = os.environ.get("SLURM_JOB_ID")
    if job_id:
        restarts = os.environ.get("SLURM_RESTART_COUNT", "0")
        out["slurm"] = {"job_id": job_id, "restart_count": int(restarts) if restarts.isdigit() else restarts}
    tag = trainer_state.get("xsite")
    if isinstance(tag, dict) and type(tag.get("base_round")) is int:
        out["round"] = tag["base_round"]
    return out


def of_context(ctx: Any) -> dict[str, Any] | None:
    """collect() for a launched rank's Context: rank 0 only (the others' trainer state is not committed). It
    never raises: rank 0 failing alone here would leave the other ranks waiting in the manager's first
    collective."""
    if ctx.rank != 0:
        return None
    try:
        return collect(ctx.run_dir, ctx.job)
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"[:500]}
