"""Single-writer lock: a non-blocking flock on STATE_DIR/lock that names its holder.

The kernel drops the flock when the holder dies (even by SIGKILL), so a stale pid in the
file never blocks anyone.
"""
from __future__ import annotations

import fcntl
import os
from pathlib import Path

from hwtune.errors import LockBusyError


class WriterLock:
    def __init__(self, state_dir):
        self.path = Path(state_dir) / "lock"
        self._fd = None

    def __enter__(self) -> "WriterLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(str(self.path), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise LockBusyError(f"{self.path} is held by pid {holder} (another hwtune is writing)") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None
