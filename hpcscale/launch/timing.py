"""Each rank's step-time breakdown, gathered every `metrics.timing_every` steps into RUN/timing.jsonl
(format and the straggler rule: hpcscale.observe.timing).

Per step a rank only reads the clock a few times and appends seven floats to a list; every `every` steps the
ranks exchange one small message each (an MPI gather of their window's means, on MPI's own communicator, so
the training's process groups and streams are not touched) and MPI rank 0 appends one line. The gather is a
collective: every rank records the same steps (the trainer's loop and ctx.checkpoint.step are collectives
already).

With the communication ledger (hpcscale.launch.ledger, `ledger` set by the launch) each step also hands over
its traffic per group, and the gather carries the window's sums and the arrival times it noted; rank 0 lines
up each group's arrivals across its ranks (`lateness`) and writes every rank's figures in the same line. The
message grows with the groups and ARRIVALS_PER_STEP, not with the model."""

from __future__ import annotations

import contextlib
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from hpcscale.launch import mpiwait
from hpcscale.launch.efficiency import memory_gauges
from hpcscale.observe.timing import COLUMNS, MAX_LINE, make_line
from hpcscale.portable.files import append_json_lines
from hpcscale.rundir import TIMING

# (group label, its global ranks) -> per step of the window, the arrival times noted on this rank
Arrivals = dict[tuple[str, tuple[int, ...]], list[list[float]]]


