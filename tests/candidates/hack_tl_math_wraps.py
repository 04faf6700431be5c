"""tl.math re-exports functools.wraps (and typing.List): names the kernel allowlist took from
dir(tl.math) as Triton's, though calling them in a kernel runs stdlib Python in the trusted
process -- wraps(obj, assigned=(...)) gets and sets attributes named by strings."""
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
def _wraps(x_ptr, w_ptr, out_ptr, n_cols, eps, BLOCK_N: tl.constexpr):
    setter = tl.math.wraps(tl, ("load",), ())
    _rmsnorm_row(x_ptr, w_ptr, out_ptr, n_cols, eps, BLOCK_N)


def launch(x, weight, eps, out):
    m, n = x.shape
    _wraps[(m,)](x, weight, out, n, eps, BLOCK_N=triton.next_power_of_2(n))
