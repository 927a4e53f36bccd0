"""Slurm's answers read back where a user chose the text: any job name, comment or working directory (`|`,
spaces, `Key=value` inside) leaves every other field as Slurm wrote it. Properties of the parsers on output laid
out as Slurm 22.05 prints it, then the same on the real local cluster."""

from __future__ import annotations

import os
import subprocess
import time

from conftest import wait_for_job
from hypothesis import given, settings
from hypothesis import strategies as st

from hpcscale.slurm import parse
from hpcscale.slurm.client import SlurmClient

US = parse.SACCT_DELIMITER
# What a user may put in a name, a comment or a path: any text on one line (hpcscale refuses control characters
# in job names; Slurm's line-based answers cannot carry a line break unambiguously anyway)
USER_TEXT = st.text(st.characters(blacklist_characters="\n\r", blacklist_categories=("Cs",)), max_size=40)
HOSTILE = st.sampled_from(
    ["a|b", "x JobState=COMPLETED", "ExitCode=0:0 NodeList=evil", "|||||||", f"a{US}b{US}c", " lead", "trail ", ""]
)
NAMES = st.one_of(USER_TEXT, HOSTILE, st.builds(lambda a, b: a + b, HOSTILE, USER_TEXT))
JOB_IDS = st.one_of(
    st.integers(1, 10**7).map(str),
    st.tuples(st.integers(1, 10**6), st.integers(0, 999)).map(lambda t: f"{t[0]}_{t[1]}"),
    st.tuples(st.integers(1, 10**6), st.sampled_from(["batch", "extern", "0"])).map(lambda t: f"{t[0]}.{t[1]}"),
)
STATES = st.sampled_from(["COMPLETED", "FAILED", "RUNNING", "PENDING", "CANCELLED by 0", "TIMEOUT", "NODE_FAIL"])
FIELDS = ("JobID", "State", "ExitCode", "NodeList", "Elapsed", "Start", "End", "JobName")


@st.composite
def sacct_row(draw) -> dict[str, str]:
    return {
        "JobID": draw(JOB_IDS),
        "State": draw(STATES),
        "ExitCode": f"{draw(st.integers(0, 255))}:{draw(st.integers(0, 64))}",
        "NodeList": draw(st.sampled_from(["n1", "n[1-2]", "None assigned", ""])),
        "Elapsed": "00:00:01",
        "Start": "2026-11-28T04:31:32",
        "End": draw(st.sampled_from(["2026-11-28T04:31:33", "Unknown"])),
        "JobName": draw(NAMES),
    }


@settings(max_examples=300, deadline=None)
@given(rows=st.lists(sacct_row(), max_size=6))
def test_sacct_rows_read_back_exactly_whatever_the_name_holds(rows):
    """A name holding the delimiter, `|`, `Key=` or U+2028 (str.splitlines would cut there) stays the name,
    and every other field is read as sacct wrote it."""
    text = "".join(US.join(r[f] for f in FIELDS) + "\n" for r in rows)
    assert parse.sacct_rows(text, FIELDS) == rows


@settings(max_examples=200, deadline=None)
@given(rows=st.lists(sacct_row(), min_size=1, max_size=4), tails=st.lists(USER_TEXT, min_size=4, max_size=4))
def test_the_rest_of_a_name_that_held_a_line_break_is_never_a_row(rows, tails):
    """A name with a line break (not one hpcscale submits) cuts that row's name at the break; what follows
    the break is no row, unless it starts like one with a real job id."""
    named = [{**r, "JobName": r["JobName"] + "\n" + t} for r, t in zip(rows, tails, strict=False)]
    text = "".join(US.join(r[f] for f in FIELDS) + "\n" for r in named)
    got = parse.sacct_rows(text, FIELDS)
    real = [g for g in got if g in rows]
    assert real == rows  # each row whole, its name cut at the break, in order
    assert all(parse.JOB_ID.fullmatch(g["JobID"]) for g in got)  # anything else at least starts like a row


def test_sacct_refuses_a_user_chosen_field_anywhere_but_last():
    assert parse.sacct_args(("JobID", "JobName"))[-1] == "JobID,JobName"
    try:
        parse.sacct_args(("JobName", "JobID", "WorkDir"))
    except ValueError as e:
        assert "only the last" in str(e)
    else:
        raise AssertionError("two user fields were accepted")


