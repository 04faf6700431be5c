"""Secrets never reach a message or a log: a BMC password in a vendor tool's command line
(`racadm -p secret`, `--password=secret`), in a URL (`https://admin:secret@bmc`), or any
known secret value a backend holds."""
from __future__ import annotations

import re
from typing import Iterable, Sequence
from urllib.parse import urlsplit, urlunsplit

MASK = "***"
PASSWORD_FLAGS = ("-p", "--password", "--passwd", "--pass", "--pwd")
_URL_USERINFO = re.compile(r"(\b[A-Za-z][A-Za-z0-9+.-]*://[^/\s@:]*):[^/\s@]*@")


def argv(args: Sequence[str]) -> list[str]:
    """A command line with the value of every password option masked."""
    out, hide = [], False
    for a in args:
        a = str(a)
        if hide:
            out.append(MASK)
            hide = False
            continue
        flag, eq, _ = a.partition("=")
        if eq and flag in PASSWORD_FLAGS:
            out.append(f"{flag}={MASK}")
            continue
        out.append(a)
        hide = a in PASSWORD_FLAGS
    return [text(a) for a in out]


def text(message: str, secrets: Iterable[str | None] = ()) -> str:
    """`message` with URL passwords and the given secret values masked."""
    message = _URL_USERINFO.sub(lambda m: f"{m.group(1)}:{MASK}@", str(message))
    for secret in sorted({s for s in secrets if s}, key=len, reverse=True):
        message = message.replace(secret, MASK)
    return message


def split_url(url: str) -> tuple[str, str | None, str | None]:
    """(url without user:password@, username, password) of an endpoint URL."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url, None, None
    userinfo, _, host = parts.netloc.rpartition("@")
    user, sep, password = userinfo.partition(":")
    return urlunsplit(parts._replace(netloc=host)), (user or None), (password if sep else None)
