"""How fast the verifier judges, against what a Triton user would run instead (one GPU).

    python bench/verifier_speed_gpu.py [--configs 24] [--out DIR] [--profile]

1. `search` (cold): a fresh process, a fresh Triton cache, the rmsnorm template's first N
   CONFIGS over the CUDA sweep through kernelsearch.search (grid): wall time, evaluations,
   evaluations/min, the kept winner per shape. Every evaluation is the full verifier (sandbox
   plans, fresh inputs, poison, canaries, the shape drawn at random, timed replays checked).
2. `autotune` (cold): a fresh process and cache, a @triton.autotune rmsnorm kernel over 24
   configs (ROWS x num_warps x num_stages), first call at each sweep shape (that is when
   autotune compiles and benchmarks): wall time.
3. `compare`: in one process, the same timer (CUDA graph replay, L2 flushed, median) for
   F.rms_norm, the autotune picks and the search's dispatch winners at each shape.
Prints tables; writes verifier_speed.json under --out (or $OUT). --profile runs the cold search
under cProfile (the search process, and the trusted executor through HWTUNE_EXECUTOR_PROFILE) and
prints where the time goes.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

AUTOTUNE_SRC = '''
import torch, triton, triton.language as tl

CONFIGS = [triton.Config({"ROWS": r}, num_warps=w, num_stages=s)
           for r in (1, 2, 4) for w in (2, 4, 8, 16) for s in (1, 2)]


@triton.autotune(configs=CONFIGS, key=["M", "N"])
@triton.jit
def rmsnorm_at(x_ptr, w_ptr, out_ptr, M, N, eps, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / N + eps)
    tl.store(out_ptr + offs, (x * rstd[:, None] * w[None, :]).to(out_ptr.dtype.element_ty), mask=mask)


def rmsnorm(x, w, eps, out):
    M, N = x.shape
    rmsnorm_at[lambda META: (triton.cdiv(M, META["ROWS"]),)](x, w, out, M, N, eps,
                                                            BLOCK_N=triton.next_power_of_2(N))
    return out
'''


def _child_search(configs: int) -> dict:
    from kernelsearch.search import search

    state = Path(tempfile.mkdtemp(prefix="hwtune-bench-search-"))
    t0 = time.time()
    lines = []
    res = search("rmsnorm", state_dir=state, strategy="grid", budget=configs, device="cuda",
                 ceilings={"copy_gb_s": 4246.0, "matmul_tflops": 817.0}, progress=lines.append)
    wall = time.time() - t0
    # where a warm evaluation's time goes (same process: executor, compiled kernels, plans kept)
    from kernelsearch.harness import evaluate
    from kernelsearch.kernels import template_path

    warm = []
    for params in [dict(b["best_params"]) for b in []] or [None]:
        t1 = time.time()
        v = evaluate("rmsnorm", template_path("rmsnorm"), params=params, device="cuda")
        warm.append({"wall_s": time.time() - t1, "accepted": v.accepted,
                     "per_shape": [{"shape": x.shape, "random": x.random, "profile_s": x.profile_s}
                                   for x in v.shapes]})
    shapes = [{"shape": r.shape, "kept": r.kept, "stock_ms": r.stock_ms if math.isfinite(r.stock_ms) else None,
               "best_ms": r.best["candidate_ms"] if r.best else None,
               "best_params": r.best["params"] if r.best else None, "verdicts": r.verdicts}
              for r in res.shapes]
    return {"wall_s": wall, "evaluations": res.evaluations, "evals_per_min": 60 * res.evaluations / wall,
            "table": res.table_path, "shapes": shapes, "log_tail": lines[-5:], "warm_eval": warm,
            "log": lines}


def _child_autotune() -> dict:
    import torch

    from kernelsearch.specs import SPECS

    ns: dict = {}
    path = Path(tempfile.mkdtemp()) / "autotuned_rmsnorm.py"
    path.write_text(AUTOTUNE_SRC)
    import importlib.util

    spec = importlib.util.spec_from_file_location("autotuned_rmsnorm", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["autotuned_rmsnorm"] = mod
    spec.loader.exec_module(mod)
    torch.cuda.init()
    torch.empty(1, device="cuda")
    per_shape = []
    t0 = time.time()
    for s in SPECS["rmsnorm"].shapes("cuda"):
        x = torch.randn(s["M"], s["N"], device="cuda", dtype=torch.bfloat16)
        w = torch.randn(s["N"], device="cuda", dtype=torch.bfloat16)
        out = torch.empty_like(x)
        t1 = time.time()
        mod.rmsnorm(x, w, 1e-6, out)
        torch.cuda.synchronize()
        per_shape.append({"shape": s, "first_call_s": time.time() - t1,
                          "picked": str(mod.rmsnorm_at.best_config)})
    return {"wall_s": time.time() - t0, "shapes": per_shape, "configs": len(mod.CONFIGS)}


def _run_child(what: str, configs: int, profile_dir: str | None = None) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1",
               TRITON_CACHE_DIR=tempfile.mkdtemp(prefix="hwtune-cold-cache-"))
    cmd = [sys.executable, __file__, "--child", what, "--configs", str(configs)]
    if profile_dir:
        env["HWTUNE_EXECUTOR_PROFILE"] = os.path.join(profile_dir, f"{what}-executor.prof")
        cmd = [sys.executable, "-m", "cProfile", "-o", os.path.join(profile_dir, f"{what}-parent.prof")] + cmd[1:]
    t0 = time.time()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=560)
    total = time.time() - t0
    if proc.returncode != 0:
        return {"error": proc.stderr[-2000:], "process_s": total}
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    doc["process_s"] = total
    return doc


def _compare(table_path: str | None) -> list[dict]:
    import importlib.util

    import torch
    import torch.nn.functional as F

    from kernelsearch.dispatch import DispatchTable
    from kernelsearch.harness.timing import time_calls
    from kernelsearch.specs import SPECS

    path = Path(tempfile.mkdtemp()) / "autotuned_rmsnorm.py"
    path.write_text(AUTOTUNE_SRC)
    spec = importlib.util.spec_from_file_location("autotuned_rmsnorm_cmp", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["autotuned_rmsnorm_cmp"] = mod
    spec.loader.exec_module(mod)
    table = DispatchTable.load(table_path) if table_path and Path(table_path).exists() else DispatchTable.empty()
    rows = []
    for s in SPECS["rmsnorm"].shapes("cuda"):
        x = torch.randn(s["M"], s["N"], device="cuda", dtype=torch.bfloat16)
        w = torch.randn(s["N"], device="cuda", dtype=torch.bfloat16)
        out = torch.empty_like(x)
        ref = F.rms_norm(x, (s["N"],), w, 1e-6)
        row = {"shape": s}
        fns = {"F.rms_norm": lambda: F.rms_norm(x, (s["N"],), w, 1e-6),
               "autotune": lambda: mod.rmsnorm(x, w, 1e-6, out)}
        tuned, _, why = table.route("rmsnorm", x, w, 1e-6)
        if tuned is not None:
            fns["search winner"] = lambda: table.call("rmsnorm", x, w, 1e-6)
        row["search_route"] = why
        for name, fn in fns.items():
            try:
                got = fn()
                err = float((got.float() - ref.float()).norm() / ref.float().norm())
                a = time_calls(fn, "cuda").median_ms
                b = time_calls(fn, "cuda").median_ms
                row[name] = {"ms": (a + b) / 2, "band": abs(a - b) / min(a, b), "rel_err": err}
            except Exception as exc:  # noqa: BLE001 -- a row of the table, not a crash
                row[name] = {"error": f"{type(exc).__name__}: {exc}"[:200]}
        rows.append(row)
    return rows


def _eval_marks(log: list[str]) -> list[float]:
    """Wall seconds at which each evaluation finished, from the search's progress lines '[i Ts] ...'."""
    import re

    out = []
    for line in log:
        m = re.match(r"\s*\[(\d+) ([0-9.]+)s\]", line)
        if m:
            out.append(float(m.group(2)))
    return out


