"""Probe: does programmatic dependent launch (PDL) close the per-kernel gap of a decode step?

A decode step at batch 1 is a chain of GEMVs, each reading the previous one's output. Every
kernel boundary costs a launch, a ramp (the first weight bytes arrive ~1 us after the start) and
a tail (the last programs finish while most SMs idle). With PDL (sm_90+) the next kernel is
launched while the previous one still runs; it may read its weights (never written during
decode) before `gdc_wait()`, and must read its input and write its output only after it.

This probe times one Llama-3-8B-shaped step without the head (per layer: q|k|v 4096->6144,
o 4096->4096, gate|up 4096->28672, down 14336->4096; bf16) as one CUDA graph of 4 x LAYERS
kernels, L2 flushed before each replay, median of REPS replays, at batch 1 (a Triton GEMV) and
batch 32 (a Triton tile with the weight as tl.dot's left operand, wgmma on sm_90):

  cublas      F.linear(out=) chain (what torch runs)
  plain       the Triton chain, plain launches
  wait        launch_pdl=True, gdc_wait() before any load (what the harness does)
  wait+late   and gdc_launch_dependents() after the main loop, before the store
  pre         each program loads its first weight tile before gdc_wait(), no trigger
  pre+late    the first weight tile before the wait, the trigger after the main loop
  pre2+late   two weight tiles before the wait (batch 1), the trigger late
  pre+first   the first weight tile, then the trigger, then the wait (run 4's "gemv+pre")
  pre+af      as pre, but the attention kernels (batch 1) trigger first: the o GEMV's programs
              launch while the attention runs and fetch their first weight tile then
  late+apre   pre+late split (batch 1): the trigger late, and only the attention's K and V
  late+gpre   tiles before the wait (apre), or only the GEMVs' first weight tile (gpre)

at batch 1 with the attention, whose split kernel leaves HBM mostly idle (latency-bound):

  wait+pfNN   as wait, and the attention's grid has 32 more programs a kv head that only read
              NN% of the layer's o weight into L2 (volatile loads, values dropped), so the o
              GEMV after it reads that much from L2
  pre+pfNN    the same with pre's early weight (K/V) tiles

and, at batch 1 with the attention, the whole step as one persistent launch (issue 13's
"persistent decode kernel where it wins": is there a win to build one for?):

  persistP      P programs of 8 warps an SM (registers capped to fit) claim the chain's tiles in
                order from a counter and wait, once a phase, until the phase before is done
  persistP+pre  each tile's first weight step (the attention's K/V tile) loaded before its wait

It checks that every chain's final output equals the plain chain's bit for bit (a missing or
misplaced wait would race and differ; the persistent step's down projection reduces with 8 warps
where the chain's uses 4, so its bits may differ by a rounding: the relative difference is
printed). Not a kernel search: a fact for the next design step. Read-only: changes no GPU
setting. Batch 1 runs last, and a persistent wait gives up after ~1M polls (flagged in the
table), so a bug cannot hang the device for long.
  python3 bench/pdl_probe.py [--layers 8] [--batches 1,32] [--attention S] [--l2-prefetch 25,50,100]
                             [--persistent 1,2] [--json F]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older triton
    gdc_wait = gdc_launch_dependents = None


@triton.jit
def _gemv(x_ptr, w_ptr, y_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
          PDL: tl.constexpr, PRE: tl.constexpr, TRIG: tl.constexpr):
    # PDL: gdc_wait() before x is read; PRE: weight tiles (0-2) loaded before the wait;
    # TRIG: gdc_launch_dependents() 0 never, 1 first (before the wait), 2 late (before the store)
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + (rn % N).to(tl.int64)[:, None] * K + rk[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    if PRE >= 1:
        w0 = tl.load(w_ptrs, eviction_policy="evict_first")
    if PRE >= 2:
        w1 = tl.load(w_ptrs + BLOCK_K, eviction_policy="evict_first")
    if PDL:
        if TRIG == 1:
            gdc_launch_dependents()
        gdc_wait()
    if PRE >= 1:
        acc += w0.to(tl.float32) * tl.load(x_ptr + rk).to(tl.float32)[None, :]
    if PRE >= 2:
        acc += w1.to(tl.float32) * tl.load(x_ptr + BLOCK_K + rk).to(tl.float32)[None, :]
    for k in range(PRE * BLOCK_K, K, BLOCK_K):
        w = tl.load(w_ptrs + k, eviction_policy="evict_first")
        x = tl.load(x_ptr + k + rk)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    if PDL:
        if TRIG == 2:
            gdc_launch_dependents()
    tl.store(y_ptr + rn, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty), mask=rn < N)


@triton.jit
def _gemm32(x_ptr, w_ptr, y_ptr, N, K, M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
            PDL: tl.constexpr, PRE: tl.constexpr, TRIG: tl.constexpr, STAGES: tl.constexpr):
    # batch M (32): y[M, N] = x[M, K] @ w[N, K]^T, the weight tile as the dot's left operand
    # (wgmma on sm_90, as the templates' "swapab"); PDL / PRE (0-1) / TRIG as _gemv's
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    rm = tl.arange(0, M)
    w_ptrs = w_ptr + (rn % N).to(tl.int64)[:, None] * K + rk[None, :]
    x_ptrs = x_ptr + rm[None, :] * K + rk[:, None]
    acc = tl.zeros([BLOCK_N, M], dtype=tl.float32)
    if PRE >= 1:
        w0 = tl.load(w_ptrs, eviction_policy="evict_first")
    if PDL:
        if TRIG == 1:
            gdc_launch_dependents()
        gdc_wait()
    if PRE >= 1:
        acc = tl.dot(w0, tl.load(x_ptrs), acc)
    for k in tl.range(PRE * BLOCK_K, K, BLOCK_K, num_stages=STAGES):
        acc = tl.dot(tl.load(w_ptrs + k, eviction_policy="evict_first"), tl.load(x_ptrs + k), acc)
    if PDL:
        if TRIG == 2:
            gdc_launch_dependents()
    tl.store(y_ptr + rm[None, :] * N + rn[:, None], acc.to(y_ptr.dtype.element_ty), mask=(rn < N)[:, None])


@triton.jit
def _attn_tile(q, k, v, s, S, qk_scale):
    # one split's softmax statistics and unnormalised output over the tokens s (< S)
    qk = tl.dot(q, tl.trans(k)) * qk_scale
    qk = tl.where((s < S)[None, :], qk, -float("inf"))
    m_i = tl.max(qk, axis=1)
    pr = tl.exp2(qk - m_i[:, None])
    return m_i, tl.sum(pr, axis=1), tl.dot(pr.to(v.dtype), v)


@triton.jit
def _l2_prefetch(ptr, part, PART: tl.constexpr, BLOCK: tl.constexpr):
    # elements [part * PART, (part + 1) * PART) of ptr's tensor fetched into L2: volatile loads
    # (kept by the compiler) whose values are dropped, four BLOCKs in flight a round
    base = ptr + part.to(tl.int64) * PART
    for off in range(0, PART, 4 * BLOCK):
        for u in tl.static_range(4):
            tl.load(base + off + u * BLOCK + tl.arange(0, BLOCK), volatile=True)


@triton.jit
def _attn_split_body(qkv_ptr, k_ptr, v_ptr, m_ws, l_ws, acc_ws, hkv, sp, S, qk_scale, G: tl.constexpr,
                     D: tl.constexpr, BLOCK_S: tl.constexpr, NSP: tl.constexpr, PDL: tl.constexpr,
                     PRE: tl.constexpr, TRIG: tl.constexpr):
    g = tl.arange(0, 16)
    d = tl.arange(0, D)
    s = sp * BLOCK_S + tl.arange(0, BLOCK_S)
    kv_off = hkv.to(tl.int64) * S * D + s[:, None] * D + d[None, :]
    if PRE >= 1:
        k = tl.load(k_ptr + kv_off, mask=(s < S)[:, None], other=0.0)
        v = tl.load(v_ptr + kv_off, mask=(s < S)[:, None], other=0.0)
    if PDL:
        if TRIG == 1:
            gdc_launch_dependents()
        gdc_wait()
    if PRE == 0:
        k = tl.load(k_ptr + kv_off, mask=(s < S)[:, None], other=0.0)
        v = tl.load(v_ptr + kv_off, mask=(s < S)[:, None], other=0.0)
    q = tl.load(qkv_ptr + (hkv * G + g)[:, None] * D + d[None, :], mask=(g < G)[:, None], other=0.0)
    m_i, l_i, acc = _attn_tile(q, k, v, s, S, qk_scale)
    if PDL:
        if TRIG == 2:
            gdc_launch_dependents()
    row = (hkv * G + g) * NSP + sp
    tl.store(m_ws + row, m_i, mask=g < G)
    tl.store(l_ws + row, l_i, mask=g < G)
    tl.store(acc_ws + row[:, None] * D + d[None, :], acc, mask=(g < G)[:, None])


@triton.jit
def _attn_split(qkv_ptr, k_ptr, v_ptr, m_ws, l_ws, acc_ws, S, qk_scale, pf_ptr, G: tl.constexpr,
                D: tl.constexpr, BLOCK_S: tl.constexpr, NSP: tl.constexpr, PDL: tl.constexpr,
                PRE: tl.constexpr, TRIG: tl.constexpr, PF_PART: tl.constexpr, PF_BLOCK: tl.constexpr):
    # batch 1 split-KV decode attention over a cache of S tokens, one (kv head, BLOCK_S tokens)
    # a program (as the kept rope_kv_attention config at batch 1: 64 splits of one 64-token tile).
    # The probe's cache is never written (the real kernel also writes the new token's slot).
    # PRE: the program's K and V tiles loaded before the wait (the kernel before it, the q|k|v
    # projection, does not write the cache). PF_PART > 0: the programs past NSP on axis 1 read
    # PF_PART elements each of pf_ptr (the next projection's weight) into L2 and nothing else:
    # they neither wait nor write, so they run while the attention, latency-bound, leaves HBM idle
    hkv = tl.program_id(0)
    sp = tl.program_id(1)
    if PF_PART > 0:
        if sp >= NSP:
            _l2_prefetch(pf_ptr, hkv * (tl.num_programs(1) - NSP) + sp - NSP, PF_PART, PF_BLOCK)
        else:
            _attn_split_body(qkv_ptr, k_ptr, v_ptr, m_ws, l_ws, acc_ws, hkv, sp, S, qk_scale, G, D,
                             BLOCK_S, NSP, PDL, PRE, TRIG)
    else:
        _attn_split_body(qkv_ptr, k_ptr, v_ptr, m_ws, l_ws, acc_ws, hkv, sp, S, qk_scale, G, D,
                         BLOCK_S, NSP, PDL, PRE, TRIG)


@triton.jit
def _attn_combine(m_ws, l_ws, acc_ws, out_ptr, NSP: tl.constexpr, D: tl.constexpr,
                  PDL: tl.constexpr, TRIG: tl.constexpr):
    h = tl.program_id(0)
    if PDL:
        if TRIG == 1:
            gdc_launch_dependents()
        gdc_wait()
    sp = tl.arange(0, NSP)
    d = tl.arange(0, D)
    m = tl.load(m_ws + h * NSP + sp)
    w = tl.exp2(m - tl.max(m, axis=0))
    l = tl.sum(w * tl.load(l_ws + h * NSP + sp), axis=0)
    acc = tl.sum(w[:, None] * tl.load(acc_ws + (h * NSP + sp)[:, None] * D + d[None, :]), axis=0)
    if PDL:
        if TRIG == 2:
            gdc_launch_dependents()
    tl.store(out_ptr + h * D + d, (acc / l).to(out_ptr.dtype.element_ty))


# --- the persistent step (batch 1): one launch, programs claim tiles in dependency order -------
# Tiles are numbered layer by layer, phase by phase (q|k|v, attention splits, combine, o,
# gate|up, down); a program claims the next with an atomic on `queue`, waits (once a phase) until
# every tile of the phase before is done (`done[phase]` counts finished tiles), computes it with
# the same tile code as the chain's kernels, then counts it done. Claiming in order cannot
# deadlock whatever the residency: the lowest unfinished tile's producers are all finished (and
# under TRITON_INTERPRET=1, where programs run one after another, program 0 does every tile).
# The last program out zeroes the counters, so the next launch (or graph replay) starts clean.


@triton.jit
def _p_wait(done_ptr, ph, need, ready, err_ptr, SPINS: tl.constexpr):
    # phase ph may start once the `need` tiles of phase ph - 1 are done; phases finish in order
    # (a tile waits for the phase before it), so a program that has seen phase ph - 1 done
    # (ready >= ph) never asks again for it or an earlier one. A probe must not hang a shared
    # GPU: after SPINS polls it gives up, flags *err_ptr and waits no more (wrong results, and
    # the probe reports the flag)
    if ph > ready:
        cnt = tl.atomic_add(done_ptr + ph - 1, 0, sem="acquire")
        n = ph * 0
        while (cnt < need) & (n < SPINS):
            cnt = tl.atomic_add(done_ptr + ph - 1, 0, sem="acquire")
            n += 1
        if cnt < need:
            tl.atomic_xchg(err_ptr, 1)
            ready = ph * 0 + (1 << 30)
        else:
            ready = ph
    return ready


@triton.jit
def _p_done(done_ptr, ph):
    tl.debug_barrier()   # every thread's stores before the release
    tl.atomic_add(done_ptr + ph, 1, sem="release")


@triton.jit
def _p_gemv(x_ptr, w_ptr, y_ptr, tile, N, K, done_ptr, ph, need, ready, NPH: tl.constexpr,
            SPINS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRE: tl.constexpr):
    # _gemv's program `tile`; x was written by other SMs in this launch: loaded through L2 (.cg)
    rn = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + (rn % N).to(tl.int64)[:, None] * K + rk[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    if PRE:
        w0 = tl.load(w_ptrs, eviction_policy="evict_first")
    ready = _p_wait(done_ptr, ph, need, ready, done_ptr + NPH, SPINS)
    if PRE:
        acc += w0.to(tl.float32) * tl.load(x_ptr + rk, cache_modifier=".cg").to(tl.float32)[None, :]
    for k in range(PRE * BLOCK_K, K, BLOCK_K):
        w = tl.load(w_ptrs + k, eviction_policy="evict_first")
        x = tl.load(x_ptr + k + rk, cache_modifier=".cg")
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    tl.store(y_ptr + rn, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty), mask=rn < N)
    _p_done(done_ptr, ph)
    return ready


@triton.jit
def _p_attn(qkv_ptr, k_ptr, v_ptr, m_ws, l_ws, acc_ws, tile, S, qk_scale, done_ptr, ph, need, ready,
            NPH: tl.constexpr, SPINS: tl.constexpr, NSP: tl.constexpr, G: tl.constexpr,
            D: tl.constexpr, BLOCK_S: tl.constexpr, PRE: tl.constexpr):
    # _attn_split's program (tile // NSP, tile % NSP)
    hkv = tile // NSP
    sp = tile % NSP
    gi = tl.arange(0, 16)
    d = tl.arange(0, D)
    s = sp * BLOCK_S + tl.arange(0, BLOCK_S)
    kv_off = hkv.to(tl.int64) * S * D + s[:, None] * D + d[None, :]
    if PRE:
        k = tl.load(k_ptr + kv_off, mask=(s < S)[:, None], other=0.0)
        v = tl.load(v_ptr + kv_off, mask=(s < S)[:, None], other=0.0)
    ready = _p_wait(done_ptr, ph, need, ready, done_ptr + NPH, SPINS)
    if not PRE:
        k = tl.load(k_ptr + kv_off, mask=(s < S)[:, None], other=0.0)
        v = tl.load(v_ptr + kv_off, mask=(s < S)[:, None], other=0.0)
    q = tl.load(qkv_ptr + (hkv * G + gi)[:, None] * D + d[None, :], mask=(gi < G)[:, None], other=0.0,
                cache_modifier=".cg")
    m_i, l_i, acc = _attn_tile(q, k, v, s, S, qk_scale)
    row = (hkv * G + gi) * NSP + sp
    tl.store(m_ws + row, m_i, mask=gi < G)
    tl.store(l_ws + row, l_i, mask=gi < G)
    tl.store(acc_ws + row[:, None] * D + d[None, :], acc, mask=(gi < G)[:, None])
    _p_done(done_ptr, ph)
    return ready


@triton.jit
def _p_combine(m_ws, l_ws, acc_ws, out_ptr, h, done_ptr, ph, need, ready, NPH: tl.constexpr,
               SPINS: tl.constexpr, NSP: tl.constexpr, D: tl.constexpr):
    # _attn_combine's program h
    ready = _p_wait(done_ptr, ph, need, ready, done_ptr + NPH, SPINS)
    sp = tl.arange(0, NSP)
    d = tl.arange(0, D)
    m = tl.load(m_ws + h * NSP + sp, cache_modifier=".cg")
    w = tl.exp2(m - tl.max(m, axis=0))
    l = tl.sum(w * tl.load(l_ws + h * NSP + sp, cache_modifier=".cg"), axis=0)
    acc = tl.sum(w[:, None] * tl.load(acc_ws + (h * NSP + sp)[:, None] * D + d[None, :], cache_modifier=".cg"),
                 axis=0)
    tl.store(out_ptr + h * D + d, (acc / l).to(out_ptr.dtype.element_ty))
    _p_done(done_ptr, ph)
    return ready


@triton.jit
def _persist(b0, b1, wqkv, wo, wgu, wd, kc, vc, m_ws, l_ws, acc_ws, queue, exit_cnt, done, S, qk_scale,
             LAYERS: tl.constexpr, DIM: tl.constexpr, NQKV: tl.constexpr, NGU: tl.constexpr,
             NI: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
             BLOCK_S: tl.constexpr, NSP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
             BN_D: tl.constexpr, BK_D: tl.constexpr, T0: tl.constexpr, T1: tl.constexpr,
             T2: tl.constexpr, T3: tl.constexpr, T4: tl.constexpr, T5: tl.constexpr,
             NPH2: tl.constexpr, PRE: tl.constexpr, SPINS: tl.constexpr):
    # the chain's step: per layer q|k|v b0 -> b1, attention on b1 (its output over q in b1),
    # o b1 -> b0, gate|up b0 -> b1, down (the first NI of b1) -> b0; Tn: tiles of phase n;
    # done[LAYERS * 6] is the spin-limit flag (see _p_wait), left for the host to read
    TL: tl.constexpr = T0 + T1 + T2 + T3 + T4 + T5
    NPH: tl.constexpr = LAYERS * 6
    ready = tl.program_id(0) * 0
    t = tl.atomic_add(queue, 1)
    while t < LAYERS * TL:
        layer = t // TL
        r = t - layer * TL
        li = layer.to(tl.int64)
        ph = layer * 6
        if r < T0:
            ready = _p_gemv(b0, wqkv + li * (NQKV * DIM), b1, r, NQKV, DIM, done, ph, T5, ready, NPH, SPINS,
                            BLOCK_N=BN, BLOCK_K=BK, PRE=PRE)
        elif r < T0 + T1:
            ready = _p_attn(b1, kc + li * (HKV * D) * S, vc + li * (HKV * D) * S, m_ws, l_ws, acc_ws, r - T0,
                            S, qk_scale, done, ph + 1, T0, ready, NPH, SPINS, NSP=NSP, G=G, D=D,
                            BLOCK_S=BLOCK_S, PRE=PRE)
        elif r < T0 + T1 + T2:
            ready = _p_combine(m_ws, l_ws, acc_ws, b1, r - T0 - T1, done, ph + 2, T1, ready, NPH, SPINS,
                               NSP=NSP, D=D)
        elif r < T0 + T1 + T2 + T3:
            ready = _p_gemv(b1, wo + li * (DIM * DIM), b0, r - T0 - T1 - T2, DIM, DIM, done, ph + 3, T2,
                            ready, NPH, SPINS, BLOCK_N=BN, BLOCK_K=BK, PRE=PRE)
        elif r < T0 + T1 + T2 + T3 + T4:
            ready = _p_gemv(b0, wgu + li * (NGU * DIM), b1, r - T0 - T1 - T2 - T3, NGU, DIM, done, ph + 4,
                            T3, ready, NPH, SPINS, BLOCK_N=BN, BLOCK_K=BK, PRE=PRE)
        else:
            ready = _p_gemv(b1, wd + li * (DIM * NI), b0, r - T0 - T1 - T2 - T3 - T4, DIM, NI, done, ph + 5,
                            T4, ready, NPH, SPINS, BLOCK_N=BN_D, BLOCK_K=BK_D, PRE=PRE)
        t = tl.atomic_add(queue, 1)
    if tl.atomic_add(exit_cnt, 1) == tl.num_programs(0) - 1:
        # the last program out: every tile is done and no program reads a counter any more
        tl.store(queue, 0)
        i = tl.arange(0, NPH2)
        tl.store(done + i, 0, mask=i < NPH)
        tl.store(exit_cnt, 0)


# chain name -> (PDL, PRE, TRIG[, the attention's TRIG[, its PRE]]; the attention's default to
# the GEMVs', its PRE at most 1); "gemv+pre" is the first probe's (one tile, trigger first).
# "pre+af": only the attention and its combine let the next kernel launch at once, so o's
# programs, placed while the latency-bound attention runs, load their first weight tile then
# (at batch 1 with the attention; elsewhere it is "pre")
MODES = {"plain": (0, 0, 0), "wait": (1, 0, 0), "wait+late": (1, 0, 2), "pre": (1, 1, 0),
         "pre+late": (1, 1, 2), "pre2+late": (1, 2, 2), "pre+first": (1, 1, 1), "pre+af": (1, 1, 0, 1),
         # pre+late split in two: only the attention's K and V tiles, or only the GEMVs' first tile
         "late+apre": (1, 0, 2, 2, 1), "late+gpre": (1, 1, 2, 2, 0)}
ATTENTION_MODES = {name for name, mode in MODES.items() if len(mode) > 3}   # differ only with attention
# Llama-3-8B's decode shapes; blocks: (BLOCK_N, BLOCK_K, num_warps) of the GEMV per K, what the
# issue-13 search kept for the linear template; pf: (prefetch programs a kv head, elements a
# load) of the "+pfNN" chains. `small()` is a model the interpreter runs in a test.
LLAMA = dict(dim=4096, hq=32, hkv=8, hd=128, inter=14336, block_s=64,
             blocks={4096: (8, 1024, 8), 14336: (16, 512, 4)}, pf=(32, 2048))


def small() -> dict:
    return dict(dim=64, hq=4, hkv=2, hd=16, inter=64, block_s=16, blocks={64: (8, 32, 4)}, pf=(2, 64))


def shapes(dims: dict) -> list:
    """(name, K, N) of one layer's four projections, in step order."""
    dim, hq, hkv, hd, inter = (dims[k] for k in ("dim", "hq", "hkv", "hd", "inter"))
    return [("qkv", dim, (hq + 2 * hkv) * hd), ("o", hq * hd, dim), ("gate_up", dim, 2 * inter),
            ("down", inter, dim)]


