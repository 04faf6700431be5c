"""Single-writer lock: an flock on STATE_DIR/lock that names its holder.

The kernel drops the flock when the holder dies (even by SIGKILL), so a stale pid in the
file never blocks anyone. The lock file is opened without following links and must be ours
(hwtune.statefile.open_lock_file); the state directory is made 0700 first. `wait_s` > 0
waits that long for a busy lock (the daemon at start waits for a live apply to end).
"""
from __future__ import annotations

import errno
import fcntl
import os
import time
from pathlib import Path

from hwtune import statefile
from hwtune.errors import LockBusyError


class WriterLock:
    def __init__(self, state_dir, wait_s: float = 0, name: str = "lock"):
        self.path = Path(state_dir) / name
        self.wait_s = wait_s
        self._fd = None

    def __enter__(self) -> "WriterLock":
        statefile.ensure_dir(self.path.parent)
        fd = statefile.open_lock_file(self.path)
        deadline = time.monotonic() + self.wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() < deadline:
                    time.sleep(0.05)
                    continue
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
                os.close(fd)
                waited = f" (waited {self.wait_s:g} s)" if self.wait_s else ""
                raise LockBusyError(f"{self.path} is held by pid {holder} (another hwtune is writing){waited}") from None
            except BaseException:
                os.close(fd)
                raise
        try:
            os.ftruncate(fd, 0)
            try:
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            except OSError as exc:
                # The pid is a courtesy to whoever finds the lock busy: a full disk must not
                # make the lock a traceback (the journal's reserve then refuses in one line).
                if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
        except BaseException:
            # Ctrl-C between the flock and here: an fd left open would keep the lock held by
            # this very process, and the restore that follows would find it "busy".
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
            raise
        self._fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None