class StepTimes:
    def __init__(
        self,
        *,
        run_dir: Path,
        every: int,
        rank: int,
        node: str,
        pp: int,
        attempt: int | None,
        device=None,
        root_mpi: int = 0,
    ):
        self.every = every
        self.root_mpi = root_mpi  # global rank 0's MPI rank: the windows are gathered to it
        self.device = device  # the rank's torch.device: its memory peaks go with each window (None: host only)
        self.energy = None  # the rank's GPU's NVML counters (launch/nvml.py), when the step loop has them
        self.health = None  # rank 0's HealthWatch (launch/health.py): straggler verdicts go to it as signs
        self.act_on_stragglers = False  # health.stragglers: save (a checkpoint for them), else logged only
        self._windows: list = []  # rank 0: the newest windows, parsed, for the straggler verdict
        self.rank, self.node, self.pp, self.attempt = rank, node, pp, attempt
        self.path = run_dir / TIMING
        self._rows: list[tuple[float, ...]] = []
        self._warned = False
        self.ledger = None  # hpcscale.launch.ledger.Ledger, when installed: each step's traffic
        self._traffic: list = []  # the window's StepTraffic, one per recorded step

    @classmethod
    def for_context(cls, ctx) -> StepTimes:
        return cls(
            run_dir=ctx.run_dir,
            every=ctx.job.metrics.timing_every,
            rank=ctx.rank,
            node=ctx.node,
            pp=ctx.pp_rank,
            attempt=ctx.metrics.attempt,
            device=ctx.device,
            root_mpi=ctx.runtime.root_mpi,
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
        if self.ledger is not None:
            self._traffic.append(self.ledger.take())
        if (step + 1) % self.every == 0:
            self._flush(step)

    def restart(self) -> None:
        """The step clock starts (a restore returned): what the ledger counted before (building the model, the
        load) belongs to no step."""
        if self.ledger is not None:
            self.ledger.take()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Work between steps that is not training (an evaluation): its traffic is left out of the steps'."""
        if self.ledger is None:
            yield
            return
        with self.ledger.aside():
            yield

    def _flush(self, step: int) -> None:

        rows, self._rows = self._rows, []
        traffic, self._traffic = self._traffic, []
        # means, not medians: a rank stopped for 30 ms in one step of five is as slow as one 6 ms slower in each
        means = [statistics.fmean(col) for col in zip(*rows, strict=True)] if rows else [0.0] * len(COLUMNS)
        sums, arrivals = window_traffic(traffic)
        steps = max(len(rows), 1)
        ledger = {name: v / steps for name, v in sums.items()}
        ledger.update(memory_gauges(self.device))  # peaks since the attempt started: not means
        if self.energy is not None and (joules := self.energy.read().get("energy_j")) is not None:
            ledger["energy_j"] = joules  # this rank's GPU since the attempt started
        mine = (self.rank, self.node, self.pp, self.attempt, len(rows), means, ledger, arrivals)
        gathered = mpiwait.gather(mine, root=self.root_mpi)  # to global rank 0, which writes the line
        if gathered is None:
            return
        gathered.sort(key=lambda g: g[0])
        attempt = next((g[3] for g in gathered if g[3] is not None), None)  # global rank 0 knows the attempt
        steps = max(g[4] for g in gathered) or 1
        late = lateness({g[0]: g[7] for g in gathered}, steps=steps)
        for g in gathered:
            g[6].update(late.get(g[0], {}))
        extra = sorted({name for g in gathered for name in g[6]})
        line = make_line(
            time=time.time(),
            attempt=attempt,
            step=step,
            steps=steps,
            rows=[list(g[5]) + [g[6].get(name, 0.0) for name in extra] for g in gathered],
            nodes=[g[1] for g in gathered],
            pp=[g[2] for g in gathered],
            columns=(*COLUMNS, *extra),
        )
        self._append(line)
        if self.health is not None:
            self._judge(line)

    def _judge(self, line: dict) -> None:
        """Rank 0: the straggler rule over the newest windows; each straggler a warning sign (launch/health)."""
        from hpcscale.observe.timing import WINDOWS, judge, parse_line

        window = parse_line(line)
        if window is None:
            return
        self._windows = [*self._windows[-(WINDOWS - 1) :], window]
        verdict = judge(self._windows)
        signs = [
            {
                "kind": "straggler",
                "node": r.node,
                "key": f"rank {r.rank}",
                "act": self.act_on_stragglers,
                "evidence": f"rank {r.rank}: own time {r.relative:.2f}x its peers' (slow in {r.slow_windows} of the "
                f"last {verdict.windows} windows)",
            }
            for r in verdict.ranks
            if r.rank in verdict.slow_ranks
        ]
        if signs:
            self.health.add(signs)

    def _append(self, line: dict) -> None:
        """One line by hpcscale.portable.files.append_json_lines (one write(2) with O_APPEND, never through a
        symlink, only a regular file): a reader sees whole lines, or a torn last one it skips. A line over the
        reader's MAX_LINE is not written. A run directory that cannot take the line (full disk) loses the line,
        not the training."""
        try:
            append_json_lines(self.path, [line], max_line=MAX_LINE, separators=(",", ":"))
        except OSError as e:
            if not self._warned:
                self._warned = True
                with contextlib.suppress(Exception):
                    print(f"hpcscale: cannot record per-rank timing in {self.path}: {e}", file=sys.stderr, flush=True)


def window_traffic(steps: list) -> tuple[dict[str, float], Arrivals]:
    """A window's ledger (one StepTraffic per step): the sums of its columns (bytes.GROUP.KIND, n.GROUP.KIND,
    wait_s.GROUP) and the arrivals per group instance and step."""
    sums: dict[str, float] = {}
    arrivals: Arrivals = {}
    for i, t in enumerate(steps):
        for (group, kind), (n, size) in t.counts.items():
            sums[f"n.{group}.{kind}"] = sums.get(f"n.{group}.{kind}", 0) + n
            sums[f"bytes.{group}.{kind}"] = sums.get(f"bytes.{group}.{kind}", 0) + size
        for group, seconds in t.waited.items():
            sums[f"wait_s.{group}"] = sums.get(f"wait_s.{group}", 0.0) + seconds
        for key, times in t.arrivals.items():
            per_step = arrivals.setdefault(key, [[] for _ in steps])
            per_step[i] = times
    return sums, arrivals


def lateness(arrivals: dict[int, Arrivals], *, steps: int) -> dict[int, dict[str, float]]:
    """Per rank, per group: late_s.GROUP, how late it entered the group's collectives after the group's first
    rank, summed, per step; last.GROUP, the share of them it entered last. `arrivals`: each rank's noted arrivals
    (rank -> (group, its ranks) -> per step, in issue order). The i-th arrival of every member of one group in
    one step is one collective (each member issues the group's collectives in the same order); a step where a
    member noted fewer is compared over the fewest."""
    import numpy as np

    instances: dict[tuple[str, tuple[int, ...]], dict[int, list[list[float]]]] = {}
    for rank, mine in arrivals.items():
        for key, per_step in mine.items():
            instances.setdefault(key, {})[rank] = per_step
    out: dict[int, dict[str, float]] = {}
    for (group, _), by_rank in instances.items():
        members = sorted(by_rank)
        if len(members) < 2:
            continue
        late = np.zeros(len(members))
        last = np.zeros(len(members))
        compared = 0
        for s in range(min(len(by_rank[r]) for r in members)):
            k = min(len(by_rank[r][s]) for r in members)
            if k == 0:
                continue
            at = np.array([by_rank[r][s][:k] for r in members])  # (members, k)
            late += (at - at.min(axis=0)).sum(axis=1)
            last += (at == at.max(axis=0)).sum(axis=1)
            compared += k
        for i, rank in enumerate(members):
            out.setdefault(rank, {})[f"late_s.{group}"] = float(late[i]) / steps
            out[rank][f"last.{group}"] = float(last[i]) / compared if compared else 0.0
    return out


class NoStepTimes:
    """Stand-in where no launch runs the entry (a unit test calling train(ctx) directly)."""

    every = 0

    def record(self, step: int, **_: float) -> None:
        pass

    def restart(self) -> None:
        pass

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        yield


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
        mpiwait.allreduce(figures, agreed, MPI.MAX)
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
