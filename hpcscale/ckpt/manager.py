"""The checkpoint tiers used by the trainer and, through the Context, by users' code: one class per tier behind
one interface (Tier: save, wait, busy, close, pin, unpin, last_step, last_stats):

- CheckpointManager, the shared tier (RUN/checkpoints on the parallel filesystem): load_latest, and drain, which
  takes a step of the node-local tier into this one (the operation between the tiers);
- NodeLocalManager, each node's own storage with partner copies (hpcscale.ckpt.nodelocal): load_node_local,
  discard_after.

    manager = CheckpointManager(run_dir / "checkpoints", ...)     # a collective: every rank constructs it
    restored = manager.load_latest(tensors)                        # newest complete, verified checkpoint
    manager.save(step, tensors, trainer_state, asynchronous=True)  # blocks only for the snapshot
    manager.wait()                                                 # a background failure is raised here
    manager.close()                                                # at the end: wait(), then end the thread

At most one save is in flight: save() first waits for the previous one, and raises its error if it failed.
"""

from __future__ import annotations

import contextlib
import os
import shutil
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
from hpcscale.ckpt.format import DIGEST, INDEX, REFUSED, committed_steps, read_index, step_dir_name
from hpcscale.ckpt.nodelocal import (
    NodeLocal,
    complete_steps,
    drain_source,
    holdings,
    needed_files,
    remember_digest,
    transfer,
    verify_held,
    write_node_local_record,
)
from hpcscale.ckpt.reader import load_shards
from hpcscale.ckpt.retention import apply_retention
from hpcscale.ckpt.rng import rng_problem, rng_state
from hpcscale.ckpt.shards import local_shards, writers
from hpcscale.ckpt.shards import mine as pieces_to_write
from hpcscale.ckpt.writer import ShardWriter, StagingPool, commit, install, prepare_index
from hpcscale.errors import BadInput, RuntimeFailure, VerificationFailure
from hpcscale.layout import ParallelDims
from hpcscale.portable.files import atomic_write
from hpcscale.util.trust import check_private_dir, private_dir

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


