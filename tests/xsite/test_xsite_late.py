"""The aggregator's rules for a late site, through real ticks on real signed files (no trainers): a
contribution that missed its round is folded into the next one when `quorum.late_rounds` allows, exactly
once, never decides a quorum, and is superseded by a newer one from the same site; with late_rounds 0 it is
ignored. θ of every round is checked against the in-process outer step."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import yaml
from xsite_harness import sites_with_round0

from hpcscale.config.xsite import load_xsite
from hpcscale.xsite import roundfile as rf
from hpcscale.xsite import rounds
from hpcscale.xsite.outer import OuterStep, aggregate, decode, encode
from hpcscale.xsite.signing import generate_key, load_keyring, load_private

SITES = ("a", "b", "c")


def _setup(tmp: Path, late_rounds: int) -> tuple:
    theta0 = {"w": torch.randn(4, 3, generator=torch.Generator().manual_seed(1)), "b": torch.zeros(5)}
    quorum = {"min_sites": 2, "timeout_seconds": 3600, "late_rounds": late_rounds}
    # the reference below is the weighted mean (the default, auto, is robust)
    config, keys = sites_with_round0(tmp, SITES, theta0, name="late", quorum=quorum, outer={"rule": "mean"})
    return config, keys, theta0


def _contribute(tmp: Path, keys: Path, site: str, base: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    d = {"w": torch.randn(4, 3, generator=g) * 0.1, "b": torch.randn(5, generator=g) * 0.1}
    incoming = tmp / "state-a" / rounds.INCOMING / site
    incoming.mkdir(parents=True, exist_ok=True)
    rf.write_contribution(incoming, site=site, base_round=base, steps=10, tokens=100, encoding="fp32",
                          tensors=encode(d, "fp32"), key=load_private(keys / f"{site}.key"))  # fmt: skip
    return decode(encode(d, "fp32"), "fp32", {k: tuple(v.shape) for k, v in d.items()})


def _round(tmp: Path, keys: Path, r: int) -> rf.PublishedRound:
    path = tmp / "state-a" / rounds.ROUNDS / f"round-{r:06d}.json"
    return rf.read_round(path, keyring=load_keyring(keys), aggregator="a", need_momentum=True)


def _published(report: rounds.TickReport) -> list[dict]:
    return [e for e in report.events if e["event"] == "published"]


@pytest.mark.parametrize("late_rounds", [1, 0])
def test_a_late_contribution_is_folded_into_the_next_round_once(tmp_path, late_rounds):
    config, keys, theta0 = _setup(tmp_path, late_rounds)
    outer = OuterStep(theta0, lr=config.outer.lr, momentum=config.outer.momentum)  # the reference
    da, db = _contribute(tmp_path, keys, "a", 0, 1), _contribute(tmp_path, keys, "b", 0, 2)
    assert [e["accepted"] for e in _published(rounds.tick(config, "a"))] == [["a", "b"]]  # quorum 2 of 3
    outer.apply(aggregate([(100.0, da), (100.0, db)]))
    dc_late = _contribute(tmp_path, keys, "c", 0, 3)  # c's round-1 work arrives after round 1
    assert _published(rounds.tick(config, "a")) == [], "a late contribution alone never makes a round"
    da, db = _contribute(tmp_path, keys, "a", 1, 4), _contribute(tmp_path, keys, "b", 1, 5)
    [event] = _published(rounds.tick(config, "a"))
    r2 = _round(tmp_path, keys, 2)
    if late_rounds:
        assert event["accepted"] == ["a", "b", "c"] and event["late"] == {"c": 0}, event
        assert {(a.site, a.base_round) for a in r2.accepted} == {("a", 1), ("b", 1), ("c", 0)}
        outer.apply(aggregate([(100.0, da), (100.0, db), (100.0, dc_late)]))
    else:
        assert event["accepted"] == ["a", "b"] and "late" not in event, event
        outer.apply(aggregate([(100.0, da), (100.0, db)]))
    theta, _ = outer.state()
    assert all(torch.equal(r2.theta[k], theta[k]) for k in theta)
    # Round 3: a and b on time; c's old contribution is never applied again (nor, superseded, an older one).
    _contribute(tmp_path, keys, "a", 2, 6), _contribute(tmp_path, keys, "b", 2, 7)
    [event] = _published(rounds.tick(config, "a"))
    assert event["accepted"] == ["a", "b"], event


def test_a_newer_contribution_supersedes_a_late_one(tmp_path):
    config, keys, _ = _setup(tmp_path, late_rounds=2)
    _contribute(tmp_path, keys, "a", 0, 1), _contribute(tmp_path, keys, "b", 0, 2)
    rounds.tick(config, "a")  # round 1 without c
    _contribute(tmp_path, keys, "c", 0, 3)  # late for round 1 ...
    _contribute(tmp_path, keys, "c", 1, 4)  # ... and c's on-time work for round 2 is here too
    _contribute(tmp_path, keys, "a", 1, 5)
    [event] = _published(rounds.tick(config, "a"))
    assert event["accepted"] == ["a", "c"] and "late" not in event, event  # c's base-1 Δ, not both
    r2 = _round(tmp_path, keys, 2)
    assert {(a.site, a.base_round) for a in r2.accepted} == {("a", 1), ("c", 1)}


def test_overlapped_adoption_keeps_the_steps_taken_since_the_boundary():
    """adopt: overlap: θ ← θ(r) + (θ_now − θ_boundary), exactly, for every parameter."""
    from hpcscale.launch.site_rounds import Rounds

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    r = object.__new__(Rounds)
    r.model = model
    snapshot = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():  # "training" after the boundary
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    now = {n: p.detach().clone() for n, p in model.named_parameters()}
    theta = {n: torch.randn_like(p) for n, p in model.named_parameters()}
    r._load(theta, snapshot)
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), theta[n] + (now[n] - snapshot[n])), n
    r._load(theta)  # wait: θ(r) itself
    assert all(torch.equal(p.detach(), theta[n]) for n, p in model.named_parameters())


def test_keep_rounds_must_outlast_late_rounds(tmp_path):
    """A late contribution's round must not be pruned before it can be folded: exit 2 naming the key."""
    from hpcscale.config.errors import ConfigError

    _setup(tmp_path, late_rounds=1)
    path = tmp_path / "xsite.yaml"
    doc = yaml.safe_load(path.read_text())
    doc["keep_rounds"] = 2
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(ConfigError, match="keep_rounds") as e:
        load_xsite(path)
    assert str(path) in str(e.value) and e.value.exit_code == 2


