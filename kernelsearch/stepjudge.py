"""Judge in the step: re-time a shape's leading configs inside the step that calls them.

The harness times one kernel alone (a graph of up to 10 calls, L2 flushed before each replay).
Inside a model's step the same kernel runs after another kernel and before a third, with PDL
overlapping their edges, and two configs the harness times within 1% can be 14-16% apart there
(BENCHMARKS.md 10h: the batch-32 O projection, a split-K tile against a swap-AB one). This
module is the second half of the one judge: it changes a dispatch table only among configs the
harness already verified and kept, and only where the step they run in is faster.

For each table entry the step routes (`calls`: the (kernel, shape, dtype) the step makes;
largest harness time first), the alternatives are:
  - up to `top` other configs of the entry's own source (same source hash) that the ledger holds
    as accepted on this fingerprint at this shape, kept against stock by the harness's keep rule,
    and within `within` of the entry's harness time (their launch plans made again by the
    harness, every guard but not timed, as for a winner a search resumes from the ledger);
  - stock: the entry removed, so that the step runs what it runs without it (for a fused kernel,
    the unfused calls and their own entries).
The step is built once per table (`make_step(table) -> fn`, fn() runs one step and returns its
output), checked (`check(out) -> None or what is wrong`; an alternative that fails is out), then
timed with the harness's timer (`kernelsearch.harness.timing.time_calls`: warm-up, one CUDA
graph, L2 flushed before each replay, events, median of the replays), the current table and its
alternatives interleaved, `rounds` rounds in a rotating order. An alternative replaces the entry
only when its median over the rounds beats the current table's by more than the current table's
own spread across rounds (at least MIN_BAND): the harness's keep rule (`timing.keep`), applied
to the step. Decisions are made one entry at a time on the table as it stands (coordinate
descent). On the CPU the timer is the interpreter's (not a speed): every step is built, checked
and timed, and nothing is changed.

The result carries each entry's evidence (the step's median under each alternative); `write`
merges the changes into the table file under its lock, an entry replaced or removed only if it
is still the one judged, and records the evidence: in the entry (`step`) and, for removed
entries too, in the table's `step_judged` list.
"""
from __future__ import annotations

import json
import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from kernelsearch.entry import Entry, _thaw

# The harness ranks close configs unlike the step (two within 1% alone, 14-16% apart in the
# step; a batch-1 attention config 12% faster alone, no faster in the step): the judge looks
# well past the harness's noise for its alternatives, and the step decides.
TOP = 3              # ledger configs tried a shape, besides the entry's own and stock
WITHIN = 0.25        # ... those within 25% of the entry's harness time
ROUNDS = 3           # timings of each table a decision
MIN_BAND = 0.003     # a step 0.3% faster is within what back-to-back graphs of one step spread
STOCK = "stock (entry removed)"


def _canonical(value) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _dims(shape) -> dict:
    return {k: v for k, v in dict(shape).items() if k != "dtype"}


def _finite(x) -> bool:
    return isinstance(x, int | float) and math.isfinite(x)


@dataclass
class Alternative:
    label: str                 # "current", STOCK, or the params as JSON
    entry: Entry | None        # what the table holds at the shape (None: no entry, stock runs)
    harness_ms: float | None = None
    step_ms: list[float] = field(default_factory=list)   # one median per round
    problem: str | None = None  # why it was not timed (plan, build, check)

    @property
    def median_ms(self) -> float:
        return statistics.median(self.step_ms) if self.step_ms else math.inf

    def to_json(self) -> dict:
        return {"label": self.label, "harness_ms": self.harness_ms,
                "step_ms": [round(t, 6) for t in self.step_ms],
                "median_ms": round(self.median_ms, 6) if self.step_ms else None,
                **({"problem": self.problem} if self.problem else {})}


