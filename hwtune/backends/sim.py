"""A simulated host kept in one JSON file, so several processes see the same "hardware".

Reads take no lock: every write replaces the file atomically (temp + fsync + rename), so a
reader sees either the old or the new state. Writers serialise on a sidecar flock
(`FILE.lock`) around read-modify-write. Each write first sleeps `write_delay_ms` (so a test
can kill a process mid-apply) and checks `faults`, e.g.
`{"op": "set_power_limit", "gpu": 1, "error": "NoPermission"}`; the error "Ignored" makes the
setter answer success and change nothing (a device that silently drops a write).

Unlike real NVML the sim knows its locked clocks and reports them; the clock knob still
restores them by reset, as it must on real hardware. `"locked_clocks_getter": false` makes it
answer as NVML does ("unknown": no getter), so the knob must rely on its own record.

The file is checked on every read (`check_host`): a malformed file is bad input (UsageError,
exit 2) naming the key, never a KeyError half way through an apply.
"""
from __future__ import annotations

import errno
import fcntl
import json
import math
import os
import re
import stat
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

from hwtune import yamlguard
from hwtune.backends import UNAVAILABLE_REASONS, DeviceError, write_json_atomic
from hwtune.errors import HwtuneError, KnobUnavailable, UsageError

# H200 SXM limits as NVML reports them.
H200_SM_CLOCKS_MHZ = list(range(1980, 344, -15))  # 110 clocks, 1980 .. 345
H200_MEMORY_CLOCKS_MHZ = [3201, 2201]
H200_POWER_LIMIT_CONSTRAINTS_W = [200, 700]
H200_POWER_LIMIT_DEFAULT_W = 700
# PCIe buses of the GPUs on a typical 8-GPU HGX board.
GPU_BUSES = [0x18, 0x2A, 0x3A, 0x5D, 0x9A, 0xAB, 0xBA, 0xDB]
# GPUs past the eighth: buses no other function uses (a bus number is one byte: 0x100 + i was
# not a PCI address, and the file `sim init --gpus 9` wrote was refused by every command).
SPARE_BUSES = [b for b in range(0x40, 0x100) if b not in GPU_BUSES]
# DevCtl as firmware commonly leaves it: MRRS 512 (bits 14:12 = 2), no-snoop on (bit 11),
# extended tags on (bit 8), MPS 256 (bits 7:5 = 1), relaxed ordering off (bit 4).
DEFAULT_DEVCTL = (2 << 12) | (1 << 11) | (1 << 8) | (1 << 5)
CSTATES = [("POLL", 0), ("C1", 2), ("C1E", 10), ("C6", 133)]


DEFAULT_GPUS = 2  # `hwtune sim init` and `hwtune demo` agree on it
DEFAULT_CPUS = 8
# One node: more than any host has, and a file every command can still read (MAX_SIM_BYTES).
MAX_GPUS = 64
MAX_CPUS = 4096
# Keys whose value may be null besides their type: a lock that is not set, a reading not reported.
NULLABLE = {"locked_sm_clocks_mhz", "locked_memory_clocks_mhz", "temperature_c", "power_w", "sm_clock_mhz",
            "memory_clock_mhz", "clock_event_reasons", "energy_mj", "xid_errors"}


def new_host(gpus: int = DEFAULT_GPUS, cpus: int = DEFAULT_CPUS) -> dict:
    """An H200-like node: GPUs with their PCIe functions, one Mellanox NIC, CPUs, BIOS."""
    if gpus < 1:
        raise UsageError(f"--gpus {gpus}: need at least 1")
    if gpus > MAX_GPUS:
        raise UsageError(f"--gpus {gpus}: at most {MAX_GPUS} (a simulated host is one node)")
    if not 1 <= cpus <= MAX_CPUS:
        raise UsageError(f"--cpus {cpus}: 1 to {MAX_CPUS}")
    host: dict = {"version": 1, "write_delay_ms": 0, "faults": [], "locked_clocks_getter": True,
                  "gpus": [], "pcie": []}
    for i in range(gpus):
        bus = GPU_BUSES[i] if i < len(GPU_BUSES) else SPARE_BUSES[i - len(GPU_BUSES)]
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
            if last and n == 0 and part not in node and part in OPTIONAL_TOP:
                node[part] = OPTIONAL_TOP[part]   # a file older than the key: it takes its default
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


# Top-level keys a sim file may lack (files written before they existed): their defaults.
OPTIONAL_TOP = {"locked_clocks_getter": True}

_BDF = re.compile(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]")
MAX_SIM_BYTES = 64 << 20


