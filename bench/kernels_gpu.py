"""Side-by-side kernel table: for every spec in kernelsearch.specs.SPECS, what the search keeps
against the peers a user would run instead, each timed here at every shape the search covered.

    python3 bench/kernels_gpu.py [--kernels rmsnorm,matmul] [--quick] [--out DIR]
                                 [--total-budget-s 360] [--budget-s 150] [--max-configs N]
                                 [--strategy grid] [--executor local|pool] [--no-compile]
    python3 bench/kernels_gpu.py --device cpu --quick      # smoke test under the interpreter

The candidates come only from `kernelsearch.search.search` (one judge: it verifies, times,
keeps or reverts and writes the dispatch table); this script only times the peers. Columns, us
per call; "(Nx)" after a peer's time = that peer's time / tuned's, i.e. tuned vs that column:
  tuned     DispatchTable.call on the table the search wrote: the verified launch plan where the
            search kept a winner, the spec's stock elsewhere ("route" says which)
  stock     the search's own timing of spec.stock_call (the harness, in its child)
  eager     spec.stock_call as a user calls it (cuBLAS / SDPA where that is the stock), plain
            launches
  graph     spec.stock_call in a CUDA graph
  compile   torch.compile(spec.stock_call, dynamic=False) in a CUDA graph (CUDA only)
  liger     Liger Kernel's op, where it has one and imports
  autotune  what @triton.autotune does over the template's configs that the search accepted at
            this shape: do_bench (median) of each one's verified launch plan, keep the fastest;
            that pick is then timed like every other column
One timer for every column: kernelsearch.harness.timing.time_calls as the harness times stock
(inputs drawn by the spec, n calls per replay each on its own inputs, inputs refreshed and L2
flushed between replays, median of 20 replays, per call); "eager" is the same loop without the
graph. Each column's output is first checked against the spec's fp64 reference (harness
compare, spec tolerance) on two input distributions: a wrong one is marked and gets no speedup.

Writes to --out (default $OUT, else ./out/kernels_gpu): kernels_gpu.json (every column, the
search's result, per-config times in bench/replay_strategies.py's format), tables.txt,
dispatch.json (the search's table) and state/ (the search's ledger, roofline cache). Results
are written after every kernel; a failing peer or kernel is recorded and the run goes on.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SEARCH_SHARE = 0.6          # of a kernel's budget for the search; the rest for the peers
# Shorter than @triton.autotune's do_bench defaults (25 / 100 ms) so the pick fits the budget.
AUTOTUNE_WARMUP_MS, AUTOTUNE_REP_MS = 5, 20
COLUMNS = ("tuned", "stock", "eager", "graph", "compile", "liger", "autotune")
_T0 = time.time()


def log(msg: str) -> None:
    print(f"[{time.time() - _T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


def short_err(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".strip().replace("\n", " ")[:300]


def is_fatal(exc: BaseException) -> bool:
    """A CUDA error that poisons this process's context: nothing after it can be trusted."""
    text = str(exc).lower()
    return any(w in text for w in ("illegal memory access", "unspecified launch failure",
                                   "device-side assert", "misaligned address", "illegal instruction"))


class DeadlineExecutor:
    """The search's executor contract with a wall-clock stop: a job asked for after `deadline`
    gets a "budget" verdict at once (a ledger row like any rejection), so the strategy ends with
    what was measured. Measured results are never dropped."""

    def __init__(self, inner, deadline: float):
        from kernelsearch.search import SequentialExecutor

        self.inner = inner or SequentialExecutor()
        self.width = getattr(self.inner, "width", 1)
        self.deadline = deadline

    def map(self, jobs: list[dict]) -> list:
        from kernelsearch.pool import failure_verdict

        if time.time() >= self.deadline:
            return [failure_verdict(j, "budget", "the bench's search time was spent before this "
                                               "evaluation") for j in jobs]
        return self.inner.map(jobs)


