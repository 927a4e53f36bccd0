"""Relative paths in a job spec mean the same wherever the job runs: a path from the job file is read from the job
file's directory, one from `-p` from the working directory, for `run --local` (ranks start where you stand) and
`submit` (ranks start in the run directory) alike; the run directory's job.yaml holds the absolute path."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from conftest import run_cli, wait_for_job
from trainjobs import job_spec

from hpcscale.config.errors import ConfigError
from hpcscale.config.load import load_job


def _dataset(where: Path) -> Path:
    corpus = where / "corpus"
    corpus.mkdir(parents=True)
    (corpus / "a.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 400)
    r = run_cli("data", "prepare", str(corpus), "--out", str(where / "data" / "tiny"), "--seq-len", "32")
    assert r.returncode == 0, r.stdout + r.stderr
    return where / "data" / "tiny" / "manifest.json"


def _job_with_relative_manifest(project: Path, **kw) -> Path:
    job = job_spec(project / "job.yaml", tp=1, pp=1, ranks=2, steps=4, **kw)
    spec = yaml.safe_load(job.read_text())
    spec["data"] = {"manifest": "data/tiny/manifest.json"}  # relative to the job file's directory
    job.write_text(yaml.safe_dump(spec))
    return job


def test_relative_paths_resolve_against_the_job_file_or_the_working_directory(tmp_path, monkeypatch):
    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    elsewhere.mkdir()
    manifest = _dataset(project)
    job = _job_with_relative_manifest(project)
    monkeypatch.chdir(elsewhere)
    assert load_job(job).spec.data.manifest == str(manifest)
    (elsewhere / "m.json").write_text("{}")
    assert load_job(job, overrides=["data.manifest=m.json"]).spec.data.manifest == str(elsewhere / "m.json")
    assert load_job(job, overrides=["data.manifest=~/x/m.json"]).spec.data.manifest == "~/x/m.json"  # the node's ~
    assert load_job(job, overrides=["data.manifest=$SCRATCH/m.json"]).spec.data.manifest == "$SCRATCH/m.json"


def test_a_manifest_that_is_not_there_is_refused_on_a_local_site_naming_the_file_line_and_key(tmp_path):
    job = _job_with_relative_manifest(tmp_path)
    with pytest.raises(ConfigError) as e:
        load_job(job)
    assert f"{tmp_path / 'data' / 'tiny' / 'manifest.json'}: no such file" in str(e.value)
    r = run_cli("config", "validate", str(job))
    assert r.returncode == 2 and f"{job}:" in r.stderr and "data.manifest" in r.stderr, r.stderr


def test_run_local_from_another_directory_reads_the_job_files_dataset(mpi, tmp_path):
    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    elsewhere.mkdir()
    manifest = _dataset(project)
    job = _job_with_relative_manifest(project)
    r = run_cli("run", str(job), "--local", "--run-dir", str(tmp_path / "run"), cwd=elsewhere, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert yaml.safe_load((tmp_path / "run" / "job.yaml").read_text())["data"]["manifest"] == str(manifest)


def test_submit_with_a_relative_manifest_trains_on_the_cluster(local_cluster, tmp_path):
    """The docs' job file shape under submit: the ranks start in the run directory, where the relative path
    named nothing and every rank failed; now it is the job file's dataset."""
    project = tmp_path / "project"
    manifest = _dataset(project)
    job = _job_with_relative_manifest(project, site="localcluster")
    r = run_cli("submit", str(job), "--run-dir", str(tmp_path / "run"), "--json", cwd=tmp_path, env=local_cluster)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    sub = json.loads(r.stdout)
    assert wait_for_job(sub["job_id"], local_cluster) == "COMPLETED"
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any("loss" in row for row in rows)
    assert yaml.safe_load((tmp_path / "run" / "job.yaml").read_text())["data"]["manifest"] == str(manifest)
