"""Turn parsed YAML into the typed config dataclasses, collecting every problem with its line.

Supported annotations: str, int, float, bool, Any, Literal[...], X | None, X | Literal[...] (a number or a
word), list[X], dict[str, X] and nested
dataclasses declared with hpcscale.config.fields.setting. Unknown keys are errors with a did-you-mean.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Literal, Union

from hpcscale.config.errors import ConfigError, ConfigIssue, did_you_mean
from hpcscale.config.fields import yaml_key
from hpcscale.config.yamlsrc import KeyPath, YamlSource, format_path


class Decoder:
    """Decodes one YamlSource; `issues` collects every problem found."""

    def __init__(self, src: YamlSource):
        self.src = src
        self.issues: list[ConfigIssue] = []
        self.warnings: list[ConfigIssue] = []  # valid but likely wrong: printed, never fatal

    def warn(self, path: KeyPath, message: str) -> None:
        self.warnings.append(ConfigIssue(*self.src.locate(path), format_path(path), message))

    def error(self, path: KeyPath, message: str) -> None:
        self.issues.append(ConfigIssue(*self.src.locate(path), format_path(path), message))

    def raise_if_any(self) -> None:
        if self.issues:
            raise ConfigError(self.issues)

    def decode(self, cls: type, value: Any, path: KeyPath = ()) -> Any:
        """An instance of dataclass `cls` from `value`, or None after recording why it could not be made."""
        if value is None:
            value = {}
        if not isinstance(value, dict):
            self.error(path, f"expected a mapping of keys, got {kind_of(value)}")
            return None
        fields = {yaml_key(f): f for f in dataclasses.fields(cls)}
        for key in value:
            if key not in fields:
                self.error((*path, key), f"unknown key{did_you_mean(key, fields)}")
        hints = typing.get_type_hints(cls)
        kwargs: dict[str, Any] = {}
        ok = True
        for key, f in fields.items():
            fpath = (*path, key)
            if key not in value:
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                    if dataclasses.is_dataclass(hints[f.name]):
                        kwargs[f.name] = self.decode(hints[f.name], {}, fpath)
                        ok = ok and kwargs[f.name] is not None
                        continue
                    self.error(path, f"missing required key '{key}'")
                    ok = False
                continue
            converted, good = self.value(hints[f.name], value[key], fpath)
            if good:
                good = self._checks(f, converted, fpath)
            ok = ok and good
            if good:
                kwargs[f.name] = converted
        if not ok:
            return None
        return cls(**kwargs)

    def _checks(self, f: dataclasses.Field, v: Any, path: KeyPath) -> bool:
        lo, hi, check = f.metadata.get("min"), f.metadata.get("max"), f.metadata.get("check")
        if v is None:
            return True
        if isinstance(v, str):  # bounds are on numbers; a number-or-word key's word has none
            lo = hi = None
        if lo is not None and v < lo:
            self.error(path, f"must be at least {lo}, got {v}")
            return False
        if hi is not None and v > hi:
            self.error(path, f"must be at most {hi}, got {v}")
            return False
        if check is not None:
            message = check(v)
            if message:
                self.error(path, message)
                return False
        return True

    def value(self, tp: Any, v: Any, path: KeyPath) -> tuple[Any, bool]:
        """(converted value, ok) for annotation `tp`."""
        origin = typing.get_origin(tp)
        if tp is Any:
            return v, True
        if origin in (Union, types.UnionType):
            args = [a for a in typing.get_args(tp) if a is not type(None)]
            if v is None:
                return None, True
            if len(args) == 1:
                return self.value(args[0], v, path)
            # A number or a word (`every_steps: 100` or `auto`): the words are one Literal, the rest one type.
            words = [a for a in args if typing.get_origin(a) is Literal]
            other = [a for a in args if typing.get_origin(a) is not Literal]
            if len(words) != 1 or len(other) != 1:
                raise TypeError(f"unsupported union {tp}")  # a schema bug, not user input
            choices = typing.get_args(words[0])
            if v in choices:
                return v, True
            if isinstance(v, str):
                shown = " or ".join(repr(c) for c in choices)
                hint = did_you_mean(v, [str(c) for c in choices])
                self.error(path, f"expected {_describe(other[0])} or {shown}, got {v!r}{hint}")
                return None, False
            return self.value(other[0], v, path)
        if v is None:
            self.error(path, f"must not be empty (expected {_describe(tp)})")
            return None, False
        if origin is Literal:
            choices = typing.get_args(tp)
            if v in choices:
                return v, True
            shown = ", ".join(repr(c) for c in choices)
            hint = did_you_mean(str(v), [str(c) for c in choices])
            self.error(path, f"must be one of {shown}, got {v!r}{hint}")
            return None, False
        if dataclasses.is_dataclass(tp):
            obj = self.decode(tp, v, path)
            return obj, obj is not None
        if origin is list:
            if not isinstance(v, list):
                self.error(path, f"expected a list, got {kind_of(v)}")
                return None, False
            (item_tp,) = typing.get_args(tp)
            items = [self.value(item_tp, item, (*path, i)) for i, item in enumerate(v)]
            return [x for x, _ in items], all(ok for _, ok in items)
        if origin is dict:
            if not isinstance(v, dict):
                self.error(path, f"expected a mapping, got {kind_of(v)}")
                return None, False
            _, val_tp = typing.get_args(tp)
            out, ok = {}, True
            for k, item in v.items():
                out[k], good = self.value(val_tp, item, (*path, k))
                ok = ok and good
            return out, ok
        return self._scalar(tp, v, path)

    def _scalar(self, tp: type, v: Any, path: KeyPath) -> tuple[Any, bool]:
        # bool is an int in Python; `nodes: true` must not mean one node.
        if tp is bool:
            if isinstance(v, bool):
                return v, True
        elif tp is int:
            if isinstance(v, int) and not isinstance(v, bool):
                return v, True
        elif tp is float:
            if isinstance(v, int | float) and not isinstance(v, bool):
                return float(v), True
        elif tp is str:
            # Numbers are accepted where a string is wanted (account: 12345) and kept as written.
            if isinstance(v, str):
                return v, True
            if isinstance(v, int | float) and not isinstance(v, bool):
                return str(v), True
        else:
            raise TypeError(f"unsupported annotation {tp}")
        self.error(path, f"expected {_describe(tp)}, got {kind_of(v)} {short_repr(v)}")
        return None, False


def kind_of(v: Any) -> str:
    """'an integer', 'a mapping'...: what a YAML value is, in an error message."""
    return {
        dict: "a mapping",
        list: "a list",
        str: "a string",
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        type(None): "nothing",
    }.get(type(v), type(v).__name__)


def _describe(tp: Any) -> str:
    return {str: "a string", int: "an integer", float: "a number", bool: "true or false"}.get(tp, str(tp))


def short_repr(v: Any) -> str:
    """repr(v), cut to 40 characters."""
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."