def test_a_folded_contribution_is_never_applied_again(tmp_path):
    """late_rounds 2: c's base-0 contribution, folded into round 2, is still in the window for round 3 and
    must not go in again (c sends nothing newer)."""
    config, keys, _ = _setup(tmp_path, late_rounds=2)
    _contribute(tmp_path, keys, "a", 0, 1), _contribute(tmp_path, keys, "b", 0, 2)
    rounds.tick(config, "a")  # round 1 without c
    _contribute(tmp_path, keys, "c", 0, 3)
    _contribute(tmp_path, keys, "a", 1, 4), _contribute(tmp_path, keys, "b", 1, 5)
    [event] = _published(rounds.tick(config, "a"))
    assert event["late"] == {"c": 0}, event
    _contribute(tmp_path, keys, "a", 2, 6), _contribute(tmp_path, keys, "b", 2, 7)
    [event] = _published(rounds.tick(config, "a"))
    assert event["accepted"] == ["a", "b"] and "late" not in event, event


def test_a_refused_outlier_does_not_come_back_as_a_late_contribution(tmp_path):
    config, keys, _ = _setup(tmp_path, late_rounds=1)
    _contribute(tmp_path, keys, "a", 0, 1), _contribute(tmp_path, keys, "b", 0, 2)
    g = torch.Generator().manual_seed(3)
    # ~50x the others' norm: over factor (10) x their median with three sites, under factor^2 (100) with two
    huge = {"w": torch.randn(4, 3, generator=g) * 5, "b": torch.randn(5, generator=g) * 5}
    incoming = tmp_path / "state-a" / rounds.INCOMING / "c"
    incoming.mkdir(parents=True)
    rf.write_contribution(incoming, site="c", base_round=0, steps=10, tokens=100, encoding="fp32",
                          tensors=encode(huge, "fp32"), key=load_private(keys / "c.key"))  # fmt: skip
    [event] = _published(rounds.tick(config, "a"))
    assert event["accepted"] == ["a", "b"] and [x["site"] for x in event["rejected"]] == ["c"], event
    r1 = _round(tmp_path, keys, 1)
    assert [(x.site, x.base_round) for x in r1.rejected] == [("c", 0)]
    # Round 2: only a in time; at the quorum timeout the round goes ahead with a alone, and with two
    # contributions the norm rule cannot tell c's again (it needs three): only "never tried again" keeps it out.
    _contribute(tmp_path, keys, "a", 1, 4)
    t0 = time.time()
    assert _published(rounds.tick(config, "a", now=t0)) == []
    [event] = _published(rounds.tick(config, "a", now=t0 + config.quorum.timeout_seconds + 1))
    assert event["accepted"] == ["a"] and "late" not in event, event


