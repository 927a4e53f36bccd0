"""What a GPU cluster runs by default, proven on CPU ranks: fused AdamW (foreach for a user's model, torch's
default on CUDA), bf16 mixed precision and async saves, at every layout. Each layout trains, saving several
times; a copy of its run directory keeps only the saves up to a later one (not the first: a process's later
saves are the ones a stale-state shortcut got wrong) and resumes from it, and the resumed steps' losses must be
the uninterrupted run's, bit for bit. A save that kept stale optimizer state, a kernel that refuses the
layout's parameters, or a resume that restores less than it saved fails here."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from conftest import REPO, run_cli
from trainjobs import GPU_DEFAULTS, job_spec, losses

STEPS, EVERY, RESUME_AT = 12, 4, 8  # saves at 4, 8 and 12 (the end); the resume starts from 8


def _run(job: Path, run: Path, *extra: str) -> str:
    result = run_cli("run", str(job), "--local", "--run-dir", str(run), *extra, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def _resume_from_a_later_save(run: Path, tmp: Path) -> Path:
    """A copy of `run` holding only its saves up to RESUME_AT, as if it had stopped there."""
    copy = tmp / "resumed"
    shutil.copytree(run, copy, symlinks=True)
    ckpts = copy / "checkpoints"
    saved = sorted(int(p.name.split("-")[1]) for p in ckpts.glob("step-*"))
    assert saved == [EVERY, RESUME_AT, STEPS], saved
    for step in saved:
        if step > RESUME_AT:
            shutil.rmtree(ckpts / f"step-{step:08d}")
    (ckpts / "LATEST").write_text(f"step-{RESUME_AT:08d}\n")
    return copy


def _user_job(path: Path, *, tp: int, pp: int, ranks: int, dp_shard: int) -> Path:
    spec = {
        "name": "user-gpu-defaults",
        "site": "local",
        "tasks_per_node": ranks,
        "parallel": {"tp": tp, "pp": pp, "dp_shard": dp_shard, **GPU_DEFAULTS["parallel"]},
        "timeout_seconds": 60,
        "environment": {"PYTHONPATH": str(REPO / "tests" / "helpers")},
        "checkpoint": {"every_steps": EVERY, "keep_last": 5, **GPU_DEFAULTS["checkpoint"]},
        "train": {"entry": "fsdp_entry:main", "params": {"steps": STEPS, **GPU_DEFAULTS["user_params"]}},
    }
    path.write_text(yaml.safe_dump(spec))
    return path


LAYOUTS = {  # id: (tp, pp, ranks, dp_shard); replicated dp alone is the stop-and-resume tests' (test_ckpt.py)
    "dp_shard2": (1, 1, 2, 2),
    "hsdp2x2": (1, 1, 4, 2),
    "tp2": (2, 1, 2, 1),
    "pp2": (1, 2, 2, 1),
    "tp2-dp_shard2": (2, 1, 4, 2),
    "pp2-dp_shard2": (1, 2, 4, 2),
}
# Saved and resumed: every kind of parameter the kernels meet, each on a mesh of two axes (a tensor-parallel
# DTensor sharded again by FSDP, a pipeline stage's FSDP shards, FSDP shards replicated across a second axis),
# and a user's tp model under foreach. The one-axis layouts hold the same kinds on one axis and train at the
# GPU defaults in the device-read test below; plain tensors under each kernel, saved again and again, are
# tests/ckpt/test_ckpt.py's every-save test.
SAVED_AND_RESUMED = ["hsdp2x2", "tp2-dp_shard2", "pp2-dp_shard2"]


@pytest.mark.parametrize("layout", [*SAVED_AND_RESUMED, "user-tp2"])
def test_gpu_defaults_save_several_times_and_resume_from_a_later_save_bit_for_bit(mpi, tmp_path, layout):
    if layout == "user-tp2":  # foreach AdamW over a user's tp model: the group it refused before
        job = _user_job(tmp_path / "job.yaml", tp=2, pp=1, ranks=2, dp_shard=1)
    else:
        tp, pp, ranks, dp_shard = LAYOUTS[layout]
        job = job_spec(
            tmp_path / "job.yaml",
            tp=tp,
            pp=pp,
            ranks=ranks,
            dp_shard=dp_shard,
            gpu_defaults=True,
            steps=STEPS,
            n_layer=2,
            checkpoint={"every_steps": EVERY, "keep_last": 5},
        )
    spec = yaml.safe_load(job.read_text())
    assert spec["parallel"]["mixed_precision"] == "bf16"
    uninterrupted = tmp_path / "run"
    _run(job, uninterrupted)
    expected = losses(uninterrupted)
    assert sorted(expected) == list(range(STEPS))
    resumed = _resume_from_a_later_save(uninterrupted, tmp_path)
    out = _run(job, resumed, "--reuse")
    assert f"resumed from checkpoint step {RESUME_AT}" in out, out[-2000:]
    again = losses(resumed)  # the resumed attempt's rows come last: they win for steps RESUME_AT..
    for step in range(RESUME_AT, STEPS):
        assert again[step] == expected[step], (step, again[step], expected[step])


@pytest.mark.parametrize("example", ["gpt-dgx.yaml", "gpt-hsdp.yaml"])
def test_the_gpu_examples_layouts_and_numerics_start_and_train_here_scaled_down(mpi, tmp_path, example):
    """docs/examples' GPU jobs with their own parallel and numerics settings (fused AdamW, bf16, tp with the
    reference GPT's replicated norms and embeddings beside its split linears), on 4 CPU ranks: each degree cut
    to 2, the model to the tests' tiny GPT."""
    spec = yaml.safe_load((REPO / "docs" / "examples" / example).read_text())
    parallel = dict(spec["parallel"])
    parallel["tp"] = min(parallel.get("tp", 1), 2)
    parallel["pp"] = min(parallel.get("pp", 1), 2)
    if parallel.get("dp_shard", 1) > 1:
        parallel["dp_shard"] = 2
    ranks = parallel["tp"] * parallel["pp"] * parallel.get("dp_shard", 1)
    numerics = {k: spec["train"]["params"][k] for k in ("bf16", "tf32", "fused_optimizer", "deterministic")}
    assert numerics["fused_optimizer"] and parallel["tp"] == 2
    if numerics["bf16"]:  # on a GPU `auto` is bf16 for this trainer; on CPU ranks it has to be asked for
        parallel["mixed_precision"] = "bf16"
    job = job_spec(tmp_path / "job.yaml", tp=parallel.pop("tp"), pp=parallel.pop("pp"), ranks=ranks, steps=4)
    scaled = yaml.safe_load(job.read_text())
    scaled["parallel"] |= parallel
    scaled["train"]["params"] |= numerics
    job.write_text(yaml.safe_dump(scaled))
    _run(job, tmp_path / "run")
    assert sorted(losses(tmp_path / "run")) == [0, 1, 2, 3]