def build(dims: dict, layers: int, S: int, dev, gen) -> dict:
    """One layer-stacked weight tensor a projection (the chain uses its per-layer views, the
    persistent kernel the whole) and one K and one V cache [layers, Hkv, S, D]."""
    hq, hkv, hd = dims["hq"], dims["hkv"], dims["hd"]
    w = {name: (torch.randn(layers, n, k, device=dev, generator=gen) / k ** 0.5).to(torch.bfloat16)
         for name, k, n in shapes(dims)}
    nsp = triton.cdiv(S, dims["block_s"]) if S else 0
    m = {"dims": dims, "layers": layers, "S": S, "nsp": nsp, "w": w,
         "width": max(max(k, n) for _, k, n in shapes(dims)),
         "weight_bytes": sum(t.numel() * t.element_size() for t in w.values()),
         "kv": tuple(torch.randn(layers, hkv, S, hd, device=dev, generator=gen).to(torch.bfloat16)
                     for _ in range(2)) if S else (),
         "ws": (torch.empty(hq * nsp, device=dev), torch.empty(hq * nsp, device=dev),
                torch.empty(hq * nsp * hd, device=dev)) if S else ()}
    m["kv_bytes"] = sum(c.numel() * c.element_size() for c in m["kv"])
    return m


def chain(m: dict, impl: str, M: int, bufs: list):
    """The step as a chain of kernels, launched as `impl` says (a MODES name, "cublas", or a
    MODES name + "+pfNN": the attention's extra programs read NN% of the o weight into L2);
    returns a callable that runs it and returns the buffer that holds the step's output."""
    base, _, pct = impl.partition("+pf")
    pdl, pre, trig, *attn = MODES.get(base, (0, 0, 0))
    atrig = attn[0] if attn else trig
    apre = attn[1] if len(attn) > 1 else min(pre, 1)
    d, S, nsp = m["dims"], m["S"], m["nsp"]
    hq, hkv, hd = d["hq"], d["hkv"], d["hd"]
    pf_progs, pf_block = d["pf"]
    pf_part = 0
    if pct:
        # elements a prefetch program reads: a whole number of its 4-block rounds
        o_numel = m["w"]["o"][0].numel()
        pf_part = int(o_numel * int(pct) / 100) // (hkv * pf_progs) // (4 * pf_block) * (4 * pf_block)

    def step():
        i = 0
        for li in range(m["layers"]):
            for name, k, n in shapes(d):
                w = m["w"][name][li]
                x, y = bufs[i % 2][:M * k].view(M, k), bufs[(i + 1) % 2][:M * n].view(M, n)
                if name == "o" and M == 1 and S:
                    # attention of the q|k|v just written (x); its output replaces q in x
                    kc, vc = m["kv"][0][li], m["kv"][1][li]
                    _attn_split[(hkv, nsp + (pf_progs if pf_part else 0))](
                        x, kc, vc, *m["ws"], S, 1.4426950408889634 / hd ** 0.5, m["w"]["o"][li],
                        G=hq // hkv, D=hd, BLOCK_S=d["block_s"], NSP=nsp, PDL=pdl, PRE=apre, TRIG=atrig,
                        PF_PART=pf_part, PF_BLOCK=pf_block, num_warps=2, launch_pdl=bool(pdl))
                    _attn_combine[(hq,)](*m["ws"], x, NSP=nsp, D=hd, PDL=pdl, TRIG=atrig, num_warps=2,
                                         launch_pdl=bool(pdl))
                if impl == "cublas":
                    torch.nn.functional.linear(x, w, out=y)
                elif M == 1:
                    bn, bk, warps = d["blocks"][k]
                    _gemv[(triton.cdiv(n, bn),)](x, w, y, n, k, BLOCK_N=bn, BLOCK_K=bk, PDL=pdl,
                                                 PRE=pre, TRIG=trig, num_warps=warps,
                                                 launch_pdl=bool(pdl))
                else:
                    bn = 64 if n > 8192 else 32
                    _gemm32[(triton.cdiv(n, bn),)](x, w, y, n, k, M=M, BLOCK_N=bn, BLOCK_K=128,
                                                   PDL=pdl, PRE=min(pre, 1), TRIG=trig, STAGES=4,
                                                   num_warps=4, launch_pdl=bool(pdl))
                i += 1
        return bufs[i % 2]
    return step


