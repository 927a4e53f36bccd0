"""The built-in trainer (`train.entry: sync_count_entry:main`, its `train.params` as for `builtin`) under a
TorchFunctionMode that counts, on the training thread, the calls that make a GPU rank's host wait for its device:
reading a tensor's value (`item`, `tolist`, `float()`, `int()`, `bool()`) and copying it to the host (`cpu`,
`numpy`). On CPU ranks nothing waits, but the same calls are made: a count here is a sync there. (`.to(d)` is not
counted: on a CPU rank it cannot tell a copy to the host from one to the rank's device.) Each rank writes
RUN/syncs.RANK.json: the count between one `ctx.checkpoint.step` return and the next (one training step, its stop
check included), per step.
"""

from __future__ import annotations

import json

from torch.overrides import TorchFunctionMode

from hpcscale.train.trainer import train

READS = {"item", "tolist", "__float__", "__int__", "__bool__", "__index__", "cpu", "numpy"}


def _caller() -> str:
    """The innermost frame outside torch and this file: where the read was asked for."""
    import sys

    f = sys._getframe(2)
    while f is not None and ("/torch/" in f.f_code.co_filename or f.f_code.co_filename == __file__):
        f = f.f_back
    return f"{f.f_code.co_filename.rsplit('/', 2)[-1]}:{f.f_lineno}" if f is not None else "?"


class HostReads(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.names: list[str] = []
        self._inside = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        counted = name in READS and self._inside == 0  # float() calls item(): one read
        if counted:
            self.count += 1
            self.names.append(f"{name} at {_caller()}")
        self._inside += counted
        try:
            return func(*args, **kwargs)
        finally:
            self._inside -= counted


def main(ctx) -> None:
    mode = HostReads()
    per_step: dict[int, list] = {}
    checkpoint = ctx.checkpoint
    step_fn = checkpoint.step
    last = [0, 0]  # count, names seen, at the previous step's end

    def counted_step(step: int, **kwargs) -> int:
        try:
            return step_fn(step, **kwargs)
        finally:
            per_step[step] = [mode.count - last[0], mode.names[last[1] :]]
            last[:] = [mode.count, len(mode.names)]

    checkpoint.step = counted_step
    try:
        with mode:
            train(ctx)
    finally:
        (ctx.run_dir / f"syncs.{ctx.rank}.json").write_text(json.dumps(per_step))
