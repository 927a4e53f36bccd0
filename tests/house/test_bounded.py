"""Every YAML and JSON input is bounded: alias expansion, nesting, size and values are refused with exit 2,
naming the file (and the line where there is one), quickly and without building the expanded document."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO
from hypothesis import given, settings
from hypothesis import strategies as st

from hpcscale.errors import BadInput
from hpcscale.util.bounded import load_json, loads_json

# 9 levels of 9 references: 9^9 ≈ 387 million strings when expanded, from 342 bytes.
BOMB = "a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
    f"{b}: &{b} [{', '.join([f'*{a}'] * 9)}]\n" for a, b in zip("abcdefgh", "bcdefghi", strict=True)
)


def _validate(*paths: Path, timeout: float = 60) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "hpcscale", "config", "validate", *map(str, paths)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )
    return result, time.monotonic() - t0


def test_alias_bomb_is_refused_naming_file_and_line_without_expanding_it(tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text(BOMB)
    result, seconds = _validate(path)
    assert result.returncode == 2, result.stderr
    assert f"{path}:1:" in result.stdout + result.stderr and "expands to more than" in result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    # The landed code ran for minutes and reached 9.8 GB: a generous bound still tells the two apart.
    assert seconds < 15


def test_alias_bomb_inside_a_job_spec_is_refused_too(tmp_path):
    bomb = BOMB.replace("\n", "\n  ").rstrip()
    path = tmp_path / "job.yaml"
    path.write_text(f"name: x\nsite: local\ntrain:\n  entry: builtin\n  params:\n    x:\n  {bomb}\n")
    result, _ = _validate(path)
    assert result.returncode == 2 and "expands to more than" in result.stdout + result.stderr, result.stdout


def test_deep_nesting_and_oversized_files_are_refused(tmp_path):
    deep = tmp_path / "deep.yaml"
    deep.write_text("a: " + "[" * 100_000 + "]" * 100_000 + "\n")
    big = tmp_path / "big.yaml"
    with open(big, "w") as f:
        f.write("name: x\n# " + "x" * (17 << 20) + "\n")
    for path, words in ((deep, "deep"), (big, "over the limit")):
        result, _ = _validate(path)
        assert result.returncode == 2 and words in result.stdout + result.stderr, (path, result.stdout)
        assert "Traceback" not in result.stderr


def test_a_fifo_given_as_a_config_is_refused_not_waited_on(tmp_path):
    fifo = tmp_path / "site.yaml"
    os.mkfifo(fifo)
    result, _ = _validate(fifo, timeout=30)  # open() on a FIFO with no writer would block forever
    assert result.returncode == 2 and "not a regular file" in result.stdout + result.stderr


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ('{"size": 1e999}', "out of range"),
        ('{"size": NaN}', "NaN is not a JSON value"),
        ('{"size": -Infinity}', "-Infinity is not a JSON value"),
        ("[" * 200_000 + "]" * 200_000, "nested too deeply"),
        ('{"n": ' + "9" * 5000 + "}", "4300 digits"),
        ('{"a": 1,\n "b": }', "m.json:2: invalid JSON"),
        (b"\xff\xfe{}", "not UTF-8"),
    ],
)
def test_json_refusals_name_the_source(text, words):
    with pytest.raises(BadInput) as e:
        loads_json(text, source="m.json")
    assert str(e.value).startswith("m.json") and words in str(e.value)


def test_json_size_is_checked_before_reading(tmp_path):
    path = tmp_path / "m.json"
    path.write_text("[" + "0," * 1000 + "0]")
    with pytest.raises(BadInput, match="over the limit of 100"):
        load_json(path, max_bytes=100)
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    with pytest.raises(BadInput, match="not a regular file"):
        load_json(fifo)


def test_a_million_entry_document_still_loads(tmp_path):
    doc = {
        "files": [
            {"path": f"d{i % 1000}/{i}", "size": i, "mtime_ns": i * 10**9, "hash": "0" * 32} for i in range(10**6)
        ]
    }
    path = tmp_path / "manifest.json"
    path.write_text(json.dumps(doc))
    assert len(load_json(path)["files"]) == 10**6


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.text(max_size=200), st.binary(max_size=200)))
def test_any_input_parses_or_is_bad_input(data):
    try:
        loads_json(data, source="fuzz.json")
    except BadInput as e:
        assert str(e).startswith("fuzz.json")


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("name: " + ":".join(["1"] * 8000) + "\n", "out of range"),  # YAML 1.1 base 60: quadratic to convert
        ("name: " + "1" * 5000 + "\n", "bad value"),
        ("name: !!timestamp 2001-13-45\n", "bad value"),
        ("? !!timestamp 2001-13-45\n: 1\n", "bad value"),
        ("name: " + "x" * (100 << 10) + "\n", "characters (at most"),
    ],
    ids=["base60", "bigint", "timestamp", "timestamp-key", "long-scalar"],
)
def test_hostile_scalars_are_bad_input_not_tracebacks(tmp_path, text, words):
    path = tmp_path / "x.yaml"
    path.write_text(text)
    result, _ = _validate(path)
    assert result.returncode == 2 and words in result.stdout + result.stderr, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
