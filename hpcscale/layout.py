"""The parallel layout of a job: the one owner of its axes, degrees, rank order, coordinates and their rules.

A job of `nodes` × `tasks_per_node` ranks is split into a mesh with named axes. `AXES` below is the registry:
each axis is named once there, with what every consumer needs (its job-spec key, whether it is data-parallel,
whether its groups stay in a node, whether every layout record holds it, how placement models its traffic),
and the layout, the DeviceMesh, config, placement, checkpoints, NCCL blame and the CLI iterate it. A new
parallelism is one entry there (docs/architecture.md lists the other files it touches).

The registry's order is the mesh's, slowest to fastest, and it is also the rank numbering: ranks are numbered
row-major over the axes (mixed radix, the last axis fastest), because init_device_mesh numbers a mesh's ranks
row-major over its dims, so one order serves both and two could only disagree. Today's axes, slowest first:
pp, dp_replicate, dp_shard, tp (Megatron's default order: tp ranks neighbours inside a node, pp farthest), so

    rank = ((pp_index * dp_replicate + dp_replicate_index) * dp_shard + dp_shard_index) * tp + tp_index
         = (pp_index * dp + dp_index) * tp + tp_index,   dp_index = dp_replicate_index * dp_shard + dp_shard_index

The data-parallel axes together are `dp`, whose degree is derived (world size / every other degree) and split
by the job's `parallel.dp_shard`: parameters, gradients and optimizer state are sharded over the dp_shard ranks
of a group (FSDP2; ZeRO-3 when dp_shard = dp) and replicated across the dp_replicate groups (HSDP when both
exceed 1). The shard group is the faster of the two, right after tp, so its all-gathers and reduce-scatters
stay as close together as the placement can put them. While nothing is sharded the mesh keeps one `dp` axis in
their place (the meshes of unsharded jobs have always been pp, dp, tp).

Everything that needs a rank's place — placement's cost model, the DeviceMesh, which rank writes a checkpoint
shard — asks this module instead of rewriting the formula. The rules are checked here once and returned as
(key, message) problems: config attaches file and line to each key; other callers raise them as BadInput.
Torch-free: login-node commands validate layouts without importing torch.

Vocabulary: an *axis* is a mesh axis (pp, dp, tp, ...); a tensor's *dim* is never called an axis.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from hpcscale.errors import BadInput


@dataclass(frozen=True, kw_only=True, slots=True)
class Axis:
    """One parallel axis, named once: everything below reads it from here."""

    name: str  # the mesh axis: DeviceMesh dim, NCCL group `mesh_<name>`, coordinate, table column, record key
    key: str | None  # its degree's job-spec key under `parallel` (None: the one axis derived from the world size)
    data_parallel: bool  # one of the axes flattened into `dp`: its ranks hold the same model slice
    in_node: bool = False  # its groups must stay inside one node, so its degree divides tasks_per_node
    # Whether every layout record holds it (checkpoint index, attempt log): records since the first have pp, dp
    # and tp. Any other axis is written only when its degree is not 1 and read as 1 when absent, so records
    # written before it existed still read, and a job that does not use it writes what older versions read.
    recorded: bool = False
    ring: bool = True  # placement's traffic: neighbours in a ring (all-reduce); False, a chain (pipeline send/recv)


DP = "dp"  # the data-parallel axes flattened into one: the mesh's `dp`, the recorded data-parallel degree

AXES: tuple[Axis, ...] = (  # slowest to fastest: the mesh's order and the rank numbering's
    Axis(name="pp", key="pp", data_parallel=False, recorded=True, ring=False),
    Axis(name="dp_replicate", key=None, data_parallel=True),  # dp / dp_shard: HSDP's replica groups
    Axis(name="dp_shard", key="dp_shard", data_parallel=True),  # FSDP2's shard groups (fastest of dp: see above)
    Axis(name="tp", key="tp", data_parallel=False, in_node=True, recorded=True),
)


def axis_named(name: str) -> Axis | None:
    """The registered axis of that name (None: not one; `dp` is the data-parallel axes together, not one)."""
    return next((a for a in AXES if a.name == name), None)


def keyed_axes() -> tuple[Axis, ...]:
    """The axes a job spec sets (`parallel.<key>`), in the registry's order."""
    return tuple(a for a in AXES if a.key)


