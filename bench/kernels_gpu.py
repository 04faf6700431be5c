"""Side-by-side kernel table: for every spec in kernelsearch.specs.SPECS, the kernel the search
keeps against the peers a user would run instead, at every shape the search covered.

    python3 bench/kernels_gpu.py [--kernels rmsnorm,matmul] [--quick] [--out DIR]
                                 [--total-budget-s 360] [--budget-s 150] [--max-configs N]
                                 [--shapes N] [--strategy grid] [--no-compile] [--no-liger]
    python3 bench/kernels_gpu.py --device cpu --quick      # smoke test under the interpreter

Candidates come only from `kernelsearch.search.search` (it verifies, times, keeps or reverts
and writes the dispatch table); this script times the peers and the tuned kernel, called
through `DispatchTable.call`, all with the harness's timer (kernelsearch.harness.timing, the
way the harness times stock), and checks every column against the spec's fp64 reference first:
a wrong one is marked and gets no speedup. Columns: see COLUMNS; bench/README.md says more.
Writes to --out (default $OUT, else ./out/kernels_gpu): kernels_gpu.json, tables.txt,
dispatch.json (the search's table) and state/ (the search's ledger and roofline cache).
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
# Every speedup printed is tuned vs one of these (that column's time / tuned's).
COLUMNS = {
    "tuned": "DispatchTable.call on the search's table: the verified plan where a winner was kept, "
             "else the spec's stock (see route)",
    "stock": "the search's own (harness) timing of the spec's stock_call",
    "eager": "the spec's stock_call as a user calls it (cuBLAS / SDPA where that is the stock), plain launches",
    "graph": "the spec's stock_call in a CUDA graph",
    "compile": "torch.compile(stock_call, dynamic=False) in a CUDA graph (CUDA only)",
    "liger": "Liger Kernel's op (functional API), where it has one and imports",
    "autotune": "@triton.autotune's rule over the configs the search accepted here: its benchmarker's "
                "median for each one's launch plan, fastest kept, then timed like the rest (* = only part "
                "of them in the time budget)",
}
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
    what was measured. Nothing measured is dropped."""

    def __init__(self, inner, deadline: float):
        from kernelsearch.search import SequentialExecutor

        self.inner = inner or SequentialExecutor()
        self.width, self.deadline = getattr(self.inner, "width", 1), deadline

    def map(self, jobs: list[dict]) -> list:
        from kernelsearch.pool import failure_verdict

        if time.time() < self.deadline:
            return self.inner.map(jobs)
        return [failure_verdict(j, "budget", "the bench's search time was spent before this evaluation")
                for j in jobs]


# ----------------------------------------------------------------------------- one timer

def time_fn(fn, spec, shape, dtype, device: str, gen, graphed: bool = True) -> dict:
    """fn(inputs) -> outputs, timed as the harness times stock (executor.stock): n calls per
    replay, each on its own input set (the spec's timed_inputs), refreshed and L2 flushed
    between replays, median per call.
    graphed=False: the same replays as plain launches (the host's launch cost counts)."""
    import torch

    from kernelsearch.harness import timing

    cuda = device.startswith("cuda")
    dist = spec.distributions_for(dtype)[0]
    sets = [spec.timed_inputs(spec.make_inputs(shape, dtype, device, gen, dist))]
    n = timing.calls_per_replay(timing.eager_ms(lambda: fn(sets[0])), 20) if cuda else 1
    sets += [spec.timed_inputs(spec.make_inputs(shape, dtype, device, gen, dist)) for _ in range(n - 1)]

    def run_all():
        for s in sets:
            fn(s)

    def refresh(rep):
        for s in sets:
            for k, v in spec.timed_inputs(spec.make_inputs(shape, dtype, device, gen, dist)).items():
                if isinstance(s[k], torch.Tensor):
                    s[k].copy_(v)

    if graphed or not cuda:
        t = timing.time_calls(run_all, device, refresh=refresh, calls=n)
    else:
        flush, times = timing.l2_flush_buffer(device), []
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(timing.CUDA_WARMUP):
            run_all()
        for rep in range(timing.CUDA_REPS):
            refresh(rep)
            flush.zero_()
            torch.cuda.synchronize()  # else the launches queue behind the flush and their cost hides
            start.record()
            run_all()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / n)
        t = timing.Timing(times, "eager_launches", n)
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
    t0 = time.time()
    try:
        wrong = check(fn, spec, shape, dtype, device, gen)
        res = {**time_fn(fn, spec, shape, dtype, device, gen, graphed), **({"wrong": wrong} if wrong else {})}
    except Exception as exc:
        if is_fatal(exc):
            raise
        res = {"time_ms": math.inf, "error": short_err(exc)}
    return {**res, "wall_s": round(time.time() - t0, 1)}  # includes compile time (torch.compile)


