"""Side-by-side kernel benchmark for issue 4: the built-in Triton templates, searched
exhaustively over their CONFIGS, against torch eager, eager in a CUDA graph, torch.compile,
cuBLAS / SDPA, Liger Kernel and a Triton-autotune-style pick over the same CONFIGS.

    python3 bench/kernels_gpu.py [--kernels rmsnorm,matmul] [--quick] [--out DIR]
                                 [--total-budget-s 360] [--budget-s 150]
    python3 bench/kernels_gpu.py --device cpu --quick      # smoke test under the interpreter

Writes to --out (default $OUT, else ./out/kernels_gpu):
  kernels_gpu.json    every (config, shape) verdict and time, every peer, the ceilings
  dispatch.json       kernelsearch.dispatch table format: the winners, plus "decisions" with
                      "stock" wherever the tuned kernel is not faster than stock by more
                      than the noise band (stock timed twice)
  tables.txt          the printed tables
Progress goes to stderr; the tables go to stdout at the end. A failing config, peer or
kernel is recorded (time inf) and the run goes on; results are written after every kernel.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

KERNELS = ["rmsnorm", "add_rmsnorm", "softmax", "matmul", "decode_attention"]
# Share of the remaining time each kernel gets (matmul has the biggest space and sweep).
WEIGHT = {"rmsnorm": 1.0, "add_rmsnorm": 1.0, "softmax": 0.8, "matmul": 1.6, "decode_attention": 1.3}
SEARCH_SHARE = 0.6          # of a kernel's budget for the config search; the rest for peers
MAX_INPUT_SETS = 16         # rotate among input sets so small shapes do not sit in L2
EPS = 1e-6

_T0 = time.time()


def log(msg: str) -> None:
    print(f"[{time.time() - _T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- shapes

def sweep(kernel: str, device: str, quick: bool) -> list[dict]:
    if device == "cpu":  # interpreter smoke test: tiny, odd
        return {"rmsnorm": [{"M": 3, "N": 130}, {"M": 1, "N": 64}],
                "add_rmsnorm": [{"M": 3, "N": 130}, {"M": 1, "N": 64}],
                "softmax": [{"M": 3, "N": 130}, {"M": 1, "N": 64}],
                "matmul": [{"M": 1, "K": 64, "N": 96}, {"M": 20, "K": 48, "N": 33}],
                "decode_attention": [{"B": 2, "Hq": 4, "Hkv": 2, "S": 40, "D": 32}]}[kernel]
    rows = [{"M": 1, "N": 4096}, {"M": 16, "N": 4096}, {"M": 4096, "N": 4096},
            {"M": 16384, "N": 3000}, {"M": 32768, "N": 8192}, {"M": 8191, "N": 5121}]
    if kernel in ("rmsnorm", "add_rmsnorm", "softmax"):
        return [rows[1], rows[4]] if quick else rows
    if kernel == "matmul":
        kn = [(4096, 4096), (4096, 14336), (14336, 4096), (8192, 28672)]  # (K, N)
        decode = [{"M": m, "K": k, "N": n} for m in (1, 4, 16) for k, n in kn]
        prefill = [{"M": 2048, "K": 4096, "N": 4096}, {"M": 1000, "K": 3000, "N": 5121}]
        if quick:
            return [decode[0], prefill[0]]
        return decode + prefill
    ctx = [(b, s) for b in (1, 8, 32) for s in (2048, 8192, 32768)]
    shapes = [{"B": b, "Hq": 32, "Hkv": 8, "S": s, "D": 128} for b, s in ctx]
    return [shapes[1], shapes[5]] if quick else shapes


def shape_str(shape: dict) -> str:
    return "x".join(str(v) for v in shape.values())


def cost(kernel: str, shape: dict, elem: int) -> tuple[int, int]:
    """(fewest bytes moved, flops) for one call."""
    if kernel in ("rmsnorm", "softmax"):
        m, n = shape["M"], shape["N"]
        return (2 * m * n + (n if kernel == "rmsnorm" else 0)) * elem, 4 * m * n
    if kernel == "add_rmsnorm":
        m, n = shape["M"], shape["N"]
        return (4 * m * n + n) * elem, 5 * m * n
    if kernel == "matmul":
        m, n, k = shape["M"], shape["N"], shape["K"]
        return (m * k + k * n + m * n) * elem, 2 * m * n * k
    b, hq, hkv, s, d = shape["B"], shape["Hq"], shape["Hkv"], shape["S"], shape["D"]
    return (2 * b * hkv * s * d + 2 * b * hq * d) * elem + 4 * b, 4 * b * hq * s * d


# ----------------------------------------------------------------------------- inputs

def make_inputs(kernel, shape, dtype, device, gen, full_lens=True):
    import torch

    def rnd(*s, scale=1.0):
        return (torch.randn(*s, generator=gen, device=device, dtype=torch.float32) * scale).to(dtype)

    if kernel == "rmsnorm":
        return dict(x=rnd(shape["M"], shape["N"], scale=2.0), weight=1.0 + rnd(shape["N"], scale=0.5),
                    eps=EPS)
    if kernel == "add_rmsnorm":
        return dict(x=rnd(shape["M"], shape["N"]), residual=rnd(shape["M"], shape["N"], scale=4.0),
                    weight=1.0 + rnd(shape["N"], scale=0.5), eps=EPS)
    if kernel == "softmax":
        return dict(x=rnd(shape["M"], shape["N"], scale=3.0))
    if kernel == "matmul":
        return dict(a=rnd(shape["M"], shape["K"]), b=rnd(shape["K"], shape["N"], scale=0.05))
    b, hq, hkv, s, d = shape["B"], shape["Hq"], shape["Hkv"], shape["S"], shape["D"]
    if full_lens:
        lens = torch.full((b,), s, dtype=torch.int32, device=device)
    else:
        lens = torch.randint(1, s + 1, (b,), generator=gen, device=device, dtype=torch.int32)
        lens[0] = s
    return dict(q=rnd(b, hq, d), k_cache=rnd(b, hkv, s, d), v_cache=rnd(b, hkv, s, d),
                seq_lens=lens, scale=d ** -0.5)


def make_outputs(kernel, shape, dtype, device):
    import torch
    if kernel in ("rmsnorm", "softmax"):
        return dict(out=torch.empty(shape["M"], shape["N"], dtype=dtype, device=device))
    if kernel == "add_rmsnorm":
        return dict(out=torch.empty(shape["M"], shape["N"], dtype=dtype, device=device),
                    residual_out=torch.empty(shape["M"], shape["N"], dtype=dtype, device=device))
    if kernel == "matmul":
        return dict(out=torch.empty(shape["M"], shape["N"], dtype=dtype, device=device))
    return dict(out=torch.empty(shape["B"], shape["Hq"], shape["D"], dtype=dtype, device=device))


def call_template(kernel, mod, i, o, params):
    if kernel == "rmsnorm":
        return mod.launch(i["x"], i["weight"], i["eps"], o["out"], **params)
    if kernel == "add_rmsnorm":
        return mod.launch(i["x"], i["residual"], i["weight"], i["eps"], o["out"], o["residual_out"], **params)
    if kernel == "softmax":
        return mod.launch(i["x"], o["out"], **params)
    if kernel == "matmul":
        return mod.launch(i["a"], i["b"], o["out"], **params)
    return mod.launch(i["q"], i["k_cache"], i["v_cache"], i["seq_lens"], i["scale"], o["out"], **params)


def reference(kernel, i) -> dict:
    """fp32 torch reference on the device (inputs upcast)."""
    import torch
    if kernel == "rmsnorm":
        x = i["x"].float()
        return dict(out=x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + i["eps"]) * i["weight"].float())
    if kernel == "add_rmsnorm":
        s = i["x"].float() + i["residual"].float()
        r = s.to(i["x"].dtype).float()
        return dict(out=r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + i["eps"]) * i["weight"].float(),
                    residual_out=s)
    if kernel == "softmax":
        return dict(out=torch.softmax(i["x"].float(), -1))
    if kernel == "matmul":
        return dict(out=i["a"].float() @ i["b"].float())
    q, k, v = i["q"].float(), i["k_cache"].float(), i["v_cache"].float()
    B, Hq, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    qg = q.view(B, Hkv, Hq // Hkv, D)
    scores = torch.matmul(qg, k.transpose(-1, -2)) * i["scale"]
    valid = torch.arange(S, device=q.device)[None, :] < i["seq_lens"].long()[:, None]
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    return dict(out=torch.matmul(torch.softmax(scores, -1), v).reshape(B, Hq, D))


def rel_l2(out, ref) -> float:
    import torch
    out = out.float()
    if not bool(torch.isfinite(out).all()):
        return math.inf
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def check(kernel, outs: dict, ref: dict, tol: float) -> str | None:
    for name, r in ref.items():
        err = rel_l2(outs[name], r)
        if not err <= tol:
            return f"{name}: relative L2 error {err:.3g} > {tol}"
    return None


# ----------------------------------------------------------------------------- peers

def peers(kernel: str, liger) -> dict:
    """name -> f(inputs) returning a dict of outputs (allocating, as users call them)."""
    import torch
    import torch.nn.functional as F
    P = {}
    if kernel == "rmsnorm":
        def eager(i):
            if hasattr(F, "rms_norm"):
                return dict(out=F.rms_norm(i["x"], (i["x"].shape[-1],), i["weight"], i["eps"]))
            x = i["x"].float()
            return dict(out=(x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + i["eps"])).to(i["x"].dtype) * i["weight"])
        P["eager"] = eager
        if liger.get("rms_norm"):
            f = liger["rms_norm"]
            P["liger"] = lambda i: dict(out=f(i["x"], i["weight"], i["eps"], 0.0, "llama", False)[0])
    elif kernel == "add_rmsnorm":
        def eager(i):
            r = i["x"] + i["residual"]
            if hasattr(F, "rms_norm"):
                return dict(out=F.rms_norm(r, (r.shape[-1],), i["weight"], i["eps"]), residual_out=r)
            rf = r.float()
            return dict(out=(rf * torch.rsqrt(rf.pow(2).mean(-1, keepdim=True) + i["eps"])).to(r.dtype) * i["weight"],
                        residual_out=r)
        P["eager"] = eager
        if liger.get("fused_add_rms_norm"):
            f = liger["fused_add_rms_norm"]

            def lig(i):
                res = f(i["x"], i["residual"], i["weight"], i["eps"], 0.0, "llama")
                return dict(out=res[0], residual_out=res[1])
            P["liger"] = lig
    elif kernel == "softmax":
        P["eager"] = lambda i: dict(out=torch.softmax(i["x"], -1))
        if liger.get("softmax"):
            f = liger["softmax"]
            P["liger"] = lambda i: dict(out=f(i["x"])[0])
    elif kernel == "matmul":
        P["eager"] = lambda i: dict(out=torch.matmul(i["a"], i["b"]))
        P["cublas"] = P["eager"]  # eager matmul is cuBLAS; the graphed column is cuBLAS in a graph
    else:
        def eager(i):
            q, k, v = i["q"], i["k_cache"], i["v_cache"]
            B, Hq, D = q.shape
            Hkv, S = k.shape[1], k.shape[2]
            s = torch.matmul(q.view(B, Hkv, Hq // Hkv, D), k.transpose(-1, -2)).float() * i["scale"]
            valid = torch.arange(S, device=q.device)[None, :] < i["seq_lens"][:, None]
            s = s.masked_fill(~valid[:, None, None, :], float("-inf"))
            p = torch.softmax(s, -1).to(v.dtype)
            return dict(out=torch.matmul(p, v).reshape(B, Hq, D))
        P["eager"] = eager

        def sdpa(i, masked):
            q, k, v = i["q"], i["k_cache"], i["v_cache"]
            mask = None
            if masked:
                S = k.shape[2]
                mask = (torch.arange(S, device=q.device)[None, :] < i["seq_lens"][:, None])[:, None, None, :]
            try:
                o = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask, scale=i["scale"],
                                                   enable_gqa=True)
            except TypeError:
                g = q.shape[1] // k.shape[1]
                o = F.scaled_dot_product_attention(q.unsqueeze(2), k.repeat_interleave(g, 1),
                                                   v.repeat_interleave(g, 1), attn_mask=mask, scale=i["scale"])
            return dict(out=o.squeeze(2))
        # Timing inputs use full seq_lens, so unmasked SDPA (flash backend allowed) computes
        # the same function there; the masked call is what a caller with ragged lengths pays.
        P["sdpa"] = lambda i: sdpa(i, False)
        P["sdpa_mask"] = lambda i: sdpa(i, True)
    return P


def load_liger() -> dict:
    found = {}
    try:
        from liger_kernel.ops.rms_norm import rms_norm_forward
        found["rms_norm"] = rms_norm_forward
    except Exception as exc:
        log(f"liger rms_norm unavailable: {type(exc).__name__}: {exc}")
    try:
        from liger_kernel.ops.fused_add_rms_norm import fused_add_rms_norm_forward
        found["fused_add_rms_norm"] = fused_add_rms_norm_forward
    except Exception as exc:
        log(f"liger fused_add_rms_norm unavailable: {type(exc).__name__}: {exc}")
    try:
        from liger_kernel.ops.softmax import _softmax_forward
        found["softmax"] = _softmax_forward
    except Exception as exc:
        log(f"liger softmax unavailable: {type(exc).__name__}: {exc}")
    return found


def stock_fn(kernel):
    """The spec's stock fallback (what dispatch runs when it has no winner), or None."""
    try:
        from kernelsearch.specs import get_spec
        spec = get_spec(kernel)
    except Exception as exc:
        log(f"spec {kernel} unavailable ({type(exc).__name__}: {exc}); stock = eager peer")
        return None

    def run(i, o):
        spec.stock(i, o)
    return run


