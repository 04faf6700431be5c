"""PCIe config space, cpufreq and cpuidle through sysfs under an injectable root.

PCIe: /sys/bus/pci/devices/<BDF>/{vendor,device,class,config}. The PCI Express capability
(ID 0x10) is found by walking the capability list from the pointer at 0x34; Device Control
is the 16-bit little-endian word at cap+8 (relaxed ordering = bit 4, max read request =
bits 14:12 as 128 << n). Writes are read-modify-write of those two bytes (pread/pwrite).
The kernel shows only the first 64 bytes of `config` to non-root readers, which holds no
capability: that case gets its own message.

CPU: governors via cpu*/cpufreq/scaling_governor. The C-state latency limit is enforced with
the per-state `disable` files under cpu*/cpuidle/state*/ rather than /dev/cpu_dma_latency:
the PM QoS request lasts only while a process holds that file open, whereas the disable
flags persist after hwtune exits and can be journaled and restored one by one.
"""
from __future__ import annotations

import errno
import os
import re
import stat
from pathlib import Path
from typing import Callable

from hwtune.errors import HwtuneError, KnobUnavailable

# What may name a directory under the sysfs root: nothing else is ever joined into a path.
BDF_NAME = re.compile(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]")
CPU_NAME = re.compile(r"cpu[0-9]{1,5}")
STATE_NAME = re.compile(r"state[0-9]{1,3}")
PCI_EXP_CAP_ID = 0x10
DEVCTL_OFFSET = 8
LNKSTA_OFFSET = 0x12


class ConfigSpaceError(HwtuneError):
    pass


class ConfigSpaceUnavailable(ConfigSpaceError, KnobUnavailable):
    """Config space this process may not see (non-root: 64 bytes) or a function without the
    PCIe capability: the knob is unavailable here (skipped), not a broken device."""

    def __init__(self, where: str, reason: str, detail: str):
        self.target = where.replace("pcie ", "pcie:", 1)
        self.knob, self.reason = "devctl", reason
        HwtuneError.__init__(self, f"{where}: {detail}")


def find_pcie_capability(config: bytes, where: str = "") -> int:
    """Offset of the PCI Express capability in a config-space image."""
    if len(config) < 0x40:
        raise ConfigSpaceError(f"{where}: config space is {len(config)} bytes, need at least 64")
    status = int.from_bytes(config[6:8], "little")
    if not status & 0x10:
        raise ConfigSpaceUnavailable(where, "NotSupported", "no capability list (status register bit 4 clear)")
    ptr = config[0x34] & 0xFC
    seen = set()
    while ptr:
        if ptr in seen or len(seen) > 48:
            raise ConfigSpaceError(f"{where}: capability list loops at 0x{ptr:02x}")
        seen.add(ptr)
        if ptr + 1 >= len(config):
            if len(config) <= 64:
                raise ConfigSpaceUnavailable(
                    where, "NoPermission", f"config space shows only {len(config)} bytes (the kernel hides the "
                    "rest from non-root readers; run as root)")
            raise ConfigSpaceError(f"{where}: capability pointer 0x{ptr:02x} beyond config space")
        if config[ptr] == PCI_EXP_CAP_ID:
            return ptr
        ptr = config[ptr + 1] & 0xFC
    raise ConfigSpaceUnavailable(where, "NotSupported", "no PCI Express capability (not a PCIe function)")


def _require_inside(root_real: str, real: str, path: Path) -> None:
    """Refuse to write `path`, which resolves to `real`, unless it lies under the sysfs root.
    Under a real /sys the PCI device links stay inside /sys; with the root "/" there is nothing
    to check."""
    if root_real != "/" and not real.startswith(root_real + "/"):
        raise HwtuneError(f"{path}: resolves to {real[:200]}, outside the sysfs root {root_real}; "
                          "refusing to write it")


def _check_inside(root_real: str, fd: int, path: Path) -> None:
    """The file actually opened (not its name: a link in a fixture tree may point anywhere)
    must lie under the sysfs root before hwtune writes it."""
    if root_real == "/":
        return
    try:
        real = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        real = os.path.realpath(path)
    _require_inside(root_real, real, path)


