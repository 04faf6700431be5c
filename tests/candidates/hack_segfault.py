"""Guard 1 hack: a kernel that reads through a wild pointer (an illegal memory access; under
the interpreter the process dies with SIGSEGV)."""
import torch
import triton
import triton.language as tl


@triton.jit
def _wild(x_ptr, out_ptr, n_cols, BLOCK_N: tl.constexpr):
    cols = tl.arange(0, BLOCK_N)
    far = x_ptr + (1 << 46) + cols
    tl.store(out_ptr + cols, tl.load(far), mask=cols < n_cols)


def launch(x, weight, eps, out):
    _wild[(1,)](x, out, x.shape[1], BLOCK_N=triton.next_power_of_2(x.shape[1]))
