"""Spare nodes in the allocation (restart.spare_nodes): which nodes a step runs on, which spare replaces a failed
node, when a failure is relaunched in place, how the batch script is rendered, and how `status` shows a relaunch
and its downtime. The fault injections on the real cluster are in test_resume.py."""

from __future__ import annotations

import json
import shutil
import subprocess
from datetime import datetime, timedelta, timezone

import pytest
from conftest import need, run_cli
from hypothesis import given, settings
from hypothesis import strategies as st
from trainjobs import job_spec

from hpcscale.config.job import JobSpec, Restart, Signals
from hpcscale.errors import BadInput
from hpcscale.observe.downtime import relaunch_downtimes
from hpcscale.recovery.nodes import first_step_nodes, relaunch_nodes, shrink_nodes
from hpcscale.recovery.requeue import Decision, relaunch_here
from hpcscale.slurm import parse
from hpcscale.slurm.status import SACCT_FIELDS, join_attempts, sacct_starts
from hpcscale.topology.tree import build_tree, flat_tree

# the local cluster's tree: leaf1 over n1, n2; leaf2 over n3, n4; one spine
TREE = build_tree([("leaf1", ["n1", "n2"], None), ("leaf2", ["n3", "n4"], None), ("spine", None, ["leaf1", "leaf2"])])
ALL = ["n1", "n2", "n3", "n4"]


def test_the_first_step_takes_the_fullest_leaves_and_leaves_the_rest_spare():
    assert first_step_nodes(ALL, 2, TREE) == ["n1", "n2"]
    assert first_step_nodes(["n4", "n2", "n3"], 2, TREE) == ["n3", "n4"]  # leaf2 holds two of them
    assert first_step_nodes(ALL, 3, TREE) == ["n1", "n2", "n3"]
    with pytest.raises(BadInput, match="the allocation has 2 nodes and the step needs 3"):
        first_step_nodes(["n1", "n2"], 3, TREE)


def test_a_failed_node_is_replaced_by_the_nearest_spare():
    assert relaunch_nodes(["n1", "n3"], ["n3"], ALL, [], TREE) == ["n1", "n4"]  # n4 under n3's own leaf
    assert relaunch_nodes(["n1", "n3"], ["n3"], ["n1", "n2", "n3"], [], TREE) == ["n1", "n2"]  # only n2 is left
    assert relaunch_nodes(["n1", "n2"], ["n2"], ALL, [], TREE) == ["n1", "n3"]  # both spares as near: the first
    assert relaunch_nodes(["n1", "n3"], ["n3"], ALL, ["n4"], TREE) == ["n1", "n2"]  # n4 was blamed before
    assert relaunch_nodes(["n1", "n2"], ["n1", "n2"], ALL, [], TREE) == ["n3", "n4"]
    assert relaunch_nodes(["n1", "n2"], ["n2"], ["n1", "n2"], [], TREE) is None  # no spare
    assert relaunch_nodes(["n1", "n2"], ["n1", "n2"], ["n1", "n2", "n3"], [], TREE) is None  # one spare, two failed


def test_a_suspect_node_of_the_step_is_replaced_while_spares_last_and_kept_after():
    # n1 showed a warning sign of its own (drained) while n2 failed: both replaced, n2 first (it must be)
    assert relaunch_nodes(["n1", "n2"], ["n2"], ALL, [], TREE, suspects=["n1"]) == ["n3", "n4"]
    # one spare: it goes to the failed node; the suspect stays (a suspect node is better than no relaunch)
    assert relaunch_nodes(["n1", "n2"], ["n2"], ["n1", "n2", "n3"], [], TREE, suspects=["n1"]) == ["n1", "n3"]
    # a suspect that is not the step's, or was failed itself, changes nothing
    assert relaunch_nodes(["n1", "n2"], ["n2"], ALL, [], TREE, suspects=["n4", "n2"]) == ["n1", "n3"]


