"""Property: no manifest, valid or hostile, makes `manifest verify` or `stage` misbehave.

For every generated manifest (a valid one of a small real tree, then mutated: hostile paths, hashes, sizes,
mtimes, modes, types, nesting, numbers JSON cannot hold), both commands run against real files in a fresh tmp
directory, and:
- the exit code is 0, 2 or 3 (1 only for a documented runtime cause: a listed file missing at the source,
  or one that cannot be read);
- there is no Python traceback;
- nothing is created, changed or removed outside DST (the whole tmp directory is snapshotted before and after);
- a manifest.json at DST lists only files whose bytes, sizes and modes at DST match it (what `verify` proves).
Most examples run the click command in-process (a process start per example would take the minute alone);
`test_through_the_real_cli` runs a few through `hpcscale` itself.
"""

from __future__ import annotations

import copy
import json
import os
import stat
import tempfile
from pathlib import Path

import pytest
import xxhash
from click.testing import CliRunner
from conftest import run_cli
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hpcscale.cli.main import cli
from hpcscale.data.manifest import read_manifest
from hpcscale.errors import BadInput

TREE = {"a.bin": b"alpha" * 40, "d/b.bin": os.urandom(3000), "d/e/c.txt": b"", "x.sh": b"#!/bin/sh\n"}
MODES = {"a.bin": 0o644, "d/b.bin": 0o600, "d/e/c.txt": 0o000, "x.sh": 0o755}
DIR_MODES = {"d": 0o755, "d/e": 0o750, "hollow": 0o700}  # "hollow" is empty

HOSTILE_PATHS = [
    "/etc/passwd",
    "..",
    "../outside/secret",
    "d/../../outside/secret",
    "a//b",
    "./a.bin",
    "a.bin/",
    "d",
    "d/e",
    "fifo",
    "link-out",
    "link-in",
    "back\\slash",
    "nul\x00byte",
    "lone\ud800surrogate",
    ".hpcscale-stage/verified.json",
    ".hpcscale-stage/lock",
    ".a.bin.0123456789abcdef.hpcscale-part",
    "manifest.json",
    "new/dir/file.bin",
    "a.bin/under-a-file",
    "x" * 300,
    "",
]
HOSTILE_HASHES = [
    "x/../../../..",
    "../../outside",
    "",
    "0" * 31,
    "0" * 33,
    "0" * 64,
    "A" * 32,
    "0" * 31 + "\x00",
    xxhash.xxh3_128(b"other").hexdigest(),
]
HOSTILE_INTS = [-1, 0, 1, 10**30, -(10**30), 2**63, 2**63 - 1, -(2**63), 9 << 20]
HOSTILE_MODES = [-1, 0o1000, 0o4755, 0, 0o777, 0o7777]
ANY = [None, True, False, 1.5, "12", [], {}, [1, 2], {"a": 1}, "\ud800"]
RAW_NUMBERS = ["1e999", "-1e999", "NaN", "Infinity", "-Infinity", "1" * 5000, "1.0e308"]


def _tree(top: Path) -> Path:
    src = top / "src"
    for rel, data in TREE.items():
        p = src / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
        p.chmod(MODES[rel])
    (src / "hollow").mkdir()
    for rel, mode in DIR_MODES.items():
        (src / rel).chmod(mode)
    os.mkfifo(src / "fifo")
    outside = top / "outside"
    outside.mkdir()
    (outside / "secret").write_text("not to be read or written")
    (src / "link-out").symlink_to(outside / "secret")
    (src / "link-in").symlink_to(src / "a.bin")
    return src


def _valid_dirs() -> list[dict]:
    return [{"path": rel, "mode": mode} for rel, mode in sorted(DIR_MODES.items())]


def _valid_entries() -> list[dict]:
    out = []
    for rel, data in sorted(TREE.items()):
        entry = {"path": rel, "size": len(data), "mtime_ns": 1_700_000_000_000_000_000 + len(rel)}
        entry["hash"] = xxhash.xxh3_128(data).hexdigest()
        entry["mode"] = MODES[rel]
        out.append(entry)
    return out


