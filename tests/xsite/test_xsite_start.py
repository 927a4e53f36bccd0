"""Cross-site rounds that start from a pretrained checkpoint (`xsite.start_from`, the DiLoCo paper's protocol):
one run trains alone, both sites start from its newest checkpoint (weights, optimizer state, step), their
rounds start at that step, and the checkpoint they started from is never written to."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import run_cli
from hypothesis import given
from hypothesis import strategies as st
from test_xsite_sync import H, _metrics, _run_sites, _setup

PRE, STEPS = 10, 30  # pretraining steps; the sites' rounds run from PRE to STEPS: two rounds of H


def _pretrain(tmp: Path, site_job: Path, entry: str) -> Path:
    """The site's job without `xsite`, PRE steps, a checkpoint at the end: the pretrained model."""
    spec = yaml.safe_load(site_job.read_text())
    spec.pop("xsite")
    spec["name"] = "pretrain"
    spec["checkpoint"] = {"every_steps": PRE, "keep_last": 2}
    spec["train"]["params"]["steps"] = PRE
    job = tmp / "job-pretrain.yaml"
    job.write_text(yaml.safe_dump(spec))
    r = subprocess.run(
        [sys.executable, "-m", "hpcscale", "run", str(job), "--local", "--run-dir", str(tmp / "run-pre")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, (entry, r.stdout[-3000:], r.stderr[-3000:])
    return tmp / "run-pre" / "checkpoints"


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")}


def _start_from(job: Path, start_from: Path, **params) -> None:
    """Give the site's job spec `xsite.start_from` (and override train params)."""
    spec = yaml.safe_load(job.read_text())
    spec["xsite"]["start_from"] = str(start_from)
    spec["train"]["params"].update(params)
    job.write_text(yaml.safe_dump(spec))


def _logs(run: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in (run / "logs").rglob("*") if p.is_file())


def _site_a_fails(tmp: Path, jobs: dict, code: int) -> str:
    """Site a's job alone: it must fail with `code` (2: refused its input; 1: a checkpoint that does not load);
    what it said, on the console and in its logs."""
    r = run_cli("run", str(jobs["a"]), "--local", "--run-dir", str(tmp / "run-a"), timeout=300)
    assert r.returncode == code, r.stdout + r.stderr
    return r.stdout + r.stderr + _logs(tmp / "run-a")


@pytest.mark.timeout(900)
@pytest.mark.parametrize("entry", ["builtin", "user"])
def test_sites_start_their_rounds_from_a_pretrained_checkpoint(mpi, tmp_path, entry):
    from safetensors.torch import load_file

    from hpcscale.ckpt.export import consolidated
    from hpcscale.ckpt.format import step_dir_name

    config, jobs = _setup(tmp_path, steps=STEPS, entry=entry)
    pre = _pretrain(tmp_path, jobs["a"], entry)
    before = _tree(pre)
    for s in ("a", "b"):
        _start_from(jobs[s], pre)
    _run_sites(tmp_path, config, jobs)
    assert _tree(pre) == before, "the pretrained checkpoints were written to"

    final = (STEPS - PRE) // H
    for s in ("a", "b"):
        run = tmp_path / f"run-{s}"
        said = _logs(run)
        assert f"started from {pre / step_dir_name(PRE)} (xsite.start_from)" in said, (s, said[-2000:])
        steps = [m["step"] for m in _metrics(run) if "loss" in m]
        assert steps and min(steps) == PRE, (s, steps[:5])  # the step counter went on from the pretrained one
        adopted = [m["xsite_round"] for m in _metrics(run) if "xsite_round" in m]
        assert adopted == list(range(final + (entry == "user"))), (s, adopted)
    # round 0 is the pretrained model itself: a's start checkpoint, at step PRE
    theta0 = load_file(str(tmp_path / "run-b" / "xsite" / "global-r000000.safetensors"))
    model = consolidated(pre / step_dir_name(PRE))
    assert theta0.keys() == model.keys() and all((theta0[k] == model[k].float()).all() for k in theta0)
    for r in range(1, final + 1):  # each round: both sites, one round of steps each, against its parent
        doc = json.loads((tmp_path / "state-a" / "rounds" / f"round-{r:06d}.json").read_text())
        assert sorted(a["site"] for a in doc["accepted"]) == ["a", "b"] and doc["rejected"] == [], doc
        assert [(a["steps"], a["base_round"]) for a in doc["accepted"]] == [(H, r - 1)] * 2, doc["accepted"]
    a = load_file(str(tmp_path / "run-a" / "xsite" / f"global-r{final:06d}.safetensors"))
    b = load_file(str(tmp_path / "run-b" / "xsite" / f"global-r{final:06d}.safetensors"))
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


def test_start_from_that_does_not_load_fails_the_site_and_names_it(mpi, tmp_path):
    """A start_from with no checkpoint in it: the site fails saying so (starting from scratch instead would not
    be the other sites' start)."""
    _, jobs = _setup(tmp_path, steps=STEPS)
    empty = tmp_path / "empty-checkpoints"
    empty.mkdir()
    _start_from(jobs["a"], empty)
    said = _site_a_fails(tmp_path, jobs, 1)
    assert f"xsite.start_from: no checkpoint in {empty} loads" in said, said[-3000:]
    assert list(empty.iterdir()) == []  # nothing written there
    assert not (tmp_path / "run-a" / "checkpoints").is_dir() or not any(
        (tmp_path / "run-a" / "checkpoints").glob("step-*")
    )


def test_start_from_another_models_checkpoint_is_refused_naming_why(mpi, tmp_path):
    """A pretrained checkpoint of another model (n_embd differs): refused with the reason, then the site fails;
    the pretrained directory is untouched. The same model's checkpoint in a step directory others can write
    (whoever can write there chooses the weights every site starts from): refused at start, exit 2, nothing in
    it read."""
    _, jobs = _setup(tmp_path, steps=STEPS)
    pre = _pretrain(tmp_path, jobs["a"], "builtin")
    before = _tree(pre)
    _start_from(jobs["a"], pre, n_embd=64)  # the pretraining run's is 32
    said = _site_a_fails(tmp_path, jobs, 1)
    assert "refusing checkpoint step-00000010" in said, said[-3000:]
    assert f"xsite.start_from: no checkpoint in {pre} loads" in said, said[-3000:]
    assert _tree(pre) == before

    shutil.rmtree(tmp_path / "run-a")
    _start_from(jobs["a"], pre, n_embd=32)  # it would load: only its directory's mode stops it
    step = pre / f"step-{PRE:08d}"
    pre.chmod(0o755)  # others may enter: the steps in it are checked too
    step.chmod(0o757)
    said = _site_a_fails(tmp_path, jobs, 2)
    assert f"xsite.start_from: {step}: refusing the directory in the xsite.start_from checkpoint directory" in said
    assert "writable by others" in said and "Nothing in it was read" in said, said[-3000:]
    assert "started from" not in said and "refusing checkpoint" not in said, said[-3000:]
    assert _tree(pre) == before


def test_start_from_at_or_past_the_last_step_is_refused(mpi, tmp_path):
    _, jobs = _setup(tmp_path, steps=PRE)  # the training would end where the pretrained checkpoint is
    pre = _pretrain(tmp_path, jobs["a"], "builtin")
    _start_from(jobs["a"], pre)
    said = _site_a_fails(tmp_path, jobs, 2)
    assert f"is at step {PRE}, and this training ends at step {PRE}" in said, said[-3000:]


@pytest.mark.timeout(600)
def test_a_site_refuses_a_round_0_that_is_not_its_start(mpi, tmp_path):
    """Site b starts from the pretrained checkpoint, the aggregator a from scratch (its job lacks start_from):
    b refuses θ(0) instead of silently dropping the pretrained weights."""
    from test_xsite_sync import _start, _tick, _until

    config, jobs = _setup(tmp_path, steps=STEPS, wait=60)
    pre = _pretrain(tmp_path, jobs["a"], "builtin")
    _start_from(jobs["b"], pre)
    procs = {s: _start(tmp_path, jobs, s) for s in ("a", "b")}
    try:
        _until("a's start checkpoint", lambda: (tmp_path / "run-a" / "checkpoints" / "step-00000000").is_dir())
        _until("b's start checkpoint", lambda: (tmp_path / "run-b" / "checkpoints" / f"step-{PRE:08d}").is_dir())
        assert _tick(config, "a").returncode in (0, 1)  # publishes round 0 from a's random start
        assert _tick(config, "b").returncode in (0, 1)  # hands θ(0) to b
        out, _ = procs["b"].communicate(timeout=300)
        assert procs["b"].returncode == 2, out[-3000:]
        assert "xsite.start_from: global round 0 is not the checkpoint this site started from" in out, out[-3000:]
        assert not any((tmp_path / "run-b" / "checkpoints").glob(f"step-{PRE + H:08d}"))  # no round was trained
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.communicate()


def test_retention_keeps_a_pinned_step():
    from hpcscale.ckpt.retention import plan

    kept, removed = plan([1005, 1010, 1020, 1030, 2000], keep_last=2, keep_every=1000, keep=frozenset({1005}))
    assert kept == [2000, 1030, 1005] and removed == [1020, 1010]


def test_the_start_checkpoint_is_pinned_until_round_0_is_adopted():
    from types import SimpleNamespace

    from hpcscale.launch.site_rounds import Rounds

    class Pins(SimpleNamespace):  # the CheckpointManager's pin calls (it also writes them to PINNED)
        def pin(self, step: int, why: str) -> None:
            self.pinned.add(step)

        def unpin(self, step: int) -> None:
            self.pinned.discard(step)

    manager = Pins(pinned=set())
    r = object.__new__(Rounds)
    r.pins = lambda: manager
    r.site, r.tokens_per_step, r.base, r.since, r.start = "a", 4, -1, 0, 0
    r.begin_at(1005)
    assert r.state_for_save(1005) == {"base_round": -1, "site": "a", "start": 1005} and manager.pinned == {1005}
    assert r.state_for_save(1010)["base_round"] == -1 and manager.pinned == {1005}  # a timed-out wait: pinned
    r.base, r.since = 0, 1005
    assert r.state_for_save(1015) == {
        "base_round": 0,
        "since": 1005,
        "steps": 10,
        "tokens": 40,
        "site": "a",
        "start": 1005,
    }
    assert manager.pinned == set()


@given(
    st.one_of(
        st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=5), st.lists(st.none())
    )
)
def test_a_hand_edited_start_reads_as_a_step_or_as_0(value):
    """The tick and the trainer read a checkpoint tag's `start` alike: a non-negative int is the start step,
    anything else (absent, bool, float, negative, text) is 0, as tags written before `start` existed."""

    from hpcscale.launch.site_rounds import Rounds
    from hpcscale.xsite.rounds import TAG, _start

    tag = {"base_round": 3} if value is None else {"base_round": 3, "start": value}
    expected = value if type(value) is int and value >= 0 else 0
    assert _start(tag) == expected
    r = object.__new__(Rounds)
    r.pins = lambda: None
    r.start = 0
    r.restore({TAG: tag})
    assert r.start == expected and r.base == 3
