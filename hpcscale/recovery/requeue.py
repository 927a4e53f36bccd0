"""The batch script's decision after its ranks end: requeue the job, or let it end (`hpcscale requeue`).

The default template runs the ranks in the background and waits for them (so a SIGTERM to the batch shell is
trapped, not fatal), then calls `hpcscale requeue "$RUN" --exit-code $rc` (`hpcscale resume "$RUN" --in-job
--exit-code $rc` in scripts written for 0.1), which lands here:

1. How the attempt ended (`classify`): exit 0 is `completed`; a stop on a signal (rank 0 recorded a `stop`
   event for this attempt, the ranks exited 75, or the step died of SIGUSR1 or SIGUSR2: only `--signal` and
   `scancel --signal` send those, and only a rank that had not yet armed its handlers dies of them) is
   `time_limit` when the job's end time is at most grace_seconds + TIME_LIMIT_SLACK_S away, else
   `preempted` (the signal came early: a preemption, an operator's `scancel --signal`); anything else is
   `failed`. Slurm sends `--signal` up to 60 s before its time (its event resolution), so with a limit under
   grace_seconds + 60 s the signal can come while the ranks are still starting: that attempt stopped, it did
   not fail. A step that died of SIGTERM (143) is not taken as a stop: srun reports 143 too when it ends the
   other ranks after one failed (--kill-on-bad-exit), and a rank that armed its handlers does not die of it.
   A failure the job's log shows it shares wherever it ran (hpcscale.launch.failure.shared_failure: a rank
   refused its input, exit 2; the same exception on ranks of two or more nodes) is `user_error`: no node is
   to blame, and a requeue would fail the same way.
2. Whether to requeue (`decide`), with separate budgets counted over this Slurm job's earlier attempts in
   RUN/attempts.jsonl: `restart.max_preemptions`, `max_time_limits`, `max_failures` (each failure waits
   `failure_backoff_seconds`, doubled each time up to `max_backoff_seconds`), and a stop after
   `max_no_progress` consecutive attempts (preemptions aside) that committed no new checkpoint (one the
   previous attempt's end did not list: `_progress`): a job that crashes at every start ends at its cap
   instead of looping.
3. The decision is appended to RUN/attempts.jsonl (an `end` event) before anything else happens; a failure
   waits its backoff here (the allocation is held meanwhile: a requeued job's start time cannot be set from
   inside the job, Slurm sets it when the job re-enters the queue), then `scontrol requeue`, which ends this
   batch script. Slurm itself holds a requeued job back for the site's credential lifetime (`AuthInfo`
   `cred_expire`, 120 s by default) before it may start. A failure's requeued job is then kept off the nodes
   the failure blamed (`restart.exclude`; `scontrol update ExcNodeList=`, which Slurm takes from a pending job
   only: SIGTERM is ignored from the requeue to that update).
4. With spare nodes (`restart.spare_nodes`, `in_place`), a failure that blames nodes of the step is relaunched
   in the allocation instead, while spares and `max_failures` last (`relaunch_here`): no requeue, no backoff.
   With `restart.shrink`, a failure with too few spares left relaunches on fewer nodes, where the job fits.

The restarted job reruns the script from the top; its ranks resume from the newest checkpoint that every rank
can load and verify, from either tier (hpcscale.launch.checkpointing, Checkpointer._load_newest).
SLURM_RESTART_COUNT is in each `begin` event.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
import time
from collections.abc import Callable, Collection
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timedelta, timezone
from pathlib import Path

from hpcscale.ckpt.format import INDEX, committed_steps, step_dir_name
from hpcscale.config.job import JobSpec
from hpcscale.config.load import on_nodes
from hpcscale.config.site import SiteConfig
from hpcscale.errors import STOPPED_EXIT_CODE, BadInput, HpcscaleError
from hpcscale.launch.failure import first_cause, signalled_task
from hpcscale.launch.signals import STOP_SIGNALS
from hpcscale.recovery.joblog import attempt_lines
from hpcscale.recovery.nodes import (
    NODE_FAILURE,
    first_step_nodes,
    rank_nodes,
    relaunch_nodes,
    shrink_nodes,
    unhealthy,
)
from hpcscale.rundir import RunDir
from hpcscale.slurm.allocation import site_tree
from hpcscale.slurm.client import SlurmClient
from hpcscale.slurm.status import signed_nodes
from hpcscale.topology.tree import SwitchTree, flat_tree
from hpcscale.util import proc
from hpcscale.util.hostlist import compress, expand
from hpcscale.util.slurmtime import parse_duration
from hpcscale.util.trust import UntrustedFile

TIME_LIMIT_SLACK_S = 60  # a stop signal this much beyond grace_seconds before the end still counts as the time limit
# srun's exit code when a rank died of a signal only a stop request sends (its handler not yet armed)
KILLED_BY_STOP_SIGNAL = frozenset(128 + int(s) for s in STOP_SIGNALS if s != signal.SIGTERM)
BUDGETS = {"preempted": "max_preemptions", "time_limit": "max_time_limits", "failed": "max_failures"}


@dataclass(frozen=True, slots=True)
class Decision:
    cause: str  # completed, time_limit, preempted, failed, cancelled, user_error
    requeue: bool
    why: str
    backoff_s: int = 0
    attempt: int | None = None
    checkpoint: int | None = None  # newest committed step when the attempt ended
    progress: bool = True  # a checkpoint committed since the end of the previous attempt
    committed: list | None = None  # committed_now() when the attempt ended: what the next one is judged against
    relaunch: list | None = None  # the next step's nodes, when it starts in this allocation (restart.spare_nodes)
    excluded: list | None = None  # the nodes this failure blames, left out of this allocation's later steps


def classify(exit_code: int, stopped: bool, seconds_left: float | None, grace_s: int, cancelled: bool = False) -> str:
    if exit_code == 0:
        return "completed"
    if cancelled:
        return "cancelled"
    if stopped or exit_code == STOPPED_EXIT_CODE or exit_code in KILLED_BY_STOP_SIGNAL:
        if seconds_left is not None and seconds_left <= grace_s + TIME_LIMIT_SLACK_S:
            return "time_limit"
        return "preempted"
    return "failed"


def failure_backoff(base_s: int, used: int, cap_s: int) -> int:
    """base_s x 2^used seconds, at most cap_s (restart.failure_backoff_seconds, the failures requeued before,
    restart.max_backoff_seconds). `used` is counted from RUN/attempts.jsonl, which others may append to: 2^used
    is never built (a million lines would make it a million bits), nor is anything longer than cap_s slept."""
    if base_s <= 0 or cap_s <= 0:
        return 0
    if used >= cap_s.bit_length():  # 2^used > cap_s already
        return cap_s
    return min(cap_s, base_s << max(used, 0))


PROGRESS_STEPS = 64  # the newest committed checkpoints an `end` event lists (Decision.committed)


def committed_now(root: Path) -> list[list]:
    """[[step, identity of its index file], ...] of the newest PROGRESS_STEPS committed checkpoints in `root`,
    newest first: what the next attempt's progress is judged against. A step saved again after its refused copy
    was set aside has a new index file, so a new identity. Only listed and lstat'ed: nothing planted there is
    opened or waited on."""
    try:
        steps = committed_steps(root)[:PROGRESS_STEPS]
    except OSError:
        return []
    out = []
    for step in steps:
        try:
            st = os.lstat(root / step_dir_name(step) / INDEX)
        except OSError:
            continue
        out.append([step, f"{st.st_ino}:{st.st_mtime_ns}"])
    return out


def _progress(ends: list[dict], checkpoint: int | None, committed: list | None) -> bool:
    """Whether the attempt committed a checkpoint: one in `committed` that the previous attempt's end did not list.
    Not "a newer newest step": a damaged newest checkpoint stays listed (it is set aside only when a save reaches
    its step), and the attempts that train from the one before it and commit steps below it make progress. An
    end event without a usable list (an older hpcscale's, or one others wrote) falls back to comparing the
    newest step, counting a value that is not a step as none."""
    before = ends[-1] if ends else {}
    seen = before.get("committed")
    usable = isinstance(seen, list) and all(
        isinstance(c, list) and len(c) == 2 and type(c[0]) is int and isinstance(c[1], str) for c in seen
    )
    if committed is not None and usable:
        known = {(step, ident) for step, ident in seen}
        return any((step, ident) not in known for step, ident in committed)
    previous = before.get("checkpoint")
    previous = previous if type(previous) is int else None
    return checkpoint is not None and (previous is None or checkpoint > previous)


def spent(ends: list[dict], cause: str) -> int:
    """How many of these `end` events requeued the job, or relaunched its step in the allocation, after a `cause`:
    what the restart budget of that cause has used (a relaunch spends the failure budget as a requeue does)."""
    return sum(1 for e in ends if e.get("cause") == cause and (e.get("requeue") or e.get("relaunch")))


def blamed_before(ends: list[dict]) -> list[str]:
    """The nodes these `end` events blamed (their `excluded`), each once, in order; what is not a name skipped."""
    names = [h for e in ends if isinstance(e.get("excluded"), list) for h in e["excluded"] if isinstance(h, str)]
    return list(dict.fromkeys(names))


def decide(
    spec: JobSpec,
    events: list[dict],
    *,
    job_id: str | None,
    cause: str,
    checkpoint: int | None,
    committed: list | None = None,
) -> Decision:
    """Whether this attempt's job goes back in the queue. `events`: RUN/attempts.jsonl so far (this attempt's
    begin and stop included, its end not yet). `checkpoint`: the newest committed step now; `committed`: the
    newest committed checkpoints now (committed_now), which judge progress."""
    begins = [e for e in events if e.get("event") == "begin"]
    attempt = begins[-1].get("attempt") if begins else None
    ends = [e for e in events if e.get("event") == "end"]
    progress = _progress(ends, checkpoint, committed)
    common = {"attempt": attempt, "checkpoint": checkpoint, "progress": progress, "committed": committed}
    if cause == "completed":
        return Decision(cause, False, "the job finished", **common)
    if cause == "cancelled":
        why = "Slurm ended the job before its time limit (scancel, a node failure): not requeued here"
        return Decision(cause, False, why, **common)
    if cause == "user_error":
        why = (
            "every rank would fail the same way again (no node is to blame): not requeued; fix the job, then "
            "`hpcscale resume RUN`"
        )
        return Decision(cause, False, why, **common)
    if not spec.signals.requeue:
        return Decision(cause, False, "signals.requeue is false", **common)
    mine = [e for e in ends if job_id is not None and e.get("job_id") == job_id]
    budget_key = BUDGETS[cause]
    r = spec.restart
    budget = {"preempted": r.max_preemptions, "time_limit": r.max_time_limits, "failed": r.max_failures}[cause]
    used = spent(mine, cause)
    if used >= budget:
        why = f"{cause.replace('_', ' ')} budget spent: {used} of restart.{budget_key} = {budget} requeues used"
        return Decision(cause, False, why, **common)
    if cause != "preempted" and not progress:
        streak = 1
        for e in reversed(mine):
            if e.get("cause") == "preempted":
                continue
            if e.get("progress"):
                break
            streak += 1
        if streak >= spec.restart.max_no_progress:
            why = (
                f"no new checkpoint in {streak} consecutive attempts (restart.max_no_progress = "
                f"{spec.restart.max_no_progress}): requeueing again would repeat the same failure"
            )
            return Decision(cause, False, why, **common)
    backoff = 0
    if cause == "failed":
        backoff = failure_backoff(r.failure_backoff_seconds, used, r.max_backoff_seconds)
    why = f"requeue {used + 1} of restart.{budget_key} = {budget}" + (f", starting in {backoff} s" if backoff else "")
    return Decision(cause, True, why, backoff_s=backoff, **common)


def _job_now(client: SlurmClient, job_id: str) -> tuple[float | None, bool]:
    """(seconds until the job's time limit or None, whether Slurm already ended it: scancel, a node failure),
    from scontrol. A job Slurm ended is COMPLETING (or CANCELLED) while its batch script still runs, with its
    EndTime moved to that moment, before StartTime + TimeLimit; at the time limit itself EndTime stays there."""
    kv = next(iter(client.show("job", job_id)), {})
    left, ended = None, False
    with contextlib.suppress(ValueError, KeyError):
        end = datetime.fromisoformat(kv["EndTime"])
        left = (end - datetime.now()).total_seconds()  # scontrol prints local time
        if kv.get("JobState", "").startswith(("COMPLETING", "CANCELLED")):
            limit = parse_duration(kv["TimeLimit"])
            ended = end < datetime.fromisoformat(kv["StartTime"]) + timedelta(seconds=limit - 1)
    return left, ended


GRACE_MARGIN = 2.0  # a stop must fit grace_seconds this many times over: saves slow down on a busy file system


def grace_advice(rd: RunDir, grace_s: int) -> str | None:
    """A warning when grace_seconds leaves less than GRACE_MARGIN× what this run measured a stop to take.

    The measure: the slowest `stop_s` of RUN/attempts.jsonl (a stop signal to its committed checkpoint, taken by
    rank 0); before any stop, the longest step plus the longest checkpoint save in RUN/metrics.jsonl.
    """
    took: float | None = None
    stops = [e.get("stop_s") for e in rd.attempt_events() if e.get("event") == "stop"]
    stops = [t for t in map(_number, stops) if t > 0]
    if stops:
        took = max(stops)
        how = f"the slowest stop of this run took {took:.1f} s from the signal to its committed checkpoint"
    else:
        step_s = save_s = 0.0
        for row in _tail_rows(rd.metrics):
            step_s = max(step_s, _number(row.get("step_time_s")))
            save_s = max(save_s, _number(row.get("checkpoint_blocking_s")))
        if save_s:
            took = step_s + save_s
            how = f"this run measured steps of up to {step_s:.1f} s and checkpoint saves of up to {save_s:.1f} s"
    if took is None or took * GRACE_MARGIN <= grace_s:
        return None
    want = int(took * GRACE_MARGIN) + 1
    return f"signals.grace_seconds is {grace_s} s but {how}: give it at least {want} s"


MAX_MEASURED_S = 1e7  # a stop, step or save longer than this (115 days) is not a measurement: ignored


def _number(value) -> float:
    """A duration from a file others may write: a finite number of seconds in [0, MAX_MEASURED_S], else 0
    (a string, NaN, 1e999, a 400-digit integer: ignored, never an OverflowError in the batch script)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return 0.0
    try:
        x = float(value)
    except OverflowError:
        return 0.0
    return x if math.isfinite(x) and 0 <= x <= MAX_MEASURED_S else 0.0


def _tail_rows(path: Path, limit: int = 8 << 20) -> list[dict]:
    """The JSON objects among the last `limit` bytes of a JSON-lines file (a long run's metrics are large).
    Read as a bounded tail of a regular file (util.bounded.read_tail): a FIFO or a device planted in the run
    directory is skipped, never waited on or read without end."""
    from hpcscale.errors import BadInput
    from hpcscale.util.bounded import loads_json, read_tail

    try:
        tail = read_tail(path, max_bytes=limit, what="metrics file", missing_ok=True)
    except BadInput:
        return []
    rows = []
    for line in tail.data.splitlines() if tail else ():
        with contextlib.suppress(BadInput):
            row = loads_json(line, source=str(path))
            if isinstance(row, dict):
                rows.append(row)
    return rows


def relaunch_here(
    spec: JobSpec,
    events: list[dict],
    *,
    job_id: str | None,
    restart_count: int,
    blamed: list[str],
    allocation: list[str],
    tree: SwitchTree,
    base: Decision,
    fits: Callable[[int], bool] | None = None,
    suspects: dict[str, str] | None = None,
    down: Collection[str] = (),
) -> Decision | None:
    """The decision to start the next step in this allocation (restart.spare_nodes), or None: the failed attempt
    blamed nodes it ran on, spares remain for them, and restart.max_failures is not spent by this job's requeues
    and relaunches. The blamed nodes stay out of the job's later steps (`excluded` of its earlier ends too).
    `fits` (restart.shrink: whether the job runs on n nodes): with too few spares, the step shrinks instead.
    `suspects` (node -> its warning sign, hpcscale.slurm.status.signed_nodes): nodes of the step replaced too
    while spares are left, and then kept out as the blamed are. `down`: spares Slurm does not have up, never
    chosen."""
    begins = [e for e in events if e.get("event") == "begin" and e.get("job_id") == job_id]
    previous = begins[-1].get("nodes") if begins else None
    if not isinstance(previous, list) or not all(isinstance(h, str) and h in allocation for h in previous):
        return None  # a begin record that is not this allocation's (a file others may write): no relaunch here
    failed = [h for h in blamed if h in previous]
    if not failed or job_id is None:
        return None
    mine = [e for e in events if e.get("event") == "end" and e.get("job_id") == job_id]
    # this allocation's blamed nodes (a requeue starts anew); the budget counts the job's every start
    before = blamed_before([e for e in mine if e.get("restart_count") == restart_count])
    used = spent(mine, "failed")
    budget = spec.restart.max_failures
    if used >= budget:
        return None
    suspects = {n: why for n, why in (suspects or {}).items() if n in previous and n not in failed}
    unusable = [*before, *(h for h in down if h not in previous)]
    nodes = relaunch_nodes(previous, failed, allocation, unusable, tree, suspects=list(suspects))
    shrunk = ""
    if nodes is None and fits is not None:
        nodes = shrink_nodes(previous, failed, allocation, unusable, tree, fits, suspects=list(suspects))
        if nodes is not None:
            shrunk = f"no spare left: the step shrinks from {len(previous)} to {len(nodes)} node(s) (restart.shrink), "
    if nodes is None:
        return None
    replaced = [h for h in suspects if h not in nodes]
    signed = "".join(f"{h} left out too for its warning sign ({suspects[h]}), " for h in replaced)
    kept = "".join(f"{h} kept despite its warning sign (no spare left for it), " for h in suspects if h in nodes)
    why = (
        f"relaunch {used + 1} of restart.max_failures = {budget} in this allocation: {compress(failed)} left out, "
        f"{signed}{kept}{shrunk}the step now on {compress(nodes)}"
    )
    return replace(base, requeue=False, why=why, backoff_s=0, relaunch=nodes, excluded=[*failed, *replaced])


def first_step(rd: RunDir, env, say=print) -> str:
    """The hostlist of the nodes the job's first step runs on in this allocation (SLURM_JOB_NODELIST): the
    choice of hpcscale.recovery.nodes.first_step_nodes on the site's switch tree. BadInput outside a job."""
    spec = rd.load_job().spec
    listed = env.get("SLURM_JOB_NODELIST")
    if not listed:
        raise BadInput("hpcscale step-nodes runs in a batch script: SLURM_JOB_NODELIST is not set")
    allocation = expand(listed)
    return compress(first_step_nodes(allocation, spec.nodes, _tree_or_flat(rd.site_config(), allocation, say)))


def _keep_off(site: SiteConfig, spec: JobSpec, events: list[dict], job_id: str, blamed: list[str]) -> list[str]:
    """The nodes a requeued job is kept off (restart.exclude): those this failure blames, and with `all-failed`
    those every earlier end of the job blamed; none when the partition could not then hold the job."""
    off = list(blamed)
    if spec.restart.exclude == "all-failed":
        off += blamed_before([e for e in events if e.get("event") == "end" and e.get("job_id") == job_id])
    off = list(dict.fromkeys(off))
    partition = site.partition(spec.partition)
    hosts = set(expand(partition.nodes)) if partition is not None else set()
    return off if len(hosts - set(off)) >= spec.nodes + spec.restart.spare_nodes else []


def _tree_or_flat(site: SiteConfig, allocation: list[str], say) -> SwitchTree:
    """The site's switch tree for choosing a spare; the allocation under one switch when it cannot be read."""
    try:
        return site_tree(site)
    except HpcscaleError as e:
        say(f"hpcscale: switch tree unavailable ({e}); choosing a spare as if every node were under one switch")
        return flat_tree(allocation)


def _down_spares(client: SlurmClient, allocation: list[str], previous) -> list[str]:
    """The allocation's nodes outside the failed step that Slurm does not have up now (drained, down, in
    maintenance): no spare. None known when sinfo does not answer."""
    step = set(previous) if isinstance(previous, list) else set()
    spares = [h for h in allocation if h not in step]
    try:
        return unhealthy(client, spares)
    except (proc.CommandFailed, OSError):
        return []


def _blamed_now(client: SlurmClient, lines: list[str], found, previous) -> list[str]:
    """The nodes a failed attempt blames: those its first cause names, those srun saw fail, and those of its
    step that Slurm does not have up now (a node lost: slurmd gone, marked down)."""
    blamed = list(found.nodes) if found is not None and not found.shared else []
    blamed += [m.group(1) for line in lines if (m := NODE_FAILURE.search(line))]
    if isinstance(previous, list) and all(isinstance(h, str) for h in previous):
        with contextlib.suppress(proc.CommandFailed, OSError):
            blamed += unhealthy(client, previous)
    return list(dict.fromkeys(blamed))


def after_step(
    run_dir: Path, exit_code: int, *, env: dict[str, str] | None = None, say=print, in_place: bool = False
) -> Decision:
    """Record how this attempt ended and requeue the job if the policy says so (see the module docstring).
    `in_place` (the batch script of a job with spare nodes): a failure with a node to blame may instead start
    the next step in this allocation (Decision.relaunch: its nodes); the script starts it."""
    env = dict(os.environ if env is None else env)
    rd = RunDir.open(run_dir)
    loaded = rd.load_job()
    spec = loaded.spec
    site = rd.site_config()  # read once: the client, the switch tree and the partition take it
    client = SlurmClient.for_site(site)
    job_id = env.get("SLURM_JOB_ID")
    events = rd.attempt_events()
    begins = [e for e in events if e.get("event") == "begin"]
    attempt = begins[-1].get("attempt") if begins else None
    stopped = any(e.get("event") == "stop" and e.get("attempt") == attempt for e in events) if begins else False
    seconds_left, cancelled = _job_now(client, job_id) if job_id and exit_code != 0 else (None, False)
    cause = classify(exit_code, stopped, seconds_left, spec.signals.grace_seconds, cancelled)
    # How the attempt ended, read from the job's log in the one order of causes (first_cause): a task that died
    # of a signal is how it ended, whatever srun's exit code (signalled_task); a failure the job shares wherever
    # it ran is a user error (srun killed the others after the first)
    shared = died = failure = found = None
    lines: list[str] = []
    if cause == "failed" and job_id:
        try:
            lines = attempt_lines(rd, job_id)
        except UntrustedFile as e:  # the decision is still made: srun's exit code stands for the attempt's
            say(f"hpcscale: warning: the job's log is not read: {e}")
        else:
            dims, placement = rank_nodes(events, job_id)
            # the one order of causes (hpcscale.launch.failure.first_cause)
            found = first_cause(lines, dims=dims, placement=placement)
            shared = found.shared if found is not None else None  # why no node is to blame, in words
            died = signalled_task(lines) if found is not None and found.kind == "signal" else None
            failure = shared or (None if died or found is None else found.words)
    if shared:
        cause = "user_error"
    committed = committed_now(rd.checkpoints)
    newest = committed[0][0] if committed else None
    decision = decide(spec, events, job_id=job_id, cause=cause, checkpoint=newest, committed=committed)
    blamed: list[str] = []  # the nodes this failure blames, asked of the logs and Slurm once
    if cause == "failed" and job_id:
        blamed = _blamed_now(client, lines, found, begins[-1].get("nodes") if begins else None)
    if in_place and cause == "failed" and (spec.restart.spare_nodes or spec.restart.shrink) and job_id:
        allocation = expand(env.get("SLURM_JOB_NODELIST", "")) if env.get("SLURM_JOB_NODELIST") else []
        tree = _tree_or_flat(site, allocation, say)
        here = relaunch_here(
            spec,
            events,
            job_id=job_id,
            restart_count=int(env.get("SLURM_RESTART_COUNT", "0") or 0),
            blamed=blamed,
            allocation=allocation,
            tree=tree,
            base=decision,
            fits=(lambda n: not on_nodes(loaded, n)[1]) if spec.restart.shrink else None,
            suspects=signed_nodes(rd),
            down=_down_spares(client, allocation, begins[-1].get("nodes") if begins else None),
        )
        decision = here or decision
    if decision.requeue and cause == "failed" and job_id and spec.restart.exclude != "never":
        keep_off = _keep_off(site, spec, events, job_id, blamed)
        if keep_off:
            decision = replace(decision, excluded=keep_off)
    code = 128 + died.signum if died else exit_code
    rd.add_attempt_event(
        {
            "event": "end",
            "time": datetime.now(timezone.utc).isoformat(),
            "job_id": job_id,
            "restart_count": int(env.get("SLURM_RESTART_COUNT", "0") or 0),
            "exit_code": code,
            "srun_exit_code": exit_code,
            "seconds_left": None if seconds_left is None else round(seconds_left),
            **({"failure": failure} if failure else {}),  # what the ranks' lines say of the failure, in words
            **asdict(decision),
        }
    )
    how = f": task {died.tasks} on {died.node} died of signal {died.signum}; srun exited {exit_code}" if died else ""
    how = f": {failure}" if failure else how
    say(f"hpcscale: attempt {decision.attempt} ended: {cause} (exit {code}{how}); {decision.why}")
    if cause in ("time_limit", "preempted") and (advice := grace_advice(rd, spec.signals.grace_seconds)):
        say(f"hpcscale: warning: {advice}")
    if decision.requeue and job_id:
        if decision.backoff_s:
            # From inside the job, this is the one backoff that holds: a requeued job's start time is set by
            # Slurm when it re-enters the queue (cred_expire later), after this script is gone.
            say(
                f"hpcscale: waiting {decision.backoff_s} s before the requeue (restart.failure_backoff_seconds, "
                f"doubled at each failure, at most restart.max_backoff_seconds)"
            )
            time.sleep(decision.backoff_s)
        # `scontrol requeue` ends this batch script (SIGTERM, then SIGKILL after KillWait): the decision is
        # already recorded above. SIGTERM is ignored from here, so the requeued (now pending) job can still be
        # kept off the nodes this job blamed: Slurm takes ExcNodeList only from a pending job.
        previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            client.run("scontrol", "requeue", job_id, timeout=60)
        except proc.CommandFailed as e:
            print(f"hpcscale: requeue failed: {e}", file=sys.stderr, flush=True)
        else:
            if decision.excluded:
                off = compress(decision.excluded)
                try:
                    client.run("scontrol", "update", f"jobid={job_id}", f"ExcNodeList={off}", timeout=60)
                    say(f"hpcscale: the requeued job is kept off {off}")
                except proc.CommandFailed as e:
                    print(f"hpcscale: the requeued job could not be kept off {off}: {e}", file=sys.stderr, flush=True)
        finally:
            signal.signal(signal.SIGTERM, previous)
    return decision
