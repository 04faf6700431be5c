"""BIOS: checked, never written. `check(expect, attributes)` compares a profile's
`bios.expect` with the attributes a BIOS backend read, and returns one Change per mismatch
(old = what the host reports, new = what the profile expects), as plan/verify show drift.
Attribute names are case-sensitive, as in Redfish; a near miss gets a "did you mean".
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any, Mapping

from hwtune.engine import Change

# YAML 1.1 reads `On`, `Yes`, `Off`, `No` as booleans, so `ProcTurboMode: On` in a profile
# arrives as True; a BIOS that reports the string "On" matches it.
_TRUE_WORDS = {"true", "yes", "on"}
_FALSE_WORDS = {"false", "no", "off"}


@dataclass
class BiosChange(Change):
    """The engine's Change (target, knob, old, new, family="bios") plus `note`: why a
    mismatch is reported the way it is (attribute missing, letter case)."""

    note: str = ""

    def to_json(self) -> dict:
        out = super().to_json()
        if self.note:
            out["note"] = self.note
        return out

    def __str__(self) -> str:
        text = super().__str__()
        return f"{text} ({self.note})" if self.note else text


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def same(expected: Any, actual: Any) -> bool:
    """Whether a reported BIOS value satisfies the expected one. Vendor tools report text
    ("0"), Redfish reports typed JSON (0): compare their text, but keep True apart from 1."""
    if isinstance(expected, bool) and isinstance(actual, str):
        return actual.strip().lower() in (_TRUE_WORDS if expected else _FALSE_WORDS)
    if isinstance(expected, bool) != isinstance(actual, bool) and not isinstance(actual, str):
        return False
    return _text(expected) == _text(actual).strip()


def _suggestion(name: str, reported: Mapping[str, Any]) -> str:
    by_case = [k for k in reported if k.lower() == name.lower()]
    if by_case:
        return by_case[0]
    close = difflib.get_close_matches(name, list(reported), n=1, cutoff=0.75)
    return close[0] if close else ""


def check(expect: Mapping[str, Any], attributes: Mapping[str, Any], target: str = "bios") -> list[BiosChange]:
    """Mismatches between `expect` and the reported `attributes`, in `expect` order; an empty
    list when the BIOS is as the profile expects."""
    changes: list[BiosChange] = []
    for name, wanted in expect.items():
        if name not in attributes:
            hint = _suggestion(name, attributes)
            note = "not reported by the BMC"
            if hint:
                note += f"; did you mean {hint!r}?"
            changes.append(BiosChange(target, name, None, wanted, "bios", note))
            continue
        actual = attributes[name]
        if same(wanted, actual):
            continue
        note = ""
        if _text(wanted).lower() == _text(actual).strip().lower():
            note = "differs only in letter case; BIOS values are case-sensitive"
        changes.append(BiosChange(target, name, actual, wanted, "bios", note))
    return changes


def read_and_check(bios, expect: Mapping[str, Any]) -> list[BiosChange]:
    """Read a BIOS backend (`.attributes()`) and check it; BiosError propagates with context."""
    return check(expect, bios.attributes(), target="bios")
