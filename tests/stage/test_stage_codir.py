"""A staging destination that others can write (docs/staging.md, "nothing outside DST"): a directory swapped
for a symlink at any moment is never written through, and records that vouch for content are trusted only when
no one else could have written them. Real files, real copier processes, a real sshd on loopback, other uids by
chown (the tests run as root in CI)."""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import stat
import sys
import threading
import time
from pathlib import Path

import pytest
import xxhash
from conftest import run_cli
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_stage import build, ssh_args, stage, stage_json

from hpcscale.data.manifest import read_manifest
from hpcscale.errors import HpcscaleError
from hpcscale.portable import sink as sink_module
from hpcscale.portable.sink import Sink
from hpcscale.util.progress import Progress
from hpcscale.xsite.channel import parse_endpoint
from hpcscale.xsite.stage import StageOptions
from hpcscale.xsite.stage import stage as stage_lib

OTHER_UID = 65534  # nobody: a co-user who can write the destination
DIR_FDS = getattr(sink_module, "DIR_FDS", 64)  # directory descriptors a Sink keeps open


def snapshot(root: Path) -> dict[str, tuple]:
    """Everything under root, by lstat: type, mode, and the bytes (or link target) hashed."""
    out: dict[str, tuple] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames + filenames:
            p = os.path.join(dirpath, n)
            s = os.lstat(p)
            if stat.S_ISLNK(s.st_mode):
                body = os.readlink(p)
            elif stat.S_ISREG(s.st_mode):
                body = hashlib.sha256(Path(p).read_bytes()).hexdigest()
            else:
                body = ""
            out[os.path.relpath(p, root)] = (stat.S_IFMT(s.st_mode), stat.S_IMODE(s.st_mode), body)
    return out


def deep_tree(root: Path, n: int = 12) -> Path:
    """n small files in a/b/c, one in a and one in a/b: a listed path with three directory levels."""
    (root / "a" / "b" / "c").mkdir(parents=True)
    for i in range(n):
        (root / "a" / "b" / "c" / f"f{i:03d}.bin").write_bytes(os.urandom(50 + i))
    (root / "a" / "top.bin").write_bytes(b"top")
    (root / "a" / "b" / "mid.bin").write_bytes(b"mid")
    return root


def outside_mirror(tmp_path: Path, level: str) -> Path:
    """A directory outside DST shaped like DST/level (so a write through a symlink there would land), holding
    a victim file under the name of a listed one."""
    out = tmp_path / "outside" / level.replace("/", "_")
    rest = {"a": "b/c", "a/b": "c", "a/b/c": ""}[level]
    (out / rest).mkdir(parents=True)
    (out / rest / "f000.bin").write_bytes(b"victim: must never change")
    (out / "keep.txt").write_bytes(b"untouched")
    return out


class SwapAfterPlan(Progress):
    """Called by the stage once its plan is done and before any file is placed: moves DST/level away and puts a
    symlink to `target` at its name, as a co-user could at that moment."""

    def __init__(self, dst: Path, level: str, target: Path):
        self.dst, self.level, self.target = dst, level, target
        self.swapped = False

    def start(self, files: int, nbytes: int) -> None:
        real = self.dst / self.level
        os.rename(real, real.with_name(real.name + ".moved"))
        os.symlink(self.target, real)
        self.swapped = True


def _endpoint_args(kind: str, src: Path, dst: Path, request) -> tuple[str, str, StageOptions]:
    if kind == "local":
        return str(src), str(dst), StageOptions(jobs=1)
    sshd = request.getfixturevalue("sshd")
    opts = StageOptions(jobs=1, ssh=tuple(shlex.split(sshd.ssh_string())), remote_python=sys.executable)
    return str(src), sshd.url(dst), opts


