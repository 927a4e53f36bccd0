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
rarely names every module. The module computes as before: its plain-tensor inputs are taken as replicated,
its outputs handed back as plain tensors, and its gradients are the same on every tp rank.

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


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _replicated_in(mesh: Any):
    from torch.distributed.tensor import DTensor, Replicate

    def to_dtensor(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and not isinstance(t, DTensor):
            return DTensor.from_local(t, mesh, [Replicate()], run_check=False)
        return t

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple:
        from torch.utils._pytree import tree_map

        return tree_map(to_dtensor, args), tree_map(to_dtensor, kwargs)

    return hook


def _local_out(module: nn.Module, args: Any, output: Any) -> Any:
    from torch.distributed.tensor import DTensor
    from torch.utils._pytree import tree_map_only

    return tree_map_only(DTensor, lambda t: t.to_local(), output)


def replicate_unplanned(model: nn.Module, tp_mesh: Any) -> list[str]:
    """Make every parameter of `model` that is not a DTensor yet a DTensor replicated over `tp_mesh`, in
    place, and have each module owning one take plain-tensor inputs as replicated and give DTensor outputs back
    as plain tensors (forward hooks; names and values unchanged). Returns the modules so changed."""
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
        module.register_forward_pre_hook(_replicated_in(tp_mesh), with_kwargs=True)
        module.register_forward_hook(_local_out)
        changed.append(name)
    return changed


def parallelize(
    model: nn.Module,
    *,
    dp_group: dist.ProcessGroup | None,
    tp_mesh: Any = None,
    tp_plan: dict[str, Any] | None = None,
    shard: Any,
) -> Any:
    """Apply `tp_plan` over `tp_mesh` (torch.distributed.tensor.parallel.parallelize_module), make the dp
    replicas identical, then return `shard(model)`: what averages or shards its gradients over the replicas
    (a GradSync, or FSDP2's ShardedSync; Context.parallelize says which). In place."""
    tp = tp_mesh.size() if tp_mesh is not None else 1
    if tp > 1:
        if not tp_plan:
            raise BadInput(
                f"parallel.tp is {tp} but ctx.parallelize got no tp_plan: tensor parallelism needs the "
                "model's plan, e.g. {'layers.0.fc': ColwiseParallel(), 'layers.0.proj': RowwiseParallel()} "
                "(docs/context-api.md)"
            )
        from torch.distributed.tensor.parallel import parallelize_module

        parallelize_module(model, tp_mesh, tp_plan)
        replicate_unplanned(model, tp_mesh)
    if dp_group is not None and dist.get_world_size(dp_group) > 1 and not on_meta(model):
        with torch.no_grad():
            for t in list(model.parameters()) + list(model.buffers()):
                dist.broadcast(_local(t), group=dp_group, group_src=0)
    return shard(model)
