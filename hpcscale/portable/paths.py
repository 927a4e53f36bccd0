"""The manifest's path rules, and the names staging gives its own files at a destination.

Every path a manifest lists is relative, '/'-separated, in normal form and inside its root: `check_relpath`
is the one rule, applied by the manifest reader (hpcscale/data/manifest.py), by both ends of a transfer and
by `manifest verify`; `within` is the one test that a resolved path stays under its root. A manifest lists
no staging state: STATE_DIR and part files (`.NAME.HASH16` + PART_SUFFIX) are what `hpcscale stage` leaves
at a destination (docs/staging.md), and `hpcscale manifest build` skips them.
"""

import os

STATE_DIR = ".hpcscale-stage"  # at a destination root: the record of what was verified there, and journals
RECORD = "verified.json"  # in STATE_DIR
PART_SUFFIX = ".hpcscale-part"  # a file in transit: `.NAME.HASH16.hpcscale-part` beside NAME


def check_relpath(path):
    """None if `path` is a safe relative path ('/'-separated, normal form, inside its root), else why not.
    Substring tests rather than a split: this runs for every file of every plan."""
    if not isinstance(path, str) or not path:
        return "path must be a non-empty string"
    if "\\" in path or "\x00" in path:
        return f"path '{path}' contains a backslash or NUL"
    if path[0] == "/":
        return f"path '{path}' is absolute"
    wrapped = "/" + path + "/"
    if "/../" in wrapped:
        return f"path '{path}' contains '..'"
    if "//" in wrapped or "/./" in wrapped:
        return f"path '{path}' is not in normal form"
    return None


def within(path, root):
    """Whether the resolved `path` is `root` or lies under it."""
    return path == root or path.startswith(root + os.sep)


def part_name(part_prefix, digest):
    """The part file of a file in transit: `part_prefix` is DIR/.NAME (hpcscale.portable.sink.Sink.paths), the
    first 16 hex digits of the expected hash tell parts of different contents apart."""
    return f"{part_prefix}.{digest[:16]}{PART_SUFFIX}"
