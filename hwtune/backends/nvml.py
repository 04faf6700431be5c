"""The GPU backend on real hardware: NVML through nvidia-ml-py. The only pynvml importer.

NVML speaks milliwatts and millijoules; everything leaving this module is in W / mJ as the
names say. Reads that the device does not support return None so that `status` always
completes. Application clocks are deprecated (CUDA 13) and never used: locked clocks only.
NVML has no getter for locked clocks, so `get_locked_*` answer "unknown" and the clock knob
keeps its own record of what hwtune set.
"""
from __future__ import annotations

from typing import Callable

from hwtune.backends import DeviceError
from hwtune.errors import HwtuneError, KnobUnavailable


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class NvmlGpus:
    def __init__(self, guard_write: Callable[[str], None], nvml=None):
        if nvml is None:
            import pynvml as nvml  # nvidia-ml-py
        self.nvml = nvml
        self.guard_write = guard_write
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:
            raise HwtuneError(f"NVML unavailable: {exc}") from exc
        self._handles: dict[int, object] = {}

    # --- plumbing -----------------------------------------------------------------------
    def _reason(self, exc) -> str:
        n = self.nvml
        value = getattr(exc, "value", None)
        if value == getattr(n, "NVML_ERROR_NO_PERMISSION", 4):
            return "NoPermission"
        if value == getattr(n, "NVML_ERROR_NOT_SUPPORTED", 3):
            return "NotSupported"
        return str(exc) or type(exc).__name__

    def _h(self, i: int):
        if i not in self._handles:
            try:
                self._handles[i] = self.nvml.nvmlDeviceGetHandleByIndex(i)
            except self.nvml.NVMLError as exc:
                raise DeviceError(f"gpu{i}", "get_handle", self._reason(exc)) from exc
        return self._handles[i]

    def _get(self, i: int, fn: str, *args, optional: bool = True):
        """Call an NVML getter; NotSupported / NoPermission read as None (status never crashes)."""
        try:
            return getattr(self.nvml, fn)(self._h(i), *args)
        except AttributeError:
            return None  # an older nvidia-ml-py without this call
        except self.nvml.NVMLError as exc:
            reason = self._reason(exc)
            if optional and reason in ("NotSupported", "NoPermission"):
                return None
            raise DeviceError(f"gpu{i}", fn, reason) from exc

    def _set(self, i: int, op: str, fn: str, *args) -> None:
        self.guard_write(f"gpu{i} {op}")
        try:
            getattr(self.nvml, fn)(self._h(i), *args)
        except self.nvml.NVMLError as exc:
            reason = self._reason(exc)
            if reason in ("NotSupported", "NoPermission"):
                raise KnobUnavailable(f"gpu{i}", op, reason) from None
            raise DeviceError(f"gpu{i}", op, reason) from exc

    # --- identity -----------------------------------------------------------------------
    def count(self) -> int:
        return int(self.nvml.nvmlDeviceGetCount())

    def info(self, i: int) -> dict:
        pci = self._get(i, "nvmlDeviceGetPciInfo")
        return {"index": i, "uuid": _text(self._get(i, "nvmlDeviceGetUUID")),
                "name": _text(self._get(i, "nvmlDeviceGetName")),
                "pci_bus_id": _text(pci.busId) if pci is not None else None}

    # --- persistence --------------------------------------------------------------------
    def get_persistence_mode(self, i: int):
        v = self._get(i, "nvmlDeviceGetPersistenceMode")
        return None if v is None else v == self.nvml.NVML_FEATURE_ENABLED

    def set_persistence_mode(self, i: int, on: bool) -> None:
        mode = self.nvml.NVML_FEATURE_ENABLED if on else self.nvml.NVML_FEATURE_DISABLED
        self._set(i, "set_persistence_mode", "nvmlDeviceSetPersistenceMode", mode)

    # --- power --------------------------------------------------------------------------
    def get_power_limit_w(self, i: int):
        mw = self._get(i, "nvmlDeviceGetPowerManagementLimit")
        return None if mw is None else mw / 1000.0

    def get_power_limit_constraints_w(self, i: int):
        v = self._get(i, "nvmlDeviceGetPowerManagementLimitConstraints")
        return None if v is None else (v[0] / 1000.0, v[1] / 1000.0)

    def get_power_limit_default_w(self, i: int):
        mw = self._get(i, "nvmlDeviceGetPowerManagementDefaultLimit")
        return None if mw is None else mw / 1000.0

    def set_power_limit_w(self, i: int, w: float) -> None:
        self._set(i, "set_power_limit", "nvmlDeviceSetPowerManagementLimit", int(round(w * 1000)))

    # --- clocks -------------------------------------------------------------------------
    def get_supported_memory_clocks_mhz(self, i: int) -> list:
        return sorted(self._get(i, "nvmlDeviceGetSupportedMemoryClocks") or [])

    def get_supported_sm_clocks_mhz(self, i: int) -> list:
        clocks: set[int] = set()
        for mem in self.get_supported_memory_clocks_mhz(i):
            clocks.update(self._get(i, "nvmlDeviceGetSupportedGraphicsClocks", mem) or [])
        return sorted(clocks)

    def get_locked_sm_clocks_mhz(self, i: int):
        return "unknown"

    def get_locked_memory_clocks_mhz(self, i: int):
        return "unknown"

    def set_locked_sm_clocks_mhz(self, i: int, lo: int, hi: int) -> None:
        self._set(i, "set_locked_sm_clocks", "nvmlDeviceSetGpuLockedClocks", int(lo), int(hi))

    def reset_locked_sm_clocks(self, i: int) -> None:
        self._set(i, "reset_locked_sm_clocks", "nvmlDeviceResetGpuLockedClocks")

    def set_locked_memory_clocks_mhz(self, i: int, lo: int, hi: int) -> None:
        self._set(i, "set_locked_memory_clocks", "nvmlDeviceSetMemoryLockedClocks", int(lo), int(hi))

    def reset_locked_memory_clocks(self, i: int) -> None:
        self._set(i, "reset_locked_memory_clocks", "nvmlDeviceResetMemoryLockedClocks")

    # --- telemetry ----------------------------------------------------------------------
    def telemetry(self, i: int) -> dict:
        n = self.nvml

        def safe(fn, *args):
            try:
                return self._get(i, fn, *args)
            except DeviceError:
                return None

        power_mw = safe("nvmlDeviceGetPowerUsage")
        reasons = safe("nvmlDeviceGetCurrentClocksEventReasons")
        if reasons is None:  # older drivers / bindings
            reasons = safe("nvmlDeviceGetCurrentClocksThrottleReasons")
        return {
            "temperature_c": safe("nvmlDeviceGetTemperature", n.NVML_TEMPERATURE_GPU),
            "power_w": None if power_mw is None else power_mw / 1000.0,
            "sm_clock_mhz": safe("nvmlDeviceGetClockInfo", n.NVML_CLOCK_SM),
            "memory_clock_mhz": safe("nvmlDeviceGetClockInfo", n.NVML_CLOCK_MEM),
            "clock_event_reasons": None if reasons is None else int(reasons),
            "energy_mj": safe("nvmlDeviceGetTotalEnergyConsumption"),
            # NVML reports XIDs only as events (nvmlEventSetWait), not as a counter: the
            # daemon counts them; a one-shot read has none.
            "xid_errors": None,
        }
