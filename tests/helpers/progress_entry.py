"""A user loop whose first step is slow, as one that torch.compile compiles at its first step is, then fast
(`train.entry: progress_entry:main`): it logs its loss each step; ctx.checkpoint.steps is set, so step() prints
progress lines."""

from __future__ import annotations

import time


def main(ctx) -> None:
    steps = int(ctx.params.get("steps", 8))
    ctx.checkpoint.steps = steps
    for step in range(ctx.checkpoint.restore(), steps):
        if step == 0:
            time.sleep(float(ctx.params.get("first_s", 3.0)))  # compiling
        else:
            time.sleep(0.01)
        ctx.metrics.log(step=step, loss=2.5 - step / 10)
        ctx.checkpoint.step(step)
