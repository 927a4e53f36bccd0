"""Parallelize a user's model in place: tensor parallelism from the user's plan, then data parallelism.

Replicated data parallelism is GradSync (grad_sync.py) rather than torch's DistributedDataParallel, for one
reason: DDP refuses DTensor parameters, so it cannot follow a tensor-parallel plan, and one code path for every
layout is what the reference trainer uses too (it is placed by ctx.parallelize like any model). GradSync has
DDP's performance properties (~25 MB buckets in reverse registration order, each all-reduced asynchronously as
soon as backward has produced it) and DDP's accumulation rule (no_sync), and it leaves the model itself in
place: parameter names keep no "module." prefix, so checkpoints and exports name tensors as the user does. It
runs in its automatic mode (at the end of every backward), or on a pipeline stage armed by each step of the
stage's schedule (hpcscale.parallel.pipeline.Pipeline). scripts/bench/user_entry.py measures a step against DDP
on the same model.

Like DDP, it starts every data-parallel replica from the same weights: parameters and buffers are broadcast
from the first rank of the dp group, so an unseeded model cannot silently diverge. A model built on the meta
device has no weights yet; `shard` materializes it with name-seeded initialization (hpcscale.parallel.init),
which gives every replica the same weights by construction.

With tensor parallelism, every parameter the plan does not split becomes a DTensor replicated over the tp mesh
(`replicate_unplanned`), as torchtitan's plans make norms and embeddings: torch's fused and foreach optimizer
kernels (AdamW's defaults on GPUs) refuse a parameter group that mixes plain tensors and DTensors, and a plan
rarely names every module. The module computes as before, on the local tensors (every tp rank holds the same
values and computes the same gradients, as without the conversion).

With parallel.dp_shard > 1 the data parallelism is torch's FSDP2 instead (hpcscale.parallel.fsdp.shard_model):
the replicas are made identical first, then each block and the root are sharded over the dp mesh; FSDP
reduce-scatters the gradients itself, so no GradSync is attached.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hpcscale.errors import BadInput
from hpcscale.parallel.init import on_meta
from hpcscale.parallel.tp_check import check_plan


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class _LocalDuringForward:
    """Forward hooks that show a module its replicated DTensor parameters as their local tensors while its own
    forward runs (`to_local()`, through which autograd hands the gradient back to the DTensor), then put the
    DTensors back, even when forward raises. The module's code, its buffers, tensors it makes and custom
    kernels then see plain tensors exactly as without tensor parallelism; only the optimizer and the
    checkpoints see DTensors. What is read at call time is whatever the module holds then (FSDP2 swaps in its
    unsharded parameters before a block's forward)."""

    def __init__(self, names: list[str]):
        self.names = names
        self._saved: list[dict[str, Any]] = []  # a stack: a module may be called inside its own forward

    def enter(self, module: nn.Module, args: Any) -> None:
        saved = {n: module._parameters[n] for n in self.names}
        for n, p in saved.items():
            if p is not None and hasattr(p, "to_local"):
                module._parameters[n] = p.to_local()  # bypasses __setattr__'s Parameter check, for this call only
        self._saved.append(saved)

    def exit(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._saved:
            module._parameters.update(self._saved.pop())


def replicate_unplanned(model: nn.Module, tp_mesh: Any) -> list[str]:
    """Make every parameter of `model` that is not a DTensor yet a DTensor replicated over `tp_mesh`, in
    place (names and values unchanged; a parameter two modules share stays one), and have each module owning
    one compute with their local tensors (_LocalDuringForward). Returns the modules so changed."""
    from torch.distributed.tensor import DTensor, Replicate

    changed = []
    made: dict[int, nn.Parameter] = {}  # one DTensor per parameter: a parameter two modules share stays shared
    for name, module in model.named_modules(remove_duplicate=False):
        own = [(n, p) for n, p in module.named_parameters(recurse=False) if not isinstance(p, DTensor)]
        own = [(n, p) for n, p in own if id(p) not in made or module._parameters[n] is not made[id(p)]]
        if not own:
            continue
        for n, p in own:
            if id(p) not in made:
                local = DTensor.from_local(p.detach(), tp_mesh, [Replicate()], run_check=False)
                made[id(p)] = nn.Parameter(local, requires_grad=p.requires_grad)
            module.register_parameter(n, made[id(p)])
        hooks = _LocalDuringForward([n for n, _ in own])
        module.register_forward_pre_hook(hooks.enter)
        module.register_forward_hook(hooks.exit, always_call=True)
        changed.append(name)
    return changed


def parallelize(
    model: nn.Module,
    *,
    dp_group: dist.ProcessGroup | None,
    tp_mesh: Any = None,
    tp_plan: dict[str, Any] | None = None,
    shard: Any,
    device: torch.device | None = None,
) -> Any:
    """Apply `tp_plan` over `tp_mesh` (torch.distributed.tensor.parallel.parallelize_module), make the dp
    replicas identical, then return `shard(model)`: what averages or shards its gradients over the replicas
    (a GradSync, or FSDP2's ShardedSync; Context.parallelize says which). In place. `device`: where the rest
    of a model built with its weights goes once the plan has placed its split parameters (the caller moves a
    model without a plan itself)."""
    from hpcscale.parallel.ties import find_ties, retie

    ties = find_ties(model)
    tp = tp_mesh.size() if tp_mesh is not None else 1
    if tp > 1:
        if not tp_plan:
            raise BadInput(
                f"parallel.tp is {tp} but ctx.parallelize got no tp_plan: tensor parallelism needs the "
                "model's plan, e.g. {'layers.0.fc': ColwiseParallel(), 'layers.0.proj': RowwiseParallel()} "
                "(docs/context-api.md)"
            )
        from torch.distributed.tensor.parallel import parallelize_module

        check_plan(model, tp_plan, tp=tp)  # before torch splits anything: an uneven split fails only at forward
        # A model with weights comes here still on the host: torch moves each planned parameter to the mesh's
        # device and keeps the rank's slice, one parameter at a time, so the device never holds the whole model.
        parallelize_module(model, tp_mesh, tp_plan)
        retie(model, ties, why="ctx.parallelize")  # the plan gives each planned module a parameter of its own
        if device is not None and not on_meta(model):
            model.to(device)  # what the plan does not split: whole on every tp rank anyway
        replicate_unplanned(model, tp_mesh)
    if dp_group is not None and dist.get_world_size(dp_group) > 1 and not on_meta(model):
        with torch.no_grad():
            for t in list(model.parameters()) + list(model.buffers()):
                dist.broadcast(_local(t), group=dp_group, group_src=0)
    return shard(model)