@st.composite
def manifests(draw) -> str:
    """A manifest's text: valid, or mutated in one to three ways."""
    doc = {"format": "hpcscale-manifest", "version": 1, "hash_algorithm": "xxh128", "files": _valid_entries()}
    doc["dirs"] = _valid_dirs()
    raw_number = None
    for _ in range(draw(st.integers(0, 3))):
        files = doc["files"] if isinstance(doc.get("files"), list) else []
        op = draw(
            st.sampled_from(
                ["path", "hash", "size", "mtime", "mode", "any_field", "add", "drop_field", "top", "deep", "dir"]
            )
            if files
            else st.sampled_from(["add", "top", "deep", "dir"])
        )
        if op == "dir":
            dirs = doc.get("dirs") if isinstance(doc.get("dirs"), list) else []
            d = {"path": draw(st.sampled_from(["d", "d/e", "new/empty", "a.bin", *HOSTILE_PATHS])), "mode": 0o755}
            if draw(st.booleans()):
                d["mode"] = copy.deepcopy(draw(st.sampled_from([*HOSTILE_MODES, *ANY])))
            dirs.append(copy.deepcopy(draw(st.sampled_from([d, d, "d", 7, [d]]))))
            doc["dirs"] = dirs
            continue
        if op in ("path", "hash", "size", "mtime", "mode", "any_field", "drop_field"):
            entry = files[draw(st.integers(0, len(files) - 1))]
            if not isinstance(entry, dict):
                continue
            key = {"path": "path", "hash": "hash", "size": "size", "mtime": "mtime_ns", "mode": "mode"}.get(op)
            if op == "path":
                entry["path"] = draw(st.sampled_from(HOSTILE_PATHS))
            elif op == "hash":
                entry["hash"] = draw(st.sampled_from(HOSTILE_HASHES))
            elif op in ("size", "mtime"):
                if draw(st.booleans()):
                    entry[key] = draw(st.sampled_from(HOSTILE_INTS))
                else:
                    entry[key] = "@RAW@"
                    raw_number = draw(st.sampled_from(RAW_NUMBERS))
            elif op == "mode":
                entry["mode"] = draw(st.sampled_from(HOSTILE_MODES))
            elif op == "any_field":
                entry[draw(st.sampled_from(["path", "size", "mtime_ns", "hash", "mode"]))] = copy.deepcopy(
                    draw(st.sampled_from(ANY))
                )
            else:
                entry.pop(draw(st.sampled_from(["path", "size", "mtime_ns", "hash", "mode"])), None)
        elif op == "add":
            data = TREE[draw(st.sampled_from(sorted(TREE)))]
            entry = {"path": draw(st.sampled_from(HOSTILE_PATHS)), "size": len(data), "mtime_ns": 0}
            entry["hash"] = xxhash.xxh3_128(data).hexdigest()
            files.append(copy.deepcopy(draw(st.sampled_from([entry, "a.bin", 5, None, [entry]]))))
            doc["files"] = files
        elif op == "top":
            key = draw(st.sampled_from(["files", "dirs", "format", "version", "hash_algorithm", "meta", "dataset"]))
            doc[key] = copy.deepcopy(draw(st.sampled_from([*ANY, 5, "sha256", 2])))  # never share a pool's object
        else:
            depth = draw(st.sampled_from([10, 1000, 200_000]))
            doc["meta"] = "@DEEP@"
            raw_deep = "[" * depth + "]" * depth
            text = json.dumps(doc).replace('"@DEEP@"', raw_deep)
            doc = {"__text__": text}
            break
    text = doc["__text__"] if "__text__" in doc else json.dumps(doc)
    if raw_number is not None:
        text = text.replace('"@RAW@"', raw_number)
    return text


def _snapshot(top: Path, skip: Path) -> dict[str, tuple]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(top):
        if Path(dirpath) == skip or str(dirpath).startswith(f"{skip}/"):
            continue
        for n in dirnames + filenames:
            p = os.path.join(dirpath, n)
            if p == str(skip):
                continue
            s = os.lstat(p)
            out[p] = (s.st_mode, s.st_size, s.st_mtime_ns, s.st_ino, s.st_nlink)
    return out


