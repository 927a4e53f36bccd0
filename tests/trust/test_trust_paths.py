"""What hpcscale did not make in this process it does not take as its own (hpcscale.util.trust.private_dir and
read_trusted; docs/runbook.md, "Shared run directories: what hpcscale trusts"). A real second unix user
(`other_user`) makes, first, what hpcscale would otherwise adopt: a run's node-local checkpoint directory in a
node's shared scratch root, its directory (and owner mark) under a checkpoint_root everyone can write, the
record that picks the nodes a resume runs on, a run id, a run's checkpoints/, a report directory. Each is
refused with exit 2 (a job's ranks at start, with their failure line) naming the path, its owner and the fix,
and nothing found there is loaded, moved or deleted."""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import pytest
import yaml
from conftest import REPO, run_cli
from trainjobs import job_spec

from hpcscale.errors import BadInput
from hpcscale.util.trust import UntrustedFile

RUN_ID = "0123456789ab"


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every path under root with its owner and mtime: what must stay as it was."""
    return {str(p.relative_to(root)): (p.lstat().st_uid, p.lstat().st_mtime_ns) for p in sorted(root.rglob("*"))}


def _give(path: Path, user) -> None:
    """Make everything under `path` (and path) the other user's, group-writable, as their umask 002 would."""
    for p in [path, *path.rglob("*")]:
        os.chown(p, user.uid, user.gid, follow_symlinks=False)
        if not p.is_symlink():
            os.chmod(p, 0o2775 if p.is_dir() else 0o664)


def _site(tmp: Path, **filesystems) -> Path:
    local = yaml.safe_load((REPO / "site_configs" / "local.yaml").read_text())
    local["filesystems"].update({k: str(v) for k, v in filesystems.items()})
    path = tmp / "site.yaml"
    path.write_text(yaml.safe_dump(local))
    return path


def _job(tmp: Path, name: str, site: Path, *, steps: int, checkpoint: dict, ranks: int = 1) -> Path:
    path = job_spec(tmp / name, tp=1, pp=1, ranks=ranks, steps=steps, checkpoint=checkpoint)
    spec = yaml.safe_load(path.read_text())
    spec["site"] = str(site)
    path.write_text(yaml.safe_dump(spec))
    return path


def _victim(tmp: Path) -> Path:
    """A run directory made (and its id drawn) before its first start, as `submit` leaves one queued: the id is
    readable by anyone who can read the run directory."""
    run = tmp / "victim"
    run.mkdir()
    (run / "submissions.jsonl").touch()
    (run / "run-id").write_text(RUN_ID + "\n")
    return run


def _out(r) -> str:
    return r.stdout[-3000:] + r.stderr[-3000:]


# ---- 1. the node-local tier's directory on a node -----------------------------------------------------------
def test_a_node_local_directory_another_user_made_first_is_refused_not_loaded(mpi, tmp_path, other_user):
    """The node-local root is shared by every user of the node (mode 1777 here, like /tmp); the other user makes
    <root>/hpcscale-<run id> before the run's next start on this node and puts in it a complete node-local step
    of their own (a run of theirs with the same model). Every rank stops at start with exit 2 and the
    failure line; their step is not loaded, and their directory is left as it was."""
    node_root = tmp_path / "node-local"
    node_root.mkdir()
    node_root.chmod(0o1777)
    site = _site(tmp_path, node_local=node_root)
    local_tier = {"every_steps": 0, "local": {"every_steps": 3}}
    theirs = tmp_path / "theirs"
    made = run_cli("run", str(_job(tmp_path, "a.yaml", site, steps=4, checkpoint=local_tier)), "--local",
                   "--run-dir", str(theirs), timeout=300)  # fmt: skip
    assert made.returncode == 0, _out(made)
    (their_dir,) = node_root.glob("hpcscale-*")
    assert (their_dir / "step-00000003" / "index.h5").is_file()  # node-local step 3 (step 4, the end: shared)
    planted = node_root / f"hpcscale-{RUN_ID}"
    shutil.copytree(their_dir, planted)
    _give(planted, other_user)
    before = _tree(planted)

    run = _victim(tmp_path)
    job = _job(tmp_path, "b.yaml", site, steps=6, checkpoint=local_tier, ranks=2)
    started = run_cli("run", str(job), "--local", "-n", "2", "--run-dir", str(run), "--reuse", timeout=300)
    out = _out(started)
    assert started.returncode == 2, out
    assert "resumed from checkpoint" not in out
    assert f"{planted}: refusing the node-local checkpoint directory: owned by {other_user.name}" in out, out
    assert "Fix: someone else made" in out and "Nothing in it was read or changed" in out
    assert _tree(planted) == before  # nothing in it read into the run, moved or deleted


