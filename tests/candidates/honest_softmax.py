"""Honest softmax over the last dimension: one program per row, max-subtracted."""
import triton
import triton.language as tl


@triton.jit
def _softmax_row(x_ptr, out_ptr, n_cols, BLOCK_N: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=-float("inf")).to(tl.float32)
    e = tl.exp(x - tl.max(x, axis=0))
    e = tl.where(mask, e, 0.0)
    tl.store(out_ptr + row * n_cols + cols, (e / tl.sum(e, axis=0)).to(out_ptr.dtype.element_ty), mask=mask)


def launch(x, out, num_warps=4):
    m, n = x.shape
    _softmax_row[(m,)](x, out, n, BLOCK_N=triton.next_power_of_2(n), num_warps=num_warps)
