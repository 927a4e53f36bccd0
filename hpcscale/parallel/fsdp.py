"""Sharded data parallelism with torch's FSDP2 (`fully_shard`), and activation checkpointing, for any model.

The one place a model's parameters are sharded: `ctx.parallelize` calls `shard_model`, for a user's model and
the built-in trainer's alike. With parallel.dp_shard > 1 each block (the model's `layers`, or the blocks the
caller names) is wrapped with `fully_shard`, then the root, over the data-parallel mesh: `mesh["dp_shard"]` when
every dp rank shards (ZeRO-3), `mesh["dp_replicate", "dp_shard"]` for HSDP (sharded within a group, replicated
across). Parameters become DTensors sharded on dim 0 over the shard group; a tensor-parallel plan applied before
keeps its own placements on the tp dimension (torch composes the two, as its FSDP + TP tutorial does). Each
block's parameters are all-gathered just before its forward and freed after it (`reshard_after_forward`),
gradients are reduce-scattered as backward produces them, and the optimizer steps only the rank's shard. Nothing
here is a replacement: FSDP2 runs on CPU with gloo as it does on GPUs with NCCL.

Mixed precision (`parallel.mixed_precision`): `bf16` gathers parameters in bf16 and reduces gradients in fp32
(torch's MixedPrecisionPolicy); the sharded parameters the optimizer updates stay fp32. A model FSDP does not
shard (dp_shard = 1) computes its forward under torch.autocast(bf16) instead, its parameters, gradients and
their all-reduce fp32; either way the model's output comes back fp32. `auto` is bf16 on CUDA and fp32 on CPU,
where bf16 matmuls are slow and gain nothing.

Activation checkpointing uses torch's composable `checkpoint` per block: it recomputes the block's forward in
backward and, unlike a wrapper module, leaves parameter names alone, so checkpoints and exports still name the
tensors as the model does.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from hpcscale.errors import BadInput
from hpcscale.layout import ParallelDims


def default_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of `model`: the entries of its `layers` (a ModuleList or ModuleDict), else of every
    ModuleList/ModuleDict among its direct children (or their direct children: `model.model.layers`, as Hugging
    Face decoders nest them). Empty when there are none: the root alone is then sharded, as one unit."""
    for owner in (model, *model.children()):
        found = [
            block
            for child in owner.children()
            if isinstance(child, nn.ModuleList | nn.ModuleDict)
            for block in (child.values() if isinstance(child, nn.ModuleDict) else child)
        ]
        if found:
            return found
    return []


def computes_in_bf16(setting: str, device: torch.device) -> bool:
    """Whether `parallel.mixed_precision` `setting` means bf16 compute on `device` (`auto`: on a GPU)."""
    return setting == "bf16" or (setting == "auto" and device.type == "cuda")


class _Autocast:
    """Forward hooks that run a module's forward under torch.autocast(bf16) and give its floating outputs back as
    `output_dtype`: fp32 for a whole model or a pipeline's last stage (the loss is taken from it), bf16 for the
    stages before, whose outputs are sent to the next stage (half the bytes of fp32). Hooks rather than a replaced
    `forward`: the module's own forward, names and state are untouched, and a deep copy (an EMA model) or a pickled
    model carries them as they are. The post-hook runs even when forward raises (always_call), so autocast never
    stays on. torch.compile runs the hooks themselves eagerly (compiler.disable: dynamo cannot trace a context
    entered in one hook and left in another) and traces the forward between them under the autocast they set."""

    eager = False  # enter and exit wrapped by torch.compiler.disable (_eager, at first use)

    output_dtype = torch.float32  # the class default: hooks pickled before there was a choice

    def __init__(self, device_type: str, output_dtype: torch.dtype = torch.float32):
        _eager()
        self.device_type = device_type
        self.output_dtype = output_dtype
        self._active: list[Any] = []

    def __setstate__(self, state: dict) -> None:  # a pickled or deep-copied model's hooks: eager as well
        _eager()
        self.__dict__.update(state)

    def enter(self, module: nn.Module, args: Any) -> None:
        ctx = torch.autocast(self.device_type, dtype=torch.bfloat16)
        ctx.__enter__()
        self._active.append(ctx)

    def exit(self, module: nn.Module, args: Any, output: Any) -> Any:
        if self._active:
            self._active.pop().__exit__(None, None, None)
        from torch.utils._pytree import tree_map_only

        dtype = self.output_dtype
        floating = (torch.bfloat16, torch.float32)
        return tree_map_only(torch.Tensor, lambda t: t.to(dtype) if t.dtype in floating else t, output)


