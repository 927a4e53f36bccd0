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

A line may be torn (a run killed mid-write) or damaged: readers skip it, never fail on it.

Reading is bounded whatever the file holds (it lives in a run directory others may write): only the last
TAIL_BYTES of the file are read (a FIFO or a device is refused: BadInput), a line over MAX_LINE bytes is
skipped unparsed, a window of more than MAX_RANKS ranks is skipped, and at most MAX_WINDOWS windows (the
newest) are kept. The verdict takes time linear in the ranks of the windows it judges.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from hpcscale.errors import BadInput
from hpcscale.util.bounded import loads_json, read_tail

COLUMNS = ("step_s", "own_s", "compute_s", "data_s", "dp_wait_s", "sync_s", "ckpt_s", "comm_s")
MAX_LINE = 4 << 20  # 4 MiB: 16k ranks of 7 figures take ~1.2 MB
MAX_RANKS = 16384  # ranks in one window (2,048 nodes of 8 GPUs); larger windows are skipped
TAIL_BYTES = 16 << 20  # read from the end of timing.jsonl: ~13 windows of MAX_RANKS ranks, thousands of small ones
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
    *, time: float, attempt: int | None, step: int, steps: int, rows: list[list[float]], nodes: list[str], pp: list[int]
) -> dict:
    """The JSON line for one window (rows in COLUMNS order, index = global rank)."""
    return {
        "time": round(time, 3),
        "attempt": attempt,
        "step": step,
        "steps": steps,
        "columns": list(COLUMNS),
        "ranks": [[round(float(v), 6) for v in row] for row in rows],
        "nodes": nodes,
        "pp": pp,
    }


def parse_line(doc: object) -> Window | None:
    """A Window from one decoded line; None for anything malformed (readers skip it)."""
    if not isinstance(doc, dict):
        return None
    columns, ranks, nodes, pp = doc.get("columns"), doc.get("ranks"), doc.get("nodes"), doc.get("pp")
    if not (isinstance(columns, list) and all(isinstance(c, str) for c in columns)):
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
