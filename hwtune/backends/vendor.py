"""BIOS attributes from the vendors' in-band tools, for BMCs reached without Redfish:
Dell `racadm` and HPE `ilorest`. Each runs its tool (or parses given text, for tests and for
output captured elsewhere) and returns the same {attribute: value} dict as RedfishBios.
"""
from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
from typing import Sequence

from hwtune import redact
from hwtune.errors import UsageError
from hwtune.backends.redfish import BiosError

TOOL_TIMEOUT_S = 120


def _argv(command: str | Sequence[str] | None, default: str) -> list[str]:
    if command is None:
        return [default]
    try:
        argv = shlex.split(command) if isinstance(command, str) else [str(a) for a in command]
    except ValueError as exc:
        raise UsageError(f"bios.command: cannot split it into arguments ({exc})") from None
    if not argv:
        raise UsageError("bios.command: empty")
    return argv


def _secrets(argv: list[str]) -> list[str]:
    """The password values on a command line (to mask them in the tool's own output too)."""
    masked = redact.argv(argv)
    found = [a for a, m in zip(argv, masked) if m == redact.MASK]
    found += [a.partition("=")[2] for a, m in zip(argv, masked) if m.endswith("=" + redact.MASK)]
    return found


def _run(argv: list[str], what: str) -> str:
    shown = shlex.join(redact.argv(argv))  # never the password after -p
    secrets = _secrets(argv)
    if shutil.which(argv[0]) is None:
        raise BiosError(f"{what}: {redact.text(argv[0])!r} not found on PATH (install the vendor tool, "
                        f"or set bios.command to its full path)")
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=TOOL_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise BiosError(f"{what}: `{shown}` did not finish within {TOOL_TIMEOUT_S} s") from None
    except (OSError, ValueError) as exc:
        raise BiosError(f"{what}: `{shown}`: {redact.text(str(exc), secrets)}") from None
    if proc.returncode != 0:
        tail = redact.text(" ".join((proc.stderr or proc.stdout).split()), secrets)[-300:]
        raise BiosError(f"{what}: `{shown}` exited {proc.returncode}: {tail}")
    return proc.stdout


# racadm answers `get BIOS.<Group>` with a `[Key=BIOS.Setup.1-1#<Group>]` header and
# `Name=Value` lines; read-only attributes start with '#', and a staged change shows as
# `Name=Current (Pending Value=New)`. The current value is what the host runs with.
_PENDING = re.compile(r"\s*\(Pending Value=.*\)\s*$")
_GROUP = re.compile(r"^BIOS\.[A-Za-z0-9]+$")


def parse_racadm(text: str) -> dict[str, str]:
    """Attributes from the output of one or more `racadm get BIOS.<Group>` runs."""
    attrs: dict[str, str] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("[") or "=" not in line:
            continue
        name, _, value = line.lstrip("#").partition("=")
        name = name.strip()
        if not name or " " in name:
            continue  # prose (warnings, "Security Alert: ...") rather than an attribute
        attrs[name] = _PENDING.sub("", value).strip()
    return attrs


def racadm_groups(text: str) -> list[str]:
    """Group names listed by `racadm get BIOS` (one `BIOS.<Group>` per line)."""
    return [line.strip() for line in text.splitlines() if _GROUP.match(line.strip())]


class RacadmBios:
    source = "racadm"

    def __init__(self, command: str | Sequence[str] | None = None, text: str | None = None):
        # `command` is the tool and its connection options, e.g.
        # "racadm -r 10.0.0.5 -u root -p secret"; hwtune appends `get ...`.
        self.argv = _argv(command, "racadm")
        self.text = text

    def attributes(self) -> dict[str, str]:
        if self.text is not None:
            attrs = parse_racadm(self.text)
        else:
            listing = _run(self.argv + ["get", "BIOS"], "racadm")
            attrs = parse_racadm(listing)
            # Depending on the iDRAC, `get BIOS` lists the groups rather than their values.
            for group in racadm_groups(listing):
                attrs.update(parse_racadm(_run(self.argv + ["get", group], "racadm")))
        if not attrs:
            raise BiosError("racadm: no Name=Value attribute lines in the output")
        return attrs


def _not_json(word: str):
    raise ValueError(f"{word} (NaN or Infinity) is not JSON")


def parse_ilorest(text: str) -> dict[str, str | int | bool]:
    """Attributes from `ilorest get --json --select Bios.`: a JSON object (or a list of them)
    holding `Attributes`, or the attributes themselves. ilorest may print progress lines
    ("Discovering data...Done") before the JSON."""
    starts = [i for i in (text.find("{"), text.find("[")) if i >= 0]
    if not starts:
        raise BiosError("ilorest: no JSON in the output")
    try:
        # NaN / Infinity are not JSON: taken as floats, they made --json output that is none
        data = json.loads(text[min(starts):], parse_constant=_not_json)
    except ValueError as exc:
        raise BiosError(f"ilorest: output is not valid JSON: {exc}") from None
    if isinstance(data, list):
        # Current settings come first; a second object is the pending settings resource.
        data = next((d for d in data if isinstance(d, dict)), None)
    if not isinstance(data, dict):
        raise BiosError("ilorest: expected a JSON object with the Bios attributes")
    attrs = data.get("Attributes", data)
    if not isinstance(attrs, dict):
        raise BiosError("ilorest: Attributes is not an object")
    # Redfish bookkeeping (@odata.*) is not a BIOS setting.
    return {k: v for k, v in attrs.items() if not k.startswith("@") and not isinstance(v, (dict, list))}


class IloRestBios:
    source = "ilorest"

    def __init__(self, command: str | Sequence[str] | None = None, text: str | None = None):
        self.argv = _argv(command, "ilorest")
        self.text = text

    def attributes(self) -> dict[str, str | int | bool]:
        text = self.text
        if text is None:
            text = _run(self.argv + ["get", "--json", "--select", "Bios."], "ilorest")
        attrs = parse_ilorest(text)
        if not attrs:
            raise BiosError("ilorest: the Bios resource has no attributes")
        return attrs
