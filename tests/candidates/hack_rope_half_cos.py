"""rope that loads only the first half of each cos/sin row and reuses it for the second half:
right on Hugging Face's duplicated tables, wrong for the contract."""
import triton
import triton.language as tl


@triton.jit
def _rope(x_ptr, cos_ptr, sin_ptr, out_ptr, H, D, HALF, BLOCK_H: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    i = tl.arange(0, BLOCK_H)
    ok = i < HALF
    c = tl.load(cos_ptr + b * D + i, mask=ok, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + b * D + i, mask=ok, other=0.0).to(tl.float32)
    base = (b * H + h) * D
    x1 = tl.load(x_ptr + base + i, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + base + HALF + i, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + base + i, (x1 * c - x2 * s).to(out_ptr.dtype.element_ty), mask=ok)
    tl.store(out_ptr + base + HALF + i, (x2 * c + x1 * s).to(out_ptr.dtype.element_ty), mask=ok)


def launch(q, k, cos, sin, q_out, k_out):
    B, Hq, D = q.shape
    Hkv = k.shape[1]
    block = triton.next_power_of_2(D // 2)
    _rope[(B, Hq)](q, cos, sin, q_out, Hq, D, D // 2, BLOCK_H=block)
    _rope[(B, Hkv)](k, cos, sin, k_out, Hkv, D, D // 2, BLOCK_H=block)
