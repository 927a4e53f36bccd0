"""How well a step uses its devices (docs/observability.md#efficiency): the model FLOPs of a step, counted once
from the model itself, achieved TFLOPS per device and MFU against the device's peak, and memory.

**Model FLOPs.** The second step of each attempt runs under torch's FlopCounterMode: the training thread's work
from the end of the first `ctx.checkpoint.step()` to the second (forward, backward, the optimizer; an evaluation
inside `ctx.checkpoint.paused(...)` left out). The first step is not counted: it builds what is built lazily (a
pipeline's shape inference runs each stage's forward once more). The counter knows matrix products,
convolutions and attention (torch.utils.flop_counter's formulas; attention as model FLOPs count it: forward
and twice that for the backward, over the whole sequence); element-wise work (norms, activations, the
optimizer's update) counts as nothing. Each rank counts what it computes at the shapes it computes it: a
DTensor's operation (tensor parallelism, FSDP) at this rank's shards. The step's FLOPs are the sum over every
rank (one MPI all-reduce, once per attempt), so work replicated on every rank of a tp group (a layer a plan
leaves whole) counts on each, and a recomputed forward (activation checkpointing) counts again: hardware
FLOPs, which equal model FLOPs where neither happens. Where the counter sees nothing (code it cannot run
under, `metrics.flops: formula`), the standard estimate stands in: 6 x parameters x tokens per step (the
attention's own FLOPs left out), with `ctx.checkpoint.tokens_per_step` set; the record says which.

**Peaks.** MFU is the achieved TFLOPS per device over the device's dense bf16 peak: PEAK_TFLOPS by the name
torch reports, or the site's `devices.peak_tflops` (which wins). None for a CPU unless the site names one.

**Memory.** The peak of the device memory torch's caching allocator handed out and reserved since the attempt
started (CUDA; no sync: host-side counters), pinned host memory, and the process's peak resident set."""

from __future__ import annotations

import re
import resource
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from hpcscale.launch import mpiwait
from hpcscale.launch.nvml import open_counters

__all__ = ["PEAK_TFLOPS", "Efficiency", "StepFlops", "memory_gauges", "peak_for"]

# Dense (no sparsity) bf16 tensor-core peaks of one device, in TFLOPS, from the vendors' data sheets. Keys are
# matched as whole words of the name torch reports (torch.cuda.get_device_name), case aside: the key with the
# most words that all appear in order wins ("h100 pcie" before "h100").
PEAK_TFLOPS: dict[str, float] = {
    "b200": 2250.0,
    "gb200": 2500.0,
    "h200": 989.4,
    "gh200": 989.4,
    "h100": 989.4,
    "h100 pcie": 756.0,
    "h100 nvl": 835.0,
    "h800": 989.4,
    "a100": 312.0,
    "a800": 312.0,
    "l40s": 362.1,
    "l40": 181.0,
    "l4": 121.0,
    "a40": 149.7,
    "a10": 125.0,
    "v100": 125.0,  # fp16: V100 has no bf16
    "mi300x": 1307.4,
    "mi250x": 383.0,
    "mi250": 362.1,
    "mi210": 181.0,
}

GB = 1e9
NVML_EVERY_S = 1.0  # a GPU's NVML counters are read at most this often (energy per step is averaged over it)


def _words(name: str) -> list[str]:
    return [w for w in re.split(r"[^a-z0-9]+", name.lower()) if w]


def _matches(key: str, words: list[str]) -> bool:
    """Whether the key's words appear in `words`, in order (not necessarily next to each other)."""
    it = iter(words)
    return all(any(w == k for w in it) for k in _words(key))


def peak_for(device_name: str, site: Mapping[str, float] | None = None) -> tuple[float | None, str | None]:
    """(peak dense TFLOPS of one device named `device_name`, where it came from: "site" or "table"), or (None,
    None). The site's `devices.peak_tflops` is looked at first, then PEAK_TFLOPS; within each the key with the
    most words wins."""
    words = _words(device_name)
    for source, table in (("site", site or {}), ("table", PEAK_TFLOPS)):
        found = [k for k in table if _words(k) and _matches(k, words)]
        if found:
            best = max(found, key=lambda k: len(_words(k)))
            return float(table[best]), source
    return None, None


def device_name(device: Any) -> str:
    """The name a peak is looked up by: the GPU's as torch reports it, `cpu` for a CPU rank."""
    if getattr(device, "type", "cpu") == "cuda":
        import torch

        return torch.cuda.get_device_name(device)
    return "cpu"


