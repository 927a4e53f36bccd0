"""The step loop's save policy (hpcscale.launch.steploop): when each checkpoint tier saves, and the drain between
them. One object per rank, behind `ctx.checkpoint` (hpcscale.launch.checkpointing.Checkpointer, the host: it owns
the state a save writes and the two tiers' managers).

- The shared tier saves on its schedule (`checkpoint.every_steps`, a number or `auto`: hpcscale.launch.timing
  .SaveSchedule), asynchronously as `checkpoint.async` says.
- With the node-local tier (`checkpoint.local`), it saves on its own schedule (`checkpoint.local.every_steps`), and
  a shared-tier save that falls due goes to the node-local tier first and is drained from there (only the chunks
  the shared tier lacks are written, in the background) at the first step where no rank's tiers are busy (the
  step's stop check carries `drain_would_wait` in its all-reduce, so every rank agrees), or, a whole period later,
  waited for. The node-local step a drain reads is pinned against the tier's retention until the drain is waited
  for. A node-local save that failed is said and skipped; a drain whose node-local step was not saved saves the
  present state to the shared tier instead (`fallback`), except at the last step and a round boundary, which
  save anyway.
Every choice here is taken on every rank alike: each one follows from outcomes the managers agree on.
"""

from __future__ import annotations

import time
from typing import Any

from hpcscale.errors import RuntimeFailure


