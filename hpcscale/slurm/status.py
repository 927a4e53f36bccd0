"""`hpcscale status RUN`: submissions and their Slurm states, from sacct (scontrol when accounting is off)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from hpcscale.config.yamlsrc import load_yaml
from hpcscale.errors import BadInput
from hpcscale.rundir import JOB, TIMING, RunDir, Submission
from hpcscale.slurm.client import SlurmClient
from hpcscale.util import proc
from hpcscale.util.bounded import loads_json

SACCT_FIELDS = ("JobID", "JobName", "State", "ExitCode", "NodeList", "Elapsed", "Start", "End")


@dataclass(frozen=True, slots=True)
class JobState:
    job_id: str
    name: str
    state: str
    exit_code: str
    nodes: str
    elapsed: str
    start: str
    end: str


@dataclass(frozen=True, slots=True)
class SubmissionStatus:
    submission: Submission
    jobs: list[JobState]  # one per Slurm job; array jobs have one per task


@dataclass(frozen=True, slots=True)
class RunStatus:
    run_dir: Path
    job_name: str | None
    source: str  # "sacct" or "scontrol"
    submissions: list[SubmissionStatus]
    latest_checkpoint: dict | None = None  # step, time, bytes, layout of the newest committed checkpoint
    last_metrics: dict | None = None  # the last training line of metrics.jsonl
    timing: dict | None = None  # the newest per-rank window of timing.jsonl and the straggler verdict
    checkpoint_interval: dict | None = None  # checkpoint.every_steps: auto's latest plan (metrics.jsonl)

    def to_json(self) -> dict:
        return {
            "run_dir": str(self.run_dir),
            "job_name": self.job_name,
            "source": self.source,
            "latest_checkpoint": self.latest_checkpoint,
            "last_metrics": self.last_metrics,
            "timing": self.timing,
            "checkpoint_interval": self.checkpoint_interval,
            "submissions": [
                {"submission": asdict(s.submission), "jobs": [asdict(j) for j in s.jobs]} for s in self.submissions
            ],
        }


def run_status(path: Path) -> RunStatus:
    rd = RunDir.open(path)
    subs = rd.submissions()
    site = rd.site_config()
    client = SlurmClient.for_site(site)
    ids = [s.job_id for s in subs if s.job_id]
    states: dict[str, list[JobState]] = {}
    sources = set()
    if ids:
        try:
            states = _sacct(client, ids)
            sources.add("sacct")
        except proc.CommandFailed:
            pass
        # Jobs sacct does not know (accounting off, or slurmdbd not caught up yet): ask the controller.
        for job_id in ids:
            if job_id not in states:
                states[job_id] = _scontrol(client, job_id)
                sources.add("scontrol")
    source = ", ".join(sorted(sources)) or "none"
    job = load_yaml(rd.path / JOB).data
    name = job.get("name") if isinstance(job, dict) else None
    return RunStatus(
        rd.path,
        name,
        source,
        [SubmissionStatus(s, states.get(s.job_id or "", [])) for s in subs],
        _latest_checkpoint(rd),
        _last_metrics(rd.metrics),
        _timing(rd),
        _last_metrics(rd.metrics, key="checkpoint_interval"),
    )


def _timing(rd: RunDir) -> dict | None:
    """The newest window (per rank: the medians; its step and attempt) and the straggler verdict."""
    from hpcscale.observe.timing import judge, read_windows

    windows = read_windows(rd.path / TIMING)
    if not windows:
        return None
    newest = windows[-1]
    verdict = judge(windows)
    return {
        "step": newest.step,
        "steps": newest.steps,
        "attempt": newest.attempt,
        "time": newest.time,
        "ranks": [
            {"rank": i, "node": newest.nodes[i], "pp": newest.pp[i], **row} for i, row in enumerate(newest.ranks)
        ],
        "stragglers": verdict.to_json(),
    }


def _latest_checkpoint(rd: RunDir) -> dict | None:
    from hpcscale.ckpt.ops import latest

    if not rd.checkpoints.is_dir():
        return None
    info = latest(rd.path)
    return asdict(info) if info else None


def _last_metrics(path: Path, *, key: str = "loss") -> dict | None:
    """The last line of metrics.jsonl with `key` (for "loss": the line; otherwise that key's value, with the
    line's step)."""
    if not path.exists():
        return None
    for line in reversed(path.read_text(errors="replace").splitlines()):
        try:
            row = loads_json(line, source=str(path), max_bytes=1 << 20)
        except BadInput:  # a torn last line of a run that is still writing, or damage: look further back
            continue
        if isinstance(row, dict) and key in row:
            if key == "loss":
                return row
            value = row[key]
            return {**value, "at_step": row.get("step")} if isinstance(value, dict) else None
    return None


def _sacct(client: SlurmClient, ids: list[str]) -> dict[str, list[JobState]]:
    args = ["sacct", "-X", "-n", "-P", "-j", ",".join(ids), "-o", ",".join(SACCT_FIELDS)]
    if client.cluster:
        args += ["-M", client.cluster]
    out = client.run(*args, timeout=30)
    if "disabled" in out.stderr:
        raise proc.CommandFailed(out.args, out.stderr)
    result: dict[str, list[JobState]] = {}
    for line in out.stdout.splitlines():
        fields = line.split("|")
        if len(fields) != len(SACCT_FIELDS):
            continue
        base = fields[0].split("_")[0].split(".")[0]
        result.setdefault(base, []).append(JobState(*fields))
    return result


def _scontrol(client: SlurmClient, job_id: str) -> list[JobState]:
    jobs = []
    for kv in client.show("job", job_id):
        jobs.append(
            JobState(
                kv.get("JobId", job_id),
                kv.get("JobName", ""),
                kv.get("JobState", "UNKNOWN"),
                kv.get("ExitCode", ""),
                kv.get("NodeList", ""),
                kv.get("RunTime", ""),
                kv.get("StartTime", ""),
                kv.get("EndTime", ""),
            )
        )
    return jobs or [JobState(job_id, "", "UNKNOWN (not in scontrol; accounting is off)", "", "", "", "", "")]
