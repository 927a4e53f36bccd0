"""Gradient-norm clipping that is correct across tensor and pipeline parallelism.

The global norm is over the whole model: each pp stage holds different parameters (sum over pp), a DTensor
gradient sharded over mesh dimensions (tp; dp_shard under FSDP2; both) holds a slice (sum over each of those
dimensions' groups), a dimension it is replicated over holds the same values (count once). dp replicas (and
HSDP's dp_replicate groups) hold identical, already averaged gradients, so nothing is summed over them. The
squares are gathered per set of sharded dimensions and each set is all-reduced over each of its dimensions'
groups: one scalar all-reduce per dimension of each set (at most four: tp, dp_shard, and both) and one over pp.

Where the sums live: on the gradients' device. NCCL reduces only tensors on the rank's own GPU, and adding a
CUDA norm into a CPU accumulator raises ("Expected all tensors to be on the same device"), so the two
accumulators are made on `device` (the rank's device; the first gradient's when not given). Each gradient's
norm is taken in fp32 by torch's own reduction (no fp64 copy of a gradient: a 400 M-element embedding shard
would need 6 GB, and some GPUs are slow at fp64), then squared and added in fp64, so many tensors' sums lose
nothing to each other; CUDA and NCCL both take fp64 scalars.

The kernels are foreach kernels over the gradients (torch's own clip_grad_norm_ does the same): one launch
for every gradient's norm, one for the scaling, not one per parameter, which on a GPU is the difference between
a few launches and thousands per step. Nothing here reads a value back to the host: the norm is returned as a
0-dim tensor on the device, and the scale is applied as a tensor (1 where the norm is within max_norm, so no
branch on its value), so the host waits only where the caller turns the norm into a number. The exception is
timing: asked for the seconds spent in the all-reduces, it has to wait for them to end.
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist
from torch import nn

from hpcscale.parallel.device import settle


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def is_split(placement) -> bool:
    """Whether a DTensor placement splits the tensor across the mesh dimension: Shard, and the _StridedShard
    FSDP2 puts on a dimension tensor parallelism already shards (whose is_shard() is False in torch 2.13)."""
    from torch.distributed.tensor.placement_types import _StridedShard

    return placement.is_shard() or isinstance(placement, _StridedShard)


def _sharded_dims(g: torch.Tensor) -> tuple[str, ...]:
    """The mesh dimensions a DTensor is sharded over (their names, in mesh order); () for a plain tensor."""
    if not hasattr(g, "placements"):
        return ()
    names = g.device_mesh.mesh_dim_names or tuple(str(i) for i in range(g.device_mesh.ndim))
    return tuple(names[i] for i, pl in enumerate(g.placements) if is_split(pl) and g.device_mesh.size(i) > 1)


def clip_grad_norm(
    params: list[nn.Parameter],
    max_norm: float,
    *,
    pp_group: dist.ProcessGroup | None,
    device: torch.device | None = None,
    waited: list[float] | None = None,
    not_counted: set[int] | frozenset[int] = frozenset(),
) -> torch.Tensor:
    """Clip the gradients of `params` in place to a global norm of `max_norm` (0 or inf: measure only) and
    return the global norm before clipping, a 0-dim fp64 tensor on `device`. A collective over the sharded
    dimensions' groups and `pp_group` (None: pp is 1); every rank of a stage holds the same parameters, so all of
    them make the same calls. `waited`: gets the seconds spent in those all-reduces appended (where a rank waits
    for its slowest peer: per-rank timing books it as waiting, not as the rank's own time); on a GPU the stream
    is settled before the clock starts and again before it stops, so the local norms' kernels are not counted
    in it. `not_counted`: id()s of parameters whose gradient is scaled but left out of the norm (a tied
    parameter's copy on a pipeline stage whose gradient another stage counts: hpcscale.parallel.ties)."""
    grads = [p.grad for p in params if p.grad is not None]
    counted = [p.grad for p in params if p.grad is not None and id(p) not in not_counted]
    if device is None:
        device = _local(grads[0]).device if grads else torch.device("cpu")
    by_key: dict[tuple[str, ...], list[torch.Tensor]] = {}
    groups: dict[tuple[str, ...], list[dist.ProcessGroup]] = {}
    for g in counted:
        key = _sharded_dims(g)
        if key not in by_key:
            by_key[key] = []
            groups[key] = [g.device_mesh.get_group(name) for name in key] if key else []
        by_key[key].append(_local(g).detach())
    sums = {key: _sum_of_squares(local, device) for key, local in by_key.items()}
    total = torch.zeros((), dtype=torch.float64, device=device)
    across_stages = pp_group is not None and dist.get_world_size(pp_group) > 1
    timed = waited is not None and (across_stages or any(groups[key] for key in sums))
    if timed:
        settle(device)
        t0 = time.perf_counter()
    for key in sorted(sums):  # the same order on every rank of the stage
        for group in groups[key]:
            dist.all_reduce(sums[key], group=group)
        total += sums[key]
    if across_stages:
        dist.all_reduce(total, group=pp_group)
    if timed:
        settle(device)  # the all-reduces are done: the clock stops on the wait, not on their launch
        waited.append(time.perf_counter() - t0)
    norm = total.sqrt()
    if 0 < max_norm < math.inf and grads:
        # 1 where the norm is within max_norm (NaN included): the gradients are then left as they are, bit for bit
        scale = torch.where(norm > max_norm, max_norm / (norm + 1e-6), 1.0)
        _scale([_local(g) for g in grads], scale)
    return norm


def _sum_of_squares(local: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The sum of the squared fp32 norms of `local`, in fp64 on `device`: a 0-dim tensor."""
    squares = torch.stack(torch._foreach_norm(local, 2, dtype=torch.float32)).to(device).double().square()
    # cumsum's last element is the squares added one by one in parameter order (on CPU a sequential scan, where
    # sum() trees the additions by vector width): the per-tensor definition's exact bits, so clipping does not
    # move a CPU run's numbers by an ulp for the sake of fewer kernels
    return squares.cumsum(0)[-1]


def _scale(local: list[torch.Tensor], scale: torch.Tensor) -> None:
    """Multiply every tensor of `local` by the 0-dim `scale` in place, one foreach kernel per device and dtype
    (the fast path takes one of each), `scale` cast to fp32 for half-precision gradients as the multiplication
    itself would (in fp64 for fp64 gradients)."""
    by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in local:
        by_kind.setdefault((t.device, t.dtype), []).append(t)
    for (dev, dtype), tensors in by_kind.items():
        torch._foreach_mul_(tensors, scale.to(device=dev, dtype=torch.promote_types(dtype, torch.float32)))
