"""Loss and gradient-norm spikes, judged against the run's own recent history (docs/observability.md#spikes).

The rule, per watched key (`loss`, `grad_norm`), on rank 0's metrics lines in the order they are logged:

- the history is the last WINDOW values of the key that were not spikes, in this attempt;
- its **level** is the median of its last LEVEL values, its **noise** the standard deviation of one step's change
  estimated robustly over the whole history (1.4826 x the median of the absolute step-to-step changes, over
  sqrt 2: a normal distribution's sigma, unmoved by a trend such as a falling loss's, or by outliers);
- with at least MIN_HISTORY values in it, a value is a **spike** when it is above both the level plus
  DEVIATIONS times the noise and FLOOR[key] x the level (when the level is positive: a loss that barely moves
  has a tiny noise, and an ordinary wobble must not pass for a spike);
- a value that is not a finite number (NaN, inf) is a spike whatever the history;
- a spike is not added to the history (it must not raise the bar for the next one), unless REBASE spikes come in a
  row: the run has moved to a new level, and the history starts again from those values.

Pure and torch-free: the metrics logger feeds it (hpcscale.launch.metrics) and the tests drive it directly.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections import deque
from dataclasses import dataclass

__all__ = ["DEVIATIONS", "FLOOR", "LEVEL", "MIN_HISTORY", "REBASE", "WATCHED", "WINDOW", "Spike", "SpikeWatch"]

WATCHED = ("loss", "grad_norm")
WINDOW = 50
LEVEL = 10
MIN_HISTORY = 20
DEVIATIONS = 8.0
FLOOR = {"loss": 1.2, "grad_norm": 2.0}
REBASE = 5
SIGMA_PER_MAD = 1.4826


@dataclass(frozen=True, slots=True)
class Spike:
    key: str
    step: int
    value: float
    level: float | None  # None: a non-finite value, judged without the history
    threshold: float | None

    def to_json(self) -> dict:
        return {
            "key": self.key,
            "value": self.value if math.isfinite(self.value) else str(self.value),
            "level": self.level,
            "threshold": self.threshold,
        }

    def words(self) -> str:
        if self.threshold is None:
            return f"{self.key} spike at step {self.step}: {self.value} (not a finite number)"
        return (
            f"{self.key} spike at step {self.step}: {self.value:.5g}, over {self.threshold:.5g} (the level "
            f"{self.level:.5g} of the last {LEVEL} steps + {DEVIATIONS:g} x their step-to-step noise, and at least "
            f"{FLOOR[self.key]:g}x the level)"
        )


class SpikeWatch:
    """One attempt's spike rule over the keys it is fed (the module's docstring)."""

    def __init__(self) -> None:
        self._history = {key: deque(maxlen=WINDOW) for key in WATCHED}
        self._run = {key: [] for key in WATCHED}  # the spikes in a row, for REBASE

    def observe(self, step: int, values: dict) -> list[Spike]:
        """The spikes among `values` (one metrics line's, logged at `step`); none for keys it does not hold."""
        found = []
        for key in WATCHED:
            value = values.get(key)
            if isinstance(value, bool) or not isinstance(value, int | float):
                continue
            spike = self._judge(key, step, float(value))
            if spike is not None:
                found.append(spike)
        return found

    def _judge(self, key: str, step: int, value: float) -> Spike | None:
        history, run = self._history[key], self._run[key]
        if not math.isfinite(value):
            return Spike(key, step, value, None, None)
        if len(history) < MIN_HISTORY:
            history.append(value)
            return None
        values = list(history)
        level = statistics.median(values[-LEVEL:])
        noise = SIGMA_PER_MAD * statistics.median(abs(b - a) for a, b in itertools.pairwise(values)) / math.sqrt(2)
        threshold = level + DEVIATIONS * noise
        if level > 0:
            threshold = max(threshold, FLOOR[key] * level)
        if value <= threshold:
            run.clear()
            history.append(value)
            return None
        run.append(value)
        if len(run) >= REBASE:  # a new level, not a spike: the history starts again from it
            history.clear()
            history.extend(run)
            run.clear()
        return Spike(key, step, value, level, threshold)
