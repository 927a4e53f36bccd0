"""What a clock or a host copy must wait for on an accelerator, in one place.

On CPU with gloo every op has finished when it returns, so `time.perf_counter()` after it measures it. On a
GPU an op returns as soon as it is queued on the current stream, and NCCL's `work.wait()` only makes the
current stream wait for the collective: the host goes on at once. A clock read there measures how fast the
host queues work, not how long the work took; the time shows up later, in whichever call first blocks the host
(a `.item()`, a `float()` of a loss). So before a clock that starts or ends an interval whose work was queued,
the host settles the rank's current stream: `settle(device)`. It is a no-op on CPU.

The stream is the current stream of `device` as the calling thread sees it. A helper thread (the checkpoint
writer) has its own current device, GPU 0 unless set: it must name the rank's device, never rely on the
default (torch.cuda.synchronize() there would wait on GPU 0 and open a context on it).
"""

from __future__ import annotations

import torch


def settle(device: torch.device) -> None:
    """Block until the work queued on `device`'s current stream is done (at once on CPU)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
