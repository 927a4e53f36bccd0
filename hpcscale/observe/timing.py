"""RUN/timing.jsonl: every rank's step-time breakdown, and the stragglers it names (docs/observability.md).

Every `metrics.timing_every` steps, rank 0 gathers from every rank the means of that rank's last window of
steps (one small MPI gather, not a collective per step) and appends one line:

    {"time": 1764000000.123, "attempt": 2, "step": 39, "steps": 20,
     "columns": ["step_s", "own_s", "compute_s", "data_s", "dp_wait_s", "sync_s", "ckpt_s", "comm_s"],
     "ranks": [[0.105, 0.061, 0.059, 0.002, 0.021, 0.013, 0.0, 0.01], ...],     # index = global rank
     "nodes": ["n1", "n1", "n2", "n2"], "pp": [0, 0, 0, 0]}

`step` is the window's last step (0-based), `steps` how many it covered. Each value is that rank's mean over
the window's steps, in seconds (so step_s = own_s + dp_wait_s + sync_s + comm_s and own_s = compute_s + data_s +
ckpt_s):
- step_s:    the step's wall time as the rank saw it;
- data_s:    waiting for the next batch (loading and the copy to the device);
- dp_wait_s: blocked on the data-parallel gradient all-reduce (the part not hidden behind backward);
- sync_s:    the step's other collectives made for the code: the stop flag's all-reduce, ctx.clip_grad_norm_'s
             and the reference trainer's loss all-reduce: where every rank waits for the slowest;
- ckpt_s:    blocked in a checkpoint save (0 in steps without one);
- comm_s:    blocked in every other collective of the training thread: FSDP's all-gathers and reduce-scatters,
             tensor-parallel all-reduces, a pipeline stage's sends and receives, the code's own collectives
             (timed where torch.distributed waits: hpcscale.launch.waits); absent from lines of older versions;
- compute_s: the rest: forward, backward, the optimizer step;
- own_s:     step_s - dp_wait_s - sync_s - comm_s: the time the rank spent on its own work, the figure stragglers are
             judged on. In synchronous training every rank's step_s is the slowest rank's, so step_s cannot tell
             who is slow; the slow rank is the one that waits least.

The communication ledger (hpcscale.launch.ledger) adds, after those, columns per process group (named by its
mesh axis: mesh_dp, mesh_tp, mesh_pp, mesh_dp_shard, mesh_dp_replicate; default_pg; other) and kind of
collective (all_reduce, all_gather, reduce_scatter, broadcast, all_to_all, send, recv, barrier, ...), each the
rank's mean per step over the window, 0 where the rank made none:
- bytes.GROUP.KIND: bytes of those collectives (all_gather: the gathered output; reduce_scatter, all_to_all:
                    the input; the rest: the tensor);
- n.GROUP.KIND:     how many were issued;
- wait_s.GROUP:     seconds blocked waiting for the group's collectives (part of dp_wait_s, sync_s and comm_s);
- late_s.GROUP:     how late the rank entered the group's collectives after the group's first rank, summed (over
                    the first collectives of each step, hpcscale.launch.ledger.ARRIVALS_PER_STEP per group);
- last.GROUP:       the share of those collectives the rank entered last (0 to 1).
Then each rank's memory peaks since its attempt started (hpcscale.launch.efficiency.memory_gauges; not means):
mem_gb and mem_reserved_gb (what torch's CUDA allocator handed out and reserved), pinned_gb (pinned host memory;
these three on GPUs only), rss_gb (the process's peak resident set), in GB (10^9 bytes).
Lines from versions without the ledger have none of them.

A line may be torn (a run killed mid-write) or damaged: readers skip it, never fail on it.

Reading is bounded whatever the file holds (it lives in a run directory others may write): only the last
TAIL_BYTES of the file are read (a FIFO or a device is refused: BadInput), a line over MAX_LINE bytes is
skipped unparsed, a window of more than MAX_RANKS ranks is skipped, and at most MAX_WINDOWS windows (the
newest) are kept. The verdicts take time linear in the ranks (and groups) of the windows they judge.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from hpcscale.errors import BadInput
from hpcscale.util.bounded import loads_json, read_tail

COLUMNS = ("step_s", "own_s", "compute_s", "data_s", "dp_wait_s", "sync_s", "ckpt_s", "comm_s")
MAX_LINE = 16 << 20  # 16 MiB: 16k ranks of 8 timing figures and ~30 of the ledger's take ~5 MB
MAX_RANKS = 16384  # ranks in one window (2,048 nodes of 8 GPUs); larger windows are skipped
TAIL_BYTES = 64 << 20  # read from the end of timing.jsonl: ~12 windows of MAX_RANKS ranks, thousands of small ones
LEDGER = ("bytes", "n", "wait_s", "late_s", "last")  # the ledger's column prefixes (bytes.GROUP.KIND, late_s.GROUP)
MAX_WINDOWS = 512  # windows kept (the newest): the report's heatmap over time, status's verdict

# The straggler rule (docs/observability.md): a rank is slow in a window when its own time is at least RATIO
# times the median of its peers (the ranks of its pipeline stage, which do the same work) and FLOOR_S more in
# absolute terms; it is a straggler when slow in at least MIN_SLOW of the last WINDOWS windows. Means over a
# window count every stall a rank caused (a rank stopped for 30 ms in one step of five holds the others back as
# much as one 6 ms slower in every step); needing MIN_SLOW windows makes one slow step or window count for nothing.
RATIO = 1.2
FLOOR_S = 0.002
WINDOWS = 5
MIN_SLOW = 3


@dataclass(frozen=True, slots=True)
class Window:
    time: float
    attempt: int | None
    step: int
    steps: int
    ranks: tuple[dict[str, float], ...]  # per global rank: column -> seconds
    nodes: tuple[str, ...]
    pp: tuple[int, ...]


def make_line(
    *,
    time: float,
    attempt: int | None,
    step: int,
    steps: int,
    rows: list[list[float]],
    nodes: list[str],
    pp: list[int],
    columns: Iterable[str] = COLUMNS,
) -> dict:
    """The JSON line for one window (rows in `columns` order, index = global rank). Figures keep 6 decimals; a
    whole number is written as one (a mean of bytes per step)."""
    return {
        "time": round(time, 3),
        "attempt": attempt,
        "step": step,
        "steps": steps,
        "columns": list(columns),
        "ranks": [[_figure(v) for v in row] for row in rows],
        "nodes": nodes,
        "pp": pp,
    }


def _figure(v: float) -> float | int:
    r = round(float(v), 6)
    return int(r) if r.is_integer() and abs(r) < 2**53 else r


def parse_line(doc: object) -> Window | None:
    """A Window from one decoded line; None for anything malformed (readers skip it)."""
    if not isinstance(doc, dict):
        return None
    columns, ranks, nodes, pp = doc.get("columns"), doc.get("ranks"), doc.get("nodes"), doc.get("pp")
    if not (isinstance(columns, list) and all(isinstance(c, str) for c in columns)):
        return None
    if len(set(columns)) != len(columns):
        return None
    if not (isinstance(ranks, list) and isinstance(nodes, list) and isinstance(pp, list)):
        return None
    if not ranks or len(ranks) > MAX_RANKS or not (len(ranks) == len(nodes) == len(pp)):
        return None
    if not all(isinstance(n, str) for n in nodes) or not all(type(p) is int and p >= 0 for p in pp):
        return None
    if not all(c in columns for c in ("step_s", "own_s")):
        return None
    rows = []
    width = len(columns)
    for row in ranks:
        if not (isinstance(row, list) and len(row) == width):
            return None
        if not all(type(v) is float or type(v) is int for v in row):  # bool, str, nested: not a figure
            return None
        try:
            figures = [float(v) for v in row]  # an integer too large for a float: OverflowError
        except OverflowError:
            return None
        if figures and (min(figures) < 0 or not math.isfinite(max(figures))):
            return None
        rows.append(dict(zip(columns, figures, strict=True)))
    step, steps, when, attempt = doc.get("step"), doc.get("steps"), doc.get("time"), doc.get("attempt")
    if type(step) is not int or type(steps) is not int or step < 0 or steps < 1 or not _finite(when):
        return None
    if attempt is not None and type(attempt) is not int:
        return None
    return Window(float(when), attempt, step, steps, tuple(rows), tuple(nodes), tuple(pp))


def _finite(v: object) -> bool:
    if not isinstance(v, int | float) or isinstance(v, bool):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:  # an integer beyond any float
        return False


def read_windows(path: Path, *, max_windows: int = MAX_WINDOWS) -> list[Window]:
    """The newest well-formed windows of RUN/timing.jsonl (at most `max_windows`, from its last TAIL_BYTES), in
    file order; [] when there is none. BadInput when it is not a regular file (a FIFO, a device)."""
    tail = read_tail(path, max_bytes=TAIL_BYTES, what="timing log", missing_ok=True)
    if tail is None:
        return []
    out: list[Window] = []
    for line in reversed(tail.data.splitlines()):
        if len(out) >= max_windows:
            break
        if not line.strip() or len(line) > MAX_LINE:
            continue
        try:
            window = parse_line(loads_json(line, source=str(path), max_bytes=MAX_LINE))
        except BadInput:
            continue
        if window is not None:
            out.append(window)
    out.reverse()
    return out


@dataclass(frozen=True, slots=True)
class RankVerdict:
    rank: int
    node: str
    pp: int
    own_s: float  # median over the judged windows of the rank's mean own time
    relative: float  # median over the judged windows of own_s / the peers' median
    slow_windows: int  # windows in which it was slow by the rule


@dataclass(frozen=True, slots=True)
class Stragglers:
    windows: int  # windows judged (the last WINDOWS of the newest attempt)
    ranks: list[RankVerdict]  # every rank, by rank
    slow_ranks: list[int]
    slow_nodes: list[str]  # nodes holding a straggler, in rank order
    reason: str = ""  # why no verdict, when there is none
    per_node: dict[str, float] = field(default_factory=dict)  # node -> its ranks' median relative own time

    def to_json(self) -> dict:
        return {
            "windows": self.windows,
            "rule": {"ratio": RATIO, "floor_s": FLOOR_S, "windows": WINDOWS, "min_slow": MIN_SLOW},
            "slow_ranks": self.slow_ranks,
            "slow_nodes": self.slow_nodes,
            "reason": self.reason,
            "nodes": self.per_node,
            "ranks": [
                {
                    "rank": r.rank,
                    "node": r.node,
                    "pp": r.pp,
                    "own_s": r.own_s,
                    "relative": r.relative,
                    "slow_windows": r.slow_windows,
                }
                for r in self.ranks
            ],
        }


def judge(windows: Iterable[Window]) -> Stragglers:
    """The stragglers of the newest attempt's last WINDOWS windows (same ranks, nodes and stages in each)."""
    every = list(windows)
    if not every:
        return Stragglers(0, [], [], [], reason="no timing recorded yet (metrics.timing_every)")
    newest = every[-1]
    recent = [w for w in every if w.attempt == newest.attempt and w.nodes == newest.nodes and w.pp == newest.pp][
        -WINDOWS:
    ]
    n = len(newest.nodes)
    slow = [0] * n
    relative: list[list[float]] = [[] for _ in range(n)]
    own: list[list[float]] = [[] for _ in range(n)]
    stages: dict[int, list[int]] = {}  # the same in every judged window (same pp)
    for i, stage in enumerate(newest.pp):
        stages.setdefault(stage, []).append(i)
    for w in recent:
        values = [row["own_s"] for row in w.ranks]
        everyone = statistics.median(values)
        for members in stages.values():
            # a stage of one rank has no peers doing the same work: it is measured against every rank
            base = statistics.median(values[i] for i in members) if len(members) > 1 else everyone
            for i in members:
                relative[i].append(values[i] / base if base > 0 else 1.0)
                own[i].append(values[i])
                if values[i] >= RATIO * base and values[i] - base >= FLOOR_S:
                    slow[i] += 1
    verdicts = [
        RankVerdict(
            i,
            newest.nodes[i],
            newest.pp[i],
            round(statistics.median(own[i]), 6),
            round(statistics.median(relative[i]), 3),
            slow[i],
        )
        for i in range(n)
    ]
    per_node: dict[str, list[float]] = {}
    for v in verdicts:
        per_node.setdefault(v.node, []).append(v.relative)
    node_relative = {node: round(statistics.median(vals), 3) for node, vals in per_node.items()}
    if len(recent) < MIN_SLOW:
        reason = f"{len(recent)} window(s) recorded in this attempt; a verdict needs {MIN_SLOW}"
        return Stragglers(len(recent), verdicts, [], [], reason=reason, per_node=node_relative)
    if n < 2:
        return Stragglers(len(recent), verdicts, [], [], reason="one rank: no peers", per_node=node_relative)
    slow_ranks = [v.rank for v in verdicts if v.slow_windows >= MIN_SLOW]
    slow_nodes = list(dict.fromkeys(newest.nodes[i] for i in slow_ranks))
    return Stragglers(len(recent), verdicts, slow_ranks, slow_nodes, per_node=node_relative)


