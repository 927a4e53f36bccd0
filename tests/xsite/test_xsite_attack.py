"""A dishonest site against the norm bounds over many rounds, through real ticks on real signed files (no
trainers): it scales its Δ up every round, or sends, reversed, just under what a bound lets through, for 12
rounds, with two and three sites, under `mean` and `auto`. What one round may do is docs/cross-site.md's threat
model; these tests check that no round exceeds it and that nothing compounds over rounds (a site's own norms
never raise its own bound). The figures in the docs come from `python tests/xsite/test_xsite_attack.py`."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from xsite_harness import sites_with_round0

from hpcscale.xsite import roundfile as rf
from hpcscale.xsite import rounds
from hpcscale.xsite.outer import DEFAULT_OUTLIER_FACTOR, encode, l2_norm, screen
from hpcscale.xsite.signing import load_keyring, load_private

SHAPES = {"w": (6, 4), "b": (5,)}
ROUNDS = 12
TIMEOUT = 3600
LR, MU = 0.7, 0.9  # the outer step's defaults
HONEST_SCALE = 0.05  # honest Δ: N(0, 0.05²) per element, ‖Δ‖ about 0.27; ‖θ(0)‖ about 65


def _honest(r: int, i: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * r + i)
    return {k: torch.randn(*shape, generator=g) * HONEST_SCALE for k, shape in SHAPES.items()}


def _scaled(d: dict[str, torch.Tensor], norm: float) -> dict[str, torch.Tensor]:
    n = l2_norm(d)
    return {k: v * (norm / n) for k, v in d.items()}


# What the dishonest site sends in round r, against the honest Δ of the aggregator's site (it can rebuild it from
# the published θ) and what it can tell of the bounds. Each returns Δ.
def grows(r: int, honest: dict, view: AttackView) -> dict:
    """Its Δ reversed and scaled 3× more every round: 3×, 9×, ... 531441× the honest norm."""
    return {k: -(3.0**r) * v for k, v in honest.items()}


def raising_its_own_bound(r: int, honest: dict, view: AttackView) -> dict:
    """Reversed, 0.99 of what a bound made of every site's recent norms, its own included, would let through:
    100 × max(‖θ‖, 1) in the first round, then 10 × the median of every norm applied in the last 5 rounds. Where
    its own norms count, each round raises the next one's bound (θ 86 → 9e5 in 12 rounds with 2 sites)."""
    recent = [n for past in view.norms[-5:] for n in past.values()]
    bound = 10 * statistics.median(recent) if recent else 100 * max(view.theta_norm, 1.0)
    return _scaled({k: -v for k, v in honest.items()}, 0.99 * bound)


def at_the_bound(r: int, honest: dict, view: AttackView) -> dict:
    """Reversed, 0.99 of what the bound lets through now: 10 × the median over the other sites of their median
    applied norm in the last 5 rounds (their norm this round where none was applied)."""
    scales = []
    for site in view.honest_sites:
        mine = [past[site] for past in view.norms[-5:] if site in past]
        scales.append(statistics.median(mine) if mine else view.this_round[site])
    return _scaled({k: -v for k, v in honest.items()}, 0.99 * 10 * statistics.median(scales))


ATTACKS = {"grows": grows, "raising_its_own_bound": raising_its_own_bound, "at_the_bound": at_the_bound}


@dataclass
class AttackView:
    theta_norm: float
    norms: list[dict[str, float]]  # per published round: site -> norm applied
    honest_sites: tuple[str, ...]
    this_round: dict[str, float]  # the honest sites' norms this round


@dataclass
class Run:
    theta_norms: list[float]  # ‖θ(r)‖, r = 0..ROUNDS
    avg_deltas: list[float]  # ‖Δ̄(r)‖, r = 1..ROUNDS, from the published θ and momentum
    honest_norms: list[float]  # the largest honest ‖Δ‖ of each round
    accepted: list[list[str]]
    rejected: list[list[str]]
    applied: list[dict[str, float]]


