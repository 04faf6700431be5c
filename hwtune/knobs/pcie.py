"""PCIe Device Control: relaxed ordering (bit 4) and max read request size (bits 14:12).

pcie.select: "nvidia" (NVIDIA display-class functions, i.e. the GPUs, not NVSwitch bridges),
"mellanox" (Mellanox/NVIDIA-networking network-class functions), "class:0x0207" (class-code
prefix), or a list of BDFs.
"""
from __future__ import annotations

import re

from hwtune.knobs import BadValue, Knob

RO_BIT = 1 << 4
MRRS_SHIFT = 12
MRRS_MASK = 0x7 << MRRS_SHIFT
VENDOR_NVIDIA = "0x10de"
VENDOR_MELLANOX = "0x15b3"
BDF = re.compile(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]")
MRRS_BYTES = (128, 256, 512, 1024, 2048, 4096)
# What the 3-bit field decodes to, reserved encodings 6 and 7 (8192, 16384) included: a
# journaled original is what the device had, and rollback must be able to put it back.
MRRS_FIELD_BYTES = tuple(128 << n for n in range(8))


def decode_devctl(devctl: int) -> dict:
    return {"relaxed_ordering": bool(devctl & RO_BIT),
            "max_read_request_bytes": 128 << ((devctl & MRRS_MASK) >> MRRS_SHIFT)}


def selected(functions: list, select) -> list:
    if select == "nvidia":
        return [f for f in functions if f["vendor"] == VENDOR_NVIDIA and f["class"].startswith("0x03")]
    if select == "mellanox":
        return [f for f in functions if f["vendor"] == VENDOR_MELLANOX and f["class"].startswith("0x02")]
    if isinstance(select, str) and select.startswith("class:"):
        prefix = select[len("class:"):].lower()
        return [f for f in functions if f["class"].startswith(prefix)]
    by_bdf = {f["bdf"]: f for f in functions}
    out = []
    for bdf in select:
        full = bdf.lower() if bdf.count(":") == 2 else "0000:" + bdf.lower()
        if full not in by_bdf:
            raise BadValue("pcie.select", f"{bdf}: no such PCI function")
        out.append(by_bdf[full])
    return out


class PcieKnob(Knob):
    family = "pcie"
    section = "pcie"
    fields = ("relaxed_ordering", "max_read_request_bytes")

    def targets(self, host, section):
        functions = host.pcie.functions()
        select = section.select if section is not None else None
        if select is None:  # status: the functions hwtune can tune
            chosen = selected(functions, "nvidia") + selected(functions, "mellanox")
        else:
            chosen = selected(functions, select)
        return [f"pcie:{f['bdf']}" for f in chosen]

    def read(self, host, target):
        return decode_devctl(host.pcie.read_devctl(target[len("pcie:"):]))

    def desired(self, host, target, section):
        out = {}
        if section.relaxed_ordering is not None:
            out["relaxed_ordering"] = bool(section.relaxed_ordering)
        if section.max_read_request_bytes is not None:
            out["max_read_request_bytes"] = int(section.max_read_request_bytes)
        return out

    def write(self, host, target, field, value):
        bdf = target[len("pcie:"):]
        if field == "relaxed_ordering":
            host.pcie.update_devctl(bdf, RO_BIT, RO_BIT if value else 0)
        else:
            n = int(value).bit_length() - 8  # 128 << n
            host.pcie.update_devctl(bdf, MRRS_MASK, n << MRRS_SHIFT)

    def known_target(self, host, target):
        bdf = target[len("pcie:"):] if target.startswith("pcie:") else None
        return bdf is not None and BDF.fullmatch(bdf) is not None and any(
            f["bdf"] == bdf for f in host.pcie.functions())

    def original_problem(self, host, target, field, original):
        if field == "relaxed_ordering":
            return None if isinstance(original, bool) else f"original {original!r:.60} is not true or false"
        if isinstance(original, bool) or original not in MRRS_FIELD_BYTES:
            return f"original {original!r:.60} is not a max read request field value (128..16384)"
        return None
