"""`ctx.checkpoint`: the job's checkpoint policy applied to a user's model, optimizer and any other state.

    start = ctx.checkpoint.restore(model, opt, scheduler=sched, data=sampler)   # newest verified checkpoint
    for step in range(start, steps):
        ...
        ctx.checkpoint.step(step)      # saves on the job's period, stops with a checkpoint on a stop signal

What it saves, by name (the reference trainer's names, so the tools read both alike):
- `model/<fqn>`: the model's state_dict (parameters and persistent buffers), plain tensors or DTensor shards;
- `optim/<fqn>/<key>`: the optimizer's tensor state, from torch.distributed.checkpoint.state_dict.get_state_dict
  (which names state by parameter, not by position, and creates an optimizer's lazy state so there is
  something to load into);
- in the checkpoint's JSON state: the optimizer's param_groups (lr, betas, ...) and non-tensor state, and each
  named object's `state_dict()` (a scheduler, a sampler, a plain dict): JSON, nothing pickled, rank 0's copy;
- each rank's torch RNG states (the checkpoint format keeps them per rank), restored when the layout is the same.

Loading fills the tensors through the checkpoint reader (any saved layout onto this one) and hands the result
to torch's set_state_dict, which puts the optimizer's hyperparameters and state back the way
`Optimizer.load_state_dict` does. A fresh start leaves the optimizer as it was: get_state_dict creates lazy
state with a zero-learning-rate step, and that state is dropped again so the first real step is the one AdamW
would take without hpcscale (its step count starts at 1, not 2).
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from hpcscale.ckpt import lineage, nodelocal
from hpcscale.ckpt.local_tier import NodeLocalManager
from hpcscale.ckpt.manager import CheckpointManager, Restored
from hpcscale.ckpt.nodelocal import RECORD
from hpcscale.ckpt.rng import restore_rng
from hpcscale.errors import BadInput, VerificationFailure
from hpcscale.launch.site_rounds import Rounds, load_start_from
from hpcscale.launch.steploop import StepLoop
from hpcscale.launch.tiersaves import TierSaves
from hpcscale.launch.watchdog import NoWatchdog
from hpcscale.parallel.fsdp import reshard
from hpcscale.parallel.ties import STAGE_TIES, find_ties
from hpcscale.rundir import CHECKPOINTS
from hpcscale.xsite.rounds import TAG

FORMAT = 1  # the JSON state's layout ("hpcscale.context" in it)


def _jsonable(value: Any, where: str) -> Any:
    """value as JSON types (tuples become lists); a clear error naming `where` for anything else."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            raise BadInput(f"checkpoint state {where} is {value}: JSON has no NaN or infinity")
        return value
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str | int):
                raise BadInput(f"checkpoint state {where} has a key of type {type(k).__name__}: JSON keys are strings")
            out[str(k)] = _jsonable(v, f"{where}.{k}")
        return out
    if isinstance(value, list | tuple):
        return [_jsonable(v, f"{where}[{i}]") for i, v in enumerate(value)]
    raise BadInput(
        f"checkpoint state {where} is a {type(value).__name__}: the JSON state holds numbers, strings, lists and "
        "dicts (tensors belong in the model or optimizer; see docs/context-api.md)"
    )


def _keys_int(state: Any) -> Any:
    """JSON turned an int-keyed dict's keys into strings; give ints back where every key is one (schedulers'
    and samplers' state_dicts often key by index)."""
    if isinstance(state, dict):
        fixed = {k: _keys_int(v) for k, v in state.items()}
        if fixed and all(isinstance(k, str) and k.lstrip("-").isdigit() for k in fixed):
            return {int(k): v for k, v in fixed.items()}
        return fixed
    if isinstance(state, list):
        return [_keys_int(v) for v in state]
    return state


def _is_legacy_trainer(state: dict) -> bool:
    """A checkpoint the built-in trainer wrote before it saved through ctx.checkpoint: {"step", "loader"} and
    no marker (nor optimizer hyperparameters: the trainer sets its own from the job)."""
    return "hpcscale.context" not in state and "objects" not in state and "loader" in state


def _upgraded(state: dict) -> dict:
    """`state` in ctx.checkpoint's format (the built-in trainer's older checkpoints: their loader becomes the
    object "loader")."""
    if not _is_legacy_trainer(state):
        return state
    out = {k: v for k, v in state.items() if k != "loader"}
    return {**out, "hpcscale.context": FORMAT, "objects": {"loader": state["loader"]}}


