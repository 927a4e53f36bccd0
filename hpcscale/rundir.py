"""The run directory: the unit a user thinks in. `status` and `resume` need nothing but its path.

RUN/
  job.yaml              the resolved job spec (every default filled in), headed by the command-line
                        overrides (-p KEY=VALUE) it was made with, one `# -p "..."` comment line each
  site.yaml             the resolved site config it ran on
  submissions.jsonl     one JSON line per submission: index, job id, cluster, time, script, excluded, reason
  submissions/0001.sbatch  the exact script each submission sent
  logs/                 slurm-<jobid>.out/.err (array jobs: slurm-<array>_<task>.*); local-<time>.out
  metrics.jsonl         rank 0's metrics, one JSON line per step, each naming its attempt
  attempts.jsonl        one JSON line per event of an attempt (a start of the job's ranks): begin (rank 0),
                        stop (rank 0, stopped on a signal), end (the batch script's decision: requeue or not)
  .resume/lock          held by `hpcscale resume` while it decides and submits (one resume at a time)
  run-id                a random id, written once: names this run's checkpoint directory elsewhere
  checkpoints/          step-NNNNNNNN/ directories (hpcscale.ckpt); a symlink to
                        <filesystems.checkpoint_root>/<run name>-<run id> when the site sets a separate
                        checkpoint root (the id: two runs with the same directory name never share one)
  sweep/NNNN/           an array task's own metrics.jsonl and checkpoints/

This module owns these names; everything else asks it for the paths.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import yaml

from hpcscale.config.job import JobSpec
from hpcscale.config.load import LoadedJob, load_job, parse_site
from hpcscale.config.render import to_plain
from hpcscale.config.site import SiteConfig
from hpcscale.config.yamlsrc import load_yaml
from hpcscale.errors import BadInput
from hpcscale.util.bounded import loads_json, read_bounded
from hpcscale.util.paths import expand_path

JOB = "job.yaml"
SITE = "site.yaml"
SUBMISSIONS = "submissions.jsonl"
LOGS = "logs"
METRICS = "metrics.jsonl"
TIMING = "timing.jsonl"  # per-rank step-time breakdown, one line per window (hpcscale.observe.timing)
TENSORBOARD = "tensorboard"  # TensorBoard event files (metrics.tensorboard: true)
CHECKPOINTS = "checkpoints"
RUN_ID = "run-id"
ATTEMPTS = "attempts.jsonl"
RESUME_STATE = ".resume"
OWNER = ".hpcscale-run"  # in a checkpoint directory under checkpoint_root: the id of the run it belongs to
OVERRIDE_LINE = "# -p "  # job.yaml's header: one override each, as a JSON string (ASCII: no line break ends it)
OVERRIDES_HEADER = (
    "# Made from the job file with these command-line overrides, in order (their values are in the keys below):\n"
)


@dataclass(frozen=True, kw_only=True, slots=True)
class Submission:
    index: int
    job_id: str | None  # None for --dry-run
    cluster: str | None
    time: str  # ISO 8601, UTC
    script: str  # relative to the run directory
    template: str
    excluded: list[str] = field(default_factory=list)
    reason: str = "submit"


def default_run_dir(run_root: Path, job_name: str, now: datetime | None = None) -> Path:
    """<run_root>/<job name, made path-safe>-<UTC time>, with -2, -3... if taken within the same second."""
    stamp = (now or datetime.now(timezone.utc)).strftime("%Y%m%d-%H%M%S")
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", job_name).strip("._") or "job"
    base = run_root / f"{safe[:64]}-{stamp}"
    candidate, n = base, 1
    while candidate.exists():
        n += 1
        candidate = Path(f"{base}-{n}")
    return candidate


def _create_once(path: Path, text: str) -> str:
    """Write `text` to `path` unless it exists, atomically (a reader never sees it half written); return what
    the file holds. Safe when every rank of a job calls it at once."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    tmp.write_text(text)
    try:
        os.link(tmp, path)
    except FileExistsError:
        pass
    finally:
        tmp.unlink()
    return path.read_text().strip()


