"""`hpcscale status RUN`: submissions and their Slurm states, from sacct (scontrol when accounting is off).

The run's site.yaml (it names SLURM_CONF) is trusted only as hpcscale.util.trust says; every other file is read
bounded (metrics.jsonl: its last METRICS_TAIL bytes; timing.jsonl: hpcscale.observe.timing's bounds) and one
that is not a regular file (a FIFO, a device) is skipped with a note, never waited on. Values are passed on as
found (JSON); the text view (hpcscale.cli.slurm_cmd) shows them only through hpcscale.util.trust.clean_markup.

Attempts. A job requeued from inside itself (hpcscale.recovery.requeue) or by Slurm starts again under the same
job id; each start is an attempt. `sacct -X -D` lists them as rows of the same JobID, oldest first (the earlier
ones REQUEUED): row i is the start with SLURM_RESTART_COUNT i. `scontrol show job` knows only the current start
(its `Restarts=N`). RUN/attempts.jsonl holds, per start that reached `hpcscale launch`, a `begin` event and,
written by the batch script before any requeue backoff, an `end` event, both naming the Slurm job and its
restart count; `join_attempts` joins the two on (job id, restart count), never on position in the file:

- Slurm's rows say the state, exit code, nodes and times; the events add the run's attempt number and how
  the start ended (cause, the attempt's exit code, the policy's words). Where the two disagree (nodes, an
  exit code), Slurm's row is shown and the event's words stay as the run recorded them.
- a restart count the events name and Slurm does not (scontrol's earlier starts, a slurmdbd behind) is shown
  from the events alone: REQUEUED below Slurm's current count, else UNKNOWN. A Slurm row without events is a
  start that never reached `hpcscale launch` (it failed first, or it has not started).
- attempts.jsonl may be written by others: an event counts only with a job id equal to the job's and an
  integer restart count in [0, MAX_RESTART]; of two for the same start the later wins; each field is taken
  only with the type hpcscale writes (text cut to MAX_TEXT characters, control characters escaped); a job
  shows at most MAX_ATTEMPTS starts (the newest; the number left out is noted).
- a step relaunched in the same allocation (restart.spare_nodes, hpcscale.recovery.requeue.relaunch_here): one
  start of the job holds several steps, each a begin and an end of its own; all but the last are shown from
  their events, state RELAUNCHED, and the last is joined with Slurm's row.
- the backoff: the newest start's end event asked for a requeue and Slurm still has the job RUNNING (the batch
  script is sleeping before `scontrol requeue`): the attempt is `waiting`, its requeue due at the event's
  time plus its backoff_s.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timedelta, timezone
from pathlib import Path

from hpcscale.config.errors import ConfigError
from hpcscale.config.yamlsrc import parse_yaml
from hpcscale.errors import BadInput
from hpcscale.observe.downtime import relaunch_downtimes
from hpcscale.rundir import JOB, TIMING, RunDir, Submission
from hpcscale.slurm import parse
from hpcscale.slurm.client import SlurmClient
from hpcscale.util import proc
from hpcscale.util.bounded import loads_json, read_bounded, read_tail
from hpcscale.util.trust import clean

# what hpcscale measures of a step (a user loop's own line has them on hpcscale's line of the same step)
STEP_FIGURES = (
    *("step_time_s", "tokens_per_s", "tflops", "mfu", "mem_gb", "mem_reserved_gb", "pinned_gb", "rss_gb"),
    *("energy_j", "power_w", "gpu_util", "sm_clock_mhz", "throttle"),
)
METRICS_TAIL = 8 << 20  # bytes read from the end of metrics.jsonl for the last step and the last plan

# JobName, which the user chooses, last: hpcscale.slurm.parse reads any text there (`|` included) as the name
SACCT_FIELDS = ("JobID", "State", "ExitCode", "NodeList", "Elapsed", "Start", "End", "JobName")

MAX_RESTART = 1 << 20  # an event's restart count beyond this is nonsense (Slurm's own cap is far lower)
MAX_ATTEMPTS = 256  # starts shown per job, the newest
MAX_TEXT = 500  # characters of an event's text shown (its `why`, its `failure`)
CAUSES = ("completed", "stopped", "time_limit", "preempted", "failed", "cancelled", "user_error")
CAUSE_WORDS = {
    "completed": "completed",
    "stopped": "stopped on request",
    "time_limit": "stopped at its time limit",
    "preempted": "preempted",
    "failed": "failed",
    "cancelled": "cancelled",
    "user_error": "failed on every rank alike (user error)",
}


@dataclass(frozen=True, slots=True)
class Attempt:
    """One start of a Slurm job (or one `run --local`) and how it ended (see the module docstring)."""

    restart: int  # SLURM_RESTART_COUNT: 0 for the job's first start
    state: str  # Slurm's state of this start (REQUEUED for an earlier start of a requeued job)
    exit_code: str  # Slurm's, "code:signal"
    nodes: str
    elapsed: str
    start: str
    end: str
    attempt: int | None = None  # the run's attempt number (its begin event); None: no rank began
    cause: str | None = None  # the end event's: completed, time_limit, preempted, failed, cancelled, user_error
    exit: int | None = None  # the end event's exit code (a task killed by signal S: 128 + S)
    why: str = ""  # the requeue policy's words
    failure: str = ""  # the failure every rank shared (user_error), or the local run's failure line
    requeue: bool | None = None  # the end event's decision
    relaunch: str = ""  # the nodes of the step that replaced this one in the same allocation (restart.spare_nodes)
    downtime: dict | None = None  # a relaunched step's: how long training stopped (hpcscale.observe.downtime)
    backoff_s: int | None = None
    ended: str = ""  # the end event's time
    waiting: bool = False  # the requeue's backoff: the end event asked for it, Slurm still has the job RUNNING
    requeue_at: str = ""  # when the waiting requeue is due (ISO 8601, UTC)
    requeue_in_s: int | None = None  # seconds from now to requeue_at (negative: overdue)
    summary: str = ""  # all of the above in words, for people


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
    attempts: list[Attempt] = field(default_factory=list)  # every start, oldest first
    attempts_left_out: int = 0  # older starts beyond MAX_ATTEMPTS


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
    model_flops: dict | None = None  # the newest attempt's model FLOPs record (metrics.jsonl; efficiency)
    # the newest warning signs (health signals) and the checkpoints they caused: {"step", "health"|"health_checkpoint"}
    signs: list[dict] = field(default_factory=list)

    def to_json(self) -> dict:
        return {
            "run_dir": str(self.run_dir),
            "job_name": self.job_name,
            "source": self.source,
            "latest_checkpoint": self.latest_checkpoint,
            "last_metrics": self.last_metrics,
            "timing": self.timing,
            "checkpoint_interval": self.checkpoint_interval,
            "model_flops": self.model_flops,
            "signs": self.signs,
            "notes": self.notes,
            "submissions": [
                {"submission": asdict(s.submission), "jobs": [asdict(j) for j in s.jobs]} for s in self.submissions
            ],
        }


def run_status(path: Path, *, now: datetime | None = None) -> RunStatus:
    rd = RunDir.open(path)
    subs = rd.submissions()
    site = rd.site_config()
    client = SlurmClient.for_site(site)
    ids = [s.job_id for s in subs if s.job_id]
    events = rd.attempt_events()
    now = now or datetime.now(timezone.utc)
    notes: list[str] = []
    rows = _metric_rows(rd.metrics, notes)
    downtimes = relaunch_downtimes(events, _relaunch_rows(rows, events))
    states: dict[str, list[JobState]] = {}
    sources = set()
    if ids:
        starts: dict[str, dict[str, tuple[str, list[Attempt]]]] = {}
        try:
            starts = _sacct(client, ids)
            sources.add("sacct")
        except proc.CommandFailed:
            pass
        # Jobs sacct does not know (accounting off, or slurmdbd not caught up yet): ask the controller.
        for job_id in ids:
            if job_id not in starts:
                starts[job_id] = _scontrol(client, job_id)
                sources.add("scontrol")
        for base, jobs in starts.items():
            states[base] = [
                _job(job_id, name, starts_of, events, now, downtimes) for job_id, (name, starts_of) in jobs.items()
            ]
    local = [s for s in subs if s.template == "local"]
    if local:
        states.update(_local_states(rd, local, events))
        sources.add("attempts")
    source = ", ".join(sorted(sources)) or "none"
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
        _last_metrics(rows, key="model_flops"),
        _signs(rows),
    )


def _job(
    job_id: str, name: str, starts: list[Attempt], events: list[dict], now: datetime, downtimes: dict | None = None
) -> JobState:
    """The job as Slurm has it now (its newest start), with every start joined with its events."""
    known = [a for a in starts if not a.state.startswith("UNKNOWN")]  # scontrol's "no such job" is no start
    attempts, left_out = join_attempts(job_id, known, events, now=now, downtimes=downtimes)
    current = starts[-1] if starts else Attempt(0, "UNKNOWN", "", "", "", "", "")
    return JobState(
        job_id,
        name,
        current.state,
        current.exit_code,
        current.nodes,
        current.elapsed,
        current.start,
        current.end,
        attempts,
        left_out,
    )


def join_attempts(
    job_id: str, starts: list[Attempt], events: list[dict], *, now: datetime, downtimes: dict | None = None
) -> tuple[list[Attempt], int]:
    """Slurm's starts of `job_id` (Attempt rows with Slurm's fields only, each with its restart count) joined with
    RUN/attempts.jsonl's begin and end events of the same job and restart count (the module docstring says how
    and what wins); returns the newest MAX_ATTEMPTS, oldest first, and how many older ones were left out."""
    # per restart count, its steps in order: (begin, end) pairs, more than one where a failed step was relaunched
    # in the same allocation (restart.spare_nodes); an end with no begin is a step no rank began
    steps: dict[int, list[list]] = {}
    for e in events:
        n = e.get("restart_count")
        if e.get("job_id") != job_id or type(n) is not int or not 0 <= n <= MAX_RESTART:
            continue
        pairs = steps.setdefault(n, [])
        if e.get("event") == "begin":
            if (
                pairs
                and pairs[-1][1] is None
                and pairs[-1][0] is not None
                and pairs[-1][0].get("attempt") == e.get("attempt")
            ):
                pairs[-1][0] = e  # the same attempt's begin again: the later wins
            else:
                pairs.append([e, None])
        elif e.get("event") == "end":
            if pairs and pairs[-1][1] is None:
                pairs[-1][1] = e
            elif pairs and pairs[-1][1].get("attempt") == e.get("attempt"):
                pairs[-1][1] = e  # the same attempt's end again: the later wins
            else:
                pairs.append([None, e])
    slurm = {a.restart: a for a in starts}
    keys = [(n, i) for n in sorted(set(slurm) | set(steps)) for i in range(max(1, len(steps.get(n, ()))))]
    current = keys[-1][0] if keys else -1  # a start with a later one of the same job was requeued
    left_out = max(0, len(keys) - MAX_ATTEMPTS)
    keys = keys[left_out:]
    out = []
    for n, i in keys:
        pairs = steps.get(n) or [[None, None]]
        begin, end = pairs[i]
        if i < len(pairs) - 1:  # a step relaunched in the same allocation: Slurm's row is the last step's
            base = _from_events(n, "RELAUNCHED", begin, end)
        else:
            base = slurm.get(n) or _from_events(n, "REQUEUED" if n < current else "UNKNOWN", begin, end)
        joined = _with_events(base, begin, end, newest=(n, i) == keys[-1], now=now)
        if joined.relaunch and downtimes and joined.attempt in downtimes:
            joined = replace(joined, downtime=downtimes[joined.attempt])
            joined = replace(joined, summary=attempt_summary(joined))
        out.append(joined)
    return out, left_out


def _from_events(restart: int, state: str, begin: dict | None, end: dict | None) -> Attempt:
    """A start Slurm's answer does not list, from its events: nodes from the begin, times from both."""
    nodes = _hosts(begin.get("nodes") if begin else None)
    start = _text(begin.get("time") if begin else None, 64)
    finished = _text(end.get("time") if end else None, 64)
    return Attempt(restart, state, "", nodes, _elapsed(start, finished), start, finished)


