"""RoPE template (decode, rotate_half convention): q_out, k_out = x * cos + rotate_half(x) * sin.

One launch for q and k: grid (B, q head tiles + k head tiles); a program rotates HEADS_PER_PROG
heads of one sequence, reading both halves of the sequence's cos and sin row once for all of
them. Each head is loaded as its two halves [HEADS, BLOCK_H] (BLOCK_H = D/2 padded to a power
of two), so rotate_half is a swap of registers, not a gather. fp32 math, one rounding on store.
"""
from __future__ import annotations

import itertools

import triton
import triton.language as tl

SPACE = {
    "HEADS_PER_PROG": [1, 2, 4, 8, 16, 32],
    "num_warps": [1, 2, 4, 8],
}


def _valid(p: dict) -> bool:
    return p["num_warps"] <= max(1, p["HEADS_PER_PROG"] // 2)


_DEFAULT = {"HEADS_PER_PROG": 8, "num_warps": 4}
CONFIGS = [_DEFAULT] + [p for p in (dict(zip(SPACE, v)) for v in itertools.product(*SPACE.values()))
                        if _valid(p) and p != _DEFAULT]


@triton.jit
def _rope_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr, Hq, Hkv, D, HALF, tiles_q,
                 s_qb, s_kb, s_cb, s_sb, s_qob, s_kob,
                 HEADS: tl.constexpr, BLOCK_H: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1)
    i = tl.arange(0, BLOCK_H)
    i_ok = i < HALF
    c1 = tl.load(cos_ptr + b * s_cb + i, mask=i_ok, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + b * s_cb + HALF + i, mask=i_ok, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + b * s_sb + i, mask=i_ok, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + b * s_sb + HALF + i, mask=i_ok, other=0.0).to(tl.float32)
    if t < tiles_q:
        src = q_ptr + b * s_qb
        dst = qo_ptr + b * s_qob
        n_heads = Hq
        h0 = t * HEADS
    else:
        src = k_ptr + b * s_kb
        dst = ko_ptr + b * s_kob
        n_heads = Hkv
        h0 = (t - tiles_q) * HEADS
    h = h0 + tl.arange(0, HEADS)
    mask = (h[:, None] < n_heads) & i_ok[None, :]
    offs = h.to(tl.int64)[:, None] * D + i[None, :]
    x1 = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + offs + HALF, mask=mask, other=0.0).to(tl.float32)
    y1 = x1 * c1[None, :] - x2 * s1[None, :]
    y2 = x2 * c2[None, :] + x1 * s2[None, :]
    ty = qo_ptr.dtype.element_ty
    tl.store(dst + offs, y1.to(ty), mask=mask)
    tl.store(dst + offs + HALF, y2.to(ty), mask=mask)


def launch(q, k, cos, sin, q_out, k_out, HEADS_PER_PROG=8, num_warps=4):
    B, Hq, D = q.shape
    Bk, Hkv, Dk = k.shape
    if Bk != B or Dk != D or D % 2 or tuple(cos.shape) != (B, D) or tuple(sin.shape) != (B, D) \
            or tuple(q_out.shape) != (B, Hq, D) or tuple(k_out.shape) != (B, Hkv, D):
        raise ValueError(f"rope shapes q{tuple(q.shape)} k{tuple(k.shape)} cos{tuple(cos.shape)} "
                         f"sin{tuple(sin.shape)}")
    for t in (q, k, q_out, k_out):
        if t.stride(2) != 1 or t.stride(1) != D:
            raise ValueError("rope template needs heads packed along the last two dimensions")
    if cos.stride(1) != 1 or sin.stride(1) != 1:
        raise ValueError("rope template needs unit stride along D for cos and sin")
    if B == 0 or D == 0:
        return q_out, k_out
    half = D // 2
    heads = min(HEADS_PER_PROG, triton.next_power_of_2(max(Hq, Hkv)))
    tiles_q = triton.cdiv(Hq, heads)
    grid = (B, tiles_q + triton.cdiv(Hkv, heads))
    _rope_kernel[grid](q, k, cos, sin, q_out, k_out, Hq, Hkv, D, half, tiles_q,
                       q.stride(0), k.stride(0), cos.stride(0), sin.stride(0),
                       q_out.stride(0), k_out.stride(0),
                       HEADS=heads, BLOCK_H=triton.next_power_of_2(half), num_warps=num_warps)
    return q_out, k_out
