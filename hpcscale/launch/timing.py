"""Each rank's step-time breakdown, gathered every `metrics.timing_every` steps into RUN/timing.jsonl
(format and the straggler rule: hpcscale.observe.timing).

Per step a rank only reads the clock a few times and appends seven floats to a list; every `every` steps the
ranks exchange one small message each (an MPI gather of their window's means, on MPI's own communicator, so
the training's process groups and streams are not touched) and MPI rank 0 appends one line. The gather is a
collective: every rank records the same steps (the trainer's loop and ctx.checkpoint.step are collectives
already)."""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import time
from pathlib import Path

from hpcscale.observe.timing import COLUMNS, make_line
from hpcscale.rundir import TIMING


class StepTimes:
    def __init__(self, *, run_dir: Path, every: int, rank: int, node: str, pp: int, attempt: int | None):
        self.every = every
        self.rank, self.node, self.pp, self.attempt = rank, node, pp, attempt
        self.path = run_dir / TIMING
        self._rows: list[tuple[float, ...]] = []
        self._warned = False

    @classmethod
    def for_context(cls, ctx) -> StepTimes:
        return cls(
            run_dir=ctx.run_dir,
            every=ctx.job.metrics.timing_every,
            rank=ctx.rank,
            node=ctx.node,
            pp=ctx.pp_rank,
            attempt=ctx.metrics.attempt,
        )

    def record(
        self,
        step: int,
        *,
        step_s: float,
        data_s: float = 0.0,
        dp_wait_s: float = 0.0,
        sync_s: float = 0.0,
        ckpt_s: float = 0.0,
        wait_s: float = 0.0,
    ) -> None:
        """Step `step` (0-based) took `step_s`; `wait_s`: every collective wait of the step outside checkpoint
        saves (hpcscale.launch.waits), of which `dp_wait_s` and `sync_s` are hpcscale's own collectives; the
        rest of it is `comm_s`. A window closes after every `every`-th step (a collective then)."""
        if not self.every:
            return
        comm = max(0.0, wait_s - dp_wait_s - sync_s)
        own = max(0.0, step_s - dp_wait_s - sync_s - comm)
        compute = max(0.0, own - data_s - ckpt_s)
        self._rows.append((step_s, own, compute, data_s, dp_wait_s, sync_s, ckpt_s, comm))
        if (step + 1) % self.every == 0:
            self._flush(step)

    def _flush(self, step: int) -> None:
        from mpi4py import MPI

        rows, self._rows = self._rows, []
        # means, not medians: a rank stopped for 30 ms in one step of five is as slow as one 6 ms slower in each
        means = [statistics.fmean(col) for col in zip(*rows, strict=True)] if rows else [0.0] * len(COLUMNS)
        gathered = MPI.COMM_WORLD.gather((self.rank, self.node, self.pp, self.attempt, len(rows), means), root=0)
        if gathered is None:
            return
        gathered.sort()
        attempt = next((g[3] for g in gathered if g[3] is not None), None)  # global rank 0 knows the attempt
        line = make_line(
            time=time.time(),
            attempt=attempt,
            step=step,
            steps=max(g[4] for g in gathered) or 1,
            rows=[g[5] for g in gathered],
            nodes=[g[1] for g in gathered],
            pp=[g[2] for g in gathered],
        )
        self._append(line)

    def _append(self, line: dict) -> None:
        """One write(2) with O_APPEND: a reader sees whole lines, or a torn last one it skips. A run directory
        that cannot take the line (full disk) loses the line, not the training."""
        import json

        data = (json.dumps(line, separators=(",", ":")) + "\n").encode()
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)
        except OSError as e:
            if not self._warned:
                self._warned = True
                with contextlib.suppress(Exception):
                    print(f"hpcscale: cannot record per-rank timing in {self.path}: {e}", file=sys.stderr, flush=True)


class NoStepTimes:
    """Stand-in where no launch runs the entry (a unit test calling train(ctx) directly)."""

    every = 0

    def record(self, step: int, **_: float) -> None:
        pass


class SaveSchedule:
    """When the periodic saves come: every `checkpoint.every_steps` steps, or, with `auto`, at the interval
    hpcscale.observe.interval plans from each save's measured cost. With auto, `saved()` is a collective (one
    tiny MPI all-reduce per save): every rank plans from the same figures, the largest any rank measured, so
    they all save at the same step."""

    def __init__(self, every: int | str, *, start: int, mtbf=None, log=None, say=None, tier: str = ""):
        self.tier = tier  # "" for the shared tier, "node-local" for checkpoint.local
        self.auto = every == "auto"
        self.every = 0 if self.auto else int(every)
        self.mtbf = mtbf
        self._log, self._say = log, say
        self.next_at: int | None = None
        if self.auto:
            from hpcscale.observe.interval import FIRST_SAVE_STEPS, StepClock

            self.next_at = start + FIRST_SAVE_STEPS
            self._clock = StepClock()
        self.choice = None

    @property
    def enabled(self) -> bool:
        return self.auto or self.every > 0

    def due(self, done_steps: int) -> bool:
        if self.auto:
            return done_steps >= self.next_at
        return bool(self.every) and done_steps % self.every == 0

    def step(self, step_s: float) -> None:
        if self.auto:
            self._clock.add(step_s)

    def saved(self, done_steps: int, blocking_s: float, previous_background_s: float | None) -> None:
        """A periodic save after `done_steps` steps blocked the loop `blocking_s` (the previous save's background
        write took `previous_background_s`, None for none): plan the next one."""
        if not self.auto:
            return
        import numpy as np
        from mpi4py import MPI

        from hpcscale.observe.interval import choose

        median, extra = self._clock.take(previous_background_s)
        figures = np.array([blocking_s, extra, median], dtype=np.float64)
        agreed = np.empty_like(figures)
        MPI.COMM_WORLD.Allreduce(figures, agreed, op=MPI.MAX)
        self.choice = choose(
            blocking_s=float(agreed[0]), background_s=float(agreed[1]), step_s=float(agreed[2]), mtbf=self.mtbf
        )
        self.next_at = done_steps + self.choice.steps
        key = "local_checkpoint_interval" if self.tier else "checkpoint_interval"
        if self._log is not None:
            self._log(step=done_steps - 1, **{key: {**self.choice.to_json(), "next_at": self.next_at}})
        if self._say is not None:
            c = self.choice
            what = f"{self.tier} checkpoint" if self.tier else "checkpoint"
            self._say(f"hpcscale: next {what} at step {self.next_at} ({c.steps} steps): {c.why}")