def _hosts(value) -> str:
    """An event's list of node names as shown ("" when it is not one): at most 16, then how many in all."""
    if not isinstance(value, list):
        return ""
    names = [clean(h, limit=64) for h in value[:16] if isinstance(h, str)]
    return ",".join(names) + (f",… ({len(value)} in all)" if len(value) > 16 else "")


def _text(value, limit: int) -> str:
    """An event's text field as shown: a string, cut to `limit`, control characters escaped; "" otherwise."""
    return clean(value, limit=limit) if isinstance(value, str) else ""


def _int(value, low: int, high: int) -> int | None:
    return value if type(value) is int and low <= value <= high else None


def _with_events(base: Attempt, begin: dict | None, end: dict | None, *, newest: bool, now: datetime) -> Attempt:
    """`base` (Slurm's fields) with what the events say about the same start: each field only with the type
    hpcscale writes, bounded."""
    attempt = _int((begin or {}).get("attempt"), 0, MAX_RESTART << 4)
    if attempt is None:
        attempt = _int((end or {}).get("attempt"), 0, MAX_RESTART << 4)
    fields: dict = {"attempt": attempt}
    if end is not None:
        cause = end.get("cause")
        requeue = end.get("requeue")
        fields.update(
            cause=cause if cause in CAUSES else None,
            exit=_int(end.get("exit_code"), -(1 << 31), (1 << 31) - 1),
            why=_text(end.get("why"), MAX_TEXT),
            failure=_text(end.get("failure"), MAX_TEXT),
            requeue=requeue if type(requeue) is bool else None,
            relaunch=_hosts(end.get("relaunch")),
            backoff_s=_int(end.get("backoff_s"), 0, 86400),
            ended=_text(end.get("time"), 64),
        )
        if newest and requeue is True and base.state.split(" ")[0] in ("RUNNING", "COMPLETING"):
            fields["waiting"] = True
            try:
                at = datetime.fromisoformat(fields["ended"]) + timedelta(seconds=fields["backoff_s"] or 0)
                if at.tzinfo is None:
                    at = at.replace(tzinfo=timezone.utc)
                fields["requeue_at"] = at.astimezone(timezone.utc).isoformat(timespec="seconds")
                fields["requeue_in_s"] = round((at - now).total_seconds())
            except (ValueError, OverflowError):
                pass  # a time hpcscale did not write: the requeue is waiting, when is not known
    joined = Attempt(**{**asdict(base), **fields})
    return Attempt(**{**asdict(joined), "summary": attempt_summary(joined)})


