"""Where knobs read and write: NVML, sysfs, the simulated host, the BMC.

Each backend is imported only when used (NVML needs a driver, sushy a BMC).
Shared here: the NVML-style error for failures that are not "unavailable", and the
durable file helpers the simulated host and the journal both use.
"""
from __future__ import annotations

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
    from hwtune.statefile import fsync_dir as _fsync_dir

    _fsync_dir(path)


def write_json_atomic(path: Path, data) -> None:
    """Write temp + fsync + rename + fsync(dir): a reader sees the old or the new file, never
    half. The temporary file comes from mkstemp (never a predictable name a link could sit
    on); the file keeps its mode (0644 when new). Used for files outside STATE_DIR (the
    simulated host); state files go through hwtune.statefile (0600)."""
    from hwtune.statefile import write_json

    path = Path(path)
    try:
        mode = os.stat(path).st_mode & 0o777
    except OSError:
        mode = 0o644
    write_json(path, data, mode)


def write_text_atomic(path: Path, text: str) -> None:
    """write_json_atomic for text that is not JSON (a YAML profile): same mkstemp + rename."""
    from hwtune.statefile import write_bytes

    path = Path(path)
    try:
        mode = os.stat(path).st_mode & 0o777
    except OSError:
        mode = 0o644
    write_bytes(path, text.encode("utf-8"), mode)