@pytest.mark.parametrize("kind", ["local", "push"])
@pytest.mark.parametrize("level", ["a", "a/b", "a/b/c"])
def test_a_symlink_at_any_level_of_a_listed_path_is_never_written_through(tmp_path, request, kind, level):
    src = deep_tree(tmp_path / "src")
    build(src)
    m = read_manifest(src / "manifest.json")
    outside = outside_mirror(tmp_path, level)
    before = snapshot(tmp_path / "outside")

    # planted before the stage: refused at the plan, naming it
    dst = tmp_path / "dst-planted"
    (dst / level).parent.mkdir(parents=True, exist_ok=True)
    os.symlink(outside, dst / level)
    frm, to, opts = _endpoint_args(kind, src, dst, request)
    with pytest.raises(HpcscaleError) as e:
        stage_lib(m, "{}", parse_endpoint(frm), parse_endpoint(to), opts)
    assert e.value.exit_code == 2 and f"{dst}/{level} is a symlink" in str(e.value)

    # swapped in after the plan found real directories there: nothing outside changes, no manifest
    dst = tmp_path / "dst-swapped"
    (dst / "a" / "b" / "c").mkdir(parents=True)
    frm, to, opts = _endpoint_args(kind, src, dst, request)
    swap = SwapAfterPlan(dst, level, outside)
    with pytest.raises(HpcscaleError) as e:
        stage_lib(m, "{}", parse_endpoint(frm), parse_endpoint(to), opts, progress=swap)
    assert swap.swapped
    assert e.value.exit_code == 2, e.value
    assert f"{dst}/{level}" in str(e.value), e.value
    assert snapshot(tmp_path / "outside") == before
    assert not (dst / "manifest.json").exists()


def test_a_directory_swapped_after_its_descriptor_was_evicted_fails_the_file_naming_it(tmp_path):
    """More directories than a Sink keeps descriptors for (DIR_FDS): the first ones are closed before their
    files are placed and walked again then, which finds the symlink and fails the file (exit 2)."""

    src = tmp_path / "src"
    for i in range(DIR_FDS + 20):
        (src / f"d{i:03d}").mkdir(parents=True)
        (src / f"d{i:03d}" / "f.bin").write_bytes(os.urandom(64))
    build(src)
    m = read_manifest(src / "manifest.json")
    dst = tmp_path / "dst"
    for i in range(DIR_FDS + 20):
        (dst / f"d{i:03d}").mkdir(parents=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "f.bin").write_bytes(b"victim")
    before = snapshot(outside)
    with pytest.raises(HpcscaleError) as e:
        stage_lib(
            m,
            "{}",
            parse_endpoint(str(src)),
            parse_endpoint(str(dst)),
            StageOptions(jobs=1),
            SwapAfterPlan(dst, "d000", outside),
        )
    assert e.value.exit_code == 2 and f"{dst}/d000 is a symlink" in str(e.value)
    assert snapshot(outside) == before
    assert not (dst / "manifest.json").exists()


def _dirs_open_under(root: Path) -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(f"{root}/") and os.path.isdir(target):
            n += 1
    return n


def test_many_directories_keep_a_bounded_number_of_descriptors_open(tmp_path):
    """A descriptor per directory, once per stage, at most DIR_FDS kept (plus those in use), all closed at the
    end: 256 directories of one file each (a/dNNN: two levels)."""

    src = tmp_path / "src"
    for i in range(4 * DIR_FDS):
        (src / "a" / f"d{i:03d}").mkdir(parents=True)
        (src / "a" / f"d{i:03d}" / "f.bin").write_bytes(os.urandom(64))
    build(src)
    m = read_manifest(src / "manifest.json")
    dst = tmp_path / "dst"
    most = [0]

    class Count(Progress):
        def advance(self, files: int = 0, nbytes: int = 0) -> None:
            most[0] = max(most[0], _dirs_open_under(dst))

    r = stage_lib(m, "{}", parse_endpoint(str(src)), parse_endpoint(str(dst)), StageOptions(jobs=1), Count())
    assert r.committed and r.sent == len(m.files)
    assert 0 < most[0] <= DIR_FDS + 4
    assert _dirs_open_under(dst) == 0  # every one closed at the end


# -- a co-user swapping a directory while a real `hpcscale stage` runs ---------------------------------------


