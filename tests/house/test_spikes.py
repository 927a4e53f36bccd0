"""The spike rule (hpcscale.observe.spikes): hand-made histories, and properties over any history."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from hpcscale.observe.spikes import DEVIATIONS, FLOOR, MIN_HISTORY, REBASE, WINDOW, SpikeWatch


def _fed(values: list[float], key: str = "loss") -> SpikeWatch:
    watch = SpikeWatch()
    for step, v in enumerate(values):
        assert watch.observe(step, {key: v}) == []
    return watch


def test_a_jump_over_the_history_is_a_spike_and_noise_is_not():
    noisy = [2.0 + 0.01 * ((i * 7) % 5 - 2) for i in range(40)]  # 1.98 .. 2.02
    watch = _fed(noisy)
    assert watch.observe(40, {"loss": 2.03}) == []  # noise
    (spike,) = watch.observe(41, {"loss": 3.5, "grad_norm": 1.0})
    assert spike.key == "loss" and spike.step == 41 and spike.value == 3.5
    assert spike.median == 2.0 and spike.threshold == FLOOR["loss"] * 2.0  # the floor, over a tiny deviation
    assert "loss spike at step 41: 3.5" in spike.words()


def test_the_deviation_sets_the_bar_when_the_history_is_wide():
    wide = [1.0 + (i % 10) * 0.2 for i in range(50)]  # 1.0 .. 2.8: median 1.9, MAD 0.5
    bar = 1.9 + DEVIATIONS * 1.4826 * 0.5
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
        assert spike.value > spike.threshold >= spike.median
        if spike.median > 0:
            assert spike.threshold >= FLOOR["loss"] * spike.median - 1e-9
