"""The step loop's clock (hpcscale.launch.steploop): what each step cost, split as per-rank timing books it, and
how far the run has to go.

A step's time is measured from the end of the previous `ctx.checkpoint.step()` (or the restore) to the end of
this one, saves included; time inside `ctx.checkpoint.paused(...)` (an evaluation) is left out, and so is the
writing of the step's line on rank 0 (the built-in trainer's `report`, a user loop's line from step()). Its parts:
`sync_s`, the stop check's all-reduce and the collectives hpcscale made for the code (`ctx.collective_s`:
clip_grad_norm_'s, the reference trainer's loss); `wait_s`, every collective wait of the training thread
(hpcscale.launch.waits) saves left out; `dp_wait_s`, the data-parallel gradient averaging's wait
(ctx.grad_sync_wait_s). They go to the rank's StepTimes (per-rank timing, docs/observability.md).

For a user loop (not the built-in trainer, whose own line says the same), a metrics line per step
(`step_time_s`, `tokens_per_s` with ctx.checkpoint.tokens_per_step) and, with ctx.checkpoint.steps set, a
progress line every PROGRESS_EVERY_S: the numbers the loop logged last, the pace (the median of this attempt's
last PACE_STEPS step times after its first: a first step that compiles or warms caches up is no guide to the
rest) and the time left.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

from hpcscale.errors import BadInput
from hpcscale.launch.timing import NoStepTimes

PROGRESS_EVERY_S = 30.0  # a user loop's progress line (steps left, time left): at most this often
PACE_STEPS = 20  # the progress line's pace: the median of this many recent step times


class LoopClock:
    """One rank's step clock, started at the step the run starts from (after its restore)."""

    def __init__(self, ctx: Any, start: int):
        self._ctx = ctx
        self._times = ctx.step_times or NoStepTimes()
        self._times.restart()  # the ledger's counts from before the first step (model build, the load) are no step's
        self._dp_wait_last = ctx.grad_sync_wait_s
        self._collective_last = ctx.collective_s
        self._t_last = time.perf_counter()  # when the last step() (or restore) returned
        self._waits_last = self.waited()  # the collective-wait clock at the last step()'s end
        self._progress = (self._t_last, start, -math.inf)  # since when, from which step, last said
        self._recent_s: deque[float] = deque(maxlen=PACE_STEPS)

    def waited(self) -> float:
        """The collective-wait clock (hpcscale.launch.waits) of the training thread; 0 while timing is off."""
        waits = self._ctx.runtime.waits
        return waits.total_s if waits is not None else 0.0

    def sync_s(self, t_sync: float, t_read: float) -> float:
        """The stop check's all-reduce (from t_sync to t_read) and the step's other collectives made for the code."""
        now = self._ctx.collective_s
        took = t_read - t_sync + now - self._collective_last
        self._collective_last = now
        return took

    def work_s(self, now: float) -> float:
        """The user's step: from the previous step()'s end to `now` (this one's stop check)."""
        return now - self._t_last

    def wait_s(self) -> float:
        """The step's collective waits so far (read before any save: saves are left out)."""
        return self.waited() - self._waits_last

    def record(self, step: int, *, step_s: float, data_s: float, sync_s: float, ckpt_s: float, wait_s: float) -> None:
        """Book the step with per-rank timing."""
        dp_wait = self._ctx.grad_sync_wait_s
        self._times.record(
            step,
            step_s=step_s,
            data_s=data_s,
            dp_wait_s=dp_wait - self._dp_wait_last,
            sync_s=sync_s,
            ckpt_s=ckpt_s,
            wait_s=wait_s,
        )
        self._dp_wait_last = dp_wait

    def skip_step(self, t_sync: float, t_read: float) -> None:
        """The step ends without being booked (a rollback undid it): the next step is measured from here, and what
        this one waited for and sent counts for none."""
        self.sync_s(t_sync, t_read)
        self._dp_wait_last = self._ctx.grad_sync_wait_s
        self._times.restart()
        self.end_step()

    def end_step(self) -> None:
        """The step's end: the next step is measured from here."""
        self._t_last = time.perf_counter()
        self._waits_last = self.waited()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Work between steps that is not training: its time and its collective waits belong to no step."""
        t, w = time.perf_counter(), self.waited()
        times = self._ctx.step_times  # an evaluation's collectives are no step's traffic either
        with times.paused() if times is not None else contextlib.nullcontext():
            yield
        self._t_last += time.perf_counter() - t
        self._waits_last += self.waited() - w

    @staticmethod
    def line(step: int, step_s: float, tokens_per_step: Any) -> dict:
        """What hpcscale measures of a step for any entry point: its wall time (from the previous step() to this
        one's end, saves included) and, with tokens_per_step set, the throughput."""
        out = {"step": step, "step_time_s": round(step_s, 6)}
        if type(tokens_per_step) not in (int, float) or tokens_per_step < 0:
            raise BadInput(
                f"ctx.checkpoint.tokens_per_step is {tokens_per_step!r}: the tokens of one global step (0: unknown)"
            )
        if tokens_per_step and step_s > 0:
            out["tokens_per_s"] = round(tokens_per_step / step_s, 3)
        return out

    def say_progress(self, step: int, step_s: float, steps: int) -> None:
        """With `steps` known: every PROGRESS_EVERY_S (and at the first and last step) one line with the steps
        left, the time they take and the numbers the loop logged last (its loss, at least, when it logs one)."""
        since, first, said = self._progress
        now = time.perf_counter()
        if step > first:
            self._recent_s.append(step_s)
        last = step + 1 >= steps
        if not (last or step == first or now - said >= PROGRESS_EVERY_S):
            return
        self._progress = (since, first, now)
        left = max(steps - step - 1, 0)
        metrics = self._ctx.metrics
        logged = "".join(f", {k} {v:.5g}" for k, v in metrics.latest(4))
        if not self._recent_s:
            metrics.print(
                f"hpcscale: step {step + 1}/{steps} done{logged}, first step {step_s:.3g} s (compilation and "
                f"warm-up included: the time left follows from the next steps), {left} steps left"
            )
            return
        pace = statistics.median(self._recent_s)
        eta = int(left * pace)
        metrics.print(
            f"hpcscale: step {step + 1}/{steps} done{logged}, {pace:.3g} s/step, {left} steps left, about "
            f"{eta // 3600}:{eta % 3600 // 60:02d}:{eta % 60:02d}"
        )
