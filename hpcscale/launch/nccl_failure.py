"""An NCCL collective that timed out: what the ranks' logs say, and which rank the others waited for.

A rank whose NCCL collective outlives the group's timeout does not raise in Python: NCCL's watchdog thread
(torch's ProcessGroupNCCL) logs the work it gave up on and ends the process with std::abort (SIGABRT), so no
failure line of hpcscale's is written and srun reports only `task N: Aborted`. The watchdog's lines name the
rank, the collective and how far the rank had got:

    [rank3]:[E1125 10:00:00.000 ProcessGroupNCCL.cpp:632] [PG ID 2 PG GUID 5(mesh_dp) Rank 1] Watchdog caught
        collective operation timeout: WorkNCCL(SeqNum=12, OpType=ALLREDUCE, NumelIn=1, NumelOut=1,
        Timeout(ms)=300000) ran for 300012 milliseconds before timing out.

The `[rankN]:` prefix is the global rank (torch's log prefix); `Rank M` inside the brackets is the rank within
the group. In a collective every member waits for the last one to arrive, so the ranks that time out are the
ones that arrived; a rank that never reached the collective (stuck in Python or in other GPU work, or dead)
writes no such line. The ranks of the job that did not report a timeout are the ones the others waited for,
and their nodes are blamed. When every rank timed out, no rank was late: the fabric between them is the
suspect, and no single node is blamed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

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


def describe_nccl_timeouts(
    timeouts: list[NcclTimeout], *, world_size: int | None, rank_nodes: list[str] | None
) -> NcclTimeoutReport | None:
    """The report for these timeouts (None when there are none). `world_size` and `rank_nodes` (the node of
    each global rank, in rank order) come from the attempt's begin record; without them no rank is blamed."""
    if not timeouts:
        return None
    first = timeouts[0]
    where = f"{first.op} #{first.seq}" + (f" on {first.group}" if first.group else "")
    reported = sorted(t.rank for t in timeouts)
    head = (
        f"NCCL collective timeout: rank(s) {_ranks(reported)} gave up on {where} after {first.timeout_s:.0f} s "
        "(NCCL's watchdog aborted them: SIGABRT)"
    )
    if world_size is None or not all(t.global_rank for t in timeouts):
        return NcclTimeoutReport(head + "; which rank they waited for is not in the logs", [], [])
    late = sorted(set(range(world_size)) - set(reported))
    if not late:
        return NcclTimeoutReport(
            head + "; every rank timed out, so none was late: suspect the network between them, not one node",
            [],
            [],
        )
    nodes = []
    if rank_nodes is not None and len(rank_nodes) == world_size:
        nodes = list(dict.fromkeys(rank_nodes[r] for r in late))
    on = f" on node(s) {', '.join(nodes)}" if nodes else ""
    return NcclTimeoutReport(
        head + f"; rank(s) {_ranks(late)}{on} never reached it: the rank(s) the others waited for", late, nodes
    )


def _ranks(ranks: list[int]) -> str:
    shown = ", ".join(str(r) for r in ranks[:8])
    return shown + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")
