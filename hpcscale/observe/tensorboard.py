"""Rank 0's metrics as TensorBoard event files (`metrics.tensorboard: true`): RUN/tensorboard/, one directory per
attempt, so `tensorboard --logdir RUN/tensorboard` shows a restarted run's attempts side by side.

tensorboardX writes the event files (TFRecord framing of protobuf Events) without TensorFlow; hpcscale does
not write that format by hand. A sink that cannot write says so once and the training goes on."""

from __future__ import annotations

import contextlib
import math
import sys
from pathlib import Path

SKIP = {"time", "attempt", "step"}


class TensorBoardSink:
    def __init__(self, directory: Path):
        self.directory = directory
        self._writer = None
        self._failed = False

    def log(self, row: dict) -> None:
        """Every finite number in `row` (nested dicts flattened as a/b) becomes a scalar at step row["step"]."""
        step = row.get("step")
        if self._failed or type(step) is not int:
            return
        try:
            if self._writer is None:
                from tensorboardX import SummaryWriter

                self._writer = SummaryWriter(str(self.directory), flush_secs=30)
            for tag, value in _scalars(row):
                self._writer.add_scalar(tag, value, global_step=step, walltime=row.get("time"))
        except Exception as e:  # a full disk or a missing package must not end the training
            self._failed = True
            print(f"hpcscale: TensorBoard events stop ({self.directory}): {type(e).__name__}: {e}", file=sys.stderr)

    def close(self) -> None:
        if self._writer is not None:
            with contextlib.suppress(Exception):
                self._writer.close()


def _scalars(row: dict, prefix: str = ""):
    for key, value in row.items():
        if not prefix and key in SKIP:
            continue
        tag = f"{prefix}{key}"
        if isinstance(value, dict):
            yield from _scalars(value, f"{tag}/")
        elif isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
            yield tag, float(value)
