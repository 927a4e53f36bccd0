"""The Context API as a user meets it: docs/context-api.md's example, taken from the page as written, run
under `hpcscale run --local` and under Slurm, killed with SIGKILL, stopped by a signal, resumed on the same
layout (losses bit for bit an uninterrupted run's) and on another (resharded, equal to float rounding);
ctx.parallelize against torch's DDP, with accumulation and a tensor-parallel plan; the JSON state's rules."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import REPO, processes_of, run_cli, wait_for_job
from hypothesis import given, settings
from hypothesis import strategies as st

DOC = REPO / "docs" / "context-api.md"
STEPS = 200  # the example's own train.params.steps


def doc_example(dest: Path, **changes) -> Path:
    """mymodel.py and job.yaml exactly as the page shows them; the one placeholder, PYTHONPATH, pointed at
    `dest`. `changes` (yaml keys) are applied to the job spec. Returns the job file."""
    blocks = re.findall(r"```(\w+)\n(.*?)```", DOC.read_text(), re.S)
    code = [body for lang, body in blocks if lang == "python" and body.startswith("# mymodel.py")]
    job = [body for lang, body in blocks if lang == "yaml" and body.startswith("# job.yaml")]
    assert len(code) == 1 and len(job) == 1, "the page must hold one mymodel.py and one job.yaml block"
    assert "/path/to/mycode" in job[0]
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "mymodel.py").write_text(code[0])
    spec = yaml.safe_load(job[0].replace("/path/to/mycode", str(dest)))
    for key, value in changes.items():
        spec[key] = value
    (dest / "job.yaml").write_text(yaml.safe_dump(spec))
    return dest / "job.yaml"


def rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def losses_by_step(run: Path) -> dict[int, list[float]]:
    """step -> the loss of every attempt that ran it (a step run again after a resume appears twice)."""
    out: dict[int, list[float]] = {}
    for r in rows(run):
        if "loss" in r:
            out.setdefault(r["step"], []).append(r["loss"])
    return out


def assert_matches(run: Path, reference: dict[int, list[float]], *, rel: float = 0.0) -> None:
    got = losses_by_step(run)
    assert set(got) == set(reference), "steps missing or extra"
    for step, values in got.items():
        want = reference[step][0]
        assert all(abs(v - want) <= rel * abs(want) for v in values), (step, values, want)


def run_local(job: Path, run: Path, *extra: str, cwd: Path | None = None):
    return run_cli("run", str(job), "--local", "--run-dir", str(run), *extra, timeout=300, cwd=cwd)


@pytest.fixture(scope="module")
def reference(mpi, tmp_path_factory) -> dict[int, list[float]]:
    """The example uninterrupted, 2 ranks: the losses every interrupted run must match."""
    tmp = tmp_path_factory.mktemp("ctx-ref")
    job = doc_example(tmp)
    r = run_local(job, tmp / "run")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    ref = losses_by_step(tmp / "run")
    assert len(ref) == STEPS
    first, last = ref[0][0], sum(ref[s][0] for s in range(STEPS - 20, STEPS)) / 20
    assert last < 0.6 * first, "the example must learn something"
    saved = [r["checkpoint"] for r in rows(tmp / "run") if "checkpoint" in r]
    assert saved == [50, 100, 150, 200], saved  # the policy's period; the end is saved once
    said = [line for line in r.stdout.splitlines() if line.startswith("hpcscale: checkpoint ")]
    assert [int(line.split()[2]) for line in said] == saved, said  # each save said as it happens
    # hpcscale times every step of the loop, and with tokens_per_step set gives its throughput: in the
    # metrics, in status and in the report
    timed = {x["step"]: x for x in rows(tmp / "run") if "step_time_s" in x and "loss" not in x}
    assert sorted(timed) == list(range(STEPS)) and all(x["tokens_per_s"] > 0 for x in timed.values())
    assert "ms/step" in run_cli("status", str(tmp / "run")).stdout
    summary = json.loads(run_cli("report", str(tmp / "run"), "-o", str(tmp / "report"), "--json").stdout)["summary"]
    assert summary["median_tokens_per_s"] > 0, summary
    return ref


def _kill_all_at(run: Path, proc: subprocess.Popen, *, checkpoint: int) -> None:
    """SIGKILL the front end, mpirun and every rank together once `checkpoint` is committed."""
    deadline = time.monotonic() + 120
    while not (run / "checkpoints" / f"step-{checkpoint:08d}").is_dir():
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended before its checkpoint"
        time.sleep(0.02)
    pids = set(processes_of(run)) | {proc.pid}
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait(timeout=30)
    deadline = time.monotonic() + 30
    while processes_of(run) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not processes_of(run), "a process of the run survived SIGKILL"


def _start(job: Path, run: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "hpcscale", "run", str(job), "--local", "--run-dir", str(run)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_doc_example_resumes_exactly_after_kill_9_and_on_another_layout(reference, tmp_path):
    job = doc_example(tmp_path / "code")
    run = tmp_path / "run"
    proc = _start(job, run)
    _kill_all_at(run, proc, checkpoint=50)
    done = losses_by_step(run)
    assert 50 <= max(done) < STEPS - 1, "the kill must land mid-run"
    moved = tmp_path / "run-other-layout"
    shutil.copytree(run, moved, symlinks=True)

    r = run_local(job, run, "--reuse")
    assert r.returncode == 0, r.stderr[-3000:]
    restored = [x["restored_from"] for x in rows(run) if "restored_from" in x]
    assert restored and restored[-1] >= 50
    assert_matches(run, reference)  # AdamW's moments, the schedule and the data position all came back

    # The same killed run carried on by 1 rank: the checkpoint is resharded, the losses agree to rounding.
    r = run_local(job, moved, "--reuse", "-n", "1")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "new layout: resharded" in r.stdout + r.stderr
    assert_matches(moved, reference, rel=2e-4)


def test_restore_refuses_to_start_from_a_model_a_refused_checkpoint_was_partly_read_into(mpi, tmp_path):
    """Every checkpoint damaged in the chunk a load reads last: each refusal comes after the rest of it was read
    into the user's model. hpcscale cannot build the user's model again, so restore() raises
    VerificationFailure (the job fails) and says what to do, instead of training on from those weights as if
    from scratch."""
    from hpcscale.ckpt.format import INDEX, read_index

    job = doc_example(tmp_path / "code")
    run = tmp_path / "run"
    r = run_local(job, run)
    assert r.returncode == 0, r.stderr[-3000:]
    step_dirs = sorted((run / "checkpoints").glob("step-*"))
    assert step_dirs
    for step_dir in step_dirs:
        index = read_index(step_dir / INDEX)
        last = max(
            (c for t in index.tensors.values() for s in t.shards for c in s.chunks), key=lambda c: (c.file, c.offset)
        )
        with open(step_dir.parent / last.file, "r+b") as f:
            f.seek(last.offset)
            byte = f.read(1)
            f.seek(last.offset)
            f.write(bytes([byte[0] ^ 0xFF]))
    r = run_local(job, run, "--reuse")
    out = r.stdout + r.stderr
    assert r.returncode != 0, out[-3000:]
    assert "refusing checkpoint" in out and "VerificationFailure" in out
    assert "cannot start from scratch either" in out and "Move the refused checkpoints" in out
    assert not [x for x in rows(run) if "loss" in x and x.get("attempt") == 2]  # nothing trained from them


def test_doc_example_stop_signal_checkpoints_then_resumes_exactly(reference, tmp_path):
    job = doc_example(tmp_path / "code", checkpoint={"every_steps": 0}, metrics={"tensorboard": True})
    run = tmp_path / "run"
    proc = _start(job, run)
    deadline = time.monotonic() + 120
    while not ((run / "metrics.jsonl").exists() and len(losses_by_step(run)) >= 30):
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 75, out[-3000:]
    events = [json.loads(line) for line in (run / "attempts.jsonl").read_text().splitlines()]
    stop = [e for e in events if e["event"] == "stop"][-1]
    assert events[-1]["event"] == "end" and events[-1]["exit_code"] == 75  # the front end's record, last
    # the front end forwards the stop as the job's signal (USR2 by default)
    assert stop["event"] == "stop" and stop["signal"] and stop["stop_s"] is not None, stop
    saved = [r["checkpoint"] for r in rows(run) if "checkpoint" in r]
    assert saved == [stop["step"] + 1], saved  # the stop's own save, at the step every rank agreed on
    assert out.splitlines()[0] == f"run directory: {run}", out[:500]  # first: what every later command takes
    r = run_local(job, run, "--reuse")
    assert r.returncode == 0, r.stderr[-3000:]
    assert_matches(run, reference)
    # status shows the two local runs as jobs: how each ended, its exit code, where and for how long
    st = json.loads(run_cli("status", str(run), "--json").stdout)
    jobs = [s["jobs"][0] for s in st["submissions"]]
    assert [(j["job_id"], j["state"], j["exit_code"]) for j in jobs] == [
        ("local", "STOPPED", "75"),
        ("local", "COMPLETED", "0"),
    ]
    assert all(j["nodes"] and j["elapsed"] for j in jobs) and st["source"] == "attempts", st
    # the loop's step time and throughput, measured by ctx.checkpoint.step, in every attempt: the report joins
    # them to its losses, status shows them, TensorBoard holds them beside the loss
    from hpcscale.observe.report import read_run

    train = read_run(run).train
    timed = {s: r for s, r in train.items() if s != stop["step"]}  # the stop's step ends in the stop, untimed
    assert all(r.get("step_time_s", 0) > 0 and r.get("tokens_per_s", 0) > 0 for r in timed.values()), train
    assert {r["attempt"] for r in train.values()} == {1, 2}
    assert st["last_metrics"]["tokens_per_s"] > 0, st["last_metrics"]
    sys.path.insert(0, str(REPO / "tests"))
    from test_report import _events

    for attempt in (1, 2):
        [path] = (run / "tensorboard" / f"attempt-{attempt}").glob("events.out.tfevents.*")
        tags = {v.tag for e in _events(path) for v in e.summary.value}
        assert {"loss", "step_time_s", "tokens_per_s"} <= tags, (attempt, tags)


def test_doc_example_under_slurm_killed_rank_then_resume(local_cluster, tmp_path):
    """Two ranks on two emulated nodes; one rank SIGKILLed mid-run; `hpcscale resume` finishes the run. The
    steps run twice (between the checkpoint and the kill) have the same loss in both attempts."""
    steps = 400  # long enough to kill mid-run under Slurm (the kill comes at checkpoint 100)
    code = tmp_path / "code"
    doc_example(code)
    spec = yaml.safe_load((code / "job.yaml").read_text())
    spec.update(site="localcluster", nodes=2, tasks_per_node=1, restart={"max_failures": 0})
    job = code / "job.yaml"
    job.write_text(yaml.safe_dump(spec))
    run = tmp_path / "run"
    env = local_cluster
    r = run_cli("submit", str(job), "--run-dir", str(run), "--json", "-p", f"train.params.steps={steps}", env=env)
    assert r.returncode == 0, r.stderr
    assert yaml.safe_load((run / "job.yaml").read_text())["train"]["params"]["steps"] == steps
    job_id = json.loads(r.stdout)["job_id"]
    deadline = time.monotonic() + 240
    while not (run / "checkpoints" / "step-00000100").is_dir():
        assert time.monotonic() < deadline, "no checkpoint 100"
        time.sleep(0.2)
    ranks = subprocess.run(["pgrep", "-f", f"hpcscale launch --run-dir {run}"], capture_output=True, text=True)
    victims = [
        int(p) for p in ranks.stdout.split() if Path(f"/proc/{p}/comm").read_text().strip() not in ("srun", "mpirun")
    ]
    assert victims
    os.kill(victims[-1], signal.SIGKILL)
    assert wait_for_job(job_id, env, timeout=240) == "FAILED"
    out = run_cli("resume", str(run), "--json", env=env)
    assert out.returncode == 0, out.stderr
    new = json.loads(out.stdout)["submitted"]
    assert wait_for_job(new, env, timeout=300) == "COMPLETED"
    got = losses_by_step(run)
    assert set(got) == set(range(steps))
    again = {s: v for s, v in got.items() if len(v) > 1}
    assert again, "the resume must have rerun the steps after its checkpoint"
    assert all(len(set(v)) == 1 for v in again.values()), again


# ---- ctx.parallelize -----------------------------------------------------------------------------------------
def test_parallelize_matches_ddp_accumulates_and_follows_a_tp_plan(mpi, tmp_path):
    """tests/helpers/parallel_entry.py, on 4 ranks at tp=2 x dp=2 and on 2 ranks at dp=2: see its docstring."""
    for ranks, tp in ((2, 1), (4, 2)):
        spec = {
            "name": f"par-tp{tp}",
            "site": "local",
            "tasks_per_node": ranks,
            "parallel": {"tp": tp},
            "environment": {"PYTHONPATH": str(REPO / "tests" / "helpers")},
            "train": {"entry": "parallel_entry:main"},
        }
        job = tmp_path / f"job{tp}.yaml"
        job.write_text(yaml.safe_dump(spec))
        r = run_local(job, tmp_path / f"run{tp}")
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
        found = [json.loads((tmp_path / f"run{tp}" / f"rank{i}.json").read_text()) for i in range(ranks)]
        for f in found:
            assert f["replicas_equal_after_parallelize"], f
            assert f["max_diff_vs_reference"] < 1e-5, f
            assert f["max_diff_accumulated_vs_whole"] < 1e-5, f
            if tp == 1:
                assert f["max_diff_vs_ddp"] < 1e-5, f
            else:
                assert f["dtensor_params"] > 0, f


def test_parallelize_refuses_tp_without_a_plan(mpi, tmp_path):
    spec = {
        "name": "noplan",
        "site": "local",
        "tasks_per_node": 2,
        "parallel": {"tp": 2},
        "environment": {"PYTHONPATH": str(tmp_path)},
        "train": {"entry": "noplan:main"},
    }
    (tmp_path / "noplan.py").write_text("import torch\n\ndef main(ctx):\n    ctx.parallelize(torch.nn.Linear(4, 4))\n")
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec))
    r = run_local(tmp_path / "job.yaml", tmp_path / "run")
    assert r.returncode == 2, r.stderr[-2000:]  # bad input, as the CLI's own refusals
    assert "parallel.tp is 2 but ctx.parallelize got no tp_plan" in r.stdout + r.stderr


REFUSED = {  # call -> what its BadInput says (docs/context-api.md, "Errors"), at pp 1 and at pp 2
    "cut_stage stage": "must be one of 0..pp-1",
    "cut_stage layers": "the model has no 'blocks'",
    "parallelize mixed_precision": "mixed_precision is 'fp8', not one of bf16, fp32, auto",
    "parallelize init": "init= initializes a model built on the meta device",
    "parallelize twice": "this model was already parallelized",
    "clip_grad_norm_ max_norm": "max_norm is -1.0",
    "metrics.log tensor": "ctx.metrics.log: loss is a tensor of 3 elements",
    "checkpoint.step before restore": "ctx.checkpoint.step() before ctx.checkpoint.restore",
    "checkpoint.save before restore": "ctx.checkpoint.save() before ctx.checkpoint.restore",
    "checkpoint.restore optimizer without model": "an optimizer needs its model",
    "checkpoint.restore object without state_dict": "has no state_dict()/load_state_dict()",
    "checkpoint.restore twice": "restore() is called once",
}
PIPELINE_REFUSED = {
    1: dict.fromkeys(
        ["pipeline before parallelize", "pipeline schedule", "pipeline n_microbatches", "pipeline 1f1b"],
        "ctx.pipeline: parallel.pp is 1",
    ),
    2: {
        "pipeline before parallelize": "call ctx.parallelize(stage) first",
        "pipeline schedule": "schedule 'zb' is not one of",
        "pipeline n_microbatches": "n_microbatches is 0",
        "pipeline 1f1b": "fewer than parallel.pp = 2",
    },
}


@pytest.mark.parametrize("pp", [1, 2])
def test_every_documented_bad_call_is_refused_with_bad_input_naming_it(mpi, tmp_path, pp):
    """Each refusal docs/context-api.md lists, made by a real entry point on real ranks: a BadInput (exit 2
    when not caught) whose message names the call and the value."""
    spec = {
        "name": "refusals",
        "site": "local",
        "tasks_per_node": pp,
        "parallel": {"pp": pp},
        "environment": {"PYTHONPATH": str(REPO / "tests" / "helpers")},
        "train": {"entry": "refusals_entry:main"},
    }
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec))
    r = run_local(tmp_path / "job.yaml", tmp_path / "run")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    for rank in range(pp):
        got = json.loads((tmp_path / "run" / f"refusals.{rank}.json").read_text())
        want = {**REFUSED, **PIPELINE_REFUSED[pp]}
        assert sorted(got) == sorted(want)
        wrong = {k: got[k] for k in want if not (got[k].startswith("BadInput: ") and want[k] in got[k])}
        assert not wrong, wrong
    if pp == 1:  # not caught, it ends the job with exit 2 and its line
        spec["train"]["params"] = {"uncaught": "metrics.log tensor"}
        (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec))
        r = run_local(tmp_path / "job.yaml", tmp_path / "run2")
        assert r.returncode == 2 and "ctx.metrics.log: loss is a tensor of 3" in r.stdout + r.stderr, r.stderr[-2000:]


# ---- the JSON state's rules ----------------------------------------------------------------------------------
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**62), 2**62) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=20,
)  # fmt: skip


@settings(deadline=None)
@given(json_values)
def test_json_state_round_trips(value):
    from hpcscale.launch.checkpointing import _jsonable

    assert json.loads(json.dumps(_jsonable(value, "x"))) == value


@settings(deadline=None)
@given(st.dictionaries(st.integers(-1000, 1000), st.integers(), max_size=6))
def test_int_keyed_state_comes_back_int_keyed(value):
    from hpcscale.launch.checkpointing import _jsonable, _keys_int

    back = _keys_int(json.loads(json.dumps(_jsonable({"sched": value}, "x"))))
    assert back == {"sched": value} or (not value and back == {"sched": {}})


def test_json_state_refuses_what_json_cannot_hold():
    import torch

    from hpcscale.errors import BadInput
    from hpcscale.launch.checkpointing import _jsonable

    for value, said in (
        ({"a": {"b": torch.zeros(2)}}, "data.a.b is a Tensor"),
        ({"lr": float("nan")}, "data.lr is nan"),
        ({(1, 2): 3}, "key of type tuple"),
        ({"f": object()}, "data.f is a object"),
    ):
        with pytest.raises(BadInput, match=re.escape(said)):
            _jsonable(value, "data")
    assert _jsonable({"betas": (0.9, 0.95)}, "g") == {"betas": [0.9, 0.95]}


class _Loader:
    """What the state check sees of the trainer's data loader."""

    def state_problem(self, saved):
        from hpcscale.data.loader import TokenLoader

        return TokenLoader.state_problem(saved)

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