class CheckpointManager(Tier):
    """The shared tier: a run's checkpoints on the parallel filesystem (RUN/checkpoints, or its directory under the
    site's checkpoint_root), one index per step written by rank 0, saves deduplicated against the newest step
    (only new chunks written); loads the newest step every rank can verify (load_latest) and takes the node-local
    tier's steps by drain."""

    def _take_root(self, owner: str | None) -> str | None:
        """The keeper, before anything under `root` is read, written or removed: make `root` a directory only
        this user can write, or accept the one there only if it is one (hpcscale.util.trust.private_dir: someone
        who made it first could have planted a step in it), then claim it for run `owner`. Returns why this
        run must not use it (None: it may)."""
        from hpcscale.rundir import claim_checkpoints

        root = self.root
        what = self.WHAT
        try:
            if root.is_symlink():  # to the run's directory under checkpoint_root
                check_private_dir(root, what=what)
            else:  # 0755: the shared tier's readers may be colleagues
                private_dir(root, what=what, mode=0o755)
            if owner is not None:
                return claim_checkpoints(root, owner)
        except BadInput as e:
            return str(e)
        except Exception as e:
            return f"{root}: cannot make it this run's {what}: {type(e).__name__}: {e}"
        return None

    def _adopt_newest(self) -> None:
        """Dedup new saves against the newest committed checkpoint already on disk (a fresh process). Its index is
        checked, its chunks are not: a restart replaces this with the step it verified (load_latest) or with
        nothing (restored_elsewhere). A damaged index is skipped: its chunks are simply written again."""
        try:
            steps = committed_steps(self.root)
            if not steps:
                return
            index = read_index(self.root / step_dir_name(steps[0]) / INDEX)
        except Exception as e:  # any failure of an index skips it; a rank never raises while being built
            problem = str(e) if isinstance(e, VerificationFailure) else f"unexpected {type(e).__name__}: {e}"
            if self.rank == 0:
                self.log(f"hpcscale: not deduplicating against the newest checkpoint: {problem}")
            return
        self.writer.adopt(index)
        self.last_step = steps[0]

    def restored_elsewhere(self, step: int) -> None:
        """The run restarted from step `step` of the other tier (the node-local one) and verified nothing here.
        This tier's newest listed step, which the manager deduplicates against since it was made, may be damaged
        (a chunk that no longer hashes to its hash, a data file gone): a save referencing its chunks would be
        damaged too, and one of its step would be taken as done. From now on saves deduplicate against nothing
        older than the first one committed (that first save or drain writes every chunk), and a save or drain
        that reaches a listed step moves it to `refused/` first, as a refused one is. `step` is the parent the
        next save records. A collective: rank 0 lists the steps."""
        self._unverified = set(self._listed_steps())
        self.writer.forget()
        self.last_step = None
        self.last_stats = None
        self._restored_from = step

    def drain(self, source: Path, step: int) -> SaveStats:
        """Save step `step` of the node-local tier rooted at `source` (this node's directory) to this tier, in the
        background, as an asynchronous save does: each rank reads the shards it wrote there from its own data file
        (every chunk verified against its hash), and the write deduplicates against this tier (only chunks it
        lacks are written) and commits with this tier's protocol; the trainer state and RNG states are the ones
        saved with that step. Nothing is copied from the live tensors, so the caller is not blocked at all. A
        source that cannot be read fails the drain on every rank alike, raised by the next wait()."""
        done = self._begin(step)
        if done is not None:
            return done
        parent = self._parent(step)
        self._bg.submit(self._drain, Path(source), step, parent)
        self._pending = True
        self.last_stats = SaveStats(step, 0.0, 0, 0)
        return self.last_stats

    def _drain(self, source: Path, step: int, parent: str | None) -> None:
        """On the writer thread: read this rank's part of node-local step `step`, then write and commit it with
        that step's trainer state (lineage included) and time, so its root digest is the node-local step's."""
        t0 = time.perf_counter()
        pending, rng, state, created, problem = [], {}, {}, None, None
        try:
            # the writer's drain buffers, never page-locked (nor the staging pool's: a node-local save may be in
            # flight meanwhile, staging there)
            pending, rng, state, created = drain_source(source, step, self.rank, staging=self.writer.staging)
        except Exception as e:
            problem = f"rank {self.rank}: node-local {step_dir_name(step)}: {type(e).__name__}: {e}"
        faults.fault("drain_read", self.rank)
        result = self._write(step, pending, rng, state, parent, problem=problem, created=created)
        if self.last_stats is not None:
            self.last_stats = SaveStats(step, 0.0, result.new_bytes, result.referenced_bytes, time.perf_counter() - t0)

    def _commit(self, step, parts, parent, trainer_state, result, created):
        """Every rank, after the gather: rank 0 commits the step in the shared root (its index, written once) and
        applies retention; every rank learns the outcome."""
        outcome: list = [None]
        if self.rank == 0:
            errors = [p["error"] for p in parts if p["error"]]
            if errors:
                outcome = [("failed", "; ".join(errors))]
            else:
                try:
                    removed = commit(
                        self.root,
                        step,
                        parts,
                        layout=self.dims.as_dict(),
                        parent=parent,
                        trainer_state=trainer_state,
                        keep_last=self.keep_last,
                        keep_every=self.keep_every,
                        keep=frozenset(self.pinned),
                        created=created,
                    )
                    outcome = [("ok", removed)]
                except Exception as e:
                    outcome = [("failed", f"rank 0 commit: {type(e).__name__}: {e}")]
        dist.broadcast_object_list(outcome, src=0, group=self.group)
        status, detail = outcome[0]
        if status != "ok":
            self.writer.failed()
            raise RuntimeFailure(f"checkpoint of step {step} failed: {detail}")
        self.writer.committed(detail)
        self.last_step = step
        return result

    # ---- loading --------------------------------------------------------------------------------------------
    def load_latest(
        self,
        tensors: dict[str, torch.Tensor],
        *,
        check_state: Callable[[dict], str | None] | None = None,
        check_rng: bool = True,
    ) -> Restored | None:
        """Load the newest checkpoint every rank can read and verify; fall back past damaged ones, saying so.

        `check_state(trainer_state)` returns what is wrong with a checkpoint's trainer state for the caller
        (None when it is usable): a problem, or an exception it raises, refuses that checkpoint on every rank
        together, like a hash mismatch. The RNG states restored (same layout) are checked against what this
        process's torch accepts, likewise (unless `check_rng` is False: a caller that does not take them).

        Chunks are read straight into `tensors` and hashed there, so a checkpoint refused during its reads
        leaves them partly overwritten. The next checkpoint that loads overwrites every element; when none is
        left, `tensors_dirty` says so (on every rank alike) and the caller must not train from them as a fresh
        start: the built-in trainer builds its model again, `ctx.checkpoint.restore` refuses to go on."""
        self.tensors_dirty = False
        dirty = False
        steps = self._listed_steps()
        targets = local_shards(tensors)
        same_layout = False
        refused: list[int] = []
        for step in steps:
            path = self.root / step_dir_name(step) / INDEX
            problem, index, wrote = None, None, False
            try:
                index = read_index(path)  # root digest, DIGEST and structure: nothing below follows a bad index
                same_layout = index.layout == self.dims.as_dict()
                problem = _state_problem(index.trainer_state, check_state) or (
                    rng_problem(index.rng.get(self.rank), self.device) if same_layout and check_rng else None
                )
                if problem is not None:
                    problem = f"{path.parent}: {problem}"
                else:
                    wrote = True
                    load_shards(index, self.root, targets)
            except VerificationFailure as e:
                problem = str(e)
            except Exception as e:
                # Whatever else a checkpoint makes a rank raise (an OSError from a failing disk, a bug that a
                # crafted index reaches), the rank must still answer the all_gather below: one rank raising
                # alone would leave the others waiting on it forever. The type is kept in the message.
                problem = f"{path.parent}: unexpected {type(e).__name__}: {e}"
            problems = [None] * dist.get_world_size()
            dist.all_gather_object(problems, (problem, wrote), group=self.group)
            bad = [p for p, _ in problems if p]
            if bad:
                dirty = dirty or any(w for _, w in problems)
                if self.rank == 0:
                    self.log(
                        f"hpcscale: refusing checkpoint {step_dir_name(step)}: {bad[0]}; "
                        "falling back to the previous one"
                    )
                refused.append(step)
                continue
            self._refused = set(refused)
            # dedup against this checkpoint only: a refused newer one is moved aside when a save reaches its
            # step, and a chunk referenced there would leave the new checkpoint pointing at a missing file
            self.writer.known.clear()
            self.writer.adopt(index)
            self.last_step = step
            self._unverified, self._restored_from = set(), None
            return Restored(step, index.trainer_state, index.rng.get(self.rank) if same_layout else None)
        self._refused = set(refused)
        self.tensors_dirty = dirty
        if refused:  # a fresh start: the next save's parent is none of the refused ones, nor are their chunks
            self.writer.known.clear()
            self.last_step = None
        if dirty and self.rank == 0:
            self.log(
                "hpcscale: no checkpoint left to load, and a refused one had already been partly read into the "
                "model and optimizer state"
            )
        return None


