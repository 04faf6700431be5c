"""Linear template (nn.Linear without bias): out[M, N] = x[M, K] @ weight[N, K].T.

The weight is stored the way nn.Linear stores it: each output feature is one contiguous row of
K values, so the weight is always read along K ([BLOCK_N, BLOCK_K] tiles, 16-byte loads along K).
- "tiled" (prefill shapes): each program computes a BLOCK_M x BLOCK_N tile with tl.dot over
  BLOCK_K steps, programs ordered in GROUP_M-tall groups so that neighbours share tiles of x
  and of the weight in L2.
- "gemv" (decode, batch 1-8): a weight-streaming GEMV without tl.dot. A program takes
  BLOCK_N weight rows and min(next power of two of M, BLOCK_M <= 8) rows of x (rows past M
  re-read valid ones, only the stores are masked), and over its range of K accumulates the
  products into a [BLOCK_N, BLOCK_K] fp32 tile (batch 1) or a [rows, BLOCK_N, BLOCK_K] one,
  summed over K once after the loop (no cross-lane reduction per step). Rows are capped so
  that the accumulator stays at <= 64 registers a thread (GEMV_ACC_PER_WARP). Weight loads
  carry evict_first (each byte is read once; x, re-read by every program, stays in L2).
  SPLIT_K > 1 reduces as "splitk" does.
- "swapab" (decode, batch 9-64): "splitk" with the weight tile as tl.dot's left operand (wgmma
  on sm_90); see "Batch 32, swapped" below.
- "splitk" (decode, batch 9-64): the rows of x go through tl.dot (padded to at least 16;
  BLOCK_M caps the rows per program, so batch 32 streams the weight once with BLOCK_M >= 32)
  or, with FMA=1, a broadcast multiply (superseded by "gemv", kept for old dispatch tables).
  Each program covers one of SPLIT_K ranges of K, so that N / BLOCK_N column blocks x SPLIT_K
  programs fill the chip. Partial sums go to an fp32 workspace [SPLIT_K, M, N] summed in a
  fixed order (deterministic, no float atomics): by a second kernel (REDUCE="launch") or by
  the program that arrives last at its tile (REDUCE="last": a CTA barrier, then an acq_rel
  arrival counter, as in the matmul template; the counters are allocated zeroed once per
  device and set back to 0 by the last program, so CUDA graphs need no fill kernel). One split
  writes `out` directly.
fp32 accumulation, cast on store; fp32 operands use exact (ieee) dots, the interpreter's bf16
arithmetic being wrong, operands are upcast on the CPU.

Why each config (H200: 132 SMs, ~4.3 TB/s by copy; at ~0.7 us of DRAM latency that is ~3 MB
in flight, ~23 KB per SM; "tile" = the weight bytes one program loads per K step; programs at
the 4096 x 4096 projection, N / BLOCK_N x splits; Llama-3-8B N runs 4096..128256, K 4096/14336).
Registers a thread: ptxas for sm_90 (triton 3.9, batch 1), no spills; the loads of a step are
issued together (16-byte vectors) and the GEMV loop is not software-pipelined (no cp.async:
num_stages changes nothing for gemv, so its configs all say 3), so bytes in flight = resident
programs x tile:
  G1 gemv 8x1024, 8 warps: 16 KB tile, 79 registers: 3 programs per SM, 48 KB in flight per
     SM; 512 programs = 1.3 rounds of 396. The first guess for batch 1 at every N.
  G2 gemv 8x512, 4 warps: 8 KB tile, 79 registers: 6 per SM, 48 KB per SM; 512 programs all
     resident (3.9 per SM).
  G3 gemv 16x512: 16 KB tile, 133 registers: 3 per SM, 48 KB; 256 programs at N = 4096 (1.9
     per SM: uneven), meant for the wide N (28672: 1792 programs, lm_head 128256: 8016).
  G4 gemv 16x256, split 2: 8 KB tile, 79 registers, 6 per SM; 512 programs; K = 14336
     (down_proj) in 7168-long halves.
  G5 gemv 32x256, split 4, 8 warps: 16 KB tile, 77 registers, 3 per SM; 512 programs, K =
     14336 in quarters.
  Batch 32 (tl.dot, mma.sync at 32 rows; loads pipelined by cp.async into num_stages - 1
  shared-memory buffers, the size triton 3.9 allocated for sm_90; 227 KB an SM):
  D1 splitk 32x32x256, one split, 3 stages: 32 KB a stage (x and weight), 64 KB = 3 programs
     per SM; no workspace: for the wide N (896 programs at 28672, 4008 at lm_head, where 4
     splits would write and re-read 65 MB of fp32 partials); 128 at 4096.
  D2 splitk 32x32x256, split 4: as D1, 512 programs at 4096 = 1.3 rounds of 3 per SM, 2
     stages ahead = 192 KB per SM. The first guess for batch 32.
  D3 splitk 32x64x256, split 4, 3 stages: 48 KB a stage, 96 KB = 2 per SM, 256 programs.
  D4 splitk 32x32x128, split 4, 4 stages: 16 KB a stage, 48 KB = 4 per SM, 512 programs.
  D5 splitk 32x64x128, split 4, 4 stages: 24 KB a stage, 72 KB = 3 per SM, 256 programs.
  D6 splitk 32x128x128, split 8, 8 warps: 40 KB a stage, 80 KB = 2 per SM, 256 programs.
  Batch 32, swapped ("swapab"): the same split-K program with the dot turned round, the
  [BLOCK_N, BLOCK_K] weight tile as tl.dot's left operand and x's 32 rows as its right one, so
  the accumulator is [BLOCK_N, 32] (transposed once after the loop). On sm_90 that is wgmma
  (64+ rows a warpgroup, operands straight from the cp.async shared-memory buffers; the
  32-row dot above is mma.sync through registers), the layout cuBLAS picks itself at batch 32
  (nvjet "128x32" and "64x32" tiles, 10-16 stages). Weight loads evict_first. Measured on the
  H200 (bench/linear_gpu.py --batches 32 --sweep-swapab, L2 flushed, 2026-12-04; us and % of
  copy; cuBLAS in the same run: QKV 4096->6144 17.3 (69%), 4096x4096 14.3 (56%), gate|up
  4096->28672 62.6 (89%), down 14336->4096 34.7 (81%)):
  W1 swapab 32x64x128, 6 stages: 24 KB a stage, 144 KB: one program an SM; 15.7 (76%),
     12.2 (66%), 61.0 (91%), 33.3 (84%): the best or near it at every shape.
  W2 swapab 32x64x64, 10 stages: 12 KB a stage, 120 KB; 15.9, 12.7, 62.3, 35.1.
  W3 swapab 32x64x128, 4 stages: 96 KB = 2 an SM; 59.7 (93%) at 4096->28672, 249 at the
     4096->128256 head (100%).
  W4 swapab 32x64x128, split 2, 6 stages: 32.6 (86%) at K = 14336 (128 programs of 7168).
  W5 swapab 32x64x64, split 2, 10 stages: 32.9 at K = 14336, 12.9 at 4096x4096.
  W6 swapab 32x128x64, 6 stages: 128-row tiles (two wgmma rows of 64), 60.5 at 4096->28672.
  (Left out: 256-row tiles, 29-45% at the 4096-wide shapes; 4 splits, never the best.)
  T1, T2 tiled 128x128x64 / 128x256x64: the prefill tiles (compute bound, tl.dot on wgmma).
Order: the grid strategy walks the template's domain in SPACE order (kernelsearch.proposers:
params sorted by name, so BLOCK_K outermost, listed descending, then BLOCK_M ascending: 8 is
gemv, 32 splitk, 128 tiled) and under a budget B takes B points evenly spread over it. CONFIGS
is listed in that same order (tests/test_linear_gemv.py holds it), so the gemv block comes
first, then the batch-32 block (D1..D6 and W1..W6 interleaved by BLOCK_K), then prefill, and
any B >= 2 samples both decode blocks in proportion (B = 2: G1, W3; B = 6: G1, G4, D2, W3, D5,
W5; B = 8: G1, G3, G5, D3, W3, W4, W2, W6). A point is measured at every shape of the sweep, so
one walk serves batch 1 and 32. List order is also what a caller taking CONFIGS[0] or the
middle entry sees (check-kernel, the bench without a dispatch table: G1 and W3).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

SPACE = {
    "variant": ["gemv", "splitk", "swapab", "tiled"],
    "BLOCK_M": [8, 16, 32, 64, 128],   # splitk, gemv: the most rows of x one program takes
    "BLOCK_N": [4, 8, 16, 32, 64, 128, 256],
    "BLOCK_K": [1024, 512, 256, 128, 64, 32],  # descending: see "Order" in the docstring
    "GROUP_M": [8],
    "SPLIT_K": [1, 2, 4, 8, 16],       # tiled: 1
    "FMA": [0, 1],                     # splitk only: broadcast multiply instead of tl.dot
    "num_warps": [4, 8],
    "num_stages": [2, 3, 4, 6, 10],
    "REDUCE": ["last", "launch"],      # splitk, gemv: the last-arriving program, or a second kernel
}

SMEM_LIMIT_BYTES = 220 * 1024          # Hopper allows 227 KB per block; keep a margin
FMA_MAX_ELEMS = 16384                  # rows x BLOCK_N x BLOCK_K fp32 products in registers
GEMV_ACC_PER_WARP = 2048               # fp32 accumulator elements per warp: 64 registers a thread
GEMV_MAX_ROWS = 8                      # gemv: BLOCK_M is a cap; more rows go to tl.dot (splitk)


def _valid(p: dict) -> bool:
    smem = (p["BLOCK_M"] * p["BLOCK_K"] + p["BLOCK_K"] * p["BLOCK_N"]) * 2 * p["num_stages"]
    if smem > SMEM_LIMIT_BYTES:
        return False
    if p["variant"] == "tiled":
        return (p["SPLIT_K"] == 1 and not p["FMA"] and p["BLOCK_K"] <= 128 and p["BLOCK_M"] >= 16
                and p["REDUCE"] == "launch")
    if p["variant"] == "gemv":
        return (p["BLOCK_M"] == GEMV_MAX_ROWS and not p["FMA"] and p["BLOCK_K"] >= 64
                and p["BLOCK_N"] * p["BLOCK_K"] <= GEMV_ACC_PER_WARP * p["num_warps"])
    if p["BLOCK_M"] < 16:
        return False
    if p["variant"] == "swapab":
        # the weight tile is the dot's left operand: wgmma wants >= 64 of its rows
        return not p["FMA"] and p["BLOCK_N"] >= 64 and p["BLOCK_K"] >= 64 and p["BLOCK_M"] <= 64
    if p["FMA"]:
        return p["BLOCK_M"] == 16 and p["BLOCK_N"] * p["BLOCK_K"] <= FMA_MAX_ELEMS // 2
    return p["BLOCK_K"] >= 64


def _cfg(variant, bm, bn, bk, sk, warps, stages, reduce="last", fma=0):
    # One split (SPLIT_K=1) writes `out` directly: REDUCE is then unused.
    return {"variant": variant, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8,
            "SPLIT_K": sk, "FMA": fma, "num_warps": warps, "num_stages": stages, "REDUCE": reduce}


# Curated, not the product of SPACE; the docstring says why each entry is here and in what
# order the grid strategy walks them (the list order, G1..T2).
CONFIGS = [
    # batch 1-8: the GEMV (rows per program = next power of two of M, at most 8)
    _cfg("gemv", 8, 8, 1024, 1, 8, 3),      # G1
    _cfg("gemv", 8, 8, 512, 1, 4, 3),       # G2
    _cfg("gemv", 8, 16, 512, 1, 4, 3),      # G3
    _cfg("gemv", 8, 16, 256, 2, 4, 3),      # G4
    _cfg("gemv", 8, 32, 256, 4, 8, 3),      # G5
    # batch 9-64: tl.dot with all 32 rows in one program (the weight is streamed once)
    # (swapab: the weight tile is tl.dot's left operand, wgmma on sm_90)
    _cfg("splitk", 32, 32, 256, 1, 4, 3),   # D1
    _cfg("splitk", 32, 32, 256, 4, 4, 3),   # D2
    _cfg("splitk", 32, 64, 256, 4, 4, 3),   # D3
    _cfg("splitk", 32, 32, 128, 4, 4, 4),   # D4
    _cfg("swapab", 32, 64, 128, 1, 4, 4),   # W3
    _cfg("swapab", 32, 64, 128, 1, 4, 6),   # W1
    _cfg("swapab", 32, 64, 128, 2, 4, 6),   # W4
    _cfg("splitk", 32, 64, 128, 4, 4, 4),   # D5
    _cfg("splitk", 32, 128, 128, 8, 8, 3),  # D6
    _cfg("swapab", 32, 64, 64, 1, 4, 10),   # W2
    _cfg("swapab", 32, 64, 64, 2, 4, 10),   # W5
    _cfg("swapab", 32, 128, 64, 1, 4, 6),   # W6
    # prefill (M = batch x tokens): compute bound tiles
    _cfg("tiled", 128, 128, 64, 1, 8, 3, "launch"),   # T1
    _cfg("tiled", 128, 256, 64, 1, 8, 3, "launch"),   # T2
]
CONFIGS = [p for p in CONFIGS if _valid(p)]


@triton.jit
def _tiled_kernel(x_ptr, w_ptr, c_ptr, M, N, K, s_xm, s_xk, s_wn, s_wk, s_cm, s_cn,
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
    # Rows and features past the edge re-read valid ones (wrap); only the store is masked.
    x_ptrs = x_ptr + (rm % M).to(tl.int64)[:, None] * s_xm + rk[None, :] * s_xk
    w_ptrs = w_ptr + (rn % N).to(tl.int64)[:, None] * s_wn + rk[None, :] * s_wk
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(x_ptrs)
            w = tl.load(w_ptrs)
        else:
            k_left = K - k * BLOCK_K
            a = tl.load(x_ptrs, mask=rk[None, :] < k_left, other=0.0)
            w = tl.load(w_ptrs, mask=rk[None, :] < k_left, other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(a, tl.trans(w), acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K * s_xk
        w_ptrs += BLOCK_K * s_wk
    c_ptrs = c_ptr + rm.to(tl.int64)[:, None] * s_cm + rn[None, :] * s_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit(do_not_specialize=["split_steps"])
def _splitk_kernel(x_ptr, w_ptr, ws_ptr, c_ptr, cnt_ptr, M, N, K, split_steps,
                   s_xm, s_xk, s_wn, s_wk, s_cm, s_cn,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   FMA: tl.constexpr, DIRECT: tl.constexpr, EVEN_K: tl.constexpr,
                   UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
                   LAST_REDUCES: tl.constexpr, SPLITS: tl.constexpr, RED_M: tl.constexpr,
                   SWAP: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    # A split is split_steps x BLOCK_K long, so the compiler knows k_lo is a multiple of
    # BLOCK_K: 16-byte loads along K. (k_lo = pid_k * k_per_split, with k_per_split not
    # specialized, left every weight load 2 bytes wide.)
    k_per_split = split_steps * BLOCK_K
    k_lo = pid_k * k_per_split
    k_hi = min(k_lo + k_per_split, K)
    x_ptrs = x_ptr + (rm % M).to(tl.int64)[:, None] * s_xm + (k_lo + rk)[None, :] * s_xk
    w_ptrs = w_ptr + (rn % N).to(tl.int64)[:, None] * s_wn + (k_lo + rk)[None, :] * s_wk
    if FMA:
        acc3 = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    elif SWAP:
        acc_t = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(k_lo, k_hi, BLOCK_K):
        # swapab: each weight byte is read once (evict_first keeps x, re-read by every
        # program, in L2); the other variants load it as they always have.
        if EVEN_K:
            a = tl.load(x_ptrs)
            if SWAP:
                w = tl.load(w_ptrs, eviction_policy="evict_first")
            else:
                w = tl.load(w_ptrs)
        else:
            k_ok = (k + rk)[None, :] < K
            a = tl.load(x_ptrs, mask=k_ok, other=0.0)
            if SWAP:
                w = tl.load(w_ptrs, mask=k_ok, other=0.0, eviction_policy="evict_first")
            else:
                w = tl.load(w_ptrs, mask=k_ok, other=0.0)
        if FMA:
            acc3 += a.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
        else:
            if UPCAST:
                a = a.to(tl.float32)
                w = w.to(tl.float32)
            if SWAP:
                # the weight tile is the dot's tall left operand (wgmma on sm_90)
                acc_t = tl.dot(w, tl.trans(a), acc_t, input_precision=DOT_PRECISION)
            else:
                acc = tl.dot(a, tl.trans(w), acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K * s_xk
        w_ptrs += BLOCK_K * s_wk
    if FMA:
        acc = tl.sum(acc3, axis=2)
    elif SWAP:
        acc = tl.trans(acc_t)
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
                # Rows in RED_M-row slices: batch 1 reads one row per split, not BLOCK_M.
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


@triton.jit(do_not_specialize=["split_steps"])
def _gemv_kernel(x_ptr, w_ptr, ws_ptr, c_ptr, cnt_ptr, M, N, K, split_steps,
                 s_xm, s_xk, s_wn, s_wk, s_cm, s_cn,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 DIRECT: tl.constexpr, EVEN_K: tl.constexpr, LAST_REDUCES: tl.constexpr,
                 SPLITS: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    # A split is split_steps x BLOCK_K long, so the compiler knows k_lo is a multiple of
    # BLOCK_K: 16-byte loads along K. (k_lo = pid_k * k_per_split, with k_per_split not
    # specialized, left every weight load 2 bytes wide.)
    k_per_split = split_steps * BLOCK_K
    k_lo = pid_k * k_per_split
    k_hi = min(k_lo + k_per_split, K)
    # Features past N re-read valid rows (wrap) so that weight loads stay unmasked along N;
    # only the stores are masked. Same for rows of x past M.
    w_ptrs = w_ptr + (rn % N).to(tl.int64)[:, None] * s_wn + (k_lo + rk)[None, :] * s_wk
    if BLOCK_M == 1:
        x_ptrs = x_ptr + pid_m.to(tl.int64) * s_xm + (k_lo + rk) * s_xk
        acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    else:
        x_ptrs = x_ptr + (rm % M).to(tl.int64)[:, None] * s_xm + (k_lo + rk)[None, :] * s_xk
        acc3 = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k in range(k_lo, k_hi, BLOCK_K):
        # Each weight byte is read once: evict_first keeps x (re-read by every program) in L2.
        if EVEN_K:
            w = tl.load(w_ptrs, eviction_policy="evict_first")
            x = tl.load(x_ptrs)
        else:
            k_ok = (k + rk) < K
            w = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0, eviction_policy="evict_first")
            if BLOCK_M == 1:
                x = tl.load(x_ptrs, mask=k_ok, other=0.0)
            else:
                x = tl.load(x_ptrs, mask=k_ok[None, :], other=0.0)
        # Products summed over K once, after the loop: no cross-lane reduction per step.
        if BLOCK_M == 1:
            acc2 += w.to(tl.float32) * x.to(tl.float32)[None, :]
        else:
            acc3 += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
        w_ptrs += BLOCK_K * s_wk
        x_ptrs += BLOCK_K * s_xk
    n_ok = rn < N
    if BLOCK_M == 1:
        acc = tl.sum(acc2, axis=1)
        if DIRECT:
            tl.store(c_ptr + pid_m.to(tl.int64) * s_cm + rn * s_cn, acc.to(c_ptr.dtype.element_ty),
                     mask=n_ok)
        else:
            tl.store(ws_ptr + (pid_k * M + pid_m).to(tl.int64) * N + rn, acc, mask=n_ok)
    else:
        acc = tl.sum(acc3, axis=2)
        mask = (rm[:, None] < M) & n_ok[None, :]
        if DIRECT:
            c_ptrs = c_ptr + rm.to(tl.int64)[:, None] * s_cm + rn[None, :] * s_cn
            tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)
        else:
            ws_ptrs = ws_ptr + (pid_k * M + rm).to(tl.int64)[:, None] * N + rn[None, :]
            tl.store(ws_ptrs, acc, mask=mask)
    if LAST_REDUCES:
        # As in _splitk_kernel: every thread's partial is stored before one thread's release.
        tl.debug_barrier()
        counter = cnt_ptr + pid_m * tl.num_programs(0) + pid_n
        arrived = tl.atomic_add(counter, 1, sem="acq_rel")
        if arrived == SPLITS - 1:
            if BLOCK_M == 1:
                total = tl.zeros([BLOCK_N], dtype=tl.float32)
                for sk in tl.static_range(SPLITS):  # fixed order: the same bits every run
                    part = ws_ptr + (sk * M + pid_m).to(tl.int64) * N + rn
                    total += tl.load(part, mask=n_ok, other=0.0, cache_modifier=".cg")
                tl.store(c_ptr + pid_m.to(tl.int64) * s_cm + rn * s_cn,
                         total.to(c_ptr.dtype.element_ty), mask=n_ok)
            else:
                mask = (rm[:, None] < M) & n_ok[None, :]
                total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                for sk in tl.static_range(SPLITS):
                    part = ws_ptr + (sk * M + rm).to(tl.int64)[:, None] * N + rn[None, :]
                    total += tl.load(part, mask=mask, other=0.0, cache_modifier=".cg")
                c_ptrs = c_ptr + rm.to(tl.int64)[:, None] * s_cm + rn[None, :] * s_cn
                tl.store(c_ptrs, total.to(c_ptr.dtype.element_ty), mask=mask)
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


def _dot_args(x):
    # fp32 operands: exact products (tl.dot would default to tf32). The interpreter's bf16
    # arithmetic is wrong, so on the CPU operands are upcast before tl.dot.
    upcast = x.device.type != "cuda"
    return upcast, ("ieee" if x.dtype == torch.float32 or upcast else "tf32")


_counters: dict = {}  # device -> int32 arrival counters, zero between launches


def _arrival_counters(device, n: int):
    key = str(device)
    cnt = _counters.get(key)
    if cnt is None or cnt.numel() < n:
        cnt = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
        _counters[key] = cnt
    return cnt


def launch(x, weight, out, variant="splitk", BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=8,
           SPLIT_K=1, FMA=0, num_warps=4, num_stages=3, REDUCE="launch"):
    M, K = x.shape
    N, K2 = weight.shape
    if K2 != K or tuple(out.shape) != (M, N):
        raise ValueError(f"linear shapes x{tuple(x.shape)} weight{tuple(weight.shape)} out{tuple(out.shape)}")
    if M == 0 or N == 0:
        return out
    if K == 0:
        raise ValueError("linear template needs K > 0")
    upcast, precision = _dot_args(x)
    even_k = K % BLOCK_K == 0
    if variant == "tiled":
        grid = (triton.cdiv(M, BLOCK_M) * triton.cdiv(N, BLOCK_N),)
        _tiled_kernel[grid](x, weight, out, M, N, K, x.stride(0), x.stride(1), weight.stride(0),
                            weight.stride(1), out.stride(0), out.stride(1),
                            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, GROUP_M=GROUP_M,
                            EVEN_K=even_k, UPCAST=upcast, DOT_PRECISION=precision,
                            num_warps=num_warps, num_stages=num_stages)
        return out
    if variant not in ("splitk", "gemv", "swapab"):
        raise ValueError(f"unknown linear variant {variant!r}")
    if variant == "swapab" and FMA:
        raise ValueError("linear variant 'swapab' is a tl.dot: FMA must be 0")
    if REDUCE not in ("launch", "last"):
        raise ValueError(f"unknown linear REDUCE {REDUCE!r}")
    rows = triton.next_power_of_2(M)
    if variant == "gemv":
        # Rows per program: M rounded up to a power of two, at most BLOCK_M, and as many as
        # the accumulator budget leaves (a larger M re-streams the weight once per row block).
        budget = max(1, GEMV_ACC_PER_WARP * num_warps // (BLOCK_N * BLOCK_K))
        block_m = max(1, min(rows, BLOCK_M, GEMV_MAX_ROWS, budget))
        k_per_split = triton.cdiv(triton.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
        splits = triton.cdiv(K, k_per_split)
        direct = splits == 1
        last = REDUCE == "last" and not direct
        ws = out if direct else torch.empty((splits, M, N), device=x.device, dtype=torch.float32)
        grid = (triton.cdiv(N, BLOCK_N), splits, triton.cdiv(M, block_m))
        cnt = _arrival_counters(x.device, grid[0] * grid[2]) if last else ws
        _gemv_kernel[grid](x, weight, ws, out, cnt, M, N, K, k_per_split // BLOCK_K, x.stride(0), x.stride(1),
                           weight.stride(0), weight.stride(1), out.stride(0), out.stride(1),
                           BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, DIRECT=direct,
                           EVEN_K=even_k, LAST_REDUCES=last, SPLITS=splits,
                           num_warps=num_warps, num_stages=num_stages)
        if not direct and not last:
            block = 1024
            _splitk_reduce_kernel[(triton.cdiv(M * N, block),)](ws, out, M, N, splits, out.stride(0),
                                                                out.stride(1), BLOCK=block, num_warps=4)
        return out
    if FMA:
        # As many rows per program as the register budget allows (valid for any M; a larger
        # M re-streams the weight once per row block). All factors are powers of two.
        block_m = max(1, min(rows, BLOCK_M, FMA_MAX_ELEMS // (BLOCK_K * BLOCK_N)))
    else:
        block_m = max(16, min(rows, BLOCK_M))  # tl.dot needs at least 16 rows
    k_per_split = triton.cdiv(triton.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    splits = triton.cdiv(K, k_per_split)
    direct = splits == 1
    last = REDUCE == "last" and not direct
    ws = out if direct else torch.empty((splits, M, N), device=x.device, dtype=torch.float32)
    grid = (triton.cdiv(N, BLOCK_N), splits, triton.cdiv(M, block_m))
    cnt = _arrival_counters(x.device, grid[0] * grid[2]) if last else ws
    _splitk_kernel[grid](x, weight, ws, out, cnt, M, N, K, k_per_split // BLOCK_K, x.stride(0), x.stride(1),
                         weight.stride(0), weight.stride(1), out.stride(0), out.stride(1),
                         BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, FMA=FMA, DIRECT=direct,
                         EVEN_K=even_k, UPCAST=upcast, DOT_PRECISION=precision,
                         LAST_REDUCES=last, SPLITS=splits, RED_M=min(rows, block_m),
                         SWAP=variant == "swapab", num_warps=num_warps, num_stages=num_stages)
    if not direct and not last:
        block = 1024
        _splitk_reduce_kernel[(triton.cdiv(M * N, block),)](ws, out, M, N, splits, out.stride(0),
                                                            out.stride(1), BLOCK=block, num_warps=4)
    return out
