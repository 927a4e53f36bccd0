"""`hpcscale status RUN` lists every attempt (start) of each job with how it ended, during a requeue's backoff
too, and its table reads in a pipe: the join of `sacct -X -D` rows with RUN/attempts.jsonl (real sacct output
shapes, hostile events), the text through a real pipe, and a rank killed on the real local Slurm cluster
(status during the failure backoff, and after the requeue).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import yaml
from conftest import REPO, run_cli, wait_for_job
from hypothesis import given, settings
from hypothesis import strategies as st
from trainjobs import job_spec

from hpcscale.slurm import parse
from hpcscale.slurm.status import MAX_ATTEMPTS, MAX_TEXT, SACCT_FIELDS, join_attempts, sacct_starts

NOW = datetime(2026, 11, 28, 7, 30, 0, tzinfo=timezone.utc)
D = parse.SACCT_DELIMITER

# `sacct -X -D -n -P --delimiter=... -o SACCT_FIELDS` for job 268, requeued once from inside (its first start
# REQUEUED), its second start pending, as the local cluster printed them; and job 270 after its second start ran
SACCT_REQUEUED_PENDING = (
    f"268{D}REQUEUED{D}0:0{D}n1{D}00:00:02{D}2026-11-28T07:25:43{D}2026-11-28T07:25:45{D}rq.sh\n"
    f"268{D}PENDING{D}0:0{D}None assigned{D}00:00:00{D}Unknown{D}Unknown{D}rq.sh\n"
)
SACCT_TWO_STARTS_AND_ONE = (
    f"270{D}REQUEUED{D}0:0{D}n[1-2]{D}00:01:02{D}2026-11-28T07:20:00{D}2026-11-28T07:21:02{D}gpt\n"
    f"270{D}COMPLETED{D}0:0{D}n[3-4]{D}00:00:40{D}2026-11-28T07:21:40{D}2026-11-28T07:22:20{D}gpt\n"
    f"271{D}FAILED{D}2:0{D}n1{D}00:00:01{D}2026-11-28T07:23:00{D}2026-11-28T07:23:01{D}gpt\n"
)


def _begin(job: str, restart: int, attempt: int, nodes=("n1", "n2")) -> dict:
    return {"event": "begin", "attempt": attempt, "time": "2026-11-28T07:20:05+00:00", "job_id": job,
            "restart_count": restart, "nodes": list(nodes)}  # fmt: skip


def _end(job: str, restart: int, attempt: int, *, cause="failed", requeue=True, backoff=30, at=None, **more) -> dict:
    why = f"requeue 1 of restart.max_failures = 3, starting in {backoff} s" if requeue else "the job finished"
    return {"event": "end", "time": (at or NOW).isoformat(), "job_id": job, "restart_count": restart,
            "exit_code": 137, "srun_exit_code": 1, "seconds_left": 500, "cause": cause, "requeue": requeue,
            "why": why, "backoff_s": backoff, "attempt": attempt, "checkpoint": 50, "progress": True,
            "committed": [[50, 0]], **more}  # fmt: skip


def _starts(text: str) -> dict:
    return sacct_starts(parse.sacct_rows(text, SACCT_FIELDS))


# ---- the join, on sacct's own output shapes ---------------------------------------------------------------
def test_each_sacct_start_joins_its_events_by_job_and_restart_count():
    starts = _starts(SACCT_TWO_STARTS_AND_ONE)
    assert list(starts) == ["270", "271"]
    name, rows = starts["270"]["270"]
    assert name == "gpt" and [(r.restart, r.state) for r in rows] == [(0, "REQUEUED"), (1, "COMPLETED")]
    # the events out of order, another job's in between, the second start's begin on other nodes than sacct says
    events = [
        _begin("270", 1, 2, nodes=("n9",)),
        _begin("999", 0, 7),
        _begin("270", 0, 1),
        _end("270", 0, 1, at=NOW - timedelta(minutes=9)),
        _end("270", 1, 2, cause="completed", requeue=False, backoff=0, exit_code=0),
    ]
    attempts, left_out = join_attempts("270", rows, events, now=NOW)
    assert left_out == 0
    first, second = attempts
    assert (first.attempt, first.state, first.cause, first.exit, first.waiting) == (1, "REQUEUED", "failed", 137, False)
    assert first.summary == "failed (exit 137); requeued: requeue 1 of restart.max_failures = 3, starting in 30 s"
    assert (second.attempt, second.state, second.nodes) == (2, "COMPLETED", "n[3-4]")  # Slurm's nodes win
    assert second.summary == "completed (exit 0)"
    # a start that never reached `hpcscale launch`: Slurm's row, and the words say so
    _, (only,) = starts["271"]["271"]
    (lone,), _ = join_attempts("271", [only], events, now=NOW)
    assert lone.attempt is None and lone.state == "FAILED" and "no rank began" in lone.summary


def test_the_backoff_shows_the_failure_and_when_the_requeue_starts():
    """The newest start's end event asked for a requeue and Slurm still has the job RUNNING: the batch script
    sleeps its backoff. The attempt failed, and the requeue is due at the end event's time + backoff_s."""
    text = f"272{D}RUNNING{D}0:0{D}n2{D}00:01:10{D}2026-11-28T07:28:50{D}Unknown{D}gpt\n"
    (_, rows) = _starts(text)["272"]["272"]
    events = [_begin("272", 0, 1), _end("272", 0, 1, backoff=60, at=NOW - timedelta(seconds=20))]
    (a,), _ = join_attempts("272", rows, events, now=NOW)
    assert a.state == "RUNNING" and a.waiting and a.requeue_in_s == 40
    assert a.requeue_at == "2026-11-28T07:30:40+00:00"
    assert a.summary == (
        "failed (exit 137); the requeue is waiting, starting in 40 s (at 2026-11-28T07:30:40+00:00): "
        "requeue 1 of restart.max_failures = 3"
    )
    (late,), _ = join_attempts("272", rows, events, now=NOW + timedelta(seconds=100))
    assert late.requeue_in_s == -60 and "due since 2026-11-28T07:30:40+00:00 (60 s ago)" in late.summary
    # once Slurm has requeued it, the same start is REQUEUED and no longer waiting
    (_, rows) = _starts(SACCT_REQUEUED_PENDING.replace("268", "272"))["272"]["272"]
    (done, pending), _ = join_attempts("272", rows, events, now=NOW)
    assert done.state == "REQUEUED" and not done.waiting and done.summary.startswith("failed (exit 137); requeued")
    assert pending.state == "PENDING" and pending.summary == ""


