"""Recovery decides from what verifies, never from what is merely listed, and its arithmetic stays bounded
whatever the run directory's files say.

- The checkpoint tier a restart loads (hpcscale.launch.checkpointing): with the shared tier's newest step
  damaged, a newer node-local step is taken over an older shared one (real ranks through `run --local`, the
  losses bitwise those of the uninterrupted run).
- The failure backoff of the requeue decision (hpcscale.recovery.requeue): doubled per failure up to
  restart.max_backoff_seconds, however many failures RUN/attempts.jsonl counts; absurd settings are refused
  by validation (exit 2, FILE:LINE: KEY).
- Progress between attempts (restart.max_no_progress): a checkpoint committed since the previous attempt's end,
  not a newer newest step: a damaged newest step stays listed while the attempts after it commit older steps.
- The placement `resume` works out from an attempt's `begin` record (rank -> node) is bounded in ranks.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from conftest import REPO, run_cli
from hypothesis import given, settings
from hypothesis import strategies as st
from trainjobs import job_spec

from hpcscale.ckpt.format import committed_steps
from hpcscale.config.job import MAX_BACKOFF_S, JobSpec, Restart, Signals
from hpcscale.recovery.nodes import MAX_RANKS, rank_nodes
from hpcscale.recovery.requeue import committed_now, decide, failure_backoff


# ---- which checkpoint a restart loads --------------------------------------------------------------------------
def _node_local_job(tmp: Path, steps: int) -> Path:
    """The built-in trainer on 2 ranks, node-local saves every 2 steps, shared saves every 4 (drained from the
    node-local tier; the end of the run saved to the shared tier itself)."""
    site = tmp / "site.yaml"
    local = yaml.safe_load((REPO / "site_configs" / "local.yaml").read_text())
    local["filesystems"]["node_local"] = str(tmp / "node-local")
    site.write_text(yaml.safe_dump(local))
    job = job_spec(tmp / "job.yaml", tp=1, pp=1, ranks=2, steps=steps, log_every=1)
    spec = yaml.safe_load(job.read_text())
    spec["site"] = str(site)
    spec["checkpoint"] = {"every_steps": 4, "local": {"every_steps": 2}}
    job.write_text(yaml.safe_dump(spec))
    return job


def _loss_rows(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss" in r]


def _flip_a_byte(step_dir: Path) -> None:
    data = sorted((step_dir / "data").glob("*.bin"))[0]
    with open(data, "r+b") as f:
        b = f.read(1)
        f.seek(0)
        f.write(bytes([b[0] ^ 0xFF]))


@pytest.mark.parametrize(
    ("damaged", "why"),
    [
        ((8,), "newer than step 4, the shared tier's newest that every rank can load"),
        ((8, 4), "no step of the shared tier loads on every rank"),
    ],
    ids=["newest", "every-shared-step"],
)
def test_a_damaged_shared_step_gives_way_to_a_newer_node_local_step_not_an_older_shared_one(
    mpi, tmp_path, damaged, why
):
    """Shared tier: steps 4 (drained) and 8 (the end of the run); node-local tier: 4 and 6. Step 8 damaged (and
    step 4 too): the restart takes node-local step 6, newer than any shared step that loads, says which tier
    and why, and trains steps 6 and 7 again to the same losses bit for bit."""
    job = _node_local_job(tmp_path, steps=8)
    run = tmp_path / "run"
    first = run_cli("run", str(job), "--local", "--run-dir", str(run), timeout=600)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert committed_steps(run / "checkpoints")[:2] == [8, 4]
    (node,) = (tmp_path / "node-local").glob("hpcscale-*")
    assert committed_steps(node)[0] == 6
    want = {r["step"]: r["loss"] for r in _loss_rows(run)}
    for step in damaged:
        _flip_a_byte(run / "checkpoints" / f"step-{step:08d}")

    again = run_cli("run", str(job), "--local", "--run-dir", str(run), "--reuse", timeout=600)
    log = again.stdout + again.stderr
    assert again.returncode == 0, log[-3000:]
    for step in damaged:
        assert f"refusing checkpoint step-{step:08d}" in log, log[-3000:]
    m = re.search(r"resumed from checkpoint step (\d+) of the (\S+) tier \(([^\n]*)\)", log)
    assert m and (int(m.group(1)), m.group(2)) == (6, "node-local"), log[-3000:]
    assert why in m.group(3), log[-3000:]
    resumed = [r for r in _loss_rows(run) if r.get("attempt") == 2]
    assert [r["step"] for r in resumed] == [6, 7], resumed
    for r in resumed:
        assert r["loss"] == want[r["step"]], (r, want)
    # the refused step 8 was set aside when the run saved step 8 again, and that save verifies
    assert list((run / "checkpoints" / "refused").glob("step-00000008-*"))
    assert run_cli("ckpt", "verify", str(run / "checkpoints" / "step-00000008")).returncode == 0


# ---- the failure backoff ----------------------------------------------------------------------------------------
@settings(max_examples=300, deadline=None)
@given(
    base=st.integers(0, MAX_BACKOFF_S),
    cap=st.integers(0, MAX_BACKOFF_S),
    used=st.one_of(st.integers(0, 80), st.integers(0, 10**12)),
)
def test_the_backoff_doubles_up_to_its_cap_and_never_builds_2_to_the_used(base, cap, used):
    got = failure_backoff(base, used, cap)
    if used <= 80:
        assert got == min(cap, base * 2**used)
    else:
        assert got == (cap if base and cap else 0)  # 2^used beyond any cap, computed without it
    assert 0 <= got <= cap


def _failed_ends(n: int, job: str = "7") -> list[dict]:
    return [{"event": "end", "job_id": job, "cause": "failed", "requeue": True, "progress": True, "checkpoint": i}
            for i in range(n)]  # fmt: skip


def test_a_long_attempt_log_waits_the_cap_not_2_to_the_power_of_its_length():
    """200,000 failures requeued before (a log others can append to, or a long run with a large budget): the
    wait is restart.max_backoff_seconds, decided at once (uncapped, 30 x 2^200000 s has 60,000 digits: the
    batch script's decision died formatting it, and time.sleep refuses it with OverflowError)."""
    spec = JobSpec(name="t", site="local", signals=Signals(), restart=Restart(max_failures=10**9))
    d = decide(spec, _failed_ends(200_000), job_id="7", cause="failed", checkpoint=200_000)
    assert d.requeue and d.backoff_s == 600
    spec = JobSpec(name="t", site="local", signals=Signals(),
                   restart=Restart(max_failures=10, failure_backoff_seconds=30, max_backoff_seconds=100))  # fmt: skip
    waits = [decide(spec, _failed_ends(n), job_id="7", cause="failed", checkpoint=n).backoff_s for n in range(5)]
    assert waits == [30, 60, 100, 100, 100]
    spec = JobSpec(name="t", site="local", signals=Signals(),
                   restart=Restart(failure_backoff_seconds=900, max_backoff_seconds=120))  # fmt: skip
    assert decide(spec, [], job_id="7", cause="failed", checkpoint=1).backoff_s == 120  # capped from the first


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("failure_backoff_seconds", MAX_BACKOFF_S + 1),
        ("max_backoff_seconds", 10**12),
        ("max_backoff_seconds", 10**400),
        ("failure_backoff_seconds", -1),
    ],
)
def test_an_absurd_backoff_setting_is_refused_with_its_file_line_and_key(tmp_path, key, value):
    job = tmp_path / "job.yaml"
    job.write_text(f"name: t\nsite: local\ntrain:\n  entry: builtin\nrestart:\n  max_failures: 3\n  {key}: {value}\n")
    out = run_cli("config", "validate", str(job))
    assert out.returncode == 2, out.stdout + out.stderr
    assert f"{job}:7: restart.{key}:" in out.stdout + out.stderr, out.stdout + out.stderr