def attempt_summary(a: Attempt) -> str:
    """How a start ended, in words: the cause, the exit code, the shared failure, the requeue policy's words,
    and during a backoff when the requeue is due."""
    if a.cause is None:
        if a.requeue is not None or a.why:
            return "ended (an end event hpcscale did not write: no cause)"
        if a.state.split(" ")[0] in ("PENDING", "RUNNING", "REQUEUED", "UNKNOWN", "") or a.attempt is not None:
            return ""
        return "no rank began (nothing in attempts.jsonl for this start): see the job's log"
    how = CAUSE_WORDS[a.cause] + ("" if a.exit is None else f" (exit {a.exit}{': ' + a.failure if a.failure else ''})")
    if a.cause == "completed":
        return how
    if a.waiting:
        why = re.sub(r", starting in \d+ s$", "", a.why)
        if a.requeue_in_s is None:
            when = "when is not known (the end event's time is unreadable)"
        elif a.requeue_in_s >= 0:
            when = f"starting in {a.requeue_in_s} s (at {a.requeue_at})"
        else:
            when = f"due since {a.requeue_at} ({-a.requeue_in_s} s ago)"
        return f"{how}; the requeue is waiting, {when}" + (f": {why}" if why else "")
    if a.relaunch:
        stopped = ""
        if a.downtime and a.downtime.get("total_s") is not None:
            parts = {"detection": "detect_s", "step start": "start_s", "load": "load_s", "first step": "first_step_s"}
            said = ", ".join(f"{k} {a.downtime[v]:.1f} s" for k, v in parts.items() if a.downtime.get(v) is not None)
            stopped = f"; training stopped {a.downtime['total_s']:.1f} s ({said})"
        return f"{how}; relaunched in the same allocation" + (f": {a.why}" if a.why else "") + stopped
    if a.requeue:
        return f"{how}; requeued" + (f": {a.why}" if a.why else "")
    if a.requeue is None:  # `run --local`: no requeue to speak of
        return how + (f"; {a.why}" if a.why else "")
    return f"{how}; not requeued" + (f": {a.why}" if a.why else "")