class Swapper(threading.Thread):
    """Keeps moving DST/sub away and putting a symlink to `outside` at its name, then moving it back."""

    def __init__(self, sub: Path, outside: Path):
        super().__init__(daemon=True)
        self.sub, self.hold, self.outside = sub, sub.with_name("sub.hold"), outside
        self.stop = threading.Event()
        self.swaps = 0

    def run(self) -> None:
        # from the first file placed on: the plan has found a real directory, the writes are under way
        while not self.stop.is_set() and not any(os.scandir(self.sub)):
            time.sleep(0.0002)
        while not self.stop.is_set():
            try:
                os.rename(self.sub, self.hold)
            except OSError:
                time.sleep(0.0005)
                continue
            try:
                os.symlink(self.outside, self.sub)
                self.swaps += 1
                time.sleep(0.002)
                os.unlink(self.sub)
            except OSError:
                pass
            self.restore()
            time.sleep(0.001)

    def restore(self) -> None:
        if self.sub.is_symlink():
            os.unlink(self.sub)
        if self.hold.exists() and not self.sub.exists():
            os.rename(self.hold, self.sub)


@pytest.mark.parametrize("kind", ["local", "push"])
def test_a_concurrent_swapper_never_gets_a_write_outside_and_never_a_false_manifest(tmp_path, request, kind):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    for i in range(400):
        (src / "sub" / f"f{i:03d}.bin").write_bytes(os.urandom(40 + i % 50))
    build(src)
    outside = tmp_path / "outside"
    outside.mkdir()
    for i in range(0, 400, 7):
        (outside / f"f{i:03d}.bin").write_bytes(b"victim")
    before = snapshot(outside)
    dst = tmp_path / "dst"
    (dst / "sub").mkdir(parents=True)
    if kind == "local":
        to, args = str(dst), ["-j", "2", "--bwlimit", "64K"]
    else:
        sshd = request.getfixturevalue("sshd")
        to, args = sshd.url(dst), [*ssh_args(sshd), "-j", "1", "--bwlimit", "64K"]
    swapper = Swapper(dst / "sub", outside)
    swapper.start()
    try:
        r = stage(src / "manifest.json", str(src), to, *args)
    finally:
        swapper.stop.set()
        swapper.join()
        swapper.restore()
    assert swapper.swaps > 0
    assert "Traceback" not in r.stderr, r.stderr
    assert snapshot(outside) == before, "a file was written outside the destination"
    assert r.returncode in (0, 1, 2), r.stderr
    if r.returncode == 0:
        v = run_cli("manifest", "verify", str(dst / "manifest.json"), "--root", str(dst))
        assert v.returncode == 0, v.stdout + v.stderr
    else:
        assert not (dst / "manifest.json").exists()
        assert "symlink" in r.stderr or "replaced" in r.stderr or "vanished" in r.stderr or "removed" in r.stderr


@pytest.mark.parametrize("now", ["symlink", "directory", "gone", "file"])
def test_a_directory_refused_as_it_was_opened_is_named_for_what_is_there_now(tmp_path, now):
    """open(O_NOFOLLOW|O_DIRECTORY) refused a name; by the time the refusal is worded, a swapper may have put the
    directory back or removed its symlink: every state says why (the swapper test above meets each by chance)."""
    dst = tmp_path / "dst"
    dst.mkdir()
    sub = dst / "sub"
    if now == "symlink":
        sub.symlink_to(tmp_path)
    elif now == "directory":
        sub.mkdir()
    elif now == "file":
        sub.write_bytes(b"x")
    sink = Sink(str(dst), "xxh128", jobs=1)
    try:
        err = sink._in_the_way(sink.root_fd(), "sub", "sub")
    finally:
        sink.close()
    words = str(err)
    assert f"{dst}/sub" in words
    assert {
        "symlink": "is a symlink",
        "directory": "is a directory again now",
        "gone": "was removed since",
        "file": "is in the way",
    }[now] in words, words
    assert now == "file" or "never writes through a symlink" in words


# -- records that vouch for content --------------------------------------------------------------------------


