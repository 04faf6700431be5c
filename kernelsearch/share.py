"""Share search results between hosts of the same device fingerprint: one JSON bundle.

A bundle carries one fingerprint's ledger rows (every attempt, failures included) and its
dispatch table, plus the source text of any winner that lives in a file rather than in a
built-in template module (a path on the exporting host means nothing elsewhere).

    bundle = export_bundle(state_dir, fingerprint_id)            # JSON-ready dict
    report = import_bundle(bundle, state_dir, local_fingerprint)  # raises FingerprintMismatch

Import rules:
- The bundle's fingerprint must be this host's (same GPU model, driver, triton, torch, CUDA:
  the whole fingerprint, because the dispatch runtime uses a table only under its exact
  fingerprint id). Otherwise `FingerprintMismatch`, naming the fields that differ, unless
  `force`: then the rows are stored under the fingerprint they were measured on (the ledger
  never lies about where a number came from) and the winners go into THIS host's table,
  each marked `imported_from` (the person forcing it vouches that the difference is harmless).
- A winner is stored only as this host's harness verifies it (its source at its hash, its params,
  shape and dtype through every guard, not timed), with the plan verified here: a bundle is
  untrusted input, and its plans and sources are what would run in the user's model. One that
  fails is left out, named in the report's `refused`.
- Idempotent: a row is identified by (run_id, kernel, dtype, shape, source hash, params,
  fingerprint, code version, started_at); one already present is not stored again. A dispatch
  entry is identified by (kernel, dtype, shape, range): an identical one is left alone, a
  different one replaces the local entry only when it is faster (lower candidate_ms).
"""
from __future__ import annotations

import json
import math
import socket
import time
from pathlib import Path

from kernelsearch.entry import text_sha256
from kernelsearch.ledger import COLUMNS, Ledger, canonical, file_hash

FORMAT = "hwtune-share"
VERSION = 1


class FingerprintMismatch(Exception):
    """The bundle was measured on another device fingerprint."""


class BadBundle(Exception):
    """Not a bundle this version can read."""


def _finite_or_none(x):
    return x if x is None or not isinstance(x, float) or math.isfinite(x) else None


def fingerprint_differences(theirs: dict, ours: dict) -> list[str]:
    """'driver 580.65 (bundle) != 575.51 (here)' for every field that differs."""
    out = []
    for k in sorted(set(theirs) | set(ours)):
        if theirs.get(k) != ours.get(k):
            out.append(f"{k} {theirs.get(k)!r} (bundle) != {ours.get(k)!r} (here)")
    return out


def _describe(fp: dict) -> str:
    keys = ("gpu", "driver", "triton") if fp.get("device") == "cuda" else ("cpu", "triton")
    return ", ".join(f"{k} {fp.get(k)}" for k in keys)


def _ledger(state_dir, ledger_path, write: bool = True) -> Ledger:
    return Ledger(ledger_path or Path(state_dir) / "ledger.sqlite", write=write)


def fingerprints_in(state_dir, ledger_path=None) -> dict[str, int]:
    """Fingerprint ids present in the ledger or as dispatch tables, with their row counts."""
    found: dict[str, int] = {}
    with _ledger(state_dir, ledger_path, write=False) as ledger:
        for fp_id, n in ledger.db.execute("SELECT fingerprint, COUNT(*) FROM attempts GROUP BY fingerprint"):
            found[fp_id] = n
    for path in sorted((Path(state_dir) / "dispatch").glob("*.json")):
        found.setdefault(path.stem, 0)
    return found


