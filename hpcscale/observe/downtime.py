"""How long training stopped when a failed step was relaunched in its allocation (restart.spare_nodes), read back
from what the run recorded: RUN/attempts.jsonl's events and RUN/metrics.jsonl's rows.

For the step of attempt k that failed and was relaunched as attempt k + 1 (its `end` event names the new
step's nodes):

    detect_s      its last training step            -> its end event (the failure noticed, srun's step gone,
                                                        the decision made: hpcscale requeue --in-place)
    start_s       its end event                     -> attempt k + 1's begin event (srun, the ranks' imports,
                                                        the bootstrap)
    load_s        the restore of attempt k + 1 (its `restore_s`: the checkpoint read and verified)
    first_step_s  attempt k + 1's begin event       -> its first training step (the load included)
    total_s       the last step before the failure  -> the first step after it

The training step lost to the failure itself (between the last recorded step and the fault) is not seen by
any record and is not counted; the steps trained again after the restore are counted by the losses, not here.
Both files may be written by others: a value of the wrong type or a negative interval gives None for that part.
"""

from __future__ import annotations

import math
from datetime import datetime, timezone

__all__ = ["relaunch_downtimes"]

MAX_S = 1e7  # an interval longer than this (115 days) is not a measurement


def _epoch(value) -> float | None:
    if isinstance(value, str):
        try:
            t = datetime.fromisoformat(value)
        except ValueError:
            return None
        return (t if t.tzinfo else t.replace(tzinfo=timezone.utc)).timestamp()
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def _span(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or not 0 <= b - a <= MAX_S:
        return None
    return round(b - a, 3)


def relaunch_downtimes(events: list[dict], rows: list[dict]) -> dict[int, dict[str, float | None]]:
    """attempt k -> its downtime parts (the module docstring), for every attempt whose end event relaunched it."""
    begins = {e.get("attempt"): e for e in events if e.get("event") == "begin" and type(e.get("attempt")) is int}
    last_step: dict[int, float] = {}
    first_step: dict[int, float] = {}
    restore: dict[int, float] = {}
    for r in rows:
        a, t = r.get("attempt"), _epoch(r.get("time"))
        if type(a) is not int or t is None:
            continue
        if "loss" in r:
            last_step[a] = max(last_step.get(a, t), t)
            first_step[a] = min(first_step.get(a, t), t)
        s = r.get("restore_s")
        if isinstance(s, int | float) and not isinstance(s, bool) and math.isfinite(s) and 0 <= s <= MAX_S:
            restore[a] = float(s)
    out = {}
    for e in events:
        k = e.get("attempt")
        if e.get("event") != "end" or type(k) is not int or not isinstance(e.get("relaunch"), list):
            continue
        ended, began = _epoch(e.get("time")), _epoch((begins.get(k + 1) or {}).get("time"))
        stopped, resumed = last_step.get(k), first_step.get(k + 1)
        out[k] = {
            "detect_s": _span(stopped, ended),
            "start_s": _span(ended, began),
            "load_s": restore.get(k + 1),
            "first_step_s": _span(began, resumed),
            "total_s": _span(stopped, resumed),
        }
    return out
