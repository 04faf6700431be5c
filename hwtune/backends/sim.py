"""A simulated host kept in one JSON file, so several processes see the same "hardware".

Reads take no lock: every write replaces the file atomically (temp + fsync + rename), so a
reader sees either the old or the new state. Writers serialise on a sidecar flock
(`FILE.lock`) around read-modify-write. Each write first sleeps `write_delay_ms` (so a test
can kill a process mid-apply) and checks `faults`, e.g.
`{"op": "set_power_limit", "gpu": 1, "error": "NoPermission"}`.

Unlike real NVML the sim knows its locked clocks and reports them; the clock knob still
restores them by reset, as it must on real hardware.
"""
from __future__ import annotations

import fcntl
import json
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

from hwtune.backends import UNAVAILABLE_REASONS, DeviceError, write_json_atomic
from hwtune.errors import HwtuneError, KnobUnavailable, UsageError

# H200 SXM limits as NVML reports them.
H200_SM_CLOCKS_MHZ = list(range(1980, 344, -15))  # 110 clocks, 1980 .. 345
H200_MEMORY_CLOCKS_MHZ = [3201, 2201]
H200_POWER_LIMIT_CONSTRAINTS_W = [200, 700]
H200_POWER_LIMIT_DEFAULT_W = 700
# PCIe buses of the GPUs on a typical 8-GPU HGX board.
GPU_BUSES = [0x18, 0x2A, 0x3A, 0x5D, 0x9A, 0xAB, 0xBA, 0xDB]
# DevCtl as firmware commonly leaves it: MRRS 512 (bits 14:12 = 2), no-snoop on (bit 11),
# extended tags on (bit 8), MPS 256 (bits 7:5 = 1), relaxed ordering off (bit 4).
DEFAULT_DEVCTL = (2 << 12) | (1 << 11) | (1 << 8) | (1 << 5)
CSTATES = [("POLL", 0), ("C1", 2), ("C1E", 10), ("C6", 133)]


DEFAULT_GPUS = 2  # `hwtune sim init` and `hwtune demo` agree on it
DEFAULT_CPUS = 8
# Keys whose value may be null besides their type: a lock that is not set, a reading not reported.
NULLABLE = {"locked_sm_clocks_mhz", "locked_memory_clocks_mhz", "temperature_c", "power_w", "sm_clock_mhz",
            "memory_clock_mhz", "clock_event_reasons", "energy_mj", "xid_errors"}


def new_host(gpus: int = DEFAULT_GPUS, cpus: int = DEFAULT_CPUS) -> dict:
    """An H200-like node: GPUs with their PCIe functions, one Mellanox NIC, CPUs, BIOS."""
    if gpus < 1:
        raise UsageError(f"--gpus {gpus}: need at least 1")
    host: dict = {"version": 1, "write_delay_ms": 0, "faults": [], "gpus": [], "pcie": []}
    for i in range(gpus):
        bus = GPU_BUSES[i] if i < len(GPU_BUSES) else 0x100 + i
        bdf = f"0000:{bus:02x}:00.0"
        host["gpus"].append({
            "index": i,
            "uuid": "GPU-" + str(uuid.uuid5(uuid.NAMESPACE_DNS, f"hwtune-sim-gpu{i}")),
            "name": "NVIDIA H200",
            "pci_bus_id": "0000" + bdf.upper(),
            "persistence_mode": False,
            "power_limit_w": H200_POWER_LIMIT_DEFAULT_W,
            "power_limit_constraints_w": list(H200_POWER_LIMIT_CONSTRAINTS_W),
            "power_limit_default_w": H200_POWER_LIMIT_DEFAULT_W,
            "supported_sm_clocks_mhz": list(H200_SM_CLOCKS_MHZ),
            "supported_memory_clocks_mhz": list(H200_MEMORY_CLOCKS_MHZ),
            "locked_sm_clocks_mhz": None,
            "locked_memory_clocks_mhz": None,
            "telemetry": {"temperature_c": 34, "power_w": 78.0, "sm_clock_mhz": 345,
                          "memory_clock_mhz": 3201, "clock_event_reasons": 0,
                          "energy_mj": 0, "xid_errors": 0},
        })
        host["pcie"].append({"bdf": bdf, "vendor": "0x10de", "device": "0x2335",
                             "class": "0x030200", "link": "gen5 x16", "devctl": DEFAULT_DEVCTL})
    host["pcie"].append({"bdf": "0000:1a:00.0", "vendor": "0x15b3", "device": "0x1021",
                         "class": "0x020700", "link": "gen5 x16", "devctl": DEFAULT_DEVCTL})
    host["cpu"] = {
        "available_governors": ["performance", "powersave"],
        "cpus": [{"governor": "powersave",
                  "cstates": [{"name": n, "latency_us": lat, "disable": False} for n, lat in CSTATES]}
                 for _ in range(cpus)],
    }
    host["bios"] = {"PowerProfile": "SysDbpm", "ProcTurboMode": "Enabled",
                    "LogicalProc": "Enabled", "SriovGlobalEnable": "Enabled"}
    return host