@pytest.mark.parametrize("layout", ["dp_shard2", "tp2", "pp2"])
def test_a_training_step_reads_the_device_once(mpi, tmp_path, layout):
    """The built-in trainer at the GPU defaults keeps the loss and the gradient norm on the device: they ride on
    the stop check's all-reduce and come back with its one read (tests/helpers/sync_count_entry.py counts every
    read of a tensor's value and copy to the host on the training thread, between step ends). The first step
    (the pipeline's shape inference, lazy optimizer state) and the last (the progress line) may read more."""
    tp, pp, ranks, dp_shard = LAYOUTS[layout]
    job = job_spec(tmp_path / "job.yaml", tp=tp, pp=pp, ranks=ranks, dp_shard=dp_shard, gpu_defaults=True, steps=6)
    spec = yaml.safe_load(job.read_text())
    spec["train"]["entry"] = "sync_count_entry:main"
    spec["environment"] = {"PYTHONPATH": str(REPO / "tests" / "helpers")}
    spec.pop("checkpoint", None)  # a save step reads tensors to write them: the steps here have none
    job.write_text(yaml.safe_dump(spec))
    _run(job, tmp_path / "run")
    for rank in range(ranks):
        counts = json.loads((tmp_path / "run" / f"syncs.{rank}.json").read_text())
        assert sorted(map(int, counts)) == list(range(6))
        for step in range(1, 5):
            n, where = counts[str(step)]
            assert n == 1 and where[0].startswith("tolist at context.py"), (rank, step, where)


def test_a_tensor_parallel_plan_that_names_few_modules_trains_with_foreach_adamw(mpi, tmp_path):
    """tests/helpers/tp_owners_entry.py at tp = 2: modules the plan leaves alone (a root owning a parameter it
    adds to its children's output, running statistics, tensors made in forward, a tied embedding and head)
    compute as without tensor parallelism, every parameter is a DTensor (so foreach AdamW takes the group), the
    tie holds, and the losses are the whole model's trained in one process."""
    spec = {
        "name": "tp-owners",
        "site": "local",
        "tasks_per_node": 2,
        "parallel": {"tp": 2},
        "timeout_seconds": 60,
        "environment": {"PYTHONPATH": str(REPO / "tests" / "helpers")},
        "train": {"entry": "tp_owners_entry:main"},
    }
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec))
    _run(tmp_path / "job.yaml", tmp_path / "run")
    for rank in range(2):
        got = json.loads((tmp_path / "run" / f"tp_owners.{rank}.json").read_text())
        assert got["all_dtensors"] and got["tied"], got
        assert "head.weight" not in got["params"]  # one parameter under its first name, as named_parameters() has it
        for a, b in zip(got["losses"], got["reference"], strict=True):
            assert abs(a - b) <= 1e-5 * abs(b), (got["losses"], got["reference"])