def sweep(spec, device: str, quick: bool) -> list[dict]:
    shapes = spec.shapes(device)
    return [shapes[0], shapes[len(shapes) // 2]] if quick and len(shapes) > 2 else shapes


# ----------------------------------------------------------------------------- one timer

def eager_launches(run_all, device, refresh, calls: int):
    """time_cuda's loop without the graph: the host's launch cost is in the numbers."""
    import torch

    from kernelsearch.harness import timing

    flush = timing.l2_flush_buffer(device)
    for _ in range(timing.CUDA_WARMUP):
        run_all()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for rep in range(timing.CUDA_REPS):
        refresh(rep)
        flush.zero_()
        torch.cuda.synchronize()  # else the launches queue behind the flush and their cost hides
        start.record()
        run_all()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return timing.Timing(times, "eager_launches", calls)


def time_fn(fn, spec, shape, dtype, device: str, gen, graphed: bool = True) -> dict:
    """fn(inputs) -> outputs, timed the way the harness times stock (executor.stock)."""
    import torch

    from kernelsearch.harness import timing

    dist = spec.distributions_for(dtype)[0]
    sets = [spec.make_inputs(shape, dtype, device, gen, dist)]
    n = 1
    if device.startswith("cuda"):
        n = timing.calls_per_replay(timing.eager_ms(lambda: fn(sets[0])), 20)
        sets += [spec.make_inputs(shape, dtype, device, gen, dist) for _ in range(n - 1)]

    def run_all():
        for s in sets:
            fn(s)

    def refresh(rep):
        for s in sets:
            for k, v in spec.make_inputs(shape, dtype, device, gen, dist).items():
                if isinstance(s[k], torch.Tensor):
                    s[k].copy_(v)

    if graphed or not device.startswith("cuda"):
        t = timing.time_calls(run_all, device, refresh=refresh, calls=n)
    else:
        t = eager_launches(run_all, device, refresh, n)
    return {"time_ms": t.median_ms, "p20_ms": t.p20_ms, "p80_ms": t.p80_ms, "method": t.method,
            "calls_per_replay": n}


def check(fn, spec, shape, dtype, device: str, gen) -> str | None:
    """None when fn's outputs match the spec's fp64 reference on two input distributions."""
    from kernelsearch.harness.compare import compare

    for dist in spec.distributions_for(dtype)[:2]:
        inputs = spec.make_inputs(shape, dtype, device, gen, dist)
        ref = spec.reference(inputs)  # first: a peer may write into its inputs
        outs = fn(inputs)
        for name in spec.out_names:
            _, bad = compare(name, outs[name], ref[name], spec.tolerance(dtype))
            if bad:
                return f"{dist} inputs: {bad.reason}"
    return None


def column(fn, spec, shape, dtype, device: str, gen, graphed: bool = True) -> dict:
    """Checked, then timed; a failure is a row (time inf), never an exception."""
    try:
        wrong = check(fn, spec, shape, dtype, device, gen)
        res = time_fn(fn, spec, shape, dtype, device, gen, graphed)
        return {**res, "wrong": wrong} if wrong else res
    except Exception as exc:
        if is_fatal(exc):
            raise
        return {"time_ms": math.inf, "error": short_err(exc)}


def speedups(cols: dict) -> dict:
    """Tuned vs each correct, timed column: that column's time / tuned's."""
    tuned = cols["tuned"]
    t = tuned.get("time_ms", math.inf)
    if tuned.get("wrong") or not math.isfinite(t) or t <= 0:
        return {}
    return {name: c["time_ms"] / t for name, c in cols.items()
            if name != "tuned" and not c.get("wrong") and math.isfinite(c.get("time_ms", math.inf))}


# ----------------------------------------------------------------------------- peers

def liger_ops() -> dict:
    """kernel -> fn(inputs) -> outputs, for the ops Liger Kernel has (its functional API)."""
    try:
        from liger_kernel.transformers import functional as lf
    except Exception as exc:
        log(f"liger unavailable: {short_err(exc)}")
        return {}

    def rope(i):  # Liger's layout: q [B, H, S, D], cos [B, S, D]; here S = 1
        q, k = lf.liger_rope(i["q"].unsqueeze(2), i["k"].unsqueeze(2), i["cos"].unsqueeze(1),
                             i["sin"].unsqueeze(1))
        return {"q_out": q.squeeze(2), "k_out": k.squeeze(2)}

    return {"rmsnorm": lambda i: {"out": lf.liger_rms_norm(i["x"], i["weight"], i["eps"])},
            "add_rmsnorm": lambda i: dict(zip(("out", "residual_out"), lf.liger_fused_add_rms_norm(
                i["x"], i["residual"], i["weight"], i["eps"]))),
            "softmax": lambda i: {"out": lf.liger_softmax(i["x"])},
            "swiglu": lambda i: {"out": lf.liger_swiglu(*i["gate_up"].chunk(2, dim=-1))},
            "rope": rope}


def tuned_fn(table, kernel: str, spec):
    def fn(inputs):
        out = table.call(kernel, *[inputs[n] for n in spec.arg_names])
        return dict(zip(spec.out_names, out if isinstance(out, tuple) else (out,)))
    return fn


def plan_fn(tk, spec, shape, dtype, device):
    def fn(inputs):
        outs = spec.make_outputs(shape, dtype, device)
        tk([inputs[n] for n in spec.arg_names], outs)
        return outs
    return fn


def autotune(kernel, spec, rep, accepted: list[dict], device: str, gen, deadline: float) -> dict:
    """@triton.autotune's rule (do_bench median per config, keep the minimum) over the configs
    the search accepted here, each run as its launch plan (the template is never imported)."""
    from kernelsearch.dispatch import Entry, TunedKernel, source_text
    from kernelsearch.harness import plan_client, timing
    from kernelsearch.specs import dtype_from_name

    if not accepted or not rep.best:
        return {"time_ms": math.inf, "error": "no config accepted at this shape"}
    t0, dt = time.time(), dtype_from_name(rep.dtype)
    dims = {k: v for k, v in rep.shape.items() if k != "dtype"}
    text, _ = source_text(rep.best["source"])
    reply = plan_client.request_plans(text, spec, [(dims, rep.dtype)], accepted,
                                      plan_client.device_info(device))
    if not reply.get("ok"):
        return {"time_ms": math.inf, "error": f"planning: {reply.get('reason', '')[:200]}"}
    if device.startswith("cuda"):
        from triton.testing import do_bench

        def bench(f):
            return do_bench(f, warmup=AUTOTUNE_WARMUP_MS, rep=AUTOTUNE_REP_MS)
    else:
        def bench(f):
            return timing.time_cpu(f).median_ms
    inputs = spec.make_inputs(rep.shape, dt, device, gen, spec.distributions_for(dt)[0])
    best, tried = None, 0
    for params, plan in zip(accepted, reply["plans"][0]):
        if time.time() > deadline:
            break
        if "error" in plan:
            continue
        tried += 1
        try:
            tk = TunedKernel(Entry.make(kernel=kernel, dtype=rep.dtype, shape=dims, source=rep.best["source"],
                                        params=params, plan=plan), spec, text)
            fn = plan_fn(tk, spec, dims, dt, device)
            ms = bench(lambda: fn(inputs))
        except Exception as exc:
            if is_fatal(exc):
                raise
            continue
        if best is None or ms < best[0]:
            best = (ms, params, fn)
    info = {"tried": tried, "of": len(accepted), "tune_s": round(time.time() - t0, 2)}
    if best is None:
        return {"time_ms": math.inf, "error": "no config ran", **info}
    res = column(best[2], spec, rep.shape, dt, device, gen)
    return {**res, "params": best[1], "do_bench_ms": best[0], **info}


# ----------------------------------------------------------------------------- one kernel

def ledger_configs(state: Path, result) -> dict:
    """(dtype, shape) -> this run's measured configs: [{"params", "time_ms", "status"}]."""
    from kernelsearch.ledger import Ledger, canonical

    rows: dict = {}
    with Ledger(state / "ledger.sqlite") as ledger:
        for a in ledger.attempts(kernel=result.kernel):
            if a["run_id"] != result.run_id or a["guard"] == "budget":
                continue
            k = (a["dtype"], canonical({d: v for d, v in a["shape"].items() if d != "dtype"}))
            ok = a["accepted"] and math.isfinite(a["candidate_ms"])
            rows.setdefault(k, []).append({"params": a["params"], "time_ms": a["candidate_ms"] if ok else math.inf,
                                           "status": "ok" if ok else (a["guard"] or "rejected")})
    return rows


def measure_shape(kernel, spec, rep, table, configs, peers: dict, device, gen, ceilings, deadline) -> dict:
    from kernelsearch.roofline import classify
    from kernelsearch.specs import dtype_from_name

    dt = dtype_from_name(rep.dtype)
    sample = spec.make_inputs(rep.shape, dt, device, gen, spec.distributions_for(dt)[0])
    _, _, route = table.route(kernel, *[sample[n] for n in spec.arg_names])
    row = {"shape": rep.shape, "dtype": rep.dtype, "bytes": spec.bytes(rep.shape, dt),
           "flops": spec.flops(rep.shape), "route": route, "kept": rep.kept, "configs": configs,
           "search": {"stock_ms": rep.stock_ms, "speedup": rep.speedup, "verdicts": rep.verdicts,
                      "best": {k: v for k, v in rep.best.items() if k != "plan"} if rep.best else None}}
    cols = {"tuned": column(tuned_fn(table, kernel, spec), spec, rep.shape, dt, device, gen),
            "stock": {"time_ms": rep.stock_ms, "method": "the search's harness timing"}}
    cols["eager"] = column(spec.stock_call, spec, rep.shape, dt, device, gen, graphed=False)
    cols["graph"] = column(spec.stock_call, spec, rep.shape, dt, device, gen)
    for name, fn in peers.items():
        if time.time() > deadline:
            cols[name] = {"time_ms": math.inf, "error": "skipped: kernel budget spent"}
            continue
        t0 = time.time()
        cols[name] = column(fn, spec, rep.shape, dt, device, gen)
        cols[name]["first_call_s"] = round(time.time() - t0, 1)  # compile time for "compile"
    accepted = [c["params"] for c in configs if c["status"] == "ok"]
    cols["autotune"] = autotune(kernel, spec, rep, accepted, device, gen, deadline)
    row["columns"] = cols
    row["speedup"] = speedups(cols)
    tuned_ms = cols["tuned"]["time_ms"]
    if ceilings.get("copy_gb_s") and not cols["tuned"].get("wrong"):
        row["bound"], pct = classify(row["flops"], row["bytes"], tuned_ms, ceilings)
        row["pct_of_roofline"] = round(pct, 1)
    return row


def run_kernel(kernel: str, args, state: Path, table_file: Path, ceilings: dict, liger: dict,
               budget_s: float) -> dict:
    import torch

    from kernelsearch.dispatch import DispatchTable
    from kernelsearch.ledger import canonical
    from kernelsearch.pool import open_executor
    from kernelsearch.search import search
    from kernelsearch.specs import get_spec

    t0 = time.time()
    spec = get_spec(kernel)
    with open_executor(args.executor, device=args.device) as inner:
        result = search(kernel, state_dir=state, strategy=args.strategy, budget=args.max_configs,
                        device=args.device, shapes=sweep(spec, args.device, args.quick),
                        executor=DeadlineExecutor(inner, t0 + SEARCH_SHARE * budget_s),
                        dispatch_path=table_file, ceilings=ceilings, progress=lambda line: log("  " + line))
    search_s = time.time() - t0
    table = DispatchTable.load(table_file)
    configs = ledger_configs(state, result)
    peers = {}
    if args.device.startswith("cuda") and not args.no_compile:
        peers["compile"] = torch.compile(spec.stock_call, dynamic=False)
    if kernel in liger:
        peers["liger"] = liger[kernel]
    gen = torch.Generator(device=args.device).manual_seed(int(time.time() * 1e6) % (2 ** 31))
    rows = []
    for rep in result.shapes:
        log(f"{kernel} {spec.describe(rep.shape)}: peers")
        key = (rep.dtype, canonical({k: v for k, v in rep.shape.items() if k != "dtype"}))
        rows.append(measure_shape(kernel, spec, rep, table, configs.get(key, []), peers, args.device,
                                  gen, ceilings, t0 + budget_s))
    search_json = result.to_json()
    for s in search_json["shapes"]:
        if s.get("best"):
            s["best"] = {k: v for k, v in s["best"].items() if k != "plan"}
    return {"kernel": kernel, "stock_name": spec.stock_name, "budget_s": round(budget_s, 1),
            "search_s": round(search_s, 1), "total_s": round(time.time() - t0, 1),
            "search": search_json, "shapes": rows}


# ----------------------------------------------------------------------------- report

def cell(c: dict | None, x: float | None) -> str:
    if c is None:
        return "n/a"
    t = c.get("time_ms", math.inf)
    if not math.isfinite(t):
        return "-"
    text = f"{t * 1e3:.1f}"
    if c.get("wrong"):
        return text + " WRONG"
    return text + (f" ({x:.2f}x)" if x is not None else "")


def table_text(res: dict) -> str:
    if "shapes" not in res or res.get("error"):
        return f"## {res['kernel']}: failed: {res.get('error')}"
    s = res["search"]
    lines = [f"## {res['kernel']} (us per call; search: {s['strategy']}, {s['evaluations']} child runs, "
             f"{res['search_s']} s; total {res['total_s']} s)",
             " | ".join(["shape", "dtype", "route", *COLUMNS, "% roofline"])]
    for r in res["shapes"]:
        cols, x = r["columns"], r["speedup"]
        roof = f"{r['pct_of_roofline']:.0f}% ({r['bound']})" if "pct_of_roofline" in r else "-"
        lines.append(" | ".join([" ".join(f"{k}={v}" for k, v in r["shape"].items() if k != "dtype"),
                                 r["dtype"], r["route"],
                                 *[cell(cols.get(c), x.get(c)) for c in COLUMNS], roof]))
    lines.append(f"(Nx) = that column's time / tuned's: tuned vs that column. stock/eager/graph/compile are "
                 f"{res['stock_name']}; WRONG = output outside the spec's tolerance (no speedup); "
                 "n/a = no such peer; - = failed or skipped (see kernels_gpu.json)")
    return "\n".join(lines)


def jsonable(obj):
    if isinstance(obj, float) and not math.isfinite(obj):
        return None if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    return obj


def write_outputs(out: Path, doc: dict, table_file: Path) -> str:
    out.mkdir(parents=True, exist_ok=True)
    (out / "kernels_gpu.json").write_text(json.dumps(jsonable(doc), indent=1) + "\n")
    if table_file.exists():
        shutil.copyfile(table_file, out / "dispatch.json")
    text = "\n\n".join(table_text(r) for r in doc["kernels"].values())
    (out / "tables.txt").write_text(text + "\n")
    return text


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernels", default="", help="comma list (default: every spec in SPECS)")
    ap.add_argument("--quick", action="store_true", help="two shapes per kernel, 12 configs")
    ap.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "out" / "kernels_gpu"))
    ap.add_argument("--total-budget-s", type=float, default=None,
                    help="wall-clock budget for the whole run (default 360, quick 150)")
    ap.add_argument("--budget-s", type=float, default=150.0, help="cap on one kernel's budget")
    ap.add_argument("--max-configs", default=None,
                    help="search budget: points per shape (default all; quick 12; cpu 2)")
    ap.add_argument("--strategy", default="grid", help="kernelsearch strategy (hwtune search --strategy)")
    ap.add_argument("--executor", default="local", choices=["local", "pool"])
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile peer")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton
    total = args.total_budget_s or (150.0 if args.quick else 360.0)
    if args.max_configs is None:
        args.max_configs = 2 if args.device == "cpu" else (12 if args.quick else "all")
    import torch
    import triton

    from kernelsearch.fingerprint import collect, fingerprint_id
    from kernelsearch.roofline import load_or_measure
    from kernelsearch.search import parse_budget
    from kernelsearch.specs import SPECS

    args.max_configs = parse_budget(args.max_configs)
    if args.device == "cuda" and not torch.cuda.is_available():
        log("no CUDA device: use --device cpu for the interpreter smoke test")
        return 2
    kernels = [k.strip() for k in args.kernels.split(",") if k.strip()] or list(SPECS)
    unknown = [k for k in kernels if k not in SPECS]
    if unknown:
        log(f"unknown kernels {unknown}; known: {list(SPECS)}")
        return 2
    out = Path(args.out)
    state = out / "state"
    table_file = state / "dispatch.json"
    table_file.unlink(missing_ok=True)  # this run's winners only
    ceilings = load_or_measure(state / "roofline.json", args.device, fingerprint_id(collect(args.device)))
    if args.device == "cuda" and not args.no_compile:
        import torch._dynamo  # one recompile per shape: keep dynamo from falling back to eager

        for name in ("cache_size_limit", "recompile_limit"):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, 256)
    liger = liger_ops()
    doc = {"argv": sys.argv[1:] if argv is None else list(argv), "torch": torch.__version__,
           "triton": triton.__version__, "device": args.device, "total_budget_s": total,
           "timer": "kernelsearch.harness.timing.time_calls", "liger": sorted(liger),
           "ceilings": ceilings, "kernels": {}}
    log(f"torch {torch.__version__}, triton {triton.__version__}; kernels {kernels}; budget {total:.0f} s")
    for n, kernel in enumerate(kernels):
        left = _T0 + total - time.time()
        budget = min(args.budget_s, max(5.0, left / (len(kernels) - n)))
        log(f"== {kernel}: budget {budget:.0f} s")
        try:
            doc["kernels"][kernel] = run_kernel(kernel, args, state, table_file, ceilings, liger, budget)
        except Exception as exc:
            log(f"{kernel} failed: {short_err(exc)}\n{traceback.format_exc()}")
            doc["kernels"][kernel] = {"kernel": kernel, "error": short_err(exc)}
            if is_fatal(exc):
                write_outputs(out, doc, table_file)
                log("CUDA context is poisoned: stopping here (results so far are written)")
                break
        print(table_text(doc["kernels"][kernel]), file=sys.stderr, flush=True)
        write_outputs(out, doc, table_file)
    text = write_outputs(out, doc, table_file)
    print(f"ceilings: copy {ceilings['copy_gb_s']:.0f} GB/s, matmul {ceilings['matmul_tflops']:.1f} TFLOP/s "
          f"({args.device}); timer {doc['timer']}" + ("; cpu: Triton interpreter, times are not speeds"
                                                      if args.device == "cpu" else ""))
    print(text)
    print(f"wrote {out}/kernels_gpu.json, dispatch.json, tables.txt in {time.time() - _T0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
