"""The node-local checkpoint tier with real gloo ranks and real files, each emulated node a directory of its
own: partner copies, recovery from what the surviving nodes hold (a lost node's part from its partner, moved
over the process group), a corrupt copy refused for the partner's, two lost partners leaving no complete step,
a full node-local disk failing the save on every rank alike, a stop signal during a node-local save (`run --local`).
On the Slurm cluster: tests/recovery/test_resume.py."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import REPO, need, run_cli
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from trainjobs import job_spec

from hpcscale.ckpt import nodelocal
from hpcscale.ckpt.format import committed_steps
from hpcscale.launch.signals import STOP_LINE

HELPER = REPO / "tests" / "helpers" / "nodelocal_ranks.py"
# the tests that start ranks (_run: one gloo process per emulated node) belong to the slow tier, as those with
# the `mpi` fixture do (tests/conftest.py); the record, batching and partner tests stay in the fast tier
starts_ranks = pytest.mark.slow


def _run(
    tmp: Path, name: str, *, nodes: list[str], action: str, partners: int = 1, env=None, fails=False, **extra
) -> list[dict]:
    spec = {
        "world": len(nodes),
        "store": str(tmp / f"store-{name}"),
        "base": str(tmp / "nodes"),
        "out": str(tmp / name),
        "nodes": nodes,
        "partners": partners,
        "action": action,
        **extra,
    }
    procs = [
        subprocess.Popen(
            [sys.executable, str(HELPER), json.dumps(spec), str(r)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, **(env or {})},
        )
        for r in range(len(nodes))
    ]
    if fails:  # a rank kills itself: the others are ended as mpirun would, once it is gone
        while all(p.poll() is None for p in procs):
            time.sleep(0.1)
        time.sleep(0.5)
        for p in procs:
            p.kill()
        return [p.communicate()[0] for p in procs]
    logs = [p.communicate(timeout=240)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)
    _run.logs = "\n".join(logs)
    return [json.loads(Path(f"{tmp / name}.rank-{r}").read_text()) for r in range(len(nodes))]


def _files(node_dir: Path, step: int) -> set[str]:
    return {p.name for p in (node_dir / f"step-{step:08d}" / "data").glob("*.bin")}


def test_partners_sit_under_another_leaf_switch_or_the_same_one():
    order = ["n1", "n2", "n3", "n4"]
    leaf = {"n1": "s1", "n2": "s1", "n3": "s2", "n4": "s2"}
    other = nodelocal.plan_partners(order, 1, leaf, rule="other")
    assert all(leaf[p] != leaf[n] for n, (p,) in other.items())
    same = nodelocal.plan_partners(order, 1, leaf, rule="same")
    assert sum(leaf[p] == leaf[n] for n, (p,) in same.items()) >= 2  # a ring: n2 -> n3 crosses either way
    held = [p for ps in nodelocal.plan_partners(order, 2, leaf, rule="other").values() for p in ps]
    assert sorted(held) == sorted(order * 2)  # every node holds exactly k others' copies
    assert nodelocal.plan_partners(["n1"], 3, {}) == {"n1": ()}


@starts_ranks
def test_a_lost_node_is_recovered_from_its_partner_and_a_new_node_gets_what_its_ranks_need(tmp_path):
    nodes = ["a", "a", "b", "b"]
    saved = _run(tmp_path, "save", nodes=nodes, action="save", steps=[10, 20])
    assert all(s == {"10": "saved", "20": "saved"} for s in saved), saved
    base = tmp_path / "nodes"
    both = _files(base / "a", 20)
    assert both == _files(base / "b", 20) and len(both) >= 3  # each node: its own ranks' files and its partner's
    assert sorted(p.name for p in (base / "a").iterdir() if p.name.startswith("step-")) == [
        "step-00000010",
        "step-00000020",
    ]
    shutil.rmtree(base / "b")  # node b is lost; c replaces it, empty
    loaded = _run(tmp_path, "load", nodes=["a", "a", "c", "c"], action="load")
    assert [r["step"] for r in loaded] == [20] * 4 and all(r["ok"] for r in loaded), loaded
    files, nbytes = loaded[0]["moved"]
    assert files >= 1 and nbytes > 0  # c's ranks' data came from a, over the process group
    assert (base / "c" / "step-00000020" / "index.h5").is_file()


@starts_ranks
def test_a_node_local_step_loads_into_another_layout_after_a_lost_node(tmp_path):
    """Saved by 4 ranks (dp 4) on two nodes, node b lost, loaded by 2 ranks (dp 2) on a and a new node c: each
    rank needs every tensor, so c gets the data of all four writers, from a's own files and its partner copies."""
    _run(tmp_path, "save", nodes=["a", "a", "b", "b"], action="save", steps=[10])
    shutil.rmtree(tmp_path / "nodes" / "b")
    loaded = _run(tmp_path, "load", nodes=["a", "c"], action="load")
    assert [r["step"] for r in loaded] == [10, 10] and all(r["ok"] for r in loaded), loaded
    files, nbytes = loaded[0]["moved"]
    assert files >= 2 and nbytes > 0, loaded


