"""Search the dispatch table for the decode calls of hwtune's built-in decoder and of a patched
Hugging Face Llama (Llama-3-8B dimensions), in one pass, before any model is measured.

    python3 bench/search_decode.py --state-dir DIR --shapes 1x2048,32x2048 --budget-s 500 --evals 4
    python3 bench/search_decode.py --state-dir DIR --kernels decode_attention --evals 40   # one, deeper

The one judge is kernelsearch.search (through daemon.bench.autotable.ensure_table): this script
only lists the (kernel, shape) pairs the two decode steps look up and hands them over, so that
the two benches that follow route through one table searched once. Prints the autotable's
progress and, at the end, one line per (kernel, shape): kept (x speedup against its named stock)
or stock.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _merge(into: dict, more: dict) -> None:
    for kernel, shapes in more.items():
        bucket = into.setdefault(kernel, [])
        for s in shapes:
            if s not in bucket:
                bucket.append(dict(s))


def decode_calls(shapes, layers: int) -> dict:
    from daemon.bench import ops as bench_ops
    from daemon.bench.hf import llama3_8b_config
    from daemon.bench.model import PRESETS
    from kernelsearch.integrations.transformers import decode_shapes as hf_shapes

    cfg = PRESETS["llama3-8b-8l"].with_overrides(layers=layers)
    out: dict = {}
    _merge(out, bench_ops.decode_shapes(cfg, shapes))
    hf_cfg = llama3_8b_config(layers)
    for batch, ctx in shapes:
        _merge(out, hf_shapes(hf_cfg, batch, ctx))   # StaticCache(max_cache_len=ctx): S = ctx
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--state-dir", required=True)
    ap.add_argument("--shapes", default="1x2048,32x2048")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--budget-s", type=float, default=500)
    ap.add_argument("--evals", type=int, default=4)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--json", help="write the per-shape results here")
    ap.add_argument("--kernels", help="only these kernels (comma-separated), e.g. a deeper search "
                                      "of one kernel before the rest")
    args = ap.parse_args(argv)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    from daemon.bench.autotable import ensure_table

    calls = decode_calls(shapes, args.layers)
    if args.kernels:
        wanted = [k.strip() for k in args.kernels.split(",") if k.strip()]
        unknown = sorted(set(wanted) - set(calls))
        if unknown:
            ap.error(f"--kernels: {', '.join(unknown)} not among the decode calls "
                     f"({', '.join(sorted(calls))})")
        calls = {k: v for k, v in calls.items() if k in wanted}
    print(f"decode calls: {sum(len(v) for v in calls.values())} (kernel, shape) pairs over "
          f"{', '.join(sorted(calls))}", flush=True)
    details: list = []
    table, note = ensure_table(state_dir=args.state_dir, device=args.device, dtype=args.dtype,
                               shapes=calls, budget_s=args.budget_s, evals=args.evals,
                               progress=lambda line: print(line, flush=True), details=details)
    print(note)
    for d in details:
        shape = " ".join(f"{k}={v}" for k, v in d["shape"].items() if k != "dtype")
        print(f"  {d['kernel']:24s} {shape:40s} {d['result']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"note": note, "details": details}, indent=1, default=str))
    return 0 if table is not None else 1


if __name__ == "__main__":
    sys.exit(main())