def speedups(cols: dict) -> dict:
    """Tuned vs each correct, timed column: that column's time / tuned's."""
    t = cols["tuned"].get("time_ms", math.inf)
    if cols["tuned"].get("wrong") or not (math.isfinite(t) and t > 0):
        return {}
    return {name: c["time_ms"] / t for name, c in cols.items()
            if name != "tuned" and not c.get("wrong") and math.isfinite(c.get("time_ms", math.inf))}


# ----------------------------------------------------------------------------- peers

def liger_ops() -> dict:
    """kernel -> fn(inputs) -> outputs for the ops Liger Kernel has."""
    try:
        from liger_kernel.transformers import functional as lf
    except Exception as exc:
        log(f"liger unavailable: {short_err(exc)}")
        return {}

    def rope(i):  # Liger's layout: q [B, H, S, D], cos [B, S, D]; here S = 1
        q, k = lf.liger_rope(*(i[n].unsqueeze(2) for n in ("q", "k")), *(i[n].unsqueeze(1) for n in ("cos", "sin")))
        return {"q_out": q.squeeze(2), "k_out": k.squeeze(2)}

    def add_rmsnorm(i):
        return dict(zip(("out", "residual_out"),
                        lf.liger_fused_add_rms_norm(i["x"], i["residual"], i["weight"], i["eps"])))

    return {"rmsnorm": lambda i: {"out": lf.liger_rms_norm(i["x"], i["weight"], i["eps"])},
            "add_rmsnorm": add_rmsnorm, "softmax": lambda i: {"out": lf.liger_softmax(i["x"])},
            "swiglu": lambda i: {"out": lf.liger_swiglu(*i["gate_up"].chunk(2, dim=-1))}, "rope": rope}


def autotune(kernel, spec, rep, accepted: list[dict], device: str, gen, deadline: float) -> dict:
    """@triton.autotune's rule (triton.runtime.autotuner: the driver's benchmarker, quantiles
    (0.5, 0.2, 0.8), keep the minimum) over the configs the search accepted here, each run as its
    launch plan: the template is never imported."""
    from kernelsearch.dispatch import Entry, TunedKernel, source_text
    from kernelsearch.harness import plan_client, timing
    from kernelsearch.kernels import TEMPLATES
    from kernelsearch.specs import dtype_from_name

    if not accepted:
        return {"time_ms": math.inf, "error": "no template config accepted at this shape"}
    t0, dt, source = time.time(), dtype_from_name(rep.dtype), {"module": TEMPLATES[kernel]}
    dims = {k: v for k, v in rep.shape.items() if k != "dtype"}
    text, _ = source_text(source)
    reply = plan_client.request_plans(text, spec, [(dims, rep.dtype)], accepted, plan_client.device_info(device))
    if not reply.get("ok"):
        return {"time_ms": math.inf, "error": f"planning: {reply.get('reason', '')[:200]}"}
    if device.startswith("cuda"):
        from triton.runtime import driver

        bench = lambda f: driver.active.get_benchmarker()(f, quantiles=(0.5, 0.2, 0.8))[0]  # noqa: E731
    else:
        bench = lambda f: timing.time_cpu(f).median_ms  # noqa: E731
    inputs = spec.make_inputs(rep.shape, dt, device, gen, spec.distributions_for(dt)[0])
    args, outs = [inputs[n] for n in spec.arg_names], spec.make_outputs(dims, dt, device)
    best, tried = None, 0
    for params, plan in zip(accepted, reply["plans"][0]):
        if time.time() > deadline:
            break
        if "error" in plan:
            continue
        tried += 1
        try:
            tk = TunedKernel(Entry.make(kernel=kernel, dtype=rep.dtype, shape=dims, source=source,
                                        params=params, plan=plan), spec, text)
            ms = bench(lambda: tk(args, outs))
        except Exception as exc:
            if is_fatal(exc):
                raise
            continue
        if best is None or ms < best[0]:
            best = (ms, params, tk)
    info = {"tried": tried, "of": len(accepted), "tune_s": round(time.time() - t0, 2)}
    if best is None:
        return {"time_ms": math.inf, "error": "no config ran", **info}

    def picked(i, tk=best[2]):
        o = spec.make_outputs(dims, dt, device)
        tk([i[n] for n in spec.arg_names], o)
        return o
    return {**column(picked, spec, rep.shape, dt, device, gen), "params": best[1], "benchmarker_ms": best[0], **info}


