"""Where knobs read and write: NVML, sysfs, the simulated host, the BMC.

Each backend is imported only when used (NVML needs a driver, sushy a BMC).
Shared here: the NVML-style error for failures that are not "unavailable", and the
durable file helpers the simulated host and the journal both use.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from hwtune.errors import HwtuneError

# NVML reasons that mean "this knob cannot be set here" (skip it) rather than "it broke".
UNAVAILABLE_REASONS = ("NoPermission", "NotSupported")


class DeviceError(HwtuneError):
    """A device call failed for a reason other than NoPermission / NotSupported."""

    def __init__(self, target: str, op: str, reason: str):
        self.target, self.op, self.reason = target, op, reason
        super().__init__(f"{target} {op}: {reason}")


def fsync_dir(path: Path) -> None:
    fd = os.open(str(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path: Path, data) -> None:
    """Write temp + fsync + rename + fsync(dir): a reader sees the old or the new file, never half."""
    write_text_atomic(path, json.dumps(data, indent=2) + "\n")


def write_text_atomic(path: Path, text: str) -> None:
    """write_json_atomic for text that is not JSON (a YAML profile)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)
