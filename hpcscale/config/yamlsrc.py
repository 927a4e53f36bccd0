"""YAML loading that remembers the line of every key, so errors can point at it.

PyYAML's composer already knows each node's position; we build plain Python data from the node tree
ourselves and keep a map from key path (a tuple of str keys and int indexes) to its 1-based line.
Anchors, aliases and merge keys (`<<`) work as in yaml.safe_load, within bounds: PyYAML's composer keeps an
alias as a reference to its anchor's node, and only building plain data expands it, so the builder counts
every value it builds and stops at MAX_VALUES (a 400-byte "billion laughs" document would expand to 10^9
values); files over MAX_BYTES and nesting over 64 levels are refused before anything large is built.

A key whose value did not come from the file (a command-line override, hpcscale.config.overrides) is listed in
`origins`; `locate` then names that origin instead of a file line that no longer holds the value.
"""

from __future__ import annotations

import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from hpcscale.config.errors import ConfigError, ConfigIssue
from hpcscale.portable import files

KeyPath = tuple[str | int, ...]

MAX_BYTES = 1 << 20  # a site config or job spec is a few KB; composing 1 MiB takes ~0.2 s
MAX_VALUES = 200_000  # scalars, lists and mappings after alias expansion
# One scalar: YAML 1.1's base-60 numbers (1:2:3:...) convert in quadratic time, and no key needs more.
MAX_SCALAR = 16 << 10


@dataclass(slots=True)
class YamlSource:
    """Parsed YAML plus where each key sits."""

    file: str
    data: Any
    lines: dict[KeyPath, int] = field(default_factory=dict)
    origins: dict[KeyPath, str] = field(default_factory=dict)  # key path -> where its value came from instead

    def line_of(self, path: KeyPath) -> int | None:
        """The line of `path`, or of its nearest ancestor that has one."""
        p = tuple(path)
        while p:
            if p in self.lines:
                return self.lines[p]
            p = p[:-1]
        return self.lines.get(())

    def locate(self, path: KeyPath) -> tuple[str, int | None]:
        """(where, line) for an error at `path`: from `path` or its nearest ancestor that has either, its
        origin (an override; no line) or its line in the file."""
        p = tuple(path)
        while p:
            if p in self.origins:
                return self.origins[p], None
            if p in self.lines:
                return self.file, self.lines[p]
            p = p[:-1]
        return self.file, self.lines.get(())


