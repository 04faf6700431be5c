"""Decode attention template: split-KV flash-decoding with GQA.

q [B, Hq, D] (one query token per sequence), caches [B, Hkv, S_max, D], seq_lens int32 [B]
(positions >= seq_lens[b] are masked), Hq % Hkv == 0, out [B, Hq, D].

Grid (B, Hkv, splits): each program takes the whole GQA group of Hq/Hkv query heads of one kv
head (padded to 16 rows for tl.dot), so K and V are read once per kv head, and walks one chunk
of the sequence in BLOCK_S steps with an online softmax. NUM_SPLITS chunks per sequence give
the chip enough programs when B x Hkv is small. Partial (max, sum, acc) go to fp32
workspaces; a second kernel combines the splits in a fixed order (deterministic, no atomics).
fp32 softmax math in base 2 (scale pre-multiplied by log2 e).
"""
from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

SPACE = {
    "BLOCK_S": [16, 32, 64, 128],
    "NUM_SPLITS": [1, 4, 8, 16, 32, 64],
    "num_warps": [2, 4, 8],
    "num_stages": [1, 2, 3],
}


def _valid(p: dict) -> bool:
    return not (p["BLOCK_S"] == 128 and p["num_warps"] == 2)


CONFIGS = [p for p in (dict(zip(SPACE, v)) for v in itertools.product(*SPACE.values())) if _valid(p)]


@triton.jit(do_not_specialize=["chunk"])
def _split_kernel(q_ptr, k_ptr, v_ptr, lens_ptr, m_ws, l_ws, acc_ws,
                  s_qb, s_qh, s_kb, s_kh, s_ks, s_vb, s_vh, s_vs,
                  Hq, G, D, chunk, splits, qk_scale,
                  BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
                  UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    hkv = tl.program_id(1).to(tl.int64)
    sp = tl.program_id(2)
    seq_len = tl.load(lens_ptr + b)
    lo = sp * chunk
    hi = min(lo + chunk, seq_len)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    g_ok = g < G
    d_ok = d < D
    heads = hkv * G + g
    q = tl.load(q_ptr + b * s_qb + heads[:, None] * s_qh + d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    k_base = k_ptr + b * s_kb + hkv * s_kh
    v_base = v_ptr + b * s_vb + hkv * s_vh
    m_i = tl.full([BLOCK_G], -float("inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_S):
        s = start + tl.arange(0, BLOCK_S)
        s_ok = s < hi
        kv_mask = s_ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + s[:, None] * s_ks + d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        qk = tl.where(s_ok[None, :], qk, -float("inf"))
        # Every chunk holds at least one valid position, so m_new is finite.
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_base + s[:, None] * s_vs + d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    row = (b * Hq + heads) * splits + sp
    tl.store(m_ws + row, m_i, mask=g_ok)
    tl.store(l_ws + row, l_i, mask=g_ok)
    tl.store(acc_ws + row[:, None] * D + d[None, :], acc, mask=g_ok[:, None] & d_ok[None, :])


@triton.jit
def _combine_kernel(m_ws, l_ws, acc_ws, out_ptr, Hq, D, splits, s_ob, s_oh,
                    BLOCK_SPLITS: tl.constexpr, BLOCK_D: tl.constexpr):
    bh = tl.program_id(0).to(tl.int64)
    b = bh // Hq
    h = bh % Hq
    sp = tl.arange(0, BLOCK_SPLITS)
    d = tl.arange(0, BLOCK_D)
    sp_ok = sp < splits
    rows = bh * splits + sp
    m = tl.load(m_ws + rows, mask=sp_ok, other=-float("inf"))
    l = tl.load(l_ws + rows, mask=sp_ok, other=0.0)
    acc = tl.load(acc_ws + rows[:, None] * D + d[None, :], mask=sp_ok[:, None] & (d[None, :] < D), other=0.0)
    m_max = tl.max(m, axis=0)
    # Empty splits carry m = -inf and weigh nothing; an empty sequence would give m_max = -inf.
    w = tl.where(m == -float("inf"), 0.0, tl.exp2(m - m_max))
    denom = tl.sum(w * l, axis=0)
    num = tl.sum(w[:, None] * acc, axis=0)
    o = tl.where(denom > 0, num / denom, 0.0)
    tl.store(out_ptr + b * s_ob + h * s_oh + d, o.to(out_ptr.dtype.element_ty), mask=d < D)


def launch(q, k_cache, v_cache, seq_lens, scale, out, BLOCK_S=64, NUM_SPLITS=8, num_warps=4,
           num_stages=2):
    B, Hq, D = q.shape
    Bk, Hkv, S_max, Dk = k_cache.shape
    if Bk != B or Dk != D or tuple(v_cache.shape) != tuple(k_cache.shape) or Hq % Hkv:
        raise ValueError(f"decode_attention shapes q{tuple(q.shape)} k{tuple(k_cache.shape)} "
                         f"v{tuple(v_cache.shape)}")
    for t in (q, k_cache, v_cache, out):
        if t.stride(-1) != 1:
            raise ValueError("decode_attention template needs unit stride along D")
    if B == 0 or S_max == 0:
        return out
    G = Hq // Hkv
    block_g = max(16, triton.next_power_of_2(G))  # tl.dot needs at least 16 rows
    block_d = max(16, triton.next_power_of_2(D))
    chunk = triton.cdiv(triton.cdiv(S_max, NUM_SPLITS), BLOCK_S) * BLOCK_S
    splits = triton.cdiv(S_max, chunk)
    upcast = q.device.type != "cuda"  # the interpreter's bf16 arithmetic is wrong
    precision = "ieee" if q.dtype == torch.float32 or upcast else "tf32"
    m_ws = torch.empty((B, Hq, splits), device=q.device, dtype=torch.float32)
    l_ws = torch.empty((B, Hq, splits), device=q.device, dtype=torch.float32)
    acc_ws = torch.empty((B, Hq, splits, D), device=q.device, dtype=torch.float32)
    _split_kernel[(B, Hkv, splits)](
        q, k_cache, v_cache, seq_lens, m_ws, l_ws, acc_ws,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        Hq, G, D, chunk, splits, float(scale) * 1.4426950408889634,
        BLOCK_G=block_g, BLOCK_S=BLOCK_S, BLOCK_D=block_d, UPCAST=upcast, DOT_PRECISION=precision,
        num_warps=num_warps, num_stages=num_stages)
    _combine_kernel[(B * Hq,)](m_ws, l_ws, acc_ws, out, Hq, D, splits, out.stride(0), out.stride(1),
                               BLOCK_SPLITS=max(2, triton.next_power_of_2(splits)), BLOCK_D=block_d,
                               num_warps=4)
    return out