@settings(max_examples=200, deadline=None)
@given(
    leaves=st.lists(st.integers(1, 4), min_size=1, max_size=4),
    data=st.data(),
)
def test_any_allocation_keeps_the_step_whole_and_never_reuses_a_blamed_node(leaves, data):
    entries, hosts = [], []
    for i, size in enumerate(leaves):
        names = [f"h{i}{j}" for j in range(size)]
        entries.append((f"leaf{i}", names, None))
        hosts += names
    entries.append(("top", None, [e[0] for e in entries]))
    tree = build_tree(entries)
    allocation = data.draw(st.lists(st.sampled_from(hosts), min_size=1, unique=True))
    n = data.draw(st.integers(1, len(allocation)))
    step = first_step_nodes(allocation, n, tree)
    assert len(step) == n == len(set(step)) and set(step) <= set(allocation)
    failed = data.draw(st.lists(st.sampled_from(step), min_size=1, unique=True))
    excluded = data.draw(st.lists(st.sampled_from(allocation), unique=True))
    suspects = data.draw(st.lists(st.sampled_from(allocation), unique=True))
    after = relaunch_nodes(step, failed, allocation, excluded, tree, suspects=suspects)
    spares = [h for h in allocation if h not in step and h not in failed and h not in excluded]
    out = set(step) & (set(failed) | set(excluded))
    if len(spares) < len(out):
        assert after is None
        return
    assert after is not None and len(after) == n == len(set(after)) and set(after) <= set(allocation)
    assert not set(after) & (set(failed) | set(excluded))
    healthy = set(step) - set(failed) - set(excluded) - set(suspects)
    assert healthy <= set(after)  # the survivors without a sign stay
    # suspects leave while spares are left after the failed: as many as there were spares for
    suspect_here = (set(step) - set(failed) - set(excluded)) & set(suspects)
    assert len(suspect_here - set(after)) == min(len(suspect_here), len(spares) - len(out))


def _spec(**restart) -> JobSpec:
    return JobSpec(name="t", site="local", signals=Signals(), restart=Restart(**restart))


def _base() -> Decision:
    return Decision("failed", True, "requeue 1 of restart.max_failures = 2", backoff_s=30, attempt=1)


def test_a_relaunch_needs_a_blamed_node_of_the_step_a_spare_and_budget():
    begin = {"event": "begin", "attempt": 1, "job_id": "7", "restart_count": 0, "nodes": ["n1", "n2"]}
    args = {"job_id": "7", "restart_count": 0, "allocation": ALL, "tree": TREE, "base": _base()}
    here = relaunch_here(_spec(max_failures=2, spare_nodes=2), [begin], blamed=["n2"], **args)
    assert here is not None and here.relaunch == ["n1", "n3"] and here.excluded == ["n2"] and not here.requeue
    assert here.backoff_s == 0 and "relaunch 1 of restart.max_failures = 2 in this allocation" in here.why
    assert relaunch_here(_spec(spare_nodes=2), [begin], blamed=[], **args) is None  # no node to blame
    assert relaunch_here(_spec(spare_nodes=2), [begin], blamed=["n4"], **args) is None  # not one of the step's
    spent = [begin, {"event": "end", "attempt": 1, "job_id": "7", "restart_count": 0, "cause": "failed",
                     "relaunch": ["n1", "n3"], "excluded": ["n2"]}]  # fmt: skip
    assert relaunch_here(_spec(max_failures=1, spare_nodes=2), spent, blamed=["n1"], **args) is None
    # the second failure in the allocation: n2, blamed before, is not taken back
    second = [*spent, {**begin, "attempt": 2, "nodes": ["n1", "n3"]}]
    again = relaunch_here(_spec(max_failures=2, spare_nodes=2), second, blamed=["n3"], **args)
    assert again is not None and again.relaunch == ["n1", "n4"]
    # n1 was drained during the attempt (a warning sign): replaced too, and kept out as n2 is; a spare Slurm has
    # down is not chosen
    signed = relaunch_here(
        _spec(max_failures=2, spare_nodes=2), [begin], blamed=["n2"], suspects={"n1": "drain: fan"}, **args
    )
    assert signed.relaunch == ["n3", "n4"] and signed.excluded == ["n2", "n1"]
    assert "n1 left out too for its warning sign (drain: fan)" in signed.why
    down = relaunch_here(
        _spec(max_failures=2, spare_nodes=2), [begin], blamed=["n2"], suspects={"n1": "drain: fan"}, down=["n3"],
        **args,
    )  # fmt: skip
    assert down.relaunch == ["n1", "n4"] and down.excluded == ["n2"]
    assert "n1 kept despite its warning sign (no spare left for it)" in down.why
    # a begin naming nodes outside the allocation (a hand-edited record): no relaunch
    odd = [{**begin, "nodes": ["n1", "x9"]}]
    assert relaunch_here(_spec(spare_nodes=2), odd, blamed=["n1"], **args) is None


