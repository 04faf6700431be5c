"""Experiment: do TMA weight loads (tensor descriptors) stream the decode projections faster?

Trusted code, not a candidate and not a template: it decides whether a TMA variant is worth
building into linear_residual / rmsnorm_linear. For each decode shape (out = residual + x @ W.T,
bf16) it times, with the harness's timer (kernelsearch.harness.timing: one CUDA graph of CALLS
calls, each on its own buffers, L2 flushed before each replay, median of the replays):
  - copy: a device copy of the weight's bytes (the bandwidth a projection can hope for);
  - cublas: F.linear + add (what torch runs);
  - the linear_residual template's CONFIGS for that batch (cp.async, what the table holds);
  - tma: the same loops with the weight read through tl.make_tensor_descriptor (TMA on sm_90),
    swapab (wgmma) at batch 32, a register GEMV at batch 1, over a small grid.
Every result is checked against an fp64 reference first (fresh random inputs, poisoned output).

    python3 bench/experiments/tma_projection.py [--quick] [--json OUT]
"""
from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys

import torch
import triton
import triton.language as tl

from kernelsearch.harness.timing import time_calls
from kernelsearch.kernels import linear_residual as lr

CALLS = 8


@triton.jit
def _tma_swapab(x_ptr, w_ptr, r_ptr, ws_ptr, c_ptr, cnt_ptr, M, N, K, split_steps,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                STAGES: tl.constexpr, SPLITS: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    wd = tl.make_tensor_descriptor(w_ptr, shape=[N, K], strides=[K, 1], block_shape=[BLOCK_N, BLOCK_K])
    xd = tl.make_tensor_descriptor(x_ptr, shape=[M, K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K])
    k_lo = pid_k * split_steps * BLOCK_K
    k_hi = min(k_lo + split_steps * BLOCK_K, K)
    acc_t = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k in tl.range(k_lo, k_hi, BLOCK_K, num_stages=STAGES):
        w = wd.load([pid_n * BLOCK_N, k])
        a = xd.load([0, k])
        acc_t = tl.dot(w, tl.trans(a), acc_t)
    acc = tl.trans(acc_t)
    rm = tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if SPLITS == 1:
        res = tl.load(r_ptr + rm[:, None] * N + rn[None, :], mask=mask, other=0.0)
        tl.store(c_ptr + rm[:, None] * N + rn[None, :], (acc + res.to(tl.float32)).to(c_ptr.dtype.element_ty),
                 mask=mask)
    else:
        tl.store(ws_ptr + (pid_k * M + rm)[:, None] * N + rn[None, :], acc, mask=mask)
        tl.debug_barrier()
        counter = cnt_ptr + pid_n
        arrived = tl.atomic_add(counter, 1, sem="acq_rel")
        if arrived == SPLITS - 1:
            total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for sk in tl.static_range(SPLITS):
                total += tl.load(ws_ptr + (sk * M + rm)[:, None] * N + rn[None, :], mask=mask, other=0.0,
                                 cache_modifier=".cg")
            res = tl.load(r_ptr + rm[:, None] * N + rn[None, :], mask=mask, other=0.0)
            tl.store(c_ptr + rm[:, None] * N + rn[None, :],
                     (total + res.to(tl.float32)).to(c_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(counter, 0, sem="relaxed")


@triton.jit
def _tma_gemv(x_ptr, w_ptr, r_ptr, c_ptr, N, K,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr):
    pid_n = tl.program_id(0)
    wd = tl.make_tensor_descriptor(w_ptr, shape=[N, K], strides=[K, 1], block_shape=[BLOCK_N, BLOCK_K])
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        w = wd.load([pid_n * BLOCK_N, k])
        xv = tl.load(x_ptr + k + rk, mask=k + rk < K, other=0.0)
        acc += w.to(tl.float32) * xv.to(tl.float32)[None, :]
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    out = tl.sum(acc, axis=1)
    res = tl.load(r_ptr + rn, mask=rn < N, other=0.0)
    tl.store(c_ptr + rn, (out + res.to(tl.float32)).to(c_ptr.dtype.element_ty), mask=rn < N)


@triton.jit
def _rows_swapab(x_ptr, w_ptr, r_ptr, c_ptr, M, N, K, rows_per,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """swapab with a balanced grid: program p takes rows [p * rows_per, (p + 1) * rows_per) of W
    (rows_per <= BLOCK_N, masked), so that the grid can match the SM count at any N."""
    pid = tl.program_id(0)
    lo = pid * rows_per
    rn = lo + tl.arange(0, BLOCK_N)
    n_ok = (tl.arange(0, BLOCK_N) < rows_per) & (rn < N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + (rm % M)[:, None] * K + rk[None, :]
    w_ptrs = w_ptr + tl.where(n_ok, rn, 0).to(tl.int64)[:, None] * K + rk[None, :]
    acc_t = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        a = tl.load(x_ptrs)
        w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0, eviction_policy="evict_first")
        acc_t = tl.dot(w, tl.trans(a), acc_t)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    acc = tl.trans(acc_t)
    mask = (rm[:, None] < M) & n_ok[None, :]
    res = tl.load(r_ptr + rm[:, None] * N + rn[None, :], mask=mask, other=0.0)
    tl.store(c_ptr + rm[:, None] * N + rn[None, :], (acc + res.to(tl.float32)).to(c_ptr.dtype.element_ty),
             mask=mask)


def rows_launch(x, w, r, out, PROGRAMS, BLOCK_K, num_stages, num_warps=4):
    M, K = x.shape
    N = w.shape[0]
    rows_per = triton.cdiv(N, PROGRAMS)
    block_n = max(64, triton.next_power_of_2(rows_per))
    _rows_swapab[(triton.cdiv(N, rows_per),)](x, w, r, out, M, N, K, rows_per,
                                              BLOCK_M=max(16, triton.next_power_of_2(M)), BLOCK_N=block_n,
                                              BLOCK_K=BLOCK_K, num_warps=num_warps, num_stages=num_stages)
    return out


def rows_configs(N, sms):
    out = []
    for progs in sorted({sms, 2 * sms, sms - 4, 128, 256}):
        rows_per = -(-N // progs)
        block_n = max(64, 1 << (rows_per - 1).bit_length())
        for bk, stages in ((64, 10), (128, 6), (128, 4), (64, 6)):
            if (block_n + 32) * bk * 2 * stages <= 220 * 1024 and block_n <= 256:
                out.append(dict(PROGRAMS=progs, BLOCK_K=bk, num_stages=stages))
    return out


_cnt = {}


def _alloc(size, alignment, stream):
    return torch.empty(size, device="cuda", dtype=torch.int8)


def tma_launch(x, w, r, out, BLOCK_N, BLOCK_K, STAGES, SPLITS=1, num_warps=4):
    M, K = x.shape
    N = w.shape[0]
    if M == 1:
        _tma_gemv[(triton.cdiv(N, BLOCK_N),)](x, w, r, out, N, K, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                                              STAGES=STAGES, num_warps=num_warps)
        return out
    steps = triton.cdiv(triton.cdiv(K, SPLITS), BLOCK_K)
    splits = triton.cdiv(K, steps * BLOCK_K)
    ws = out if splits == 1 else torch.empty((splits, M, N), device=x.device, dtype=torch.float32)
    grid_n = triton.cdiv(N, BLOCK_N)
    cnt = _cnt.get(grid_n)
    if cnt is None:
        cnt = _cnt[grid_n] = torch.zeros(grid_n, dtype=torch.int32, device=x.device)
    _tma_swapab[(grid_n, splits)](x, w, r, ws, out, cnt, M, N, K, steps, BLOCK_M=max(16, triton.next_power_of_2(M)),
                                  BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, STAGES=STAGES, SPLITS=splits,
                                  num_warps=num_warps)
    return out


def tma_configs(M, quick):
    if M == 1:
        grid = itertools.product([8, 16, 32], [128, 256], [4, 6, 8], [4, 8])
        out = [dict(BLOCK_N=bn, BLOCK_K=bk, STAGES=s, num_warps=w) for bn, bk, s, w in grid
               if bn * bk <= 2048 * w and (bn * bk * 2 * (s - 1)) <= 200 * 1024]
    else:
        grid = itertools.product([64, 128], [64, 128, 256], [4, 6, 8, 10], [1, 2], [4])
        out = [dict(BLOCK_N=bn, BLOCK_K=bk, STAGES=s, SPLITS=sp, num_warps=w) for bn, bk, s, sp, w in grid
               if (bn + 32) * bk * 2 * s <= 220 * 1024]
    return out[::3] if quick else out


def measure(label, fn_for, bufs, ref, device="cuda"):
    """fn_for(i) runs call i on bufs[i]; verified on call 0 first."""
    x, w, r, out = bufs[0]
    out.fill_(float("nan"))
    try:
        fn_for(0)
        torch.cuda.synchronize()
    except Exception as exc:  # a config that does not build on this card
        return {"label": label, "error": f"{type(exc).__name__}: {str(exc)[:200]}"}
    err = (out.double() - ref).abs().max().item()
    tol = 2e-2 * ref.abs().max().item() + 1e-2
    if not err <= tol:
        return {"label": label, "error": f"wrong: max err {err:.3g} > {tol:.3g}"}

    def run():
        for i in range(CALLS):
            fn_for(i)
    t = time_calls(run, device, reps=30, calls=CALLS)
    return {"label": label, "us": t.median_ms * 1e3, "p20": t.p20_ms * 1e3, "p80": t.p80_ms * 1e3}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-tma", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--shapes", default="1x4096x4096,1x6144x4096,32x4096x4096,32x6144x4096,32x4096x14336")
    args = ap.parse_args()
    triton.set_allocator(_alloc)
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}", flush=True)
    big = torch.empty(256 << 20, device="cuda", dtype=torch.bfloat16)
    big_dst = torch.empty_like(big)
    # run 18 took this first, on an idle card (SM clock 345 MHz), and read 2420 / 2745 GB/s on an
    # H100 / H200 that the bench's 2 GB copy puts at ~3016 / ~4253: copy for a second first
    for _ in range(4000):
        big_dst.copy_(big)
    torch.cuda.synchronize()
    t = time_calls(lambda: big_dst.copy_(big), "cuda", reps=20)
    copy_gbs = 2 * big.numel() * 2 / (t.median_ms * 1e-3) / 1e9
    del big, big_dst
    print(f"copy bandwidth (512 MB read + 512 MB written): {copy_gbs:.0f} GB/s", flush=True)
    results = []
    for spec in args.shapes.split(","):
        M, N, K = (int(v) for v in spec.split("x"))
        bufs = []
        for _ in range(CALLS):
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5
            r = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
            bufs.append((x, w, r, torch.empty(M, N, device="cuda", dtype=torch.bfloat16)))
        x, w, r, _ = bufs[0]
        ref = r.double() + x.double() @ w.double().T
        rows = []
        src = [torch.empty(N * K, device="cuda", dtype=torch.bfloat16).normal_() for _ in range(CALLS)]
        dst = [torch.empty_like(s) for s in src]
        t = time_calls(lambda: [d.copy_(s) for d, s in zip(dst, src)], "cuda", reps=30, calls=CALLS)
        copy_us = t.median_ms * 1e3
        rows.append({"label": "copy (read + write of W's bytes)", "us": copy_us})
        read_floor_us = N * K * 2 / (copy_gbs * 1e9) * 1e6  # W's bytes at the large copy's rate
        rows.append(measure("cublas F.linear + add",
                            lambda i: bufs[i][3].copy_(torch.nn.functional.linear(bufs[i][0], bufs[i][1]) + bufs[i][2]),
                            bufs, ref))
        for p in lr.CONFIGS:
            if (M == 1) != (p["variant"] == "gemv"):
                continue
            rows.append(measure("template " + json.dumps(p, separators=(",", ":")),
                                lambda i, p=p: lr.launch(*bufs[i], **p), bufs, ref))
        if M > 1:
            sms = torch.cuda.get_device_properties(0).multi_processor_count
            for p in rows_configs(N, sms):
                rows.append(measure("rows " + json.dumps(p, separators=(",", ":")),
                                    lambda i, p=p: rows_launch(*bufs[i], **p), bufs, ref))
        for p in ([] if args.no_tma else tma_configs(M, args.quick)):
            rows.append(measure("tma " + json.dumps(p, separators=(",", ":")),
                                lambda i, p=p: tma_launch(*bufs[i], **p), bufs, ref))
        ok = [row for row in rows[1:] if "us" in row]
        for row in ok:
            row["pct_copy"] = 100 * read_floor_us / row["us"]
        best_t = min((row for row in ok if row["label"].startswith("template")), key=lambda r: r["us"], default=None)
        best_m = min((row for row in ok if row["label"].startswith("tma")), key=lambda r: r["us"], default=None)
        best_r = min((row for row in ok if row["label"].startswith("rows")), key=lambda r: r["us"], default=None)
        if best_t and best_r:
            print(f"  best rows / best template: {best_r['us']:.2f} / {best_t['us']:.2f} us = "
                  f"{best_t['us'] / best_r['us']:.3f}x")
        print(f"\n== M={M} N={N} K={K}: W's bytes at copy rate {read_floor_us:.2f} us (a copy of "
              f"them, read + write: {copy_us:.2f} us)", flush=True)
        for row in sorted(ok, key=lambda r: r["us"])[:12]:
            print(f"  {row['us']:8.2f} us  {row['pct_copy']:5.1f}% of copy  {row['label']}")
        bad = [row for row in rows if "error" in row]
        print(f"  ({len(bad)} configs failed: " + "; ".join(f"{r['label']}: {r['error'][:90]}" for r in bad[:4]) + ")")
        if best_t and best_m:
            print(f"  best tma / best template: {best_m['us']:.2f} / {best_t['us']:.2f} us = "
                  f"{best_t['us'] / best_m['us']:.3f}x")
        results.append({"shape": {"M": M, "N": N, "K": K}, "copy_us": copy_us, "floor_us": read_floor_us,
                        "rows": rows})
        del bufs, src, dst
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "triton": triton.__version__, "copy_gbs": copy_gbs,
                       "results": results}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
