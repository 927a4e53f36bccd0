"""Tied parameters: one parameter that a model reaches under several names (an embedding and its output head, as
Llama 3.2, Qwen2.5, GPT-2 and Gemma have by default), kept one parameter at every layout.

Found from the model itself: `named_parameters(remove_duplicate=False)` lists a parameter once per name it has,
so a tie is any parameter object listed under more than one name. What would otherwise untie them:

- tensor parallelism: `parallelize_module` gives each planned module its own new DTensor parameter. `retie`
  points every name of a tie back at one of them when the plan placed them alike (an embedding split by rows and
  a head split by columns both shard the [vocab, dim] weight on dim 0), and refuses the model otherwise (BadInput
  naming the pair and both placements): a tie split two ways cannot be one parameter;
- a model built on the meta device: `to_empty` gives each module a new tensor when the device changes
  (hpcscale.parallel.init.materialize re-ties them before initializing; FSDP2 keeps its own ties);
- pipeline parallelism: the first stage keeps the embedding and the last the head, each in its own process.
  `cut_stage` records every tie that the cut spreads over several stages (`StageTie`), and ctx.parallelize makes
  them one parameter in value: the copies start from the value the whole model would have (broadcast from the
  stage whose module the whole model initializes last, as hpcscale.parallel.init.initialize does), and after each
  pipeline step the copies' gradients are summed over the stages that hold them (the group of those stages at
  the same data- and tensor-parallel position), as Megatron-LM does for its embedding group. The same gradient
  and the same optimizer arithmetic keep the copies bitwise equal; the global norm counts the tied gradient once
  (on the lowest stage holding it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from hpcscale.errors import BadInput

STAGE_TIES = "_hpcscale_stage_ties"  # the attribute cut_stage leaves on a cut model: list[StageTie]


def find_ties(model: nn.Module) -> list[tuple[str, ...]]:
    """Every parameter `model` reaches under more than one name: its names, in named_parameters order."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return [tuple(n) for n in names.values() if len(n) > 1]


def _post_order_names(module: nn.Module, prefix: str = "") -> list[str]:
    """Module names in the order initialization visits them, children first (hpcscale.parallel.init's order)."""
    out = []
    for name, child in module.named_children():
        out += _post_order_names(child, f"{prefix}.{name}" if prefix else name)
    return [*out, prefix]


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    parent, _, attr = name.rpartition(".")
    return (model.get_submodule(parent) if parent else model), attr


def _placement(p) -> str:
    if hasattr(p, "placements"):
        return f"{tuple(p.placements)} over mesh {p.device_mesh.mesh_dim_names}"
    return "not split"


def retie(model: nn.Module, ties: Sequence[tuple[str, ...]], *, why: str) -> None:
    """Make each tie in `ties` (names in `model`) one parameter again: every name holds its first name's parameter.
    BadInput when two names hold tensors of different shapes or placements (`why`: what placed them)."""
    for names in ties:
        owner, attr = _owner(model, names[0])
        first = owner._parameters[attr]
        for other in names[1:]:
            o_owner, o_attr = _owner(model, other)
            p = o_owner._parameters[o_attr]
            if p is first:
                continue
            if p.shape != first.shape or _placement(p) != _placement(first) or p.dtype != first.dtype:
                raise BadInput(
                    f"{why}: parameters {names[0]} and {other} are one tied parameter in the model, but they were "
                    f"placed differently ({names[0]}: {tuple(first.shape)} {first.dtype}, {_placement(first)}; "
                    f"{other}: {tuple(p.shape)} {p.dtype}, {_placement(p)}): split both modules alike in the "
                    "tensor-parallel plan (an embedding with RowwiseParallel and a head with ColwiseParallel both "
                    "split the weight's rows), or leave both out of it, or untie them in the model"
                )
            o_owner._parameters[o_attr] = first


@dataclass(frozen=True)
class StageTie:
    """A tied parameter that a pipeline cut spreads over several stages. `names`: its names in the whole model;
    `stages`: the stages holding a copy, ascending; `init_stage`: the stage whose module the whole model
    initializes last (its copy's value is the whole model's); `here`: this stage's name for it (None: this stage
    holds none)."""

    names: tuple[str, ...]
    stages: tuple[int, ...]
    init_stage: int
    here: str | None


def _stages_of(name: str, *, layers: str, block_stage: dict[str, int], first: Sequence[str], last: Sequence[str],
               pp: int) -> set[int]:  # fmt: skip
    """The stages a whole-model parameter name is kept on by cut_stage."""
    prefix = layers + "."
    if name.startswith(prefix):
        key = name[len(prefix) :].split(".", 1)[0]
        return {block_stage[key]}
    if any(name == p or name.startswith(p + ".") for p in first):
        return {0}
    if any(name == p or name.startswith(p + ".") for p in last):
        return {pp - 1}
    return set(range(pp))


def stage_ties(
    model: nn.Module,
    *,
    stage: int,
    pp: int,
    layers: str,
    block_stage: dict[str, int],
    first_stage_only: Sequence[str],
    last_stage_only: Sequence[str],
) -> list[StageTie]:
    """The ties of the whole `model` (before it is cut) that the cut spreads over more than one stage."""
    order = {name: i for i, name in enumerate(_post_order_names(model))}
    out = []
    for names in find_ties(model):
        cut = dict(layers=layers, block_stage=block_stage, first=first_stage_only, last=last_stage_only, pp=pp)
        where = {n: _stages_of(n, **cut) for n in names}
        stages = sorted(set().union(*where.values()))
        if len(stages) < 2 or all(len(s) == pp for s in where.values()):
            continue  # on one stage only, or kept whole on every stage: nothing crosses a stage
        last_init = max(names, key=lambda n: order[n.rpartition(".")[0]])
        here = next((n for n in names if stage in where[n]), None)
        out.append(StageTie(tuple(names), tuple(stages), min(where[last_init]), here))
    return out
