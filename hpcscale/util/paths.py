"""Paths as configs write them: `~` and `$VAR` expanded when used, never when loaded."""

from __future__ import annotations

import os
from pathlib import Path


def expand_path(path: str) -> Path:
    return Path(os.path.expandvars(os.path.expanduser(path)))
