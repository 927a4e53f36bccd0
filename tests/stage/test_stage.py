"""`hpcscale manifest build|diff|verify` and `hpcscale stage`, run as a user runs them: real files, a real sshd on
loopback (tests/helpers/sshd.py), real kills mid-transfer."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import xxhash
from conftest import REPO, need, run_cli

from hpcscale.data.manifest import read_manifest

PY = sys.executable


def make_tree(root: Path, small: int = 40, big_mb: int = 0) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for i in range(small):
        d = root / f"d{i % 4}" / "sub"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"f{i}.bin").write_bytes(os.urandom(100 + 37 * i))
    (root / "empty").write_bytes(b"")
    if big_mb:
        (root / "big.bin").write_bytes(os.urandom(big_mb << 20))
    return root


def build(root: Path, *args: str) -> dict:
    r = run_cli("manifest", "build", str(root), "--json", *args)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def stage(manifest: Path, src: str, dst: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return run_cli("stage", str(manifest), "--from", src, "--to", dst, *args, timeout=timeout)


def stage_json(manifest: Path, src: str, dst: str, *args: str) -> dict:
    r = stage(manifest, src, dst, "--json", *args)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def same_tree(a: Path, b: Path) -> None:
    """Every file the manifest of a lists is in b with the same bytes and mtime."""
    m = read_manifest(a / "manifest.json")
    for f in m.files:
        assert (b / f.path).read_bytes() == (a / f.path).read_bytes(), f.path
        assert (b / f.path).stat().st_mtime_ns == f.mtime_ns, f.path


def no_parts(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.name.endswith(".hpcscale-part")]


def ssh_args(sshd) -> list[str]:
    return ["--ssh", sshd.ssh_string(), "--remote-python", PY]


# -- manifest build / diff / verify ------------------------------------------------------------------------


def test_build_hashes_every_file_reuses_unchanged_ones_and_rehashes_on_request(tmp_path):
    root = make_tree(tmp_path / "data")
    (root / ".hpcscale-stage").mkdir()  # staging state is not data
    (root / "d0" / ".f.0123456789abcdef.hpcscale-part").write_bytes(b"partial")
    doc = build(root)
    assert doc["files"] == 41 and doc["hashed"] == 41 and doc["reused"] == 0
    assert {n["path"] for n in doc["not_listed"]} == {".hpcscale-stage", "d0/.f.0123456789abcdef.hpcscale-part"}
    m = read_manifest(root / "manifest.json")
    assert m.hash_algorithm == "xxh128"
    paths = [f.path for f in m.files]
    assert paths == sorted(paths) and "manifest.json" not in paths and "empty" in paths
    assert not any("hpcscale" in p for p in paths)
    for f in m.files:
        assert f.hash == xxhash.xxh3_128((root / f.path).read_bytes()).hexdigest()
        assert f.size == (root / f.path).stat().st_size

    changed = root / "d1" / "sub" / "f1.bin"
    changed.write_bytes(b"new content")
    (root / "added.txt").write_text("hello")
    doc = build(root)
    assert doc["hashed"] == 2 and doc["reused"] == 40
    assert {f.path: f.hash for f in read_manifest(root / "manifest.json").files}["d1/sub/f1.bin"] == (
        xxhash.xxh3_128(b"new content").hexdigest()
    )
    assert build(root, "--rehash")["hashed"] == 42
    doc = build(root, "--algorithm", "sha256")  # another algorithm: nothing can be reused
    assert doc["hashed"] == 42 and read_manifest(root / "manifest.json").hash_algorithm == "sha256"


def test_build_keeps_a_token_dataset_and_recounts_its_samples(tmp_path):
    from hpcscale.data.prepare import prepare

    src = tmp_path / "text"
    src.mkdir()
    (src / "a.txt").write_text("hpcscale staging test line\n" * 400)
    out = tmp_path / "ds"
    prepare(src, out, sample_len=33, shard_samples=50)
    before = read_manifest(out / "manifest.json")
    doc = build(out)
    assert doc["reused"] == len(before.files) and doc["hashed"] == 0
    after = read_manifest(out / "manifest.json")
    assert after.dataset == before.dataset and after.files == before.files


def test_build_follows_symlinks_inside_the_root_and_refuses_those_leading_out(tmp_path):
    root = make_tree(tmp_path / "data", small=3)
    (root / "alias.bin").symlink_to(root / "d0" / "sub" / "f0.bin")
    m = build(root)
    assert m["files"] == 5
    outside = tmp_path / "secret"
    outside.write_text("not part of the dataset")
    (root / "d1" / "leak").symlink_to(outside)
    r = run_cli("manifest", "build", str(root))
    assert r.returncode == 2, r.stderr
    assert "d1/leak" in r.stderr and "out of the root" in r.stderr and "Traceback" not in r.stderr


def test_diff_reports_added_removed_and_changed(tmp_path):
    root = make_tree(tmp_path / "data", small=5)
    build(root)
    old = tmp_path / "old.json"
    old.write_text((root / "manifest.json").read_text())
    (root / "d0" / "sub" / "f0.bin").write_bytes(b"changed")
    (root / "d1" / "sub" / "f1.bin").unlink()
    (root / "new.txt").write_text("new")
    build(root)
    r = run_cli("manifest", "diff", str(old), str(root / "manifest.json"), "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["added"] == ["new.txt"] and d["removed"] == ["d1/sub/f1.bin"]
    assert [c["path"] for c in d["changed"]] == ["d0/sub/f0.bin"] and d["unchanged"] == 4
    table = run_cli("manifest", "diff", str(old), str(root))
    assert table.returncode == 0 and "1 added, 1 removed, 1 changed, 4 unchanged" in table.stdout
    other = tmp_path / "sha"
    make_tree(other, small=1)
    build(other, "--algorithm", "sha256")
    r = run_cli("manifest", "diff", str(old), str(other / "manifest.json"))
    assert r.returncode == 2 and "sha256" in r.stderr and "xxh128" in r.stderr


def test_verify_names_every_missing_truncated_and_corrupt_file(tmp_path):
    root = make_tree(tmp_path / "data", small=8)
    build(root)
    ok = run_cli("manifest", "verify", str(root / "manifest.json"), "--json")
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["ok"] == 9
    flipped = root / "d0" / "sub" / "f0.bin"
    data = bytearray(flipped.read_bytes())
    data[len(data) // 2] ^= 0x01
    flipped.write_bytes(bytes(data))
    (root / "d1" / "sub" / "f1.bin").unlink()
    with open(root / "d2" / "sub" / "f2.bin", "r+b") as f:
        f.truncate(10)
    r = run_cli("manifest", "verify", str(root / "manifest.json"), "--json")
    assert r.returncode == 3
    problems = {p["path"]: p["problem"] for p in json.loads(r.stdout)["problems"]}
    assert problems.keys() == {"d0/sub/f0.bin", "d1/sub/f1.bin", "d2/sub/f2.bin"}
    assert problems["d1/sub/f1.bin"] == "missing" and "hash" in problems["d0/sub/f0.bin"]
    assert "size 10" in problems["d2/sub/f2.bin"]
    human = run_cli("manifest", "verify", str(root / "manifest.json"))
    assert human.returncode == 3 and all(p in human.stderr for p in problems)


BAD_MANIFESTS = {
    "absolute path": ({"path": "/etc/passwd", "size": 1, "mtime_ns": 0, "hash": "00"}, "files[0]", "absolute"),
    "dot-dot": ({"path": "a/../../x", "size": 1, "mtime_ns": 0, "hash": "00"}, "files[0]", "'..'"),
    "negative size": ({"path": "a", "size": -1, "mtime_ns": 0, "hash": "00"}, "files[0]", "size"),
    "not an object": ("a", "files[0]", "expected an object"),
}


@pytest.mark.parametrize("case", sorted(BAD_MANIFESTS))
def test_malformed_manifests_exit_2_naming_the_entry(tmp_path, case):
    entry, key, words = BAD_MANIFESTS[case]
    m = tmp_path / "manifest.json"
    doc = {"format": "hpcscale-manifest", "version": 1, "hash_algorithm": "xxh128", "files": [entry]}
    m.write_text(json.dumps(doc))
    (tmp_path / "dst").mkdir()
    for r in (
        run_cli("manifest", "verify", str(m)),
        stage(m, str(tmp_path), str(tmp_path / "dst")),
    ):
        assert r.returncode == 2, r.stderr
        assert str(m) in r.stderr and key in r.stderr and words in r.stderr and "Traceback" not in r.stderr
    assert list((tmp_path / "dst").iterdir()) == []


def test_unknown_hash_algorithm_and_broken_json_exit_2(tmp_path):
    m = tmp_path / "manifest.json"
    m.write_text(json.dumps({"format": "hpcscale-manifest", "version": 1, "hash_algorithm": "md5", "files": []}))
    r = stage(m, str(tmp_path), str(tmp_path / "dst"))
    assert r.returncode == 2 and "hash_algorithm" in r.stderr and "md5" in r.stderr
    m.write_text('{"format": "hpcscale-manifest", "files": [')
    r = run_cli("manifest", "verify", str(m))
    assert r.returncode == 2 and "invalid JSON" in r.stderr


# -- stage between local paths -----------------------------------------------------------------------------


def test_local_stage_copies_verifies_and_reruns_as_a_no_op(tmp_path):
    src = make_tree(tmp_path / "src", big_mb=9)
    build(src)
    dst = tmp_path / "dst"
    first = stage_json(src / "manifest.json", str(src), str(dst), "-j", "3", "--sync")
    assert first["sent"] == first["files"] == 42 and first["verified"] == 42 and first["committed"]
    assert first["bytes_sent"] == first["bytes_total"] and not first["failed"]
    same_tree(src, dst)
    assert (dst / "manifest.json").read_text() == (src / "manifest.json").read_text()
    assert no_parts(dst) == []
    again = stage_json(src / "manifest.json", str(src), str(dst))
    assert again["sent"] == 0 and again["up_to_date"] == 42 and again["proven_by_hash"] == 0
    hashed = stage_json(src / "manifest.json", str(src), str(dst), "--check", "hash")
    assert hashed["sent"] == 0 and hashed["proven_by_hash"] == 42 and hashed["verified"] == 42
    ok = run_cli("manifest", "verify", str(dst / "manifest.json"))
    assert ok.returncode == 0, ok.stderr


def test_a_destination_file_changed_behind_our_back_is_caught_by_its_ctime(tmp_path):
    """Same size, mtime put back: rsync's quick check would trust it; the record's ctime and inode do not."""
    src = make_tree(tmp_path / "src", small=6)
    build(src)
    dst = tmp_path / "dst"
    stage_json(src / "manifest.json", str(src), str(dst))
    victim = dst / "d2" / "sub" / "f2.bin"
    st = victim.stat()
    victim.write_bytes(bytes(st.st_size))
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))
    r = stage_json(src / "manifest.json", str(src), str(dst))
    assert r["sent"] == 1 and r["up_to_date"] == 6
    same_tree(src, dst)


def test_touching_some_files_moves_only_those(tmp_path):
    src = make_tree(tmp_path / "src", small=100)
    build(src)
    dst = tmp_path / "dst"
    stage_json(src / "manifest.json", str(src), str(dst))
    for i in (3, 50):
        (src / f"d{i % 4}" / "sub" / f"f{i}.bin").write_bytes(os.urandom(64))
    assert build(src)["hashed"] == 2
    r = stage_json(src / "manifest.json", str(src), str(dst))
    assert r["sent"] == 2 and r["up_to_date"] == 99
    same_tree(src, dst)


def test_dry_run_writes_nothing(tmp_path):
    src = make_tree(tmp_path / "src", small=5)
    build(src)
    dst = tmp_path / "dst"
    r = stage(src / "manifest.json", str(src), str(dst), "--dry-run")
    assert r.returncode == 0, r.stderr
    assert "6 of 6 files would be sent" in r.stdout and "would send d0/sub/f0.bin" in r.stdout
    assert not dst.exists()


def test_a_source_changed_after_the_manifest_exits_3_and_never_takes_the_name(tmp_path):
    src = make_tree(tmp_path / "src", small=5)
    build(src)
    (src / "d1" / "sub" / "f1.bin").write_bytes(os.urandom(137))  # same size, other bytes
    dst = tmp_path / "dst"
    r = stage(src / "manifest.json", str(src), str(dst), "--json")
    assert r.returncode == 3, r.stderr
    doc = json.loads(r.stdout)
    assert [f["path"] for f in doc["failed"]] == ["d1/sub/f1.bin"] and doc["sent"] == 5
    assert "d1/sub/f1.bin" in r.stderr and "did the source change" in r.stderr
    assert not (dst / "d1" / "sub" / "f1.bin").exists() and no_parts(dst) == []
    assert not (dst / "manifest.json").exists()  # not a complete copy: no manifest


@pytest.mark.parametrize("remote", [False, True])
def test_a_source_file_that_cannot_be_opened_fails_alone_and_blocks_the_manifest(tmp_path, request, remote):
    """A dangling symlink where the manifest lists a file: opening it fails with a plain OSError in the opener
    thread. That file is reported failed, every other file still arrives, and no manifest is written."""
    src = make_tree(tmp_path / "src", small=6)
    build(src)
    target = src / "d1" / "sub" / "f1.bin"
    target.unlink()
    target.symlink_to(src / "d1" / "sub" / "gone.bin")  # inside the root, leading nowhere
    dst = tmp_path / "dst"
    args = ()
    to = str(dst)
    if remote:
        sshd = request.getfixturevalue("sshd")
        to, args = sshd.url(dst), ssh_args(sshd)
    r = stage(src / "manifest.json", str(src), to, "--json", *args)
    assert r.returncode == 1, r.stderr
    doc = json.loads(r.stdout)
    assert [f["path"] for f in doc["failed"]] == ["d1/sub/f1.bin"]
    assert doc["sent"] == 6  # the 5 other small files and "empty"; not the broken one
    assert not (dst / "manifest.json").exists()


def test_a_source_symlink_leading_out_is_refused_with_exit_2(tmp_path):
    src = make_tree(tmp_path / "src", small=3)
    build(src)
    secret = tmp_path / "secret"
    secret.write_bytes(os.urandom(100 + 37 * 1))
    target = src / "d1" / "sub" / "f1.bin"
    target.unlink()
    target.symlink_to(secret)
    r = stage(src / "manifest.json", str(src), str(tmp_path / "dst"))
    assert r.returncode == 2, r.stderr
    assert "d1/sub/f1.bin" in r.stderr and "symlink out of" in r.stderr


def test_a_destination_symlink_is_never_written_through(tmp_path):
    src = make_tree(tmp_path / "src", small=3)
    build(src)
    dst = tmp_path / "dst"
    dst.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    (dst / "d1").symlink_to(outside)
    r = stage(src / "manifest.json", str(src), str(dst))
    assert r.returncode == 2, r.stderr
    assert f"{dst}/d1 is a symlink" in r.stderr and "never writes through" in r.stderr
    assert list(outside.iterdir()) == []


@pytest.mark.parametrize("files", [1, 3])
def test_bandwidth_limit_holds_the_rate(tmp_path, files):
    """One file: one copier; three: three copier processes, which share the rate (all streams together)."""
    src = tmp_path / "src"
    src.mkdir()
    for i in range(files):
        (src / f"a{i}.bin").write_bytes(os.urandom((3 << 20) // files))
    build(src)
    t = time.monotonic()
    r = stage_json(src / "manifest.json", str(src), str(tmp_path / "dst"), "--bwlimit", "1M", "-j", "3")
    assert r["sent"] == files and r["streams"] == files
    assert time.monotonic() - t >= 2.0  # 3 MiB at 1 MiB/s, less the 50 ms burst allowance


def test_bad_endpoints_and_rates_exit_2(tmp_path):
    src = make_tree(tmp_path / "src", small=1)
    build(src)
    m = src / "manifest.json"
    for args, words in (
        (["--from", "ftp://x/y", "--to", str(tmp_path / "d")], "unknown scheme"),
        (["--from", "ssh://a/x", "--to", "ssh://b/y"], "one side must be local"),
        (["--from", "ssh://host:port/x", "--to", str(tmp_path / "d")], "port"),
        (["--from", str(src), "--to", str(tmp_path / "d"), "--bwlimit", "fast"], "--bwlimit"),
    ):
        r = run_cli("stage", str(m), *args)
        assert r.returncode == 2, (args, r.stderr)
        assert words in r.stderr


def _kill_when_part_appears(cmd: list[str], where: Path, min_bytes: int = 1 << 20) -> None:
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        parts = [q for q in no_parts(where) if q.stat().st_size >= min_bytes] if where.exists() else []
        if parts:
            break
        assert p.poll() is None, p.communicate()
        time.sleep(0.05)
    else:
        p.kill()
        raise AssertionError("no part file appeared")
    p.send_signal(signal.SIGKILL)
    p.wait()


def _check_killed_state(src: Path, dst: Path) -> None:
    """After a kill: whatever holds a final name is complete and correct; the big file is only a part."""
    m = read_manifest(src / "manifest.json")
    for f in m.files:
        final = dst / f.path
        if final.exists():
            assert xxhash.xxh3_128(final.read_bytes()).hexdigest() == f.hash, f.path
    assert not (dst / "big.bin").exists()
    assert not (dst / "manifest.json").exists()


def test_local_stage_killed_mid_transfer_resumes_where_it_stopped(tmp_path):
    src = make_tree(tmp_path / "src", small=20, big_mb=12)
    build(src)
    dst = tmp_path / "dst"
    cmd = ["hpcscale", "stage", str(src / "manifest.json"), "--from", str(src), "--to", str(dst), "--bwlimit", "2M"]
    _kill_when_part_appears(cmd, dst)
    _check_killed_state(src, dst)
    r = stage_json(src / "manifest.json", str(src), str(dst))
    assert r["resumed"] == 1 and r["bytes_sent"] < 12 << 20 and r["committed"]
    same_tree(src, dst)
    assert no_parts(dst) == []


# -- copier processes (a local copy with -j 2 or more) -------------------------------------------------------


def _children(pid: int) -> list[int]:
    """Live processes whose parent is `pid` (zombies excluded: they write nothing)."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            status = (d / "status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
        if fields.get("PPid", "").strip() == str(pid) and not fields.get("State", "").startswith("Z"):
            out.append(int(d.name))
    return out


