"""Cross-site rounds against a dishonest or broken partner, through real ticks on real signed files (no
trainers): what one site can and cannot do to the published weights under each rule (the threat model in
docs/cross-site.md, a test per row), finite contributions that would overflow the outer step, a poisoned round
a site must refuse and recover from, and quorum timeouts across clock steps."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from xsite_harness import sites_with_round0

from hpcscale.config.xsite import load_xsite
from hpcscale.errors import BadInput
from hpcscale.xsite import roundfile as rf
from hpcscale.xsite import rounds
from hpcscale.xsite.outer import decode, encode
from hpcscale.xsite.signing import load_keyring, load_private

SHAPES = {"w": (6, 4), "b": (5,)}


def _setup(tmp: Path, sites: tuple[str, ...], **outer) -> tuple:
    g = torch.Generator().manual_seed(1)
    theta0 = {k: torch.randn(*shape, generator=g) for k, shape in SHAPES.items()}
    quorum = {"min_sites": len(sites), "timeout_seconds": 3600}
    config, keys = sites_with_round0(tmp, sites, theta0, name="trust", quorum=quorum, outer=outer)
    return config, keys, tmp / f"state-{sites[0]}"


def _honest(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(*shape, generator=g) * 0.05 for k, shape in SHAPES.items()}


def _send(tmp: Path, keys: Path, agg_state: Path, site: str, base: int, delta: dict, tokens: int = 1000) -> None:
    incoming = agg_state / rounds.INCOMING / site
    incoming.mkdir(parents=True, exist_ok=True)
    rf.write_contribution(incoming, site=site, base_round=base, steps=10, tokens=tokens, encoding="fp32",
                          tensors=encode(delta, "fp32"), key=load_private(keys / f"{site}.key"))  # fmt: skip


def _round(agg_state: Path, keys: Path, r: int, aggregator: str) -> rf.PublishedRound | None:
    path = agg_state / rounds.ROUNDS / f"round-{r:06d}.json"
    if not path.exists():
        return None
    return rf.read_round(path, keyring=load_keyring(keys), aggregator=aggregator, need_momentum=True)


def _events(report: rounds.TickReport, kind: str) -> list[dict]:
    return [e for e in report.events if e["event"] == kind]


def _step(agg_state: Path, keys: Path, r: int, aggregator: str) -> dict[str, torch.Tensor]:
    """θ(r) − θ(r − 1)."""
    new, old = _round(agg_state, keys, r, aggregator), _round(agg_state, keys, r - 1, aggregator)
    return {k: new.theta[k] - old.theta[k] for k in new.theta}


def _along(step: dict[str, torch.Tensor], delta: dict[str, torch.Tensor]) -> float:
    """How far the published step went the way the honest site's Δ asks (θ moves along −Δ): > 0 forward."""
    return float(sum((-step[k].double() * delta[k].double()).sum() for k in step))


# ---- finite contributions that would overflow -------------------------------------------------------------------


def test_a_finite_contribution_that_would_overflow_is_refused_and_the_round_waits_for_honest_ones(tmp_path):
    config, keys, agg = _setup(tmp_path, ("a", "b"), rule="mean")
    huge = {k: torch.full(shape, 3e38) for k, shape in SHAPES.items()}  # finite in fp32: θ − 1.33·Δ is -inf
    _send(tmp_path, keys, agg, "b", 0, huge)
    report = rounds.tick(config, "a", now=1000.0)  # refused at once: it neither counts nor starts the clock
    assert _round(agg, keys, 1, "a") is None
    [rejected] = _events(report, "rejected")
    assert rejected["site"] == "b" and "> 100 × max(‖θ(base)‖" in rejected["reason"]
    report = rounds.tick(config, "a", now=1000.0 + 3601)  # no quorum clock ran for a refused contribution
    assert _round(agg, keys, 1, "a") is None and not _events(report, "published")
    assert not _events(report, "rejected")  # said once
    honest = _honest(2)
    _send(tmp_path, keys, agg, "a", 0, honest)
    assert not _events(rounds.tick(config, "a", now=5000.0), "published")  # a's arrival starts the clock
    [published] = _events(rounds.tick(config, "a", now=5000.0 + 3601), "published")
    assert published["accepted"] == ["a"] and published["rejected"][0]["site"] == "b"
    r1 = _round(agg, keys, 1, "a")
    assert all(torch.isfinite(t).all() for t in (*r1.theta.values(), *r1.momentum.values()))
    assert {a.site: a.norm is not None for a in r1.accepted} == {"a": True}


