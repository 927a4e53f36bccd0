"""Slurm's answers read back where they hold text a user chose: job names, comments, working directories, log
paths. Any text is a valid job name (it is always quoted), so `|`, spaces and `Key=value` inside one must not
move a field, hide a job, or change what a state is read as.

sacct (`sacct_args`, `sacct_rows`): parsable output (-P) with an unlikely delimiter (US, 0x1f) instead of `|`,
and at most one field a user chooses, asked for last: a row is split into exactly as many fields as were asked,
so whatever the last one holds (the delimiter included) stays in it. Rows are split at "\\n" only (str.splitlines
would also split at \\x1c-\\x1e, \\x85 and U+2028, which a name may hold), and a row whose JobID is not a job id
is not a row (the rest of a name that held a line break, which hpcscale's own names cannot).

scontrol (`scontrol_jobs`): `scontrol show job` in its multi-line form, not `-o`. There each user-chosen value
(JobName, Command, WorkDir, Comment, StdErr, StdIn, StdOut) ends its line, so it is read to the end of the
line, and the keys hpcscale needs (JobState, ExitCode, NodeList, times, Reason) sit on lines of their own before
any of them: `-o` puts everything on one line, where a name "x JobState=COMPLETED" or a comment "ExitCode=0:0"
reads as a key. A key's first occurrence in a record wins (a value that held a line break can only add keys
after the real ones), and a record is kept only when it is the job asked for or one of its array tasks.
"""

from __future__ import annotations

import re

SACCT_DELIMITER = "\x1f"  # ASCII unit separator: hpcscale refuses control characters in job names

# sacct fields whose text a user chooses: at most one per query, and last
SACCT_USER_FIELDS = frozenset({"JobName", "Comment", "AdminComment", "SystemComment", "WorkDir", "Constraints"})

# 123, 123_4, 123_[1-5%2], 123+1 (a heterogeneous job's component), each optionally .batch / .extern / .0
JOB_ID = re.compile(r"\d+(?:_(?:\d+|\[[0-9,\-%]+\]))?(?:\+\d+)?(?:\.[A-Za-z0-9_-]+)?")

# scontrol show job: keys whose value a user chooses and that end their line in the multi-line form
SCONTROL_REST_OF_LINE = frozenset(
    {"JobName", "Command", "WorkDir", "Comment", "AdminComment", "SystemComment", "StdErr", "StdIn", "StdOut"}
)
SCONTROL_TRAILING_SPACE = frozenset({"Comment", "AdminComment", "SystemComment"})  # printed as "Comment=%s "
_KEY = re.compile(r"([A-Za-z][A-Za-z0-9_:/]*)=")


def sacct_args(fields: tuple[str, ...] | list[str]) -> list[str]:
    """The output options of a sacct query for `fields` (no header, parsable, the unlikely delimiter).
    ValueError when a user-chosen field is not the last one: only the last field can hold any text."""
    users = [i for i, f in enumerate(fields) if f in SACCT_USER_FIELDS]
    if users and users != [len(fields) - 1]:
        raise ValueError(f"sacct fields {list(fields)}: only the last may be one a user chooses")
    return ["-n", "-P", f"--delimiter={SACCT_DELIMITER}", "-o", ",".join(fields)]


def sacct_rows(text: str, fields: tuple[str, ...] | list[str]) -> list[dict[str, str]]:
    """The rows of `sacct_args(fields)` output, as field -> value; lines that are not rows are skipped."""
    rows = []
    for line in text.split("\n"):
        if line.endswith("\r"):
            line = line[:-1]
        parts = line.split(SACCT_DELIMITER, len(fields) - 1)
        if len(parts) != len(fields):
            continue
        row = dict(zip(fields, parts, strict=True))
        if "JobID" in row and not JOB_ID.fullmatch(row["JobID"]):
            continue
        rows.append(row)
    return rows


def job_base(job_id: str) -> str:
    """The job a JobID belongs to: 123 for 123, 123_4, 123_[1-5], 123+1, 123.batch."""
    return re.split(r"[_+.]", job_id, maxsplit=1)[0]


def _line(line: str, into: dict[str, str]) -> None:
    pos = 0
    while pos < len(line):
        m = _KEY.match(line, pos)
        if m is None:  # not a key: skip the word
            nxt = line.find(" ", pos)
            pos = len(line) if nxt < 0 else nxt + 1
            continue
        key, start = m.group(1), m.end()
        if key in SCONTROL_REST_OF_LINE:
            value = line[start:]
            if key in SCONTROL_TRAILING_SPACE and value.endswith(" "):
                value = value[:-1]
            into.setdefault(key, value)
            return
        end = line.find(" ", start)
        end = len(line) if end < 0 else end
        into.setdefault(key, line[start:end])
        pos = end + 1


def scontrol_jobs(text: str, job_id: str = "") -> list[dict[str, str]]:
    """`scontrol show job [ID]` (multi-line form) as one dict of KEY -> value per job record; with `job_id`,
    only that job's record and its array tasks' (a record whose JobId, ArrayJobId or HetJobId is it, or whose
    ArrayJobId_ArrayTaskId is)."""
    records: list[dict[str, str]] = []
    current: dict[str, str] | None = None
    for raw in text.split("\n"):
        line = raw[:-1] if raw.endswith("\r") else raw
        if line.startswith("JobId="):  # a record's first line is the only one not indented
            current = {}
            records.append(current)
            _line(line, current)
        elif current is not None and line.startswith("   ") and line.strip():
            _line(line[3:], current)
    seen: set[str] = set()
    out = []
    for r in records:
        jid = r.get("JobId", "")
        if not JOB_ID.fullmatch(jid) or jid in seen:
            continue
        task = f"{r.get('ArrayJobId')}_{r.get('ArrayTaskId')}"
        if job_id and job_id not in (jid, r.get("ArrayJobId"), r.get("HetJobId"), task):
            continue
        seen.add(jid)
        out.append(r)
    return out
