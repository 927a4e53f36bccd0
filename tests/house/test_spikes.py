"""The spike rule (hpcscale.observe.spikes): hand-made histories, and properties over any history."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from hpcscale.observe.spikes import DEVIATIONS, FLOOR, LEVEL, MIN_HISTORY, REBASE, WINDOW, SpikeWatch


def _fed(values: list[float], key: str = "loss") -> SpikeWatch:
    watch = SpikeWatch()
    for step, v in enumerate(values):
        assert watch.observe(step, {key: v}) == []
    return watch


def test_a_jump_over_the_history_is_a_spike_and_noise_is_not():
    noisy = [2.0 + 0.01 * ((i * 7) % 5 - 2) for i in range(40)]  # 1.98 .. 2.02
    assert _fed(noisy).observe(40, {"loss": 2.03}) == []  # noise
    (spike,) = _fed(noisy).observe(40, {"loss": 3.5, "grad_norm": 1.0})
    assert spike.key == "loss" and spike.step == 40 and spike.value == 3.5
    level = sorted(noisy[-10:])[4:6]
    assert spike.level == sum(level) / 2 and spike.threshold == FLOOR["loss"] * spike.level  # the floor: tiny noise
    assert "loss spike at step 40: 3.5" in spike.words()


def test_the_noise_sets_the_bar_when_steps_jump_about():
    wide = [1.0 if i % 2 else 3.0 for i in range(50)]  # level 2, every step's change 2: noise 1.4826 x 2 / sqrt 2
    bar = 2.0 + DEVIATIONS * 1.4826 * 2.0 / math.sqrt(2)
    assert _fed(wide).observe(50, {"loss": bar - 0.01}) == []
    (spike,) = _fed(wide).observe(50, {"loss": bar + 0.01})
    assert math.isclose(spike.threshold, bar)


def test_nothing_is_judged_before_the_history_is_long_enough_except_a_non_finite_value():
    watch = SpikeWatch()
    for step in range(MIN_HISTORY):
        assert watch.observe(step, {"loss": 1.0 if step < MIN_HISTORY - 1 else 100.0}) == []
    fresh = SpikeWatch()
    (nan,) = fresh.observe(0, {"loss": float("nan")})
    assert nan.threshold is None and "not a finite number" in nan.words()
    (inf,) = fresh.observe(1, {"grad_norm": float("inf")})
    assert inf.key == "grad_norm"


def test_a_falling_loss_is_judged_against_its_recent_level_not_its_start():
    falling = [5.5 - 0.06 * i + 0.05 * ((i * 7) % 3 - 1) for i in range(30)]  # 5.5 down to about 3.8, noisy
    watch = _fed(falling)
    recent = sorted(falling[-LEVEL:])[LEVEL // 2 - 1 : LEVEL // 2 + 1]
    assert watch.observe(30, {"loss": 4.4}) == []
    (spike,) = watch.observe(31, {"loss": 6.0})  # below where the run started, far above where it is
    assert spike.level == sum(recent) / 2


def test_a_spike_does_not_raise_the_bar_but_a_new_level_becomes_the_history():
    watch = _fed([2.0] * 30)
    spikes = [watch.observe(30 + i, {"loss": 5.0}) for i in range(REBASE)]
    assert all(len(s) == 1 for s in spikes)
    assert watch.observe(40, {"loss": 5.0}) == []  # REBASE in a row: the new level is the history now
    watch = _fed([2.0] * 30)
    assert watch.observe(30, {"loss": 5.0}) and watch.observe(31, {"loss": 2.0}) == []
    assert watch.observe(32, {"loss": 5.0})  # one spike, then a normal step: the next spike is judged as before


def test_other_keys_and_values_that_are_not_numbers_are_ignored():
    watch = _fed([2.0] * 30)
    assert watch.observe(30, {"val_loss": 100.0, "loss": "high", "grad_norm": True}) == []


@given(
    history=st.lists(st.floats(-1e6, 1e6, allow_nan=False), min_size=MIN_HISTORY, max_size=2 * WINDOW),
    value=st.floats(allow_nan=True, allow_infinity=True),
)
@settings(max_examples=300, deadline=None)
def test_a_spike_is_above_every_bar_of_the_rule_and_a_non_spike_below_one(history, value):
    watch = SpikeWatch()
    kept = []
    for step, v in enumerate(history):
        if not watch.observe(step, {"loss": v}):
            kept.append(v)
    spikes = watch.observe(len(history), {"loss": value})
    if not math.isfinite(value):
        assert len(spikes) == 1
        return
    for spike in spikes:
        assert spike.value > spike.threshold >= spike.level
        if spike.level > 0:
            assert spike.threshold >= FLOOR["loss"] * spike.level - 1e-9
