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
  resume.jsonl          one JSON line per `hpcscale resume` decision: the diagnosis, checkpoint, excluded nodes
  .resume/lock          held by `hpcscale resume` while it decides and submits (one resume at a time)
  .submitted.json       mode 0600: the sha256 and text of job.yaml and site.yaml as last submitted (written with
                        them by every submit, `run --local` and resume); `resume` refuses a run whose files
                        changed since, showing the difference, unless told --accept-changes
  run-id                a random id, written once: names this run's checkpoint directory elsewhere
  checkpoints/          step-NNNNNNNN/ directories (hpcscale.ckpt); a symlink to
                        <filesystems.checkpoint_root>/<run name>-<run id> when the site sets a separate
                        checkpoint root (the id: two runs with the same directory name never share one)
  sweep/NNNN/           an array task's own metrics.jsonl and checkpoints/

This module owns these names; everything else asks it for the paths.

Others may be able to write a run directory (a shared filesystem, group write access), so (hpcscale.util.trust):
- job.yaml, site.yaml and .submitted.json are honoured only from files owned by the user or root that no one
  else can write, checked on the descriptor they are read from (O_NOFOLLOW, fstat); hpcscale writes them mode
  0644 (0600 for the record) whatever the umask;
- every write replaces a file through a temporary of a random name created with O_CREAT|O_EXCL|O_NOFOLLOW
  (a symlink planted anywhere is replaced, never followed), inside a subdirectory opened with O_NOFOLLOW;
  JSON-lines logs are appended through O_NOFOLLOW and must be regular files;
