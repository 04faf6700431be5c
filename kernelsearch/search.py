"""The inner loop: propose -> verify + time (harness, in a child) -> record -> keep | revert -> dispatch.

For each shape of the sweep a strategy searches the template's SPACE for the fastest point
at that shape. A point is always measured on every shape still unknown for it, in ONE child
run: the child's start-up (torch import, CUDA context, compile) costs far more than timing a
few more shapes, and the other shapes' strategies then find it already measured.

Every attempt is a ledger row, written here in the parent (executors only run jobs). A
winner is kept for a shape only when faster than stock by more than the noise band
(`kernelsearch.harness.timing.keep`, the fixed metric); the dispatch table lists only winners.

Executor contract (for worker pools, Ray): `map(jobs) -> verdicts` in order, where a job is a
JSON-ready dict of `kernelsearch.harness.evaluate` keyword arguments and a verdict is a
`Verdict` (or its JSON). `width` (optional attribute): jobs worth sending at once.
"""
from __future__ import annotations

import importlib
import importlib.util
import json
import math
import os
import random
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from kernelsearch.entry import text_sha256
from kernelsearch.ledger import Ledger, canonical, code_version, file_hash, git_describe
from kernelsearch.proposers import REGISTRY, allowed_from_configs, key
from kernelsearch.specs import get_spec

BUDGETS = {"small": 4, "medium": 32, "large": 128, "all": 10**9}
DEFAULT_NOISE_BAND = 0.02  # used when the harness could not measure one


class SequentialExecutor:
    """Runs jobs one after another in this process (the harness keeps one executor per device
    and one session per candidate file between jobs)."""

    width = 1

    def map(self, jobs: list[dict]) -> list:
        from kernelsearch.harness import evaluate

        return [evaluate(**job) for job in jobs]


@dataclass
class Outcome:
    """One (candidate, shape) result as the loop uses it."""
    accepted: bool
    candidate_ms: float
    stock_ms: float
    noise_band: float | None
    guard: str | None
    reason: str
    flops: float = 0.0
    bytes: float = 0.0
    plan: dict | None = None    # the launch plan verified at this shape (None when resumed)

    @property
    def time_ms(self) -> float:
        return self.candidate_ms if self.accepted else math.inf


@dataclass
class Candidate:
    """What is measured: a source file (template or agent-written) plus params."""
    source_path: Path
    source_hash: str
    params: dict
    source_ref: dict  # dispatch's "source": {"module": ...} or {"path": ...}

    @property
    def ident(self) -> str:
        return f"{self.source_hash}:{key(self.params)}"


@dataclass
class ShapeReport:
    shape: dict
    dtype: str
    stock_ms: float = math.inf
    best: dict | None = None          # {"params", "source", "candidate_ms", "stock_ms", "noise_band"}
    kept: bool = False
    speedup: float | None = None
    bound: str = "unknown"
    pct_of_ceiling: float = 0.0
    attempts: int = 0
    verdicts: dict = field(default_factory=dict)   # "accepted" | guard -> count

    def to_json(self) -> dict:
        d = dict(self.__dict__)
        d["stock_ms"] = _json_float(self.stock_ms)
        return d


@dataclass
class SearchResult:
    kernel: str
    device: str
    strategy: str
    fingerprint_id: str
    run_id: str
    shapes: list[ShapeReport]
    evaluations: int               # child runs started (jobs), resumed ones excluded
    resumed: int                   # (candidate, shape) pairs taken from the ledger
    table_path: str | None
    ceilings: dict | None
    elapsed_s: float
    stopped: str | None = None     # why the search ended before its budget (its time limit)
    unfinished: list = field(default_factory=list)   # shapes whose strategy did not finish

    def to_json(self) -> dict:
        return {"kernel": self.kernel, "device": self.device, "strategy": self.strategy,
                "fingerprint_id": self.fingerprint_id, "run_id": self.run_id,
                "evaluations": self.evaluations, "resumed": self.resumed,
                "table_path": self.table_path, "ceilings": self.ceilings,
                "elapsed_s": round(self.elapsed_s, 3), "stopped": self.stopped,
                "unfinished": self.unfinished, "shapes": [s.to_json() for s in self.shapes]}