def _replace_and_forge(dst: Path, rel: str, how: str) -> None:
    """Replace dst/rel with other bytes of the same size (mtime put back), and forge the record so that its
    line matches the new file's stat with the manifest's hash, as a co-user with write access could."""
    f = dst / rel
    old = f.stat()
    f.write_bytes(bytes(b ^ 0xFF for b in f.read_bytes()))
    os.utime(f, ns=(old.st_atime_ns, old.st_mtime_ns))
    new = f.stat()
    state = dst / ".hpcscale-stage"
    record = state / "verified.json"
    doc = json.loads(record.read_text())
    good = doc["files"][rel][4]
    doc["files"][rel] = [new.st_size, new.st_mtime_ns, new.st_ctime_ns, new.st_ino, good]
    forged = state / "forged.tmp"
    forged.write_text(json.dumps(doc))
    if how == "other-uid":
        os.chown(forged, OTHER_UID, OTHER_UID)
        os.chmod(forged, 0o644)
    elif how == "writable":
        os.chmod(forged, 0o666)
    os.replace(forged, record)
    if how == "open-dir":
        os.chmod(state, 0o777)


@pytest.mark.parametrize(
    ("kind", "how"),
    [("local", "other-uid"), ("local", "writable"), ("local", "open-dir"), ("push", "other-uid"), ("push", "open-dir")],
)
def test_a_forged_record_is_not_trusted(tmp_path, request, kind, how):
    src = deep_tree(tmp_path / "src", n=6)
    build(src)
    dst = tmp_path / "dst"
    if kind == "local":
        to, args = str(dst), []
    else:
        sshd = request.getfixturevalue("sshd")
        to, args = sshd.url(dst), ssh_args(sshd)
    assert stage_json(src / "manifest.json", str(src), to, *args)["committed"]
    state = dst / ".hpcscale-stage"
    modes = stat.S_IMODE(state.stat().st_mode), stat.S_IMODE((state / "verified.json").stat().st_mode)
    rel = "a/b/c/f002.bin"
    _replace_and_forge(dst, rel, how)
    out = stage_json(src / "manifest.json", str(src), to, *args)
    assert out["sent"] == 1 and out["up_to_date"] == out["files"] - 1, out  # hashed, caught, sent again
    # the user is told why everything was hashed (over ssh too: the remote sink's reason, checked and cleaned)
    assert ".hpcscale-stage" in (out["record_ignored"] or ""), out
    assert (dst / rel).read_bytes() == (src / rel).read_bytes()
    v = run_cli("manifest", "verify", str(dst / "manifest.json"), "--root", str(dst))
    assert v.returncode == 0, v.stdout + v.stderr
    assert modes == (0o700, 0o600)  # made private by the first stage
    if how == "open-dir":  # left open (a team may share it on purpose), and so never trusted again
        assert stat.S_IMODE(state.stat().st_mode) == 0o777
        again = stage_json(src / "manifest.json", str(src), to, *args)
        assert again["committed"] and again["proven_by_hash"] == again["files"], again


def _staged(tmp_path: Path) -> tuple[Path, Path, object, list[list]]:
    """A small tree staged once: (src, dst, its manifest, the manifest's entries as Sink.plan takes them)."""
    src = deep_tree(tmp_path / "src", n=3)
    build(src)
    dst = tmp_path / "dst"
    stage_json(src / "manifest.json", str(src), str(dst))
    m = read_manifest(src / "manifest.json")
    return src, dst, m, [[f.path, f.size, f.mtime_ns, f.hash, f.mode] for f in m.files]


@pytest.mark.parametrize("how", ["other-uid", "writable", "open-dir"])
def test_the_plan_says_why_it_ignored_the_record(tmp_path, how):
    src, dst, m, entries = _staged(tmp_path)
    _replace_and_forge(dst, "a/b/c/f001.bin", how)
    sink = Sink(str(dst), m.hash_algorithm, jobs=1)
    try:
        plan = sink.plan(entries)
    finally:
        sink.close()
    why = plan.record_ignored
    assert isinstance(why, str) and ".hpcscale-stage" in why
    assert {"other-uid": f"uid {OTHER_UID}", "writable": "writable by", "open-dir": "writable by"}[how] in why
    assert plan.hashed == len(entries)  # every file there hashed, as with --check hash
    assert plan.statuses.count(0) == 1  # the replaced one, caught
    # a trusted record: no such field (the reply stays as it was); a state directory others can write is left
    # open (a team may share it) and stays untrusted
    stage_json(src / "manifest.json", str(src), str(dst))
    sink = Sink(str(dst), m.hash_algorithm, jobs=1)
    try:
        assert ("record_ignored" in sink.plan(entries).info()) == (how == "open-dir")
    finally:
        sink.close()