def _local_states(rd: RunDir, local: list[Submission], events: list[dict]) -> dict[str, list[JobState]]:
    """`run --local` runs as jobs, from RUN/attempts.jsonl (keyed "local:INDEX"): the end event the front end
    wrote (COMPLETED, STOPPED or FAILED, its exit code, the time from the submission to it), RUNNING while the
    newest one's rank 0 is alive, UNKNOWN when a front end ended without saying how (killed itself). Each is
    one attempt, with the end event's cause and failure line."""
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
        elapsed = _elapsed(sub.time, finished)
        base = Attempt(0, state, code, nodes, elapsed, sub.time, finished)
        began = begin if type(attempt) is int else None
        joined = _with_events(base, began, end, newest=True, now=datetime.now(timezone.utc))
        out[f"local:{sub.index}"] = [JobState("local", "", state, code, nodes, elapsed, sub.time, finished, [joined])]
    return out


def _elapsed(start: str, end: str) -> str:
    """[D-]HH:MM:SS between two ISO times, as sacct writes it; empty when either is missing or unreadable."""
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


def _relaunch_rows(lines: list[bytes], events: list[dict]) -> list[dict]:
    """The metrics rows of the attempts around each relaunch in an allocation (the failed step's and the next
    one's), parsed: what hpcscale.observe.downtime reads. None parsed when the run relaunched nothing."""
    around = {e["attempt"] + d for e in events if e.get("event") == "end" and isinstance(e.get("relaunch"), list)
              and type(e.get("attempt")) is int for d in (0, 1)}  # fmt: skip
    if not around:
        return []
    rows = []
    for line in lines:
        try:
            row = loads_json(line, source="metrics.jsonl")
        except BadInput:
            continue
        if isinstance(row, dict) and row.get("attempt") in around:
            rows.append(row)
    return rows


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
            return {**row, **{k: timed[k] for k in STEP_FIGURES if k in timed}}
    return row


