"""Command-line overrides (-p KEY=VALUE): parsed within bounds, typed and validated like the file, named as
`command line -p KEY` in errors, and recorded in the run directory's job.yaml that launch and resume read."""

from __future__ import annotations

import json

import pytest
import yaml
from click.testing import CliRunner
from conftest import REPO, run_cli
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from trainjobs import job_spec

from hpcscale.cli.main import cli
from hpcscale.config.decode import Decoder
from hpcscale.config.errors import COMMAND_LINE, ConfigError
from hpcscale.config.job import JobSpec
from hpcscale.config.load import load_job
from hpcscale.config.overrides import MAX_CHARS, MAX_OVERRIDES, apply_overrides, parse_override, parse_overrides
from hpcscale.config.yamlsrc import parse_yaml
from hpcscale.errors import BadInput
from hpcscale.rundir import RunDir, Submission
from hpcscale.slurm.submit import submit_job

DGX = REPO / "docs" / "examples" / "gpt-dgx.yaml"  # example-dgx-h100: topology from the file, no controller needed


def invoke(*args: str):
    return CliRunner().invoke(cli, [str(a) for a in args])


# --- the parser ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("3e-4", 3e-4),  # a string in YAML 1.1: a float here
        ("1e5", 1e5),
        ("1.0e5", 1e5),
        ("-.5", -0.5),
        ("0.001", 0.001),
        ("4", 4),
        ("true", True),
        ("null", None),
        ("", None),
        ("fast", "fast"),
        ("'3e-4'", "3e-4"),  # quoted: kept as text
        ("!!str 1e5", "1e5"),
        ("a=b", "a=b"),  # only the first = splits
        ("[1e-4, 3e-4]", [1e-4, 3e-4]),
        ("{lr: 1e-3, steps: 2}", {"lr": 1e-3, "steps": 2}),
    ],
)
def test_value_is_yaml_with_1_2_floats(value, expected):
    assert parse_override(f"train.params.x={value}").value == expected


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("nodes", "is not KEY=VALUE"),
        ("=4", "none of them empty"),
        ("train..lr=1", "none of them empty"),
        ("nodes.=1", "none of them empty"),
        ("no des=1", "has a space"),
        ("x=a: b", "block mapping: quote it"),
        ("x=- a", "block list"),
        ("x=[&a 1, *a]", "anchors and aliases"),
        ("x=[1, 2", "invalid YAML"),
        ("x=[0, {a: 1, a: 2}]", "command line -p x[1].a: duplicate key"),
        ("x=!!python/name:os.system x", "bad value"),
        ("x=1\nnodes: 9", "line break"),
        ("x=" + "1" * MAX_CHARS, "over the limit"),
        (".".join(["a"] * 17) + "=1", "more than 16"),
    ],
)
def test_malformed_override_is_bad_input(text, fragment):
    with pytest.raises(ConfigError, match="command line -p") as e:
        parse_override(text)
    assert fragment in str(e.value)
    assert e.value.exit_code == 2


def test_too_many_overrides_is_bad_input():
    with pytest.raises(ConfigError, match=f"more than {MAX_OVERRIDES}"):
        parse_overrides([f"train.params.k{i}=1" for i in range(MAX_OVERRIDES + 1)])


def test_every_malformed_override_is_reported_at_once():
    with pytest.raises(ConfigError) as e:
        parse_overrides(["nodes", "=1", "nodes=2"])
    assert len(e.value.issues) == 2


@settings(max_examples=500, deadline=None)
@given(st.text(max_size=80) | st.text(alphabet="ab.=[]{}:,-'\"&*!# 01e+\t\n\\", max_size=40))
def test_any_text_parses_or_is_bad_input(text):
    try:
        o = parse_override(text)
    except BadInput:
        return
    assert o.text == text and all(o.path) and "=" in text


