"""The durable record of original values: STATE_DIR/journal.json.

Before any write the original value is in this file on disk (write temp + fsync + rename +
fsync of the directory), so restore never depends on an orderly shutdown. `status` is
"in_progress" while an apply runs and "committed" after it succeeded; a journal found
"in_progress" was left by an apply that did not finish. Only the earliest original of each
(target, field) is kept, so rollback returns to the host as it was before hwtune.
`profiles` names the applies behind it, newest last: one row per profile name and at most
MAX_PROFILES rows, so a long tune (one apply per point) does not grow the file per apply.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

from hwtune.backends import fsync_dir, write_json_atomic
from hwtune.errors import HwtuneError

IN_PROGRESS = "in_progress"
COMMITTED = "committed"
MAX_PROFILES = 8


def journal_path(state_dir) -> Path:
    return Path(state_dir) / "journal.json"


def read_journal(state_dir) -> dict | None:
    path = journal_path(state_dir)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, json.JSONDecodeError) as exc:
        raise HwtuneError(f"journal {path}: unreadable ({exc}); restore by hand or move it away") from exc
    if not isinstance(data, dict) or not isinstance(data.get("entries"), list):
        raise HwtuneError(f"journal {path}: not a hwtune journal")
    return data


class Journal:
    def __init__(self, state_dir):
        self.state_dir = Path(state_dir)
        self.path = journal_path(state_dir)
        self.data = read_journal(state_dir) or {"version": 1, "status": COMMITTED, "profiles": [], "entries": []}

    @property
    def entries(self) -> list:
        return self.data["entries"]

    @property
    def status(self) -> str:
        return self.data.get("status", COMMITTED)

    def save(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.path, self.data)

    def begin(self, profile_name: str) -> None:
        self.data["status"] = IN_PROGRESS
        runs = [p for p in self.data.get("profiles", []) if p.get("profile") != profile_name]
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
        self.entries.append({"target": target, "family": family, "field": field,
                             "original": original, "recorded_at": time.time()})
        self.save()
        return True

    def forget(self, keys: list) -> None:
        """Drop entries whose change was undone (keys: (target, field))."""
        drop = set(keys)
        self.data["entries"] = [e for e in self.entries if (e["target"], e["field"]) not in drop]

    def finish(self, status: str = COMMITTED) -> None:
        """Commit (or leave as `status`); a journal with nothing left is removed."""
        if not self.entries:
            self.remove()
            return
        self.data["status"] = status
        self.save()

    def remove(self) -> None:
        try:
            os.unlink(self.path)
            fsync_dir(self.state_dir)
        except FileNotFoundError:
            pass
