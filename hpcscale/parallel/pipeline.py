"""Pipeline parallelism with torch.distributed.pipelining (GPipe or 1F1B), for any model built as a stack.

The model is built on every rank (on the meta device for a large one: hpcscale.parallel.init; whole with the
same seed, so identical, otherwise), then each stage drops what it does not own:
the blocks in `model.layers` (a ModuleList, or a ModuleDict keyed by global index "0", "1", ...; another
attribute path with `layers=`, e.g. "model.layers") are split into pp contiguous runs (earlier stages take the
remainder); the modules named as first-stage-only (embeddings) stay on the first stage, those named as
last-stage-only (final norm, output head) on the last. A stage keeps its blocks under their global index, so
parameter names are the whole model's ("layers.5.mlp.fc.weight" on whichever stage holds block 5) and a
checkpoint loads into any other pp. A ModuleList cut so still iterates and slices as before (`for block in
self.layers`, `self.layers[:n]`); indexing it by position (`self.layers[0]`) finds only the indices it kept. The
reference GPT (hpcscale.train.model) is built this way, and a user's model can be too. 1F1B: Narayanan et al.,
SC'21; GPipe: Huang et al. 2019.

`Pipeline` (what `ctx.pipeline` returns) runs one step of the schedule with the data-parallel gradient
averaging around it: the stage's GradSync (replicated data parallelism) is armed for the step's micro-batch
backward passes and finished after them, so pp × dp replicas stay identical without the loop doing anything;
FSDP2 (parallel.dp_shard > 1) reduce-scatters during the schedule's backward itself.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from hpcscale.errors import BadInput
from hpcscale.parallel.ties import STAGE_TIES, stage_ties

# the public API (docs/context-api.md, docs/huggingface.md, docs/checkpoint-format.md): what user code imports
__all__ = ["SCHEDULES", "Pipeline", "cut_stage"]

# torch's schedule classes by name; torch.distributed.pipelining is imported where a schedule is built: it imports
# dynamo (about a second), which a job at pp = 1 may never need
SCHEDULES = {"1f1b": "Schedule1F1B", "gpipe": "ScheduleGPipe"}


def stage_layers(n_layer: int, pp: int, stage: int) -> range:
    base, extra = divmod(n_layer, pp)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))


def _owner(model: torch.nn.Module, path: str) -> tuple[torch.nn.Module, str]:
    """The module holding the attribute at dotted `path`, and the attribute's name."""
    parent, _, name = path.rpartition(".")
    try:
        owner = model.get_submodule(parent)
    except AttributeError:
        raise BadInput(f"cut_stage: the model has no {path!r} ({parent!r} is missing)") from None
    if not hasattr(owner, name):
        raise BadInput(f"cut_stage: the model has no {path!r}")
    return owner, name


def cut_stage(
    model: torch.nn.Module,
    *,
    stage: int,
    pp: int,
    first_stage_only: Sequence[str],
    last_stage_only: Sequence[str],
    layers: str = "layers",
    split: Sequence[int] | None = None,
) -> torch.nn.Module:
    """Keep only this stage's part of `model` (in place): its run of the blocks at `layers` (a ModuleList or a
    ModuleDict keyed "0", "1", ...), each under its global index, and the attributes named (dotted paths) as
    belonging to the first or last stage set to None elsewhere (the model's forward skips None parts).
    `split`: how many blocks each stage takes, in stage order (e.g. [3, 5]: the first stage, which also
    embeds, takes fewer); by default the blocks are split evenly, earlier stages taking the remainder."""
    if type(pp) is not int or pp < 1 or type(stage) is not int or not 0 <= stage < pp:
        raise BadInput(f"cut_stage: stage={stage!r} must be one of 0..pp-1 (pp={pp!r}, a positive integer)")
    owner, name = _owner(model, layers)
    blocks = getattr(owner, name)
    if not isinstance(blocks, torch.nn.ModuleList | torch.nn.ModuleDict):
        raise BadInput(f"cut_stage: model.{layers} is a {type(blocks).__name__}, not a ModuleList or ModuleDict")
    if len(blocks) < pp:
        raise BadInput(f"cut_stage: model.{layers} has {len(blocks)} blocks, fewer than pp = {pp} stages")
    keys = list(blocks._modules)
    if isinstance(blocks, torch.nn.ModuleDict) and keys != [str(i) for i in range(len(keys))]:
        raise BadInput(f"cut_stage: model.{layers} is a ModuleDict keyed {keys[:3]}..., not '0', '1', ...")
    for path in (*first_stage_only, *last_stage_only):
        _owner(model, path)  # every name is checked on every stage, not only where it is dropped
    if split is not None:
        split = list(split)
        if len(split) != pp or any(type(k) is not int or k < 1 for k in split) or sum(split) != len(blocks):
            raise BadInput(
                f"cut_stage: split={split} must give each of the pp = {pp} stages at least one block, "
                f"{len(blocks)} blocks in all"
            )
    if pp == 1:
        return model
    starts = [sum(split[:s]) for s in range(pp)] if split else None
    runs = [range(starts[s], starts[s] + split[s]) if split else stage_layers(len(blocks), pp, s) for s in range(pp)]
    block_stage = {str(i): s for s, run in enumerate(runs) for i in run}
    ties = stage_ties(
        model,
        stage=stage,
        pp=pp,
        layers=layers,
        block_stage=block_stage,
        first_stage_only=first_stage_only,
        last_stage_only=last_stage_only,
    )
    keep = {str(i) for i in runs[stage]}
    for key in keys:
        if key not in keep:
            # straight from _modules: ModuleList's own __delitem__ renumbers what is left, which would rename
            # every parameter of the stage ("layers.5" becoming "layers.0") and tie checkpoints to this pp
            del blocks._modules[key]
    for path in first_stage_only if stage > 0 else ():
        setattr(*_owner(model, path), None)
    for path in last_stage_only if stage < pp - 1 else ():
        setattr(*_owner(model, path), None)
    # what ctx.parallelize needs to keep each tie one parameter across the stages (hpcscale.parallel.ties)
    model.__dict__[STAGE_TIES] = ties
    return model