def test_a_node_local_directory_is_made_0700_and_every_directory_between_is_checked(tmp_path, other_user):
    from hpcscale.config.load import LoadedSite, parse_site
    from hpcscale.config.yamlsrc import parse_yaml
    from hpcscale.rundir import node_local_dir

    base = tmp_path / "scratch"
    base.mkdir()
    base.chmod(0o1777)  # every user's, like /tmp
    path = _site(tmp_path, node_local=base)
    loaded = LoadedSite(parse_site(parse_yaml(path.read_text(), str(path))), path)
    old = os.umask(0o002)  # a user's umask on a RHEL-like system: no group write comes from it
    try:
        made = node_local_dir(loaded, "n1", RUN_ID, sweep="0001")
    finally:
        os.umask(old)
    assert made == base / f"hpcscale-{RUN_ID}" / "sweep" / "0001"
    for p in (made, made.parent, made.parent.parent):
        assert stat.S_IMODE(p.stat().st_mode) == 0o700, oct(p.stat().st_mode)
    assert node_local_dir(loaded, "n1", RUN_ID, sweep="0001") == made  # a resume: its own directory, accepted

    other = "fedcba987654"  # the other user made the run's directory; the sweep task's inside would be ours
    other_user.make(base / f"hpcscale-{other}", directory=True)
    with pytest.raises(UntrustedFile, match=f"node n2: .*hpcscale-{other}: refusing .* owned by {other_user.name}"):
        node_local_dir(loaded, "n2", other, sweep="0001")
    assert not (base / f"hpcscale-{other}" / "sweep").exists()  # nothing made inside theirs
    (base / "hpcscale-aaaaaaaaaaaa").symlink_to(tmp_path)  # a symlink planted at the name
    with pytest.raises(UntrustedFile, match="a symbolic link"):
        node_local_dir(loaded, "n1", "aaaaaaaaaaaa")


# ---- 2. a site-wide checkpoint_root every user can write ------------------------------------------------------
def test_a_checkpoint_root_directory_another_user_made_first_is_refused_not_resumed_from(mpi, tmp_path, other_user):
    """checkpoint_root is site-wide and everyone can write it (1777). The other user makes the run's directory
    there, <root>/<run name>-<run id>, with the run's own id in its owner mark and a step of theirs in it,
    before the run starts. The start stops with exit 2; their step is not resumed from."""
    burst = tmp_path / "burst"
    burst.mkdir()
    burst.chmod(0o1777)
    site = _site(tmp_path, checkpoint_root=burst)
    theirs = tmp_path / "theirs"
    every_4 = {"every_steps": 4}
    made = run_cli("run", str(_job(tmp_path, "a.yaml", site, steps=4, checkpoint=every_4)), "--local",
                   "--run-dir", str(theirs), timeout=300)  # fmt: skip
    assert made.returncode == 0, _out(made)
    run = _victim(tmp_path)
    planted = burst / f"{run.name}-{RUN_ID}"
    planted.mkdir()
    shutil.copytree(theirs / "checkpoints" / "step-00000004", planted / "step-00000004")
    (planted / ".hpcscale-run").write_text(RUN_ID + "\n")  # the run's own id: the mark alone vouches for nothing
    _give(planted, other_user)
    before = _tree(planted)

    job = _job(tmp_path, "b.yaml", site, steps=8, checkpoint=every_4)
    started = run_cli("run", str(job), "--local", "--run-dir", str(run), "--reuse", timeout=300)
    out = _out(started)
    assert started.returncode == 2, out
    assert "resumed from checkpoint" not in out
    assert (
        f"{planted}: refusing the run's checkpoint directory under checkpoint_root: owned by {other_user.name}" in out
    )
    assert _tree(planted) == before
    assert not (run / "checkpoints").exists()  # never linked to theirs