# JSON escapes a character beyond U+FFFF as a surrogate pair, which YAML's "\u" escapes do not join
TEXT = st.characters(exclude_categories=["Cs"], max_codepoint=0xFFFF)
JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(alphabet=TEXT, max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(alphabet=TEXT, max_size=8), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(JSON_VALUES)
def test_json_values_round_trip(value):
    """JSON is YAML flow syntax; with YAML 1.2 floats every JSON value reads back as itself."""
    text = json.dumps(value)
    assert parse_override(f"train.params.x={text}").value == value


@settings(max_examples=300, deadline=None)
@given(st.floats(allow_nan=False, allow_infinity=False) | st.integers(min_value=-(2**63), max_value=2**63 - 1))
def test_numbers_as_python_prints_them_read_back_as_numbers(number):
    value = parse_override(f"train.params.x={number!r}").value
    assert type(value) is type(number) and value == number


# --- applying: typed and validated like the file, errors named "command line -p KEY" ----------------------

BASE = (
    "name: t\nsite: local\ntrain:\n  entry: builtin\n  params: {steps: 5, lr: 0.001}\ncheckpoint:\n  every_steps: 2\n"
)
KEYS = [
    "nodes",
    "name",
    "time_limit",
    "train",
    "train.params",
    "train.params.lr",
    "train.params.steps",
    "train.params.seed",
    "train.entry",
    "checkpoint",
    "checkpoint.every_steps",
    "environment.FOO",
    "sweep.params.lr",
    "command",
    "parallel.tp",
]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.tuples(st.sampled_from(KEYS) | st.text(alphabet="abc.", min_size=1, max_size=8), JSON_VALUES), max_size=4
    )
)
def test_any_override_of_a_job_decodes_or_is_config_error(pairs):
    src = parse_yaml(BASE, "job.yaml")
    try:
        overridden = apply_overrides(src, parse_overrides([f"{k}={json.dumps(v)}" for k, v in pairs]))
        dec = Decoder(overridden)
        spec = dec.decode(JobSpec, overridden.data)
        dec.raise_if_any()
    except ConfigError as e:
        for issue in e.issues:  # a problem in an overridden key never names a file line
            if issue.file == "job.yaml" and issue.key in {k for k, _ in pairs}:
                pytest.fail(f"overridden key named by its file line: {issue}")
        return
    assert spec is not None
    assert src.data == yaml.safe_load(BASE)  # the file's own tree is untouched


def test_override_sets_creates_and_marks_where_keys_came_from():
    src = parse_yaml(BASE, "job.yaml")
    out = apply_overrides(
        src, parse_overrides(["train.params.lr=3e-4", "train.params.seed=3", "data.manifest=/d/m.json"])
    )
    assert out.data["train"]["params"] == {"steps": 5, "lr": 3e-4, "seed": 3}
    assert out.data["data"] == {"manifest": "/d/m.json"}
    assert out.locate(("train", "params", "lr")) == (COMMAND_LINE, None)
    assert out.locate(("train", "params", "seed")) == (COMMAND_LINE, None)
    assert out.locate(("data",)) == (COMMAND_LINE, None)  # created by the override
    assert out.locate(("train", "params", "steps")) == ("job.yaml", 5)  # still the file's
    assert out.locate(("checkpoint", "every_steps")) == ("job.yaml", 7)


def test_replacing_a_section_forgets_the_lines_under_it():
    out = apply_overrides(parse_yaml(BASE, "job.yaml"), parse_overrides(["train.params={lr: x}"]))
    assert out.locate(("train", "params", "lr")) == (COMMAND_LINE, None)
    assert out.locate(("train", "params", "steps")) == (COMMAND_LINE, None)


def test_later_override_wins_and_edits_what_an_earlier_one_set():
    out = apply_overrides(
        parse_yaml(BASE, "job.yaml"), parse_overrides(["nodes=2", "nodes=3", "train.params={a: 1}", "train.params.b=2"])
    )
    assert out.data["nodes"] == 3 and out.data["train"]["params"] == {"a": 1, "b": 2}


@pytest.mark.parametrize(
    ("override", "fragment"),
    [
        ("nodes.x=1", "command line -p nodes.x: nodes is an integer 1, not a mapping of keys"),
        ("train.entry.x=1", "train.entry is a string 'builtin'"),
        ("command.0=python3", "command line -p command.0: command is a list: -p cannot set one item of it"),
    ],
)
def test_path_through_a_scalar_or_into_a_list_is_refused(override, fragment):
    src = parse_yaml("name: t\nsite: local\nnodes: 1\ntrain: {entry: builtin}\ncommand: [a]\n", "job.yaml")
    with pytest.raises(ConfigError) as e:
        apply_overrides(src, parse_overrides([override]))
    assert fragment in str(e.value)


# --- through the commands -----------------------------------------------------------------------------------


def test_render_uses_the_overridden_nodes():
    plain = invoke("render", DGX, "--run-dir", "/runs/x")
    assert plain.exit_code == 0, plain.output
    assert "#SBATCH --nodes=16\n" in plain.output
    r = invoke("render", DGX, "--run-dir", "/runs/x", "-p", "nodes=4", "--param", "time_limit=02:00:00")
    assert r.exit_code == 0, r.output
    assert "#SBATCH --nodes=4\n" in r.output and "#SBATCH --nodes=16" not in r.output
    assert "#SBATCH --time=02:00:00\n" in r.output


