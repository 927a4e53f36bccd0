"""The global rounds a tick hands to its run (RUN/xsite/), against names planted there: by the same user (a stray
`touch`), and by a real second unix user who shares the run directory's group (tests/conftest.py `other_user`).
What was handed over is the tick's record (handed.json, each round's file with its sha256 and size), never a
file name: a planted name neither halts the aggregator (it would say it is behind, for ever) nor stops a site
exporting and resending, nor reaches a trainer's weights. Real ticks on real signed files; the trainer's side
through the product's Rounds on a one-rank gloo group."""

from __future__ import annotations

import json
import os
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from xsite_harness import contribute_delta, sites_with_round0

from hpcscale.xsite import roundfile as rf
from hpcscale.xsite import rounds

SHAPES = {"w": (6, 4), "b": (5,)}


class Sites:
    """Sites a (the aggregator) and b, their runs started (job.yaml), round 0 published and handed over."""

    def __init__(self, tmp: Path, *, shared_runs: bool = False):
        g = torch.Generator().manual_seed(1)
        self.theta0 = {k: torch.randn(*shape, generator=g) for k, shape in SHAPES.items()}
        quorum = {"min_sites": 2, "timeout_seconds": 3600}
        self.config, self.keys = sites_with_round0(tmp, ("a", "b"), self.theta0, name="handed", quorum=quorum,
                                                   outer={}, bound=True)  # fmt: skip
        self.tmp, self.now = tmp, 1_000_000.0
        self.training = rf.training_id("handed", self.theta0)
        for s in ("a", "b"):
            run = self.run(s)
            run.mkdir()
            (run / "job.yaml").write_text(f"name: {s}\n")
            if shared_runs:  # a project directory its group may write (setgid, umask 002 set-ups)
                os.chmod(run, 0o2775)

    def run(self, site: str) -> Path:
        return self.tmp / f"run-{site}"

    def state(self, site: str) -> Path:
        return self.tmp / f"state-{site}"

    def tick(self, site: str, after: float = 1.0) -> rounds.TickReport:
        self.now += after
        return rounds.tick(self.config, site, now=self.now)

    def contribute(self, site: str, base: int, seed: int) -> None:
        """What `site`'s export writes: Δ against θ(base) as published, bound to it."""
        theta = rf.read_round(self.state("a") / rounds.ROUNDS / f"round-{base:06d}.json",
                              keyring=_keyring(self.keys), aggregator="a").theta  # fmt: skip
        contribute_delta(self.state(site), self.keys, site=site, base=base, theta=theta, seed=seed,
                         training=self.training, shapes=SHAPES)  # fmt: skip

    def published(self) -> list[int]:
        return rounds._published(self.state("a"))


def _keyring(keys: Path):
    from hpcscale.xsite.signing import load_keyring

    return load_keyring(keys)


def _kinds(report: rounds.TickReport) -> list[str]:
    return [e["event"] for e in report.events]


def _events(report: rounds.TickReport, kind: str) -> list[dict]:
    return [e for e in report.events if e["event"] == kind]


# ---- the tick: a name in RUN/xsite is not a round handed over ----------------------------------------------------


def test_a_stray_global_file_name_neither_halts_the_aggregator_nor_stops_a_site(tmp_path):
    """The reviewer's repro: after `touch run-a/xsite/global-r000500.safetensors` the aggregator said "its own
    run was handed round 500 … publishes nothing" at every tick, and sites stopped exporting and resending."""
    sites = Sites(tmp_path)
    assert _kinds(sites.tick("a")) == ["pushed", "pushed", "handed over"]
    (sites.run("a") / "xsite" / "global-r000500.safetensors").touch()
    sites.tick("b")
    (sites.run("b") / "xsite" / "global-r000500.safetensors").touch()
    assert rounds.latest_global(sites.run("a")) == 0 == rounds.latest_global(sites.run("b"))
    for r in (1, 2):
        sites.contribute("a", r - 1, 10 * r)
        sites.contribute("b", r - 1, 10 * r + 1)
        report_b = sites.tick("b")
        assert [e["to"] for e in _events(report_b, "pushed")] == ["a"], report_b.events
        report = sites.tick("a")
        assert not _events(report, "behind") and not report.errors, report.events
        assert [e["round"] for e in _events(report, "published")] == [r]
        sites.tick("b")
        assert rounds.latest_global(sites.run("a")) == r == rounds.latest_global(sites.run("b"))
    assert sites.published() == [0, 1, 2]


