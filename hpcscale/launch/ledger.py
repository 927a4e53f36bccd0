"""The communication ledger: per step and per process group, the collectives the training thread issues, their
bytes, the time it blocked in them, and when it arrived at each (RUN/timing.jsonl, docs/observability.md).

What each layout should send is known from its model: replicated data parallelism all-reduces the gradients once
a step, HSDP all-reduces its shards across replicas once a step however many micro-batches, FSDP under a pipeline
gathers each block once a step, a bf16 pipeline sends bf16 activations. The ledger counts what torch was asked
to do, so a regression in any of these shows as bytes, per group, per step. Everything is read from the call's
tensors' shapes and dtypes as torch receives them: no host sync, no collective of its own, no tensor read.

Where it counts (installed once per process, with hpcscale.launch.waits, by `install`):

- the methods of `ProcessGroup` that torch.distributed's Python API ends in: `all_reduce`, `all_gather`,
  `all_gather_into_tensor` / `all_gather_single`, `reduce_scatter(_tensor)`, `broadcast`, `all_to_all`,
  `barrier`, `send`, `recv`, `isend`, `irecv` (and so `batch_isend_irecv` and pipelining's P2P ops),
  `*_object` collectives (as the tensor collectives they make), and the coalesced forms. Each API call issues
  exactly one of these, whichever alias the caller used (`all_gather_into_tensor` calls `all_gather_single`),
  so nothing is counted twice, and every caller is seen however it reached the function (FSDP2's collectives,
  hpcscale's gradient buckets, the stop flag, a user's own call), where wrapping the module functions would
  miss callers that bound them at import;
- the Python functions of torch.distributed._functional_collectives that issue an op (`all_reduce`,
  `all_gather_single`, `reduce_scatter_single`, `broadcast`, `all_to_all_single` and the coalesced forms):
  DTensor's redistributions (tensor parallelism, in forward and in its autograd backward) call them through the
  module at call time; the deprecated aliases call these, so they count once. DTensor's shard-to-shard
  all-to-all (`shard_dim_alltoall`, a C++ op off CPU; an all-gather on CPU, counted as such) is wrapped where
  placement_types calls it, once DTensor is loaded (at install, or at the first step end after).

Bytes follow nccl-tests' "size": all_reduce, broadcast, send, recv: the tensor; all_gather: the gathered output
(the whole parameter for FSDP); reduce_scatter and all_to_all: the input. A group is named by its description
(`group_desc`), which DeviceMesh sets to the mesh axis (`mesh_dp`, `mesh_tp`, `mesh_pp`, `mesh_dp_shard`,
`mesh_dp_replicate`); `default_pg` is the world group; a group without a description is `other`. A group of
one rank moves nothing and is not counted.

Arrivals: at each collective (not send/recv, whose sides are not simultaneous) the rank notes time.time() on
entry, for the first ARRIVALS_PER_STEP collectives of each group per step. Every rank of a group issues that
group's collectives in the same order, so the i-th arrival of each member is one collective; rank 0 compares
them when it gathers the window (hpcscale.launch.timing): how late each rank came after the first, and how often
it came last. time.time() is one clock for every process of a node; across nodes their offset (NTP: about a
millisecond, PTP: microseconds) adds to every lateness, so lateness between nodes means something only well
above it.

Not counted: another thread's collectives outside a backward pass (the checkpoint writer's saves run on their own
thread and gloo group); a backward pass is counted on whichever thread torch's autograd engine runs it (on GPUs its
own device threads); collectives issued from C++ without the Python API
(DDP's reducer: hpcscale's own gradient sync does not use it; the autograd backward of the `*_autograd`
functional collectives, which DTensor does not use); code compiled by torch.compile (its collectives are graph
ops; nothing is counted while tracing either). Blocked time per group (`wait_s`) is attributed where
hpcscale.launch.waits times the wait: a Work or a functional collective's tensor is remembered by id() until its
wait, within the step. Per collective the cost is a few dictionary updates and at most one clock read: about
3 µs with the wait clock, measured on this machine's CPU.
"""

