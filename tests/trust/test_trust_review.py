"""The trust rule (docs/runbook.md, "Shared run directories: what hpcscale trusts") against a second real user:
a shared place someone else owns, a node-local step swapped while the job runs, an ACL behind a private group,
a build directory moved away, a report directory with something in the way, a reused run directory."""

from __future__ import annotations

import grp
import os
import shutil
import stat
import struct
import subprocess

import pytest
from conftest import run_cli

from hpcscale.errors import BadInput
from hpcscale.util.trust import UntrustedFile, check_fd, private_dir


def test_a_shared_place_someone_else_owns_is_refused_before_anything_is_made_in_it(other_user, tmp_path):
    """Their 0777 directory above the node-local root: they could rename what hpcscale makes there away and put a
    planted step in its place while the job runs, so it is refused, naming it; /tmp-like places still work."""
    tmp_path.chmod(0o755)
    hl = other_user.make(tmp_path / "hl", directory=True, mode=0o777)
    with pytest.raises(UntrustedFile, match=r"hl: refusing it as the place of the .*owned by hpcscale-other"):
        private_dir(hl / "local1/tmp/n1/hpcscale-abc", below=hl / "local1/tmp/n1", what="node-local directory")
    assert not (hl / "local1" / "tmp" / "n1" / "hpcscale-abc").exists()
    sticky = other_user.make(tmp_path / "theirs-sticky", directory=True, mode=0o1777)  # its owner renames anything
    with pytest.raises(UntrustedFile, match="owned by hpcscale-other"):
        private_dir(sticky / "n1/hpcscale-abc", below=sticky / "n1", what="node-local directory")
    world = tmp_path / "world"
    world.mkdir(mode=0o777)
    world.chmod(0o777)  # root's, but anyone may rename in it
    with pytest.raises(UntrustedFile, match="writable by others and not sticky"):
        private_dir(world / "n1/hpcscale-abc", below=world / "n1", what="node-local directory")
    shared = tmp_path / "var-tmp"
    shared.mkdir()
    shared.chmod(0o1777)  # like /var/tmp, where the local cluster's node_local is
    private_dir(shared / "hpcscale-localcluster/local1/hpcscale-abc", below=shared / "hpcscale-localcluster/local1",
                what="node-local directory")  # fmt: skip
    project = tmp_path / "project"
    project.mkdir()
    project.chmod(0o2775)  # a project's group-shared directory: allowed
    private_dir(project / "ckpt/run-1", below=project / "ckpt", what="checkpoint directory")


def test_private_dir_gives_the_mode_asked_for_whatever_the_umask(tmp_path):
    old = os.umask(0o077)
    try:
        private_dir(tmp_path / "a" / "b", below=tmp_path, mode=0o755, what="checkpoint directory")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "a").stat().st_mode) == 0o755
    assert stat.S_IMODE((tmp_path / "a" / "b").stat().st_mode) == 0o755


def test_a_drain_refuses_a_node_local_step_put_in_place_of_the_one_this_job_saved(group, tmp_path):
    """The node-local root renamed away and another directory, holding a step consistent in itself (its own
    index and digest), put at its path: the drain reads the step there, and must refuse it, since its root
    digest is not the one this job committed for that step."""
    import torch
    from test_host_memory import DIMS, _node_local

    from hpcscale.ckpt.manager import CheckpointManager

    local = _node_local(tmp_path / "node")
    local.save(4, {"w": torch.ones(64)}, {"step": 4}, asynchronous=False)
    planted = _node_local(tmp_path / "planted")  # stands in for the attacker's own save of the same step
    planted.save(4, {"w": torch.full((64,), 7.0)}, {"step": 4}, asynchronous=False)
    os.rename(tmp_path / "node", tmp_path / "node.moved")
    os.rename(tmp_path / "planted", tmp_path / "node")
    shared = CheckpointManager(tmp_path / "shared", dims=DIMS, rank=0)
    shared.drain(local.root, 4)
    with pytest.raises(Exception, match="refusing to drain it to the shared tier: its root digest"):
        shared.wait()
    assert not (tmp_path / "shared" / "step-00000004").exists()
    os.rename(tmp_path / "node", tmp_path / "planted")
    os.rename(tmp_path / "node.moved", tmp_path / "node")
    shared2 = CheckpointManager(tmp_path / "shared2", dims=DIMS, rank=0)
    shared2.drain(local.root, 4)  # the job's own step drains as before
    shared2.wait()
    assert shared2.last_step == 4
    for m in (local, planted, shared, shared2):
        m.close()


# a POSIX access ACL as the kernel stores it (linux/posix_acl_xattr.h): version 2, then (tag, perm, id) entries
_ACL_UNDEFINED_ID = 0xFFFFFFFF