# ----------------------------------------------------------------------------- one kernel

def ledger_configs(state: Path, result) -> dict:
    """(dtype, shape) -> this run's measured configs [{"params", "time_ms", "status"}]."""
    from kernelsearch.ledger import Ledger, canonical

    rows: dict = {}
    with Ledger(state / "ledger.sqlite") as ledger:
        for a in ledger.attempts(kernel=result.kernel):
            if a["run_id"] == result.run_id and a["guard"] != "budget":
                ok = a["accepted"] and math.isfinite(a["candidate_ms"])
                rows.setdefault((a["dtype"], canonical({d: v for d, v in a["shape"].items() if d != "dtype"})), []) \
                    .append({"params": a["params"], "time_ms": a["candidate_ms"] if ok else math.inf,
                             "status": "ok" if ok else (a["guard"] or "rejected"), "source": json.loads(a["source"])})
    return rows


def measure_shape(kernel, spec, rep, table, configs, peers: dict, device, gen, ceilings, deadline) -> dict:
    from kernelsearch.kernels import TEMPLATES
    from kernelsearch.roofline import classify
    from kernelsearch.specs import dtype_from_name

    dt = dtype_from_name(rep.dtype)
    sample = spec.make_inputs(rep.shape, dt, device, gen, spec.distributions_for(dt)[0])
    row = {"shape": rep.shape, "dtype": rep.dtype, "bytes": spec.bytes(rep.shape, dt), "flops": spec.flops(rep.shape),
           "route": table.route(kernel, *[sample[n] for n in spec.arg_names])[2], "kept": rep.kept,
           "configs": configs,
           "search": {"stock_ms": rep.stock_ms, "speedup": rep.speedup, "verdicts": rep.verdicts,
                      "best": {k: v for k, v in rep.best.items() if k != "plan"} if rep.best else None}}

    def tuned(inputs):
        out = table.call(kernel, *[inputs[n] for n in spec.arg_names])
        return dict(zip(spec.out_names, out if isinstance(out, tuple) else (out,)))

    before = dict(table.counts)
    cols = {"tuned": column(tuned, spec, rep.shape, dt, device, gen)}
    # how the tuned column's calls were routed: the evidence that it ran the table's plan
    cols["tuned"]["routed"] = {r: table.counts.get((kernel, r), 0) - before.get((kernel, r), 0)
                               for r in ("tuned", "stock")}
    cols |= {"stock": {"time_ms": rep.stock_ms},
             "eager": column(spec.stock_call, spec, rep.shape, dt, device, gen, graphed=False),
             "graph": column(spec.stock_call, spec, rep.shape, dt, device, gen)}
    for name, fn in peers.items():
        cols[name] = column(fn, spec, rep.shape, dt, device, gen) if time.time() < deadline else \
            {"time_ms": math.inf, "error": "skipped: kernel budget spent"}
    template = {"module": TEMPLATES[kernel]}
    cols["autotune"] = autotune(kernel, spec, rep, [c["params"] for c in configs
                                                    if c["status"] == "ok" and c["source"] == template],
                                device, gen, deadline)
    row.update(columns=cols, speedup=speedups(cols))
    if ceilings.get("copy_gb_s") and not cols["tuned"].get("wrong"):
        row["bound"], pct = classify(row["flops"], row["bytes"], cols["tuned"]["time_ms"], ceilings)
        row["pct_of_roofline"] = round(pct, 1)
    return row