# --- export -------------------------------------------------------------------------------------
def export_bundle(state_dir, fingerprint_id: str, fingerprint: dict | None = None, ledger_path=None,
                  kernel: str | None = None) -> dict:
    """One fingerprint's rows and dispatch table as a JSON-ready bundle (`kernel` narrows it)."""
    from kernelsearch.dispatch import table_path

    with _ledger(state_dir, ledger_path, write=False) as ledger:
        rows = ledger.attempts(kernel=kernel, fingerprint=fingerprint_id)
    attempts = []
    for row in rows:
        row = {c: _finite_or_none(row[c]) for c in COLUMNS}
        attempts.append(row)
    table_file = table_path(state_dir, fingerprint_id)
    dispatch, sources, notes = None, {}, []
    if table_file.exists():
        from kernelsearch.dispatch import DispatchTable

        table = DispatchTable.load(table_file)
        notes += [f"unreadable dispatch entry left out: {why}" for why in table.invalid]
        dispatch = dict(table.data)
        kept = []
        for e in table.entries:
            if kernel is not None and e.kernel != kernel:
                continue
            path = (e.source or {}).get("path")
            if path:
                if not Path(path).is_file() or file_hash(path) != e.source_hash:
                    notes.append(f"{e.kernel} {canonical(dict(e.shape))}: source {path} missing or changed, "
                                 "entry left out")
                    continue
                sources[e.source_hash] = Path(path).read_text()
            kept.append(e.to_json())
        dispatch["entries"] = kept
        fingerprint = fingerprint or dispatch.get("fingerprint")
    if fingerprint is None and rows:
        fingerprint = rows[0]["fingerprint_json"]
    if not attempts and dispatch is None:
        present = fingerprints_in(state_dir, ledger_path)
        raise LookupError(f"nothing recorded for fingerprint {fingerprint_id}"
                          f"{' and kernel ' + kernel if kernel else ''} in {state_dir}; present: "
                          + (", ".join(f"{k} ({n} rows)" for k, n in present.items()) or "none"))
    return {"format": FORMAT, "version": VERSION, "created_at": time.time(), "host": socket.gethostname(),
            "fingerprint_id": fingerprint_id, "fingerprint": fingerprint or {}, "kernel": kernel,
            "attempts": attempts, "dispatch": dispatch, "sources": sources, "notes": notes}


# --- import -------------------------------------------------------------------------------------
def check_bundle(bundle: dict) -> None:
    if not isinstance(bundle, dict) or bundle.get("format") != FORMAT:
        raise BadBundle(f"not an hwtune share bundle (format {bundle.get('format') if isinstance(bundle, dict) else None!r})")
    if bundle.get("version") != VERSION:
        raise BadBundle(f"bundle version {bundle.get('version')!r}; this hwtune reads version {VERSION}")
    dispatch = bundle.get("dispatch")
    for ok, what in ((isinstance(bundle.get("fingerprint_id"), str), "'fingerprint_id' must be a string"),
                     (isinstance(bundle.get("fingerprint") or {}, dict), "'fingerprint' must be an object"),
                     (isinstance(bundle.get("attempts", []), list) and
                      all(isinstance(r, dict) for r in bundle.get("attempts", [])), "'attempts' must be a list of rows"),
                     (dispatch is None or (isinstance(dispatch, dict) and isinstance(dispatch.get("entries", []), list)),
                      "'dispatch' must be a table (an object with a list of entries)"),
                     (isinstance(bundle.get("sources") or {}, dict), "'sources' must be an object")):
        if not ok:
            raise BadBundle(f"malformed bundle: {what}")


def _has_row(ledger: Ledger, row: dict) -> bool:
    return ledger.db.execute(
        "SELECT 1 FROM attempts WHERE run_id=? AND kernel=? AND dtype=? AND shape=? AND source_hash=? "
        "AND params=? AND fingerprint=? AND code_version=? AND started_at=? LIMIT 1",
        (row["run_id"], row["kernel"], row["dtype"], canonical(row["shape"]), row["source_hash"],
         canonical(row["params"]), row["fingerprint"], row["code_version"], row["started_at"])).fetchone() is not None


_TEXT = ("run_id", "kernel", "dtype", "strategy", "source", "source_hash", "fingerprint", "code_version")
_NUMBERS = ("candidate_ms", "stock_ms", "noise_band", "flops", "bytes")


def _is_number(x) -> bool:
    # an int past a float's range (10**400) is no time: float() of it raises
    return isinstance(x, int | float) and not isinstance(x, bool) and (
        isinstance(x, float) or abs(x) <= 2 ** 1023)