class NodeLocalManager(Tier):
    """The node-local tier (hpcscale.ckpt.nodelocal): `root` is a directory on each node's own storage. Every node
    writes its ranks' data and its own copy of the index, partner nodes keep copies of the data, each save stands
    alone (no chunk of an earlier step is referenced), and load_node_local gathers a step from what the surviving
    nodes hold. The node's lowest rank does there what rank 0 does in a shared root."""

    WHAT = "node-local checkpoint directory"

    def __init__(self, root: Path, *, node_local: NodeLocal, **kwargs):
        self.node_local = node_local
        # where rank 0 records which nodes hold the newest step (read by `hpcscale resume`)
        self.record: Path | None = None
        self.committed: set[int] = set()  # the steps this process's saves committed on every node
        self.moved = (0, 0)  # data files, bytes sent between nodes by the last load_node_local that succeeded
        super().__init__(root, **kwargs)

    def _keeper_rank(self) -> int:
        nl = self.node_local
        return nl.leader(nl.node_of[self.rank])

    def _take_root(self, owner: str | None) -> str | None:
        """The node's keeper: its directory made 0700 (a node's own disk: no one else needs it), or accepted only
        if it is private already (hpcscale.util.trust.private_dir); node-local directories are named by the run's
        id, so there is nothing to claim."""
        where = f"node {self.node_local.node_of[self.rank]}: "
        try:
            private_dir(self.root, what=self.WHAT, mode=0o700)
        except BadInput as e:
            return f"{where}{e}"
        except Exception as e:
            return f"{where}{self.root}: cannot make it this run's {self.WHAT}: {type(e).__name__}: {e}"
        return None

    def _fresh_save(self) -> None:
        self.writer.forget()  # every node-local step stands alone

    def _commit(self, step, parts, parent, trainer_state, result, created):
        """Every rank, after the gather: rank 0 writes the index, every node's lowest rank installs the same
        bytes in its own root and commits there, then each rank's data file is copied to its node's partners.
        The save fails (on every rank alike) unless every node committed; a partner copy that fails is said,
        not fatal: the step is then only as safe as the nodes that hold it."""
        nl = self.node_local
        name = step_dir_name(step)
        payload: list = [None]
        if self.rank == 0:
            errors = [p["error"] for p in parts if p["error"]]
            if errors:
                payload = [("failed", "; ".join(errors))]
            else:
                try:
                    index = prepare_index(
                        self.root, step, parts, layout=self.dims.as_dict(), parent=parent, trainer_state=trainer_state
                    )
                    tmp = self.root / f".tmp-{name}"
                    blobs = {f: (tmp / f).read_bytes() for f in (INDEX, DIGEST)}
                    payload = [("ok", (blobs, sorted(index.files()), index.digest))]
                except Exception as e:
                    payload = [("failed", f"rank 0 index: {type(e).__name__}: {e}")]
        dist.broadcast_object_list(payload, src=0, group=self.group)
        status, detail = payload[0]
        problem = None
        if status == "ok" and self._keeper:
            try:
                tmp = self.root / f".tmp-{name}"
                if self.rank != 0:
                    tmp.mkdir(mode=0o755, exist_ok=True)  # inside the node's private root (_take_root)
                    for f, blob in detail[0].items():
                        atomic_write(tmp / f, blob)
                keep = frozenset(self.pinned)
                # a step of an abandoned timeline (saved, then the job restarted from an older one): node-local
                # steps stand alone, so nothing else refers to it
                shutil.rmtree(self.root / name, ignore_errors=True)
                # keep_last steps besides this one until its partner copies are made (below): until then a lost
                # node takes its part of this step along, and the steps before it are what recovery has
                install(self.root, step, keep_last=self.keep_last + 1, keep_every=self.keep_every, keep=keep)
            except Exception as e:
                problem = f"node {nl.node_of[self.rank]}: {type(e).__name__}: {e}"
        problems = [None] * dist.get_world_size()
        dist.all_gather_object(problems, problem, group=self.group)
        if status != "ok" or any(problems):
            self.writer.failed()
            why = detail if status != "ok" else next(p for p in problems if p)
            raise RuntimeFailure(f"node-local checkpoint of step {step} failed: {why}")
        files = set(detail[1])
        writer_of = {f: r for r in range(len(nl.node_of)) if (f := f"{name}/data/rank-{r:05d}.bin") in files}
        copies = [(r, nl.leader(p), f) for f, r in writer_of.items() for p in nl.partners[nl.node_of[r]]]
        faults.fault("partner_copy", self.rank)  # tests only: a node lost between its step and its partner copies
        mine = transfer(copies, rank=self.rank, root=self.root, group=self.group)
        failed = [None] * dist.get_world_size()
        dist.all_gather_object(failed, mine, group=self.group)
        if self.rank == 0 and any(failed):
            lost = "; ".join(p for ps in failed for p in ps)
            self.log(f"hpcscale: warning: node-local {name}: partner copies failed: {lost}")
        if self._keeper:  # the copies made: now the retention keep_last says
            try:
                apply_retention(
                    self.root, keep_last=self.keep_last, keep_every=self.keep_every, keep=frozenset(self.pinned)
                )
            except OSError as e:
                self.log(f"hpcscale: warning: node {nl.node_of[self.rank]}: node-local retention: {e}")
        if self.rank == 0 and self.record is not None:
            holders = {f: [nl.node_of[r]] for f, r in writer_of.items()}
            for src, dst, f in copies:  # a copy counts once neither side said it failed
                if not any(f in p for p in failed[src] + failed[dst]):
                    holders[f].append(nl.node_of[dst])
            try:
                write_node_local_record(self.record, step=step, nodes=nl.nodes, holders=holders)
            except OSError as e:
                self.log(f"hpcscale: warning: cannot record the node-local tier in {self.record}: {e}")
        self.writer.committed([])
        self.last_step = step
        remember_digest(self.root, step, detail[2])  # what a drain of this step must find (drain_source)
        self.committed.add(step)
        if len(self.committed) > 4096:  # bounded: a drain never waits for thousands of node-local saves
            self.committed.discard(min(self.committed))
        return result

    def discard_after(self, step: int | None) -> None:
        """Node-local tier: remove this node's steps newer than `step` (the one the run restarted from; None:
        from scratch). They belong to a timeline the run abandoned, and recovery must never prefer them."""
        if not self._keeper:
            return
        for s in committed_steps(self.root):
            if step is None or s > step:
                (self.root / step_dir_name(s) / INDEX).unlink(missing_ok=True)  # not a step any more, first
                shutil.rmtree(self.root / step_dir_name(s), ignore_errors=True)

    def load_node_local(
        self,
        tensors: dict[str, torch.Tensor],
        *,
        at_least: int | None,
        below: int | None = None,
        check_state: Callable[[dict], str | None] | None = None,
    ) -> Restored | None:
        """Node-local tier: load the newest step, no older than `at_least` and older than `below` (the steps from
        `below` on were tried already: each is hashed and refused once), that the nodes of this job hold whole
        between them, reading nothing from any shared filesystem. Each node's lowest rank verifies what its node
        holds (every chunk hashed: a corrupt copy does not count); a node that lacks the index, or a data file
        one of its ranks needs, gets it from a node that holds it, over the checkpoint group; then every rank
        loads from its own node as load_latest does (any layout). A step some rank cannot load is refused on
        every rank and the next older one tried. None when none is left (`tensors_dirty` as in load_latest)."""
        nl = self.node_local
        self.tensors_dirty = False
        # what each node holds (indexes read and checked, data files present); the chunks are hashed only for the
        # step tried, below: an older step is read only when a newer one fails
        held = holdings(self.root, verify=False, log=self.log, below=below) if self._keeper else None
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, held, group=self.group)
        per_node = {nl.node_of[r]: h for r, h in enumerate(everyone) if h is not None}
        targets = local_shards(tensors)
        dirty = False
        self.moved = (0, 0)  # data files, bytes sent between nodes by the load that succeeded
        for step in complete_steps(per_node):
            if at_least is not None and step < at_least:
                break
            name = step_dir_name(step)
            verified = verify_held(self.root, step, held.get(step)) if self._keeper else None
            dist.all_gather_object(everyone, verified, group=self.group)
            for r, v in enumerate(everyone):
                if v is None:
                    continue
                entry, refused = v  # a keeper's word on its node: what verifies, or nothing
                if entry is None:
                    per_node[nl.node_of[r]].pop(step, None)
                else:
                    per_node[nl.node_of[r]][step] = entry
                for why in refused if self.rank == 0 else ():
                    self.log(f"hpcscale: {nl.node_of[r]}: {why}")
            if step not in complete_steps({nd: {step: h[step]} for nd, h in per_node.items() if step in h}):
                if self.rank == 0:
                    self.log(f"hpcscale: node-local {name}: the copies that verify do not make it whole")
                continue
            have = {nd: set(h[step][1]) if step in h else None for nd, h in per_node.items()}
            source = {}  # file -> the first node (in node order) that holds a verified copy
            for nd in nl.nodes:
                for f in have.get(nd) or ():
                    source.setdefault(f, nd)
            with_index = next(nd for nd in nl.nodes if have.get(nd) is not None)
            moves = [
                (nl.leader(with_index), nl.leader(nd), f"{name}/{f}")
                for nd in nl.nodes
                if have.get(nd) is None
                for f in (DIGEST, INDEX)  # the index last: a directory with it is a committed step
            ]
            problem, wrote, needed = None, False, set()
            problems = transfer(moves, rank=self.rank, root=self.root, group=self.group)
            dist.barrier(group=self.group)  # the node's index in place before its other ranks read it
            try:
                if not problems:
                    index = read_index(self.root / name / INDEX)
                    needed = needed_files(index, targets)
            except Exception as e:
                problems.append(f"{self.root / name}: {type(e).__name__}: {e}")
            wants: list = [None] * dist.get_world_size()
            dist.all_gather_object(wants, (problems, sorted(needed)), group=self.group)
            bad = [p for ps, _ in wants for p in ps]
            if not bad:
                missing = sorted(
                    {(nl.node_of[r], f) for r, (_, fs) in enumerate(wants) for f in fs}
                    - {(nd, f) for nd, fs in have.items() for f in fs or ()}
                )
                moves = [(nl.leader(source[f]), nl.leader(nd), f) for nd, f in missing]
                received: list[int] = []
                moved = transfer(moves, rank=self.rank, root=self.root, group=self.group, received=received)
                problem = "; ".join(moved) or None
                same_layout = False
                dist.barrier(group=self.group)  # every file in place on every node before any rank reads
                try:
                    if problem is None:
                        same_layout = index.layout == self.dims.as_dict()
                        problem = _state_problem(index.trainer_state, check_state) or (
                            rng_problem(index.rng.get(self.rank), self.device) if same_layout else None
                        )
                    if problem is None:
                        wrote = True
                        load_shards(index, self.root, targets)
                except VerificationFailure as e:
                    problem = str(e)
                except Exception as e:
                    problem = f"{self.root / name}: unexpected {type(e).__name__}: {e}"
                outcome: list = [None] * dist.get_world_size()
                dist.all_gather_object(outcome, (problem, wrote, sum(received)), group=self.group)
                bad = [p for p, _, _ in outcome if p]
                dirty = dirty or any(w for _, w, _ in outcome)
                self.moved = (len(moves), sum(n for _, _, n in outcome))
            if bad:
                if self.rank == 0:
                    self.log(f"hpcscale: refusing node-local {name}: {bad[0]}; trying an older one")
                continue
            self.last_step = step
            remember_digest(self.root, step, index.digest)  # loaded and verified: a drain may take it
            return Restored(step, index.trainer_state, index.rng.get(self.rank) if same_layout else None)
        self.tensors_dirty = dirty
        return None


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


def _state_problem(state: dict, check: Callable[[dict], str | None] | None) -> str | None:
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
