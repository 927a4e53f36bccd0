"""A GPU's own counters through NVML (nvidia-ml-py, the `nvml` extra: docs/observability.md#energy): the energy
it used since the attempt started, its utilisation, its SM clock and why its clocks are held down (throttle
reasons). Read on the host from the driver: no device sync, tens of microseconds a read.

Only a machine with an NVIDIA driver can prove the readings; everywhere else `open()` says why it reads nothing
(not a GPU rank, nvidia-ml-py not installed, no driver library), and the figures are absent, not zero."""

from __future__ import annotations

import contextlib
from typing import Any

__all__ = ["GpuCounters", "open_counters"]

# NVML's clock event (throttle) reasons, by the names nvidia-smi uses, most telling first
REASONS = (
    ("nvmlClocksEventReasonHwThermalSlowdown", "hw_thermal"),
    ("nvmlClocksEventReasonSwThermalSlowdown", "sw_thermal"),
    ("nvmlClocksEventReasonHwPowerBrakeSlowdown", "hw_power_brake"),
    ("nvmlClocksEventReasonHwSlowdown", "hw_slowdown"),
    ("nvmlClocksEventReasonSwPowerCap", "sw_power_cap"),
    ("nvmlClocksEventReasonSyncBoost", "sync_boost"),
)


class GpuCounters:
    """One GPU's NVML handle; `read()` is this attempt's figures so far."""

    def __init__(self, nvml: Any, handle: Any):
        self._nvml, self._handle = nvml, handle
        self._energy0 = self._energy_mj()

    def _energy_mj(self) -> int | None:
        try:
            return int(self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle))  # mJ since the driver loaded
        except self._nvml.NVMLError:  # before Volta: no energy counter
            return None

    def read(self) -> dict[str, Any]:
        """`energy_j` (this GPU's, since the attempt started), `gpu_util` (%, over the driver's last sample
        period), `sm_clock_mhz`, `throttle` (the reasons its clocks are held down now, [] when none); a figure the
        GPU does not report is left out."""
        nvml, h = self._nvml, self._handle
        out: dict[str, Any] = {}
        energy = self._energy_mj()
        if energy is not None and self._energy0 is not None:
            out["energy_j"] = round((energy - self._energy0) / 1000, 3)
        with contextlib.suppress(nvml.NVMLError):
            out["gpu_util"] = int(nvml.nvmlDeviceGetUtilizationRates(h).gpu)
        with contextlib.suppress(nvml.NVMLError):
            out["sm_clock_mhz"] = int(nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_SM))
        try:
            mask = int(nvml.nvmlDeviceGetCurrentClocksEventReasons(h))
            out["throttle"] = [name for attr, name in REASONS if mask & int(getattr(nvml, attr, 0))]
        except (nvml.NVMLError, AttributeError):
            pass
        return out


def open_counters(device: Any) -> tuple[GpuCounters | None, str]:
    """(this rank's GPU's counters, "") or (None, why there are none). The GPU is found by its UUID (NVML numbers
    every GPU of the node; CUDA_VISIBLE_DEVICES renumbers the ones a process sees)."""
    if getattr(device, "type", "cpu") != "cuda":
        return None, "not measured on CPU ranks (no energy counter)"
    try:
        import pynvml
    except ImportError:
        return None, "not measured: nvidia-ml-py is not installed (pip install 'hpcscale[nvml]')"
    try:
        import torch

        pynvml.nvmlInit()
        uuid = str(torch.cuda.get_device_properties(device).uuid)
        handle = pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
    except (pynvml.NVMLError, RuntimeError) as e:
        return None, f"not measured: NVML: {e}"
    return GpuCounters(pynvml, handle), ""
