"""Staging and manifests under attack and accident (the issue "Trust under attack and accident"): every finding
reproduced as a test against real files, a real sshd on loopback and real concurrent processes."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import xxhash
from conftest import run_cli
from test_stage import build, make_tree, no_parts, same_tree, ssh_args, stage, stage_json

from hpcscale.data.manifest import FileEntry, Manifest, read_manifest
from hpcscale.errors import HpcscaleError
from hpcscale.xsite.channel import parse_endpoint
from hpcscale.xsite.stage import StageOptions
from hpcscale.xsite.stage import stage as stage_lib


def _doc(*entries: dict, algorithm: str = "xxh128") -> dict:
    return {"format": "hpcscale-manifest", "version": 1, "hash_algorithm": algorithm, "files": list(entries)}


def _entry(root: Path, rel: str, **over) -> dict:
    data = (root / rel).read_bytes()
    e = {"path": rel, "size": len(data), "mtime_ns": (root / rel).stat().st_mtime_ns}
    e["hash"] = xxhash.xxh3_128(data).hexdigest()
    e.update(over)
    return e


def _tree_snapshot(root: Path) -> dict[str, tuple]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames + filenames:
            p = os.path.join(dirpath, n)
            st = os.lstat(p)
            out[p] = (st.st_mode, st.st_size, st.st_mtime_ns, st.st_nlink)
    return out


def _endpoints(kind: str, src: Path, dst: Path, request) -> tuple[str, str, list[str]]:
    if kind == "local":
        return str(src), str(dst), []
    sshd = request.getfixturevalue("sshd")
    if kind == "push":
        return str(src), sshd.url(dst), ssh_args(sshd)
    return sshd.url(src), str(dst), ssh_args(sshd)


# -- 1. a manifest over an incomplete copy --------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["local", "push", "pull"])
def test_an_out_of_range_mtime_exits_2_and_writes_no_manifest(tmp_path, request, kind):
    src = make_tree(tmp_path / "src", small=4)
    build(src)
    doc = json.loads((src / "manifest.json").read_text())
    doc["files"][1]["mtime_ns"] = 10**30
    (src / "manifest.json").write_text(json.dumps(doc))
    dst = tmp_path / "dst"
    frm, to, args = _endpoints(kind, src, dst, request)
    r = stage(src / "manifest.json", frm, to, *args)
    assert r.returncode == 2, r.stderr
    assert "files[1]" in r.stderr and "mtime_ns" in r.stderr and "Traceback" not in r.stderr
    assert not (dst / "manifest.json").exists()


@pytest.mark.parametrize("kind", ["local", "push", "pull"])
def test_an_unexpected_error_in_any_worker_fails_the_stage_without_a_manifest(tmp_path, request, kind):
    """The library is handed a Manifest that no reader checked (cross-site rounds build them in memory): an
    mtime no filesystem can hold must fail the stage, never kill a thread and commit what is left."""
    src = make_tree(tmp_path / "src", small=4)
    build(src)
    m = read_manifest(src / "manifest.json")
    bad = [FileEntry(f.path, f.size, 10**30 if i == 1 else f.mtime_ns, f.hash) for i, f in enumerate(m.files)]
    dst = tmp_path / "dst"
    frm, to, args = _endpoints(kind, src, dst, request)
    opts = StageOptions()
    if args:
        opts.ssh = args[1].split()
        opts.remote_python = args[3]
    with pytest.raises(HpcscaleError) as e:
        stage_lib(Manifest(m.hash_algorithm, bad), "{}", parse_endpoint(frm), parse_endpoint(to), opts)
    assert e.value.exit_code in (1, 2) and bad[1].path in str(e.value)
    assert not (dst / "manifest.json").exists()


def test_a_copier_that_dies_of_anything_fails_the_stage(tmp_path, monkeypatch):
    from hpcscale.portable import sink

    src = make_tree(tmp_path / "src", small=6)
    build(src)
    m = read_manifest(src / "manifest.json")
    real = sink.Writer.finish

    def finish(self):
        if self.path.endswith("f2.bin"):
            raise ZeroDivisionError("injected")
        return real(self)

    monkeypatch.setattr(sink.Writer, "finish", finish)
    dst = tmp_path / "dst"
    with pytest.raises(HpcscaleError) as e:
        stage_lib(m, "{}", parse_endpoint(str(src)), parse_endpoint(str(dst)), StageOptions(jobs=2))
    assert "f2.bin" in str(e.value) and "injected" in str(e.value)
    assert not (dst / "manifest.json").exists()


@pytest.mark.parametrize("kind", ["local", "push"])
def test_an_update_that_fails_halfway_leaves_no_stale_manifest_vouching_for_new_bytes(tmp_path, request, kind):
    src = make_tree(tmp_path / "src", small=4)
    build(src)
    dst = tmp_path / "dst"
    frm, to, args = _endpoints(kind, src, dst, request)
    assert stage_json(src / "manifest.json", frm, to, *args)["committed"]
    (src / "d0" / "sub" / "f0.bin").write_bytes(b"new content")
    (src / "zz-new.bin").write_bytes(os.urandom(500))
    build(src)
    (src / "zz-new.bin").write_bytes(os.urandom(500))  # after the manifest: fails its hash
    r = stage(src / "manifest.json", frm, to, *args)
    assert r.returncode == 3, r.stderr
    assert (dst / "d0" / "sub" / "f0.bin").read_bytes() == b"new content"
    assert not (dst / "manifest.json").exists()  # the old one would list f0.bin's old hash


# -- 2. two stages into one destination ------------------------------------------------------------------------


def _big_tree(root: Path) -> Path:
    make_tree(root, small=3)
    (root / "large01.bin").write_bytes(os.urandom(24 << 20))
    return root


@pytest.mark.parametrize("kind", ["local", "push"])
def test_a_second_stage_into_the_same_destination_is_refused_while_the_first_runs(tmp_path, request, kind):
    src = _big_tree(tmp_path / "src")
    build(src)
    dst = tmp_path / "dst"
    frm, to, args = _endpoints(kind, src, dst, request)
    m = str(src / "manifest.json")
    a = subprocess.Popen(
        ["hpcscale", "stage", m, "--from", frm, "--to", to, "--bwlimit", "8M", "--json", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 30
    while not no_parts(dst) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert no_parts(dst), "the first stage never started its large file"
    b = stage(src / "manifest.json", frm, to, *args)
    assert b.returncode == 1, b.stderr
    assert "another hpcscale stage" in b.stderr and "lock" in b.stderr and "Traceback" not in b.stderr
    _out, err = a.communicate(timeout=60)
    assert a.returncode == 0, err
    same_tree(src, dst)
    assert run_cli("manifest", "verify", str(dst / "manifest.json")).returncode == 0
    assert not (dst / ".hpcscale-stage" / "lock").exists()


def test_a_stale_lock_of_a_dead_process_is_taken_over_and_a_foreign_one_is_named(tmp_path):
    src = make_tree(tmp_path / "src", small=3)
    build(src)
    dst = tmp_path / "dst"
    (dst / ".hpcscale-stage").mkdir(parents=True)
    lock = dst / ".hpcscale-stage" / "lock"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    lock.write_text(json.dumps({"host": socket.gethostname(), "pid": dead.pid, "start": 1, "boot": "x"}))
    assert stage_json(src / "manifest.json", str(src), str(dst))["committed"]
    assert not lock.exists()
    lock.write_text(json.dumps({"host": "dtn9.elsewhere", "pid": 4242, "start": 1, "boot": "x"}))
    r = stage(src / "manifest.json", str(src), str(dst), "--check", "hash")
    assert r.returncode == 1 and "dtn9.elsewhere" in r.stderr and "4242" in r.stderr and str(lock) in r.stderr


# -- 3. writes outside the destination ------------------------------------------------------------------------


def test_a_hash_that_is_a_path_is_refused_and_nothing_is_written_outside(tmp_path):
    top = tmp_path / "a" / "b" / "c"
    src = top / "src"
    src.mkdir(parents=True)
    (src / "big.bin").write_bytes(os.urandom(9 << 20))
    m = src / "manifest.json"
    m.write_text(json.dumps(_doc(_entry(src, "big.bin", hash="x/../../../.."))))
    dst = top / "dst"
    before = _tree_snapshot(tmp_path)
    for r in (stage(m, str(src), str(dst)), run_cli("manifest", "verify", str(m))):
        assert r.returncode == 2, r.stderr
        assert "files[0]" in r.stderr and "hash" in r.stderr and "Traceback" not in r.stderr
    after = _tree_snapshot(tmp_path)
    assert {p for p in after if not p.startswith(str(dst))} == set(before)


def test_the_state_directory_as_a_symlink_is_never_written_through(tmp_path):
    src = make_tree(tmp_path / "src", small=3)
    build(src)
    dst = tmp_path / "dst"
    dst.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "journal-keep.jsonl").write_text("mine\n")
    (dst / ".hpcscale-stage").symlink_to(outside)
    r = stage(src / "manifest.json", str(src), str(dst))
    assert r.returncode == 2, r.stderr
    assert ".hpcscale-stage" in r.stderr and "symlink" in r.stderr
    assert [p.name for p in outside.iterdir()] == ["journal-keep.jsonl"]
    assert (outside / "journal-keep.jsonl").read_text() == "mine\n"


@pytest.mark.parametrize("resume", [False, True])
def test_a_planted_part_file_hard_linked_outside_is_never_written_through(tmp_path, resume):
    src = tmp_path / "src"
    src.mkdir()
    (src / "big.bin").write_bytes(os.urandom(10 << 20))
    build(src)
    digest = read_manifest(src / "manifest.json").files[0].hash
    dst = tmp_path / "dst"
    dst.mkdir()
    victim = tmp_path / "victim"
    victim.write_bytes((src / "big.bin").read_bytes()[: 1 << 20] if resume else b"precious")
    before = victim.read_bytes()
    os.link(victim, dst / f".big.bin.{digest[:16]}.hpcscale-part")
    r = stage_json(src / "manifest.json", str(src), str(dst))
    assert r["committed"] and r["resumed"] == 0
    assert victim.read_bytes() == before and victim.stat().st_nlink == 1
    same_tree(src, dst)


# -- 4. permissions ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["local", "push", "pull"])
def test_modes_are_kept_and_can_be_masked(tmp_path, request, kind):
    src = make_tree(tmp_path / "src", small=2)
    modes = {"private.key": 0o000, "run.sh": 0o755, "secret": 0o600, "group.txt": 0o640}
    for name, mode in modes.items():
        (src / name).write_bytes(os.urandom(300))
        (src / name).chmod(mode)
    (src / "big.bin").write_bytes(os.urandom(9 << 20))  # a part file, not an unnamed inode
    (src / "big.bin").chmod(0o700)
    modes["big.bin"] = 0o700
    (src / "d0").chmod(0o750)
    (src / "d1" / "sub").chmod(0o700)
    (src / "hollow").mkdir(mode=0o711)  # empty
    (src / "hollow").chmod(0o711)
    dir_modes = {"d0": 0o750, "d1/sub": 0o700, "hollow": 0o711, "d1": 0o755}
    build(src)
    listed = {f.path: f.mode for f in read_manifest(src / "manifest.json").files}
    assert all(listed[n] == mode for n, mode in modes.items())
    dst = tmp_path / "dst"
    frm, to, args = _endpoints(kind, src, dst, request)
    stage_json(src / "manifest.json", frm, to, *args)
    for name, mode in modes.items():
        assert stat.S_IMODE((dst / name).stat().st_mode) == mode, name
    for name, mode in dir_modes.items():
        assert stat.S_IMODE((dst / name).stat().st_mode) == mode, name
    masked = tmp_path / "masked"
    frm, to, args = _endpoints(kind, src, masked, request)
    stage_json(src / "manifest.json", frm, to, "--umask", "027", *args)
    for name, mode in {**modes, **dir_modes}.items():
        assert stat.S_IMODE((masked / name).stat().st_mode) == mode & ~0o027, name
    # a mode changed at the source (content unchanged) reaches the destination on the next run
    (src / "secret").chmod(0o644)
    build(src)
    frm, to, args = _endpoints(kind, src, dst, request)
    r = stage_json(src / "manifest.json", frm, to, *args)
    assert r["sent"] == 1
    assert r["committed"]
    assert stat.S_IMODE((dst / "secret").stat().st_mode) == 0o644


def test_manifests_without_modes_are_still_read_and_staged(tmp_path):
    src = make_tree(tmp_path / "src", small=2)
    doc = _doc(*(_entry(src, p) for p in ("d0/sub/f0.bin", "d1/sub/f1.bin", "empty")))
    (src / "manifest.json").write_text(json.dumps(doc))
    assert all(f.mode is None for f in read_manifest(src / "manifest.json").files)
    assert stage_json(src / "manifest.json", str(src), str(tmp_path / "dst"))["committed"]


# -- 5. silently dropped files -------------------------------------------------------------------------------


def test_every_file_is_listed_or_reported_not_listed_with_a_reason(tmp_path):
    root = make_tree(tmp_path / "data", small=2)
    (root / "notes.hpcscale-part").write_text("a user file that only looks like ours")
    (root / "sub" / ".hpcscale-stage").mkdir(parents=True)
    (root / "sub" / ".hpcscale-stage" / "x.txt").write_text("deep")
    (root / "back\\slash.txt").write_text("a legal POSIX name")
    (root / "empty-dir").mkdir()
    (root / ".hpcscale-stage").mkdir()
    (root / ".hpcscale-stage" / "verified.json").write_text("{}")
    (root / ".f.0123456789abcdef.hpcscale-part").write_text("a transfer in progress")
    doc = build(root)
    m = read_manifest(root / "manifest.json")  # its own reader accepts what build wrote
    listed = {f.path for f in m.files}
    assert {"notes.hpcscale-part", "sub/.hpcscale-stage/x.txt"} <= listed
    not_listed = {n["path"]: n["reason"] for n in doc["not_listed"]}
    assert "back\\slash.txt" in not_listed and "backslash" in not_listed["back\\slash.txt"]
    assert {"empty-dir", "sub", "sub/.hpcscale-stage"} <= {d.path for d in m.dirs}  # directories, empty ones too
    assert ".hpcscale-stage" in not_listed and ".f.0123456789abcdef.hpcscale-part" in not_listed
    every = {os.path.relpath(p, root) for p in root.rglob("*")}
    covered = listed | set(not_listed) | {d.path for d in m.dirs} | {"manifest.json"}
    assert all(p in covered or any(p.startswith(n + "/") for n in not_listed) for p in every)
    human = run_cli("manifest", "build", str(root))
    assert human.returncode == 0 and "back\\slash.txt" in human.stdout + human.stderr


# -- 6. tracebacks and hangs on bad manifests ----------------------------------------------------------------

HOSTILE = {
    "1e999 size": '{"path": "a", "size": 1e999, "mtime_ns": 0, "hash": "%s"}',
    "1e999 mtime": '{"path": "a", "size": 1, "mtime_ns": 1e999, "hash": "%s"}',
    "lone surrogate": '{"path": "a\\ud800", "size": 1, "mtime_ns": 0, "hash": "%s"}',
    "NUL in hash": '{"path": "a", "size": 1, "mtime_ns": 0, "hash": "%s\\u0000"}',
    "bool size": '{"path": "a", "size": true, "mtime_ns": 0, "hash": "%s"}',
    "float size": '{"path": "a", "size": 1.5, "mtime_ns": 0, "hash": "%s"}',
    "mode out of range": '{"path": "a", "size": 1, "mtime_ns": 0, "hash": "%s", "mode": 70000}',
    "state dir": '{"path": ".hpcscale-stage/verified.json", "size": 1, "mtime_ns": 0, "hash": "%s"}',
}


@pytest.mark.parametrize("case", [*sorted(HOSTILE), "files: 5", "deep nesting"])
def test_hostile_manifests_exit_2_without_a_traceback(tmp_path, case):
    m = tmp_path / "manifest.json"
    head = '{"format": "hpcscale-manifest", "version": 1, "hash_algorithm": "xxh128", "files": '
    if case == "files: 5":
        m.write_text(head + "5}")
    elif case == "deep nesting":
        m.write_text(head + "[]," + '"meta": ' + "[" * 200_000 + "]" * 200_000 + "}")
    else:
        m.write_text(head + "[" + HOSTILE[case] % ("0" * 32) + "]}")
    (tmp_path / "a").write_bytes(b"x")
    dst = tmp_path / "dst"
    for r in (run_cli("manifest", "verify", str(m)), stage(m, str(tmp_path), str(dst))):
        assert r.returncode == 2, (case, r.stderr)
        assert "Traceback" not in r.stderr and str(m) in r.stderr
    assert not dst.exists() or list(dst.iterdir()) == []


def test_a_fifo_at_a_listed_path_is_refused_not_waited_on(tmp_path):
    src = make_tree(tmp_path / "src", small=2)
    build(src)
    fifo = src / "d1" / "sub" / "f1.bin"
    fifo.unlink()
    os.mkfifo(fifo)
    r = run_cli("manifest", "verify", str(src / "manifest.json"), timeout=20)
    assert r.returncode in (2, 3) and "d1/sub/f1.bin" in r.stderr and "Traceback" not in r.stderr
    r = stage(src / "manifest.json", str(src), str(tmp_path / "dst"), timeout=20)
    assert r.returncode == 2 and "d1/sub/f1.bin" in r.stderr and "regular file" in r.stderr
    assert not (tmp_path / "dst" / "manifest.json").exists()


def _without_dac_override(*args: str) -> subprocess.CompletedProcess:
    """`hpcscale ARGS` as root without the capabilities that bypass file permissions (so mode 000 means it)."""
    caps = "-dac_override,-dac_read_search"
    cmd = ["setpriv", f"--inh-caps={caps}", f"--bounding-set={caps}", "hpcscale", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def test_an_unreadable_file_is_reported_by_build_and_is_not_damage_to_verify(tmp_path):
    run = _without_dac_override if os.geteuid() == 0 else run_cli  # a plain user meets mode 000 as it is
    root = make_tree(tmp_path / "data", small=3)
    build(root)
    (root / "d1" / "sub" / "f1.bin").chmod(0o000)
    r = run("manifest", "verify", str(root / "manifest.json"))
    assert r.returncode == 1, r.stderr
    assert "d1/sub/f1.bin" in r.stderr and "ermission denied" in r.stderr and "Traceback" not in r.stderr
    r = run("manifest", "build", str(root), "--rehash", "--json")
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    not_listed = {n["path"]: n["reason"] for n in json.loads(r.stdout)["not_listed"]}
    assert "ermission denied" in not_listed["d1/sub/f1.bin"]
    assert "d1/sub/f1.bin" not in {f.path for f in read_manifest(root / "manifest.json").files}


def test_an_agent_whose_client_went_silent_exits_and_its_lock_is_taken_over(tmp_path, sshd):
    """A client cut off by a broken link sends nothing, not even a close: its agent must not hold the
    destination lock until sshd notices (hours without ClientAliveInterval). It exits after `idle_s` of waiting
    (600 s by default) and the next stage takes the dead holder's lock over."""
    from test_stage import PY

    from hpcscale.xsite.channel import Channel

    src = make_tree(tmp_path / "src", small=3)
    build(src)
    dst = tmp_path / "dst"
    m = read_manifest(src / "manifest.json")
    ch = Channel(parse_endpoint(sshd.url(dst), "destination"), "sink", tuple(sshd.ssh_command()), PY)
    try:
        entries = [[f.path, f.size, f.mtime_ns, f.hash, f.mode] for f in m.files]
        ch.call(
            {"op": "init", "opts": {"algorithm": m.hash_algorithm, "jobs": 1, "idle_s": 4}},
            {"op": "plan", "entries": entries, "check": "stat", "manifest_sha256": None},
        )
        lock = dst / ".hpcscale-stage" / "lock"
        assert lock.exists()
        refused = stage(src / "manifest.json", str(src), sshd.url(dst), *ssh_args(sshd))
        assert refused.returncode == 1 and "another hpcscale stage" in refused.stderr, refused.stderr
        deadline = time.monotonic() + 30  # the silent client's agent gives up after 4 s of waiting, and its ssh ends
        while ch.p.poll() is None:
            assert time.monotonic() < deadline, "the agent still waits on its silent client after 30 s"
            time.sleep(0.1)
        assert stage_json(src / "manifest.json", str(src), sshd.url(dst), *ssh_args(sshd))["committed"]
        same_tree(src, dst)
    finally:
        ch.p.kill()
        ch.p.wait()
