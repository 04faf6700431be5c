"""GPU proof of the kernel harness (issue 3): run on a CUDA host, e.g. one H200.

    python bench/harness_gpu.py            # everything below, ~3-4 minutes
    python bench/harness_gpu.py --quick    # first 2 shapes per spec

1. check-kernel --device cuda on an honest candidate for every spec over the full CUDA sweep
   (bf16): verdict, per-shape error, candidate/stock median ms (CUDA graph replay, L2 flushed),
   speedup and the noise band (stock timed twice).
2. Attacks on the GPU: synchronising or using a private stream / capture state in launch()
   (the sandbox has no such thing: cannot be planned), a patched timer (static), a write past
   the output (canary zones), a counter kept across calls to skip work (persistent workspace
   not left zero), poison sniffing, reading uninitialised memory (nondeterministic), correct
   only on the published widths (the shape drawn at random), and an honest candidate timed by
   graph replay.
3. Optionally (--templates) the built-in templates kernelsearch/kernels/*.py.
Prints tables; writes harness_gpu.json under $OUT when set.
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
sys.path.insert(0, str(ROOT))

from kernelsearch.harness import evaluate  # noqa: E402
from kernelsearch.specs import SPECS  # noqa: E402

CANDIDATES = ROOT / "tests" / "candidates"
SPEC_NAMES = ["rmsnorm", "add_rmsnorm", "softmax", "matmul", "decode_attention"]


def _ms(v):
    return "-" if v is None or not math.isfinite(v) else f"{v:.4f}"


def _run(label, kernel, path, **kw):
    t0 = time.time()
    v = evaluate(kernel, path, device="cuda", **kw)
    wall_s = time.time() - t0
    print(f"[{wall_s:6.1f}s] {label}: {'ACCEPTED' if v.accepted else 'REJECTED'}"
          f"{'' if v.accepted else f' by {v.guard}: {v.reason[:300]}'}", flush=True)
    return v, wall_s


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="first 2 CUDA shapes per spec")
    ap.add_argument("--templates", action="store_true", help="also check kernelsearch/kernels/*.py")
    ap.add_argument("--specs", default=",".join(SPEC_NAMES))
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    props = torch.cuda.get_device_properties(0)
    print(f"device: {props.name}, L2 {getattr(props, 'L2_cache_size', 0) >> 20} MiB, torch {torch.__version__}",
          flush=True)
    report = {"device": props.name, "torch": torch.__version__, "honest": {}, "guards": {}, "templates": {}}
    specs = [s for s in args.specs.split(",") if s]

    rows = []
    for name in specs:
        shapes = SPECS[name].shapes("cuda")[:2] if args.quick else None
        v, wall_s = _run(f"honest {name}", name, CANDIDATES / f"honest_{name}.py", shapes=shapes)
        report["honest"][name] = {"wall_s": wall_s, **v.to_json()}
        rows += [(name, s) for s in v.shapes]

    print("\n== 1. honest candidates, full CUDA sweep (graph replay, L2 flushed, median of 25) ==")
    print(f"{'spec':<17} {'shape':<34} {'dtype':<9} {'err':>9} {'cand_ms':>9} {'stock_ms':>9} "
          f"{'speedup':>8} {'noise':>7} {'GB/s(cand)':>10} {'TF/s(cand)':>10} status")
    for name, s in rows:
        shape = " ".join(f"{k}={v}" for k, v in s.shape.items() if k != "dtype")
        err = "-" if s.error_rel_l2 is None else f"{s.error_rel_l2:.1e}"
        gbs = s.bytes / s.candidate_ms / 1e6 if math.isfinite(s.candidate_ms) else float("nan")
        tfs = s.flops / s.candidate_ms / 1e9 if math.isfinite(s.candidate_ms) else float("nan")
        noise = "-" if s.noise_band is None or not math.isfinite(s.noise_band) else f"{100 * s.noise_band:.1f}%"
        speed = "-" if s.speedup is None else f"{s.speedup:.2f}x"
        print(f"{name:<17} {shape:<34} {s.dtype:<9} {err:>9} {_ms(s.candidate_ms):>9} {_ms(s.stock_ms):>9} "
              f"{speed:>8} {noise:>7} {gbs:>10.1f} {tfs:>10.2f} {s.status}")

    print("\n== 2. GPU-only guards ==", flush=True)
    probe = [{"M": 4096, "N": 4096}]
    demos = [("sync inside launch", "hack_sync_in_launch", False, "exception"),
             ("private stream", "hack_private_stream", False, "exception"),
             ("replay a copy saved before capture", "hack_capture_replay_cache", False, "exception"),
             ("patched CUDA event timer", "hack_patch_timer", False, "static"),
             ("write past the output", "hack_oob_write", False, "out_of_bounds"),
             ("counter across calls to skip work", "hack_skip_reps", False, "workspace_state"),
             ("poison sniffing", "hack_sniff_poison", False, "unwritten_output"),
             ("uninitialised scratch (racy)", "hack_scratch_noise", False, "nondeterministic"),
             ("hard-coded eps", "hack_fixed_eps", False, "correctness"),
             ("honest, graph-replay timed", "honest_rmsnorm", True, None)]
    published = [("right only on published widths", "hack_published_only", False, None)]
    guard_rows = []
    for label, fname, expect_accept, expect_guard in demos:
        v, wall_s = _run(label, "rmsnorm", CANDIDATES / f"{fname}.py", shapes=probe)
        ok = v.accepted == expect_accept and (expect_guard is None or v.guard == expect_guard or (
            # the poison of each call is drawn (NaN, huge, random): when every check drew NaN, the
            # sniffer computed there and the graph-replayed calls are where it is caught
            fname == "hack_sniff_poison" and v.guard == "cuda_graph" and "still hold the poison" in v.reason))
        timing = v.shapes[0].timing if v.shapes else ""
        guard_rows.append((label, v.accepted, v.guard, ok, timing, v.reason[:120]))
        report["guards"][fname] = {"expected_guard": expect_guard, "as_expected": ok, **v.to_json()}
    for label, fname, expect_accept, expect_guard in published:
        v, wall_s = _run(label, "rmsnorm", CANDIDATES / f"{fname}.py", shapes=SPECS["rmsnorm"].shapes("cuda")[:2])
        ok = not v.accepted and "drawn at random" in v.reason
        guard_rows.append((label, v.accepted, v.guard, ok, "", v.reason[:120]))
        report["guards"][fname] = {"expected_guard": "any, on the shape drawn at random", "as_expected": ok,
                                   **v.to_json()}
    print(f"{'demo':<42} {'accepted':<9} {'guard':<14} {'as expected':<12} reason / timing")
    for label, acc, guard, ok, timing, reason in guard_rows:
        print(f"{label:<42} {str(acc):<9} {str(guard):<14} {str(ok):<12} {timing or reason}")

    if args.templates:
        print("\n== 3. built-in templates (first CONFIG) ==", flush=True)
        for name in specs:
            path = ROOT / "kernelsearch" / "kernels" / f"{name}.py"
            if path.exists():
                shapes = SPECS[name].shapes("cuda")[:2] if args.quick else None
                v, wall_s = _run(f"template {name}", name, path, shapes=shapes)
                report["templates"][name] = {"wall_s": wall_s, **v.to_json()}
                for s in v.shapes:
                    print(f"  {name:<17} {s.shape} cand {_ms(s.candidate_ms)} stock {_ms(s.stock_ms)} "
                          f"speedup {s.speedup and round(s.speedup, 2)} noise {s.noise_band}")

    print("\n== noise band per spec (stock timed twice; relative) ==")
    for name in specs:
        bands = [s.noise_band for n, s in rows if n == name and s.noise_band is not None and math.isfinite(s.noise_band)]
        if bands:
            print(f"{name:<17} median {100 * sorted(bands)[len(bands) // 2]:.2f}%  max {100 * max(bands):.2f}%  "
                  f"over {len(bands)} shapes")
    out = os.environ.get("OUT")
    if out:
        Path(out, "harness_gpu.json").write_text(json.dumps(report, indent=1))
        print(f"wrote {out}/harness_gpu.json")
    bad = [n for n in specs if not report["honest"][n]["accepted"]] + \
          [g for g, r in report["guards"].items() if not r["as_expected"]]
    print("ALL AS EXPECTED" if not bad else f"NOT AS EXPECTED: {bad}")
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