# ---- progress between attempts ----------------------------------------------------------------------------------
def _commit(root: Path, step: int) -> None:
    """What the listing of committed checkpoints sees of a commit: the step's index file, put in place last."""
    d = root / f"step-{step:08d}"
    (d / "data").mkdir(parents=True)
    (d / "index.h5").write_bytes(b"index of step %d" % step)


def _ended(root: Path, spec: JobSpec, events: list[dict], *, commits: list[int]) -> dict:
    """An attempt of job 7 that committed `commits` and failed: its `end` event, as after_step records it."""
    for step in commits:
        _commit(root, step)
    committed = committed_now(root)
    d = decide(spec, events, job_id="7", cause="failed", checkpoint=committed[0][0] if committed else None,
               committed=committed)  # fmt: skip
    return {"event": "end", "job_id": "7", "cause": "failed", "requeue": d.requeue, "progress": d.progress,
            "checkpoint": d.checkpoint, "committed": d.committed, "why": d.why}  # fmt: skip


def test_attempts_that_commit_below_a_damaged_newest_step_make_progress(tmp_path):
    """Steps 4 and 8 committed, 8 damaged: the next attempts load 4 and commit 5, then 6, then fail. Each made
    progress (judged by the newest listed step, 8 throughout, they made none, and the second was the last:
    restart.max_no_progress = 2). An attempt that commits nothing makes none; step 8 saved again after its
    refused copy was set aside is a new checkpoint."""
    root = tmp_path / "checkpoints"
    spec = JobSpec(name="t", site="local", signals=Signals(), restart=Restart(max_failures=10, max_no_progress=2))
    events = [_ended(root, spec, [], commits=[4, 8])]
    for step in (5, 6):
        events.append(_ended(root, spec, events, commits=[step]))
        assert events[-1]["progress"] and events[-1]["requeue"], events[-1]
    events.append(_ended(root, spec, events, commits=[]))
    assert not events[-1]["progress"] and events[-1]["requeue"], events[-1]  # the first without progress
    (root / "refused").mkdir()
    (root / "step-00000008").rename(root / "refused" / "step-00000008-20261128T000000Z")
    events.append(_ended(root, spec, events, commits=[8]))
    assert events[-1]["progress"] and events[-1]["requeue"], events[-1]
    events.append(_ended(root, spec, events, commits=[]))
    events.append(_ended(root, spec, events, commits=[]))
    assert not events[-1]["requeue"] and "no new checkpoint in 2 consecutive attempts" in events[-1]["why"]


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(checkpoint=JSON, committed=JSON, progress=JSON, requeue=JSON)
def test_an_end_event_others_wrote_never_breaks_the_decision(checkpoint, committed, progress, requeue):
    """RUN/attempts.jsonl may be appended to by others: whatever its last `end` event holds, the decision is
    made (no TypeError comparing a step with a string), and a list that is not one of [step, identity] pairs
    counts as none."""
    spec = JobSpec(name="t", site="local", signals=Signals(), restart=Restart(max_failures=3))
    end = {"event": "end", "job_id": "7", "cause": "failed", "checkpoint": checkpoint, "committed": committed,
           "progress": progress, "requeue": requeue}  # fmt: skip
    for now in ([[12, "1:2"]], None):
        d = decide(spec, [end], job_id="7", cause="failed", checkpoint=12, committed=now)
        assert isinstance(d.progress, bool) and isinstance(d.requeue, bool)


# ---- the placement of a begin record ----------------------------------------------------------------------------
def test_a_begin_record_claiming_a_huge_world_is_not_enumerated():
    """A `begin` record (RUN/attempts.jsonl) saying 10^12 ranks on one node, its layout agreeing: neither the
    rank -> node list nor the layout (whose groups the NCCL timeout diagnosis enumerates) is taken; before the
    bound, resume built a list of 10^12 names. A real record's placement is still worked out."""
    huge = {"event": "begin", "job_id": "7", "nodes": ["n1"], "world_size": 10**12,
            "layout": {"pp": 1, "dp": 10**12, "tp": 1}}  # fmt: skip
    assert rank_nodes([huge], "7") == (None, None)
    edge = {
        **huge,
        "world_size": MAX_RANKS + 2,
        "nodes": ["n1", "n2"],
        "layout": {"pp": 1, "dp": MAX_RANKS + 2, "tp": 1},
    }
    assert rank_nodes([edge], "7") == (None, None)
    real = {**huge, "world_size": 4, "nodes": ["n1", "n2"], "layout": {"pp": 1, "dp": 2, "tp": 2}}
    dims, placement = rank_nodes([real], "7")
    assert dims.world_size == 4 and placement == ["n1", "n1", "n2", "n2"]
