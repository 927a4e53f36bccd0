"""Per-rank timing, the straggler rule and the checkpoint interval (hpcscale.observe, docs/observability.md).

The rule and the formula are tested as functions (hypothesis for the file format); the recording is tested in
real runs: a local run writes every rank's windows and the auto interval, a run whose saves get slower plans
longer intervals, and on the local Slurm cluster a rank slowed by SIGSTOP/SIGCONT bursts is named, with its
node, by `hpcscale status`, and `resume --exclude-slow` keeps the job off that node.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from conftest import run_cli
from hypothesis import given, settings
from hypothesis import strategies as st
from trainjobs import job_spec

from hpcscale.observe.interval import choose, daly, job_mtbf, young
from hpcscale.observe.timing import (
    COLUMNS,
    FLOOR_S,
    MIN_SLOW,
    RATIO,
    WINDOWS,
    judge,
    make_line,
    parse_line,
    read_windows,
)


# ---- the file format ---------------------------------------------------------------------------------------------
def _window(own: list[float], *, step: int = 19, attempt: int | None = 1, nodes=None, pp=None) -> dict:
    n = len(own)
    rows = [[o + 0.01, o, o, 0.0, 0.005, 0.005, 0.0, 0.0] for o in own]
    return make_line(
        time=1.0, attempt=attempt, step=step, steps=20, rows=rows, nodes=nodes or ["n1"] * n, pp=pp or [0] * n
    )


def test_a_line_round_trips_and_names_every_column():
    line = _window([0.01, 0.02])
    w = parse_line(json.loads(json.dumps(line)))
    assert w is not None and w.step == 19 and w.attempt == 1 and w.nodes == ("n1", "n1")
    assert set(w.ranks[0]) == set(COLUMNS) and w.ranks[1]["own_s"] == 0.02
    # a line of a version before comm_s (seven columns) still reads, and status shows it (comm wait 0)
    old = {**line, "columns": list(COLUMNS[:7]), "ranks": [r[:7] for r in line["ranks"]]}
    assert parse_line(json.loads(json.dumps(old))).ranks[1]["own_s"] == 0.02


@settings(max_examples=300, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
                    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=6),
                    max_leaves=30))  # fmt: skip
def test_any_json_value_parses_to_a_window_or_none(doc):
    parse_line(doc)  # never raises


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=300), st.integers(min_value=0, max_value=400))
def test_torn_or_damaged_files_keep_their_good_lines(tmp_path_factory, junk, cut):
    path = tmp_path_factory.mktemp("t") / "timing.jsonl"
    good = json.dumps(_window([0.01, 0.011])) + "\n"
    torn = json.dumps(_window([0.03, 0.031], step=39))[: cut % 200]
    path.write_bytes(good.encode() + junk.replace(b"\n", b" ") + b"\n" + good.encode() + torn.encode())
    windows = read_windows(path)
    assert len(windows) >= 2 and all(w.step in (19, 39) for w in windows)


def test_hand_edited_values_are_refused():
    for edit in (
        lambda d: d["ranks"][0].__setitem__(1, -1.0),  # negative time
        lambda d: d["ranks"][0].__setitem__(1, "fast"),
        lambda d: d["nodes"].pop(),  # ranks and nodes disagree
        lambda d: d.__setitem__("pp", [0, -1]),
        lambda d: d.__setitem__("step", 1.5),
        lambda d: d.__setitem__("columns", ["step_s"]),
    ):
        doc = _window([0.01, 0.02])
        edit(doc)
        assert parse_line(doc) is None


# ---- the straggler rule ---------------------------------------------------------------------------------------------
def _windows(per_window: list[list[float]], **kw):
    return [parse_line(_window(own, step=20 * i + 19, **kw)) for i, own in enumerate(per_window)]


def test_a_persistently_slow_rank_is_named_with_its_node():
    own = [[0.010, 0.010, 0.016, 0.010]] * WINDOWS
    v = judge(_windows(own, nodes=["n1", "n1", "n2", "n2"]))
    assert v.slow_ranks == [2] and v.slow_nodes == ["n2"] and not v.reason
    assert v.ranks[2].relative == pytest.approx(1.6) and v.ranks[2].slow_windows == WINDOWS


def test_one_slow_window_or_a_small_difference_names_nobody():
    base = [0.010, 0.010, 0.010, 0.010]
    blip = [[*base[:2], 0.05, base[3]]] + [base] * (WINDOWS - 1)
    assert judge(_windows(blip)).slow_ranks == []
    small = [[0.010, 0.010, 0.0119, 0.010]] * WINDOWS  # 19 % slower: under the ratio
    assert judge(_windows(small)).slow_ranks == []
    tiny = [[0.001, 0.001, 0.0025, 0.001]] * WINDOWS  # 2.5x, but 1.5 ms: under the floor
    assert judge(_windows(tiny)).slow_ranks == []


def test_slow_in_enough_of_the_last_windows_only():
    slow, fine = [0.01, 0.01, 0.02], [0.01, 0.01, 0.01]
    assert judge(_windows([slow] * MIN_SLOW + [fine] * (WINDOWS - MIN_SLOW))).slow_ranks == [2]
    assert judge(_windows([slow] * (MIN_SLOW - 1) + [fine] * (WINDOWS - MIN_SLOW + 1))).slow_ranks == []
    # older windows than the last WINDOWS do not count
    assert judge(_windows([slow] * 10 + [fine] * WINDOWS)).slow_ranks == []


def test_peers_are_the_ranks_of_the_same_pipeline_stage():
    # stage 1 does more work than stage 0 (the head): that is not straggling; rank 3 is slower than rank 2
    own = [[0.010, 0.010, 0.020, 0.030]] * WINDOWS
    v = judge(_windows(own, pp=[0, 0, 1, 1]))
    assert v.slow_ranks == [3]


def test_no_verdict_without_enough_windows_of_the_newest_attempt():
    old = _windows([[0.01, 0.03]] * WINDOWS, attempt=1)
    new = _windows([[0.01, 0.03]] * (MIN_SLOW - 1), attempt=2)
    v = judge(old + new)
    assert v.slow_ranks == [] and "needs" in v.reason
    assert judge([]).reason


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.floats(min_value=0.005, max_value=1.0), min_size=2, max_size=12),
    st.integers(min_value=0, max_value=11),
    st.floats(min_value=1.0, max_value=4.0),
    st.randoms(),
)
def test_the_rule_is_what_it_says_and_ignores_rank_order(base, victim, factor, rnd):
    """Every rank equally fast except one, slowed by `factor`: it is named exactly when the documented rule says,
    and renumbering the ranks renumbers the verdict, nothing else."""
    n = len(base)
    victim %= n
    speed = base[0]
    own = [speed] * n
    own[victim] = speed * factor
    import statistics

    own = [round(v, 6) for v in own]  # as the file holds them
    peers = statistics.median(own)
    expected = [victim] if own[victim] >= RATIO * peers and own[victim] - peers >= FLOOR_S else []
    assert judge(_windows([own] * WINDOWS)).slow_ranks == expected
    order = list(range(n))
    rnd.shuffle(order)
    shuffled = [own[i] for i in order]
    assert judge(_windows([shuffled] * WINDOWS)).slow_ranks == [order.index(v) for v in expected]


# ---- the checkpoint interval ---------------------------------------------------------------------------------------
def _waste(interval: float, cost: float, mtbf: float) -> float:
    """Daly's model: expected wall time per second of work when saving every `interval` s of work at `cost` s
    a save, failures exponential with mean `mtbf`, restart free."""
    return mtbf * math.expm1((interval + cost) / mtbf) / interval


@pytest.mark.parametrize(("cost", "mtbf"), [(1, 3600), (30, 86400), (120, 3600 * 6), (600, 3600), (5, 40)])
def test_daly_is_the_optimum_of_the_expected_time(cost, mtbf):
    """Against a brute-force search of the exact model: Daly's interval wastes less than 0.5 % over the best."""
    t = daly(cost, mtbf)
    grid = [mtbf * 10 ** (k / 400) for k in range(-2400, 800)]
    best = min(_waste(x, cost, mtbf) for x in grid)
    assert _waste(t, cost, mtbf) <= best * 1.005
    assert t <= young(cost, mtbf)  # the higher-order terms and the −C move it below Young's