from __future__ import annotations

import contextlib
import functools
import re
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

ARRIVALS_PER_STEP = 64  # arrivals noted per group per step: what rank 0 compares per window is bounded

# ProcessGroup method -> (kind, index of the argument whose tensors are the collective's size, or None)
PG_METHODS: dict[str, tuple[str, int | None]] = {
    "allreduce": ("all_reduce", 0),
    "allreduce_coalesced": ("all_reduce", 0),
    "reduce": ("reduce", 0),
    "broadcast": ("broadcast", 0),
    "allgather": ("all_gather", 0),
    "all_gather_single": ("all_gather", 0),
    "_allgather_base": ("all_gather", 0),
    "allgather_coalesced": ("all_gather", 0),
    "allgather_into_tensor_coalesced": ("all_gather", 0),
    "all_gather_single_coalesced": ("all_gather", 0),
    "reduce_scatter": ("reduce_scatter", 1),
    "reduce_scatter_single": ("reduce_scatter", 1),
    "_reduce_scatter_base": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", 1),
    "reduce_scatter_single_coalesced": ("reduce_scatter", 1),
    "alltoall": ("all_to_all", 1),
    "alltoall_base": ("all_to_all", 1),
    "all_to_all_single": ("all_to_all", 1),
    "gather": ("gather", 1),
    "scatter": ("scatter", 0),
    "barrier": ("barrier", None),
    "send": ("send", 0),
    "recv": ("recv", 0),
    "recv_anysource": ("recv", 0),
}
P2P = frozenset({"send", "recv"})


@dataclass(frozen=True, slots=True)
class FuncolSpec:
    """A functional collective's signature, as far as the ledger reads it."""

    kind: str
    group_at: tuple[int, str]  # (position, keyword) of its group argument
    gathered: bool = False  # the size is the output: the input times the group's size


# torch.distributed._functional_collectives function -> its spec; the input is always the first argument
FUNCOL: dict[str, FuncolSpec] = {
    "all_reduce": FuncolSpec("all_reduce", (2, "group")),
    "all_reduce_coalesced": FuncolSpec("all_reduce", (2, "group")),
    "broadcast": FuncolSpec("broadcast", (2, "group")),
    "all_gather_single": FuncolSpec("all_gather", (2, "group"), gathered=True),
    "all_gather_single_coalesced": FuncolSpec("all_gather", (1, "group"), gathered=True),
    "reduce_scatter_single": FuncolSpec("reduce_scatter", (3, "group")),
    "reduce_scatter_single_coalesced": FuncolSpec("reduce_scatter", (3, "group")),
    "all_to_all_single": FuncolSpec("all_to_all", (3, "group")),
}

_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")


def group_label(desc: str) -> str:
    """The name a group's traffic is recorded under: its description, `other` without one; only [A-Za-z0-9_-]
    (the name becomes part of a column name in timing.jsonl)."""
    if not desc or desc == "undefined":
        return "other"
    return _UNSAFE.sub("_", desc)[:64]


def nbytes(x: object) -> int:
    """The bytes of a tensor, or of every tensor in a (nested) list of them."""
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, list | tuple):
        return sum(nbytes(y) for y in x)
    return 0


@dataclass(slots=True)
class _Group:
    label: str
    ranks: tuple[int, ...]  # global ranks: which instance of the axis (two dp groups are two instances)
    size: int
    noted: int = 0  # arrivals noted this step


@dataclass(slots=True)
class StepTraffic:
    """One step's traffic of the training thread."""

    # (group label, kind) -> [collectives, bytes]
    counts: dict[tuple[str, str], list[int]] = field(default_factory=dict)
    # (group label, its global ranks) -> the time.time() of each noted arrival, in issue order
    arrivals: dict[tuple[str, tuple[int, ...]], list[float]] = field(default_factory=dict)
    waited: dict[str, float] = field(default_factory=dict)  # group label -> seconds blocked in its waits