def build_schedule(
    stage_module: torch.nn.Module,
    *,
    pp_mesh: DeviceMesh,
    n_microbatches: int,
    kind: str,
    loss_fn: Callable,
    device: torch.device,
):
    """The pipeline schedule for this stage. Each micro-batch's loss is `loss_fn(output, target) /
    n_microbatches`, so the losses the last stage gets back add up to the step's mean loss and the gradients
    are already the mean over micro-batches when backward ends, exactly as plain accumulation at pp = 1 makes
    them (`(loss / n).backward()` per micro-batch).

    Why not torch's `scale_grads=True`: it divides the gradients after the schedule's last backward, in
    place. A data-parallel gradient hook (grad_sync.GradSync) has by then copied the undivided gradients into
    its buckets and started their all-reduce, and its finish() writes the undivided average back: gradients
    n_microbatches times too large. Scaling the loss keeps every gradient final when its hook fires."""

    def scaled(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return loss_fn(output, target) / n_microbatches

    import torch.distributed.pipelining as pipelining

    stage = pipelining.PipelineStage(
        stage_module, pp_mesh.get_local_rank(), pp_mesh.size(), device, group=pp_mesh.get_group()
    )
    schedule = getattr(pipelining, SCHEDULES[kind])
    return schedule(stage, n_microbatches=n_microbatches, loss_fn=scaled, scale_grads=False)


class Pipeline:
    """One pipeline stage's schedule and its data-parallel gradient averaging (`ctx.pipeline`).

    `first`: this stage takes the inputs; `last`: it takes the targets and gets the loss. `step(inputs,
    targets)` runs one training step's forward and backward over `n_microbatches` micro-batches (split along
    dim 0) and returns the step's mean loss on the last stage (None elsewhere); the optimizer step is the
    caller's. `eval(inputs, targets)` runs forward only. Every stage passes what it has: the first stage its
    inputs, the last its targets; others nothing (what a stage does not take is ignored)."""

    def __init__(
        self,
        schedule: Any,
        syncs: Sequence[Any],
        *,
        n_microbatches: int,
        first: bool,
        last: bool,
        ties: Sequence[tuple[torch.nn.Parameter, Any]] = (),
    ):
        self.schedule = schedule
        self._syncs = list(syncs)
        self._ties = list(ties)  # (parameter, group of the stages holding a copy): gradients summed after a step
        self.n_microbatches = n_microbatches
        self.first = first
        self.last = last

    def _run(self, run: Callable, inputs: Any, targets: Any) -> torch.Tensor | None:
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.first else ()
        kwargs = {"target": targets, "losses": losses} if self.last else {}
        run(*args, **kwargs)
        # each micro-batch's loss is already divided by n_microbatches (build_schedule): their sum is the mean
        return torch.stack(losses).sum().detach() if self.last else None

    def step(self, inputs: Any = None, targets: Any = None) -> torch.Tensor | None:
        for sync in self._syncs:
            sync.begin(self.n_microbatches)
        try:
            loss = self._run(self.schedule.step, inputs, targets)
        except BaseException:
            for sync in self._syncs:  # no reduction waits on peers that may never come: the step failed
                sync.armed = False
            raise
        for sync in self._syncs:
            sync.finish()
        self._sum_tied()
        return loss

    def _sum_tied(self) -> None:
        """Sum each tied parameter's gradient over the stages holding a copy (after the data-parallel averaging:
        the sum of averages is the average of sums), so every copy takes the same step."""
        import torch.distributed as dist

        for param, group in self._ties:
            if param.grad is None:  # this stage's copy took no part in the step's loss
                param.grad = torch.zeros_like(param)
            grad = param.grad
            if hasattr(grad, "placements") and tuple(grad.placements) != tuple(param.placements):
                # an embedding split by rows gets its gradient back replicated over tp; the head's copy is split:
                # the same split on every stage makes the local pieces the same elements (a slice, no transfer)
                grad = param.grad = grad.redistribute(param.device_mesh, param.placements)
            dist.all_reduce(grad.to_local() if hasattr(grad, "to_local") else grad, group=group)

    def eval(self, inputs: Any = None, targets: Any = None) -> torch.Tensor | None:
        return self._run(self.schedule.eval, inputs, targets)