# ----------------------------------------------------------------------------- timing

class Timer:
    """Graph-replay timing (the harness's own) and plain eager-launch timing."""

    def __init__(self, device: str):
        self.device = device
        from kernelsearch.harness import timing
        self.harness = timing

    def graphed(self, fn) -> tuple[float, dict]:
        """Median ms per call of fn, replayed from a CUDA graph with L2 flushed between replays."""
        if self.device != "cuda":
            return self.eager(fn)
        t = self.harness.time_calls(fn, "cuda")
        return t.median_ms, {"method": t.method, "launches_per_replay": t.launches_per_replay,
                             "p20_ms": t.p20_ms, "p80_ms": t.p80_ms}

    def eager(self, fn, reps=15) -> tuple[float, dict]:
        """Median ms per call with ordinary launches (host launch overhead included)."""
        if self.device != "cuda":
            fn()
            times = []
            for _ in range(3):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
            return sorted(times)[1], {"method": "cpu_interpreter (not a speed)"}
        import torch
        flush = self.harness.l2_flush_buffer("cuda")
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        n = max(1, min(20, int(1.0 / max(s.elapsed_time(e), 1e-3))))
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        for k in range(reps):
            flush.zero_()
            starts[k].record()
            for _ in range(n):
                fn()
            ends[k].record()
        torch.cuda.synchronize()
        times = sorted(a.elapsed_time(b) / n for a, b in zip(starts, ends))
        return times[len(times) // 2], {"method": "eager_launches", "launches_per_rep": n}

    def sync(self):
        if self.device == "cuda":
            import torch
            torch.cuda.synchronize()


def rotating(sets: list, body):
    """fn() that calls body(set) on the next input set each time (so graphs cycle sets)."""
    state = {"k": 0}

    def fn():
        s = sets[state["k"] % len(sets)]
        state["k"] += 1
        return body(s)
    return fn


def is_fatal(exc: BaseException) -> bool:
    """A CUDA error that poisons the context: nothing after it can be trusted."""
    text = str(exc).lower()
    return any(w in text for w in ("illegal memory access", "unspecified launch failure",
                                   "device-side assert", "misaligned address", "illegal instruction"))


def short_err(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().replace("\n", " ")
    return text[:300]


# ----------------------------------------------------------------------------- precompile

_WORKER_CACHE: dict = {}


def _shrunk(kernel: str, shape: dict) -> dict:
    """A smaller shape that compiles to the same specializations (only non-constexpr dims shrink)."""
    s = dict(shape)
    if kernel in ("rmsnorm", "add_rmsnorm", "softmax"):
        s["M"] = min(s["M"], 256)  # M is not specialized
    elif kernel == "matmul" and s["M"] > 64:
        s["M"] = 64 + (s["M"] % 16)  # same divisibility-by-16 class, > 16
    elif kernel == "decode_attention":
        s["B"] = 1
    return s


def _precompile_worker(kernel: str, shapes: list, configs: list, dtype_name: str, device: str) -> int:
    """Child process: run each config once per shape so Triton's disk cache holds the binaries."""
    import torch
    if kernel not in _WORKER_CACHE:
        from kernelsearch.kernels import load_template
        dtype = getattr(torch, dtype_name)
        gen = torch.Generator(device=device).manual_seed(0)
        cases = []
        for shape in shapes:
            sh = _shrunk(kernel, shape)
            cases.append((make_inputs(kernel, sh, dtype, device, gen), make_outputs(kernel, sh, dtype, device)))
        _WORKER_CACHE[kernel] = (load_template(kernel), cases)
    mod, cases = _WORKER_CACHE[kernel]
    done = 0
    for params in configs:
        for (shape, (i, o)) in zip(shapes, cases):
            if skip_reason(kernel, shape, params):
                continue
            try:
                call_template(kernel, mod, i, o, params)
                if device == "cuda":
                    torch.cuda.synchronize()
                done += 1
            except Exception as exc:
                if is_fatal(exc):
                    raise
    return done


def precompile(plan: dict, workers: int, deadline: float, dtype_name: str, device: str = "cuda") -> dict:
    """Compile every (kernel, config, shape) in parallel child processes, before any timing."""
    import concurrent.futures as cf
    import multiprocessing as mp
    t0 = time.time()
    stats = {"workers": workers, "tasks": 0, "done": 0, "failed_tasks": 0}
    try:
        ctx = mp.get_context("spawn")
        pool = cf.ProcessPoolExecutor(max_workers=workers, mp_context=ctx)
    except Exception as exc:
        stats["error"] = short_err(exc)
        return stats
    # Small tasks, interleaved across kernels, in the order the search will reach them: when
    # the deadline cuts this phase short, every kernel has its first configs compiled.
    queues = {k: [configs[j:j + 4] for j in range(0, len(configs), 4)] for k, (_, configs) in plan.items()}
    futures = []
    while any(queues.values()):
        for kernel, q in queues.items():
            if q:
                futures.append(pool.submit(_precompile_worker, kernel, plan[kernel][0], q.pop(0), dtype_name, device))
    stats["tasks"] = len(futures)
    try:
        for fut in cf.as_completed(futures, timeout=max(1.0, deadline - time.time())):
            try:
                stats["done"] += fut.result()
            except Exception as exc:
                stats["failed_tasks"] += 1
                stats.setdefault("errors", []).append(short_err(exc))
    except cf.TimeoutError:
        stats["timed_out"] = True
    for fut in futures:
        fut.cancel()
    procs = list(getattr(pool, "_processes", {}).values())
    pool.shutdown(wait=False, cancel_futures=True)
    for p in procs:  # children this script started; a compile stuck past the deadline ends here
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=5)
    stats["seconds"] = round(time.time() - t0, 1)
    return stats


# ----------------------------------------------------------------------------- search

def skip_reason(kernel: str, shape: dict, params: dict) -> str | None:
    if kernel == "matmul" and params.get("variant") == "splitk" and shape["M"] > 64:
        return "splitk is a decode template (M <= 64)"
    return None


def config_order(configs: list, cap: int, seed: int = 0) -> list:
    """The first config (the template default order's head) then a seeded shuffle, capped."""
    rest = list(configs[1:])
    random.Random(seed).shuffle(rest)
    return ([configs[0]] + rest)[:cap] if configs else []


class Case:
    """One shape of one kernel: timing input sets, a fresh verification set and its reference."""

    def __init__(self, kernel, shape, dtype, device, gen, l2_bytes, tol):
        import torch
        self.kernel, self.shape, self.dtype, self.device, self.tol = kernel, shape, dtype, device, tol
        elem = torch.empty((), dtype=dtype).element_size()
        self.bytes, self.flops = cost(kernel, shape, elem)
        n_sets = 1 if device != "cuda" else max(1, min(MAX_INPUT_SETS, math.ceil(2 * l2_bytes / max(self.bytes, 1))))
        self.sets = [(make_inputs(kernel, shape, dtype, device, gen), make_outputs(kernel, shape, dtype, device))
                     for _ in range(n_sets)]
        # Verification: fresh random data (ragged seq_lens for attention), fp32 reference.
        self.vin = make_inputs(kernel, shape, dtype, device, gen, full_lens=False)
        self.vout = make_outputs(kernel, shape, dtype, device)
        self.vref = reference(kernel, self.vin)
        # Peers are checked on timing set 0 (full seq_lens, see peers()).
        self.ref0 = reference(kernel, self.sets[0][0])

    def poison_verify(self):
        for t in self.vout.values():
            t.fill_(float("nan"))


def evaluate_config(case: Case, mod, params: dict, timer: Timer) -> dict:
    kernel = case.kernel
    row = {"params": params}
    reason = skip_reason(kernel, case.shape, params)
    if reason:
        return {**row, "status": "skipped", "reason": reason, "time_ms": math.inf}
    try:
        case.poison_verify()
        call_template(kernel, mod, case.vin, case.vout, params)
        timer.sync()
        bad = check(kernel, case.vout, case.vref, case.tol)
        if bad:
            return {**row, "status": "wrong", "reason": bad, "time_ms": math.inf}
    except Exception as exc:
        if is_fatal(exc):
            raise
        return {**row, "status": "error", "reason": short_err(exc), "time_ms": math.inf}
    try:
        fn = rotating(case.sets, lambda s: call_template(kernel, mod, s[0], s[1], params))
        ms, info = timer.graphed(fn)
        # The outputs the timing runs wrote to input set 0 must be right too.
        bad = check(kernel, case.sets[0][1], case.ref0, case.tol)
        if bad:
            return {**row, "status": "wrong_after_timing", "reason": bad, "time_ms": math.inf}
        return {**row, "status": "ok", "time_ms": ms, "timing": info}
    except Exception as exc:
        if is_fatal(exc):
            raise
        return {**row, "status": "time_error", "reason": short_err(exc), "time_ms": math.inf}


def time_peer(case: Case, f, timer: Timer, graphed: bool) -> dict:
    try:
        outs = f(case.sets[0][0])
        timer.sync()
        bad = check(case.kernel, outs, case.ref0, case.tol)
        fn = rotating(case.sets, lambda s: f(s[0]))
        ms, info = timer.graphed(fn) if graphed else timer.eager(fn)
        return {"time_ms": ms, "timing": info, **({"wrong": bad} if bad else {})}
    except Exception as exc:
        if is_fatal(exc):
            raise
        return {"time_ms": math.inf, "error": short_err(exc)}


def autotune_pick(case: Case, mod, candidates: list, timer: Timer, time_cap_s: float) -> dict:
    """What @triton.autotune does for this shape: triton.testing.do_bench (median) of every
    candidate config, keep the minimum. Done over launch() because the templates compute
    grids and workspaces on the host and may launch two kernels."""
    import triton.testing
    t0 = time.time()
    best, best_ms = None, math.inf
    i, o = case.sets[0]
    tried = 0
    for params in candidates:
        if time.time() - t0 > time_cap_s:
            break
        tried += 1
        try:
            ms = triton.testing.do_bench(lambda: call_template(case.kernel, mod, i, o, params),
                                         warmup=5, rep=10, quantiles=[0.5])
            ms = ms[0] if isinstance(ms, (list, tuple)) else ms
        except Exception as exc:
            if is_fatal(exc):
                raise
            continue
        if ms < best_ms:
            best, best_ms = params, ms
    tune_s = time.time() - t0
    if best is None:
        return {"time_ms": math.inf, "tune_s": tune_s, "error": "no config ran"}
    fn = rotating(case.sets, lambda s: call_template(case.kernel, mod, s[0], s[1], best))
    ms, info = timer.graphed(fn)
    return {"time_ms": ms, "params": best, "do_bench_ms": best_ms, "tune_s": round(tune_s, 2),
            "candidates": tried, "of": len(candidates), "timing": info}


def run_kernel(kernel: str, args, timer: Timer, ceilings: dict, liger: dict, budget_s: float,
               global_deadline: float) -> dict:
    import torch
    from kernelsearch.kernels import load_template, template_path
    t_start = time.time()
    search_deadline = t_start + SEARCH_SHARE * budget_s
    kernel_deadline = t_start + budget_s
    device = args.device
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-4
    mod = load_template(kernel)
    gen = torch.Generator(device=device).manual_seed(int(time.time() * 1e6) % (2 ** 31))
    l2 = ceilings.get("l2_bytes", 60 << 20)
    shapes = sweep(kernel, device, args.quick)
    result = {"kernel": kernel, "dtype": str(dtype).replace("torch.", ""), "budget_s": round(budget_s, 1),
              "template": str(template_path(kernel).relative_to(ROOT)), "space": mod.SPACE,
              "n_configs_space": len(mod.CONFIGS), "shapes": []}
    cases = []
    for shape in shapes:
        try:
            cases.append(Case(kernel, shape, dtype, device, gen, l2, tol))
        except Exception as exc:
            if is_fatal(exc):
                raise
            log(f"{kernel} {shape_str(shape)}: inputs failed: {short_err(exc)}")
            result["shapes"].append({"shape": shape, "error": short_err(exc)})
    rows = {id(c): [] for c in cases}
    order = config_order(mod.CONFIGS, args.max_configs)
    n_done = 0
    for params in order:
        if time.time() > search_deadline:
            log(f"{kernel}: search budget spent after {n_done}/{len(order)} configs")
            break
        for case in cases:
            rows[id(case)].append(evaluate_config(case, mod, params, timer))
        n_done += 1
        if n_done % 10 == 0:
            log(f"{kernel}: {n_done}/{len(order)} configs")
    search_s = time.time() - t_start
    result["configs_evaluated"] = n_done
    result["search_s"] = round(search_s, 1)
    peer_fns = peers(kernel, liger)
    stock = stock_fn(kernel)
    for n_case, case in enumerate(cases):
        if time.time() > global_deadline + 20:
            log(f"{kernel}: past the run's deadline; peers for the remaining shapes skipped")
            result["shapes"].append({"shape": case.shape, "bytes": case.bytes, "flops": case.flops,
                                     "error": "skipped: run deadline", "configs": rows[id(case)]})
            continue
        log(f"{kernel} {shape_str(case.shape)}: peers")
        entry = {"shape": case.shape, "bytes": case.bytes, "flops": case.flops,
                 "input_sets": len(case.sets), "configs": rows[id(case)]}
        ok = [r for r in rows[id(case)] if r["status"] == "ok"]
        best = min(ok, key=lambda r: r["time_ms"]) if ok else None
        entry["best"] = {"params": best["params"], "time_ms": best["time_ms"]} if best else None
        entry["verdicts"] = {}
        for r in rows[id(case)]:
            entry["verdicts"][r["status"]] = entry["verdicts"].get(r["status"], 0) + 1
        pe = {}
        eager = peer_fns["eager"]
        pe["eager"] = time_peer(case, eager, timer, graphed=False)
        pe["graphed_eager"] = time_peer(case, eager, timer, graphed=True)
        for name in ("cublas", "sdpa", "sdpa_mask", "liger"):
            if name in peer_fns:
                pe[name] = time_peer(case, peer_fns[name], timer, graphed=True)
        if device == "cuda" and not args.no_compile:
            if time.time() < kernel_deadline - 5:
                try:
                    t0 = time.time()
                    compiled = torch.compile(eager, dynamic=False)
                    compiled(case.sets[0][0])
                    torch.cuda.synchronize()
                    compile_s = time.time() - t0
                    pe["compile"] = {**time_peer(case, compiled, timer, graphed=True), "compile_s": round(compile_s, 1)}
                except Exception as exc:
                    if is_fatal(exc):
                        raise
                    pe["compile"] = {"time_ms": math.inf, "error": short_err(exc)}
            else:
                pe["compile"] = {"time_ms": math.inf, "error": "skipped: kernel budget spent"}
        if device == "cuda":
            cands = [r["params"] for r in ok]
            cap_s = max(2.0, 0.5 * (kernel_deadline - time.time()) / (len(cases) - n_case))
            if cands:
                try:
                    pe["autotune"] = autotune_pick(case, mod, cands, timer, cap_s)
                except Exception as exc:
                    if is_fatal(exc):
                        raise
                    pe["autotune"] = {"time_ms": math.inf, "error": short_err(exc)}
            else:
                pe["autotune"] = {"time_ms": math.inf, "error": "skipped: no config or budget spent"}
        # Stock (what dispatch falls back to) timed twice: the noise band of this shape.
        if stock is not None:
            def stock_call(i, stock=stock, case=case):
                o = make_outputs(kernel, case.shape, case.dtype, case.device)
                stock(i, o)
                return o
            s1 = time_peer(case, stock_call, timer, graphed=True)
            s2 = time_peer(case, stock_call, timer, graphed=True)
        else:
            s1 = pe["graphed_eager"]
            s2 = time_peer(case, eager, timer, graphed=True)
        entry["stock"] = {"time_ms": s1["time_ms"], "time2_ms": s2["time_ms"],
                          "source": "spec.stock" if stock is not None else "eager"}
        entry["noise_band"] = noise(s1["time_ms"], s2["time_ms"])
        entry["peers"] = pe
        result["shapes"].append(entry)
    result["total_s"] = round(time.time() - t_start, 1)
    return result


def noise(a: float, b: float) -> float:
    if not (math.isfinite(a) and math.isfinite(b)) or min(a, b) <= 0:
        return math.inf
    return abs(a - b) / min(a, b)


# ----------------------------------------------------------------------------- report

PEER_COLS = [("eager", "eager"), ("graphed_eager", "graph"), ("compile", "compile"),
             ("cublas", "cuBLAS"), ("sdpa", "SDPA"), ("liger", "liger"), ("autotune", "autotune")]
NOISE_FLOOR = 0.01  # a single pair of stock timings understates the spread; never trust < 1%


def fmt_us(ms) -> str:
    return "-" if ms is None or not math.isfinite(ms) else f"{ms * 1e3:.1f}"


def short_params(p: dict) -> str:
    abbrev = {"ROWS_PER_PROG": "R", "BLOCK_N": "BN", "PROGRAMS_PER_SM": "P", "num_warps": "w",
              "num_stages": "s", "BLOCK_M": "BM", "BLOCK_K": "BK", "GROUP_M": "G", "SPLIT_K": "SK",
              "FMA": "fma", "BLOCK_S": "BS", "NUM_SPLITS": "NS", "variant": ""}
    return ",".join(f"{abbrev.get(k, k)}{v}" for k, v in p.items())


def roof(entry: dict, t_ms: float, ceil: dict) -> str:
    if not t_ms or not math.isfinite(t_ms) or not ceil.get("copy_gb_s"):
        return "-"
    mem_ms = entry["bytes"] / (ceil["copy_gb_s"] * 1e9) * 1e3
    cmp_ms = entry["flops"] / (ceil["matmul_tflops"] * 1e12) * 1e3
    if mem_ms >= cmp_ms:
        return f"{100 * mem_ms / t_ms:.0f}% BW"
    return f"{100 * cmp_ms / t_ms:.0f}% MM"


def table(res: dict, ceil: dict) -> str:
    head = ["shape", "MB", "best config", "tuned", *[c for _, c in PEER_COLS], "stock", "x best peer", "roof"]
    lines = [f"## {res['kernel']} ({res['dtype']}; times in us; {res.get('configs_evaluated', 0)} of "
             f"{res.get('n_configs_space', 0)} configs; search {res.get('search_s', 0)} s, total {res.get('total_s', 0)} s)",
             " | ".join(head)]
    for e in res["shapes"]:
        if "best" not in e or "peers" not in e:
            lines.append(f"{shape_str(e['shape'])} | error: {e.get('error')}")
            continue
        tuned = e["best"]["time_ms"] if e["best"] else math.inf
        pe = e.get("peers", {})
        peer_times = {k: pe[k]["time_ms"] for k, _ in PEER_COLS if k in pe and not pe[k].get("wrong")}
        best_peer = min([t for t in peer_times.values() if math.isfinite(t)], default=math.inf)
        speed = f"{best_peer / tuned:.2f}" if math.isfinite(tuned) and math.isfinite(best_peer) else "-"
        cols = [shape_str(e["shape"]), f"{e['bytes'] / 1e6:.1f}",
                short_params(e["best"]["params"]) if e["best"] else "none passed", fmt_us(tuned)]
        for k, _ in PEER_COLS:
            p = pe.get(k)
            cols.append("n/a" if p is None else (fmt_us(p["time_ms"]) + ("!" if p.get("wrong") else "")))
        cols += [fmt_us(e["stock"]["time_ms"]), speed, roof(e, tuned, ceil)]
        lines.append(" | ".join(cols))
    lines.append("('!' = peer output outside tolerance; n/a = peer has no such op; - = failed/skipped)")
    return "\n".join(lines)


def dispatch_table(results: list, device: str) -> dict:
    """Winners in kernelsearch.dispatch's format; every shape's decision under "decisions"."""
    fp, fid = {}, None
    try:
        from kernelsearch.fingerprint import collect, fingerprint_id
        fp = collect(device)
        fid = fingerprint_id(fp)
    except Exception as exc:
        log(f"fingerprint unavailable: {short_err(exc)}")
    from kernelsearch.dispatch import file_sha256
    from kernelsearch.kernels import TEMPLATES, template_path
    entries, decisions = [], []
    for res in results:
        kernel = res["kernel"]
        for e in res["shapes"]:
            if not e.get("best") or "stock" not in e:
                if "stock" in e:
                    decisions.append({"kernel": kernel, "dtype": res["dtype"], "shape": e["shape"],
                                      "choice": "stock", "why": "no config passed"})
                continue
            tuned, stock_ms = e["best"]["time_ms"], e["stock"]["time_ms"]
            band = max(e["noise_band"], NOISE_FLOOR) if math.isfinite(e["noise_band"]) else math.inf
            wins = math.isfinite(tuned) and (not math.isfinite(stock_ms) or tuned * (1 + band) < stock_ms)
            d = {"kernel": kernel, "dtype": res["dtype"], "shape": e["shape"], "choice": "tuned" if wins else "stock",
                 "params": e["best"]["params"], "candidate_ms": tuned, "stock_ms": stock_ms, "noise_band": band}
            decisions.append(d)
            if wins:
                entries.append({"kernel": kernel, "dtype": res["dtype"], "shape": e["shape"],
                                "source": {"module": TEMPLATES[kernel]},
                                "source_hash": file_sha256(template_path(kernel)),
                                "params": e["best"]["params"], "candidate_ms": tuned, "stock_ms": stock_ms,
                                "speedup": (stock_ms / tuned) if math.isfinite(stock_ms) else None})
    return {"format": 1, "fingerprint_id": fid, "fingerprint": fp, "triton": fp.get("triton"),
            "torch": fp.get("torch"), "entries": entries, "decisions": decisions}


def jsonable(obj):
    if isinstance(obj, float) and not math.isfinite(obj):
        return None if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {k: jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    return obj


def write_outputs(out_dir: Path, doc: dict, results: list, device: str) -> str:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "kernels_gpu.json").write_text(json.dumps(jsonable(doc), indent=1) + "\n")
    try:
        (out_dir / "dispatch.json").write_text(json.dumps(jsonable(dispatch_table(results, device)), indent=1) + "\n")
    except Exception as exc:
        log(f"dispatch table failed: {short_err(exc)}")
    text = "\n\n".join(table(r, doc["ceilings"]) for r in results)
    (out_dir / "tables.txt").write_text(text + "\n")
    return text


# ----------------------------------------------------------------------------- main

def measure_ceilings(device: str) -> dict:
    import torch
    if device != "cuda":
        return {"device": "cpu"}
    c = {}
    try:
        from kernelsearch.roofline import measure
        c = measure("cuda")
    except Exception as exc:
        log(f"roofline.measure failed ({short_err(exc)}); no ceilings, no % of ceiling")
        c = {"error": short_err(exc)}
    props = torch.cuda.get_device_properties(0)
    c.update(gpu=props.name, sm_count=props.multi_processor_count,
             l2_bytes=getattr(props, "L2_cache_size", 0) or (60 << 20))
    return c


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernels", default=",".join(KERNELS), help="comma list, default all")
    ap.add_argument("--quick", action="store_true", help="two shapes per kernel, few configs")
    ap.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "out" / "kernels_gpu"))
    ap.add_argument("--total-budget-s", type=float, default=None,
                    help="wall-clock budget for the whole run (default 360, quick 150)")
    ap.add_argument("--budget-s", type=float, default=150.0, help="cap on one kernel's budget")
    ap.add_argument("--max-configs", type=int, default=None, help="cap on configs per kernel")
    ap.add_argument("--precompile-workers", type=int, default=None,
                    help="child processes compiling in parallel before timing (0: off)")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile peer")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    total = args.total_budget_s or (150.0 if args.quick else 360.0)
    if args.max_configs is None:
        args.max_configs = 12 if args.quick else (6 if args.device == "cpu" else 10 ** 6)
    deadline = _T0 + total
    import torch
    if args.device == "cuda" and not torch.cuda.is_available():
        log("no CUDA device: use --device cpu for the interpreter smoke test")
        return 2
    kernels = [k.strip() for k in args.kernels.split(",") if k.strip()]
    unknown = [k for k in kernels if k not in KERNELS]
    if unknown:
        log(f"unknown kernels {unknown}; known: {KERNELS}")
        return 2
    out_dir = Path(args.out)
    import triton
    doc = {"argv": sys.argv[1:], "torch": torch.__version__, "triton": triton.__version__,
           "device": args.device, "total_budget_s": total, "kernels": {}}
    log(f"torch {torch.__version__}, triton {triton.__version__}; kernels {kernels}; budget {total:.0f} s")
    doc["ceilings"] = measure_ceilings(args.device)
    log(f"ceilings: {json.dumps(jsonable(doc['ceilings']))}")
    timer = Timer(args.device)
    if args.device == "cuda" and not args.no_compile:
        try:  # one recompile per shape: keep dynamo from falling back to eager after 8
            import torch._dynamo
            for name in ("cache_size_limit", "recompile_limit"):
                if hasattr(torch._dynamo.config, name):
                    setattr(torch._dynamo.config, name, 256)
        except Exception as exc:
            log(f"dynamo config: {short_err(exc)}")
    doc["timer"] = "kernelsearch.harness.timing"
    liger = load_liger() if args.device == "cuda" else {}
    doc["liger"] = sorted(liger)

    from kernelsearch.kernels import load_template
    workers = args.precompile_workers
    if workers is None:
        workers = 0 if (args.quick or args.device != "cuda") else max(1, min(12, (os.cpu_count() or 4) - 2))
    if workers > 0:
        pc_s = min(110.0, 0.28 * (deadline - time.time()))
        plan = {}
        for k in kernels:
            shapes = sweep(k, args.device, args.quick)
            # Configs the search can reach in its share of the time (~25 ms per config and shape).
            share = (deadline - time.time() - pc_s) * WEIGHT[k] / sum(WEIGHT[j] for j in kernels)
            reach = int(1.3 * SEARCH_SHARE * share / (0.025 * len(shapes))) + 8
            plan[k] = (shapes, config_order(load_template(k).CONFIGS, min(args.max_configs, reach)))
        pc_deadline = time.time() + pc_s
        log(f"precompiling in {workers} child processes (until +{pc_deadline - time.time():.0f} s)")
        doc["precompile"] = precompile(plan, workers, pc_deadline,
                                       "bfloat16" if args.device == "cuda" else "float32", args.device)
        log(f"precompile: {doc['precompile']}")

    results = []
    for n, kernel in enumerate(kernels):
        left = deadline - time.time()
        weights = sum(WEIGHT[k] for k in kernels[n:])
        budget = min(args.budget_s, max(5.0, left * WEIGHT[kernel] / weights))
        log(f"== {kernel}: budget {budget:.0f} s")
        try:
            res = run_kernel(kernel, args, timer, doc["ceilings"], liger, budget, deadline)
        except Exception as exc:
            log(f"{kernel} failed: {short_err(exc)}\n{traceback.format_exc()}")
            res = {"kernel": kernel, "dtype": "bfloat16", "shapes": [], "error": short_err(exc)}
            results.append(res)
            doc["kernels"][kernel] = res
            write_outputs(out_dir, doc, results, args.device)
            if is_fatal(exc):
                log("CUDA context is poisoned: stopping here (results so far are written)")
                break
            continue
        results.append(res)
        doc["kernels"][kernel] = res
        text = write_outputs(out_dir, doc, results, args.device)
        print(table(res, doc["ceilings"]), file=sys.stderr, flush=True)
        torch.cuda.empty_cache() if args.device == "cuda" else None
    text = write_outputs(out_dir, doc, results, args.device)
    c = doc["ceilings"]
    if c.get("copy_gb_s"):
        print(f"ceilings: copy {c['copy_gb_s']:.0f} GB/s, bf16 matmul {c['matmul_tflops']:.0f} TFLOP/s "
              f"({c.get('gpu')}, L2 {c.get('l2_bytes', 0) >> 20} MiB); timer {doc['timer']}")
    print(text)
    print(f"wrote {out_dir}/kernels_gpu.json, dispatch.json, tables.txt in {time.time() - _T0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
