"""Slurm hostlist expressions (n[1-4,7], gpu[001-128]) through python-hostlist, with our error type."""

from __future__ import annotations

import hostlist as _hostlist

from hpcscale.errors import BadInput


class BadHostlist(BadInput):
    """A malformed hostlist expression; the message names the expression."""


def expand(expr: str) -> list[str]:
    """Every host named by `expr`, in order, duplicates removed; BadHostlist if it is malformed.

    python-hostlist refuses expressions naming more than hostlist.MAX_SIZE hosts, so a typo such as
    n[1-100000000] is an error instead of a billion strings.
    """
    text = expr.strip()
    if not text:
        raise BadHostlist("empty hostlist")
    try:
        return _hostlist.expand_hostlist(text)
    except _hostlist.BadHostlist as e:
        raise BadHostlist(f"bad hostlist '{expr}': {e}") from None


def compress(hosts: list[str]) -> str:
    """The shortest Slurm-style expression for `hosts` (sorted as Slurm sorts them)."""
    return _hostlist.collect_hostlist(hosts)


def sort_hosts(hosts: list[str]) -> list[str]:
    """Hosts in Slurm's order: numeric parts compared as numbers (n2 before n10)."""
    return sorted(hosts, key=_hostlist.numeric_sort_key)


def check_hostlist(value: str) -> str | None:
    """A config field check: None if `value` is a well-formed hostlist, else why not."""
    try:
        expand(value)
    except BadHostlist as e:
        return str(e)
    return None
