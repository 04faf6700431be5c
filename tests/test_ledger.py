"""The ledger keeps every attempt in SQLite and answers resume and summary questions."""
import math
import sqlite3

from kernelsearch.ledger import Ledger, code_version


def _row(**over):
    row = dict(run_id="r1", kernel="rmsnorm", dtype="bfloat16", shape={"M": 64, "N": 256},
               strategy="grid", source="kernelsearch.kernels.rmsnorm", source_hash="abc",
               params={"BLOCK_N": 256, "num_warps": 4}, accepted=True, guard=None, reason="",
               candidate_ms=0.010, stock_ms=0.012, noise_band=0.02, flops=1e5, bytes=6.6e4,
               fingerprint="cpu-1234", fingerprint_json={"device": "cpu"}, code_version="ks-1")
    row.update(over)
    return row


def _identity(**over):
    ident = dict(kernel="rmsnorm", dtype="bfloat16", shape={"N": 256, "M": 64}, source_hash="abc",
                 params={"num_warps": 4, "BLOCK_N": 256}, fingerprint="cpu-1234", code_version="ks-1")
    ident.update(over)
    return ident


def test_recorded_attempt_survives_reopening_and_is_found_by_identity(tmp_path):
    path = tmp_path / "ledger.sqlite"
    with Ledger(path) as ledger:
        ledger.record([_row()])
    with Ledger(path) as ledger:
        found = ledger.lookup(**_identity())   # key order of shape/params does not matter
    assert found and found["candidate_ms"] == 0.010 and found["params"]["BLOCK_N"] == 256


def test_resume_does_not_match_another_fingerprint_code_version_or_source(tmp_path):
    with Ledger(tmp_path / "l.sqlite") as ledger:
        ledger.record([_row()])
        assert ledger.lookup(**_identity(fingerprint="nvidia-h200-1")) is None
        assert ledger.lookup(**_identity(code_version="ks-2")) is None
        assert ledger.lookup(**_identity(source_hash="def")) is None
        assert ledger.lookup(**_identity(params={"BLOCK_N": 512, "num_warps": 4})) is None


def test_failed_attempt_time_is_stored_as_null_and_read_back_as_inf(tmp_path):
    path = tmp_path / "l.sqlite"
    with Ledger(path) as ledger:
        ledger.record([_row(accepted=False, guard="timeout", reason="killed after 5 s",
                            candidate_ms=math.inf)])
        assert ledger.lookup(**_identity())["candidate_ms"] == math.inf
    raw = sqlite3.connect(path).execute("SELECT candidate_ms, guard FROM attempts").fetchone()
    assert raw == (None, "timeout")


def test_summary_counts_verdicts_per_guard_and_reason(tmp_path):
    with Ledger(tmp_path / "l.sqlite") as ledger:
        ledger.record([_row(), _row(params={"BLOCK_N": 512}),
                       _row(accepted=False, guard="correctness", reason="rel L2 0.3 > 0.01"),
                       _row(accepted=False, guard="correctness", reason="rel L2 0.3 > 0.01"),
                       _row(accepted=False, guard="compile", reason="out of resources"),
                       _row(kernel="softmax", accepted=False, guard="timeout", reason="hang")])
        s = ledger.summary(kernel="rmsnorm")
        assert (s["total"], s["accepted"], s["rejected"]) == (5, 2, 3)
        assert s["by_guard"] == {"correctness": 2, "compile": 1}
        assert s["top_reasons"][0] == {"guard": "correctness", "reason": "rel L2 0.3 > 0.01", "count": 2}
        assert ledger.summary()["total"] == 6
        assert [a["kernel"] for a in ledger.attempts(limit=1)] == ["softmax"]


def test_code_version_changes_when_harness_source_changes(tmp_path):
    (tmp_path / "harness").mkdir()
    (tmp_path / "specs").mkdir()
    (tmp_path / "harness" / "timing.py").write_text("A = 1\n")
    before = code_version(tmp_path)
    (tmp_path / "harness" / "timing.py").write_text("A = 2\n")
    assert code_version(tmp_path) != before


def _files(d):
    """Each file's bytes; the -shm (SQLite's shared-memory index, which any reader of a WAL
    database updates) by name only."""
    return {p.name: None if p.name.endswith("-shm") else p.read_bytes() for p in d.iterdir()}


