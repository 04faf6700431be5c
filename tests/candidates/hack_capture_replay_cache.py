"""Guard 8/9 hack (GPU): honest when called eagerly (every check trial); while a CUDA graph is
being captured it records only a copy of the output saved by its last eager call on the same
buffers. Timed replays then cost one copy, and are right as long as the timer feeds the graph
the inputs it was warmed up and captured on."""
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


@triton.jit
def _copy(src, dst, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst + offs, tl.load(src + offs, mask=offs < n), mask=offs < n)


_SAVED = {}  # (x, out) buffer addresses -> output of the last eager call on them


def launch(x, weight, eps, out):
    n_all = out.numel()
    key = (x.data_ptr(), out.data_ptr())
    if torch.cuda.is_current_stream_capturing() and key in _SAVED:
        _copy[(triton.cdiv(n_all, 1024),)](_SAVED[key], out, n_all, BLOCK=1024)
        return
    m, n = x.shape
    _rmsnorm_row[(m,)](x, weight, out, n, eps, BLOCK_N=triton.next_power_of_2(n))
    if key not in _SAVED:
        _SAVED[key] = torch.empty_like(out)
    _copy[(triton.cdiv(n_all, 1024),)](out, _SAVED[key], n_all, BLOCK=1024)