def test_one_site_alone_is_bounded_by_the_model_then_by_its_own_history(tmp_path):
    config, keys, agg = _setup(tmp_path, ("a",))
    for r, scale in ((1, 1.0), (2, 1.0)):
        _send(tmp_path, keys, agg, "a", r - 1, {k: v * scale for k, v in _honest(r).items()})
        assert _events(rounds.tick(config, "a"), "published")
    history = [a.norm for r in (1, 2) for a in _round(agg, keys, r, "a").accepted]
    _send(tmp_path, keys, agg, "a", 2, {k: v * 50 for k, v in _honest(3).items()})  # 50× its usual norm
    [published] = _events(rounds.tick(config, "a", now=0.0), "published")
    assert published["accepted"] == ["a"] and 0 < published["clipped"]["a"] < 1  # cut to the usual size
    [applied] = _round(agg, keys, 3, "a").accepted
    assert applied.norm == pytest.approx(10 * sorted(history)[len(history) // 2 - 1 : len(history) // 2 + 1][-1]
                                         if len(history) % 2 else 10 * sum(history) / 2, rel=1e-5)  # fmt: skip


# ---- steering: what one dishonest site can do under each rule (docs/cross-site.md threat model) ----------------


def test_two_sites_auto_one_sends_a_reversed_and_scaled_delta_the_round_does_not_reverse(tmp_path):
    config, keys, agg = _setup(tmp_path, ("a", "b"))  # rule: auto (the default)
    honest = _honest(2)
    _send(tmp_path, keys, agg, "a", 0, honest)
    _send(tmp_path, keys, agg, "b", 0, {k: -50 * v for k, v in honest.items()})
    [held] = _events(rounds.tick(config, "a", now=0.0), "rejected")  # 50× the other's: held out of the round
    assert held["site"] == "b" and held["reason"].startswith("held out")
    assert _events(rounds.tick(config, "a", now=3601.0), "published")  # at the quorum timeout, without b
    assert _along(_step(agg, keys, 1, "a"), honest) > 0


def test_two_sites_auto_a_huge_token_claim_buys_nothing(tmp_path):
    config, keys, agg = _setup(tmp_path, ("a", "b"))
    honest = _honest(2)
    _send(tmp_path, keys, agg, "a", 0, honest)
    _send(tmp_path, keys, agg, "b", 0, {k: -v for k, v in honest.items()}, tokens=2**62)
    rounds.tick(config, "a")
    assert _along(_step(agg, keys, 1, "a"), honest) >= -1e-6


def test_two_sites_mean_the_token_claim_is_capped_but_one_site_can_reverse_the_mean(tmp_path):
    """The row that says why `mean` is not the default: capped at 2× the other's tokens, a reversed Δ still
    outweighs the honest one."""
    config, keys, agg = _setup(tmp_path, ("a", "b"), rule="mean")
    honest = _honest(2)
    _send(tmp_path, keys, agg, "a", 0, honest)
    _send(tmp_path, keys, agg, "b", 0, {k: -v for k, v in honest.items()}, tokens=2**62)
    rounds.tick(config, "a")
    step = _step(agg, keys, 1, "a")
    theta0 = _round(agg, keys, 0, "a").theta
    # weights capped to 2000 : 1000, so Δ̄ = (2·(−Δ_a) + Δ_a)/3 = −Δ_a/3 (not −Δ_a·2^62/(2^62+1000))
    want = {k: -(1.0 + 0.9) * 0.7 * (-honest[k] / 3) for k in honest}
    assert all(torch.allclose(step[k], want[k], atol=1e-6) for k in step), (step, theta0)
    assert _along(step, honest) < 0


@pytest.mark.parametrize("outer", [{}, {"rule": "median"}, {"rule": "trimmed_mean", "trim": 0.34}])
def test_three_sites_auto_one_outlier_cannot_move_a_coordinate_beyond_the_honest_values(tmp_path, outer):
    """auto (the default), median, and trimmed mean cutting ⌊0.34 · 3⌋ = 1 value at each end."""
    config, keys, agg = _setup(tmp_path, ("a", "b", "c"), **outer)
    da, db = _honest(2), _honest(3)
    _send(tmp_path, keys, agg, "a", 0, da)
    _send(tmp_path, keys, agg, "b", 0, db)
    _send(tmp_path, keys, agg, "c", 0, {k: -5 * v for k, v in da.items()})  # under the norm bounds
    rounds.tick(config, "a")
    r1, r0 = _round(agg, keys, 1, "a"), _round(agg, keys, 0, "a")
    for k in da:  # Δ̄ is the median: inside [min, max] of the honest values per coordinate
        mean = -(r1.theta[k] - r0.theta[k]) / (0.7 * 1.9)
        lo, hi = torch.minimum(da[k], db[k]), torch.maximum(da[k], db[k])
        assert bool(((mean >= lo - 1e-6) & (mean <= hi + 1e-6)).all())


@pytest.mark.parametrize("case", ["two sites", "three sites", "three sites, two in"])
def test_a_scaled_up_delta_after_the_first_round_is_held_out_refused_or_cut(tmp_path, case):
    """Round 2, the last site sends 50× its usual Δ. Two sites: held out (one other site to compare with: the
    aggregator's own is kept); three: refused by the other contributions' median; three of which two are in
    the round: cut to 10× the median of the other two sites' recent norms."""
    sites = ("a", "b") if case == "two sites" else ("a", "b", "c")
    config, keys, agg = _setup(tmp_path, sites)
    for s, seed in zip(sites, range(10, 20), strict=False):
        _send(tmp_path, keys, agg, s, 0, _honest(seed))
    assert _events(rounds.tick(config, "a"), "published")
    senders = sites[:-1] if case != "three sites, two in" else ("a",)
    for s, seed in zip(senders, range(20, 30), strict=False):
        _send(tmp_path, keys, agg, s, 1, _honest(seed))
    _send(tmp_path, keys, agg, sites[-1], 1, {k: 50 * v for k, v in _honest(99).items()})
    report = rounds.tick(config, "a", now=100.0)
    assert not _events(report, "published")  # what is refused or held out does not count toward the quorum
    later = rounds.tick(config, "a", now=100.0 + 3601)
    [published] = _events(later, "published")
    if case == "three sites, two in":
        assert published["accepted"] == ["a", "c"] and 0 < published["clipped"]["c"] < 1 / 4
        [c] = [x for x in _round(agg, keys, 2, "a").accepted if x.site == "c"]
        r1 = {x.site: x.norm for x in _round(agg, keys, 1, "a").accepted}
        assert c.norm == pytest.approx(10 * (r1["a"] + r1["b"]) / 2, rel=1e-5)  # the median of two: their mean
        return
    [refused] = _events(report, "rejected")
    assert refused["site"] == sites[-1]
    if case == "two sites":
        assert refused["reason"].startswith("held out")
        assert "a's median ‖Δ‖ applied in its last 1 rounds" in refused["reason"]
    else:
        assert "the median of the other sites" in refused["reason"]
    assert published["accepted"] == list(sites[:-1]) and [x["site"] for x in published["rejected"]] == [sites[-1]]


def test_two_sites_a_tiny_delta_cannot_stall_the_round_or_get_the_honest_one_refused(tmp_path):
    """The 2-site attack on a ratio rule: send ‖Δ‖ ≪ the honest one's, so the honest one looks like the
    outlier. With one site to compare with, the aggregator's own site's contribution is kept and the other held
    out: the round goes on with the honest Δ whole (at the quorum timeout)."""
    config, keys, agg = _setup(tmp_path, ("a", "b"))
    honest = _honest(2)
    _send(tmp_path, keys, agg, "a", 0, honest)
    _send(tmp_path, keys, agg, "b", 0, {k: -1e-6 * v for k, v in honest.items()})
    [held] = _events(rounds.tick(config, "a", now=0.0), "rejected")
    assert held["site"] == "b" and "the aggregator's site a sent" in held["reason"]
    [published] = _events(rounds.tick(config, "a", now=3601.0), "published")
    assert published["accepted"] == ["a"] and [x["site"] for x in published["rejected"]] == ["b"]
    step = _step(agg, keys, 1, "a")
    assert all(torch.allclose(step[k], -0.7 * 1.9 * honest[k], atol=1e-6) for k in step)


# ---- a poisoned round at a site: refused, and the next valid one taken ------------------------------------------


def test_site_copies_carry_no_norms_and_status_shows_what_holds_the_pending_round(tmp_path):
    """A site on a release without the `norm` field must still read round copies; the aggregator's
    `sync status` names the round being built, its refusals, and a round 0 with nothing to publish it from."""
    config, keys, agg = _setup(tmp_path, ("a", "b"))
    assert rounds.status(config, "a")["pending"]["round"] == 1  # round 0 is there (made by _setup)
    _send(tmp_path, keys, agg, "a", 0, _honest(2))
    _send(tmp_path, keys, agg, "b", 0, {k: torch.full(shape, 1e30) for k, shape in SHAPES.items()})
    rounds.tick(config, "a", now=10.0)
    pending = rounds.status(config, "a")["pending"]
    assert pending["round"] == 1 and "> 100 × max" in pending["rejected"]["b"] and pending["waiting_since"] == 10.0
    rounds.tick(config, "a", now=10.0 + 3601)
    copy = agg / rounds.OUTGOING / "round-000001.json"
    assert copy.exists() and '"norm"' not in copy.read_text()
    assert '"norm"' in (agg / rounds.ROUNDS / "round-000001.json").read_text()

    import shutil

    shutil.rmtree(agg / rounds.ROUNDS)  # an aggregator whose start checkpoint is gone: nothing to publish from
    blocked = rounds.status(config, "a")["pending"]
    assert blocked["round"] == 0 and "there is none" in blocked["blocked"]


def test_a_site_refuses_a_non_finite_round_and_takes_the_next_valid_one(tmp_path):
    config, keys, _ = _setup(tmp_path, ("a", "b"))
    run_b, inbox = tmp_path / "run-b", tmp_path / "state-b" / rounds.INBOX
    run_b.mkdir()
    (run_b / "job.yaml").write_text("name: b\n")
    inbox.mkdir(parents=True)
    akey = load_private(keys / "a.key")
    theta = {k: torch.zeros(shape) for k, shape in SHAPES.items()}
    bad = {k: torch.full(shape, float("inf")) for k, shape in SHAPES.items()}  # signed by the aggregator's key
    rf.write_round(inbox, round=1, parent=0, outer=rounds._outer(config), accepted=[], rejected=[], theta=bad,
                   momentum=None, key=akey)  # fmt: skip
    report = rounds.tick(config, "b")
    assert rounds.latest_global(run_b) is None
    assert any("not finite" in e["reason"] for e in _events(report, "rejected"))
    assert not _events(rounds.tick(config, "b"), "rejected")  # decided once, not verified again every tick
    rf.write_round(inbox, round=2, parent=1, outer=rounds._outer(config), accepted=[], rejected=[], theta=theta,
                   momentum=None, key=akey)  # fmt: skip
    rounds.tick(config, "b")
    assert rounds.latest_global(run_b) == 2


def test_the_trainer_never_adopts_weights_that_are_not_its_models_or_not_finite():
    import types

    from hpcscale.launch.site_rounds import Rounds

    model = torch.nn.Linear(3, 2)
    fake = types.SimpleNamespace(model=model)
    good = {"weight": torch.zeros(2, 3), "bias": torch.zeros(2)}
    assert Rounds._unfit(fake, good) is None
    # θ holds more than this rank's parameters: buffers (the site's own) and a pipeline's other stages
    assert Rounds._unfit(fake, good | {"bn.running_mean": torch.zeros(4), "layers.9.w": torch.zeros(7)}) is None
    assert "non-finite" in Rounds._unfit(fake, good | {"bias": torch.tensor([1.0, float("nan")])})
    assert "shape (3, 2)" in Rounds._unfit(fake, good | {"weight": torch.zeros(3, 2)})
    assert "not this model's (no ['bias'])" in Rounds._unfit(fake, {"weight": torch.zeros(2, 3)})


# ---- quorum timeouts across clock steps ------------------------------------------------------------------------


def test_the_quorum_timeout_survives_the_wall_clock_stepping_back_a_day(tmp_path):
    config, keys, agg = _setup(tmp_path, ("a", "b"))
    _send(tmp_path, keys, agg, "a", 0, _honest(2))
    t0 = rounds.TickClock(wall=1_000_000.0, boot="boot-1", uptime=500.0)
    assert not _events(rounds.tick(config, "a", clock=t0), "published")
    stepped = rounds.TickClock(wall=t0.wall - 86400, boot="boot-1", uptime=t0.uptime + 3601)
    [published] = _events(rounds.tick(config, "a", clock=stepped), "published")
    assert published["waited_s"] == pytest.approx(3601, abs=1)


def test_the_quorum_timeout_is_not_fired_early_by_the_wall_clock_jumping_forward(tmp_path):
    config, keys, agg = _setup(tmp_path, ("a", "b"))
    _send(tmp_path, keys, agg, "a", 0, _honest(2))
    t0 = rounds.TickClock(wall=1_000_000.0, boot="boot-1", uptime=500.0)
    rounds.tick(config, "a", clock=t0)
    jumped = rounds.TickClock(wall=t0.wall + 86400, boot="boot-1", uptime=t0.uptime + 10)
    assert not _events(rounds.tick(config, "a", clock=jumped), "published")


def test_after_a_reboot_a_start_in_the_future_restarts_the_wait_instead_of_blocking_it(tmp_path):
    config, keys, agg = _setup(tmp_path, ("a", "b"))
    _send(tmp_path, keys, agg, "a", 0, _honest(2))
    rounds.tick(config, "a", clock=rounds.TickClock(wall=2_000_000.0, boot="boot-1", uptime=500.0))
    back = rounds.TickClock(wall=2_000_000.0 - 86400, boot="boot-2", uptime=20.0)  # rebooted, clock a day back
    report = rounds.tick(config, "a", clock=back)
    assert not _events(report, "published")
    assert [e["waited_s"] for e in _events(report, "quorum")] == [0.0]  # never negative
    later = rounds.TickClock(wall=back.wall + 3601, boot="boot-2", uptime=back.uptime + 3601)
    assert _events(rounds.tick(config, "a", clock=later), "published")


def test_decoded_contributions_equal_what_was_sent():
    d = _honest(5)
    assert all(torch.equal(decode(encode(d, "fp32"), "fp32", SHAPES)[k], d[k]) for k in d)


# ---- nothing a tick deletes or leaves behind is outside its own state -----------------------------------------


def test_retention_never_follows_a_symlinked_incoming_directory(tmp_path):
    """A site's incoming/ directory swapped for a link to somewhere else: the tick refuses it (exit 2) before it
    reads or deletes anything (and its retention opens every directory with O_NOFOLLOW besides): files there
    that look like old rounds' are never deleted."""
    import yaml as _yaml

    from hpcscale.util.trust import UntrustedFile

    config, keys, agg = _setup(tmp_path, ("a", "b"))
    doc = _yaml.safe_load((tmp_path / "xsite.yaml").read_text())
    doc["quorum"]["min_sites"], doc["keep_rounds"] = 1, 2
    (tmp_path / "xsite.yaml").write_text(_yaml.safe_dump(doc))
    config = load_xsite(tmp_path / "xsite.yaml")
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "contrib-b-r000000.json").write_text("precious")
    (victim / "round-000000.json").write_text("precious")
    (agg / rounds.INCOMING).mkdir(parents=True, exist_ok=True)
    (agg / rounds.INCOMING / "b").symlink_to(victim, target_is_directory=True)
    for r in range(1, 5):
        _send(tmp_path, keys, agg, "a", r - 1, _honest(r))
        with pytest.raises(UntrustedFile, match="incoming/b: refusing the cross-site sync state directory: a symb"):
            rounds.tick(config, "a")
    assert sorted(p.name for p in victim.iterdir()) == ["contrib-b-r000000.json", "round-000000.json"]
    assert (victim / "round-000000.json").read_text() == "precious"