def test_with_too_few_spares_a_shrinking_step_takes_as_many_nodes_left_as_fit():
    even = lambda n: n % 2 == 0  # noqa: E731  (a layout that needs an even node count)
    assert shrink_nodes(["n1", "n2", "n3", "n4"], ["n2"], ALL, [], TREE, even) == ["n3", "n4"]  # the fullest leaf
    assert shrink_nodes(["n1", "n2", "n3", "n4"], ["n2"], ALL, [], TREE, lambda n: True) == ["n1", "n3", "n4"]
    assert shrink_nodes(["n1", "n2"], ["n2"], ALL, ["n3", "n4"], TREE, lambda n: True) == ["n1"]
    assert shrink_nodes(["n1", "n2"], ["n2"], ["n1", "n2"], [], TREE, even) is None  # nothing fits
    # never more nodes than the step had: a spare left over is no reason to grow
    assert shrink_nodes(["n1", "n2"], ["n1", "n2"], ["n1", "n2", "n3"], [], TREE, lambda n: True) == ["n3"]
    # a node with a warning sign is left out while the count can be met without it, and kept where it cannot
    assert shrink_nodes(["n1", "n2", "n3", "n4"], ["n2"], ALL, [], TREE, even, suspects=["n3"]) == ["n1", "n4"]
    assert shrink_nodes(ALL, ["n2"], ALL, [], TREE, lambda n: True, suspects=["n3"]) == ["n1", "n3", "n4"]
    assert shrink_nodes(ALL, ["n1", "n2"], ALL, [], TREE, even, suspects=["n3", "n4"]) == ["n3", "n4"]


def test_a_shrink_is_a_relaunch_on_fewer_nodes_only_where_the_job_fits_and_only_when_asked():
    begin = {"event": "begin", "attempt": 1, "job_id": "7", "restart_count": 0, "nodes": ["n1", "n2"]}
    args = {"job_id": "7", "restart_count": 0, "allocation": ["n1", "n2"], "tree": TREE, "base": _base()}
    here = relaunch_here(_spec(max_failures=2, shrink=True), [begin], blamed=["n2"], fits=lambda n: True, **args)
    assert here is not None and here.relaunch == ["n1"] and here.excluded == ["n2"] and not here.requeue
    assert "no spare left: the step shrinks from 2 to 1 node(s) (restart.shrink), the step now on n1" in here.why
    assert relaunch_here(_spec(shrink=True), [begin], blamed=["n2"], fits=lambda n: False, **args) is None
    assert relaunch_here(_spec(), [begin], blamed=["n2"], **args) is None  # not asked: requeued as before
    # spares first: a shrink only once they are spent
    wide = {**args, "allocation": ALL}
    first = relaunch_here(_spec(spare_nodes=2, shrink=True), [begin], blamed=["n2"], fits=lambda n: True, **wide)
    assert first is not None and first.relaunch == ["n1", "n3"] and "shrinks" not in first.why
    # a shrink leaves a node with a warning sign out where the step fits without it, and keeps it out after
    four = {**begin, "nodes": ALL}
    even = lambda n: n % 2 == 0  # noqa: E731
    signed = relaunch_here(
        _spec(max_failures=2, shrink=True), [four], blamed=["n2"], fits=even, suspects={"n3": "drain: fan"}, **wide
    )
    assert signed is not None and signed.relaunch == ["n1", "n4"] and signed.excluded == ["n2", "n3"]
    assert "n3 left out too for its warning sign (drain: fan)" in signed.why and "shrinks from 4 to 2" in signed.why


