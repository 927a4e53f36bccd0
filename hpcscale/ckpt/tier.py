"""What both checkpoint tiers share, behind one interface (Tier: save, wait, busy, close, pin, unpin,
last_step, last_stats): the writer thread and its staging buffers, saves (one in flight at most; asynchronous
ones in the background), pins against retention, the wait for a save in flight. Each tier is its own class in
its own module and commits and loads its own way:

- hpcscale.ckpt.manager.CheckpointManager, the shared tier (RUN/checkpoints on the parallel filesystem):
  load_latest, and drain, which takes a step of the node-local tier into this one (the operation between the
  tiers);
- hpcscale.ckpt.local_tier.NodeLocalManager, each node's own storage with partner copies
  (hpcscale.ckpt.nodelocal): load_node_local, discard_after.

At most one save is in flight: save() first waits for the previous one, and raises its error if it failed.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from hpcscale.ckpt import faults
from hpcscale.ckpt.format import REFUSED, committed_steps, step_dir_name
from hpcscale.ckpt.nodelocal import (
    NodeLocal,
)
from hpcscale.ckpt.retention import apply_retention
from hpcscale.ckpt.rng import rng_state
from hpcscale.ckpt.shards import local_shards, writers
from hpcscale.ckpt.shards import mine as pieces_to_write
from hpcscale.ckpt.writer import ShardWriter, StagingPool
from hpcscale.errors import BadInput, RuntimeFailure
from hpcscale.layout import ParallelDims

CKPT_GROUP_MIN_TIMEOUT_S = 1800  # gloo's own default: a save may wait this long for a slow filesystem


@dataclass(frozen=True, slots=True)
class Restored:
    step: int
    trainer_state: dict
    rng: dict[str, np.ndarray] | None  # this rank's RNG states, when the layout is the saved one


@dataclass(frozen=True, slots=True)
class SaveStats:
    step: int
    blocking_s: float  # what the caller waited for (the snapshot; the whole save when synchronous)
    new_bytes: int  # this rank's newly written bytes
    referenced_bytes: int  # this rank's bytes referenced from earlier checkpoints
    background_s: float = 0.0  # an async save: from the call's return to its commit


class Tier:
    """What both checkpoint tiers do alike (module docstring): the writer thread and its staging buffers, saves
    (one in flight at most; asynchronous ones in the background), pins against retention, the wait for a save
    in flight. A tier commits a save its own way (`_commit`) and loads its own way: CheckpointManager is the
    shared tier (load_latest, and the drain from the other tier), NodeLocalManager each node's own storage
    (load_node_local). Every method is a collective over the checkpoint group unless it says otherwise."""

    node_local: NodeLocal | None = None  # the node-local tier's layout; None for the shared tier
    WHAT = "checkpoint directory"  # how refusals name `root`

    def __init__(
        self,
        root: Path,
        *,
        dims: ParallelDims,
        rank: int,
        keep_last: int = 3,
        keep_every: int = 0,
        direct_io: bool = True,
        log=None,
        lineage: dict | None = None,
        background_nice: int = 0,
        read_only: bool = False,
        device: torch.device | None = None,
        timeout_s: float | None = None,
        owner: str | None = None,
        staging: StagingPool | None = None,
    ):
        """read_only: only `load_latest` (another run's checkpoints: xsite.start_from). Nothing under `root` is
        created, cleaned or set aside, and `save` refuses.

        device: the rank's device (the training thread's current one). The writer thread makes it its own
        current device before it touches CUDA, so its pinned buffers, copy stream and events are on the rank's
        GPU, not GPU 0. timeout_s: the job's timeout_seconds; the checkpoint group's collective timeout is that
        or CKPT_GROUP_MIN_TIMEOUT_S, whichever is longer. owner: the run's id; the directory is claimed for it
        (hpcscale.rundir.claim_checkpoints) before anything in it is written or removed, and a directory another
        run owns is refused on every rank (BadInput). Before that (unless read_only) `root` is made by this user,
        or accepted only if it is this user's (or root's) and no one else can write it (_take_root): otherwise
        every rank raises BadInput, and nothing under it was read, written or removed.

        staging: the host buffers asynchronous saves copy the tensors into (writer.StagingPool), shared with
        another manager of this rank (the other tier's: one staging copy per rank); without it, its own. Saves of
        the managers that share it take turns in its buffers (a save waits while another's still reads them)."""
        self.root, self.dims, self.rank = root, dims, rank
        # who keeps `root` tidy: rank 0 of a shared root, each node's lowest rank of a node-local one
        self._keeper = rank == self._keeper_rank()
        self.read_only = read_only
        self.lineage = lineage  # what produced this run's checkpoints (hpcscale.ckpt.lineage), rank 0's
        self.coords = dims.coords(rank)  # where this rank sits: decides which shards it writes
        self.keep_last, self.keep_every = keep_last, keep_every
        # steps retention keeps whatever keep_last/keep_every say (rank 0's set counts, written to PINNED so
        # `ckpt gc` honours it too): a cross-site start checkpoint until round 0 is adopted (launch.site_rounds)
        self.pinned: set[int] = set()
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        # Metadata of saves travels on its own gloo group: a background save never interleaves with training
        # collectives on the default group.
        # A save's collectives wait for the slowest rank's writes and rank 0's commit, which on a busy parallel
        # filesystem can outlast the training's collective timeout: never less than gloo's default 30 minutes
        self.group = dist.new_group(
            backend="gloo",
            timeout=timedelta(seconds=max(timeout_s, CKPT_GROUP_MIN_TIMEOUT_S)) if timeout_s else None,
            group_desc="ckpt",  # how the communication ledger names its traffic on the training thread
        )
        self.device = device if device is not None else torch.device("cpu")
        if not read_only:  # every rank refuses together: one raising alone would leave the others waiting
            refusals: list = [None] * dist.get_world_size()
            dist.all_gather_object(refusals, self._take_root(owner) if self._keeper else None, group=self.group)
            if refused := next((r for r in refusals if r), None):
                raise BadInput(refused)
        if self._keeper and not read_only:
            leftovers = list(root.glob(".tmp-*"))
            if leftovers:
                try:
                    # removes .tmp-* only (a crashed run's: this job has none in progress yet): keeps everything
                    apply_retention(root, keep_last=10**9, keep_every=0, own_saves=True)
                    self.log(f"hpcscale: removed {len(leftovers)} unfinished save(s) in {root}")
                except Exception as e:  # rank 0 raising alone would leave the others at the barrier
                    self.log(f"hpcscale: could not remove unfinished saves in {root}: {type(e).__name__}: {e}")
        dist.barrier(group=self.group)
        self.writer = ShardWriter(root, rank=rank, group=self.group, direct_io=direct_io, staging=staging)
        self.staging = self.writer.pool
        self.last_step: int | None = None
        self._writers_key: tuple | None = None  # what _writer_table was last computed for
        self._writers_table: dict = {}
        self._refused: set[int] = set()  # steps load_latest refused: set aside if a save reaches one
        # steps listed here when the run restarted from the other tier, none of them verified (restored_elsewhere):
        # set aside, like refused ones, if a save reaches one; and the step restored, the next save's parent
        self._unverified: set[int] = set()
        self._restored_from: int | None = None
        # load_latest returned None after a refused checkpoint had been partly read into the caller's tensors
        # (chunks are read straight into them and hashed there): they are no longer the fresh start's values
        self.tensors_dirty = False
        self._adopt_newest()
        self.last_stats: SaveStats | None = None
        # One thread for every async save, started at the first
        self._bg = _Background(f"hpcscale-ckpt-{rank}", background_nice, device=self.device)
        self._pending = False  # an async save was handed to it and not yet waited for
        self._staged: threading.Event | None = None  # a deferred save's copy taken (wait_staged)

    def _keeper_rank(self) -> int:
        """The rank that keeps `root` tidy (claims it, removes unfinished saves, applies retention)."""
        return 0

    def _take_root(self, owner: str | None) -> str | None:
        """The keeper, before anything under `root` is read, written or removed: make `root` a directory only
        this user can write, or accept the one there only if it is one (hpcscale.util.trust.private_dir: someone
        who made it first could have planted a step in it). Returns why this run must not use it (None: it may)."""
        raise NotImplementedError

    def pin(self, step: int, why: str) -> None:
        """Keep `step` whatever the retention policy says, until unpin(step); on disk (PINNED) from rank 0."""
        if step not in self.pinned:
            self.pinned.add(step)
            self._write_pins({step: why})

    def unpin(self, step: int) -> None:
        if step in self.pinned:
            self.pinned.discard(step)
            self._write_pins({})

    def _write_pins(self, new: dict[int, str]) -> None:
        if self.rank != 0 or self.read_only:
            return
        from hpcscale.ckpt.retention import read_pins, write_pins

        try:
            pins = {s: w for s, w in read_pins(self.root).items() if s in self.pinned} | new
            write_pins(self.root, {s: w for s, w in pins.items() if s in self.pinned})
        except OSError as e:  # the pin still holds for this job's own retention (self.pinned)
            self.log(f"hpcscale: cannot record pinned checkpoints in {self.root}: {e}")

    def _adopt_newest(self) -> None:
        """What a fresh process deduplicates its first save against: nothing, unless the tier says (the shared
        tier's newest committed step)."""

    # ---- saving ---------------------------------------------------------------------------------------------
    def save(
        self,
        step: int,
        tensors: dict[str, torch.Tensor],
        trainer_state: dict,
        *,
        asynchronous: bool,
        defer_staging: bool = False,
    ) -> SaveStats:
        """Save `tensors` and `trainer_state` as step `step`. Synchronous: returns when committed. Asynchronous:
        returns once the tensors are copied (staged) to host buffers and writes in the background; with
        `defer_staging` even the copy runs in the background, and the caller must call wait_staged() before it
        next changes any of `tensors` in place (the trainer: before the optimizer step; on an accelerator the
        copy then overlaps the forward and backward passes, which leave the tensors alone)."""
        done = self._begin(step)
        if done is not None:
            return done
        t0 = time.perf_counter()
        faults.slow(step)  # tests only: HPCSCALE_CKPT_SLOW, a filesystem that got slower
        self._fresh_save()
        shards = local_shards(tensors)
        table = self._writer_table(shards)
        mine = pieces_to_write(shards, table, self.rank)
        rng = rng_state(self.device)
        # On a GPU: what the copy must wait for is what this (training) thread queued before this call
        ready = None
        if self.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        parent = self._parent(step)
        state = dict(trainer_state)
        if self.lineage is not None:
            from hpcscale.ckpt.lineage import TAG, for_save

            state[TAG] = for_save(self.lineage, state, parent)
        if not asynchronous:
            result = self._write(step, self.writer.snapshot(mine, copy=False), rng, state, parent)
            self.last_stats = SaveStats(step, time.perf_counter() - t0, result.new_bytes, result.referenced_bytes)
            return self.last_stats
        # the staging buffers, once no other manager's save (the other tier's) still reads them; given back when
        # this save's write has ended (_holding_staging), or below if it is never handed over
        self.staging.take(self, alive=self._bg.alive)
        try:
            if defer_staging:
                staged = threading.Event()
                job = (self._stage_and_write, mine, step, rng, state, parent, staged, ready)
                self._bg.submit(self._holding_staging, *job)
                self._staged = staged  # only once handed over: a refused save leaves none
            else:
                pending = self.writer.snapshot(mine, copy=True, ready=ready)
                self._bg.submit(self._holding_staging, self._background, step, pending, rng, state, parent)
        except BaseException:
            self.staging.give_back(self)
            raise
        self._pending = True
        self.last_stats = SaveStats(step, time.perf_counter() - t0, 0, 0)
        return self.last_stats

    def _fresh_save(self) -> None:
        """Before a save's shards are chosen: what the tier forgets (the node-local tier: every step stands alone)."""

    def _holding_staging(self, fn: Callable, *args) -> None:
        """On the writer thread: fn(*args), a save that reads the staging buffers; they are given back after it."""
        try:
            fn(*args)
        finally:
            self.staging.give_back(self)

    def _begin(self, step: int) -> SaveStats | None:
        """Before a save or drain of `step`: wait for the one in flight; the stats of `step` when it is saved
        already (nothing to do), else None. A refused checkpoint of that step is set aside first."""
        if self.read_only:
            raise RuntimeError(f"checkpoints in {self.root} are opened read-only: nothing is saved there")
        self.wait()
        if step == self.last_step:
            return self.last_stats or SaveStats(step, 0.0, 0, 0)
        # the same on every rank: load_latest agreed on what it refused, and rank 0 listed the unverified steps
        if step in self._refused:
            self._refused.discard(step)
            self._set_aside([step])
        elif step in self._unverified:  # listed, never verified: what a save of this step replaces, not is
            self._unverified.discard(step)
            self._set_aside([step], what="checkpoint not verified since the restart")
        return None

    def _parent(self, step: int) -> str | None:
        """The parent a save of `step` records: the newest step this tier committed or verified, else the one the
        run restarted from on the other tier; never `step` or a later one."""
        before = self.last_step if self.last_step is not None else self._restored_from
        return step_dir_name(before) if before is not None and before < step else None

    def _writer_table(self, shards: list) -> dict:
        """shards.writers() for these tensors, computed once for each set of names, shapes and placements (it
        depends on nothing else, and at thousands of ranks it is seconds of work)."""
        key = tuple(
            (
                s.name,
                s.global_shape,
                s.tensor.element_size(),
                getattr(getattr(s.source, "device_mesh", None), "mesh_dim_names", None),
                tuple(s.source.device_mesh.mesh.shape) if hasattr(s.source, "device_mesh") else None,
                tuple(getattr(s.source, "placements", ())),
            )
            for s in shards
        )
        if self._writers_key != key:
            self._writers_table = writers(shards, self.dims, pp_rank=self.coords.pp)
            self._writers_key = key
        return self._writers_table

    def _stage_and_write(self, mine, step, rng, state, parent, staged: threading.Event, ready) -> None:
        """On the writer thread: what it raises (nothing was written) is raised by the next wait()."""
        try:
            pending = self.writer.snapshot(mine, copy=True, ready=ready)
        finally:
            staged.set()
        self._background(step, pending, rng, state, parent)

    def wait_staged(self) -> None:
        """Block until a deferred save's copy of the tensors is taken (at once when none is pending): after
        this the caller may change them. Does not wait for the write; raises if the writer thread died."""
        if self._staged is not None:
            while not self._staged.wait(self._bg.POLL_S):
                self._bg.raise_if_dead()
            self._staged = None

    def _background(self, *args) -> None:
        """On the writer thread: what it raises is raised by the next wait()."""
        t0 = time.perf_counter()
        result = self._write(*args)
        if self.last_stats is not None:
            self.last_stats = SaveStats(
                result.step,
                self.last_stats.blocking_s,
                result.new_bytes,
                result.referenced_bytes,
                time.perf_counter() - t0,
            )

    def _write(self, step, pending, rng, trainer_state, parent, *, problem: str | None = None, created=None):
        rows, result, error = [], None, problem
        faults.slow_write(step, node_local=self.node_local is not None)  # tests only: a save in flight longer
        try:
            if problem is None:
                rows, result = self.writer.write(step, pending)
        except Exception as e:
            error = f"rank {self.rank}: {type(e).__name__}: {e}"
        parts = [None] * dist.get_world_size() if self.rank == 0 else None
        pool = self.staging
        staged = (pool.nbytes, pool.pinned_bytes, pool.pin_problem)
        dist.gather_object(
            {"rank": self.rank, "rows": rows, "rng": rng, "error": error, "staged": staged},
            parts,
            dst=0,
            group=self.group,
        )
        if self.rank == 0 and not pool.reported and any(p["staged"][0] for p in parts):
            pool.reported = True  # once per rank 0's pool: both tiers' managers share it
            self.log(_staging_line([p["staged"] for p in parts]))
        return self._commit(step, parts, parent, trainer_state, result, created)

    def busy(self) -> bool:
        """Whether an asynchronous save or drain is still running (wait() would block); never blocks."""
        return self._pending and self._bg.busy

    def wait(self) -> None:
        """Block until the save in flight is committed; raise its error if it failed, or that the writer thread
        died."""
        if self._pending:
            try:
                self._bg.join()
            except RuntimeFailure:  # the thread died: nothing is in flight any more
                self._pending = False
                raise
            self._pending = False  # after the join: an interrupted join (Ctrl-C) leaves the save still in flight
        self._staged = None
        error = self._bg.take_error()
        if error is not None:
            raise error

    def close(self) -> None:
        """Wait for the save in flight (raising its error, as wait() does), then end the writer thread: idle, it
        would live until the process exits. Idempotent; a manager that never saved asynchronously has no thread.
        Synchronous saves still work afterwards; an asynchronous one raises."""
        try:
            self.wait()
        finally:
            self._bg.close()

    def newest_committed(self) -> int | None:
        """The newest committed step in `root` (rank 0 lists it, every rank gets it), None when there is none."""
        return next(iter(self._listed_steps()), None)

    def _listed_steps(self) -> list[int]:
        """committed_steps(root), newest first, as rank 0 lists them, on every rank ([] when it cannot)."""
        listing: list = [None]
        if self.rank == 0:
            try:
                listing = [committed_steps(self.root)]
            except Exception as e:  # rank 0 raising alone would leave the others in the broadcast
                self.log(f"hpcscale: cannot list checkpoints in {self.root}: {type(e).__name__}: {e}")
                listing = [[]]
        dist.broadcast_object_list(listing, src=0, group=self.group)
        return listing[0]

    def _set_aside(self, steps: list[int], *, what: str = "refused checkpoint") -> None:
        """Move refused checkpoints to ROOT/refused/ (rank 0; every rank waits), when a save reaches their step
        (and, as `what` says, steps of this tier that were not verified when the run restarted from the other).

        Training went on from an older step, so they belong to an abandoned timeline, and left in place this
        save would find its step already committed (the fallback would dead-end there on every restart). They
        are moved, never deleted: the operator may want to look at what went wrong. Loading never moves them."""
        if not steps:
            return
        if self.rank == 0:
            stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
            aside = self.root / REFUSED
            try:
                aside.mkdir(mode=0o755, exist_ok=True)  # inside the private root (_take_root)
                for step in steps:
                    name = step_dir_name(step)
                    (self.root / name).rename(aside / f"{name}-{stamp}")
                    self.log(f"hpcscale: moved {what} {name} to {aside}/{name}-{stamp}")
            except OSError as e:  # rank 0 raising alone would leave the others at the barrier
                self.log(f"hpcscale: could not move refused checkpoints aside: {e}")
        dist.barrier(group=self.group)


class _Background:
    """One long-lived daemon thread that runs the async saves, one at a time. Starting a thread per save costs
    the training loop milliseconds (the new thread takes the GIL before start() returns); handing a job to a
    waiting thread does not.

    The thread's nice value is raised by `nice` (checkpoint.background_nice, default 0: the loop's own
    priority). At 19 a rank's
    main thread gets a core the moment it wakes instead of queueing behind 8 ranks' copying and hashing; the
    save's CPU work is the same, but on a CPU-bound node it runs only in the loop's waits and finishes later
    (docs/checkpoint-format.md, scripts/bench/ckpt.py 3b measures both). The jobs the loop waits for run at
    that priority too: a deferred save's copy (wait_staged) and a save not finished when the next one is due.

    Whatever a job raises is kept for take_error() (the manager's wait() raises it in the training thread), so
    the thread outlives a failed save. Should it die anyway, submit() and join() say so instead of waiting for a
    thread that will never answer: the caller waits with the hang watchdog paused."""

    POLL_S = 1.0  # how soon join() notices a thread that died with a job: a dead thread notifies no one

    def __init__(self, name: str, nice: int, *, device: torch.device | None = None):
        self.name, self.nice = name, nice
        self.device = device if device is not None else torch.device("cpu")  # the rank's: made current on the thread
        self._cv = threading.Condition()
        self._job: tuple | None = None
        self._busy = False
        self._closed = False
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None  # what escaped the last job
        self._died_of: BaseException | None = None

    def submit(self, fn: Callable, *args) -> None:
        with self._cv:
            if self._closed:
                raise RuntimeFailure("checkpoint manager is closed: it runs no more asynchronous saves")
            self._raise_if_dead()
            assert not self._busy, "a save is already in flight"
            self._job, self._busy = (fn, args), True
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
            self._cv.notify_all()

    def join(self) -> None:
        """Wait until the job handed over is done; raise if the thread died first."""
        with self._cv:
            while not self._cv.wait_for(lambda: not self._busy, timeout=self.POLL_S):
                self._raise_if_dead()

    @property
    def busy(self) -> bool:
        with self._cv:
            return self._busy

    def alive(self) -> bool:
        """False once the thread has died: a job handed to it will never run (or never finish)."""
        thread = self._thread
        return thread is None or thread.is_alive()

    def take_error(self) -> BaseException | None:
        with self._cv:
            error, self._error = self._error, None
            return error

    def raise_if_dead(self) -> None:
        with self._cv:
            self._raise_if_dead()

    def close(self) -> None:
        """Let the thread finish the job in flight, end it and join it. Idempotent; nothing to do before the
        first save started it."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join()

    def _raise_if_dead(self) -> None:
        if self._thread is not None and not self._thread.is_alive() and not self._closed:
            cause = f" of {type(self._died_of).__name__}: {self._died_of}" if self._died_of is not None else ""
            raise RuntimeFailure(
                f"the checkpoint writer thread {self.name} died{cause}; the save in flight, if any, was not "
                "committed and this rank cannot save asynchronously any more"
            ) from self._died_of

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # outside a job (an asynchronous exception): submit() and join() report it
            self._died_of = e
            raise

    def _loop(self) -> None:
        if self.device.type == "cuda":  # a new thread's current device is GPU 0: make it the rank's
            torch.cuda.set_device(self.device)
        if self.nice:  # this thread only (Linux: a thread's id is a process id to setpriority)
            # Added to the nice value the thread was born with (the rank's: under `nice 5`, 5 + nice), never
            # raising its priority. Not Linux, or refused: the save still runs, at the loop's priority.
            with contextlib.suppress(OSError, AttributeError):
                me = threading.get_native_id()
                os.setpriority(os.PRIO_PROCESS, me, min(19, os.getpriority(os.PRIO_PROCESS, me) + self.nice))
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._job is not None or self._closed)
                if self._job is None:
                    return
                (fn, args), self._job = self._job, None
            try:
                fn(*args)
            except BaseException as e:  # KeyboardInterrupt, SystemExit too: the thread must live on
                with self._cv:
                    self._error = _kept(e)  # the job's frames are done: they can let go of its arguments
            finally:
                # Dropped before waiting for the next job, which may come much later or never: the arguments
                # reach the tensors saved (the live model's, on the accelerator too) and the trainer state.
                fn = args = None
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()


def _staging_line(staged: list[tuple[int, int, str | None]]) -> str:
    """What rank 0 says at the first save that staged: each rank's (host bytes, page-locked bytes, why a GPU
    arena is not page-locked) of its staging buffers (writer.StagingPool)."""
    mib = 1 << 20
    pinned = [p for _, p, _ in staged]
    held = [n for n, _, _ in staged]
    if len(staged) <= 8:
        each = ", ".join(f"rank {r} {p / mib:.1f} MiB" for r, p in enumerate(pinned))
    else:
        top = max(range(len(pinned)), key=pinned.__getitem__)
        each = f"at most {pinned[top] / mib:.1f} MiB (rank {top}), {sum(pinned) / mib:.1f} MiB over {len(staged)} ranks"
    line = (
        f"hpcscale: staging for checkpoints: pinned host memory per rank: {each}; staging buffers "
        f"{min(held) / mib:.1f} to {max(held) / mib:.1f} MiB per rank"
    )
    problems = [(r, why) for r, (_, _, why) in enumerate(staged) if why]
    if problems:
        line += f"; rank {problems[0][0]}'s are not pinned (device-to-host copies synchronous): {problems[0][1]}"
    return line


def state_problem(state: dict, check: Callable[[dict], str | None] | None) -> str | None:
    """What the caller's check says of a trainer state; an exception it raises counts as a problem."""
    if check is None:
        return None
    try:
        problem = check(state)
    except Exception as e:
        return f"trainer state: unexpected {type(e).__name__} while checking it: {e}"
    return None if problem is None else f"trainer state: {problem}"


def _kept(error: BaseException) -> BaseException:
    """A background save's error, kept until the training thread's next wait(): its traceback still reads as
    before, but its frames let go of their local variables (the tensors saved, the trainer state)."""
    traceback.clear_frames(error.__traceback__)
    return error
