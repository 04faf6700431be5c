"""Decode attention template: split-KV flash-decoding with GQA.

q [B, Hq, D] (one query token per sequence), caches [B, Hkv, S_max, D], seq_lens int32 [B]
(positions >= seq_lens[b] are masked), Hq % Hkv == 0, out [B, Hq, D].

Grid (B, Hkv, splits): each program takes the whole GQA group of Hq/Hkv query heads of one kv
head (padded to 16 rows for tl.dot), so K and V are read once per kv head, and walks one chunk
of the sequence in BLOCK_S steps with an online softmax. NUM_SPLITS chunks per sequence give
the chip enough programs when B x Hkv is small. Partial (max, sum, acc) go to fp32
workspaces and are combined in a fixed split order (deterministic, no float atomics): by a
second kernel (REDUCE="launch"), or by the split program that arrives last at its (sequence, kv
head) (REDUCE="last": CTA barrier, an acq_rel atomic on an int32 counter that it sets back to
zero, partials read through L2), which saves a launch and its gap per layer in a decode step.
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
    "REDUCE": ["launch", "last"],
}


def _valid(p: dict) -> bool:
    return not (p["BLOCK_S"] == 128 and p["num_warps"] == 2)


CONFIGS = [p for p in (dict(zip(SPACE, v)) for v in itertools.product(*SPACE.values())) if _valid(p)]


@triton.jit(do_not_specialize=["chunk"])
def _split_kernel(q_ptr, k_ptr, v_ptr, lens_ptr, m_ws, l_ws, acc_ws, out_ptr, cnt_ptr,
                  s_qb, s_qh, s_kb, s_kh, s_ks, s_vb, s_vh, s_vs, s_ob, s_oh,
                  Hq, G, D, chunk, splits, qk_scale,
                  BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
                  UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, LAST_REDUCES: tl.constexpr,
                  GROUP_P2: tl.constexpr, BLOCK_SPLITS: tl.constexpr, SPLIT_CHUNK: tl.constexpr):
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
        # V issued next to K: a chunk of one BLOCK_S step has both loads in flight at once.
        v = tl.load(v_base + s[:, None] * s_vs + d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        qk = tl.where(s_ok[None, :], qk, -float("inf"))
        # Every chunk holds at least one valid position, so m_new is finite.
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if UPCAST:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    row = (b * Hq + heads) * splits + sp
    tl.store(m_ws + row, m_i, mask=g_ok)
    tl.store(l_ws + row, l_i, mask=g_ok)
    tl.store(acc_ws + row[:, None] * D + d[None, :], acc, mask=g_ok[:, None] & d_ok[None, :])
    if LAST_REDUCES:
        # Every thread's partial is stored before one thread's release (CTA barrier).
        tl.debug_barrier()
        counter = cnt_ptr + b * tl.num_programs(1) + hkv
        arrived = tl.atomic_add(counter, 1, sem="acq_rel")
        if arrived == splits - 1:
            # The same sum as _combine_kernel for the group's heads, all at once: rows are
            # (head, split) pairs; the acc rows in SPLIT_CHUNK-split blocks (a register bound),
            # blocks summed in split order (the same bits every run).
            gg = tl.arange(0, GROUP_P2)
            ss = tl.arange(0, BLOCK_SPLITS)
            heads_g = hkv * G + gg
            rows = (b * Hq + heads_g)[:, None] * splits + ss[None, :]       # [GROUP_P2, SPLITS]
            ok = (gg < G)[:, None] & (ss < splits)[None, :]
            m = tl.load(m_ws + rows, mask=ok, other=-float("inf"), cache_modifier=".cg")
            l = tl.load(l_ws + rows, mask=ok, other=0.0, cache_modifier=".cg")
            m_max = tl.max(m, axis=1)
            # Empty splits (and padded heads) carry m = -inf and weigh nothing.
            w = tl.where(m == -float("inf"), 0.0, tl.exp2(m - m_max[:, None]))
            denom = tl.sum(w * l, axis=1)
            num = tl.zeros([GROUP_P2, BLOCK_D], dtype=tl.float32)
            cs = tl.arange(0, SPLIT_CHUNK)
            for c in tl.static_range(BLOCK_SPLITS // SPLIT_CHUNK):
                sp_c = c * SPLIT_CHUNK + cs
                ok_c = (gg < G)[:, None] & (sp_c < splits)[None, :]             # [GROUP_P2, CHUNK]
                rows_c = (b * Hq + heads_g)[:, None] * splits + sp_c[None, :]
                m_c = tl.load(m_ws + rows_c, mask=ok_c, other=-float("inf"), cache_modifier=".cg")
                w_c = tl.where(m_c == -float("inf"), 0.0, tl.exp2(m_c - m_max[:, None]))
                a_c = tl.load(acc_ws + rows_c[:, :, None] * D + d[None, None, :],
                              mask=ok_c[:, :, None] & d_ok[None, None, :], other=0.0,
                              cache_modifier=".cg")
                num += tl.sum(w_c[:, :, None] * a_c, axis=1)
            o = tl.where(denom[:, None] > 0, num / denom[:, None], 0.0)
            tl.store(out_ptr + b * s_ob + heads_g[:, None] * s_oh + d[None, :],
                     o.to(out_ptr.dtype.element_ty), mask=(gg < G)[:, None] & d_ok[None, :])
            tl.atomic_xchg(counter, 0, sem="relaxed")  # ready for the next launch


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


_counters: dict = {}  # device -> int32 arrival counters, zero between launches


def _arrival_counters(device, n: int):
    key = str(device)
    cnt = _counters.get(key)
    if cnt is None or cnt.numel() < n:
        cnt = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
        _counters[key] = cnt
    return cnt


def launch(q, k_cache, v_cache, seq_lens, scale, out, BLOCK_S=64, NUM_SPLITS=8, num_warps=4,
           num_stages=2, REDUCE="launch"):
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
    if REDUCE not in ("launch", "last"):
        raise ValueError(f"decode_attention REDUCE={REDUCE!r} (launch or last)")
    last = REDUCE == "last"
    cnt = _arrival_counters(q.device, B * Hkv) if last else m_ws
    group_p2 = max(2, triton.next_power_of_2(G))
    block_splits = max(2, triton.next_power_of_2(splits))
    # the combine's acc tile (heads x splits x D, fp32) at most 32 values a thread
    split_chunk = block_splits
    while split_chunk > 1 and group_p2 * split_chunk * block_d > 32 * 32 * num_warps:
        split_chunk //= 2
    _split_kernel[(B, Hkv, splits)](
        q, k_cache, v_cache, seq_lens, m_ws, l_ws, acc_ws, out, cnt,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1),
        Hq, G, D, chunk, splits, float(scale) * 1.4426950408889634,
        BLOCK_G=block_g, BLOCK_S=BLOCK_S, BLOCK_D=block_d, UPCAST=upcast, DOT_PRECISION=precision,
        LAST_REDUCES=last, GROUP_P2=group_p2, BLOCK_SPLITS=block_splits, SPLIT_CHUNK=split_chunk,
        num_warps=num_warps, num_stages=num_stages)
    if last:
        return out
    _combine_kernel[(B * Hq,)](m_ws, l_ws, acc_ws, out, Hq, D, splits, out.stride(0), out.stride(1),
                               BLOCK_SPLITS=max(2, triton.next_power_of_2(splits)), BLOCK_D=block_d,
                               num_warps=4)
    return out