@pytest.fixture
def full_state_disk(tmp_path):
    """The aggregator's state directory on a 256 KiB tmpfs (needs root to mount)."""
    import subprocess

    from conftest import need

    state = tmp_path / "state-a"
    state.mkdir()
    # mode 0755: the tick keeps its state only in a directory no one else can write (tmpfs defaults to 1777)
    argv = ["mount", "-t", "tmpfs", "-o", "size=256k,mode=0755", "tmpfs", str(state)]
    mounted = subprocess.run(argv, capture_output=True)
    need(mounted.returncode == 0, f"mounting a tmpfs (root): {mounted.stderr.decode().strip()}")
    try:
        yield state
    finally:
        subprocess.run(["umount", "-l", str(state)], check=False)


def test_a_full_disk_leaves_no_temporary_file_and_no_holderless_lock(tmp_path, full_state_disk):
    config, keys, agg = _setup(tmp_path, ("a", "b"))
    _send(tmp_path, keys, agg, "a", 0, _honest(2))
    filler = agg / "filler"
    with open(filler, "wb", buffering=0) as f:  # fill the disk to the last byte
        for block in (4096, 1):
            try:
                while True:
                    f.write(b"\0" * block)
            except OSError:
                pass
    report = rounds.tick(config, "a", now=100.0)  # not even the lock can be written
    lock = agg / rounds.LOCK_DIR / "lock"
    assert "cannot write the lock (No space left on device)" in str(report.locked_out)
    assert not lock.exists(), "a lock file naming no holder was left behind"
    os.truncate(filler, os.path.getsize(filler) - 4096)  # one page: the lock fits, the quorum record does not
    report = rounds.tick(config, "a", now=101.0)
    assert not report.locked_out and any("No space left" in e for e in report.errors), report.errors
    leftovers = [p.name for p in agg.rglob("*") if ".tmp-" in p.name or p.name.endswith(".tmp")]
    assert leftovers == [], leftovers
    filler.unlink()  # space again: the next tick works, no one had to remove anything by hand
    assert not rounds.tick(config, "a", now=102.0).locked_out