def persistent(m: dict, bufs: list, programs: int, pre: int, num_warps: int = 8, spins: int = 1 << 20,
               maxnreg: int | None = None):
    """The batch-1 step with attention as one launch of `programs` programs (_persist); `maxnreg`
    caps its registers a thread (ptxas gives it ~175 at 8 warps: one program an SM). Its
    counters (queue, exit, one a phase, then the spin-limit flag) are allocated zeroed once and
    every launch leaves them zeroed, the flag excepted: `step.gave_up()` says whether a wait hit
    its limit (the results are then wrong) and clears it."""
    d, S, nsp = m["dims"], m["S"], m["nsp"]
    (_, dim, nqkv), _, (_, _, ngu), (_, ni, _) = shapes(d)
    assert d["hq"] * d["hd"] == dim and d["hq"] // d["hkv"] <= 16 and nsp & (nsp - 1) == 0
    bn, bk, _ = d["blocks"][dim]
    bn_d, bk_d, _ = d["blocks"][ni]
    tiles = (triton.cdiv(nqkv, bn), d["hkv"] * nsp, d["hq"], triton.cdiv(dim, bn), triton.cdiv(ngu, bn),
             triton.cdiv(dim, bn_d))
    nph = 6 * m["layers"]
    counters = torch.zeros(3 + nph, dtype=torch.int32, device=bufs[0].device)
    w = m["w"]

    def step():
        step.compiled = _persist[(programs,)](
            bufs[0], bufs[1], w["qkv"], w["o"], w["gate_up"], w["down"], *m["kv"], *m["ws"], counters[0:],
            counters[1:], counters[2:], S, 1.4426950408889634 / d["hd"] ** 0.5, LAYERS=m["layers"], DIM=dim,
            NQKV=nqkv, NGU=ngu, NI=ni, HKV=d["hkv"], G=d["hq"] // d["hkv"], D=d["hd"], BLOCK_S=d["block_s"],
            NSP=nsp, BN=bn, BK=bk, BN_D=bn_d, BK_D=bk_d, T0=tiles[0], T1=tiles[1], T2=tiles[2], T3=tiles[3],
            T4=tiles[4], T5=tiles[5], NPH2=triton.next_power_of_2(nph), PRE=pre, SPINS=spins,
            num_warps=num_warps, **({"maxnreg": maxnreg} if maxnreg else {}))
        return bufs[0]

    def gave_up() -> bool:
        flag = bool(counters[-1].item())
        counters[-1] = 0
        return flag

    step.counters, step.tiles, step.gave_up, step.compiled = counters, tiles, gave_up, None
    return step