def test_a_directory_another_user_made_for_the_global_weights_is_refused_and_the_rounds_go_on(
    tmp_path, shared_tmp, other_user
):
    """RUN is a project directory its group may write; a colleague makes RUN/xsite first and plants names in
    it: a high round (0 bytes), a well-shaped θ nobody signed, a symlink and a FIFO. The aggregator's tick
    refuses the directory (reported every tick, with the fix), writes nothing into it, and publishes on."""
    sites = Sites(shared_tmp, shared_runs=True)
    planted = other_user.make(sites.run("a") / "xsite", directory=True)
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    _plant(other_user, planted, victim)
    report = sites.tick("a")
    assert not _events(report, "behind") and not _events(report, "handed over"), report.events
    [error] = [e for e in report.errors if "hand over" in e]
    assert str(planted) in error and "owned by hpcscale-other" in error and "remove it" in error
    assert sorted(p.name for p in planted.iterdir()) == sorted(_PLANTED), "nothing written into their directory"
    assert victim.read_text() == "precious\n"
    sites.tick("b")  # round 0 handed to b's own run
    sites.contribute("a", 0, 1)
    sites.contribute("b", 0, 2)
    sites.tick("b")
    report = sites.tick("a")
    assert [e["round"] for e in _events(report, "published")] == [1] and not _events(report, "behind")
    assert sites.published() == [0, 1]
    status = rounds.status(sites.config, "a")
    assert status["pending"]["behind"] is None


_PLANTED = ("global-r000500.safetensors", "global-r000400.safetensors", "global-r000300.safetensors",
            "global-r000200.safetensors")  # fmt: skip


def _plant(other_user, directory: Path, victim: Path) -> None:
    """As the other user: a 0-byte high round, a well-shaped θ nobody signed, a symlink, a FIFO."""
    wellshaped = directory.parent / "wellshaped.safetensors"
    save_file({k: torch.full(s, 7.0) for k, s in SHAPES.items()}, str(wellshaped))
    os.chmod(wellshaped, 0o644)
    for argv in (
        ("touch", str(directory / _PLANTED[0])),
        ("cp", str(wellshaped), str(directory / _PLANTED[1])),
        ("ln", "-s", str(victim), str(directory / _PLANTED[2])),
        ("mkfifo", str(directory / _PLANTED[3])),
    ):
        done = other_user.run(*argv)
        assert done.returncode == 0, done.stderr
    wellshaped.unlink()


def test_the_record_of_rounds_handed_over_is_the_ticks_own(tmp_path):
    """What a hand-over writes: θ, then handed.json naming its file, sha256 and size, in a directory only the
    user can write (whatever the umask), the record readable back only as the tick wrote it."""
    from hpcscale.xsite import handed

    sites = Sites(tmp_path)
    old = os.umask(0o002)
    try:
        sites.tick("a")
    finally:
        os.umask(old)
    d = sites.run("a") / "xsite"
    assert (os.stat(d).st_mode & 0o777) == 0o755
    doc = json.loads((d / handed.RECORD).read_text())
    [entry] = doc["rounds"]
    data = (d / entry["file"]).read_bytes()
    import hashlib

    assert entry == {"round": 0, "file": "global-r000000.safetensors", "sha256": hashlib.sha256(data).hexdigest(),
                     "bytes": len(data)}  # fmt: skip
    assert rounds.load_global(sites.run("a"), 0).keys() == SHAPES.keys()


# ---- the trainer: it adopts only what the record names, as the record names it ------------------------------------


class _Metrics:
    def __init__(self) -> None:
        self.lines: list[str] = []
        self.logged: list[dict] = []

    def print(self, line: str) -> None:
        self.lines.append(line)

    def log(self, **fields) -> None:
        self.logged.append(fields)


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(SHAPES["w"]))
        self.b = torch.nn.Parameter(torch.zeros(SHAPES["b"]))


def _trainer(sites: Sites, site: str):
    """The product's trainer side of the rounds for `site`, in this process (rank 0 of a one-rank group)."""
    from hpcscale.launch.site_rounds import Rounds

    spec = types.SimpleNamespace(config=str(sites.tmp / "xsite.yaml"), site=site, start_from=None)
    ctx = types.SimpleNamespace(job=types.SimpleNamespace(xsite=spec), run_dir=sites.run(site), rank=0,
                                device=torch.device("cpu"), stop=types.SimpleNamespace(requested=False),
                                metrics=_Metrics())  # fmt: skip
    model = _Model()
    return Rounds(ctx, model, tokens_per_step=1), model, ctx.metrics


@pytest.mark.timeout(60)
@pytest.mark.parametrize("planted", ["empty", "wellshaped", "symlink", "fifo"])
def test_the_trainer_never_takes_a_name_planted_in_a_directory_another_user_made(
    shared_tmp, other_user, group, planted
):
    sites = Sites(shared_tmp, shared_runs=True)
    d = other_user.make(sites.run("b") / "xsite", directory=True)
    victim = shared_tmp / "victim.safetensors"
    save_file({k: torch.full(s, 5.0) for k, s in SHAPES.items()}, str(victim))
    name = "global-r000007.safetensors"
    if planted == "empty":
        argv = ("touch", str(d / name))
    elif planted == "wellshaped":
        os.chmod(victim, 0o644)
        argv = ("cp", str(victim), str(d / name))
    elif planted == "symlink":
        argv = ("ln", "-s", str(victim), str(d / name))
    else:
        argv = ("mkfifo", str(d / name))
    done = other_user.run(*argv)
    assert done.returncode == 0, done.stderr
    trainer, model, metrics = _trainer(sites, "b")
    assert trainer.wait_and_adopt(10, wait_s=0.0) is None
    assert torch.equal(model.w.detach(), torch.zeros(SHAPES["w"]))
    assert any(str(d) in line and "owned by hpcscale-other" in line for line in metrics.lines), metrics.lines