def _attention_mapping() -> dict:
    """FlopCounterMode formulas for attention as model FLOPs count it: the two products of the forward (QK^T and
    the scores times V, over the whole sequence: causal masking is not halved, as torch counts it), and twice
    that for the backward. Torch's own backward formulas add the recomputed scores (hardware work, not the
    model's); the CPU kernel has no formula of its own (its attention would count nothing)."""
    import torch
    from torch.utils.flop_counter import sdpa_flop_count

    def forward(query, key, value, *_args, out_shape=None, **_kwargs) -> int:
        return sdpa_flop_count(query, key, value)

    def backward(grad_out, query, key, value, *_args, out_shape=None, **_kwargs) -> int:
        return 2 * sdpa_flop_count(query, key, value)

    aten = torch.ops.aten
    mapping = {}
    for name in (
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
    ):
        if hasattr(aten, name):
            mapping[getattr(aten, name)] = forward
        if hasattr(aten, name + "_backward"):
            mapping[getattr(aten, name + "_backward")] = backward
    return mapping


class _NoModules:
    """Stands in for FlopCounterMode's module tracker, never entered: every count goes to "Global". The tracker
    puts hooks on every module's forward and backward, and its backward hooks break a pipeline stage's backward
    (torch.distributed.pipelining computes it with autograd.grad, which they refuse)."""

    parents = ("Global",)

    def __enter__(self):
        return self

    def __exit__(self, *_):
        return None


def _counter():
    """A FlopCounterMode that counts what this process computes, at the shapes it computes them: a DTensor's
    operation (tensor parallelism, FSDP) is left to DTensor, whose local operations on this rank's shards then
    come through the mode and count; its sharding propagation's runs on fake tensors do not. (torch's own
    mode counts a DTensor operation at the global shapes, on every rank, and its fake runs too.) Built on
    torch.utils.flop_counter's formulas and its dispatch mode (`_FlopCounterMode`, private: pinned by
    tests/training/test_efficiency.py)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.distributed.tensor import DTensor
    from torch.utils.flop_counter import FlopCounterMode, _FlopCounterMode

    class LocalShapes(_FlopCounterMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(issubclass(t, DTensor) for t in types):
                return NotImplemented  # DTensor's turn; its local operations come back here
            if any(issubclass(t, FakeTensor) for t in types):
                return func(*args, **(kwargs or {}))
            if isinstance(func, torch._ops.HigherOrderOperator) or func._overloadpacket in self.counter.flop_registry:
                return super().__torch_dispatch__(func, types, args, kwargs)
            # an operation without a formula runs as it runs uncounted: torch's mode would run its decomposition
            # instead, other kernels whose sums round otherwise, and the counted step would not be bitwise any
            # other step (a resumed run, counted at another step, left the uninterrupted run's weights)
            return func(*args, **(kwargs or {}))

    class Counter(FlopCounterMode):
        failed = False  # a formula raised (shapes it does not know): the count is not to be trusted

        def _count_flops(self, func_packet, out, args, kwargs):
            try:
                return super()._count_flops(func_packet, out, args, kwargs)
            except Exception:  # the operation ran; only its count failed: never the user's step
                self.failed = True
                return out

        def __enter__(self):
            self.flop_counts.clear()
            self.mode = LocalShapes(self)
            self.mode.__enter__()
            return self

        def __exit__(self, *args):
            mode, self.mode = self.mode, None
            return mode.__exit__(*args)

    counter = Counter(display=False, custom_mapping=_attention_mapping())
    counter.mod_tracker = _NoModules()  # every count to "Global" (FlopCounterMode._count_flops reads it)
    return counter


class StepFlops:
    """FlopCounterMode around one step on the training thread: begin() at the restore's end, end() at the
    step's `ctx.checkpoint.step()`; suspend()/resume() around work between steps that is not training."""

    def __init__(self) -> None:
        self._mode: Any = None
        self._total = 0
        self._suspended = False
        self.failed = False

    @property
    def counting(self) -> bool:
        return self._mode is not None or self._suspended

    def begin(self) -> None:
        self._total = 0
        self._suspended = False
        self.failed = False
        self._enter(_counter())

    def _enter(self, mode: Any) -> None:
        mode.__enter__()
        self._mode = mode

    def _leave(self) -> None:
        mode, self._mode = self._mode, None
        if mode is not None:
            mode.__exit__(None, None, None)
            self._total += int(mode.get_total_flops())
            self.failed = self.failed or mode.failed

    def suspend(self) -> None:
        if self._mode is not None:
            self._leave()
            self._suspended = True

    def resume(self) -> None:
        if self._suspended:
            self._suspended = False
            self._enter(_counter())

    def end(self) -> int:
        """The FLOPs counted since begin(), suspended spans left out; counting stops."""
        self._leave()
        self._suspended = False
        return self._total


