"""Experiment (BENCHMARKS.md 10n; not adopted: equal in the H200 step, with or without early
reads): kernelsearch/kernels/linear_residual.py at 8091743 with a "rows" variant added (_rows_kernel,
ROWS_TILE_BYTES_PER_THREAD, K1-K5 in CONFIGS, BLOCK_N 1 and 2 in SPACE for rows only), searched
as a candidate: `hwtune search linear_residual --source bench/experiments/linear_residual_rows.py`
(bench/experiments/rows_gpu.sh). The template's own text follows, unchanged.

linear_residual template: out[M, N] = residual[M, N] + x[M, K] @ weight[N, K].T (out of place).

The o_proj and down_proj of a decoder layer with the residual add in their epilogue. The weight
is nn.Linear's layout (one contiguous row of K values per output feature), read along K in
[BLOCK_N, BLOCK_K] tiles with 16-byte loads. The residual is read once, where `out` is written:
by the program that stores `out` on the direct path (one split), by the reducer only on the
split-K paths (the last-arriving program, or the reduce kernel), never by the partial sums. So
the epilogue costs M x N reads of the residual and nothing else: at decode the weight bytes
(N x K) dominate and the floor is the weight stream.
- "gemv" (decode, batch 1-8): a weight-streaming GEMV without tl.dot, as in the linear
  template. A program takes BLOCK_N weight rows and min(next power of two of M, BLOCK_M <= 8,
  the accumulator budget) rows of x (rows past M and features past N re-read valid ones; only
  the residual loads and the stores are masked), accumulates the products into a
  [BLOCK_N, BLOCK_K] fp32 tile (batch 1) or a [rows, BLOCK_N, BLOCK_K] one, summed over K once
  after the loop. Weight loads carry evict_first (read once; x, re-read by every program,
  stays in L2). UNROLL=2 loads two K steps (two independent tiles) before the first multiply,
  so each program has twice the weight bytes in flight for the same accumulator registers;
  the steps that do not fill a whole UNROLL group (the end of K) run one at a time, masked
  only when K is not a multiple of BLOCK_K.
  Early reads: loads of the split's first weight step are also issued at the very top,
  values dropped (volatile), so that with HWTUNE_PDL_EARLY=1 they reach L2 before the wait
  for the kernel ahead ends; the loop is unchanged (docs/ARCHITECTURE.md, "Early reads").
- "swapab" (decode, batch 9-64): "splitk" with the weight tile as tl.dot's left operand (wgmma
  on sm_90); see "Batch 32, swapped" below.
- "splitk" (decode, batch 9-64): the rows of x go through tl.dot (padded to at least 16;
  BLOCK_M caps the rows per program, so batch 32 streams the weight once with BLOCK_M >= 32),
  loads pipelined over num_stages by the compiler (cp.async on sm_90).
Split-K (SPLIT_K > 1, both variants): each program covers one of SPLIT_K ranges of K, each
split_steps x BLOCK_K long with split_steps a runtime int (so the compiler knows the split
offset is a multiple of BLOCK_K: 16-byte loads). Partials go to an fp32 workspace [splits, M, N]
summed in a fixed split order (deterministic, no float atomics), then the residual is added in
fp32 and `out` stored once: by a second kernel (REDUCE="launch") or by the program that arrives
last at its tile (REDUCE="last": a CTA barrier, then an acq_rel arrival counter; the counters
are allocated zeroed once per device and set back to 0 by the last program, so CUDA graphs
need no fill kernel). One split writes `out` directly (REDUCE unused).
fp32 accumulation, residual added in fp32, cast on store; fp32 operands use exact (ieee) dots;
the interpreter's bf16 arithmetic being wrong, tl.dot operands are upcast on the CPU.

Why each config (H200: 132 SMs, 64 K registers and 227 KB of shared memory an SM, ~4.3 TB/s by
copy). Little's law: at ~0.7 us of idle DRAM latency the copy rate needs ~3 MB in flight, ~23 KB
an SM; under full load the latency grows (queueing), and a register-loading GEMV program has
nothing in flight while it multiplies. The 4096 x 4096 o_proj is 32 MB of bf16 weight, ~7.8 us
at copy rate, so a 1 us ramp or a partial last round is already 13%: linear.py's gemv (48 KB in
flight an SM at its peak, 512 programs in 1.3 rounds) reaches 66-80% of copy there. Issue 13
asks >= 85% at M = 1 and M = 32. What limits a register-loading GEMV is the register file: the
loaded tile lands in registers next to its fp32 accumulator (twice the tile's bytes), so about a
third of the 256 KB register file is in flight at best (48-64 KB an SM whatever the tile;
UNROLL=2 only moves the ratio to a half, at 125 registers a thread). Hence PIPE=1: the main loop
is a tl.range with num_stages, which triton 3.9 software-pipelines for sm_90 (16-byte cp.async
into num_stages - 1 shared-memory buffers ahead; without tl.range the compiler leaves a loop
without tl.dot unpipelined, which is why linear.py's gemv ignores num_stages), so bytes in
flight come from the 227 KB of shared memory and stay in flight while the program multiplies.
(The weight's cp.async keep evict_first as an L2 cache policy; x, an eighth of the bytes and
from L2, goes 8 bytes a thread at BLOCK_K = 512, 4 warps.) The other levers: a grid that is one balanced round (every program
resident at once, no partial second round), and split-K where the loop is long (K = 14336).
"tile" = weight bytes one program loads per step (x UNROLL); "programs" at 4096 x 4096 = N /
BLOCK_N x splits; registers a thread and shared memory from triton 3.9 + ptxas for sm_90 (bf16,
batch 1; tests/test_kernel_linear_residual.py compiles them), no spills; resident programs an SM
= min(65536 / (registers rounded up to 8 x threads), 227 KB / shared memory); bytes in flight an
SM = resident x tile (PIPE=0: the loads of one step, issued together) or resident x
(num_stages - 1) x tile (PIPE=1).
  R1 gemv 8x1024, 8 warps: 16 KB tile, 80 registers: 3 resident, 48 KB an SM; 512 programs =
     1.3 rounds of 396. linear.py's G1 + the residual: the baseline the others must beat.
  R3 gemv 8x512, 4 warps, UNROLL=2: 2 x 8 KB, 126 registers: 4 resident, 64 KB; 512 programs in
     one round of 528: the register-only way to more bytes in flight.
  P1 gemv 8x512, 4 warps, PIPE, 4 stages: 8 KB tile, 79 registers, 27 KB shared: 6 resident,
     3 tiles ahead = 144 KB an SM; 512 programs in one round of 792. The first guess for >= 85%.
  P2 gemv 8x512, 4 warps, PIPE, 5 stages: 36 KB shared, 6 resident, 4 ahead = 192 KB an SM.
  P3 gemv 8x256, 4 warps, PIPE, 6 stages: 4 KB tile, 52 registers, 23 KB shared: 9 resident, 5
     ahead = 180 KB an SM; 512 programs in one round of 1188; 16 steps at K = 4096 (the
     pipeline's prologue and drain a smaller share of each program).
  P5 gemv 8x512, 4 warps, PIPE, 4 stages, split 2, last: as P1 (80 registers, 144 KB an SM) with
     1024 programs (1.3 rounds): for K = 14336 (down_proj, 14 steps a split instead of 28);
     the last of the 2 adds the residual.
  P6 gemv 16x256, 4 warps, PIPE, 4 stages, split 4, launch: 8 KB tile, 78 registers, 26 KB
     shared: 6 resident, 144 KB; 1024 programs at 4096, K = 14336 in 3584-long quarters; the
     reduce kernel (a second launch instead of the arrival counter: measured) adds the residual.
  Batch 32 (tl.dot, mma.sync at 32 rows; the compiler pipelines these loops itself: cp.async
  into num_stages - 1 buffers, "stage" = the x and weight bytes of one step; at batch 1 they
  also run, 15 of 16 mma rows wasted, with the same shared-memory pipeline):
  D6 splitk 32x32x256, one split, 3 stages: 32 KB a stage, 64 KB shared = 3 programs an SM, 192
     KB in flight an SM; no workspace, the program adds the residual; 128 programs at 4096
     (too few), for the N >= 14336 a model may bring.
  D1 splitk 32x32x256, split 4, 3 stages: as D6 (96 registers), 512 programs = 1.3 rounds of
     396. linear.py's D2, its first guess for batch 32.
  D2 splitk 32x32x256, split 8, 3 stages, last: as D1 with 1024 programs (2.6 rounds: the last
     partial round a smaller share), 512-long splits at 4096.
  D3 splitk 32x64x256, split 4, 4 stages: 48 KB a stage, 144 KB shared = 1 program an SM, 144
     KB in flight; 256 programs = 1.9 rounds of 132: the deepest pipe a program.
  D4 splitk 32x32x128, split 4, 4 stages: 16 KB a stage, 48 KB = 4 an SM, 192 KB in flight; 512
     programs in one round of 528 (linear.py's D4).
  D5 splitk 32x64x128, split 8, 4 stages, launch: 24 KB a stage, 72 KB = 3 an SM, 216 KB in
     flight; 512 programs; the reduce kernel adds the residual.
  D7 splitk 32x32x128, split 8, 4 stages: as D4 with 1024 programs (1.9 rounds of 528) and
     512-long splits at 4096.
  Batch 32, swapped ("swapab": as splitk, with the [BLOCK_N, BLOCK_K] weight tile as tl.dot's
  left operand and x's 32 rows as its right one, the [BLOCK_N, 32] accumulator transposed once
  after the loop: wgmma on sm_90, operands from the cp.async buffers, where the 32-row dot
  above is mma.sync through registers; weight loads evict_first). The tiles are linear.py's
  measured swapab tiles (its docstring: W1 12.2 us at 4096x4096 against cuBLAS's 14.3, W4 32.6
  at 14336 -> 4096 against 34.7, L2 flushed, H200):
  W1 swapab 32x64x128, 6 stages: 24 KB a stage, 144 KB, one program an SM; 64 at 4096x4096.
  W3 swapab 32x64x128, split 2, 4 stages: 96 KB = 2 an SM; 128 programs.
  W4 swapab 32x64x128, split 2, 6 stages: 128 programs, 7168-long halves at K = 14336.
  W2 swapab 32x64x64, 10 stages: 12 KB a stage, 120 KB.
  W5 swapab 32x64x64, split 2, 10 stages: as W2 with 128 programs.
  (Left out after reading ptxas: gemv 8x1024 at 4 warps with UNROLL=2 (144 registers) or 16x512
  at 4 warps (167; 239 with UNROLL=2): too few programs resident. linear.py's G2 and G5 remain
  points of SPACE for a search that wants them.)
Order: the grid strategy walks the template's domain in SPACE order (kernelsearch.proposers:
params sorted by name, so BLOCK_K outermost, listed descending, then BLOCK_M ascending: 8 is
gemv, 32 splitk, then BLOCK_N, PIPE, REDUCE, SPLIT_K, UNROLL, num_stages, num_warps) and under a
budget B takes B points evenly spread over it. CONFIGS is listed in that order (the test holds
it): the gemv block first (BLOCK_K >= 256), then the batch-32 block (splitk and swapab: 7 + 5),
so any B >= 2 samples both and B >= 6 at least 3 of each; CONFIGS[0] (check-kernel's default)
is R1.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

SPACE = {
    "variant": ["gemv", "splitk", "swapab", "rows"],
    "BLOCK_M": [8, 16, 32, 64],        # the most rows of x one program takes
    "BLOCK_N": [1, 2, 4, 8, 16, 32, 64, 128],  # 1 and 2: rows only
    "BLOCK_K": [1024, 512, 256, 128, 64, 32],  # descending: see "Order" in the docstring
    "SPLIT_K": [1, 2, 4, 8, 16],
    "UNROLL": [1, 2],                  # gemv: K steps loaded together per loop iteration
    "PIPE": [0, 1],                    # gemv: the main loop pipelined over num_stages (cp.async)
    "num_warps": [4, 8],
    "num_stages": [2, 3, 4, 5, 6, 10],
    "REDUCE": ["last", "launch"],      # split-K: the last-arriving program, or a second kernel
}

SMEM_LIMIT_BYTES = 220 * 1024          # Hopper allows 227 KB per block; keep a margin
GEMV_ACC_PER_WARP = 2048               # fp32 accumulator elements per warp: 64 registers a thread
GEMV_MAX_ROWS = 8                      # gemv: BLOCK_M is a cap; more rows go to tl.dot (splitk)
ROWS_TILE_BYTES_PER_THREAD = 256       # rows: the weight tile a thread holds (bf16 K=4096, 1 row,
                                       # 4 warps: 64); larger tiles are refused at launch


def _valid(p: dict) -> bool:
    if p["variant"] == "rows":
        # K is taken whole: BLOCK_K (1024 by convention), SPLIT_K, PIPE, REDUCE and num_stages
        # do not apply and take one value each, so that each tile is one point of SPACE
        return (p["BLOCK_N"] <= 4 and p["BLOCK_K"] == 1024 and p["BLOCK_M"] == GEMV_MAX_ROWS
                and p["SPLIT_K"] == 1 and p["UNROLL"] == 1 and not p["PIPE"]
                and p["REDUCE"] == "last" and p["num_stages"] == 2)
    if p["BLOCK_N"] < 4:  # 1 and 2 are rows tiles
        return False
    if p["variant"] == "gemv":
        # PIPE: num_stages - 1 buffers of the step's weight and x tiles (bf16)
        smem = ((p["BLOCK_N"] + p["BLOCK_M"]) * p["BLOCK_K"] * p["UNROLL"] * 2
                * (p["num_stages"] - 1) if p["PIPE"] else 0)
        return (p["BLOCK_M"] == GEMV_MAX_ROWS and p["BLOCK_K"] >= 64 and smem <= SMEM_LIMIT_BYTES
                and p["BLOCK_N"] * p["BLOCK_K"] <= GEMV_ACC_PER_WARP * p["num_warps"])
    smem = (p["BLOCK_M"] * p["BLOCK_K"] + p["BLOCK_K"] * p["BLOCK_N"]) * 2 * p["num_stages"]
    # swapab: the weight tile is the dot's left operand, and wgmma wants >= 64 of its rows
    return (p["BLOCK_M"] >= 16 and p["BLOCK_K"] >= 64 and p["UNROLL"] == 1 and not p["PIPE"]
            and smem <= SMEM_LIMIT_BYTES
            and (p["variant"] == "splitk" or (p["BLOCK_N"] >= 64 and p["BLOCK_M"] <= 64)))


def _cfg(variant, bm, bn, bk, sk, warps, stages, reduce="last", unroll=1, pipe=0):
    return {"variant": variant, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": sk,
            "UNROLL": unroll, "PIPE": pipe, "num_warps": warps, "num_stages": stages,
            "REDUCE": reduce}


# Curated, not the product of SPACE; the docstring says why each entry is here. Listed in the
# order the grid strategy walks them (SPACE order), not by the docstring's names.
CONFIGS = [
    # batch 1-8: whole weight rows a program, K in one load
    _cfg("rows", 8, 1, 1024, 1, 4, 2),                          # K1
    _cfg("rows", 8, 1, 1024, 1, 8, 2),                          # K2
    _cfg("rows", 8, 2, 1024, 1, 4, 2),                          # K3
    _cfg("rows", 8, 2, 1024, 1, 8, 2),                          # K4
    _cfg("rows", 8, 4, 1024, 1, 8, 2),                          # K5
    # batch 1-8: the GEMV (rows per program = next power of two of M, at most 8)
    _cfg("gemv", 8, 8, 1024, 1, 8, 3),                          # R1
    _cfg("gemv", 8, 8, 512, 1, 4, 3, unroll=2),                 # R3
    _cfg("gemv", 8, 8, 512, 1, 4, 4, pipe=1),                   # P1
    _cfg("gemv", 8, 8, 512, 1, 4, 5, pipe=1),                   # P2
    _cfg("gemv", 8, 8, 512, 2, 4, 4, pipe=1),                   # P5
    _cfg("gemv", 8, 8, 256, 1, 4, 6, pipe=1),                   # P3
    _cfg("gemv", 8, 16, 256, 4, 4, 4, "launch", pipe=1),        # P6
    # batch 9-64: tl.dot with all 32 rows in one program (the weight is streamed once)
    # (swapab: the weight tile is tl.dot's left operand, wgmma on sm_90)
    _cfg("splitk", 32, 32, 256, 1, 4, 3),                       # D6
    _cfg("splitk", 32, 32, 256, 4, 4, 3),                       # D1
    _cfg("splitk", 32, 32, 256, 8, 4, 3),                       # D2
    _cfg("splitk", 32, 64, 256, 4, 4, 4),                       # D3
    _cfg("splitk", 32, 32, 128, 4, 4, 4),                       # D4
    _cfg("splitk", 32, 32, 128, 8, 4, 4),                       # D7
    _cfg("swapab", 32, 64, 128, 1, 4, 6),                       # W1
    _cfg("swapab", 32, 64, 128, 2, 4, 4),                       # W3
    _cfg("swapab", 32, 64, 128, 2, 4, 6),                       # W4
    _cfg("splitk", 32, 64, 128, 8, 4, 4, "launch"),             # D5
    _cfg("swapab", 32, 64, 64, 1, 4, 10),                       # W2
    _cfg("swapab", 32, 64, 64, 2, 4, 10),                       # W5
]
CONFIGS = [p for p in CONFIGS if _valid(p)]


@triton.jit(do_not_specialize=["split_steps"])
def _gemv_kernel(x_ptr, w_ptr, r_ptr, ws_ptr, c_ptr, cnt_ptr, M, N, K, split_steps,
                 s_xm, s_xk, s_wn, s_wk, s_rm, s_rn, s_cm, s_cn,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 UNROLL: tl.constexpr, LOOP_STAGES: tl.constexpr, DIRECT: tl.constexpr,
                 EVEN_K: tl.constexpr, LAST_REDUCES: tl.constexpr, SPLITS: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    # A split is split_steps x BLOCK_K long, so the compiler knows k_lo is a multiple of
    # BLOCK_K: 16-byte loads along K.
    k_per_split = split_steps * BLOCK_K
    k_lo = pid_k * k_per_split
    k_hi = min(k_lo + k_per_split, K)
    # Whole groups of UNROLL steps lie inside [k_lo, k_hi), hence inside K: never masked.
    k_main = k_lo + ((k_hi - k_lo) // (UNROLL * BLOCK_K)) * (UNROLL * BLOCK_K)
    # Features past N re-read valid rows (wrap) so that weight loads stay unmasked along N;
    # only the residual loads and the stores are masked. Same for rows of x past M.
    w_ptrs = w_ptr + (rn % N).to(tl.int64)[:, None] * s_wn + (k_lo + rk)[None, :] * s_wk
    # Early reads (see the docstring): the split's first weight step into L2, values dropped.
    # Every split has at least one step (splits = cdiv(K, k_per_split)); with EVEN_K it is whole.
    if EVEN_K:
        w_l2 = tl.load(w_ptrs, volatile=True)
    else:
        w_l2 = tl.load(w_ptrs, mask=((k_lo + rk) < k_hi)[None, :], other=0.0, volatile=True)
    if BLOCK_M == 1:
        x_ptrs = x_ptr + pid_m.to(tl.int64) * s_xm + (k_lo + rk) * s_xk
        acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    else:
        x_ptrs = x_ptr + (rm % M).to(tl.int64)[:, None] * s_xm + (k_lo + rk)[None, :] * s_xk
        acc3 = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    # LOOP_STAGES > 1: the compiler pipelines this loop (cp.async into LOOP_STAGES - 1 shared
    # memory buffers ahead); 1: plain register loads, issued together, waited for each step.
    for k in tl.range(k_lo, k_main, UNROLL * BLOCK_K, num_stages=LOOP_STAGES):
        # Each weight byte is read once: evict_first keeps x (re-read by every program) in L2.
        if UNROLL == 2:
            # Both tiles' loads issued before either multiply: twice the bytes in flight.
            w0 = tl.load(w_ptrs, eviction_policy="evict_first")
            w1 = tl.load(w_ptrs + BLOCK_K * s_wk, eviction_policy="evict_first")
            x0 = tl.load(x_ptrs)
            x1 = tl.load(x_ptrs + BLOCK_K * s_xk)
            if BLOCK_M == 1:
                acc2 += w0.to(tl.float32) * x0.to(tl.float32)[None, :]
                acc2 += w1.to(tl.float32) * x1.to(tl.float32)[None, :]
            else:
                acc3 += x0.to(tl.float32)[:, None, :] * w0.to(tl.float32)[None, :, :]
                acc3 += x1.to(tl.float32)[:, None, :] * w1.to(tl.float32)[None, :, :]
        else:
            w = tl.load(w_ptrs, eviction_policy="evict_first")
            x = tl.load(x_ptrs)
            if BLOCK_M == 1:
                acc2 += w.to(tl.float32) * x.to(tl.float32)[None, :]
            else:
                acc3 += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
        w_ptrs += UNROLL * BLOCK_K * s_wk
        x_ptrs += UNROLL * BLOCK_K * s_xk
    # The steps left (fewer than UNROLL, or a ragged end of K): one at a time.
    for k in range(k_main, k_hi, BLOCK_K):
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
            res = tl.load(r_ptr + pid_m.to(tl.int64) * s_rm + rn * s_rn, mask=n_ok, other=0.0)
            tl.store(c_ptr + pid_m.to(tl.int64) * s_cm + rn * s_cn,
                     (acc + res.to(tl.float32)).to(c_ptr.dtype.element_ty), mask=n_ok)
        else:
            tl.store(ws_ptr + (pid_k * M + pid_m).to(tl.int64) * N + rn, acc, mask=n_ok)
    else:
        acc = tl.sum(acc3, axis=2)
        mask = (rm[:, None] < M) & n_ok[None, :]
        if DIRECT:
            res = tl.load(r_ptr + rm.to(tl.int64)[:, None] * s_rm + rn[None, :] * s_rn, mask=mask,
                          other=0.0)
            c_ptrs = c_ptr + rm.to(tl.int64)[:, None] * s_cm + rn[None, :] * s_cn
            tl.store(c_ptrs, (acc + res.to(tl.float32)).to(c_ptr.dtype.element_ty), mask=mask)
        else:
            ws_ptrs = ws_ptr + (pid_k * M + rm).to(tl.int64)[:, None] * N + rn[None, :]
            tl.store(ws_ptrs, acc, mask=mask)
    if LAST_REDUCES:
        # Every thread's partial is stored before one thread's release (CTA barrier).
        tl.debug_barrier()
        counter = cnt_ptr + pid_m * tl.num_programs(0) + pid_n
        arrived = tl.atomic_add(counter, 1, sem="acq_rel")
        if arrived == SPLITS - 1:
            if BLOCK_M == 1:
                total = tl.zeros([BLOCK_N], dtype=tl.float32)
                for sk in tl.static_range(SPLITS):  # fixed order: the same bits every run
                    part = ws_ptr + (sk * M + pid_m).to(tl.int64) * N + rn
                    total += tl.load(part, mask=n_ok, other=0.0, cache_modifier=".cg")
                res = tl.load(r_ptr + pid_m.to(tl.int64) * s_rm + rn * s_rn, mask=n_ok, other=0.0)
                tl.store(c_ptr + pid_m.to(tl.int64) * s_cm + rn * s_cn,
                         (total + res.to(tl.float32)).to(c_ptr.dtype.element_ty), mask=n_ok)
            else:
                mask = (rm[:, None] < M) & n_ok[None, :]
                total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                for sk in tl.static_range(SPLITS):
                    part = ws_ptr + (sk * M + rm).to(tl.int64)[:, None] * N + rn[None, :]
                    total += tl.load(part, mask=mask, other=0.0, cache_modifier=".cg")
                res = tl.load(r_ptr + rm.to(tl.int64)[:, None] * s_rm + rn[None, :] * s_rn,
                              mask=mask, other=0.0)
                c_ptrs = c_ptr + rm.to(tl.int64)[:, None] * s_cm + rn[None, :] * s_cn
                tl.store(c_ptrs, (total + res.to(tl.float32)).to(c_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(counter, 0, sem="relaxed")  # ready for the next launch


@triton.jit
def _rows_kernel(x_ptr, w_ptr, r_ptr, ws_ptr, c_ptr, cnt_ptr, M, N, K, split_steps,
                 s_xm, s_xk, s_wn, s_wk, s_rm, s_rn, s_cm, s_cn,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    # "rows": BLOCK_N whole weight rows a program, all of K (BLOCK_K = K's next power of two)
    # in one load, issued first; then each row of x in turn against the tile in registers.
    # (ws_ptr, cnt_ptr and split_steps: the other kernels' signature, unused: one split.)
    pid_n = tl.program_id(0)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    # Features past N re-read valid rows (wrap): the weight load is masked along K only.
    w_ptrs = w_ptr + (rn % N).to(tl.int64)[:, None] * s_wn + rk[None, :] * s_wk
    if EVEN_K:
        w = tl.load(w_ptrs, eviction_policy="evict_first")
    else:
        w = tl.load(w_ptrs, mask=(rk < K)[None, :], other=0.0, eviction_policy="evict_first")
    n_ok = rn < N
    wf = w.to(tl.float32)
    for m in range(0, M):
        if EVEN_K:
            x = tl.load(x_ptr + m * s_xm + rk * s_xk)
        else:
            x = tl.load(x_ptr + m * s_xm + rk * s_xk, mask=rk < K, other=0.0)
        acc = tl.sum(wf * x.to(tl.float32)[None, :], axis=1)
        res = tl.load(r_ptr + m * s_rm + rn * s_rn, mask=n_ok, other=0.0)
        tl.store(c_ptr + m * s_cm + rn * s_cn, (acc + res.to(tl.float32)).to(c_ptr.dtype.element_ty),
                 mask=n_ok)


@triton.jit(do_not_specialize=["split_steps"])
def _splitk_kernel(x_ptr, w_ptr, r_ptr, ws_ptr, c_ptr, cnt_ptr, M, N, K, split_steps,
                   s_xm, s_xk, s_wn, s_wk, s_rm, s_rn, s_cm, s_cn,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   DIRECT: tl.constexpr, EVEN_K: tl.constexpr, UPCAST: tl.constexpr,
                   DOT_PRECISION: tl.constexpr, LAST_REDUCES: tl.constexpr,
                   SPLITS: tl.constexpr, RED_M: tl.constexpr, SWAP: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    # As in _gemv_kernel: the split offset is a known multiple of BLOCK_K (16-byte loads).
    k_per_split = split_steps * BLOCK_K
    k_lo = pid_k * k_per_split
    k_hi = min(k_lo + k_per_split, K)
    x_ptrs = x_ptr + (rm % M).to(tl.int64)[:, None] * s_xm + (k_lo + rk)[None, :] * s_xk
    w_ptrs = w_ptr + (rn % N).to(tl.int64)[:, None] * s_wn + (k_lo + rk)[None, :] * s_wk
    if SWAP:
        acc_t = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(k_lo, k_hi, BLOCK_K):
        # swapab: each weight byte is read once (evict_first keeps x, re-read by every
        # program, in L2); splitk loads it as it always has.
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
    if SWAP:
        acc = tl.trans(acc_t)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if DIRECT:
        res = tl.load(r_ptr + rm.to(tl.int64)[:, None] * s_rm + rn[None, :] * s_rn, mask=mask,
                      other=0.0)
        c_ptrs = c_ptr + rm.to(tl.int64)[:, None] * s_cm + rn[None, :] * s_cn
        tl.store(c_ptrs, (acc + res.to(tl.float32)).to(c_ptr.dtype.element_ty), mask=mask)
    else:
        ws_ptrs = ws_ptr + (pid_k * M + rm).to(tl.int64)[:, None] * N + rn[None, :]
        tl.store(ws_ptrs, acc, mask=mask)
        if LAST_REDUCES:
            # Every thread's partial is stored before one thread's release (CTA barrier).
            tl.debug_barrier()
            counter = cnt_ptr + pid_m * tl.num_programs(0) + pid_n
            arrived = tl.atomic_add(counter, 1, sem="acq_rel")
            if arrived == SPLITS - 1:
                # Rows in RED_M-row slices: a batch of 9 reads 16 rows per split, not BLOCK_M.
                rr = tl.arange(0, RED_M)
                n_ok = rn[None, :] < N
                for m0 in range(0, tl.minimum(M - pid_m * BLOCK_M, BLOCK_M), RED_M):
                    rows = pid_m * BLOCK_M + m0 + rr
                    rmask = (rows[:, None] < M) & n_ok
                    total = tl.zeros([RED_M, BLOCK_N], dtype=tl.float32)
                    for sk in tl.static_range(SPLITS):  # fixed order: the same bits every run
                        part = ws_ptr + (sk * M + rows).to(tl.int64)[:, None] * N + rn[None, :]
                        total += tl.load(part, mask=rmask, other=0.0, cache_modifier=".cg")
                    res = tl.load(r_ptr + rows.to(tl.int64)[:, None] * s_rm + rn[None, :] * s_rn,
                                  mask=rmask, other=0.0)
                    c_ptrs = c_ptr + rows.to(tl.int64)[:, None] * s_cm + rn[None, :] * s_cn
                    tl.store(c_ptrs, (total + res.to(tl.float32)).to(c_ptr.dtype.element_ty),
                             mask=rmask)
                tl.atomic_xchg(counter, 0, sem="relaxed")  # ready for the next launch


@triton.jit
def _reduce_kernel(ws_ptr, r_ptr, c_ptr, M, N, SPLITS, s_rm, s_rn, s_cm, s_cn,
                   BLOCK: tl.constexpr):
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
    res = tl.load(r_ptr + m * s_rm + n * s_rn, mask=mask, other=0.0)
    tl.store(c_ptr + m * s_cm + n * s_cn, (acc + res.to(tl.float32)).to(c_ptr.dtype.element_ty),
             mask=mask)


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


def launch(x, weight, residual, out, variant="gemv", BLOCK_M=8, BLOCK_N=8, BLOCK_K=512,
           SPLIT_K=1, UNROLL=1, PIPE=0, num_warps=4, num_stages=3, REDUCE="last"):
    M, K = x.shape
    N, K2 = weight.shape
    if K2 != K or tuple(residual.shape) != (M, N) or tuple(out.shape) != (M, N):
        raise ValueError(f"linear_residual shapes x{tuple(x.shape)} weight{tuple(weight.shape)} "
                         f"residual{tuple(residual.shape)} out{tuple(out.shape)}")
    if M == 0 or N == 0:
        return out
    if K == 0:
        raise ValueError("linear_residual template needs K > 0")
    if variant not in ("gemv", "splitk", "swapab", "rows"):
        raise ValueError(f"unknown linear_residual variant {variant!r}")
    if REDUCE not in ("launch", "last"):
        raise ValueError(f"unknown linear_residual REDUCE {REDUCE!r}")
    if UNROLL not in (1, 2) or (variant != "gemv" and UNROLL != 1):
        raise ValueError(f"linear_residual UNROLL={UNROLL!r}: 1 or 2, and 1 for splitk and swapab")
    strides = (x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), residual.stride(0),
               residual.stride(1), out.stride(0), out.stride(1))
    if variant == "rows":
        # BLOCK_K, SPLIT_K, REDUCE, PIPE, num_stages: unused (K whole, one split, no loop to pipe)
        block_k = triton.next_power_of_2(K)
        if BLOCK_N * block_k * 2 > ROWS_TILE_BYTES_PER_THREAD * 32 * num_warps:
            raise ValueError(f"linear_residual rows: a {BLOCK_N} x {block_k} weight tile is more than "
                             f"{ROWS_TILE_BYTES_PER_THREAD} bytes a thread at {num_warps} warps")
        _rows_kernel[(triton.cdiv(N, BLOCK_N),)](x, weight, residual, out, out, out, M, N, K, 1,
                                                 *strides, BLOCK_N=BLOCK_N, BLOCK_K=block_k,
                                                 EVEN_K=block_k == K, num_warps=num_warps,
                                                 num_stages=1)
        return out
    even_k = K % BLOCK_K == 0
    rows = triton.next_power_of_2(M)
    if variant == "gemv":
        # Rows per program: M rounded up to a power of two, at most BLOCK_M, and as many as
        # the accumulator budget leaves (a larger M re-streams the weight once per row block).
        budget = max(1, GEMV_ACC_PER_WARP * num_warps // (BLOCK_N * BLOCK_K))
        block_m = max(1, min(rows, BLOCK_M, GEMV_MAX_ROWS, budget))
        step = BLOCK_K * UNROLL  # splits of whole UNROLL groups: only the last one has a rest
    else:
        block_m = max(16, min(rows, BLOCK_M))  # tl.dot needs at least 16 rows
        step = BLOCK_K
    k_per_split = triton.cdiv(triton.cdiv(K, SPLIT_K), step) * step
    splits = triton.cdiv(K, k_per_split)
    direct = splits == 1
    last = REDUCE == "last" and not direct
    ws = out if direct else torch.empty((splits, M, N), device=x.device, dtype=torch.float32)
    grid = (triton.cdiv(N, BLOCK_N), splits, triton.cdiv(M, block_m))
    cnt = _arrival_counters(x.device, grid[0] * grid[2]) if last else ws
    if variant == "gemv":
        _gemv_kernel[grid](x, weight, residual, ws, out, cnt, M, N, K, k_per_split // BLOCK_K,
                           *strides, BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                           UNROLL=UNROLL, LOOP_STAGES=num_stages if PIPE else 1, DIRECT=direct,
                           EVEN_K=even_k, LAST_REDUCES=last, SPLITS=splits,
                           num_warps=num_warps, num_stages=num_stages)
    else:
        upcast, precision = _dot_args(x)
        _splitk_kernel[grid](x, weight, residual, ws, out, cnt, M, N, K, k_per_split // BLOCK_K,
                             *strides, BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                             DIRECT=direct, EVEN_K=even_k, UPCAST=upcast, DOT_PRECISION=precision,
                             LAST_REDUCES=last, SPLITS=splits, RED_M=min(rows, block_m),
                             SWAP=variant == "swapab", num_warps=num_warps, num_stages=num_stages)
    if not direct and not last:
        block = 1024
        _reduce_kernel[(triton.cdiv(M * N, block),)](ws, residual, out, M, N, splits,
                                                     residual.stride(0), residual.stride(1),
                                                     out.stride(0), out.stride(1), BLOCK=block,
                                                     num_warps=4)
    return out
