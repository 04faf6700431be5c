"""The search loop on a real GPU: each strategy's search time, evaluations and result per shape.

    python3 bench/search_gpu.py [--kernels rmsnorm,softmax] [--strategies grid,random,optuna,evolution]
                                [--budget 8] [--executor local|pool] [--deadline-s 540] [--out DIR]
    python3 bench/search_gpu.py --device cpu --kernels rmsnorm --budget 2 --shapes-cap 1   # smoke test

Every (kernel, strategy) run is `kernelsearch.search.search` exactly as `hwtune search` runs it
(harness children, ledger, keep rule), each with its own ledger so no strategy reuses another's
measurements. The roofline ceilings are measured once and shared.
Writes to --out (default $OUT, else ./out/search_gpu):
  search_gpu.json   per run: search time, child runs, per-shape stock / best / kept / bound;
                    plus "kernels" in bench/replay_strategies.py's input format (every
                    (params, shape) measured by any run)
  dispatch/         the table each run would install
  tables.txt        the `hwtune search`-style table of every run
Runs that do not fit before --deadline-s are skipped and listed as such.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def per_config_timings(out: Path, runs: list[dict]) -> dict:
    """Every (kernel, shape, params) any run measured, in replay_strategies.py's format."""
    from kernelsearch.ledger import Ledger, canonical

    seen: dict[str, dict[str, dict[str, dict]]] = {}
    for run in runs:
        if "ledger" not in run:
            continue
        with Ledger(run["ledger"]) as ledger:
            for a in ledger.attempts(kernel=run["kernel"]):
                shape_k = canonical(a["shape"])
                rows = seen.setdefault(a["kernel"], {}).setdefault(shape_k, {})
                t = a["candidate_ms"] if a["accepted"] and math.isfinite(a["candidate_ms"]) else None
                rows[canonical(a["params"])] = {"params": a["params"], "time_ms": t,
                                                "status": "ok" if t is not None else (a["guard"] or "rejected")}
    return {k: {"shapes": [{"shape": json.loads(s), "configs": list(rows.values())}
                           for s, rows in shapes.items()]} for k, shapes in seen.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--kernels", default="rmsnorm,softmax,add_rmsnorm")
    ap.add_argument("--strategies", default="grid,random,optuna,evolution")
    ap.add_argument("--budget", default="8", help="points per shape (as hwtune search --budget)")
    ap.add_argument("--executor", choices=("local", "pool"), default="local")
    ap.add_argument("--shapes-cap", type=int, default=None, help="only the first N shapes of each sweep")
    ap.add_argument("--deadline-s", type=float, default=540.0, help="start no run after this many seconds")
    ap.add_argument("--timeout-s", type=float, default=None, help="per harness request")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "out") / "search_gpu")
    args = ap.parse_args(argv)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    t0 = time.time()

    from daemon.commands.search import _table  # the same table hwtune search prints
    from kernelsearch.fingerprint import collect, fingerprint_id
    from kernelsearch.roofline import load_or_measure
    from kernelsearch.search import search
    from kernelsearch.specs import get_spec

    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    fp = collect(args.device)
    fid = fingerprint_id(fp)
    log(f"device {fid}: {json.dumps(fp)}")
    ceilings = load_or_measure(out / "roofline.json", args.device, fid)
    log(f"ceilings: copy {ceilings['copy_gb_s']:.0f} GB/s, matmul {ceilings['matmul_tflops']:.1f} TFLOP/s")
    doc = {"fingerprint": fp, "fingerprint_id": fid, "ceilings": ceilings, "budget": args.budget,
           "executor": args.executor, "runs": []}
    tables = []

    def save():
        doc["kernels"] = per_config_timings(out, doc["runs"])
        doc["elapsed_s"] = round(time.time() - t0, 1)
        (out / "search_gpu.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
        (out / "tables.txt").write_text("\n\n".join(tables) + "\n")

    for kernel in [k for k in args.kernels.split(",") if k]:
        shapes = get_spec(kernel).shapes(args.device)[: args.shapes_cap]
        for strategy in [s for s in args.strategies.split(",") if s]:
            run = {"kernel": kernel, "strategy": strategy}
            if time.time() - t0 > args.deadline_s:
                run["skipped"] = "deadline"
                doc["runs"].append(run)
                log(f"{kernel} {strategy}: skipped (deadline)")
                continue
            state = out / "state" / f"{kernel}-{strategy}"
            run["ledger"] = str(state / "ledger.sqlite")
            log(f"{kernel} {strategy}: budget {args.budget} over {len(shapes)} shapes")
            started = time.time()
            try:
                from kernelsearch.pool import open_executor

                with open_executor(args.executor, device=args.device) as executor:
                    result = search(kernel, state_dir=state, strategy=strategy, budget=args.budget,
                                    device=args.device, shapes=shapes, ceilings=ceilings,
                                    executor=executor, timeout_s=args.timeout_s,
                                    dispatch_path=out / "dispatch" / f"{kernel}-{strategy}.json",
                                    progress=lambda line: log("  " + line))
            except Exception as exc:  # a broken run is a row, the others go on
                run["error"] = f"{type(exc).__name__}: {exc}"
                log(f"{kernel} {strategy}: FAILED {run['error']}")
                doc["runs"].append(run)
                save()
                continue
            run.update(search_s=round(time.time() - started, 1), result=result.to_json())
            doc["runs"].append(run)
            text = f"## {kernel} / {strategy}\n" + _table(result)
            tables.append(text)
            print(text + "\n", flush=True)
            save()
    save()
    print(f"wrote {out}/search_gpu.json and tables.txt in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