def test_daly_limits_and_known_value():
    assert young(60, 86400) == pytest.approx(math.sqrt(2 * 60 * 86400))
    assert daly(60, 86400) == pytest.approx(3220.0 * (1 + math.sqrt(60 / 172800) / 3 + 60 / 1555200) - 60, rel=1e-3)
    assert daly(100, 40) == 40  # a save costing more than 2 MTBF: save every MTBF
    assert daly(0, 3600) == 0
    with pytest.raises(ValueError):
        daly(1, 0)


def test_the_interval_grows_with_the_cost_and_shrinks_with_the_nodes():
    m1 = job_mtbf(node_mtbf_hours=1000, nodes=1, events=[], now=0)
    m8 = job_mtbf(node_mtbf_hours=1000, nodes=8, events=[], now=0)
    assert m8.seconds == pytest.approx(m1.seconds / 8)
    cheap = choose(blocking_s=1, background_s=0, step_s=0.5, mtbf=m8)
    dear = choose(blocking_s=4, background_s=0, step_s=0.5, mtbf=m8)
    assert dear.steps > cheap.steps and dear.steps == pytest.approx(2 * cheap.steps, rel=0.05)
    assert choose(blocking_s=1, background_s=3, step_s=0.5, mtbf=m8).cost_s == 4


