"""Property: no mangled YAML makes hpcscale crash. Validation ends in success or a ConfigError (exit 2)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import yaml
from click.testing import CliRunner
from conftest import REPO
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hpcscale.cli.main import cli
from hpcscale.config.validate import validate_files

BASES = [
    (REPO / "site_configs" / "localcluster.yaml").read_text(),
    (REPO / "site_configs" / "example-dgx-h100.yaml").read_text(),
    (REPO / "docs" / "examples" / "gpt-dgx.yaml").read_text(),
    (REPO / "docs" / "examples" / "hello-localcluster.yaml").read_text(),
]
YAMLISH = st.text(alphabet=st.sampled_from(list("ab01:-[]{}&*!|>'\"%@`#,.? \n\t\\~$<=")), max_size=30)


@st.composite
def mangled_text(draw) -> str:
    text = draw(st.sampled_from(BASES))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["delete", "insert", "replace_line", "duplicate_line", "truncate"]))
        if not text:
            break
        i = draw(st.integers(0, len(text) - 1))
        if op == "delete":
            text = text[:i] + text[i + draw(st.integers(1, 20)) :]
        elif op == "insert":
            text = text[:i] + draw(YAMLISH) + text[i:]
        elif op == "truncate":
            text = text[:i]
        else:
            lines = text.splitlines()
            k = draw(st.integers(0, len(lines) - 1))
            lines[k : k + 1] = [draw(YAMLISH)] if op == "replace_line" else [lines[k], lines[k]]
            text = "\n".join(lines)
    return text


YAML_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)


@st.composite
def mangled_structure(draw) -> str:
    """A valid document with one value, at any depth, replaced by arbitrary YAML data."""
    data = yaml.safe_load(draw(st.sampled_from(BASES)))
    node = data
    while True:
        keys = list(node) if isinstance(node, dict) else list(range(len(node)))
        if not keys:
            break
        key = draw(st.sampled_from(keys))
        child = node[key]
        if isinstance(child, dict | list) and child and draw(st.booleans()):
            node = child
            continue
        node[key] = draw(YAML_VALUES)
        break
    return yaml.safe_dump(data)


def _check(text: str) -> None:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "fuzz.yaml"
        path.write_text(text, encoding="utf-8", errors="surrogatepass")
        # The library: anything other than a result is an escaped exception and fails the test.
        (result,) = validate_files([path])
        for issue in result.issues:
            assert issue.file and str(issue).startswith(issue.file)
        # The CLI: exit 0 or 2, never a crash.
        cli_result = CliRunner().invoke(cli, ["config", "validate", str(path)])
        assert cli_result.exit_code in (0, 2), cli_result.output
        assert cli_result.exception is None or isinstance(cli_result.exception, SystemExit), repr(cli_result.exception)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mangled_text())
def test_mangled_text_never_crashes(text):
    _check(text)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mangled_structure())
def test_mangled_structure_never_crashes(text):
    _check(text)
