"""Gradient-norm clipping that is correct across tensor and pipeline parallelism.

The global norm is over the whole model: each pp stage holds different parameters (sum over pp), a
tensor-parallel Shard holds a slice (sum over tp), a Replicate parameter is the same on every tp rank
(count once). dp replicas hold identical, already averaged gradients, so nothing is summed over dp.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def clip_grad_norm(
    params: list[nn.Parameter],
    max_norm: float,
    *,
    tp_group: dist.ProcessGroup | None,
    pp_group: dist.ProcessGroup | None,
) -> float:
    sharded = torch.zeros((), dtype=torch.float64)
    replicated = torch.zeros((), dtype=torch.float64)
    for p in params:
        if p.grad is None:
            continue
        g = p.grad
        if hasattr(g, "to_local"):
            local = g.to_local().double()
            if any(pl.is_shard() for pl in g.placements):
                sharded += local.pow(2).sum()
                continue
            replicated += local.pow(2).sum()
        else:
            replicated += g.double().pow(2).sum()
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        dist.all_reduce(sharded, group=tp_group)
    total = sharded + replicated
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        dist.all_reduce(total, group=pp_group)
    norm = float(total.sqrt())
    if max_norm > 0 and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for p in params:
            if p.grad is not None:
                g = p.grad
                (g.to_local() if hasattr(g, "to_local") else g).mul_(scale)
    return norm
