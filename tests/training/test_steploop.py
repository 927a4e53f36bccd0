"""The step loop's named parts, each on its own: the save policy of both tiers (TierSaves) with real checkpoint
managers on a one-rank gloo group, and the clock (LoopClock) with a real metrics file. The whole loop behind
ctx.checkpoint.step runs in every training test (tests/ckpt/test_nodelocal.py, tests/house/test_progress.py, ...).
"""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest
import torch

from hpcscale.errors import BadInput
from hpcscale.launch.context import MetricsLogger, Runtime
from hpcscale.launch.loopclock import LoopClock
from hpcscale.launch.metrics import log_health
from hpcscale.launch.tiersaves import TierSaves
from hpcscale.launch.watchdog import NoWatchdog


class Host:
    """What TierSaves asks of ctx.checkpoint: the two tiers' managers, the state a save writes, the policy."""

    def __init__(self, shared, local, policy, metrics):
        self.manager, self._local, self._policy = shared, local, policy
        self._ctx = SimpleNamespace(runtime=Runtime(), metrics=metrics)
        self._watchdog = NoWatchdog()
        self.defer_staging = False

    def _state_for_save(self, done: int):
        return {"model/w": torch.full((4,), float(done))}, {"step": done}


def _managers(tmp_path):
    from hpcscale.ckpt import nodelocal
    from hpcscale.ckpt.local_tier import NodeLocalManager
    from hpcscale.ckpt.manager import CheckpointManager
    from hpcscale.layout import ParallelDims

    dims = ParallelDims.for_world(world_size=1, tp=1, pp=1)
    layout = nodelocal.build(["n1"], 0, {}, [], "other")
    local = NodeLocalManager(tmp_path / "local", dims=dims, rank=0, keep_last=10, node_local=layout)
    shared = CheckpointManager(tmp_path / "shared", dims=dims, rank=0, keep_last=10)
    return shared, local


def _run(saves: TierSaves, steps: int) -> list[tuple[int, str]]:
    """The loop's order of the policy's calls (hpcscale.launch.steploop), the drain's question answered by the
    managers themselves: what happened after each step."""
    happened = []
    for done in range(1, steps + 1):
        saves._host.manager.wait()  # each step long enough for the drain before to end (a loaded machine: not so)
        draining = saves.drain_due is not None
        busy = draining and saves.drain_would_wait()
        saves.tick(0.01)
        if draining and not busy:
            saves.drain(fallback=True, done=done)
            happened.append((done, "drained"))
        if saves.periodic(done) or saves.drain_due == done:
            happened.append((done, "to drain"))
        if saves.node_local(done):
            happened.append((done, "node-local"))
    return happened


def test_the_shared_tiers_save_goes_through_the_node_local_tier_and_is_drained_at_the_next_step(group, tmp_path):
    shared, local = _managers(tmp_path)
    metrics = MetricsLogger(tmp_path / "metrics.jsonl")
    policy = SimpleNamespace(every_steps=4, asynchronous=False, local=SimpleNamespace(every_steps=3))
    saves = TierSaves(Host(shared, local, policy, metrics))
    saves.start(0)
    happened = _run(saves, 9)
    # node-local every 3 and wherever a shared save is to be drained (4, 8); each drained at the step after
    assert happened == [
        (3, "node-local"),
        (4, "to drain"),
        (4, "node-local"),
        (5, "drained"),
        (6, "node-local"),
        (8, "to drain"),
        (8, "node-local"),
        (9, "drained"),
        (9, "node-local"),
    ], happened
    shared.wait()
    assert shared.last_step == 8 and sorted(local.committed) == [3, 4, 6, 8, 9]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["checkpoint"] for r in rows if "checkpoint" in r] == [4, 8]
    assert [r["local_checkpoint"] for r in rows if "local_checkpoint" in r] == [3, 4, 6, 8, 9]
    saves.forget_drain()
    shared.close()
    local.close()


