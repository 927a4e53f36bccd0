"""The Context: everything an entry point gets from hpcscale. This is the public API (docs/context-api.md).

def main(ctx: hpcscale.launch.context.Context) -> None:
    model = ...on ctx.device...
    for step in range(ctx.params["steps"]):
        ...
        ctx.metrics.log(step=step, loss=loss)
        if ctx.should_stop():       # a collective: every rank must call it at the same point
            break
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpcscale.config.job import JobSpec
from hpcscale.launch.signals import StopFlag
from hpcscale.layout import ParallelDims


class MetricsLogger:
    """JSON lines in RUN/metrics.jsonl, written by global rank 0 only; `print` echoes progress to stdout.
    Every line names its attempt (RUN/attempts.jsonl): a step repeated after a requeue or resume is told apart."""

    def __init__(self, path: Path | None, *, attempt: int | None = None):
        self.path = path
        self.attempt = attempt
        self._f = open(path, "a", buffering=1) if path is not None else None  # noqa: SIM115 - lives with the run

    def log(self, **values: Any) -> None:
        if self._f is not None:
            head = (
                {"time": round(time.time(), 3)}
                if self.attempt is None
                else {"time": round(time.time(), 3), "attempt": self.attempt}
            )
            self._f.write(json.dumps({**head, **values}) + "\n")

    def print(self, message: str) -> None:
        if self._f is not None:
            print(message, flush=True)

    def close(self) -> None:
        if self._f is not None:
            self._f.close()


@dataclass(kw_only=True)
class Context:
    rank: int  # global rank in placement order (tp fastest, then dp, then pp)
    world_size: int
    local_rank: int
    node: str
    dims: ParallelDims
    pp_rank: int
    dp_rank: int
    tp_rank: int
    mesh: Any  # torch.distributed.device_mesh.DeviceMesh with dims ("pp", "dp", "tp")
    device: Any  # torch.device: cuda:<local_rank> with GPUs, cpu otherwise
    backend: str  # "nccl" or "gloo"
    run_dir: Path
    job: JobSpec
    params: dict[str, Any]  # train.params, with this array task's sweep values applied
    metrics: MetricsLogger
    stop: StopFlag
    sweep_point: dict[str, Any] = field(default_factory=dict)
    scratch: Path | None = None  # the site's scratch directory
    hooks: dict[str, Any] = field(default_factory=dict)  # filled by the checkpoint and data layers

    def should_stop(self) -> bool:
        """Whether any rank received a stop signal. A collective over all ranks: call it everywhere."""
        import torch
        import torch.distributed as dist

        flag = torch.tensor([1.0 if self.stop.requested else 0.0], device=self.device)
        dist.all_reduce(flag)
        return bool(flag.item() > 0)
