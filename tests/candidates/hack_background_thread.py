"""Guard 11 hack: launch() hands the kernel to a worker thread and returns at once (it looks free
to a timer); the outputs are written after the call returned, racing the harness. torch.threading
is refused statically; a thread pool reached through torch.cuda.tunable is not, so the live
thread is what gives it away."""
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


def _run(x, weight, eps, out):
    m, n = x.shape
    _rmsnorm_row[(m,)](x, weight, out, n, eps, BLOCK_N=triton.next_power_of_2(n))


_POOL = []


def launch(x, weight, eps, out):
    if not _POOL:
        _POOL.append(torch.cuda.tunable.concurrent.futures.ThreadPoolExecutor(1))
    _POOL[0].submit(_run, x, weight, eps, out)
