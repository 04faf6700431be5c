"""Knob families and their registry.

A knob family reads, plans and writes a few fields of one kind of target (a GPU, a PCIe
function, the CPUs). Interface (docs/ARCHITECTURE.md):
`targets(host, section)`, `read(host, target) -> {field: value}`,
`desired(host, target, section) -> {field: value}` (validated against what the device
reports; raises BadValue naming the profile key), `original(host, target, field)` (what the
journal keeps: for locked clocks always "reset"), `write(host, target, field, value)`,
`restore(host, target, field, original)`, `same(host, target, field, current, wanted)`,
`show(host, target, field, value)` (a value, journaled originals included, in the profile's terms),
`split_original(host, target, field, original)` (a per-CPU original split into the part
this host has now and the rest, else None),
`journal_problem(host, target, field, original)` (why a journal entry is not one this knob
wrote on this host: the target outside the knob's own device namespace, an unknown field,
a value of the wrong kind; None when it may be restored) and `must_reissue(field, original)`
(an original restored even when the read says it is in place: a "reset" of locked clocks,
which NVML cannot read back).
"""
from __future__ import annotations

import math
import re

from hwtune.errors import HwtuneError


class BadValue(HwtuneError):
    """A profile value the device cannot take; `key` is the dotted profile key."""

    exit_code = 2

    def __init__(self, key: str, message: str):
        self.key, self.message = key, message
        super().__init__(f"{key}: {message}")


class Knob:
    family = ""
    section = ""
    fields: tuple = ()

    def targets(self, host, section) -> list:
        raise NotImplementedError

    def read(self, host, target: str) -> dict:
        raise NotImplementedError

    def desired(self, host, target: str, section) -> dict:
        raise NotImplementedError

    def original(self, host, target: str, field: str):
        return self.read(host, target)[field]

    def write(self, host, target: str, field: str, value) -> None:
        raise NotImplementedError

    def restore(self, host, target: str, field: str, original) -> None:
        self.write(host, target, field, original)

    def same(self, host, target: str, field: str, current, wanted) -> bool:
        return current == wanted

    def show(self, host, target: str, field: str, value):
        """`value` as people read it (the journal may keep a more exact form)."""
        return value

    def must_reissue(self, field: str, original) -> bool:
        return False

    def restored(self, host, target: str, field: str, after, original) -> bool:
        """Whether the value read back after a restore shows the original in place."""
        return self.same(host, target, field, after, original)

    def split_original(self, host, target: str, field: str, original):
        """(the part of a per-device original this host has now, the rest), or None: lets a
        rollback restore the CPUs that are here and keep the others for later."""
        return None

    def known_target(self, host, target: str) -> bool:
        raise NotImplementedError

    def original_problem(self, host, target: str, field: str, original) -> str | None:
        raise NotImplementedError

    def journal_problem(self, host, target, field, original) -> str | None:
        if not isinstance(target, str) or not self.known_target(host, target):
            return f"target {str(target)[:80]!r} is not a {self.family} device of this host"
        if field not in self.fields:
            return f"field {str(field)[:80]!r} is not a {self.family} field"
        return self.original_problem(host, target, field, original)


GPU_TARGET = re.compile(r"gpu(0|[1-9][0-9]{0,3})")


def is_gpu_target(host, target: str) -> bool:
    m = GPU_TARGET.fullmatch(target)
    return m is not None and int(m.group(1)) < host.gpus.count()


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def gpu_index(target: str) -> int:
    return int(target[3:])


def gpu_targets(host, section) -> list:
    """gpu.select: all | [0, 1] | [GPU-uuid, ...]"""
    n = host.gpus.count()
    select = getattr(section, "select", "all") if section is not None else "all"
    if select == "all":
        return [f"gpu{i}" for i in range(n)]
    out = []
    uuids = None
    for item in select:
        if isinstance(item, int):
            if not 0 <= item < n:
                raise BadValue("gpu.select", f"gpu{item}: no such GPU (this host has {n}: 0..{n - 1})")
            out.append(f"gpu{item}")
        else:
            if uuids is None:
                uuids = {host.gpus.info(i)["uuid"]: i for i in range(n)}
            if item not in uuids:
                raise BadValue("gpu.select", f"{item}: no GPU with this UUID")
            out.append(f"gpu{uuids[item]}")
    return list(dict.fromkeys(out))


from hwtune.knobs.cpu import CpuGovernorKnob, CpuIdleKnob  # noqa: E402
from hwtune.knobs.gpu_clocks import GpuClocksKnob  # noqa: E402
from hwtune.knobs.gpu_power import GpuPowerKnob  # noqa: E402
from hwtune.knobs.pcie import PcieKnob  # noqa: E402
from hwtune.knobs.persistence import PersistenceKnob  # noqa: E402

# family -> class, in apply order within a section. BIOS is checked, never written, so it is
# not here: see hwtune.knobs.bios.check.
KNOBS: dict[str, type] = {
    "persistence": PersistenceKnob,
    "gpu_power": GpuPowerKnob,
    "gpu_clocks": GpuClocksKnob,
    "pcie": PcieKnob,
    "cpu_governor": CpuGovernorKnob,
    "cpu_idle": CpuIdleKnob,
}
