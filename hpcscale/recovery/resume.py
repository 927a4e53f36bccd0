"""`hpcscale resume RUN`: read what happened to a run, explain it, pick a verified checkpoint, resubmit.

1. One resume at a time: RUN/.resume/lock (hpcscale.portable.lock: O_EXCL, stale only when its holder is
   provably gone). Two `resume` commands at once: one decides and submits, the other is refused (exit 2) or,
   coming second, finds the new job pending and is refused for that.
2. How the last job ended: sacct --duplicates (every attempt of a requeued job) with its step rows, where the
   real cause often is (the batch step COMPLETED, step 0 FAILED 1:0); scontrol when accounting cannot answer.
   A job still pending, requeued or running refuses the resume (no duplicate runs); so does a finished run.
3. Who failed: the ranks' own failure lines and srun's `task N: Killed` lines in the job's logs (the first
   rank to fail for a reason of its own; a hang names the rank that stopped making progress), slurmstepd's
   `CANCELLED ... DUE TO TIME LIMIT / PREEMPTION / NODE FAILURE`, and the job's nodes that are not up now.
   A failure the job shares wherever it ran (hpcscale.launch.failure.first_cause's `shared`: bad input; the
   same exception on ranks of several nodes) blames no node, and the plan warns that the resubmission fails
   the same way unless the job was fixed.
4. The checkpoint: the newest whose index and every chunk verify (hpcscale.ckpt.ops.verify); the ones refused
   are listed with why. (The ranks load the same one: they fall back past what does not verify.)
5. Exclusion (`restart.exclude`, or --exclude): never; the nodes of this failure; or every node that failed
   in this run (earlier resumes' exclusions too).
6. Resubmit with `--exclude`, optionally at another node count (--nodes: resharded on load, the global batch
   kept), record the decision (RUN/resume.jsonl, and the submission's reason and excluded nodes).

`resume()` is the whole command, the one call the CLI makes and renders: the steps above under the lock, with
one Slurm client and one rendering of the script (what `--dry-run` shows is what sbatch gets).

What it resubmits is what was submitted: RUN/job.yaml and RUN/site.yaml must be trusted (owned by the user or
root, writable by no one else: hpcscale.util.trust) and unchanged since the last submission (their record,
RUN/.submitted.json); a change is refused with its diff unless accepted (`check_submitted`). The plan carries
everything the resubmission runs (`Plan.runs`: the script, the command, the environment, the site and its
SLURM_CONF), so `--dry-run` shows it whole. Logs are read through bounded tails (joblog.LOG_TAIL bytes each; FIFOs
and devices refused), never whole.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from hpcscale.ckpt.format import committed_steps, step_dir_name
from hpcscale.ckpt.ops import verify
from hpcscale.config.load import LoadedJob, on_nodes
from hpcscale.config.render import to_plain
from hpcscale.errors import BadInput, HpcscaleError
from hpcscale.launch.failure import first_cause
from hpcscale.launch.local import LocalResult, local_env, run_local
from hpcscale.observe.timing import judge, read_windows
from hpcscale.portable import lock as run_lock
from hpcscale.portable.errors import StageError
from hpcscale.recovery.joblog import attempt_lines, read_logs
from hpcscale.recovery.nodes import NODE_FAILURE, rank_nodes, unhealthy
from hpcscale.recovery.requeue import blamed_before, grace_advice, spent
from hpcscale.rundir import RESUME_STATE, TIMING, RunDir, Submission
from hpcscale.slurm.client import SlurmClient
from hpcscale.slurm.status import signed_nodes
from hpcscale.slurm.submit import Prepared, prepare, submit_job
from hpcscale.util import proc
from hpcscale.util.hostlist import expand
from hpcscale.util.paths import expand_path
from hpcscale.util.pystart import child_env, hpcscale_command
from hpcscale.util.trust import check_fd, check_trusted, clean

ACTIVE = {"PENDING", "RUNNING", "REQUEUED", "CONFIGURING", "COMPLETING", "SUSPENDED", "RESIZING", "REQUEUE_HOLD",
          "REQUEUE_FED", "RESV_DEL_HOLD", "SIGNALING", "STAGE_OUT", "STOPPED", "SPECIAL_EXIT"}  # fmt: skip
_STEPD = re.compile(r"\*\*\* (?:JOB|STEP) \S+ ON (\S+) CANCELLED AT \S+ DUE TO ([A-Z ]+?) \*\*\*")


@dataclass(slots=True)
class Diagnosis:
    job_id: str | None
    state: str  # the job's state (its last attempt), e.g. FAILED, TIMEOUT, NODE_FAIL, COMPLETED, LOCAL
    exit_code: str
    explanation: str  # one line for a person
    source: str  # sacct, scontrol, attempts (local)
    nodes: list[str] = field(default_factory=list)  # the nodes the job ran on
    failed_nodes: list[str] = field(default_factory=list)  # nodes to blame (the failure's, the ones not up now)
    rank_failure: str | None = None  # the first rank to fail, and how
    shared_failure: str | None = None  # a failure the job shares wherever it ran (no node to blame), in words
    attempts: list[dict] = field(default_factory=list)  # sacct rows of every attempt and step
    finished: bool = False
    active: bool = False


@dataclass(slots=True)
class Plan:
    run_dir: str
    kind: str  # "slurm" or "local"
    diagnosis: Diagnosis
    checkpoint: int | None  # the step the ranks will load; None: from the start
    refused: list[dict]  # [{step, problem}] newer checkpoints that do not verify
    exclude: list[str]
    nodes: int
    submitted: str | None = None  # the new job id
    dry_run: bool = False
    warnings: list[str] = field(default_factory=list)  # what to tune before it happens again
    runs: dict | None = None  # what the resubmission runs (what_it_runs): script, command, environment, site
    accepted_changes: list[str] = field(default_factory=list)  # the diff --accept-changes accepted
    tier: str = "shared"  # where the ranks will load from: "shared", or "node-local" (checkpoint.local)
    tier_reason: str = ""  # why that tier
    nodelist: list[str] = field(default_factory=list)  # nodes the resubmission must include (the node-local holders)

    def to_json(self) -> dict:
        return asdict(self)


# ---- reading what happened ---------------------------------------------------------------------------------
def _sacct_rows(client: SlurmClient, job_id: str) -> list[dict]:
    """Every attempt and step of the job (sacct --duplicates), read as hpcscale.slurm.parse reads sacct: a
    field holding `|` moves no other. CommandFailed when sacct fails or accounting is off."""
    return client.sacct([job_id], ("JobID", "State", "ExitCode", "NodeList", "Start", "End", "Reason"), "-D")


def _scontrol_row(client: SlurmClient, job_id: str) -> list[dict]:
    rows = []
    for kv in client.show("job", job_id):
        rows.append(
            {
                "JobID": kv.get("JobId", job_id),
                "State": kv.get("JobState", "UNKNOWN"),
                "ExitCode": kv.get("ExitCode", ""),
                "NodeList": kv.get("NodeList", ""),
                "Start": kv.get("StartTime", ""),
                "End": kv.get("EndTime", ""),
                "Reason": kv.get("Reason", ""),
            }
        )
    return rows


def _nodes(text: str) -> list[str]:
    if not text or text.startswith("None"):
        return []
    try:
        return expand(text)
    except HpcscaleError:
        return []


def diagnose_slurm(rd: RunDir, sub: Submission, client: SlurmClient) -> Diagnosis:
    job_id = sub.job_id or ""
    source = "sacct"
    try:
        rows = _sacct_rows(client, job_id)
    except proc.CommandFailed:
        rows = []
    if not rows:
        rows, source = _scontrol_row(client, job_id), "scontrol"
    allocs = [r for r in rows if "." not in r["JobID"]]
    last = allocs[-1] if allocs else (rows[-1] if rows else {"State": "UNKNOWN", "ExitCode": "", "NodeList": ""})
    state = last["State"].split()[0] if last["State"] else "UNKNOWN"
    d = Diagnosis(job_id, state, last.get("ExitCode", ""), "", source, attempts=rows)
    d.nodes = _nodes(last.get("NodeList", ""))
    if state in ACTIVE:
        d.active = True
        d.explanation = f"job {job_id} is {state}: nothing to resume while it is in the queue or running"
        return d
    lines = attempt_lines(rd, job_id)
    steps = [r for r in rows if r["JobID"].startswith(f"{job_id}.") and not r["JobID"].endswith((".batch", ".extern"))]
    step = steps[-1] if steps else None
    stepd = [m for line in lines if (m := _STEPD.search(line))]
    events = rd.attempt_events()
    ends = [e for e in events if e.get("event") == "end" and e.get("job_id") == job_id]
    end = ends[-1] if ends else None
    down = unhealthy(client, d.nodes)
    down += [m.group(1) for line in lines if (m := NODE_FAILURE.search(line)) and m.group(1) not in down]
    if end is not None and end.get("cause") in ("preempted", "time_limit"):
        blamed = []  # the ranks stopped on a signal: srun's lines about their exits blame nobody
    else:
        blamed = []
        dims, placement = rank_nodes(events, job_id)
        cause = first_cause(lines, dims=dims, placement=placement)  # the order every reader takes; read once
        if cause is not None:  # as rank_failure says it: a shared failure in its own words, blaming no node
            d.rank_failure, blamed, d.shared_failure = cause.shared or cause.words, list(cause.nodes), cause.shared
    d.failed_nodes = list(dict.fromkeys([*blamed, *down]))
    if (
        state == "COMPLETED"
        and (step is None or step["ExitCode"].startswith("0:"))
        and (end is None or end.get("cause") == "completed")
    ):
        d.finished = True
        d.explanation = f"job {job_id} COMPLETED: the run finished"
        return d
    why = []
    if end is not None:
        cause = str(end.get("cause", "?")).replace("_", " ")
        why.append(f"the ranks ended: {cause} (exit {end.get('exit_code')}); {end.get('why')}")
    elif state == "NODE_FAIL" or down:
        why.append(f"node failure: {', '.join(down) or 'a node'} (failed, or not up now)")
    if step is not None and step["State"].split()[0] != state:
        why.append(f"step {step['JobID']} {step['State']} {step['ExitCode']}")
    if stepd:
        why.append(f"slurmstepd: cancelled due to {stepd[-1].group(2).lower()} on {stepd[-1].group(1)}")
    if d.rank_failure:
        why.append(d.rank_failure)
    d.explanation = f"job {job_id} {state} (exit {d.exit_code})" + (": " + "; ".join(why) if why else "")
    return d


def diagnose_local(rd: RunDir, sub: Submission) -> Diagnosis:
    events = rd.attempt_events()
    begins = [e for e in events if e.get("event") == "begin"]
    d = Diagnosis(None, "LOCAL", "", "", "attempts")
    pid = rd.local_attempt_pid()
    if pid is not None:
        d.active = True
        d.explanation = f"the local run is still going (rank 0 is pid {pid})"
        return d
    lines = read_logs(rd, [Path(sub.script).name]) if sub.script else []
    stops = [e for e in events if e.get("event") == "stop" and begins and e.get("attempt") == begins[-1].get("attempt")]
    dims, placement = rank_nodes(events, None)
    cause = first_cause(lines, dims=dims, placement=placement)  # the order every reader takes
    d.rank_failure = cause.words if cause is not None else None
    d.shared_failure = None if stops or cause is None else cause.shared
    if stops:
        d.explanation = f"stopped on {stops[-1].get('signal')} after step {stops[-1].get('step')}"
    elif d.rank_failure:
        d.explanation = f"failed: {d.rank_failure}"
    else:
        d.explanation = "the last local run ended without a failure line or a stop"
    return d


# ---- checkpoints ---------------------------------------------------------------------------------------------
def pick_checkpoint(rd: RunDir) -> tuple[int | None, list[dict]]:
    """(the newest step that verifies whole, [{step, problem}] of the newer ones that do not)."""

    if not rd.checkpoints.is_dir():
        return None, []
    refused = []
    for step in committed_steps(rd.checkpoints):
        try:
            report = verify(rd.checkpoints / step_dir_name(step))
            problem = None if report.passed else "; ".join(f"{p.path}: {p.problem}" for p in report.problems[:3])
        except HpcscaleError as e:
            problem = str(e)
        except OSError as e:
            problem = f"cannot be read: {e}"
        if problem is None:
            return step, refused
        refused.append({"step": step, "problem": problem})
    return None, refused


def _finished_local(rd: RunDir, loaded: LoadedJob, step: int | None) -> bool:
    steps = loaded.spec.train.params.get("steps") if loaded.spec.train else None
    return step is not None and isinstance(steps, int) and step >= steps


# ---- the decision --------------------------------------------------------------------------------------------
@contextlib.contextmanager
def resume_lock(rd: RunDir):
    state = rd.path / RESUME_STATE
    with contextlib.suppress(FileExistsError):
        state.mkdir(mode=0o755)
    try:
        fd = os.open(state, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise BadInput(f"{state}: not a directory of this run ({e.strerror}); remove it") from None
    try:
        check_fd(fd, state, what="resume lock directory", directory=True)  # another's could hold a fake lock
        try:
            token = run_lock.acquire(fd, str(state))
        except StageError as e:
            raise BadInput(f"another `hpcscale resume` is deciding for {rd.path}: {e}") from None
        try:
            yield
        finally:
            run_lock.release(fd, token)
    finally:
        os.close(fd)


def plan_resume(
    rd: RunDir,
    *,
    exclude_mode: str | None = None,
    nodes: int | None = None,
    client: SlurmClient | None = None,
    exclude_slow: bool = False,
) -> tuple[Plan, LoadedJob]:
    """Everything `resume` decides, nothing submitted. BadInput (exit 2) when there is nothing to resume."""
    plan, loaded, _client = _decide(
        rd, exclude_mode=exclude_mode, nodes=nodes, client=client, exclude_slow=exclude_slow
    )
    return plan, loaded


def _in_place_outlook(spec, events: list[dict], diag: Diagnosis) -> str:
    """What a running job with spare nodes does at its next failure that blames a node: which spares are left
    (the allocation's nodes in no step and not blamed) and how much of restart.max_failures it has used."""
    mine = [e for e in events if e.get("job_id") == diag.job_id]
    begins = [e for e in mine if e.get("event") == "begin"]
    ends = [e for e in mine if e.get("event") == "end"]
    current = begins[-1].get("restart_count") if begins else None
    step = begins[-1].get("nodes") if begins and isinstance(begins[-1].get("nodes"), list) else []
    blamed = blamed_before([e for e in ends if e.get("restart_count") == current])
    spares = [h for h in diag.nodes if h not in step and h not in blamed]
    used = spent(ends, "failed")
    left = max(0, spec.restart.max_failures - used)
    if spares and left:
        return (
            f"; at its next failure that blames a node it relaunches in its allocation (spares left: "
            f"{', '.join(spares)}; {left} of restart.max_failures = {spec.restart.max_failures} left)"
        )
    if not spares and left and spec.restart.shrink:
        return (
            f"; at its next failure that blames a node it relaunches in its allocation on fewer nodes where the "
            f"job fits (no spare left, restart.shrink; {left} of restart.max_failures = "
            f"{spec.restart.max_failures} left)"
        )
    why = "no spare is left" if not spares else "restart.max_failures is spent"
    return f"; at its next failure it does not relaunch in its allocation ({why})"


def _decide(
    rd: RunDir, *, exclude_mode: str | None, nodes: int | None, client: SlurmClient | None, exclude_slow: bool
) -> tuple[Plan, LoadedJob, SlurmClient | None]:
    """plan_resume, and the Slurm client it diagnosed with (None for a local run): the resubmission uses it too."""
    subs = rd.submissions()
    if not subs:
        raise BadInput(f"{rd.path}: no submission recorded: nothing to resume (use hpcscale submit or run)")
    last = subs[-1]
    loaded = rd.load_job()
    spec = loaded.spec
    local = last.template == "local"
    if local:
        diag = diagnose_local(rd, last)
    else:
        if not last.job_id:
            raise BadInput(f"{rd.path}: the last submission was a dry run: submit it first")
        client = client or SlurmClient.for_site(loaded.site.config)
        diag = diagnose_slurm(rd, last, client)
    if diag.active:
        in_place = spec.restart.spare_nodes or spec.restart.shrink
        outlook = _in_place_outlook(spec, rd.attempt_events(), diag) if in_place else ""
        raise BadInput(f"{rd.path}: {clean(diag.explanation)}{outlook}")  # log text: cleaned for the terminal
    step, refused = pick_checkpoint(rd)
    if diag.finished or (local and _finished_local(rd, loaded, step)):
        why = clean(diag.explanation) or f"checkpoint at step {step}"
        raise BadInput(f"{rd.path}: the run finished ({why}): nothing to resume")
    mode = exclude_mode or spec.restart.exclude
    exclude: list[str] = []
    if not local and mode != "never":
        exclude = list(diag.failed_nodes)
        if mode == "all-failed":
            for s in subs:
                exclude += s.excluded
            exclude = list(dict.fromkeys(exclude))
    if not local and mode != "never":  # nodes that showed a warning sign during the last attempt: suspect
        suspects = {n: why for n, why in signed_nodes(rd).items() if n not in exclude}
        exclude += list(suspects)
    else:
        suspects = {}
    slow: list[str] = []
    if exclude_slow:  # the nodes of the stragglers `hpcscale status` names (hpcscale.observe.timing)
        if local:
            raise BadInput("--exclude-slow: a local run has one node; there is no other node to move to")
        verdict = judge(read_windows(rd.path / TIMING))
        if verdict.reason:
            raise BadInput(f"--exclude-slow: {rd.path}: no straggler verdict: {verdict.reason}")
        slow = [node for node in verdict.slow_nodes if node not in exclude]
        exclude += slow
    n = nodes or spec.nodes
    if local and nodes:
        raise BadInput("--nodes: a local run has one node; change the ranks with `hpcscale run --local -n`")
    plan = Plan(str(rd.path), "local" if local else "slurm", diag, step, refused, sorted(exclude), n)
    if exclude_slow:
        plan.warnings.append(
            f"--exclude-slow: excluding the stragglers' node(s) {','.join(slow)}"
            if slow
            else "--exclude-slow: status names no straggler in the last attempt; no node added"
        )
    for node, why in suspects.items():
        plan.warnings.append(f"excluding {node}: it showed a warning sign during the last attempt ({why})")
    if diag.shared_failure:
        plan.warnings.append(
            f"the last attempt failed alike wherever it ran ({clean(diag.shared_failure, limit=300)}): no node is "
            "to blame and none is excluded for it; unless the job (job.yaml, the entry point, the files it names) "
            "was fixed since, the resubmission fails the same way"
        )
    if not local and spec.checkpoint.local.every_steps:
        _choose_tier(plan, rd, client, n)
    if not local and (advice := grace_advice(rd, spec.signals.grace_seconds)):
        plan.warnings.append(advice)
    if n != spec.nodes:
        loaded = _resized(loaded, n)
    return plan, loaded, client


def _choose_tier(plan: Plan, rd: RunDir, client: SlurmClient, nodes: int) -> None:
    """The node-local tier when its newest recorded step is at least as new as the shared tier's newest
    verified one and the nodes that hold it whole survive (not excluded, not down): the resubmission must then
    run on them (`--nodelist`), and the ranks load it without reading the shared tier. Otherwise the shared
    tier, and why."""
    # lazy: ckpt.nodelocal imports torch, and resume runs on the login node (hpcscale resume)
    from hpcscale.ckpt.nodelocal import RECORD, plan_from_record

    lost = set(plan.exclude)
    choice = plan_from_record(rd.path / RECORD, lost=lost, max_nodes=nodes)
    if choice.step is not None and (down := unhealthy(client, choice.nodes)):
        choice = plan_from_record(rd.path / RECORD, lost=lost | set(down), max_nodes=nodes)
    if choice.step is None:
        plan.tier_reason = f"{choice.why}: the shared tier"
    elif plan.checkpoint is not None and choice.step < plan.checkpoint:
        plan.tier_reason = f"the shared tier's step {plan.checkpoint} is newer than node-local step {choice.step}"
    else:
        plan.tier, plan.nodelist, plan.checkpoint = "node-local", choice.nodes, choice.step
        plan.tier_reason = f"{choice.why}: the job runs on them (--nodelist) and reads nothing from the shared tier"


def _resized(loaded: LoadedJob, nodes: int) -> LoadedJob:
    resized, issues = on_nodes(loaded, nodes)
    if issues:
        raise BadInput("\n".join(f"{i} (resuming on {nodes} nodes)" for i in issues))
    return resized


def submit_resume(rd: RunDir, plan: Plan, loaded: LoadedJob, prepared: Prepared | None = None) -> str | None:
    """Submit the plan's job (`prepared`: as what_it_runs showed it, sent as it is) and record the decision."""

    reason = f"resume from step {plan.checkpoint}" if plan.checkpoint is not None else "resume from the start"
    reason += f" after: {plan.diagnosis.explanation}"[:400]
    r = submit_job(
        loaded,
        run_dir=rd.path,
        reuse=True,
        excluded=tuple(plan.exclude),
        required=tuple(plan.nodelist),
        reason=reason,
        prepared=prepared,
    )
    plan.submitted = r.job_id
    record(rd, plan)
    return r.job_id


def check_submitted(rd: RunDir, *, accept: bool, save: bool = True) -> list[str]:
    """Refuse (BadInput, exit 2, the diff in the message) when RUN/job.yaml or RUN/site.yaml changed since the
    last submission recorded them, or nothing recorded them; with `accept` (--accept-changes) return the diff
    instead, recording the files as they are now when `save` (not for --dry-run). [] when unchanged."""
    diff = rd.changes_since_submitted()
    if not diff:
        return []
    if not accept:
        raise BadInput(
            f"{rd.path}: the job would not run what was submitted: its files changed since "
            "(someone, or you, edited them):\n"
            + "\n".join(diff)
            + "\nRefusing to resubmit. Check the difference; if you made it and mean it, resume with "
            "--accept-changes (it records the files as they are now)"
        )
    if save:
        rd.accept_current()
    return diff


def what_it_runs(rd: RunDir, plan: Plan, loaded: LoadedJob, prepared: Prepared | None = None) -> dict:
    """Everything the resubmission would run, as submit_job / run_local will build it: the sbatch script (its
    exact text) or the mpirun command, the program, the environment it sets (the site's variables and the job's
    `environment:`), the modules and files it sources, the site and the SLURM_CONF its Slurm commands use.
    `prepared`: the Slurm submission (prepare_resubmission) to show; else it is prepared here."""
    spec, site = loaded.spec, loaded.site.config
    _check_named_files(loaded)
    env = {**site.environment.variables, **spec.environment}
    out: dict = {
        "site": site.name,
        "site_file": str(loaded.site.path),
        "job_file": str(loaded.path),
        "site_config": to_plain(site),
        "environment": env,
        "modules": list(site.environment.modules),
        "source": list(site.environment.source),
    }
    if plan.kind == "local":
        out["command"] = [
            "mpirun", "-n", str(spec.world_size), "--oversubscribe", "--bind-to", "none", *site.launcher.extra_args,
            *hpcscale_command("launch", "--run-dir", str(rd.path)),
        ]  # fmt: skip

        # as run_local sets it (PYTHONPATH's absolute entries only)
        out["environment"] = child_env({**env, **local_env(), "OMP_NUM_THREADS": "1"}, {})
        return out
    prepared = prepared or prepare_resubmission(rd, plan, loaded)
    # as handed to Slurm (vetted, symlinks resolved); None: the default
    out["slurm_conf"] = prepared.client.check_conf()
    out["template"] = prepared.template
    program = ["hpcscale", "launch", "--run-dir", str(rd.path)]
    out["command"] = list(spec.command) if spec.command is not None else program
    out["script"] = prepared.script
    return out


def prepare_resubmission(rd: RunDir, plan: Plan, loaded: LoadedJob, client: SlurmClient | None = None) -> Prepared:
    """The Slurm resubmission of the plan, resolved and rendered once: shown by what_it_runs, sent by
    submit_resume."""

    return prepare(loaded, run_dir=rd.path, excluded=tuple(plan.exclude), required=tuple(plan.nodelist), client=client)


def _check_named_files(loaded: LoadedJob) -> None:
    """The files the job script sources (site `environment.source`) and the program a `command:` job names by
    absolute path run as the user: each that exists here must be trusted like the configuration naming it
    (hpcscale.util.trust; UntrustedFile, exit 2). Paths that exist only on the compute nodes are not checked."""

    named = [(p, "file the job script sources (site.yaml environment.source)") for p in
             loaded.site.config.environment.source]  # fmt: skip
    command = loaded.spec.command
    if command and command[0].startswith("/"):
        named.append((command[0], "program of the job's command"))
    for text, what in named:
        path = expand_path(text)
        if os.path.lexists(path):
            check_trusted(Path(os.path.realpath(path)), what=what)


def record(rd: RunDir, plan: Plan) -> None:
    rd.add_resume_decision({"time": datetime.now(timezone.utc).isoformat(), **plan.to_json()})


@dataclass(slots=True)
class Resumed:
    """What `resume` did: the plan (with the new job id once submitted), and for a local run what its rerun did."""

    plan: Plan
    local: LocalResult | None = None  # the local rerun's result (run_local); None: submitted, or a dry run


def resume(
    rd: RunDir,
    *,
    exclude_mode: str | None = None,
    exclude_slow: bool = False,
    nodes: int | None = None,
    accept_changes: bool = False,
    dry_run: bool = False,
    on_plan: Callable[[Plan], None] = lambda plan: None,
    echo: Callable[[str], None] = print,
    warn: Callable[[str], None] | None = None,
) -> Resumed:
    """`hpcscale resume RUN`, whole: under the resume lock, refuse changed files (check_submitted), decide
    (plan_resume), show what it runs (what_it_runs), then, unless `dry_run`, resubmit to Slurm (submit_resume) or
    record the decision and rerun a local run (run_local, its output through `echo` and its warnings through
    `warn`). `on_plan(plan)` is called once the plan is final, before anything is submitted or run (a local
    run's decision is recorded first). The Slurm client, the resolved job and its script are built once, and
    what is shown is what is sent."""
    with resume_lock(rd):
        accepted = check_submitted(rd, accept=accept_changes, save=not dry_run)  # before anything runs
        plan, loaded, client = _decide(
            rd, exclude_mode=exclude_mode, nodes=nodes, client=None, exclude_slow=exclude_slow
        )
        plan.dry_run = dry_run
        plan.accepted_changes = accepted
        prepared = prepare_resubmission(rd, plan, loaded, client) if plan.kind == "slurm" else None
        plan.runs = what_it_runs(rd, plan, loaded, prepared)
        if dry_run or plan.kind == "slurm":
            on_plan(plan)
            if not dry_run:
                submit_resume(rd, plan, loaded, prepared)
            return Resumed(plan)
        record(rd, plan)
        on_plan(plan)

        result = run_local(loaded, ranks=loaded.spec.world_size, run_dir=rd.path, reuse=True, echo=echo, warn=warn)
    return Resumed(plan, result)
