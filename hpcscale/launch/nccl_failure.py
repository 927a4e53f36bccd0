"""An NCCL collective that timed out: what the ranks' logs say, and which rank the others waited for.

A rank whose NCCL collective outlives the group's timeout does not raise in Python: NCCL's watchdog thread
(torch's ProcessGroupNCCL) logs the work it gave up on and ends the process with std::abort (SIGABRT), so no
failure line of hpcscale's is written and srun reports only `task N: Aborted`. The watchdog's lines name the
rank, the collective and how far the rank had got:

    [rank3]:[E1125 10:00:00.000 ProcessGroupNCCL.cpp:632] [PG ID 2 PG GUID 5(mesh_dp) Rank 1] Watchdog caught
        collective operation timeout: WorkNCCL(SeqNum=12, OpType=ALLREDUCE, NumelIn=1, NumelOut=1,
        Timeout(ms)=300000) ran for 300012 milliseconds before timing out.

The `[rankN]:` prefix is the global rank (torch's log prefix); `Rank M` inside the brackets is the rank within the
group, and the group's description names the mesh axis (`mesh_` and the axis: torch's init_device_mesh names each
axis's groups so) or the default group (`default_pg`). The groups are the layout's (ParallelDims.group_axes, from
the registry in hpcscale.layout): pp, dp, tp; with sharded data parallelism (dp_shard > 1) pp, dp_replicate,
dp_shard, tp, plus `mesh_dp`, the dp axes flattened into one (parallel/mesh.py). In a collective every member of the
group waits for the last one to arrive, so the ranks that time out are the ones that arrived; a member that never
reached it (stuck in Python or in other GPU work, or dead) writes no such line. The late ranks are therefore the
members of the reporters' groups that did not report, worked out from the attempt's layout (its begin record: nodes
in placement order and every degree, dp_shard included: an FSDP all-gather that times out is a `mesh_dp_shard`
collective, HSDP's gradient all-reduce a `mesh_dp_replicate` one), and their nodes are blamed. Only those groups:
the first SIGABRT makes srun kill every rank, so ranks of other groups may never get to write their own timeout, and
must not be taken for late ones. When every member timed out, no rank was late: the fabric between them is the
suspect, and no node is blamed; nor is one when the group cannot be worked out (no layout recorded, a group hpcscale
did not make).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from hpcscale.layout import ParallelDims

_TIMEOUT = re.compile(
    r"(?:\[rank(?P<global>\d+)\]:)?.*?\[(?:PG ID \d+ PG GUID \S+?(?:\((?P<group>[^)]*)\))? )?Rank (?P<rank>\d+)\] "
    r"Watchdog caught collective operation timeout: WorkNCCL\(SeqNum=(?P<seq>\d+), OpType=(?P<op>\w+)"
    r".*?Timeout\(ms\)=(?P<timeout>\d+)\)"
)


@dataclass(frozen=True, slots=True)
class NcclTimeout:
    """One rank's NCCL watchdog report."""

    rank: int  # the global rank when the log prefix gives it, else the rank within the group
    global_rank: bool  # whether `rank` is the global rank
    group: str | None  # the group's description (mesh_dp, mesh_tp, default_pg, ...) when logged
    seq: int  # the collective's sequence number in its group
    op: str  # ALLREDUCE, ALLGATHER, ...
    timeout_s: float

    @classmethod
    def parse(cls, line: str) -> NcclTimeout | None:
        m = _TIMEOUT.search(line)
        if m is None:
            return None
        glob = m.group("global")
        return cls(
            rank=int(glob) if glob is not None else int(m.group("rank")),
            global_rank=glob is not None,
            group=m.group("group"),
            seq=int(m.group("seq")),
            op=m.group("op"),
            timeout_s=int(m.group("timeout")) / 1000,
        )


@dataclass(frozen=True, slots=True)
class NcclTimeoutReport:
    """What a job's NCCL timeouts say, for a person and for node exclusion."""

    line: str
    blamed_ranks: list[int]
    blamed_nodes: list[str]


def nccl_timeouts(lines: list[str]) -> list[NcclTimeout]:
    """Every rank's first NCCL timeout report, in the order the logs have them."""
    seen: dict[int, NcclTimeout] = {}
    for line in lines:
        if "Watchdog caught collective operation timeout" not in line:
            continue
        t = NcclTimeout.parse(line)
        if t is not None and t.rank not in seen:
            seen[t.rank] = t
    return list(seen.values())


def _members(t: NcclTimeout, dims: ParallelDims | None) -> list[int] | None:
    """The global ranks of the group `t` timed out in (None: cannot be worked out)."""
    if not t.global_rank or dims is None or not 0 <= t.rank < dims.world_size:
        return None
    if t.group in (None, "default_pg"):
        return list(range(dims.world_size)) if t.group == "default_pg" else None
    axis = t.group.removeprefix("mesh_")
    return dims.group(t.rank, axis) if t.group.startswith("mesh_") and axis in dims.group_axes else None


def describe_nccl_timeouts(
    timeouts: list[NcclTimeout], *, dims: ParallelDims | None, rank_nodes: list[str] | None
) -> NcclTimeoutReport | None:
    """The report for these timeouts (None when there are none). `dims` and `rank_nodes` (the node of each
    global rank, in rank order) come from the attempt's begin record; without them no rank is blamed."""
    if not timeouts:
        return None
    first = timeouts[0]
    where = f"{first.op} #{first.seq}" + (f" on {first.group}" if first.group else "")
    reported = sorted({t.rank for t in timeouts})
    head = (
        f"NCCL collective timeout: rank(s) {_ranks(reported)} gave up on {where} after {first.timeout_s:.0f} s "
        "(NCCL's watchdog aborted them: SIGABRT)"
    )
    groups = [_members(t, dims) for t in timeouts]
    if any(g is None for g in groups):
        return NcclTimeoutReport(head + "; which rank they waited for is not in the logs", [], [])
    members = {r for g in groups for r in g or ()}
    late = sorted(members - set(reported))
    if not late:
        return NcclTimeoutReport(
            head + "; every rank of that group timed out, so none was late: suspect the network between them, "
            "not one node",
            [],
            [],
        )
    nodes = []
    if rank_nodes is not None and dims is not None and len(rank_nodes) == dims.world_size:
        nodes = list(dict.fromkeys(rank_nodes[r] for r in late))
    on = f" on node(s) {', '.join(nodes)}" if nodes else ""
    return NcclTimeoutReport(
        head + f"; rank(s) {_ranks(late)}{on} never reached it: the rank(s) the others waited for", late, nodes
    )


def _ranks(ranks: list[int]) -> str:
    shown = ", ".join(str(r) for r in ranks[:8])
    return shown + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")