def test_a_lock_file_that_names_no_holder_says_it_clears_itself(tmp_path):
    from hpcscale.portable import lock
    from hpcscale.portable.errors import StageError

    d = tmp_path / "state"
    d.mkdir()
    (d / "lock").write_bytes(b"")  # cut short
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(StageError) as e:
            lock.acquire(fd, str(d))
    finally:
        os.close(fd)
    assert "names no holder" in str(e.value) and "taken over by itself 60 s after it was made" in str(e.value)
    assert "by hand" not in str(e.value)


# ---- records bound to one training and to the weights they build on --------------------------------------------


def _bound_round0(tmp: Path, sites: tuple[str, ...]) -> tuple:
    """_setup, with round 0 naming its training as the tick's own round 0 does."""
    config, keys, agg = _setup(tmp, sites)
    r0 = _round(agg, keys, 0, sites[0])
    for p in (agg / rounds.ROUNDS).iterdir():
        p.unlink()
    training = rf.training_id(config.name, r0.theta)
    rf.write_round(agg / rounds.ROUNDS, round=0, parent=None, outer=rounds._outer(config), accepted=[], rejected=[],
                   theta=r0.theta, momentum=r0.momentum, key=load_private(keys / f"{sites[0]}.key"),
                   training=training)  # fmt: skip
    return config, keys, agg, r0.theta, training