def test_the_batch_script_runs_its_steps_on_the_chosen_nodes_and_passes_shellcheck(tmp_path):
    job = job_spec(tmp_path / "job.yaml", tp=1, pp=1, ranks=4, site="localcluster", nodes=2)
    spec = job.read_text() + "restart:\n  spare_nodes: 2\n"
    job.write_text(spec)
    r = run_cli("render", str(job), "--run-dir", str(tmp_path / "run"))
    assert r.returncode == 0, r.stderr
    text = r.stdout
    assert "#SBATCH --nodes=4\n" in text and "#SBATCH --no-kill\n" in text
    assert '--overlap --nodes="$step_n" --ntasks="$((step_n * 2))" --nodelist="$nodes" hpcscale launch' in text
    assert 'step_n=$(scontrol show hostnames "$nodes" | wc -l)' in text  # a step may shrink: counted each time
    assert 'nodes=$(hpcscale step-nodes "$HPCSCALE_RUN_DIR")' in text
    assert 'nodes=$(hpcscale requeue "$HPCSCALE_RUN_DIR" --exit-code "$rc" --in-place)' in text
    need(shutil.which("shellcheck") is not None, "shellcheck (Debian package)")
    (tmp_path / "s.sbatch").write_text(text)
    out = subprocess.run(["shellcheck", "--shell=bash", str(tmp_path / "s.sbatch")], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout


def test_step_nodes_outside_a_job_is_refused(tmp_path):
    job = job_spec(tmp_path / "job.yaml", tp=1, pp=1, ranks=4, site="localcluster", nodes=2)
    r = run_cli("submit", str(job), "--dry-run", "--run-dir", str(tmp_path / "run"))
    assert r.returncode == 0, r.stderr
    out = run_cli("step-nodes", str(tmp_path / "run"), env={"SLURM_JOB_NODELIST": ""})
    assert out.returncode == 2 and "SLURM_JOB_NODELIST is not set" in out.stderr, out.stderr
    out = run_cli("step-nodes", str(tmp_path / "run"), env={"SLURM_JOB_NODELIST": "n[2-4]"})
    assert out.returncode == 0 and out.stdout.strip() in ("n[3-4]", "n[2-3]"), out.stdout + out.stderr


T0 = datetime(2026, 11, 28, 9, 0, 0, tzinfo=timezone.utc)


def _at(s: float) -> str:
    return (T0 + timedelta(seconds=s)).isoformat()


def test_status_shows_each_step_of_an_allocation_and_how_long_training_stopped():
    events = [
        {"event": "begin", "attempt": 1, "job_id": "9", "restart_count": 0, "nodes": ["n1", "n2"], "time": _at(0)},
        {"event": "end", "attempt": 1, "job_id": "9", "restart_count": 0, "cause": "failed", "exit_code": 137,
         "requeue": False, "relaunch": ["n1", "n3"], "excluded": ["n2"], "why": "relaunch 1", "time": _at(30)},
        {"event": "begin", "attempt": 2, "job_id": "9", "restart_count": 0, "nodes": ["n1", "n3"], "time": _at(34)},
        {"event": "end", "attempt": 2, "job_id": "9", "restart_count": 0, "cause": "completed", "exit_code": 0,
         "requeue": False, "why": "the job finished", "time": _at(90)},
    ]  # fmt: skip
    t0 = T0.timestamp()
    rows = [
        {"attempt": 1, "step": 40, "loss": 3.0, "time": t0 + 25},
        {"attempt": 2, "step": 39, "restored_from": 40, "restore_s": 0.5, "time": t0 + 37},
        {"attempt": 2, "step": 40, "loss": 3.0, "time": t0 + 38},
    ]
    downtimes = relaunch_downtimes(events, rows)
    assert downtimes == {1: {"detect_s": 5.0, "start_s": 4.0, "load_s": 0.5, "first_step_s": 4.0, "total_s": 13.0}}
    attempts, _ = join_attempts("9", [], events, now=T0 + timedelta(seconds=100), downtimes=downtimes)
    assert [a.state for a in attempts] == ["RELAUNCHED", "UNKNOWN"]
    assert [a.nodes for a in attempts] == ["n1,n2", "n1,n3"]
    first = attempts[0]
    assert first.relaunch == "n1,n3" and "relaunched in the same allocation: relaunch 1" in first.summary
    assert "training stopped 13.0 s (detection 5.0 s, step start 4.0 s, load 0.5 s, first step 4.0 s)" in first.summary
    # values of the wrong type from a hand-edited file: no part is made up
    bad = relaunch_downtimes([{**events[1], "time": "yesterday"}, events[2]], [{**rows[0], "time": "x"}])
    assert bad == {1: {"detect_s": None, "start_s": None, "load_s": None, "first_step_s": None, "total_s": None}}
    json.dumps([a.downtime for a in attempts])


def test_without_a_tree_the_spare_is_the_first_free_node():
    flat = flat_tree(ALL)
    assert relaunch_nodes(["n1", "n2"], ["n1"], ALL, [], flat) == ["n2", "n3"]


def test_a_job_slurm_resized_is_one_start_not_a_requeue():
    """A failed node removed from a --no-kill job: `sacct -X -D` ends the job's record where it was resized
    (RESIZING) and goes on in a new one, as the local cluster printed it; both are one start, restart count 0."""
    d = parse.SACCT_DELIMITER
    text = (
        f"569{d}RESIZING{d}0:0{d}n[1-4]{d}00:00:12{d}2026-11-28T11:26:04{d}2026-11-28T11:26:16{d}tiny\n"
        f"569{d}COMPLETED{d}0:0{d}n[1,3-4]{d}00:00:42{d}2026-11-28T11:26:16{d}2026-11-28T11:26:58{d}tiny\n"
    )
    ((name, starts),) = sacct_starts(parse.sacct_rows(text, SACCT_FIELDS))["569"].values()
    assert name == "tiny" and [(a.restart, a.state, a.nodes, a.start) for a in starts] == [
        (0, "COMPLETED", "n[1,3-4]", "2026-11-28T11:26:04")
    ]


def test_the_report_says_how_long_training_stopped_at_each_relaunch(tmp_path):
    from hpcscale.observe.report import read_run, render_markdown, summarize

    t0 = T0.timestamp()
    rows = [
        {"step": 40, "loss": 3.0, "attempt": 1, "time": t0 + 25},
        {"step": 39, "restored_from": 40, "restore_s": 0.5, "attempt": 2, "time": t0 + 37},
        {"step": 40, "loss": 3.0, "attempt": 2, "time": t0 + 38},
    ]
    events = [
        {"event": "begin", "attempt": 1, "job_id": "9", "restart_count": 0, "time": _at(0)},
        {"event": "end", "attempt": 1, "job_id": "9", "restart_count": 0, "cause": "failed", "relaunch": ["n1", "n3"],
         "time": _at(30)},
        {"event": "begin", "attempt": 2, "job_id": "9", "restart_count": 0, "time": _at(34)},
    ]  # fmt: skip
    (tmp_path / "job.yaml").write_text("name: m\n")
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "attempts.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    s = summarize(read_run(tmp_path), None, [])
    assert s["relaunches"] == [
        {"attempt": 1, "detect_s": 5.0, "start_s": 4.0, "load_s": 0.5, "first_step_s": 4.0, "total_s": 13.0}
    ]
    assert (
        "| relaunched in place after attempt 1 | training stopped 13.0 s (detection 5.0 s, step start 4.0 s, "
        "load 0.5 s, first step 4.0 s) |" in render_markdown(s)
    )
