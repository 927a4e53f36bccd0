"""The shared checkpoint tier, used by the trainer and, through the Context, by users' code: a run's checkpoints on
the parallel filesystem (hpcscale.ckpt.tier holds what both tiers share; the node-local tier is
hpcscale.ckpt.local_tier).

    manager = CheckpointManager(run_dir / "checkpoints", ...)     # a collective: every rank constructs it
    restored = manager.load_latest(tensors)                        # newest complete, verified checkpoint
    manager.save(step, tensors, trainer_state, asynchronous=True)  # blocks only for the snapshot
    manager.wait()                                                 # a background failure is raised here
    manager.close()                                                # at the end: wait(), then end the thread

At most one save is in flight: save() first waits for the previous one, and raises its error if it failed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from hpcscale.ckpt import faults
from hpcscale.ckpt.format import INDEX, committed_steps, read_index, step_dir_name
from hpcscale.ckpt.nodelocal import (
    drain_source,
)
from hpcscale.ckpt.reader import load_shards
from hpcscale.ckpt.rng import rng_problem
from hpcscale.ckpt.shards import local_shards
from hpcscale.ckpt.tier import Restored, SaveStats, Tier, state_problem
from hpcscale.ckpt.writer import commit
from hpcscale.errors import BadInput, RuntimeFailure, VerificationFailure
from hpcscale.util.trust import check_private_dir, private_dir

__all__ = ["CheckpointManager", "Restored", "SaveStats", "Tier"]


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
                problem = state_problem(index.trainer_state, check_state) or (
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