def test_starts_only_the_events_know_are_shown_from_them():
    """scontrol knows only the current start (Restarts=2): the earlier ones come from attempts.jsonl, REQUEUED
    (a later start of the same job exists); a user_error's shared failure is in the words."""
    from hpcscale.slurm.status import Attempt

    current = Attempt(2, "FAILED", "2:0", "n1", "00:00:03", "2026-11-28T07:29:00", "2026-11-28T07:29:03")
    shared = "rank 0: data.path: no such file"
    events = [_begin("280", 0, 1), _end("280", 0, 1), _begin("280", 1, 2), _end("280", 1, 2, cause="preempted"),
              _begin("280", 2, 3),
              _end("280", 2, 3, cause="user_error", requeue=False, exit_code=2, failure=shared,
                   why="every rank would fail the same way again")]  # fmt: skip
    attempts, _ = join_attempts("280", [current], events, now=NOW)
    assert [(a.restart, a.state, a.attempt) for a in attempts] == [
        (0, "REQUEUED", 1),
        (1, "REQUEUED", 2),
        (2, "FAILED", 3),
    ]
    assert attempts[0].nodes == "n1,n2" and attempts[0].elapsed  # from the begin and end events
    assert attempts[2].summary == (
        "failed on every rank alike (user error) (exit 2: rank 0: data.path: no such file); not requeued: every "
        "rank would fail the same way again"
    )


def test_events_others_could_write_are_bounded_and_never_break_the_join():
    rows = _starts(SACCT_REQUEUED_PENDING)["268"]["268"][1]
    flood = [_end("268", n, n, requeue=True) for n in range(MAX_ATTEMPTS + 50)]
    attempts, left_out = join_attempts("268", rows, flood, now=NOW)
    assert len(attempts) == MAX_ATTEMPTS and left_out == 50 and attempts[-1].restart == MAX_ATTEMPTS + 49
    odd = [_end("268", 1 << 40, 1), _end("268", "0", 1), _end(268, 0, 1), _end("268", -1, 1)]  # none is this job's
    attempts, _ = join_attempts("268", rows, odd, now=NOW)
    assert [a.cause for a in attempts] == [None, None]


JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=700),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
FIELDS = ("attempt", "time", "cause", "exit_code", "why", "failure", "requeue", "backoff_s", "nodes", "relaunch")


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.fixed_dictionaries(
            {"event": st.sampled_from(["begin", "end"]), "job_id": st.just("268"), "restart_count": st.integers(0, 3)},
            optional={k: JSONISH for k in FIELDS},
        ),
        max_size=8,
    )
)
def test_any_event_values_give_bounded_printable_attempts(events):
    from rich.console import Console

    from hpcscale.cli.slurm_cmd import format_status
    from hpcscale.rundir import Submission
    from hpcscale.slurm.status import JobState, RunStatus, SubmissionStatus

    rows = _starts(SACCT_REQUEUED_PENDING)["268"]["268"][1]
    attempts, _ = join_attempts("268", rows, events, now=NOW)
    for a in attempts:
        assert len(a.why) <= MAX_TEXT + 1 and len(a.failure) <= MAX_TEXT + 1 and len(a.summary) < 4 * MAX_TEXT
        assert a.exit is None or type(a.exit) is int
        assert not any(ord(ch) < 32 for ch in a.summary)
    job = JobState("268", "rq", "PENDING", "0:0", "", "", "", "", attempts)
    status = RunStatus(
        Path("/r"),
        "rq",
        "sacct",
        [
            SubmissionStatus(
                Submission(index=1, job_id="268", cluster=None, time="t", script="s", template="default"), [job]
            )
        ],
    )
    console = Console(width=100, record=True, file=open(os.devnull, "w"))  # noqa: SIM115
    for part in format_status(status):
        console.print(part)
    json.dumps(status.to_json())


# ---- through a real pipe ---------------------------------------------------------------------------------
def _run_dir(tmp_path: Path, site: str = "localcluster") -> Path:
    job = job_spec(tmp_path / "job.yaml", tp=1, pp=1, ranks=2, site=site)
    run = tmp_path / "run"
    r = run_cli("submit", str(job), "--dry-run", "--run-dir", str(run))
    assert r.returncode == 0, r.stderr
    return run


