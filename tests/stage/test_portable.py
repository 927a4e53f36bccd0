"""hpcscale.portable and the staging agent travel to another site's bare python3 (hpcscale/xsite/bootstrap.py):
the promises that make that work, held on the source and proven by running the agent on an older python."""

from __future__ import annotations

import ast
import glob
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, need
from hypothesis import given, settings
from hypothesis import strategies as st
from test_stage import build, make_tree, same_tree, stage, stage_json

from hpcscale.portable import hashing, paths
from hpcscale.portable.errors import KINDS, StageError
from hpcscale.xsite import bootstrap

PORTABLE = REPO / "hpcscale" / "portable"
SHIPPED = {name: Path(bootstrap.module_path(name)) for name in bootstrap.AGENT_MODULES}
OPTIONAL = {"xxhash", "blake3"}  # hash modules, imported when first needed and reported when missing


def _imports(path: Path) -> list[str]:
    """Every module `path` imports, anywhere in the file (inside functions too), as the most specific name:
    `from hpcscale.portable import wire` names hpcscale.portable.wire when that is a module."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert not node.level, f"{path}: a relative import (the remote installs modules by absolute name)"
            for a in node.names:
                child = f"{node.module}.{a.name}"
                is_module = node.module.startswith("hpcscale") and os.path.exists(bootstrap.module_path(child))
                out.append(child if is_module else node.module)
    return out


def test_shipped_code_is_python_3_8_syntax_and_standard_library_only():
    for path in sorted({*PORTABLE.glob("*.py"), *SHIPPED.values()}):
        ast.parse(path.read_text(), str(path), feature_version=(3, 8))
        for name in _imports(path):
            top = name.split(".")[0]
            if top == "hpcscale":
                assert name.startswith("hpcscale.portable."), f"{path.name} imports {name}"
            else:
                assert top in sys.stdlib_module_names or top in OPTIONAL, f"{path.name} imports {name}"


def test_the_agent_ships_every_module_it_imports_each_after_the_modules_it_imports():
    """BOOT executes AGENT_MODULES in order: a module imported but not shipped, or shipped after its importer,
    would fail only at the other site."""
    order = {name: i for i, name in enumerate(bootstrap.AGENT_MODULES)}
    assert bootstrap.AGENT_MODULES[-1] == "hpcscale.xsite.agent"  # BOOT calls the last one's main
    for name, path in SHIPPED.items():
        for dep in _imports(path):
            if dep.startswith("hpcscale"):
                assert dep in order, f"{name} imports {dep}, which is not shipped (bootstrap.AGENT_MODULES)"
                assert order[dep] < order[name], f"{name} is executed before {dep}, which it imports"
    # nothing shipped that the agent does not need
    needed, todo = set(), ["hpcscale.xsite.agent"]
    while todo:
        name = todo.pop()
        if name not in needed:
            needed.add(name)
            todo += [d for d in _imports(SHIPPED[name]) if d.startswith("hpcscale")]
    assert needed == set(order)


def test_portable_modules_state_their_invariant_and_the_package_init_is_empty():
    for path in PORTABLE.glob("*.py"):
        assert ast.get_docstring(ast.parse(path.read_text())), f"{path.name}: start with the invariant it keeps"
    body = ast.parse((PORTABLE / "__init__.py").read_text()).body
    assert len(body) == 1 and isinstance(body[0], ast.Expr), "the remote creates hpcscale.portable empty"


def test_one_owner_of_the_hash_algorithm_names():
    from hpcscale.data import manifest

    assert hashing.XXH128 == "xxh128" and hashing.HASH_ALGORITHMS == ("xxh128", "sha256", "blake3")
    assert manifest.HASH_ALGORITHMS is hashing.HASH_ALGORITHMS
    spelled = []
    package = REPO / "hpcscale"
    files = [*package.glob("portable/*.py"), *package.glob("xsite/*.py"), *package.glob("data/manifest*.py")]
    for path in [*files, package / "cli" / "stage_cmd.py"]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in hashing.HASH_ALGORITHMS and path.name != "hashing.py":
                spelled.append(f"{path.relative_to(REPO)}:{node.lineno}: {node.value!r}")
    assert not spelled, "name the algorithms through hpcscale.portable.hashing:\n" + "\n".join(spelled)


def test_hashers_and_their_errors():
    assert hashing.hasher("sha256").name == "sha256"
    h = hashing.hasher("xxh128")
    h.update(b"abc")
    import xxhash

    assert h.hexdigest() == xxhash.xxh3_128(b"abc").hexdigest()
    with pytest.raises(StageError) as e:
        hashing.hasher("md5")
    assert e.value.kind == "input" and "md5" in str(e.value) and "xxh128, sha256, blake3" in str(e.value)
    assert e.value.kind in KINDS


@pytest.mark.parametrize(
    "path, words",
    [
        ("a/b.bin", None),
        ("", "non-empty"),
        (None, "non-empty"),
        ("/etc/passwd", "absolute"),
        ("a/../../x", "'..'"),
        ("..", "'..'"),
        ("a//b", "normal form"),
        ("a/./b", "normal form"),
        ("a/", "normal form"),
        ("a\\b", "backslash"),
        ("a\x00b", "NUL"),
    ],
)
def test_the_path_rule(path, words):
    problem = paths.check_relpath(path)
    assert (problem is None) if words is None else (words in problem)


def test_part_names_and_within():
    assert paths.part_name("/d/x/.f.bin", "0123456789abcdef0123") == "/d/x/.f.bin.0123456789abcdef.hpcscale-part"
    assert paths.within("/a/b", "/a") and paths.within("/a", "/a") and not paths.within("/ab", "/a")


def _python38() -> str | None:
    """A python 3.8 interpreter on this machine (the oldest the agent promises to run on), or None."""
    candidates = ["python3.8", *sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.8*/bin/python3.8")))]
    for exe in candidates:
        try:
            probe = "import sys; print(sys.executable, sys.version_info[:2] == (3, 8))"
            out = subprocess.run([exe, "-c", probe], capture_output=True, text=True, timeout=30)
        except OSError:
            continue
        if out.returncode == 0 and out.stdout.split()[-1] == "True":
            return out.stdout.split()[0]
    return None


def test_the_agent_runs_on_python_3_8(tmp_path, sshd):
    """The oldest python the agent promises (a different bytecode magic: it compiles the shipped sources):
    push, no-op rerun and pull of a sha256 tree, a large file (part-file path) among small ones."""
    py38 = _python38()
    need(py38 is not None, "python 3.8 (the oldest the agent promises)")  # the proof needs that interpreter
    src = make_tree(tmp_path / "src", small=6, big_mb=9)
    build(src, "--algorithm", "sha256")
    m = src / "manifest.json"
    args = ["--ssh", sshd.ssh_string(), "--remote-python", py38]
    remote = tmp_path / "remote"
    push = stage_json(m, str(src), sshd.url(remote), "-j", "2", *args)
    assert push["sent"] == 8 and push["committed"]
    same_tree(src, remote)
    assert stage_json(m, str(src), sshd.url(remote), *args)["sent"] == 0
    local = tmp_path / "local"
    pull = stage_json(m, sshd.url(remote), str(local), "-j", "2", *args)
    assert pull["sent"] == 8 and pull["committed"]
    same_tree(src, local)
    probe = subprocess.run([py38, "-c", "import xxhash"], capture_output=True)
    if probe.returncode != 0:  # and it names the module an xxh128 manifest would need there
        build(src, "--algorithm", "xxh128")
        r = stage(m, str(src), sshd.url(tmp_path / "remote2"), *args)
        assert r.returncode == 2 and "xxhash" in r.stderr


_ENTRY_PART = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(1 << 64), max_value=1 << 64),
    st.sampled_from([0, 0o644, 0o777, 0o1000, -1, (1 << 63) - 1, 1 << 63, -(1 << 63)]),
    st.text(max_size=70),
    st.sampled_from(["a/b", "../x", "/abs", "a//b", ".", "ok.bin", "d/.x.0123456789abcdef.hpcscale-part"]),
    st.text(alphabet="0123456789abcdefABCDEF", min_size=30, max_size=66),
    st.floats(allow_nan=True),
)


@st.composite
def _near_valid_entry(draw):
    """A valid xxh128 entry, with one field (or none) swapped for anything."""
    entry = [
        draw(st.sampled_from(["a", "d/e.bin", "x y/z"])),
        draw(st.integers(0, (1 << 63) - 1)),
        draw(st.integers(-(1 << 63), (1 << 63) - 1)),
        draw(st.text(alphabet="0123456789abcdef", min_size=32, max_size=32)),
        draw(st.none() | st.integers(0, 0o777)),
    ]
    k = draw(st.integers(0, 5))
    if k < 5:
        entry[k] = draw(_ENTRY_PART)
    return draw(st.sampled_from([entry, tuple(entry)]))


@given(
    entry=st.one_of(
        _near_valid_entry(),
        st.lists(_ENTRY_PART, min_size=0, max_size=6),
        st.tuples(_ENTRY_PART, _ENTRY_PART, _ENTRY_PART, _ENTRY_PART, _ENTRY_PART),
        _ENTRY_PART,
    ),
    algorithm=st.sampled_from(["xxh128", "sha256", "blake3", "md5"]),
)
@settings(max_examples=400, deadline=None)
def test_one_entry_predicate_whose_fast_path_agrees_with_its_words(entry, algorithm):
    """The plan's check of a file entry is paths.check_entry alone: its one-expression fast path accepts
    exactly what the field-by-field checks accept (lists and tuples alike), so a refusal is always worded."""
    assert (paths.check_entry(entry, algorithm) is None) == (paths._entry_problem(entry, algorithm) is None)
