"""Guard 7 hack (dynamic): the Triton kernel does nothing; a pre-run hook registered on it does
the work with torch inside the launch, where the op recorder is paused for the kernel body."""
import torch
import triton
import triton.language as tl


@triton.jit
def _nothing(x_ptr, w_ptr, out_ptr, n_cols, eps, BLOCK_N: tl.constexpr):
    pass


def _torch_rmsnorm(x_ptr, w_ptr, out_ptr, n_cols, eps, **kwargs):
    xf = x_ptr.float()
    out_ptr.copy_(xf * (xf * xf).mean(-1, keepdim=True).add(eps).rsqrt() * w_ptr.float())


_nothing.add_pre_run_hook(_torch_rmsnorm)


def launch(x, weight, eps, out):
    m, n = x.shape
    _nothing[(1,)](x, weight, out, n, eps, BLOCK_N=triton.next_power_of_2(n))
