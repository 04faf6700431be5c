"""RMSNorm fused into the projection that follows it (norm + q|k|v, final norm + lm_head):
out[M, N] = (x / sqrt(mean(x^2) + eps) * norm_weight) @ weight[N, K].T.

The normalised x never exists in memory. Each program already loads the x tiles of its range
of K (x is re-read by every program from L2, as in the linear template), so it also sums their
squares there, and multiplies them by the norm_weight tile of the step ([BLOCK_K] values read
from L2, 1/BLOCK_N of the weight tile's bytes); each row's dot products are scaled by its 1/rms
once, at the end. No byte of DRAM traffic is added to the linear template's: the weight stream
dominates (N x K against M x K + K), and the fused norm costs a few FMAs a loaded x value.
- "gemv" (decode, batch 1-8): the linear template's weight-streaming GEMV, no tl.dot. A
  program takes BLOCK_N weight rows and min(next power of two of M, BLOCK_M <= 8) rows of x
  (rows past M re-read valid ones, only the stores are masked), accumulates the products of
  the weight and x * norm_weight into a [BLOCK_N, BLOCK_K] fp32 tile (batch 1) or a
  [rows, BLOCK_N, BLOCK_K] one, and x^2 into a [rows, BLOCK_K] one, all summed over K once
  after the loop (no cross-lane reduction per step). Rows are capped so that the product
  accumulator stays at <= 64 registers a thread (GEMV_ACC_PER_WARP). Weight loads carry
  evict_first (each byte is read once; x, re-read by every program, stays in L2).
  PIPE=1 writes the K loop as a tl.range with num_stages, as in the linear_residual template:
  triton software-pipelines it for sm_90 (16-byte cp.async of the weight, under an L2
  evict_first policy, and of the x and norm_weight tiles into num_stages - 1 shared-memory
  buffers ahead; a loop without tl.dot is left unpipelined otherwise). The sum of squares is
  still taken from the x tile each step reads (now from shared memory): no extra load. PIPE=0
  gives the tl.range num_stages=1: the PTX of the plain range loop before PIPE existed (every
  gemv config compared for sm_90, less line numbers).
  Early reads: loads of the split's first weight step are also issued at the very top,
  values dropped (volatile), so that with HWTUNE_PDL_EARLY=1 they reach L2 before the wait
  for the kernel ahead ends; the loop is unchanged (docs/ARCHITECTURE.md, "Early reads").
- "swapab" (decode, batch 9-64): "splitk" with the weight tile as tl.dot's left operand (wgmma
  on sm_90); see "Batch 32, swapped" below.
- "splitk" (decode, batch 9-64): the rows of x go through tl.dot (padded to at least 16; all
  32 rows of batch 32 in one program, so that the weight is streamed once). tl.dot is fed
  x * norm_weight cast back to the input dtype (what the stock path rounds too: the normalised
  x in bf16), the products accumulate in fp32 and are scaled by 1/rms after the loop, so fp16
  inputs of any scale the spec draws cannot overflow in the operand (x * norm_weight is as
  large as x times a weight near 1, never divided by a small rms first). The sum of squares is
  a [rows] fp32 vector summed per step (a [rows, BLOCK_K] tile would cost 64 registers a
  thread at 32 x 256).
Split-K (SPLIT_K > 1, either variant): each of the SPLIT_K programs of a column block covers
one range of K and sees only that range's x, so it stores both its unscaled partial products
(fp32 workspace [SPLIT_K, M, N]) and its partial sums of squares (fp32 [SPLIT_K, N tiles, M]:
one slot per split, column block and row, so that the reducer of a column block reads only
what its own splits wrote and no program waits on another column block). The reducer sums both
in a fixed order (split 0 first: the same bits every run, no float atomics) and then scales:
a second kernel (REDUCE="launch", reading the sums of squares of column block 0: every column
block computes the same bits from the same x) or the program that arrives last at its column
block (REDUCE="last": a CTA barrier, then an acq_rel arrival counter, as in the linear
template; the counters are allocated zeroed once per device and set back to 0 by the last
program, so CUDA graphs need no fill kernel). One split writes `out` directly.
fp32 accumulation, cast on store; fp32 operands use exact (ieee) dots; the interpreter's bf16
arithmetic being wrong, operands are upcast on the CPU.

Why each config: the weight tiles, programs and bytes in flight are the linear template's (the
same decode weight streams: K 4096 / 3584, N 4608..128256; H200: 132 SMs, ~4.3 TB/s by copy,
~23 KB in flight per SM needed at ~0.7 us of DRAM latency), because the fused norm adds no
weight bytes and only a [BLOCK_K] norm_weight tile and the x^2 accumulator to each program.
Registers a thread: ptxas for sm_90 (triton 3.9, bf16, batch 1 / batch 32; linear's in
brackets), no spills; an SM holds 64 K registers, allocated 8 a thread at a time, so 8 warps
at <= 80 registers fit 3 programs and 4 warps at <= 80 fit 6. tests/test_kernel_rmsnorm_linear.py
compiles every gemv config and D2 for sm_90 here and checks their weight loads are 16-byte
vectors (16-byte cp.async for P1, P2) and that nothing spills. Measured on the H200 (issue 13 run 1,
L2 flushed, bench/results/h200-issue13): G1 19.3 us at 4096 -> 6144 (61% of copy), G2 22.7,
G4 19.4; G1 262 us at lm_head 4096 -> 128256 (~93% of copy).
  G1 gemv 8x1024, 8 warps: 16 KB weight tile, 80 registers [79]: 3 programs per SM, 48 KB in
     flight per SM; 768 programs at q|k|v 6144 (1.9 rounds of 396), 16032 at lm_head. The
     first guess for batch 1 (CONFIGS[0]), the winner of both batch-1 shapes in run 1.
  G2 gemv 8x512, 4 warps: 8 KB tile, 91 registers [79]: 5 per SM (linear: 6), 40 KB per SM.
     P1's tile and warps without the pipeline: what PIPE alone is worth.
  PIPE=1 (as linear_residual's P configs, which took its 4096 x 4096 batch-1 call from 22.3 us
  (R1, G1's tile) to 14.1 (P1) on the H200): the loaded tile no longer waits in registers
  next to the accumulator, so bytes in flight come from the 227 KB of shared memory and stay
  in flight while the program multiplies. An SM holds 228 KB of shared memory, 1 KB of it
  reserved a program; resident programs = min(65536 / (registers x threads), 228 KB /
  (shared + 1 KB)); bytes in flight an SM = resident x (num_stages - 1) x weight tile. Shared
  memory a program = (BLOCK_N + 2) x BLOCK_K x 2 bytes x (num_stages - 1) at batch 1 (the
  weight, x and norm_weight tiles; the weight goes 16 bytes a copy, x and norm_weight, from
  L2, BLOCK_K / (32 x warps) values a thread: 8 bytes in P1, 4 in P2):
  P1 gemv 8x512, 4 warps, PIPE, 4 stages: 8 KB tile, 72 registers, 30 KB shared: 7 resident,
     3 tiles ahead = 168 KB in flight an SM; 768 programs at 6144 in one round of 924 (G1: 1.9
     rounds of 396 at 48 KB). Aimed at q|k|v 4096 -> 6144 (and a candidate at lm_head).
  P2 gemv 16x256, 4 warps, PIPE, 5 stages: 8 KB tile, 72 registers, 36 KB shared: 6 resident,
     4 ahead = 192 KB an SM; aimed at lm_head 4096 -> 128256 (8016 programs, 10.1 rounds of 792):
     16 rows a program halve the x and norm_weight bytes re-read from L2 into shared memory
     per weight byte (1/8 instead of 1/4 at 8 rows) and 16 steps a program keep each pipeline
     full longer between its prologue and drain.
  (G3, gemv 16x512 at 4 warps, 163 registers: 3 per SM, 48 KB in flight, meant for lm_head,
  is left out: P2 takes the wide-N role with four times the bytes in flight, and CONFIGS keeps
  as many gemv entries as batch-32 ones (see "Order"). It remains a point of SPACE.)
  G4 gemv 16x256, split 2: 8 KB tile, 80 registers [79], 6 per SM; 768 programs at 6144, 576
     at Qwen's 4608: halves of K 2048 / 1792 long.
  G5 gemv 32x256, split 4, 8 warps: 16 KB tile, 80 registers [77], 3 per SM; 768 programs at
     6144.
  Batch 32 (tl.dot, mma.sync at 32 rows; the weight and x tiles are pipelined by cp.async
  into num_stages - 1 shared-memory buffers; the norm's multiply reads x from there):
  D1 splitk 32x32x256, one split, 3 stages: 32 KB a stage, 80 registers [72], 66 KB of shared
     memory: 3 programs per SM; no workspace: for lm_head (4008 programs; 4 splits would
     write and re-read 65 MB of fp32 partials).
  D2 splitk 32x32x256, split 4: as D1 (80 registers [96]), 768 programs at 6144. The first
     guess for batch 32.
  D3 splitk 32x64x256, split 4, 3 stages: 48 KB a stage, 97 KB, 128 registers: 2 per SM, 384
     programs at 6144.
  D4 splitk 32x32x128, split 4, 4 stages: 16 KB a stage, 49 KB, 95 registers: 4 per SM, 768
     programs.
  D5 splitk 32x64x128, split 4, 4 stages: 24 KB a stage, 72 KB, 165 registers: 3 per SM, 384
     programs.
  D6 splitk 32x128x128, split 8, 8 warps: 40 KB a stage, 81 KB, 102 registers: 2 per SM, 384
     programs.
  Batch 32, swapped ("swapab": as splitk, the [BLOCK_N, BLOCK_K] weight tile as tl.dot's left
  operand, the normed x tile (x * norm_weight in the weight's dtype, as splitk makes it) as the
  right one, the [BLOCK_N, 32] accumulator transposed once after the loop: wgmma on sm_90
  where the 32-row dot above is mma.sync; weight loads evict_first; the squares summed into a
  [32, BLOCK_K] tile and reduced once after the loop, not across warps (a CTA barrier) every
  step: 37.8 -> 35.7 us at the one tile measured both ways, 32x64x128 at 4096 -> 6144,
  bench/results/h200-issue13/run9-probes/fused32-earlier.txt). Measured at 4096 -> 6144, batch
  32 (bench/fused32_probe.py, L2 flushed, H200, 2026-12-04, run9-probes/fused32.txt; rms_norm
  then F.linear (cuBLAS) 23.9 us in the same run; linear.py's swapab without a norm 15.7): the
  tile is 64 x 64; BLOCK_K = 128 takes 35.7-43.7 with one split (25.1 with two), 32-wide tiles
  26.5-36.7. 96 column blocks fill 96 of 132 SMs, hence the splits. Inside the built-in step (run 9 of BENCHMARKS
  §10d) W1 took 19.3 us, where cuBLAS's QKV took 16.1 and the rmsnorm before it 2.0:
  W1 swapab 32x64x64, split 2, 6 stages: 12 KB a stage, 72 KB = 3 an SM; 192 programs: 19.7 us
     (1.21x the stock path, 60% of copy).
  W2 swapab 32x64x64, split 2, 8 stages: 96 KB = 2 an SM: 20.1.
  W3 swapab 32x64x64, split 4, 6 stages: 384 programs of 1024 (3 an SM: one round): 20.6.
  W4 swapab 32x64x64, 10 stages, one split: 23.5; for the 4096 -> 128256 head (2004 programs,
     where splits would write 16 MB of fp32 partials).
  W5 swapab 32x64x64, 6 stages, one split: the head with 3 programs an SM.
Order: the grid strategy walks the domain in SPACE order (params sorted by name: BLOCK_K
outermost, listed descending, then BLOCK_M ascending: 8 is gemv, 32 splitk, then BLOCK_N,
PIPE, REDUCE, SPLIT_K, num_stages, num_warps); CONFIGS is listed in that order (the test holds
it): G1, G2, P1, G4, P2, G5, then the batch-32 block, D1..D6 then W5, W4, W1, W2, W3, so that
a budget B takes B points evenly spread and B >= 2 samples both blocks (B = 2: G1, D3; B = 6:
G1, P1, G5, D3, D6, W1). CONFIGS[0] (G1) and the middle entry (D3) are what a caller without a
dispatch table takes.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

SPACE = {
    "variant": ["gemv", "splitk", "swapab"],
    "BLOCK_M": [8, 16, 32, 64],        # the most rows of x one program takes
    "BLOCK_N": [4, 8, 16, 32, 64, 128, 256],
    "BLOCK_K": [1024, 512, 256, 128, 64],  # descending: see "Order" in the docstring
    "SPLIT_K": [1, 2, 4, 8, 16],
    "PIPE": [0, 1],                    # gemv: the K loop pipelined over num_stages (cp.async)
    "num_warps": [4, 8],
    "num_stages": [2, 3, 4, 5, 6, 8, 10],
    "REDUCE": ["last", "launch"],      # the last-arriving program, or a second kernel
}

SMEM_LIMIT_BYTES = 220 * 1024          # Hopper allows 227 KB per block; keep a margin
GEMV_ACC_PER_WARP = 2048               # fp32 product accumulator elements per warp: 64 registers a thread
GEMV_MAX_ROWS = 8                      # gemv: BLOCK_M is a cap; more rows go to tl.dot (splitk)


def _valid(p: dict) -> bool:
    if p["variant"] == "gemv" and p["PIPE"]:
        # num_stages - 1 buffers of the step's weight, x (BLOCK_M rows) and norm_weight tiles
        smem = (p["BLOCK_N"] + p["BLOCK_M"] + 1) * p["BLOCK_K"] * 2 * (p["num_stages"] - 1)
    else:
        smem = (p["BLOCK_M"] * p["BLOCK_K"] + p["BLOCK_K"] * p["BLOCK_N"]) * 2 * p["num_stages"]
    if smem > SMEM_LIMIT_BYTES:
        return False
    if p["variant"] == "gemv":
        return (p["BLOCK_M"] == GEMV_MAX_ROWS and p["BLOCK_K"] >= 64
                and p["BLOCK_N"] * p["BLOCK_K"] <= GEMV_ACC_PER_WARP * p["num_warps"])
    # swapab: the weight tile is the dot's left operand, and wgmma wants >= 64 of its rows
    return (p["BLOCK_M"] >= 16 and p["BLOCK_K"] >= 64 and not p["PIPE"]
            and (p["variant"] == "splitk" or (p["BLOCK_N"] >= 64 and p["BLOCK_M"] <= 64)))


def _cfg(variant, bm, bn, bk, sk, warps, stages, reduce="last", pipe=0):
    # One split (SPLIT_K=1) writes `out` directly: REDUCE is then unused.
    return {"variant": variant, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": sk,
            "PIPE": pipe, "num_warps": warps, "num_stages": stages, "REDUCE": reduce}


# Curated, not the product of SPACE; the docstring says why each entry is here and in what
# order the grid strategy walks them (SPACE order, not by the docstring's names).
CONFIGS = [
    # batch 1-8: the GEMV (rows per program = next power of two of M, at most 8)
    _cfg("gemv", 8, 8, 1024, 1, 8, 3),      # G1
    _cfg("gemv", 8, 8, 512, 1, 4, 3),       # G2
    _cfg("gemv", 8, 8, 512, 1, 4, 4, pipe=1),   # P1
    _cfg("gemv", 8, 16, 256, 2, 4, 3),      # G4
    _cfg("gemv", 8, 16, 256, 1, 4, 5, pipe=1),  # P2 (after G4: PIPE sorts before SPLIT_K)
    _cfg("gemv", 8, 32, 256, 4, 8, 3),      # G5
    # batch 9-64: tl.dot with all 32 rows in one program (the weight is streamed once)
    # (swapab: the weight tile is tl.dot's left operand, wgmma on sm_90)
    _cfg("splitk", 32, 32, 256, 1, 4, 3),   # D1
    _cfg("splitk", 32, 32, 256, 4, 4, 3),   # D2
    _cfg("splitk", 32, 64, 256, 4, 4, 3),   # D3
    _cfg("splitk", 32, 32, 128, 4, 4, 4),   # D4
    _cfg("splitk", 32, 64, 128, 4, 4, 4),   # D5
    _cfg("splitk", 32, 128, 128, 8, 8, 3),  # D6
    _cfg("swapab", 32, 64, 64, 1, 4, 6),    # W5
    _cfg("swapab", 32, 64, 64, 1, 4, 10),   # W4
    _cfg("swapab", 32, 64, 64, 2, 4, 6),    # W1
    _cfg("swapab", 32, 64, 64, 2, 4, 8),    # W2
    _cfg("swapab", 32, 64, 64, 4, 4, 6),    # W3
]
CONFIGS = [p for p in CONFIGS if _valid(p)]


@triton.jit(do_not_specialize=["split_steps"])
def _gemv_kernel(x_ptr, g_ptr, w_ptr, ws_ptr, ss_ptr, c_ptr, cnt_ptr, M, N, K, split_steps, eps,
                 s_xm, s_xk, s_gk, s_wn, s_wk, s_cm, s_cn,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 LOOP_STAGES: tl.constexpr, DIRECT: tl.constexpr, EVEN_K: tl.constexpr,
                 LAST_REDUCES: tl.constexpr, SPLITS: tl.constexpr, SQ_R: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    num_n = tl.num_programs(0)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    # A split is split_steps x BLOCK_K long, so the compiler knows k_lo is a multiple of
    # BLOCK_K: 16-byte loads along K (a split offset it cannot prove aligned made every
    # weight load 2 bytes wide in the linear template).
    k_per_split = split_steps * BLOCK_K
    k_lo = pid_k * k_per_split
    k_hi = min(k_lo + k_per_split, K)
    # Features past N re-read valid rows (wrap) so that weight loads stay unmasked along N;
    # only the stores are masked. Same for rows of x past M.
    w_ptrs = w_ptr + (rn % N).to(tl.int64)[:, None] * s_wn + (k_lo + rk)[None, :] * s_wk
    g_ptrs = g_ptr + (k_lo + rk) * s_gk
    # Early reads (see the docstring): the split's first weight step into L2, values dropped.
    # Every split has at least one step (splits = cdiv(K, k_per_split)); with EVEN_K it is whole.
    if EVEN_K:
        w_l2 = tl.load(w_ptrs, volatile=True)
    else:
        w_l2 = tl.load(w_ptrs, mask=((k_lo + rk) < K)[None, :], other=0.0, volatile=True)
    if BLOCK_M == 1:
        x_ptrs = x_ptr + pid_m.to(tl.int64) * s_xm + (k_lo + rk) * s_xk
        acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        sq1 = tl.zeros([BLOCK_K // SQ_R], dtype=tl.float32)
    else:
        x_ptrs = x_ptr + (rm % M).to(tl.int64)[:, None] * s_xm + (k_lo + rk)[None, :] * s_xk
        acc3 = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
        sq2 = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    # LOOP_STAGES > 1 (PIPE=1): the compiler pipelines this loop (cp.async of the weight, x and
    # norm_weight tiles into LOOP_STAGES - 1 shared-memory buffers ahead); 1: plain register
    # loads, issued together, waited for each step.
    for k in tl.range(k_lo, k_hi, BLOCK_K, num_stages=LOOP_STAGES):
        # Each weight byte is read once: evict_first keeps x (re-read by every program) in L2.
        if EVEN_K:
            w = tl.load(w_ptrs, eviction_policy="evict_first")
            x = tl.load(x_ptrs).to(tl.float32)
            g = tl.load(g_ptrs).to(tl.float32)
        else:
            k_ok = (k + rk) < K
            w = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0, eviction_policy="evict_first")
            g = tl.load(g_ptrs, mask=k_ok, other=0.0).to(tl.float32)
            if BLOCK_M == 1:
                x = tl.load(x_ptrs, mask=k_ok, other=0.0).to(tl.float32)
            else:
                x = tl.load(x_ptrs, mask=k_ok[None, :], other=0.0).to(tl.float32)
        # Products and squares summed over K once, after the loop: no cross-lane reduction
        # per step. The norm's 1/rms is applied to the sums, after the loop.
        if BLOCK_M == 1:
            # x is loaded SQ_R values a thread: summing them there keeps 1/SQ_R of the
            # squares live (G1 at 80 registers, not 84: 3 programs of 8 warps an SM, not 2).
            sq1 += tl.sum(tl.reshape(x * x, [BLOCK_K // SQ_R, SQ_R]), axis=1)
            acc2 += w.to(tl.float32) * (x * g)[None, :]
        else:
            sq2 += x * x
            acc3 += (x * g[None, :])[:, None, :] * w.to(tl.float32)[None, :, :]
        w_ptrs += BLOCK_K * s_wk
        x_ptrs += BLOCK_K * s_xk
        g_ptrs += BLOCK_K * s_gk
    n_ok = rn < N
    if BLOCK_M == 1:
        acc = tl.sum(acc2, axis=1)
        sq = tl.sum(sq1, axis=0)
        if DIRECT:
            inv = 1.0 / tl.sqrt(sq / K + eps)
            tl.store(c_ptr + pid_m.to(tl.int64) * s_cm + rn * s_cn,
                     (acc * inv).to(c_ptr.dtype.element_ty), mask=n_ok)
        else:
            tl.store(ws_ptr + (pid_k * M + pid_m).to(tl.int64) * N + rn, acc, mask=n_ok)
            tl.store(ss_ptr + (pid_k * num_n + pid_n).to(tl.int64) * M + pid_m, sq)
    else:
        acc = tl.sum(acc3, axis=2)
        sq = tl.sum(sq2, axis=1)
        m_ok = rm < M
        mask = m_ok[:, None] & n_ok[None, :]
        if DIRECT:
            inv = 1.0 / tl.sqrt(sq / K + eps)
            c_ptrs = c_ptr + rm.to(tl.int64)[:, None] * s_cm + rn[None, :] * s_cn
            tl.store(c_ptrs, (acc * inv[:, None]).to(c_ptr.dtype.element_ty), mask=mask)
        else:
            ws_ptrs = ws_ptr + (pid_k * M + rm).to(tl.int64)[:, None] * N + rn[None, :]
            tl.store(ws_ptrs, acc, mask=mask)
            tl.store(ss_ptr + (pid_k * num_n + pid_n).to(tl.int64) * M + rm, sq, mask=m_ok)
    if LAST_REDUCES:
        # Every thread's partials are stored before one thread's release (CTA barrier).
        tl.debug_barrier()
        counter = cnt_ptr + pid_m * num_n + pid_n
        arrived = tl.atomic_add(counter, 1, sem="acq_rel")
        if arrived == SPLITS - 1:
            if BLOCK_M == 1:
                total = tl.zeros([BLOCK_N], dtype=tl.float32)
                sq_t = tl.zeros([1], dtype=tl.float32)
                for sk in tl.static_range(SPLITS):  # fixed order: the same bits every run
                    part = ws_ptr + (sk * M + pid_m).to(tl.int64) * N + rn
                    total += tl.load(part, mask=n_ok, other=0.0, cache_modifier=".cg")
                    sq_p = ss_ptr + (sk * num_n + pid_n).to(tl.int64) * M + pid_m + tl.arange(0, 1)
                    sq_t += tl.load(sq_p, cache_modifier=".cg")
                inv = 1.0 / tl.sqrt(sq_t / K + eps)
                tl.store(c_ptr + pid_m.to(tl.int64) * s_cm + rn * s_cn,
                         (total * inv).to(c_ptr.dtype.element_ty), mask=n_ok)
            else:
                m_ok = rm < M
                mask = m_ok[:, None] & n_ok[None, :]
                total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                sq_t = tl.zeros([BLOCK_M], dtype=tl.float32)
                for sk in tl.static_range(SPLITS):
                    part = ws_ptr + (sk * M + rm).to(tl.int64)[:, None] * N + rn[None, :]
                    total += tl.load(part, mask=mask, other=0.0, cache_modifier=".cg")
                    sq_p = ss_ptr + (sk * num_n + pid_n).to(tl.int64) * M + rm
                    sq_t += tl.load(sq_p, mask=m_ok, other=0.0, cache_modifier=".cg")
                inv = 1.0 / tl.sqrt(sq_t / K + eps)
                c_ptrs = c_ptr + rm.to(tl.int64)[:, None] * s_cm + rn[None, :] * s_cn
                tl.store(c_ptrs, (total * inv[:, None]).to(c_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(counter, 0, sem="relaxed")  # ready for the next launch


@triton.jit(do_not_specialize=["split_steps"])
def _splitk_kernel(x_ptr, g_ptr, w_ptr, ws_ptr, ss_ptr, c_ptr, cnt_ptr, M, N, K, split_steps, eps,
                   s_xm, s_xk, s_gk, s_wn, s_wk, s_cm, s_cn,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   DIRECT: tl.constexpr, EVEN_K: tl.constexpr, UPCAST: tl.constexpr,
                   DOT_PRECISION: tl.constexpr, LAST_REDUCES: tl.constexpr,
                   SPLITS: tl.constexpr, RED_M: tl.constexpr, SWAP: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    num_n = tl.num_programs(0)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    # As in _gemv_kernel: a split offset that is a known multiple of BLOCK_K (16-byte loads).
    k_per_split = split_steps * BLOCK_K
    k_lo = pid_k * k_per_split
    k_hi = min(k_lo + k_per_split, K)
    x_ptrs = x_ptr + (rm % M).to(tl.int64)[:, None] * s_xm + (k_lo + rk)[None, :] * s_xk
    w_ptrs = w_ptr + (rn % N).to(tl.int64)[:, None] * s_wn + (k_lo + rk)[None, :] * s_wk
    g_ptrs = g_ptr + (k_lo + rk) * s_gk
    if SWAP:
        acc_t = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if SWAP:
        sq2 = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    else:
        sq = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k in range(k_lo, k_hi, BLOCK_K):
        # swapab: each weight byte is read once (evict_first keeps x, re-read by every
        # program, in L2); splitk loads it as it always has.
        if EVEN_K:
            a = tl.load(x_ptrs)
            g = tl.load(g_ptrs)
            if SWAP:
                w = tl.load(w_ptrs, eviction_policy="evict_first")
            else:
                w = tl.load(w_ptrs)
        else:
            k_ok = (k + rk) < K
            a = tl.load(x_ptrs, mask=k_ok[None, :], other=0.0)
            g = tl.load(g_ptrs, mask=k_ok, other=0.0)
            if SWAP:
                w = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0, eviction_policy="evict_first")
            else:
                w = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0)
        af = a.to(tl.float32)
        if SWAP:
            # squares summed over K once, after the loop: no cross-warp reduction (a CTA
            # barrier) in the loop that streams the weight
            sq2 += af * af
        else:
            sq += tl.sum(af * af, axis=1)
        # The dot operand is x * norm_weight in the input dtype (unscaled by 1/rms: no fp16
        # overflow); 1/rms scales the fp32 sums after the loop.
        an = af * g.to(tl.float32)[None, :]
        if UPCAST:
            w = w.to(tl.float32)
        else:
            an = an.to(w.dtype)
        if SWAP:
            # the weight tile is the dot's tall left operand (wgmma on sm_90)
            acc_t = tl.dot(w, tl.trans(an), acc_t, input_precision=DOT_PRECISION)
        else:
            acc = tl.dot(an, tl.trans(w), acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K * s_xk
        w_ptrs += BLOCK_K * s_wk
        g_ptrs += BLOCK_K * s_gk
    if SWAP:
        acc = tl.trans(acc_t)
        sq = tl.sum(sq2, axis=1)
    m_ok = rm < M
    mask = m_ok[:, None] & (rn[None, :] < N)
    if DIRECT:
        inv = 1.0 / tl.sqrt(sq / K + eps)
        c_ptrs = c_ptr + rm.to(tl.int64)[:, None] * s_cm + rn[None, :] * s_cn
        tl.store(c_ptrs, (acc * inv[:, None]).to(c_ptr.dtype.element_ty), mask=mask)
    else:
        ws_ptrs = ws_ptr + (pid_k * M + rm).to(tl.int64)[:, None] * N + rn[None, :]
        tl.store(ws_ptrs, acc, mask=mask)
        tl.store(ss_ptr + (pid_k * num_n + pid_n).to(tl.int64) * M + rm, sq, mask=m_ok)
        if LAST_REDUCES:
            # Every thread's partials are stored before one thread's release (CTA barrier).
            tl.debug_barrier()
            counter = cnt_ptr + pid_m * num_n + pid_n
            arrived = tl.atomic_add(counter, 1, sem="acq_rel")
            if arrived == SPLITS - 1:
                # Rows in RED_M-row slices: batch 1 reads one row per split, not BLOCK_M.
                rr = tl.arange(0, RED_M)
                n_ok = rn[None, :] < N
                for m0 in range(0, tl.minimum(M - pid_m * BLOCK_M, BLOCK_M), RED_M):
                    rows = pid_m * BLOCK_M + m0 + rr
                    r_ok = rows < M
                    rmask = r_ok[:, None] & n_ok
                    total = tl.zeros([RED_M, BLOCK_N], dtype=tl.float32)
                    sq_t = tl.zeros([RED_M], dtype=tl.float32)
                    for sk in tl.static_range(SPLITS):  # fixed order: the same bits every run
                        part = ws_ptr + (sk * M + rows).to(tl.int64)[:, None] * N + rn[None, :]
                        total += tl.load(part, mask=rmask, other=0.0, cache_modifier=".cg")
                        sq_p = ss_ptr + (sk * num_n + pid_n).to(tl.int64) * M + rows
                        sq_t += tl.load(sq_p, mask=r_ok, other=0.0, cache_modifier=".cg")
                    inv = 1.0 / tl.sqrt(sq_t / K + eps)
                    c_ptrs = c_ptr + rows.to(tl.int64)[:, None] * s_cm + rn[None, :] * s_cn
                    tl.store(c_ptrs, (total * inv[:, None]).to(c_ptr.dtype.element_ty), mask=rmask)
                tl.atomic_xchg(counter, 0, sem="relaxed")  # ready for the next launch


@triton.jit
def _splitk_reduce_kernel(ws_ptr, ss_ptr, c_ptr, M, N, K, SPLITS, ss_stride, eps, s_cm, s_cn,
                          BLOCK: tl.constexpr):
    # One row per program along axis 1: its sum of squares is one value per split (column
    # block 0's slot, ss_stride = N tiles x M apart).
    m = tl.program_id(1)
    rn = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    n_ok = rn < N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    sq = tl.zeros([1], dtype=tl.float32)
    ptrs = ws_ptr + m.to(tl.int64) * N + rn
    sq_ptrs = ss_ptr + m + tl.arange(0, 1)
    for _ in range(0, SPLITS):  # fixed order: the same bits every run
        acc += tl.load(ptrs, mask=n_ok, other=0.0)
        sq += tl.load(sq_ptrs)
        ptrs += M * N  # M x N < 2^31 (M <= a few thousand rows)
        sq_ptrs += ss_stride
    inv = 1.0 / tl.sqrt(sq / K + eps)
    tl.store(c_ptr + m.to(tl.int64) * s_cm + rn * s_cn, (acc * inv).to(c_ptr.dtype.element_ty),
             mask=n_ok)


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


def launch(x, norm_weight, weight, eps, out, variant="gemv", BLOCK_M=8, BLOCK_N=8, BLOCK_K=1024,
           SPLIT_K=1, PIPE=0, num_warps=8, num_stages=3, REDUCE="last"):
    M, K = x.shape
    N, K2 = weight.shape
    if K2 != K or tuple(norm_weight.shape) != (K,) or tuple(out.shape) != (M, N):
        raise ValueError(f"rmsnorm_linear shapes x{tuple(x.shape)} norm_weight{tuple(norm_weight.shape)} "
                         f"weight{tuple(weight.shape)} out{tuple(out.shape)}")
    if M == 0 or N == 0:
        return out
    if K == 0:
        raise ValueError("rmsnorm_linear template needs K > 0")
    if variant not in ("splitk", "gemv", "swapab"):
        raise ValueError(f"unknown rmsnorm_linear variant {variant!r}")
    if REDUCE not in ("launch", "last"):
        raise ValueError(f"unknown rmsnorm_linear REDUCE {REDUCE!r}")
    eps = float(eps)
    even_k = K % BLOCK_K == 0
    rows = triton.next_power_of_2(M)
    if variant == "gemv":
        # Rows per program: M rounded up to a power of two, at most BLOCK_M, and as many as
        # the accumulator budget leaves (a larger M re-streams the weight once per row block).
        budget = max(1, GEMV_ACC_PER_WARP * num_warps // (BLOCK_N * BLOCK_K))
        block_m = max(1, min(rows, BLOCK_M, GEMV_MAX_ROWS, budget))
    else:
        block_m = max(16, min(rows, BLOCK_M))  # tl.dot needs at least 16 rows
    k_per_split = triton.cdiv(triton.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    splits = triton.cdiv(K, k_per_split)
    direct = splits == 1
    last = REDUCE == "last" and not direct
    grid = (triton.cdiv(N, BLOCK_N), splits, triton.cdiv(M, block_m))
    if direct:
        ws, ss = out, out
    else:
        ws = torch.empty((splits, M, N), device=x.device, dtype=torch.float32)
        ss = torch.empty((splits, grid[0], M), device=x.device, dtype=torch.float32)
    cnt = _arrival_counters(x.device, grid[0] * grid[2]) if last else ws
    args = (x, norm_weight, weight, ws, ss, out, cnt, M, N, K, k_per_split // BLOCK_K, eps,
            x.stride(0), x.stride(1), norm_weight.stride(0), weight.stride(0), weight.stride(1),
            out.stride(0), out.stride(1))
    if variant == "gemv":
        _gemv_kernel[grid](*args, BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                           LOOP_STAGES=num_stages if PIPE else 1, DIRECT=direct,
                           EVEN_K=even_k, LAST_REDUCES=last, SPLITS=splits,
                           SQ_R=max(1, min(8, BLOCK_K // (32 * num_warps))),
                           num_warps=num_warps, num_stages=num_stages)
    else:
        upcast, precision = _dot_args(x)
        _splitk_kernel[grid](*args, BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, DIRECT=direct,
                             EVEN_K=even_k, UPCAST=upcast, DOT_PRECISION=precision,
                             LAST_REDUCES=last, SPLITS=splits, RED_M=min(rows, block_m),
                             SWAP=variant == "swapab", num_warps=num_warps, num_stages=num_stages)
    if not direct and not last:
        block = 1024
        _splitk_reduce_kernel[(triton.cdiv(N, block), M)](ws, ss, out, M, N, K, splits, grid[0] * M, eps,
                                                          out.stride(0), out.stride(1), BLOCK=block,
                                                          num_warps=4)
    return out