def test_a_stray_round_name_in_an_inbox_deletes_nothing_and_blocks_nothing(tmp_path):
    """An empty `inbox/round-999999.json` (hostile, or left by hand) must not make every real round "old" to
    retention, nor stop the newest verified round from reaching the run."""
    config, keys, _ = _setup(tmp_path, late_rounds=0)
    run_b = tmp_path / "run-b"
    run_b.mkdir()
    (run_b / "job.yaml").write_text("name: b\n")
    for s in ("a", "b"):
        (tmp_path / f"state-{s}" / rounds.INBOX).mkdir(parents=True, exist_ok=True)
        (tmp_path / f"state-{s}" / rounds.INBOX / "round-999999.json").write_text("")
    _contribute(tmp_path, keys, "a", 0, 1), _contribute(tmp_path, keys, "b", 0, 2)
    rounds.tick(config, "a")  # round 1, pushed to every inbox
    report = rounds.tick(config, "b")
    assert (run_b / "xsite" / "global-r000001.safetensors").exists(), report.events
    assert any(e["event"] == "rejected" and "999999" in e["file"] for e in report.events), report.events
    assert {p.name for p in (tmp_path / "state-a" / rounds.ROUNDS).glob("round-*.json")} == {
        "round-000000.json",
        "round-000001.json",
    }
    assert (tmp_path / "state-b" / rounds.INBOX / "round-000001.json").exists()


def test_a_compiled_model_adopts_the_weights_checkpoints_name():
    """torch.compile names parameters `_orig_mod.<name>`; checkpoints (and so θ) name them `<name>`."""
    from hpcscale.launch.site_rounds import Rounds

    r = object.__new__(Rounds)
    r.model = torch.compile(torch.nn.Linear(4, 2))
    assert {n for n, _ in r.model.named_parameters()} == {"_orig_mod.weight", "_orig_mod.bias"}
    theta = {"weight": torch.randn(2, 4), "bias": torch.randn(2)}
    r._load(theta)
    assert torch.equal(r.model.weight.detach(), theta["weight"]) and torch.equal(r.model.bias.detach(), theta["bias"])


def test_the_aggregators_records_and_log_are_kept_bounded(tmp_path, monkeypatch):
    """quorum.json and rejected.json keep only the rounds retention keeps; log.jsonl keeps its newest half
    past its cap, from a whole line, and sync status still reads it."""
    config, keys, _ = _setup(tmp_path, late_rounds=0)
    path = tmp_path / "xsite.yaml"
    doc = yaml.safe_load(path.read_text())
    doc["keep_rounds"] = 2
    path.write_text(yaml.safe_dump(doc))
    config = load_xsite(path)
    monkeypatch.setattr(rounds, "LOG_MAX_BYTES", 4096)
    state = tmp_path / "state-a"
    bad = tmp_path / "bad"
    bad.mkdir()
    generate_key(bad, "c")  # c signs with a key the keyring does not hold: rejected every round
    for r in range(6):
        _contribute(tmp_path, keys, "a", r, 10 + r), _contribute(tmp_path, keys, "b", r, 20 + r)
        incoming = state / rounds.INCOMING / "c"
        incoming.mkdir(parents=True, exist_ok=True)
        rf.write_contribution(incoming, site="c", base_round=r, steps=10, tokens=100, encoding="fp32",
                              tensors=encode({"w": torch.zeros(4, 3), "b": torch.zeros(5)}, "fp32"),
                              key=load_private(bad / "c.key"))  # fmt: skip
        assert len(_published(rounds.tick(config, "a"))) == 1
        rounds.tick(config, "a")  # prunes after the round is verified
    import json

    quorum = json.loads((state / rounds.QUORUM).read_text())
    rejected = json.loads((state / rounds.REJECTED).read_text())
    assert sorted(int(k) for k in quorum) == [5, 6], quorum  # rounds 5 and 6 kept (keep_rounds 2)
    assert rejected and all(int(k.split("/")[0]) >= 5 for k in rejected), rejected
    log = (state / rounds.LOG).read_bytes()
    assert len(log) <= 4096 + 2048 and log.endswith(b"\n")
    assert all("event" in json.loads(line) for line in log.splitlines())  # every line whole
    assert rounds.status(config, "a")["rounds"], "status reads the rotated log"


def test_the_aggregator_refuses_a_contribution_larger_than_its_model_before_inflating_it(tmp_path):
    """A site's key signs whatever specs it likes: a compressed payload listing 32 MiB of zeros for a model of
    a few floats is a few KiB on the wire. The tick reads contributions within the model's size, so it refuses
    that one before decompressing it, and the round goes on without it."""
    config, keys, _ = _setup(tmp_path, late_rounds=0)
    _contribute(tmp_path, keys, "a", 0, 1)
    incoming = tmp_path / "state-a" / rounds.INCOMING / "b"
    incoming.mkdir(parents=True, exist_ok=True)
    bomb = {"w": torch.zeros(4, 3), "b": torch.zeros(5), "x": torch.zeros(8 << 20)}
    rf.write_contribution(incoming, site="b", base_round=0, steps=10, tokens=100, encoding="fp32", tensors=bomb,
                          key=load_private(keys / "b.key"), compression="zstd")  # fmt: skip
    assert (incoming / "contrib-b-r000000.safetensors").stat().st_size < 64 << 10
    _contribute(tmp_path, keys, "c", 0, 3)
    report = rounds.tick(config, "a")
    [refused] = [e for e in report.events if e["event"] == "rejected"]
    assert refused["site"] == "b" and "over the limit of" in refused["reason"], refused
    assert [e["accepted"] for e in _published(report)] == [["a", "c"]]