def test_status_in_a_pipe_keeps_its_table_narrow_and_each_reason_whole(tmp_path):
    """Into a pipe (no terminal, no COLUMNS) the table keeps to 80 columns and the long text (a submission's
    reason, each attempt's cause) is below it, one whole line each, numbered from the table."""
    run = _run_dir(tmp_path)
    reason = "resume from step 150: " + "; ".join(["rank 3 on node n2 stopped making progress (no step in 300 s)"] * 5)
    failure = "rank 0: ValueError: data.path /scratch/me/corpus/train-00017.bin: " + "x" * 200
    subs = [
        {"index": 1, "job_id": None, "cluster": None, "time": "2026-11-28T07:00:00+00:00", "script": "",
         "template": "local", "excluded": [], "reason": "submit"},
        {"index": 2, "job_id": None, "cluster": None, "time": "2026-11-28T07:10:00+00:00", "script": "",
         "template": "local", "excluded": ["n2", "n3"], "reason": reason},
    ]  # fmt: skip
    (run / "submissions.jsonl").write_text("".join(json.dumps(s) + "\n" for s in subs))
    ends = [
        {"event": "end", "time": "2026-11-28T07:05:00+00:00", "job_id": None, "local": True, "submission": 1,
         "attempt": None, "exit_code": 0, "cause": "completed", "failure": None},
        {"event": "end", "time": "2026-11-28T07:11:00+00:00", "job_id": None, "local": True, "submission": 2,
         "attempt": None, "exit_code": 2, "cause": "failed", "failure": failure},
    ]  # fmt: skip
    (run / "attempts.jsonl").write_text("".join(json.dumps(e) + "\n" for e in ends))
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    out = subprocess.run(
        [sys.executable, "-m", "hpcscale", "status", str(run)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        text=True, env=env, cwd=REPO, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0
    lines = out.stdout.splitlines()
    head = lines.index(next(line for line in lines if line.lstrip().startswith("#")))
    table = lines[head : lines.index("", head + 1) if "" in lines[head + 1 :] else head + 5]
    assert all(len(line) <= 80 for line in table), "\n".join(table)
    assert f"#2 submitted 2026-11-28T07:10:00+00:00: {reason} (excluded n2,n3)" in lines
    assert any(line.startswith("[1] job local, restart 0: failed (exit 2: " + failure) for line in lines), out.stdout
    assert "FAILED" in "\n".join(table) and "[1]" in "\n".join(table)


# ---- on the real local Slurm cluster ---------------------------------------------------------------------
def _slurm_job(path: Path, steps: int) -> Path:
    job_spec(path, tp=1, pp=1, ranks=2, site="localcluster", nodes=1, steps=steps, checkpoint={"every_steps": 25})
    spec = yaml.safe_load(path.read_text())
    spec["restart"] = {"max_failures": 1, "failure_backoff_seconds": 25}
    path.write_text(yaml.safe_dump(spec))
    return path


def _poll(what, timeout: float, every: float = 0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (got := what()) is not None:
            return got
        time.sleep(every)
    raise AssertionError(f"not seen in {timeout} s")


def _rank_pids(run: Path) -> list[int]:
    out = subprocess.run(["pgrep", "-f", f"hpcscale launch --run-dir {run}"], capture_output=True, text=True)
    pids = []
    for p in out.stdout.split():
        try:
            if Path(f"/proc/{p}/comm").read_text().strip() in ("srun", "mpirun", "orterun"):
                continue
        except OSError:
            continue
        pids.append(int(p))
    return pids


def test_a_killed_rank_shows_failed_through_the_backoff_and_requeued_after(local_cluster, tmp_path):
    """One rank of a 2-rank job killed (kill -9): the batch script records the failure and sleeps its 25 s
    backoff while Slurm still says RUNNING. status then says the attempt failed and when the requeue starts;
    after the requeue the first start is REQUEUED with its cause, and the second one's row follows."""
    run = tmp_path / "run"
    r = run_cli("submit", str(_slurm_job(tmp_path / "job.yaml", steps=400)), "--run-dir", str(run), "--json",
                env=local_cluster)  # fmt: skip
    assert r.returncode == 0, r.stderr
    job_id = json.loads(r.stdout)["job_id"]
    env = {**os.environ, **local_cluster}
    try:
        metrics = run / "metrics.jsonl"
        _poll(lambda: True if metrics.exists() and metrics.read_text().count('"loss"') >= 40 else None, 240)
        victim = _rank_pids(run)[0]
        environ = Path(f"/proc/{victim}/environ").read_bytes().split(b"\0")
        node = next(v.split(b"=", 1)[1].decode() for v in environ if v.startswith(b"SLURMD_NODENAME="))
        os.kill(victim, signal.SIGKILL)

        def waiting():
            doc = json.loads(run_cli("status", str(run), "--json", env=local_cluster).stdout)
            attempts = doc["submissions"][0]["jobs"][0]["attempts"]
            return doc if attempts and attempts[-1]["waiting"] else None

        doc = _poll(waiting, 60)
        (job,) = doc["submissions"][0]["jobs"]
        (a,) = job["attempts"]
        assert job["state"] == "RUNNING" and a["cause"] == "failed" and a["exit"] == 137 and a["attempt"] == 1
        assert 0 < a["requeue_in_s"] <= 25 and "the requeue is waiting, starting in " in a["summary"]
        text = subprocess.run(["hpcscale", "status", str(run)], stdout=subprocess.PIPE, text=True, env=env, cwd=REPO)
        assert "FAILED, requeue in " in text.stdout, text.stdout
        assert "[1] job " + job_id + ", attempt 1, restart 0: failed (exit 137); the requeue is waiting" in text.stdout

        def requeued():
            doc = json.loads(run_cli("status", str(run), "--json", env=local_cluster).stdout)
            attempts = doc["submissions"][0]["jobs"][0]["attempts"]
            return attempts if len(attempts) == 2 and attempts[0]["state"] == "REQUEUED" else None

        first, second = _poll(requeued, 90)
        assert first["cause"] == "failed" and not first["waiting"] and first["restart"] == 0
        assert first["summary"].startswith("failed (exit 137); requeued: requeue 1 of restart.max_failures = 1")
        assert second["restart"] == 1 and second["state"] in ("PENDING", "RUNNING", "COMPLETED")
        # the requeued job is kept off the node the failure blamed (restart.exclude: failed), wherever it starts
        shown = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True, env=env).stdout
        assert f"ExcNodeList={node}" in shown, shown
        assert f"the requeued job is kept off {node}" in (run / "logs" / f"slurm-{job_id}.err").read_text()
        assert wait_for_job(job_id, local_cluster, timeout=300) == "COMPLETED"
        doc = _poll(
            lambda: (
                d
                if (d := json.loads(run_cli("status", str(run), "--json", env=local_cluster).stdout))["submissions"][0][
                    "jobs"
                ][0]["attempts"][-1]["cause"]
                == "completed"
                else None
            ),
            30,
        )
        attempts = doc["submissions"][0]["jobs"][0]["attempts"]
        assert node not in attempts[-1]["nodes"], attempts
        assert [(a["state"], a["cause"], a["attempt"]) for a in attempts] == [
            ("REQUEUED", "failed", 1),
            ("COMPLETED", "completed", 2),
        ]
        text = subprocess.run(["hpcscale", "status", str(run)], stdout=subprocess.PIPE, text=True, env=env, cwd=REPO)
        assert "REQUEUED" in text.stdout and "COMPLETED" in text.stdout
        assert f"[1] job {job_id}, attempt 1, restart 0: failed (exit 137); requeued" in text.stdout
    finally:
        subprocess.run(["scancel", job_id], env=env, capture_output=True)
