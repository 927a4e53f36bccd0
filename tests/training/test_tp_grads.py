"""hpcscale.parallel.tp_grads on real gloo ranks: a parameter the tp plan leaves whole but each tp rank computes on
its own share of an activation (a per-head q_norm/k_norm inside a tp-split attention) is refused at the first
optimizer step, exit 2, naming it; whole-state norms and heads left whole train (tests/helpers/tp_grads_entry.py
trains both models in one job)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml
from conftest import REPO, run_cli

LAYOUTS = {  # id -> (parallel section, ranks)
    "tp2": ({"tp": 2}, 2),
    "dp_shard2-tp2": ({"tp": 2, "dp_shard": 2}, 4),
    "pp2-tp2": ({"tp": 2, "pp": 2}, 4),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_per_head_norm_left_whole_is_refused_naming_it_and_whole_state_norms_train(mpi, tmp_path, layout):
    parallel, ranks = LAYOUTS[layout]
    spec = {
        "name": f"tpgrads-{layout}",
        "site": "local",
        "tasks_per_node": ranks,
        "parallel": parallel,
        "environment": {"PYTHONPATH": str(REPO / "tests" / "helpers")},
        "train": {"entry": "tp_grads_entry:main"},
    }
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec))
    run = tmp_path / "run"
    r = run_cli("run", str(tmp_path / "job.yaml"), "--local", "--run-dir", str(run), timeout=600)
    out = r.stdout + r.stderr
    # the model without a per-head norm trained on every rank, and every rank saw the same losses
    good = [json.loads((run / f"good.{i}.json").read_text()) for i in range(ranks)]
    assert all(g == good[0] for g in good), good
    assert len(good[0]) == 3 and all(x == x for x in good[0])
    # the one with q_norm and k_norm left whole was refused before its first step, on every rank
    assert not list(run.glob("bad.*.json")), out[-3000:]
    assert r.returncode == 2, out[-3000:]
    assert "each tp rank's own share of an activation" in out, out[-3000:]
    stage0 = "layers.0.attn.q_norm.weight" in out and "layers.0.attn.k_norm.weight" in out
    stage1 = "layers.1.attn.q_norm.weight" in out and "layers.1.attn.k_norm.weight" in out
    assert stage0 and (stage1 or parallel.get("pp", 1) > 1), out[-3000:]
    refusal = out[out.index("got a different gradient") :]
    refusal = refusal[: refusal.index("Each is computed")]
    assert "out_norm" not in refusal and "layers.0.norm" not in refusal and "head" not in refusal, refusal


def test_the_comparison_absorbs_rounding_and_flags_any_real_difference_on_two_ranks(tmp_path):
    """spreads() on two real gloo ranks: what differs by rounding passes, a gradient of another share, a missing
    or non-finite one on one rank only is flagged; nothing anywhere is not."""
    out = tmp_path / "found"
    r = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
         str(REPO / "tests" / "helpers" / "tp_grads_ranks.py"), str(out)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    found = [json.loads((tmp_path / f"found.{i}.json").read_text()) for i in range(2)]
    assert found[0] == found[1]
    assert sorted(found[0]) == sorted(
        ["one part in a thousand", "a different share", "permuted sign", "none on one rank", "nan on one rank"]
    ), found[0]