def test_link_checkpoints_refuses_a_group_writable_or_foreign_directory_and_makes_its_own_0755(tmp_path, other_user):
    from hpcscale.rundir import link_checkpoints

    root = tmp_path / "burst"
    run = tmp_path / "run"
    run.mkdir()
    old = os.umask(0o002)
    try:
        link = link_checkpoints(run, root / "run-aaaaaaaaaaaa" / "sweep" / "0001", run_id=RUN_ID, below=root)
    finally:
        os.umask(old)
    target = root / "run-aaaaaaaaaaaa" / "sweep" / "0001"
    assert link.resolve() == target.resolve()
    for p in (target, target.parent, target.parent.parent):
        assert stat.S_IMODE(p.stat().st_mode) == 0o755
    assert link_checkpoints(run, target, run_id=RUN_ID, below=root) == link  # the next start: accepted

    mine = root / "run-bbbbbbbbbbbb"
    mine.mkdir(mode=0o775)
    mine.chmod(0o775)  # group-writable, the group not the owner's private one: anyone in it could plant steps
    with pytest.raises(UntrustedFile, match=r"writable by its group \(mode 0775\).*chmod -R go-w"):
        link_checkpoints(tmp_path / "run2", mine, run_id=RUN_ID)
    foreign = other_user.make(root / "run-cccccccccccc", directory=True, mode=0o755)
    with pytest.raises(UntrustedFile, match=f"owned by {other_user.name}"):
        link_checkpoints(tmp_path / "run3", foreign, run_id=RUN_ID)
    assert list(foreign.iterdir()) == []  # no mark written into theirs


# ---- 3. RUN/node-local.json, which chooses --nodelist ----------------------------------------------------------
def test_a_node_local_record_someone_else_wrote_or_could_write_is_refused(tmp_path, other_user):
    from hpcscale.ckpt import nodelocal

    record = {"step": 40, "nodes": ["evil1"], "holders": {"step-00000040/data/rank-00000.bin": ["evil1"]}}
    path = tmp_path / nodelocal.RECORD
    other_user.make(path, text=json.dumps(record))
    with pytest.raises(UntrustedFile, match=f"refusing the node-local record: owned by {other_user.name}"):
        nodelocal.plan_from_record(path, lost=set(), max_nodes=2)
    path.unlink()
    path.write_text(json.dumps(record))
    path.chmod(0o664)  # the user's own, but their group could have written it
    with pytest.raises(UntrustedFile, match="writable by its group"):
        nodelocal.plan_from_record(path, lost=set(), max_nodes=2)
    path.unlink()
    (tmp_path / "elsewhere.json").write_text(json.dumps(record))
    path.symlink_to(tmp_path / "elsewhere.json")
    with pytest.raises(UntrustedFile, match="a symbolic link"):
        nodelocal.plan_from_record(path, lost=set(), max_nodes=2)
    path.unlink()
    old = os.umask(0o002)
    try:  # what the job writes is 0644 whatever its umask, and trusted
        nodelocal.write_node_local_record(path, step=40, nodes=["n1"], holders={"f": ["n1"]})
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert nodelocal.plan_from_record(path, lost=set(), max_nodes=2).nodes == ["n1"]


# ---- 4. the same class elsewhere: the run id, a run's checkpoints/, the report's -o ----------------------------
def test_a_run_id_someone_else_wrote_is_refused(tmp_path, other_user):
    from hpcscale.rundir import RunDir

    run = tmp_path / "run"
    run.mkdir()
    other_user.make(run / "run-id", text="fedcba987654\n", mode=0o644)  # names their directory elsewhere
    with pytest.raises(UntrustedFile, match=f"refusing the run id: owned by {other_user.name}"):
        RunDir(run).run_id()


def test_a_runs_checkpoints_another_user_made_first_are_refused_on_every_rank(group, tmp_path, other_user):
    """RUN may be writable by a colleague: a checkpoints/ they made there, with a step in it, is not the
    run's. The manager refuses it before reading, cleaning or claiming anything in it."""
    from hpcscale.ckpt.manager import CheckpointManager
    from hpcscale.layout import ParallelDims

    dims = ParallelDims.for_world(world_size=1, tp=1, pp=1)
    run = tmp_path / "run"
    run.mkdir()
    planted = other_user.make(run / "checkpoints", directory=True)
    (planted / "step-00000009").mkdir()
    (planted / ".tmp-step-00000010").mkdir()  # an "unfinished save" the manager would otherwise remove
    _give(planted, other_user)
    before = _tree(planted)
    with pytest.raises(BadInput, match=f"checkpoints: refusing the checkpoint directory: owned by {other_user.name}"):
        CheckpointManager(planted, dims=dims, rank=0, owner=RUN_ID)
    assert _tree(planted) == before

    mine = tmp_path / "mine"  # the run's own, 0755, but a step directory in it its group can write
    CheckpointManager(mine, dims=dims, rank=0, owner=RUN_ID).close()
    assert stat.S_IMODE(mine.stat().st_mode) == 0o755
    (mine / "step-00000003").mkdir()
    (mine / "step-00000003").chmod(0o775)
    with pytest.raises(BadInput, match=r"step-00000003: refusing the directory in the checkpoint directory"):
        CheckpointManager(mine, dims=dims, rank=0, owner=RUN_ID)
    (mine / "step-00000003").chmod(0o755)
    CheckpointManager(mine, dims=dims, rank=0, owner=RUN_ID).close()


