"""`hpcscale status RUN`: submissions and their Slurm states, from sacct (scontrol when accounting is off).

The run's site.yaml (it names SLURM_CONF) is trusted only as hpcscale.util.trust says; every other file is read
bounded (metrics.jsonl: its last METRICS_TAIL bytes; timing.jsonl: hpcscale.observe.timing's bounds) and one
that is not a regular file (a FIFO, a device) is skipped with a note, never waited on. Values are passed on as
found (JSON); the text view (hpcscale.cli.slurm_cmd) shows them only through hpcscale.util.trust.clean_markup.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from hpcscale.config.errors import ConfigError
from hpcscale.config.yamlsrc import parse_yaml
from hpcscale.errors import BadInput
from hpcscale.rundir import JOB, TIMING, RunDir, Submission
from hpcscale.slurm import parse
from hpcscale.slurm.client import SlurmClient
from hpcscale.util import proc
from hpcscale.util.bounded import loads_json, read_bounded, read_tail

METRICS_TAIL = 8 << 20  # bytes read from the end of metrics.jsonl for the last step and the last plan

# JobName, which the user chooses, last: hpcscale.slurm.parse reads any text there (`|` included) as the name
SACCT_FIELDS = ("JobID", "State", "ExitCode", "NodeList", "Elapsed", "Start", "End", "JobName")


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
    notes: list[str] = field(default_factory=list)  # files skipped, and why (not regular files, damage)

    def to_json(self) -> dict:
        return {
            "run_dir": str(self.run_dir),
            "job_name": self.job_name,
            "source": self.source,
            "latest_checkpoint": self.latest_checkpoint,
            "last_metrics": self.last_metrics,
            "timing": self.timing,
            "checkpoint_interval": self.checkpoint_interval,
            "notes": self.notes,
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
    local = [s for s in subs if s.template == "local"]
    if local:
        states.update(_local_states(rd, local))
        sources.add("attempts")
    source = ", ".join(sorted(sources)) or "none"
    notes: list[str] = []
    rows = _metric_rows(rd.metrics, notes)
    return RunStatus(
        rd.path,
        _job_name(rd),
        source,
        [SubmissionStatus(s, states.get(s.job_id or f"local:{s.index}", [])) for s in subs],
        _latest_checkpoint(rd),
        _last_training_line(rows),
        _timing(rd, notes),
        _last_metrics(rows, key="checkpoint_interval"),
        notes,
    )


def _local_states(rd: RunDir, local: list[Submission]) -> dict[str, list[JobState]]:
    """`run --local` runs as jobs, from RUN/attempts.jsonl (keyed "local:INDEX"): the end event the front end
    wrote (COMPLETED, STOPPED or FAILED, its exit code, the time from the submission to it), RUNNING while the
    newest one's rank 0 is alive, UNKNOWN when a front end ended without saying how (killed itself)."""
    events = rd.attempt_events()
    out: dict[str, list[JobState]] = {}
    for sub in local:
        end = next((e for e in events if e.get("event") == "end" and e.get("submission") == sub.index), None)
        attempt = end.get("attempt") if end is not None else None
        begin = next((e for e in events if e.get("event") == "begin" and e.get("attempt") == attempt), None)
        hosts = begin.get("nodes") if begin is not None and type(attempt) is int else None
        nodes = ",".join(str(n) for n in hosts) if isinstance(hosts, list) else ""
        if end is not None:
            cause = str(end.get("cause", ""))
            state = {"completed": "COMPLETED", "stopped": "STOPPED"}.get(cause, "FAILED")
            code, finished = str(end.get("exit_code", "")), str(end.get("time", ""))
        elif sub is local[-1] and rd.local_attempt_pid() is not None:
            state, code, finished = "RUNNING", "", ""
        else:
            state, code, finished = "UNKNOWN", "", ""
        out[f"local:{sub.index}"] = [
            JobState("local", "", state, code, nodes, _elapsed(sub.time, finished), sub.time, finished)
        ]
    return out


