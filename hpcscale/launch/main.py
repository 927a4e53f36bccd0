"""What `hpcscale launch` does in every rank: read the run directory, bootstrap, build the mesh, run the entry.

Failures end the whole job fast: an exception in any rank is printed with its rank and node, then the rank
calls MPI_Abort, which makes srun/mpirun kill every rank at once (a rank that failed because it lost a peer
waits PEER_LOST_GRACE_S first, so srun/mpirun report the peer's death, not its abort; any other waits
FAILED_ALIKE_GRACE_S, so ranks that fail the same way write their lines too); a rank that dies
without a word is noticed by srun (--kill-on-bad-exit) or mpirun; every collective has a timeout (job spec
`timeout_seconds`); and a rank that stops making progress without dying is named by its peers' watchdogs
(launch/watchdog.py, `hang_timeout_seconds`), which write their stacks and abort the job.
"""

from __future__ import annotations

import importlib
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from hpcscale.config.load import LoadedJob
from hpcscale.errors import BadInput
from hpcscale.launch import waits
from hpcscale.launch.attempts import attempt_event, begin_attempt
from hpcscale.launch.bootstrap import bootstrap, node_name
from hpcscale.launch.context import Context, MetricsLogger, Runtime
from hpcscale.launch.ending import (
    FAILED_ALIKE_GRACE_S,
    PEER_LOST_GRACE_S,
    STOP_BARRIER_S,
    abort_job,
    exit_together,
    leave_together,
)
from hpcscale.launch.failure import failure_line, lost_a_peer
from hpcscale.launch.health import HealthWatch, NoHealthWatch
from hpcscale.launch.placing import Placement, from_mpi_root
from hpcscale.launch.scheduler import NO_SCHEDULER, SchedulerView
from hpcscale.launch.signals import RANKS_READY, STOPPED_EXIT_CODE, StopFlag, StopRequested
from hpcscale.launch.timing import StepTimes
from hpcscale.launch.watchdog import Watchdog
from hpcscale.layout import ParallelDims
from hpcscale.observe.interval import job_mtbf
from hpcscale.rundir import (
    METRICS,
    TENSORBOARD,
    RunDir,
    link_checkpoints,
    node_local_dir,
    site_checkpoint_root,
    sweep_dir,
)
from hpcscale.util.paths import expand_path
from hpcscale.util.pystart import clean_import_path, pause_collector, resume_collector

# The reference trainer is loaded by name like any user's entry point: launch runs entry points, it does not
# know the trainer (hpcscale.train sits above launch and builds on its Context).
BUILTIN_ENTRY = "hpcscale.train.trainer:train"


def resolve_entry(entry: str) -> Callable:
    module, _, func = (BUILTIN_ENTRY if entry == "builtin" else entry).partition(":")
    try:
        return getattr(importlib.import_module(module), func)
    except (ImportError, AttributeError) as e:
        raise BadInput(f"train.entry '{entry}' cannot be loaded: {e}") from None


def _signal_name(signum: int | None) -> str | None:
    import signal

    return None if signum is None else signal.Signals(signum).name


def _stop_step(e: StopRequested) -> int | None:
    """The step after which the ranks stopped (the trainer raises StopRequested(step)); None if not given."""
    return e.args[0] if e.args and isinstance(e.args[0], int) else None


def apply_environment(loaded: LoadedJob) -> None:
    """Give this rank the job's environment (the site's `environment.variables`, then the job spec's
    `environment:`), whatever started it: the rendered script and `run --local` export them, an admin's own
    script calling `hpcscale launch` may not. A variable the rank already has keeps its value (the script that
    started it said so); PYTHONPATH's absolute entries are added to the import path this process already has,
    after the ones there, so `train.entry` is found (an empty or relative entry would name the working
    directory: never, util/pystart). Runs before the bootstrap, so NCCL, gloo and CUDA see the variables when
    they start."""
    wanted = {**loaded.site.config.environment.variables, **loaded.spec.environment}
    for name, value in wanted.items():
        if name == "PYTHONPATH":
            for entry in (e for e in value.split(os.pathsep) if os.path.isabs(e)):
                if entry not in sys.path:
                    sys.path.append(entry)
                have = os.environ.get(name, "").split(os.pathsep)
                if entry not in have:  # for what the rank starts (compile workers, dataloader processes)
                    os.environ[name] = os.pathsep.join([*(e for e in have if e), entry])
        else:
            os.environ.setdefault(name, value)


