"""Whether the parameters tensor parallelism leaves whole get the same gradient on every tp rank: checked once.

A parameter the tp plan does not split is replicated over the tp mesh axis (hpcscale.parallel.data_parallel's
`replicate_unplanned`): every tp rank holds the same values and is trusted to compute the same gradient, since
each is meant to apply it to the whole activation (a norm of the hidden state, an embedding, a head). A parameter
applied instead to the rank's own share of a split activation (Qwen3's per-head q_norm and k_norm inside a
tp-split attention, a user's per-head scale or bias) gets only that share's part of its gradient, not the sum
over the tp group: the ranks then take different optimizer steps and from the first step on each trains a
different model, with nothing failing. Nothing static can tell the two apart (the module is the same; only where
its input comes from differs), so the gradients themselves are compared, once.

When: at the first optimizer step (torch.optim's global step pre-hook) after each optimizer's first backward,
for the parameters of models given to ctx.parallelize at parallel.tp > 1 that this optimizer steps. That is the
one point every entry point passes through, with gradients final in every layout. The end of backward is not:
replicated data parallelism (GradSync) hooks backward only when dp > 1, FSDP2 (ShardedSync) leaves backward to
torch and its sharded parameters fire no gradient hooks, a pipeline stage's backward runs inside its schedule
(and tied copies are summed after it), and ctx.clip_grad_norm_ is the caller's choice. Before the optimizer step
the data-parallel averaging, FSDP's reduce-scatter, the pipeline's tie sums and any clipping are done, and this
is the last moment before the ranks' weights part. An entry point that updates weights without a torch.optim
optimizer is not checked.

What is compared: per parameter, its local gradient's sum, L1 norm and squared L2 norm (fp32 reductions, as
clip.py takes norms: no fp64 copy of a gradient), with whether it has a gradient and whether those are finite:
(P, 5) values, stacked with their negation and all-reduced with MAX over the tp group once, which gives every
rank the maximum and minimum of each. Then one read back to the host (one sync on a GPU, not one per parameter).
Under FSDP2 each tp peer holds the same dp shard of the parameter, so local shards compare as whole tensors do.
The same inputs through the same kernels give the same bits on one device type; the tolerance (RTOL of the
parameter's L1 norm; 2 RTOL of its squared L2 norm) only absorbs the rounding of a data-parallel all-reduce whose
summation order differs between the tp peers' dp groups (NCCL picks each communicator's ring), while a gradient
computed on a share differs from its peers' by its own order of magnitude. A gradient whose tp placement is
Partial is a sum torch still owes (SequenceParallel's norms): not compared.

After every parameter watched has been checked (or has gone with its model) the hook is removed: nothing runs at
later steps.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from hpcscale.errors import BadInput
from hpcscale.parallel.tp_check import listed

RTOL = 1e-5  # of the parameter's L1 norm; far below what a gradient computed on a share differs by
MAX_LISTED = 5  # parameters named in one refusal; the rest counted


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _tp_placement(t: torch.Tensor) -> Any:
    """The placement of DTensor `t` on the mesh axis named "tp" (None: a plain tensor, or no tp axis)."""
    mesh = getattr(t, "device_mesh", None)
    if mesh is None:
        return None
    names = mesh.mesh_dim_names or ()
    return t.placements[names.index("tp")] if "tp" in names else None


def whole_over_tp(param: torch.Tensor) -> bool:
    """Whether tp leaves `param` whole on every tp rank: a plain tensor, or a DTensor replicated over "tp"."""
    placement = _tp_placement(param)
    return placement is None or placement.is_replicate()


@dataclass(frozen=True, slots=True)
class GradSpread:
    """One parameter whose gradient is not the same on every rank of its tp group."""

    name: str
    why: str  # a gradient on some tp ranks only, finite on some only, or how far apart (relative to its norm)

    def line(self) -> str:
        return f"{self.name} ({self.why})"


SKIP = object()  # in spreads' list: a parameter this rank cannot compare (its gradient's sum is still owed)


def _no_update(optimizer: torch.optim.Optimizer) -> bool:
    """Whether every parameter group's learning rate is 0: a step that changes no weight (torch's
    _init_optim_state, called by get_state_dict and set_state_dict on a fresh optimizer, a warm-up that starts
    at 0). Read on every rank alike: the same optimizer settings everywhere."""
    lrs = [g.get("lr") for g in optimizer.param_groups]
    return bool(lrs) and all(lr is not None and float(lr) == 0.0 for lr in lrs)


def _stats(grads: list, device: torch.device) -> torch.Tensor:
    """(P, 6) fp64 on `device`: has a gradient, finite, sum, L1 norm, squared L2 norm, skipped, per gradient."""
    rows = []
    for g in grads:
        if g is None or g is SKIP:
            row = torch.zeros(6, dtype=torch.float64, device=device)
            row[5] = 1.0 if g is SKIP else 0.0
            rows.append(row)
            continue
        local = _local(g).detach()
        norms = [
            local.sum(dtype=torch.float32),
            torch.linalg.vector_norm(local, 1, dtype=torch.float32),
            torch.linalg.vector_norm(local, 2, dtype=torch.float32),
        ]
        parts = torch.stack(norms).to(device=device, dtype=torch.float64)
        finite = torch.isfinite(parts).all()
        parts = torch.where(finite, parts, 0.0)
        one = torch.ones(1, dtype=torch.float64, device=device)
        zero = torch.zeros(1, dtype=torch.float64, device=device)
        rows.append(torch.cat([one, finite.double().reshape(1), parts[:2], parts[2:].square(), zero]))
    return torch.stack(rows)


def spreads(
    named: list[tuple[str, torch.Tensor | None]], *, group: dist.ProcessGroup, device: torch.device
) -> list[GradSpread]:
    """The gradients of `named` (name, gradient, None, or SKIP: this rank cannot compare it, and so none does)
    that differ across the ranks of `group` beyond the
    tolerance (module docstring). A collective over `group`: every rank passes the same names in the same order.
    One all-reduce, one read back to the host."""
    if not named:
        return []
    table = _stats([g for _, g in named], device)
    both = torch.cat([table, -table]).reshape(-1)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    rows = both.reshape(2, len(named), 6).tolist()  # the one host sync
    found = []
    for (name, _), hi, neg_lo in zip(named, rows[0], rows[1], strict=True):
        lo = [-x for x in neg_lo]
        if hi[5] > 0:
            continue  # some rank's gradient still owes its sum over tp: nothing to compare yet
        if hi[0] != lo[0]:
            found.append(GradSpread(name, "a gradient on some tp ranks, none on others"))
        elif hi[0] == 0 or (hi[1] == 0 and lo[1] == 0):
            continue  # no gradient anywhere, or not finite anywhere: a matter for the loss, not for the layout
        elif hi[1] != lo[1]:
            found.append(GradSpread(name, "finite on some tp ranks, not on others"))
        else:
            l1, l2sq = max(hi[3], 0.0), max(hi[4], 0.0)
            rel = max(
                (hi[2] - lo[2]) / l1 if l1 else 0.0,
                (hi[3] - lo[3]) / l1 if l1 else 0.0,
                (hi[4] - lo[4]) / (2 * l2sq) if l2sq else 0.0,
            )
            if rel > RTOL:
                found.append(GradSpread(name, f"differs by {rel:.2g} of its norm"))
    return found


def refusal(found: list[GradSpread], *, tp: int) -> BadInput:
    """The BadInput naming `found` (up to MAX_LISTED, then a count) and what to do."""
    lines = listed([s.line() for s in found], MAX_LISTED)
    return BadInput(
        f"ctx.parallelize: at parallel.tp = {tp} these parameters, left whole on every tp rank by the tp_plan, got "
        "a different gradient on each tp rank at the first optimizer step:\n  "
        + "\n  ".join(lines)
        + "\nEach is computed on each tp rank's own share of an activation (a per-head norm, scale or bias inside a "
        "tp-split attention, as Qwen3's q_norm), so each rank gets only its share's part of the gradient and would "
        "train a different model. Split them in the tp_plan along the activation's split (or have their gradient "
        "summed over the tp group), or run with parallel.tp = 1 (docs/context-api.md)"
    )


@dataclass(eq=False)
class TpGradCheck:
    """The once-only comparison of whole-over-tp gradients for one rank (module docstring). `watch(model)` after
    ctx.parallelize has placed it; the check runs from torch.optim's global step pre-hook."""

    group: dist.ProcessGroup  # the rank's tp group
    device: torch.device
    tp: int
    # id(parameter) -> (its name, a weak reference to it): a model built again lets the old one go
    _pending: dict[int, tuple[str, Any]] = field(default_factory=dict)
    _seen: Any = field(default_factory=weakref.WeakSet)  # optimizers whose first step was checked
    _handle: Any = None

    def watch(self, model: nn.Module) -> None:
        for name, p in model.named_parameters():
            if p.requires_grad and whole_over_tp(p):
                self._pending[id(p)] = (name, weakref.ref(p))
        if self._pending and self._handle is None:
            self._handle = register_optimizer_step_pre_hook(self._pre_step)

    def forget(self, model: nn.Module) -> None:
        """Stop watching `model`'s parameters (ctx.forget: a model built again replaces it)."""
        for p in model.parameters():
            entry = self._pending.get(id(p))
            if entry is not None and entry[1]() is p:
                del self._pending[id(p)]
        if not self._pending:
            self.close()

    def _pre_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if optimizer in self._seen or _no_update(optimizer):
            return  # a step at learning rate 0 (torch's state_dict helpers make one to create lazy state) is none
        self._seen.add(optimizer)
        named = []
        for group in optimizer.param_groups:
            for p in group["params"]:
                entry = self._pending.get(id(p))
                if entry is None or entry[1]() is not p:
                    continue
                del self._pending[id(p)]
                # every rank compares the same parameters in the same order, whatever its gradients' placements:
                # one whose gradient torch still owes a sum of (Partial, as under SequenceParallel) is skipped
                # by all of them together (spreads)
                placement = _tp_placement(p.grad) if p.grad is not None else None
                owed = placement is not None and not placement.is_replicate()
                named.append((entry[0], SKIP if owed else p.grad))
        self._pending = {k: v for k, v in self._pending.items() if v[1]() is not None}
        if not self._pending:
            self.close()
        found = spreads(named, group=self.group, device=self.device)
        if found:
            raise refusal(found, tp=self.tp)

    def close(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