@pytest.mark.timeout(60)
@pytest.mark.parametrize("swap", ["empty", "wellshaped", "symlink", "fifo", "unlisted newer"])
def test_the_trainer_adopts_only_the_file_the_record_names_with_its_digest(tmp_path, group, swap):
    """The directory is the user's (only they or root could change it): a θ file changed after the hand-over
    (by hand, a disk fault) is refused with a line, and training goes on; a newer name the record does not
    list is nothing."""
    sites = Sites(tmp_path)
    sites.tick("a")
    sites.tick("b")  # round 0 handed to b's run
    d = sites.run("b") / "xsite"
    target = d / "global-r000000.safetensors"
    other = tmp_path / "other.safetensors"
    save_file({k: torch.full(s, 5.0) for k, s in SHAPES.items()}, str(other))
    if swap == "unlisted newer":
        save_file({k: torch.full(s, 5.0) for k, s in SHAPES.items()}, str(d / "global-r000009.safetensors"))
    else:
        target.unlink()
        if swap == "empty":
            target.touch()
        elif swap == "wellshaped":
            save_file({k: torch.full(s, 5.0) for k, s in SHAPES.items()}, str(target))
        elif swap == "symlink":
            target.symlink_to(other)
        else:
            os.mkfifo(target)
    trainer, model, metrics = _trainer(sites, "b")
    got = trainer.wait_and_adopt(10, wait_s=0.0)
    if swap == "unlisted newer":
        assert got == 0 and torch.equal(model.w.detach(), sites.theta0["w"])
        return
    assert got is None and torch.equal(model.w.detach(), torch.zeros(SHAPES["w"]))
    [line] = [ln for ln in metrics.lines if "not adopting global round 0" in ln]
    assert str(target) in line and "training on" in line
    assert trainer.wait_and_adopt(20, wait_s=0.0) is None  # refused once, never waited for again


# ---- the sync state directory: the tick's own, or refused before anything in it is read ---------------------------


def test_a_state_directory_another_user_made_first_is_refused_before_it_is_used(shared_tmp, other_user):
    from hpcscale.util.trust import UntrustedFile

    sites = Sites(shared_tmp, shared_runs=True)
    os.chmod(shared_tmp, 0o2775)  # a project area its group may write
    os.chown(shared_tmp, os.getuid(), other_user.gid)
    theirs = other_user.make(sites.state("b"), directory=True)
    with pytest.raises(UntrustedFile, match="owned by hpcscale-other") as e:
        sites.tick("b")
    assert str(theirs) in str(e.value) and "remove it" in str(e.value)
    assert list(theirs.iterdir()) == [], "nothing made, read or written in their directory"


def test_a_round_name_planted_in_a_group_writable_rounds_directory_is_refused_with_the_fix(shared_tmp, other_user):
    """rounds/ made group-writable (a tick under umask 002, a shared group): a colleague's round-999999.json
    there stopped the aggregator publishing for ever (its newest round did not verify), and would have had
    retention delete every real round. The tick now stops at once, exit 2, naming rounds/ and the fix."""
    from hpcscale.util.trust import UntrustedFile

    sites = Sites(shared_tmp, shared_runs=True)
    rounds_dir = sites.state("a") / rounds.ROUNDS
    os.chmod(rounds_dir, 0o2775)
    os.chown(rounds_dir, os.getuid(), other_user.gid)
    done = other_user.run("sh", "-c", 'echo "{}" > "$1"', "sh", str(rounds_dir / "round-999999.json"))
    assert done.returncode == 0, done.stderr
    with pytest.raises(UntrustedFile, match="writable by its group") as e:
        sites.tick("a")
    assert str(rounds_dir) in str(e.value) and f"chmod -R go-w {rounds_dir}" in str(e.value)
    (rounds_dir / "round-999999.json").unlink()  # what the fix says: check what is in it, then chmod
    os.chmod(rounds_dir, 0o755)
    assert _kinds(sites.tick("a")) == ["pushed", "pushed", "handed over"]


def test_the_tick_makes_its_state_directories_its_own_whatever_the_umask(tmp_path):
    """(A push makes what is missing with the pushing session's umask: with umask 002 and a shared group the
    next tick refuses it with the fix, so each site's first tick comes before the aggregator's push to it.)"""
    sites = Sites(tmp_path)
    old = os.umask(0o002)
    try:
        sites.tick("b")
        sites.tick("a")
    finally:
        os.umask(old)
    made = [sites.state("b"), sites.state("b") / rounds.INBOX, sites.state("a") / rounds.INCOMING / "b",
            sites.state("a") / rounds.OUTGOING, sites.state("a") / rounds.LOCK_DIR]  # fmt: skip
    assert {oct(os.stat(d).st_mode & 0o777) for d in made} == {"0o755"}
