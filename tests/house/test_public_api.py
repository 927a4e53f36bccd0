"""The public API is declared: each module user code imports has `__all__`, every name in it exists, and every
`hpcscale.<module>.<name>` the user docs name (and every `from hpcscale.<module> import <name>` they show) is in
its module's `__all__`. A name the docs teach that is not declared, or a declared one that is gone, fails here.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PUBLIC = (
    "hpcscale.launch.context",
    "hpcscale.launch.signals",
    "hpcscale.parallel.pipeline",
    "hpcscale.parallel.init",
    "hpcscale.train.hf",
    "hpcscale.ckpt.export",
    "hpcscale.errors",
)
USER_DOCS = ("docs/context-api.md", "docs/huggingface.md", "docs/checkpoint-format.md", "README.md")


@pytest.mark.parametrize("name", PUBLIC)
def test_every_public_module_declares_what_it_exports_and_has_it(name):
    module = importlib.import_module(name)
    declared = getattr(module, "__all__", None)
    assert declared, f"{name} has no __all__"
    missing = [n for n in declared if not hasattr(module, n)]
    assert not missing, f"{name}.__all__ names what it does not have: {missing}"


def _named_in_docs() -> set[tuple[str, str]]:
    found = set()
    for doc in USER_DOCS:
        text = (ROOT / doc).read_text()
        for m in re.finditer(r"\bhpcscale(?:\.[a-z_]+)+\.([A-Za-z_][A-Za-z0-9_]*)\b", text):
            dotted = m.group(0)
            module, _, attr = dotted.rpartition(".")
            found.add((module, attr))
        for m in re.finditer(r"from (hpcscale(?:\.[a-z_]+)+) import ([A-Za-z_][\w, ]*)", text):
            for attr in m.group(2).split(","):
                found.add((m.group(1), attr.strip()))
    return found


def test_what_the_user_docs_name_is_declared():
    undeclared = []
    for module, attr in sorted(_named_in_docs()):
        if module not in PUBLIC:
            continue
        declared = importlib.import_module(module).__all__
        if attr not in declared:
            undeclared.append(f"{module}.{attr}")
    assert not undeclared, f"the docs teach names their modules do not declare in __all__: {undeclared}"
