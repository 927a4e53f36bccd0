"""Whether a tensor-parallel plan fits the model, decided before torch splits anything.

torch shards a parameter whose split dim the tp degree does not divide unevenly and says nothing; what breaks
is later, inside the first forward: a column-parallel layer hands its output on as a local tensor, and the next
tensor-parallel layer (or an attention's `view(..., -1, head_dim)`) takes that local tensor for an even
share of the whole (DTensor.from_local): "a and b must have same reduction dim", "shape '[4, 3, -1, 6]' is
invalid". So, for every module the plan names (keys matched as torch's parallelize_module matches them, `*`
per dotted part), with degree tp:

- ColwiseParallel whose output stays sharded and local (its default; not output_layouts=Replicate(), not
  use_local_output=False): the split dim must divide by tp: a Linear's weight dim 0 (out_features), an
  Embedding's weight dim 1 (embedding_dim);
- RowwiseParallel on a Linear taking a sharded input (its default input_layouts=Shard(-1)): weight dim 1
  (in_features), which must match the sharded activation it is handed;
- a column-parallel Linear inside a module with an integer `head_dim` (an attention: hpcscale's GPT, Hugging
  Face's q/k/v projections, query and key-value heads alike) must leave each tp rank whole heads:
  out_features must divide by tp x head_dim.

What is not checked, because it works: a row-parallel Embedding (its vocabulary dim split unevenly: the output
is reduced from partial sums), a column-parallel layer whose output is gathered (Replicate) or kept as a
DTensor, a row-parallel layer given a replicated input. Data-parallel sharding adds no rule: FSDP2 shards each
rank's tensor-parallel slice on dim 0 and pads an uneven split itself (forward, backward, the optimizer step, a
save and a resharded load ran at tp 2 x dp_shard 4 with a one-row slice). Styles other than torch's two
(SequenceParallel, PrepareModule*, a user's own) split no parameter this can see, and are left alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatch
from typing import Any

from torch import nn

from hpcscale.errors import BadInput

MAX_LISTED = 8  # problems named in one refusal; the rest counted


def listed(lines: list[str], limit: int = MAX_LISTED) -> list[str]:
    """The first `limit` of `lines`, then `... and N more`: what one refusal names."""
    return lines[:limit] + ([f"... and {len(lines) - limit} more"] if len(lines) > limit else [])


@dataclass(frozen=True, slots=True)
class SplitProblem:
    """One parameter the plan would split in a way the first forward cannot run."""

    module: str  # dotted name in the model ("" is the root)
    style: str  # ColwiseParallel, RowwiseParallel
    param: str  # weight, bias
    dim: int  # the tensor dim split over the tp mesh axis
    size: int
    need: str  # what the size must be a multiple of, in words

    def line(self, tp: int) -> str:
        name = f"{self.module}.{self.param}" if self.module else self.param
        return (
            f"{name}: {self.style} splits dim {self.dim} (size {self.size}) over the tp axis (degree {tp}); {self.need}"
        )


def _matches(name: str, key: str) -> bool:
    """Whether module `name` is what plan key `key` names (parallelize_module: fnmatch per dotted part)."""
    parts, atoms = name.split(".") if name else [], key.split(".") if key else []
    return len(parts) == len(atoms) and all(fnmatch(p, a) for p, a in zip(parts, atoms, strict=True))


def _sharded_local_output(style: Any) -> bool:
    from torch.distributed.tensor import Shard

    layouts = getattr(style, "output_layouts", None) or ()
    return getattr(style, "use_local_output", True) and any(isinstance(p, Shard) for p in layouts)


def _sharded_input(style: Any) -> bool:
    from torch.distributed.tensor import Shard

    return any(isinstance(p, Shard) for p in getattr(style, "input_layouts", None) or ())


def problems(model: nn.Module, plan: Any, *, tp: int) -> list[SplitProblem]:
    """Every split `plan` (a dict of module name pattern -> ParallelStyle, or one style for the root) would make
    of `model`'s parameters at degree `tp` that the first forward could not run (module docstring)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if tp <= 1:
        return []
    entries = plan.items() if isinstance(plan, dict) else [("", plan)]
    modules = dict(model.named_modules(remove_duplicate=False))
    found: list[SplitProblem] = []
    for key, style in entries:
        for name, module in modules.items():
            if not _matches(name, key):
                continue
            kind = type(style).__name__
            weight = getattr(module, "weight", None)
            if weight is None or not hasattr(weight, "shape") or weight.dim() != 2:
                continue
            if isinstance(style, ColwiseParallel) and _sharded_local_output(style):
                dim = 0 if isinstance(module, nn.Linear) else 1 if isinstance(module, nn.Embedding) else None
                if dim is None:
                    continue
                size = int(weight.shape[dim])
                if size % tp:
                    found.append(SplitProblem(name, kind, "weight", dim, size, f"{size} is not a multiple of {tp}"))
                    continue
                head_dim = _head_dim(modules, name) if isinstance(module, nn.Linear) else None
                if head_dim and size % (tp * head_dim):
                    heads = f"{size / head_dim:g} heads of head_dim {head_dim}"
                    found.append(
                        SplitProblem(
                            name,
                            kind,
                            "weight",
                            dim,
                            size,
                            f"that is {heads} (the head_dim of {name.rpartition('.')[0] or 'the model'}): each tp "
                            f"rank must hold whole heads, so the heads must be a multiple of {tp}",
                        )
                    )
            elif isinstance(style, RowwiseParallel) and isinstance(module, nn.Linear) and _sharded_input(style):
                size = int(weight.shape[1])
                if size % tp:
                    found.append(SplitProblem(name, kind, "weight", 1, size, f"{size} is not a multiple of {tp}"))
    return found


def _head_dim(modules: dict[str, nn.Module], name: str) -> int | None:
    parent = modules.get(name.rpartition(".")[0]) if name else None
    value = getattr(parent, "head_dim", None)
    return value if type(value) is int and value > 0 else None


def check_plan(model: nn.Module, plan: Any, *, tp: int) -> None:
    """BadInput (exit 2, at start on every rank) naming each parameter `plan` would split so that the first
    forward fails: its module, the dim, its size, the tp axis's degree and what the size must divide by."""
    found = problems(model, plan, tp=tp)
    if not found:
        return
    lines = listed([p.line(tp) for p in found])
    raise BadInput(
        f"ctx.parallelize: the tp_plan does not fit the model at parallel.tp = {tp} (torch would split these "
        "unevenly and the first forward would fail inside it):\n  "
        + "\n  ".join(lines)
        + "\nChoose sizes that tp divides, a tp that divides them, or leave these modules out of the plan "
        "(docs/context-api.md)"
    )
