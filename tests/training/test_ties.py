"""Tied parameters stay one parameter at every layout (hpcscale.parallel.ties): a user's model whose head is tied
to its embedding (tests/helpers/tied_entry.py), built whole or on the meta device, at each layout against the same
model trained whole in one process: the same losses and gradient norms, and one tied weight (one parameter on a
stage holding both names; bitwise equal copies on the stages of a pipeline)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from conftest import REPO, run_cli

# id: (ranks, parallel, meta). Replicated dp takes one rank's path (GradSync over the materialized model); FSDP2
# keeps its own ties (test_hf trains the page's tied Llama at dp_shard 4 and pp 2 x dp_shard 2, built whole); a
# pipeline of a model built whole starts from equal copies anyway: the meta builds below are the harder cases.
LAYOUTS = {
    "one-rank-meta": (1, {}, True),
    "tp2-meta": (2, {"tp": 2}, True),
    "pp2-tp2-meta": (4, {"pp": 2, "tp": 2}, True),
    "pp2-dp_shard2-meta": (4, {"pp": 2, "dp_shard": 2}, True),
}


def _matches_one_process(ref: dict, what: str) -> None:
    """Rank 0's losses and norms at the steps it ran are the whole model's in one process, within 1e-5."""
    assert ref["losses"], what
    for step, loss in ref["losses"].items():
        want = ref["reference"][int(step)]
        assert abs(loss - want) <= 1e-5 * abs(want), (what, step, ref["losses"], ref["reference"])
    for step, norm in ref["norms"].items():
        want = ref["reference_norms"][int(step)]
        assert abs(norm - want) <= 1e-5 * abs(want), (what, step, ref["norms"], ref["reference_norms"])


def _job(tmp: Path, ranks: int, parallel: dict, meta: bool, **extra) -> Path:
    spec = {
        "name": "tied",
        "site": "local",
        "tasks_per_node": ranks,
        "parallel": parallel,
        "timeout_seconds": 120,
        "environment": {"PYTHONPATH": f"{REPO}:{REPO / 'tests' / 'helpers'}"},  # this checkout's hpcscale
        "train": {"entry": "tied_entry:main", "params": {"meta": meta, "steps": 6, **extra}},
    }
    (tmp / "job.yaml").write_text(yaml.safe_dump(spec))
    return tmp / "job.yaml"


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_tied_embedding_and_head_train_as_one_parameter_at_every_layout(mpi, tmp_path, layout):
    ranks, parallel, meta = LAYOUTS[layout]
    result = run_cli("run", str(_job(tmp_path, ranks, parallel, meta)), "--local", "--run-dir", str(tmp_path / "run"),
                     timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    got = [json.loads((tmp_path / "run" / f"tied.{r}.json").read_text()) for r in range(ranks)]
    _matches_one_process(got[0], layout)
    if parallel.get("pp", 1) == 1:
        assert all(r["one_parameter"] for r in got), layout
        assert all(len(r["copies"]) == 2 for r in got)
    digests = {d for r in got for d in r["copies"].values()}
    assert len(digests) == 1, (layout, [(r["stage"], r["copies"]) for r in got])


def test_a_tie_the_tensor_parallel_plan_splits_one_way_only_is_refused(mpi, tmp_path):
    """The plan splits the head but leaves the embedding whole: one tied parameter cannot be both; exit 2
    naming the pair and both placements, before any step."""
    job = _job(tmp_path, 2, {"tp": 2}, False, split_head_only=True)
    result = run_cli("run", str(job), "--local", "--run-dir", str(tmp_path / "run"), timeout=300)
    assert result.returncode == 2, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout + result.stderr
    assert "emb.weight and head.weight are one tied parameter" in out, out[-3000:]
    assert "Shard(dim=0)" in out and "not split" in out


def test_ties_are_found_from_the_model_and_a_cut_records_those_it_spreads_over_stages():
    import sys

    sys.path.insert(0, str(REPO / "tests" / "helpers"))
    from tied_entry import TiedLM

    from hpcscale.parallel.pipeline import cut_stage
    from hpcscale.parallel.ties import STAGE_TIES, find_ties

    assert find_ties(TiedLM()) == [("emb.weight", "head.weight")]
    torch.nn.Linear(2, 2)  # an untied model has none
    assert find_ties(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))) == []
    for stage, here in ((0, "emb.weight"), (1, None), (2, "head.weight")):
        model = cut_stage(TiedLM(), stage=stage, pp=3, first_stage_only=("emb",), last_stage_only=("norm", "head"))
        (tie,) = model.__dict__[STAGE_TIES]
        # the head is initialized after the embedding in the whole model: its stage's values are the tie's
        assert (tie.names, tie.stages, tie.init_stage, tie.here) == (("emb.weight", "head.weight"), (0, 2), 2, here)
    whole = cut_stage(TiedLM(), stage=0, pp=1, first_stage_only=("emb",), last_stage_only=("norm", "head"))
    assert STAGE_TIES not in whole.__dict__


@pytest.mark.parametrize("first,then", [(1, 2), (2, 1)], ids=["pp1-then-pp2", "pp2-then-pp1"])
def test_a_tied_models_checkpoint_holds_the_tie_once_and_resumes_at_another_pipeline_degree(mpi, tmp_path, first, then):
    """Saved at one pipeline degree, resumed at another: the checkpoint holds the tied weight and its optimizer
    state once, under its first name (emb.weight), and the stage holding the head reads it from there; the
    resumed steps are the one-process run's."""
    job = _job(tmp_path, first, {"pp": first}, True, ckpt=True, steps=4)
    spec = yaml.safe_load(job.read_text())
    spec["checkpoint"] = {"every_steps": 2}
    job.write_text(yaml.safe_dump(spec))
    run = tmp_path / "run"
    r = run_cli("run", str(job), "--local", "--run-dir", str(run), timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    inspect = run_cli("ckpt", "inspect", str(run / "checkpoints" / "step-00000004"), "--json")
    assert inspect.returncode == 0, inspect.stderr
    names = {t["name"] for t in json.loads(inspect.stdout)["tensors"]}
    assert "model/emb.weight" in names and "model/head.weight" not in names, sorted(names)
    assert not any(n.startswith("optim/head.weight/") for n in names), sorted(names)
    spec.update(tasks_per_node=then, parallel={"pp": then})
    spec["train"]["params"]["steps"] = 6
    job.write_text(yaml.safe_dump(spec))
    r = run_cli("run", str(job), "--local", "--run-dir", str(run), "--reuse", timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "resumed from checkpoint step 4" in r.stdout, r.stdout[-3000:]
    got = json.loads((run / "tied.0.json").read_text())
    assert sorted(got["losses"]) == ["4", "5"], got["losses"]
    _matches_one_process(got, f"pp {first} then pp {then}")
