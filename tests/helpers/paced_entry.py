"""The built-in trainer at a walking pace (`train.entry: paced_entry:train`): each step is followed by a sleep of
PACED_STEP_S seconds (0.25 by default). For the tests that wait on Slurm for minutes (a time limit's signal)
and need training to go on meanwhile, not to take the machine's cores from the rest of the suite: its steps,
checkpoints, stops and resumes are the built-in trainer's own."""

import os
import time

from hpcscale.train.trainer import train as builtin_train


def train(ctx):
    pause = float(os.environ.get("PACED_STEP_S", "0.25"))
    step = ctx.checkpoint.step

    def paced(*args, **kwargs):
        time.sleep(pause)
        return step(*args, **kwargs)

    ctx.checkpoint.step = paced  # the trainer calls ctx.checkpoint.step after each step
    builtin_train(ctx)