@dataclass
class Decision:
    kernel: str
    dtype: str
    shape: dict
    before: Entry
    after: Entry | None        # the entry the table holds now (None: removed, stock runs)
    outcome: str               # "kept", "replaced", "removed", "not judged: ..."
    band: float | None = None
    alternatives: list[Alternative] = field(default_factory=list)
    method: str = ""

    @property
    def changed(self) -> bool:
        return self.outcome in ("replaced", "removed")

    def evidence(self) -> dict:
        return {"outcome": self.outcome, "method": self.method, "band": self.band,
                "judged_at": round(time.time(), 3), "kernel": self.kernel, "dtype": self.dtype,
                "shape": dict(self.shape), "before_params": _thaw(self.before.params),
                "after_params": None if self.after is None else _thaw(self.after.params),
                "alternatives": [a.to_json() for a in self.alternatives]}

    def describe(self) -> str:
        """The outcome and each alternative's step median (the progress line after the name)."""
        timed = [a for a in self.alternatives if a.step_ms]
        base = next((a.median_ms for a in timed if a.label == "current"), math.inf)
        parts = []
        for a in self.alternatives:
            if a.step_ms:
                rel = f" ({100 * (a.median_ms / base - 1):+.2f}%)" if a.label != "current" and math.isfinite(base) else ""
                parts.append(f"{a.label} {a.median_ms:.4f} ms{rel}")
            else:
                parts.append(f"{a.label}: {a.problem}")
        band = f", band {100 * self.band:.2f}%" if self.band is not None else ""
        return f"{self.outcome}{band}; " + "; ".join(parts)


@dataclass
class JudgeResult:
    table: object              # the DispatchTable as judged
    decisions: list[Decision]
    method: str
    changes_applied: bool      # False where the timer is not a speed (the CPU interpreter)
    summary: dict | None = None  # the step with the table as given against as judged
    notes: list[str] = field(default_factory=list)   # e.g. a ledger that could not be read

    def to_json(self) -> dict:
        return {"method": self.method, "changes_applied": self.changes_applied,
                "decisions": [d.evidence() for d in self.decisions], "summary": self.summary,
                "notes": list(self.notes)}


def _is_speed(method: str) -> bool:
    return method.startswith("cuda")


def leading(ledger_path, entry: Entry, fingerprint_id: str, *, top: int = TOP,
            within: float = WITHIN) -> list[dict]:
    """The ledger's accepted configs of `entry`'s source at its shape on this fingerprint that the
    harness timed against stock and kept there, within `within` of the entry's harness time,
    fastest first, the entry's own params left out: [{"params", "candidate_ms", "stock_ms",
    "noise_band"}]. The ledger is only read (`ledger.read_accepted`); sqlite3.Error where it
    cannot be."""
    from kernelsearch.harness.timing import keep
    from kernelsearch.ledger import read_accepted
    from kernelsearch.search import DEFAULT_NOISE_BAND

    want_shape = _canonical(_dims(entry.shape))
    own = _canonical(_thaw(entry.params))
    latest: dict[str, dict] = {}
    for row in read_accepted(ledger_path, kernel=entry.kernel, fingerprint=fingerprint_id,
                             dtype=entry.dtype, source_hash=entry.source_hash or ""):
        if not (isinstance(row["params"], dict) and isinstance(row["shape"], dict)
                and _canonical(_dims(row["shape"])) == want_shape and _finite(row["candidate_ms"])
                and row["candidate_ms"] > 0 and _finite(row["stock_ms"]) and row["stock_ms"] > 0):
            continue
        key = _canonical(row["params"])
        if key != own:
            latest[key] = row          # rows come in id order: the latest attempt wins
    best = entry.candidate_ms if _finite(entry.candidate_ms) else min(
        (r["candidate_ms"] for r in latest.values()), default=math.inf)
    out = []
    for row in latest.values():
        band = row["noise_band"] if _finite(row["noise_band"]) else DEFAULT_NOISE_BAND
        if not keep(row["candidate_ms"], row["stock_ms"], band):
            continue
        if row["candidate_ms"] > best * (1.0 + within):
            continue
        out.append({"params": row["params"], "candidate_ms": row["candidate_ms"], "stock_ms": row["stock_ms"],
                    "noise_band": row["noise_band"] if _finite(row["noise_band"]) else None})
    out.sort(key=lambda r: r["candidate_ms"])
    return out[:max(0, int(top))]


def _source_path(entry: Entry):
    from kernelsearch.dispatch import source_text

    found = source_text(_thaw(entry.source)) if entry.source else None
    return None if found is None else found[1]


def _alternative_entry(entry: Entry, row: dict, device: str) -> tuple[Entry | None, str | None]:
    from kernelsearch.harness.verify import verified_plan

    path = _source_path(entry)
    if path is None:
        return None, "source not found"
    # verified here, not planned on the row's word: a ledger row's `accepted` is no proof (a
    # bundle's rows are stored as given), and what is timed in the step runs unchecked on the GPU
    plan, why = verified_plan(entry.kernel, path, _dims(entry.shape), entry.dtype, row["params"], device,
                              source_hash=entry.source_hash)
    if plan is None:
        return None, why
    speedup = row["stock_ms"] / row["candidate_ms"]
    try:
        alt = entry.replace(params=row["params"], plan=plan, candidate_ms=row["candidate_ms"],
                            stock_ms=row["stock_ms"], noise_band=row["noise_band"],
                            speedup=round(speedup, 4))
    except Exception as exc:
        return None, f"{type(exc).__name__}: {exc}"
    data = alt.to_json()
    data.pop("step", None)     # evidence belongs to the entry it was measured for
    return Entry.from_json(data), None


