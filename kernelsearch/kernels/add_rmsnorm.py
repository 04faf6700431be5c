"""Fused residual add + RMSNorm template.

residual_out = x + residual (rounded to the input dtype, as torch's bf16 add does: the sum is
formed in fp32 and rounded once), out = rmsnorm(residual_out) * weight. One pass over the
inputs instead of two kernels; the same tiling parameters as the rmsnorm template (rows per
program, whole row vs chunks, persistent grid). fp32 accumulation, cast on store.
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
    "PROGRAMS_PER_SM": [0, 2, 8],      # 0: one program per row tile (not persistent)
    "num_warps": [4, 8, 16],
    "num_stages": [1, 2],
    "ALIGN": [0, 1],                   # 1: odd-width rows as head + aligned body + tail
}

MAX_TILE_ELEMS = 32768  # launch() clamps the rows per program (and chunks wider rows) to this


def _valid(p: dict) -> bool:
    if p["BLOCK_N"] and p["ROWS_PER_PROG"] * p["BLOCK_N"] < p["num_warps"] * 32 * 8:
        return False
    return p["BLOCK_N"] == 0 or p["ROWS_PER_PROG"] * p["BLOCK_N"] <= MAX_TILE_ELEMS


# Curated rather than the full product (the bench reaches only part of a big space in its time
# budget). ALIGN=1 is the same kernel as ALIGN=0 wherever rows are already 16-byte aligned,
# so the grid below runs with ALIGN=1; the ALIGN=0 entries are the first H200 run's winners.
_GRID = {"ROWS_PER_PROG": [1, 2, 4], "BLOCK_N": [0, 1024], "PROGRAMS_PER_SM": [0, 2],
         "num_warps": [4, 8], "num_stages": [1], "ALIGN": [1]}
_WINNERS_RUN1 = [dict(ROWS_PER_PROG=1, BLOCK_N=0, PROGRAMS_PER_SM=2, num_warps=4, num_stages=2, ALIGN=0),
                 dict(ROWS_PER_PROG=2, BLOCK_N=0, PROGRAMS_PER_SM=8, num_warps=16, num_stages=2, ALIGN=0),
                 dict(ROWS_PER_PROG=1, BLOCK_N=0, PROGRAMS_PER_SM=0, num_warps=4, num_stages=1, ALIGN=0)]
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
def _add_rmsnorm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, rout_ptr, M, n_v,
                        sx_v, sr_v, so_v, sro_v, eps, num_tiles,
                        ROWS: tl.constexpr, BLOCK_N: tl.constexpr, ONE_PASS: tl.constexpr,
                        VEC: tl.constexpr):
    N = n_v * VEC
    stride_xm = sx_v * VEC
    stride_rm = sr_v * VEC
    stride_om = so_v * VEC
    stride_rom = sro_v * VEC
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    row_ids = tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    if ONE_PASS:
        w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    for tile in range(pid, num_tiles, nprog):
        rows = tile * ROWS + row_ids
        row_ok = rows < M
        rows64 = rows.to(tl.int64)[:, None]
        x_rows = x_ptr + rows64 * stride_xm
        r_rows = r_ptr + rows64 * stride_rm
        o_rows = out_ptr + rows64 * stride_om
        ro_rows = rout_ptr + rows64 * stride_rom
        if ONE_PASS:
            mask = row_ok[:, None] & (cols[None, :] < N)
            x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            r = tl.load(r_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            s = (x + r).to(rout_ptr.dtype.element_ty)
            tl.store(ro_rows + cols[None, :], s, mask=mask)
            sf = s.to(tl.float32)
            rstd = 1.0 / tl.sqrt(tl.sum(sf * sf, axis=1) / N + eps)
            y = sf * rstd[:, None] * w[None, :]
            tl.store(o_rows + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            sq = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
            for start in range(0, N, BLOCK_N):
                c = start + cols
                mask = row_ok[:, None] & (c[None, :] < N)
                x = tl.load(x_rows + c[None, :], mask=mask, other=0.0).to(tl.float32)
                r = tl.load(r_rows + c[None, :], mask=mask, other=0.0).to(tl.float32)
                s = (x + r).to(rout_ptr.dtype.element_ty)
                tl.store(ro_rows + c[None, :], s, mask=mask)
                sf = s.to(tl.float32)
                sq += sf * sf
            rstd = 1.0 / tl.sqrt(tl.sum(sq, axis=1) / N + eps)
            # The second pass recomputes the sum from x and residual (L2 hits) rather than
            # reading residual_out back: another thread of this program may have written it,
            # and that read would need a barrier to be safe.
            for start in range(0, N, BLOCK_N):
                c = start + cols
                mask = row_ok[:, None] & (c[None, :] < N)
                x = tl.load(x_rows + c[None, :], mask=mask, other=0.0).to(tl.float32)
                r = tl.load(r_rows + c[None, :], mask=mask, other=0.0).to(tl.float32)
                sf = (x + r).to(rout_ptr.dtype.element_ty).to(tl.float32)
                wc = tl.load(w_ptr + c, mask=c < N, other=0.0).to(tl.float32)
                y = sf * rstd[:, None] * wc[None, :]
                tl.store(o_rows + c[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M", "num_tiles", "stride"])
def _add_rmsnorm_aligned_kernel(x_ptr, r_ptr, w_ptr, out_ptr, rout_ptr, M, N, stride, eps,
                                num_tiles, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                                ONE_PASS: tl.constexpr, A: tl.constexpr):
    # Odd-width rows: head [s, s8) + 16-byte-aligned body [s8, e8) + tail [e8, e), as in the
    # rmsnorm template's aligned kernel; the four [M, N] tensors share one row stride.
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    row_ids = tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    h = tl.arange(0, A)
    dt = rout_ptr.dtype.element_ty
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
        sh = (tl.load(x_ptr + hoff, mask=hmask, other=0.0).to(tl.float32)
              + tl.load(r_ptr + hoff, mask=hmask, other=0.0).to(tl.float32)).to(dt)
        st = (tl.load(x_ptr + toff, mask=tmask, other=0.0).to(tl.float32)
              + tl.load(r_ptr + toff, mask=tmask, other=0.0).to(tl.float32)).to(dt)
        tl.store(rout_ptr + hoff, sh, mask=hmask)
        tl.store(rout_ptr + toff, st, mask=tmask)
        shf = sh.to(tl.float32)
        stf = st.to(tl.float32)
        sq_edges = tl.sum(shf * shf, axis=1) + tl.sum(stf * stf, axis=1)
        if ONE_PASS:
            boff = s8[:, None] + cols[None, :]
            bmask = row_ok[:, None] & (cols[None, :] < body[:, None])
            sb = (tl.load(x_ptr + boff, mask=bmask, other=0.0).to(tl.float32)
                  + tl.load(r_ptr + boff, mask=bmask, other=0.0).to(tl.float32)).to(dt)
            tl.store(rout_ptr + boff, sb, mask=bmask)
            sbf = sb.to(tl.float32)
            rstd = 1.0 / tl.sqrt((tl.sum(sbf * sbf, axis=1) + sq_edges) / N + eps)
            wb = tl.load(w_ptr + head[:, None] + cols[None, :], mask=bmask, other=0.0).to(tl.float32)
            tl.store(out_ptr + boff, (sbf * rstd[:, None] * wb).to(out_ptr.dtype.element_ty), mask=bmask)
        else:
            sq = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
            for start in range(0, N, BLOCK_N):
                c = start + cols
                boff = s8[:, None] + c[None, :]
                bmask = row_ok[:, None] & (c[None, :] < body[:, None])
                sb = (tl.load(x_ptr + boff, mask=bmask, other=0.0).to(tl.float32)
                      + tl.load(r_ptr + boff, mask=bmask, other=0.0).to(tl.float32)).to(dt)
                tl.store(rout_ptr + boff, sb, mask=bmask)
                sbf = sb.to(tl.float32)
                sq += sbf * sbf
            rstd = 1.0 / tl.sqrt((tl.sum(sq, axis=1) + sq_edges) / N + eps)
            # Recomputed from x and residual (L2 hits), not read back from residual_out.
            for start in range(0, N, BLOCK_N):
                c = start + cols
                boff = s8[:, None] + c[None, :]
                bmask = row_ok[:, None] & (c[None, :] < body[:, None])
                sbf = (tl.load(x_ptr + boff, mask=bmask, other=0.0).to(tl.float32)
                       + tl.load(r_ptr + boff, mask=bmask, other=0.0).to(tl.float32)).to(dt).to(tl.float32)
                wb = tl.load(w_ptr + head[:, None] + c[None, :], mask=bmask, other=0.0).to(tl.float32)
                tl.store(out_ptr + boff, (sbf * rstd[:, None] * wb).to(out_ptr.dtype.element_ty), mask=bmask)
        wh = tl.load(w_ptr + h[None, :] + 0 * rows[:, None], mask=hmask, other=0.0).to(tl.float32)
        wt = tl.load(w_ptr + (N - tail)[:, None] + h[None, :], mask=tmask, other=0.0).to(tl.float32)
        tl.store(out_ptr + hoff, (shf * rstd[:, None] * wh).to(out_ptr.dtype.element_ty), mask=hmask)
        tl.store(out_ptr + toff, (stf * rstd[:, None] * wt).to(out_ptr.dtype.element_ty), mask=tmask)


def launch(x, residual, weight, eps, out, residual_out, ROWS_PER_PROG=1, BLOCK_N=0,
           PROGRAMS_PER_SM=0, num_warps=4, num_stages=1, ALIGN=0):
    M, N = x.shape
    if M == 0 or N == 0:
        return out, residual_out
    for t in (x, residual, out, residual_out):
        if t.stride(1) != 1:
            raise ValueError("add_rmsnorm template needs unit stride along the last dimension")
    one_pass = BLOCK_N == 0 or BLOCK_N >= N
    block_n = triton.next_power_of_2(N) if one_pass else BLOCK_N
    if block_n > MAX_TILE_ELEMS:  # a row too wide for registers: loop over it in chunks
        one_pass, block_n = False, MAX_TILE_ELEMS
    rows = max(1, min(ROWS_PER_PROG, MAX_TILE_ELEMS // block_n))  # valid for any N
    num_tiles = triton.cdiv(M, rows)
    grid = num_tiles if PROGRAMS_PER_SM == 0 else min(num_tiles, _sm_count(x.device) * PROGRAMS_PER_SM)
    strides = (x.stride(0), residual.stride(0), out.stride(0), residual_out.stride(0))
    vec = _vec_width(x.element_size(), N, *strides)
    a = 16 // x.element_size()
    if ALIGN and vec < a and N >= 2 * a and len(set(strides)) == 1:
        _add_rmsnorm_aligned_kernel[(grid,)](x, residual, weight, out, residual_out, M, N, strides[0],
                                             float(eps), num_tiles, ROWS=rows, BLOCK_N=block_n,
                                             ONE_PASS=one_pass, A=a, num_warps=num_warps,
                                             num_stages=num_stages)
        return out, residual_out
    _add_rmsnorm_kernel[(grid,)](x, residual, weight, out, residual_out, M, N // vec,
                                 *(st // vec for st in strides), float(eps), num_tiles,
                                 ROWS=rows, BLOCK_N=block_n, ONE_PASS=one_pass, VEC=vec,
                                 num_warps=num_warps, num_stages=num_stages)
    return out, residual_out