def _send_bound(agg: Path, keys: Path, site: str, base: int, delta: dict, *, training: str, base_theta: dict) -> None:
    incoming = agg / rounds.INCOMING / site
    incoming.mkdir(parents=True, exist_ok=True)
    rf.write_contribution(incoming, site=site, base_round=base, steps=10, tokens=1000, encoding="fp32",
                          tensors=encode(delta, "fp32"), key=load_private(keys / f"{site}.key"), training=training,
                          base_theta_sha256=rf.theta_digest(base_theta))  # fmt: skip


def test_a_contribution_from_another_training_or_other_base_weights_is_refused(tmp_path):
    config, keys, agg, theta0, training = _bound_round0(tmp_path, ("a", "b", "c"))
    other = {k: v + 1 for k, v in theta0.items()}
    _send_bound(agg, keys, "a", 0, _honest(2), training=training, base_theta=theta0)
    _send_bound(agg, keys, "b", 0, _honest(3), training="third:" + "0" * 32, base_theta=theta0)  # same keys
    _send_bound(agg, keys, "c", 0, _honest(4), training=training, base_theta=other)  # against other weights
    report = rounds.tick(config, "a", now=1.0)
    reasons = {e["site"]: e["reason"] for e in _events(report, "rejected")}
    assert "from another cross-site training (third:" in reasons["b"]
    assert "computed against other weights than round 0's" in reasons["c"]
    [published] = _events(rounds.tick(config, "a", now=1.0 + 3601), "published")
    assert published["accepted"] == ["a"]
    assert _round(agg, keys, 1, "a").training == training  # every round names the training


