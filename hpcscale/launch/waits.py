"""The seconds a rank's training thread spends blocked in torch.distributed collectives, whoever issues them.

Per-rank timing judges stragglers on each rank's own time: its step less what it waited for its peers. hpcscale
times the collectives it makes itself (the data-parallel all-reduce, the stop check, the clip), but in most
layouts the waits are elsewhere: FSDP's all-gathers and reduce-scatters, tensor-parallel all-reduces inside the
model, a pipeline stage's sends and receives, a user's own all-reduce of the loss. A rank blocked there for a
slow peer would look slow itself. So the clock is taken where every one of them blocks the calling thread on
CPU/gloo:

- `torch._C._distributed_c10d.Work.wait`: every collective of torch.distributed's Python API waits on its Work
  object there, synchronous ones (`all_reduce(t)` calls `work.wait()`) and asynchronous ones alike (FSDP2's
  collectives, `batch_isend_irecv`, `broadcast_object_list`, a barrier);
- `torch.distributed._functional_collectives.wait_tensor`: where DTensor's redistributions (tensor parallelism)
  wait for their functional collectives.

Only the installing thread's waits count: the checkpoint writer's collectives run on its own thread, and a
save's blocking time is counted as checkpoint time by its caller. Both hooks are installed once per process
and cost two clock reads per wait; the communication ledger (hpcscale.launch.ledger), installed beside them,
is told each wait's handle and seconds (`on_wait`) to attribute blocked time to the collective's group.

On GPUs with NCCL a `wait()` only orders the current stream after the collective and returns at once: the
rank blocks where it next waits for the GPU (a `.item()`, the stop check's settle), which per-rank timing
counts as compute. Only a GPU run can show how far that moves the verdict there.
"""

from __future__ import annotations

import functools
import threading
import time


class CollectiveWaits:
    """Cumulative seconds the installing thread was blocked in collective waits (`total_s`)."""

    def __init__(self) -> None:
        self.total_s = 0.0
        self.thread = threading.get_ident()
        # (the Work or tensor waited on, seconds): the communication ledger's per-group blocked time
        self.on_wait = None

    def _timed(self, fn):
        import torch

        compiling = torch.compiler.is_compiling

        @functools.wraps(fn)
        def wait(*args, **kwargs):
            # another thread's wait, or one torch.compile traces into a graph (no clock there: it would break
            # the graph, and tracing is not waiting)
            if compiling() or threading.get_ident() != self.thread:
                return fn(*args, **kwargs)
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                took = time.perf_counter() - t
                self.total_s += took
                if self.on_wait is not None and args:
                    self.on_wait(args[0], took)

        wait.__hpcscale_timed__ = True
        return wait


_installed: CollectiveWaits | None = None


def install() -> CollectiveWaits:
    """Time every collective wait of the calling thread from now on (idempotent: the first caller's thread)."""
    global _installed
    if _installed is not None:
        return _installed
    import torch.distributed._functional_collectives as funcol
    from torch._C._distributed_c10d import Work

    clock = CollectiveWaits()
    if not getattr(Work.wait, "__hpcscale_timed__", False):
        Work.wait = clock._timed(Work.wait)
    if not getattr(funcol.wait_tensor, "__hpcscale_timed__", False):
        funcol.wait_tensor = clock._timed(funcol.wait_tensor)
    _installed = clock
    return clock
