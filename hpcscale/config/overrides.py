"""Command-line overrides of a job spec: `-p KEY=VALUE` (run, submit, render, config validate).

An override edits the tree the job file parsed into, before anything is decoded, so its value is typed and
validated exactly like the same key written in the file; only the place an error names differs:
`command line -p train.params.lr: ...` instead of `job.yaml:12: train.params.lr: ...` (YamlSource.origins).

KEY is a dotted path of mapping keys (`nodes`, `checkpoint.every_steps`, `train.params.lr`, `environment.FOO`).
Mappings missing on the way are created, so a key the file does not have can be added; whether it is a real
key is then the decoder's question (unknown key, with a did-you-mean). A path through a scalar (`nodes.x`) or
into a list (`command.0`) is refused: give the whole list instead (`-p command=[python3, train.py]`).

VALUE is YAML, as after `KEY:` in the file, on one line: a scalar (`4`, `true`, `null`, `fast`) or a flow
collection (`[1, 2]`, `{lr: 1.0e-3}`); an empty VALUE is null, like `KEY:` with nothing after it. One rule
differs from the file: a plain number in exponent notation that YAML 1.1 (PyYAML) reads as a string (`3e-4`,
`1e5`, `1.0e5`, `-.5`) is a float, as in YAML 1.2 and JSON, because that is what anyone typing it on a command
line means. Quote it to keep the text (`-p 'name="1e5"'`). Anchors and aliases are refused (a few characters
could otherwise expand to many values), and so is a block collection (`-p 'x=a: b'` would be a mapping):
quote such text. Overrides apply in order; a later one for the same key wins.

Bounds, like every input: at most MAX_OVERRIDES of them, each at most MAX_CHARS characters, a KEY of at most
MAX_KEY_PARTS parts, printable characters only (a line break would let a value end a comment in the recorded
RUN/job.yaml); the value itself is parsed with the file's limits (hpcscale.config.yamlsrc).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import yaml

from hpcscale.config.decode import kind_of, short_repr
from hpcscale.config.errors import COMMAND_LINE, ConfigError, ConfigIssue
from hpcscale.config.yamlsrc import YamlSource, build_yaml, compose_yaml

MAX_OVERRIDES = 64
MAX_CHARS = 4096
MAX_KEY_PARTS = 16

EXAMPLE = "-p train.params.lr=3e-4"


class _OverrideLoader(yaml.SafeLoader):
    """SafeLoader plus YAML 1.2's float syntax; add_implicit_resolver copies the table, SafeLoader is untouched."""


# YAML 1.2 core schema floats. Tried after YAML 1.1's own resolvers, so it only catches what 1.1 leaves a string.
_OverrideLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?$"),
    list("-+.0123456789"),
)


@dataclass(frozen=True, slots=True)
class Override:
    """One `-p KEY=VALUE`: the text as given, the key path and the parsed value."""

    text: str
    path: tuple[str, ...]
    value: Any

    @property
    def key(self) -> str:
        return ".".join(self.path)


def _bad(key: str, message: str) -> ConfigError:
    return ConfigError([ConfigIssue(COMMAND_LINE, None, key, message)])


def _shown(text: str) -> str:
    return repr(text if len(text) <= 60 else text[:57] + "...")


def parse_override(text: str) -> Override:
    """`KEY=VALUE` -> Override; anything malformed is a ConfigError (exit 2) naming the key when there is one."""
    if len(text) > MAX_CHARS:
        raise _bad("", f"{_shown(text)}: {len(text)} characters, over the limit of {MAX_CHARS}")
    odd = next((i for i, c in enumerate(text) if not c.isprintable()), None)
    if odd is not None:
        raise _bad(
            "", f"{_shown(text)}: character {odd + 1} is a control character, line break or unusual space (one line)"
        )
    key, eq, value_text = text.partition("=")
    if not eq:
        raise _bad("", f"{_shown(text)} is not KEY=VALUE (e.g. {EXAMPLE})")
    parts = key.split(".")
    if not key or any(not part for part in parts):
        raise _bad("", f"{_shown(text)}: KEY must be dotted names, none of them empty (e.g. {EXAMPLE})")
    if len(parts) > MAX_KEY_PARTS:
        raise _bad("", f"{_shown(text)}: KEY has {len(parts)} parts, more than {MAX_KEY_PARTS}")
    if any(c.isspace() for c in key):
        raise _bad("", f"{_shown(text)}: KEY has a space in it")
    return Override(text, tuple(parts), _parse_value(value_text, key))