def test_an_unbound_contribution_into_a_bound_training_is_refused_with_the_fix(tmp_path):
    config, keys, agg, _, _ = _bound_round0(tmp_path, ("a", "b"))
    _send(tmp_path, keys, agg, "b", 0, _honest(3))  # no training, no base digest: an older hpcscale's
    [rejected] = _events(rounds.tick(config, "a", now=1.0), "rejected")
    assert "names no training or base weights" in rejected["reason"] and "upgrade that site" in rejected["reason"]


def test_a_site_refuses_rounds_of_another_training_and_takes_the_genuine_one(tmp_path):
    config, keys, _, theta0, training = _bound_round0(tmp_path, ("a", "b"))
    run_b, state_b = tmp_path / "run-b", tmp_path / "state-b"
    run_b.mkdir()
    (run_b / "job.yaml").write_text("name: b\n")
    (state_b / rounds.INBOX).mkdir(parents=True)
    akey = load_private(keys / "a.key")

    def deliver(r: int, training_name: str) -> None:
        rf.write_round(state_b / rounds.INBOX, round=r, parent=r - 1, outer=rounds._outer(config), accepted=[],
                       rejected=[], theta=theta0, momentum=None, key=akey, training=training_name)  # fmt: skip

    deliver(1, "third:" + "1" * 32)  # another training's round, same keys, copied into the inbox
    report = rounds.tick(config, "b")
    assert rounds.latest_global(run_b) is None
    assert any("not one of 'trust'" in e["reason"] for e in _events(report, "rejected"))
    deliver(2, training)
    rounds.tick(config, "b")
    assert rounds.latest_global(run_b) == 2 and (state_b / rounds.TRAINING).read_text() == training
    deliver(3, "trust:" + "2" * 32)  # the same config name, another θ(0): another training
    report = rounds.tick(config, "b")
    assert rounds.latest_global(run_b) == 2
    assert any(f"this site follows {training}" in e["reason"] for e in _events(report, "rejected"))