def _fastest_first(axes) -> list[Axis]:
    return list(reversed(axes))


def _factors(degrees: dict[str, int], axes) -> str:
    """`tp(2) * pp(4)`: the named degrees, fastest axis first."""
    return " * ".join(f"{a.key}({degrees[a.key]})" for a in _fastest_first(axes))


def _spec_degrees(degrees: dict[str, Any], *, what: str) -> dict[str, int]:
    """Every keyed axis' degree (absent: 1); a key that names no axis is refused."""
    names = {a.key for a in keyed_axes()}
    unknown = sorted(set(degrees) - names)
    if unknown:
        raise BadInput(f"{what}: {', '.join(unknown)} is not a parallel axis (axes: {', '.join(sorted(names))})")
    return {k: degrees.get(k, 1) for k in (a.key for a in keyed_axes())}


@dataclass(frozen=True, kw_only=True, slots=True)
class LayoutProblem:
    key: str  # the job-spec key at fault, dotted (`parallel`, `parallel.tp`)
    message: str


@dataclass(frozen=True, slots=True)
class RankCoords:
    """A rank's index along each axis (attributes by axis name) and along the flattened `dp`; also element-wise,
    numpy arrays of indexes for an array of ranks."""

    index: dict[str, Any]  # axis name -> index, every registered axis
    dp: Any  # the index along the data-parallel axes flattened (dp_replicate_index * dp_shard + dp_shard_index)

    def __getattr__(self, name: str) -> Any:
        if not name.startswith("_"):
            try:
                return self.index[name]
            except KeyError:
                pass
        raise AttributeError(name)

    def of(self, axis: str) -> Any:
        """The index along `axis` (a registered axis or `dp`)."""
        return self.dp if axis == DP else self.index[axis]


def layout_problems(*, nodes: int, tasks_per_node: int, **degrees: int) -> list[LayoutProblem]:
    """Every rule a layout (nodes, tasks_per_node and each axis' degree by its job-spec key: tp, pp, dp_shard)
    breaks; empty when it is valid."""
    d = _spec_degrees(degrees, what="layout")
    keyed = keyed_axes()
    if min(nodes, tasks_per_node, *d.values()) < 1:
        names = ["nodes", "tasks_per_node", *(a.key for a in keyed)]
        return [
            LayoutProblem(key="parallel", message=f"{', '.join(names[:-1])} and {names[-1]} must all be at least 1")
        ]
    out = []
    world = nodes * tasks_per_node
    model = [a for a in keyed if not a.data_parallel]  # the axes that split the model; dp is what is left
    split = math.prod(d[a.key] for a in model)
    if world % split:
        out.append(
            LayoutProblem(
                key="parallel",
                message=f"{_factors(d, model)} = {split} does not divide the world size "
                f"nodes({nodes}) * tasks_per_node({tasks_per_node}) = {world}",
            )
        )
    for a in _fastest_first(keyed):
        if a.in_node and tasks_per_node % d[a.key]:
            out.append(
                LayoutProblem(
                    key=f"parallel.{a.key}",
                    message=f"{a.key}({d[a.key]}) does not divide tasks_per_node({tasks_per_node}); "
                    f"{a.name} groups must stay inside a node",
                )
            )
    if not world % split:
        dp = world // split
        for a in _fastest_first(keyed):
            if a.data_parallel and dp % d[a.key]:
                out.append(
                    LayoutProblem(
                        key=f"parallel.{a.key}",
                        message=f"{a.key}({d[a.key]}) does not divide the data-parallel degree dp = nodes({nodes}) "
                        f"* tasks_per_node({tasks_per_node}) / ({_factors(d, model)}) = {dp}",
                    )
                )
    return out


