"""The parallel layout of a job: the one owner of its degrees, rank order, coordinates and their rules.

A job of `nodes` × `tasks_per_node` ranks is split into a mesh with named axes (pp, dp, tp). Ranks are ordered
tp fastest, then dp, then pp (Megatron's default order), so

    rank = (pp_index * dp + dp_index) * tp + tp_index

The data-parallel degree splits further into dp_replicate × dp_shard (`parallel.dp_shard`): parameters,
gradients and optimizer state are sharded over the dp_shard ranks of a group (FSDP2; ZeRO-3 when dp_shard = dp)
and replicated across the dp_replicate groups (HSDP when both exceed 1). The shard group is the faster of the
two, right after tp, so its all-gathers and reduce-scatters stay as close together as the placement can put them:

    dp_index = dp_replicate_index * dp_shard + dp_shard_index

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


def layout_problems(*, nodes: int, tasks_per_node: int, tp: int, pp: int, dp_shard: int = 1) -> list[LayoutProblem]:
    """Every rule a (nodes, tasks_per_node, tp, pp, dp_shard) layout breaks; empty when it is valid."""
    if min(nodes, tasks_per_node, tp, pp, dp_shard) < 1:
        return [
            LayoutProblem(key="parallel", message="nodes, tasks_per_node, tp, pp and dp_shard must all be at least 1")
        ]
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
    if not world % (tp * pp) and (world // (tp * pp)) % dp_shard:
        dp = world // (tp * pp)
        out.append(
            LayoutProblem(
                key="parallel.dp_shard",
                message=f"dp_shard({dp_shard}) does not divide the data-parallel degree dp = nodes({nodes}) * "
                f"tasks_per_node({tasks_per_node}) / (tp({tp}) * pp({pp})) = {dp}",
            )
        )
    return out


def _raise_if(problems: list[LayoutProblem]) -> None:
    if problems:
        raise BadInput("; ".join(p.message for p in problems))


@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelDims:
    """The mesh's degrees along (pp, dp, tp) and the rank order over them; dp_shard of the dp ranks shard the
    model's state among them (1: every dp rank holds a full replica)."""

    pp: int
    dp: int
    tp: int
    dp_shard: int = 1

    def __post_init__(self) -> None:
        if min(self.pp, self.dp, self.tp, self.dp_shard) < 1:
            raise BadInput(
                f"pp({self.pp}), dp({self.dp}), tp({self.tp}) and dp_shard({self.dp_shard}) must all be at least 1"
            )
        if self.dp % self.dp_shard:
            raise BadInput(f"dp_shard({self.dp_shard}) does not divide the data-parallel degree dp({self.dp})")

    @classmethod
    def for_world(cls, *, world_size: int, tp: int, pp: int, dp_shard: int = 1) -> ParallelDims:
        """dp derived from the world size (the ranks actually started); the error names every factor."""
        if tp < 1 or pp < 1 or world_size % (tp * pp):
            raise BadInput(f"tp({tp}) * pp({pp}) = {tp * pp} does not divide WORLD_SIZE({world_size})")
        dp = world_size // (tp * pp)
        if dp_shard < 1 or dp % dp_shard:
            raise BadInput(
                f"dp_shard({dp_shard}) does not divide the data-parallel degree dp = WORLD_SIZE({world_size}) / "
                f"(tp({tp}) * pp({pp})) = {dp}"
            )
        return cls(pp=pp, dp=dp, tp=tp, dp_shard=dp_shard)

    @property
    def dp_replicate(self) -> int:
        """How many full copies of the model's state the dp ranks keep (dp / dp_shard)."""
        return self.dp // self.dp_shard

    @property
    def sharded(self) -> bool:
        return self.dp_shard > 1

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    def coords(self, rank: int) -> RankCoords:
        """A rank's coordinates; also element-wise over a numpy array of ranks (placement's cost model)."""
        if isinstance(rank, int) and not 0 <= rank < self.world_size:
            raise BadInput(f"rank {rank} is outside a world of {self.world_size}")
        return RankCoords(pp=rank // (self.dp * self.tp), dp=(rank // self.tp) % self.dp, tp=rank % self.tp)

    @property
    def mesh_axes(self) -> tuple[str, ...]:
        """The DeviceMesh's axes, slowest to fastest in rank order: (pp, dp, tp), or (pp, dp_replicate, dp_shard,
        tp) when dp_shard > 1, where `dp` is then the two flattened into one (parallel/mesh.py builds these)."""
        return ("pp", "dp_replicate", "dp_shard", "tp") if self.sharded else ("pp", "dp", "tp")

    def group(self, rank: int, axis: str) -> list[int]:
        """The ranks of `rank`'s process group along mesh `axis` (pp, dp, tp, dp_replicate or dp_shard): those
        that share its coordinates on every other axis, in group order."""
        c = self.coords(rank)
        if axis in ("dp_replicate", "dp_shard"):
            replica, shard = divmod(c.dp, self.dp_shard)  # dp_index = dp_replicate_index * dp_shard + dp_shard_index
            dps = (
                [replica * self.dp_shard + i for i in range(self.dp_shard)]
                if axis == "dp_shard"
                else [i * self.dp_shard + shard for i in range(self.dp_replicate)]
            )
            return [self.rank(pp=c.pp, dp=d, tp=c.tp) for d in dps]
        at = {"pp": c.pp, "dp": c.dp, "tp": c.tp}
        size = {"pp": self.pp, "dp": self.dp, "tp": self.tp}[axis]
        return [self.rank(**(at | {axis: i})) for i in range(size)]

    def rank(self, *, pp: int, dp: int, tp: int) -> int:
        """The global rank at these coordinates (the inverse of `coords`)."""
        return (pp * self.dp + dp) * self.tp + tp

    def as_dict(self) -> dict[str, int]:
        """The layout as a checkpoint index and the attempt log record it; dp_shard only when it shards."""
        out = {"pp": self.pp, "dp": self.dp, "tp": self.tp}
        return out | {"dp_shard": self.dp_shard} if self.dp_shard > 1 else out

    @classmethod
    def from_dict(cls, record: object) -> ParallelDims:
        """The layout `as_dict` recorded (dp_shard absent: 1); BadInput when it is not one."""
        if not isinstance(record, dict):
            raise BadInput(f"not a recorded layout: {record!r}")
        degrees = {"dp_shard": 1} | {k: record.get(k) for k in ("pp", "dp", "tp", "dp_shard") if k in record}
        if len(degrees) != 4 or not all(type(v) is int for v in degrees.values()):
            raise BadInput(f"not a recorded layout (integers pp, dp, tp, and dp_shard when it shards): {record!r}")
        return cls(**degrees)


@dataclass(frozen=True, kw_only=True, slots=True)
class JobLayout:
    """A job's layout on nodes: how many ranks each node runs, and the mesh over them. Validated on creation."""

    nodes: int
    tasks_per_node: int
    tp: int
    pp: int
    dp_shard: int = 1

    def __post_init__(self) -> None:
        _raise_if(
            layout_problems(
                nodes=self.nodes, tasks_per_node=self.tasks_per_node, tp=self.tp, pp=self.pp, dp_shard=self.dp_shard
            )
        )

    @property
    def world(self) -> int:
        return self.nodes * self.tasks_per_node

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.pp)

    @property
    def dims(self) -> ParallelDims:
        return ParallelDims(pp=self.pp, dp=self.dp, tp=self.tp, dp_shard=self.dp_shard)
