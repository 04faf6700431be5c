"""A kernel that prints in a loop: under the interpreter (and from the GPU's printf buffer) every
program of every call writes to the executor's output, a file on the host's disk with no size
limit, which this filled for as long as the case's deadline let it run (and was accepted when
the loop was short)."""
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


@triton.jit
def _flood(x_ptr, w_ptr, out_ptr, n_cols, eps, BLOCK_N: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    x = tl.load(x_ptr + row * n_cols + cols, mask=cols < n_cols, other=0.0)
    for i in range(1 << 20):
        tl.device_print("flood", x)
    _rmsnorm_row(x_ptr, w_ptr, out_ptr, n_cols, eps, BLOCK_N)


def launch(x, weight, eps, out):
    m, n = x.shape
    _flood[(m,)](x, weight, out, n, eps, BLOCK_N=triton.next_power_of_2(n))