def _acl(*entries: tuple[int, int, int]) -> bytes:
    return struct.pack("<I", 2) + b"".join(struct.pack("<HHI", tag, perm, uid) for tag, perm, uid in entries)


def test_an_acl_granting_write_is_not_excused_as_the_owners_private_group(other_user, tmp_path):
    """A file of theirs, in their own user-private group, mode 0664: group write alone is allowed. With an ACL
    giving a named user write, the group bits are the ACL's mask, and that user could rewrite it: refused."""
    name = other_user.name
    try:
        grp.getgrnam(name)
    except KeyError:
        subprocess.run(["groupadd", name], check=True, capture_output=True)
    gid = grp.getgrnam(name).gr_gid
    tmp_path.chmod(0o755)
    plain, with_acl = tmp_path / "plain.yaml", tmp_path / "acl.yaml"
    for f in (plain, with_acl):
        f.write_text("name: x\n")
        os.chown(f, other_user.uid, gid)
        os.chmod(f, 0o664)
    USER_OBJ, USER, GROUP_OBJ, MASK, OTHER = 0x01, 0x02, 0x04, 0x10, 0x20
    acl = _acl((USER_OBJ, 6, _ACL_UNDEFINED_ID), (USER, 6, 65534), (GROUP_OBJ, 4, _ACL_UNDEFINED_ID),
               (MASK, 6, _ACL_UNDEFINED_ID), (OTHER, 4, _ACL_UNDEFINED_ID))  # fmt: skip
    try:
        os.setxattr(with_acl, "system.posix_acl_access", acl)
    except OSError as e:
        pytest.skip(f"this filesystem keeps no POSIX ACLs ({e.strerror})")
    assert stat.S_IMODE(with_acl.stat().st_mode) == 0o664  # the mask shows as the group bits
    fds = {f: os.open(f, os.O_RDONLY) for f in (plain, with_acl)}
    verdicts = {}
    os.seteuid(other_user.uid)  # the file's owner judges it, as their own hpcscale would (a real uid change)
    try:
        for f, fd in fds.items():
            try:
                check_fd(fd, f, what="job spec")
                verdicts[f] = None
            except UntrustedFile as e:
                verdicts[f] = str(e)
    finally:
        os.seteuid(0)
        for fd in fds.values():
            os.close(fd)
    assert verdicts[plain] is None  # group write in their private group, no ACL: allowed
    assert (
        verdicts[with_acl] is not None and "writable by its group (mode 0664) (through its ACL)" in verdicts[with_acl]
    )
    assert "setfacl -b" in verdicts[with_acl]


def test_a_build_directory_moved_away_mid_build_is_exit_2_not_a_traceback(tmp_path):
    from hpcscale.data.builddir import BuildDir

    out = tmp_path / "ds"
    with BuildDir(out) as b, pytest.raises(BadInput, match="replaced by someone else"):
        os.rename(tmp_path / b.name, tmp_path / "elsewhere")
        b.commit()
    assert not out.exists()
    with BuildDir(out) as b, pytest.raises(BadInput, match="replaced by someone else"):  # another put in its place
        os.rename(tmp_path / b.name, tmp_path / "elsewhere2")
        (tmp_path / b.name).mkdir()
        b.commit()
    assert not out.exists()


def test_report_with_a_directory_at_summary_md_is_exit_2_naming_it(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "job.yaml").write_text("name: m\n")
    (run / "metrics.jsonl").write_text('{"step": 0, "loss": 1.0}\n{"step": 1, "loss": 0.5}\n')
    out = tmp_path / "o"
    (out / "summary.md").mkdir(parents=True)
    r = run_cli("report", str(run), "-o", str(out))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert f"{out / 'summary.md'}" in r.stderr


def test_reuse_refuses_a_run_directory_someone_else_made(other_user, tmp_path):
    from hpcscale.rundir import RunDir

    tmp_path.chmod(0o755)
    theirs = other_user.make(tmp_path / "run", directory=True, mode=0o755)
    with pytest.raises(UntrustedFile, match=r"run directory \(--reuse\).*owned by hpcscale-other"):
        RunDir.create(theirs, reuse=True)
    assert not (theirs / "logs").exists()
    mine = tmp_path / "mine"
    mine.mkdir()
    mine.chmod(0o777)
    with pytest.raises(UntrustedFile, match="writable by its group and others"):
        RunDir.create(mine, reuse=True)
    fresh = RunDir.create(tmp_path / "fresh", reuse=True)  # missing: made here, as without --reuse
    assert (fresh.path / "logs").is_dir() and shutil.disk_usage(fresh.path)