def _checker(**objects):
    """A Checkpointer registered with `objects` and no optimizer: its state check is pure (no collective)."""
    from types import SimpleNamespace

    from hpcscale.launch.checkpointing import Checkpointer
    from hpcscale.layout import ParallelDims

    ctx = SimpleNamespace(
        job=SimpleNamespace(checkpoint=None, xsite=None, train=SimpleNamespace(entry="user.py")),
        dims=ParallelDims(tp=1, pp=1, dp=1),
    )
    c = Checkpointer(ctx)
    c._register(None, None, objects)
    return c


def test_state_check_asks_each_object_and_reads_the_trainers_older_format():
    """ctx.checkpoint refuses (so an older checkpoint is taken) a state an object says it cannot load, or none
    for it; the built-in trainer's checkpoints from before it saved through ctx.checkpoint load as its loader's."""
    from hpcscale.launch.checkpointing import FORMAT, _upgraded

    c = _checker(loader=_Loader())
    good = {"epoch": 0, "batch": 3, "seed": 1}
    assert c._state_problem({"step": 3, "hpcscale.context": FORMAT, "objects": {"loader": good}}) is None
    assert c._state_problem({"step": 3, "loader": good}) is None  # the trainer's older format
    assert _upgraded({"step": 3, "loader": good, "xsite": 1}) == {
        "step": 3, "xsite": 1, "hpcscale.context": FORMAT, "objects": {"loader": good}
    }  # fmt: skip
    said = c._state_problem({"step": 3, "hpcscale.context": FORMAT, "objects": {}})
    assert said == "loader: the state is NoneType, not an object with epoch, batch and seed", said
    said = c._state_problem({"step": 3, "loader": {"epoch": -1, "batch": 0}})
    assert said is not None and said.startswith("loader: epoch is '-1'"), said
    # an older trainer state is the trainer's: code registering other objects refuses it, naming why
    other = _checker(sched={})
    said = other._state_problem({"step": 3, "loader": good})
    assert said is not None and "built-in trainer's checkpoint" in said, said
    assert other._state_problem({"step": 3}) is not None  # no marker, no loader: another program's


