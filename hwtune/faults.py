"""Named fault points, so tests can crash, pause, signal or fill the disk at an exact step.

HWTUNE_FAULT="POINT[@N[+]]=ACTION[,...]": at the N-th time (from the N-th time on with "+",
every time without @N) the code passes POINT, do ACTION:
  kill          SIGKILL this process (a crash at that instant)
  term|hup|int  send SIGTERM / SIGHUP / SIGINT to this process
  enospc        raise OSError(ENOSPC) (a full disk at that write)
  pause[:S]     write "hwtune-fault: paused at POINT" on stderr, then sleep up to S seconds
                (default 30), ending early once a deferred signal is pending
Points: device.write / device.written (before / after each hardware write of apply, undo or
rollback), journal.record, clocks.recorded, rollback.restore, state.write:FILE,
state.reserve. Unset (always, outside tests) this costs one dictionary lookup.
"""
from __future__ import annotations

import errno
import os
import signal
import sys
import time

_counts: dict = {}
_spec_text: str | None = None
_spec: list = []


def _parse(text: str) -> list:
    out = []
    for item in text.split(","):
        point, sep, action = item.strip().partition("=")
        if not sep:
            continue
        name, _, nth = point.partition("@")
        nth = nth.strip()
        onward = nth.endswith("+")
        nth = nth.rstrip("+")
        out.append((name.strip(), int(nth) if nth.isdigit() else None, onward, action.strip()))
    return out


def hit(point: str) -> None:
    global _spec_text, _spec
    text = os.environ.get("HWTUNE_FAULT")
    if not text:
        return
    if text != _spec_text:
        _spec_text, _spec = text, _parse(text)
        _counts.clear()
    base = point.split(":", 1)[0]
    for n, (name, nth, onward, action) in enumerate(_spec):
        if name not in (point, base):
            continue
        _counts[n] = count = _counts.get(n, 0) + 1
        if nth is not None and (count < nth if onward else count != nth):
            continue
        _act(point, action)


def _act(point: str, action: str) -> None:
    kind, _, arg = action.partition(":")
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind in ("term", "hup", "int"):
        os.kill(os.getpid(), {"term": signal.SIGTERM, "hup": signal.SIGHUP, "int": signal.SIGINT}[kind])
    elif kind == "enospc":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    elif kind == "pause":
        from hwtune import signals

        try:
            sys.stderr.write(f"hwtune-fault: paused at {point}\n")
            sys.stderr.flush()
        except (OSError, ValueError):
            pass
        end = time.monotonic() + (float(arg) if arg else 30.0)
        while time.monotonic() < end and not signals.pending():
            time.sleep(0.02)