def link_checkpoints(work_dir: Path, target: Path, *, run_id: str) -> Path:
    """Make `work_dir/checkpoints` lead to `target` (under the site's separate checkpoint root), creating it.

    Called by every rank when the job starts (on compute nodes, where that filesystem is mounted; never on
    the login node at submit time); safe to call from every rank at once. A run directory that already holds
    real checkpoints keeps them where they are: moving a run's checkpoints is the operator's decision, never
    a side effect."""
    link = work_dir / CHECKPOINTS
    target.mkdir(parents=True, exist_ok=True)
    owner = _create_once(target / OWNER, run_id)
    if owner != run_id:
        raise BadInput(
            f"{target} holds the checkpoints of another run (run id {owner}, this run is {run_id}); "
            f"refusing to share it: its retention would delete the other run's checkpoints"
        )
    try:
        link.symlink_to(target, target_is_directory=True)
    except FileExistsError:
        if link.is_symlink() and Path(os.readlink(link)) != target:
            raise BadInput(
                f"{link} leads to {os.readlink(link)}, not to {target} (filesystems.checkpoint_root changed "
                "since the run started); point the link where the checkpoints are, or start a new run"
            ) from None
    return link


def claim_checkpoints(root: Path, run_id: str) -> str | None:
    """Mark the checkpoint directory `root` (RUN/checkpoints) as run `run_id`'s, or say why this run must not
    use it (None: it may). A directory carries its owner's id in OWNER from its first use on; one marked by
    another run is refused, whatever the route to it (a symlink, a copied run directory), so no run writes
    into another's checkpoints or lets its retention delete them. An unmarked directory reached through a
    symlink is refused too: hpcscale links a run's checkpoints elsewhere only under a checkpoint_root, and
    marks them there first (link_checkpoints). An unmarked real directory is claimed (checkpoints from before
    the mark). Safe when every rank calls it at once."""
    marker = root / OWNER
    if not os.path.lexists(marker):
        owner = None
    else:
        try:
            owner = read_bounded(marker, max_bytes=256, what="owner mark").decode(errors="replace").strip()
        except BadInput as e:
            return f"{e}: refusing a checkpoint directory whose owner is unknown"
    if owner is None:
        if root.is_symlink():
            return (
                f"{root} leads to {os.readlink(root)}, which no run has marked as its own ({OWNER}): hpcscale "
                "links checkpoints elsewhere only under filesystems.checkpoint_root, marked first. Refusing to "
                f"write into (or delete in) another directory; make {root} a directory of this run's"
            )
        owner = _create_once(marker, run_id)
    if owner != run_id:
        return (
            f"{root} holds the checkpoints of another run (run id {owner}, this run is {run_id}); refusing to "
            "share them: this run's retention would delete the other's. A copied run directory: delete its "
            f"run-id and give it its own checkpoints/ (or remove {marker} to adopt them on purpose)"
        )
    return None


def site_checkpoint_root(site: SiteConfig) -> Path | None:
    """The site's separate checkpoint root (filesystems.checkpoint_root), expanded; None when unset."""
    root = site.filesystems.checkpoint_root
    return expand_path(root) if root else None


