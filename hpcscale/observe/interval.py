"""`checkpoint.every_steps: auto`: the checkpoint interval that loses the least time (docs/observability.md).

A job that saves every T seconds of work, each save costing C seconds of the training loop, and fails on average
every M seconds, loses about C/T to saves and (T + C)/(2M) of redone work per failure. Young (1974) found the
optimum T ≈ sqrt(2·C·M); Daly (2006, "A higher order estimate of the optimum checkpoint interval for restart
dumps") the higher-order estimate used here:

    T = sqrt(2·C·M) · (1 + sqrt(C / (2M)) / 3 + C / (18·M)) − C      for C < 2M,   and T = M otherwise.

C is measured, not guessed: the time a save blocked the loop plus the extra time the steps took while its
background write ran (their total against the interval's median step), the largest over all ranks. M is the
job's MTBF: the site's `reliability.node_mtbf_hours` divided by the job's nodes, blended with this run's own
failures (the site's figure counts as one failure observed over its MTBF, so one early failure moves the
estimate without collapsing it).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass

FIRST_SAVE_STEPS = 10  # the first save measures C; until then there is no cost to plan from
HOUR = 3600.0


def young(cost_s: float, mtbf_s: float) -> float:
    """Young's first-order optimum: sqrt(2·C·M) seconds of work between saves."""
    return math.sqrt(2.0 * cost_s * mtbf_s)


def daly(cost_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum, seconds of work between saves (M when a save costs 2M or more)."""
    if cost_s < 0 or mtbf_s <= 0:
        raise ValueError(f"cost {cost_s} s and MTBF {mtbf_s} s: the cost must be ≥ 0 and the MTBF > 0")
    if cost_s >= 2.0 * mtbf_s:
        return mtbf_s
    ratio = cost_s / (2.0 * mtbf_s)
    return max(0.0, young(cost_s, mtbf_s) * (1.0 + math.sqrt(ratio) / 3.0 + ratio / 9.0) - cost_s)


@dataclass(frozen=True, slots=True)
class Mtbf:
    seconds: float  # the job's estimated mean time between failures
    site_node_hours: float
    nodes: int
    failures: int  # this run's failed attempts
    exposure_s: float  # the run's wall time over which they were counted

    def describe(self) -> str:
        ran = duration(self.exposure_s)
        own = (
            f"; {self.failures} failure(s) in {ran} of this run"
            if self.failures
            else f"; no failure in {ran} of this run"
        )
        return (
            f"job MTBF {duration(self.seconds)} (site node MTBF {self.site_node_hours:g} h / {self.nodes} "
            f"node{'s' if self.nodes != 1 else ''}{own})"
        )


def duration(seconds: float) -> str:
    """3.6 s, 12.0 min, 4.2 h: the unit that keeps the figure readable."""
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 2 * HOUR:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / HOUR:.1f} h"


def job_mtbf(*, node_mtbf_hours: float, nodes: int, events: list[dict], now: float) -> Mtbf:
    """The job's MTBF from the site's node MTBF and RUN/attempts.jsonl.

    A failure is an attempt whose end says `failed`, or an attempt followed by another begin with neither an end
    nor a stop of its own (its batch script died with it: a node loss). The exposure is the time from each
    attempt's begin to its end (or the next begin, or now). Estimate: (exposure + prior) / (failures + 1), the
    prior being the site's job MTBF counted as one failure observed over that long."""
    prior = node_mtbf_hours * HOUR / max(1, nodes)
    begins = [e for e in events if e.get("event") == "begin" and isinstance(e.get("time"), str)]
    # each attempt's first end and whether it stopped, in one pass: the log is a file others may append to,
    # and this runs at every job start (begins x events was hours on a log of a million lines)
    first_end: dict = {}
    stopped: set = set()
    for e in events:
        kind = e.get("event")
        if kind == "end":
            first_end.setdefault(_attempt_key(e.get("attempt")), e)
        elif kind == "stop":
            stopped.add(_attempt_key(e.get("attempt")))
    failures = 0
    exposure = 0.0
    for i, begin in enumerate(begins):
        start = _seconds(begin["time"])
        if start is None:
            continue
        later = begins[i + 1] if i + 1 < len(begins) else None
        attempt = _attempt_key(begin.get("attempt"))
        end = first_end.get(attempt)
        if (end is not None and end.get("cause") == "failed") or (
            end is None and later is not None and attempt not in stopped
        ):
            failures += 1
        finish = _seconds(end["time"]) if end is not None and isinstance(end.get("time"), str) else None
        if finish is None:
            finish = _seconds(later["time"]) if later is not None else now
        if finish is not None and finish > start:
            exposure += finish - start
    return Mtbf((exposure + prior) / (failures + 1), node_mtbf_hours, nodes, failures, exposure)


def _attempt_key(value: object) -> object:
    """An attempt number as a dict key that matches as == does (1, 1.0 and True alike): JSON lists and objects,
    which a hand-edited log may hold there, as tuples and frozensets of the same."""
    if isinstance(value, list):
        return ("list", tuple(_attempt_key(v) for v in value))
    if isinstance(value, dict):
        return ("dict", frozenset((k, _attempt_key(v)) for k, v in value.items()))
    return value


def _seconds(stamp: str) -> float | None:
    from datetime import datetime

    try:
        return datetime.fromisoformat(stamp).timestamp()
    except (ValueError, TypeError):
        return None


@dataclass(frozen=True, slots=True)
class Choice:
    """One planning decision, as metrics.jsonl records it (`checkpoint_interval`) and `status` shows it."""

    steps: int  # steps until the next save
    seconds: float  # the optimum interval in seconds of work
    cost_s: float  # C
    blocking_s: float  # C's part the save blocked the loop
    background_s: float  # C's part the steps lost during the previous save's background write
    step_s: float  # the median step the steps were counted in
    mtbf_s: float  # M
    why: str

    def to_json(self) -> dict:
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in asdict(self).items()}