def _check_destination(dst: Path) -> None:
    """A manifest at DST vouches only for what is there: every listed file has its size, hash and mode, every
    listed directory is one, with its mode."""
    if not (dst / "manifest.json").is_file():
        return
    try:
        m = read_manifest(dst / "manifest.json")
    except BadInput:
        return  # a data file of that name, listed by the manifest and staged as data: no manifest at DST
    for d in m.dirs:
        st_ = os.lstat(dst / d.path)
        assert stat.S_ISDIR(st_.st_mode) and stat.S_IMODE(st_.st_mode) == d.mode, d.path
    for f in m.files:
        p = dst / f.path
        st_ = os.lstat(p)
        assert stat.S_ISREG(st_.st_mode), f.path
        assert xxhash.xxh3_128(p.read_bytes()).hexdigest() == f.hash and st_.st_size == f.size, f.path
        if f.mode is not None:
            assert stat.S_IMODE(st_.st_mode) == f.mode, f.path


RUNTIME_CAUSES = ("cannot be read", "No such file or directory", "Not a directory")  # docs/staging.md, exit codes


def _ok(code: int, output: str) -> bool:
    """0, 2, 3; or 1 for a documented runtime cause: a listed file missing at the source, or unreadable."""
    return code in (0, 2, 3) or (code == 1 and any(c in output for c in RUNTIME_CAUSES))


def _run_example(text: str, invoke) -> None:
    with tempfile.TemporaryDirectory() as d:
        top = Path(d)
        src = _tree(top)
        manifest = top / "m" / "manifest.json"
        manifest.parent.mkdir()
        manifest.write_text(text, encoding="utf-8", errors="surrogatepass")
        dst = top / "dst"
        before = _snapshot(top, dst)
        code, out = invoke(["manifest", "verify", str(manifest), "--root", str(src)])
        assert _ok(code, out), (code, out)
        code, out = invoke(["stage", str(manifest), "--from", str(src), "--to", str(dst), "-j", "2"])
        assert _ok(code, out), (code, out)
        assert _snapshot(top, dst) == before
        _check_destination(dst)
        if code != 0:
            return
        m = read_manifest(manifest)
        if "manifest.json" not in {f.path for f in m.files} | {d.path for d in m.dirs}:
            assert (dst / "manifest.json").read_bytes() == manifest.read_bytes()
            code, out = invoke(["manifest", "verify", str(dst / "manifest.json")])
            assert code == 0, out


def _in_process(args: list[str]) -> tuple[int, str]:
    r = CliRunner().invoke(cli, args)
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    assert "Traceback" not in r.output
    return r.exit_code, r.output


def _real(args: list[str]) -> tuple[int, str]:
    r = run_cli(*args, timeout=30)
    assert "Traceback" not in r.stderr, r.stderr
    return r.returncode, r.stdout + r.stderr


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(manifests())
def test_no_manifest_makes_verify_or_stage_misbehave(text):
    _run_example(text, _in_process)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(manifests())
def test_through_the_real_cli(text):
    _run_example(text, _real)


def test_the_valid_manifest_stages_with_its_modes():
    """The unmutated manifest is the control: it must stage, keep modes, and verify at the destination."""
    text = json.dumps(
        {
            "format": "hpcscale-manifest",
            "version": 1,
            "hash_algorithm": "xxh128",
            "files": _valid_entries(),
            "dirs": _valid_dirs(),
        }
    )
    _run_example(text, _in_process)
    with tempfile.TemporaryDirectory() as d:
        top = Path(d)
        src = _tree(top)
        (top / "manifest.json").write_text(text)
        code, out = _in_process(["stage", str(top / "manifest.json"), "--from", str(src), "--to", str(top / "dst")])
        assert code == 0, out
        for rel, mode in {**MODES, **DIR_MODES}.items():
            assert stat.S_IMODE(os.lstat(top / "dst" / rel).st_mode) == mode, rel


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.from_regex(r"[A-Za-z0-9_.-]{1,8}", fullmatch=True).filter(lambda s: s not in (".", "..")),
        min_size=1,
        max_size=4,
    ),
    st.integers(1, 3),
)
def test_a_path_under_a_listed_file_is_refused_when_read(parts, depth):
    """'Data.bin' and 'Data.bin/x' cannot both exist: refused at read time (exit 2), not at the copy."""
    from hpcscale.data.manifest import parse_manifest

    file = "/".join(parts)
    below = file + "".join(f"/n{i}" for i in range(depth))
    digest = "0" * 32
    doc = {"format": "hpcscale-manifest", "version": 1, "hash_algorithm": "xxh128",
           "files": [{"path": p, "size": 0, "hash": digest} for p in (below, file)]}  # fmt: skip
    try:
        parse_manifest(doc, "m.json")
    except BadInput as e:
        assert f"'{below}' lies under '{file}', which is listed as a file" in str(e)
    else:
        raise AssertionError("accepted a path under a listed file")