def _row_problem(row: dict) -> str | None:
    """Why a bundle's ledger row is not one (a field of the wrong type), or None: the ledger
    stores what it is given, and --resume and summaries read it back as these types."""
    for c in _TEXT:
        if not isinstance(row[c], str):
            return f"'{c}' must be a string"
    for c in ("guard", "reason", "git_describe"):
        if row.get(c) is not None and not isinstance(row[c], str):
            return f"'{c}' must be a string or null"
    for c in ("shape", "params", "fingerprint_json"):
        if not isinstance(row[c], dict):
            return f"'{c}' must be an object"
    if not isinstance(row["accepted"], bool):
        return "'accepted' must be true or false"
    for c in _NUMBERS:
        if row[c] is not None and not _is_number(row[c]):
            return f"'{c}' must be a number or null"
    for c in ("started_at", "finished_at"):
        if not (_is_number(row[c]) and math.isfinite(row[c])):
            return f"'{c}' must be a finite number"
    return None


def _ms(e) -> float:
    return float(e.candidate_ms) if e.candidate_ms is not None else math.inf


def import_bundle(bundle: dict, state_dir, local_fingerprint: dict, ledger_path=None,
                  force: bool = False) -> dict:
    """Store a bundle's rows and winners here; see the module docstring for the rules."""
    from kernelsearch.dispatch import DispatchTable, table_path
    from kernelsearch.fingerprint import fingerprint_id

    check_bundle(bundle)
    theirs_id = bundle["fingerprint_id"]
    ours_id = fingerprint_id(local_fingerprint)
    foreign = theirs_id != ours_id
    if foreign and not force:
        diff = fingerprint_differences(bundle.get("fingerprint") or {}, local_fingerprint)
        raise FingerprintMismatch(
            f"bundle from {bundle.get('host', '?')} was measured on {theirs_id} ({_describe(bundle.get('fingerprint') or {})}); "
            f"this host is {ours_id} ({_describe(local_fingerprint)}): {'; '.join(diff) or 'fingerprint ids differ'}. "
            "Its timings say nothing about this device; refusing (use --force to import anyway: rows keep "
            "their fingerprint, winners go into this host's table marked imported_from)")
    report = {"fingerprint_id": theirs_id, "forced": foreign, "rows_added": 0, "rows_present": 0,
              "entries_added": 0, "entries_replaced": 0, "entries_kept": 0, "entries_refused": 0,
              "refused": [], "table": None}
    with _ledger(state_dir, ledger_path) as ledger:
        new = []
        for i, row in enumerate(bundle.get("attempts", [])):
            missing = [c for c in COLUMNS if c not in row and c != "git_describe"]
            if missing:
                raise BadBundle(f"ledger row without {', '.join(missing)}")
            problem = _row_problem(row)
            if problem:
                raise BadBundle(f"malformed bundle: ledger row {i}: {problem}")
            if _has_row(ledger, row) or any(_same_row(row, n) for n in new):
                report["rows_present"] += 1
            else:
                new.append(row)
        ledger.record(new)
        report["rows_added"] = len(new)
    dispatch = bundle.get("dispatch")
    if dispatch and dispatch.get("entries"):
        target_id = ours_id
        path = table_path(state_dir, target_id)
        with DispatchTable.updating(path) as table:
            report["table"] = str(_merge_entries(table, dispatch, bundle, state_dir, report, foreign,
                                                 theirs_id, target_id, local_fingerprint).save(path))
    return report


