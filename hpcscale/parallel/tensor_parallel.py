"""Tensor parallelism for the reference GPT with torch's DTensor plans (Megatron-style, Shoeybi et al. 2019).

Per block: q, k, v and mlp.fc are column-parallel (each tp rank computes its heads / its slice of the hidden
units), attn.o and mlp.proj are row-parallel (partial sums all-reduced back to a replicated output). One
all-reduce per sub-layer in forward and one in backward. Embeddings, norms and the output head stay
replicated: at the reference model's vocabulary (256 bytes) sharding them would cost more than it saves.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


def apply_tp(model: nn.Module, *, tp_mesh: DeviceMesh) -> None:
    if tp_mesh.size() == 1:
        return
    plan = {
        "attn.q": ColwiseParallel(),
        "attn.k": ColwiseParallel(),
        "attn.v": ColwiseParallel(),
        "attn.o": RowwiseParallel(),
        "mlp.fc": ColwiseParallel(),
        "mlp.proj": RowwiseParallel(),
    }
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, plan)
