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
