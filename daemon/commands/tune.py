"""`hwtune tune`: the nested tuning cycle (daemon/tune.py)."""
from __future__ import annotations

import argparse
import json
import sys


def _gpus(text: str) -> tuple:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--gpus {text!r}: expected indices like 0,1") from None


def add_tune_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--objective", choices=("throughput", "energy"), default="energy",
                   help="energy: most tokens/J at >= FLOOR x stock tokens/s; throughput: most tokens/s")
    p.add_argument("--floor", type=float, default=0.98, help="throughput floor for --objective energy")
    p.add_argument("--budget", type=int, default=12, help="at most this many hardware points measured (stock included); the search may stop sooner")
    p.add_argument("--exhaustive", action="store_true",
                   help="also sweep the whole space and compare (evaluations used, best vs exhaustive best)")
    p.add_argument("--workload", choices=("decode", "gemm", "copy"), default="decode",
                   help="simulated host: the modelled workload (a GPU host measures a decode GEMV)")
    p.add_argument("--gpus", type=_gpus, default=None, help="GPU indices (default all)")
    k = p.add_mutually_exclusive_group()
    k.add_argument("--kernels", default="rmsnorm", help="kernels searched at the chosen point, comma-separated")
    k.add_argument("--no-kernels", action="store_true", help="hardware loop only")
    p.add_argument("--kernel-budget", default="2", help="`hwtune search --budget` per kernel")
    end = p.add_mutually_exclusive_group()
    end.add_argument("--keep", dest="keep", action="store_true", default=True,
                     help="keep the best point, journaled (default)")
    end.add_argument("--restore", dest="keep", action="store_false", help="restore the starting settings")
    p.add_argument("--nightly", action="store_true",
                   help="as hwtune-retune.service runs it: service config's thermal limits; the daemon "
                        "pauses its drift checks while this runs")
    p.add_argument("--json", action="store_true", help="one JSON document on stdout")


def _check_inputs(args, kernels: tuple) -> None:
    """Everything the cycle would find wrong only after the hardware loop ran, found now."""
    import difflib
    import re

    from hwtune.errors import UsageError
    from kernelsearch.kernels import TEMPLATES

    if args.budget < 1:
        raise UsageError(f"--budget {args.budget}: at least 1 hardware point (the stock point is the first)")
    if not 0 < args.floor <= 1:
        raise UsageError(f"--floor {args.floor}: a fraction of stock tokens/s in (0, 1], e.g. 0.98")
    for k in kernels:
        if k not in TEMPLATES:
            near = difflib.get_close_matches(k, TEMPLATES, n=1)
            raise UsageError(f"--kernels {k}: no such kernel"
                             + (f"; did you mean {near[0]}?" if near else "")
                             + f" (known: {', '.join(TEMPLATES)})")
    if not re.fullmatch(r"[1-9][0-9]*|small|medium|large|all", args.kernel_budget):
        raise UsageError(f"--kernel-budget {args.kernel_budget!r}: a positive number or small|medium|large|all")
    if kernels:   # not after the hardware loop: its points would be measured, then the tune fail
        try:
            import torch  # noqa: F401
            import triton  # noqa: F401
        except ModuleNotFoundError as exc:
            raise UsageError(f"the kernel step needs {exc.name}, which is not installed: pip install "
                             "'hwtune[kernels]', or tune the hardware alone with --no-kernels") from None


def run_tune(args, ctx) -> int:
    from daemon.tune import TuneOptions, format_table, summary, tune

    kernels = () if args.no_kernels else tuple(k.strip() for k in args.kernels.split(",") if k.strip())
    _check_inputs(args, kernels)
    ctx.check_can_write("tune")
    opts = TuneOptions(objective=args.objective, floor=args.floor, budget=args.budget,
                       exhaustive=args.exhaustive, workload=args.workload, kernels=kernels,
                       kernel_budget=args.kernel_budget, keep=args.keep, gpus=args.gpus, nightly=args.nightly)
    report = tune(ctx, opts)
    report["summary"] = summary(report)
    if args.json:
        json.dump(report, sys.stdout, indent=1, default=str)
        print()
        print(format_table(report), file=sys.stderr)
    else:
        print(format_table(report))
    if report.get("aborted"):
        return 1
    if any(not k.get("ok") for k in report.get("kernels") or []):
        return 1
    return 0