def with_entry(table, old: Entry, new: Entry | None):
    """A copy of `table` with `old` replaced by `new` (None: removed); loaded plans shared."""

    entries = []
    for e in table.entries:
        if e is old:
            if new is not None:
                entries.append(new)
        else:
            entries.append(e)
    out = type(table)({**table.data, "entries": entries}, table.path)
    out._launch = table._launch       # keyed by source, hash, params, shape and dtype
    out._device_ok = table._device_ok
    return out


def _time_ms(fn, device: str, reps: int | None):
    from kernelsearch.harness.timing import time_calls

    t = time_calls(fn, device, reps)
    return t.median_ms, t.method


def judge(table, *, make_step: Callable, calls, device: str, ledger_path=None, top: int = TOP,
          within: float = WITHIN, rounds: int = ROUNDS, reps: int | None = None,
          check: Callable | None = None, timer: Callable | None = None, deadline: float | None = None,
          progress: Callable[[str], None] = lambda line: None) -> JudgeResult:
    """See the module docstring. `calls`: [(kernel, shape dict, dtype name)] the step makes;
    `deadline` (time.monotonic()): no entry is started after it; `timer(fn) -> (median ms,
    method)` replaces the harness's timer (tests only)."""
    import sqlite3

    from kernelsearch.harness.timing import keep

    timer = timer or (lambda fn: _time_ms(fn, device, reps))
    rounds = max(1, int(rounds))
    fp_id = table.data.get("fingerprint_id")
    ledger_path = Path(ledger_path) if ledger_path is not None and Path(ledger_path).exists() else None
    notes: list[str] = []
    seen, judged = set(), []
    for kernel, shape, dtype in calls:
        entry = table.lookup(kernel, shape, dtype)
        if entry is None or entry.key in seen:
            continue
        seen.add(entry.key)
        judged.append(entry)
    judged.sort(key=lambda e: -(e.candidate_ms if _finite(e.candidate_ms) else 0.0))
    start = table
    decisions: list[Decision] = []
    method = ""
    for n, entry in enumerate(judged, 1):
        # the table as it stands holds this very entry (earlier decisions touch other keys)
        entry = table.lookup(entry.kernel, _dims(entry.shape), entry.dtype)
        head = f"step judge {n}/{len(judged)} {entry.kernel} " + " ".join(
            f"{k}={v}" for k, v in _dims(entry.shape).items())

        def not_judged(why: str, alternatives=()):
            decisions.append(Decision(entry.kernel, entry.dtype, _dims(entry.shape), entry, entry,
                                      f"not judged: {why}", alternatives=list(alternatives)))
            progress(f"{head}: {decisions[-1].outcome}")

        if deadline is not None and time.monotonic() > deadline:
            not_judged("time budget")
            continue
        if entry.range is not None:
            not_judged("an entry with a range (one plan a shape)")
            continue
        if not table.usable(entry):
            not_judged("the entry does not route (source changed or plan invalid)")
            continue
        alts = [Alternative("current", entry, entry.candidate_ms)]
        rows = []
        if ledger_path is not None:
            try:
                rows = leading(ledger_path, entry, fp_id, top=top, within=within)
            except (sqlite3.Error, OSError) as exc:   # stock is still tried
                note = f"ledger {ledger_path} not read: {type(exc).__name__}: {exc}"
                if note not in notes:
                    notes.append(note)
                    progress(f"step judge: {note}")
        for row in rows:
            alt, problem = _alternative_entry(entry, row, device)
            alts.append(Alternative(_canonical(row["params"]), alt, row["candidate_ms"], problem=problem))
        alts.append(Alternative(STOCK, None, entry.stock_ms))
        progress(f"{head}: {len(alts) - 1} alternative(s) ({len(rows)} from the ledger, and stock)")
        steps = {}
        for a in alts:
            if a.problem:
                continue
            try:
                t = table if a.label == "current" else with_entry(table, entry, a.entry)
                fn = make_step(t)
                out = fn()
                problem = check(out) if check is not None else None
            except Exception as exc:
                problem = f"{type(exc).__name__}: {str(exc)[:200]}"
            if problem:
                a.problem = f"step check: {problem}"
                continue
            steps[a.label] = (t, fn)
        if "current" not in steps:
            not_judged(f"the current step fails ({alts[0].problem})", alts)
            continue
        order = [a for a in alts if a.label in steps]
        for r in range(rounds):
            shift = r % len(order)
            for a in order[shift:] + order[:shift]:
                if a.problem:
                    continue
                try:
                    ms, method = timer(steps[a.label][1])
                except Exception as exc:   # e.g. a step that cannot be captured: out
                    a.problem = f"timing: {type(exc).__name__}: {str(exc)[:200]}"
                    a.step_ms.clear()
                    continue
                a.step_ms.append(ms)
        current = alts[0]
        if current.problem:
            not_judged(f"the current step fails ({current.problem})", alts)
            continue
        base = current.median_ms
        band = max(MIN_BAND, ((max(current.step_ms) - min(current.step_ms)) / min(current.step_ms))
                   if current.step_ms and min(current.step_ms) > 0 else math.inf)
        rivals = [a for a in order if a.label != "current" and not a.problem and math.isfinite(a.median_ms)]
        best = min(rivals, key=lambda a: a.median_ms, default=None)
        outcome, after = "kept", entry
        if best is not None and keep(best.median_ms, base, band):
            if _is_speed(method):
                outcome = "removed" if best.entry is None else "replaced"
                after = best.entry
                table = steps[best.label][0]
            else:
                outcome = f"kept ({best.label} timed faster, but the times are {method})"
        d = Decision(entry.kernel, entry.dtype, _dims(entry.shape), entry, after, outcome,
                     band=band, alternatives=alts, method=method)
        if after is not None:
            evidence = d.evidence()
            stamped = after.replace(step=evidence)
            table = with_entry(table, after, stamped)
            d.after = stamped
        decisions.append(d)
        progress(f"{head}: {d.describe()}")
    result = JudgeResult(table, decisions, method, _is_speed(method), notes=notes)
    if any(d.changed for d in decisions):
        before, after = Alternative("as given", None), Alternative("as judged", None)
        try:
            fn_before, fn_after = make_step(start), make_step(table)
            for r in range(rounds):
                for a, fn in ((before, fn_before), (after, fn_after))[::(1 if r % 2 == 0 else -1)]:
                    a.step_ms.append(timer(fn)[0])
        except Exception as exc:   # the decisions stand; only their sum is not measured
            result.summary = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
            return result
        result.summary = {"as_given": before.to_json(), "as_judged": after.to_json(),
                          "speedup": before.median_ms / after.median_ms}
        progress(f"step judge: the step as given {before.median_ms:.4f} ms, as judged "
                 f"{after.median_ms:.4f} ms ({before.median_ms / after.median_ms:.3f}x)")
    return result