def write_attr(root_real: str, path: Path, text: str) -> None:
    """Write a sysfs attribute, never through a link that leaves the sysfs root (checked on
    the resolved name: opening first would truncate the file it points at)."""
    _require_inside(root_real, os.path.realpath(path), path)
    path.write_text(text)


class SysfsPcie:
    def __init__(self, root: Path, guard_write: Callable[[str], None]):
        self.base = Path(root) / "sys/bus/pci/devices"
        self.root_real = os.path.realpath(root)
        self.guard_write = guard_write

    def _read_attr(self, bdf: str, name: str) -> str:
        return read_attr(self.base / bdf / name).strip().lower()

    def functions(self) -> list:
        if not self.base.is_dir():
            return []
        out = []
        for d in sorted(self.base.iterdir()):
            if not BDF_NAME.fullmatch(d.name):
                continue
            try:
                out.append({"bdf": d.name, "vendor": self._read_attr(d.name, "vendor"),
                            "device": self._read_attr(d.name, "device"),
                            "class": self._read_attr(d.name, "class")})
            except HwtuneError:
                continue  # not a function hwtune can identify: not one it tunes
        return out

    def _config(self, bdf: str) -> bytes:
        path = self.base / bdf / "config"
        try:
            fd = os.open(str(path), os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise ConfigSpaceError(f"pcie {bdf}: cannot read {path}: not a regular file")
                return os.pread(fd, 4096, 0)
            finally:
                os.close(fd)
        except OSError as exc:
            raise ConfigSpaceError(f"pcie {bdf}: cannot read {path}: {exc.strerror}") from None

    def _cap(self, bdf: str) -> int:
        return find_pcie_capability(self._config(bdf), f"pcie {bdf}")

    def read_devctl(self, bdf: str) -> int:
        config = self._config(bdf)
        cap = find_pcie_capability(config, f"pcie {bdf}")
        return int.from_bytes(config[cap + DEVCTL_OFFSET:cap + DEVCTL_OFFSET + 2], "little")

    def link(self, bdf: str):
        try:
            config = self._config(bdf)
            cap = find_pcie_capability(config, f"pcie {bdf}")
        except ConfigSpaceError:
            return None
        if cap + LNKSTA_OFFSET + 2 > len(config):
            return None
        lnksta = int.from_bytes(config[cap + LNKSTA_OFFSET:cap + LNKSTA_OFFSET + 2], "little")
        return f"gen{lnksta & 0xF} x{(lnksta >> 4) & 0x3F}"

    def update_devctl(self, bdf: str, mask: int, bits: int) -> None:
        target = f"pcie:{bdf}"
        if not isinstance(bdf, str) or not BDF_NAME.fullmatch(bdf):
            raise HwtuneError(f"pcie {str(bdf)[:80]!r}: not a PCI address; refusing to write")
        self.guard_write(f"{target} set_devctl")
        offset = self._cap(bdf) + DEVCTL_OFFSET
        path = self.base / bdf / "config"
        try:
            fd = os.open(str(path), os.O_RDWR)
        except PermissionError:
            raise KnobUnavailable(target, "devctl", "NoPermission (config space is writable by root only)") from None
        try:
            _check_inside(self.root_real, fd, path)
            old = int.from_bytes(os.pread(fd, 2, offset), "little")
            new = (old & ~mask & 0xFFFF) | (bits & mask)
            if os.pwrite(fd, new.to_bytes(2, "little"), offset) != 2:
                raise HwtuneError(f"{target}: short write of DevCtl at 0x{offset:x}")
        except OSError as exc:
            if exc.errno in (errno.EPERM, errno.EACCES):
                raise KnobUnavailable(target, "devctl", "NoPermission") from None
            raise HwtuneError(f"{target}: DevCtl write at 0x{offset:x} failed: {exc.strerror}") from exc
        finally:
            os.close(fd)


def read_attr(path: Path, limit: int = 1 << 16) -> str:
    """A sysfs attribute's text. Never blocks (a FIFO planted in a fixture tree), never a raw
    OSError: an unreadable file is one HwtuneError naming it."""
    try:
        fd = os.open(str(path), os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise HwtuneError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise HwtuneError(f"cannot read {path}: not a regular file")
        data = os.read(fd, limit)
    except OSError as exc:
        raise HwtuneError(f"cannot read {path}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    try:
        return data.decode("ascii")
    except UnicodeDecodeError:
        raise HwtuneError(f"cannot read {path}: not text") from None


def _natural(name: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


class SysfsCpu:
    def __init__(self, root: Path, guard_write: Callable[[str], None]):
        self.base = Path(root) / "sys/devices/system/cpu"
        self.root_real = os.path.realpath(root)
        self.guard_write = guard_write

    def _cpu_dirs(self) -> list:
        if not self.base.is_dir():
            return []
        return sorted((d for d in self.base.iterdir() if re.fullmatch(r"cpu\d+", d.name)),
                      key=lambda d: int(d.name[3:]))

    def governors(self) -> dict:
        out = {}
        for d in self._cpu_dirs():
            f = d / "cpufreq/scaling_governor"
            if f.exists():
                out[d.name] = read_attr(f).strip()
        return out

    def available_governors(self):
        sets = []
        for d in self._cpu_dirs():
            f = d / "cpufreq/scaling_available_governors"
            if f.exists():
                sets.append(read_attr(f).split())
        if not sets:
            return None
        common = set(sets[0]).intersection(*sets[1:])
        return [g for g in sets[0] if g in common]

    def _write_all(self, files: list, target: str, op: str) -> None:
        """Write (path, text) pairs, skipping files that already hold the text. NoPermission
        before any write means the knob is unavailable (skipped, nothing changed); after one,
        the CPUs are half-written, which is a failure: the engine then restores them."""
        wrote = False
        for path, text in files:
            try:
                if path.read_text().strip() == text:
                    continue
                write_attr(self.root_real, path, text)
                wrote = True
            except PermissionError:
                if wrote:
                    raise HwtuneError(f"{target} {op}: writing {path}: permission denied after "
                                      "other CPUs were written") from None
                raise KnobUnavailable(target, op, f"NoPermission ({path})") from None
            except OSError as exc:
                raise HwtuneError(f"{target} {op}: writing {path} failed: {exc.strerror}") from exc

    def set_governors(self, mapping: dict) -> None:
        for cpu in mapping:
            if not isinstance(cpu, str) or not CPU_NAME.fullmatch(cpu):
                raise HwtuneError(f"cpu governor: {str(cpu)[:80]!r} is not a CPU name; refusing to write")
        self.guard_write("cpu set_governor")
        self._write_all([(self.base / cpu / "cpufreq/scaling_governor", gov) for cpu, gov in mapping.items()],
                        "cpu", "governor")

    def cstates(self) -> list:
        out = []
        for d in self._cpu_dirs():
            idle = d / "cpuidle"
            if not idle.is_dir():
                continue
            for s in sorted((s for s in idle.iterdir() if STATE_NAME.fullmatch(s.name)), key=lambda s: _natural(s.name)):
                name = read_attr(s / "name").strip() if (s / "name").exists() else s.name
                latency = read_attr(s / "latency").strip()
                if not latency.isdigit() or len(latency) > 12:  # int() refuses 4300+ digits
                    raise HwtuneError(f"cannot read {s / 'latency'}: {latency[:20]!r} is not a latency")
                out.append({"cpu": d.name, "state": s.name, "name": name, "latency_us": int(latency),
                            "disabled": read_attr(s / "disable").strip() == "1"})
        return out

    def set_cstates_disabled(self, mapping: dict) -> None:
        self.guard_write("cpu set_cstate_disable")
        files = []
        for key, disabled in mapping.items():
            cpu, _, state = str(key).partition("/")
            if not CPU_NAME.fullmatch(cpu) or not STATE_NAME.fullmatch(state):
                raise HwtuneError(f"cpu idle state {str(key)[:80]!r}: not cpuN/stateK; refusing to write")
            files.append((self.base / cpu / "cpuidle" / state / "disable", "1" if disabled else "0"))
        self._write_all(files, "cpu", "max_cstate_latency_us")
