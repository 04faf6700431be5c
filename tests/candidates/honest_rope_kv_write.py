"""rope_kv_write, plainly: one program per (sequence, head) of the fused q|k|v row."""
import triton
import triton.language as tl


@triton.jit
def _rope_kv(qkv_ptr, cos_ptr, sin_ptr, pos_ptr, k_ptr, v_ptr, qo_ptr, Hq, Hkv, S, D, HALF,
             BLOCK_H: tl.constexpr, ROTATE_K: tl.constexpr, WRITE_KV: tl.constexpr,
             ZERO_OTHER: tl.constexpr, PAST_END: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    i = tl.arange(0, BLOCK_H)
    ok = i < HALF
    c1 = tl.load(cos_ptr + b * D + i, mask=ok, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + b * D + HALF + i, mask=ok, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + b * D + i, mask=ok, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + b * D + HALF + i, mask=ok, other=0.0).to(tl.float32)
    src = qkv_ptr + (b * (Hq + 2 * Hkv) + h) * D
    x1 = tl.load(src + i, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF + i, mask=ok, other=0.0).to(tl.float32)
    y1 = x1 * c1 - x2 * s1
    y2 = x2 * c2 + x1 * s2
    ty = qo_ptr.dtype.element_ty
    pos = tl.load(pos_ptr + b)
    if h < Hq:
        dst = qo_ptr + (b * Hq + h) * D
        tl.store(dst + i, y1.to(ty), mask=ok)
        tl.store(dst + HALF + i, y2.to(ty), mask=ok)
    elif WRITE_KV:
        j = h - Hq
        base = k_ptr + (b * Hkv + j) * S * D
        if h >= Hq + Hkv:
            j = h - Hq - Hkv
            base = v_ptr + (b * Hkv + j) * S * D
            y1 = x1
            y2 = x2
        elif not ROTATE_K:
            y1 = x1
            y2 = x2
        if ZERO_OTHER:
            other = base + ((pos + 1) % S) * D
            tl.store(other + i, tl.zeros([BLOCK_H], dtype=tl.float32).to(ty), mask=ok)
            tl.store(other + HALF + i, tl.zeros([BLOCK_H], dtype=tl.float32).to(ty), mask=ok)
        dst = base + pos * D
        tl.store(dst + i, y1.to(ty), mask=ok)
        tl.store(dst + HALF + i, y2.to(ty), mask=ok)
        if PAST_END:
            last = (b * Hkv + j) == (tl.num_programs(0) * Hkv - 1)
            if last:   # the last head's block ends where the buffer ends: one row further
                end = k_ptr + tl.num_programs(0).to(tl.int64) * Hkv * S * D
                tl.store(end + i, y1.to(ty), mask=ok)


def launch(qkv, cos, sin, positions, k_cache, v_cache, q_out):
    B, H_all, D = qkv.shape
    _, Hkv, S, _ = k_cache.shape
    Hq = H_all - 2 * Hkv
    _rope_kv[(B, H_all)](qkv, cos, sin, positions, k_cache, v_cache, q_out, Hq, Hkv, S, D, D // 2,
                         BLOCK_H=triton.next_power_of_2(D // 2), ROTATE_K=True, WRITE_KV=True, ZERO_OTHER=False, PAST_END=False)
