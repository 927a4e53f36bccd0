"""An aggregator whose state directory is restored from an older copy while its sites train on, through real
ticks on real signed files (no trainers; the sites' contributions are written as their export writes them). It
must notice that its sites are ahead, never publish a second, different round from what its backup held, say
so (log, `sync status`, exit 1) with the way back, and go on from the newest round every verified record agrees
on: by itself once a site's signed contribution confirms θ, or from a round record copied from a site's inbox."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from click.testing import CliRunner
from xsite_harness import contribute_delta, sites_with_round0

from hpcscale.cli.sync_cmd import sync
from hpcscale.xsite import roundfile as rf
from hpcscale.xsite import rounds
from hpcscale.xsite.outer import encode
from hpcscale.xsite.signing import load_keyring, load_private

SHAPES = {"w": (6, 4), "b": (5,)}
TIMEOUT = 3600  # quorum timeout, and so the resend interval (max(600 s, the quorum timeout))


class Sites:
    """Sites a (the aggregator) and b, their runs started (job.yaml), round 0 naming its training."""

    def __init__(self, tmp: Path):
        g = torch.Generator().manual_seed(1)
        theta0 = {k: torch.randn(*shape, generator=g) for k, shape in SHAPES.items()}
        quorum = {"min_sites": 2, "timeout_seconds": TIMEOUT}
        self.config, self.keys = sites_with_round0(tmp, ("a", "b"), theta0, name="restore", quorum=quorum,
                                                   outer={}, bound=True)  # fmt: skip
        self.tmp, self.now = tmp, 1_000_000.0
        self.training = rf.training_id("restore", theta0)
        for s in ("a", "b"):
            (tmp / f"run-{s}").mkdir()
            (tmp / f"run-{s}" / "job.yaml").write_text(f"name: {s}\n")
        self.tick("a")  # round 0 to both inboxes, and handed to a's run
        self.tick("b")

    def state(self, site: str) -> Path:
        return self.tmp / f"state-{site}"

    def tick(self, site: str, after: float = 1.0) -> rounds.TickReport:
        self.now += after
        return rounds.tick(self.config, site, now=self.now)

    def contribute(self, site: str, seed: int) -> None:
        """What `site`'s export writes for its newest round: Δ against the θ its run was handed, bound to it."""
        run = self.tmp / f"run-{site}"
        base = rounds.latest_global(run)
        theta = rounds.load_global(run, base)
        contribute_delta(self.state(site), self.keys, site=site, base=base, theta=theta, seed=seed,
                         training=self.training, shapes=SHAPES)  # fmt: skip

    def round_of_both(self, r: int) -> None:
        self.contribute("a", 10 * r)
        self.contribute("b", 10 * r + 1)
        self.tick("b")  # b's contribution to the aggregator
        assert [e["round"] for e in _events(self.tick("a"), "published")] == [r]
        self.tick("b")  # round r handed to b's run
        assert rounds.latest_global(self.tmp / "run-b") == r == rounds.latest_global(self.tmp / "run-a")

    def published(self) -> list[int]:
        return rounds._published(self.state("a"))


def _events(report: rounds.TickReport, kind: str) -> list[dict]:
    return [e for e in report.events if e["event"] == kind]


def _restored_mid_run(tmp: Path) -> Sites:
    """Six rounds; a's state directory copied while round 4 was being built (b's contribution for it in), and
    put back after round 6, while both sites' contributions against round 6 are on their way."""
    sites = Sites(tmp)
    for r in (1, 2, 3):
        sites.round_of_both(r)
    sites.contribute("a", 40)
    sites.contribute("b", 41)
    sites.tick("b")  # b's contribution against round 3 is in a's incoming/: the copy holds it
    backup = tmp / "backup-state-a"
    shutil.copytree(sites.state("a"), backup, symlinks=True)
    assert [e["round"] for e in _events(sites.tick("a"), "published")] == [4]
    sites.tick("b")
    for r in (5, 6):
        sites.round_of_both(r)
    sites.contribute("a", 70)
    sites.contribute("b", 71)
    sites.tick("b")  # pushed before the restore: lost with it
    shutil.rmtree(sites.state("a"))
    shutil.copytree(backup, sites.state("a"), symlinks=True)
    return sites


