"""A GPU's own counters through NVML (nvidia-ml-py, the `nvml` extra: docs/observability.md#energy): the energy
it used since the attempt started, its utilisation, its SM clock and why its clocks are held down (throttle
reasons). Read on the host from the driver: no device sync, tens of microseconds a read.

Only a machine with an NVIDIA driver can prove the readings; everywhere else `open()` says why it reads nothing
(not a GPU rank, nvidia-ml-py not installed, no driver library), and the figures are absent, not zero."""

from __future__ import annotations

import contextlib
import os
from typing import Any

__all__ = ["DeviceSigns", "GpuCounters", "InjectedSign", "device_signs", "open_counters"]

# NVML's clock event (throttle) reasons, by the names nvidia-smi uses, most telling first
REASONS = (
    ("nvmlClocksEventReasonHwThermalSlowdown", "hw_thermal"),
    ("nvmlClocksEventReasonSwThermalSlowdown", "sw_thermal"),
    ("nvmlClocksEventReasonHwPowerBrakeSlowdown", "hw_power_brake"),
    ("nvmlClocksEventReasonHwSlowdown", "hw_slowdown"),
    ("nvmlClocksEventReasonSwPowerCap", "sw_power_cap"),
    ("nvmlClocksEventReasonSyncBoost", "sync_boost"),
)


# the reasons that are the GPU protecting itself (heat, a failing power supply), not a policy (a power cap, boost)
HEALTH_REASONS = ("hw_thermal", "sw_thermal", "hw_power_brake", "hw_slowdown")
XID_PER_READ = 16  # Xid events taken from the event set at one read (a storm of them is one sign's worth)
# Xids that say the GPU or its links are failing (NVIDIA's Xid catalogue: double-bit and uncontained ECC errors,
# row remapping, NVLink, the GPU fallen off the bus, GSP and micro-controller errors). Others (13, 31, 43, 45: a
# program's illegal access, or its cleanup after being killed) a program can cause: logged, no node suspected
HARDWARE_XIDS = frozenset({48, 61, 62, 63, 64, 74, 79, 92, 94, 95, 119, 120, 140})
DEVICE_KINDS = ("ecc", "row_remap", "xid", "throttle")
EVIDENCE_MAX = 200


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


