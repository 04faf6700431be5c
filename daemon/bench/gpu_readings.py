"""Read-only GPU readings for the bench: the energy counter and a few settings.

Prefers hwtune's NVML backend (`hwtune.backends.nvml.NvmlGpus`, `telemetry(i)["energy_mj"]`);
when that module is not there, reads pynvml directly (read-only calls only: this file never
sets anything on the GPU).
"""
from __future__ import annotations


def _refuse_write(op: str) -> None:
    raise PermissionError(f"hwtune bench is read-only for GPU settings (refused {op})")


class GpuReader:
    def __init__(self, nvml_index: int = 0):
        self.index = nvml_index
        self.source = None
        self._backend = None
        self._pynvml = None
        self._handle = None
        self.error = None
        try:
            from hwtune.backends.nvml import NvmlGpus  # another engineer's module
            backend = NvmlGpus(guard_write=_refuse_write)
            if backend.telemetry(nvml_index)["energy_mj"] is None:
                raise RuntimeError("telemetry has no energy_mj")
            self._backend, self.source = backend, "hwtune.backends.nvml"
        except Exception as exc:
            self.error = f"hwtune NVML backend: {type(exc).__name__}: {exc}"
        try:
            import pynvml
            pynvml.nvmlInit()
            self._pynvml = pynvml
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(nvml_index)
            if self.source is None:
                self.source = "pynvml"
        except Exception as exc:
            self._pynvml = None
            self.error = (self.error + "; " if self.error else "") + f"pynvml: {type(exc).__name__}: {exc}"

    @property
    def available(self) -> bool:
        return self.source is not None

    def energy_mj(self) -> float | None:
        try:
            if self._backend is not None:
                return float(self._backend.telemetry(self.index)["energy_mj"])
            if self._handle is not None:
                return float(self._pynvml.nvmlDeviceGetTotalEnergyConsumption(self._handle))
        except Exception:
            return None
        return None

    def facts(self) -> dict:
        """GPU settings for the fingerprint; each field on its own, a failing read is a null."""
        out: dict = {"source": self.source}
        nv, h = self._pynvml, self._handle
        if nv is None or h is None:
            out["error"] = self.error
            return out

        def read(key, fn):
            try:
                v = fn()
                out[key] = v.decode() if isinstance(v, bytes) else v
            except Exception as exc:
                out[key] = None
                out.setdefault("read_errors", {})[key] = type(exc).__name__

        read("name", lambda: nv.nvmlDeviceGetName(h))
        read("uuid", lambda: nv.nvmlDeviceGetUUID(h))
        read("pci_bus_id", lambda: nv.nvmlDeviceGetPciInfo(h).busId)
        read("driver", lambda: nv.nvmlSystemGetDriverVersion())
        read("cuda_driver", lambda: nv.nvmlSystemGetCudaDriverVersion_v2())
        read("vbios", lambda: nv.nvmlDeviceGetVbiosVersion(h))
        read("persistence_mode", lambda: bool(nv.nvmlDeviceGetPersistenceMode(h)))
        read("power_limit_w", lambda: nv.nvmlDeviceGetPowerManagementLimit(h) / 1000.0)
        read("power_limit_default_w", lambda: nv.nvmlDeviceGetPowerManagementDefaultLimit(h) / 1000.0)
        read("enforced_power_limit_w", lambda: nv.nvmlDeviceGetEnforcedPowerLimit(h) / 1000.0)
        read("sm_clock_mhz", lambda: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM))
        read("memory_clock_mhz", lambda: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_MEM))
        read("max_sm_clock_mhz", lambda: nv.nvmlDeviceGetMaxClockInfo(h, nv.NVML_CLOCK_SM))
        read("max_memory_clock_mhz", lambda: nv.nvmlDeviceGetMaxClockInfo(h, nv.NVML_CLOCK_MEM))
        read("temperature_c", lambda: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU))
        read("clock_event_reasons", lambda: nv.nvmlDeviceGetCurrentClocksEventReasons(h))
        read("pcie_link_gen", lambda: nv.nvmlDeviceGetCurrPcieLinkGeneration(h))
        read("pcie_link_width", lambda: nv.nvmlDeviceGetCurrPcieLinkWidth(h))
        read("pcie_max_link_gen", lambda: nv.nvmlDeviceGetMaxPcieLinkGeneration(h))
        read("pcie_max_link_width", lambda: nv.nvmlDeviceGetMaxPcieLinkWidth(h))
        read("virtualization_mode", lambda: nv.nvmlDeviceGetVirtualizationMode(h))
        return out