def test_saved_steps_are_closed_to_others_whatever_the_umask(group, tmp_path):
    import torch

    from hpcscale.ckpt.manager import CheckpointManager
    from hpcscale.layout import ParallelDims

    dims = ParallelDims.for_world(world_size=1, tp=1, pp=1)
    old = os.umask(0o002)
    try:
        m = CheckpointManager(tmp_path / "ckpt", dims=dims, rank=0, owner=RUN_ID, direct_io=False)
        m.save(1, {"w": torch.ones(8)}, {"step": 1}, asynchronous=False)
        m.close()
    finally:
        os.umask(old)
    for p in [tmp_path / "ckpt", *(tmp_path / "ckpt").rglob("*")]:
        assert not stat.S_IMODE(p.lstat().st_mode) & 0o022, (p, oct(p.lstat().st_mode))
    # and the next start accepts what it saved
    CheckpointManager(tmp_path / "ckpt", dims=dims, rank=0, owner=RUN_ID).close()


def test_a_report_directory_another_user_made_first_is_refused(tmp_path, other_user):
    run = tmp_path / "run"
    run.mkdir()
    (run / "submissions.jsonl").touch()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n")
    out = other_user.make(tmp_path / "report", directory=True)
    r = run_cli("report", str(run), "-o", str(out))
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"refusing the report directory (-o): owned by {other_user.name}" in r.stderr
    assert list(out.iterdir()) == []
    sticky = tmp_path / "shared"
    sticky.mkdir()
    sticky.chmod(0o1777)  # like /tmp: others may add names, not replace the user's files
    assert run_cli("report", str(run), "-o", str(sticky / "mine")).returncode == 0


def test_private_dir_refuses_a_file_a_symlink_and_a_sticky_directory_others_can_write(tmp_path):
    from hpcscale.util.trust import private_dir

    (tmp_path / "file").write_text("x")
    with pytest.raises(UntrustedFile, match="not a directory"):
        private_dir(tmp_path / "file", what="test directory")
    (tmp_path / "link").symlink_to(tmp_path)
    with pytest.raises(UntrustedFile, match="a symbolic link"):
        private_dir(tmp_path / "link", what="test directory")
    (tmp_path / "sticky").mkdir()
    (tmp_path / "sticky").chmod(0o1777)  # others cannot remove the owner's entries, but can add steps
    with pytest.raises(UntrustedFile, match=r"writable by its group and others \(mode 1777\)"):
        private_dir(tmp_path / "sticky", what="test directory")
    with pytest.raises(ValueError):
        private_dir(tmp_path / "x", what="test directory", mode=0o775)


def test_checkpoints_loaded_but_never_written_are_refused_from_a_directory_others_could_write(tmp_path, other_user):
    """xsite.start_from's check (util/trust.check_private_dir with reading): another user's directory, or one of
    ours with a step others can write, is refused; the fix says to copy it, not to have it removed, since
    hpcscale never writes there. The sites' runs themselves: tests/xsite/test_xsite_start.py."""
    from hpcscale.util.trust import check_private_dir

    theirs = other_user.make(tmp_path / "pretrain", directory=True)
    with pytest.raises(UntrustedFile) as e:
        check_private_dir(theirs, what="xsite.start_from checkpoint directory", reading=True)
    said = str(e.value)
    assert f"refusing the xsite.start_from checkpoint directory: owned by {other_user.name}" in said
    assert "copy it into a directory of yours" in said and "remove" not in said
    ours = tmp_path / "ours"
    (ours / "step-00000010" / "data").mkdir(parents=True)
    ours.chmod(0o755)
    (ours / "step-00000010" / "data").chmod(0o757)
    with pytest.raises(UntrustedFile) as e:
        check_private_dir(ours, what="xsite.start_from checkpoint directory", reading=True)
    assert "step-00000010/data: refusing the directory in the xsite.start_from checkpoint directory" in str(e.value)
    assert "writable by others" in str(e.value) and f"chmod -R go-w {ours}" in str(e.value)
    (ours / "step-00000010" / "data").chmod(0o755)
    check_private_dir(ours, what="xsite.start_from checkpoint directory", reading=True)  # accepted