def test_read_accepted_only_reads_and_sees_rows_a_killed_writer_left_in_the_wal(tmp_path):
    import subprocess
    import sys

    import pytest

    from kernelsearch.ledger import read_accepted
    from tests.conftest import ROOT

    path = tmp_path / "ledger.sqlite"
    want = dict(kernel="rmsnorm", fingerprint="cpu-1234", dtype="bfloat16", source_hash="abc")
    with Ledger(path) as ledger:
        ledger.record([_row(), _row(accepted=False), _row(dtype="float16"), _row(source_hash="x"),
                       _row(params={"BLOCK_N": 512, "num_warps": 4})])
        ledger.db.execute("UPDATE attempts SET params='{not json' WHERE id=5")
        ledger.db.commit()
    before = _files(tmp_path)
    assert [r["params"] for r in read_accepted(path, **want)] == [{"BLOCK_N": 256, "num_warps": 4}]
    assert _files(tmp_path) == before               # no lock, no -wal or -shm made
    # a writer killed before its checkpoint: its rows are in the -wal, and are read
    code = (f"import os, sys; sys.path.insert(0, {str(ROOT)!r})\n"
            "from kernelsearch.ledger import Ledger\n"
            "from tests.test_ledger import _row\n"
            f"Ledger({str(path)!r}).record([_row(candidate_ms=0.5)])\n"
            "os._exit(0)\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
    assert (tmp_path / "ledger.sqlite-wal").exists()
    before = _files(tmp_path)
    assert [r["candidate_ms"] for r in read_accepted(path, **want)] == [0.010, 0.5]
    assert _files(tmp_path) == before
    (tmp_path / "junk.sqlite").write_bytes(b"junk" * 100)
    with pytest.raises(sqlite3.DatabaseError):
        read_accepted(tmp_path / "junk.sqlite", **want)
    assert not any(p.name.startswith("junk.sqlite-") for p in tmp_path.iterdir())


def test_a_file_that_is_not_a_usable_ledger_is_refused_naming_it(tmp_path):
    import pytest

    from kernelsearch.ledger import LedgerError

    good = tmp_path / "good.sqlite"
    with Ledger(good) as ledger:
        ledger.record([_row()] * 50)
    junk = tmp_path / "junk.sqlite"
    junk.write_bytes(b"junk" * 1000)
    truncated = tmp_path / "truncated.sqlite"
    truncated.write_bytes(good.read_bytes()[:5000])
    renamed = tmp_path / "renamed.sqlite"
    renamed.write_bytes(good.read_bytes())
    db = sqlite3.connect(renamed)
    db.execute("ALTER TABLE attempts RENAME COLUMN reason TO why")   # another version's schema
    db.commit()
    db.close()
    older = tmp_path / "older.sqlite"
    db = sqlite3.connect(older)
    db.execute("CREATE TABLE attempts (id INTEGER PRIMARY KEY, run_id TEXT, kernel TEXT)")
    db.commit()
    db.close()
    for path in (junk, truncated, renamed, older):
        with pytest.raises(LedgerError, match=f"ledger {path}: .*(another --ledger)"):
            Ledger(path)


def test_a_read_only_ledger_is_refused_for_writing_and_opens_for_reading(tmp_path, monkeypatch):
    import pytest

    from kernelsearch.ledger import LedgerError

    path = tmp_path / "ledger.sqlite"
    with Ledger(path) as ledger:
        ledger.record([_row()])
    # as SQLite opens a file it may not write (chmod is no bar to root, so say it directly)
    real = sqlite3.connect
    monkeypatch.setattr(sqlite3, "connect", lambda name, **kw: real(f"file:{name}?mode=ro", uri=True, **kw))
    with pytest.raises(LedgerError, match=f"ledger {path}: cannot be written"):
        Ledger(path)
    with Ledger(path, write=False) as ledger:
        assert len(ledger.attempts()) == 1


def test_a_failed_write_is_a_ledger_error_and_keeps_nothing_of_it(tmp_path):
    import pytest

    from kernelsearch.ledger import LedgerError

    path = tmp_path / "ledger.sqlite"
    with Ledger(path) as ledger:
        ledger.record([_row()])
        ledger.db.execute("PRAGMA query_only=1")   # as a file turned read-only under a search
        with pytest.raises(LedgerError, match=f"ledger {path}: .*nothing of this write was kept"):
            ledger.record([_row(), _row()])
        ledger.db.execute("PRAGMA query_only=0")
        assert len(ledger.attempts()) == 1


def test_a_ledger_that_is_no_regular_file_or_another_users_is_refused(tmp_path):
    """A FIFO was a sqlite3 'disk I/O error' traceback from connect(); a ledger another user
    owns was used, its rows steering what --resume keeps."""
    import os

    import pytest

    from kernelsearch.ledger import LedgerError

    fifo = tmp_path / "fifo.sqlite"
    os.mkfifo(fifo)
    with pytest.raises(LedgerError, match=f"ledger {fifo}: not a regular file"):
        Ledger(fifo)
    if os.geteuid() == 0:
        other = tmp_path / "other.sqlite"
        with Ledger(other) as ledger:
            ledger.record([_row()])
        os.chown(other, 65534, 65534)
        for write in (True, False):
            with pytest.raises(LedgerError, match="owned by uid 65534, not by this user or root"):
                Ledger(other, write=write)
