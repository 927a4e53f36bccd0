"""`hpcscale report` and the TensorBoard events, from a real local run with a restart (docs/report.md)."""

from __future__ import annotations

import contextlib
import json
import struct
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest
import yaml
from conftest import REPO, run_cli
from hypothesis import given, settings
from hypothesis import strategies as st
from trainjobs import job_spec

from hpcscale.errors import BadInput
from hpcscale.observe.report import read_run, render_markdown, summarize

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def run(mpi, tmp_path_factory) -> Path:
    """2 ranks, 20 steps, then the same job to 40 steps in the same directory (attempt 2 from step 20)."""
    tmp = tmp_path_factory.mktemp("report")
    job = job_spec(tmp / "job.yaml", tp=1, pp=1, ranks=2, steps=20, checkpoint={"every_steps": 10}, eval_every=10)
    spec = yaml.safe_load(job.read_text())
    spec["metrics"] = {"timing_every": 5, "tensorboard": True}
    job.write_text(yaml.safe_dump(spec))
    out = tmp / "run"
    r = run_cli("run", "--local", str(job), "--run-dir", str(out), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    spec["train"]["params"]["steps"] = 40
    job.write_text(yaml.safe_dump(spec))
    r = run_cli("run", "--local", str(job), "--run-dir", str(out), "--reuse", timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def _train_rows(run: Path) -> dict[int, dict]:
    rows = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "loss" in row:
            rows[row["step"]] = row
    return rows


def test_the_report_plots_and_summarizes_what_the_run_logged(run, tmp_path):
    out = tmp_path / "rep"
    r = run_cli("report", str(run), "-o", str(out), "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    names = sorted(Path(p).name for p in doc["files"])
    assert names == ["efficiency.png", "loss.png", "ranks.png", "summary.md", "throughput.png"]
    for name in ("efficiency.png", "loss.png", "ranks.png", "throughput.png"):
        data = (out / name).read_bytes()
        assert data.startswith(PNG) and len(data) > 5000, name
    rows = _train_rows(run)
    s = doc["summary"]
    assert s["steps"] == 40 and s["last_step"] == 39 and s["final_loss"] == rows[39]["loss"]
    assert s["attempts"] == 2 and s["restarts"] == [{"step": 20, "attempt": 2}]
    assert s["checkpoints"] == [10, 20, 30, 40]
    assert s["tokens"] == round(sum(r["tokens_per_s"] * r["step_time_s"] for r in rows.values()))
    assert s["stragglers"]["windows"] >= 3
    # efficiency: the model FLOPs counted in each attempt, TFLOPS per device on every step after the counted one
    assert s["efficiency"]["flops_source"] == "counted" and s["efficiency"]["median_tflops"] > 0
    assert s["efficiency"]["median_mfu"] is None and s["efficiency"]["rss_gb"] > 0  # no peak for a CPU here
    assert s["usage"]["attempts"] == 2 and 0 < s["usage"]["node_hours"] < 0.1 and s["usage"]["gpu_hours"] is None
    text = (out / "summary.md").read_text()
    assert f"{rows[39]['loss']:.4f}" in text and "attempt 2 from step 20" in text and "![ranks.png](ranks.png)" in text


def test_the_report_runs_without_torch(run, tmp_path):
    probe = (
        "import sys, json\nfrom pathlib import Path\nfrom hpcscale.observe.report import build\n"
        f"build(Path({str(run)!r}), Path({str(tmp_path / 'r')!r}))\n"
        "print(json.dumps('torch' in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) is False


def _events(path: Path) -> list:
    """Every Event in a TFRecord file, its framing read by hand (length, masked CRC, data, masked CRC)."""
    from tensorboardX.proto.event_pb2 import Event

    data, out, pos = path.read_bytes(), [], 0
    while pos < len(data):
        (length,) = struct.unpack("<Q", data[pos : pos + 8])
        event = Event()
        event.ParseFromString(data[pos + 12 : pos + 12 + length])
        out.append(event)
        pos += 12 + length + 4
    assert pos == len(data)
    return out


def test_tensorboard_events_hold_the_metrics_per_attempt(run):
    rows = _train_rows(run)
    seen: dict[int, float] = {}
    for attempt in (1, 2):
        [path] = list((run / "tensorboard" / f"attempt-{attempt}").glob("events.out.tfevents.*"))
        for event in _events(path):
            for value in event.summary.value:
                if value.tag == "loss":
                    seen[event.step] = value.simple_value
    assert set(seen) == set(rows)
    assert all(seen[s] == pytest.approx(rows[s]["loss"], rel=1e-6) for s in rows)


def test_the_per_rank_grid_covers_both_attempts_of_the_run(run):
    """ranks.png's grid from the real two-attempt run: one column per timing window of each attempt, every
    rank's own time in each (the second attempt's windows are not dropped)."""
    import math

    from hpcscale.observe.report import rank_grid
    from hpcscale.observe.timing import read_windows

    windows = read_windows(run / "timing.jsonl")
    assert sorted({w.attempt for w in windows}) == [1, 2] and len(windows) == 8  # 20 steps a window of 5, twice
    grid, per_row = rank_grid(windows)
    assert grid.shape == (2, 8) and per_row == 1
    assert not any(math.isnan(v) for v in grid.flatten()) and (grid > 0).all()


def test_bad_inputs_are_exit_2(run, tmp_path):
    assert run_cli("report", str(tmp_path), "-o", str(tmp_path / "o")).returncode == 2  # not a run directory
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "job.yaml").write_text("name: e\n")
    (empty / "metrics.jsonl").write_text('{"step": 0, "checkpoint": 1}\n')
    r = run_cli("report", str(empty))
    assert r.returncode == 2 and "no training line" in r.stderr
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    link = tmp_path / "link"
    link.symlink_to(elsewhere)
    r = run_cli("report", str(run), "-o", str(link))
    assert r.returncode == 2 and "symbolic link" in r.stderr
    assert list(elsewhere.iterdir()) == []


@settings(max_examples=60, deadline=None)
@given(st.lists(st.one_of(st.binary(max_size=60), st.builds(lambda s, v: json.dumps({"step": s, "loss": v}).encode(),
       st.integers(-5, 50), st.floats(allow_nan=True, allow_infinity=True))), max_size=30))  # fmt: skip
def test_any_metrics_file_reads_or_is_refused_cleanly(tmp_path_factory, lines):
    run = tmp_path_factory.mktemp("m")
    (run / "job.yaml").write_text("name: m\n")
    (run / "metrics.jsonl").write_bytes(
        b"\n".join(line.replace(b"\n", b" ") for line in lines) + b'\n{"step": 0, "loss": 1.0}'
    )
    data = read_run(run)  # one good line at least: never BadInput, never a crash
    assert data.train[0]["loss"] == 1.0 and all(isinstance(r["loss"], int | float) for r in data.train.values())
    render_markdown(summarize(data, None, []))
    (run / "metrics.jsonl").write_bytes(b"\n".join(lines))
    with contextlib.suppress(BadInput):
        read_run(run)


def test_a_steps_time_and_throughput_join_its_loss_in_either_order_and_attempt(tmp_path):
    """ctx.checkpoint.step's own line (step_time_s, tokens_per_s) belongs with the loss the loop logs for the
    same step in the same attempt, whether the loop logs before or after calling step(); a step run again after
    a resume takes the new attempt's figures, never the old one's."""
    rows = [
        {"step": 0, "loss": 3.0, "attempt": 1},
        {"step": 0, "step_time_s": 0.5, "tokens_per_s": 100.0, "attempt": 1},  # after its loss
        {"step": 1, "step_time_s": 0.25, "tokens_per_s": 200.0, "attempt": 1},  # before its loss
        {"step": 1, "loss": 2.5, "attempt": 1},
        {"step": 1, "step_time_s": 2.0, "tokens_per_s": 25.0, "attempt": 2},  # step 1 again, after a resume
        {"step": 1, "loss": 2.5, "attempt": 2},
        {"step": 2, "loss": 2.0, "attempt": 2},
    ]
    (tmp_path / "job.yaml").write_text("name: m\n")
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = read_run(tmp_path)
    assert (data.train[0]["step_time_s"], data.train[0]["tokens_per_s"]) == (0.5, 100.0)
    assert (data.train[1]["step_time_s"], data.train[1]["tokens_per_s"], data.train[1]["attempt"]) == (2.0, 25.0, 2)
    assert "step_time_s" not in data.train[2]


def test_tokens_survive_steps_logged_without_timing(tmp_path):
    """A run stopped and resumed logs its first step after the resume without tokens/s and step time: the tokens
    axis and the summary's tokens stay, that step counted as the median timed step, and the summary says so."""
    rows = [
        {"step": s, "loss": 3.0 - s / 10, "step_time_s": 0.5, "tokens_per_s": 200.0, "attempt": 1} for s in range(4)
    ]
    rows.append({"step": 4, "loss": 2.5, "attempt": 2})  # the first step after the resume: no timing
    rows += [{"step": s, "loss": 2.4, "step_time_s": 0.25, "tokens_per_s": 400.0, "attempt": 2} for s in (5, 6)]
    (tmp_path / "job.yaml").write_text("name: m\n")
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    from hpcscale.observe.report import tokens_by_step

    data = read_run(tmp_path)
    tokens = tokens_by_step(data)
    assert tokens is not None and tokens[3] == 400.0 and tokens[4] == 500.0 and tokens[6] == 700.0
    s = summarize(data, None, [])
    assert s["tokens"] == 700 and s["untimed_steps"] == 1
    assert "1 step(s) without timing counted as the median step" in render_markdown(s)
    only_loss = tmp_path / "loss-only"
    only_loss.mkdir()
    (only_loss / "job.yaml").write_text("name: m\n")
    (only_loss / "metrics.jsonl").write_text(json.dumps({"step": 0, "loss": 1.0}) + "\n")
    assert tokens_by_step(read_run(only_loss)) is None


def test_node_and_gpu_hours_add_up_every_attempt_and_one_that_left_no_end_counts_to_its_last_step():
    from hpcscale.observe.report import RunData, usage

    def begin(a, t, nodes, world, device):
        return {"event": "begin", "attempt": a, "time": t, "nodes": nodes, "world_size": world, "device": device}

    events = [
        begin(1, "2026-11-28T10:00:00+00:00", ["n1", "n2"], 8, "cuda"),
        {"event": "end", "attempt": 1, "time": "2026-11-28T10:30:00+00:00"},
        begin(2, "2026-11-28T11:00:00+00:00", ["n1", "n2", "n3", "n4"], 16, "cuda"),  # killed: no end record
    ]
    data = RunData("r")
    data.train = {5: {"attempt": 2, "time": datetime.fromisoformat("2026-11-28T11:15:00+00:00").timestamp()}}
    got = usage(events, data)
    assert got == {"attempts": 2, "node_hours": 0.5 * 2 + 0.25 * 4, "gpu_hours": 0.5 * 8 + 0.25 * 16}
    events[0]["device"] = None  # an older version's record: GPU-hours not known
    assert usage(events, data)["gpu_hours"] is None
    events[0]["world_size"] = 10**12  # a record others may write: that attempt gives no figure
    assert usage(events, data) == {"attempts": 1, "node_hours": 1.0, "gpu_hours": 4.0}