SIGNS_SHOWN = 8


def _rows_with(lines: list[bytes], marker: bytes) -> Iterator[dict]:
    """The lines holding `marker` that parse as JSON objects, in the order given; torn or damaged ones skipped."""
    for line in lines:
        if marker not in line:
            continue
        try:
            row = loads_json(line, source="metrics.jsonl", max_bytes=1 << 20)
        except BadInput:
            continue
        if isinstance(row, dict):
            yield row


def _signs(lines: list[bytes]) -> list[dict]:
    """The newest SIGNS_SHOWN lines of warning signs and the checkpoints they caused, oldest first (`lines`: newest
    first). Each {"step", "health": [signs]} or {"step", "health_checkpoint": {...}}; malformed ones skipped."""
    out: list[dict] = []
    for row in _rows_with(lines, b'"health'):
        if isinstance(row.get("health"), list):
            signs = [s for s in row["health"][:16] if isinstance(s, dict)]
            out.append({"step": row.get("step"), "health": signs})
        elif isinstance(row.get("health_checkpoint"), dict):
            out.append({"step": row.get("step"), "health_checkpoint": row["health_checkpoint"]})
        if len(out) >= SIGNS_SHOWN:
            break
    return out[::-1]


# the signs of a node's own state, Slurm's and its GPUs' (health.devices): what `resume` and the relaunch hold
# against a node (a reservation passes, a straggler is --exclude-slow's to move off, a time limit names no node,
# throttling is the room's heat, not the node's fault)
NODE_SIGNS = ("drain", "fail", "maint", "reboot", "down", "not_responding", "ecc", "xid", "row_remap")


