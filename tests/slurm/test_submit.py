"""`hpcscale submit` and `status` against the real local cluster."""

from __future__ import annotations

import json
import time
from pathlib import Path

import yaml
from conftest import REPO, run_cli, wait_for_job


def _job(tmp_path: Path, **overrides) -> Path:
    spec = {
        "name": "hello",
        "site": "localcluster",
        "nodes": 2,
        "tasks_per_node": 2,
        "time_limit": "00:05:00",
        "command": ["hostname"],
    }
    spec.update(overrides)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def _submit(job: Path, *args: str) -> dict:
    result = run_cli("submit", str(job), "--json", *args)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def _settled_status(run_dir: Path, settled, timeout: float = 15) -> dict:
    """`status --json` once the first job's accounting record satisfies `settled`. For sub-second jobs
    slurmdbd first creates the row from a step message (JobName 'allocation', one node) and completes it a
    moment later; real clusters show the same lag."""
    deadline = time.monotonic() + timeout
    while True:
        status = json.loads(run_cli("status", str(run_dir), "--json").stdout)
        jobs = status["submissions"][0]["jobs"]
        if (jobs and settled(jobs[0])) or time.monotonic() > deadline:
            return status
        time.sleep(0.5)


def test_submit_lands_under_one_leaf_completes_and_status_shows_it(local_cluster, tmp_path):
    run_dir = tmp_path / "run"
    sub = _submit(_job(tmp_path), "--run-dir", str(run_dir))
    assert sub["switches"] == 1 and sub["run_dir"] == str(run_dir)
    assert wait_for_job(sub["job_id"], local_cluster) == "COMPLETED"
    status = _settled_status(run_dir, lambda job: job["nodes"].startswith("n["))
    (entry,) = status["submissions"]
    (job,) = entry["jobs"]
    assert (job["job_id"], job["state"], job["exit_code"]) == (sub["job_id"], "COMPLETED", "0:0")
    assert job["nodes"] in ("n[1-2]", "n[3-4]")  # --switches=1: both nodes under one leaf switch
    assert status["source"] == "sacct"
    log = (run_dir / "logs" / f"slurm-{sub['job_id']}.out").read_text().split()
    assert len(log) == 4  # four ranks ran hostname
    record = json.loads((run_dir / "submissions.jsonl").read_text())
    assert record["job_id"] == sub["job_id"] and record["script"] == "submissions/0001.sbatch"
    assert (run_dir / "submissions" / "0001.sbatch").read_text().startswith("#!/bin/bash")
    assert yaml.safe_load((run_dir / "job.yaml").read_text())["name"] == "hello"
    human = run_cli("status", str(run_dir))
    assert human.returncode == 0 and "COMPLETED" in human.stdout


def test_hostile_fields_run_nothing_injected(local_cluster, tmp_path):
    marker = tmp_path / "pwned"
    hostile = [f"$(touch {marker}-1)", f"`touch {marker}-2`", f"x; touch {marker}-3", 'it\'s "q"', "two\nlines"]
    job = _job(
        tmp_path,
        name=f"evil'; touch {marker}-4; echo '",
        environment={"HOSTILE": hostile[0]},
        command=["printf", "[%s]\\n", *hostile],
        nodes=1,
        tasks_per_node=1,
    )
    run_dir = tmp_path / "run; $(touch pwned-5)"
    sub = _submit(job, "--run-dir", str(run_dir))
    assert wait_for_job(sub["job_id"], local_cluster) == "COMPLETED"
    out = (run_dir / "logs" / f"slurm-{sub['job_id']}.out").read_text()
    assert out == "".join(f"[{h}]\n" for h in hostile)  # every argument arrived as one literal word
    assert not list(tmp_path.glob("pwned*")) and not Path("pwned-5").exists()
    name = f"evil'; touch {marker}-4; echo '"
    status = _settled_status(run_dir, lambda job: job["name"] != "allocation")
    assert status["submissions"][0]["jobs"][0]["name"] == name


def test_environment_values_arrive_literally(local_cluster, tmp_path):
    value = "$(id) `id` ${HOME} 'x' \"y\""
    job = _job(tmp_path, environment={"HOSTILE": value}, command=["printenv", "HOSTILE"], nodes=1, tasks_per_node=1)
    sub = _submit(job, "--run-dir", str(tmp_path / "run"))
    assert wait_for_job(sub["job_id"], local_cluster) == "COMPLETED"
    assert (tmp_path / "run" / "logs" / f"slurm-{sub['job_id']}.out").read_text() == value + "\n"