def attack(tmp: Path, sites: tuple[str, ...], rule: str, how) -> Run:
    """ROUNDS rounds in which the last of `sites` is dishonest (`how`), the others honest; the first aggregates."""
    g = torch.Generator().manual_seed(1)
    theta0 = {k: torch.randn(*shape, generator=g) * 12 for k, shape in SHAPES.items()}
    quorum = {"min_sites": len(sites), "timeout_seconds": TIMEOUT}
    config, keys = sites_with_round0(tmp, sites, theta0, name="attack", quorum=quorum, outer={"rule": rule})
    agg, keyring = tmp / f"state-{sites[0]}", load_keyring(keys)
    honest_sites, dishonest = sites[:-1], sites[-1]

    def published(r: int) -> rf.PublishedRound:
        path = agg / rounds.ROUNDS / f"round-{r:06d}.json"
        return rf.read_round(path, keyring=keyring, aggregator=sites[0], need_momentum=True)

    run = Run([l2_norm(theta0)], [], [], [], [], [])
    for r in range(1, ROUNDS + 1):
        base = published(r - 1)
        sent = {s: _honest(r, i) for i, s in enumerate(honest_sites)}
        view = AttackView(l2_norm(base.theta), run.applied, honest_sites, {s: l2_norm(d) for s, d in sent.items()})
        sent[dishonest] = how(r, sent[sites[0]], view)
        for s, d in sent.items():
            incoming = agg / rounds.INCOMING / s
            incoming.mkdir(parents=True, exist_ok=True)
            rf.write_contribution(incoming, site=s, base_round=r - 1, steps=10, tokens=1000, encoding="fp32",
                                  tensors=encode(d, "fp32"), key=load_private(keys / f"{s}.key"))  # fmt: skip
        now = 10.0 * TIMEOUT * r
        rounds.tick(config, sites[0], now=now)
        rounds.tick(config, sites[0], now=now + TIMEOUT + 1)  # a round waiting for its quorum is applied now
        new = published(r)  # every round is published: a dishonest site cannot stop the training
        # Δ̄ from what the round publishes: buf(r) = μ·buf(r−1) + Δ̄(r) (torch's SGD; buf(0) = 0)
        avg = {k: new.momentum[k] - MU * base.momentum[k] for k in new.momentum}
        run.theta_norms.append(l2_norm(new.theta))
        run.avg_deltas.append(l2_norm(avg))
        run.honest_norms.append(max(view.this_round.values()))
        run.accepted.append(sorted(a.site for a in new.accepted))
        run.rejected.append(sorted(x.site for x in new.rejected))
        run.applied.append({a.site: a.norm for a in new.accepted})
    return run


# How far one round's Δ̄ may go, in units of the honest sites' largest ‖Δ‖ (docs/cross-site.md, threat model):
# mean with 2 sites: (Δ_h + Δ_d)/2 with ‖Δ_d‖ ≤ 10 × the honest site's scale; with 3: (Δ_1 + Δ_2 + Δ_d)/3 with
# ‖Δ_d‖ ≤ 10 × the honest ones' median; auto with 2: both clipped to the smaller; with 3: the coordinate-wise
# median lies between the two honest values, so within √2 of the larger honest norm.
BOUND = {("mean", 2): 5.5, ("mean", 3): 4.0, ("auto", 2): 1.0, ("auto", 3): math.sqrt(2)}


@pytest.mark.parametrize("how", sorted(ATTACKS))
@pytest.mark.parametrize("rule", ["mean", "auto"])
@pytest.mark.parametrize("sites", [("a", "b"), ("a", "b", "c")], ids=["2-sites", "3-sites"])
def test_a_dishonest_site_gains_nothing_round_after_round(tmp_path, sites, rule, how):
    run = attack(tmp_path, sites, rule, ATTACKS[how])
    # honest rounds vary by a few percent in their norm: the margin is for that, not for the attacker
    limit = BOUND[(rule, len(sites))] * 1.02
    for r, (avg, honest) in enumerate(zip(run.avg_deltas, run.honest_norms, strict=True), start=1):
        assert avg <= limit * honest, f"round {r}: ‖Δ̄‖ = {avg:.3g} > {limit:.3g} × {honest:.3g}: {run}"
    # nothing compounds: θ moves no further than 12 rounds at the bound would take it, nowhere near its own scale
    assert run.theta_norms[-1] < 1.5 * run.theta_norms[0], run.theta_norms
    if how == "grows" and len(sites) == 2:  # within 10× the honest norm in rounds 1 and 2, held out from 3 on
        assert run.rejected[2:] == [["b"]] * (ROUNDS - 2) and run.accepted[2:] == [["a"]] * (ROUNDS - 2)
    if how == "raising_its_own_bound":  # 99 × ‖θ‖ in round 1, 3·10⁴ × the honest norm: never applied whole
        assert sites[-1] in run.rejected[0] or run.applied[0][sites[-1]] <= 10 * run.honest_norms[0]