def _gone(pids: list[int], timeout: float = 10) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = []
        for pid in pids:
            try:
                state = Path(f"/proc/{pid}/status").read_text()
            except OSError:
                continue
            if "State:\tZ" not in state:
                alive.append(pid)
        if not alive:
            return True
        time.sleep(0.05)
    return False


def _as_from_a_terminal() -> None:
    """In the child before exec: SIGINT and SIGTERM as a user's shell hands them to a command (default, not
    blocked), whatever the test worker's own state (a worker started in the background may ignore SIGINT)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, (signal.SIGINT, signal.SIGTERM))


def _start_slow_copy(tmp_path: Path) -> tuple[Path, Path, subprocess.Popen, list[int]]:
    """A local stage with two copier processes, slowed by --bwlimit, caught while its two big files are in
    flight, one in each process; returns (src, dst, the front end, its copier processes)."""
    src = make_tree(tmp_path / "src", small=30, big_mb=12)
    (src / "big2.bin").write_bytes(os.urandom(12 << 20))
    build(src)
    dst = tmp_path / "dst"
    cmd = ["hpcscale", "stage", str(src / "manifest.json"), "--from", str(src), "--to", str(dst), "-j", "2"]
    p = subprocess.Popen([*cmd, "--bwlimit", "2M"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO,
                         preexec_fn=_as_from_a_terminal)  # fmt: skip
    deadline = time.monotonic() + 60
    while not (dst.exists() and len([q for q in no_parts(dst) if q.stat().st_size >= 1 << 20]) == 2):
        assert p.poll() is None, p.communicate()
        assert time.monotonic() < deadline, "no part files appeared"
        time.sleep(0.05)
    kids = _children(p.pid)
    assert len(kids) == 2, kids  # the local copy runs in copier processes
    return src, dst, p, kids


def _rerun_completes(src: Path, dst: Path) -> None:
    r = stage_json(src / "manifest.json", str(src), str(dst), "-j", "2")
    assert r["committed"] and r["resumed"] == 2 and r["bytes_sent"] < 24 << 20
    same_tree(src, dst)
    assert no_parts(dst) == []
    assert run_cli("manifest", "verify", str(dst / "manifest.json")).returncode == 0


def test_a_killed_copier_process_fails_the_stage_and_nothing_is_committed(tmp_path):
    src, dst, p, kids = _start_slow_copy(tmp_path)
    os.kill(kids[0], signal.SIGKILL)
    _out, err = p.communicate(timeout=60)
    assert p.returncode == 1, err
    assert f"copier process {kids[0]} was killed by signal 9" in err.decode() and b"Traceback" not in err
    assert _gone(kids)
    # the other process went on to the end of its files (a rerun has less to do); the killed one's big file is
    # still a part, and whatever holds a final name is whole
    m = read_manifest(src / "manifest.json")
    for f in m.files:
        if (dst / f.path).exists():
            assert xxhash.xxh3_128((dst / f.path).read_bytes()).hexdigest() == f.hash, f.path
    assert len(no_parts(dst)) == 1
    assert not (dst / "manifest.json").exists()
    assert not (dst / ".hpcscale-stage" / "lock").exists()
    r = stage_json(src / "manifest.json", str(src), str(dst), "-j", "2")
    assert r["committed"] and r["resumed"] == 1
    same_tree(src, dst)
    assert run_cli("manifest", "verify", str(dst / "manifest.json")).returncode == 0


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT])
def test_the_copier_processes_never_outlive_the_front_end(tmp_path, sig):
    """kill -9, a plain kill, Ctrl-C: the copier processes end with the front end, no file is written after,
    nothing is committed, and a rerun continues from the part file."""
    src, dst, p, kids = _start_slow_copy(tmp_path)
    p.send_signal(sig)
    p.communicate(timeout=60)
    assert p.returncode != 0
    assert _gone(kids), f"copier processes {kids} outlived the front end"
    sizes = {q: q.stat().st_size for q in no_parts(dst)}
    time.sleep(1.0)  # at 1 MB/s a surviving writer would have grown its part file by now
    assert {q: q.stat().st_size for q in no_parts(dst)} == sizes
    _check_killed_state(src, dst)
    assert not (dst / "big2.bin").exists()
    _rerun_completes(src, dst)


def test_an_input_error_in_one_copier_process_stops_the_others(tmp_path):
    """A file whose source turns into a symlink leading out of the root (exit 2): the other process is stopped,
    not left copying; nothing is committed."""
    src = make_tree(tmp_path / "src", small=30, big_mb=12)
    build(src)
    outside = tmp_path / "outside.bin"
    victim = src / "d3" / "sub" / "f27.bin"
    outside.write_bytes(victim.read_bytes())
    victim.unlink()
    victim.symlink_to(outside)
    dst = tmp_path / "dst"
    t = time.monotonic()
    r = stage(src / "manifest.json", str(src), str(dst), "-j", "2", "--bwlimit", "2M")
    assert r.returncode == 2, r.stderr
    assert "f27.bin" in r.stderr and "leads through a symlink out of" in r.stderr and "Traceback" not in r.stderr
    assert time.monotonic() - t < 6  # the big file alone would take 6 s at 2 MB/s: it was stopped
    assert not (dst / "manifest.json").exists()


def test_a_front_end_started_with_sigchld_ignored_still_reaps_and_commits(tmp_path):
    """A launcher that set SIGCHLD to SIG_IGN (it survives exec) would let the kernel reap the copiers."""
    src = make_tree(tmp_path / "src", small=30)
    build(src)
    dst = tmp_path / "dst"
    r = subprocess.run(
        ["hpcscale", "stage", str(src / "manifest.json"), "--from", str(src), "--to", str(dst), "-j", "2", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=lambda: signal.signal(signal.SIGCHLD, signal.SIG_IGN),
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["committed"] and json.loads(r.stdout)["streams"] == 2
    same_tree(src, dst)


def test_a_work_pipe_that_cannot_grow_gets_longer_units_and_never_blocks(tmp_path, monkeypatch):
    """A user over the kernel's pipe limits gets small pipes that F_SETPIPE_SZ cannot grow: the units are cut to
    what the pipe holds (written before any copier exists, more would block for ever)."""
    import fcntl

    from hpcscale.xsite import copiers
    from hpcscale.xsite.stage import StageOptions, stage_files

    src = tmp_path / "src"
    for i in range(1500):
        d = src / f"d{i % 10}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"f{i}").write_bytes(i.to_bytes(4, "little"))
    build(src)
    monkeypatch.setattr(copiers, "CHUNK", 1)  # 1500 units: 6000 bytes of indexes
    monkeypatch.setattr(copiers, "widen_pipe", lambda fd, size: fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, 4096))
    r = stage_files(read_manifest(src / "manifest.json"), str(src), str(tmp_path / "dst"), opts=StageOptions(jobs=2))
    assert r.committed and r.sent == 1500 and r.streams == 2
    same_tree(src, tmp_path / "dst")


@pytest.mark.parametrize("where", ["child", "parent"])
def test_a_signal_while_forking_never_runs_the_front_ends_code_in_a_copier(tmp_path, where):
    """SIGINT arriving in a copier's first instant, or in the front end while it forks: the copier never unwinds
    through the front end's code (a second summary, a lock released under it); the front end handles its own."""
    src = make_tree(tmp_path / "src", small=30)
    build(src)
    dst = tmp_path / "dst"
    script = f"""
import os, signal, sys
from hpcscale.data.manifest import read_manifest
from hpcscale.xsite.stage import StageOptions, stage_files
me = os.getpid()
hook = "after_in_child" if {where!r} == "child" else "after_in_parent"
os.register_at_fork(**{{hook: lambda: os.kill(os.getpid(), signal.SIGINT)}})
try:
    m = read_manifest({str(src / "manifest.json")!r})
    r = stage_files(m, {str(src)!r}, {str(dst)!r}, opts=StageOptions(jobs=2))
    print("PID", os.getpid(), "committed", r.committed, r.streams, flush=True)
except KeyboardInterrupt:
    print("PID", os.getpid(), "interrupted", flush=True)
"""
    r = subprocess.run([PY, "-c", script], capture_output=True, text=True, timeout=120, cwd=REPO,
                       preexec_fn=_as_from_a_terminal)  # fmt: skip
    lines = [line for line in r.stdout.splitlines() if line.startswith("PID")]
    assert len(lines) == 1, r.stdout + r.stderr  # one process came back from stage_files: the front end
    assert "Traceback" not in r.stderr, r.stderr
    if where == "child":  # the copiers ignore it; the stage completes
        assert lines[0].endswith("committed True 2"), lines
        same_tree(src, dst)
    else:  # the front end's own Ctrl-C: copiers killed, nothing committed, the lock given back
        assert lines[0].endswith("interrupted"), lines
        assert not (dst / "manifest.json").exists()
        assert not (dst / ".hpcscale-stage" / "lock").exists()


