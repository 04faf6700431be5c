"""Softmax over the last dimension of x [M, N].

BLOCK_N=0 keeps the whole (padded) row in registers: one read, one write. A positive BLOCK_N
is the online form for long rows: the first pass keeps a running max and a rescaled running
sum chunk by chunk, the second pass re-reads each chunk (mostly from L1/L2) and writes
exp(x - max) / sum. ROWS_PER_PROG rows share a program so that short rows keep enough bytes in
flight; PROGRAMS_PER_SM>0 makes the grid persistent. fp32 math, exp2 with a log2(e) prescale.
"""
from __future__ import annotations

import functools
import itertools

import torch
import triton
import triton.language as tl

SPACE = {
    "ROWS_PER_PROG": [1, 2, 4, 8],
    "BLOCK_N": [0, 1024, 4096],        # 0: whole row, padded to a power of two
    "PROGRAMS_PER_SM": [0, 4],         # 0: one program per row tile (not persistent)
    "num_warps": [4, 8, 16],
}

MAX_TILE_ELEMS = 32768  # launch() clamps the rows per program (and chunks wider rows) to this


def _valid(p: dict) -> bool:
    if p["BLOCK_N"] and p["ROWS_PER_PROG"] * p["BLOCK_N"] < p["num_warps"] * 32 * 8:
        return False
    return p["BLOCK_N"] == 0 or p["ROWS_PER_PROG"] * p["BLOCK_N"] <= MAX_TILE_ELEMS


CONFIGS = [p for p in (dict(zip(SPACE, v)) for v in itertools.product(*SPACE.values())) if _valid(p)]

@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def _vec_width(elem_size: int, *ints: int) -> int:
    """Largest power of two (up to one 16-byte vector) dividing every int. Passed as a
    constexpr so that Triton can prove row starts and the column mask are vector-aligned
    (it specializes ints only for divisibility by 16: N=3000 would otherwise load 2 bytes
    at a time)."""
    v = max(1, 16 // elem_size)
    while v > 1 and any(i % v for i in ints):
        v //= 2
    return v


@triton.jit(do_not_specialize=["M", "num_tiles"])
def _softmax_kernel(x_ptr, out_ptr, M, n_v, sx_v, so_v, num_tiles,
                    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, ONE_PASS: tl.constexpr,
                    VEC: tl.constexpr):
    N = n_v * VEC
    stride_xm = sx_v * VEC
    stride_om = so_v * VEC
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    row_ids = tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    for tile in range(pid, num_tiles, nprog):
        rows = tile * ROWS + row_ids
        row_ok = rows < M
        x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
        o_rows = out_ptr + rows.to(tl.int64)[:, None] * stride_om
        if ONE_PASS:
            mask = row_ok[:, None] & (cols[None, :] < N)
            x = tl.load(x_rows + cols[None, :], mask=mask, other=-float("inf")).to(tl.float32)
            m = tl.max(x, axis=1)
            e = tl.exp2((x - m[:, None]) * 1.4426950408889634)
            y = e / tl.sum(e, axis=1)[:, None]
            tl.store(o_rows + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            m = tl.full([ROWS], -float("inf"), dtype=tl.float32)
            s = tl.zeros([ROWS], dtype=tl.float32)
            for start in range(0, N, BLOCK_N):
                c = start + cols
                mask = row_ok[:, None] & (c[None, :] < N)
                x = tl.load(x_rows + c[None, :], mask=mask, other=-float("inf")).to(tl.float32)
                m_new = tl.maximum(m, tl.max(x, axis=1))
                # Rows past M are all -inf: their NaNs are never stored.
                e = tl.exp2((x - m_new[:, None]) * 1.4426950408889634)
                s = s * tl.exp2((m - m_new) * 1.4426950408889634) + tl.sum(e, axis=1)
                m = m_new
            inv = 1.0 / s
            for start in range(0, N, BLOCK_N):
                c = start + cols
                mask = row_ok[:, None] & (c[None, :] < N)
                x = tl.load(x_rows + c[None, :], mask=mask, other=-float("inf")).to(tl.float32)
                y = tl.exp2((x - m[:, None]) * 1.4426950408889634) * inv[:, None]
                tl.store(o_rows + c[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


def launch(x, out, ROWS_PER_PROG=1, BLOCK_N=0, PROGRAMS_PER_SM=0, num_warps=4, num_stages=1):
    M, N = x.shape
    if M == 0 or N == 0:
        return out
    if x.stride(1) != 1 or out.stride(1) != 1:
        raise ValueError("softmax template needs unit stride along the last dimension")
    one_pass = BLOCK_N == 0 or BLOCK_N >= N
    block_n = triton.next_power_of_2(N) if one_pass else BLOCK_N
    if block_n > MAX_TILE_ELEMS:  # a row too wide for registers: loop over it in chunks
        one_pass, block_n = False, MAX_TILE_ELEMS
    rows = max(1, min(ROWS_PER_PROG, MAX_TILE_ELEMS // block_n))  # valid for any N
    num_tiles = triton.cdiv(M, rows)
    grid = num_tiles if PROGRAMS_PER_SM == 0 else min(num_tiles, _sm_count(x.device) * PROGRAMS_PER_SM)
    vec = _vec_width(x.element_size(), N, x.stride(0), out.stride(0))
    _softmax_kernel[(grid,)](x, out, M, N // vec, x.stride(0) // vec, out.stride(0) // vec, num_tiles,
                             ROWS=rows, BLOCK_N=block_n, ONE_PASS=one_pass, VEC=vec,
                             num_warps=num_warps, num_stages=num_stages)
    return out