def _parse_value(text: str, key: str) -> Any:
    try:
        node = compose_yaml(text, COMMAND_LINE, loader=_OverrideLoader)
        if isinstance(node, yaml.CollectionNode) and not node.flow_style:
            raise _bad("", f"{_shown(text)} is a block {_collection(node)}: quote it to keep the text")
        if _has_alias(node):
            raise _bad("", "anchors and aliases (&, *) are not allowed in -p")
        return build_yaml(node, COMMAND_LINE).data
    except ConfigError as e:
        # A line inside a one-line value means nothing: name the override's key (and the place inside the value).
        raise ConfigError(
            [ConfigIssue(COMMAND_LINE, None, _join(key, i.key), i.message.splitlines()[0]) for i in e.issues]
        ) from None


def _join(key: str, inner: str) -> str:
    """train.params + lr -> train.params.lr; command + [0] -> command[0]."""
    return key if not inner else f"{key}{inner}" if inner.startswith("[") else f"{key}.{inner}"


def _collection(node: yaml.Node) -> str:
    return "mapping" if isinstance(node, yaml.MappingNode) else "list"


def _has_alias(root: yaml.Node | None) -> bool:
    """Whether a node is reached twice (an alias names its anchor's node); iterative, aliases never expanded."""
    seen: set[int] = set()
    stack = [root] if root is not None else []
    while stack:
        node = stack.pop()
        if id(node) in seen:
            return True
        seen.add(id(node))
        if isinstance(node, yaml.SequenceNode):
            stack.extend(node.value)
        elif isinstance(node, yaml.MappingNode):
            stack.extend(n for pair in node.value for n in pair)
    return False


def parse_overrides(texts: Sequence[str]) -> tuple[Override, ...]:
    """Every `-p` parsed; all malformed ones are reported together."""
    if len(texts) > MAX_OVERRIDES:
        raise _bad("", f"{len(texts)} overrides, more than {MAX_OVERRIDES}: put them in the job file")
    parsed, issues = [], []
    for text in texts:
        try:
            parsed.append(parse_override(text))
        except ConfigError as e:
            issues += e.issues
    if issues:
        raise ConfigError(issues)
    return tuple(parsed)


def apply_overrides(src: YamlSource, overrides: Sequence[Override]) -> YamlSource:
    """A copy of `src` with each override set in order, its key (and any mapping it created) marked as coming
    from the command line. A file whose top is not a mapping is returned as it is: the decoder reports it."""
    if not overrides or not isinstance(src.data, dict | None):
        return src
    data = copy.deepcopy(src.data) if src.data is not None else {}
    lines, origins = dict(src.lines), dict(src.origins)
    for o in overrides:
        node = data
        for depth, part in enumerate(o.path[:-1], 1):
            here = o.path[:depth]
            if node.get(part) is None:  # absent, or `key:` with nothing: a mapping is what the path needs
                if part not in node:
                    origins[here] = COMMAND_LINE
                node[part] = {}
            elif isinstance(node[part], list):
                raise _bad(
                    o.key,
                    f"{'.'.join(here)} is a list: -p cannot set one item of it; give the whole list "
                    f"(-p {'.'.join(here)}=[a, b])",
                )
            elif not isinstance(node[part], dict):
                raise _bad(
                    o.key,
                    f"{'.'.join(here)} is {kind_of(node[part])} {short_repr(node[part])}, not a mapping of keys",
                )
            node = node[part]
        replaced = node.get(o.path[-1])
        node[o.path[-1]] = o.value
        # What was under this key is gone; its lines must not be named for the new value.
        lines.pop(o.path, None)
        if isinstance(replaced, dict | list):
            for table in (lines, origins):
                for path in [p for p in table if p[: len(o.path)] == o.path]:
                    del table[path]
        origins[o.path] = COMMAND_LINE
    return YamlSource(src.file, data, lines, origins)