def test_render_on_the_local_cluster(local_cluster):
    job = REPO / "docs" / "examples" / "hello-localcluster.yaml"
    result = run_cli("render", str(job), "--run-dir", "/runs/h", "-p", "nodes=1", env=local_cluster)
    assert result.returncode == 0, result.stderr
    assert "#SBATCH --nodes=1\n" in result.stdout


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("train.params.lr=fast", "command line -p train.params.lr: expected a number, got a string 'fast'"),
        ("nodes=two", "command line -p nodes: expected an integer, got a string 'two'"),
        ("nodes=0", "command line -p nodes: must be at least 1, got 0"),
        ("train.params.lrr=1e-3", "command line -p train.params.lrr: unknown key (did you mean 'lr'?)"),
        ("checkpoint.evry_steps=3", "command line -p checkpoint.evry_steps: unknown key (did you mean 'every_steps'?)"),
        ("nodse=4", "command line -p nodse: unknown key (did you mean 'nodes'?)"),
        ("site=nosuch", "command line -p site: no such site 'nosuch'"),
        ("nodes", "command line -p: 'nodes' is not KEY=VALUE"),
        ("nodes.x=1", "command line -p nodes.x: nodes is an integer 16"),
        ("environment.FOO=a: b", "command line -p environment.FOO: 'a: b' is a block mapping"),
    ],
)
@pytest.mark.parametrize("command", ["render", "submit", "validate"])
def test_bad_override_exits_2_naming_the_key_and_the_command_line(command, override, expected, tmp_path):
    args = ["config", "validate", DGX] if command == "validate" else [command, DGX, "--run-dir", tmp_path / "run"]
    r = invoke(*args, "-p", override)
    assert r.exit_code == 2, r.output
    line = next(line for line in r.output.splitlines() if expected in line)
    assert str(DGX) not in line  # no file line for a key the command line set
    assert not (tmp_path / "run").exists()  # nothing written


def test_file_problems_keep_their_lines_next_to_override_problems(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(DGX.read_text().replace("  tp: 8\n", "  tp: 8\n  tq: 1\n"))
    r = invoke("config", "validate", job, "-p", "nodes=zero", "--json")
    assert r.exit_code == 2
    issues = {i["key"]: i for i in json.loads(r.output)["files"][0]["issues"]}
    assert issues["nodes"]["file"] == COMMAND_LINE and issues["nodes"]["line"] is None
    assert issues["parallel.tq"]["file"] == str(job) and issues["parallel.tq"]["line"] == 13


def test_validate_applies_overrides_to_job_specs_only():
    site = REPO / "site_configs" / "localcluster.yaml"
    r = invoke("config", "validate", site, DGX, "-p", "nodes=8")
    assert r.exit_code == 0, r.output


def test_overrides_apply_to_the_base_spec_of_a_sweep(tmp_path):
    job = tmp_path / "sweep.yaml"
    job.write_text(DGX.read_text() + "sweep:\n  params: {lr: [0.001, 0.0003], seed: [1, 2]}\n")
    loaded = load_job(job, overrides=["train.params.steps=5", "sweep.params.seed=[1, 2, 3]", "nodes=2"])
    assert loaded.spec.train.params["steps"] == 5 and loaded.spec.nodes == 2
    assert loaded.spec.sweep.params == {"lr": [0.001, 0.0003], "seed": [1, 2, 3]}
    r = invoke("render", job, "--run-dir", "/runs/s", "-p", "sweep.params.seed=[1, 2, 3]")
    assert r.exit_code == 0, r.output
    assert "#SBATCH --array=0-5\n" in r.output


def test_submit_records_the_overridden_spec_and_resume_keeps_it(tmp_path):
    run = tmp_path / "run"
    r = invoke("submit", DGX, "--run-dir", run, "--dry-run", "-p", "train.params.lr=3e-4", "-p", "nodes=4")
    assert r.exit_code == 0, r.output
    text = (run / "job.yaml").read_text()
    assert '# -p "train.params.lr=3e-4"\n# -p "nodes=4"\n' in text
    recorded = yaml.safe_load(text)
    assert recorded["nodes"] == 4 and recorded["train"]["params"]["lr"] == 3e-4
    rd = RunDir.open(run)
    loaded = rd.load_job()  # what launch runs inside the job, and what resume resubmits
    assert loaded.spec.nodes == 4 and loaded.spec.train.params["lr"] == 3e-4
    assert rd.recorded_overrides() == ["train.params.lr=3e-4", "nodes=4"]
    # `hpcscale resume` resubmits rd.load_job() into the run (a dry run records no submission: add one)
    rd.record(Submission(index=1, job_id="1", cluster=None, time="t", script="submissions/0001.sbatch", template="x"))
    submit_job(loaded, run_dir=run, reuse=True, dry_run=True)
    assert (run / "job.yaml").read_text() == text


def test_submit_without_overrides_writes_no_header(tmp_path):
    r = invoke("submit", DGX, "--run-dir", tmp_path / "run", "--dry-run")
    assert r.exit_code == 0, r.output
    assert not (tmp_path / "run" / "job.yaml").read_text().startswith("#")


def test_run_local_uses_and_records_the_override(mpi, tmp_path):
    job = job_spec(tmp_path / "job.yaml", tp=1, pp=1, ranks=1)  # steps: 20 in the file
    run = tmp_path / "run"
    result = run_cli(
        "run", str(job), "--local", "-n", "1", "--run-dir", str(run), "-p", "train.params.steps=2", timeout=300
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert yaml.safe_load((run / "job.yaml").read_text())["train"]["params"]["steps"] == 2
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len([r for r in rows if "loss" in r]) == 2
    assert RunDir(run).recorded_overrides() == ["train.params.steps=2"]
