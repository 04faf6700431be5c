"""SQLite ledger: every attempt is a row, kept or not.

Table `attempts`, one row per (candidate, shape): kernel, dtype, shape, the candidate (template
params as JSON and/or the source file's hash), the verdict (accepted, guard, reason), candidate /
stock times and noise band, the device fingerprint and the code version the numbers came from.
`--resume` skips a (kernel, dtype, shape, source hash, params, fingerprint, code version)
already in the ledger. Non-finite times are stored as NULL and read back as inf.

Table `searches`, one row per (kernel, dtype, shape) of a search that ran to its end (its
winners merged into the dispatch table): attempts alone do not say that a shape was searched,
since a search killed half-way leaves them too. `kept` says whether that search kept a kernel
there (1) or stock won (0); rows written before the column existed hold NULL (not known).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import sqlite3
import stat
import subprocess
import time
from pathlib import Path

from kernelsearch.entry import file_sha256 as file_hash  # noqa: F401 -- the ledger's name for it

PACKAGE_DIR = Path(__file__).resolve().parent
# What a measurement depends on besides the candidate: the verifier/timer and the specs.
MEASURED_BY = ("harness", "specs")

SCHEMA = """
CREATE TABLE IF NOT EXISTS attempts (
    id INTEGER PRIMARY KEY,
    run_id TEXT NOT NULL,
    kernel TEXT NOT NULL,
    dtype TEXT NOT NULL,
    shape TEXT NOT NULL,
    strategy TEXT NOT NULL,
    source TEXT NOT NULL,
    source_hash TEXT NOT NULL,
    params TEXT NOT NULL,
    accepted INTEGER NOT NULL,
    guard TEXT,
    reason TEXT,
    candidate_ms REAL,
    stock_ms REAL,
    noise_band REAL,
    flops REAL,
    bytes REAL,
    fingerprint TEXT NOT NULL,
    fingerprint_json TEXT NOT NULL,
    code_version TEXT NOT NULL,
    git_describe TEXT,
    started_at REAL NOT NULL,
    finished_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS attempts_identity
    ON attempts (kernel, dtype, shape, source_hash, params, fingerprint, code_version);
CREATE TABLE IF NOT EXISTS searches (
    id INTEGER PRIMARY KEY,
    run_id TEXT NOT NULL,
    kernel TEXT NOT NULL,
    dtype TEXT NOT NULL,
    shape TEXT NOT NULL,
    strategy TEXT NOT NULL,
    budget INTEGER NOT NULL,
    source_hash TEXT NOT NULL,
    fingerprint TEXT NOT NULL,
    code_version TEXT NOT NULL,
    finished_at REAL NOT NULL,
    kept INTEGER
);
"""

COLUMNS = ("run_id", "kernel", "dtype", "shape", "strategy", "source", "source_hash", "params",
           "accepted", "guard", "reason", "candidate_ms", "stock_ms", "noise_band", "flops",
           "bytes", "fingerprint", "fingerprint_json", "code_version", "git_describe",
           "started_at", "finished_at")


def canonical(value) -> str:
    return json.dumps(value if value is not None else {}, sort_keys=True, separators=(",", ":"))


def code_version(package_dir: Path = PACKAGE_DIR) -> str:
    """Hash of the harness and spec sources: a change there makes old timings incomparable."""
    h = hashlib.sha256()
    for sub in MEASURED_BY:
        for path in sorted((package_dir / sub).rglob("*.py")):
            h.update(str(path.relative_to(package_dir)).encode())
            h.update(path.read_bytes())
    return "ks-" + h.hexdigest()[:12]


def git_describe(repo_dir: Path = PACKAGE_DIR.parent) -> str:
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=repo_dir,
                             capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return out.stdout.strip() or "unknown"


class LedgerError(ValueError):
    """A ledger file this version cannot use, or a write it refused (names the file)."""


SEARCHES_COLUMNS = ("run_id", "kernel", "dtype", "shape", "strategy", "budget", "source_hash",
                    "fingerprint", "code_version", "finished_at")


def _check_file(path: Path) -> None:
    """LedgerError unless `path` (a link followed) is missing or a regular file owned by this
    user or root: SQLite on a FIFO failed with a traceback, and rows another user wrote would
    steer what a search keeps (hwtune runs as root)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise LedgerError(f"ledger {path}: cannot be read ({exc.strerror or exc})") from None
    if not stat.S_ISREG(st.st_mode):
        raise LedgerError(f"ledger {path}: not a regular file" + (" (a directory)" if stat.S_ISDIR(st.st_mode) else ""))
    if st.st_uid not in (0, os.geteuid()):
        raise LedgerError(f"ledger {path}: owned by uid {st.st_uid}, not by this user or root; refusing to "
                          "trust it (inspect it, then remove it or choose another --ledger)")


def _db_float(x):
    return float(x) if x is not None and math.isfinite(float(x)) else None


def _py_float(x):
    return math.inf if x is None else float(x)


class Ledger:
    def __init__(self, path, *, write: bool = True):
        """Open (making it when missing) the ledger at `path`; LedgerError naming the file when
        it is not one (corrupt, truncated, another schema) or, with `write`, cannot be written
        now (read-only, another writer holding it past the timeout): said before a search
        spends its time, not when its first row is recorded."""
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        _check_file(self.path)
        try:
            self.db = sqlite3.connect(str(self.path), timeout=30)
        except sqlite3.Error as exc:
            raise LedgerError(f"ledger {self.path}: cannot be opened ({exc})") from None
        self.db.row_factory = sqlite3.Row
        try:
            self._open(write)
        except sqlite3.Error as exc:
            self.db.close()
            raise LedgerError(f"ledger {self.path}: not a ledger this hwtune can use ({exc}); "
                              "move it aside or choose another --ledger") from None
        except LedgerError:
            self.db.close()
            raise

    def _open(self, write: bool) -> None:
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.executescript(SCHEMA)
        for table, wanted in (("attempts", COLUMNS), ("searches", SEARCHES_COLUMNS)):
            have = {row[1] for row in self.db.execute(f"PRAGMA table_info({table})")}
            missing = [c for c in wanted if c not in have]
            if missing:
                raise LedgerError(f"ledger {self.path}: table {table} has no column {', '.join(missing)} "
                                  "(written by another version of hwtune?); move it aside or choose "
                                  "another --ledger")
        columns = {row[1] for row in self.db.execute("PRAGMA table_info(searches)")}
        if "kept" not in columns:   # a ledger from before the column: its rows stay NULL
            try:
                with self.db:
                    self.db.execute("ALTER TABLE searches ADD COLUMN kept INTEGER")
            except sqlite3.OperationalError:   # another process added it first
                columns = {row[1] for row in self.db.execute("PRAGMA table_info(searches)")}
                if "kept" not in columns:
                    raise
        if write:   # a row inserted and rolled back: the file stays as it was
            try:
                self.db.execute("BEGIN IMMEDIATE")
                try:
                    self.db.execute(f"INSERT INTO searches ({', '.join(SEARCHES_COLUMNS)}) "
                                    f"VALUES ({', '.join('?' * len(SEARCHES_COLUMNS))})",
                                    ("", "", "", "", "", 0, "", "", "", 0.0))
                finally:
                    self.db.rollback()
            except sqlite3.Error as exc:
                raise LedgerError(f"ledger {self.path}: cannot be written ({exc}); "
                                  "choose another --ledger") from None

    def close(self) -> None:
        self.db.close()

    @contextlib.contextmanager
    def _writing(self):
        """One transaction; a failed write (disk full, the file made read-only, another writer
        past the timeout) is rolled back whole and raised as LedgerError naming the file."""
        try:
            with self.db:
                yield
        except sqlite3.Error as exc:
            raise LedgerError(f"ledger {self.path}: {exc}; nothing of this write was kept") from None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def record(self, rows: list[dict]) -> None:
        """Append attempts in one transaction. Each row needs every column but `id`."""
        now = time.time()
        values = []
        for r in rows:
            r = dict(r)
            r.setdefault("started_at", now)
            r.setdefault("finished_at", now)
            r.setdefault("git_describe", None)
            r["shape"] = canonical(r["shape"])
            r["params"] = canonical(r["params"])
            r["fingerprint_json"] = canonical(r["fingerprint_json"])
            r["accepted"] = int(bool(r["accepted"]))
            for f in ("candidate_ms", "stock_ms", "noise_band", "flops", "bytes"):
                r[f] = _db_float(r.get(f))
            values.append(tuple(r[c] for c in COLUMNS))
        with self._writing():
            self.db.executemany(
                f"INSERT INTO attempts ({', '.join(COLUMNS)}) VALUES ({', '.join('?' * len(COLUMNS))})",
                values)

    def record_search(self, *, run_id, kernel, shapes: list[tuple[str, dict]], strategy, budget,
                      source_hash, fingerprint, code_version, kept: list[bool] | None = None) -> None:
        """A search finished on `shapes` ((dtype, shape) pairs): one row each, one transaction.
        `kept[i]`: whether it kept a kernel at shapes[i] (None: not known, stored as NULL)."""
        now = time.time()
        flags = [None] * len(shapes) if kept is None else [int(bool(k)) for k in kept]
        if len(flags) != len(shapes):
            raise ValueError(f"record_search: {len(flags)} kept flag(s) for {len(shapes)} shape(s)")
        with self._writing():
            self.db.executemany(
                "INSERT INTO searches (run_id, kernel, dtype, shape, strategy, budget, source_hash, "
                "fingerprint, code_version, finished_at, kept) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [(run_id, kernel, dtype, canonical({k: v for k, v in shape.items() if k != "dtype"}),
                  strategy, int(budget), source_hash, fingerprint, code_version, now, flag)
                 for (dtype, shape), flag in zip(shapes, flags)])

    def searched(self, *, fingerprint, source_hashes: dict[str, str]) -> set[tuple[str, str, str]]:
        """{(kernel, dtype, canonical shape)} whose latest finished search on this fingerprint,
        with the kernel's source at `source_hashes[kernel]` (kernels not named there: none),
        kept nothing: stock won there, so searching again would only repeat that answer.
        A shape where the search kept a kernel is not in it: its winner lives in the dispatch
        table, and a table that lost it (re-seeded, deleted) must get it back, which a search
        resumed from this ledger does without measuring again. Rows of unknown outcome (NULL,
        from before the column) are not in it either."""
        latest: dict[tuple[str, str, str], int | None] = {}
        for k, d, shape, h, kept in self.db.execute(
                "SELECT kernel, dtype, shape, source_hash, kept FROM searches WHERE fingerprint=? "
                "ORDER BY id", (fingerprint,)):
            if source_hashes.get(k) == h:
                latest[(k, d, shape)] = kept
        return {key for key, kept in latest.items() if kept == 0}

    def lookup(self, *, kernel, dtype, shape, source_hash, params, fingerprint, code_version) -> dict | None:
        """The latest attempt with this identity, or None (what --resume skips)."""
        row = self.db.execute(
            "SELECT * FROM attempts WHERE kernel=? AND dtype=? AND shape=? AND source_hash=? "
            "AND params=? AND fingerprint=? AND code_version=? ORDER BY id DESC LIMIT 1",
            (kernel, dtype, canonical(shape), source_hash, canonical(params), fingerprint,
             code_version)).fetchone()
        return _row(row) if row else None

    def attempts(self, kernel=None, fingerprint=None, limit=None) -> list[dict]:
        where, args = _filters(kernel, fingerprint)
        sql = f"SELECT * FROM attempts {where} ORDER BY id"
        if limit:
            sql = f"SELECT * FROM ({sql.replace('ORDER BY id', 'ORDER BY id DESC')} LIMIT {int(limit)}) ORDER BY id"
        return [_row(r) for r in self.db.execute(sql, args)]

    def summary(self, kernel=None, fingerprint=None) -> dict:
        """Counts: total, accepted, rejected per guard, and the commonest reasons per guard."""
        where, args = _filters(kernel, fingerprint)
        total, accepted = self.db.execute(
            f"SELECT COUNT(*), COALESCE(SUM(accepted), 0) FROM attempts {where}", args).fetchone()
        rej = f"{where} {'AND' if where else 'WHERE'} accepted=0"
        by_guard = {g or "unknown": n for g, n in self.db.execute(
            f"SELECT guard, COUNT(*) FROM attempts {rej} GROUP BY guard ORDER BY COUNT(*) DESC", args)}
        reasons = [{"guard": g or "unknown", "reason": r or "", "count": n} for g, r, n in self.db.execute(
            f"SELECT guard, substr(reason, 1, 160), COUNT(*) FROM attempts {rej} "
            f"GROUP BY guard, substr(reason, 1, 160) ORDER BY COUNT(*) DESC LIMIT 20", args)]
        return {"total": total, "accepted": accepted, "rejected": total - accepted,
                "by_guard": by_guard, "top_reasons": reasons}


