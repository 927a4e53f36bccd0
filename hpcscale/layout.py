"""The parallel layout of a job: the one owner of its degrees, rank order, coordinates and their rules.

A job of `nodes` × `tasks_per_node` ranks is split into a mesh with named axes (pp, dp, tp). Ranks are ordered
tp fastest, then dp, then pp (Megatron's default order), so

    rank = (pp_index * dp + dp_index) * tp + tp_index

Everything that needs a rank's place — placement's cost model, the DeviceMesh, which rank writes a checkpoint
shard — asks this module instead of rewriting the formula. The rules are checked here once and returned as
(key, message) problems: config attaches file and line to each key; other callers raise them as BadInput.
Torch-free: login-node commands validate layouts without importing torch.

Vocabulary: an *axis* is a mesh axis (pp, dp, tp); a tensor's *dim* is never called an axis.
"""

from __future__ import annotations

from dataclasses import dataclass

from hpcscale.errors import BadInput

AXES = ("pp", "dp", "tp")  # slowest to fastest in rank order; also the DeviceMesh's dimension names


@dataclass(frozen=True, kw_only=True, slots=True)
class LayoutProblem:
    key: str  # the job-spec key at fault, dotted (`parallel`, `parallel.tp`)
    message: str


@dataclass(frozen=True, kw_only=True, slots=True)
class RankCoords:
    """A rank's index along each mesh axis."""

    pp: int
    dp: int
    tp: int


def layout_problems(*, nodes: int, tasks_per_node: int, tp: int, pp: int) -> list[LayoutProblem]:
    """Every rule a (nodes, tasks_per_node, tp, pp) layout breaks; empty when it is valid."""
    if min(nodes, tasks_per_node, tp, pp) < 1:
        return [LayoutProblem(key="parallel", message="nodes, tasks_per_node, tp and pp must all be at least 1")]
    out = []
    world = nodes * tasks_per_node
    if world % (tp * pp):
        out.append(
            LayoutProblem(
                key="parallel",
                message=f"tp({tp}) * pp({pp}) = {tp * pp} does not divide the world size "
                f"nodes({nodes}) * tasks_per_node({tasks_per_node}) = {world}",
            )
        )
    if tasks_per_node % tp:
        out.append(
            LayoutProblem(
                key="parallel.tp",
                message=f"tp({tp}) does not divide tasks_per_node({tasks_per_node}); "
                "tensor-parallel groups must stay inside a node",
            )
        )
    return out


def _raise_if(problems: list[LayoutProblem]) -> None:
    if problems:
        raise BadInput("; ".join(p.message for p in problems))


@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelDims:
    """The mesh's degrees along (pp, dp, tp) and the rank order over them."""

    pp: int
    dp: int
    tp: int

    def __post_init__(self) -> None:
        if min(self.pp, self.dp, self.tp) < 1:
            raise BadInput(f"pp({self.pp}), dp({self.dp}) and tp({self.tp}) must all be at least 1")

    @classmethod
    def for_world(cls, *, world_size: int, tp: int, pp: int) -> ParallelDims:
        """dp derived from the world size (the ranks actually started); the error names every factor."""
        if tp < 1 or pp < 1 or world_size % (tp * pp):
            raise BadInput(f"tp({tp}) * pp({pp}) = {tp * pp} does not divide WORLD_SIZE({world_size})")
        return cls(pp=pp, dp=world_size // (tp * pp), tp=tp)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    def coords(self, rank: int) -> RankCoords:
        """A rank's coordinates; also element-wise over a numpy array of ranks (placement's cost model)."""
        if isinstance(rank, int) and not 0 <= rank < self.world_size:
            raise BadInput(f"rank {rank} is outside a world of {self.world_size}")
        return RankCoords(pp=rank // (self.dp * self.tp), dp=(rank // self.tp) % self.dp, tp=rank % self.tp)

    def group(self, rank: int, axis: str) -> list[int]:
        """The ranks of `rank`'s process group along mesh `axis` ("pp", "dp" or "tp"): those that share its
        coordinates on the other two axes, in group order."""
        c = self.coords(rank)
        at = {"pp": c.pp, "dp": c.dp, "tp": c.tp}
        size = {"pp": self.pp, "dp": self.dp, "tp": self.tp}[axis]
        return [self.rank(**(at | {axis: i})) for i in range(size)]

    def rank(self, *, pp: int, dp: int, tp: int) -> int:
        """The global rank at these coordinates (the inverse of `coords`)."""
        return (pp * self.dp + dp) * self.tp + tp

    def as_dict(self) -> dict[str, int]:
        return {"pp": self.pp, "dp": self.dp, "tp": self.tp}


@dataclass(frozen=True, kw_only=True, slots=True)
class JobLayout:
    """A job's layout on nodes: how many ranks each node runs, and the mesh over them. Validated on creation."""

    nodes: int
    tasks_per_node: int
    tp: int
    pp: int

    def __post_init__(self) -> None:
        _raise_if(layout_problems(nodes=self.nodes, tasks_per_node=self.tasks_per_node, tp=self.tp, pp=self.pp))

    @property
    def world(self) -> int:
        return self.nodes * self.tasks_per_node

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.pp)

    @property
    def dims(self) -> ParallelDims:
        return ParallelDims(pp=self.pp, dp=self.dp, tp=self.tp)