def test_a_restored_aggregator_says_it_is_behind_publishes_no_fork_and_catches_up_by_itself(tmp_path):
    sites = _restored_mid_run(tmp_path)
    assert sites.published() == [0, 1, 2, 3]
    report = sites.tick("a")  # its own contribution against round 3 makes a quorum with b's: no round 4 from it
    assert not _events(report, "published") and sites.published() == [0, 1, 2, 3]
    [behind] = _events(report, "behind")
    assert "its newest published round is round 3" in behind["reason"]
    assert "its own run was handed round 6" in behind["reason"]
    assert "cp " in behind["reason"] and "round-000006.json" in behind["reason"]
    assert "it publishes nothing" in behind["reason"] and report.errors  # sync exits 1: cron mails it
    pending = rounds.status(sites.config, "a")["pending"]
    assert pending["round"] == 4 and pending["behind"] == behind["reason"]
    shown = CliRunner().invoke(sync, ["status", "--config", str(tmp_path / "xsite.yaml"), "--site", "a"])
    assert shown.exit_code == 0 and "behind: sites are ahead of this aggregator" in shown.output
    again = sites.tick("a")
    assert not _events(again, "behind") and again.errors  # said once in the log; an error every tick
    # b's contribution against round 6 is unanswered: b sends it again, and it confirms θ(6) in a's run
    assert [e["file"] for e in _events(sites.tick("b", after=TIMEOUT + 1), "pushed")] == ["contrib-b-r000006.json"]
    report = sites.tick("a")
    [caught] = _events(report, "caught up")
    assert caught["round"] == 6 and caught["after"] == 3 and "b named" in caught["source"]
    assert not report.errors and sites.published() == [0, 1, 2, 3, 6]
    assert rounds.status(sites.config, "a")["pending"]["behind"] is None
    sites.tick("a")  # round 6 to a's own inbox: its export makes its contribution against it
    sites.contribute("a", 80)
    [published] = _events(sites.tick("a"), "published")
    assert published["round"] == 7 and published["accepted"] == ["a", "b"]
    sites.tick("b")
    assert rounds.latest_global(tmp_path / "run-b") == 7 == rounds.latest_global(tmp_path / "run-a")
    r7 = rf.read_round(sites.state("a") / rounds.ROUNDS / "round-000007.json", keyring=load_keyring(sites.keys),
                       aggregator="a", need_momentum=True)  # fmt: skip
    assert r7.training == sites.training


def test_a_round_copied_from_a_sites_inbox_is_adopted_at_the_next_tick(tmp_path):
    """The way back the message gives, without waiting for a site's contribution: the round's record, signed by
    the aggregator's own key, copied from b's inbox."""
    sites = _restored_mid_run(tmp_path)
    [behind] = _events(sites.tick("a"), "behind")
    command = behind["reason"].split("`")[1]
    assert command.startswith("cp ") and str(sites.state("b") / rounds.INBOX / "round-000006.json") in command
    for name in ("round-000006.json", "round-000006.safetensors"):
        shutil.copy(sites.state("b") / rounds.INBOX / name, sites.state("a") / rounds.INBOX / name)
    [caught] = _events(sites.tick("a"), "caught up")
    assert caught["round"] == 6 and "signed by this aggregator's key" in caught["source"]
    assert sites.published() == [0, 1, 2, 3, 6]


def test_a_partner_naming_a_newer_round_is_reported_and_stops_nothing(tmp_path):
    """A partner's key can sign any round number: with nothing of the aggregator's own saying so, a contribution
    against a round it never published is reported, and the rounds go on."""
    sites = Sites(tmp_path)
    theta0 = rounds.load_global(tmp_path / "run-b", 0)
    incoming = sites.state("a") / rounds.INCOMING / "b"
    incoming.mkdir(parents=True, exist_ok=True)  # the tick makes every site's incoming/ directory
    rf.write_contribution(incoming, site="b", base_round=999, steps=10, tokens=1000, encoding="fp32",
                          tensors=encode(theta0, "fp32"), key=load_private(sites.keys / "b.key"),
                          training=sites.training, base_theta_sha256="0" * 64)  # fmt: skip
    sites.contribute("a", 1)
    sites.contribute("b", 2)
    sites.tick("b")
    report = sites.tick("a")
    [behind] = _events(report, "behind")
    assert "b sent a signed contribution against round 999" in behind["reason"]
    assert "It goes on publishing meanwhile" in behind["reason"]
    assert [e["round"] for e in _events(report, "published")] == [1] and not report.errors
