"""`hpcscale ckpt export`: one consolidated model (full tensors, model weights only) for inference."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from hpcscale.ckpt.format import INDEX, read_index
from hpcscale.ckpt.ops import data_file_problem
from hpcscale.ckpt.reader import ChunkReader, read_shard_region, torch_dtype
from hpcscale.errors import BadInput, VerificationFailure


def consolidated(step_dir: Path, *, prefix: str = "model/") -> dict[str, torch.Tensor]:
    """Every `prefix` tensor whole, every chunk's hash checked; VerificationFailure (exit 3) before anything is
    written when the index or a chunk fails."""
    index = read_index(step_dir / INDEX)
    problem = data_file_problem(step_dir.parent, index)  # before allocating what the chunks claim to hold
    if problem:
        raise VerificationFailure(f"{step_dir}: {problem}")
    reader = ChunkReader(step_dir.parent)
    out = {}
    try:
        for name, rec in sorted(index.tensors.items()):
            if not name.startswith(prefix):
                continue
            # read_index proved the shards tile the tensor; counted again here because an element no shard
            # writes would go out as whatever torch.empty left in memory
            covered = sum(math.prod(s.shape) for s in rec.shards)
            if covered != math.prod(rec.global_shape):
                raise VerificationFailure(
                    f"tensor {name}: its shards cover {covered} of {math.prod(rec.global_shape)} elements"
                )
            t = torch.empty(rec.global_shape, dtype=torch_dtype(rec.dtype))
            for s in rec.shards:
                hi = [o + n for o, n in zip(s.offset, s.shape, strict=True)]
                t[tuple(slice(o, h) for o, h in zip(s.offset, hi, strict=True))] = read_shard_region(
                    reader, name, s, t.dtype, list(s.offset), hi
                )
            out[name.removeprefix(prefix)] = t
    finally:
        reader.close()
    return out


def export(step_dir: Path, fmt: str, out: Path) -> dict:
    tensors = consolidated(step_dir)
    if fmt == "torch":
        torch.save(tensors, out)
    elif fmt == "safetensors":
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in tensors.items()}, str(out))
    else:
        raise BadInput(f"unknown export format '{fmt}' (torch, safetensors)")
    return {
        "out": str(out),
        "format": fmt,
        "tensors": len(tensors),
        "parameters": sum(t.numel() for t in tensors.values()),
    }
