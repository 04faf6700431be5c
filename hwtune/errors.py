"""Errors that carry context and an exit code (see the CLI's exit-code table in README)."""
from __future__ import annotations


class HwtuneError(Exception):
    """Base error; `exit_code` is what the CLI returns."""

    exit_code = 1


class UsageError(HwtuneError):
    """Bad input from the user (profile, arguments): nothing was written."""

    exit_code = 2


class ProfileError(UsageError):
    """A profile that does not validate. Carries file, line and key."""

    def __init__(self, message: str, file: str | None = None, line: int | None = None,
                 key: str | None = None, hint: str | None = None):
        self.file, self.line, self.key, self.hint = file, line, key, hint
        where = file or "<profile>"
        if line is not None:
            where += f":{line}"
        text = f"{where}: {key + ': ' if key else ''}{message}"
        if hint:
            text += f" ({hint})"
        super().__init__(text)


class ReadOnlyError(HwtuneError):
    """A write was attempted while --read-only / HWTUNE_READ_ONLY=1 is in force."""

    exit_code = 4


class LockBusyError(HwtuneError):
    """Another writer holds the lock."""

    exit_code = 5


class PendingJournalError(HwtuneError):
    """A journal left by an interrupted apply must be rolled back first."""

    exit_code = 3


class KnobUnavailable(HwtuneError):
    """A knob the device refuses (NoPermission / NotSupported): skipped, never half-applied."""

    def __init__(self, target: str, knob: str, reason: str):
        self.target, self.knob, self.reason = target, knob, reason
        super().__init__(f"{target} {knob}: {reason}")
