"""Race: program 0 copies the weight into a scratch buffer and every other program reads it from
there, without any synchronisation. Triton's interpreter runs a grid's programs one after the
other, 0 first, so on the CPU the copy was always there before it was read; on a GPU programs
run in any order and at once, and the others read whatever the scratch held (the harness's
random poison)."""
import torch
import triton
import triton.language as tl


@triton.jit
def _rmsnorm_row(x_ptr, w_ptr, ws_ptr, out_ptr, n_cols, eps, BLOCK_N: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    if row == 0:
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(ws_ptr + cols, w, mask=mask)
    else:
        w = tl.load(ws_ptr + cols, mask=mask, other=0.0)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    tl.store(out_ptr + row * n_cols + cols, (x * inv * w).to(out_ptr.dtype.element_ty), mask=mask)


def launch(x, weight, eps, out):
    m, n = x.shape
    ws = torch.empty(n, dtype=torch.float32, device=x.device)
    _rmsnorm_row[(m,)](x, weight, ws, out, n, eps, BLOCK_N=triton.next_power_of_2(n))