def compiled(models: Iterable[Any]) -> bool:
    """Whether any of the models (or a module in them) went through torch.compile: dynamo does not compile under
    a dispatch mode such as the counter's (it would leave a frame it meets then eager for the rest of the run)."""
    for model in models:
        for m in model.modules():
            if type(m).__name__ == "OptimizedModule" or getattr(m, "_compiled_call_impl", None) is not None:
                return True
    return False


def parameters_of_stage(models: Iterable[Any]) -> int:
    """The parameters of the models this rank holds, whole: a DTensor counts its global shape (its tp and FSDP
    shards together), a plain tensor its own. The same number on every rank of a pipeline stage."""
    seen: set[int] = set()
    total = 0
    for model in models:
        for p in model.parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            total += int(p.numel())  # DTensor.numel() is the global tensor's
    return total


def memory_gauges(device: Any) -> dict[str, float]:
    """This process's memory: the peak bytes torch's CUDA allocator handed out (`mem_gb`) and reserved
    (`mem_reserved_gb`) since the attempt started, the pinned host memory it holds (`pinned_gb`), and the peak
    resident set (`rss_gb`), in GB (10^9 bytes). Host-side counters only: no device sync. On a CPU rank only
    `rss_gb` (the device's memory is the host's)."""
    out: dict[str, float] = {}
    if getattr(device, "type", "cpu") == "cuda":
        import torch

        out["mem_gb"] = round(torch.cuda.max_memory_allocated(device) / GB, 3)
        out["mem_reserved_gb"] = round(torch.cuda.max_memory_reserved(device) / GB, 3)
        try:
            stats = torch.cuda.host_memory_stats()
            out["pinned_gb"] = round(stats.get("allocated_bytes.current", 0) / GB, 3)
        except (AttributeError, RuntimeError):
            pass
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    out["rss_gb"] = round(peak_kib * (1 if sys.platform == "darwin" else 1024) / GB, 3)
    return out


@dataclass(frozen=True, slots=True)
class ModelFlops:
    """The model FLOPs of one global step and how they were found."""

    per_step: int
    source: str  # "counted" or "formula"
    tokens_per_step: int

    @property
    def per_token(self) -> float | None:
        return self.per_step / self.tokens_per_step if self.tokens_per_step else None

    def to_json(self, *, device: str, peak: float | None, peak_source: str | None, world: int) -> dict:
        out = {
            "flops_per_step": self.per_step,
            "source": self.source,
            "device": device,
            "devices": world,
            "peak_tflops": peak,
            "peak_source": peak_source,
        }
        if self.per_token is not None:
            out["flops_per_token"] = round(self.per_token, 1)
        return out