def run_kernel(kernel: str, args, state: Path, table_file: Path, ceilings: dict, liger: dict,
               budget_s: float, executor=None) -> dict:
    """The search (through `executor`, default the loop's own, stopped at SEARCH_SHARE of the
    budget), then every column at each shape it covered."""
    import torch

    from kernelsearch.dispatch import DispatchTable
    from kernelsearch.ledger import canonical
    from kernelsearch.search import search
    from kernelsearch.specs import get_spec

    t0, spec = time.time(), get_spec(kernel)
    shapes, cap = spec.shapes(args.device), args.shapes or (2 if args.quick else 0)
    if cap and len(shapes) > cap:  # spread over the sweep, the first shape included
        shapes = [shapes[i * len(shapes) // cap] for i in range(cap)]
    result = search(kernel, state_dir=state, strategy=args.strategy, budget=args.max_configs, device=args.device,
                    shapes=shapes, executor=DeadlineExecutor(executor, t0 + SEARCH_SHARE * budget_s),
                    dispatch_path=table_file, ceilings=ceilings, progress=lambda line: log("  " + line))
    search_s = time.time() - t0
    table, configs = DispatchTable.load(table_file), ledger_configs(state, result)
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
        rows.append(measure_shape(kernel, spec, rep, table, configs.get(key, []), peers, args.device, gen,
                                  ceilings, t0 + budget_s))
    search_json = result.to_json()
    for s in search_json["shapes"]:
        s["best"] = s["best"] and {k: v for k, v in s["best"].items() if k != "plan"}
    return {"kernel": kernel, "stock_name": spec.stock_name, "budget_s": round(budget_s, 1),
            "search_s": round(search_s, 1), "total_s": round(time.time() - t0, 1), "search": search_json,
            "shapes": rows}


# ----------------------------------------------------------------------------- report

def cell(c: dict | None, x: float | None) -> str:
    t = math.inf if c is None else c.get("time_ms", math.inf)
    if c is None or not math.isfinite(t):
        return "n/a" if c is None else "-"
    return f"{t * 1e3:.1f}" + (" WRONG" if c.get("wrong") else f" ({x:.2f}x)" if x is not None else "")


def table_text(res: dict) -> str:
    if "shapes" not in res:
        return f"## {res['kernel']}: failed: {res.get('error')}"
    s = res["search"]
    lines = [f"## {res['kernel']} (us per call; search: {s['strategy']}, {s['evaluations']} child runs, "
             f"{res['search_s']} s; total {res['total_s']} s; stock = {res['stock_name']})",
             " | ".join(["shape", "dtype", "route", *COLUMNS, "% roofline"])]
    for r in res["shapes"]:
        cells = {c: cell(r["columns"].get(c), r["speedup"].get(c)) for c in COLUMNS}
        at = r["columns"]["autotune"]
        cells["autotune"] += "*" if at.get("tried", 0) < at.get("of", 0) else ""
        roof = f"{r['pct_of_roofline']:.0f}% ({r['bound']})" if "pct_of_roofline" in r else "-"
        lines.append(" | ".join([" ".join(f"{k}={v}" for k, v in r["shape"].items() if k != "dtype"),
                                 r["dtype"], r["route"], *cells.values(), roof]))
    lines.append("(Nx) after a time: tuned vs that column (its time / tuned's); WRONG: outside the spec's "
                 "tolerance, no speedup; n/a: no such peer; -: failed or skipped (kernels_gpu.json says why)")
    return "\n".join(lines)


def jsonable(obj):
    if isinstance(obj, float) and not math.isfinite(obj):
        return None if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, (dict, list, tuple)):
        return {str(k): jsonable(v) for k, v in obj.items()} if isinstance(obj, dict) else [jsonable(v) for v in obj]
    return obj


def write_outputs(out: Path, doc: dict, table_file: Path) -> str:
    out.mkdir(parents=True, exist_ok=True)
    (out / "kernels_gpu.json").write_text(json.dumps(jsonable(doc), indent=1) + "\n")
    if table_file.exists():
        shutil.copyfile(table_file, out / "dispatch.json")
    text = "\n\n".join([table_text(r) for r in doc["kernels"].values()] +
                       ["\n".join(f"{name}: {what}" for name, what in COLUMNS.items())])
    (out / "tables.txt").write_text(text + "\n")
    return text


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernels", default="", help="comma list (default: every spec in SPECS)")
    ap.add_argument("--quick", action="store_true", help="two shapes per kernel, 12 configs")
    ap.add_argument("--shapes", type=int, default=None, help="at most N shapes per sweep (quick: 2)")
    ap.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "out" / "kernels_gpu"))
    ap.add_argument("--total-budget-s", type=float, default=None, help="whole run (default 360, quick 150)")
    ap.add_argument("--budget-s", type=float, default=150.0, help="cap on one kernel's budget")
    ap.add_argument("--max-configs", default=None, help="search points per shape (default all; quick 12; cpu 2)")
    ap.add_argument("--strategy", default="grid", help="kernelsearch strategy (as hwtune search --strategy)")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile peer")
    ap.add_argument("--no-liger", action="store_true", help="skip the Liger Kernel peer")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton
    total = args.total_budget_s or (150.0 if args.quick else 360.0)
    import torch
    import triton

    from kernelsearch.fingerprint import collect, fingerprint_id
    from kernelsearch.roofline import load_or_measure
    from kernelsearch.search import parse_budget
    from kernelsearch.specs import SPECS

    args.max_configs = parse_budget(args.max_configs or (2 if args.device == "cpu" else 12 if args.quick else "all"))
    if args.device == "cuda" and not torch.cuda.is_available():
        log("no CUDA device: use --device cpu for the interpreter smoke test")
        return 2
    kernels = [k.strip() for k in args.kernels.split(",") if k.strip()] or list(SPECS)
    unknown = [k for k in kernels if k not in SPECS]
    if unknown:
        log(f"unknown kernels {unknown}; known: {list(SPECS)}")
        return 2
    out = Path(args.out)
    state, table_file = out / "state", out / "state" / "dispatch.json"
    table_file.unlink(missing_ok=True)  # this run's winners only
    ceilings = load_or_measure(state / "roofline.json", args.device, fingerprint_id(collect(args.device)))
    if args.device == "cuda" and not args.no_compile:
        import torch._dynamo  # one recompile per shape: keep dynamo from falling back to eager

        for name in ("cache_size_limit", "recompile_limit"):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, 256)
    liger = {} if args.no_liger else liger_ops()
    doc = {"argv": sys.argv[1:] if argv is None else list(argv), "torch": torch.__version__,
           "triton": triton.__version__, "device": args.device, "total_budget_s": total,
           "timer": "kernelsearch.harness.timing.time_calls", "columns": COLUMNS, "liger": sorted(liger),
           "ceilings": ceilings, "kernels": {}}
    log(f"torch {torch.__version__}, triton {triton.__version__}; kernels {kernels}; budget {total:.0f} s")
    for n, kernel in enumerate(kernels):
        budget = min(args.budget_s, max(5.0, (_T0 + total - time.time()) / (len(kernels) - n)))
        log(f"== {kernel}: budget {budget:.0f} s")
        try:
            doc["kernels"][kernel] = run_kernel(kernel, args, state, table_file, ceilings, liger, budget)
        except Exception as exc:
            log(f"{kernel} failed: {short_err(exc)}\n{traceback.format_exc()}")
            doc["kernels"][kernel] = {"kernel": kernel, "error": short_err(exc)}
            if is_fatal(exc):
                log("CUDA context is poisoned: stopping here (results so far are written)")
                break
        finally:
            write_outputs(out, doc, table_file)
        print(table_text(doc["kernels"][kernel]), file=sys.stderr, flush=True)
    text = write_outputs(out, doc, table_file)
    print(f"ceilings: copy {ceilings['copy_gb_s']:.0f} GB/s, matmul {ceilings['matmul_tflops']:.1f} TFLOP/s "
          f"({args.device}); timer {doc['timer']}" +
          ("; cpu: Triton interpreter, times are not speeds" if args.device == "cpu" else ""))
    print(text)
    print(f"wrote {out}/kernels_gpu.json, dispatch.json, tables.txt in {time.time() - _T0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
