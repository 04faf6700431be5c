"""rmsnorm_qkv_rope template (decode, batch 1-8): RMSNorm + the q|k|v projection + RoPE on q and
k + the KV-cache write, in one launch.

The projection is rmsnorm_linear's weight-streaming GEMV ("gemv": no tl.dot; x * norm_weight
times the weight tile into a [BLOCK_N, BLOCK_K] fp32 accumulator, or [rows, BLOCK_N, BLOCK_K]
for up to 8 rows of x, the squares of x summed alongside, everything reduced over K once after
the loop; PIPE=1 pipelines the loop over num_stages with cp.async on sm_90; weight loads
evict_first; the first weight step also issued at the top, values dropped, for early reads).
What is new is which rows a program takes and what it does with them:
- RoPE pairs feature d of a head with feature d + D/2 of the same head. A program takes
  BLOCK_N / 2 consecutive *pairs* (pair p = head p // (D/2), feature p % (D/2)) and loads both
  rows of each, interleaved in its tile (tile row 2i: the pair's first-half row, 2i + 1: its
  second-half row). Each weight row is still read along K in 16-byte vectors; only the order
  of rows in the tile changes.
- After the loop, the tile's sums are scaled by 1/rms and split into the two halves of each
  pair (tl.split of a [pairs, 2] view), rotated in fp32 with the cos/sin of each row of x
  (v heads pass unrotated), and stored once: q heads into q_out, k and v heads into the cache
  slot positions[b] (nothing where the position is outside [0, S)). The projection is never
  stored as such: q|k|v is rotated from its fp32 sums, one rounding, on store.
No split-K: the rotation needs each pair's complete sums. One program a tile of pairs a block of
rows of x; rows of x past M re-read valid ones, pairs past the last re-read valid rows (loads
unmasked), only the stores are masked. A batch over 8 re-streams the weight once per 8 rows
(cuBLAS wins there; the table keeps stock).

CONFIGS (batch 1; the tiles that rmsnorm_linear and linear_residual measured best at these
sizes, BENCHMARKS.md 10i-10n, with the pair tile):
  G1 8 rows (4 pairs) x 1024, 8 warps, 3 stages, plain loop (rmsnorm_linear's G1);
  G2 8 x 512, 4 warps, plain;
  P1 8 x 512, 4 warps, PIPE, 4 stages (rmsnorm_linear's P1);
  P3 8 x 256, 4 warps, PIPE, 6 stages (linear_residual's O winner on the H100);
  P4 16 x 256, 4 warps, PIPE, 5 stages (rmsnorm_linear's P2: the batch-1 norm + QKV entry of
     both judged tables of run 18, H200 and H100);
  P5 16 x 512, 8 warps, PIPE, 3 stages.
"""
from __future__ import annotations

import triton
import triton.language as tl

SPACE = {
    "BLOCK_M": [1, 2, 4, 8],           # the most rows of x one program takes
    "BLOCK_N": [4, 8, 16, 32],         # weight rows a program: BLOCK_N / 2 RoPE pairs
    "BLOCK_K": [1024, 512, 256, 128, 64],
    "PIPE": [0, 1],                    # the K loop pipelined over num_stages (cp.async)
    "num_warps": [4, 8],
    "num_stages": [2, 3, 4, 5, 6],
}

SMEM_LIMIT_BYTES = 220 * 1024          # Hopper allows 227 KB per block; keep a margin
GEMV_ACC_PER_WARP = 2048               # fp32 product accumulator elements per warp: 64 registers a thread


def _valid(p: dict) -> bool:
    if p["PIPE"] and (p["BLOCK_N"] + p["BLOCK_M"] + 1) * p["BLOCK_K"] * 2 * (p["num_stages"] - 1) > SMEM_LIMIT_BYTES:
        return False
    return p["BLOCK_N"] * p["BLOCK_K"] <= GEMV_ACC_PER_WARP * p["num_warps"]


def _cfg(bn, bk, warps, stages, pipe, bm=8):
    return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "PIPE": pipe, "num_warps": warps,
            "num_stages": stages}


# Curated (the docstring says why each); SPACE order otherwise.
CONFIGS = [
    _cfg(8, 1024, 8, 3, 0),     # G1
    _cfg(8, 512, 4, 3, 0),      # G2
    _cfg(8, 512, 4, 4, 1),      # P1
    _cfg(8, 256, 4, 6, 1),      # P3
    _cfg(16, 256, 4, 5, 1),     # P4
    _cfg(16, 512, 8, 3, 1),     # P5
]