@starts_ranks
def test_a_corrupt_copy_is_refused_and_the_partners_copy_is_taken(tmp_path):
    nodes = ["a", "b", "c", "d"]  # flat: partners two apart, a <-> c, b <-> d
    _run(tmp_path, "save", nodes=nodes, action="save", steps=[10])
    base = tmp_path / "nodes"
    mine = base / "a" / "step-00000010" / "data" / "rank-00000.bin"
    assert mine.is_file() and (base / "c" / "step-00000010" / "data" / "rank-00000.bin").is_file()
    data = bytearray(mine.read_bytes())
    data[100] ^= 0xFF
    mine.write_bytes(bytes(data))
    loaded = _run(tmp_path, "load", nodes=nodes, action="load")
    assert [r["step"] for r in loaded] == [10] * 4 and all(r["ok"] for r in loaded), loaded
    assert "rank-00000.bin: the chunk at offset" in _run.logs  # said, then replaced by c's copy
    assert loaded[0]["moved"][0] >= 1


@starts_ranks
def test_a_node_lost_before_its_partner_copies_leaves_keep_last_whole_steps_behind(tmp_path):
    """keep_last 2: steps 10 and 20 saved with their partner copies; node b killed (-9) in step 30 after every
    node installed it but before the partner copies. Node a must still hold two whole steps before 30 (a step is
    not counted towards keep_last until its copies are made): with a's copy of b's part of step 20 corrupted too,
    a load without b takes step 10 (30 is not whole, 20 not any more), not nothing."""
    nodes = ["a", "a", "b", "b"]
    _run(tmp_path, "save", nodes=nodes, action="save", steps=[10, 20])
    _run(tmp_path, "save-killed", nodes=nodes, action="save", steps=[30], env={"HPCSCALE_CKPT_FAULT": "partner_copy@2"},
         fails=True)  # fmt: skip
    base = tmp_path / "nodes"
    held = sorted(p.name for p in (base / "a").iterdir() if p.name.startswith("step-"))
    assert held == ["step-00000010", "step-00000020", "step-00000030"], held
    b_file = next(iter(_files(base / "a", 20) - {"rank-00000.bin", "rank-00001.bin"}))
    copy = base / "a" / "step-00000020" / "data" / b_file
    data = bytearray(copy.read_bytes())
    data[100] ^= 0xFF
    copy.write_bytes(bytes(data))
    shutil.rmtree(base / "b")
    loaded = _run(tmp_path, "load", nodes=["a", "a", "c", "c"], action="load")
    assert [r["step"] for r in loaded] == [10] * 4 and all(r["ok"] for r in loaded), _run.logs


@starts_ranks
def test_two_lost_nodes_that_partner_each_other_leave_no_complete_step(tmp_path):
    nodes = ["a", "b", "c", "d"]
    _run(tmp_path, "save", nodes=nodes, action="save", steps=[10])
    base = tmp_path / "nodes"
    shutil.rmtree(base / "a")
    shutil.rmtree(base / "c")  # a's partner
    loaded = _run(tmp_path, "load", nodes=["e", "b", "f", "d"], action="load")
    assert [r["step"] for r in loaded] == [None] * 4  # the caller falls back to the shared tier


@starts_ranks
def test_a_step_older_than_the_shared_tiers_newest_is_not_taken(tmp_path):
    nodes = ["a", "b"]
    _run(tmp_path, "save", nodes=nodes, action="save", steps=[10])
    loaded = _run(tmp_path, "load", nodes=nodes, action="load", at_least=11)
    assert [r["step"] for r in loaded] == [None, None]


@starts_ranks
def test_a_full_node_local_disk_fails_the_save_on_every_rank_alike_and_keeps_the_older_step(tmp_path):
    base = tmp_path / "nodes"
    (base / "b").mkdir(parents=True)
    # mode 0700: the node's directory of the run (a fresh tmpfs is 1777, and the tier refuses a directory others
    # can write)
    opts = "size=64k,mode=0700"
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(base / "b")], capture_output=True)
    need(mounted.returncode == 0, f"mounting a tmpfs (root): {mounted.stderr.decode().strip()}")
    try:
        saved = _run(tmp_path, "save", nodes=["a", "b"], action="save", steps=[10])
    finally:
        subprocess.run(["umount", "-l", str(base / "b")], check=False)
    # rank 1 (node b) writes about 200 KB: it fails, and so does the save on both ranks, with the same words
    assert saved[0] == saved[1] and "No space left on device" in saved[0]["10"], saved
    assert not list((base / "a").glob("step-*"))  # committed on every node or on none


