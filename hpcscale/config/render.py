"""Config dataclasses back to plain data, with YAML key names (for `config show` and run directories)."""

from __future__ import annotations

import dataclasses
from typing import Any

from hpcscale.config.fields import yaml_key


def to_plain(obj: Any) -> Any:
    """Plain dicts/lists of a config dataclass tree, keyed as in YAML."""
    if dataclasses.is_dataclass(obj):
        return {yaml_key(f): to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, list):
        return [to_plain(x) for x in obj]
    if isinstance(obj, dict):
        return {k: to_plain(v) for k, v in obj.items()}
    return obj
