"""rope_kv_write template (one decode token): q_out = rope(q); the cache slot of each sequence
gets rope(k) and v, in one launch.

Grid (B, q head tiles + k head tiles + v head tiles): a program handles HEADS_PER_PROG heads of
one sequence in one of the three parts of the fused q|k|v row. Heads are loaded as their two
halves [HEADS, BLOCK_H] (BLOCK_H = D/2 padded to a power of two; contiguous along D, so the
loads vectorise to 16 bytes), so rotate_half is a swap of registers, not a gather; the cos/sin
row is read once per program. q and k: fp32 math, one rounding on store; v: copied as is (bit
exact). A position outside [0, S) writes nothing (the cache is never written out of bounds).
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


# [4 heads, 64] bf16 halves over one warp: 8 elements, 16 bytes, per thread and load (D = 128)
_DEFAULT = {"HEADS_PER_PROG": 4, "num_warps": 1}
CONFIGS = [_DEFAULT] + [p for p in (dict(zip(SPACE, v)) for v in itertools.product(*SPACE.values()))
                        if _valid(p) and p != _DEFAULT]


@triton.jit
def _rope_kv_write_kernel(qkv_ptr, cos_ptr, sin_ptr, pos_ptr, k_ptr, v_ptr, qo_ptr,
                          Hq, Hkv, S, D, HALF, tiles_q, tiles_kv,
                          HEADS: tl.constexpr, BLOCK_H: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1)
    i = tl.arange(0, BLOCK_H)
    i_ok = i < HALF
    row = qkv_ptr + b * (Hq + 2 * Hkv) * D
    if t < tiles_q + tiles_kv:   # q or k: rotated
        c1 = tl.load(cos_ptr + b * D + i, mask=i_ok, other=0.0).to(tl.float32)
        c2 = tl.load(cos_ptr + b * D + HALF + i, mask=i_ok, other=0.0).to(tl.float32)
        s1 = tl.load(sin_ptr + b * D + i, mask=i_ok, other=0.0).to(tl.float32)
        s2 = tl.load(sin_ptr + b * D + HALF + i, mask=i_ok, other=0.0).to(tl.float32)
        if t < tiles_q:
            h = t * HEADS + tl.arange(0, HEADS)
            ok = (h[:, None] < Hq) & i_ok[None, :]
            src = row + h.to(tl.int64)[:, None] * D + i[None, :]
            dst = qo_ptr + (b * Hq + h.to(tl.int64))[:, None] * D + i[None, :]
        else:
            pos = tl.load(pos_ptr + b)
            h = (t - tiles_q) * HEADS + tl.arange(0, HEADS)
            p = pos + tl.zeros([HEADS], dtype=tl.int64)   # a tensor: the interpreter's masks must be
            ok = (h[:, None] < Hkv) & ((p >= 0) & (p < S))[:, None] & i_ok[None, :]
            src = row + (Hq + h.to(tl.int64))[:, None] * D + i[None, :]
            dst = k_ptr + ((b * Hkv + h.to(tl.int64)) * S + pos)[:, None] * D + i[None, :]
        x1 = tl.load(src, mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF, mask=ok, other=0.0).to(tl.float32)
        ty = qo_ptr.dtype.element_ty
        tl.store(dst, (x1 * c1[None, :] - x2 * s1[None, :]).to(ty), mask=ok)
        tl.store(dst + HALF, (x2 * c2[None, :] + x1 * s2[None, :]).to(ty), mask=ok)
    else:                        # v: copied into the cache slot
        pos = tl.load(pos_ptr + b)
        h = (t - tiles_q - tiles_kv) * HEADS + tl.arange(0, HEADS)
        p = pos + tl.zeros([HEADS], dtype=tl.int64)
        ok = (h[:, None] < Hkv) & ((p >= 0) & (p < S))[:, None] & i_ok[None, :]
        src = row + (Hq + Hkv + h.to(tl.int64))[:, None] * D + i[None, :]
        dst = v_ptr + ((b * Hkv + h.to(tl.int64)) * S + pos)[:, None] * D + i[None, :]
        tl.store(dst, tl.load(src, mask=ok, other=0.0), mask=ok)
        tl.store(dst + HALF, tl.load(src + HALF, mask=ok, other=0.0), mask=ok)


def launch(qkv, cos, sin, positions, k_cache, v_cache, q_out, HEADS_PER_PROG=4, num_warps=1):
    B, H_all, D = qkv.shape
    Bk, Hkv, S, Dk = k_cache.shape
    Hq = H_all - 2 * Hkv
    if Bk != B or Dk != D or D % 2 or Hq < 1 or tuple(v_cache.shape) != (B, Hkv, S, D) \
            or tuple(cos.shape) != (B, D) or tuple(sin.shape) != (B, D) \
            or tuple(positions.shape) != (B,) or tuple(q_out.shape) != (B, Hq, D):
        raise ValueError(f"rope_kv_write shapes qkv{tuple(qkv.shape)} k_cache{tuple(k_cache.shape)} "
                         f"v_cache{tuple(v_cache.shape)} cos{tuple(cos.shape)} q_out{tuple(q_out.shape)}")
    for t in (qkv, cos, sin, positions, k_cache, v_cache, q_out):
        if not t.is_contiguous():
            raise ValueError("rope_kv_write template needs contiguous tensors")
    if B == 0 or D == 0:
        return q_out
    half = D // 2
    heads = min(HEADS_PER_PROG, triton.next_power_of_2(max(Hq, Hkv)))
    tiles_q = triton.cdiv(Hq, heads)
    tiles_kv = triton.cdiv(Hkv, heads)
    grid = (B, tiles_q + 2 * tiles_kv)
    _rope_kv_write_kernel[grid](qkv, cos, sin, positions, k_cache, v_cache, q_out,
                                Hq, Hkv, S, D, half, tiles_q, tiles_kv,
                                HEADS=heads, BLOCK_H=triton.next_power_of_2(half), num_warps=num_warps)
    return q_out
