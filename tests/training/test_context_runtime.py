"""What the Context keeps of a model, as the public API says: `ctx.models`, `ctx.forget`, and the documented
`ctx.checkpoint.rebuild` hook replacing the model it restored into.

A user's rebuild (every checkpoint refused after part of one was read into the model) used to leave the first
model registered: its gradient averaging kept it and its gradient-sized buffers alive for the rest of the run,
and clip_grad_norm_, no_sync and accumulate still acted on it. Real ranks (mpirun, gloo), real checkpoints
damaged at their last chunk.
"""

from __future__ import annotations

import json

import pytest
import yaml
from conftest import REPO, run_cli
from test_ckpt import _damage_last_chunk

from hpcscale.errors import BadInput


def _job(tmp_path, steps: int):
    spec = {
        "name": "rebuild",
        "site": "local",
        "tasks_per_node": 2,
        "timeout_seconds": 60,
        "checkpoint": {"every_steps": 2},
        "environment": {"PYTHONPATH": str(REPO / "tests" / "helpers")},
        "train": {"entry": "rebuild_entry:main", "params": {"steps": steps}},
    }
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(spec))
    return job


def test_a_users_rebuild_replaces_the_model_it_restored_into(mpi, tmp_path):
    job, run = _job(tmp_path, 4), tmp_path / "run"
    r = run_cli("run", str(job), "--local", "--run-dir", str(run), timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    steps = sorted((run / "checkpoints").glob("step-*"))
    assert steps, "no checkpoint saved"
    for step_dir in steps:
        _damage_last_chunk(step_dir)
    again = run_cli("run", str(job), "--local", "--run-dir", str(run), "--reuse", timeout=300)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-3000:]
    for rank in range(2):
        out = json.loads((run / f"rebuild{rank}.json").read_text())
        assert out.get("rebuilt"), out
        assert not out["first_model_alive"], "something of hpcscale's still holds the model rebuild replaced"
        assert out["models_are_the_new_one"] == [True], out
        for norm, own in out["norms"]:  # replicas: the averaged gradient is the same on both; clip sees it alone
            assert abs(norm - own) <= 1e-6 * max(own, 1e-12), out["norms"]


def test_forget_refuses_a_model_it_was_not_given(group):
    import torch

    from hpcscale.launch.context import Context

    ctx = Context.__new__(Context)  # the registry alone: no mesh needed to refuse
    ctx._models, ctx._syncs, ctx._stage_ties, ctx._norm_skip, ctx._tp_grads = [], [], {}, set(), None
    with pytest.raises(BadInput, match=r"not given to ctx\.parallelize"):
        ctx.forget(torch.nn.Linear(2, 2))
    assert ctx.models == ()


def test_metrics_lines_go_through_the_one_appender(tmp_path):
    """RUN/metrics.jsonl is appended to as every log of hpcscale is (portable.files.JsonLinesAppender, the
    descriptor held: a line per step is one write): a line over the bound refused whole (before, a long line went
    out in several writes of a buffered file), a torn last line ended before the next."""
    from hpcscale.launch.metrics import METRICS_LINE_BYTES, MetricsLogger

    path = tmp_path / "metrics.jsonl"
    metrics = MetricsLogger(path, attempt=3)
    metrics.log(step=0, loss=1.5)
    with pytest.raises(BadInput, match="over the"):
        metrics.log(step=1, words=["x" * 1000] * (METRICS_LINE_BYTES // 1000))
    with open(path, "a") as f:
        f.write('{"step": 2, "lo')  # a torn line (a full disk, a kill)
    metrics.log(step=3, loss=1.25)
    lines = path.read_text().splitlines()
    assert [json.loads(x)["step"] for x in (lines[0], lines[2])] == [0, 3] and lines[1] == '{"step": 2, "lo'
    assert json.loads(lines[2])["attempt"] == 3 and metrics.latest(1) == [("loss", 1.25)]
    metrics.close()