def _scontrol_record(job_id: str, name: str, state: str, comment: str, workdir: str, out: str, array: str = "") -> str:
    """One record of `scontrol show job` as Slurm 22.05 lays it out (from the local cluster's answers)."""
    head = f"JobId={job_id} " + (f"ArrayJobId={array} ArrayTaskId=1 " if array else "") + f"JobName={name}"
    lines = [
        head,
        "   UserId=root(0) GroupId=root(0) MCS_label=N/A",
        "   Priority=4294901758 Nice=0 Account=root QOS=normal",
        f"   JobState={state} Reason=None Dependency=(null)",
        "   Requeue=1 Restarts=0 BatchFlag=1 Reboot=0 ExitCode=0:0",
        "   RunTime=00:00:01 TimeLimit=UNLIMITED TimeMin=N/A",
        "   StartTime=2026-11-28T04:32:32 EndTime=2026-11-28T04:32:33 Deadline=N/A",
        "   NodeList=n1",
        "   Command=(null)",
        f"   WorkDir={workdir}",
        *([f"   Comment={comment} "] if comment else []),
        "   StdErr=/dev/null",
        "   StdIn=/dev/null",
        f"   StdOut={out}",
        "   Power=",
        "   ",
        "",
    ]
    return "\n".join(lines) + "\n"


@settings(max_examples=300, deadline=None)
@given(name=NAMES, comment=NAMES, workdir=NAMES, out=NAMES, state=STATES.map(lambda s: s.split()[0]))
def test_scontrol_jobs_read_every_key_as_slurm_wrote_it_whatever_the_user_text_holds(
    name, comment, workdir, out, state
):
    """The `-o` form put a name's or a comment's `JobState=...` in the place of the real one; in the
    multi-line form each user value is its line's rest, and the state, exit code, nodes and times are real."""
    text = _scontrol_record("101", name, state, comment, workdir, out) + _scontrol_record(
        "102", "other", "RUNNING", "", "/tmp", "/dev/null", array="101"
    )
    (first, second) = parse.scontrol_jobs(text, "101")
    assert first["JobName"] == name and first["WorkDir"] == workdir and first["StdOut"] == out
    assert first.get("Comment", "") == comment
    assert (first["JobState"], first["ExitCode"], first["NodeList"]) == (state, "0:0", "n1")
    assert (first["StartTime"], first["EndTime"], first["RunTime"]) == (
        "2026-11-28T04:32:32",
        "2026-11-28T04:32:33",
        "00:00:01",
    )
    assert second["JobId"] == "102" and second["JobState"] == "RUNNING"
    assert [r["JobId"] for r in parse.scontrol_jobs(text, "102")] == ["102"]
    assert parse.scontrol_jobs(text, "7") == []


def test_a_comment_with_a_line_break_adds_no_key_and_no_job():
    text = _scontrol_record(
        "101", "n", "RUNNING", "c\n   JobState=COMPLETED ExitCode=9:0\nJobId=101 JobName=forged", "/tmp", "/o"
    )
    (job,) = parse.scontrol_jobs(text, "101")
    assert (job["JobState"], job["ExitCode"], job["JobName"]) == ("RUNNING", "0:0", "n")


# -- the real cluster -------------------------------------------------------------------------------------------


def test_hostile_names_and_comments_on_the_real_cluster(local_cluster, tmp_path):
    """Jobs named and commented with `|`, spaces and `Key=value`: scontrol and sacct, through SlurmClient,
    give each job's real state and its whole name."""
    client = SlurmClient(conf=local_cluster["SLURM_CONF"])
    names = ["a|b c", "x JobState=COMPLETED ExitCode=7:0", f"u{US}s|"]
    ids = []
    comment = ["--comment", "c|d ExitCode=9:0 JobState=FAILED"]
    for name in names:
        r = subprocess.run(
            ["sbatch", "--parsable", "-J", name, *comment, "-o", "/dev/null", "--wrap", "sleep 1; exit 3"],
            capture_output=True,
            text=True,
            env={**os.environ, **local_cluster},
            cwd=tmp_path,
        )
        assert r.returncode == 0, r.stderr
        ids.append(r.stdout.strip().split(";")[0])
    for job_id, name in zip(ids, names, strict=True):
        (shown,) = client.show("job", job_id)
        assert shown["JobName"] == name and shown["Comment"] == "c|d ExitCode=9:0 JobState=FAILED"
        assert shown["JobState"] in ("PENDING", "RUNNING", "COMPLETING", "FAILED"), shown["JobState"]
        assert wait_for_job(job_id, local_cluster) == "FAILED"
    (shown,) = client.show("job", ids[1])
    assert (shown["JobState"], shown["ExitCode"]) == ("FAILED", "3:0")
    deadline = time.monotonic() + 20  # slurmdbd names a short job's row "allocation" for a moment first
    while True:
        rows = client.sacct(ids, ("JobID", "State", "ExitCode", "JobName"), "-X")
        if all(r["JobName"] != "allocation" for r in rows) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert [(r["JobID"], r["State"], r["ExitCode"], r["JobName"]) for r in rows] == [
        (i, "FAILED", "3:0", n) for i, n in zip(ids, names, strict=True)
    ]