@settings(deadline=None, max_examples=200)
@given(st.dictionaries(st.sampled_from(["step", "loader", "objects", "hpcscale.context", "x"]), json_values))
def test_state_check_answers_every_hand_edited_state_without_raising(state):
    c = _checker(loader=_Loader())
    problem = c._state_problem(state)
    assert problem is None or isinstance(problem, str)


def test_launch_gives_the_ranks_the_jobs_environment_whatever_started_them(mpi, tmp_path):
    """An admin's own script that calls `hpcscale launch --run-dir RUN` without exporting the job spec's
    `environment:` (the rendered script and `run --local` export it): the entry point is still found on the
    job's PYTHONPATH and sees its variables; a variable the script did set keeps the script's value."""
    from hpcscale.launch.local import local_env

    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "envcheck.py").write_text(
        "import os\n\n"
        "def main(ctx):\n"
        "    (ctx.run_dir / f'env.{ctx.rank}').write_text(os.environ.get('HPCS_A', '-') + ' ' + "
        "os.environ.get('HPCS_B', '-'))\n"
    )
    spec = {
        "name": "envcheck",
        "site": "local",
        "tasks_per_node": 2,
        "environment": {"PYTHONPATH": str(mods), "HPCS_A": "from-spec", "HPCS_B": "from-spec"},
        "train": {"entry": "envcheck:main"},
    }
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec))
    run = tmp_path / "run"
    r = run_local(tmp_path / "job.yaml", run)  # makes the run directory, as `submit --dry-run` would
    assert r.returncode == 0, r.stderr[-2000:]
    assert (run / "env.1").read_text() == "from-spec from-spec"
    (run / "env.1").unlink()
    # the admin's script: none of the job's variables exported, one of its own set
    env = {k: v for k, v in os.environ.items() if not k.startswith("HPCS_") and k != "PYTHONPATH"}
    env |= local_env() | {"HPCS_B": "from-script"}
    out = subprocess.run(
        ["mpirun", "-n", "2", "--oversubscribe", "--bind-to", "none", sys.executable, "-m", "hpcscale", "launch",
         "--run-dir", str(run)],
        env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert (run / "env.1").read_text() == "from-spec from-script"