def launch(run_dir: Path, *, sweep_index: int | None = None, scheduler: SchedulerView = NO_SCHEDULER) -> int:
    """Run this rank. A rank that finished exits here, with every rank (exit_together); otherwise returns the
    process exit code (STOPPED_EXIT_CODE after a stop request, 1 after a failure that did not abort)."""
    stop = StopFlag()
    stop.install()  # before the slow imports and MPI_Init: a stop signal during start-up is not lost
    pause_collector()  # until the entry point is called: torch's imports, MPI_Init, the process groups, the mesh
    # A rank started by a batch script through the console script: its PYTHONPATH's relative entries name the
    # run directory; nothing from there for mpi4py, torch or the entry (run --local's ranks are clean already)
    clean_import_path()
    from mpi4py import MPI

    try:
        # inside: a job spec the ranks refuse (hand-edited since the submission) writes the failure line with its
        # bad-input mark too, which tells the requeue and resume that no node is to blame
        loaded = RunDir(run_dir).load_job()
        apply_environment(loaded)
        spec = loaded.spec
        if spec.train is None:
            raise BadInput(f"{run_dir}/job.yaml has no `train:` entry; `command:` jobs run their program directly")
        placement = Placement(loaded, scheduler)
        info = bootstrap(
            timeout_s=spec.timeout_seconds,
            order_nodes=placement,
            device=spec.device,
            gpus_requested=spec.gpus_per_node,
        )
        if info.rank == 0:  # every rank passed the bootstrap, so every rank's stop handler is installed
            print(RANKS_READY, flush=True)
        switches = from_mpi_root(lambda: placement.switches)  # rank 0 read the tree: every rank gets it
        code = _run(loaded, info, run_dir, stop, sweep_index, switches=switches, scheduler=scheduler)
        if code == 0:
            exit_together(0)
    except StopRequested as e:
        if getattr(e, "together", False):
            exit_together(STOPPED_EXIT_CODE)
        code = STOPPED_EXIT_CODE
    except Exception as e:
        # One line that names the rank and node, then the traceback; then take the whole job down now.
        rank = os.environ.get("HPCSCALE_RANK", "?")
        print(failure_line(e, rank=rank, mpi_rank=MPI.COMM_WORLD.rank, node=node_name()), file=sys.stderr, flush=True)
        traceback.print_exc()
        sys.stderr.flush()
        # bad input the user can fix (an entry point's refused argument, a job spec the ranks reject) ends the
        # job with its exit code, 2, as the CLI's own refusals do; anything else 1
        code = e.exit_code if isinstance(e, BadInput) else 1
        if lost_a_peer(e):
            # A survivor: give srun/mpirun time to notice the rank that died first (kill -9, the OOM killer) and
            # kill this one. A survivor's MPI_Abort that reaches mpirun first makes it report the abort, not the
            # death, and the log would then name no cause (Open MPI 4 on a loaded machine did).
            time.sleep(PEER_LOST_GRACE_S)
        elif MPI.COMM_WORLD.size > 1:  # ranks failing alike get their lines out (a node is blamed otherwise)
            time.sleep(FAILED_ALIKE_GRACE_S)
        MPI.COMM_WORLD.Abort(code)
        return code
    return code


def _job_mtbf(loaded: LoadedJob, work_dir: Path, nodes: list[str]):
    try:
        events = RunDir(work_dir).attempt_events()
    except OSError:
        events = []
    return job_mtbf(
        node_mtbf_hours=loaded.site.config.reliability.node_mtbf_hours,
        nodes=len(nodes),
        events=events,
        now=time.time(),
    )


def _health_watch(loaded: LoadedJob, info, scheduler: SchedulerView):
    """Rank 0 of a Slurm job polls the job's warning signs (health.poll_seconds; launch/health.py). Every other
    rank holds one without a poller: its own GPU's signs (health.devices) come to it from the step loop."""
    cfg = loaded.spec.health
    if info.rank != 0:
        if cfg.devices == "off":
            return NoHealthWatch()
        return HealthWatch(None, poll_s=cfg.poll_seconds, cooldown_s=cfg.cooldown_seconds)
    job_id = os.environ.get("SLURM_JOB_ID")
    site, nodes, signs = loaded.site.config, list(info.nodes), scheduler.signs
    read = None
    if job_id and signs is not None and cfg.poll_seconds:

        def read() -> list[dict]:
            return signs(job_id, nodes, within_s=cfg.warn_before_seconds, now=time.time(), site=site)

    # without a scheduler to ask, signs still come from the straggler verdict (StepTimes on rank 0)
    return HealthWatch(read, poll_s=cfg.poll_seconds, cooldown_s=cfg.cooldown_seconds).start()