def _num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _clock_pair(v) -> bool:
    return v is None or (isinstance(v, list) and len(v) == 2 and all(_int(x) and x > 0 for x in v))


_GPU_KEYS = {
    "uuid": (lambda v: isinstance(v, str), "text"),
    "name": (lambda v: isinstance(v, str), "text"),
    "pci_bus_id": (lambda v: isinstance(v, str), "text"),
    "persistence_mode": (lambda v: isinstance(v, bool), "true or false"),
    "power_limit_w": (lambda v: _num(v) and v > 0, "a number of watts"),
    "power_limit_constraints_w": (lambda v: isinstance(v, list) and len(v) == 2 and all(_num(x) for x in v)
                                  and 0 < v[0] <= v[1], "[min, max] watts"),
    "power_limit_default_w": (lambda v: _num(v) and v > 0, "a number of watts"),
    "supported_sm_clocks_mhz": (lambda v: isinstance(v, list) and all(_int(x) and x > 0 for x in v),
                                "a list of MHz"),
    "supported_memory_clocks_mhz": (lambda v: isinstance(v, list) and all(_int(x) and x > 0 for x in v),
                                    "a list of MHz"),
    "locked_sm_clocks_mhz": (_clock_pair, "null or [min, max] MHz"),
    "locked_memory_clocks_mhz": (_clock_pair, "null or [min, max] MHz"),
}
_TELEMETRY_KEYS = ("temperature_c", "power_w", "sm_clock_mhz", "memory_clock_mhz", "clock_event_reasons",
                   "energy_mj", "xid_errors")


def check_host(data, where: str) -> None:
    """Raise UsageError naming the first key of a simulated host file that is missing or of
    the wrong kind."""
    def bad(key, what):
        raise UsageError(f"simulated host {where}: {key}: {what}")

    if not isinstance(data, dict):
        bad("(top level)", f"expected an object, got {type(data).__name__}")
    for key in ("gpus", "pcie", "cpu"):
        if key not in data:
            bad(key, "missing (recreate the file: hwtune sim init FILE --force)")
    if not isinstance(data["gpus"], list):
        bad("gpus", "expected a list")
    for i, g in enumerate(data["gpus"]):
        if not isinstance(g, dict):
            bad(f"gpus.{i}", "expected an object")
        for key, (ok, what) in _GPU_KEYS.items():
            if key not in g:
                bad(f"gpus.{i}.{key}", "missing")
            if not ok(g[key]):
                bad(f"gpus.{i}.{key}", f"expected {what}")
        t = g.get("telemetry")
        if t is not None:
            if not isinstance(t, dict):
                bad(f"gpus.{i}.telemetry", "expected an object")
            for key in _TELEMETRY_KEYS:
                if t.get(key) is not None and not _num(t[key]):
                    bad(f"gpus.{i}.telemetry.{key}", "expected a number or null")
    if not isinstance(data["pcie"], list):
        bad("pcie", "expected a list")
    for n, f in enumerate(data["pcie"]):
        if not isinstance(f, dict):
            bad(f"pcie.{n}", "expected an object")
        for key in ("bdf", "vendor", "device", "class"):
            if not isinstance(f.get(key), str):
                bad(f"pcie.{n}.{key}", "missing or not text")
        if not _BDF.fullmatch(f["bdf"]):
            bad(f"pcie.{n}.bdf", "expected a PCI address like 0000:18:00.0")
        if not _int(f.get("devctl")) or not 0 <= f["devctl"] <= 0xFFFF:
            bad(f"pcie.{n}.devctl", "expected a 16-bit register value")
        if f.get("link") is not None and not isinstance(f["link"], str):
            bad(f"pcie.{n}.link", "expected text or null")
    cpu = data["cpu"]
    if not isinstance(cpu, dict):
        bad("cpu", "expected an object")
    govs = cpu.get("available_governors")
    if govs is not None and (not isinstance(govs, list) or not all(isinstance(x, str) for x in govs)):
        bad("cpu.available_governors", "expected a list of names")
    if not isinstance(cpu.get("cpus"), list):
        bad("cpu.cpus", "missing or not a list")
    for n, c in enumerate(cpu["cpus"]):
        if not isinstance(c, dict):
            bad(f"cpu.cpus.{n}", "expected an object")
        if c.get("governor") is not None and not isinstance(c["governor"], str):
            bad(f"cpu.cpus.{n}.governor", "expected a name or null")
        states = c.get("cstates") or []
        if not isinstance(states, list):
            bad(f"cpu.cpus.{n}.cstates", "expected a list")
        for k, st in enumerate(states):
            if not isinstance(st, dict) or not isinstance(st.get("name"), str) or not _int(st.get("latency_us")) \
                    or not isinstance(st.get("disable"), bool):
                bad(f"cpu.cpus.{n}.cstates.{k}", "expected {name, latency_us (integer), disable (true/false)}")
    if data.get("bios") is not None and not isinstance(data["bios"], dict):
        bad("bios", "expected an object or null")
    faults = data.get("faults")
    if faults is not None and (not isinstance(faults, list) or not all(isinstance(x, dict) for x in faults)):
        bad("faults", "expected a list of objects")
    delay = data.get("write_delay_ms")
    if delay is not None and (not _num(delay) or delay < 0):
        bad("write_delay_ms", "expected a number >= 0")
    if "locked_clocks_getter" in data and not isinstance(data["locked_clocks_getter"], bool):
        bad("locked_clocks_getter", "expected true or false")