def _elapsed(start: str, end: str) -> str:
    """[D-]HH:MM:SS between two ISO times, as sacct writes it; empty when either is missing or unreadable."""
    from datetime import datetime

    try:
        seconds = int((datetime.fromisoformat(end) - datetime.fromisoformat(start)).total_seconds())
    except (TypeError, ValueError):
        return ""
    if seconds < 0:
        return ""
    days, rest = divmod(seconds, 86400)
    text = f"{rest // 3600:02d}:{rest % 3600 // 60:02d}:{rest % 60:02d}"
    return f"{days}-{text}" if days else text


def _job_name(rd: RunDir) -> str | None:
    """job.yaml's name, for the title only (bounded; a damaged or odd file costs the title, nothing else)."""
    try:
        job = parse_yaml(read_bounded(rd.path / JOB, max_bytes=1 << 20, what=JOB).decode("utf-8"), JOB).data
    except (BadInput, ConfigError, UnicodeDecodeError):
        return None
    name = job.get("name") if isinstance(job, dict) else None
    return name if isinstance(name, str) else None


def _timing(rd: RunDir, notes: list[str]) -> dict | None:
    """The newest window (per rank: the means; its step and attempt), its traffic per process group, the straggler
    verdict and the late-arrival verdict."""
    from hpcscale.observe.timing import judge, judge_arrivals, read_windows, traffic

    try:
        windows = read_windows(rd.path / TIMING)
    except BadInput as e:
        notes.append(f"{TIMING} skipped: {e}")
        return None
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
        "traffic": [g.to_json() for g in traffic(newest)],  # [] before the ledger's columns
        "late": judge_arrivals(windows).to_json(),
    }


def _latest_checkpoint(rd: RunDir) -> dict | None:
    from hpcscale.ckpt.ops import latest

    if not rd.checkpoints.is_dir():
        return None
    info = latest(rd.path)
    return asdict(info) if info else None


def _metric_rows(path: Path, notes: list[str]) -> list[bytes]:
    """The lines of metrics.jsonl's last METRICS_TAIL bytes, newest first; [] when it is missing or skipped."""
    try:
        tail = read_tail(path, max_bytes=METRICS_TAIL, what="metrics log", missing_ok=True)
    except BadInput as e:
        notes.append(f"{path.name} skipped: {e}")
        return []
    return [] if tail is None else tail.data.splitlines()[::-1]


def _last_training_line(lines: list[bytes]) -> dict | None:
    """The newest line with a loss, with the step time and throughput hpcscale logged for the same step on a
    line of its own (a user loop's: ctx.checkpoint.step) when the line has none."""
    row = _last_metrics(lines)
    if row is None or "step_time_s" in row:
        return row
    for line in lines[:64]:  # hpcscale's line follows the loop's, so it is among the newest
        if b"step_time_s" not in line:
            continue
        try:
            timed = loads_json(line, source="metrics.jsonl", max_bytes=1 << 20)
        except BadInput:
            continue
        if isinstance(timed, dict) and timed.get("step") == row.get("step") and "loss" not in timed:
            return {**row, **{k: timed[k] for k in ("step_time_s", "tokens_per_s") if k in timed}}
    return row


def _last_metrics(lines: list[bytes], *, key: str = "loss") -> dict | None:
    """The last line of metrics.jsonl with `key` (for "loss": the line; otherwise that key's value, with the
    line's step), among `lines` (newest first)."""
    for line in lines:
        if key.encode() not in line:
            continue
        try:
            row = loads_json(line, source="metrics.jsonl", max_bytes=1 << 20)
        except BadInput:  # a torn last line of a run that is still writing, or damage: look further back
            continue
        if isinstance(row, dict) and key in row:
            if key == "loss":
                return row
            value = row[key]
            return {**value, "at_step": row.get("step")} if isinstance(value, dict) else None
    return None


def _sacct(client: SlurmClient, ids: list[str]) -> dict[str, list[JobState]]:
    result: dict[str, list[JobState]] = {}
    for row in client.sacct(ids, SACCT_FIELDS, "-X"):
        state = JobState(
            job_id=row["JobID"],
            name=row["JobName"],
            state=row["State"],
            exit_code=row["ExitCode"],
            nodes=row["NodeList"],
            elapsed=row["Elapsed"],
            start=row["Start"],
            end=row["End"],
        )
        result.setdefault(parse.job_base(row["JobID"]), []).append(state)
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