class RunDir:
    def __init__(self, path: Path):
        self.path = path

    @classmethod
    def create(cls, path: Path, *, reuse: bool = False) -> RunDir:
        """A new run directory; an existing one only with `reuse` (and only if it is a run directory)."""
        if path.exists():
            if not reuse:
                raise BadInput(
                    f"run directory {path} exists; pass --reuse to add a submission to it, or choose another --run-dir"
                )
            if not (path / SUBMISSIONS).exists() and any(path.iterdir()):
                raise BadInput(f"{path} exists and is not an hpcscale run directory; refusing to write into it")
        (path / LOGS).mkdir(parents=True, exist_ok=True)
        (path / "submissions").mkdir(exist_ok=True)
        return cls(path)

    @classmethod
    def open(cls, path: Path) -> RunDir:
        if not (path / SUBMISSIONS).is_file() and not (path / JOB).is_file():
            raise BadInput(f"{path} is not an hpcscale run directory (no {JOB} or {SUBMISSIONS})")
        return cls(path)

    @property
    def logs(self) -> Path:
        return self.path / LOGS

    @property
    def metrics(self) -> Path:
        return self.path / METRICS

    @property
    def checkpoints(self) -> Path:
        return self.path / CHECKPOINTS

    def discard(self) -> None:
        """Remove a run directory this command just created."""
        shutil.rmtree(self.path, ignore_errors=True)

    def run_id(self) -> str:
        """This run's id, created on first use (run directories from before it get one then)."""
        return _create_once(self.path / RUN_ID, secrets.token_hex(6))

    def load_job(self) -> LoadedJob:
        """The job as recorded here (job.yaml with its recorded site.yaml): what every rank runs."""
        if not (self.path / JOB).is_file():
            raise BadInput(f"{self.path} is not an hpcscale run directory (no {JOB})")
        return load_job(self.path / JOB, site=str(self.path / SITE))

    def write_resolved(self, spec: JobSpec, site: SiteConfig, *, overrides: Sequence[str] = ()) -> None:
        """The job spec and site as they were run, every default filled in. `overrides` (the -p KEY=VALUE
        texts the spec was made with) head job.yaml as comments: the values are already in the spec, the
        header says which of them came from the command line rather than the job file."""
        header = "".join(f"{OVERRIDE_LINE}{json.dumps(o)}\n" for o in overrides)
        header = OVERRIDES_HEADER + header if header else ""
        _atomic_write(self.path / JOB, header + yaml.safe_dump(to_plain(spec), sort_keys=False))
        _atomic_write(self.path / SITE, yaml.safe_dump(to_plain(site), sort_keys=False))

    def recorded_overrides(self) -> list[str]:
        """The -p texts job.yaml's header records (write_resolved); [] for none, or no job.yaml yet."""
        path = self.path / JOB
        if not path.is_file():
            return []
        out = []
        for line in path.read_text(errors="replace").splitlines():
            if not line.startswith("#"):
                break
            if line.startswith(OVERRIDE_LINE):
                try:
                    text = json.loads(line[len(OVERRIDE_LINE) :])
                except ValueError:
                    continue
                if isinstance(text, str):
                    out.append(text)
        return out

    def next_index(self) -> int:
        return len(self.submissions()) + 1

    def write_script(self, index: int, text: str) -> Path:
        path = self.path / "submissions" / f"{index:04d}.sbatch"
        _atomic_write(path, text)
        path.chmod(0o755)
        return path

    def record(self, sub: Submission) -> None:
        """Append one submission; fsynced so a crash right after sbatch never loses the job id."""
        append_json_line(self.path / SUBMISSIONS, asdict(sub))

    def add_attempt_event(self, event: dict) -> None:
        """Append one attempt event (begin, stop, end) to attempts.jsonl, fsynced."""
        append_json_line(self.path / ATTEMPTS, event)

    def attempt_events(self) -> list[dict]:
        """Every attempt event, oldest first; a line cut short by a crash is skipped."""
        path = self.path / ATTEMPTS
        if not path.is_file():
            return []
        out = []
        for lineno, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            try:
                row = loads_json(line, source=f"{path}:{lineno}", max_bytes=1 << 20)
            except BadInput:
                continue
            if isinstance(row, dict) and isinstance(row.get("event"), str):
                out.append(row)
        return out

    def next_attempt(self) -> int:
        """The number the attempt starting now gets: 1 + the attempts begun before it."""
        return 1 + sum(1 for e in self.attempt_events() if e["event"] == "begin")

    def submissions(self) -> list[Submission]:
        path = self.path / SUBMISSIONS
        if not path.exists():
            return []
        out = []
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                out.append(Submission(**loads_json(line, source=f"{path}:{lineno}", max_bytes=1 << 20)))
            except BadInput as e:
                raise BadInput(f"{path}:{lineno}: damaged submission record ({e})") from None
            except (ValueError, TypeError) as e:
                raise BadInput(f"{path}:{lineno}: damaged submission record ({e})") from None
        return out

    def site_config(self) -> SiteConfig:
        """The site this run was submitted to, as recorded (so status works without the site file)."""
        return parse_site(load_yaml(self.path / SITE))


def append_json_line(path: Path, doc: dict) -> None:
    """One JSON line appended with one write(2) (O_APPEND: lines from two writers never interleave), fsynced."""
    line = json.dumps(doc, sort_keys=True) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