def test_stage_of_a_manifest_listing_a_file_and_a_path_under_it_is_exit_2(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    (src / "Data.bin").mkdir(parents=True)
    (src / "Data.bin" / "x").write_bytes(b"x")
    digest = xxhash.xxh3_128_hexdigest(b"x")
    manifest = tmp_path / "m.json"
    manifest.write_text(json.dumps({"format": "hpcscale-manifest", "version": 1, "hash_algorithm": "xxh128",
                                    "files": [{"path": "Data.bin", "size": 1, "hash": digest},
                                              {"path": "Data.bin/x", "size": 1, "hash": digest}]}))  # fmt: skip
    result = run_cli("stage", str(manifest), "--from", str(src), "--to", str(dst))
    assert result.returncode == 2, result.stdout + result.stderr
    assert "'Data.bin/x' lies under 'Data.bin', which is listed as a file" in result.stderr
    assert not dst.exists()


TOKEN_DTYPE = st.one_of(st.sampled_from(["uint8", "uint16", "uint32"]), st.text(max_size=8), st.integers(), st.none())
COUNT = st.one_of(st.integers(-2, 2**40), st.booleans(), st.floats(allow_nan=False), st.text(max_size=4), st.none())


@settings(max_examples=300, deadline=None)
@given(dtype=st.one_of(st.just(...), TOKEN_DTYPE), vocab=COUNT, sample_len=COUNT)
def test_a_dataset_reads_back_its_dtype_and_vocabulary_or_is_refused_naming_the_key(dtype, vocab, sample_len):
    """`dataset.dtype` (uint8, uint16 or uint32; absent, from before it was written: uint16) and
    `dataset.vocab_size` / `sample_len` (positive integers): a manifest with them reads back exactly what it
    says, and one that written again reads the same; anything else is BadInput naming the key."""
    from hpcscale.data.manifest import manifest_text, parse_manifest

    doc = {
        "format": "hpcscale-manifest",
        "version": 1,
        "hash_algorithm": "xxh128",
        "files": [{"path": "shards/000000.bin", "size": 0, "hash": "0" * 32}],
        "dataset": {"kind": "tokens", "vocab_size": vocab, "sample_len": sample_len, "shards": []},
    }
    doc["dataset"]["shards"] = [{"path": "shards/000000.bin", "samples": 0}]
    if dtype is not ...:
        doc["dataset"]["dtype"] = dtype
    good_count = [type(v) is int and v > 0 for v in (vocab, sample_len)]
    good_dtype = dtype is ... or dtype in ("uint8", "uint16", "uint32")
    if not all(good_count):
        key = "vocab_size" if not good_count[0] else "sample_len"
        with pytest.raises(BadInput, match=rf"m\.json: dataset\.{key}: "):
            parse_manifest(doc, "m.json")
        return
    if not good_dtype:
        with pytest.raises(BadInput, match=r"m\.json: dataset\.dtype: .* is not uint8, uint16 or uint32"):
            parse_manifest(doc, "m.json")
        return
    m = parse_manifest(doc, "m.json")
    want = "uint16" if dtype is ... else dtype
    assert (m.dataset.dtype, m.dataset.vocab_size, m.dataset.sample_len) == (want, vocab, sample_len)
    again = parse_manifest(json.loads(manifest_text(m)), "again.json")
    assert again.dataset == m.dataset and json.loads(manifest_text(m))["dataset"]["dtype"] == want
