"""Warning signs of a running job, as Slurm knows them (docs/observability.md#health-signals): a node of the job
drained, failing or under maintenance; a reservation that will take one of its nodes before the job ends; the
job's time limit near. Read by rank 0 of the job through `hpcscale launch`'s SchedulerView (the rank side
imports nothing of slurm/); each sign is a plain dict, {"kind", "node", "evidence"}.

Everything read is another program's text: values are cut to EVIDENCE_CHARS, times that do not parse are no
sign, and a scontrol that fails or hangs (timeout) gives no sign rather than an error."""

from __future__ import annotations

import re
from datetime import datetime

from hpcscale.config.site import SiteConfig
from hpcscale.slurm.client import SlurmClient
from hpcscale.util.hostlist import expand
from hpcscale.util.proc import CommandFailed

__all__ = ["BAD_NODE_STATES", "job_signs"]

# a node state with any of these is a sign (DRAIN covers DRAINING and DRAINED)
BAD_NODE_STATES = ("DRAIN", "FAIL", "MAINT", "REBOOT", "DOWN", "NOT_RESPONDING")
EVIDENCE_CHARS = 300
_FIELD = re.compile(r"(?:^|\s)(\w+)=(\S*)")


def _fields(line: str) -> dict[str, str]:
    """KEY=VALUE pairs of one `scontrol -o` line, the first of each key, none from a node's Reason (free text an
    administrator or a health check wrote: `State=` inside it must not change the node's state)."""
    head = line.split(" Reason=", 1)[0]
    out: dict[str, str] = {}
    for m in _FIELD.finditer(head):
        out.setdefault(m.group(1), m.group(2))
    return out


def _reason(line: str) -> str:
    """A node's Reason, whole: the last field of `scontrol show node -o`, spaces and all."""
    found = re.search(r"\sReason=(.*)$", line)
    return found.group(1).strip()[:EVIDENCE_CHARS] if found else ""


def _when(text: str | None) -> float | None:
    if not text or text in ("Unknown", "None", "N/A"):
        return None
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        return None


def job_signs(
    job_id: str,
    nodes: list[str],
    *,
    within_s: float,
    now: float,
    site: SiteConfig | None = None,
    client: SlurmClient | None = None,
) -> list[dict]:
    """The signs Slurm shows now for job `job_id` on `nodes`: nodes in a BAD_NODE_STATES state; reservations
    holding any of them that start within `within_s` (and before the job's end, when it has one) and that the job
    does not run in; the job's end (its time limit) within `within_s`."""
    client = client or SlurmClient.for_site(site)
    signs: list[dict] = []
    mine = set(nodes)
    try:
        out = client.run("scontrol", "show", "node", "-o", ",".join(nodes), check=False, timeout=20).stdout
    except CommandFailed:
        out = ""
    for line in out.splitlines():
        f = _fields(line)
        name, state = f.get("NodeName", ""), f.get("State", "").upper()
        bad = [s for s in BAD_NODE_STATES if s in state]
        if name in mine and bad:
            reason = _reason(line)
            evidence = f"State={state}" + (f" Reason={reason}" if reason else "")
            signs.append({"kind": bad[0].lower(), "node": name, "evidence": evidence[:EVIDENCE_CHARS]})
    try:
        job = next((j for j in client.show("job", job_id, timeout=20) if j.get("JobId") == job_id), {})
    except CommandFailed:
        job = {}
    end = _when(job.get("EndTime")) if job.get("TimeLimit") not in (None, "UNLIMITED", "Partition_Limit") else None
    if end is not None and 0 <= end - now <= within_s:
        signs.append(
            {
                "kind": "time_limit",
                "node": None,
                "evidence": f"EndTime={job.get('EndTime')} TimeLimit={job.get('TimeLimit')}"[:EVIDENCE_CHARS],
            }
        )
    try:
        out = client.run("scontrol", "show", "reservation", "-o", check=False, timeout=20).stdout
    except CommandFailed:
        out = ""
    for line in out.splitlines():
        f = _fields(line)
        name = f.get("ReservationName")
        if not name or name == job.get("Reservation"):
            continue
        try:
            held = [n for n in expand(f.get("Nodes", "")) if n in mine]
        except Exception:  # a hostlist this code cannot read is no sign
            continue
        start = _when(f.get("StartTime"))
        if not held or start is None or not now < start <= now + within_s or (end is not None and start >= end):
            continue
        evidence = f"ReservationName={name} StartTime={f.get('StartTime')} Flags={f.get('Flags', '')}"
        signs.extend({"kind": "reservation", "node": n, "evidence": evidence[:EVIDENCE_CHARS]} for n in held)
    return signs
