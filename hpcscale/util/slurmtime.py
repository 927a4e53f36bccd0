"""Slurm time limits (sbatch --time): parse every form sbatch accepts, print one canonical form."""

from __future__ import annotations

import re

# minutes | minutes:seconds | hours:minutes:seconds | days-hours | days-hours:minutes | days-hours:minutes:seconds
_DAYS = re.compile(r"^(\d+)-(\d+)(?::(\d+))?(?::(\d+))?$")
_CLOCK = re.compile(r"^(\d+)(?::(\d+))?(?::(\d+))?$")


def parse_duration(text: str | int) -> int:
    """Seconds in a Slurm duration; ValueError with the accepted forms otherwise."""
    if isinstance(text, int) and not isinstance(text, bool) and text >= 0:
        return text * 60  # a bare number means minutes, as in sbatch
    s = str(text).strip()
    if m := _DAYS.match(s):
        d, h, mi, sec = (int(x) if x else 0 for x in m.groups())
        return _checked(((d * 24 + h) * 60 + mi) * 60 + sec, s, (h, 23), (mi, 59), (sec, 59))
    if m := _CLOCK.match(s):
        parts = [int(x) for x in m.groups() if x is not None]
        if len(parts) == 1:
            return parts[0] * 60
        if len(parts) == 2:
            return _checked(parts[0] * 60 + parts[1], s, (parts[1], 59))
        h, mi, sec = parts
        return _checked((h * 60 + mi) * 60 + sec, s, (mi, 59), (sec, 59))
    raise ValueError(f"'{s}' is not a Slurm time (use MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS)")


def _checked(total: int, s: str, *limits: tuple[int, int]) -> int:
    for value, top in limits:
        if value > top:
            raise ValueError(f"'{s}' has a field over {top}")
    return total


def format_duration(seconds: int) -> str:
    """Canonical sbatch form: HH:MM:SS, or D-HH:MM:SS from one day on."""
    d, rest = divmod(seconds, 86400)
    h, rest = divmod(rest, 3600)
    m, s = divmod(rest, 60)
    return f"{d}-{h:02d}:{m:02d}:{s:02d}" if d else f"{h:02d}:{m:02d}:{s:02d}"


def check_duration(value: str) -> str | None:
    """A config field check: None if `value` is a Slurm time, else why not."""
    try:
        parse_duration(value)
    except ValueError as e:
        return str(e)
    return None