class DeviceSigns:
    """One GPU's warning signs through NVML (docs/observability.md#health-signals): uncorrected ECC errors since the
    attempt started, a row remapping pending or failed, Xid critical errors (an NVML event set, read without
    waiting), clocks held down to protect the GPU (HEALTH_REASONS). `read(step)` gives the signs seen now, as
    hpcscale.launch.health.HealthWatch.add takes them (the same sign again is not new there). Host-side driver
    calls, no device sync: tens of microseconds a read. Only a GPU machine proves what the driver answers."""

    def __init__(self, nvml: Any, handle: Any, *, where: str, node: str):
        self._nvml, self._h, self.where, self.node = nvml, handle, where, node
        self._ecc0 = self._ecc()
        self._events = None
        try:
            events = nvml.nvmlEventSetCreate()
            nvml.nvmlDeviceRegisterEvents(handle, nvml.nvmlEventTypeXidCriticalError, events)
            self._events = events
        except (nvml.NVMLError, AttributeError):  # not supported here (a MIG slice, a driver without events)
            pass

    def _ecc(self) -> int | None:
        nvml = self._nvml
        try:
            return int(
                nvml.nvmlDeviceGetTotalEccErrors(
                    self._h, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC
                )
            )
        except (nvml.NVMLError, AttributeError):  # ECC off, or a GPU without it
            return None

    def _sign(self, kind: str, what: str, **extra) -> dict:
        return {"kind": kind, "node": self.node, "evidence": f"{self.where}: {what}"[:EVIDENCE_MAX], **extra}

    def close(self) -> None:
        """The Xid event set back to the driver."""
        events, self._events = self._events, None
        if events is not None:
            with contextlib.suppress(self._nvml.NVMLError, AttributeError):
                self._nvml.nvmlEventSetFree(events)

    def read(self, step: int) -> list[dict]:
        nvml, h, out = self._nvml, self._h, []
        ecc = self._ecc()
        if ecc is not None and self._ecc0 is not None and ecc > self._ecc0:
            out.append(self._sign("ecc", f"{ecc - self._ecc0} uncorrected ECC error(s) since the attempt started"))
        try:
            _corrected, _uncorrected, pending, failed = nvml.nvmlDeviceGetRemappedRows(h)
            if failed:
                out.append(self._sign("row_remap", "a row remapping failed"))
            elif pending:
                out.append(self._sign("row_remap", "a row remapping is pending (the GPU needs a reset)"))
        except (nvml.NVMLError, AttributeError, TypeError, ValueError):  # before Ampere: no row remapping
            pass
        for _ in range(XID_PER_READ if self._events is not None else 0):
            try:
                data = nvml.nvmlEventSetWait_v2(self._events, 0)
            except nvml.NVMLError as e:  # NVML_ERROR_TIMEOUT: no event waiting; anything else: stop asking
                if getattr(e, "value", None) != getattr(nvml, "NVML_ERROR_TIMEOUT", None):
                    self._events = None
                break
            xid = int(data.eventData)
            if xid in HARDWARE_XIDS:
                out.append(self._sign("xid", f"Xid {xid} (a critical error the driver reported)"))
            else:  # a program can cause it: logged only (suspect False: no save, no node suspected)
                out.append(self._sign("xid", f"Xid {xid} (the driver's; a program can cause it)", suspect=False))
        try:
            mask = int(nvml.nvmlDeviceGetCurrentClocksEventReasons(h))
            held = [name for attr, name in REASONS if name in HEALTH_REASONS and mask & int(getattr(nvml, attr, 0))]
            if held:  # once per rank and attempt, whatever the reasons' mix (a hot room flaps)
                out.append(self._sign("throttle", "clocks held down: " + ", ".join(held), key=f"{self.where} throttle"))
        except (nvml.NVMLError, AttributeError):
            pass
        return out


class InjectedSign:
    """HPCSCALE_DEVICE_SIGN=<kind>@<step>[:<rank>]: a device warning sign of `kind` on that rank (every rank
    without one) from `step` on, for the tests of what a sign does on machines without a GPU. Unset in normal
    runs."""

    def __init__(self, spec: str, *, rank: int, where: str, node: str):
        kind, _, rest = spec.partition("@")
        at, _, who = rest.partition(":")
        try:
            self.kind, self.step = kind.strip() or "xid", int(at or 0)
            self.mine = not who or int(who) == rank
            if self.kind not in DEVICE_KINDS:
                raise ValueError(self.kind)
        except ValueError:
            from hpcscale.errors import BadInput

            raise BadInput(
                f"HPCSCALE_DEVICE_SIGN={spec!r}: expected <kind>@<step>[:<rank>], kind one of {', '.join(DEVICE_KINDS)}"
            ) from None
        self.where, self.node = where, node

    def close(self) -> None:
        pass

    def read(self, step: int) -> list[dict]:
        if not self.mine or step < self.step:
            return []
        return [{"kind": self.kind, "node": self.node, "evidence": f"{self.where}: injected (HPCSCALE_DEVICE_SIGN)"}]


def device_signs(device: Any, *, rank: int, node: str) -> DeviceSigns | InjectedSign | None:
    """This rank's reader of its GPU's warning signs, or None (a CPU rank, no nvidia-ml-py, no driver: the
    figures' open_counters says which)."""
    injected = os.environ.get("HPCSCALE_DEVICE_SIGN", "")
    if injected:
        return InjectedSign(injected, rank=rank, where=f"rank {rank}", node=node)
    counters, _why = open_counters(device)
    if counters is None:
        return None
    try:
        uuid = str(counters._nvml.nvmlDeviceGetUUID(counters._handle))
    except counters._nvml.NVMLError:
        uuid = "its GPU"
    return DeviceSigns(counters._nvml, counters._handle, where=f"rank {rank} {uuid}", node=node)
