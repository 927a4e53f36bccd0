"""What a rank holds and what it writes: local shards of named tensors, placed in global coordinates, and
the deterministic choice of the one rank that writes each distinct shard.

A shard is identified by (tensor name, offset in the global tensor). Ranks that hold the same shard (dp
replicas; tp ranks for replicated tensors) all compute the same writer, greedily balancing bytes (largest
shards first, to the holder with the fewest bytes so far), so no communication is needed to agree.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from hpcscale.layout import ParallelDims


@dataclass(frozen=True, slots=True)
class LocalShard:
    name: str
    tensor: torch.Tensor  # the local data (a DTensor's local tensor)
    global_shape: tuple[int, ...]
    offset: tuple[int, ...]
    tp_sharded: bool  # split across tp ranks (else every tp rank of the stage holds the same data)
    # The tensor as the caller holds it (the Parameter, the DTensor): its identity and version counter say
    # whether it changed. A DTensor's to_local() is a new object each call whose counter never moves.
    source: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


def local_shards(tensors: dict[str, torch.Tensor]) -> list[LocalShard]:
    """Every named tensor's local piece with its global placement; DTensors through their placements."""
    out = []
    for name, t in tensors.items():
        if hasattr(t, "to_local"):
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

            _, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
            # The local tensor itself, as torch's own checkpointing reads it: to_local() is an autograd call
            # (0.1 ms each, 40 of them in the save call) for a view that is detached and copied anyway.
            local = getattr(t, "_local_tensor", None)
            local = t.to_local() if local is None else local
            sharded = any(p.is_shard() for p in t.placements)
            out.append(LocalShard(name, local, tuple(t.shape), tuple(offset), sharded, source=t))
        else:
            out.append(LocalShard(name, t, tuple(t.shape), (0,) * t.dim(), False, source=t))
    return out


def writer_of(shard: LocalShard, table: dict[tuple, int], *, tp_rank: int) -> int:
    return table[(shard.name, tp_rank if shard.tp_sharded else None)]


def writers(shards: list[LocalShard], dims: ParallelDims, *, pp_rank: int) -> dict[tuple, int]:
    """(name, tp index, or None for a tensor replicated over tp) -> the global rank that writes it.

    Computed from what every rank of the stage knows alike (names, global shapes, degrees), never from the
    local pieces, so all holders of a shard agree on its writer without talking."""
    load: dict[int, int] = defaultdict(int)
    out: dict[tuple, int] = {}

    def rank(dp: int, tp: int) -> int:
        return dims.rank(pp=pp_rank, dp=dp, tp=tp)

    items = []
    for s in shards:
        total = s.tensor.element_size() * _numel(s.global_shape)
        if s.tp_sharded:
            items += [((s.name, t), total // dims.tp, [rank(d, t) for d in range(dims.dp)]) for t in range(dims.tp)]
        else:
            items.append(((s.name, None), total, [rank(d, t) for d in range(dims.dp) for t in range(dims.tp)]))
    for key, nbytes, holders in sorted(items, key=lambda i: (-i[1], i[0][0], -1 if i[0][1] is None else i[0][1])):
        chosen = min(holders, key=lambda r: (load[r], r))
        load[chosen] += nbytes
        out[key] = chosen
    return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
