"""sd_notify for a Type=notify service, without libsystemd.

systemd passes NOTIFY_SOCKET (a filesystem path, or '@name' for the abstract namespace) and,
with WatchdogSec=, WATCHDOG_USEC (and WATCHDOG_PID naming the process it expects pings from).
Without NOTIFY_SOCKET every call is a no-op, so the daemon runs the same outside systemd.
"""
from __future__ import annotations

import os
import socket
import time
from typing import Mapping

from hwtune.errors import HwtuneError


WAIT_S = 2.0  # READY=1, RELOADING=1, STOPPING=1 on a full queue: tried again this long


class NotifyError(HwtuneError):
    """The notify socket is set but a message could not be sent to it."""


def _socket_address(value: str) -> str | bytes:
    # Abstract-namespace sockets are spelled '@name' in the environment and '\0name' on the wire.
    if value.startswith("@"):
        return b"\0" + value[1:].encode()
    return value


def watchdog_interval_s(env: Mapping[str, str] | None = None, pid: int | None = None) -> float | None:
    """Seconds between WATCHDOG=1 pings (half of WATCHDOG_USEC), or None when no watchdog is
    asked of this process: WATCHDOG_USEC unset/invalid/zero, or WATCHDOG_PID naming another
    process (the variable was inherited by a child)."""
    env = os.environ if env is None else env
    raw = env.get("WATCHDOG_USEC", "").strip()
    if not raw:
        return None
    try:
        usec = int(raw)
    except ValueError:
        return None
    if usec <= 0:
        return None
    wanted_pid = env.get("WATCHDOG_PID", "").strip()
    if wanted_pid:
        try:
            if int(wanted_pid) != (os.getpid() if pid is None else pid):
                return None
        except ValueError:
            return None
    # Half the timeout: one late ping must not kill the service.
    return usec / 1_000_000 / 2


class Notifier:
    """Sends state lines to systemd's notify socket; every method is a no-op without one."""

    def __init__(self, address: str | None):
        self.address = address
        self._sock: socket.socket | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "Notifier":
        env = os.environ if env is None else env
        return cls(env.get("NOTIFY_SOCKET") or None)

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def notify(self, wait_s: float = 0, **fields: object) -> bool:
        """Send KEY=value lines (keyword names are upper-cased: ready=1 -> READY=1).
        Returns False when there is no socket or its queue is full (nothing sent). `wait_s`:
        how long a full queue is waited for (READY=1, STOPPING=1: systemd waits for them)."""
        if not self.enabled or not fields:
            return False
        lines = []
        for key, value in fields.items():
            if isinstance(value, bool):
                value = int(value)
            text = str(value)
            if "\n" in text:
                # A newline would start a new assignment on systemd's side.
                text = text.replace("\n", " ")
            lines.append(f"{key.upper()}={text}")
        payload = ("\n".join(lines) + "\n").encode()
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            # Never block the service loop on a reader that is not reading (systemd always
            # reads; a stalled test socket must not stall the watchdog path): drop instead,
            # or for a message systemd waits for, try again for at most wait_s.
            deadline = time.monotonic() + wait_s
            while True:
                try:
                    self._sock.sendto(payload, socket.MSG_DONTWAIT, _socket_address(self.address))
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        return False
                    time.sleep(0.01)
        except OSError as exc:
            raise NotifyError(f"NOTIFY_SOCKET={self.address}: cannot send {lines[0]}...: {exc}") from exc
        return True

    def ready(self, status: str | None = None) -> bool:
        fields: dict[str, object] = {"ready": 1}
        if status is not None:
            fields["status"] = status
        fields["mainpid"] = os.getpid()
        return self.notify(wait_s=WAIT_S, **fields)

    def status(self, text: str) -> bool:
        return self.notify(status=text)

    def watchdog(self) -> bool:
        return self.notify(watchdog=1)

    def reloading(self) -> bool:
        return self.notify(wait_s=WAIT_S, reloading=1)

    def stopping(self, status: str | None = None) -> bool:
        fields: dict[str, object] = {"stopping": 1}
        if status is not None:
            fields["status"] = status
        return self.notify(wait_s=WAIT_S, **fields)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __enter__(self) -> "Notifier":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