class Efficiency:
    """One rank's efficiency figures for the step loop (hpcscale.launch.steploop). With `metrics.flops: count`
    the attempt's second step is counted (the first builds what is built lazily: a pipeline's shape inference
    runs each stage's forward once more); at that step's `ctx.checkpoint.step()` every rank agrees the step's
    model FLOPs (one MPI all-reduce, once); from then on a step's time gives `tflops` (per device) and `mfu`,
    beside the memory gauges."""

    def __init__(self, ctx: Any, *, mode: str, peak_tflops: Mapping[str, float] | None = None):
        self._ctx = ctx
        self.mode = mode  # "count", "formula" or "off"
        self.device = device_name(ctx.device)
        self.peak, self.peak_source = peak_for(self.device, peak_tflops)
        self.flops: ModelFlops | None = None
        self._counter = StepFlops() if mode == "count" else None
        # this rank's GPU's NVML counters (energy, utilisation, clocks, throttling), or why there are none
        self.gpu, self.energy_why = open_counters(ctx.device)
        self._gpu_read_at = -float("inf")
        self._energy_last: tuple[float, float] | None = None  # (time, energy_j) of the last read, for power_w
        # "first": the first step runs; "counting": the next one is counted; "agree" (formula): nothing to count,
        # the figures are agreed at the first step(); "settled": known, or found unknowable
        self._state = {"count": "first", "formula": "agree"}.get(mode, "settled")
        self._paused = 0  # nested pauses (ctx.checkpoint.paused, a rollback) open now
        self.why_formula = ""  # why the formula stands in for a count, when it does

    def next_step(self, *, last: bool) -> None:
        """A step() ended: the next step starts (`last`: none follows). The second step of the attempt is
        counted."""
        if self._state == "first" and self._counter is not None:
            if last:
                self._state = "agree"  # no second step: the formula, if it can
                return
            if compiled(self._ctx.models):  # dynamo would not compile under the counter's mode: never count
                self._state, self.mode = "agree", "formula"
                self.why_formula = "a torch.compile'd model is not counted"
                return
            self._counter.begin()
            self._state = "counting"

    def suspend(self) -> None:
        """Work that is not training begins (pauses nest: counting resumes when the outermost one ends)."""
        self._paused += 1
        if self._counter is not None and self._paused == 1:
            self._counter.suspend()

    def resume(self) -> None:
        self._paused = max(0, self._paused - 1)
        if self._counter is not None and self._paused == 0:
            self._counter.resume()

    def close(self) -> None:
        """The loop ended with the count in flight (the code stopped calling step()): nothing is counted."""
        if self._counter is not None and self._counter.counting:
            self._counter.end()
        self._state = "settled"

    def step_done(self, tokens_per_step: int) -> dict | None:
        """At every `ctx.checkpoint.step()`, on every rank, before anything else of it: at the counted step (or
        the first, with `formula`) the step's model FLOPs over every rank (an MPI all-reduce: a collective, as
        step() is) and the metrics record of them (rank 0 logs it); None at every other step."""
        failed = False
        if self._state == "counting":
            counted = self._counter.end()
            failed = self._counter.failed
        elif self._state == "agree":
            counted = 0
        else:
            return None
        self._state = "settled"
        ctx = self._ctx
        stage = parameters_of_stage(ctx.models) if (ctx.tp_rank == 0 and ctx.dp_rank == 0) else 0
        import numpy as np
        from mpi4py import MPI

        # float64: a step of a large model exceeds int64 FLOPs; its 53 bits hold the sum to 1e-16
        agreed = np.zeros(3, dtype=np.float64)
        mpiwait.allreduce(np.array([counted, stage, failed], dtype=np.float64), agreed, MPI.SUM)
        counted_world, parameters = int(agreed[0]), int(agreed[1])
        if agreed[2]:  # a rank's counter met an operation it could not count: the formula, on every rank
            counted_world, self.why_formula = 0, "the counter could not count an operation"
        tokens = int(tokens_per_step or 0)
        if counted_world > 0:
            self.flops = ModelFlops(counted_world, "counted", tokens)
        elif parameters and tokens:
            self.flops = ModelFlops(6 * parameters * tokens, "formula", tokens)
        if self.flops is None:
            seen = "the counter saw no matrix product and " if self.mode == "count" else ""
            return {
                "energy": self.energy_why or "measured (NVML)",
                "flops_per_step": None,
                "why": f"{seen}ctx.checkpoint.tokens_per_step is not set",
                "device": self.device,
                "devices": ctx.world_size,
                "peak_tflops": self.peak,
                "peak_source": self.peak_source,
            }
        record = self.flops.to_json(
            device=self.device, peak=self.peak, peak_source=self.peak_source, world=ctx.world_size
        )
        if self.flops.source == "formula":
            record["parameters"] = parameters
            if self.why_formula:
                record["why_formula"] = self.why_formula
        record["energy"] = self.energy_why or "measured (NVML)"
        return record

    def figures(self, step_s: float) -> dict[str, float]:
        """What a step's metrics line carries: `tflops` (model TFLOPS achieved per device over the step's wall
        time) and `mfu` (that over the peak) once the model FLOPs are known, and the memory gauges."""
        out: dict[str, float] = {}
        if self.flops is not None and step_s > 0:
            tflops = self.flops.per_step / step_s / self._ctx.world_size / 1e12
            out["tflops"] = float(f"{tflops:.6g}")  # six figures, whatever the scale (a CPU's 1e-5)
            if self.peak:
                out["mfu"] = float(f"{tflops / self.peak:.6g}")
        out.update(memory_gauges(self._ctx.device))
        if self.gpu is not None and time.monotonic() - self._gpu_read_at >= NVML_EVERY_S:
            out.update(self._gpu_figures())
        return out

    def _gpu_figures(self) -> dict:
        """NVML's figures, at most every NVML_EVERY_S (a read costs tens of microseconds): `energy_j` since the
        attempt started and `power_w` since the read before, `gpu_util`, `sm_clock_mhz`, `throttle`."""
        now = time.monotonic()
        self._gpu_read_at = now
        got = self.gpu.read()
        energy = got.get("energy_j")
        if energy is not None:
            if self._energy_last is not None and now > self._energy_last[0]:
                got["power_w"] = round((energy - self._energy_last[1]) / (now - self._energy_last[0]), 1)
            self._energy_last = (now, energy)
        return got