class OutOfTime(Exception):
    """A search's time limit passed: the evaluations not started are not run."""


def _json_float(x):
    return x if x is not None and math.isfinite(x) else None


def _shape_key(shape: dict) -> str:
    return canonical({k: v for k, v in shape.items() if k != "dtype"})


def parse_budget(text) -> int:
    """A number or small|medium|large|all. A number beyond `all` is all (a budget is recorded in
    the ledger, whose SQLite integers stop at 2**63 - 1)."""
    n = text if isinstance(text, int) else BUDGETS[text] if text in BUDGETS else int(text)
    return min(n, BUDGETS["all"])


def template_candidate(kernel: str, source_path: Path | None = None, device: str = "cpu",
                       shapes: list[dict] | None = None, dtype: str | None = None, timeout_s=None):
    """(SPACE, validity rule, Candidate factory) for the built-in template (or a given file).
    SPACE and CONFIGS come from the file's literals or from its sandboxed import (the harness's
    Session): the file is never imported here."""
    from kernelsearch.harness.verify import session
    from kernelsearch.kernels import TEMPLATES, template_path

    if source_path is None:
        source_path = template_path(kernel)
        ref = {"module": TEMPLATES[kernel]}
    else:
        source_path = Path(source_path).resolve()
        ref = {"path": str(source_path)}
    s = session(kernel, source_path, device, shapes, dtype, timeout_s)
    s.prepare()
    s.warm()  # every CONFIGS entry's kernels start compiling in parallel (CUDA)
    space = dict(s.space or {})
    if not space and s.configs:
        # CONFIGS alone (no SPACE): they are the points searched. Without this the space was
        # the one empty point, which no config matches: nothing searched, "0 child runs"
        for config in s.configs:
            for name, value in config.items():
                values = space.setdefault(name, [])
                if value not in values:
                    values.append(value)
    allowed = allowed_from_configs(s.configs)
    # the bytes the session read and planned (a file replaced since is not this candidate: every
    # job names this digest and the harness rejects a file that no longer has it)
    digest = text_sha256(s.text) if s.text else file_hash(source_path)

    def make(params: dict) -> Candidate:
        return Candidate(Path(source_path), digest, dict(params), ref)

    return space, allowed, make