def _print_profiles(profile_dir: str, out_dir: str | None) -> None:
    """Top entries of each profile: to OUT/profile.txt (or stdout without --out)."""
    import io
    import pstats

    buf = io.StringIO()
    for name in ("search-parent.prof", "search-executor.prof"):
        path = os.path.join(profile_dir, name)
        if not os.path.exists(path):
            buf.write(f"\n(no profile {name})\n")
            continue
        for key in ("cumulative", "tottime"):
            buf.write(f"\n== profile {name}, by {key} ==\n")
            pstats.Stats(path, stream=buf).sort_stats(key).print_stats(60)
    if out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        Path(out_dir, "profile.txt").write_text(buf.getvalue())
        print(f"\nprofiles written to {Path(out_dir, 'profile.txt')}")
    else:
        print(buf.getvalue())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", type=int, default=24)
    ap.add_argument("--child", default=None)
    ap.add_argument("--out", default=os.environ.get("OUT"))
    ap.add_argument("--repeat", type=int, default=2, help="cold runs of each (fresh processes and caches)")
    ap.add_argument("--profile", action="store_true", help="cProfile the cold search (search process and executor)")
    args = ap.parse_args()
    if args.child == "search":
        print(json.dumps(_child_search(args.configs), default=str))
        return 0
    if args.child == "autotune":
        print(json.dumps(_child_autotune(), default=str))
        return 0
    profile_dir = tempfile.mkdtemp(prefix="hwtune-profile-") if args.profile else None
    runs = []
    for i in range(max(1, args.repeat)):  # alternate, so that drift hits both alike
        runs.append({"search": _run_child("search", args.configs, profile_dir if i == 0 else None),
                     "autotune": _run_child("autotune", args.configs)})
    report = {"runs": runs, "search": runs[-1]["search"], "autotune": runs[-1]["autotune"]}
    print("\n== cold: the verifier's search vs Triton's @autotune (rmsnorm, CUDA sweep) ==")
    for i, run in enumerate(runs, 1):
        s, a = run["search"], run["autotune"]
        if "error" in s:
            print(f"run {i} search failed:", s["error"][-1500:])
        else:
            marks = _eval_marks(s.get("log", []))
            steady = (60 * (len(marks) - 1) / (marks[-1] - marks[0])) if len(marks) > 2 else math.nan
            s["first_eval_s"], s["steady_evals_per_min"] = (marks[0] if marks else None), steady
            print(f"run {i} search   {args.configs} configs: {s['evaluations']} evaluations in {s['wall_s']:.1f} s "
                  f"({s['evals_per_min']:.1f}/min overall; first done at {marks[0] if marks else math.nan:.1f} s, "
                  f"then {steady:.1f}/min); process incl. start {s['process_s']:.1f} s")
        if "error" in a:
            print(f"run {i} autotune failed:", a["error"][-1500:])
        else:
            print(f"run {i} autotune {a['configs']} configs x {len(a['shapes'])} shapes: {a['wall_s']:.1f} s; "
                  f"process incl. start {a['process_s']:.1f} s")
    s = report["search"]
    report["compare"] = _compare(s.get("table"))
    print(f"\n{'shape':<16} {'F.rms_norm us':>14} {'autotune us':>12} {'search us':>10} {'search/auto':>11} "
          f"{'search/stock':>12}  winner")
    for r in report["compare"]:
        def us(k):
            v = r.get(k, {}).get("ms")
            return v * 1e3 if v else math.nan
        st, au, se = us("F.rms_norm"), us("autotune"), us("search winner")
        shape = f"{r['shape']['M']}x{r['shape']['N']}"
        print(f"{shape:<16} {st:>14.2f} {au:>12.2f} {se:>10.2f} {au / se:>10.2f}x {st / se:>11.2f}x  "
              f"{r['search_route']}")
    for w in s.get("warm_eval", []):
        print(f"\nwarm re-evaluation of CONFIGS[0]: {w['wall_s']:.2f} s, accepted {w['accepted']}")
        for x in w["per_shape"]:
            print(f"  {x['shape']} random={x['random']} {x['profile_s']}")
    if "log" in s:
        print("\nsearch log (evaluation lines with wall-clock marks):")
        for line in s["log"][:40]:
            print("  " + line[:160])
    if "shapes" in s:
        print("\nsearch per shape: kept, best, stock (harness timing)")
        for r in s["shapes"]:
            print(f"  {r['shape']}: kept={r['kept']} best={r['best_ms']} stock={r['stock_ms']} "
                  f"params={r['best_params']} verdicts={r['verdicts']}")
    if profile_dir:
        _print_profiles(profile_dir, args.out)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "verifier_speed.json").write_text(json.dumps(report, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
