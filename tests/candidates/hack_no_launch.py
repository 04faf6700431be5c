"""Guard 7 hack (dynamic): a Triton kernel is defined but never launched; torch does the work
through tensor methods the static check does not list."""
import torch
import triton
import triton.language as tl


@triton.jit
def _unused(x_ptr):
    pass


def launch(x, weight, eps, out):
    xf = x.float()
    out.copy_(xf * (xf * xf).mean(-1, keepdim=True).add(eps).rsqrt() * weight.float())