def test_a_round_of_another_models_shapes_is_not_handed_over(tmp_path):
    import sys

    from conftest import REPO

    sys.path.insert(0, str(REPO / "tests" / "helpers"))
    from ckpt_tamper import save_in_process

    config, keys, _ = _setup(tmp_path, ("a", "b"))
    run_b, inbox = tmp_path / "run-b", tmp_path / "state-b" / rounds.INBOX
    run_b.mkdir()
    (run_b / "job.yaml").write_text("name: b\n")
    inbox.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    save_in_process(run_b / "checkpoints", 1, {"model/w": torch.randn(6, 4, generator=g), "model/b": torch.randn(5)})
    wrong = {"w": torch.zeros(4, 6), "b": torch.zeros(5)}
    rf.write_round(inbox, round=1, parent=0, outer=rounds._outer(config), accepted=[], rejected=[], theta=wrong,
                   momentum=None, key=load_private(keys / "a.key"))  # fmt: skip
    report = rounds.tick(config, "b")
    assert rounds.latest_global(run_b) is None
    assert any("w has shape (4, 6), this run's model has (6, 4)" in e["reason"] for e in _events(report, "rejected"))


# ---- a record lost at the other end after its push is sent again -----------------------------------------------


def test_a_contribution_or_round_lost_after_its_push_is_sent_again(tmp_path):
    import time as _time

    config, keys, agg = _setup(tmp_path, ("a", "b"))
    outbox_b = tmp_path / "state-b" / rounds.OUTBOX
    outbox_b.mkdir(parents=True)
    rf.write_contribution(outbox_b, site="b", base_round=0, steps=10, tokens=1000, encoding="fp32",
                          tensors=encode(_honest(3), "fp32"), key=load_private(keys / "b.key"))  # fmt: skip
    now = _time.time()
    assert [e["to"] for e in _events(rounds.tick(config, "b", now=now), "pushed")] == ["a"]
    landed = agg / rounds.INCOMING / "b" / "contrib-b-r000000.json"
    assert landed.exists()
    for p in landed.parent.glob("contrib-*"):  # lost at the aggregator (a restored backup, a cleanup by hand)
        p.unlink()
    assert not _events(rounds.tick(config, "b", now=now + 60), "pushed")  # not yet: it may merely be waiting
    [again] = _events(rounds.tick(config, "b", now=now + 3700), "pushed")
    assert "not answered: sending it again" in again["again"] and landed.exists()

    # the aggregator's round push, lost at the site
    _send(tmp_path, keys, agg, "a", 0, _honest(2))
    report = rounds.tick(config, "a", now=now + 3800)
    assert _events(report, "published")
    inbox_b = tmp_path / "state-b" / rounds.INBOX / "round-000001.json"
    assert inbox_b.exists()
    inbox_b.unlink()
    assert not [e for e in _events(rounds.tick(config, "a", now=now + 3900), "pushed") if e["to"] == "b"]
    pushed = [e for e in _events(rounds.tick(config, "a", now=now + 3800 + 3700), "pushed") if e["to"] == "b"]
    assert pushed and "sending it again" in pushed[0]["again"] and inbox_b.exists()