def _run(
    loaded: LoadedJob,
    info,
    run_dir: Path,
    stop: StopFlag,
    sweep_index: int | None,
    *,
    switches=None,
    scheduler: SchedulerView = NO_SCHEDULER,
) -> int:
    import torch.distributed as dist

    from hpcscale.parallel.mesh import build_mesh  # lazy: imports torch, which loads after clean_import_path()

    os.environ["HPCSCALE_RANK"] = str(info.rank)
    spec = loaded.spec
    dims = ParallelDims.for_world(world_size=info.world_size, **spec.parallel.degrees)
    device = info.device
    mesh = build_mesh(device_type=device.type, backend=info.backend, dims=dims, timeout_s=spec.timeout_seconds)
    coords = dims.coords(info.rank)
    params = dict(spec.train.params)
    point: dict = {}
    work_dir = run_dir
    if sweep_index is not None:
        if spec.sweep is None or not 0 <= sweep_index < spec.sweep.size:
            raise BadInput(f"--sweep-index {sweep_index}: the job has no such sweep point")
        point = spec.sweep.point(sweep_index)
        params.update(point)
        work_dir = sweep_dir(run_dir, sweep_index)
    checkpoint_root = site_checkpoint_root(loaded.site.config)
    run_id = RunDir(run_dir).run_id()  # every checkpoint directory is marked with it (rundir.claim_checkpoints)
    if checkpoint_root is not None:  # checkpoints on their own filesystem, under the run's name and id
        target = checkpoint_root / f"{run_dir.name}-{run_id}"
        if sweep_index is not None:
            target = target / "sweep" / work_dir.name
        link_checkpoints(work_dir, target, run_id=run_id, below=checkpoint_root)
    node_local = None  # this node's directory of the node-local checkpoint tier (checkpoint.local), made private
    if spec.checkpoint.local.every_steps and loaded.site.config.filesystems.node_local:
        sweep = work_dir.name if sweep_index is not None else None
        node_local = node_local_dir(loaded.site, info.node, run_id, sweep=sweep)
    attempt = begin_attempt(work_dir, info, dims, scheduler.log_paths) if info.rank == 0 else None
    tensorboard = work_dir / TENSORBOARD / f"attempt-{attempt}" if spec.metrics.tensorboard else None
    metrics = MetricsLogger(work_dir / METRICS if info.rank == 0 else None, attempt=attempt, tensorboard=tensorboard)
    mtbf_s = None
    if "auto" in (spec.checkpoint.every_steps, spec.checkpoint.local.every_steps):  # the job's MTBF, on every rank
        mtbf_s = from_mpi_root(lambda: _job_mtbf(loaded, work_dir, info.nodes))
    # this thread's waits in every collective, whoever issues it (per-rank timing)
    collective_waits = waits.install() if spec.metrics.timing_every else None
    health = _health_watch(loaded, info, scheduler)
    ctx = Context(
        rank=info.rank,
        world_size=info.world_size,
        local_rank=info.local_rank,
        node=info.node,
        dims=dims,
        pp_rank=coords.pp,
        dp_rank=coords.dp,
        tp_rank=coords.tp,
        mesh=mesh,
        device=device,
        backend=info.backend,
        run_dir=work_dir,
        job=spec,
        params=params,
        metrics=metrics,
        stop=stop,
        sweep_point=point,
        scratch=expand_path(loaded.site.config.filesystems.scratch),
        run_id=run_id,
        runtime=Runtime(
            node_local=node_local,
            switches=switches,
            mtbf_s=mtbf_s,
            waits=collective_waits,
            peak_tflops=dict(loaded.site.config.devices.peak_tflops),
            health=health,
            root_mpi=info.root_mpi,
        ),
    )
    watchdog = Watchdog(
        rank=info.rank,
        mpi_rank=info.mpi_rank,
        node=info.node,
        world_size=info.world_size,
        min_seconds=spec.hang_timeout_seconds,
        on_hang=abort_job,
    ).start()
    ctx.watchdog = watchdog  # the entry point beats it after each step (ctx.checkpoint.step does)

    ctx.step_times = StepTimes.for_context(ctx)  # each step's breakdown, gathered every timing_every steps
    if spec.health.stragglers != "off":
        ctx.step_times.health = health  # rank 0: a straggler verdict at a window is a warning sign
        ctx.step_times.act_on_stragglers = spec.health.stragglers == "save"
    if collective_waits is not None:
        from hpcscale.launch import ledger  # lazy: imports torch, which loads after clean_import_path()

        # what each of the thread's collectives sends, per group (the communication ledger), in the timing rows
        ctx.step_times.ledger = ledger.install(collective_waits)
    resume_collector()  # hpcscale's start-up is done: the entry module's imports and its steps run with it on
    try:
        resolve_entry(spec.train.entry)(ctx)
        ctx.close()  # ctx.checkpoint's last step's save, and the wait for one in flight
    except StopRequested as e:
        if info.rank == 0:  # the batch script's requeue decision reads it (hpcscale.recovery.requeue)
            # stop_s: from the signal to the committed checkpoint, what the stop took of the grace time
            took = None if stop.at is None else round(time.monotonic() - stop.at, 2)
            attempt_event(work_dir, "stop", attempt, signal=_signal_name(stop.signal), step=_stop_step(e), stop_s=took)
        # Every rank agreed on this step (Context.should_stop). They leave together, after rank 0 recorded the
        # stop: srun --kill-on-bad-exit takes the first exit 75 for a failure and kills the ranks still
        # running, rank 0 perhaps before its record. A bounded wait: a rank stopped alone must not hang here.
        # Tearing the process group down here joins gloo's threads; exiting with them alive aborted ranks
        # after a clean stop ("terminate called without an active exception").
        dist.destroy_process_group()
        e.together = leave_together(STOP_BARRIER_S)  # type: ignore[attr-defined]
        raise
    finally:
        watchdog.stop()  # the closing barrier has the collective timeout
        health.stop()
        metrics.close()
    dist.barrier()
    dist.destroy_process_group()
    return 0
