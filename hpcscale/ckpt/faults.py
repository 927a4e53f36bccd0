"""Fault injection for crash tests: HPCSCALE_CKPT_FAULT=<point>[@<rank>] kills the process (SIGKILL) at a
named point of a save or gc. Unset in normal runs; costs one environment lookup per point."""

from __future__ import annotations

import os
import signal

POINTS = ("data_written", "data_durable", "index_written", "gc", "drain_read", "partner_copy")


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
    _sleep(os.environ.get("HPCSCALE_CKPT_SLOW", ""), step)


def slow_write(step: int, *, node_local: bool) -> None:
    """HPCSCALE_CKPT_SLOW_WRITE=<seconds>@<step>[:shared|:node-local]: the write of every save (or drain) from
    `step` on (`@=<step>`: of that step's alone), of both tiers or the one named, starts `seconds` late, on the
    writer thread of an asynchronous save: a save that stays in flight that long, for the tests of what waits
    for one or fails during one."""
    spec, _, tier = os.environ.get("HPCSCALE_CKPT_SLOW_WRITE", "").partition(":")
    if not tier or tier == ("node-local" if node_local else "shared"):
        _sleep(spec, step)


def _sleep(spec: str, step: int) -> None:
    if not spec:
        return
    seconds, _, start = spec.partition("@")
    if step == int(start[1:]) if start.startswith("=") else step >= int(start or 0):
        import time

        time.sleep(float(seconds))