# ---- the tick's own files, planted as links, FIFOs or junk ------------------------------------------------------


@pytest.mark.timeout(120)
def test_files_planted_in_a_state_directory_neither_hang_a_tick_nor_lead_its_writes_elsewhere(tmp_path):
    """Links, FIFOs and junk where a tick keeps its log, records and push markers: nothing is written through a
    link, no FIFO is waited on (each would hang the tick, or `sync status`, for ever), and junk reads as
    nothing (a log line that is a list, a round that is not a number)."""
    config, keys, agg = _setup(tmp_path, ("a", "b"))
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    (agg / rounds.LOG).symlink_to(victim)
    os.mkfifo(agg / rounds.QUORUM)
    os.mkfifo(agg / rounds.REJECTED)
    outbox_b = tmp_path / "state-b" / rounds.OUTBOX
    outbox_b.mkdir(parents=True)
    rf.write_contribution(outbox_b, site="b", base_round=0, steps=10, tokens=1000, encoding="fp32",
                          tensors=encode(_honest(3), "fp32"), key=load_private(keys / "b.key"))  # fmt: skip
    os.mkfifo(outbox_b / ".pushed-contrib-b-r000000")
    assert [e["to"] for e in _events(rounds.tick(config, "b", now=10.0), "pushed")] == ["a"]
    _send(tmp_path, keys, agg, "a", 0, _honest(2))
    report = rounds.tick(config, "a", now=20.0)
    assert _events(report, "published") and victim.read_text() == "precious\n"
    assert any("cannot append" in e for e in report.errors), report.errors  # said, on the terminal
    (agg / rounds.LOG).unlink()
    (agg / rounds.LOG).write_text('[1, 2]\n{"event": "published", "round": [1]}\n7\n{"event": "pushed", "bytes": 5}\n')
    doc = rounds.status(config, "a")  # never a traceback
    assert doc["bytes_sent"] == 5 and [r["round"] for r in doc["rounds"]] == [0, 1]
    state_b = tmp_path / "state-b"
    os.mkfifo(state_b / rounds.TRAINING)
    run_b = tmp_path / "run-b"
    run_b.mkdir()
    (run_b / "job.yaml").write_text("name: b\n")
    assert (state_b / rounds.INBOX / "round-000001.json").exists()  # pushed by a's tick
    with pytest.raises(BadInput, match="TRAINING"):  # exit 2 naming the file, not a wait on a FIFO
        rounds.tick(config, "b", now=30.0)