def test_the_bandwidth_limit_is_one_budget_for_all_copier_processes(tmp_path):
    """One big file and three tiny ones at 1 MiB/s with -j 4: the process with the big file has the whole rate
    once the others are done (a 1/4 share each would take 12 s)."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "big.bin").write_bytes(os.urandom(3 << 20))
    for i in range(3):
        (src / f"t{i}").write_bytes(b"x")
    build(src)
    t = time.monotonic()
    r = stage_json(src / "manifest.json", str(src), str(tmp_path / "dst"), "--bwlimit", "1M", "-j", "4")
    took = time.monotonic() - t
    assert r["committed"] and r["streams"] == 4
    assert 2.0 <= took < 6.0, took


def test_no_memory_to_fork_copies_in_threads(tmp_path, monkeypatch):
    import errno

    from hpcscale.xsite.stage import StageOptions, stage_files

    src = make_tree(tmp_path / "src", small=20)
    build(src)

    def no_fork():
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    monkeypatch.setattr(os, "fork", no_fork)
    r = stage_files(read_manifest(src / "manifest.json"), str(src), str(tmp_path / "dst"), opts=StageOptions(jobs=3))
    assert r.committed and r.sent == 21 and r.streams == 3
    same_tree(src, tmp_path / "dst")


# -- stage over ssh (a real sshd on loopback) ------------------------------------------------------------


def test_ssh_push_and_pull_copy_verify_and_rerun_as_no_ops(tmp_path, sshd):
    src = make_tree(tmp_path / "src", big_mb=6)
    build(src)
    m = src / "manifest.json"
    remote = tmp_path / "remote"
    push = stage_json(m, str(src), sshd.url(remote), "-j", "3", *ssh_args(sshd))
    assert push["sent"] == 42 and push["verified"] == 42 and push["committed"]
    same_tree(src, remote)
    assert stage_json(m, str(src), sshd.url(remote), *ssh_args(sshd))["sent"] == 0

    local = tmp_path / "local"
    pull = stage_json(m, sshd.url(remote), str(local), "-j", "2", *ssh_args(sshd))
    assert pull["sent"] == 42 and pull["committed"]
    same_tree(src, local)
    assert stage_json(m, sshd.url(remote), str(local), *ssh_args(sshd))["sent"] == 0
    assert run_cli("manifest", "verify", str(local / "manifest.json")).returncode == 0


def test_ssh_push_killed_mid_transfer_resumes(tmp_path, sshd):
    src = make_tree(tmp_path / "src", small=20, big_mb=12)
    build(src)
    remote = tmp_path / "remote"
    cmd = ["hpcscale", "stage", str(src / "manifest.json"), "--from", str(src), "--to", sshd.url(remote)]
    _kill_when_part_appears([*cmd, "--bwlimit", "2M", *ssh_args(sshd)], remote)
    time.sleep(0.5)  # the remote agent sees EOF and exits
    _check_killed_state(src, remote)
    r = stage_json(src / "manifest.json", str(src), sshd.url(remote), *ssh_args(sshd))
    assert r["resumed"] == 1 and r["bytes_sent"] < 12 << 20 and r["committed"]
    same_tree(src, remote)
    assert no_parts(remote) == []


def test_ssh_pull_killed_mid_transfer_resumes(tmp_path, sshd):
    src = make_tree(tmp_path / "src", small=20, big_mb=12)
    build(src)
    local = tmp_path / "local"
    cmd = ["hpcscale", "stage", str(src / "manifest.json"), "--from", sshd.url(src), "--to", str(local)]
    _kill_when_part_appears([*cmd, "--bwlimit", "2M", *ssh_args(sshd)], local)
    _check_killed_state(src, local)
    r = stage_json(src / "manifest.json", sshd.url(src), str(local), *ssh_args(sshd))
    assert r["resumed"] == 1 and r["bytes_sent"] < 12 << 20 and r["committed"]
    same_tree(src, local)


def test_the_agent_needs_only_python3_on_the_remote(tmp_path, sshd):
    """Debian's own /usr/bin/python3 (no hpcscale, no xxhash) runs the agent for sha256 manifests, and
    refuses xxh128 ones naming the missing module."""
    debian_py = "/usr/bin/python3"
    need(os.path.exists(debian_py), "a system python3 beside the test interpreter")  # a second interpreter
    probe = subprocess.run([debian_py, "-c", "import xxhash"], capture_output=True)
    need(probe.returncode != 0, "a /usr/bin/python3 without xxhash")  # the proof needs a python3 without it
    src = make_tree(tmp_path / "src", small=4)
    build(src, "--algorithm", "sha256")
    args = ["--ssh", sshd.ssh_string(), "--remote-python", debian_py]
    r = stage_json(src / "manifest.json", str(src), sshd.url(tmp_path / "remote"), *args)
    assert r["sent"] == 5 and r["committed"]
    same_tree(src, tmp_path / "remote")
    build(src, "--algorithm", "xxh128")
    r = stage(src / "manifest.json", str(src), sshd.url(tmp_path / "remote2"), *args)
    assert r.returncode == 2 and "xxhash" in r.stderr


def test_ssh_connection_failure_is_a_runtime_error_naming_the_host(tmp_path, sshd):
    src = make_tree(tmp_path / "src", small=1)
    build(src)
    bad = f"ssh://127.0.0.1:1{tmp_path}/x"
    r = stage(src / "manifest.json", str(src), bad, "--ssh", sshd.ssh_string().replace(f"-p {sshd.port}", ""))
    assert r.returncode == 1, r.stderr
    assert "127.0.0.1" in r.stderr and "Traceback" not in r.stderr


# -- scale ---------------------------------------------------------------------------------------------------


def test_manifest_of_100k_files(tmp_path):
    root = tmp_path / "many"
    for d in range(100):
        sub = root / f"{d:02d}"
        sub.mkdir(parents=True)
        for i in range(1000):
            with open(sub / f"{i:04d}", "wb") as f:
                f.write(b"%d/%d" % (d, i))
    doc = build(root)
    assert doc["files"] == 100_000 and doc["hashed"] == 100_000
    again = build(root)
    assert again["reused"] == 100_000 and again["hashed"] == 0
    m = read_manifest(root / "manifest.json")
    assert m.files[12345].path == "12/0345" and m.files[12345].hash == xxhash.xxh3_128(b"12/345").hexdigest()


def test_manifest_and_stage_never_import_torch(tmp_path):
    """They run on login and transfer nodes: no torch, no mpi4py."""
    src = make_tree(tmp_path / "src", small=3)
    probe = (
        "import json, sys\n"
        "from hpcscale.cli.main import cli\n"
        "for args in ({build!r}, {stage!r}, {verify!r}):\n"
        "    try:\n"
        "        cli(args)\n"
        "    except SystemExit as e:\n"
        "        assert e.code in (0, None), (args, e.code)\n"
        "print(json.dumps({{'torch': 'torch' in sys.modules, 'mpi4py': 'mpi4py' in sys.modules}}))\n"
    ).format(
        build=["manifest", "build", str(src)],
        stage=["stage", str(src / "manifest.json"), "--from", str(src), "--to", str(tmp_path / "dst")],
        verify=["manifest", "verify", str(tmp_path / "dst" / "manifest.json")],
    )
    out = subprocess.run([PY, "-c", probe], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"torch": False, "mpi4py": False}


def test_stage_files_is_a_library_for_the_cross_site_rounds(tmp_path):
    """The cross-site rounds call stage_files in-process: same guarantees, a result object, errors as exceptions."""
    from hpcscale.errors import VerificationFailure
    from hpcscale.xsite.stage import StageOptions, stage_files

    src = make_tree(tmp_path / "src", small=4)
    build(src)
    m = read_manifest(src / "manifest.json")
    r = stage_files(m, str(src), str(tmp_path / "dst"), opts=StageOptions(jobs=2))
    assert r.sent == 5 and r.committed and read_manifest(tmp_path / "dst" / "manifest.json").files == m.files
    (src / "d0" / "sub" / "f0.bin").write_bytes(b"x" * 100)  # same size as before, other bytes
    with pytest.raises(VerificationFailure) as e:
        stage_files(m, str(src), str(tmp_path / "other"))
    assert "d0/sub/f0.bin" in str(e.value) and e.value.result.sent == 4


def test_a_remote_path_under_home_is_expanded_there(tmp_path, sshd):
    """ssh://host/~/x means x under the remote user's home, not a directory named '~'."""
    src = make_tree(tmp_path / "src", small=2)
    build(src)
    name = f"hpcscale-test-{os.getpid()}-{tmp_path.name}"
    home = Path(os.path.expanduser("~"))
    url = f"ssh://127.0.0.1:{sshd.port}/~/{name}"
    try:
        r = stage_json(src / "manifest.json", str(src), url, *ssh_args(sshd))
        assert r["sent"] == 3
        same_tree(src, home / name)
        assert not (REPO / "~").exists() and not (home / "~").exists()
    finally:
        import shutil

        shutil.rmtree(home / name, ignore_errors=True)


