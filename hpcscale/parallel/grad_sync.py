"""Data-parallel gradient averaging: bucketed all-reduce, started during backward.

torch's DistributedDataParallel does not accept DTensor parameters (tensor-parallel models): its constructor
broadcasts parameters with an op DTensor has no sharding rule for (NotImplementedError: c10d.broadcast_).
This is the smallest replacement with DDP's performance properties: gradients are packed into ~25 MB buckets
in reverse registration order (roughly the order backward produces them), and a bucket's all-reduce starts
asynchronously as soon as its last gradient is accumulated, overlapping communication with the rest of
backward. DTensor gradients are reduced through their local shards, so tp groups never see dp traffic.

Every rank all-reduces the buckets in one order, bucket index order, whatever its backward did: collectives on
a group are matched by their order, not by name, so a rank that reduced bucket 2 while its peer reduced bucket 1
would sum one bucket into another (or hang on a size mismatch). A parameter can get a gradient on one rank and
none on another in the same step (a branch the data takes, an unused head), and its bucket is then full on one
rank and not on the other. So a bucket that fills waits until every bucket before it has been launched, and
finish() launches whatever is left, in order, with zeros for the missing gradients (the average then counts
them as zero, as DDP's find_unused_parameters does). A bucket held back by an unused parameter delays the ones
after it to the end of backward: their overlap is lost on that step, never their order.

Packing a bucket, dividing by the group's size and writing the averages back are foreach kernels (one launch
per bucket packed, one each for the step's division and write-back, not one per parameter), and nothing here
reads a value back to the host.

A gradient must be final when its hook fires: the bucket copies it then. Anything that rescales gradients
after backward (torch's pipeline schedules with scale_grads=True) would be undone by finish(), which writes
the average of the copies back; hpcscale.parallel.pipeline scales the loss instead.

Gradient accumulation: a parameter's hook fires once per micro-batch backward; the bucket is reduced on the
`accumulation_steps`-th firing, i.e. after the last micro-batch, as DDP's no_sync() would arrange.

Two ways to drive it. A pipeline stage (hpcscale.parallel.pipeline.Pipeline, through `ctx.pipeline`) calls
`begin(n)` before a step's n micro-batch backward passes and `finish()` after them; a backward outside that
pair raises instead of leaving the replicas to diverge silently. Every other model (Context.parallelize)
gets `automatic=True`: the first hook of a backward queues `finish()` on the autograd engine (the callback DDP
itself uses), so it runs when that backward ends, and the loop stays `loss.backward(); opt.step()`.
Accumulation there is DDP's: backward passes inside `no_sync()` only accumulate, the next one outside it
reduces the sum.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from hpcscale.parallel.device import settle


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


@dataclass(slots=True)
class _Bucket:
    params: list[nn.Parameter]
    buffer: torch.Tensor  # (sum of the params' local numel,): what is all-reduced
    views: list[torch.Tensor]  # one view of `buffer` per param, shaped like its local gradient
    pending: int = 0
    work: dist.Work | None = None
    fired: dict[int, int] = field(default_factory=dict)


class GradSync:
    """Average gradients over `group` (the dp group). Call `begin(n)` before a step's backward passes and
    `finish()` before the optimizer step (or pass automatic=True); `comm_wait_s` is the time finish() spent
    blocked on the network. `outside`: what a gradient produced outside begin()/finish() is told (counted
    mode); the default says the stage's steps go through its pipeline."""

    def __init__(
        self,
        model: nn.Module,
        group: dist.ProcessGroup | None,
        *,
        bucket_mb: float = 25.0,
        automatic: bool = False,
        outside: str = "",
    ):
        self.group = group
        self.size = dist.get_world_size(group) if group is not None else 1
        self.accumulation_steps = 1
        self.comm_wait_s = 0.0
        self.comm_wait_total_s = 0.0  # every finish()'s wait added up: per-rank timing takes differences
        self.buckets: list[_Bucket] = []
        self.automatic = automatic
        self.syncing = True  # automatic mode: False inside no_sync()
        self.armed = False  # counted mode: between begin() and finish()
        self.outside = outside or (
            "a backward ran outside the pipeline's step (ctx.pipeline(...).step): its gradients would not be "
            "averaged over the data-parallel replicas, which would diverge"
        )
        self._queued = False
        self._next = 0  # the bucket to launch next: buckets go out in index order only
        if self.size == 1:
            return
        params = [p for p in model.parameters() if p.requires_grad]
        limit = int(bucket_mb * 2**20)
        current: list[nn.Parameter] = []
        nbytes = 0
        for p in reversed(params):
            current.append(p)
            nbytes += _local(p).numel() * _local(p).element_size()
            if nbytes >= limit:
                self._add_bucket(current)
                current, nbytes = [], 0
        if current:
            self._add_bucket(current)
        for bucket in self.buckets:
            for p in bucket.params:
                p.register_post_accumulate_grad_hook(self._hook(bucket))
        if automatic:
            self.begin(1)

    def _add_bucket(self, params: list[nn.Parameter]) -> None:
        dtype = _local(params[0]).dtype
        numels = [_local(p).numel() for p in params]
        buffer = torch.zeros(sum(numels), dtype=dtype, device=_local(params[0]).device)
        views = [v.view(_local(p).shape) for v, p in zip(buffer.split(numels), params, strict=True)]
        self.buckets.append(_Bucket(params, buffer, views))

    def _hook(self, bucket: _Bucket):
        def hook(p: nn.Parameter) -> None:
            if self.automatic:
                if not self.syncing:
                    return
                if not self._queued:  # runs once this backward has finished, on the thread that called it
                    self._queued = True
                    torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            elif not self.armed:
                raise RuntimeError(f"hpcscale: {self.outside}")
            count = bucket.fired.get(id(p), 0) + 1
            bucket.fired[id(p)] = count
            if count == self.accumulation_steps:
                bucket.pending -= 1
                if bucket.pending == 0:
                    self._launch_ready()

        return hook

    def _launch_ready(self) -> None:
        """Launch the full buckets that every earlier bucket has gone before (the order every rank keeps)."""
        while self._next < len(self.buckets) and self.buckets[self._next].pending == 0:
            self._launch(self.buckets[self._next])
            self._next += 1

    def _launch(self, bucket: _Bucket) -> None:
        torch._foreach_copy_(bucket.views, [_local(p.grad) for p in bucket.params])
        bucket.work = dist.all_reduce(bucket.buffer, group=self.group, async_op=True)

    def _end_of_backward(self) -> None:
        self._queued = False
        self.finish()
        self.begin(1)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Automatic mode: backward passes in here accumulate gradients locally; the next one outside reduces."""
        before, self.syncing = self.syncing, False
        try:
            yield
        finally:
            self.syncing = before

    def begin(self, accumulation_steps: int) -> None:
        """Arm the hooks for one optimizer step made of `accumulation_steps` backward passes."""
        self.accumulation_steps = accumulation_steps
        self.armed = True
        self._next = 0
        for bucket in self.buckets:
            bucket.pending = len(bucket.params)
            bucket.fired.clear()
            bucket.work = None

    def finish(self) -> None:
        """Wait for every bucket and write the averaged gradients back."""
        self.armed = False
        if self.size == 1:
            return
        device = self.buckets[0].buffer.device
        # On a GPU, work.wait() only makes the current stream wait: the clock is read once backward's queued
        # kernels are done and again once the reductions are, so comm_wait_s is the wait for the network alone
        # (hpcscale.parallel.device).
        settle(device)
        t = time.perf_counter()
        for bucket in self.buckets[self._next :]:  # held back by a parameter with no gradient: in order
            for p in bucket.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            self._launch(bucket)
        self._next = len(self.buckets)
        for bucket in self.buckets:
            bucket.work.wait()
        settle(device)
        self.comm_wait_s = time.perf_counter() - t
        self.comm_wait_total_s += self.comm_wait_s
        torch._foreach_div_([bucket.buffer for bucket in self.buckets], self.size)
        grads = [_local(p.grad) for bucket in self.buckets for p in bucket.params]
        torch._foreach_copy_(grads, [v for bucket in self.buckets for v in bucket.views])