def _kind(value) -> str:
    if isinstance(value, bool):
        return "true/false"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "text"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a section"
    return "null"


def _short(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _check_value(dotted: str, key: str, old, new) -> None:
    """The new value has the old one's type (a number stays a number: `temperature_c=hot` is
    refused); a list of numbers stays one; null only where the sim reads null."""
    if new is None and (old is None or key in NULLABLE):
        return
    if old is None:
        if key in ("locked_sm_clocks_mhz", "locked_memory_clocks_mhz") and not (
                isinstance(new, list) and len(new) == 2 and all(_kind(v) == "a number" for v in new)):
            raise UsageError(f"{dotted}={json.dumps(new)}: expected [min_mhz, max_mhz] or null")
        return
    if _kind(new) != _kind(old):
        raise UsageError(f"{dotted}={json.dumps(new)}: expected {_kind(old)}{' or null' if key in NULLABLE else ''}"
                         f" (now {_short(old)})")
    if isinstance(old, list) and old and all(_kind(v) == "a number" for v in old):
        if not all(_kind(v) == "a number" for v in new):
            raise UsageError(f"{dotted}={json.dumps(new)}: expected a list of numbers")


def set_dotted(data, dotted: str, value, raw: str | None = None) -> None:
    """`gpus.0.telemetry.temperature_c` -> data["gpus"][0]["telemetry"]["temperature_c"] = value.

    Only keys the file already has, each with a value of its type: a typo must not add a key
    nothing reads. BIOS attribute names are the BMC's own, so `bios.NAME` may be new (text).
    `raw`: the text as typed, used where the key holds text (`bios.X=1` is the text "1")."""
    import difflib

    parts = dotted.split(".")
    node = data
    for n, part in enumerate(parts):
        last = n == len(parts) - 1
        if isinstance(node, list):
            try:
                idx = int(part)
                node[idx]
            except (ValueError, IndexError):
                raise UsageError(f"{dotted}: {'.'.join(parts[:n])} has no element {part!r}"
                                 f" (0..{len(node) - 1})") from None
            if last:
                _check_value(dotted, parts[n - 1] if n else part, node[idx], value)
                node[idx] = value
            else:
                node = node[idx]
        elif isinstance(node, dict):
            if last and raw is not None and (isinstance(node.get(part), str)
                                              or (parts[:n] == ["bios"] and part not in node)):
                value = raw
            if part not in node and not (last and parts[:n] == ["bios"] and isinstance(value, str)):
                near = difflib.get_close_matches(part, [str(k) for k in node], n=1)
                where = ".".join(parts[:n]) or "the top level"
                raise UsageError(f"{dotted}: no key {part!r} in {where}"
                                 + (f"; did you mean {'.'.join(parts[:n] + near)}?" if near else
                                    f" (keys: {', '.join(map(str, node))})"))
            if last:
                _check_value(dotted, part, node.get(part), value)
                node[part] = value
            else:
                node = node[part]
        else:
            raise UsageError(f"{dotted}: {'.'.join(parts[:n])} is a value, not a section")


class SimFile:
    """The JSON file and its write discipline."""

    def __init__(self, path: Path, guard_write: Callable[[str], None] | None = None):
        self.path = Path(path)
        self.guard_write = guard_write or (lambda op: None)
        if not self.path.exists():
            raise UsageError(f"simulated host {self.path}: no such file (create it: hwtune sim init {self.path})")

    def read(self) -> dict:
        try:
            return json.loads(self.path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise HwtuneError(f"simulated host {self.path}: unreadable: {exc}") from exc

    @contextmanager
    def _locked(self):
        with open(str(self.path) + ".lock", "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def update(self, change: Callable[[dict], None]) -> None:
        """Read-modify-write under the sidecar lock, committed by an atomic rename."""
        with self._locked():
            data = self.read()
            change(data)
            write_json_atomic(self.path, data)

    def device_write(self, op: str, target: str, match: dict, change: Callable[[dict], None]) -> None:
        """A hardware write: refused when read-only, may be faulted, sleeps, then commits."""
        self.guard_write(f"{target} {op}")
        data = self.read()
        for fault in data.get("faults") or []:
            if fault.get("op") != op:
                continue
            if any(k in fault and fault[k] != v for k, v in match.items()):
                continue
            reason = str(fault.get("error", "Unknown"))
            if reason in UNAVAILABLE_REASONS:
                raise KnobUnavailable(target, op, reason)
            raise DeviceError(target, op, reason)
        delay_ms = float(data.get("write_delay_ms") or 0)
        if delay_ms > 0:
            time.sleep(delay_ms / 1000.0)
        self.update(change)


class SimGpus:
    def __init__(self, file: SimFile):
        self.file = file

    def _gpu(self, i: int) -> dict:
        gpus = self.file.read()["gpus"]
        if not 0 <= i < len(gpus):
            raise HwtuneError(f"gpu{i}: no such GPU (simulated host has {len(gpus)})")
        return gpus[i]

    def _write(self, op: str, i: int, field: str, value) -> None:
        def change(data):
            data["gpus"][i][field] = value
        self._gpu(i)
        self.file.device_write(op, f"gpu{i}", {"gpu": i}, change)

    def count(self) -> int:
        return len(self.file.read()["gpus"])

    def info(self, i: int) -> dict:
        g = self._gpu(i)
        return {"index": i, "uuid": g["uuid"], "name": g["name"], "pci_bus_id": g["pci_bus_id"]}

    def get_persistence_mode(self, i: int) -> bool:
        return bool(self._gpu(i)["persistence_mode"])

    def set_persistence_mode(self, i: int, on: bool) -> None:
        self._write("set_persistence_mode", i, "persistence_mode", bool(on))

    def get_power_limit_w(self, i: int) -> float:
        return self._gpu(i)["power_limit_w"]

    def get_power_limit_constraints_w(self, i: int) -> tuple:
        lo, hi = self._gpu(i)["power_limit_constraints_w"]
        return (lo, hi)

    def get_power_limit_default_w(self, i: int) -> float:
        return self._gpu(i)["power_limit_default_w"]

    def set_power_limit_w(self, i: int, w: float) -> None:
        lo, hi = self.get_power_limit_constraints_w(i)
        if not lo <= w <= hi:  # NVML answers InvalidArgument
            raise DeviceError(f"gpu{i}", "set_power_limit", f"InvalidArgument ({w} W outside {lo}..{hi})")
        self._write("set_power_limit", i, "power_limit_w", w)

    def get_supported_sm_clocks_mhz(self, i: int) -> list:
        return sorted(self._gpu(i)["supported_sm_clocks_mhz"])

    def get_supported_memory_clocks_mhz(self, i: int) -> list:
        return sorted(self._gpu(i)["supported_memory_clocks_mhz"])

    def get_locked_sm_clocks_mhz(self, i: int):
        v = self._gpu(i)["locked_sm_clocks_mhz"]
        return tuple(v) if v else None

    def get_locked_memory_clocks_mhz(self, i: int):
        v = self._gpu(i)["locked_memory_clocks_mhz"]
        return tuple(v) if v else None

    def set_locked_sm_clocks_mhz(self, i: int, lo: int, hi: int) -> None:
        self._write("set_locked_sm_clocks", i, "locked_sm_clocks_mhz", [int(lo), int(hi)])

    def reset_locked_sm_clocks(self, i: int) -> None:
        self._write("reset_locked_sm_clocks", i, "locked_sm_clocks_mhz", None)

    def set_locked_memory_clocks_mhz(self, i: int, lo: int, hi: int) -> None:
        self._write("set_locked_memory_clocks", i, "locked_memory_clocks_mhz", [int(lo), int(hi)])

    def reset_locked_memory_clocks(self, i: int) -> None:
        self._write("reset_locked_memory_clocks", i, "locked_memory_clocks_mhz", None)

    def telemetry(self, i: int) -> dict:
        g = self._gpu(i)
        t = dict(g.get("telemetry") or {})
        # What the card would report given its settings: clocks inside the locked range,
        # power under the limit.
        locked = g.get("locked_sm_clocks_mhz")
        if locked and t.get("sm_clock_mhz") is not None:
            t["sm_clock_mhz"] = min(max(t["sm_clock_mhz"], locked[0]), locked[1])
        if t.get("power_w") is not None:
            t["power_w"] = min(t["power_w"], g["power_limit_w"])
        keys = ("temperature_c", "power_w", "sm_clock_mhz", "memory_clock_mhz",
                "clock_event_reasons", "energy_mj", "xid_errors")
        return {k: t.get(k) for k in keys}


class SimPcie:
    def __init__(self, file: SimFile):
        self.file = file

    def _fn(self, bdf: str, data: dict | None = None) -> dict:
        for fn in (data or self.file.read())["pcie"]:
            if fn["bdf"] == bdf:
                return fn
        raise HwtuneError(f"pcie {bdf}: no such function on the simulated host")

    def functions(self) -> list:
        return [{"bdf": f["bdf"], "vendor": f["vendor"], "device": f["device"], "class": f["class"]}
                for f in self.file.read()["pcie"]]

    def read_devctl(self, bdf: str) -> int:
        return int(self._fn(bdf)["devctl"])

    def link(self, bdf: str):
        return self._fn(bdf).get("link")

    def update_devctl(self, bdf: str, mask: int, bits: int) -> None:
        self._fn(bdf)

        def change(data):
            fn = self._fn(bdf, data)
            fn["devctl"] = (int(fn["devctl"]) & ~mask & 0xFFFF) | (bits & mask)
        self.file.device_write("set_devctl", f"pcie:{bdf}", {"bdf": bdf}, change)


class SimCpu:
    def __init__(self, file: SimFile):
        self.file = file

    def _cpus(self, data=None) -> list:
        return (data or self.file.read())["cpu"]["cpus"]

    def governors(self) -> dict:
        return {f"cpu{n}": c.get("governor") for n, c in enumerate(self._cpus())}

    def available_governors(self):
        return list(self.file.read()["cpu"].get("available_governors") or [])

    def set_governors(self, mapping: dict) -> None:
        def change(data):
            cpus = self._cpus(data)
            for name, gov in mapping.items():
                cpus[int(name[3:])]["governor"] = gov
        self.file.device_write("set_governor", "cpu", {}, change)

    def cstates(self) -> list:
        out = []
        for n, c in enumerate(self._cpus()):
            for s, st in enumerate(c.get("cstates") or []):
                out.append({"cpu": f"cpu{n}", "state": f"state{s}", "name": st["name"],
                            "latency_us": st["latency_us"], "disabled": bool(st["disable"])})
        return out

    def set_cstates_disabled(self, mapping: dict) -> None:
        """mapping: {"cpu0/state3": True, ...}"""
        def change(data):
            cpus = self._cpus(data)
            for key, disabled in mapping.items():
                cpu, state = key.split("/")
                cpus[int(cpu[3:])]["cstates"][int(state[5:])]["disable"] = bool(disabled)
        self.file.device_write("set_cstate_disable", "cpu", {}, change)


class SimBios:
    source = "sim"

    def __init__(self, file: SimFile):
        self.file = file

    def attributes(self) -> dict:
        return dict(self.file.read().get("bios") or {})
