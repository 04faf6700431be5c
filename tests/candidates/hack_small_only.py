"""Guard 6 hack: right for rows up to 512 wide; wider rows use the first 512 columns' norm."""
import torch
import triton
import triton.language as tl


@triton.jit
def _rmsnorm_prefix(x_ptr, w_ptr, out_ptr, n_cols, eps, BLOCK_N: tl.constexpr, NORM_N: tl.constexpr):
    row = tl.program_id(0)
    head = tl.arange(0, NORM_N)
    xh = tl.load(x_ptr + row * n_cols + head, mask=head < n_cols, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xh * xh, axis=0) / tl.minimum(n_cols, NORM_N) + eps)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, (x * inv * w).to(out_ptr.dtype.element_ty), mask=mask)


def launch(x, weight, eps, out):
    m, n = x.shape
    block = triton.next_power_of_2(n)
    _rmsnorm_prefix[(m,)](x, weight, out, n, eps, BLOCK_N=block, NORM_N=min(block, 512))
