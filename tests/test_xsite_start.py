"""Cross-site rounds that start from a pretrained checkpoint (`xsite.start_from`, the DiLoCo paper's protocol):
one run trains alone, both sites start from its newest checkpoint (weights, optimizer state, step), their
rounds start at that step, and the checkpoint they started from is never written to."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import run_cli
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
        spec = yaml.safe_load(jobs[s].read_text())
        spec["xsite"]["start_from"] = str(pre)
        jobs[s].write_text(yaml.safe_dump(spec))
    _run_sites(tmp_path, config, jobs)
    assert _tree(pre) == before, "the pretrained checkpoints were written to"

    final = (STEPS - PRE) // H
    for s in ("a", "b"):
        run = tmp_path / f"run-{s}"
        out = (run / "logs").rglob("*")
        said = "\n".join(p.read_text(errors="replace") for p in out if p.is_file())
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
    spec = yaml.safe_load(jobs["a"].read_text())
    spec["xsite"]["start_from"] = str(empty)
    jobs["a"].write_text(yaml.safe_dump(spec))
    r = run_cli("run", str(jobs["a"]), "--local", "--run-dir", str(tmp_path / "run-a"), timeout=300)
    assert r.returncode == 1, r.stdout + r.stderr
    said = (
        r.stdout
        + r.stderr
        + "".join(p.read_text(errors="replace") for p in (tmp_path / "run-a" / "logs").rglob("*") if p.is_file())
    )
    assert f"xsite.start_from: no checkpoint in {empty} loads" in said, said[-3000:]
    assert list(empty.iterdir()) == []  # nothing written there
    assert not (tmp_path / "run-a" / "checkpoints").is_dir() or not any(
        (tmp_path / "run-a" / "checkpoints").glob("step-*")
    )


def test_start_from_another_models_checkpoint_is_refused_naming_why(mpi, tmp_path):
    """A pretrained checkpoint of another model (n_embd differs): refused with the reason, then the site fails;
    the pretrained directory is untouched."""
    _, jobs = _setup(tmp_path, steps=STEPS)
    pre = _pretrain(tmp_path, jobs["a"], "builtin")
    before = _tree(pre)
    spec = yaml.safe_load(jobs["a"].read_text())
    spec["xsite"]["start_from"] = str(pre)
    spec["train"]["params"]["n_embd"] = 64  # the pretraining run's is 32
    jobs["a"].write_text(yaml.safe_dump(spec))
    r = run_cli("run", str(jobs["a"]), "--local", "--run-dir", str(tmp_path / "run-a"), timeout=300)
    assert r.returncode == 1, r.stdout + r.stderr
    said = (
        r.stdout
        + r.stderr
        + "".join(p.read_text(errors="replace") for p in (tmp_path / "run-a" / "logs").rglob("*") if p.is_file())
    )
    assert "refusing checkpoint step-00000010" in said, said[-3000:]
    assert f"xsite.start_from: no checkpoint in {pre} loads" in said, said[-3000:]
    assert _tree(pre) == before
