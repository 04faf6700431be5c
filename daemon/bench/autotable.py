"""The dispatch table a benchmark routes through, searched first where it is missing.

`ensure_table` is the one place a benchmark gets its kernels: it never judges a kernel itself.
It loads this device's table, and where the table does not cover the model's decode calls it
runs `kernelsearch.search.search` (the only judge: one keep rule, one timer) on exactly those
(kernel, shape, dtype), within a time budget, writing into STATE_DIR/dispatch/<fingerprint-id>.json
as `hwtune search` does; then it loads the result.

Covered: the table has an entry for the shape (a tuned kernel won there), or the ledger in the
state dir records that the latest search of that (kernel, dtype, shape) ran to its end on this
device fingerprint with the template as it is now and kept nothing (stock won, or every candidate
failed): searching again would only repeat that answer. A search that was killed, one of an older
template, or one that kept a kernel the table no longer has (a table re-seeded or deleted) does
not cover its shapes; they are searched again, resuming the attempts the ledger holds (a kept
winner comes back into the table without being measured again).
A table given explicitly (`table_path` that exists) is used as it is: it is not searched into.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

# Most of a decode step's time first: a budget that runs out leaves the small ops on stock.
# The fused decode kernels lead (each replaces a GEMV and the ops around it; by weight bytes of
# Llama-3-8B's step: gate|up, then norm + qkv / lm_head, then o / down + residual).
SEARCH_ORDER = ("rmsnorm_gate_up_swiglu", "rmsnorm_linear", "rmsnorm_qkv_rope", "linear_residual", "linear",
                "matmul", "rope_kv_attention", "decode_attention", "add_rmsnorm", "rope_kv_write", "rope", "swiglu",
                "rmsnorm")
DEFAULT_EVALS = 2
DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def _canonical(shape: dict) -> str:
    return json.dumps({k: v for k, v in shape.items() if k != "dtype"}, sort_keys=True,
                      separators=(",", ":"))


def _describe(shape: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in shape.items() if k != "dtype")


def _load(path):
    from kernelsearch.dispatch import DispatchTable

    try:
        return DispatchTable.load(path), f"dispatch table {path}"
    except Exception as exc:
        return None, f"dispatch table {path} failed to load: {type(exc).__name__}: {exc}"


def _searched(state_dir, fingerprint_id: str, kernels) -> set:
    """{(kernel, dtype, canonical shape)} whose latest search ran to its end on this fingerprint
    with the kernel's built-in template as it is now and kept nothing (stock won). A search
    killed half-way (a timeout, Ctrl-C) leaves ledger attempts but no such record, a template
    edited since makes the old answer stale, and a kept winner belongs in the table: all three
    are searched again where the table lacks them (resuming the attempts the ledger has)."""
    path = Path(state_dir) / "ledger.sqlite"
    if not path.exists():
        return set()
    from kernelsearch.kernels import TEMPLATES, template_path
    from kernelsearch.ledger import Ledger, file_hash

    hashes = {k: file_hash(template_path(k)) for k in kernels if k in TEMPLATES}
    with Ledger(path, write=False) as ledger:   # only read: no write probe
        return ledger.searched(fingerprint=fingerprint_id, source_hashes=hashes)


def _entry(table, kernel: str, shape: dict, dtype: str):
    """The table's entry for the shape when it routes; None when there is none, or it is stale
    (its template edited since the search: dispatch runs stock for it, so the shape is missing)."""
    if table is None:
        return None
    entry = table.lookup(kernel, shape, dtype)
    return entry if entry is not None and table.usable(entry) else None


def _tuned_count(table, shapes: dict, dtype: str) -> tuple[int, int]:
    n = sum(len(v) for v in shapes.values())
    return sum(_entry(table, k, s, dtype) is not None for k, v in shapes.items() for s in v), n


def default_table_path(state_dir, device: str):
    """STATE_DIR/dispatch/<fingerprint-id>.json for this device (where `hwtune search` writes),
    or None when kernelsearch cannot say (no torch)."""
    try:
        from kernelsearch.dispatch import table_path
        from kernelsearch.fingerprint import collect, fingerprint_id
        return table_path(state_dir, fingerprint_id(collect(device)))
    except Exception:
        return None


def ensure_table(*, state_dir, device: str, dtype: str, shapes: dict[str, list[dict]],
                 budget_s: float, table_path=None, progress=print, evals: int = DEFAULT_EVALS,
                 details: list | None = None):
    """-> (DispatchTable | None, one-line note). `shapes`: {kernel: [shape dict]} of every call
    the benchmarked step makes, in the dispatch table's keys; `dtype` a spec dtype name
    (bfloat16, float16, float32; bf16/fp16/fp32 accepted). Searches the uncovered shapes
    (grid strategy, `evals` evaluations per kernel, each measuring all its missing shapes)
    kernel by kernel in SEARCH_ORDER while `budget_s` lasts; a kernel not started in time, or
    without a spec or a built-in template here, stays stock and the note says so. `details`, when given, receives one
    dict per (kernel, shape) with what happened there."""
    started = time.monotonic()
    dtype = DTYPE_ALIASES.get(dtype, dtype)
    try:
        from kernelsearch.dispatch import table_path as default_path
        from kernelsearch.fingerprint import collect, fingerprint_id
    except Exception as exc:  # triton or torch missing: the benchmark still runs stock
        return None, f"kernelsearch.dispatch unavailable: {type(exc).__name__}: {exc}"
    details = details if details is not None else []

    if table_path is not None and Path(table_path).exists():
        table, note = _load(table_path)
        if table is not None:
            tuned, n = _tuned_count(table, shapes, dtype)
            try:
                routes = table.routes_on(device.split(":")[0])
            except Exception:   # cannot tell: the per-call routes still say what ran
                routes = True
            note += " (given, not searched into): "
            if not routes:   # route() refuses every entry here: say so, not "N have an entry"
                want = table.data.get("fingerprint_id")
                note += (f"made for {want or 'no fingerprint'}, this device is "
                         f"{fingerprint_id(collect(device))}: none of its {tuned} entries for these {n} "
                         f"decode shapes routes here, every call runs stock")
            else:
                note += f"{tuned} of {n} decode shapes have an entry, the rest run stock"
        return table, note

    if state_dir is None:
        return None, "no state directory: no dispatch table, nothing searched (stock)"
    fp_id = fingerprint_id(collect(device))
    path = default_path(state_dir, fp_id)
    table = None
    if path.exists():
        table, note = _load(path)
        if table is None:  # a search would have to rewrite it: leave it for a person to look at
            return None, note + "; not searched (the search would overwrite it)"
    searched = _searched(state_dir, fp_id, shapes)
    missing: dict[str, list[dict]] = {}
    for kernel, kernel_shapes in shapes.items():
        for shape in kernel_shapes:
            if _entry(table, kernel, shape, dtype) is not None:
                continue
            if (kernel, dtype, _canonical(shape)) in searched:
                continue
            missing.setdefault(kernel, []).append(dict(shape))
    if not missing:
        tuned, n = _tuned_count(table, shapes, dtype)
        return table, f"dispatch table {path}: covers all {n} decode shapes ({tuned} tuned, the rest stock won)"

    from kernelsearch.kernels import TEMPLATES
    from kernelsearch.search import search
    from kernelsearch.specs import SPECS

    n_missing = sum(len(v) for v in missing.values())
    progress(f"autotable: {n_missing} decode shape(s) of {', '.join(sorted(missing))} not in "
             f"{path}: searching them ({evals} evaluation(s) per kernel, budget {budget_s:.0f} s)")
    order = [k for k in SEARCH_ORDER if k in missing] + sorted(set(missing) - set(SEARCH_ORDER))
    call_s: list[float] = []
    work: list[int] = []       # evaluations x shapes of each search call
    skipped: list[str] = []
    kept = stock_won = 0
    for kernel in order:
        spec = SPECS.get(kernel)
        todo = []
        for shape in missing[kernel]:
            problem = None if spec is None else spec.valid_shape(shape)
            if spec is None or kernel not in TEMPLATES or problem:
                why = ("no spec here (stock)" if spec is None else
                       "no built-in template here (stock)" if kernel not in TEMPLATES else
                       f"outside the spec: {problem}")
                details.append({"kernel": kernel, "shape": shape, "dtype": dtype, "result": f"not searched: {why}"})
                skipped.append(f"{kernel} {_describe(shape)} ({why})")
            else:
                todo.append(shape)
        if not todo:
            continue
        left = budget_s - (time.monotonic() - started)
        # seconds per (evaluation x shape) so far: a kernel starts only when its share is
        # likely to fit (one child run measures every missing shape of the kernel)
        rate = sum(call_s) / max(1, sum(work)) if call_s else 0.0
        if left <= 0 or rate * max(1, int(evals)) * len(todo) > left:
            for shape in todo:
                details.append({"kernel": kernel, "shape": shape, "dtype": dtype,
                                "result": "not searched: time budget"})
            skipped.append(f"{kernel} x{len(todo)} (time budget)")
            progress(f"autotable: {kernel}: {len(todo)} shape(s) not searched, {max(left, 0):.0f} s of the "
                     f"search budget left")
            continue
        t = time.monotonic()
        progress(f"autotable: search {kernel} on {len(todo)} shape(s): "
                 + "; ".join(_describe(s) for s in todo))
        try:
            result = search(kernel, state_dir=state_dir, strategy="grid", budget=max(1, int(evals)),
                            device=device, dtype=dtype, shapes=todo, dispatch_path=path, resume=True,
                            time_limit_s=left,
                            progress=lambda line, k=kernel: progress(f"  {k}: {line}"))
        except Exception as exc:  # a failed search is a fact of this run, not the end of the bench
            for shape in todo:
                details.append({"kernel": kernel, "shape": shape, "dtype": dtype,
                                "result": f"search failed: {type(exc).__name__}: {str(exc)[:200]}"})
            skipped.append(f"{kernel} (search failed: {type(exc).__name__})")
            progress(f"autotable: search {kernel} failed: {type(exc).__name__}: {exc}")
            call_s.append(time.monotonic() - t)
            work.append(max(1, int(evals)) * len(todo))
            continue
        call_s.append(time.monotonic() - t)
        work.append(max(1, int(evals)) * len(todo))
        against = spec.stock_name
        cut = [_canonical(u) for u in result.unfinished]
        if cut:
            skipped.append(f"{kernel} x{len(cut)} (cut short by the time budget; a later run goes on)")
        for r in result.shapes:
            best = r.best or {}
            short = " (cut short by the time budget)" if _canonical(r.shape) in cut else ""
            if r.kept:
                kept += 1
                what = f"kept a kernel{short}, {r.speedup:.2f}x against {against}"
            elif short:
                what = (f"not finished: time budget; stock for now ({against})"
                        + (f", best candidate so far {r.speedup:.3g}x" if r.speedup else ""))
            else:
                stock_won += 1
                what = (f"stock kept ({against}); best candidate {r.speedup:.3g}x" if r.speedup
                        else f"stock kept ({against}); no candidate passed ({r.verdicts})")
            details.append({"kernel": kernel, "shape": r.shape, "dtype": r.dtype, "result": what,
                            "kept": r.kept, "speedup": r.speedup, "against": against,
                            "stock_ms": r.to_json()["stock_ms"], "best_ms": best.get("candidate_ms"),
                            "params": best.get("params")})
            progress(f"autotable: {kernel} {_describe(r.shape)} {r.dtype}: {what}")
    if call_s:  # the search's executor child keeps a device context and its memory: the
        try:      # measurements that follow should not share the device with it
            from kernelsearch.harness import runner
            runner.discard(device)
        except Exception:
            pass
    table, note = _load(path) if path.exists() else (None, f"no dispatch table at {path}")
    tuned, n = _tuned_count(table, shapes, dtype)
    done = kept + stock_won
    note += (f": searched {done} of {n_missing} missing decode shapes in {time.monotonic() - started:.0f} s ({kept} kept a "
             f"kernel, {stock_won} stayed stock); {tuned} of {n} decode shapes tuned")
    if skipped:
        note += "; not searched: " + ", ".join(skipped)
    return table, note