def write(path, result: JudgeResult) -> tuple[int, list[str]]:
    """Merge `result`'s decisions into the table file at `path` under its lock. An entry is
    replaced, removed or stamped only if the file still holds the entry that was judged (same
    key, source hash and params). -> (entries written, notes on what was left alone)."""
    import errno

    from kernelsearch.dispatch import DispatchTable

    path = Path(path)
    if path.is_symlink():   # saving replaces the name: the link would become a copy, its target stale
        raise OSError(errno.ELOOP, "a symbolic link: the judged table is not written through it", str(path))
    if not path.exists():   # the table it came from is gone: nothing to merge into
        raise FileNotFoundError(errno.ENOENT, "no such file (removed since it was loaded)", str(path))
    notes, written = [], 0
    with DispatchTable.updating(path) as table:
        log = table.data.get("step_judged")
        log = list(log) if isinstance(log, list) else []
        for d in result.decisions:
            if d.outcome.startswith("not judged"):
                continue
            idx = next((i for i, e in enumerate(table.entries)
                        if e.key == d.before.key and e.source_hash == d.before.source_hash
                        and _canonical(_thaw(e.params)) == _canonical(_thaw(d.before.params))), None)
            if idx is None:
                notes.append(f"{d.kernel} {d.shape}: changed in {path} since it was judged; left as it is")
                continue
            if d.after is None:
                del table.entries[idx]
            else:
                table.entries[idx] = d.after
            log.append(d.evidence())
            written += 1
        table.data["step_judged"] = log[-200:]
        table.save(path)
    return written, notes