@pytest.mark.parametrize("who", ["partner tiny", "aggregator large"])
def test_with_two_sites_the_aggregators_own_contribution_is_kept_when_the_two_disagree(tmp_path, who):
    """Which of two sites is wrong cannot be told from norms: the aggregator's own site is kept, the other held
    out, and the round goes on at its quorum timeout (a held-out contribution does not count). A partner that
    sends a tiny Δ no longer stalls the round; an aggregator site whose trainer diverged is not stopped by it."""
    g = torch.Generator().manual_seed(1)
    theta0 = {k: torch.randn(*shape, generator=g) for k, shape in SHAPES.items()}
    config, keys = sites_with_round0(tmp_path, ("a", "b"), theta0, name="two",
                                     quorum={"min_sites": 2, "timeout_seconds": TIMEOUT}, outer={})  # fmt: skip
    agg = tmp_path / "state-a"
    da, db = _honest(1, 0), _honest(1, 1)
    if who == "partner tiny":
        db = {k: v * 1e-6 for k, v in db.items()}
    else:
        da = {k: v * 50 for k, v in da.items()}
    for s, d in (("a", da), ("b", db)):
        incoming = agg / rounds.INCOMING / s
        incoming.mkdir(parents=True, exist_ok=True)
        rf.write_contribution(incoming, site=s, base_round=0, steps=10, tokens=1000, encoding="fp32",
                              tensors=encode(d, "fp32"), key=load_private(keys / f"{s}.key"))  # fmt: skip
    report = rounds.tick(config, "a", now=100.0)
    [held] = [e for e in report.events if e["event"] == "rejected"]
    assert held["site"] == "b" and held["reason"].startswith("held out")
    assert "norms cannot tell which of the two is wrong" in held["reason"]
    assert not [e for e in report.events if e["event"] == "published"]  # b does not count toward the quorum
    [published] = [e for e in rounds.tick(config, "a", now=100.0 + TIMEOUT + 1).events if e["event"] == "published"]
    assert published["accepted"] == ["a"] and [x["site"] for x in published["rejected"]] == ["b"]
    r1 = rf.read_round(agg / rounds.ROUNDS / "round-000001.json", keyring=load_keyring(keys), aggregator="a",
                       need_momentum=True)  # fmt: skip
    assert all(torch.allclose(r1.momentum[k], da[k]) for k in da)  # Δ̄ = Δ_a, whole: not stalled, not cut


# ---- the rule itself, for any norms (outer.screen) ----------------------------------------------------------------

_site_names = st.sampled_from(["a", "b", "c", "d"])
_norm = st.floats(min_value=0, max_value=1e6, allow_nan=False)
_history = st.dictionaries(_site_names, st.lists(_norm | st.sampled_from([math.nan, math.inf, -1.0]), max_size=6))


@settings(max_examples=300, deadline=None)
@given(norms=st.dictionaries(_site_names, _norm, min_size=1), history=_history, own=st.lists(_norm, max_size=6),
       site=_site_names, aggregator=_site_names | st.none())  # fmt: skip
@example(norms={"a": 0.0, "d": 1.0}, history={}, own=[1.0], site="a", aggregator="d")  # via the aggregator's check
def test_a_sites_own_history_never_changes_what_is_decided_about_it(norms, history, own, site, aggregator):
    """By construction: a site's reference is made of the other sites' norms, so whatever it sent before (its
    applied norms, here replaced by any others) cannot change whether its contribution is kept, cut or held."""
    if site not in norms:
        return

    def decision(h):
        s = screen(norms, theta_norm=65.0, history=h, aggregator=aggregator)
        return s.rejected.get(site), s.clipped.get(site)

    assert decision({**history, site: own}) == decision({k: v for k, v in history.items() if k != site})


