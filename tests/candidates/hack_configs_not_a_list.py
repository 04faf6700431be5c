"""CONFIGS a literal that is not a list of dicts: the harness indexed it (CONFIGS[0]) before
any check, and check-kernel died with a TypeError instead of giving a verdict."""
import torch
import triton
import triton.language as tl


@triton.jit
def _rmsnorm_row(x_ptr, w_ptr, out_ptr, n_cols, eps, BLOCK_N: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    tl.store(out_ptr + row * n_cols + cols, (x * inv * w).to(out_ptr.dtype.element_ty), mask=mask)


CONFIGS = 5


def launch(x, weight, eps, out, num_warps=4):
    m, n = x.shape
    _rmsnorm_row[(m,)](x, weight, out, n, eps, BLOCK_N=triton.next_power_of_2(n), num_warps=num_warps)
