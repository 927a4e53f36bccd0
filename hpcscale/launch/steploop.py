"""The per-step runtime behind `ctx.checkpoint.step(step)`: what happens between two training steps, as named
parts, each its own object:

1. the hang watchdog's beat (hpcscale.launch.watchdog);
2. the stop protocol: one all-reduce, after the step's queued device work, carries every rank's stop flags (one
   per stop signal: every rank learns which came),
   whether a drain due would wait (the save policy's question) and the loop's `sums` (a loss, a norm), read
   back once: the step's one host sync. Any rank's flag: every rank saves the state after this step to the
   shared tier, waits for it (and for a node-local save in flight) and raises StopRequested (exit 75);
3. the save policy of both tiers (hpcscale.launch.tiersaves.TierSaves): a drain that can start without
   waiting, the shared tier's periodic save (through the node-local tier when the job has one), the
   node-local tier's own;
4. cross-site rounds (hpcscale.launch.site_rounds.Rounds, a site of an `xsite:` job): a round boundary saves
   the round checkpoint and waits for (or, overlapping, later adopts) the next global round;
5. the clock (hpcscale.launch.loopclock.LoopClock): the step's time and its parts to per-rank timing, and for a
   user loop a metrics line and the progress line;
6. efficiency (hpcscale.launch.efficiency.Efficiency): the attempt's second step counted for its model FLOPs
   (agreed over the ranks at its step(), once), then each line's `tflops`, `mfu` and memory;
7. spikes (hpcscale.observe.spikes.SpikeWatch, train.on_spike): the loss and gradient norm the loop sums are
   judged right after the stop check brought them back, the same numbers on every rank, so every rank reaches
   the same verdict. `rollback` then loads the newest checkpoint (none is newer: this step's saves come after),
   skips the batches from it to the spike and returns the step to continue from, before anything of the
   spiked step is saved or a stop is taken (a stop flag set meanwhile is seen at the next step);
8. health signals (hpcscale.launch.health, rank 0's poller of Slurm's warning signs): the stop check's all-reduce
   carries rank 0's "a new sign wants a checkpoint" (cooldown applied there), so every rank takes the immediate
   node-local checkpoint (when the job has that tier) at the same step; rank 0 logs each new sign once.
The last step (`ctx.checkpoint.steps` set) saves nothing here: Checkpointer.close saves the end state after the
code returns. `ctx.checkpoint` (hpcscale.launch.checkpointing.Checkpointer) owns the state a save writes and
what a restart loads; it makes this loop at its restore, at the step the run starts from.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

from hpcscale.errors import BadInput
from hpcscale.launch import mpiwait
from hpcscale.launch.efficiency import Efficiency
from hpcscale.launch.health import NoHealthWatch
from hpcscale.launch.loopclock import LoopClock
from hpcscale.launch.metrics import log_health
from hpcscale.launch.nvml import device_signs
from hpcscale.launch.signals import STOP_LINE, STOP_SIGNALS, StopRequested
from hpcscale.observe.spikes import SpikeWatch
from hpcscale.parallel.device import settle

SPIKE_LINE_EVERY = 10  # a key's spike lines for people: at most one per this many steps (metrics.jsonl has each)
ROLLBACKS_TO_ONE_CHECKPOINT = 3  # spikes that keep coming back after this many rollbacks to one step: warn only


class StepLoop:
    """One rank's step loop, from the step the run starts at (`start`)."""

    def __init__(self, host: Any, start: int):
        self._host = host  # the Checkpointer: its state, its tiers' managers, its rounds
        self.saves = host._tiers  # TierSaves, started here
        self.saves.start(start)
        self.clock = LoopClock(host._ctx, start)
        # a metrics line per step with step_time_s (and tokens_per_s): not for the built-in trainer, whose own
        # line per step carries them
        self._user_lines = getattr(host._ctx.job.train, "entry", None) != "builtin"
        ctx = host._ctx
        self.efficiency = Efficiency(ctx, mode=ctx.job.metrics.flops, peak_tflops=ctx.runtime.peak_tflops)
        if ctx.step_times is not None and self.efficiency.gpu is not None:
            ctx.step_times.energy = self.efficiency.gpu  # each rank's GPU energy with its timing windows
        self.on_spike = getattr(ctx.job.train, "on_spike", "warn")
        self.spikes = SpikeWatch() if self.on_spike != "off" else None
        self._said: dict[str, int] = {}  # key -> the step of its last spike line for people
        self._expect: int | None = None  # after a rollback: the step the code must call step() with next
        self._rollbacks = 0  # rollbacks with no save between them: all to one checkpoint
        self.health = ctx.runtime.health or NoHealthWatch()
        # this rank's GPU's own signs (health.devices), read every health.poll_seconds on this thread: driver
        # calls on the host, no device sync
        health = ctx.job.health
        self._devices = health.devices
        self.device_signs = (
            device_signs(ctx.device, rank=ctx.rank, node=ctx.node)
            if health.devices != "off" and health.poll_seconds
            else None
        )
        self._device_every, self._device_read_at = health.poll_seconds, -float("inf")
        if self.on_spike == "rollback" and not host._skippers():
            raise BadInput(
                "train.on_spike: rollback: nothing given to ctx.checkpoint.restore can skip batches (an object "
                "with a skip(batches) method, as the built-in trainer's loader has): a rollback would read the "
                "spike's batches again"
            )

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Work between steps that is not training (an evaluation): no step's time, traffic or FLOPs."""
        self.efficiency.suspend()
        try:
            with self.clock.paused():
                yield
        finally:
            self.efficiency.resume()

    def step(
        self,
        step: int,
        *,
        data_s: float = 0.0,
        sums: dict[str, Any] | None = None,
        report: Callable[[dict[str, float]], None] | None = None,
    ) -> int:
        """Step `step` (0-based) is finished (Checkpointer.step says what the arguments are). Returns the step to
        run next: `step + 1`, or after a rollback the checkpoint's step."""
        host, saves, clock = self._host, self.saves, self.clock
        ctx = host._ctx
        if self._expect is not None and step != self._expect:
            raise BadInput(
                f"ctx.checkpoint.step({step}) after a rollback to step {self._expect}: with train.on_spike: rollback "
                "the loop must continue from the step ctx.checkpoint.step returned"
            )
        self._expect = None
        host._watchdog.beat(step)
        flops = self.efficiency.step_done(host.tokens_per_step)  # the counted step's: a collective, once
        if flops is not None:
            self._say_flops(step, flops)
        done = step + 1
        host._done = done
        host._stepped = True
        settle(ctx.device)  # the user's queued GPU work belongs to the step, not to the stop check's wait
        t_sync = time.perf_counter()
        draining = saves.drain_due is not None
        self._read_device(step)
        # a rank other than 0 with new signs of its own GPU sends them to rank 0, which logs them (below)
        news = ctx.rank != 0 and self.health.pending()
        # the stop flag is one per stop signal: every rank learns which one came (srun signals each node's ranks
        # at its own moment: rank 0, which records the stop, may not have got it yet)
        got = ctx.stop.signal
        flags, values = ctx.any_of_and_sums(
            (*(got == s for s in STOP_SIGNALS), draining and saves.drain_would_wait(), self.health.wants_save(), news),
            sums or {},
        )
        *came, tier_busy, signed, news = flags
        stop = any(came)
        if stop and ctx.stop.signal is None:  # another rank's signal: this rank stops for it too (`at` stays None)
            ctx.stop.signal = next(s for s, c in zip(STOP_SIGNALS, came, strict=True) if c)
        if news:
            self._gather_signs()
        t_read = time.perf_counter()
        report_s = 0.0
        if report is not None:
            report(dict(values))  # the code's copy: the verdict below must see the same numbers on every rank
            # writing the step's line (rank 0's, the built-in trainer's) is no part of the step, as a user loop's
            # line, written after the step is booked, is not: else rank 0 alone pays for it, and on a loaded
            # machine with short steps the straggler rule named it for that
            report_s = time.perf_counter() - t_read
        found = self.spikes.observe(step, values) if self.spikes is not None and values else []
        if found:
            back = self._spiked(step, found)
            if back is not None:
                clock.skip_step(t_sync, t_read)  # the spiked step is no step: its waits and traffic are dropped
                return back
        self._say_signs(step)  # before a stop: the signs gathered at this step are logged, not lost with it
        if stop:
            self._stop(step)
        t_saves = time.perf_counter()
        wait_s = clock.wait_s()  # the step's collective waits, saves left out
        sync_s = clock.sync_s(t_sync, t_read)
        work_s = clock.work_s(t_saves) - report_s
        saves.tick(work_s)
        rounds = host._rounds
        last = host.steps is not None and done >= host.steps
        boundary = rounds is not None and rounds.is_boundary(done)
        ckpt_s = 0.0
        saves_before = saves.saves
        if draining and not tier_busy:  # the node-local save it reads is committed on every node: no wait
            ckpt_s += saves.drain(fallback=not last and not boundary, done=done)
        if last:
            pass  # close() saves the end state, after the code's own end (a final evaluation) and the round in flight
        elif boundary:
            host._round_boundary(done)
        else:
            ckpt_s += saves.periodic(done)
        if not last:
            ckpt_s += saves.node_local(done)
        if signed and not last:  # a warning sign: a checkpoint now, on every rank
            ckpt_s += self._sign_save(step, done)
        if saves.saves != saves_before:  # a save: a rollback from here on goes back to it
            self._rollbacks = 0
        if rounds is not None and rounds.overlap and not boundary and not last:
            host.manager.wait_staged()  # adopting a round changes the weights a deferred save is still copying
            rounds.poll(done)  # adopt the round in flight if it has landed
        clock.record(step, step_s=work_s + ckpt_s, data_s=data_s, sync_s=sync_s, ckpt_s=ckpt_s, wait_s=wait_s)
        if self._user_lines:
            step_s = work_s + ckpt_s
            ctx.metrics.log(**clock.line(step, step_s, host.tokens_per_step), **self.efficiency.figures(step_s))
            if host.steps:
                clock.say_progress(step, work_s + ckpt_s, host.steps)
        clock.end_step()
        self.efficiency.next_step(last=last)
        return done

    def _say_flops(self, step: int, record: dict) -> None:
        """The model FLOPs found at the counted step: a metrics line and one line for people."""
        metrics = self._host._ctx.metrics
        metrics.log(step=step, model_flops=record)
        per_step = record.get("flops_per_step")
        if per_step is None:
            metrics.print(f"hpcscale: model FLOPs not known ({record['why']}): no tflops or mfu")
            return
        per_token = record.get("flops_per_token")
        tok = f", {per_token / 1e9:.4g} GFLOP per token" if per_token else ""
        peak = (
            f"MFU against {record['peak_tflops']:g} TFLOPS per {record['device']} ({record['peak_source']})"
            if record["peak_tflops"]
            else f"no peak known for {record['device']}: no MFU (site devices.peak_tflops)"
        )
        metrics.print(f"hpcscale: model FLOPs {per_step / 1e12:.4g} TFLOP per step ({record['source']}{tok}); {peak}")

    def _spiked(self, step: int, found: list) -> int | None:
        """Spikes at `step` (the same on every rank): logged (rank 0) with the data position, and with `rollback`
        the newest checkpoint loaded again and the batches from it to the spike skipped. Returns the step to
        continue from after a rollback, None otherwise."""
        host = self._host
        metrics = host._ctx.metrics
        for spike in found:
            last = self._said.get(spike.key)
            if last is None or step - last >= SPIKE_LINE_EVERY or step < last:
                self._said[spike.key] = step
                metrics.print(f"hpcscale: {spike.words()}")
        spikes = [s.to_json() for s in found]
        if self.on_spike != "rollback":
            metrics.log(step=step, spike=spikes, position=host._positions())
            return None
        if self._rollbacks >= ROLLBACKS_TO_ONE_CHECKPOINT:
            metrics.log(step=step, spike=spikes, position=host._positions())
            metrics.print(
                f"hpcscale: not rolled back again: {self._rollbacks} rollbacks to one checkpoint met spikes again "
                "(they follow the model, not the data); training goes on"
            )
            return None
        t0 = time.perf_counter()
        keys = sorted({s["key"] for s in spikes})
        with self.clock.paused(), self.efficiency_paused():
            rolled = host._roll_back({"spike_step": step, "keys": keys})
        if rolled is None:
            metrics.log(step=step, spike=spikes, position=host._positions(), rollback=None)
            metrics.print("hpcscale: no checkpoint to roll back to: training goes on")
            return None
        back, at_checkpoint, kept = rolled
        self._rollbacks += 1
        metrics.log(
            step=step,
            spike=spikes,
            rollback={"to_step": back, "from": at_checkpoint, "to": kept, "s": round(time.perf_counter() - t0, 3)},
        )
        metrics.print(
            f"hpcscale: rolled back to checkpoint step {back}; the data read since it, to the spike's batch, is "
            f"skipped ({_position_words(at_checkpoint)} to {_position_words(kept)}); training goes on from step {back}"
        )
        self._expect = back
        return back

    def closing(self) -> None:
        """The code returned (Checkpointer.close): a rollback it did not follow is an error, not an end."""
        self.efficiency.close()
        if self.device_signs is not None:
            self.device_signs.close()
        if self._expect is not None:
            raise BadInput(
                f"the loop ended after a rollback to step {self._expect} (train.on_spike: rollback): it must go on "
                "from the step ctx.checkpoint.step returned; the state now is that checkpoint's, not the end's"
            )

    @contextlib.contextmanager
    def efficiency_paused(self) -> Iterator[None]:
        self.efficiency.suspend()
        try:
            yield
        finally:
            self.efficiency.resume()

    def _read_device(self, step: int) -> None:
        """This rank's GPU's signs, every health.poll_seconds: new ones ask for a save (health.devices: save) on
        every rank through the stop check."""
        if self.device_signs is None or time.monotonic() - self._device_read_at < self._device_every:
            return
        self._device_read_at = time.monotonic()
        found = self.device_signs.read(step)
        if found:
            save = self._devices == "save"
            for sign in found:  # one that only warns (health.devices: warn, an Xid a program can cause) is no
                sign["suspect"] = save and sign.get("suspect", True)  # reason to save or to suspect its node
            self.health.add([{**sign, "act": sign["suspect"]} for sign in found])

    def _gather_signs(self) -> None:
        """Every rank, when one has new signs of its GPU: they go to rank 0 (one MPI gather; rare), which logs
        them as its own. Their save is asked for by each rank's own vote in the stop check, not again here."""

        ctx = self._host._ctx
        mine = self.health.take() if ctx.rank != 0 else []
        got = mpiwait.gather(mine, root=ctx.runtime.root_mpi)  # global rank 0's MPI rank
        if got:
            self.health.add([{**sign, "act": False} for part in got for sign in part])

    def _say_signs(self, step: int) -> None:
        """Rank 0: each new warning sign once, with its evidence (metrics.jsonl and a line)."""
        signs = self.health.take()
        if not signs:
            return
        metrics = self._host._ctx.metrics
        log_health(metrics, step, health=signs)
        for sign in signs:
            where = f" on {sign['node']}" if sign.get("node") else ""
            metrics.print(f"hpcscale: warning sign at step {step}: {sign['kind']}{where} ({sign['evidence']})")

    def _sign_save(self, step: int, done: int) -> float:
        """The node-local checkpoint a warning sign asks for, after `done` steps (the shared tier's schedule is
        unchanged); none when this step saved that tier already, and none without the tier (the sign is logged
        only). Returns the seconds blocked."""
        host = self._host
        self.health.saved()  # the cooldown starts whatever happens: a sign asks once
        if host._local is None:
            return 0.0
        if self.saves.saved.get("node-local") == done:  # this step saved it already (the training thread's record)
            return 0.0
        blocking = self.saves.save_local(done)
        if self.saves.saved.get("node-local") == done:  # else the save failed, was said and skipped
            entry = {"step": done, "tier": "node-local", "blocking_s": round(blocking, 4)}
            log_health(host._ctx.metrics, step, health_checkpoint=entry)
            host._ctx.metrics.print(f"hpcscale: node-local checkpoint {done} for the warning sign(s) above")
        return blocking

    def _stop(self, step: int) -> None:
        """A rank got a stop signal: the state after `step` saved to the shared tier and waited for (a node-local
        save in flight committed before the groups are torn down), then StopRequested on every rank."""
        host = self._host
        host.save(step + 1, asynchronous=False)
        host.manager.wait()
        if host._local_manager is not None:
            with host._watchdog.paused("checkpoint"):
                self.saves.local_wait()
        host._ctx.metrics.print(f"{STOP_LINE} {step} (checkpoint saved)")
        raise StopRequested(step)


def _position_words(positions: dict) -> str:
    """`loader epoch 0 batch 25`: a data position as a rollback's line says it."""
    words = []
    for name, state in positions.items():
        if isinstance(state, dict) and "batch" in state:
            words.append(f"{name} epoch {state.get('epoch')} batch {state.get('batch')}")
        else:
            words.append(f"{name} {str(state)[:80]}")
    return ", ".join(words) or "no position"