- every read is bounded in bytes and refuses FIFOs and devices (hpcscale.util.bounded).
"""

from __future__ import annotations

import difflib
import errno
import hashlib
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
from hpcscale.config.load import LoadedJob, LoadedSite, load_job_source, parse_site
from hpcscale.config.render import to_plain
from hpcscale.config.site import SiteConfig
from hpcscale.config.yamlsrc import YamlSource, parse_yaml
from hpcscale.errors import BadInput
from hpcscale.portable import files
from hpcscale.portable.files import atomic_create, atomic_write
from hpcscale.util.bounded import MiB, loads_json, read_bounded
from hpcscale.util.paths import expand_path
from hpcscale.util.trust import UntrustedFile, check_dir_fd, clean, private_dir, read_trusted

JOB = "job.yaml"
SITE = "site.yaml"
SUBMISSIONS = "submissions.jsonl"
LOGS = "logs"
SUBMISSIONS_DIR = "submissions"  # the script of each submission, NNNN.sbatch
METRICS = "metrics.jsonl"
TIMING = "timing.jsonl"  # per-rank step-time breakdown, one line per window (hpcscale.observe.timing)
TENSORBOARD = "tensorboard"  # TensorBoard event files (metrics.tensorboard: true)
CHECKPOINTS = "checkpoints"
RUN_ID = "run-id"
ATTEMPTS = "attempts.jsonl"
RESUME_STATE = ".resume"
RESUME_LOG = "resume.jsonl"
RECORD = ".submitted.json"  # what was submitted: job.yaml's and site.yaml's digests and texts (mode 0600)
MAX_RECORD_LINES = 64 * MiB  # submissions.jsonl, attempts.jsonl: far more than any run writes
MAX_DIFF_LINES = 200  # of the difference `resume` shows between what was submitted and the files now
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


def _create_once(path: Path, text: str, *, what: str) -> str:
    """Write `text` to `path` unless it exists (atomic_create: a reader never sees it half written, and of
    every rank of a job calling it at once exactly one writes); return what the file holds. The file names a
    directory (a run id) or says whose one is (an owner mark), so it is read only if trusted
    (hpcscale.util.trust.read_trusted: the user's or root's, writable by no one else; UntrustedFile, exit 2)."""
    atomic_create(path, text)  # mode 0644 at most: no umask makes it group-writable
    return read_trusted(path, what=what, max_bytes=4096).decode(errors="replace").strip()


def link_checkpoints(work_dir: Path, target: Path, *, run_id: str, below: Path | None = None) -> Path:
    """Make `work_dir/checkpoints` lead to `target` (under the site's separate checkpoint root, `below`; by
    default target's parent), creating it.

    Every directory from `below` down to `target` is made by this user, or accepted only if it is this user's
    (or root's) and no one else can write it (hpcscale.util.trust.private_dir; UntrustedFile, exit 2): a
    checkpoint root everyone can write lets anyone make a run's directory, and its owner mark, before the run
    does, and plant a step the run would resume from. Called by every rank when the job starts (on compute
    nodes, where that filesystem is mounted; never on the login node at submit time); safe to call from every
    rank at once. A run directory that already holds real checkpoints keeps them where they are: moving a
    run's checkpoints is the operator's decision, never a side effect."""
    link = work_dir / CHECKPOINTS
    private_dir(target, below=below, mode=0o755, what="run's checkpoint directory under checkpoint_root")
    owner = _create_once(target / OWNER, run_id, what="owner mark of a checkpoint directory")
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
            owner = read_trusted(marker, what="owner mark", max_bytes=256).decode(errors="replace").strip()
        except UntrustedFile as e:
            return str(e)
        except BadInput as e:
            return f"{e}: refusing a checkpoint directory whose owner is unknown"
    if owner is None:
        if root.is_symlink():
            return (
                f"{root} leads to {os.readlink(root)}, which no run has marked as its own ({OWNER}): hpcscale "
                "links checkpoints elsewhere only under filesystems.checkpoint_root, marked first. Refusing to "
                f"write into (or delete in) another directory; make {root} a directory of this run's"
            )
        owner = _create_once(marker, run_id, what="owner mark")
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


def sweep_dir(run_dir: Path, index: int) -> Path:
    """RUN/sweep/NNNN, the run directory of one point of a sweep (an array task: its attempts, metrics and
    checkpoints), made by this user (0755), or accepted only if it and RUN/sweep are this user's (or root's) and
    no one else can write them (hpcscale.util.trust.private_dir; UntrustedFile, exit 2): one made first by
    someone else, in a run directory others may write, could hold the attempts and checkpoints a resume reads.
    Every rank of the task calls it at start, at once."""
    path = run_dir / "sweep" / f"{index:04d}"
    private_dir(path, below=run_dir, mode=0o755, what="sweep point's run directory")
    return path


NODE_LOCAL_DIR = "hpcscale-{run_id}"  # a run's directory under the site's filesystems.node_local, on each node


def node_local_dir(site: LoadedSite, node: str, run_id: str, *, sweep: str | None = None) -> Path:
    """This node's directory of the run's node-local checkpoint tier: <filesystems.node_local>/hpcscale-<run id>
    (/sweep/<NNNN> for an array task), made by this user with mode 0700, or accepted only if it is this user's
    (or root's) and no one else can write it (hpcscale.util.trust.private_dir; UntrustedFile, exit 2). The node-
    local root is shared by every user of the node, and the run id is no secret (RUN/run-id): a directory made
    there first by someone else could hold a step they planted, which the resume would load. Every rank on the
    node calls it at start, at once."""
    base = expand_path(site.config.filesystems.node_local)
    path = base / NODE_LOCAL_DIR.format(run_id=run_id)
    if "$" in str(path):
        raise BadInput(
            f"{site.path}: filesystems.node_local of site '{site.config.name}' expands to {path} on node {node}: "
            "a variable it names is not set in the job's environment"
        )
    if sweep is not None:
        path = path / "sweep" / sweep
    try:
        private_dir(path, below=base, mode=0o700, what="node-local checkpoint directory")
    except BadInput as e:
        raise type(e)(f"node {node}: {e}") from None
    return path


def _reused_run_dir(path: Path) -> None:
    """`--reuse`: make the run directory (mkdir, failing on an existing name) or keep the one there only if it is
    the user's or root's and no one else can write it (hpcscale.util.trust.check_dir_fd; UntrustedFile, exit 2):
    someone else's, or one others may write, could hold a job.yaml or logs they put there."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.mkdir()
    except FileExistsError:
        pass  # judged below, on the descriptor
    except OSError as e:
        raise BadInput(f"{path}: cannot make the run directory ({e.strerror})") from None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise BadInput(f"{path}: cannot open the run directory ({e.strerror})") from None
    try:
        check_dir_fd(fd, path, what="run directory (--reuse)")
    finally:
        os.close(fd)


class RunDir:
    def __init__(self, path: Path):
        self.path = path
        # job.yaml and site.yaml as changes_since_submitted compared them: what this instance then loads, so
        # that what `resume` runs is the text it compared (a second read could find a file renamed in since)
        self._compared: dict[str, str] | None = None

    @classmethod
    def create(cls, path: Path, *, reuse: bool = False) -> RunDir:
        """A new run directory; an existing one only with `reuse` (and only if it is a run directory)."""
        if not reuse:  # made here, failing if it exists: someone could make it first (a run root's names are
            path.parent.mkdir(parents=True, exist_ok=True)  # predictable) and would then own the run's directory
            try:
                path.mkdir()
            except FileExistsError:
                raise BadInput(
                    f"run directory {path} exists; pass --reuse to add a submission to it, or choose another --run-dir"
                ) from None
        else:  # made here when missing; one that exists is kept only as a checkpoint directory would be
            _reused_run_dir(path)
            if not (path / SUBMISSIONS).exists() and any(path.iterdir()):
                raise BadInput(f"{path} exists and is not an hpcscale run directory; refusing to write into it")
        # made here (0755), or, in a run reused, kept only if the user's or root's and no one else can write them:
        # `resume` reads a failed job's rank, node and signal from RUN/logs, so someone else's logs directory (made
        # first in a run directory others may write) could feed it failure lines (hpcscale.util.trust.private_dir)
        for name, what in ((LOGS, "run's logs directory"), (SUBMISSIONS_DIR, "run's submissions directory")):
            private_dir(path / name, below=path, mode=0o755, what=what)
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
        """This run's id, created on first use (run directories from before it get one then): 12 lowercase hex
        digits. It names a directory under the checkpoint root and on each node, so a file someone else wrote
        is refused (UntrustedFile), and so is anything but an id in it (a path, `..`: BadInput), never joined
        into a path."""
        value = _create_once(self.path / RUN_ID, secrets.token_hex(6), what="run id")
        if not re.fullmatch(r"[0-9a-f]{12}", value):
            raise BadInput(f"{self.path / RUN_ID}: {value[:40]!r} is not a run id (12 lowercase hex digits)")
        return value

    def _config_text(self, name: str) -> str:
        """job.yaml or site.yaml as UTF-8 text, read only from a file the user may trust (hpcscale.util.trust:
        owned by the user or root, writable by no one else, not a symlink, checked on the descriptor read)."""
        if self._compared is not None and name in self._compared:
            return self._compared[name]
        path = self.path / name
        data = read_trusted(path, what=f"run's {name}")
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise BadInput(f"{path}: not UTF-8 text ({e.reason})") from None

    def _site_source(self) -> YamlSource:
        return parse_yaml(self._config_text(SITE), str(self.path / SITE))

    def load_job(self) -> LoadedJob:
        """The job as recorded here (job.yaml with its recorded site.yaml): what every rank runs. Both files
        must be trusted (UntrustedFile, exit 2, otherwise); what is parsed is what was checked."""
        if not os.path.lexists(self.path / JOB):
            raise BadInput(f"{self.path} is not an hpcscale run directory (no {JOB})")
        src = parse_yaml(self._config_text(JOB), str(self.path / JOB))
        site = LoadedSite(parse_site(self._site_source()), self.path / SITE)
        return load_job_source(src, self.path / JOB, site)

    def write_resolved(self, spec: JobSpec, site: SiteConfig, *, overrides: Sequence[str] = ()) -> None:
        """The job spec and site as they were run, every default filled in. `overrides` (the -p KEY=VALUE
        texts the spec was made with) head job.yaml as comments: the values are already in the spec, the
        header says which of them came from the command line rather than the job file. Both are written mode
        0644 whatever the umask (a group-writable file is not trusted), and recorded in .submitted.json with
        their digests: `resume` then runs what was submitted, or says what changed."""
        self._compared = None  # rewritten here: read again from now on
        header = "".join(f"{OVERRIDE_LINE}{json.dumps(o)}\n" for o in overrides)
        header = OVERRIDES_HEADER + header if header else ""
        texts = {
            JOB: header + yaml.safe_dump(to_plain(spec), sort_keys=False),
            SITE: yaml.safe_dump(to_plain(site), sort_keys=False),
        }
        for name, text in texts.items():
            _atomic_write(self.path / name, text)
        self._write_record(texts)

    # ---- what was submitted --------------------------------------------------------------------------------
    def _write_record(self, texts: dict[str, str]) -> None:
        doc = {
            "version": 1,
            "files": {n: {"sha256": hashlib.sha256(t.encode()).hexdigest(), "text": t} for n, t in texts.items()},
        }
        _atomic_write(self.path / RECORD, json.dumps(doc, indent=1) + "\n", mode=0o600)

    def recorded(self) -> dict[str, str] | None:
        """{name: text} of job.yaml and site.yaml as last submitted; None when nothing is recorded (a run
        directory from before the record). The record must be trusted like the files it vouches for."""
        path = self.path / RECORD
        if not os.path.lexists(path):
            return None
        data = read_trusted(path, what="record of what was submitted", max_bytes=4 * MiB)
        doc = loads_json(data, source=str(path), max_bytes=4 * MiB)
        files = doc.get("files") if isinstance(doc, dict) else None
        out = {}
        for name in (JOB, SITE):
            entry = files.get(name) if isinstance(files, dict) else None
            if not (
                isinstance(entry, dict) and isinstance(entry.get("text"), str) and isinstance(entry.get("sha256"), str)
            ):
                raise BadInput(f"{path}: damaged record (no {name} entry); check the files, then --accept-changes")
            if hashlib.sha256(entry["text"].encode()).hexdigest() != entry["sha256"]:
                raise BadInput(f"{path}: damaged record ({name}'s text does not match its digest)")
            out[name] = entry["text"]
        return out

    def changes_since_submitted(self) -> list[str]:
        """How job.yaml and site.yaml differ from what was last submitted: [] when they do not; otherwise the
        lines of a unified diff per changed file (sanitized for a terminal, at most MAX_DIFF_LINES), or one
        line saying there is no record. The current files are read as load_job reads them (trusted only)."""
        before = self.recorded()
        now = {name: self._config_text(name) for name in (JOB, SITE)}
        self._compared = now
        if before is None:
            return [
                f"{self.path}: no record of what was submitted ({RECORD}: a run directory from before hpcscale "
                f"recorded it); read {JOB} and {SITE} in it before trusting them"
            ]
        lines: list[str] = []
        for name in (JOB, SITE):
            if now[name] == before[name]:
                continue
            diff = difflib.unified_diff(
                before[name].splitlines(),
                now[name].splitlines(),
                f"{name} (as submitted)",
                f"{name} (now)",
                lineterm="",
            )
            lines += [clean(line, limit=300) for line in diff]
        if len(lines) > MAX_DIFF_LINES:
            lines = [*lines[:MAX_DIFF_LINES], f"... {len(lines) - MAX_DIFF_LINES} more line(s) of difference"]
        return lines

    def accept_current(self) -> None:
        """Record job.yaml and site.yaml as they are now as what was submitted (`resume --accept-changes`)."""
        self._write_record({name: self._config_text(name) for name in (JOB, SITE)})

    def recorded_overrides(self) -> list[str]:
        """The -p texts job.yaml's header records (write_resolved); [] for none, or no job.yaml yet."""
        path = self.path / JOB
        if not path.is_file():
            return []
        out = []
        text = read_bounded(path, max_bytes=MiB, what=JOB).decode(errors="replace")
        for line in text.splitlines():
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
        """RUN/submissions/NNNN.sbatch, mode 0755 (set on the temporary before it takes the name: never a
        chmod through a path someone could have swapped)."""
        path = self.path / SUBMISSIONS_DIR / f"{index:04d}.sbatch"
        _atomic_write(path, text, mode=0o755)
        return path

    def record(self, sub: Submission) -> None:
        """Append one submission; fsynced so a crash right after sbatch never loses the job id."""
        append_json_line(self.path / SUBMISSIONS, asdict(sub))

    def add_attempt_event(self, event: dict) -> None:
        """Append one attempt event (begin, stop, end) to attempts.jsonl, fsynced."""
        append_json_line(self.path / ATTEMPTS, event)

    def add_resume_decision(self, doc: dict) -> None:
        """Append one `hpcscale resume` decision to resume.jsonl, fsynced."""
        append_json_line(self.path / RESUME_LOG, doc)

    def attempt_events(self) -> list[dict]:
        """Every attempt event, oldest first; a line cut short by a crash is skipped."""
        path = self.path / ATTEMPTS
        if not os.path.lexists(path):
            return []
        out = []
        text = read_bounded(path, max_bytes=MAX_RECORD_LINES, what="attempt log").decode(errors="replace")
        for lineno, line in enumerate(text.splitlines(), 1):
            try:
                row = loads_json(line, source=f"{path}:{lineno}", max_bytes=1 << 20)
            except BadInput:
                continue
            if isinstance(row, dict) and isinstance(row.get("event"), str):
                out.append(row)
        return out

    def local_attempt_pid(self, settle_s: float = 10.0) -> int | None:
        """Rank 0's pid when the newest attempt was begun on this host and its rank 0 still runs, else None. A
        rank that is just exiting gets `settle_s`: mpirun (and so `run --local`) may return once every rank
        has finalized, before the last has exited."""
        import time

        from hpcscale.portable.lock import process_alive

        begins = [e for e in self.attempt_events() if e["event"] == "begin"]
        if not begins or begins[-1].get("host") != os.uname().nodename:
            return None
        pid, start = begins[-1].get("pid"), begins[-1].get("pid_start")
        if not (type(pid) is int and pid > 0 and type(start) is int):
            return None
        deadline = time.monotonic() + settle_s
        while process_alive(pid, start):
            if time.monotonic() > deadline:
                return pid
            time.sleep(0.1)
        return None

    def next_attempt(self) -> int:
        """The number the attempt starting now gets: 1 + the attempts begun before it."""
        return 1 + sum(1 for e in self.attempt_events() if e["event"] == "begin")

    def submissions(self) -> list[Submission]:
        path = self.path / SUBMISSIONS
        if not os.path.lexists(path):
            return []
        out = []
        text = read_bounded(path, max_bytes=MAX_RECORD_LINES, what="submission log").decode(errors="replace")
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = loads_json(line, source=f"{path}:{lineno}", max_bytes=1 << 20)
                if not isinstance(row, dict):
                    raise TypeError("not a JSON object")
                sub = Submission(**row)
            except BadInput as e:
                raise BadInput(f"{path}:{lineno}: damaged submission record ({clean(e, limit=300)})") from None
            except (ValueError, TypeError) as e:
                raise BadInput(f"{path}:{lineno}: damaged submission record ({clean(e, limit=300)})") from None
            if not all(isinstance(v, str) or v is None for v in (sub.job_id, sub.cluster)) or not all(
                isinstance(v, str) for v in (sub.time, sub.script, sub.template, sub.reason)
            ):
                raise BadInput(f"{path}:{lineno}: damaged submission record (a field of the wrong type)")
            if type(sub.index) is not int or not (
                isinstance(sub.excluded, list) and all(isinstance(n, str) for n in sub.excluded)
            ):
                raise BadInput(f"{path}:{lineno}: damaged submission record (a field of the wrong type)")
            out.append(sub)
        return out

    def site_config(self) -> SiteConfig:
        """The site this run was submitted to, as recorded (so status works without the site file); trusted
        only as load_job trusts it (it names SLURM_CONF, the environment, the launcher)."""
        return parse_site(self._site_source())


def append_json_line(path: Path, doc: dict) -> None:
    """One JSON line appended to a run's log (submissions.jsonl, attempts.jsonl, resume.jsonl) and fsync'd, with
    hpcscale.portable.files.append_json_lines's guarantees: a symlink planted at `path`, or anything but a
    regular file, is refused (BadInput, exit 2), never appended through; a full disk is BadInput too."""
    try:
        files.append_json_lines(path, [doc], durable=True, sort_keys=True)
    except files.NotRegularFile:
        raise BadInput(f"{path}: not a regular file; refusing to append to it (remove it)") from None
    except files.TooLarge as e:
        raise BadInput(f"{path}: a record of {e.size} bytes, over the limit of {e.limit}; nothing appended") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise BadInput(f"{path}: a symbolic link; refusing to append through it (remove it)") from None
        raise BadInput(f"{path}: cannot append ({e.strerror})") from None


def _open_parent(path: Path, run_dir: Path | None = None) -> int:
    """A descriptor of `path`'s directory. A run's subdirectory (submissions/) is opened with O_NOFOLLOW
    relative to the run directory: one swapped for a symlink is refused, never written through."""
    parent = path.parent
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
    if run_dir is None or parent == run_dir:
        return os.open(parent, flags)
    base = os.open(run_dir, flags)
    try:
        return os.open(parent.relative_to(run_dir), flags | os.O_NOFOLLOW, dir_fd=base)
    except OSError as e:
        raise BadInput(f"{parent}: not a directory of the run ({e.strerror}); refusing to write into it") from None
    finally:
        os.close(base)


def _atomic_write(path: Path, text: str, *, mode: int = 0o644, run_dir: Path | None = None) -> None:
    """Replace `path` with `text`, atomically and durably, file mode `mode` whatever the umask. The temporary
    has a random name and is created with O_CREAT|O_EXCL|O_NOFOLLOW in the directory's descriptor: a symlink
    planted at any name is replaced (rename does not follow it), never written through."""
    dfd = _open_parent(path, run_dir if run_dir is not None else _run_dir_of(path))
    try:
        atomic_write(path.name, text, dir_fd=dfd, mode=mode, exact_mode=True)
    finally:
        os.close(dfd)


def _run_dir_of(path: Path) -> Path | None:
    """The run directory above a file hpcscale writes in one of its subdirectories (submissions/NNNN.sbatch)."""
    return path.parent.parent if path.parent.name == "submissions" else None
