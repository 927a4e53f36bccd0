"""Models bigger than one rank's memory: built on the meta device, placed, then initialized shard by shard.

A model built whole on every rank before it is sharded needs the whole model's memory on every rank for a
moment, which is exactly what sharding is for avoiding. Built under `torch.device("meta")` instead, its
parameters have shapes and no storage; `ctx.parallelize` applies the tensor-parallel plan and FSDP2 to the
meta model (torch supports both), allocates only each rank's shards (`to_empty`), and then `materialize`
fills them: per parameter, the full tensor is made on the CPU and initialized, this rank's piece is copied
into its shard, and the full tensor is dropped. A rank's peak is its shards plus one module's own parameters in full.

Initialization is seeded by name: before a module's parameters are initialized, torch's global RNG is seeded
from (seed, the module's qualified name). A parameter's initial value therefore depends on neither the order of
initialization, nor which pipeline stage kept it, nor the layout: a model built on meta and materialized
under any (pp, dp, tp) has bitwise the weights of the same model built whole with `initialize` on one process,
and every data-parallel replica holds the same weights without a broadcast.

For each module, children before parents (the order `model.apply` uses), its own `reset_parameters()` runs
first when it has one (what construction would have done: LayerNorm's ones and zeros), then the caller's
`init(module)` (what `model.apply(init)` would do). Values are drawn on the CPU whatever the device, so a model
materialized on a GPU equals the CPU-built one; the cost is that every rank draws the full values of every
parameter it holds a piece of (its pipeline stage's), one parameter at a time.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterator

import torch
from torch import nn

from hpcscale.errors import BadInput

# the public API (docs/context-api.md, docs/huggingface.md, docs/checkpoint-format.md): what user code imports
__all__ = ["initialize", "materialize"]

Init = Callable[[nn.Module], None]


def module_seed(seed: int, name: str) -> int:
    """The RNG seed of the module called `name` ("" for the root) in a model initialized from `seed`."""
    digest = hashlib.sha256(f"{seed}\0{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _post_order(module: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    for name, child in module.named_children():
        yield from _post_order(child, f"{prefix}.{name}" if prefix else name)
    yield prefix, module


def on_meta(model: nn.Module) -> bool:
    """Whether `model` was built on the meta device: every parameter and buffer (BadInput when only some are,
    which to_empty would silently leave half uninitialized)."""
    tensors = list(model.parameters()) + list(model.buffers())
    meta = [t.is_meta for t in tensors]
    if any(meta) and not all(meta):
        names = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if not t.is_meta][:3]
        raise BadInput(
            f"ctx.parallelize: the model is partly on the meta device ({sum(meta)} of {len(meta)} tensors; "
            f"{', '.join(names)} are not): build it wholly under torch.device('meta') or wholly on a real device"
        )
    return bool(meta) and all(meta)


def _run_init(module: nn.Module, init: Init | None, seed: int, name: str) -> None:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(module_seed(seed, name))
        reset = getattr(module, "reset_parameters", None)
        if callable(reset):
            reset()
        if init is not None:
            init(module)


def initialize(model: nn.Module, init: Init | None, *, seed: int) -> None:
    """Initialize a model built on the CPU, in place, exactly as `materialize` initializes the same model built
    on meta: the single-process reference of a meta-built model (and a model's own constructor, as the
    reference GPT's is). On the CPU because that is where the seeded draws are defined (BadInput otherwise)."""
    elsewhere = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.device.type != "cpu"][:3]
    if elsewhere:
        raise BadInput(f"initialize: {', '.join(elsewhere)} are not on the CPU; build the model there, then move it")
    with torch.no_grad():
        for name, module in _post_order(model):
            _run_init(module, init, seed, name)


def _local(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's piece of `full` (on the CPU) for the (possibly DTensor) parameter `like`: a slice, no
    communication (src_data_rank=None: every rank drew the same values). On a GPU the full tensor is moved to
    the device first, as distribute_tensor wants it on the mesh's device type: one module's parameters in full
    on the device for a moment. (CPU and gloo prove this here; the CUDA path is the same calls on a CUDA mesh,
    not yet run on a GPU.)"""
    if hasattr(like, "device_mesh"):
        from torch.distributed.tensor import distribute_tensor

        full = full.to(like.device)
        return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None).to_local()
    return full


def _nan_like(p: torch.Tensor) -> nn.Parameter:
    """A full-size CPU stand-in for parameter `p` (a DTensor's global shape), NaN until initialized."""
    return nn.Parameter(torch.full(p.shape, math.nan, dtype=p.dtype), requires_grad=False)


def materialize(model: nn.Module, init: Init | None, *, seed: int, device: torch.device) -> None:
    """Give a meta-built, already placed (tp plan, FSDP2) model storage on `device` for its own shards only,
    and initialize them: bitwise what `initialize(model built whole, init, seed=seed)` holds at the same
    places. BadInput names the parameter or floating-point buffer that neither reset_parameters nor `init`
    set (they start as NaN, which is how a forgotten one is found)."""
    from hpcscale.parallel.ties import find_ties, retie

    ties = find_ties(model)
    model.to_empty(device=device)  # a tie whose tensor changes device comes back as one tensor per module
    retie(model, ties, why="ctx.parallelize")
    # a tied parameter's full values as its earlier owner left them: the next owner's init starts from them, as
    # in the model built whole, where each owner's init writes the one tensor in turn (the last one's values win)
    tied = {id(model.get_parameter(names[0])) for names in ties}
    drawn: dict[int, nn.Parameter] = {}  # tied parameters only: the rest are dropped after their module's init
    with torch.no_grad():
        for name, module in _post_order(model):
            own = dict(module.named_parameters(recurse=False))
            bufs = {k: b for k, b in module.named_buffers(recurse=False) if b.is_floating_point()}
            if not own and not bufs and init is None:
                continue
            for b in bufs.values():
                b.fill_(math.nan)
            full = {k: drawn[id(p)] if id(p) in drawn else _nan_like(p) for k, p in own.items()}
            drawn.update({id(p): full[k] for k, p in own.items() if id(p) in tied})
            for k, t in full.items():
                module._parameters[k] = t
            try:
                _run_init(module, init, seed, name)
            finally:
                for k, p in own.items():
                    module._parameters[k] = p
            for k, p in own.items():
                where = f"{name}.{k}" if name else k
                if torch.isnan(full[k]).any():
                    raise BadInput(f"ctx.parallelize: init left parameter {where} (partly) unset")
                target = p.to_local() if hasattr(p, "to_local") else p
                target.copy_(_local(full[k].data, p))
            for bname, b in bufs.items():
                if torch.isnan(b).any():
                    where = f"{name}.{bname}" if name else bname
                    raise BadInput(
                        f"ctx.parallelize: init left buffer {where} unset (to_empty leaves buffers uninitialized: "
                        "init must compute them)"
                    )
