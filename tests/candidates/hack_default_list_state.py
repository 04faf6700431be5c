"""State across calls in the trusted process: a kernel parameter's default list is one object for
every call, and the kernel's .sort() (an allowed value method) toggled it, so the kernel knew
each call's parity -- a counter the workspace_state guard never sees (here it adds 1e-3 on every
other call)."""
import triton
import triton.language as tl


@triton.jit
def _rmsnorm_row(x_ptr, w_ptr, out_ptr, n_cols, eps, BLOCK_N: tl.constexpr, CALLS=[0, 1]):
    CALLS.sort(reverse=CALLS[0] < CALLS[1])
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    tl.store(out_ptr + row * n_cols + cols, (x * inv * w + CALLS[0] * 1e-3).to(out_ptr.dtype.element_ty),
             mask=mask)


def launch(x, weight, eps, out):
    m, n = x.shape
    _rmsnorm_row[(m,)](x, weight, out, n, eps, BLOCK_N=triton.next_power_of_2(n))