class Loop:
    """State of one search run: memo of outcomes, ledger, executor. Strategies drive it."""

    def __init__(self, *, kernel, device, shapes, dtype, ledger: Ledger, executor, fingerprint: dict,
                 fingerprint_id: str, strategy: str, resume: bool, timeout_s, progress,
                 deadline: float | None = None):
        self.kernel, self.device, self.shapes, self.dtype = kernel, device, shapes, dtype
        self.ledger, self.executor = ledger, executor
        self.fingerprint, self.fingerprint_id = fingerprint, fingerprint_id
        self.strategy, self.resume, self.timeout_s = strategy, resume, timeout_s
        self.progress = progress
        self.deadline = deadline                           # time.monotonic() past which nothing starts
        self.primary_dtype = get_spec(kernel).primary_dtype(device)
        self.code_version = code_version()
        self.git = git_describe()
        self.run_id = time.strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:6]
        self.memo: dict[str, dict[str, Outcome]] = {}     # candidate ident -> shape key -> outcome
        self.candidates: dict[str, Candidate] = {}
        self.dtypes: dict[str, str] = {}                   # shape key -> dtype measured
        self.evaluations = 0
        self.resumed = 0
        self.started = time.time()

    # --- measuring ------------------------------------------------------------------------
    def _dtype_of(self, shape: dict) -> str:
        # the harness's rule: an explicit dtype, else the shape's pinned one, else the primary
        return self.dtype or shape.get("dtype") or self.primary_dtype

    def _from_ledger(self, cand: Candidate, shape: dict) -> Outcome | None:
        row = self.ledger.lookup(kernel=self.kernel, dtype=self._dtype_of(shape), shape=shape,
                                 source_hash=cand.source_hash, params=cand.params,
                                 fingerprint=self.fingerprint_id, code_version=self.code_version)
        if row is None:
            return None
        return Outcome(row["accepted"], row["candidate_ms"], row["stock_ms"], row["noise_band"],
                       row["guard"], row["reason"] or "", row["flops"] or 0, row["bytes"] or 0)

    def measure(self, cands: list[Candidate]) -> None:
        """Make sure every candidate has an outcome on every shape (one job per candidate)."""
        jobs, owners = [], []
        for cand in cands:
            self.candidates[cand.ident] = cand
            known = self.memo.setdefault(cand.ident, {})
            missing = []
            for shape in self.shapes:
                sk = _shape_key(shape)
                if sk in known:
                    continue
                if self.resume:
                    prior = self._from_ledger(cand, shape)
                    if prior is not None:
                        known[sk] = prior
                        self.resumed += 1
                        continue
                missing.append(shape)
            if missing:
                jobs.append({"kernel": self.kernel, "source_path": str(cand.source_path),
                             "params": cand.params, "device": self.device, "shapes": missing,
                             "dtype": self.dtype, "timeout_s": self.timeout_s, "time_it": True,
                             "source_hash": cand.source_hash})
                owners.append((cand, missing))
        width = max(1, int(getattr(self.executor, "width", 1)))
        for i in range(0, len(jobs), width):
            if self.deadline is not None and time.monotonic() >= self.deadline:
                raise OutOfTime(f"{len(jobs) - i} evaluation(s) not started")
            started = time.time()
            verdicts = self.executor.map(jobs[i:i + width])
            for (cand, missing), verdict in zip(owners[i:i + width], verdicts):
                self.record(cand, missing, verdict, started)

    def record(self, cand: Candidate, shapes: list[dict], verdict, started: float) -> None:
        """Turn one verdict into outcomes and ledger rows (one per shape asked for)."""
        from kernelsearch.harness.verdict import Verdict

        if not isinstance(verdict, Verdict):
            verdict = Verdict.from_json(verdict)
        self.evaluations += 1
        by_shape = {_shape_key(s.shape): s for s in verdict.shapes}
        rows = []
        for shape in shapes:
            sk = _shape_key(shape)
            sr = by_shape.get(sk)
            ok = bool(verdict.accepted and sr is not None and sr.status == "ok"
                      and math.isfinite(sr.candidate_ms))
            out = Outcome(ok, sr.candidate_ms if sr else math.inf, sr.stock_ms if sr else math.inf,
                          sr.noise_band if sr else None, None if ok else (verdict.guard or "timing"),
                          verdict.reason if not ok else "", sr.flops if sr else 0, sr.bytes if sr else 0,
                          sr.plan if (sr and ok) else None)
            self.memo[cand.ident][sk] = out
            dtype = sr.dtype if sr else self._dtype_of(shape)
            self.dtypes[sk] = dtype
            rows.append({"run_id": self.run_id, "kernel": self.kernel, "dtype": dtype,
                         "shape": shape,
                         "strategy": self.strategy, "source": json.dumps(cand.source_ref),
                         "source_hash": cand.source_hash, "params": cand.params,
                         "accepted": ok, "guard": out.guard, "reason": out.reason,
                         "candidate_ms": out.candidate_ms, "stock_ms": out.stock_ms,
                         "noise_band": out.noise_band, "flops": out.flops, "bytes": out.bytes,
                         "fingerprint": self.fingerprint_id, "fingerprint_json": self.fingerprint,
                         "code_version": self.code_version, "git_describe": self.git,
                         "started_at": started, "finished_at": time.time()})
        self.ledger.record(rows)
        best = min((o.time_ms for o in self.memo[cand.ident].values()), default=math.inf)
        status = "accepted" if verdict.accepted else f"rejected by {verdict.guard}: {verdict.reason[:100]}"
        self.progress(f"[{self.evaluations} {time.time() - self.started:.1f}s] {cand.source_path.name} "
                      f"{key(cand.params)} -> {status}"
                      + (f" (fastest shape {best:.4f} ms)" if math.isfinite(best) else ""))

    def objective(self, make: Callable[[dict], Candidate], shape: dict):
        """The strategy's evaluate for one shape: points -> candidate_ms at that shape (inf = failed)."""
        sk = _shape_key(shape)

        def evaluate(points: list[dict]) -> list[float]:
            cands = [make(p) for p in points]
            self.measure(cands)
            return [self.memo[c.ident][sk].time_ms for c in cands]

        return evaluate

    def best_so_far(self) -> list[dict]:
        """Per shape: stock time and the fastest accepted candidate so far (for the agent)."""
        rows = []
        for shape in self.shapes:
            sk = _shape_key(shape)
            outs = [(o, ident) for ident, m in self.memo.items() if (o := m.get(sk))]
            ok = [(o, ident) for o, ident in outs if o.accepted]
            best = min(ok, key=lambda x: x[0].candidate_ms) if ok else None
            stock = [o.stock_ms for o, _ in outs if math.isfinite(o.stock_ms)]
            rows.append({"shape": shape, "stock_ms": min(stock) if stock else None,
                         "best_ms": best[0].candidate_ms if best else None,
                         "best_source_hash": self.candidates[best[1]].source_hash if best else None,
                         "best_params": self.candidates[best[1]].params if best else None})
        return rows

    # --- choosing ---------------------------------------------------------------------------
    def report(self, ceilings: dict | None) -> list[ShapeReport]:
        from kernelsearch.harness.timing import keep
        from kernelsearch.roofline import classify

        reports = []
        for shape in self.shapes:
            sk = _shape_key(shape)
            rep = ShapeReport(shape=shape, dtype=self.dtypes.get(sk, self._dtype_of(shape)))
            best_ident, best_out = None, None
            stock = []
            flops = bytes_ = 0   # the shape's work: the same in every outcome that reports it
            for ident, outcomes in self.memo.items():
                out = outcomes.get(sk)
                if out is None:
                    continue
                rep.attempts += 1
                label = "accepted" if out.accepted else (out.guard or "unknown")
                rep.verdicts[label] = rep.verdicts.get(label, 0) + 1
                if math.isfinite(out.stock_ms):
                    stock.append(out.stock_ms)
                if out.flops or out.bytes:
                    flops, bytes_ = out.flops, out.bytes
                if out.accepted and (best_out is None or out.candidate_ms < best_out.candidate_ms):
                    best_ident, best_out = ident, out
            rep.stock_ms = sorted(stock)[len(stock) // 2] if stock else math.inf
            if best_out is not None:
                cand = self.candidates[best_ident]
                # an unmeasurable band (inf; NULL once in the ledger) counts as the default one,
                # so that a resumed run decides as the run that measured it did
                band = best_out.noise_band
                if band is None or not math.isfinite(band):
                    band = DEFAULT_NOISE_BAND
                # paired comparison: the winner's own stock timing, taken in the same child;
                # where that failed, the shape's median stock time. With no stock time at all
                # keep() keeps nothing: a kernel is kept only where it is shown faster than stock
                against = best_out.stock_ms if math.isfinite(best_out.stock_ms) else rep.stock_ms
                rep.kept = keep(best_out.candidate_ms, against, band)
                rep.speedup = against / best_out.candidate_ms if math.isfinite(against) else None
                rep.best = {"params": cand.params, "source": cand.source_ref,
                            "source_hash": cand.source_hash, "candidate_ms": best_out.candidate_ms,
                            "stock_ms": _json_float(against),
                            "noise_band": _json_float(best_out.noise_band), "plan": best_out.plan,
                            "source_path": str(cand.source_path)}
            if ceilings and (flops or bytes_):
                time_ms = rep.best["candidate_ms"] if rep.kept else rep.stock_ms
                rep.bound, rep.pct_of_ceiling = classify(flops, bytes_, time_ms, ceilings)
                rep.pct_of_ceiling = round(rep.pct_of_ceiling, 1)
            reports.append(rep)
        return reports


def write_dispatch(path: Path, kernel: str, fingerprint: dict, fingerprint_id: str,
                   reports: list[ShapeReport], device: str = "cpu") -> Path:
    """Merge this run's winners into the device's table: this kernel's swept shapes are replaced."""
    from kernelsearch.dispatch import DispatchTable

    with DispatchTable.updating(path) as table:
        return _merge_winners(table, kernel, fingerprint, fingerprint_id, reports, device).save(path)


def _merge_winners(table, kernel: str, fingerprint: dict, fingerprint_id: str,
                   reports: list[ShapeReport], device: str = "cpu"):
    import torch
    import triton

    from kernelsearch.dispatch import DispatchTable, Entry

    if table.data.get("fingerprint_id") not in (None, fingerprint_id):
        table = DispatchTable.empty()
    swept = {(r.dtype, _shape_key(r.shape)) for r in reports}
    table.entries = [e for e in table.entries
                     if not (e.kernel == kernel and (e.dtype, canonical(dict(e.shape))) in swept)]
    against = get_spec(kernel).stock_name
    for r in reports:
        if r.kept:
            b = r.best
            plan = b.get("plan")
            if plan is None:  # resumed from the ledger: verified again here, not planned on its word
                from kernelsearch.harness.verify import verified_plan

                plan, _ = verified_plan(kernel, b["source_path"], r.shape, r.dtype, b["params"], device,
                                        source_hash=b["source_hash"])
            if plan is None:
                continue
            table.entries.append(Entry.make(
                plan=plan, kernel=kernel, dtype=r.dtype,
                shape={k: v for k, v in r.shape.items() if k != "dtype"},
                source=b["source"], source_hash=b["source_hash"], params=b["params"],
                candidate_ms=b["candidate_ms"], stock_ms=b["stock_ms"],
                speedup=round(r.speedup, 4) if r.speedup else None, against=against,
                noise_band=b["noise_band"]))
    table.data.update(fingerprint_id=fingerprint_id, fingerprint=fingerprint,
                      triton=triton.__version__, torch=torch.__version__, updated_at=time.time())
    return table


def search(kernel: str, *, state_dir, strategy: str = "grid", budget=32, device: str = "cpu",
           dtype: str | None = None, shapes: list[dict] | None = None, resume: bool = False,
           seed: int = 0, executor=None, ledger_path=None, dispatch_path=None,
           timeout_s: float | None = None, source_path=None, ceilings: dict | None = None,
           agent=None, time_limit_s: float | None = None,
           progress: Callable[[str], None] = lambda line: None) -> SearchResult:
    """Run one search; see the module docstring. `agent` is an AgentConfig for strategy "agent".

    `time_limit_s` bounds the search's wall time from this call on: once it has passed, no
    evaluation starts (one already running finishes). Shapes whose strategy finished are
    written and recorded as searched; a shape cut short adds its winner to the table only
    where it is kept against stock (an entry it has is left as it was otherwise), and is not
    recorded as searched, so that a later run (`resume`) goes on with it."""
    deadline = None if time_limit_s is None else time.monotonic() + max(0.0, float(time_limit_s))
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton
    from kernelsearch.fingerprint import collect, fingerprint_id
    from kernelsearch.roofline import load_or_measure

    state_dir = Path(state_dir)
    spec = get_spec(kernel)
    shapes = shapes or spec.shapes(device)
    if device.startswith("cuda"):
        from kernelsearch.harness import runner

        runner.executor(device)  # starts now (torch, CUDA, compile workers) while we get ready
    fp = collect(device)
    fp_id = fingerprint_id(fp)
    from kernelsearch.dispatch import DispatchTable, table_path

    out = Path(dispatch_path) if dispatch_path else table_path(state_dir, fp_id)
    if out.exists():
        DispatchTable.load(out)   # TableError now, not after the search when the winners are merged
    budget = parse_budget(budget)
    # LedgerError now (not a ledger, read-only), not after the roofline and the first evaluation
    ledger = Ledger(ledger_path or state_dir / "ledger.sqlite")
    if ceilings is None:
        progress(f"roofline: ceilings for {fp_id} (measured once, then cached)")
        try:
            ceilings = load_or_measure(state_dir / "roofline" / f"{fp_id}.json", device, fp_id)
        except BaseException:
            ledger.close()
            raise
    loop = Loop(kernel=kernel, device=device, shapes=shapes, dtype=dtype, ledger=ledger,
                executor=executor or SequentialExecutor(), fingerprint=fp, fingerprint_id=fp_id,
                strategy=strategy, resume=resume, timeout_s=timeout_s, progress=progress,
                deadline=deadline)
    finished: list[dict] = []   # shapes whose strategy ran to its end
    stopped = None
    try:
        space, allowed, make = template_candidate(kernel, source_path, device, shapes, dtype, timeout_s)
        if strategy != "agent" and strategy not in REGISTRY:
            raise KeyError(f"unknown strategy {strategy!r}: expected one of "
                           f"{', '.join(list(REGISTRY) + ['agent'])}")
        try:
            if strategy == "agent":
                from kernelsearch.agent import agent_rounds

                # the template's default point is the baseline the agent has to beat
                loop.measure([make({})])
                agent_rounds(loop, agent, spec=spec, rounds=budget, ceilings=ceilings,
                             state_dir=state_dir, baseline_path=make({}).source_path)
                finished = list(shapes)
            else:
                for i, shape in enumerate(shapes):
                    progress(f"shape {i + 1}/{len(shapes)} {spec.describe(shape)}: {strategy}, budget {budget}")
                    REGISTRY[strategy](space, loop.objective(make, shape), budget,
                                       random.Random(seed * 1_000_003 + i), allowed=allowed)
                    finished.append(shape)
        except OutOfTime as exc:
            stopped = (f"time limit {time_limit_s:g} s reached after {loop.evaluations} evaluation(s) "
                       f"({exc})")
            progress(f"{stopped}: {len(shapes) - len(finished)} of {len(shapes)} shape(s) not finished; "
                     f"their winners are kept only where they beat stock, and a later run goes on with them")
        reports = loop.report(ceilings)
        done = {_shape_key(s) for s in finished}
        # a shape cut short: its winner where kept, else nothing (its entry, if any, stays)
        written_reports = [r for r in reports if _shape_key(r.shape) in done or r.kept]
        written = write_dispatch(out, kernel, fp, fp_id, written_reports, device)
        # only now is each shape searched: a search killed before this line leaves attempts
        # in the ledger but no record here, and `ensure_table` searches those shapes again
        finished_reports = [r for r in reports if _shape_key(r.shape) in done]
        ledger.record_search(run_id=loop.run_id, kernel=kernel,
                             shapes=[(r.dtype, r.shape) for r in finished_reports],
                             kept=[r.kept for r in finished_reports],
                             strategy=strategy, budget=budget, source_hash=make({}).source_hash,
                             fingerprint=fp_id, code_version=loop.code_version)
    finally:
        ledger.close()
    unfinished = [r.shape for r in reports if _shape_key(r.shape) not in done]
    return SearchResult(kernel, device, strategy, fp_id, loop.run_id, reports, loop.evaluations,
                        loop.resumed, str(written), ceilings, time.time() - loop.started,
                        stopped, unfinished)