def check_small(layers: int = 2, S: int = 30, programs: int = 3, device: str = "cpu") -> dict:
    """The persistent step and the chain with L2 prefetch programs against the plain chain on
    `small()` (run under TRITON_INTERPRET=1 on a CPU, where program 0 of the persistent step
    claims every tile and no wait ever spins): max |difference|, bits equal; for the persistent
    step also the counters after a launch (all zero) and the tiles each phase counted done in a
    launch whose last program never resets them (the `need` of the phase after it)."""
    gen = torch.Generator(device=device).manual_seed(1)
    m = build(small(), layers, S, device, gen)
    x0 = torch.randn(m["width"], device=device, generator=gen).to(torch.bfloat16)
    out, report = {}, {}
    for name in ("plain", "persist", "persist+pre", "plain+pf50", "plain+pf100"):
        bufs = [x0.clone(), torch.full_like(x0, float("nan"))]
        step = (persistent(m, bufs, programs, int(name.endswith("+pre")), num_warps=4)
                if name.startswith("persist") else chain(m, name, 1, bufs))
        out[name] = step().clone()
        if name == "plain":
            continue
        report[name] = {"max_abs_diff": (out[name].float() - out["plain"].float()).abs().max().item(),
                        "bits_equal": bool(torch.equal(out[name], out["plain"]))}
        if not name.startswith("persist"):
            continue
        report[name].update(counters_after=step.counters.tolist(), tiles=list(step.tiles))
        step.counters[1] = -(1 << 20)   # the exit count never reaches the last program's
        bufs[0].copy_(x0)
        step()
        report[name]["done_per_phase"] = step.counters[2:-1].tolist()
        report[name]["gave_up"] = step.gave_up()
    return report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--batches", default="1,32", help="comma-separated: 1 (GEMV) and/or 32 (wgmma tile)")
    ap.add_argument("--attention", type=int, default=2048, metavar="S",
                    help="batch 1: split-KV attention over S cached tokens (64-token splits) and its "
                         "combine between q|k|v and o in every layer (0: none)")
    ap.add_argument("--persistent", default="1,2", metavar="P[,P]",
                    help="batch 1 with attention: the persistent step with P programs of 8 warps an SM "
                         "(registers capped to fit), each with and without its tiles' first weight (K/V) "
                         "load before its wait (empty: none)")
    ap.add_argument("--l2-prefetch", default="25,50,100", metavar="PCT[,PCT]",
                    help="batch 1 with attention: chains whose attention kernel has 32 extra programs a "
                         "kv head reading PCT%% of the next o weight into L2 (with the wait first, and "
                         "with early reads); empty: none")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    if a.attention and (a.attention % 64 or a.attention & (a.attention // 64 - 1)):
        ap.error("--attention: S must be 64 times a power of two (1024, 2048, 4096, ...), or 0")
    try:
        per_sm = [int(v) for v in a.persistent.split(",") if v.strip()]
        pf_pcts = [int(v) for v in a.l2_prefetch.split(",") if v.strip()]
        batches = [int(v) for v in a.batches.split(",")]
    except ValueError:
        ap.error("--persistent, --l2-prefetch and --batches take comma-separated integers")
    if any(p < 1 or p > 100 for p in pf_pcts):
        ap.error("--l2-prefetch: percentages 1..100")
    if any(b not in (1, 32) for b in batches):
        ap.error("--batches: 1 (GEMV) and/or 32 (wgmma tile)")
    if any(p < 1 or p > 4 for p in per_sm):
        ap.error("--persistent: programs an SM must be 1..4 (8 warps each; 4 leaves 64 registers a thread)")
    if not torch.cuda.is_available():
        print("pdl_probe: needs a CUDA GPU (sm_90+); nothing measured", file=sys.stderr)
        return 2
    if gdc_wait is None:
        print("pdl_probe: this triton has no gdc_wait; nothing measured", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    S = a.attention
    m = build(LLAMA, a.layers, S, dev, g)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    wbytes, kvbytes = m["weight_bytes"], m["kv_bytes"]
    flush = torch.empty(2 * torch.cuda.get_device_properties(dev).L2_cache_size, dtype=torch.uint8,
                        device=dev)
    src = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)

    def copy_bw():
        ts = []
        for _ in range(10):
            s, e = torch.cuda.Event(True), torch.cuda.Event(True)
            s.record(); dst.copy_(src); e.record(); torch.cuda.synchronize()
            ts.append(s.elapsed_time(e))
        return 2 * src.numel() / (statistics.median(ts) * 1e-3)

    bw = copy_bw()
    floor_ms = wbytes / bw * 1e3
    floor_attn_ms = (wbytes + kvbytes) / bw * 1e3   # batch 1 with the attention
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "layers": a.layers, "weight_bytes": wbytes, "kv_bytes_batch1": kvbytes, "copy_bytes_per_s": bw,
              "floor_ms": floor_ms, "floor_batch1_ms": floor_attn_ms, "attention_S": S, "sms": sms,
              "batches": {}}
    print(f"pdl_probe: {torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}; "
          f"{a.layers} layers x 4 projections, bf16, weights {wbytes / 1e6:.0f} MB, copy {bw / 1e9:.0f} GB/s, "
          f"weight floor {floor_ms * 1e3:.1f} us; one CUDA graph a step, L2 flushed, median of {a.reps}")
    if S:
        print(f"batch 1 also runs split-KV attention over {S} cached tokens ({m['nsp']} splits, then a combine) "
              f"between q|k|v and o: KV {kvbytes / 1e6:.0f} MB, floor {floor_attn_ms * 1e3:.1f} us")
    # batch 1 last: its persistent rows are the ones that could stall
    for M in sorted(batches, key=lambda b: b == 1):
        # Activations: two ping-pong buffers wide enough for any K or N (x of a call = the
        # previous call's y); values stay O(1) because each weight row has norm ~1.
        bufs = [torch.randn(M * m["width"], device=dev, generator=g).to(torch.bfloat16) for _ in range(2)]
        x0 = bufs[0].clone()
        steps = {impl: chain(m, impl, M, bufs) for impl in ("cublas", *MODES)
                 if impl not in ATTENTION_MODES or (M == 1 and S)}
        if M == 1 and S:
            for pct in pf_pcts:
                for base in ("wait", "pre"):
                    steps[f"{base}+pf{pct}"] = chain(m, f"{base}+pf{pct}", M, bufs)
            for p in per_sm:
                for pre in (0, 1):
                    # 64K registers an SM shared by p programs of 256 threads (ptxas rounds to 8)
                    cap = 65536 // (p * 256) // 8 * 8
                    steps[f"persist{p}" + ("+pre" if pre else "")] = persistent(
                        m, bufs, p * sms, pre, maxnreg=cap if cap < 255 else None)
        rows, outputs = [], {}
        report["batches"][str(M)] = rows

        def save():   # after each row: what was measured survives a later failure or timeout
            if a.json:
                with open(a.json, "w") as f:
                    json.dump(report, f, indent=1)

        for impl in [*steps, "plain", "wait"]:   # the last two again: the spread
            step = steps[impl]
            row = {"impl": impl}
            try:
                for _ in range(3):
                    bufs[0].copy_(x0); step()
                    torch.cuda.synchronize()
                    if hasattr(step, "gave_up") and step.gave_up():
                        raise RuntimeError("a persistent wait gave up (its phase never completed): "
                                           "results wrong, not timed")
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    out = step()
                times = []
                for r in range(a.reps):
                    bufs[0].copy_(x0)
                    flush.zero_()
                    s, e = torch.cuda.Event(True), torch.cuda.Event(True)
                    s.record(); graph.replay(); e.record(); torch.cuda.synchronize()
                    times.append(s.elapsed_time(e))
                outputs.setdefault(impl, out.clone())
                med = statistics.median(times)
                q = statistics.quantiles(times, n=10)
                fl = floor_attn_ms if M == 1 else floor_ms
                nk = 6 if M == 1 and S else 4
                row.update(ms=med, p10=q[0], p90=q[-1], pct_floor=100 * fl / med,
                           us_per_kernel_over_floor=(med - fl) * 1e3 / (nk * a.layers))
                if hasattr(step, "gave_up"):
                    row["gave_up_waiting"] = step.gave_up()   # a wait hit its limit: results wrong
                    row["counters_zero_after"] = not bool(step.counters.any())
                    row["regs"] = getattr(step.compiled, "n_regs", None)
                    row["spills"] = getattr(step.compiled, "n_spills", None)
                del graph
            except Exception as exc:  # report, go on with the next chain
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            rows.append(row)
            print(f"  batch {M} {impl}: " + (f"{row['ms'] * 1e3:.1f} us" if "ms" in row else row["error"]),
                  flush=True)
            save()
        base = outputs.get("plain")
        plain_ms = next((r["ms"] for r in rows if r["impl"] == "plain" and "ms" in r), None)
        for row in rows:
            name = row["impl"]
            if name != "cublas" and name != "plain" and name in outputs and base is not None:
                # the persistent step reduces its tiles with 8 warps, the chain's down with 4:
                # its bits may differ from plain's by a rounding, never more
                row["bitwise_equal_to_plain"] = bool(torch.equal(outputs[name], base))
                row["max_rel_diff_vs_plain"] = ((outputs[name].float() - base.float()).abs().max()
                                                / base.float().abs().max()).item()
            if "ms" in row and rows[0].get("ms"):
                row["speedup_vs_cublas"] = rows[0]["ms"] / row["ms"]
                row["speedup_vs_plain"] = plain_ms / row["ms"] if plain_ms else None
        print(f"batch {M}: {'GEMV' if M == 1 else 'tl.dot, weight tile left (wgmma)'}"
              + (" + Triton split-KV attention and combine (plain launches in the cublas chain)" if M == 1 and S else ""))
        print(f"{'chain':<13} {'us/step':>9} {'p10':>8} {'p90':>8} {'% floor':>8} {'us/kernel over floor':>21} "
              f"{'vs cublas':>9} {'vs plain':>9}  same bits (max rel diff)")
        for r in rows:
            if "error" in r:
                print(f"{r['impl']:<13} error: {r['error']}")
                continue
            same = r.get("bitwise_equal_to_plain", "-")
            if same is False:
                same = f"False ({r['max_rel_diff_vs_plain']:.1e})"
            print(f"{r['impl']:<13} {r['ms'] * 1e3:9.1f} {r['p10'] * 1e3:8.1f} {r['p90'] * 1e3:8.1f} "
                  f"{r['pct_floor']:8.1f} {r['us_per_kernel_over_floor']:21.2f} {r.get('speedup_vs_cublas') or 0:8.3f}x "
                  f"{r['speedup_vs_plain'] or 0:8.3f}x  {same}"
                  + ("" if r.get("counters_zero_after", True) else "  COUNTERS NOT ZERO")
                  + ("  A WAIT GAVE UP (results wrong)" if r.get("gave_up_waiting") else "")
                  + (f"  ({r['regs']} registers, {r['spills']} spilled)" if r.get("regs") else ""))
        save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