def _record(tmp: Path, data) -> Path:
    path = tmp / nodelocal.RECORD
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def test_resume_reads_the_record_to_pick_the_surviving_holders(tmp_path):
    rec = {
        "step": 40,
        "nodes": ["n1", "n2", "n3"],
        "holders": {
            "step-00000040/data/rank-00000.bin": ["n1", "n2"],
            "step-00000040/data/rank-00001.bin": ["n2", "n3"],
        },
    }
    path = _record(tmp_path, rec)
    choice = nodelocal.plan_from_record(path, lost={"n2"}, max_nodes=3)
    assert (choice.step, choice.nodes) == (40, ["n1", "n3"])
    assert nodelocal.plan_from_record(path, lost={"n2"}, max_nodes=1).step is None  # needs 2 nodes
    lost_both = nodelocal.plan_from_record(path, lost={"n1", "n2"}, max_nodes=3)
    assert lost_both.step is None and "held only by lost nodes (n1, n2)" in lost_both.why
    assert (
        nodelocal.plan_from_record(tmp_path / "none.json", lost=set(), max_nodes=2).why == "no node-local step recorded"
    )


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
        max_leaves=20,
    )
    | st.fixed_dictionaries(
        {
            "step": st.integers(-2, 50) | st.text(max_size=3),
            "nodes": st.lists(st.sampled_from(["n1", "n2", "n3"]) | st.integers(), max_size=4),
            "holders": st.dictionaries(st.text(max_size=6), st.lists(st.sampled_from(["n1", "n2", "n3"]), max_size=3)),
        }
    ),
    st.sets(st.sampled_from(["n1", "n2", "n3"])),
)
def test_a_crafted_record_never_raises_and_never_names_a_lost_node(tmp_path, data, lost):
    """The record is a file in the run directory: whatever it holds, resume gets a choice or a reason."""
    choice = nodelocal.plan_from_record(_record(tmp_path, data), lost=lost, max_nodes=2)
    assert isinstance(choice.why, str)
    if choice.step is not None:
        assert type(choice.step) is int and choice.step >= 0
        assert choice.nodes and not set(choice.nodes) & lost and len(choice.nodes) <= 2
        for held in data["holders"].values():  # every file on a chosen node
            assert set(held) & set(choice.nodes)


def _hashes(root: Path, step: int) -> dict[str, list[list[str]]]:
    from hpcscale.ckpt.format import read_index

    index = read_index(root / f"step-{step:08d}" / "index.h5")
    return {t: [[c.hash for c in sh.chunks] for sh in index.tensors[t].shards] for t in index.tensors}


@starts_ranks
def test_a_drain_ships_only_the_chunks_the_shared_tier_lacks_and_commits_the_same_content(tmp_path):
    nodes = ["a", "a", "b", "b"]
    out = _run(tmp_path, "drain", nodes=nodes, action="drain", steps=[2, 4])
    shared = tmp_path / "nodes" / "shared"
    frozen = (1 << 18) * 2  # bf16 bytes of the one tensor that never changes
    assert sum(o["2"]["referenced"] for o in out) == 0
    assert sum(o["4"]["referenced"] for o in out) == frozen  # the second drain does not write it again
    assert sum(o["4"]["new"] for o in out) == sum(o["2"]["new"] for o in out) - frozen
    for step in (2, 4):  # the same chunks, tensor by tensor, as the node-local step it came from
        assert _hashes(shared, step) == _hashes(tmp_path / "nodes" / "a", step)
        # one format across tiers: the same root digest, though the shared step 4 keeps a chunk in step 2's file
        digests = {
            (root / f"step-{step:08d}" / "DIGEST").read_text() for root in (shared, *(tmp_path / "nodes").glob("[ab]"))
        }
        assert len(digests) == 1, digests
        done = subprocess.run(
            [sys.executable, "-m", "hpcscale", "ckpt", "verify", str(shared / f"step-{step:08d}")],
            capture_output=True,
            text=True,
        )
        assert done.returncode == 0, done.stdout + done.stderr
    # the drained step 4 refers to step 2's files for the frozen tensor: incremental on the shared tier
    from hpcscale.ckpt.format import read_index

    index = read_index(shared / "step-00000004" / "index.h5")
    assert any(f.startswith("step-00000002/") for f in index.files())
    # the node-local step's lineage, parent included: the checkpoint saved before it in this run, on any tier
    assert index.trainer_state["lineage"]["parent"] == "step-00000002" and index.parent == "step-00000002"