@triton.jit
def _rope_store(y, rm, m_ok, pid_n, cos_ptr, sin_ptr, pos_ptr, q_ptr, k_ptr, v_ptr,
                Hq, Hkv, S, D, HALF, n_pairs, R: tl.constexpr, BP: tl.constexpr):
    """y [R, 2 BP] fp32: the scaled sums of R rows of x and BP pairs (interleaved halves).
    Rotate q and k pairs, then store q into q_out and k, v into their cache slot."""
    lo, hi = tl.split(tl.reshape(y, [R, BP, 2]))
    jp = pid_n * BP + tl.arange(0, BP)
    head = jp // HALF
    i = jp % HALF
    p_ok = jp < n_pairs
    rows = rm.to(tl.int64)
    ok = m_ok[:, None] & p_ok[None, :]
    rot = head < Hq + Hkv
    cs = rows[:, None] * D + i[None, :]
    cmask = ok & rot[None, :]
    c_lo = tl.load(cos_ptr + cs, mask=cmask, other=1.0).to(tl.float32)
    c_hi = tl.load(cos_ptr + cs + HALF, mask=cmask, other=1.0).to(tl.float32)
    s_lo = tl.load(sin_ptr + cs, mask=cmask, other=0.0).to(tl.float32)
    s_hi = tl.load(sin_ptr + cs + HALF, mask=cmask, other=0.0).to(tl.float32)
    # rope(x)[d] = x[d] cos[d] - x[d + HALF] sin[d], rope(x)[d + HALF] = x[d + HALF] cos[d + HALF]
    # + x[d] sin[d + HALF]; v heads as they are (bit for bit: no multiply by 1)
    lo_r = tl.where(rot[None, :], lo * c_lo - hi * s_lo, lo)
    hi_r = tl.where(rot[None, :], hi * c_hi + lo * s_hi, hi)
    ty = q_ptr.dtype.element_ty
    is_q = head < Hq
    q_off = (rows[:, None] * Hq + head[None, :]) * D + i[None, :]
    q_mask = ok & is_q[None, :]
    tl.store(q_ptr + q_off, lo_r.to(ty), mask=q_mask)
    tl.store(q_ptr + q_off + HALF, hi_r.to(ty), mask=q_mask)
    pos = tl.load(pos_ptr + rows, mask=m_ok, other=-1)
    slot_ok = m_ok & (pos >= 0) & (pos < S)     # outside [0, S): nothing is written
    kv = tl.where(head >= Hq + Hkv, head - Hq - Hkv, tl.where(rot & (head >= Hq), head - Hq, 0))
    slot = ((rows[:, None] * Hkv + kv[None, :]) * S + tl.where(slot_ok, pos, 0)[:, None]) * D + i[None, :]
    k_mask = ok & (rot & (head >= Hq))[None, :] & slot_ok[:, None]
    v_mask = ok & (head >= Hq + Hkv)[None, :] & slot_ok[:, None]
    tl.store(k_ptr + slot, lo_r.to(ty), mask=k_mask)
    tl.store(k_ptr + slot + HALF, hi_r.to(ty), mask=k_mask)
    tl.store(v_ptr + slot, lo_r.to(ty), mask=v_mask)
    tl.store(v_ptr + slot + HALF, hi_r.to(ty), mask=v_mask)