def test_existing_run_dir_is_refused_unless_reused(local_cluster, tmp_path):
    job = _job(tmp_path, nodes=1, tasks_per_node=1)
    run_dir = tmp_path / "run"
    first = _submit(job, "--run-dir", str(run_dir))
    again = run_cli("submit", str(job), "--run-dir", str(run_dir))
    assert again.returncode == 2 and "--reuse" in again.stderr
    second = _submit(job, "--run-dir", str(run_dir), "--reuse")
    records = [json.loads(line) for line in (run_dir / "submissions.jsonl").read_text().splitlines()]
    assert [r["job_id"] for r in records] == [first["job_id"], second["job_id"]]
    assert [r["index"] for r in records] == [1, 2]
    assert (run_dir / "submissions" / "0002.sbatch").exists()
    for sub in (first, second):
        wait_for_job(sub["job_id"], local_cluster)


def test_dry_run_writes_the_script_and_submits_nothing(local_cluster, tmp_path):
    sub = _submit(_job(tmp_path), "--run-dir", str(tmp_path / "run"), "--dry-run")
    assert sub["job_id"] is None and sub["dry_run"] is True
    assert Path(sub["script"]).read_text().startswith("#!/bin/bash")
    assert not (tmp_path / "run" / "submissions.jsonl").exists()


def test_slurm_refusal_reaches_the_user_verbatim(local_cluster, tmp_path):
    # A site file that is out of date: it claims GPUs the cluster does not have, so sbatch refuses the job.
    site = (
        (REPO / "site_configs" / "localcluster.yaml")
        .read_text()
        .replace("cpus_per_node: 4", "cpus_per_node: 4\n    gpus_per_node: 1")
    )
    (tmp_path / "stale.yaml").write_text(site)
    job = _job(tmp_path, site=str(tmp_path / "stale.yaml"), gpus_per_node=1, nodes=1, tasks_per_node=1)
    result = run_cli("submit", str(job), "--run-dir", str(tmp_path / "run"))
    assert result.returncode == 1
    assert "sbatch: error: Invalid generic resource (gres) specification" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists()  # the run directory this call created is gone again


def test_status_falls_back_to_scontrol_when_sacct_cannot_answer(local_cluster, tmp_path):
    run_dir = tmp_path / "run"
    sub = _submit(_job(tmp_path, nodes=1, tasks_per_node=1), "--run-dir", str(run_dir))
    wait_for_job(sub["job_id"], local_cluster)
    # Point the recorded site at a cluster name accounting does not know: sacct fails, scontrol still knows.
    site = yaml.safe_load((run_dir / "site.yaml").read_text())
    site["slurm"]["cluster"] = "nosuchcluster"
    (run_dir / "site.yaml").write_text(yaml.safe_dump(site))
    status = json.loads(run_cli("status", str(run_dir), "--json").stdout)
    assert "scontrol" in status["source"]
    assert status["submissions"][0]["jobs"][0]["state"] == "COMPLETED"


def test_status_of_a_non_run_directory_is_bad_input(tmp_path):
    result = run_cli("status", str(tmp_path))
    assert result.returncode == 2 and "not an hpcscale run directory" in result.stderr


def test_a_name_with_separators_keeps_its_state_and_name_in_status(local_cluster, tmp_path):
    """A job name holding `|`, spaces and `Key=value`: status reads the job from sacct (it was skipped there,
    and became UNKNOWN once scontrol forgot the job) and, when sacct cannot answer, from scontrol, with its
    real state and its whole name both ways."""
    name = "a|b|c JobState=FAILED ExitCode=9:0 | x"
    run_dir = tmp_path / "run"
    sub = _submit(_job(tmp_path, name=name, nodes=1, tasks_per_node=1), "--run-dir", str(run_dir))
    assert wait_for_job(sub["job_id"], local_cluster) == "COMPLETED"
    status = _settled_status(run_dir, lambda job: job["name"] != "allocation")
    (job,) = status["submissions"][0]["jobs"]
    assert status["source"] == "sacct"
    assert (job["job_id"], job["name"], job["state"], job["exit_code"]) == (sub["job_id"], name, "COMPLETED", "0:0")
    site = yaml.safe_load((run_dir / "site.yaml").read_text())
    site["slurm"]["cluster"] = "nosuchcluster"  # sacct fails: scontrol, which still knows the job
    (run_dir / "site.yaml").write_text(yaml.safe_dump(site))
    status = json.loads(run_cli("status", str(run_dir), "--json").stdout)
    (job,) = status["submissions"][0]["jobs"]
    assert "scontrol" in status["source"]
    assert (job["name"], job["state"], job["exit_code"]) == (name, "COMPLETED", "0:0")
