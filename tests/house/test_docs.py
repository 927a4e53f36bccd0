"""Docs that are generated from code must match it."""

import importlib.util

from conftest import REPO


def test_config_reference_is_current():
    spec = importlib.util.spec_from_file_location("gen", REPO / "scripts" / "gen_config_reference.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    committed = (REPO / "docs" / "config-reference.md").read_text()
    assert committed == gen.render(), "docs/config-reference.md is stale: run python scripts/gen_config_reference.py"


def test_every_schema_key_is_in_the_reference():
    import dataclasses

    from hpcscale.config import job, site
    from hpcscale.config import train as train_config
    from hpcscale.config import xsite as xsite_config
    from hpcscale.config.fields import yaml_key

    text = (REPO / "docs" / "config-reference.md").read_text()
    for module in (site, job, train_config, xsite_config):
        for obj in vars(module).values():
            if dataclasses.is_dataclass(obj) and obj.__module__ == module.__name__:
                for f in dataclasses.fields(obj):
                    assert f"| `{yaml_key(f)}` |" in text, f"{obj.__name__}.{f.name} undocumented"


# Internals the launcher drives (closing what it opened), not part of what an entry point calls.
NOT_FOR_ENTRY_POINTS = {
    ("Checkpointer", "close"),
    ("MetricsLogger", "close"),
    ("MetricsLogger", "attempt"),
    ("MetricsLogger", "path"),
    ("MetricsLogger", "tensorboard"),
}


def test_every_public_call_of_the_context_api_is_on_its_page_with_every_parameter():
    """docs/context-api.md names each public attribute of ctx, ctx.checkpoint, a pipeline and ctx.metrics, and
    writes each method as a call naming every parameter it takes: a renamed or added parameter fails here."""
    import dataclasses
    import inspect
    import re

    from hpcscale.launch.checkpointing import Checkpointer
    from hpcscale.launch.context import Context, MetricsLogger
    from hpcscale.parallel.pipeline import Pipeline

    text = re.sub(r"```.*?```", "", (REPO / "docs" / "context-api.md").read_text(), flags=re.S)
    spans = re.findall(r"`([^`\n]+)`", text)
    problems = []
    for cls in (Context, Checkpointer, Pipeline, MetricsLogger):
        names = {n for n in dir(cls) if not n.startswith("_")}
        if dataclasses.is_dataclass(cls):
            names |= {f.name for f in dataclasses.fields(cls) if not f.name.startswith("_")}
        else:  # the attributes its constructor sets
            names |= set(re.findall(r"self\.([a-z]\w*)\s*[:=]", inspect.getsource(cls.__init__)))
        for name in sorted(names - {n for c, n in NOT_FOR_ENTRY_POINTS if c == cls.__name__}):
            member = inspect.getattr_static(cls, name, None)
            if inspect.isfunction(member):
                calls = [s for s in spans if re.match(rf"(\w+\.)*{re.escape(name)}\(", s)]
                params = [p for p in inspect.signature(member).parameters if p != "self"]
                if not calls:
                    problems.append(f"{cls.__name__}.{name}: no call `{name}(...)` on the page")
                else:
                    problems += [
                        f"{cls.__name__}.{name}: parameter {p!r} is not in any of {calls}"
                        for p in params
                        if not any(re.search(rf"\b{re.escape(p)}\b", c) for c in calls)
                    ]
            elif not any(re.fullmatch(rf"(\w+\.)*{re.escape(name)}", s) for s in spans):
                problems.append(f"{cls.__name__}.{name}: not named on the page")
    assert not problems, "\n".join(problems)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped, spaces to hyphens."""
    import re

    text = re.sub(r"[`*]|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path) -> set[str]:
    import re

    seen: dict[str, int] = {}
    out = set()
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    for m in re.finditer(r"^#{1,6} (.+)$", text, flags=re.M):
        slug = _slug(m.group(1))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_every_link_and_named_file_in_the_docs_exists():
    """Every relative link in README.md and docs/ reaches a file (and the heading its #anchor names), and
    every repository path a doc names in backticks (docs/..., scripts/..., hpcscale/..., tests/...) exists: a
    renamed file or heading fails here, not in a reader's hands."""
    import re

    pages = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    problems = []
    for page in pages:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue  # http(s), mailto: not checked offline
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                problems.append(f"{page.relative_to(REPO)}: link to {target}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                problems.append(f"{page.relative_to(REPO)}: link to {target}: no such heading")
        for named in re.findall(r"`((?:docs|scripts|hpcscale|tests|site_configs|examples)/[\w./-]+)`", text):
            if not (REPO / named.rstrip("/.")).exists():
                problems.append(f"{page.relative_to(REPO)}: names {named}, which does not exist")
    assert not problems, "\n".join(problems)
