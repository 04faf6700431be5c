"""Guard 10 hack: adds relative noise of ~2e-5 (under the fp32 tolerance) with a fresh seed per
call, as a racy kernel would."""
import torch
import triton
import triton.language as tl


@triton.jit
def _noisy_rmsnorm(x_ptr, w_ptr, out_ptr, n_cols, eps, seed, BLOCK_N: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    noise = 1.0 + 4e-5 * (tl.rand(seed, row * n_cols + cols) - 0.5)
    tl.store(out_ptr + row * n_cols + cols, (x * inv * w * noise).to(out_ptr.dtype.element_ty), mask=mask)


_calls = 0


def launch(x, weight, eps, out):
    global _calls
    _calls += 1
    m, n = x.shape
    _noisy_rmsnorm[(m,)](x, weight, out, n, eps, _calls, BLOCK_N=triton.next_power_of_2(n))