def _eager() -> None:
    """Wrap _Autocast's hooks in torch.compiler.disable, once: at first use rather than at import, since it
    imports dynamo (over a second), which a script importing this module may never need."""
    if not _Autocast.eager:
        _Autocast.enter = torch.compiler.disable(_Autocast.enter)  # type: ignore[method-assign]
        _Autocast.exit = torch.compiler.disable(_Autocast.exit)  # type: ignore[method-assign]
        _Autocast.eager = True


def autocast_forward(model: nn.Module, device: torch.device, *, last_stage: bool = True) -> None:
    """bf16 compute for a model FSDP does not shard: its forward runs under torch.autocast(bf16) on `device`'s
    type, its floating outputs are cast to fp32 (as FSDP's root policy casts them; bf16 on a pipeline stage
    before the last), and its parameters stay fp32. Forward hooks on `model` (_Autocast)."""
    hooks = _Autocast(device.type, torch.float32 if last_stage else torch.bfloat16)
    model.register_forward_pre_hook(hooks.enter)
    model.register_forward_hook(hooks.exit, always_call=True)


def resolve_reshard(setting: bool | str, *, pp: int) -> bool:
    """parallel.reshard_after_forward as FSDP2 takes it: `auto` is true at pp = 1 and false with pp > 1. A
    pipeline stage runs several micro-batches' forwards before their backwards; resharding after each forward
    would all-gather every block once per micro-batch in forward and again in backward, where keeping the
    gathered parameters costs one gather per block per step (torchtitan turns it off under pp likewise)."""
    if setting == "auto":
        return pp == 1
    return bool(setting)