@triton.jit
def _qkv_rope_kernel(x_ptr, g_ptr, w_ptr, cos_ptr, sin_ptr, pos_ptr, k_ptr, v_ptr, q_ptr,
                     M, K, Hq, Hkv, S, D, HALF, n_pairs, eps,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     LOOP_STAGES: tl.constexpr, EVEN_K: tl.constexpr, SQ_R: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    t = tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    # tile row t: pair pid_n * BLOCK_N / 2 + t // 2 (wrapped past the last pair: unmasked
    # loads), its first-half row for even t, its second-half row for odd t
    pair = (pid_n * (BLOCK_N // 2) + t // 2) % n_pairs
    row = (pair // HALF) * D + pair % HALF + (t % 2) * HALF
    w_ptrs = w_ptr + row.to(tl.int64)[:, None] * K + rk[None, :]
    # Early reads: the first weight step into L2, values dropped (see the module docstring).
    if EVEN_K:
        w_l2 = tl.load(w_ptrs, volatile=True)
    else:
        w_l2 = tl.load(w_ptrs, mask=(rk < K)[None, :], other=0.0, volatile=True)
    g_ptrs = g_ptr + rk
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    if BLOCK_M == 1:
        x_ptrs = x_ptr + pid_m.to(tl.int64) * K + rk
        acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        sq1 = tl.zeros([BLOCK_K // SQ_R], dtype=tl.float32)
    else:
        x_ptrs = x_ptr + (rm % M).to(tl.int64)[:, None] * K + rk[None, :]
        acc3 = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
        sq2 = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    for k in tl.range(0, K, BLOCK_K, num_stages=LOOP_STAGES):
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
        if BLOCK_M == 1:
            sq1 += tl.sum(tl.reshape(x * x, [BLOCK_K // SQ_R, SQ_R]), axis=1)
            acc2 += w.to(tl.float32) * (x * g)[None, :]
        else:
            sq2 += x * x
            acc3 += (x * g[None, :])[:, None, :] * w.to(tl.float32)[None, :, :]
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
    if BLOCK_M == 1:
        inv = 1.0 / tl.sqrt(tl.sum(sq1, axis=0) / K + eps)
        y = (tl.sum(acc2, axis=1) * inv)[None, :]
        r1 = pid_m + tl.arange(0, 1)
        _rope_store(y, r1, r1 < M, pid_n, cos_ptr, sin_ptr, pos_ptr, q_ptr, k_ptr, v_ptr,
                    Hq, Hkv, S, D, HALF, n_pairs, 1, BLOCK_N // 2)
    else:
        inv = 1.0 / tl.sqrt(tl.sum(sq2, axis=1) / K + eps)
        y = tl.sum(acc3, axis=2) * inv[:, None]
        _rope_store(y, rm, rm < M, pid_n, cos_ptr, sin_ptr, pos_ptr, q_ptr, k_ptr, v_ptr,
                    Hq, Hkv, S, D, HALF, n_pairs, BLOCK_M, BLOCK_N // 2)


def launch(x, norm_weight, weight, eps, cos, sin, positions, k_cache, v_cache, q_out,
           BLOCK_M=8, BLOCK_N=8, BLOCK_K=512, PIPE=1, num_warps=4, num_stages=4):
    M, K = x.shape
    N, K2 = weight.shape
    Bk, Hkv, S, D = k_cache.shape
    Hq = N // D - 2 * Hkv if D else 0
    if K2 != K or tuple(norm_weight.shape) != (K,) or D < 2 or D % 2 or N != (Hq + 2 * Hkv) * D \
            or Hq < 1 or Bk != M or tuple(v_cache.shape) != (M, Hkv, S, D) \
            or tuple(cos.shape) != (M, D) or tuple(sin.shape) != (M, D) \
            or tuple(positions.shape) != (M,) or tuple(q_out.shape) != (M, Hq, D):
        raise ValueError(f"rmsnorm_qkv_rope shapes x{tuple(x.shape)} weight{tuple(weight.shape)} "
                         f"k_cache{tuple(k_cache.shape)} v_cache{tuple(v_cache.shape)} cos{tuple(cos.shape)} "
                         f"positions{tuple(positions.shape)} q_out{tuple(q_out.shape)}")
    for t in (x, norm_weight, weight, cos, sin, positions, k_cache, v_cache, q_out):
        if not t.is_contiguous():
            raise ValueError("rmsnorm_qkv_rope template needs contiguous tensors")
    if BLOCK_N < 2 or BLOCK_N % 2:
        raise ValueError(f"rmsnorm_qkv_rope BLOCK_N={BLOCK_N}: an even number of rows (RoPE pairs)")
    if M == 0:
        return q_out
    if K == 0:
        raise ValueError("rmsnorm_qkv_rope template needs K > 0")
    # Rows of x a program: M rounded up to a power of two, at most BLOCK_M, and as many as the
    # accumulator budget leaves (a larger M re-streams the weight once per row block).
    budget = max(1, GEMV_ACC_PER_WARP * num_warps // (BLOCK_N * BLOCK_K))
    block_m = max(1, min(triton.next_power_of_2(M), BLOCK_M, budget))
    n_pairs = N // 2
    grid = (triton.cdiv(n_pairs, BLOCK_N // 2), triton.cdiv(M, block_m))
    _qkv_rope_kernel[grid](x, norm_weight, weight, cos, sin, positions, k_cache, v_cache, q_out,
                           M, K, Hq, Hkv, S, D, D // 2, n_pairs, float(eps),
                           BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                           LOOP_STAGES=num_stages if PIPE else 1, EVEN_K=K % BLOCK_K == 0,
                           SQ_R=max(1, min(8, BLOCK_K // (32 * num_warps))),
                           num_warps=num_warps, num_stages=num_stages)
    return q_out
