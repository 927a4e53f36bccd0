"""Every checkpoint records what produced it (hpcscale.ckpt.lineage): the job spec as run, hpcscale's version,
the user's code version in a git checkout (commit, dirty), the parent checkpoint, Slurm's job and restart
count, a cross-site base round. Checked on a real run of a Context entry kept in a real git repository."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from conftest import need, run_cli

import hpcscale
from hpcscale.ckpt import lineage

ENTRY = """
import torch
from torch import nn


def main(ctx):
    model = ctx.parallelize(nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    start = ctx.checkpoint.restore(model, opt)
    for step in range(start, ctx.params["steps"]):
        loss = model(torch.randn(8, 4)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        ctx.checkpoint.step(step)
"""


def _git(repo: Path, *args: str) -> str:
    r = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True)
    return r.stdout.strip()


@pytest.fixture
def repo(tmp_path) -> Path:
    need(shutil.which("git") is not None, "git")
    code = tmp_path / "code"
    code.mkdir()
    (code / "lineage_entry.py").write_text(ENTRY)
    _git(code, "init", "-q")
    _git(code, "-c", "user.email=t@example.org", "-c", "user.name=t", "add", "lineage_entry.py")
    _git(code, "-c", "user.email=t@example.org", "-c", "user.name=t", "commit", "-q", "-m", "entry")
    return code


def test_code_version_names_the_commit_and_whether_tracked_files_changed(repo, monkeypatch):
    monkeypatch.syspath_prepend(str(repo))
    head = _git(repo, "rev-parse", "HEAD")
    v = lineage.code_version("lineage_entry:main")
    assert v == {"entry": "lineage_entry:main", "path": str(repo / "lineage_entry.py"), "git_commit": head,
                 "dirty": False}  # fmt: skip
    (repo / "lineage_entry.py").write_text(ENTRY + "\n# edited\n")
    assert lineage.code_version("lineage_entry:main")["dirty"] is True
    assert lineage.code_version("builtin") == {"entry": "builtin"}
    missing = lineage.code_version("no_such_module_anywhere:main")  # recorded as the entry alone, never fatal
    assert missing == {"entry": "no_such_module_anywhere:main"}


def test_a_save_names_slurm_job_restart_and_round(monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    got = lineage.for_save({"hpcscale_version": "x"}, {"xsite": {"base_round": 7}}, "step-00000010")
    assert got == {"hpcscale_version": "x", "parent": "step-00000010", "slurm": {"job_id": "4242", "restart_count": 2},
                   "round": 7}  # fmt: skip


def test_every_checkpoint_of_a_run_records_its_lineage(mpi, repo, tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({
        "name": "lineage", "site": "local", "tasks_per_node": 1,
        "environment": {"PYTHONPATH": str(repo), "API_TOKEN": "s3cr3t"},
        "checkpoint": {"every_steps": 5, "keep_last": 5},
        "train": {"entry": "lineage_entry:main", "params": {"steps": 10}},
    }))  # fmt: skip
    run = tmp_path / "run"
    r = run_cli("run", str(job), "--local", "--run-dir", str(run), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    spec_sha = hashlib.sha256((run / "job.yaml").read_bytes()).hexdigest()
    parents = {}
    for step in (5, 10):
        out = run_cli("ckpt", "inspect", str(run / "checkpoints" / f"step-{step:08d}"), "--json")
        assert out.returncode == 0, out.stderr
        lin = json.loads(out.stdout)["trainer_state"]["lineage"]
        assert lin["hpcscale_version"] == hpcscale.__version__
        assert lin["job"]["sha256"] == spec_sha  # of the file as run; the copy hides environment values
        copy = yaml.safe_load(lin["job"]["text"])
        assert copy["environment"] == {"PYTHONPATH": "<redacted>", "API_TOKEN": "<redacted>"}
        assert copy["train"] == yaml.safe_load((run / "job.yaml").read_text())["train"]
        assert "s3cr3t" not in json.dumps(lin)
        assert lin["code"]["git_commit"] == _git(repo, "rev-parse", "HEAD") and lin["code"]["dirty"] is False
        assert "slurm" not in lin and "round" not in lin  # a local run, not a cross-site site
        parents[step] = lin["parent"]
    assert parents == {5: None, 10: "step-00000005"}
    listing = json.loads(run_cli("ckpt", "ls", str(run), "--json").stdout)["checkpoints"]
    head = _git(repo, "rev-parse", "HEAD")
    assert (
        [(c["step"], c["parent"], c["origin"]) for c in listing]
        == [  # newest first, each naming its parent
            (s, p, f"job {spec_sha[:8]} code {head[:8]}") for s, p in ((10, "step-00000005"), (5, None))
        ]
    ), listing
    text = run_cli("ckpt", "inspect", str(run))
    assert text.returncode == 0, text.stderr
    assert f"git {_git(repo, 'rev-parse', 'HEAD')[:12]}" in text.stdout and spec_sha in text.stdout, text.stdout
