"""linear_residual, stream-K (an experiment, searched with `hwtune search linear_residual --source`):
out[M, N] = residual[M, N] + x[M, K] @ weight[N, K].T, for decode batches (the rows of x go
through tl.dot, at least 16).

Why: at batch 32 the swapab tiles the step judge keeps for the 4096 x 4096 O projection are 64
weight rows wide with one split: 64 programs, one an SM, so 68 of the H100's 132 SMs stay idle and
the kernel reaches 63% of the DRAM peak (BENCHMARKS.md 10k). Split-K makes more programs, but
every split pays a reduce over whole tiles.

Stream-K: the work is N / BLOCK_N tiles x cdiv(K, BLOCK_K) K steps ("units"), and PROGRAMS
programs each take an equal, contiguous range of units (tile-major). A program walks its range
tile by tile. A tile it covers whole is stored directly, with the residual added. A tile shared
with the next or previous program (at most a few, since ranges are contiguous) has each
program store its partial [BLOCK_M, BLOCK_N] fp32 sum in the tile's slot for it (slot =
program - the tile's first program), then take an acq_rel ticket on the tile's counter. The
last of the tile's programs sums the slots in slot order (the same bits every run, whatever
the arrival order), adds the residual, stores, and sets the counter back to 0 (counters are
allocated zeroed once per device: CUDA graphs need no fill kernel). Only shared tiles pay a
reduce, at most two a program.

The weight tile is tl.dot's left operand (swapab: wgmma on sm_90), x's rows its right one, and
the [BLOCK_N, BLOCK_M] accumulator is transposed once per tile. fp32 accumulation, residual
added in fp32, cast on store; fp32 operands use exact (ieee) dots; on the CPU (the interpreter,
whose bf16 arithmetic is wrong) operands are upcast.

Measured (run 17, BENCHMARKS.md 10l, H100): it loses. The 4096 x 4096 O took 22.1 us against
19.5 for the 64-program swapab template tile and 18.2 for cuBLAS + add. The 14336 -> 4096 down took
48.7 us against 46.9 (swapab, 2 splits), and was 0.65% slower in the batch-32 step. Kept here as
a record and a starting point, not as a template.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

SPACE = {
    "BLOCK_M": [16, 32, 64],
    "BLOCK_N": [64, 128],
    "BLOCK_K": [64, 128],
    "PROGRAMS": [128, 132, 264],
    "num_warps": [4],
    "num_stages": [4, 6, 10],
}

SMEM_LIMIT_BYTES = 220 * 1024


def _valid(p: dict) -> bool:
    smem = (p["BLOCK_M"] + p["BLOCK_N"]) * p["BLOCK_K"] * 2 * p["num_stages"]
    return smem <= SMEM_LIMIT_BYTES


def _cfg(bm, bn, bk, progs, stages):
    return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "PROGRAMS": progs, "num_warps": 4,
            "num_stages": stages}


CONFIGS = [p for p in [
    _cfg(32, 64, 128, 132, 6),     # the judge's O tile (64 x 128, 6 stages) on every SM
    _cfg(32, 64, 128, 132, 4),
    _cfg(32, 64, 64, 132, 10),     # the 64-deep tile, 10 stages
    _cfg(32, 64, 128, 264, 4),     # two programs an SM (96 KB each)
    _cfg(32, 64, 64, 128, 10),
    _cfg(32, 128, 64, 132, 6),
] if _valid(p)]


@triton.jit(do_not_specialize=["units", "progs", "maxseg"])
def _streamk_kernel(x_ptr, w_ptr, r_ptr, ws_ptr, c_ptr, cnt_ptr, M, N, K, steps, units, progs,
                    maxseg, n_tiles, s_xm, s_xk, s_wn, s_wk, s_rm, s_rn, s_cm, s_cn,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    EVEN_K: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr):
    p = tl.program_id(0)
    pid_m = tl.program_id(1)
    u_lo = (p * units) // progs
    u_hi = ((p + 1) * units) // progs
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rb = tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    rw = tl.arange(0, BLOCK_M)
    m_ok = rm < M
    u = u_lo
    while u < u_hi:
        t = u // steps
        k0 = u - t * steps
        k1 = tl.minimum(steps, k0 + (u_hi - u))
        rn = t * BLOCK_N + rb
        # rows past M and features past N re-read valid ones; only the stores are masked
        x_ptrs = x_ptr + (rm % M).to(tl.int64)[:, None] * s_xm + (k0 * BLOCK_K + rk)[None, :] * s_xk
        w_ptrs = w_ptr + (rn % N).to(tl.int64)[:, None] * s_wn + (k0 * BLOCK_K + rk)[None, :] * s_wk
        acc_t = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for kk in range(k0, k1):
            if EVEN_K:
                a = tl.load(x_ptrs)
                w = tl.load(w_ptrs, eviction_policy="evict_first")
            else:
                k_ok = (kk * BLOCK_K + rk)[None, :] < K
                a = tl.load(x_ptrs, mask=k_ok, other=0.0)
                w = tl.load(w_ptrs, mask=k_ok, other=0.0, eviction_policy="evict_first")
            if UPCAST:
                a = a.to(tl.float32)
                w = w.to(tl.float32)
            acc_t = tl.dot(w, tl.trans(a), acc_t, input_precision=DOT_PRECISION)
            x_ptrs += BLOCK_K * s_xk
            w_ptrs += BLOCK_K * s_wk
        acc = tl.trans(acc_t)
        mask = m_ok[:, None] & (rn < N)[None, :]
        if (k0 == 0) & (k1 == steps):
            res = tl.load(r_ptr + rm.to(tl.int64)[:, None] * s_rm + rn[None, :] * s_rn, mask=mask,
                          other=0.0)
            tl.store(c_ptr + rm.to(tl.int64)[:, None] * s_cm + rn[None, :] * s_cn,
                     (acc + res.to(tl.float32)).to(c_ptr.dtype.element_ty), mask=mask)
        else:
            # the programs that share tile t: the owners of its first and last units
            first = ((t * steps + 1) * progs + units - 1) // units - 1
            last = ((t + 1) * steps * progs + units - 1) // units - 1
            slot = (pid_m * n_tiles + t) * maxseg
            tile = (slot + (p - first)).to(tl.int64) * (BLOCK_M * BLOCK_N)
            tl.store(ws_ptr + tile + rw[:, None] * BLOCK_N + rb[None, :], acc)
            # every thread's partial is stored before one thread's release (CTA barrier)
            tl.debug_barrier()
            counter = cnt_ptr + pid_m * n_tiles + t
            arrived = tl.atomic_add(counter, 1, sem="acq_rel")
            if arrived == last - first:
                total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                for s in range(0, last - first + 1):   # slot order: the same bits every run
                    part = ws_ptr + (slot + s).to(tl.int64) * (BLOCK_M * BLOCK_N)
                    total += tl.load(part + rw[:, None] * BLOCK_N + rb[None, :], cache_modifier=".cg")
                res = tl.load(r_ptr + rm.to(tl.int64)[:, None] * s_rm + rn[None, :] * s_rn,
                              mask=mask, other=0.0)
                tl.store(c_ptr + rm.to(tl.int64)[:, None] * s_cm + rn[None, :] * s_cn,
                         (total + res.to(tl.float32)).to(c_ptr.dtype.element_ty), mask=mask)
                tl.atomic_xchg(counter, 0, sem="relaxed")  # ready for the next launch
        u += k1 - k0


_counters: dict = {}  # device -> int32 arrival counters, zero between launches


def _arrival_counters(device, n: int):
    key = str(device)
    cnt = _counters.get(key)
    if cnt is None or cnt.numel() < n:
        cnt = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
        _counters[key] = cnt
    return cnt


def launch(x, weight, residual, out, BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, PROGRAMS=132,
           num_warps=4, num_stages=6):
    M, K = x.shape
    N, K2 = weight.shape
    if K2 != K or tuple(residual.shape) != (M, N) or tuple(out.shape) != (M, N):
        raise ValueError(f"linear_residual shapes x{tuple(x.shape)} weight{tuple(weight.shape)} "
                         f"residual{tuple(residual.shape)} out{tuple(out.shape)}")
    if M == 0 or N == 0:
        return out
    if K == 0:
        raise ValueError("linear_residual template needs K > 0")
    block_m = max(16, min(triton.next_power_of_2(M), BLOCK_M))   # tl.dot needs at least 16 rows
    n_tiles = triton.cdiv(N, BLOCK_N)
    steps = triton.cdiv(K, BLOCK_K)
    units = n_tiles * steps
    progs = min(PROGRAMS, units)
    # a tile's units meet at most cdiv(steps, the fewest units a program takes) + 1 programs
    maxseg = triton.cdiv(steps, max(1, units // progs)) + 1
    m_blocks = triton.cdiv(M, block_m)
    ws = torch.empty((m_blocks * n_tiles * maxseg * block_m * BLOCK_N,), device=x.device,
                     dtype=torch.float32)
    cnt = _arrival_counters(x.device, m_blocks * n_tiles)
    upcast = x.device.type != "cuda"
    precision = "ieee" if x.dtype == torch.float32 or upcast else "tf32"
    _streamk_kernel[(progs, m_blocks)](
        x, weight, residual, ws, out, cnt, M, N, K, steps, units, progs, maxseg, n_tiles,
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), residual.stride(0),
        residual.stride(1), out.stride(0), out.stride(1),
        BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, EVEN_K=K % BLOCK_K == 0,
        UPCAST=upcast, DOT_PRECISION=precision, num_warps=num_warps, num_stages=num_stages)
    return out