# ---- the communication ledger (hpcscale.launch.ledger) -------------------------------------------------------------
# A rank arrives late in a window when, in some group, its summed lateness per step is at least LATE_FLOOR_S,
# LATE_SHARE of its step time (blocking saves left out) and LATE_RATIO times the median of the group's other
# ranks; it is the rank the others keep waiting for when late in at least MIN_SLOW of the last WINDOWS windows.
# Lateness is measured on the ranks' clocks: across nodes their offset adds to it (hpcscale.launch.ledger), so a
# floor well above NTP's millisecond matters there.
LATE_RATIO = 2.0
LATE_FLOOR_S = 0.002
# a lateness under a tenth of the step costs the others little: rank 0's own per-step work (it writes the lines)
# makes it a few milliseconds late at the collective after it on a loaded machine, a fact not worth a name
LATE_SHARE = 0.1


def _ledger_columns(window: Window) -> dict[str, dict[str, list[str]]]:
    """group -> {"bytes": [column...], "n": [...], "wait_s": [...], "late_s": [...], "last": [...]}."""
    out: dict[str, dict[str, list[str]]] = {}
    for column in window.ranks[0]:
        prefix, _, rest = column.partition(".")
        if prefix not in LEDGER or not rest:
            continue
        group = rest.partition(".")[0]
        out.setdefault(group, {p: [] for p in LEDGER})[prefix].append(column)
    return out


