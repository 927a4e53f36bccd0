"""What a rank holds and what it writes: local shards of named tensors, placed in global coordinates, and
the deterministic choice of the one rank that writes each distinct shard.

A shard is identified by (tensor name, offset in the global tensor). Every rank of a pipeline stage works out, for
each tensor, which piece every other rank of the stage holds: a plain tensor is the same on all of them; a DTensor's
piece follows from its placements and the rank's coordinates on its mesh's named dimensions (any layout axis or dp:
ParallelDims.mesh_index), whatever other dimensions the rank has are replicas. The ranks that hold the same piece
(dp replicas of a tp shard, the dp_replicate groups of an FSDP shard) all compute the same writer, greedily
balancing bytes (largest shards first, to the holder with the fewest bytes so far), so no communication is needed to
agree, and every rank writes only pieces it holds: a sharded model's state is never gathered to one rank. Empty
pieces (FSDP's last ranks when a dimension does not divide) are not written.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from functools import lru_cache

import torch

from hpcscale.errors import BadInput
from hpcscale.layout import ParallelDims


@dataclass(frozen=True, slots=True)
class LocalShard:
    name: str
    tensor: torch.Tensor  # the local data (a DTensor's local tensor)
    global_shape: tuple[int, ...]
    offset: tuple[int, ...]
    # The tensor as the caller holds it (the Parameter, the DTensor): a DTensor's mesh and placements say which
    # ranks hold the same piece (writers()).
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
            # (one per tensor, on the save's critical path) for a view that is detached and copied anyway.
            local = getattr(t, "_local_tensor", None)
            local = t.to_local() if local is None else local
            out.append(LocalShard(name, local, tuple(t.shape), tuple(offset), source=t))
        else:
            out.append(LocalShard(name, t, tuple(t.shape), (0,) * t.dim(), source=t))
    return out


@lru_cache(maxsize=1 << 18)  # a few distinct shapes x every coordinate of a 4096-rank mesh
def _piece(global_shape: tuple, mesh_shape: tuple, coord: tuple, placements: tuple) -> tuple[tuple, tuple]:
    """(local shape, global offset) of the piece at `coord` of a DTensor's mesh (torch's own rule, uneven and
    strided sharding included: what compute_local_shape_and_global_offset gives that rank)."""
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    shape, offset = _compute_local_shape_and_global_offset(global_shape, mesh_shape, list(coord), placements)
    return tuple(shape), tuple(offset)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def writers(shards: list[LocalShard], dims: ParallelDims, *, pp_rank: int) -> dict[tuple, int]:
    """(name, global offset) -> the global rank that writes that piece, for every non-empty piece any rank of
    stage `pp_rank` holds of the named tensors in `shards`.

    Computed from what every rank of the stage knows alike (names, global shapes, placements, degrees), never
    from the local data, so all holders of a piece agree on its writer without talking."""
    stage = [r for r in range(dims.world_size) if dims.coords(r).pp == pp_rank]  # in rank order, as before
    where = {r: dims.mesh_index(r) for r in stage}
    load: dict[int, int] = defaultdict(int)
    out: dict[tuple, int] = {}
    items = []
    for s in shards:
        elt = s.tensor.element_size()
        t = s.source
        if t is None or not hasattr(t, "device_mesh"):
            if _numel(s.global_shape):
                items.append(((s.name, (0,) * len(s.global_shape)), elt * _numel(s.global_shape), stage))
            continue
        names = t.device_mesh.mesh_dim_names
        if not names or any(n not in where[stage[0]] for n in names):
            raise BadInput(
                f"checkpoint tensor {s.name}: a DTensor on a mesh with dimensions {names}; hpcscale checkpoints "
                f"tensors laid out over the job's mesh (ctx.mesh: {', '.join(where[stage[0]])})"
            )
        mesh_shape = tuple(t.device_mesh.mesh.shape)
        placements = tuple(t.placements)
        holders: dict[tuple, list[int]] = defaultdict(list)
        sizes: dict[tuple, int] = {}
        for r in stage:
            shape, offset = _piece(s.global_shape, mesh_shape, tuple(where[r][n] for n in names), placements)
            holders[offset].append(r)
            sizes[offset] = _numel(shape)
        for offset, ranks in holders.items():
            if sizes[offset]:
                items.append(((s.name, offset), elt * sizes[offset], ranks))
    for key, nbytes, ranks in sorted(items, key=lambda i: (-i[1], i[0])):
        chosen = ranks[0] if len(ranks) == 1 else min(ranks, key=lambda r: (load[r], r))
        load[chosen] += nbytes
        out[key] = chosen
    return out


def mine(shards: list[LocalShard], table: dict[tuple, int], rank: int) -> list[LocalShard]:
    """The pieces of `shards` (this rank's) that `rank` writes."""
    return [s for s in shards if s.tensor.numel() and table.get((s.name, s.offset)) == rank]