def mixed_precision_policy(setting: str, device: torch.device, *, root: bool = False):
    """bf16 parameters and compute and fp32 gradient reductions, or none; `root`: the policy of the unit at the
    model's root, whose output (the logits: the loss is taken from them) is cast to fp32 (a pipeline stage
    before the last is not given it: its bf16 output is what it sends to the next stage). A block's output stays
    bf16: the root's own layers after the blocks (a final norm, the head) hold bf16 parameters, and a norm
    refuses an fp32 input with bf16 weights (the reference GPT's final norm would fail at its first step).
    `auto` is bf16 on a GPU; the built-in trainer resolves it with its own `bf16` param first."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if computes_in_bf16(setting, device):
        return MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32 if root else None
        )
    return MixedPrecisionPolicy()


def data_parallel_mesh(mesh: Any, dims: ParallelDims) -> Any:
    """The mesh FSDP2 shards over: 1-D over the shard group, or 2-D (replicate, shard) for HSDP."""
    return mesh["dp_shard"] if dims.dp_replicate == 1 else mesh["dp_replicate", "dp_shard"]


def resolve_blocks(model: nn.Module, blocks: Any) -> list[nn.Module]:
    """The units to shard (and checkpoint activations of), in forward order, from what the caller gave: None
    (default_blocks), a module class (every submodule of that class, outermost only: a block's own sub-blocks
    of the same class stay in it), names of submodules ("layers.0", "model.layers.3"), or the modules
    themselves. BadInput names what does not resolve."""
    if blocks is None:
        return default_blocks(model)
    if isinstance(blocks, type):
        found: list[nn.Module] = []
        inside: set[int] = set()
        for m in model.modules():
            if id(m) in inside or m is model or not isinstance(m, blocks):
                continue
            found.append(m)
            inside.update(id(sub) for sub in m.modules())
        if not found:
            raise BadInput(f"blocks={blocks.__name__}: the model has no submodule of that class")
        return found
    if isinstance(blocks, str):
        blocks = [blocks]
    out = []
    for b in blocks:
        if isinstance(b, str):
            try:
                out.append(model.get_submodule(b))
            except AttributeError:
                raise BadInput(f"blocks: the model has no submodule {b!r}") from None
        elif isinstance(b, nn.Module):
            out.append(b)
        else:
            raise BadInput(f"blocks: {b!r} is neither a submodule nor a submodule's name")
    inside_model = {id(m) for m in model.modules()}
    stray = [b for b in out if id(b) not in inside_model or b is model]
    if stray:
        raise BadInput(f"blocks: {len(stray)} of the given blocks are not submodules of the model")
    return out


def checkpoint_activations(blocks: Iterable[nn.Module]) -> None:
    from torch.distributed._composable import checkpoint

    for block in blocks:
        checkpoint(block)


def shard_model(
    model: nn.Module,
    *,
    mesh: Any,
    dims: ParallelDims,
    device: torch.device,
    blocks: Any = None,
    reshard_after_forward: bool = True,
    mixed_precision: str = "auto",
    activation_checkpointing: bool = False,
    last_stage: bool = True,
) -> nn.Module:
    """Apply activation checkpointing (when asked) and, when dims.dp_shard > 1, FSDP2 per block and at the
    root over the job's data-parallel mesh (otherwise bf16 `mixed_precision` is an autocast forward). In place;
    returns `model`. The model must already be on `device` with any tensor-parallel plan applied, and (for
    pp > 1) be this rank's pipeline stage; `last_stage` false for a stage before the last, whose output
    stays bf16 under bf16 mixed precision."""
    blocks = resolve_blocks(model, blocks)
    if activation_checkpointing:
        checkpoint_activations(blocks)
    if not dims.sharded:
        if computes_in_bf16(mixed_precision, device):
            autocast_forward(model, device, last_stage=last_stage)
        return model
    from torch.distributed.fsdp import fully_shard

    dp_mesh = data_parallel_mesh(mesh, dims)
    policy = mixed_precision_policy(mixed_precision, device)
    for i, block in enumerate(blocks):
        # The last block's parameters are needed again at once by backward: keeping them saves an all-gather.
        fully_shard(
            block,
            mesh=dp_mesh,
            reshard_after_forward=reshard_after_forward and i < len(blocks) - 1,
            mp_policy=policy,
        )
    root_policy = mixed_precision_policy(mixed_precision, device, root=last_stage)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard_after_forward, mp_policy=root_policy)
    return model


def reshard(model: nn.Module) -> None:
    """Put every FSDP2 unit of `model` back in its sharded state (a no-op for a model FSDP does not shard).

    A forward without backward (evaluation under no_grad) leaves the units that do not reshard after forward
    (the last block; every one with reshard_after_forward false) holding their gathered parameters, and while a
    unit is unsharded its module attributes are the full tensors, not the sharded DTensors the optimizer
    holds. Whatever reads parameters by name (a checkpoint's state) calls this first."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


class ShardedSync:
    """The gradient-sync interface ctx.parallelize attaches (hpcscale.parallel.grad_sync.GradSync's begin,
    finish, no_sync and timing) for a model FSDP2 shards: FSDP reduce-scatters during backward itself. Inside no_sync()
    backward only accumulates (FSDP's set_requires_gradient_sync(False)); the next backward outside reduces."""

    comm_wait_s = 0.0
    comm_wait_total_s = 0.0

    def __init__(self, model: nn.Module, *, replicas: int = 1, pipeline: bool = False):
        self.model = model
        self.replicas = replicas  # dp_replicate: HSDP's replica groups, all-reduced across after each reduce-scatter
        self.pipeline = pipeline  # a pipeline stage: its schedule drives FSDP's reductions, accumulate() leaves them

    def begin(self, accumulation_steps: int) -> None:
        pass

    def finish(self) -> None:
        pass

    def no_sync(self):
        import contextlib

        @contextlib.contextmanager
        def off():
            self.model.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                self.model.set_requires_gradient_sync(True)

        return off()

    def accumulate(self):
        """A step's micro-batches before its last (Context.accumulate): under HSDP each backward still
        reduce-scatters within its shard group, so gradients stay sharded, but the all-reduce across replicas
        waits for the last micro-batch (FSDP2's set_requires_all_reduce), once per step instead of once per
        micro-batch. Without replicas there is nothing to defer: FSDP reduce-scatters every micro-batch. Nor on a
        pipeline stage, whose schedule accumulates its micro-batches and reduces once per step itself: deferring
        the all-reduce around a whole pipe.step() would skip it."""
        import contextlib

        @contextlib.contextmanager
        def deferred():
            defer = self.replicas > 1 and not self.pipeline
            if defer:
                self.model.set_requires_all_reduce(False)
            try:
                yield
            finally:
                if defer:
                    self.model.set_requires_all_reduce(True)

        return deferred()