class Ledger:
    """Counts the installing thread's collectives into `current` (a StepTraffic); `take()` hands the step's over."""

    def __init__(self, *, arrivals_per_step: int = ARRIVALS_PER_STEP, clock=time.time) -> None:
        self.thread = threading.get_ident()
        self.arrivals_per_step = arrivals_per_step
        self.clock = clock
        self.current = StepTraffic()
        self._groups: dict[object, _Group] = {}  # ProcessGroup -> _Group
        self._by_name: dict[str, _Group] = {}  # a group's name (functional collectives) -> _Group
        # id() of a Work or a functional collective's tensor not yet waited -> its group's label. Cleared each step:
        # a handle never waited (torch frees it unwaited) cannot hold memory past it, and a later object given its
        # id could at worst take its label for one wait's time (not bytes).
        self._pending: dict[int, str] = {}
        self._dtensor_wrapped = False

    def _wrap_dtensor(self) -> None:
        """Wrap DTensor's shard_dim_alltoall once DTensor is loaded: importing it only for this costs half a
        second at start-up, and a job without DTensor never calls it. Checked at install and at every step end."""
        placements = sys.modules.get("torch.distributed.tensor.placement_types")
        if placements is None:
            return
        fn = getattr(placements, "shard_dim_alltoall", None)
        if fn is not None and not getattr(fn, "__hpcscale_ledger__", False):
            placements.shard_dim_alltoall = self._shard_dim_alltoall(fn)
        self._dtensor_wrapped = True

    def take(self) -> StepTraffic:
        """The traffic since the last take; counting starts afresh."""
        if not self._dtensor_wrapped:
            self._wrap_dtensor()
        out, self.current = self.current, StepTraffic()
        self._pending.clear()
        for g in self._groups.values():
            g.noted = 0
        return out

    @contextlib.contextmanager
    def aside(self) -> Iterator[None]:
        """Count what runs inside apart, and drop it (an evaluation between steps): the step's count goes on after.
        Every rank sets the same work aside, so the arrivals noted stay the same collectives on every rank."""
        kept, noted = self.current, {pg: g.noted for pg, g in self._groups.items()}
        self.current = StepTraffic()
        try:
            yield
        finally:
            self.current = kept
            for pg, g in self._groups.items():
                g.noted = noted.get(pg, 0)

    # ---- counting ----------------------------------------------------------------------------------------------
    def _group(self, pg) -> _Group:
        g = self._groups.get(pg)
        if g is None:
            ranks = tuple(dist.get_process_group_ranks(pg))
            g = self._groups[pg] = _Group(group_label(pg.group_desc), ranks, len(ranks))
        return g

    def _named(self, name: str) -> _Group:
        g = self._by_name.get(name)
        if g is None:
            from torch.distributed.distributed_c10d import _resolve_process_group

            g = self._by_name[name] = self._group(_resolve_process_group(name))
        return g

    def count(self, g: _Group, kind: str, size: int) -> None:
        """One collective of `kind` and `size` bytes on `g`, entered now."""
        cur = self.current
        cell = cur.counts.get((g.label, kind))
        if cell is None:
            cell = cur.counts[(g.label, kind)] = [0, 0]
        cell[0] += 1
        cell[1] += size
        if kind not in P2P and g.noted < self.arrivals_per_step:
            g.noted += 1
            key = (g.label, g.ranks)
            seen = cur.arrivals.get(key)
            if seen is None:
                seen = cur.arrivals[key] = []
            seen.append(self.clock())

    def waited(self, handle: object, seconds: float) -> None:
        """hpcscale.launch.waits timed a wait of `handle` (a Work, or a functional collective's tensor)."""
        label = self._pending.pop(id(handle), None)
        if label is not None:
            self.current.waited[label] = self.current.waited.get(label, 0.0) + seconds

    def _counts_here(self) -> bool:
        """The installing (training) thread, or a backward pass on any thread: on GPUs torch's autograd engine
        runs backward on its own per-device threads, and the collectives issued there (GradSync's buckets,
        FSDP's reduce-scatters and backward all-gathers, tensor parallelism's backward all-reduces) are the
        training's. The checkpoint writer's threads run no backward."""
        if torch.compiler.is_compiling():
            return False
        return threading.get_ident() == self.thread or torch._C._current_graph_task_id() != -1

    # ---- the wrappers ------------------------------------------------------------------------------------------
    def _pg_method(self, fn, kind: str, at: int | None):
        @functools.wraps(fn)
        def method(pg, *args, **kwargs):
            if not self._counts_here():
                return fn(pg, *args, **kwargs)
            g = self._group(pg)
            if g.size < 2:
                return fn(pg, *args, **kwargs)
            self.count(g, kind, nbytes(args[at]) if at is not None and len(args) > at else 0)
            work = fn(pg, *args, **kwargs)
            if work is not None:
                self._pending[id(work)] = g.label
            return work

        method.__hpcscale_ledger__ = True
        return method

    def _funcol(self, fn, spec: FuncolSpec):
        from torch.distributed import _functional_collectives as funcol

        pos, key = spec.group_at

        @functools.wraps(fn)
        def collective(*args, **kwargs):
            if not self._counts_here():
                return fn(*args, **kwargs)
            group = args[pos] if len(args) > pos else kwargs.get(key)
            tag = kwargs.get("tag", args[pos + 1] if len(args) > pos + 1 else "")
            g = self._named(funcol._resolve_group_name(group, tag))
            if g.size < 2:
                return fn(*args, **kwargs)
            size = nbytes(args[0] if args else kwargs.get("self", kwargs.get("inputs")))
            self.count(g, spec.kind, size * g.size if spec.gathered else size)
            out = fn(*args, **kwargs)
            for t in out if isinstance(out, list) else (out,):
                self._pending[id(getattr(t, "elem", t))] = g.label  # an AsyncCollectiveTensor waits on .elem
            return out

        collective.__hpcscale_ledger__ = True
        return collective

    def _shard_dim_alltoall(self, fn):
        @functools.wraps(fn)
        def alltoall(input, gather_dim, shard_dim, mesh, mesh_dim):
            # on CPU torch gathers instead, through all_gather_single, which counts it
            if mesh.device_type != "cpu" and self._counts_here():
                g = self._group(mesh.get_group(mesh_dim))
                if g.size > 1:
                    self.count(g, "all_to_all", nbytes(input))
            return fn(input, gather_dim, shard_dim, mesh, mesh_dim)

        alltoall.__hpcscale_ledger__ = True
        return alltoall


_installed: Ledger | None = None


def install(waits=None) -> Ledger:
    """Count every collective of the calling thread from now on (idempotent: the first caller's thread). `waits`:
    hpcscale.launch.waits' clock, whose timed waits are attributed to their groups."""
    global _installed
    if _installed is not None:
        return _installed
    import torch.distributed._functional_collectives as funcol
    from torch.distributed import ProcessGroup

    ledger = Ledger()
    for name, (kind, at) in PG_METHODS.items():
        fn = getattr(ProcessGroup, name, None)
        if fn is not None and not getattr(fn, "__hpcscale_ledger__", False):
            setattr(ProcessGroup, name, ledger._pg_method(fn, kind, at))
    for name, spec in FUNCOL.items():
        fn = getattr(funcol, name, None)
        if fn is not None and not getattr(fn, "__hpcscale_ledger__", False):
            setattr(funcol, name, ledger._funcol(fn, spec))
    ledger._wrap_dtensor()
    if waits is not None:
        waits.on_wait = ledger.waited
    _installed = ledger
    return ledger
