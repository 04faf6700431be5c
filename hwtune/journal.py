"""The durable record of original values: STATE_DIR/journal.json.

Before any write the original value is in this file on disk (mkstemp + fsync + rename +
fsync of the directory, mode 0600: hwtune.statefile), so restore never depends on an orderly
shutdown. `status` is "in_progress" while an apply runs and "committed" after it succeeded;
a journal found "in_progress" was left by an apply that did not finish. Only the earliest
original of each (target, field) is kept, so rollback returns to the host as it was before
hwtune. `profiles` names the applies behind it, newest last: one row per profile name and at
most MAX_PROFILES rows, so a long tune (one apply per point) does not grow the file per apply.

The journal tells root what to write, so it is read only when it is ours (root's or this
user's, not writable by group or others, not a link). Rollback reads it forgivingly (`load`):
a torn or damaged file still gives back every entry that can be decoded; the rest are listed
as `unreadable` and kept in the file, so it is never reported restored.
"""
from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from hwtune import faults, statefile
from hwtune.errors import HwtuneError

IN_PROGRESS = "in_progress"
COMMITTED = "committed"
MAX_PROFILES = 8
ENTRY_KEYS = ("target", "family", "field", "original")
NAME = "journal.json"


def journal_path(state_dir) -> Path:
    return Path(state_dir) / NAME


def read_journal(state_dir) -> dict | None:
    """The whole journal, or None; HwtuneError when it is untrusted, torn or not a journal."""
    path = journal_path(state_dir)
    raw = statefile.read_bytes(path, "journal")
    if raw is None:
        return None
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise HwtuneError(f"journal {path}: unreadable ({type(exc).__name__}); `hwtune rollback` restores "
                          "every entry it can still read") from None
    if not isinstance(data, dict) or not isinstance(data.get("entries"), list):
        raise HwtuneError(f"journal {path}: not a hwtune journal; `hwtune rollback` restores every entry "
                          "it can still read")
    # Apply adds to this journal and status lists it: an entry or a run that is not one is
    # damage to report here, never a TypeError half way through an apply.
    for n, entry in enumerate(data["entries"], 1):
        why = entry_problem(entry)
        if why is not None:
            raise HwtuneError(f"journal {path}: {_label(entry, n)}: {why}; `hwtune rollback` restores every "
                              "entry it can still read")
    runs = data.get("profiles", [])
    if not isinstance(runs, list) or not all(isinstance(r, dict) for r in runs):
        raise HwtuneError(f"journal {path}: profiles: not a list of applies; `hwtune rollback` restores every "
                          "entry it can still read")
    return data


def entry_problem(entry) -> str | None:
    """Why `entry` is not a journal entry (shape only: the engine checks it against the host)."""
    if not isinstance(entry, dict):
        return f"not an object ({type(entry).__name__})"
    for key in ENTRY_KEYS:
        if key not in entry:
            return f"missing field {key!r}"
    for key in ("target", "family", "field"):
        if not isinstance(entry[key], str) or not entry[key] or len(entry[key]) > 200:
            return f"field {key!r} is not a name"
    unknown = set(entry) - set(ENTRY_KEYS) - {"recorded_at"}
    if unknown:
        return f"unknown field {sorted(map(str, unknown))[0]!r}"
    return None


def _label(entry, n: int) -> str:
    if isinstance(entry, dict) and isinstance(entry.get("target"), str) and isinstance(entry.get("field"), str):
        return f"entry {n} ({entry['target'][:60]} {entry['field'][:60]})"
    return f"entry {n}"


@dataclass
class Loaded:
    """What rollback can use of a journal: decodable entries, and what it could not read."""

    data: dict
    entries: list = field(default_factory=list)  # shape-checked entry dicts, in journal order
    unreadable: list = field(default_factory=list)  # one line per entry (or part) not read
    torn: bool = False