class TierSaves:
    """Both tiers' schedules and saves for one rank. `start(step)` once the run's start step is known."""

    def __init__(self, host: Any):
        self._host = host  # the Checkpointer: manager, _local, _state_for_save, _watchdog, _ctx, _policy
        self.shared = None  # launch.timing.SaveSchedule of the shared tier, made at start
        self.local_schedule = None  # the node-local tier's (checkpoint.local.every_steps), made at start
        self.drain_due: int | None = None  # a periodic save saved to the node-local tier, drained at the next step
        self._drain_pin: int | None = None  # the node-local step a drain in flight reads (kept from retention)
        self._background_before: float | None = None  # what the shared save before wrote in the background
        # the training thread's own record of its saves: tier ("shared", "node-local") -> the step of its newest,
        # and how many were taken (a manager's last_step moves when the writer thread commits: not this)
        self.saved: dict[str, int] = {}
        self.saves = 0
        self._local_background_before: float | None = None

    def start(self, step: int) -> None:
        from hpcscale.launch.timing import SaveSchedule

        ctx, policy = self._host._ctx, self._host._policy
        self.shared = SaveSchedule(
            policy.every_steps, start=step, mtbf=ctx.runtime.mtbf_s, log=ctx.metrics.log, say=ctx.metrics.print
        )
        self.local_schedule = SaveSchedule(
            policy.local.every_steps,
            start=step,
            mtbf=ctx.runtime.mtbf_s,
            log=ctx.metrics.log,
            say=ctx.metrics.print,
            tier="node-local",
        )

    # ---- the step's decisions, in the order the step loop takes them ------------------------------------------
    def tick(self, work_s: float) -> None:
        """A step of `work_s` seconds of the user's work: both schedules learn its length (`auto`)."""
        self.shared.step(work_s)
        self.local_schedule.step(work_s)

    def drain_would_wait(self) -> bool:
        """Whether draining now would wait: the node-local save it reads still in flight (a later one in flight
        does not matter: it started after that one had finished), or the shared tier still writing."""
        local = self._host._local
        return (self._in_flight_local(self.drain_due) and local.busy()) or self._host.manager.busy()

    def periodic(self, done: int) -> float:
        """The shared tier's save after `done` steps if its schedule says so: to the node-local tier to be drained,
        when the job has one, else written. Returns the seconds the caller was blocked."""
        if not self.shared.due(done):
            return 0.0
        local = self._host._local
        if local is None:
            blocking = self.save(done, asynchronous=self._host._policy.asynchronous)
            self.shared.saved(done, blocking, self._background_before)
            return blocking
        blocking = 0.0
        # with `auto` the schedule moves on only when the drain runs: a pending one is this period's save
        if self.drain_due is None or not self.shared.auto:
            if self.drain_due is not None:  # the one before has waited a whole period: wait for it now
                blocking += self.drain(fallback=False, done=done)
            # to the node-local tier (node_local below), then drained from there; kept from retention until then
            self.drain_due = done
            local.pin(done, "to be drained to the shared tier")
        return blocking

    def node_local(self, done: int) -> float:
        """The node-local tier's save after `done` steps, if its schedule says so or a shared save is to be
        drained from it. Returns the seconds the caller was blocked."""
        if self._host._local is None:
            return 0.0
        due = self.local_schedule.due(done)
        if not (due or self.drain_due == done):
            return 0.0
        blocking = self.save_local(done)
        if due:
            self.local_schedule.saved(done, blocking, self._local_background_before)
        return blocking

    # ---- saves, the drain, the waits --------------------------------------------------------------------------
    def save(self, done_steps: int, *, asynchronous: bool) -> float:
        """A shared-tier save now, as the state after `done_steps` steps; returns the seconds the caller was
        blocked (the wait for a save still writing included)."""
        host = self._host
        tensors, state = host._state_for_save(done_steps)
        with host._watchdog.paused("checkpoint"):
            t = time.perf_counter()
            self.shared_wait()
            waited = time.perf_counter() - t
            manager = host.manager
            before = manager.last_stats
            # defer_staging: even the copy to host memory runs in the background; the optimizers' pre-step hook
            # (Checkpointer._hook_optimizers) waits for it before the next change to the saved tensors
            stats = manager.save(
                done_steps, tensors, state, asynchronous=asynchronous, defer_staging=asynchronous and host.defer_staging
            )
        # what the save before wrote in the background: its cost to the loop, for checkpoint.every_steps: auto
        self._background_before = (before.background_s or None) if before is not None else None
        self.saved["shared"] = done_steps
        self.saves += 1
        blocking = waited + stats.blocking_s
        metrics = host._ctx.metrics
        metrics.log(step=done_steps - 1, checkpoint=done_steps, checkpoint_blocking_s=round(blocking, 6))
        how = "the rest written in the background" if asynchronous else "written"
        metrics.print(f"hpcscale: checkpoint {done_steps} saved: {blocking:.2f} s blocking, {how}")
        return blocking

    def save_local(self, done_steps: int) -> float:
        """Save to the node-local tier, asynchronously as checkpoint.async says; returns the seconds the caller
        was blocked. A node-local save that fails (a full local disk, a node's directory gone) is said and
        skipped: training and the shared tier go on."""
        host = self._host
        local = host._local
        tensors, state = host._state_for_save(done_steps)
        # bounded: a rank stopped inside a node-local save is named within the watchdog's pause limit, not at the
        # collective timeout (hpcscale.launch.watchdog); the wait for the save before is not this save's own work
        with host._watchdog.paused("node-local checkpoint", bounded=True):
            t = time.perf_counter()
            self.local_wait()
            host._watchdog.progress()
            before = local.last_stats  # what the save before wrote in the background: its cost, for `auto`
            self._local_background_before = (before.background_s or None) if before is not None else None
            try:
                local.save(done_steps, tensors, state, asynchronous=host._policy.asynchronous)
                self.saved["node-local"] = done_steps
                self.saves += 1
            except (RuntimeFailure, OSError) as e:  # the same on every rank: the outcome is agreed on
                host._ctx.metrics.print(f"hpcscale: warning: node-local checkpoint {done_steps} skipped: {e}")
            blocking = time.perf_counter() - t
        host._ctx.metrics.log(
            step=done_steps - 1, local_checkpoint=done_steps, local_checkpoint_blocking_s=round(blocking, 6)
        )
        return blocking

    def drain(self, *, fallback: bool, done: int) -> float:
        """The periodic save of step `drain_due` went to the node-local tier: drain it to the shared tier in the
        background (ckpt.manager.drain). If that node-local save failed, and `fallback`, save the state after
        `done` steps to the shared tier instead, as without the tier. Nothing is drained that is not newer than
        the shared tier's newest (a save since). Returns the seconds the caller was blocked."""
        n, self.drain_due = self.drain_due, None
        host = self._host
        local, manager, metrics = host._local, host.manager, host._ctx.metrics
        with host._watchdog.paused("checkpoint"):
            t = time.perf_counter()
            if self._in_flight_local(n):  # else a later save waited for it: its outcome is known
                self.local_wait()  # the same on every rank: so is every choice below
            self.shared_wait()
            newest = manager.last_step
            if newest is not None and n <= newest:  # a save since (ctx.checkpoint.save, a round) is newer
                local.unpin(n)
                return time.perf_counter() - t
            if n not in local.committed:
                local.unpin(n)
                if not fallback:
                    return time.perf_counter() - t
                metrics.print(
                    f"hpcscale: node-local step {n} was not saved: saving step {done} to the shared tier instead"
                )
                blocking = self.save(done, asynchronous=host._policy.asynchronous)
                self.shared.saved(done, blocking, self._background_before)
                return blocking
            before = manager.last_stats
            self._drain_pin = n  # unpinned once the drain is waited for (shared_wait)
            manager.drain(local.root, n)
            blocking = time.perf_counter() - t
        self._background_before = (before.background_s or None) if before is not None else None
        self.shared.saved(n, blocking, self._background_before)
        metrics.log(step=n - 1, checkpoint=n, checkpoint_blocking_s=round(blocking, 6))
        metrics.print(
            f"hpcscale: checkpoint {n} saved: {blocking:.2f} s blocking, drained from the node-local tier "
            "in the background"
        )
        return blocking

    def shared_wait(self) -> None:
        """Wait for the shared tier's save or drain in flight. A drain that failed is said, not raised (the
        node-local step it read is still there, and the next periodic save tries again); its node-local step
        is released to retention either way."""
        pinned, self._drain_pin = self._drain_pin, None
        try:
            self._host.manager.wait()
        except RuntimeFailure as e:  # raised on every rank alike (the commit's outcome is broadcast)
            if pinned is None:
                raise
            self._host._ctx.metrics.print(f"hpcscale: warning: the drain of node-local step {pinned} failed: {e}")
        finally:
            if pinned is not None:
                self._host._local.unpin(pinned)

    def local_wait(self) -> None:
        """Wait for the node-local save in flight; a failure of it is said, not raised."""
        try:
            self._host._local.wait()
        except RuntimeFailure as e:  # raised on every rank alike (the commit's outcome is broadcast)
            self._host._ctx.metrics.print(f"hpcscale: warning: a node-local checkpoint was not saved: {e}")

    def forget_drain(self) -> None:
        """At the end: a drain never started is not started; the end-of-run save goes to the shared tier itself."""
        if self.drain_due is not None:
            self._host._local.unpin(self.drain_due)
            self.drain_due = None

    def _in_flight_local(self, n: int | None) -> bool:
        local = self._host._local
        return local.last_stats is not None and local.last_stats.step == n