def _raise_if(problems: list[LayoutProblem]) -> None:
    if problems:
        raise BadInput("; ".join(p.message for p in problems))


class ParallelDims:
    """The mesh's degree along every axis (attributes by axis name: dims.pp, dims.dp_shard, ...; dims.dp is the
    data-parallel axes' product) and the rank order over them. Built from the job-spec degrees and dp:
    `ParallelDims(pp=2, dp=4, tp=2, dp_shard=2)`; an axis not given has degree 1. Immutable."""

    __slots__ = ("_degrees",)

    def __init__(self, *, dp: int, **degrees: int) -> None:
        d = _spec_degrees(degrees, what="ParallelDims")
        given = {DP: dp} | d
        if not all(type(v) is int for v in given.values()) or min(given.values()) < 1:
            parts = [f"{k}({v})" for k, v in given.items()]
            raise BadInput(f"{', '.join(parts[:-1])} and {parts[-1]} must all be at least 1")
        dp_keyed = [a for a in keyed_axes() if a.data_parallel]
        shard = math.prod(d[a.key] for a in dp_keyed)
        if dp % shard:
            raise BadInput(f"{_factors(d, dp_keyed)} does not divide the data-parallel degree dp({dp})")
        object.__setattr__(self, "_degrees", {a.name: d[a.key] if a.key else dp // shard for a in AXES})

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"ParallelDims is immutable: cannot set {name}")

    def __getattr__(self, name: str) -> int:
        if not name.startswith("_"):
            try:
                return self._degrees[name]
            except KeyError:
                pass
        raise AttributeError(name)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ParallelDims) and self._degrees == other._degrees

    def __hash__(self) -> int:
        return hash(tuple(self._degrees.items()))

    def __repr__(self) -> str:
        return f"ParallelDims({', '.join(f'{k}={v}' for k, v in self._degrees.items())})"

    def __reduce__(self):
        return (_dims_from_degrees, (dict(self._degrees),))

    @classmethod
    def for_world(cls, *, world_size: int, **degrees: int) -> ParallelDims:
        """dp derived from the world size (the ranks actually started); the error names every factor."""
        d = _spec_degrees(degrees, what="ParallelDims")
        model = [a for a in keyed_axes() if not a.data_parallel]
        split = math.prod(d[a.key] for a in model)
        if min(d.values()) < 1 or world_size % split:
            raise BadInput(f"{_factors(d, model)} = {split} does not divide WORLD_SIZE({world_size})")
        dp = world_size // split
        for a in keyed_axes():
            if a.data_parallel and dp % d[a.key]:
                raise BadInput(
                    f"{a.key}({d[a.key]}) does not divide the data-parallel degree dp = WORLD_SIZE({world_size}) / "
                    f"({_factors(d, model)}) = {dp}"
                )
        return cls(dp=dp, **d)

    @property
    def degrees(self) -> dict[str, int]:
        """Every axis' degree by name, slowest first (the registry's order)."""
        return dict(self._degrees)

    @property
    def dp(self) -> int:
        """The data-parallel degree: the data-parallel axes' product."""
        return math.prod(self._degrees[a.name] for a in AXES if a.data_parallel)

    @property
    def sharded(self) -> bool:
        """Whether the data-parallel axes are split (dp_shard > 1): the mesh then has each of them."""
        return any(self._degrees[a.name] > 1 for a in AXES if a.data_parallel and a.key)

    @property
    def world_size(self) -> int:
        return math.prod(self._degrees.values())

    def spec_degrees(self) -> dict[str, int]:
        """The degrees a job spec sets, by key (tp, pp, dp_shard, ...): what for_world takes with the world size."""
        return {a.key: self._degrees[a.name] for a in keyed_axes()}

    def coords(self, rank: int) -> RankCoords:
        """A rank's coordinates; also element-wise over a numpy array of ranks (placement's cost model)."""
        if isinstance(rank, int) and not 0 <= rank < self.world_size:
            raise BadInput(f"rank {rank} is outside a world of {self.world_size}")
        index, rest = {}, rank
        for a in reversed(AXES):  # mixed radix, fastest axis the lowest digit
            index[a.name] = rest % self._degrees[a.name]
            rest = rest // self._degrees[a.name]
        dp = 0
        for a in AXES:
            if a.data_parallel:
                dp = dp * self._degrees[a.name] + index[a.name]
        return RankCoords({a.name: index[a.name] for a in AXES}, dp)

    def rank(self, **at: Any) -> int:
        """The global rank at these coordinates (the inverse of `coords`): an index per axis by name, or `dp` for
        the data-parallel axes flattened; an axis of degree 1 may be left out. Element-wise over numpy arrays."""
        at = dict(at)
        if DP in at:
            flat = at.pop(DP)
            for a in reversed(AXES):
                if a.data_parallel:
                    if a.name in at:
                        raise BadInput(f"rank(): give dp or {a.name}, not both")
                    at[a.name] = flat % self._degrees[a.name]
                    flat = flat // self._degrees[a.name]
        out = 0
        for a in AXES:
            size = self._degrees[a.name]
            i = at.pop(a.name, None)
            if i is None:
                if size != 1:
                    raise BadInput(f"rank(): the {a.name} index is missing (degree {size})")
                i = 0
            out = out * size + i
        if at:
            raise BadInput(f"rank(): {', '.join(sorted(at))} is not a parallel axis")
        return out

    def rank_at(self, coords: RankCoords, **changes: Any) -> Any:
        """The rank at `coords` with the indexes in `changes` (by axis name, or `dp` for the data-parallel axes
        flattened) put in their place; element-wise over numpy arrays."""
        at = dict(coords.index)
        if DP in changes:
            at = {a: i for a, i in at.items() if a not in self.dp_axes}
        return self.rank(**(at | changes))

    @property
    def mesh_axes(self) -> tuple[str, ...]:
        """The DeviceMesh's axes, slowest to fastest in rank order: every registered axis (pp, dp_replicate,
        dp_shard, tp), or, while nothing is sharded, `dp` in place of the data-parallel ones (pp, dp, tp). When
        sharded, `dp` is also the data-parallel axes flattened into one (parallel/mesh.py builds these)."""
        out: list[str] = []
        for a in AXES:
            name = a.name if self.sharded or not a.data_parallel else DP
            if name not in out:
                out.append(name)
        return tuple(out)

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """The degree along each of mesh_axes."""
        return tuple(self.dp if n == DP else self._degrees[n] for n in self.mesh_axes)

    @property
    def dp_axes(self) -> tuple[str, ...]:
        """The data-parallel axes, slowest first (flattened into `dp`)."""
        return tuple(a.name for a in AXES if a.data_parallel)

    @property
    def group_axes(self) -> tuple[str, ...]:
        """The axes hpcscale's mesh makes process groups for: mesh_axes, and `dp` (an axis, or the flattened one)."""
        return self.mesh_axes if DP in self.mesh_axes else (*self.mesh_axes, DP)

    @property
    def coordinate_axes(self) -> tuple[str, ...]:
        """A rank's coordinates as tables and records show them, fastest first: tp, dp, then the data-parallel
        split when it is sharded (dp_shard, dp_replicate), pp; every other axis in its place."""
        out: list[str] = []
        for a in reversed(AXES):
            if not a.data_parallel:
                out.append(a.name)
            elif DP not in out:
                out += [DP, *(reversed(self.dp_axes) if self.sharded else ())]
        return tuple(out)

    def mesh_index(self, rank: int) -> dict[str, int]:
        """A rank's index on every axis name a job's meshes use (every registered axis and `dp`)."""
        c = self.coords(rank)
        return c.index | {DP: c.dp}

    def group(self, rank: int, axis: str) -> list[int]:
        """The ranks of `rank`'s process group along mesh `axis` (any registered axis, or `dp`): those that share
        its coordinates on every other axis, in group order."""
        c = self.coords(rank)
        if axis != DP and axis not in self._degrees:
            raise BadInput(f"{axis} is not a parallel axis")
        return [self.rank_at(c, **{axis: i}) for i in range(self.dp if axis == DP else self._degrees[axis])]

    def as_dict(self) -> dict[str, int]:
        """The layout as a checkpoint index and the attempt log record it: pp, dp, tp always, any other axis
        given by the job spec only when its degree is not 1 (dp_shard only when it shards)."""
        out: dict[str, int] = {}
        for a in AXES:
            if a.data_parallel and DP not in out:
                out[DP] = self.dp
            if a.recorded:
                out[a.name] = self._degrees[a.name]
        return out | {
            a.name: self._degrees[a.name] for a in keyed_axes() if not a.recorded and self._degrees[a.name] != 1
        }

    def text(self) -> str:
        """`pp=2 dp=4 dp_shard=2 tp=2`: what `as_dict` records, as a person reads it, in the registry's order (the
        data-parallel degree where its axes stand, an axis not always recorded only when it is not 1)."""
        record = self.as_dict()
        names: list[str] = []
        for a in AXES:
            if a.data_parallel and DP not in names:
                names.append(DP)
            if a.name in record:
                names.append(a.name)
        return " ".join(f"{n}={record[n]}" for n in names)

    @classmethod
    def from_dict(cls, record: object) -> ParallelDims:
        """The layout `as_dict` recorded (an axis not always recorded absent: 1); BadInput when it is not one."""
        if not isinstance(record, dict):
            raise BadInput(f"not a recorded layout: {repr(record)[:200]}")
        required = [DP, *(a.name for a in AXES if a.recorded)]
        optional = [a.name for a in keyed_axes() if not a.recorded]
        degrees = {k: record.get(k) for k in (*required, *optional) if k in record}
        if any(k not in degrees for k in required) or not all(type(v) is int for v in degrees.values()):
            raise BadInput(
                f"not a recorded layout (integers {', '.join(required)}, and {', '.join(optional)} when not 1): "
                f"{repr(record)[:200]}"
            )
        dp = degrees.pop(DP)
        return cls(dp=dp, **{a.key: degrees[a.name] for a in keyed_axes() if a.name in degrees})


