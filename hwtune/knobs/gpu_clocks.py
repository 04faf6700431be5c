"""Locked SM and memory clocks (application clocks are deprecated in CUDA 13: never used).

NVML has no getter for locked clocks, so the original is always journaled as "reset" and
restored by a reset. What hwtune itself set is kept in STATE_DIR/locks.json (keyed by GPU
UUID and boot id: a reboot clears locks), which is how a real host reads back.
"""
from __future__ import annotations

import json
from pathlib import Path

from hwtune.backends import write_json_atomic
from hwtune.knobs import BadValue, Knob, gpu_index, gpu_targets

FIELDS = ("sm_clock_mhz", "memory_clock_mhz")


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _record_path(host) -> Path | None:
    return Path(host.state_dir) / "locks.json" if getattr(host, "state_dir", None) else None


def _load_record(host) -> dict:
    path = _record_path(host)
    if path is None or not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return data.get("gpus", {}) if data.get("boot_id") == _boot_id() else {}


def _save_record(host, uuid: str, field: str, value) -> None:
    path = _record_path(host)
    if path is None:
        return
    gpus = _load_record(host)
    gpus.setdefault(uuid, {})[field] = value
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, {"boot_id": _boot_id(), "gpus": gpus})


class GpuClocksKnob(Knob):
    family = "gpu_clocks"
    section = "gpu"
    fields = FIELDS

    def targets(self, host, section):
        return gpu_targets(host, section)

    def read(self, host, target):
        i = gpu_index(target)
        out = {}
        record = None
        for field, getter in (("sm_clock_mhz", host.gpus.get_locked_sm_clocks_mhz),
                              ("memory_clock_mhz", host.gpus.get_locked_memory_clocks_mhz)):
            v = getter(i)
            if v == "unknown":
                if record is None:
                    record = _load_record(host).get(host.gpus.info(i)["uuid"], {})
                out[field] = record.get(field, "unknown")
            else:
                out[field] = list(v) if v else "reset"
        return out

    def desired(self, host, target, section):
        i = gpu_index(target)
        out = {}
        for field, supported_fn in (("sm_clock_mhz", host.gpus.get_supported_sm_clocks_mhz),
                                    ("memory_clock_mhz", host.gpus.get_supported_memory_clocks_mhz)):
            value = getattr(section, field)
            if value is None:
                continue
            if value == "reset":
                out[field] = "reset"
                continue
            lo, hi = value
            if lo > hi:
                raise BadValue(f"gpu.{field}", f"{target} {field}=[{lo}, {hi}]: min {lo} > max {hi}")
            supported = supported_fn(i)
            for clock in (lo, hi):
                if supported and clock not in supported:
                    near = sorted(supported, key=lambda c: abs(c - clock))[:2]
                    raise BadValue(f"gpu.{field}",
                                   f"{target} {field}={clock} MHz: not a supported clock "
                                   f"({len(supported)} supported, {supported[0]}..{supported[-1]}; "
                                   f"nearest {', '.join(map(str, sorted(near)))})")
            out[field] = [lo, hi]
        return out

    def original(self, host, target, field):
        return "reset"

    def write(self, host, target, field, value):
        i = gpu_index(target)
        if field == "sm_clock_mhz":
            if value == "reset":
                host.gpus.reset_locked_sm_clocks(i)
            else:
                host.gpus.set_locked_sm_clocks_mhz(i, value[0], value[1])
        else:
            if value == "reset":
                host.gpus.reset_locked_memory_clocks(i)
            else:
                host.gpus.set_locked_memory_clocks_mhz(i, value[0], value[1])
        _save_record(host, host.gpus.info(i)["uuid"], field, "reset" if value == "reset" else list(value))

    def same(self, host, target, field, current, wanted):
        if isinstance(current, (list, tuple)) and isinstance(wanted, (list, tuple)):
            return list(current) == list(wanted)
        return current == wanted