def read_accepted(path, *, kernel: str, fingerprint: str, dtype: str, source_hash: str) -> list[dict]:
    """The accepted attempts of one kernel's source on one fingerprint and dtype, in id order,
    read without writing anything. Without a -wal file beside it (every writer closed), SQLite's
    immutable mode: no lock, no -wal or -shm made (a search writing meanwhile may be missed or
    read as an error). With one (a writer still open, or killed before its checkpoint), a plain
    read-only connection, which reads the rows still in the -wal through the -shm already there.
    Raises sqlite3.Error where the file is not a readable ledger; a row whose JSON does not
    parse is left out."""
    from urllib.parse import quote

    path = Path(path).resolve()
    wal = path.with_name(path.name + "-wal").exists()
    uri = f"file:{quote(str(path))}?mode=ro" + ("" if wal else "&immutable=1")
    db = sqlite3.connect(uri, uri=True)
    try:
        db.row_factory = sqlite3.Row
        rows = db.execute("SELECT * FROM attempts WHERE kernel=? AND fingerprint=? AND dtype=? "
                          "AND source_hash=? AND accepted=1 ORDER BY id",
                          (kernel, fingerprint, dtype, source_hash)).fetchall()
    finally:
        db.close()
    out = []
    for row in rows:
        try:
            out.append(_row(row))
        except (ValueError, TypeError):
            continue
    return out


def _filters(kernel, fingerprint):
    clauses, args = [], []
    if kernel:
        clauses.append("kernel=?")
        args.append(kernel)
    if fingerprint:
        clauses.append("fingerprint=?")
        args.append(fingerprint)
    return ("WHERE " + " AND ".join(clauses) if clauses else ""), args


def _row(row: sqlite3.Row) -> dict:
    d = dict(row)
    for f in ("shape", "params", "fingerprint_json"):
        d[f] = json.loads(d[f])
    d["accepted"] = bool(d["accepted"])
    for f in ("candidate_ms", "stock_ms"):
        d[f] = _py_float(d[f])
    return d