def test_prelaunch_starts_ssh_from_raw_arguments_and_the_command_adopts_only_a_match(tmp_path, sshd):
    """`hpcscale stage` starts ssh from its raw arguments before click loads (about 50 ms sooner); the command
    takes that channel only if it is the one click's parse calls for, and closes it otherwise."""
    import shlex

    from hpcscale.xsite import channel

    url = sshd.url(tmp_path / "remote")
    ssh = sshd.ssh_string()
    args = ["m.json", "--from", str(tmp_path), f"--to={url}", "-j", "2", "--ssh", ssh, "--remote-python", PY]
    src, dst = channel.parse_endpoint(str(tmp_path)), channel.parse_endpoint(url)

    channel.prelaunch(args)
    ch = channel._prelaunched
    assert ch is not None
    assert channel.take_prelaunched(src, dst, shlex.split(ssh), PY) is ch
    reply = ch.call({"op": "init", "opts": {"algorithm": "xxh128", "dry_run": False, "sync": False, "jobs": 1}})
    assert reply["ready"] and reply["root"] == str(tmp_path / "remote")  # a live agent at the other end
    ch.close()
    assert ch.p.returncode == 0

    channel.prelaunch(args)
    other = channel._prelaunched
    assert channel.take_prelaunched(src, dst, shlex.split(ssh), "python3.99") is None  # not what click parsed
    assert other.p.returncode is not None  # closed, not left running

    for extra in (["--dry-run"], ["--help"], ["-h"]):
        channel.prelaunch(args + extra)
        assert channel._prelaunched is None
    channel.prelaunch(["m.json", "--from", str(tmp_path)])  # no --to: nothing to start
    assert channel._prelaunched is None


