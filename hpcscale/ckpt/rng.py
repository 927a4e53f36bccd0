"""Each rank's random number generator states: taken at a save, checked and put back at a load.

A rank has a CPU generator and, on a GPU, one per device: the rank's own device is named explicitly, never
taken from torch's notion of the current device, and a rank on the CPU (device: cpu on a GPU node) never touches
CUDA (that would open a context on GPU 0). Both are saved; both are restored, so dropout and any sampling on
the GPU continue where the uninterrupted run would. A checkpoint saved on CPU restores on a GPU rank with the
CUDA generator as seeded, and one saved on a GPU restores on CPU with its CUDA state unused.
"""

from __future__ import annotations

import numpy as np
import torch


def rng_state(device: torch.device | None = None) -> dict[str, np.ndarray]:
    """This rank's generator states: "cpu", and "cuda" (that of `device`) when the rank trains on a GPU."""
    out = {"cpu": torch.get_rng_state().numpy().copy()}
    if device is not None and device.type == "cuda":
        out["cuda"] = torch.cuda.get_rng_state(device).numpy().copy()
    return out


def restore_rng(states: dict[str, np.ndarray], device: torch.device) -> None:
    """Put back what rng_state() took (after rng_problem() found nothing wrong): the CPU generator, and the
    CUDA generator of `device` when the rank trains on a GPU and the checkpoint has one."""
    torch.set_rng_state(torch.from_numpy(np.array(states["cpu"], dtype=np.uint8)))
    if device.type == "cuda" and "cuda" in states:
        torch.cuda.set_rng_state(torch.from_numpy(np.array(states["cuda"], dtype=np.uint8)), device=device)


def rng_problem(states: dict[str, np.ndarray] | None, device: torch.device | None = None) -> str | None:
    """What is wrong with this rank's saved RNG states for this process's torch: the CPU state must be one
    torch.set_rng_state accepts (tried, then undone); a CUDA state, when saved and the rank is on a GPU, must
    have the length torch.cuda.get_rng_state(device) has."""
    if not states or "cpu" not in states:
        return "no CPU RNG state for this rank"
    cpu = np.asarray(states["cpu"])
    want = torch.get_rng_state().numel()
    if cpu.dtype != np.uint8 or cpu.shape != (want,):
        return f"the CPU RNG state has shape {cpu.shape} of {cpu.dtype}; this torch expects ({want},) of uint8"
    current = torch.get_rng_state()
    try:
        torch.set_rng_state(torch.from_numpy(cpu.copy()))
    except Exception as e:  # RuntimeError: a state of the right length whose contents torch refuses
        return f"the CPU RNG state is refused by torch: {str(e)[:200]}"
    finally:
        torch.set_rng_state(current)
    if "cuda" in states and device is not None and device.type == "cuda":
        cuda = np.asarray(states["cuda"])
        want = torch.cuda.get_rng_state(device).numel()
        if cuda.dtype != np.uint8 or cuda.shape != (want,):
            return f"the CUDA RNG state has shape {cuda.shape}; this torch expects ({want},)"
    return None
