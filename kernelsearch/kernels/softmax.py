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
    "ALIGN": [0, 1],                   # 1: odd-width rows as head + aligned body + tail
}

MAX_TILE_ELEMS = 32768  # launch() clamps the rows per program (and chunks wider rows) to this


def _valid(p: dict) -> bool:
    if p["BLOCK_N"] and p["ROWS_PER_PROG"] * p["BLOCK_N"] < p["num_warps"] * 32 * 8:
        return False
    return p["BLOCK_N"] == 0 or p["ROWS_PER_PROG"] * p["BLOCK_N"] <= MAX_TILE_ELEMS


# Curated (see the rmsnorm template): the grid runs with ALIGN=1 (a no-op on aligned rows);
# the ALIGN=0 entries are the first H200 run's winners.
_GRID = {"ROWS_PER_PROG": [1, 2, 4], "BLOCK_N": [0, 1024, 4096], "PROGRAMS_PER_SM": [0, 4],
         "num_warps": [4, 8], "ALIGN": [1]}
_WINNERS_RUN1 = [dict(ROWS_PER_PROG=1, BLOCK_N=4096, PROGRAMS_PER_SM=0, num_warps=4, ALIGN=0),
                 dict(ROWS_PER_PROG=1, BLOCK_N=4096, PROGRAMS_PER_SM=4, num_warps=8, ALIGN=0),
                 dict(ROWS_PER_PROG=1, BLOCK_N=0, PROGRAMS_PER_SM=0, num_warps=4, ALIGN=0)]
CONFIGS = [p for p in (dict(zip(_GRID, v)) for v in itertools.product(*_GRID.values())) if _valid(p)]
CONFIGS += [p for p in _WINNERS_RUN1 if p not in CONFIGS]

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


@triton.jit(do_not_specialize=["M", "num_tiles", "stride"])
def _softmax_aligned_kernel(x_ptr, out_ptr, M, N, stride, num_tiles, ROWS: tl.constexpr,
                            BLOCK_N: tl.constexpr, ONE_PASS: tl.constexpr, A: tl.constexpr):
    # Odd-width rows: head [s, s8) + 16-byte-aligned body [s8, e8) + tail [e8, e) (see the
    # rmsnorm template). The body is never empty (N >= 2A), so the running max is finite
    # after it for every valid row.
    LOG2E: tl.constexpr = 1.4426950408889634
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    row_ids = tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    h = tl.arange(0, A)
    for tile in range(pid, num_tiles, nprog):
        rows = tile * ROWS + row_ids
        row_ok = rows < M
        s = rows.to(tl.int64) * stride
        s8 = ((s + (A - 1)) // A) * A
        e8 = ((s + N) // A) * A
        head = (s8 - s).to(tl.int32)
        tail = (s + N - e8).to(tl.int32)
        body = (e8 - s8).to(tl.int32)
        hoff = s[:, None] + h[None, :]
        toff = e8[:, None] + h[None, :]
        hmask = row_ok[:, None] & (h[None, :] < head[:, None])
        tmask = row_ok[:, None] & (h[None, :] < tail[:, None])
        xh = tl.load(x_ptr + hoff, mask=hmask, other=-float("inf")).to(tl.float32)
        xt = tl.load(x_ptr + toff, mask=tmask, other=-float("inf")).to(tl.float32)
        m_edges = tl.maximum(tl.max(xh, axis=1), tl.max(xt, axis=1))
        if ONE_PASS:
            boff = s8[:, None] + cols[None, :]
            bmask = row_ok[:, None] & (cols[None, :] < body[:, None])
            xb = tl.load(x_ptr + boff, mask=bmask, other=-float("inf")).to(tl.float32)
            m = tl.maximum(tl.max(xb, axis=1), m_edges)
            eb = tl.exp2((xb - m[:, None]) * LOG2E)
            s_b = tl.sum(eb, axis=1)
        else:
            m = tl.full([ROWS], -float("inf"), dtype=tl.float32)
            s_b = tl.zeros([ROWS], dtype=tl.float32)
            for start in range(0, N, BLOCK_N):
                c = start + cols
                bmask = row_ok[:, None] & (c[None, :] < body[:, None])
                xb = tl.load(x_ptr + s8[:, None] + c[None, :], mask=bmask, other=-float("inf")).to(tl.float32)
                # A chunk past the body is all -inf: the max must not fall to -inf - -inf.
                m_new = tl.maximum(m, tl.max(xb, axis=1))
                m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
                s_b = s_b * tl.exp2((m - m_safe) * LOG2E) + tl.sum(tl.exp2((xb - m_safe[:, None]) * LOG2E), axis=1)
                m = m_new
            m_all = tl.maximum(m, m_edges)
            s_b = s_b * tl.exp2((m - m_all) * LOG2E)
            m = m_all
        eh = tl.exp2((xh - m[:, None]) * LOG2E)
        et = tl.exp2((xt - m[:, None]) * LOG2E)
        inv = 1.0 / (s_b + tl.sum(eh, axis=1) + tl.sum(et, axis=1))
        tl.store(out_ptr + hoff, (eh * inv[:, None]).to(out_ptr.dtype.element_ty), mask=hmask)
        tl.store(out_ptr + toff, (et * inv[:, None]).to(out_ptr.dtype.element_ty), mask=tmask)
        if ONE_PASS:
            tl.store(out_ptr + boff, (eb * inv[:, None]).to(out_ptr.dtype.element_ty), mask=bmask)
        else:
            for start in range(0, N, BLOCK_N):
                c = start + cols
                bmask = row_ok[:, None] & (c[None, :] < body[:, None])
                xb = tl.load(x_ptr + s8[:, None] + c[None, :], mask=bmask, other=-float("inf")).to(tl.float32)
                y = tl.exp2((xb - m[:, None]) * LOG2E) * inv[:, None]
                tl.store(out_ptr + s8[:, None] + c[None, :], y.to(out_ptr.dtype.element_ty), mask=bmask)


def launch(x, out, ROWS_PER_PROG=1, BLOCK_N=0, PROGRAMS_PER_SM=0, num_warps=4, num_stages=1,
           ALIGN=0):
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
    a = 16 // x.element_size()
    if ALIGN and vec < a and N >= 2 * a and x.stride(0) == out.stride(0):
        _softmax_aligned_kernel[(grid,)](x, out, M, N, x.stride(0), num_tiles, ROWS=rows,
                                         BLOCK_N=block_n, ONE_PASS=one_pass, A=a,
                                         num_warps=num_warps, num_stages=num_stages)
        return out
    _softmax_kernel[(grid,)](x, out, M, N // vec, x.stride(0) // vec, out.stride(0) // vec, num_tiles,
                             ROWS=rows, BLOCK_N=block_n, ONE_PASS=one_pass, VEC=vec,
                             num_warps=num_warps, num_stages=num_stages)
    return out
