"""Locked SM and memory clocks (application clocks are deprecated in CUDA 13: never used).

NVML has no getter for locked clocks, so the original is always journaled as "reset" and
restored by a reset, re-issued on every rollback (a reset is idempotent; a record can be
stale). What hwtune itself set is kept in STATE_DIR/locks.json (keyed by GPU UUID and boot
id: a reboot clears locks), which is how a real host reads back. The record is made durable
before each write: first as "unknown" (so a crash or a full disk between the write and its
record never reads as "reset"), then as the value once the device took it.
"""
from __future__ import annotations

from pathlib import Path

from hwtune import faults, statefile
from hwtune.knobs import BadValue, Knob, gpu_index, gpu_targets, is_gpu_target

FIELDS = ("sm_clock_mhz", "memory_clock_mhz")


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _record_path(host) -> Path | None:
    return Path(host.state_dir) / "locks.json" if getattr(host, "state_dir", None) else None


def _load_record(host) -> dict:
    """{uuid: {field: value}}; anything unreadable or untrusted reads as no record ("unknown")."""
    path = _record_path(host)
    if path is None:
        return {}
    try:
        data = statefile.read_json(path, "clock record")
    except statefile.StateError:
        return {}
    if not isinstance(data, dict) or data.get("boot_id") != _boot_id() or not isinstance(data.get("gpus"), dict):
        return {}
    return {k: v for k, v in data["gpus"].items() if isinstance(v, dict)}


def _save_record(host, uuid: str, field: str, value) -> None:
    path = _record_path(host)
    if path is None:
        return
    gpus = _load_record(host)
    gpus.setdefault(uuid, {})[field] = value
    statefile.ensure_dir(path.parent)
    statefile.write_json(path, {"boot_id": _boot_id(), "gpus": gpus})


def _drop_record(host) -> None:
    path = _record_path(host)
    try:
        if path is not None:
            path.unlink()
    except OSError:
        pass


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
                value = record.get(field, "unknown")
                ok = value in ("reset", "unknown") or (isinstance(value, list) and len(value) == 2)
                out[field] = value if ok else "unknown"
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
            if not supported:  # nothing to check a lock against: never written unchecked
                from hwtune.errors import KnobUnavailable
                raise KnobUnavailable(target, field, "NotSupported (the GPU reports no supported clocks)")
            for clock in (lo, hi):
                if clock not in supported:
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
        uuid = host.gpus.info(i)["uuid"]
        _save_record(host, uuid, field, "unknown")  # durable before the device changes
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
        faults.hit("clocks.written")
        _save_record(host, uuid, field, "reset" if value == "reset" else list(value))
        faults.hit("clocks.recorded")

    def restore(self, host, target, field, original):
        if original != "reset":
            self.write(host, target, field, original)
            return
        # A reset is issued first, whatever the record: it must happen even when the disk is
        # full. If its record cannot be written, the record goes (reads say "unknown", never a
        # stale lock or a stale reset, and the next rollback re-issues the reset).
        i = gpu_index(target)
        uuid = host.gpus.info(i)["uuid"]
        if field == "sm_clock_mhz":
            host.gpus.reset_locked_sm_clocks(i)
        else:
            host.gpus.reset_locked_memory_clocks(i)
        try:
            _save_record(host, uuid, field, "reset")
        except statefile.StateError:
            _drop_record(host)

    def restored(self, host, target, field, after, original):
        # Without a getter (NVML) the reset's own success is all the device says.
        return self.same(host, target, field, after, original) or (original == "reset" and after == "unknown")

    def must_reissue(self, field, original):
        return original == "reset"

    def known_target(self, host, target):
        return is_gpu_target(host, target)

    def original_problem(self, host, target, field, original):
        return None if original == "reset" else f"original {original!r:.60} is not reset (locked clocks are journaled as reset)"

    def same(self, host, target, field, current, wanted):
        if isinstance(current, (list, tuple)) and isinstance(wanted, (list, tuple)):
            return list(current) == list(wanted)
        return current == wanted