def format_path(path: KeyPath) -> str:
    """('partitions', 0, 'name') -> 'partitions[0].name'."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


class _Builder:
    def __init__(self, file: str):
        self.file = file
        self.lines: dict[KeyPath, int] = {}
        self.scalars = yaml.constructor.SafeConstructor()
        self.built = 0

    def issue(self, node: yaml.Node, key: str, message: str) -> ConfigError:
        return ConfigError([ConfigIssue(self.file, node.start_mark.line + 1, key, message)])

    def build(self, node: yaml.Node, path: KeyPath, depth: int = 0) -> Any:
        if depth > 64:
            raise self.issue(node, format_path(path), "nesting deeper than 64 levels")
        self.built += 1
        if self.built > MAX_VALUES:
            raise self.issue(
                node, format_path(path), f"expands to more than {MAX_VALUES} values (anchors and aliases included)"
            )
        self.lines.setdefault(path, node.start_mark.line + 1)
        if isinstance(node, yaml.MappingNode):
            return self._mapping(node, path, depth)
        if isinstance(node, yaml.SequenceNode):
            return [self.build(item, (*path, i), depth + 1) for i, item in enumerate(node.value)]
        return self._scalar(node, path)

    def _scalar(self, node: yaml.Node, path: KeyPath) -> Any:
        if isinstance(node.value, str) and len(node.value) > MAX_SCALAR:
            raise self.issue(node, format_path(path), f"a value of {len(node.value)} characters (at most {MAX_SCALAR})")
        try:
            value = self.scalars.construct_object(node, deep=True)
        except Exception as e:  # PyYAML raises ValueError and others for dates, huge ints: all bad input
            raise self.issue(node, format_path(path), f"bad value: {e}") from None
        if isinstance(value, int) and value.bit_length() > 64:  # a base-60 number can be astronomically large
            raise self.issue(node, format_path(path), "integer out of range (more than 64 bits)")
        return value

    def _mapping(self, node: yaml.MappingNode, path: KeyPath, depth: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        explicit: set[str] = set()
        for key_node, value_node in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                # `<<: *anchor` (or a list of them): keys written explicitly win over merged ones.
                sources = value_node.value if isinstance(value_node, yaml.SequenceNode) else [value_node]
                for src in sources:
                    merged = self.build(src, path, depth + 1)
                    if not isinstance(merged, dict):
                        raise self.issue(src, format_path(path), "a merge (<<) needs a mapping")
                    for k, v in merged.items():
                        if k not in explicit:
                            out[k] = v
                continue
            if not isinstance(key_node, yaml.ScalarNode):
                raise self.issue(key_node, format_path(path), "keys must be plain strings")
            key = self._scalar(key_node, path)
            if not isinstance(key, str):
                key = str(key)
            kpath = (*path, key)
            if key in explicit:
                raise self.issue(key_node, format_path(kpath), "duplicate key")
            explicit.add(key)
            self.lines[kpath] = key_node.start_mark.line + 1
            out[key] = self.build(value_node, kpath, depth + 1)
        return out


def parse_yaml(text: str, file: str) -> YamlSource:
    """Parse one YAML document; any syntax problem becomes a ConfigError with its line."""
    return build_yaml(compose_yaml(text, file), file)


def compose_yaml(text: str, file: str, *, loader: type[yaml.SafeLoader] = yaml.SafeLoader) -> yaml.Node | None:
    """The node tree of one YAML document (None when empty); `loader` may add implicit resolvers."""
    if len(text) > MAX_BYTES:
        raise ConfigError([ConfigIssue(file, None, "", f"{len(text)} characters, over the limit of {MAX_BYTES}")])
    try:
        return yaml.compose(text, Loader=loader)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        line = mark.line + 1 if mark else None
        raise ConfigError([ConfigIssue(file, line, "", f"invalid YAML: {e.problem or e}")]) from None
    except yaml.YAMLError as e:
        raise ConfigError([ConfigIssue(file, None, "", f"invalid YAML: {e}")]) from None
    except RecursionError:
        raise ConfigError([ConfigIssue(file, None, "", "invalid YAML: nested too deeply")]) from None


def build_yaml(node: yaml.Node | None, file: str) -> YamlSource:
    """Plain data from a node tree, with the line of every key (bounded: see the module docstring)."""
    if node is None:
        return YamlSource(file, None, {})
    builder = _Builder(file)
    try:
        data = builder.build(node, ())
    except RecursionError:
        raise ConfigError([ConfigIssue(file, None, "", "invalid YAML: nested too deeply")]) from None
    return YamlSource(file, data, builder.lines)


def load_yaml(path: str | Path) -> YamlSource:
    """Read and parse a YAML file; unreadable files are bad input too. The file is read once from the descriptor
    that is checked (hpcscale.portable.files.read_regular: fstat on that descriptor, O_NONBLOCK): a FIFO or a
    device, there before or swapped in after any earlier look, is refused, never waited on, and so is a file
    over MAX_BYTES, before a byte is read or once it grows past it while read."""
    p = Path(path)

    def issue(message: str) -> ConfigError:
        return ConfigError([ConfigIssue(str(p), None, "", message)])

    try:
        data, _ = files.read_regular(p, max_bytes=MAX_BYTES)
        text = data.decode("utf-8")
    except FileNotFoundError:
        raise issue("no such file") from None
    except files.NotRegularFile as e:
        directory = e.stat is not None and stat.S_ISDIR(e.stat.st_mode)
        raise issue("is a directory, not a YAML file" if directory else "not a regular file") from None
    except files.TooLarge as e:
        raise issue(f"{e.size} bytes, over the limit of {MAX_BYTES}") from None
    except IsADirectoryError:
        raise issue("is a directory, not a YAML file") from None
    except UnicodeDecodeError as e:
        raise issue(f"not UTF-8 text ({e.reason})") from None
    except OSError as e:
        raise issue(f"cannot read: {e.strerror}") from None
    return parse_yaml(text, str(p))
