"""`hwtune check-kernel KERNEL FILE`: one candidate through the full verifier and timed runs.

Exit 0 accepted, 1 rejected (the guard and the reason on stderr), 2 bad input.
Without --params, a file with CONFIGS is checked with its first config (the search tries the
others); --params JSON overrides.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from daemon.device import DEVICE_HELP, resolve_device
from hwtune.errors import UsageError

# every spec of kernelsearch.specs.SPECS (tests/test_specs.py holds this list to the registry)
KERNEL_HELP = "spec name: rmsnorm, add_rmsnorm, softmax, matmul, linear, swiglu, rope, rope_kv_write, decode_attention, rope_kv_attention, rmsnorm_linear, rmsnorm_qkv_rope, rmsnorm_gate_up_swiglu, linear_residual"


def did_you_mean(kernel: str) -> str:
    """'; did you mean rmsnorm?' for a mistyped kernel name (rmsnrm), else ''."""
    import difflib

    from kernelsearch.specs import SPECS

    near = difflib.get_close_matches(kernel, list(SPECS), n=1)
    return f"; did you mean {near[0]}?" if near else ""


def unknown_kernel(kernel: str) -> UsageError:
    from kernelsearch.specs import SPECS

    return UsageError(f"unknown kernel {kernel!r}{did_you_mean(kernel)} (expected one of {', '.join(SPECS)})")


def add_check_kernel_arguments(p) -> None:
    p.add_argument("kernel", help=KERNEL_HELP)
    p.add_argument("file", type=Path, help="candidate Triton file defining launch(...)")
    p.add_argument("--device", default="auto",
                   help=f"{DEVICE_HELP}; cpu: reduced sweep; or cuda:N")
    p.add_argument("--json", action="store_true", help="one JSON document on stdout")
    p.add_argument("--params", default=None, metavar="JSON",
                   help="launch parameters as a JSON object (default: the file's CONFIGS[0])")
    p.add_argument("--dtype", default=None, help="force one dtype for every shape (bfloat16, float16, float32)")
    p.add_argument("--timeout", type=float, default=None, metavar="S",
                   help="hard limit per harness request (the sandbox run, one shape) in seconds (default 120)")
    p.add_argument("--no-time", action="store_true", help="verify only; skip the timed runs")


def _fmt_ms(v: float) -> str:
    return "-" if v is None or not math.isfinite(v) else f"{v:.4f}"


def _print_table(verdict, out, timed: bool = True) -> None:
    print(f"{'shape':<34} {'dtype':<9} {'err':>9} {'cand_ms':>10} {'stock_ms':>10} {'speedup':>8} "
          f"{'noise':>7}  timing", file=out)
    for s in verdict.shapes:
        shape = " ".join(f"{k}={v}" for k, v in s.shape.items() if k != "dtype")
        err = "-" if s.error_rel_l2 is None else f"{s.error_rel_l2:.2e}"
        speed = "-" if s.speedup is None else f"{s.speedup:.2f}x"
        noise = "-" if s.noise_band is None or not math.isfinite(s.noise_band) else f"{100 * s.noise_band:.1f}%"
        how = s.timing or s.status
        if s.random:
            how = f"{s.status}: drawn at random, checked (not timed)"
        print(f"{shape:<34} {s.dtype:<9} {err:>9} {_fmt_ms(s.candidate_ms):>10} {_fmt_ms(s.stock_ms):>10} "
              f"{speed:>8} {noise:>7}  {how}", file=out)
    from kernelsearch.specs import SPECS

    if not timed:
        print("not timed (--no-time): verified only", file=out)
    elif verdict.kernel in SPECS:
        print(f"speedup = stock_ms / cand_ms; stock is {SPECS[verdict.kernel].stock_name}, as a user calls it",
              file=out)
    if verdict.isolation:
        print(f"sandbox for launch(): {', '.join(verdict.isolation)}", file=out)


def run_check_kernel(args, ctx) -> int:
    from kernelsearch.harness import evaluate
    from kernelsearch.specs import DTYPES, SPECS

    if args.kernel not in SPECS:
        if str(args.file) in SPECS:   # hwtune check-kernel cand.py rmsnorm
            raise UsageError(f"the kernel goes first, then the file: hwtune check-kernel {args.file} {args.kernel}")
        raise unknown_kernel(args.kernel)
    if not args.file.is_file():
        raise UsageError(f"{args.file}: " + ("a directory, not a candidate file" if args.file.is_dir()
                                             else "not a regular file" if args.file.exists()   # a FIFO, /dev/null
                                             else "no such file"))
    if args.timeout is not None and not (math.isfinite(args.timeout) and args.timeout > 0):
        # 0 would silently mean the default, a negative number a rejected candidate
        raise UsageError(f"--timeout {args.timeout:g}: a positive number of seconds")
    device = resolve_device(args.device)
    if args.dtype is not None and args.dtype not in DTYPES:
        raise UsageError(f"--dtype {args.dtype}: expected one of {', '.join(DTYPES)}")
    params = None
    if args.params is not None:
        try:
            params = json.loads(args.params)
        except ValueError as exc:
            raise UsageError(f"--params: not JSON ({exc})") from None
        if not isinstance(params, dict):
            raise UsageError("--params: expected a JSON object")
    verdict = evaluate(args.kernel, args.file, params=params, device=device, dtype=args.dtype,
                       timeout_s=args.timeout, time_it=not args.no_time)
    if args.json:
        json.dump(verdict.to_json(), sys.stdout, indent=2)
        sys.stdout.write("\n")
    elif verdict.shapes:   # a file refused before any shape ran (not Python, empty) has no table
        _print_table(verdict, sys.stdout, timed=not args.no_time)
    # a path is the user's, but a newline in it would print a line of its choosing
    shown = str(args.file) if str(args.file).isprintable() else ascii(str(args.file))
    if verdict.accepted:
        print(f"check-kernel {args.kernel} {shown}: accepted (params {json.dumps(verdict.params)})",
              file=sys.stderr)
        return 0
    print(f"check-kernel {args.kernel} {shown}: REJECTED by guard {verdict.guard}: {verdict.reason}",
          file=sys.stderr)
    return 1
