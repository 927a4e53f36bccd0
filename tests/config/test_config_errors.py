"""Bad input: every case exits 2 and names file, line and key; no traceback reaches the user.

Each case marks the line the error must point at with `# <-`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import REPO, run_cli

from hpcscale.cli.main import cli

JOB = "name: j\nsite: localcluster\n"
SITE = "name: s\nscheduler: slurm\nfilesystems:\n  scratch: /s\n  run_root: /r\n"

CASES = [
    # (id, kind, text, key, message fragment)
    ("unknown-key-did-you-mean", "job", JOB + "nodse: 2  # <-\n", "nodse", "did you mean 'nodes'"),
    ("string-for-int", "job", JOB + "nodes: two  # <-\n", "nodes", "expected an integer"),
    ("bool-for-int", "job", JOB + "nodes: true  # <-\n", "nodes", "expected an integer, got a boolean"),
    ("below-minimum", "job", JOB + "tasks_per_node: 0  # <-\n", "tasks_per_node", "at least 1"),
    (
        "tp-pp-do-not-divide-world",
        "job",
        JOB + "nodes: 3\ntasks_per_node: 2\nparallel:  # <-\n  tp: 2\n  pp: 2\n",
        "parallel",
        "tp(2) * pp(2) = 4 does not divide the world size nodes(3) * tasks_per_node(2) = 6",
    ),
    (
        "tp-does-not-divide-tasks-per-node",
        "job",
        JOB + "nodes: 2\ntasks_per_node: 2\nparallel:\n  tp: 4  # <-\n",
        "parallel.tp",
        "tp(4) does not divide",
    ),
    (
        "dp-shard-does-not-divide-dp",
        "job",
        JOB + "nodes: 3\ntasks_per_node: 2\nparallel:\n  tp: 2\n  dp_shard: 2  # <-\n",
        "parallel.dp_shard",
        "dp_shard(2) does not divide the data-parallel degree dp = nodes(3) * tasks_per_node(2) / (tp(2) * pp(1)) = 3",
    ),
    (
        "mixed-precision-choice",
        "job",
        JOB + "parallel:\n  mixed_precision: bf61  # <-\n",
        "parallel.mixed_precision",
        "did you mean 'bf16'",
    ),
    ("unknown-partition", "job", JOB + "partition: debgu  # <-\n", "partition", "did you mean 'debug'"),
    ("more-nodes-than-partition", "job", JOB + "nodes: 5  # <-\n", "nodes", "has 4"),
    (
        "grace-not-below-time-limit",
        "job",
        JOB + "time_limit: '00:02:00'\nsignals:\n  grace_seconds: 120  # <-\n",
        "signals.grace_seconds",
        "not shorter than the time limit",
    ),
    ("gpus-over-partition", "job", JOB + "gpus_per_node: 1  # <-\n", "gpus_per_node", "has 0"),
    ("cores-over-node", "job", JOB + "tasks_per_node: 4\ncpus_per_task: 2  # <-\n", "cpus_per_task", "8 cores"),
    ("bad-time-limit", "job", JOB + "time_limit: '25:61:00'  # <-\n", "time_limit", "field over 59"),
    (
        "time-over-partition-limit",
        "job",
        "name: j\nsite: example-dgx-h100\npartition: interactive\ntime_limit: '05:00:00'  # <-\n",
        "time_limit",
        "over partition 'interactive'",
    ),
    ("unknown-site", "job", "name: j\nsite: nowhere  # <-\n", "site", "no such site"),
    (
        "every-steps-word",
        "job",
        JOB + "checkpoint:\n  every_steps: atuo  # <-\n",
        "checkpoint.every_steps",
        "expected an integer or 'auto', got 'atuo' (did you mean 'auto'?)",
    ),
    (
        "every-steps-negative",
        "job",
        JOB + "checkpoint:\n  every_steps: -5  # <-\n",
        "checkpoint.every_steps",
        "at least 0",
    ),
    (
        "every-steps-bool",
        "job",
        JOB + "checkpoint:\n  every_steps: true  # <-\n",
        "checkpoint.every_steps",
        "expected an integer",
    ),
    (
        "site-mtbf-zero",
        "site",
        SITE + "reliability:\n  node_mtbf_hours: 0  # <-\n",
        "reliability.node_mtbf_hours",
        "at least 0.001",
    ),
    ("yaml-syntax", "job", JOB + "nodes: [1, 2\nqos: x  # <-\n", "", "invalid YAML"),
    ("duplicate-key", "job", JOB + "nodes: 1\nnodes: 2  # <-\n", "nodes", "duplicate key"),
    ("newline-in-job-name", "job", 'name: "a\\nb"  # <-\nsite: localcluster\n', "name", "control characters"),
    ("bad-entry", "job", JOB + "train:\n  entry: 'os.system(1)'  # <-\n", "train.entry", "neither 'builtin'"),
    ("train-and-command", "job", JOB + "train: {}\ncommand: [x]  # <-\n", "command", "not both"),
    ("bad-env-name", "job", JOB + "environment:  # <-\n  'A-B': x\n", "environment", "not environment variable"),
    (
        "signal-choice",
        "job",
        JOB + "signals:\n  signal: USR3  # <-\n",
        "signals.signal",
        "must be one of 'USR1', 'USR2', 'TERM'",
    ),
    ("not-a-mapping", "job", "- a  # <-\n- b\n", "", "expected a mapping"),
    (
        "spares-beyond-the-partition",
        "job",
        JOB + "nodes: 3\nrestart:\n  spare_nodes: 2  # <-\n",
        "restart.spare_nodes",
        "3 nodes and 2 spares requested but partition 'debug' has 4",
    ),
    (
        "spares-for-a-command-job",
        "job",
        JOB + "command: [hostname]\nrestart:\n  spare_nodes: 1  # <-\n",
        "restart.spare_nodes",
        "a `command:` job cannot have restart.spare_nodes",
    ),
    (
        "shrink-for-a-sweep",
        "job",
        JOB + "sweep:\n  params:\n    lr: [1, 2]\nrestart:\n  shrink: true  # <-\n",
        "restart.shrink",
        "a sweep cannot have restart.shrink",
    ),
    (
        "spares-without-slurm",
        "job",
        "name: j\nsite: local\nrestart:\n  spare_nodes: 1  # <-\n",
        "restart.spare_nodes",
        "has no Slurm allocation to relaunch a step in (restart.spare_nodes)",
    ),
    ("missing-required", "job", "site: localcluster  # <-\n", "", "missing required key 'name'"),
    (
        "site-bad-hostlist",
        "site",
        SITE + "partitions:\n  - name: p\n    nodes: n[1-  # <-\n    cpus_per_node: 4\n",
        "partitions[0].nodes",
        "unbalanced brackets",
    ),
    (
        "site-duplicate-partition",
        "site",
        SITE + "partitions:\n  - {name: p, nodes: 'n1', cpus_per_node: 1}\n"
        "  - {name: p, nodes: 'n2', cpus_per_node: 1}  # <-\n",
        "partitions[1].name",
        "defined twice",
    ),
    (
        "site-unknown-switch",
        "site",
        SITE + "partitions:\n  - {name: p, nodes: 'n[1-2]', cpus_per_node: 1}\ntopology:\n  source: file\n  switches:\n"
        "    - {name: leaf, nodes: 'n[1-2]'}\n    - {name: top, switches: 'leaf,laef'}  # <-\n",
        "topology.switches[1].switches",
        "unknown switches: laef",
    ),
    (
        "site-scheduler-choice",
        "site",
        SITE.replace("scheduler: slurm", "scheduler: slrum  # <-"),
        "scheduler",
        "did you mean 'slurm'",
    ),
    (
        "site-local-with-srun",
        "site",
        SITE.replace("scheduler: slurm", "scheduler: local") + "launcher:\n  kind: srun  # <-\n",
        "launcher.kind",
        "mpirun",
    ),
    (
        "site-relative-path",
        "site",
        SITE.replace("scratch: /s", "scratch: rel  # <-"),
        "filesystems.scratch",
        "absolute path",
    ),
]


def _expected_line(text: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), 1) if "# <-" in line)


@pytest.mark.parametrize(("kind", "text", "key", "fragment"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_case_exits_2_naming_file_line_and_key(tmp_path: Path, monkeypatch, kind, text, key, fragment):
    monkeypatch.chdir(REPO)
    path = tmp_path / f"bad-{kind}.yaml"
    path.write_text(text)
    result = CliRunner().invoke(cli, ["config", "validate", "--kind", kind, str(path)])
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit)  # exited on purpose, not a crash
    where = f"{path}:{_expected_line(text)}: "
    expected = where + (f"{key}: " if key else "")
    lines = [line for line in result.output.splitlines() if line.startswith("error ")]
    assert any(line.startswith(f"error {expected}") and fragment in line for line in lines), result.output


def test_there_are_at_least_15_named_cases():
    assert len(CASES) >= 15


def test_every_problem_in_a_file_is_reported_at_once(tmp_path: Path):
    path = tmp_path / "job.yaml"
    path.write_text(JOB + "nodes: x\nqso: normal\ntime_limit: soon\n")
    result = CliRunner().invoke(cli, ["config", "validate", str(path)])
    assert result.exit_code == 2
    assert "nodes: expected an integer" in result.output
    assert "qso: unknown key (did you mean 'qos'?)" in result.output
    assert "time_limit: 'soon' is not a Slurm time" in result.output


def test_shipped_configs_and_examples_validate():
    files = sorted(str(p) for p in (REPO / "site_configs").glob("*.yaml"))
    files += sorted(str(p) for p in (REPO / "docs" / "examples").glob("*.yaml"))
    result = run_cli("config", "validate", *files)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("ok ") == len(files)
    assert "warn" not in (result.stdout + result.stderr).lower(), result.stdout + result.stderr
    for example in (REPO / "docs" / "examples").glob("*.yaml"):  # each Slurm one renders with no warning either
        if example.name == "gpt-local.yaml":  # `run --local`'s: render refuses a site without Slurm (tested apart)
            continue
        rendered = run_cli("render", str(example))
        assert rendered.returncode == 0 and "#SBATCH" in rendered.stdout, rendered.stderr
        assert "warn" not in rendered.stderr.lower(), (example, rendered.stderr)


def test_json_report_for_a_bad_file(tmp_path: Path):
    path = tmp_path / "job.yaml"
    path.write_text(JOB + "nodes: 9\n")
    result = run_cli("config", "validate", "--json", str(path))
    assert result.returncode == 2
    import json

    doc = json.loads(result.stdout)
    assert doc["ok"] is False
    (issue,) = doc["files"][0]["issues"]
    assert (issue["line"], issue["key"]) == (3, "nodes")


def test_missing_file_is_bad_input_not_a_crash(tmp_path: Path):
    result = run_cli("config", "validate", str(tmp_path / "nope.yaml"))
    assert result.returncode == 2
    assert "no such file" in result.stderr
    assert "Traceback" not in result.stderr


def test_config_show_resolves_defaults():
    result = run_cli("config", "show", "localcluster", "--json")
    assert result.returncode == 0, result.stderr
    import json

    doc = json.loads(result.stdout)
    assert doc["launcher"] == {"kind": "srun", "mpi": "pmix", "wait_seconds": 60, "cpu_bind": None, "extra_args": []}
    assert doc["staging"]["jobs"] == 8  # a default filled in


def test_config_show_unknown_site_suggests():
    result = run_cli("config", "show", "localclustr")
    assert result.returncode == 2
    assert "did you mean 'localcluster'" in result.stderr


def test_likely_mistakes_are_warned_with_file_line_and_key_and_exit_0(tmp_path: Path):
    """A stop signal NCCL may take and a hang timeout the collective timeout beats: valid, so exit 0, but said."""
    path = tmp_path / "job.yaml"
    text = JOB + "train:\n  entry: builtin\nsignals:\n  signal: USR1  # <-\nhang_timeout_seconds: 400\n"
    path.write_text(text)
    result = run_cli("config", "validate", str(path))
    assert result.returncode == 0, result.stderr
    warns = [line for line in result.stderr.splitlines() if line.startswith("warn")]
    assert any(f"{path}:{_expected_line(text)}: signals.signal: NCCL" in w for w in warns), result.stderr
    assert any(f"{path}:7: hang_timeout_seconds: 400 s is not below timeout_seconds" in w for w in warns), warns
    doc = run_cli("config", "validate", "--json", str(path))
    import json

    keys = [w["key"] for w in json.loads(doc.stdout)["files"][0]["warnings"]]
    assert doc.returncode == 0 and keys == ["signals.signal", "hang_timeout_seconds"]
    render = run_cli("render", str(path))
    assert render.returncode == 0 and "warning: " in render.stderr and "signals.signal" in render.stderr


def test_grace_time_is_held_against_what_an_earlier_run_measured(tmp_path: Path):
    """`config validate --run-dir`: the slowest stop recorded in attempts.jsonl (signal to committed checkpoint),
    or before any stop the longest step plus the longest save in metrics.jsonl, must fit grace_seconds twice."""
    import json

    path = tmp_path / "job.yaml"
    text = JOB + "signals:\n  grace_seconds: 80  # <-\n"
    path.write_text(text)
    run = tmp_path / "run"
    run.mkdir()
    (run / "job.yaml").write_text(text)
    (run / "metrics.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in [{"step": 0, "step_time_s": 5.0}, {"checkpoint_blocking_s": 40.0}])
        + "not json\n"
    )
    warned = run_cli("config", "validate", str(path), "--run-dir", str(run))
    assert warned.returncode == 0, warned.stderr
    line = f"{path}:{_expected_line(text)}: signals.grace_seconds: signals.grace_seconds is 80 s"
    assert line in warned.stderr and "at least 91 s" in warned.stderr, warned.stderr
    (run / "attempts.jsonl").write_text(json.dumps({"event": "stop", "attempt": 1, "stop_s": 20.5}) + "\n")
    quiet = run_cli("config", "validate", str(path), "--run-dir", str(run))  # a stop measured: 41 s <= 80 s
    assert quiet.returncode == 0 and "warn" not in quiet.stderr, quiet.stderr
    (run / "attempts.jsonl").write_text(json.dumps({"event": "stop", "attempt": 1, "stop_s": 70}) + "\n")
    again = run_cli("config", "validate", str(path), "--run-dir", str(run))
    assert "slowest stop of this run took 70.0 s" in again.stderr and "at least 141 s" in again.stderr
    not_a_run = run_cli("config", "validate", str(path), "--run-dir", str(tmp_path / "nothing"))
    assert not_a_run.returncode == 2 and "not an hpcscale run directory" in not_a_run.stderr


def test_train_entry_is_found_without_importing_it(tmp_path: Path, monkeypatch):
    """`train.entry` is looked up on the job's PYTHONPATH, package by package, its source scanned: a misspelt
    function is an error (exit 2, file, line, key, a did-you-mean); a module not on this machine, a warning;
    nothing is imported (the package's __init__ would create a marker file)."""
    pkg = tmp_path / "src" / "mymodel"
    pkg.mkdir(parents=True)
    marker = tmp_path / "imported"
    (pkg / "__init__.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    (pkg / "train.py").write_text("import torch\n\n\ndef main(ctx):\n    pass\n\n\nif True:\n    other = main\n")
    env = f"environment:\n  PYTHONPATH: {tmp_path / 'src'}\n"

    def validate(entry: str):
        path = tmp_path / "job.yaml"
        path.write_text(JOB + env + f"train:\n  entry: '{entry}'  # <-\n")
        return path, run_cli("config", "validate", str(path))

    path, good = validate("mymodel.train:main")
    assert good.returncode == 0 and "warn" not in good.stderr, good.stderr
    assert validate("mymodel.train:other")[1].returncode == 0
    path, typo = validate("mymodel.train:mian")
    assert typo.returncode == 2, typo.stderr
    where = f"{path}:{_expected_line(path.read_text())}: train.entry: module 'mymodel.train'"
    assert where in typo.stderr and "defines no top-level 'mian' (did you mean 'main'?)" in typo.stderr
    path, missing = validate("elsewhere.train:main")
    assert missing.returncode == 0 and "warn" in missing.stderr and "'elsewhere.train' is not found" in missing.stderr
    assert not marker.exists()
