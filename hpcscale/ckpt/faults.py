"""Fault injection for crash tests: HPCSCALE_CKPT_FAULT=<point>[@<rank>] kills the process (SIGKILL) at a
named point of a save or gc. Unset in normal runs; costs one environment lookup per point."""

from __future__ import annotations

import os
import signal

POINTS = ("data_written", "data_durable", "index_written", "gc")


def fault(point: str, rank: int) -> None:
    spec = os.environ.get("HPCSCALE_CKPT_FAULT", "")
    if not spec:
        return
    name, _, who = spec.partition("@")
    if name == point and (not who or int(who) == rank):
        os.kill(os.getpid(), signal.SIGKILL)


def slow(step: int) -> None:
    """HPCSCALE_CKPT_SLOW=<seconds>@<step>: every save from `step` on takes `seconds` longer (a filesystem
    that got slower), for the tests of `checkpoint.every_steps: auto`."""
    spec = os.environ.get("HPCSCALE_CKPT_SLOW", "")
    if not spec:
        return
    seconds, _, start = spec.partition("@")
    if step >= int(start or 0):
        import time

        time.sleep(float(seconds))