def _merge_entries(table, dispatch, bundle, state_dir, report, foreign, theirs_id, target_id,
                   local_fingerprint):
    """Add the bundle's winners to this host's table; a conflicting entry is replaced only by a
    faster one."""
    from kernelsearch.dispatch import Entry, EntryError

    index = {e.key: i for i, e in enumerate(table.entries)}
    source_dir = Path(state_dir) / "shared" / "sources"
    device = "cuda" if local_fingerprint.get("device") == "cuda" else "cpu"
    for raw in dispatch["entries"]:
        try:
            entry = Entry.from_json(raw)
        except EntryError as exc:
            raise BadBundle(str(exc)) from None
        src_path = (entry.source or {}).get("path")
        changes = {}
        if src_path:
            text = (bundle.get("sources") or {}).get(entry.source_hash)
            if not isinstance(text, str) or not isinstance(entry.source_hash, str) or \
                    not entry.source_hash.isalnum() or text_sha256(text) != entry.source_hash:
                _refuse(report, entry, "its source text is not in the bundle under its hash")
                continue
            source_dir.mkdir(parents=True, exist_ok=True)
            local = source_dir / f"{entry.source_hash}.py"
            if not local.is_file() or text_sha256(local.read_text()) != entry.source_hash:
                local.write_text(text)
            changes["source"] = {"path": str(local.resolve())}
        if foreign:
            changes["imported_from"] = theirs_id
        if changes:
            entry = entry.replace(**changes)
        k = entry.key
        current = table.entries[index[k]] if k in index else None
        if current is not None and _same_kernel(current, entry):
            report["entries_kept"] += 1
            continue
        if current is not None and _ms(entry) >= _ms(current):
            report["entries_kept"] += 1
            continue
        plan, why = _verified_plan(entry, device)
        if plan is None:
            _refuse(report, entry, why)
            continue
        entry = entry.replace(plan=plan)
        if k not in index:
            index[k] = len(table.entries)
            table.entries.append(entry)
            report["entries_added"] += 1
            continue
        table.entries[index[k]] = entry
        report["entries_replaced"] += 1
    fp = local_fingerprint
    table.data.update(fingerprint_id=target_id, fingerprint=fp, updated_at=time.time())
    table.data.setdefault("triton", fp.get("triton"))
    table.data.setdefault("torch", fp.get("torch"))
    return table


def _same_kernel(a, b) -> bool:
    return (a.source_hash, canonical(dict(a.params)), dict(a.source or {})) == \
           (b.source_hash, canonical(dict(b.params)), dict(b.source or {}))


def _refuse(report: dict, entry, why: str) -> None:
    report["entries_refused"] += 1
    report["refused"].append(f"{entry.kernel} {entry.dtype} {canonical(dict(entry.shape))}: {why}"[:300])


def _verified_plan(entry, device: str) -> tuple[dict | None, str]:
    """(the launch plan this host's harness verified for the entry, "") or (None, why not): its
    source, params, shape and dtype through every guard, checked, not timed. A bundle's plan and
    its word that the kernel is correct are never taken: a hand-written plan (another grid,
    the output aliased onto an input) or a wrong kernel would run in the user's model."""
    from kernelsearch.dispatch import source_text
    from kernelsearch.harness.verify import evaluate
    from kernelsearch.specs import SPECS

    spec = SPECS.get(entry.kernel)
    if spec is None:
        return None, f"unknown kernel {entry.kernel!r}"
    shape = dict(entry.shape)
    problem = spec.valid_shape(shape)
    if problem:
        return None, problem
    try:
        found = source_text(dict(entry.source or {}))
    except (OSError, UnicodeDecodeError):
        found = None
    if found is None or text_sha256(found[0]) != entry.source_hash:
        return None, "its source is not here with its hash (a built-in template of another version?)"
    verdict = evaluate(entry.kernel, found[1], dict(entry.params), device=device, shapes=[shape],
                       dtype=entry.dtype, time_it=False)
    plans = [r.plan for r in verdict.shapes if not r.random and r.plan]
    if not verdict.accepted or not plans:
        return None, f"rejected by this host's harness ({verdict.guard}: {verdict.reason})"
    return plans[0], ""


def _same_row(a: dict, b: dict) -> bool:
    keys = ("run_id", "kernel", "dtype", "source_hash", "fingerprint", "code_version", "started_at")
    return all(a[k] == b[k] for k in keys) and canonical(a["shape"]) == canonical(b["shape"]) \
        and canonical(a["params"]) == canonical(b["params"])
