"""Fused Triton kernels that cut launches per layer in the tuned decode step.

- `rope_kv_write`: one launch per layer instead of the stock path's RoPE bmm plus two
  index_put writes into the cache (and a copy to make q contiguous): one program per
  (sequence, head) of the fused QKV output; q heads are rotated into a fresh contiguous
  [B, Hq, D] buffer, k heads are rotated and v heads copied straight into the cache at the
  sequence's position. Angles are pos * inv_freq in fp32 from device tensors (no host sync,
  graph-capturable, no per-position rotation table).
- `silu_mul`: silu(gate) * up of the fused gate/up GEMV output in one launch (stock: two).
fp32 math, rounded once on store. Under the Triton interpreter (CPU) values are upcast first:
the interpreter's bf16 arithmetic is wrong.
Triton is imported lazily (set TRITON_INTERPRET=1 before the first call on a CPU).
"""
from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=None)
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def rope_kv_kernel(qkv_ptr, pos_ptr, inv_freq_ptr, q_ptr, k_ptr, v_ptr,
                       s_xb, s_xh, s_qb, s_qh, s_kb, s_kh, s_ks, s_vb, s_vh, s_vs,
                       Hq, Hkv, HALF: tl.constexpr, BLOCK_H: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        i = tl.arange(0, BLOCK_H)
        ok = i < HALF
        src = qkv_ptr + b * s_xb + h * s_xh
        x1 = tl.load(src + i, mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF + i, mask=ok, other=0.0).to(tl.float32)
        pos = tl.load(pos_ptr + b)
        ang = pos.to(tl.float32) * tl.load(inv_freq_ptr + i, mask=ok, other=0.0)
        c = tl.cos(ang)
        s = tl.sin(ang)
        hh = h + tl.zeros([BLOCK_H], dtype=tl.int32)  # per-element: masks must be tensors
        is_q = hh < Hq
        is_k = (hh >= Hq) & (hh < Hq + Hkv)
        is_v = hh >= Hq + Hkv
        rot = hh < Hq + Hkv  # v is not rotated
        y1 = tl.where(rot, x1 * c - x2 * s, x1)
        y2 = tl.where(rot, x2 * c + x1 * s, x2)
        hk = (h - Hq).to(tl.int64)
        hv = (h - Hq - Hkv).to(tl.int64)
        q_dst = q_ptr + b * s_qb + h.to(tl.int64) * s_qh
        k_dst = k_ptr + b * s_kb + hk * s_kh + pos * s_ks
        v_dst = v_ptr + b * s_vb + hv * s_vh + pos * s_vs
        ty = q_ptr.dtype.element_ty
        tl.store(q_dst + i, y1.to(ty), mask=ok & is_q)
        tl.store(q_dst + HALF + i, y2.to(ty), mask=ok & is_q)
        tl.store(k_dst + i, y1.to(ty), mask=ok & is_k)
        tl.store(k_dst + HALF + i, y2.to(ty), mask=ok & is_k)
        tl.store(v_dst + i, y1.to(ty), mask=ok & is_v)
        tl.store(v_dst + HALF + i, y2.to(ty), mask=ok & is_v)

    @triton.jit
    def silu_mul_kernel(x_ptr, out_ptr, F, s_xm, s_om, BLOCK: tl.constexpr):
        m = tl.program_id(1).to(tl.int64)
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < F
        gate = tl.load(x_ptr + m * s_xm + offs, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + m * s_xm + F + offs, mask=ok, other=0.0).to(tl.float32)
        y = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(out_ptr + m * s_om + offs, y.to(out_ptr.dtype.element_ty), mask=ok)

    return triton, rope_kv_kernel, silu_mul_kernel


def rope_kv_write(qkv, positions, inv_freq, k_cache, v_cache, heads: int, q_out=None):
    """qkv [B, Hq+2Hkv, D] (unit stride along D), positions int64 [B], inv_freq fp32 [D/2],
    caches [B, Hkv, S_max, D]. Writes rotated k and v at each sequence's position in place.
    -> q rotated, contiguous [B, Hq, D]."""
    triton, kernel, _ = _kernels()
    b, h_all, d = qkv.shape
    hkv = k_cache.shape[1]
    if h_all != heads + 2 * hkv or d % 2 or inv_freq.shape[0] != d // 2:
        raise ValueError(f"rope_kv_write shapes qkv{tuple(qkv.shape)} heads={heads} "
                         f"k{tuple(k_cache.shape)} inv_freq{tuple(inv_freq.shape)}")
    for t in (qkv, k_cache, v_cache):
        if t.stride(-1) != 1:
            raise ValueError("rope_kv_write needs unit stride along D")
    q = q_out if q_out is not None else torch.empty(b, heads, d, device=qkv.device, dtype=qkv.dtype)
    half = d // 2
    kernel[(b, h_all)](qkv, positions, inv_freq, q, k_cache, v_cache,
                       qkv.stride(0), qkv.stride(1), q.stride(0), q.stride(1),
                       k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                       v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
                       heads, hkv, HALF=half, BLOCK_H=triton.next_power_of_2(half),
                       num_warps=1)
    return q


def silu_mul(gate_up):
    """gate_up [M, 2F] (unit stride along the last dim) -> silu(gate) * up [M, F]."""
    triton, _, kernel = _kernels()
    m, two_f = gate_up.shape
    if two_f % 2 or gate_up.stride(-1) != 1:
        raise ValueError(f"silu_mul needs [M, 2F] with unit stride, got {tuple(gate_up.shape)}")
    f = two_f // 2
    out = torch.empty(m, f, device=gate_up.device, dtype=gate_up.dtype)
    block = 1024
    kernel[(triton.cdiv(f, block), m)](gate_up, out, f, gate_up.stride(0), out.stride(0),
                                       BLOCK=block, num_warps=4)
    return out