def _begin(attempt: int, t: str) -> dict:
    return {"event": "begin", "attempt": attempt, "time": f"2026-11-23T{t}+00:00"}


def test_the_runs_own_failures_shorten_the_mtbf():
    hour = 3600.0
    events = [
        _begin(1, "00:00:00"),  # failed: no stop, no end, another begin followed
        _begin(2, "01:00:00"),
        {"event": "stop", "attempt": 2, "time": "2026-11-23T01:30:00+00:00"},  # preempted: not a failure
        _begin(3, "02:00:00"),
        {"event": "end", "attempt": 3, "cause": "failed", "time": "2026-11-23T03:00:00+00:00"},
        _begin(4, "03:10:00"),
    ]
    now = time_of("04:10:00")
    m = job_mtbf(node_mtbf_hours=10, nodes=2, events=events, now=now)
    assert m.failures == 2
    exposure = 1 * hour + 1 * hour + 1 * hour + 1 * hour  # attempt 2 runs to the next begin
    assert m.exposure_s == pytest.approx(exposure)
    assert m.seconds == pytest.approx((exposure + 5 * hour) / 3)
    assert "2 failure(s)" in m.describe()


def time_of(t: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(f"2026-11-23T{t}+00:00").timestamp()


# ---- real runs -------------------------------------------------------------------------------------------------------
def _rows(run: Path, key: str) -> list[dict]:
    out = []
    for line in (run / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if key in row:
            out.append(row)
    return out


def test_a_local_run_records_every_ranks_windows_and_status_shows_them(mpi, tmp_path):
    # windows of 20 steps: a few milliseconds of a loaded machine's scheduling in one step of a 10-step window (of
    # 12 ms steps) made a rank 1.5x its stage's other rank in that window
    job = job_spec(tmp_path / "job.yaml", tp=1, pp=2, ranks=4, steps=80)
    spec = yaml.safe_load(job.read_text())
    spec["metrics"] = {"timing_every": 20}
    job.write_text(yaml.safe_dump(spec))
    run = tmp_path / "run"
    r = run_cli("run", "--local", str(job), "--run-dir", str(run), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    windows = read_windows(run / "timing.jsonl")
    assert [w.step for w in windows] == [19, 39, 59, 79] and all(w.steps == 20 for w in windows)
    assert all(len(w.ranks) == 4 and w.pp == (0, 0, 1, 1) and w.attempt == 1 for w in windows)
    step_times = [r["step_time_s"] for r in _rows(run, "loss")]
    for w in windows:
        for row in w.ranks:
            assert 0 < row["own_s"] <= row["step_s"] and row["compute_s"] <= row["own_s"]
            assert row["dp_wait_s"] > 0 and row["sync_s"] > 0 and row["ckpt_s"] == 0  # dp=2: a gradient all-reduce
            # pp=2: each stage waits for the other's sends and receives (comm_s)
            assert row["comm_s"] > 0
            parts = row["own_s"] + row["dp_wait_s"] + row["sync_s"] + row["comm_s"]
            assert row["step_s"] == pytest.approx(parts, abs=1e-5)  # means add up (6 decimals each)
            # the rank's step is the step rank 0 logs, give or take the clocks' offsets within a step
            assert min(step_times) * 0.5 <= row["step_s"] <= max(step_times) * 1.5
    doc = json.loads(run_cli("status", str(run), "--json").stdout)
    assert doc["timing"]["step"] == 79 and len(doc["timing"]["ranks"]) == 4
    verdict = doc["timing"]["stragglers"]
    assert verdict["windows"] == 4 and verdict["reason"] == "" and verdict["slow_ranks"] == [], verdict  # no cause
    text = run_cli("status", str(run)).stdout
    assert "per-rank step time" in text and "stragglers:" in text


def test_timing_off_writes_nothing_and_costs_no_collective(mpi, tmp_path):
    job = job_spec(tmp_path / "job.yaml", tp=1, pp=1, ranks=2, steps=12)
    spec = yaml.safe_load(job.read_text())
    spec["metrics"] = {"timing_every": 0}
    job.write_text(yaml.safe_dump(spec))
    run = tmp_path / "run"
    r = run_cli("run", "--local", str(job), "--run-dir", str(run), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert not (run / "timing.jsonl").exists()
    assert "per-rank" not in run_cli("status", str(run)).stdout


def test_auto_interval_plans_longer_intervals_when_saves_get_slower(mpi, tmp_path):
    """A site whose nodes fail every 3.6 s, saves made 0.5 s slower from step 30 on (fault injection): the
    planned interval grows with the cost, and every plan is recorded with its reason."""
    site = tmp_path / "flaky.yaml"
    local = yaml.safe_load((Path(__file__).parents[2] / "site_configs" / "local.yaml").read_text())
    local["name"] = "flaky"
    local["reliability"] = {"node_mtbf_hours": 0.001}
    site.write_text(yaml.safe_dump(local))
    job = job_spec(tmp_path / "job.yaml", tp=1, pp=1, ranks=2, steps=400, checkpoint={"every_steps": "auto"})
    spec = yaml.safe_load(job.read_text())
    spec["site"] = str(site)
    spec["checkpoint"]["async"] = False
    job.write_text(yaml.safe_dump(spec))
    run = tmp_path / "run"
    env = {"HPCSCALE_CKPT_SLOW": "0.5@30"}
    r = run_cli("run", "--local", str(job), "--run-dir", str(run), env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    plans = [row["checkpoint_interval"] for row in _rows(run, "checkpoint_interval")]
    saves = [row["checkpoint"] for row in _rows(run, "checkpoint")]
    assert plans[0]["next_at"] == 10 + plans[0]["steps"] and saves[0] == 10
    planned = [p["next_at"] for p in plans if p["next_at"] < 400]
    assert planned == saves[1 : len(planned) + 1]  # each save where the plan said
    before = [p for p, s in zip(plans, saves, strict=False) if s < 30]
    after = [p for p, s in zip(plans, saves, strict=False) if s >= 30]
    assert before and after, (plans, saves)
    assert min(p["blocking_s"] for p in after) >= 0.5
    assert all(p["background_s"] == 0 for p in plans)  # synchronous saves: nothing written in the background
    # the planned interval in seconds grows with the cost; in steps it is that over the measured step time, which
    # a loaded machine moves (a slower step makes fewer steps of the same interval), so seconds are compared
    assert min(p["seconds"] for p in after) > max(p["seconds"] for p in before)
    for p in plans:
        assert p["mtbf_s"] == pytest.approx(3.6, rel=0.5) and "Daly optimum" in p["why"]
        assert p["seconds"] == pytest.approx(daly(p["cost_s"], p["mtbf_s"]), rel=1e-3)
    status = json.loads(run_cli("status", str(run), "--json").stdout)
    assert status["checkpoint_interval"]["next_at"] == plans[-1]["next_at"]


@pytest.mark.parametrize("shared", ["auto", 20])
def test_each_tier_plans_its_own_auto_interval_and_the_shared_saves_are_drained(mpi, tmp_path, shared):
    """`every_steps: auto` on the node-local tier, the shared one auto or fixed: the node-local tier plans from its
    own saves' cost and the steps' measured time, each shared save is taken on the node-local tier and drained
    from there once, in order, and the plans are recorded apart."""
    site = tmp_path / "flaky.yaml"
    local = yaml.safe_load((Path(__file__).parents[2] / "site_configs" / "local.yaml").read_text())
    local["name"] = "flaky"
    local["reliability"] = {"node_mtbf_hours": 0.001}
    local["filesystems"]["node_local"] = str(tmp_path / "node-local")
    site.write_text(yaml.safe_dump(local))
    job = job_spec(tmp_path / "job.yaml", tp=1, pp=1, ranks=2, steps=60, checkpoint={"every_steps": shared})
    spec = yaml.safe_load(job.read_text())
    spec["site"] = str(site)
    spec["checkpoint"]["local"] = {"every_steps": "auto"}
    job.write_text(yaml.safe_dump(spec))
    run = tmp_path / "run"
    r = run_cli("run", "--local", str(job), "--run-dir", str(run), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    local_plans = [row["local_checkpoint_interval"] for row in _rows(run, "local_checkpoint_interval")]
    local_saves = [row["local_checkpoint"] for row in _rows(run, "local_checkpoint")]
    shared_saves = [row["checkpoint"] for row in _rows(run, "checkpoint")]
    assert local_plans and (shared != "auto" or _rows(run, "checkpoint_interval")), r.stdout[-3000:]
    assert local_saves[0] == 10 and local_plans[0]["next_at"] == 10 + local_plans[0]["steps"]
    planned = [p["next_at"] for p in local_plans if p["next_at"] < 60]
    assert set(planned) <= set(local_saves)  # each node-local save where its plan said
    for p in local_plans:  # planned from the steps' measured time and the site's MTBF
        assert "Daly optimum" in p["why"] and p["step_s"] > 0 and p["mtbf_s"] == pytest.approx(3.6, rel=0.5), p
    log = r.stdout + r.stderr
    drained = [int(x.split()[2]) for x in log.splitlines() if "drained from the node-local tier" in x]
    assert drained and set(drained) <= set(local_saves) and set(drained) <= set(shared_saves), log[-3000:]
    assert drained == sorted(set(drained)), drained  # each shared save once, in order
    assert "was not saved" not in log and "next node-local checkpoint at step" in log


# ---- a real straggler on the local Slurm cluster -------------------------------------------------------------
def _slurm_ranks(run: Path) -> dict[int, tuple[str, int]]:
    """pid -> (node, SLURM_LOCALID) of every rank of the run."""
    out = subprocess.run(["pgrep", "-f", f"hpcscale launch --run-dir {run}"], capture_output=True, text=True)
    found = {}
    for p in out.stdout.split():
        try:
            if Path(f"/proc/{p}/comm").read_text().strip() in ("srun", "mpirun", "orterun"):
                continue
            env = dict(kv.split(b"=", 1) for kv in Path(f"/proc/{p}/environ").read_bytes().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        if b"SLURMD_NODENAME" in env and b"SLURM_LOCALID" in env:
            found[int(p)] = (env[b"SLURMD_NODENAME"].decode(), int(env[b"SLURM_LOCALID"]))
    return found


def _bursts(pid: int, done: threading.Event, stopped_s: float = 0.06, running_s: float = 0.02) -> None:
    """Stop and continue `pid` in turn: a rank that gets about a quarter of the CPU it should, as on a sick
    node. A step of this tiny model takes about as long as one burst (tens of ms), so a milder duty cycle
    slows a step by less than the judge's 1.2 when the other ranks share two cores with it."""
    while not done.is_set():
        try:
            os.kill(pid, signal.SIGSTOP)
            time.sleep(stopped_s)
            os.kill(pid, signal.SIGCONT)
            time.sleep(running_s)
        except ProcessLookupError:
            return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)


def test_status_names_the_rank_slowed_by_sigstop_bursts_and_resume_moves_off_its_node(local_cluster, tmp_path):
    job = job_spec(tmp_path / "job.yaml", tp=1, pp=1, ranks=4, site="localcluster", nodes=2, steps=100000,
                   checkpoint={"every_steps": 50})  # fmt: skip
    spec = yaml.safe_load(job.read_text())
    spec["metrics"] = {"timing_every": 20}
    spec["signals"] = {"requeue": False}
    job.write_text(yaml.safe_dump(spec))
    run = tmp_path / "run"
    sub = run_cli("submit", str(job), "--run-dir", str(run), "--json", env=local_cluster)
    assert sub.returncode == 0, sub.stderr
    job_id = json.loads(sub.stdout)["job_id"]
    env = {**os.environ, **local_cluster}
    done = threading.Event()
    try:
        deadline = time.monotonic() + 240
        while len(read_windows(run / "timing.jsonl")) < 2:
            assert time.monotonic() < deadline, "no timing windows after 240 s"
            time.sleep(0.5)
        ranks = _slurm_ranks(run)
        node = max(node for node, _ in ranks.values())  # the allocation's second node
        victim = next(pid for pid, (n, local) in ranks.items() if n == node and local == 1)
        started = read_windows(run / "timing.jsonl")[-1].step
        thread = threading.Thread(target=_bursts, args=(victim, done), daemon=True)
        thread.start()
        while not [w for w in read_windows(run / "timing.jsonl") if w.step > started + 20][WINDOWS - 1 :]:
            assert time.monotonic() < deadline + 240, "the slowed run made too few windows"
            time.sleep(0.5)
        # stop the job while the rank is still slow: every rank saves and stops; status then reads a file that
        # no longer changes
        subprocess.run(["scancel", "--signal=USR2", job_id], env=env, check=True)
        deadline = time.monotonic() + 240
        while subprocess.run(["squeue", "-h", "-j", job_id], capture_output=True, text=True, env=env).stdout.strip():
            assert time.monotonic() < deadline, "the stopped job did not leave the queue"
            time.sleep(0.2)  # one squeue call; a 1 s poll added half a second on average
    finally:
        done.set()
        subprocess.run(["scancel", job_id], env=env)  # a failed assertion above must not leave the job running
    status = run_cli("status", str(run), "--json", env=local_cluster)
    assert status.returncode == 0, status.stderr
    verdict = json.loads(status.stdout)["timing"]["stragglers"]
    window = read_windows(run / "timing.jsonl")[-1]
    expected = window.nodes.index(node) + 1  # the node's second rank: SLURM_LOCALID 1
    assert verdict["slow_ranks"] == [expected], verdict
    assert verdict["slow_nodes"] == [node], verdict
    text = " ".join(run_cli("status", str(run), env=local_cluster).stdout.split())
    assert f"straggler: rank {expected} on node {node}" in text, text
    plan = run_cli("resume", str(run), "--dry-run", "--json", "--exclude-slow", env=local_cluster)
    assert plan.returncode == 0, plan.stderr
    doc = json.loads(plan.stdout)
    assert doc["exclude"] == [node], doc
    assert any(f"stragglers' node(s) {node}" in w for w in doc["warnings"]), doc


def test_status_shows_big_jobs_per_node_and_names_the_straggler(tmp_path):
    """Above 16 ranks the table has a row per node (its ranks' medians); the straggler line still names the
    rank and its node."""
    from rich.console import Console

    from hpcscale.cli.slurm_cmd import format_timing
    from hpcscale.observe.timing import judge

    nodes = [f"n{i // 4 + 1}" for i in range(32)]
    own = [0.010] * 32
    own[13] = 0.02  # on n4
    windows = _windows([own] * WINDOWS, nodes=nodes)
    verdict = judge(windows)
    newest = windows[-1]
    timing = {
        "step": newest.step,
        "steps": newest.steps,
        "attempt": newest.attempt,
        "ranks": [
            {"rank": i, "node": newest.nodes[i], "pp": newest.pp[i], **row} for i, row in enumerate(newest.ranks)
        ],
        "stragglers": verdict.to_json(),
    }
    console = Console(record=True, width=200)
    for line in format_timing(timing, tmp_path):
        console.print(line)
    text = console.export_text()
    rows = [line for line in text.splitlines() if line.startswith("│ n")]
    assert [r.split()[1] for r in rows] == [f"n{i}" for i in range(1, 9)]  # one row per node, not per rank
    assert "straggler: rank 13 on node n4" in text and "--exclude-slow" in text


def test_the_per_rank_plot_covers_every_attempt_even_after_a_move_to_other_nodes():
    """ranks.png has a column for each window of each attempt: a resume that moved off a slow node, or ran on
    fewer ranks, leaves the earlier attempt's columns (the straggler's) in the picture; a rank an attempt did
    not have is blank; the labels name every node a rank ran on."""
    from hpcscale.observe.report import _nodes_of, rank_grid

    first = _windows([[0.01, 0.03, 0.01, 0.01]] * 3, nodes=["n1", "n1", "n2", "n2"])
    second = [parse_line(_window([0.01, 0.01], step=40 + i, attempt=2, nodes=["n3", "n3"])) for i in range(2)]
    grid, per_row = rank_grid(first + second)
    assert per_row == 1 and grid.shape == (4, 5)
    assert grid[1, :3].tolist() == [30.0] * 3 and grid[1, 3:].tolist() == [10.0] * 2  # the slow attempt stays
    assert np.isnan(grid[2:, 3:]).all() and not np.isnan(grid[:, :3]).any()
    assert _nodes_of(first + second, 1) == "n1→n3" and _nodes_of(first + second, 3) == "n2"
    many = [parse_line(_window([0.01] * 300, step=1 + i, attempt=1)) for i in range(2)]
    many.append(parse_line(_window([0.01] * 100 + [0.05], step=3, attempt=2)))
    grid, per_row = rank_grid(many)
    assert per_row == 3 and grid.shape == (100, 3)
    assert grid[33, 2] == 50.0 and np.isnan(grid[34:, 2]).all() and not np.isnan(grid[:, :2]).any()