def _salvage(text: str) -> tuple:
    """([(n, entry)], unreadable lines) from a journal that does not parse as a whole: decode
    the entries one by one from the `"entries": [` list on."""
    dec = json.JSONDecoder()
    m = re.search(r'"entries"\s*:\s*\[', text)
    if m is None:
        return [], ["the entries list (the file is damaged before it)"]
    pos, entries, bad, n, closed = m.end(), [], [], 0, False
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text):
            break
        if text[pos] == "]":
            closed = True
            break
        n += 1
        try:
            obj, pos = dec.raw_decode(text, pos)
        except (ValueError, RecursionError):
            bad.append(f"entry {n}: damaged")
            nxt = re.compile(r'\{\s*"target"').search(text, pos + 1)  # entries start with their target
            if nxt is None:
                break
            pos = nxt.start()
            continue
        entries.append((n, obj))
    if not closed:
        bad.append("the end of the entries list (the file is truncated: entries after it may be lost)")
    return entries, bad


def load(state_dir) -> Loaded | None:
    """The journal for rollback; None when there is none. Trust is checked (StateError)."""
    path = journal_path(state_dir)
    raw = statefile.read_bytes(path, "journal")
    if raw is None:
        return None
    text = raw.decode("utf-8", errors="replace")  # a bad byte spoils only its own entry
    try:
        data = json.loads(text)
        ok = isinstance(data, dict) and isinstance(data.get("entries"), list)
    except (ValueError, RecursionError):
        data, ok = None, False
    out = Loaded(data={"version": 1, "status": IN_PROGRESS, "profiles": [], "entries": []})
    if ok:
        numbered = list(enumerate(data["entries"], 1))
        out.data = data
        prior = data.get("unreadable")
        if isinstance(prior, list):
            out.unreadable.extend(str(x)[:300] for x in prior)
        elif prior is not None:
            out.unreadable.append("the unreadable list of an earlier rollback")
    else:
        out.torn = True
        numbered, bad = _salvage(text)
        out.unreadable.extend(bad)
    for n, entry in numbered:
        why = entry_problem(entry)
        if why is None:
            out.entries.append(entry)
        else:
            out.unreadable.append(f"{_label(entry, n)}: {why}")
    return out


class Journal:
    def __init__(self, state_dir, data: dict | None = None):
        self.state_dir = Path(state_dir)
        self.path = journal_path(state_dir)
        self.data = data if data is not None else (
            read_journal(state_dir) or {"version": 1, "status": COMMITTED, "profiles": [], "entries": []})

    @property
    def entries(self) -> list:
        return self.data["entries"]

    @property
    def status(self) -> str:
        return self.data.get("status", COMMITTED)

    def save(self) -> None:
        statefile.ensure_dir(self.state_dir)
        statefile.write_json(self.path, self.data)

    def begin(self, profile_name: str) -> None:
        self.data["status"] = IN_PROGRESS
        runs = [p for p in self.data.get("profiles", []) if isinstance(p, dict) and p.get("profile") != profile_name]
        runs.append({"profile": profile_name, "started_at": time.time(), "pid": os.getpid()})
        self.data["profiles"] = runs[-MAX_PROFILES:]
        self.save()

    def find(self, target: str, field: str) -> dict | None:
        for e in self.entries:
            if e["target"] == target and e["field"] == field:
                return e
        return None

    def record(self, target: str, family: str, field: str, original) -> bool:
        """Make the original durable before its write. False when an earlier one is kept."""
        if self.find(target, field) is not None:
            return False
        faults.hit("journal.record")
        self.entries.append({"target": target, "family": family, "field": field,
                             "original": original, "recorded_at": time.time()})
        try:
            self.save()
        except BaseException:
            self.entries.pop()  # not durable: the write must not happen
            raise
        return True

    def forget(self, keys: list) -> None:
        """Drop entries whose change was undone (keys: (target, field))."""
        drop = set(keys)
        self.data["entries"] = [e for e in self.entries if (e["target"], e["field"]) not in drop]

    def finish(self, status: str = COMMITTED) -> None:
        """Commit (or leave as `status`); a journal with nothing left is removed."""
        if not self.entries and not self.data.get("unreadable"):
            self.remove()
            return
        self.data["status"] = status
        self.save()

    def remove(self) -> None:
        try:
            os.unlink(self.path)
            statefile.fsync_dir(self.state_dir)
        except FileNotFoundError:
            pass

    def size_with(self, extra_entries: list) -> int:
        """Bytes of this journal once `extra_entries` are recorded (to set space aside)."""
        probe = dict(self.data, entries=list(self.entries) + list(extra_entries), status=IN_PROGRESS)
        return len(json.dumps(probe, indent=2)) + 256