def signed_nodes(rd: RunDir) -> dict[str, str]:
    """node -> the signs of its own state (Slurm's or its GPUs') during the run's newest attempt (health signals in
    metrics.jsonl), each kind once, the first of it, oldest first ("drain: ...; not_responding: ..."): what
    `resume` treats as suspect. Only nodes that attempt ran on (its begin record) count: metrics.jsonl is a file
    others may write."""
    events = rd.attempt_events()
    begins = [e for e in events if e.get("event") == "begin" and type(e.get("attempt")) is int]
    newest = max((e["attempt"] for e in begins), default=None)
    ran_on = {n for e in begins if e["attempt"] == newest for n in (e.get("nodes") or []) if isinstance(n, str)}
    found: dict[str, dict[str, str]] = {}
    for row in _rows_with(_metric_rows(rd.metrics, [])[::-1], b'"health"'):  # oldest first
        if row.get("attempt") != newest or not isinstance(row.get("health"), list):
            continue
        for sign in row["health"]:
            node = sign.get("node") if isinstance(sign, dict) else None
            suspect = sign.get("suspect", True) is not False  # a GPU sign that only warned (health.devices: warn)
            if node in ran_on and sign.get("kind") in NODE_SIGNS and suspect:
                found.setdefault(node, {}).setdefault(sign["kind"], clean(sign.get("evidence"), limit=200))
    return {node: "; ".join(f"{kind}: {evidence}" for kind, evidence in kinds.items()) for node, kinds in found.items()}


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


def _sacct(client: SlurmClient, ids: list[str]) -> dict[str, dict[str, tuple[str, list[Attempt]]]]:
    return sacct_starts(client.sacct(ids, SACCT_FIELDS, "-X", "-D"))


def sacct_starts(rows: list[dict[str, str]]) -> dict[str, dict[str, tuple[str, list[Attempt]]]]:
    """Every start of each job in `sacct -X -D` rows (SACCT_FIELDS), by job then JobID (an array job's tasks are
    JobIDs of their own): the newest row's name and the starts, oldest first, row i having restart count i (a
    RESIZING row is not a start of its own: it and the row after it are one)."""
    result: dict[str, dict[str, tuple[str, list[Attempt]]]] = {}
    resized: dict[str, str] = {}  # JobID -> the Start of its record before a resize
    for row in rows:
        jobs = result.setdefault(parse.job_base(row["JobID"]), {})
        _, starts = jobs.get(row["JobID"], ("", []))
        if row["State"].split(" ")[0] == "RESIZING":
            # Slurm ends a job's record where it resized it (a failed node removed from a --no-kill job) and goes
            # on in a new one: the same start, not a requeue
            resized.setdefault(row["JobID"], row["Start"])
            jobs[row["JobID"]] = (row["JobName"], starts)
            continue
        starts.append(
            Attempt(
                restart=len(starts),
                state=row["State"],
                exit_code=row["ExitCode"],
                nodes=row["NodeList"],
                elapsed=row["Elapsed"],
                start=resized.pop(row["JobID"], row["Start"]),
                end=row["End"],
            )
        )
        jobs[row["JobID"]] = (row["JobName"], starts)
    return result


def _scontrol(client: SlurmClient, job_id: str) -> dict[str, tuple[str, list[Attempt]]]:
    """The controller's view: only each job's current start (its restart count from `Restarts=`)."""
    jobs: dict[str, tuple[str, list[Attempt]]] = {}
    for kv in client.show("job", job_id):
        restarts = kv.get("Restarts", "0")
        start = Attempt(
            int(restarts) if restarts.isdigit() and int(restarts) <= MAX_RESTART else 0,
            kv.get("JobState", "UNKNOWN"),
            kv.get("ExitCode", ""),
            kv.get("NodeList", ""),
            kv.get("RunTime", ""),
            kv.get("StartTime", ""),
            kv.get("EndTime", ""),
        )
        jobs[kv.get("JobId", job_id)] = (kv.get("JobName", ""), [start])
    if not jobs:
        jobs[job_id] = ("", [Attempt(0, "UNKNOWN (not in scontrol; accounting is off)", "", "", "", "", "")])
    return jobs