MAX_SKIPPED = 1000  # rollback records a checkpoint keeps (the newest)


def skipped_of(saved: dict) -> list[dict]:
    """The rollback records of a checkpoint's JSON state (`skipped`): a list of objects; anything else (an older
    checkpoint's none, a hand-edited value) reads as none."""
    value = saved.get("skipped")
    if not isinstance(value, list):
        return []
    return [r for r in value if isinstance(r, dict)][-MAX_SKIPPED:]


@dataclass(frozen=True, slots=True)
class TierChoice:
    """What a restart loaded (Checkpointer._load_newest): the step, from which tier and why."""

    restored: Restored | None  # None when no step of either tier loads on every rank
    tier: str  # "shared" or "node-local"
    why: str  # for the resume line: what was moved, what the other tier offered
    dirty: bool  # nothing loaded, and a refused step had already been partly read into the tensors


class Checkpointer:
    """The object behind `ctx.checkpoint` (docs/context-api.md). Every method is a collective: call it at the
    same point in every rank."""

    def __init__(self, ctx: Any):
        self._ctx = ctx
        self._policy = ctx.job.checkpoint
        self._manager = None
        self._local_manager = None  # the node-local tier's manager (checkpoint.local), built on first use
        self._lineage_value, self._lineage_collected = None, False
        self._model: torch.nn.Module | None = None
        self._optimizers: tuple[torch.optim.Optimizer, ...] = ()
        self._objects: dict[str, Any] = {}
        self._group_sizes: list[int] = []  # parameters per optimizer group, whole model (_register)
        self._renames: dict[str, str | None] = {}  # tied parameters' names in checkpoints (_tie_names)
        self._not_saved: set[str] = set()
        self._registered = False
        self._stepped = False  # step() ran in this attempt
        self._done: int | None = None  # steps finished at the last step() call
        self._restored_step: int | None = None
        self._rounds = None  # a site of a cross-site training (the job's `xsite:`): hpcscale.launch.site_rounds
        self.tokens_per_step = 0  # cross-site weighting by tokens: set it before restore(); 0 counts steps alike
        self.steps: int | None = None  # the training's length, when the code says (set before restore())
        self.defer_staging = False  # async saves copy to host memory until the optimizers' next step()
        self.rebuild = None  # () -> (model, optimizer): a fresh build, when every checkpoint was refused dirty
        self._tiers = TierSaves(self)  # both tiers' schedules, saves and the drain between them
        self._loop: StepLoop | None = None  # what step() runs, made at restore (it plans from the start step)
        self._skipped: list[dict] = []  # rollbacks' skipped batches on the way to this state (saved with it)

    # ---- the two calls --------------------------------------------------------------------------------------
    def restore(self, model: torch.nn.Module | None = None, optimizer: Any = None, **state: Any) -> int:
        """Register what a checkpoint holds and load the newest verified checkpoint into it, if there is one.
        Returns the step to start from (0 on a fresh start). `optimizer` is one optimizer or a list; every
        other keyword names an object with state_dict()/load_state_dict() or a plain dict (updated in place)."""
        self._register(model, optimizer, state)
        manager = self.manager
        tensors, model_sd, optim_sd = self._tensors()
        dist.barrier()  # restore_s is the load alone, not a peer's slower start-up
        t0 = time.perf_counter()
        choice = self._load_newest(tensors)
        restored, dirty = choice.restored, choice.dirty
        if self._local is not None:  # node-local steps newer than where the run restarts are of another timeline
            self._local.discard_after(restored.step if restored is not None else None)
        if dirty and self.rebuild is not None:  # every rank alike
            if any(m is self._model for m in self._ctx.models):  # the fresh build replaces it (ctx.forget)
                self._ctx.forget(self._model)
            self._model, optimizer = self.rebuild()
            self._optimizers = tuple(optimizer) if isinstance(optimizer, list | tuple) else (optimizer,)
            self._optimizers = tuple(o for o in self._optimizers if o is not None)
            self._hook_optimizers()
            tensors, model_sd, optim_sd = self._tensors()  # what xsite.start_from below loads into: the new ones
        elif dirty:  # every rank alike: load_latest (or load_node_local) agreed on it
            raise VerificationFailure(
                f"every checkpoint in {manager.root} was refused (the lines above say why), and one was refused "
                "only after part of it had been read into your model, so it cannot start from scratch either: "
                "your code built the model, hpcscale cannot build it again. Move the refused checkpoints out of "
                f"{manager.root} (`hpcscale ckpt verify` on each says what is wrong; keep them for inspection) and "
                "start again: with none left, the run starts from scratch"
            )
        pretrained = False  # xsite.start_from: a fresh site starts from that checkpoint (not its data or RNG)
        if restored is None and self._ctx.job.xsite is not None and self._ctx.job.xsite.start_from:
            restored = load_start_from(
                self._ctx, self._ctx.dims, tensors, check_state=self._state_problem, steps=self.steps
            )
            pretrained = True
        if restored is None:
            for opt in self._optimizers:  # drop the lazy state get_state_dict created: see the module docstring
                opt.state.clear()
            self._restored_step = None
            if self._start_rounds(None):  # the start checkpoint (the aggregator's is round 0), then adopt θ(0)
                self._round_boundary(0)
                for opt in self._optimizers:  # its save made the lazy state again: the first step stays AdamW's own
                    opt.state.clear()
            self._start_clock(0)
            return 0
        saved = _upgraded(restored.trainer_state)
        self._apply_saved(saved, restored.step, model_sd, optim_sd, pretrained=pretrained)
        self._skipped = [] if pretrained else skipped_of(saved)
        if pretrained:  # rounds start here: the start checkpoint (the aggregator's is round 0), then adopt θ(0)
            self._restored_step = self._done = restored.step
            self._start_rounds(None)
            self._rounds.begin_at(restored.step)
            self._round_boundary(restored.step)
            self._start_clock(restored.step)
            return restored.step
        if restored.rng is not None:
            restore_rng(restored.rng, self._ctx.device)
        self._ctx.metrics.log(
            step=restored.step - 1, restored_from=restored.step, restore_s=round(time.perf_counter() - t0, 4)
        )
        where = f" of the {choice.tier} tier ({choice.why})" if self._local is not None else ""
        self._ctx.metrics.print(
            f"hpcscale: resumed from checkpoint step {restored.step}{where}"
            + ("" if restored.rng is not None else " (new layout: resharded)")
        )
        self._restored_step = restored.step
        self._done = restored.step
        if self._start_rounds(saved) and self._rounds.is_boundary(restored.step):
            with self._watchdog.paused("cross-site round"):  # resumed from a round checkpoint: the wait it was in
                self._rounds.wait_and_adopt(restored.step)
        elif self._rounds is not None:  # overlap, restarted mid-round: the boundary's weights from its checkpoint
            self._rounds.rebuild_snapshot(restored.step, self.manager.root)
        self._start_clock(restored.step)
        return restored.step

    def step(
        self,
        step: int,
        *,
        data_s: float = 0.0,
        sums: dict[str, Any] | None = None,
        report: Callable[[dict[str, float]], None] | None = None,
    ) -> int:
        """Step `step` (0-based) is finished: beat the hang watchdog, save on the job's period
        (checkpoint.every_steps, asynchronous as checkpoint.async says) and, when any rank got a stop signal,
        save now and stop every rank together (StopRequested: exit 75, requeued by the batch script).
        `data_s`: the seconds of the step spent waiting for data, when the code knows (per-rank timing).
        `sums`: one-element tensors (a loss, its contribution from this rank) summed over every rank in the stop
        flag's own all-reduce, and read back with it: the step's one host sync serves both. `report(values)` gets
        them as numbers, on every rank, before anything is saved or a stop raised (log the step there).
        The last step (`steps` set) saves nothing here: close() saves the end state after the code returns.
        Returns the step to run next: `step + 1`, or after a rollback (train.on_spike: rollback) the step of the
        checkpoint it loaded."""
        if not self._registered:
            raise BadInput("ctx.checkpoint.step() before ctx.checkpoint.restore(...): restore registers the state")
        return self._loop.step(step, data_s=data_s, sums=sums, report=report)

    def efficiency(self, step_s: float) -> dict[str, float]:
        """A step of `step_s` seconds as efficiency figures for a metrics line: `tflops` (model TFLOPS achieved
        per device) and `mfu` once the attempt's counted step is past, and this rank's memory peaks (`mem_gb`,
        `mem_reserved_gb`, `pinned_gb` on a GPU; `rss_gb`). A user loop's own lines have them already; this is
        for a line of your own (docs/observability.md#efficiency). Empty before restore()."""
        return self._loop.efficiency.figures(step_s) if self._loop is not None else {}

    # ---- the rest -------------------------------------------------------------------------------------------
    def save(self, done_steps: int, *, asynchronous: bool | None = None) -> float:
        """Save now, as the state after `done_steps` steps (asynchronous: the job's checkpoint.async); returns
        the seconds the caller was blocked (the wait for a save still writing included)."""
        if not self._registered:
            raise BadInput("ctx.checkpoint.save() before ctx.checkpoint.restore(...): restore registers the state")
        if asynchronous is None:
            asynchronous = self._ctx.job.checkpoint.asynchronous
        return self._tiers.save(done_steps, asynchronous=asynchronous)

    def _state_for_save(self, done_steps: int) -> tuple[dict, dict]:
        """(the tensors, the JSON state) a save of the state after `done_steps` steps writes."""
        tensors, _, optim_sd = self._tensors()
        if self._not_saved:  # a tied parameter's copy: the lowest stage holding one writes it
            tensors = {k: v for k, v in tensors.items() if k.split("/")[1] not in self._not_saved}
        state = {"step": done_steps, "hpcscale.context": FORMAT, "objects": self._object_states()}
        if self._skipped:  # the batches rollbacks skipped on the way to this state (train.on_spike: rollback)
            state["skipped"] = list(self._skipped)
        if self._rounds is not None:  # lineage: every checkpoint names the global round its weights started from
            state[TAG] = self._rounds.state_for_save(done_steps)
        if optim_sd is not None:
            state["optimizer"] = {
                "param_groups": _jsonable(optim_sd["param_groups"], "optimizer.param_groups"),
                "group_sizes": self._group_sizes,
                "state": {
                    fqn: _jsonable({k: v for k, v in s.items() if not torch.is_tensor(v)}, f"optimizer.state.{fqn}")
                    for fqn, s in optim_sd["state"].items()
                    if any(not torch.is_tensor(v) for v in s.values())
                },
            }
        return tensors, state

    def _roll_back(self, record: dict) -> tuple[int, dict, dict] | None:
        """Load the newest checkpoint again, as restore() did (train.on_spike: rollback, hpcscale.launch.steploop):
        the saves in flight are waited for first (a drain due stays due: its step is not newer than the one
        loaded); none is newer than the step being judged, since step() saves after the judgement. The objects
        that are a data position (a `skip(batches)` method: the built-in trainer's loader) keep the position they
        have now, just after the spike's batch: every batch read since the checkpoint is skipped, however many a
        step reads and however many rollbacks came before. `record` (the spike) goes, with the positions, into
        every later save's state. Returns (the step loaded, the positions at it, the positions kept), or None
        when no checkpoint loads (nothing was changed). VerificationFailure when every checkpoint was refused
        after part of one was read into the model."""
        keep = {name: copy.deepcopy(self._objects[name].state_dict()) for name in self._skippers()}
        records = list(self._skipped)  # the checkpoint's own records, and those of rollbacks since it
        with self._watchdog.paused("rollback"):
            self.manager.wait()
            if self._local_manager is not None:
                self._tiers.local_wait()
            tensors, model_sd, optim_sd = self._tensors()
            choice = self._load_newest(tensors)
        restored = choice.restored
        if restored is None:
            if choice.dirty:
                raise VerificationFailure(
                    "train.on_spike: rollback: every checkpoint was refused (the lines above say why), one after part "
                    "of it had been read into the model: training cannot go on from the state it held"
                )
            return None
        if self._local is not None:
            self._local.discard_after(restored.step)
        saved = _upgraded(restored.trainer_state)
        self._apply_saved(saved, restored.step, model_sd, optim_sd)
        at_checkpoint = self._positions()
        for name, state in keep.items():
            self._objects[name].load_state_dict(state)
        kept = self._positions()
        self._skipped = [*records, {**record, "to_step": restored.step, "from": at_checkpoint, "to": kept}]
        del self._skipped[:-MAX_SKIPPED]
        if restored.rng is not None:
            restore_rng(restored.rng, self._ctx.device)
        self._restored_step = self._done = restored.step
        return restored.step, at_checkpoint, kept

    def _positions(self) -> dict[str, Any]:
        """The data position now: the state of every registered object that can skip batches (the loader's)."""
        return {
            name: _jsonable(obj.state_dict(), name) for name, obj in self._objects.items() if name in self._skippers()
        }

    def _skippers(self) -> list[str]:
        """The registered objects that are a data position: those that can skip batches (a `skip(batches)`
        method, as the built-in trainer's loader has)."""
        return [name for name, obj in self._objects.items() if callable(getattr(obj, "skip", None))]

    def _apply_saved(self, saved: dict, step: int, model_sd, optim_sd, *, pretrained: bool = False) -> None:
        """A loaded checkpoint's JSON state `saved` (of step `step`) into the registered model, optimizers and
        objects (the tensors were read in place already); with `pretrained` (xsite.start_from) the objects keep
        their constructed state."""
        if self._model is not None:
            from torch.distributed.checkpoint.state_dict import set_state_dict

            # the built-in trainer's older checkpoints keep no hyperparameters: the optimizer keeps its own
            if optim_sd is not None and "optimizer" in saved:
                # the saved hyperparameters, this rank's own parameters: a pipeline stage, or another layout's,
                # holds other parameters than rank 0 did when it wrote the JSON state
                optim_sd["param_groups"] = [
                    {**s, "params": c["params"]}
                    for s, c in zip(
                        _keys_int(saved["optimizer"]["param_groups"]), optim_sd["param_groups"], strict=True
                    )
                ]
                for fqn, extra in saved["optimizer"].get("state", {}).items():
                    optim_sd["state"].setdefault(fqn, {}).update(extra)
            set_state_dict(
                self._model,
                list(self._optimizers),
                model_state_dict=model_sd,
                optim_state_dict=optim_sd if optim_sd is not None else {},
            )
        objects = saved.get("objects", {})
        if pretrained and self._objects:  # another run's data position (and the like) is not this site's
            self._ctx.metrics.print(
                f"hpcscale: xsite.start_from: {', '.join(sorted(self._objects))} start as constructed (only the "
                "model, the optimizer and the step are taken from another run's checkpoint)"
            )
        for name, obj in self._objects.items():
            if pretrained:
                continue
            if name not in objects:
                self._ctx.metrics.print(
                    f"hpcscale: checkpoint step {step} holds no state for {name!r} "
                    f"(it holds {sorted(objects) or 'none'}): {name} starts as constructed"
                )
                continue
            value = _keys_int(objects[name])
            try:
                if isinstance(obj, dict):
                    obj.clear()
                    obj.update(value)
                else:
                    obj.load_state_dict(value)
            except Exception as e:
                raise BadInput(
                    f"checkpoint step {step}: {name}.load_state_dict refused the saved state: {type(e).__name__}: {e}"
                ) from e

    def _load_newest(self, tensors: dict) -> TierChoice:
        """Load the newest step that every rank can load and verify, from either tier (the node-local one at an
        equal step: it reads nothing from the shared filesystem). A step counts only once it has loaded: the
        shared tier's newest listed step may be damaged, and then a node-local step older than it but newer
        than the shared step that does load is the one to take.

        1. Node-local steps at least as new as the shared tier's newest listed one: one that loads is at least as
           new as anything the shared tier could give, and nothing is read from the shared tier. Nothing of the
           shared tier was verified then, so its manager deduplicates against none of its steps and sets aside a
           listed step a save reaches (CheckpointManager.restored_elsewhere): that step may be damaged.
        2. Otherwise the shared tier, falling back past what it refuses: `s`, the newest shared step that loads.
        3. When the shared tier fell back past refused steps (or had none that loads), the node-local steps
           newer than `s` and older than those step 1 refused (each is hashed and refused once): one that
           loads replaces every element the shared load wrote (and its RNG and trainer state are its own). The
           shared tier's manager keeps what step 2 verified: its next saves deduplicate against `s` and set its
           refused steps aside. A node-local step refused after part of it was read into the tensors leaves
           them dirty: `s` is loaded again.
        Every branch is taken on every rank alike (each load's outcome is agreed on over the checkpoint group)."""
        local, manager, check = self._local, self.manager, self._state_problem
        if local is None:
            restored = manager.load_latest(tensors, check_state=check)
            return TierChoice(restored, "shared", "", restored is None and manager.tensors_dirty)

        def moved() -> str:  # by the node-local load that succeeded
            files, nbytes = local.moved
            return f"{files} data file(s), {nbytes / 2**20:.1f} MiB moved between nodes"

        listed = manager.newest_committed()
        restored = local.load_node_local(tensors, at_least=listed, check_state=check)
        if restored is not None:
            manager.restored_elsewhere(restored.step)
            return TierChoice(restored, "node-local", f"{moved()}; nothing read from the shared tier", False)
        dirty = local.tensors_dirty
        shared = manager.load_latest(tensors, check_state=check)
        dirty = shared is None and (dirty or manager.tensors_dirty)
        if listed is not None and (shared is None or shared.step < listed):
            after = None if shared is None else shared.step + 1
            newer = local.load_node_local(tensors, at_least=after, below=listed, check_state=check)
            if newer is not None:
                than = (
                    "no step of the shared tier loads on every rank"
                    if shared is None
                    else f"newer than step {shared.step}, the shared tier's newest that every rank can load"
                )
                return TierChoice(newer, "node-local", f"{moved()}; {than}", False)
            if local.tensors_dirty and shared is not None:  # a refused node-local step overwrote part of it
                shared = manager.load_latest(tensors, check_state=check)
            dirty = (dirty or local.tensors_dirty) if shared is None else False
        return TierChoice(shared, "shared", "the node-local tier holds no newer step that every rank can load", dirty)

    @property
    def _local(self):
        """The node-local tier's CheckpointManager (hpcscale.ckpt.nodelocal), None when the job has none (created
        on first use: a collective)."""
        ctx = self._ctx
        if self._local_manager is None and ctx.runtime.node_local is not None:
            tier = ctx.job.checkpoint.local
            node_of: list = [None] * ctx.world_size
            dist.all_gather_object(node_of, ctx.node)
            # the switch tree as rank 0 read it at placement (launch/main.py): no rank asks Slurm again
            leaf_of, leaf_order = ctx.runtime.switches if len(set(node_of)) > 1 and ctx.runtime.switches else ({}, [])
            layout = nodelocal.build(
                node_of,
                tier.partners,
                leaf_of,
                leaf_order,
                tier.partner_switch,
            )
            self._local_manager = NodeLocalManager(
                ctx.runtime.node_local,
                dims=ctx.dims,
                rank=ctx.rank,
                keep_last=tier.keep_last,
                direct_io=ctx.job.checkpoint.direct_io,
                background_nice=ctx.job.checkpoint.background_nice,
                log=ctx.metrics.print,
                device=ctx.device,
                timeout_s=ctx.job.timeout_seconds,
                node_local=layout,
                lineage=self._lineage(),  # a drain keeps the node-local step's trainer state, lineage included
                staging=self.manager.staging,  # one set of staging buffers per rank for both tiers (writer.StagingPool)
            )

            if ctx.rank == 0:
                self._local_manager.record = ctx.run_dir / RECORD
            ctx.metrics.print(
                f"hpcscale: node-local tier in {ctx.runtime.node_local}; partner copies: {layout.describe()}"
            )
        return self._local_manager

    def close(self) -> None:
        """After the entry point returned (launch calls it): save the last finished step if the job has a
        checkpoint period and that step is not saved yet, and wait for a save in flight; then end the manager's
        writer thread."""
        self._tiers.forget_drain()  # never drained: the end-of-run save goes to the shared tier itself
        if self._loop is not None:
            self._loop.closing()  # a count the code's end cut short counts nothing; a rollback not followed: refused
        try:
            self._close_shared()
        finally:  # after the shared tier (a drain in flight reads the node-local files), and whatever it raised
            if self._local_manager is not None:
                self._tiers.local_wait()
                self._local_manager.close()

    def _close_shared(self) -> None:
        if self._manager is None:
            return
        done = self._done
        with self._watchdog.paused("checkpoint"):
            self._tiers.shared_wait()
            rounds = self._rounds
            finished = self._stepped and self.steps is not None and done == self.steps
            if rounds is not None and finished and rounds.is_boundary(done):
                rounds.before_round_checkpoint(done)  # overlap: the round in flight first, as at every boundary
            # a cross-site site's last checkpoint is a round's too (its contribution), whatever every_steps says
            wanted = self._policy.every_steps != 0 or rounds is not None
            if wanted and done is not None and self._manager.last_step != done:
                self.save(done, asynchronous=False)
            self._manager.close()

    @contextlib.contextmanager
    def paused(self, reason: str, *, bounded: bool = False) -> Iterator[None]:
        """Work between steps that is not training (an evaluation): the hang watchdog waits for it (with
        `bounded`, up to its pause limit: hpcscale.launch.watchdog), and its time is left out of the step times
        (per-rank timing, checkpoint.every_steps: auto)."""
        if self._loop is not None:
            with self._watchdog.paused(reason, bounded=bounded), self._loop.paused():
                yield
            return
        times = self._ctx.step_times  # an evaluation's collectives are no step's traffic either
        with (
            self._watchdog.paused(reason, bounded=bounded),
            times.paused() if times is not None else contextlib.nullcontext(),
        ):
            yield

    def _hook_optimizers(self) -> None:
        """defer_staging: every registered optimizer waits, before its step() changes the tensors, for a save's
        copy of them still being taken in the background."""
        if not self.defer_staging:
            return
        for opt in self._optimizers:
            opt.register_step_pre_hook(lambda *_: self._manager.wait_staged() if self._manager is not None else None)

    def _start_clock(self, start: int) -> None:
        """The step loop (hpcscale.launch.steploop), from the step the run starts at."""
        self._loop = StepLoop(self, start)

    # ---- cross-site rounds (docs/cross-site.md) -------------------------------------------------------------------
    def _start_rounds(self, saved: dict | None) -> bool:
        if self._ctx.job.xsite is None:
            return False
        if self._model is None:
            raise BadInput("the job is a cross-site site (xsite:): ctx.checkpoint.restore needs the model")

        self._rounds = Rounds(
            self._ctx, self._model, tokens_per_step=int(self.tokens_per_step), pins=lambda: self.manager
        )
        if saved is not None:
            self._rounds.restore(saved)
        return True

    def _round_boundary(self, done_steps: int) -> None:
        """Save the round checkpoint the sync tick exports, then wait for (or, adopt: overlap, go on and later
        adopt) the next global round, as the built-in trainer does."""
        with self._watchdog.paused("cross-site round"):
            self._rounds.boundary(done_steps, lambda: (self.save(done_steps, asynchronous=False), self.manager.wait()))

    def _lineage(self) -> dict | None:
        """What produced this run's checkpoints (hpcscale.ckpt.lineage), collected once for both tiers."""
        if not self._lineage_collected:
            self._lineage_value, self._lineage_collected = lineage.of_context(self._ctx), True
        return self._lineage_value

    @property
    def manager(self):
        """The CheckpointManager underneath (created on first use: a collective)."""
        if self._manager is None:
            ctx = self._ctx
            policy = ctx.job.checkpoint
            self._manager = CheckpointManager(
                ctx.run_dir / CHECKPOINTS,
                dims=ctx.dims,
                rank=ctx.rank,
                keep_last=policy.keep_last,
                keep_every=policy.keep_every,
                direct_io=policy.direct_io,
                background_nice=policy.background_nice,
                log=ctx.metrics.print,
                lineage=self._lineage(),
                device=ctx.device,
                timeout_s=ctx.job.timeout_seconds,
                owner=ctx.run_id,
            )
        return self._manager

    @property
    def _watchdog(self):
        return self._ctx.watchdog or NoWatchdog()

    def _register(self, model, optimizer, state: dict[str, Any]) -> None:
        if self._registered:
            raise BadInput("ctx.checkpoint.restore() is called once, before the training loop")
        if optimizer is None:
            optimizers = ()
        else:
            optimizers = tuple(optimizer) if isinstance(optimizer, list | tuple) else (optimizer,)
        if optimizers and model is None:
            raise BadInput("ctx.checkpoint.restore(): an optimizer needs its model (restore(model, optimizer))")
        for name, obj in state.items():
            if not isinstance(obj, dict) and not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise BadInput(
                    f"ctx.checkpoint.restore({name}=...): a {type(obj).__name__} has no state_dict()/"
                    "load_state_dict(); pass an object that has them, or a dict"
                )
        self._model, self._optimizers, self._objects = model, optimizers, dict(state)
        self._renames, self._not_saved = self._tie_names()
        self._group_sizes = self._whole_model_group_sizes()
        self._hook_optimizers()
        self._registered = True

    def _tie_names(self) -> tuple[dict[str, str | None], set[str]]:
        """A checkpoint holds a tied parameter once, under its first name in the whole model (hpcscale.parallel.ties),
        whatever the layout: (this stage's names to store under another name, None for one dropped as the same tensor
        as an earlier name here; the names this stage does not write, as a lower stage holding a copy writes them).
        Every stage reads them by that name, so a checkpoint loads into any pp."""

        renames: dict[str, str | None] = {}
        not_saved: set[str] = set()
        if self._model is None:
            return renames, not_saved
        for names in find_ties(self._model):  # one parameter under several names on this stage
            renames.update(dict.fromkeys(names[1:]))
        for tie in self._model.__dict__.get(STAGE_TIES) or ():
            if tie.here is None:
                continue
            if tie.here != tie.names[0]:
                renames[tie.here] = tie.names[0]
            if self._ctx.pp_rank != tie.stages[0]:
                not_saved.add(tie.names[0])
        return renames, not_saved

    def _whole_model_group_sizes(self) -> list[int]:
        """Parameters per optimizer group over the whole model. A pipeline stage holds only its own, so the
        stages' counts are summed (a collective over pp, on the rank's device: NCCL reduces only GPU tensors); a
        tied parameter's copy on a stage above the lowest one holding it counts there only."""
        skip = getattr(self._ctx, "_norm_skip", ())  # the copies whose gradient a lower stage counts: the same ones
        sizes = [sum(id(p) not in skip for p in g["params"]) for opt in self._optimizers for g in opt.param_groups]
        if self._ctx.dims.pp > 1:
            group = self._ctx.mesh["pp"].get_group()
            count = torch.tensor([len(sizes), -len(sizes)], dtype=torch.int64, device=self._ctx.device)
            dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)  # the most and the fewest groups of a stage
            if int(count[0]) != -int(count[1]):
                raise BadInput(
                    f"ctx.checkpoint.restore: the pipeline stages' optimizers have between {-int(count[1])} and "
                    f"{int(count[0])} parameter groups; every stage needs the same groups (keep empty ones)"
                )
            if sizes:
                t = torch.tensor(sizes, dtype=torch.int64, device=self._ctx.device)
                dist.all_reduce(t, group=group)
                sizes = [int(x) for x in t.tolist()]
        return sizes

    def _tensors(self) -> tuple[dict[str, torch.Tensor], dict | None, dict | None]:
        """The checkpoint's tensors by name, and torch's model and optimizer state dicts they come from."""
        if self._model is None:
            return {}, None, None
        from torch.distributed.checkpoint.state_dict import get_state_dict

        reshard(self._model)  # FSDP2 units a no-grad forward left gathered name full tensors, not the shards
        model_sd, optim_sd = get_state_dict(self._model, list(self._optimizers))
        names = self._renames
        tensors = {f"model/{names.get(k, k)}": v for k, v in model_sd.items() if torch.is_tensor(v) and names.get(k, k)}
        if not self._optimizers:
            return tensors, model_sd, None
        for fqn, s in optim_sd["state"].items():
            for key, value in s.items():
                if torch.is_tensor(value) and names.get(fqn, fqn):
                    tensors[f"optim/{names.get(fqn, fqn)}/{key}"] = value
        return tensors, model_sd, optim_sd

    def _object_states(self) -> dict[str, Any]:
        out = {}
        for name, obj in self._objects.items():
            value = dict(obj) if isinstance(obj, dict) else obj.state_dict()
            out[name] = _jsonable(value, name)
        return out

    def _state_problem(self, state: dict) -> str | None:
        """What makes a checkpoint's JSON state unusable here (every rank refuses it together)."""
        if type(state.get("step")) is not int or state["step"] < 0:
            return f"step is {str(state.get('step'))[:40]!r}, not a non-negative integer"
        legacy = _is_legacy_trainer(state)
        if legacy and set(self._objects) != {"loader"}:
            return "a built-in trainer's checkpoint (its older format): it holds a loader and nothing else"
        state = _upgraded(state)
        if state.get("hpcscale.context") != FORMAT:
            return (
                "not written by ctx.checkpoint (no 'hpcscale.context' marker: a built-in trainer's checkpoint or "
                "another program's)"
            )
        if not isinstance(state.get("objects", {}), dict):
            return "objects is not a JSON object"
        for name, obj in self._objects.items():  # an object that can say what it cannot load refuses it here
            if callable(getattr(obj, "state_problem", None)):  # asked with None when the checkpoint holds none
                problem = obj.state_problem(state.get("objects", {}).get(name))
                if problem is not None:
                    return f"{name}: {problem}"
        if self._optimizers and not legacy:
            saved = state.get("optimizer")
            groups = saved.get("param_groups") if isinstance(saved, dict) else None
            if not isinstance(groups, list):
                return "no optimizer param_groups: the checkpoint was saved without an optimizer"
            sizes = saved.get("group_sizes")
            if sizes is None and self._ctx.dims.pp == 1:  # written before the whole model's sizes were kept
                sizes = [len(s.get("params", ())) if isinstance(s, dict) else None for s in groups]
            if (
                len(groups) != len(self._group_sizes)
                or any(not isinstance(s, dict) for s in groups)
                or (sizes is not None and sizes != self._group_sizes)
            ):
                return (
                    f"the optimizer has {len(self._group_sizes)} parameter group(s) of {self._group_sizes} "
                    f"parameters (whole model); the checkpoint's differ"
                )
        return None