def test_a_record_over_its_bound_is_ignored_and_every_file_hashed(tmp_path, monkeypatch):
    """verified.json is read whole before it is parsed, at most RECORD_MAX bytes: a bigger one was not written
    by hpcscale, so it vouches for nothing and the plan says why."""
    _src, dst, m, entries = _staged(tmp_path)
    monkeypatch.setattr(sink_module, "RECORD_MAX", 16)
    sink = Sink(str(dst), m.hash_algorithm, jobs=1)
    try:
        plan = sink.plan(entries)
    finally:
        sink.close()
    assert "over the 16 a record may hold" in (plan.record_ignored or ""), plan.record_ignored
    assert plan.hashed == len(entries) and plan.up_to_date == len(entries)


def test_a_forged_journal_never_reaches_the_record(tmp_path):
    """A journal line vouches for content at the next commit: one planted by another uid, matching a replaced
    file's stat, must not be merged into the record (old behaviour: it was, and the next stage trusted it)."""
    src = deep_tree(tmp_path / "src", n=4)
    build(src)
    dst = tmp_path / "dst"
    stage_json(src / "manifest.json", str(src), str(dst))
    rel = "a/b/c/f001.bin"
    f = dst / rel
    good = json.loads((dst / ".hpcscale-stage" / "verified.json").read_text())["files"][rel][4]
    old = f.stat()
    f.write_bytes(bytes(b ^ 0xFF for b in f.read_bytes()))
    os.utime(f, ns=(old.st_atime_ns, old.st_mtime_ns))
    new = f.stat()
    journal = dst / ".hpcscale-stage" / "journal-0123456789abcdef-00.jsonl"
    line = ["xxh128", rel, [new.st_size, new.st_mtime_ns, new.st_ctime_ns, new.st_ino, good]]
    journal.write_text(json.dumps(line) + "\n")
    os.chown(journal, OTHER_UID, OTHER_UID)
    # a stage of another manifest (not listing the file) commits: journals are merged into the record then
    doc = json.loads((src / "manifest.json").read_text())
    doc["files"] = [e for e in doc["files"] if e["path"] != rel]
    (tmp_path / "part.json").write_text(json.dumps(doc))
    assert stage_json(tmp_path / "part.json", str(src), str(dst))["committed"]
    assert rel not in json.loads((dst / ".hpcscale-stage" / "verified.json").read_text())["files"]
    out = stage_json(src / "manifest.json", str(src), str(dst))
    assert out["sent"] == 1, out
    assert f.read_bytes() == (src / rel).read_bytes()


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=12,
)
_line = st.one_of(
    _json,
    st.tuples(
        st.sampled_from(["xxh128", "sha256"]),
        st.text(min_size=1, max_size=12),
        st.lists(st.integers(), max_size=5),
        st.lists(st.integers(min_value=0, max_value=2**63), min_size=2, max_size=2),
    ).map(list),
    st.tuples(st.just("xxh128"), st.text(min_size=1, max_size=12), st.lists(st.integers(), max_size=5)).map(list),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lines=st.lists(_line, max_size=8))
def test_journal_lines_of_any_shape_never_crash_and_well_formed_ones_are_taken(tmp_path, lines):
    """Journal lines with and without the directory they were placed in (4 or 3 fields) are taken; anything
    else is skipped, never an exception."""
    dst = tmp_path / f"d{xxhash.xxh3_64(repr(lines).encode()).hexdigest()}"
    state = dst / ".hpcscale-stage"
    state.mkdir(parents=True, mode=0o700, exist_ok=True)
    (state / "journal-00-00.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    sink = Sink(str(dst), "xxh128", jobs=1)
    try:
        records, journals = sink.load_records()
    finally:
        sink.close()
    assert journals
    want = {}
    for x in lines:
        if type(x) is list and len(x) in (3, 4) and x[0] == "xxh128" and type(x[1]) is str:
            want[x[1]] = x[2]
    assert records == want
