"""Guard 7 hack (static): cuBLAS in disguise."""
import torch
import triton
import triton.language as tl


@triton.jit
def _unused(x_ptr):
    pass


def launch(a, b, out):
    torch.matmul(a, b, out=out)