@settings(max_examples=300, deadline=None)
@given(norms=st.dictionaries(_site_names, _norm, min_size=1), history=_history, aggregator=_site_names | st.none())
def test_what_is_kept_is_within_the_factor_of_the_other_sites(norms, history, aggregator):
    """Every contribution kept (after its cut), except the aggregator's own, is within factor × its reference
    (the median over the other sites' scales), and within the absolute bound; nothing is both cut and refused."""
    s = screen(norms, theta_norm=65.0, history=history, aggregator=aggregator)
    assert not (s.rejected.keys() & s.clipped.keys())
    for site, value in norms.items():
        if site in s.rejected:
            continue
        applied = value * s.clipped[site][0] if site in s.clipped else value
        assert applied <= 100 * 65.0 * (1 + 1e-12)
        if site == aggregator:
            continue
        scales = []
        for other in set(norms) | set(history):
            if other == site:
                continue
            recent = [v for v in history.get(other, []) if math.isfinite(v) and v > 0]
            if recent:
                scales.append(statistics.median(recent))
            elif other in norms and other not in {k for k, why in s.rejected.items() if "held out" not in why}:
                scales.append(norms[other])
        reference = statistics.median(scales) if scales else 65.0
        assert applied <= DEFAULT_OUTLIER_FACTOR * reference * (1 + 1e-9), (site, applied, reference, s)


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)
_entry = (
    st.fixed_dictionaries(
        {"site": st.sampled_from(["a", "b", "zz"]) | _json, "norm": _json | st.floats(allow_nan=True)}
    )
    | _json
)


@pytest.fixture(scope="module")
def two_site_config(tmp_path_factory):
    from hpcscale.config.xsite import load_xsite

    tmp = tmp_path_factory.mktemp("config")
    (tmp / "xsite.yaml").write_text(
        "name: t\naggregator: a\nround_steps: 1\nkeys: /k\nsites:\n"
        + "".join(f"  - {{name: {s}, run: /r{s}, state: /s{s}, reach: /s{s}, key: /k{s}}}\n" for s in "ab")
    )
    return load_xsite(tmp / "xsite.yaml")


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(docs=st.lists(st.fixed_dictionaries({"accepted": st.lists(_entry, max_size=5) | _json}) | _json, max_size=5))
def test_the_norms_read_back_from_round_records_are_bounded_whatever_the_files_say(
    tmp_path_factory, two_site_config, docs
):
    """The history is read from the aggregator's own round records, which others may have written over: any
    JSON there adds only finite norms from 0 to fp32's largest, of this config's sites, and never raises."""
    import json

    state = tmp_path_factory.mktemp("norms")
    (state / rounds.ROUNDS).mkdir()
    for r, doc in enumerate(docs, start=1):
        (state / rounds.ROUNDS / f"round-{r:06d}.json").write_text(json.dumps(doc))  # NaN and Infinity too
    got = rounds._applied_norms(two_site_config, state, range(1, len(docs) + 1))
    assert set(got) <= {"a", "b"}
    assert all(type(v) is float and 0 <= v <= rf.FP32_MAX for values in got.values() for v in values)


def _figures() -> None:
    """The threat model's figures: ‖θ‖ after each round and the largest ‖Δ̄‖ / honest ‖Δ‖ of any round."""
    import tempfile

    print(f"{'sites':>5} {'rule':>5} {'attack':>22}  max ‖Δ̄‖/‖Δ_h‖   ‖θ(0)‖ → ‖θ(12)‖   left out in rounds")
    for sites in (("a", "b"), ("a", "b", "c")):
        for rule in ("mean", "auto"):
            for name, how in sorted(ATTACKS.items()):
                with tempfile.TemporaryDirectory() as tmp:
                    run = attack(Path(tmp), sites, rule, how)
                ratio = max(a / h for a, h in zip(run.avg_deltas, run.honest_norms, strict=True))
                out = [r for r, rej in enumerate(run.rejected, start=1) if sites[-1] in rej]
                print(f"{len(sites):>5} {rule:>5} {name:>22}  {ratio:13.2f}   {run.theta_norms[0]:6.1f} → "
                      f"{run.theta_norms[-1]:8.1f}   {out}")  # fmt: skip


if __name__ == "__main__":
    _figures()
