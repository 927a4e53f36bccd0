"""Gradient-norm clipping that is correct across tensor and pipeline parallelism.

The global norm is over the whole model: each pp stage holds different parameters (sum over pp), a
tensor-parallel Shard holds a slice (sum over tp), a Replicate parameter is the same on every tp rank
(count once). dp replicas hold identical, already averaged gradients, so nothing is summed over dp.

Where the sums live: on the gradients' device. NCCL reduces only tensors on the rank's own GPU, and adding a
CUDA norm into a CPU accumulator raises ("Expected all tensors to be on the same device"), so the two
accumulators are made on `device` (the rank's device; the first gradient's when not given). Each gradient's
norm is taken in fp32 by torch's own reduction (no fp64 copy of a gradient: a 400 M-element embedding shard
would need 6 GB, and some GPUs are slow at fp64), then squared and added in fp64, so many tensors' sums lose
nothing to each other; CUDA and NCCL both take fp64 scalars. The one host sync is the norm's `float()`, after
both all-reduces.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def clip_grad_norm(
    params: list[nn.Parameter],
    max_norm: float,
    *,
    tp_group: dist.ProcessGroup | None,
    pp_group: dist.ProcessGroup | None,
    device: torch.device | None = None,
) -> float:
    """Clip the gradients of `params` in place to a global norm of `max_norm` (0: measure only) and return the
    global norm before clipping. A collective over `tp_group` and `pp_group` (None: that degree is 1)."""
    grads = [p.grad for p in params if p.grad is not None]
    if device is None:
        device = _local(grads[0]).device if grads else torch.device("cpu")
    sharded = torch.zeros((), dtype=torch.float64, device=device)
    replicated = torch.zeros((), dtype=torch.float64, device=device)
    for g in grads:
        local = _local(g)
        square = torch.linalg.vector_norm(local.detach(), 2, dtype=torch.float32).double().square().to(device)
        if hasattr(g, "placements") and any(pl.is_shard() for pl in g.placements):
            sharded += square
        else:
            replicated += square
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        dist.all_reduce(sharded, group=tp_group)
    total = sharded + replicated
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        dist.all_reduce(total, group=pp_group)
    norm = float(total.sqrt())
    if max_norm > 0 and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for g in grads:
            _local(g).mul_(scale)
    return norm
