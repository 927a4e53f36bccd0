"""Who may sign for a site: the keyring and the key files, against a real second unix user who shares a group
(tests/conftest.py `other_user`). A public key someone else could add or replace would let them sign as any
site, the aggregator included: a forged round would reach every site's trainer."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from xsite_harness import sites_with_round0

from hpcscale.util.trust import UntrustedFile
from hpcscale.xsite import roundfile as rf
from hpcscale.xsite import rounds
from hpcscale.xsite.signing import generate_key, load_keyring, load_private

SHAPES = {"w": (6, 4), "b": (5,)}


def _sites(tmp: Path):
    theta0 = {k: torch.zeros(s) for k, s in SHAPES.items()}
    quorum = {"min_sites": 2, "timeout_seconds": 3600}
    config, keys = sites_with_round0(tmp, ("a", "b"), theta0, name="keys", quorum=quorum, outer={})
    run = tmp / "run-b"
    run.mkdir()
    (run / "job.yaml").write_text("name: b\n")
    return config, keys


def test_a_key_another_user_added_to_a_group_writable_keyring_signs_nothing(shared_tmp, other_user):
    """The keyring directory is group-writable; a colleague adds `a.1.pub`, a generation of the aggregator's key
    that is theirs, and signs a round with it. It was handed to b's run; now the tick stops with exit 2 naming
    the keyring and the fix, before it reads any record."""
    config, keys = _sites(shared_tmp)
    os.chmod(keys, 0o2775)
    os.chown(keys, os.getuid(), other_user.gid)
    forged = shared_tmp / "forged"
    forged.mkdir()
    _, public = generate_key(forged, "a", generation=1)
    os.chmod(public, 0o644)
    done = other_user.run("cp", str(public), str(keys / "a.1.pub"))
    assert done.returncode == 0, done.stderr
    inbox = shared_tmp / "state-b" / rounds.INBOX
    inbox.mkdir(parents=True)
    evil = {k: torch.full(s, 9.0) for k, s in SHAPES.items()}
    rf.write_round(inbox, round=1, parent=0, outer=rounds._outer(config), accepted=[], rejected=[], theta=evil,
                   momentum=None, key=load_private(forged / "a.1.key"))  # fmt: skip
    with pytest.raises(UntrustedFile, match="keyring directory: writable by its group") as e:
        rounds.tick(config, "b")
    assert str(keys) in str(e.value) and f"chmod -R go-w {keys}" in str(e.value)
    assert not (shared_tmp / "run-b" / "xsite").exists()


def test_a_public_key_file_another_user_owns_or_can_write_is_refused(shared_tmp, other_user):
    keys = shared_tmp / "keys"
    keys.mkdir()
    generate_key(keys, "a")
    generate_key(keys, "b")
    theirs = other_user.make(keys / "b.1.pub", text=(keys / "b.pub").read_text(), mode=0o644)
    with pytest.raises(UntrustedFile, match=r"b\.1\.pub: refusing the public key: owned by hpcscale-other"):
        load_keyring(keys)
    theirs.unlink()
    os.chmod(keys / "b.pub", 0o664)
    with pytest.raises(UntrustedFile, match=r"b\.pub: refusing the public key: writable by its group"):
        load_keyring(keys)
    os.chmod(keys / "b.pub", 0o644)
    assert sorted(load_keyring(keys)) == ["a", "b"]


def test_a_private_key_another_user_owns_is_refused(shared_tmp, other_user):
    keys = shared_tmp / "keys"
    keys.mkdir()
    private, _ = generate_key(keys, "a")
    os.chown(private, other_user.uid, other_user.gid)  # theirs, 0600: put in place of yours
    with pytest.raises(UntrustedFile, match=r"a\.key: refusing the private key: owned by hpcscale-other"):
        load_private(private)


def test_keygen_never_writes_into_a_directory_another_user_made(shared_tmp, other_user):
    from hpcscale.cli.sync_cmd import sync

    os.chmod(shared_tmp, 0o2775)
    os.chown(shared_tmp, os.getuid(), other_user.gid)
    theirs = other_user.make(shared_tmp / "keys", directory=True)
    result = CliRunner().invoke(sync, ["keygen", "--site", "a", "--out", str(theirs)])
    assert isinstance(result.exception, UntrustedFile) and "owned by hpcscale-other" in str(result.exception)
    assert list(theirs.iterdir()) == []
    result = CliRunner().invoke(sync, ["keygen", "--site", "a", "--out", str(shared_tmp / "mine")])
    assert result.exit_code == 0, result.output
    assert oct(os.stat(shared_tmp / "mine").st_mode & 0o777) == "0o700"
