"""The host the hardware loop works on: real (NVML + sysfs) or simulated (one JSON file).

Every backend setter calls `host.guard_write(op)` first; in read-only mode that raises
before anything is touched.
"""
from __future__ import annotations

from pathlib import Path

from hwtune.errors import ReadOnlyError


class NoGpus:
    """Stands in for NVML when there is no driver: zero GPUs and the reason why."""

    def __init__(self, reason: str):
        self.reason = reason

    def count(self) -> int:
        return 0


class Host:
    def __init__(self, kind: str, read_only: bool):
        self.kind = kind  # "sim" | "real"
        self.read_only = bool(read_only)
        self.gpus = None
        self.pcie = None
        self.cpu = None
        self.bios = None
        self.sim_path: Path | None = None
        # Where knobs keep their own records (locked clocks); set by the engine per call.
        self.state_dir: Path | None = None

    def guard_write(self, op: str) -> None:
        if self.read_only:
            raise ReadOnlyError(f"read-only mode: refused {op} (nothing was written)")

    @property
    def gpu_error(self) -> str | None:
        return getattr(self.gpus, "reason", None)


def open_host(sim_path=None, sysfs_root="/", read_only: bool = False, bios=None) -> Host:
    """`sim_path` set: the simulated host in that file. Otherwise NVML and sysfs under `sysfs_root`.

    `bios` is a BIOS backend (see docs/ARCHITECTURE.md) or None; the sim brings its own.
    """
    if sim_path:
        from hwtune.backends.sim import SimBios, SimCpu, SimFile, SimGpus, SimPcie

        host = Host("sim", read_only)
        f = SimFile(Path(sim_path), host.guard_write)
        f.read()  # a malformed file is bad input (exit 2) before any command touches it
        host.sim_path = Path(sim_path)
        host.gpus, host.pcie, host.cpu = SimGpus(f), SimPcie(f), SimCpu(f)
        host.bios = bios if bios is not None else SimBios(f)
        return host

    from hwtune.backends.sysfs import SysfsCpu, SysfsPcie

    host = Host("real", read_only)
    try:
        from hwtune.backends.nvml import NvmlGpus

        host.gpus = NvmlGpus(host.guard_write)
    except Exception as exc:  # no driver, no library: the rest of the host still works
        host.gpus = NoGpus(str(exc))
    root = Path(sysfs_root or "/")
    host.pcie = SysfsPcie(root, host.guard_write)
    host.cpu = SysfsCpu(root, host.guard_write)
    host.bios = bios
    return host