class SimFile:
    """The JSON file and its write discipline."""

    def __init__(self, path: Path, guard_write: Callable[[str], None] | None = None):
        self.path = Path(path)
        self.guard_write = guard_write or (lambda op: None)
        if not self.path.exists():
            raise UsageError(f"simulated host {self.path}: no such file (create it: hwtune sim init {self.path})")

    def check_writable(self) -> None:
        """UsageError unless this user can write the host: the file, its sidecar lock, and the
        directory the atomic rename writes into (found at the first write, a command had
        already journaled its first change)."""
        lock = self.lock_path
        for path in (self.path.parent, self.path, lock):
            if path.exists() and not os.access(path, os.W_OK):
                raise UsageError(f"simulated host {self.path}: {path} is not writable by this user; "
                                 "use a host file of your own (hwtune sim init FILE)")
        if os.path.lexists(lock):
            os.close(self._open_lock())

    @property
    def lock_path(self) -> Path:
        return Path(str(self.path) + ".lock")

    def _open_lock(self) -> int:
        """FILE.lock's descriptor: never through a link (root would create or open whatever
        it names), only a regular file (a directory or a FIFO is no lock)."""
        lock = self.lock_path
        try:
            fd = os.open(str(lock), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            why = "a symbolic link" if exc.errno == errno.ELOOP else (exc.strerror or str(exc))
            raise UsageError(f"simulated host {self.path}: {lock}: {why}; refusing to use it as its lock") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise UsageError(f"simulated host {self.path}: {lock}: not a regular file; refusing to use it as its lock")
        return fd

    def read_raw(self):
        try:
            raw, _ = yamlguard.read_input(self.path, MAX_SIM_BYTES)
        except yamlguard.Unreadable as exc:
            raise UsageError(f"simulated host {self.path}: {exc.problem}") from None
        try:
            return json.loads(raw.decode("utf-8"),
                              parse_constant=lambda c: (_ for _ in ()).throw(ValueError(f"{c} is not a number")))
        except UnicodeDecodeError:
            raise UsageError(f"simulated host {self.path}: not UTF-8 text") from None
        except RecursionError:
            raise UsageError(f"simulated host {self.path}: nested too deeply") from None
        except ValueError as exc:
            raise UsageError(f"simulated host {self.path}: not valid JSON ({str(exc)[:120]})") from None

    def read(self) -> dict:
        """The host, checked (check_host): a malformed file is a UsageError naming the key."""
        data = self.read_raw()
        check_host(data, str(self.path))
        return data

    @contextmanager
    def _locked(self):
        fd = self._open_lock()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def update(self, change: Callable[[dict], None]) -> None:
        """Read-modify-write under the sidecar lock, committed by an atomic rename."""
        with self._locked():
            data = self.read_raw()
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
            if reason == "Ignored":
                return  # a device that answers success and keeps its value
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

    def _locked_clocks(self, i: int, field: str):
        data = self.file.read()
        if not 0 <= i < len(data["gpus"]):
            raise HwtuneError(f"gpu{i}: no such GPU (simulated host has {len(data['gpus'])})")
        if data.get("locked_clocks_getter") is False:
            return "unknown"  # as NVML: there is no getter for locked clocks
        v = data["gpus"][i][field]
        return tuple(v) if v else None

    def get_locked_sm_clocks_mhz(self, i: int):
        return self._locked_clocks(i, "locked_sm_clocks_mhz")

    def simulated_sm_lock_mhz(self, i: int):
        """What the simulated card runs with, whatever the getter answers (for the model)."""
        v = self._gpu(i)["locked_sm_clocks_mhz"]
        return tuple(v) if v else None

    def get_locked_memory_clocks_mhz(self, i: int):
        return self._locked_clocks(i, "locked_memory_clocks_mhz")

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
