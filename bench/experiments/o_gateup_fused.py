"""Experiment: the O projection streamed inside the gate/up kernel ("what replaces" the 4096x4096
projection in issue 13), at batch 1.

Trusted code, not a candidate and not a template. One launch does both phases of a decoder
layer's middle: h = residual + a @ Wo.T (the O projection and its residual add), then
y = silu(g) * u with g | u = rmsnorm(h) * norm_weight @ Wgu.T (norm + gate/up + SwiGLU).
Programs 0..P_O-1 are O programs: each computes 8 rows of h, stores them, and counts itself
into a global-memory counter (CTA barrier, then a release atomic). Programs P_O.. are gate/up
programs: each spins on that counter (acquire) until all P_O O programs have arrived, then runs
the norm + gate/up + SwiGLU GEMV on h (read with .cg: L1 is not coherent across SMs). The last
gate/up program to finish sets both counters back to 0 (CUDA-graph safe). The probe assumes
what the hardware does in practice but CUDA does not promise: blocks are placed in index order,
so every O program is resident before a gate/up program can spin (all 512 fit in one wave at
80-88 registers); a kernel built from this would need that guarantee first. With PRE=1 a
gate/up program first loads its first gate and up tiles (values dropped) so that they are in
L2 when the counter releases it.

Against: the same two phases as two kernels (plain, and chained with programmatic dependent
launch: each waits first and lets the next launch after its loop), the O kernel and the gate/up
kernel alone. Each is checked against an fp64 reference first (fresh random inputs, poisoned
outputs); timer as bench/experiments/read_ceiling.py (one CUDA graph of CALLS layers, each on its
own weights, L2 flushed before each replay, median of 30). % of copy: the two weights' bytes
at the bench's copy rate.

    python3 bench/experiments/o_gateup_fused.py [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import sys

import torch
import triton
import triton.language as tl

from kernelsearch.harness.timing import time_calls

CALLS = 8
H, I = 4096, 14336
RO, RG, BK, STAGES = 8, 4, 512, 4

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:
    gdc_wait = gdc_launch_dependents = None


@triton.jit
def _o_phase(a_ptr, wo_ptr, res_ptr, h_ptr, pid, K, RO: tl.constexpr, BK: tl.constexpr,
             STAGES: tl.constexpr):
    rn = pid * RO + tl.arange(0, RO)
    rk = tl.arange(0, BK)
    acc = tl.zeros([RO, BK], dtype=tl.float32)
    for k in tl.range(0, K, BK, num_stages=STAGES):
        w = tl.load(wo_ptr + rn.to(tl.int64)[:, None] * K + (k + rk)[None, :], eviction_policy="evict_first")
        a = tl.load(a_ptr + k + rk)
        acc += w.to(tl.float32) * a.to(tl.float32)[None, :]
    r = tl.load(res_ptr + rn)
    tl.store(h_ptr + rn, (tl.sum(acc, axis=1) + r.to(tl.float32)).to(h_ptr.dtype.element_ty))


@triton.jit
def _gu_phase(h_ptr, nw_ptr, wgu_ptr, y_ptr, pid, K, I, eps, RG: tl.constexpr, BK: tl.constexpr,
              STAGES: tl.constexpr):
    rn = pid * RG + tl.arange(0, RG)
    rk = tl.arange(0, BK)
    accg = tl.zeros([RG, BK], dtype=tl.float32)
    accu = tl.zeros([RG, BK], dtype=tl.float32)
    ss = tl.zeros([BK], dtype=tl.float32)
    for k in tl.range(0, K, BK, num_stages=STAGES):
        wg = tl.load(wgu_ptr + rn.to(tl.int64)[:, None] * K + (k + rk)[None, :], eviction_policy="evict_first")
        wu = tl.load(wgu_ptr + (I + rn).to(tl.int64)[:, None] * K + (k + rk)[None, :],
                     eviction_policy="evict_first")
        h = tl.load(h_ptr + k + rk, cache_modifier=".cg").to(tl.float32)
        nw = tl.load(nw_ptr + k + rk).to(tl.float32)
        ss += h * h
        x = h * nw
        accg += wg.to(tl.float32) * x[None, :]
        accu += wu.to(tl.float32) * x[None, :]
    inv = 1.0 / tl.sqrt(tl.sum(ss, axis=0) / K + eps)
    g = tl.sum(accg, axis=1) * inv
    u = tl.sum(accu, axis=1) * inv
    tl.store(y_ptr + rn, (g / (1.0 + tl.exp(-g)) * u).to(y_ptr.dtype.element_ty))


@triton.jit
def _fused(a_ptr, wo_ptr, res_ptr, h_ptr, nw_ptr, wgu_ptr, y_ptr, cnt_ptr, K, I, eps, P_O, P_GU,
           RO: tl.constexpr, RG: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr,
           PRE: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_wait()
    pid = tl.program_id(0)
    if pid < P_O:
        _o_phase(a_ptr, wo_ptr, res_ptr, h_ptr, pid, K, RO, BK, STAGES)
        tl.debug_barrier()  # every thread's h stores before the release
        tl.atomic_add(cnt_ptr, 1, sem="release")
    else:
        q = pid - P_O
        if PRE:
            rn = q * RG + tl.arange(0, RG)
            rk = tl.arange(0, BK)
            tl.load(wgu_ptr + rn.to(tl.int64)[:, None] * K + rk[None, :], volatile=True)
            tl.load(wgu_ptr + (I + rn).to(tl.int64)[:, None] * K + rk[None, :], volatile=True)
        n = tl.atomic_add(cnt_ptr, 0, sem="acquire")
        while n < P_O:
            n = tl.atomic_add(cnt_ptr, 0, sem="acquire")
        _gu_phase(h_ptr, nw_ptr, wgu_ptr, y_ptr, q, K, I, eps, RG, BK, STAGES)
        tl.debug_barrier()
        done = tl.atomic_add(cnt_ptr + 1, 1, sem="acq_rel")
        if done == P_GU - 1:  # every gate/up program is past its wait: ready for the next launch
            tl.atomic_xchg(cnt_ptr, 0, sem="relaxed")
            tl.atomic_xchg(cnt_ptr + 1, 0, sem="relaxed")
    if PDL:
        gdc_launch_dependents()


@triton.jit
def _o_kernel(a_ptr, wo_ptr, res_ptr, h_ptr, K, RO: tl.constexpr, BK: tl.constexpr,
              STAGES: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_wait()
    _o_phase(a_ptr, wo_ptr, res_ptr, h_ptr, tl.program_id(0), K, RO, BK, STAGES)
    if PDL:
        gdc_launch_dependents()


@triton.jit
def _gu_kernel(h_ptr, nw_ptr, wgu_ptr, y_ptr, K, I, eps, RG: tl.constexpr, BK: tl.constexpr,
               STAGES: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_wait()
    _gu_phase(h_ptr, nw_ptr, wgu_ptr, y_ptr, tl.program_id(0), K, I, eps, RG, BK, STAGES)
    if PDL:
        gdc_launch_dependents()


def _pdl_kw(pdl):
    return {"launch_pdl": True} if pdl else {}


def run_fused(b, cnt, pre=False, pdl=False):
    P_O, P_GU = H // RO, I // RG
    _fused[(P_O + P_GU,)](b["a"], b["wo"], b["res"], b["h"], b["nw"], b["wgu"], b["y"], cnt, H, I, 1e-5,
                          P_O, P_GU, RO=RO, RG=RG, BK=BK, STAGES=STAGES, PRE=pre, PDL=pdl,
                          num_warps=4, num_stages=STAGES, **_pdl_kw(pdl))


def run_o(b, pdl=False):
    _o_kernel[(H // RO,)](b["a"], b["wo"], b["res"], b["h"], H, RO=RO, BK=BK, STAGES=STAGES, PDL=pdl,
                          num_warps=4, num_stages=STAGES, **_pdl_kw(pdl))


def run_gu(b, pdl=False):
    _gu_kernel[(I // RG,)](b["h"], b["nw"], b["wgu"], b["y"], H, I, 1e-5, RG=RG, BK=BK, STAGES=STAGES,
                           PDL=pdl, num_warps=4, num_stages=STAGES, **_pdl_kw(pdl))


def make_bufs(device, dtype):
    return {"a": torch.randn(H, device=device, dtype=dtype),
            "wo": (torch.randn(H, H, device=device, dtype=dtype) / 64),
            "res": torch.randn(H, device=device, dtype=dtype),
            "h": torch.empty(H, device=device, dtype=dtype),
            "nw": (1 + 0.1 * torch.randn(H, device=device, dtype=dtype)),
            "wgu": (torch.randn(2 * I, H, device=device, dtype=dtype) / 64),
            "y": torch.empty(I, device=device, dtype=dtype)}


def reference(b):
    h = b["res"].double() + b["wo"].double() @ b["a"].double()
    hn = h / torch.sqrt((h * h).mean() + 1e-5) * b["nw"].double()
    gu = b["wgu"].double() @ hn
    g, u = gu[:I], gu[I:]
    return h, g / (1 + torch.exp(-g)) * u


def check(b, fn):
    b["h"].fill_(float("nan"))
    b["y"].fill_(float("nan"))
    fn()
    if b["h"].is_cuda:
        torch.cuda.synchronize()
    h, y = reference(b)
    eh = ((b["h"].double() - h).norm() / h.norm()).item()
    ey = ((b["y"].double() - y).norm() / y.norm()).item()
    return eh, ey


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.manual_seed(0)
    from daemon.bench.run import measure_copy_bandwidth_gbs

    dev = torch.cuda.get_device_properties(0)
    copy_gbs = measure_copy_bandwidth_gbs("cuda")
    floor_us = (H * H + 2 * I * H) * 2 / (copy_gbs * 1e3)
    print(f"{dev.name}  triton {triton.__version__}  copy {copy_gbs:.0f} GB/s; O + gate|up weights "
          f"{(H * H + 2 * I * H) * 2 / 1e6:.1f} MB = {floor_us:.2f} us at copy rate", flush=True)
    bufs = [make_bufs("cuda", torch.bfloat16) for _ in range(CALLS)]
    cnt = torch.zeros(2, device="cuda", dtype=torch.int32)
    variants = {
        "O kernel alone": (lambda b: run_o(b), False),
        "gate/up kernel alone": (lambda b: run_gu(b), False),
        "chain: O, then gate/up (plain)": (lambda b: (run_o(b), run_gu(b)), True),
        "chain with PDL": (lambda b: (run_o(b, True), run_gu(b, True)), True),
        "fused (plain)": (lambda b: run_fused(b, cnt), True),
        "fused, PRE": (lambda b: run_fused(b, cnt, pre=True), True),
        "fused with PDL": (lambda b: run_fused(b, cnt, pdl=True), True),
        "fused, PRE, with PDL": (lambda b: run_fused(b, cnt, pre=True, pdl=True), True),
    }
    rows = []
    for label, (fn, full) in variants.items():
        row = {"label": label}
        try:
            if full:
                for _ in range(2):  # twice: the counters must be back at 0
                    eh, ey = check(bufs[0], lambda: fn(bufs[0]))
                    if not (eh < 1e-2 and ey < 2e-2):
                        raise ValueError(f"wrong: h rel {eh:.2e}, y rel {ey:.2e}")
                row.update(err_h=eh, err_y=ey)
            t = time_calls(lambda: [fn(b) for b in bufs], "cuda", reps=30, calls=CALLS)
            row["us"] = t.median_ms * 1e3
            row["pct_copy"] = 100 * floor_us / row["us"] if full else None
            print(f"  {row['us']:8.2f} us" + (f"  {row['pct_copy']:5.1f}% of copy" if full else "") + f"  {label}",
                  flush=True)
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            print(f"  {label}: {row['error']}", flush=True)
        rows.append(row)
    print(f"counters after: {cnt.tolist()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": dev.name, "copy_gbs": copy_gbs, "floor_us": floor_us, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
