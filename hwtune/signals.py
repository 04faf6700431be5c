"""Signals never cut a write sequence in half.

`Deferred()` holds SIGTERM, SIGHUP and SIGINT while an apply or a rollback writes: the
handler only notes the signal. The sequence asks `stop` at its step boundaries: a signal that
would have ended the process (default action, or Python's KeyboardInterrupt) is the signal
to stop there, undo or finish, and exit 128 + signo (the caller raises `Interrupted`). A
signal the program handles itself (the daemon, `hwtune tune`) is handed to that handler
once the sequence is over, so nesting composes. Outside the main thread nothing is held.
"""
from __future__ import annotations

import signal
import threading

from hwtune.errors import HwtuneError

HELD = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)
_active: list = []


class Interrupted(HwtuneError):
    """A write sequence ended early (undone) or was finished because of a signal."""

    def __init__(self, signo: int, message: str):
        self.signo = signo
        self.exit_code = 128 + signo
        super().__init__(message)


def name(signo: int) -> str:
    try:
        return signal.Signals(signo).name
    except ValueError:
        return f"signal {signo}"


def pending() -> bool:
    """A held signal is waiting (fault pauses end early on it)."""
    return any(d.received for d in _active)


class Deferred:
    def __init__(self):
        self.received: list = []
        self._old: dict = {}
        self._on = False

    def __enter__(self) -> "Deferred":
        if threading.current_thread() is not threading.main_thread():
            return self
        for s in HELD:
            try:
                self._old[s] = signal.signal(s, self._note)
            except (ValueError, OSError):
                pass
        self._on = True
        _active.append(self)
        return self

    def _note(self, signo, frame) -> None:
        self.received.append(signo)

    def _terminates(self, signo: int) -> bool:
        old = self._old.get(signo, signal.SIG_DFL)
        return old in (signal.SIG_DFL, None) or old is signal.default_int_handler

    @property
    def stop(self) -> int | None:
        """The first held signal that would have ended the process, else None."""
        for s in self.received:
            if self._terminates(s):
                return s
        return None

    def __exit__(self, *exc) -> None:
        if not self._on:
            return
        self._on = False
        if self in _active:
            _active.remove(self)
        for s, old in self._old.items():
            try:
                signal.signal(s, old if old is not None else signal.SIG_DFL)
            except (ValueError, OSError):
                pass
        # Signals the program handles itself: its handler runs now, after the sequence.
        for s in dict.fromkeys(self.received):
            old = self._old.get(s)
            if callable(old) and old is not signal.default_int_handler:
                old(s, None)
