"""Declaring config fields once: type, default, doc and checks, read by the decoder and the doc generator.

    nodes: int = setting("Nodes to allocate.", default=1, min=1)

The doc string becomes the entry in docs/config-reference.md (scripts/gen_config_reference.py), so a key
cannot exist without being documented.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

MISSING = dataclasses.MISSING
Check = Callable[[Any], str | None]  # returns an error message, or None when the value is fine


def setting(
    doc: str,
    *,
    default: Any = MISSING,
    factory: Callable[[], Any] | None = None,
    min: float | None = None,
    max: float | None = None,
    check: Check | None = None,
    key: str | None = None,
) -> Any:
    """A dataclass field with hpcscale's metadata. `key` is the YAML key when it differs from the name."""
    meta = {"doc": doc, "min": min, "max": max, "check": check, "key": key}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def yaml_key(f: dataclasses.Field) -> str:
    return f.metadata.get("key") or f.name