@dataclass(frozen=True, slots=True)
class GroupTraffic:
    """One process group's traffic in a window, per step: medians over the ranks that used the group."""

    group: str
    ranks: int  # ranks that issued collectives in it
    bytes: float  # bytes per step, every kind
    bytes_max: float  # the most any rank issued (pipeline stages differ)
    kinds: dict[str, dict[str, float]]  # kind -> {"bytes": per step, "n": collectives per step}
    wait_s: float  # seconds per step blocked in its collectives
    gbps: float | None  # bytes over the time blocked in them (GB/s), where a rank was blocked at all

    def to_json(self) -> dict:
        return {
            "group": self.group,
            "ranks": self.ranks,
            "bytes": self.bytes,
            "bytes_max": self.bytes_max,
            "kinds": self.kinds,
            "wait_s": self.wait_s,
            "gbps": self.gbps,
        }


def human_bytes(n: float) -> str:
    """Bytes in decimal units (as GB/s is): 512 B, 271.1 kB, 1.34 GB."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.{2 if scale == 1e9 else 1}f} {unit}"
    return f"{n:.0f} B"


def traffic(window: Window) -> list[GroupTraffic]:
    """Each group's traffic per step in `window`, by name; [] for a line without the ledger's columns."""
    out = []
    for group, cols in sorted(_ledger_columns(window).items()):
        members = [row for row in window.ranks if any(row[c] > 0 for c in cols["n"])]
        if not members:
            continue
        totals = [sum(row[c] for c in cols["bytes"]) for row in members]
        kinds = {}
        for c in cols["bytes"]:
            kind = c.split(".", 2)[2]
            n = f"n.{group}.{kind}"
            kinds[kind] = {
                "bytes": statistics.median(row[c] for row in members),
                "n": statistics.median(row.get(n, 0.0) for row in members),
            }
        waits = [sum(row[c] for c in cols["wait_s"]) for row in members]
        rates = [b / w / 1e9 for b, w in zip(totals, waits, strict=True) if w > 0 and b > 0]
        out.append(
            GroupTraffic(
                group=group,
                ranks=len(members),
                bytes=statistics.median(totals),
                bytes_max=max(totals),
                kinds=kinds,
                wait_s=round(statistics.median(waits), 6),
                gbps=round(statistics.median(rates), 3) if rates else None,
            )
        )
    return out


@dataclass(frozen=True, slots=True)
class LateArrivals:
    windows: int  # windows judged (the last WINDOWS of the newest attempt)
    slow_ranks: list[int]  # late in at least MIN_SLOW of them
    slow_nodes: list[str]
    ranks: list[dict]  # per rank: late_windows, groups it was late in, its largest lateness (s per step)
    reason: str = ""  # why no verdict, when there is none

    def to_json(self) -> dict:
        return {
            "windows": self.windows,
            "rule": {
                "ratio": LATE_RATIO,
                "floor_s": LATE_FLOOR_S,
                "share": LATE_SHARE,
                "windows": WINDOWS,
                "min_slow": MIN_SLOW,
            },
            "slow_ranks": self.slow_ranks,
            "slow_nodes": self.slow_nodes,
            "reason": self.reason,
            "ranks": self.ranks,
        }


def _median_without(ordered: list[float], p: int) -> float:
    """The median of sorted `ordered` without its element at index `p` (len(ordered) >= 2)."""

    def at(k: int) -> float:  # the k-th of the remaining elements
        return ordered[k] if k < p else ordered[k + 1]

    m = len(ordered) - 1
    return at(m // 2) if m % 2 else (at(m // 2 - 1) + at(m // 2)) / 2


def judge_arrivals(windows: Iterable[Window]) -> LateArrivals:
    """The ranks the others keep waiting for at collectives, in the newest attempt's last WINDOWS windows."""
    every = list(windows)
    if not every:
        return LateArrivals(0, [], [], [], reason="no timing recorded yet (metrics.timing_every)")
    newest = every[-1]
    recent = [w for w in every if w.attempt == newest.attempt and w.nodes == newest.nodes and w.pp == newest.pp][
        -WINDOWS:
    ]
    recent = [w for w in recent if any(cols["late_s"] for cols in _ledger_columns(w).values())]
    n = len(newest.nodes)
    late_windows = [0] * n
    groups: list[set[str]] = [set() for _ in range(n)]
    worst: list[list[float]] = [[] for _ in range(n)]
    for w in recent:
        late_here = [False] * n
        most = [0.0] * n
        for group, cols in _ledger_columns(w).items():
            if not cols["late_s"]:
                continue
            column = cols["late_s"][0]
            members = [i for i, row in enumerate(w.ranks) if any(row[c] > 0 for c in cols["n"])]
            ordered = sorted(w.ranks[i][column] for i in members)
            for i in members:
                value = w.ranks[i][column]
                most[i] = max(most[i], value)
                step_s = w.ranks[i]["step_s"] - w.ranks[i].get("ckpt_s", 0.0)  # a blocking save is not the step's
                if len(ordered) < 2 or value < max(LATE_FLOOR_S, LATE_SHARE * step_s):
                    continue
                if value >= LATE_RATIO * _median_without(ordered, bisect.bisect_left(ordered, value)):
                    late_here[i] = True
                    groups[i].add(group)
        for i in range(n):
            late_windows[i] += late_here[i]
            worst[i].append(most[i])
    ranks = [
        {
            "rank": i,
            "node": newest.nodes[i],
            "late_windows": late_windows[i],
            "groups": sorted(groups[i]),
            "late_s": round(statistics.median(worst[i]), 6) if worst[i] else 0.0,
        }
        for i in range(n)
    ]
    if not recent:
        return LateArrivals(0, [], [], ranks, reason="no arrival times recorded (no collectives, or an older version)")
    if len(recent) < MIN_SLOW:
        reason = f"{len(recent)} window(s) with arrival times in this attempt; a verdict needs {MIN_SLOW}"
        return LateArrivals(len(recent), [], [], ranks, reason=reason)
    slow_ranks = [i for i in range(n) if late_windows[i] >= MIN_SLOW]
    slow_nodes = list(dict.fromkeys(newest.nodes[i] for i in slow_ranks))
    return LateArrivals(len(recent), slow_ranks, slow_nodes, ranks)