def test_without_the_node_local_tier_the_shared_tier_saves_on_its_schedule(group, tmp_path):
    from hpcscale.ckpt.manager import CheckpointManager
    from hpcscale.layout import ParallelDims

    shared = CheckpointManager(tmp_path / "shared", dims=ParallelDims.for_world(world_size=1, tp=1, pp=1), rank=0)
    policy = SimpleNamespace(every_steps=3, asynchronous=True, local=SimpleNamespace(every_steps=0))
    saves = TierSaves(Host(shared, None, policy, MetricsLogger(tmp_path / "metrics.jsonl")))
    saves.start(0)
    saved = [done for done in range(1, 8) if (saves.tick(0.01), saves.periodic(done))[1] or shared.last_step == done]
    shared.wait()
    assert saved == [3, 6] and shared.last_step == 6 and saves.node_local(6) == 0.0
    shared.close()


def _clock(tmp_path, **ctx):
    metrics = MetricsLogger(tmp_path / "metrics.jsonl")
    base = {"step_times": None, "grad_sync_wait_s": 0.0, "collective_s": 0.0, "runtime": Runtime(), "metrics": metrics}
    return LoopClock(SimpleNamespace(**{**base, **ctx}), start=0), metrics


def test_the_clock_leaves_paused_work_out_and_counts_the_codes_collectives_as_sync(tmp_path):
    ctx = SimpleNamespace(step_times=None, grad_sync_wait_s=0.0, collective_s=0.0, runtime=Runtime(), metrics=None)
    clock = LoopClock(ctx, start=0)
    with clock.paused():
        time.sleep(0.2)  # an evaluation: no step's time
    assert clock.work_s(time.perf_counter()) < 0.15
    ctx.collective_s = 0.5  # clip_grad_norm_'s all-reduces waited half a second
    assert clock.sync_s(10.0, 10.25) == pytest.approx(0.75)
    assert clock.sync_s(10.0, 10.25) == pytest.approx(0.25)  # counted once


def test_the_step_line_and_the_progress_line(tmp_path, capsys):
    clock, metrics = _clock(tmp_path)
    assert LoopClock.line(3, 0.5, 1000) == {"step": 3, "step_time_s": 0.5, "tokens_per_s": 2000.0}
    assert LoopClock.line(3, 0.5, 0) == {"step": 3, "step_time_s": 0.5}
    with pytest.raises(BadInput, match="tokens_per_step"):
        LoopClock.line(3, 0.5, "lots")
    metrics.log(step=0, loss=2.5, step_time_s=9.0)  # the loop's loss is shown; hpcscale's own keys are not
    clock.say_progress(0, 30.0, 100)
    first = capsys.readouterr().out
    assert "step 1/100 done, loss 2.5, first step 30 s" in first and "about" not in first
    for step in range(1, 99):
        clock.say_progress(step, 0.5, 100)  # quiet until PROGRESS_EVERY_S or the last step
    assert capsys.readouterr().out == ""
    clock.say_progress(99, 0.5, 100)
    last = capsys.readouterr().out
    assert "step 100/100 done, loss 2.5, 0.5 s/step, 0 steps left" in last  # the first step's 30 s is no pace
    assert metrics.latest(1) == [("loss", 2.5)] and metrics.latest(0) == []


def test_the_warning_sign_keys_are_hpcscales_own(tmp_path):
    """`status` reads warning signs and the checkpoints they caused from `health` and `health_checkpoint`: a line
    the user's loop logs under either key is refused (nothing written), hpcscale's own writer puts them there."""
    path = tmp_path / "metrics.jsonl"
    metrics = MetricsLogger(path)
    for key in ("health", "health_checkpoint"):
        with pytest.raises(BadInput, match=f"{key} is the key hpcscale's own warning signs"):
            metrics.log(step=3, loss=1.0, **{key: [{"kind": "fake", "node": "n1", "evidence": "spoofed"}]})
    assert path.read_text() == ""
    sign = {"kind": "ecc", "node": "n2", "evidence": "2 new uncorrected errors"}
    log_health(metrics, 4, health=[sign])
    log_health(metrics, 4, health_checkpoint={"step": 5, "tier": "node-local", "blocking_s": 0.1})
    with pytest.raises(ValueError, match="health"):
        log_health(metrics, 4, loss=1.0)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["step"], r.get("health"), r.get("health_checkpoint", {}).get("step")) for r in rows] == [
        (4, [sign], None),
        (4, None, 5),
    ]
    assert metrics.latest() == []  # not numbers of the user's loop: the progress line does not show them
