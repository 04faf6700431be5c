"""STATE_DIR/tuning.json: names the live `hwtune tune`, so the daemon pauses its drift
correction and, on a safety event, asks that process (SIGTERM) to restore.

A pid alone is no identity: after a killed tune or a reboot the pid may belong to an
unrelated process. The marker records the process's start time (/proc/PID/stat field 22),
the boot id and its command line, and an expiry the tune renews while it runs. A marker whose
process does not match all three is stale (removed); an expired one is ignored. Only a
marker this user or root wrote, not writable by others, is read (hwtune.statefile).
"""
from __future__ import annotations

import os
import time
from pathlib import Path

from hwtune import statefile

NAME = "tuning.json"
TTL_S = 600.0
RENEW_S = 30.0


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def identity(pid: int) -> dict | None:
    """{start_time, cmdline, boot_id} of a live process, None when there is none."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    try:
        # The command name (field 2) may hold spaces and parentheses: count from the last ')'.
        start_time = int(stat[stat.rindex(b")") + 2:].split()[19])
    except (ValueError, IndexError):
        return None
    args = [a.decode(errors="replace") for a in cmdline.split(b"\0")]
    if args and args[-1] == "":
        args.pop()
    return {"start_time": start_time, "cmdline": args, "boot_id": _boot_id()}


def matches(record: dict, pid: int) -> str | None:
    """Why `pid` is not the process `record` names (None: it is)."""
    now = identity(pid)
    if now is None:
        return "no such process"
    for key in ("start_time", "boot_id", "cmdline"):
        if record.get(key) != now[key]:
            return f"{key.replace('_', ' ')} differs (the pid was reused)"
    return None


class Marker:
    """The marker of this process: written at start, renewed by `renew`, removed at the end."""

    def __init__(self, state_dir, **extra):
        self.path = Path(state_dir) / NAME
        self.extra = extra
        self._renewed = 0.0

    def write(self) -> None:
        me = identity(os.getpid()) or {}
        now = time.time()
        statefile.ensure_dir(self.path.parent)
        statefile.write_json(self.path, {"pid": os.getpid(), **me, "started_at": now,
                                         "expires_at": now + TTL_S, **self.extra})
        self._renewed = time.monotonic()

    def renew(self) -> None:
        if time.monotonic() - self._renewed >= RENEW_S:
            try:
                self.write()
            except statefile.StateError:
                pass  # a full disk: the old expiry stands; the daemon resumes after it

    def remove(self) -> None:
        try:
            self.path.unlink()
        except OSError:
            pass


def live_tuner(state_dir, log=None, on_dead=None) -> int | None:
    """Pid of the live tune the marker names, else None (stale markers are removed). A stale
    marker is first handed to `on_dead(record)`: the tune it names ended without cleaning up
    (kill -9, a crash, a reboot), maybe at one of its trial points; the marker stays while
    `on_dead` returns False (it could not act yet)."""
    path = Path(state_dir) / NAME
    try:
        data = statefile.read_json(path, "tuning marker")
    except statefile.StateError as exc:
        if log:
            log(f"{exc}; ignored")
        return None
    if data is None:
        return None
    pid = data.get("pid") if isinstance(data, dict) else None
    if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 1 or pid == os.getpid():
        why = "names no process"
    else:
        why = matches(data, pid)
    if why is not None:
        if on_dead is not None and isinstance(data, dict) and not on_dead(data):
            return None
        try:
            path.unlink()
        except OSError:
            pass
        if log:
            log(f"stale {path} (pid {pid}: {why}): removed, drift correction continues")
        return None
    expires = data.get("expires_at")
    if not isinstance(expires, (int, float)) or isinstance(expires, bool) or time.time() > expires:
        if log:
            log(f"{path} of pid {pid} expired (not renewed since {data.get('started_at')}): ignored")
        return None
    return pid
