"""Matmul template: out[M, N] = a[M, K] @ b[K, N], two variants chosen by the `variant` param.

- "tiled" (prefill shapes): each program computes a BLOCK_M x BLOCK_N tile with tl.dot over
  BLOCK_K steps, programs ordered in GROUP_M-tall groups so that neighbours share tiles of `a`
  and `b` in L2.
- "splitk" (decode shapes, M <= 16): a weight-streaming GEMV. Each program streams a
  [BLOCK_K, BLOCK_N] slab of `b` per step with wide loads along N (b is row-major), multiplies
  it by the matching [M, BLOCK_K] rows of `a` (tl.dot with M padded to 16, or a broadcast FMA
  when FMA=1, for tiny M), and covers one of SPLIT_K ranges of K, so that even N/BLOCK_N
  programs x SPLIT_K fill the chip. Partial sums go to an fp32 workspace [SPLIT_K, M, N]; a
  second kernel sums the splits in a fixed order and casts (deterministic, no atomics).
  With a single split the first kernel writes `out` directly.
  REDUCE="last" drops that second launch (about 2 us of a 14-35 us decode GEMV on the H200):
  each program bumps a per-tile arrival counter after storing its partial (a CTA barrier,
  then an acq_rel atomic: the CUTLASS semaphore pattern); the program that arrives last sums
  the SPLIT_K partials in split order 0..S-1 (the same bits every run, whoever arrives last),
  reading them through L2 (.cg), writes `out` and sets the counter back to 0 for the next
  launch. The counters are allocated zeroed once per device and reused (CUDA-graph safe: no
  fill kernel per launch).
fp32 accumulation, cast on store.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

SPACE = {
    "variant": ["tiled", "splitk"],
    "BLOCK_M": [16, 64, 128],          # splitk: 16 (rows of `a` per program, M is padded to it)
    "BLOCK_N": [64, 128, 256],
    "BLOCK_K": [32, 64, 128, 256],
    "GROUP_M": [8],
    "SPLIT_K": [1, 2, 4, 8, 16, 32],   # tiled: 1
    "FMA": [0, 1],                     # splitk only: broadcast FMA instead of tl.dot
    "num_warps": [4, 8],
    "num_stages": [2, 3, 4],
    "REDUCE": ["launch", "last"],      # splitk: second kernel, or the last-arriving program
}

SMEM_LIMIT_BYTES = 220 * 1024          # Hopper allows 227 KB per block; keep a margin
FMA_MAX_ELEMS = 16384                  # BLOCK_M x BLOCK_K x BLOCK_N fp32 products in registers


def _valid(p: dict) -> bool:
    smem = (p["BLOCK_M"] * p["BLOCK_K"] + p["BLOCK_K"] * p["BLOCK_N"]) * 2 * p["num_stages"]
    if p["variant"] == "tiled":
        if p["SPLIT_K"] != 1 or p["FMA"] or p["BLOCK_K"] > 128 or p["REDUCE"] != "launch":
            return False
        return smem <= SMEM_LIMIT_BYTES
    if p["BLOCK_M"] != 16 or p["BLOCK_K"] < 64 or smem > SMEM_LIMIT_BYTES:
        return False
    return not p["FMA"] or p["BLOCK_K"] * p["BLOCK_N"] <= FMA_MAX_ELEMS


def _cfg(variant, bm, bn, bk, sk, warps, stages, reduce="launch", fma=0):
    return {"variant": variant, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8,
            "SPLIT_K": sk, "FMA": fma, "num_warps": warps, "num_stages": stages, "REDUCE": reduce}


# Curated (the bench reaches only part of a big space in its budget). Decode GEMVs stream the
# weights once: what matters is bytes in flight per SM (BLOCK_K x BLOCK_N x stages of `b` per
# program, times programs per SM) and a grid of about 1-4 x 132 programs (N/BLOCK_N column
# blocks x SPLIT_K), without a second launch. First: the first H200 run's best decode
# structure, with the in-kernel reduction.
_SPLITK_LAST = [(bn, bk, w, st, sk)
                for bn, bk, w, st in [(128, 128, 4, 2), (128, 128, 4, 3), (128, 128, 4, 4),
                                      (64, 256, 4, 2), (64, 256, 4, 3), (256, 64, 4, 4), (256, 64, 8, 4)]
                for sk in (8, 4, 16)] + [(128, 128, 4, 4, 2), (256, 64, 4, 4, 2)]
CONFIGS = [_cfg("splitk", 16, bn, bk, sk, w, st, "last") for bn, bk, w, st, sk in _SPLITK_LAST]
CONFIGS += [  # the first H200 run's winners and runners-up, unchanged
    _cfg("splitk", 16, 64, 256, 8, 4, 2), _cfg("splitk", 16, 128, 128, 8, 4, 2),
    _cfg("splitk", 16, 128, 256, 1, 4, 2),
    _cfg("tiled", 16, 128, 128, 1, 8, 4), _cfg("tiled", 16, 256, 64, 1, 4, 4),
    _cfg("tiled", 16, 64, 64, 1, 4, 4), _cfg("tiled", 64, 128, 128, 1, 4, 4),
    _cfg("tiled", 128, 128, 64, 1, 4, 4), _cfg("tiled", 128, 64, 32, 1, 8, 4),
    _cfg("splitk", 16, 64, 64, 8, 4, 4, fma=1)]
CONFIGS = [p for p in CONFIGS if _valid(p)]


@triton.jit
def _tiled_kernel(a_ptr, b_ptr, c_ptr, M, N, K, s_am, s_ak, s_bk, s_bn, s_cm, s_cn,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, UPCAST: tl.constexpr,
                  DOT_PRECISION: tl.constexpr):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    # Rows/columns past the edge re-read valid ones (wrap); only the store is masked.
    a_ptrs = a_ptr + (rm % M).to(tl.int64)[:, None] * s_am + rk[None, :] * s_ak
    b_ptrs = b_ptr + rk.to(tl.int64)[:, None] * s_bk + (rn % N)[None, :] * s_bn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_left = K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=rk[None, :] < k_left, other=0.0)
            b = tl.load(b_ptrs, mask=rk[:, None] < k_left, other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K * s_ak
        b_ptrs += BLOCK_K * s_bk
    c_ptrs = c_ptr + rm.to(tl.int64)[:, None] * s_cm + rn[None, :] * s_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit(do_not_specialize=["k_per_split"])
def _splitk_kernel(a_ptr, b_ptr, ws_ptr, c_ptr, cnt_ptr, M, N, K, k_per_split,
                   s_am, s_ak, s_bk, s_bn, s_cm, s_cn,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   FMA: tl.constexpr, DIRECT: tl.constexpr, EVEN_K: tl.constexpr,
                   UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
                   LAST_REDUCES: tl.constexpr, SPLITS: tl.constexpr, RED_M: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    k_lo = pid_k * k_per_split
    k_hi = min(k_lo + k_per_split, K)
    a_ptrs = a_ptr + (rm % M).to(tl.int64)[:, None] * s_am + (k_lo + rk)[None, :] * s_ak
    b_ptrs = b_ptr + (k_lo + rk).to(tl.int64)[:, None] * s_bk + (rn % N)[None, :] * s_bn
    if FMA:
        acc3 = tl.zeros([BLOCK_M, BLOCK_K, BLOCK_N], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(k_lo, k_hi, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            a = tl.load(a_ptrs, mask=(k + rk)[None, :] < K, other=0.0)
            b = tl.load(b_ptrs, mask=(k + rk)[:, None] < K, other=0.0)
        if FMA:
            acc3 += a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :]
        else:
            if UPCAST:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K * s_ak
        b_ptrs += BLOCK_K * s_bk
    if FMA:
        acc = tl.sum(acc3, axis=1)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if DIRECT:
        c_ptrs = c_ptr + rm.to(tl.int64)[:, None] * s_cm + rn[None, :] * s_cn
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)
    else:
        ws_ptrs = ws_ptr + (pid_k * M + rm).to(tl.int64)[:, None] * N + rn[None, :]
        tl.store(ws_ptrs, acc, mask=mask)
        if LAST_REDUCES:
            # Every thread's partial is stored before one thread's release (CTA barrier).
            tl.debug_barrier()
            counter = cnt_ptr + pid_m * tl.num_programs(0) + pid_n
            arrived = tl.atomic_add(counter, 1, sem="acq_rel")
            if arrived == SPLITS - 1:
                # Rows in RED_M-row slices: M=1 reads one row per split, not BLOCK_M.
                rr = tl.arange(0, RED_M)
                n_ok = rn[None, :] < N
                for m0 in range(0, tl.minimum(M - pid_m * BLOCK_M, BLOCK_M), RED_M):
                    rows = pid_m * BLOCK_M + m0 + rr
                    rmask = (rows[:, None] < M) & n_ok
                    total = tl.zeros([RED_M, BLOCK_N], dtype=tl.float32)
                    for sk in tl.static_range(SPLITS):  # fixed order: the same bits every run
                        part = ws_ptr + (sk * M + rows).to(tl.int64)[:, None] * N + rn[None, :]
                        total += tl.load(part, mask=rmask, other=0.0, cache_modifier=".cg")
                    c_ptrs = c_ptr + rows.to(tl.int64)[:, None] * s_cm + rn[None, :] * s_cn
                    tl.store(c_ptrs, total.to(c_ptr.dtype.element_ty), mask=rmask)
                tl.atomic_xchg(counter, 0, sem="relaxed")  # ready for the next launch


@triton.jit
def _splitk_reduce_kernel(ws_ptr, c_ptr, M, N, SPLITS, s_cm, s_cn, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mn = M * N
    mask = offs < mn
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    ptrs = ws_ptr + offs
    for _ in range(0, SPLITS):  # fixed order: the same bits every run
        acc += tl.load(ptrs, mask=mask, other=0.0)
        ptrs += mn
    m = offs // N
    n = offs % N
    tl.store(c_ptr + m * s_cm + n * s_cn, acc.to(c_ptr.dtype.element_ty), mask=mask)


def _dot_args(a):
    # fp32 operands: exact products (tl.dot would default to tf32). The interpreter's bf16
    # arithmetic is wrong, so on the CPU operands are upcast before tl.dot.
    upcast = a.device.type != "cuda"
    return upcast, ("ieee" if a.dtype == torch.float32 or upcast else "tf32")


_counters: dict = {}  # device -> int32 arrival counters, zero between launches


def _arrival_counters(device, n: int):
    key = str(device)
    cnt = _counters.get(key)
    if cnt is None or cnt.numel() < n:
        cnt = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
        _counters[key] = cnt
    return cnt


def launch(a, b, out, variant="tiled", BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, GROUP_M=8, SPLIT_K=1,
           FMA=0, num_warps=4, num_stages=3, REDUCE="launch"):
    M, K = a.shape
    K2, N = b.shape
    if K2 != K or tuple(out.shape) != (M, N):
        raise ValueError(f"matmul shapes a{tuple(a.shape)} b{tuple(b.shape)} out{tuple(out.shape)}")
    if M == 0 or N == 0:
        return out
    if K == 0:
        raise ValueError("matmul template needs K > 0")
    upcast, precision = _dot_args(a)
    even_k = K % BLOCK_K == 0
    if variant == "tiled":
        grid = (triton.cdiv(M, BLOCK_M) * triton.cdiv(N, BLOCK_N),)
        _tiled_kernel[grid](a, b, out, M, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
                            out.stride(0), out.stride(1),
                            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, GROUP_M=GROUP_M,
                            EVEN_K=even_k, UPCAST=upcast, DOT_PRECISION=precision,
                            num_warps=num_warps, num_stages=num_stages)
        return out
    if variant != "splitk":
        raise ValueError(f"unknown matmul variant {variant!r}")
    if FMA:
        # As many rows of `a` per program as the register budget allows (valid for any M;
        # larger M just re-streams b once per row block). All factors are powers of two.
        block_m = max(1, min(triton.next_power_of_2(M), 16, FMA_MAX_ELEMS // (BLOCK_K * BLOCK_N)))
    else:
        block_m = 16  # tl.dot needs at least 16 rows
    k_per_split = triton.cdiv(triton.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    splits = triton.cdiv(K, k_per_split)
    if REDUCE not in ("launch", "last"):
        raise ValueError(f"unknown matmul REDUCE {REDUCE!r}")
    direct = splits == 1
    last = REDUCE == "last" and not direct
    ws = out if direct else torch.empty((splits, M, N), device=a.device, dtype=torch.float32)
    grid = (triton.cdiv(N, BLOCK_N), splits, triton.cdiv(M, block_m))
    cnt = _arrival_counters(a.device, grid[0] * grid[2]) if last else ws
    _splitk_kernel[grid](a, b, ws, out, cnt, M, N, K, k_per_split, a.stride(0), a.stride(1),
                         b.stride(0), b.stride(1), out.stride(0), out.stride(1),
                         BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, FMA=FMA, DIRECT=direct,
                         EVEN_K=even_k, UPCAST=upcast, DOT_PRECISION=precision,
                         LAST_REDUCES=last, SPLITS=splits,
                         RED_M=min(triton.next_power_of_2(M), block_m),
                         num_warps=num_warps, num_stages=num_stages)
    if not direct and not last:
        block = 1024
        _splitk_reduce_kernel[(triton.cdiv(M * N, block),)](ws, out, M, N, splits, out.stride(0),
                                                            out.stride(1), BLOCK=block, num_warps=4)
    return out
