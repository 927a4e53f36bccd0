"""A user loop's progress line (ctx.checkpoint.steps set): the numbers the loop logs beside the pace, and a time
left that a slow first step (torch.compile compiling, caches warming up) does not inflate."""

from __future__ import annotations

import re

import yaml
from conftest import REPO, run_cli


def test_the_progress_line_shows_the_loss_and_a_pace_the_first_step_does_not_skew(mpi, tmp_path):
    spec = {
        "name": "progress",
        "site": "local",
        "tasks_per_node": 1,
        "timeout_seconds": 120,
        "environment": {"PYTHONPATH": str(REPO / "tests" / "helpers")},
        "train": {"entry": "progress_entry:main", "params": {"steps": 8, "first_s": 3.0}},
    }
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec))
    r = run_cli("run", str(tmp_path / "job.yaml"), "--local", "--run-dir", str(tmp_path / "run"), timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    first = re.search(r"hpcscale: step 1/8 done, loss 2.5, first step ([\d.e+-]+) s \(compilation", r.stdout)
    assert first and float(first.group(1)) >= 3.0, r.stdout[-2000:]
    last = re.search(r"hpcscale: step 8/8 done, loss 1.8, ([\d.e+-]+) s/step, 0 steps left", r.stdout)
    assert last, r.stdout[-2000:]
    # the mean over the attempt would be about 3.1 / 8 = 0.39 s: the line gives the steps after the first
    assert float(last.group(1)) < 0.2, last.group(0)