def _dims_from_degrees(degrees: dict[str, int]) -> ParallelDims:
    dims = object.__new__(ParallelDims)
    object.__setattr__(dims, "_degrees", degrees)
    return dims


class JobLayout:
    """A job's layout on nodes: how many ranks each node runs, and the mesh over them (attributes: nodes,
    tasks_per_node, world, dims, and every axis' degree by name). Validated on creation. Immutable."""

    __slots__ = ("dims", "nodes", "tasks_per_node")

    def __init__(self, *, nodes: int, tasks_per_node: int, **degrees: int) -> None:
        _raise_if(layout_problems(nodes=nodes, tasks_per_node=tasks_per_node, **degrees))
        object.__setattr__(self, "nodes", nodes)
        object.__setattr__(self, "tasks_per_node", tasks_per_node)
        object.__setattr__(self, "dims", ParallelDims.for_world(world_size=nodes * tasks_per_node, **degrees))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"JobLayout is immutable: cannot set {name}")

    def __getattr__(self, name: str) -> int:
        if name.startswith("_") or name in JobLayout.__slots__:  # a slot not set yet: no lookup through dims
            raise AttributeError(name)
        return getattr(self.dims, name)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, JobLayout) and (self.nodes, self.tasks_per_node, self.dims) == (
            other.nodes,
            other.tasks_per_node,
            other.dims,
        )

    def __hash__(self) -> int:
        return hash((self.nodes, self.tasks_per_node, self.dims))

    def __repr__(self) -> str:
        return f"JobLayout(nodes={self.nodes}, tasks_per_node={self.tasks_per_node}, dims={self.dims!r})"

    @property
    def world(self) -> int:
        return self.nodes * self.tasks_per_node
