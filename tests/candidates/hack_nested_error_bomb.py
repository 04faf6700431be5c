"""Memory bomb in the trusted executor: Triton's interpreter wraps an exception raised in a nested
@triton.jit call as InterpreterError(repr(e)) at every level, and repr doubles the backslashes
escaping the quotes of the level below: the message of a failure at the bottom of a chain of
N calls is 2^N bytes long. At 48 levels the executor allocated what memory the host had
(a MemoryError, or the host's OOM killer) long before any deadline."""
import triton
import triton.language as tl


@triton.jit
def _h0(x):
    return tl.load(x)  # x is a float: the load fails, at the bottom


@triton.jit
def _h1(x):
    return _h0(x)


@triton.jit
def _h2(x):
    return _h1(x)


@triton.jit
def _h3(x):
    return _h2(x)


@triton.jit
def _h4(x):
    return _h3(x)


@triton.jit
def _h5(x):
    return _h4(x)


@triton.jit
def _h6(x):
    return _h5(x)


@triton.jit
def _h7(x):
    return _h6(x)


@triton.jit
def _h8(x):
    return _h7(x)


@triton.jit
def _h9(x):
    return _h8(x)


@triton.jit
def _h10(x):
    return _h9(x)


@triton.jit
def _h11(x):
    return _h10(x)


@triton.jit
def _h12(x):
    return _h11(x)


@triton.jit
def _h13(x):
    return _h12(x)


@triton.jit
def _h14(x):
    return _h13(x)


@triton.jit
def _h15(x):
    return _h14(x)


@triton.jit
def _h16(x):
    return _h15(x)


@triton.jit
def _h17(x):
    return _h16(x)


@triton.jit
def _h18(x):
    return _h17(x)


@triton.jit
def _h19(x):
    return _h18(x)


@triton.jit
def _h20(x):
    return _h19(x)


@triton.jit
def _h21(x):
    return _h20(x)


@triton.jit
def _h22(x):
    return _h21(x)


@triton.jit
def _h23(x):
    return _h22(x)


@triton.jit
def _h24(x):
    return _h23(x)


@triton.jit
def _h25(x):
    return _h24(x)


@triton.jit
def _h26(x):
    return _h25(x)


@triton.jit
def _h27(x):
    return _h26(x)


@triton.jit
def _h28(x):
    return _h27(x)


@triton.jit
def _h29(x):
    return _h28(x)


@triton.jit
def _h30(x):
    return _h29(x)


@triton.jit
def _h31(x):
    return _h30(x)


@triton.jit
def _h32(x):
    return _h31(x)


@triton.jit
def _h33(x):
    return _h32(x)


@triton.jit
def _h34(x):
    return _h33(x)


@triton.jit
def _h35(x):
    return _h34(x)


@triton.jit
def _h36(x):
    return _h35(x)


@triton.jit
def _h37(x):
    return _h36(x)


@triton.jit
def _h38(x):
    return _h37(x)


@triton.jit
def _h39(x):
    return _h38(x)


@triton.jit
def _h40(x):
    return _h39(x)


@triton.jit
def _h41(x):
    return _h40(x)


@triton.jit
def _h42(x):
    return _h41(x)


@triton.jit
def _h43(x):
    return _h42(x)


@triton.jit
def _h44(x):
    return _h43(x)


@triton.jit
def _h45(x):
    return _h44(x)


@triton.jit
def _h46(x):
    return _h45(x)


@triton.jit
def _h47(x):
    return _h46(x)


@triton.jit
def _rmsnorm_row(x_ptr, w_ptr, out_ptr, n_cols, eps, BLOCK_N: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, _h47(x), mask=mask)


def launch(x, weight, eps, out):
    m, n = x.shape
    _rmsnorm_row[(m,)](x, weight, out, n, eps, BLOCK_N=triton.next_power_of_2(n))