def choose(*, blocking_s: float, background_s: float, step_s: float, mtbf: Mtbf) -> Choice:
    """The steps to the next save from the measured cost of the last one."""
    cost = max(0.0, blocking_s) + max(0.0, background_s)
    seconds = daly(cost, mtbf.seconds)
    steps = max(1, round(seconds / step_s)) if step_s > 0 else FIRST_SAVE_STEPS
    why = (
        f"Daly optimum {seconds:.1f} s of work for a save costing {cost:.2f} s "
        f"({blocking_s:.2f} s blocked + {background_s:.2f} s of slower steps) and a {mtbf.describe()}; "
        f"at {step_s * 1000:.1f} ms a step"
    )
    return Choice(steps, seconds, cost, blocking_s, background_s, step_s, mtbf.seconds, why)


class StepClock:
    """The steps since the last save, in order: how long a normal step takes, and how much longer than normal
    the steps took while the last save's background write ran (its cost to the loop)."""

    def __init__(self) -> None:
        self._times: list[float] = []

    def add(self, step_s: float) -> None:
        self._times.append(step_s)

    def take(self, background_s: float | None) -> tuple[float, float]:
        """(normal step, extra seconds) since the last take; (0, 0) with no steps.

        The steps that ran while the write did (the first ones, until their sum reaches its `background_s`)
        are compared with the mean of the steps after it; with no background write (synchronous saves) or too
        few steps after it, the normal step is the median and nothing is extra."""
        times, self._times = self._times, []
        if not times:
            return 0.0, 0.0
        during, elapsed = 0, 0.0
        if background_s:
            while during < len(times) and elapsed < background_s:
                elapsed += times[during]
                during += 1
        after = times[during:]
        if not background_s or len(after) < 3:
            return statistics.median(times), 0.0
        normal = statistics.fmean(after)
        return normal, max(0.0, sum(times[:during]) - normal * during)