@pytest.mark.parametrize("same_python", [True, False])
def test_boot_runs_the_compiled_agent_only_under_the_same_bytecode_magic(tmp_path, same_python):
    """The bootstrap runs the marshalled agent when the remote python has the local one's bytecode magic
    number, and compiles the source otherwise (here: a foreign magic number and bytes that are not even
    marshal data, which must then never be loaded)."""
    import io
    from importlib.util import MAGIC_NUMBER

    from hpcscale.portable import wire
    from hpcscale.xsite import bootstrap

    blobs = bootstrap.agent_blobs()
    if not same_python:
        blobs = bootstrap.boot_input(b"\x00\x01\r\n", b"not marshal data", bootstrap.agent_sources())
    assert (MAGIC_NUMBER in blobs[:32]) == same_python
    requests = io.BytesIO()
    wire.send(requests, {"op": "init", "opts": {"algorithm": "sha256"}})
    wire.send(requests, {"op": "bye"})
    r = subprocess.run(
        [PY, "-S", "-c", bootstrap.BOOT, "sink", str(tmp_path / "dst")],
        input=blobs + requests.getvalue(),
        capture_output=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    out = io.BytesIO(r.stdout)
    assert "hello" in wire.recv(out)
    assert wire.recv(out)["ready"] is True


def test_a_record_read_ahead_is_used_only_while_the_record_file_is_unchanged(tmp_path):
    """The agent reads the destination's record at 'init', before the plan takes the lock
    (Sink.prefetch_record). A record replaced in between (another stage's commit) must be read again: here the
    new record says nothing, so the plan hashes every file instead of trusting what was read ahead."""
    from hpcscale.portable.sink import Sink

    src = make_tree(tmp_path / "src", small=6)
    build(src)
    dst = tmp_path / "dst"
    stage_json(src / "manifest.json", str(src), str(dst))
    m = read_manifest(src / "manifest.json")
    entries = [[f.path, f.size, f.mtime_ns, f.hash, f.mode] for f in m.files]

    def plan(replace_record: bool) -> dict:
        sink = Sink(str(dst), m.hash_algorithm, jobs=1)
        try:
            sink.prefetch_record()
            if replace_record:
                sink._prefetch()  # the read ahead is done: what it read is the old record
                record = dst / ".hpcscale-stage" / "verified.json"
                fresh = record.with_name("fresh.tmp")
                fresh.write_text(json.dumps({"hash_algorithm": m.hash_algorithm, "files": {}}))
                os.replace(fresh, record)  # as a commit replaces it: another inode
            result = sink.plan(entries)
            assert result.up_to_date == len(entries)  # every file is in place either way
            return result
        finally:
            sink.close()

    assert plan(replace_record=False).hashed == 0  # proven by the record read ahead
    assert plan(replace_record=True).hashed == len(entries)  # the stale read ahead was not used