@starts_ranks
def test_kill_9_during_a_drain_leaves_the_shared_tiers_previous_step_whole(tmp_path):
    nodes = ["a", "a", "b", "b"]
    _run(tmp_path, "drain-ok", nodes=nodes, action="drain", steps=[2])
    logs = _run(
        tmp_path, "drain-killed", nodes=nodes, action="drain", steps=[4], env={"HPCSCALE_CKPT_FAULT": "drain_read@1"},
        fails=True,
    )  # fmt: skip
    shared = tmp_path / "nodes" / "shared"
    assert (tmp_path / "nodes" / "a" / "step-00000004" / "index.h5").exists(), logs  # saved locally, not drained
    assert sorted(p.name for p in shared.glob("step-*")) == ["step-00000002"]
    assert (shared / "LATEST").read_text().strip() == "step-00000002"
    done = subprocess.run(
        [sys.executable, "-m", "hpcscale", "ckpt", "verify", str(shared)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5), st.just("f")), max_size=60).map(
        lambda xs: [(a, b, f) for a, b, f in xs if a != b]
    ),
    st.integers(1, 4),
)
def test_transfer_batches_keep_every_rank_under_the_window_and_the_list_in_order(transfers, window):
    runs = nodelocal.batches(transfers, window)
    assert [i for r in runs for i in r] == list(range(len(transfers)))  # every transfer once, in order
    for r in runs:
        assert len(r) > 0
        for rank in range(6):
            assert sum(rank in transfers[i][:2] for i in r) <= window


def test_a_stop_signal_waits_for_the_node_local_save_in_flight_before_the_ranks_exit(mpi, tmp_path):
    """`hpcscale run --local -n 2` with the node-local tier, every node-local save's write held back 4 s
    (HPCSCALE_CKPT_SLOW_WRITE): SIGTERM to the front end once a node-local save is in flight. The ranks stop with
    the stop's checkpoint (exit 75), and before their process groups go the node-local save in flight commits:
    every node-local step the run handed over is committed and verifies, and no unfinished save is left."""
    site = tmp_path / "site.yaml"
    local = yaml.safe_load((REPO / "site_configs" / "local.yaml").read_text())
    local["filesystems"]["node_local"] = str(tmp_path / "node-local")
    site.write_text(yaml.safe_dump(local))
    job = job_spec(tmp_path / "job.yaml", tp=1, pp=1, ranks=2, steps=100000, log_every=1)
    spec = yaml.safe_load(job.read_text())
    spec["site"] = str(site)
    spec["checkpoint"] = {"every_steps": 0, "local": {"every_steps": 2}}
    job.write_text(yaml.safe_dump(spec))
    run, out = tmp_path / "run", tmp_path / "out.txt"
    env = {**os.environ, "HPCSCALE_CKPT_SLOW_WRITE": "4@2:node-local"}
    with open(out, "w") as f:
        front = subprocess.Popen(
            ["hpcscale", "run", str(job), "--local", "-n", "2", "--run-dir", str(run)],
            stdout=f,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env=env,
        )

    def local_saves() -> list[int]:
        metrics = run / "metrics.jsonl"
        rows = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.exists() else []
        return [r["local_checkpoint"] for r in rows if "local_checkpoint" in r]

    try:
        deadline = time.monotonic() + 180
        while not local_saves():  # logged once the save is handed to the writer thread: in flight for 4 s
            assert front.poll() is None and time.monotonic() < deadline, out.read_text()[-3000:]
            time.sleep(0.05)
        front.send_signal(signal.SIGTERM)
        assert front.wait(timeout=180) == 75, out.read_text()[-3000:]
    finally:
        if front.poll() is None:
            front.kill()
            front.wait()
    log = out.read_text()
    assert STOP_LINE in log, log[-3000:]
    (node,) = (tmp_path / "node-local").glob("hpcscale-*")
    assert list(node.glob(".tmp-*")) == [], log[-3000:]  # no save cut short by the exit
    steps = committed_steps(node)
    assert steps and steps[0] == max(local_saves()), (steps, local_saves(), log[-3000:])
    verified = run_cli("ckpt", "verify", str(node / f"step-{steps[0]:08d}"))
    assert verified.returncode == 0, verified.stdout + verified.stderr
