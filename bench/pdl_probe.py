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

and checks that every PDL chain's final output equals the plain chain's bit for bit (a missing
or misplaced wait would race and differ). Not a kernel search: a fact for the next design step.
Read-only: changes no GPU setting.   python3 bench/pdl_probe.py [--layers 8] [--batches 1,32] [--json F]
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

SHAPES = [("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 28672), ("down", 14336, 4096)]
# (BLOCK_N, BLOCK_K, num_warps) per K: what the issue-13 search kept for the linear template
BLOCKS = {4096: (8, 1024, 8), 14336: (16, 512, 4)}


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
def _attn_split(qkv_ptr, k_ptr, v_ptr, m_ws, l_ws, acc_ws, S, qk_scale, G: tl.constexpr,
                D: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr, PRE: tl.constexpr,
                TRIG: tl.constexpr):
    # batch 1 split-KV decode attention over a cache of S tokens, one (kv head, BLOCK_S tokens)
    # a program (as the kept rope_kv_attention config at batch 1: 64 splits of one 64-token tile).
    # The probe's cache is never written (the real kernel also writes the new token's slot).
    # PRE: the program's K and V tiles loaded before the wait (the kernel before it, the q|k|v
    # projection, does not write the cache)
    hkv = tl.program_id(0)
    sp = tl.program_id(1)
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
    qk = tl.dot(q, tl.trans(k)) * qk_scale
    qk = tl.where((s < S)[None, :], qk, -float("inf"))
    m_i = tl.max(qk, axis=1)
    pr = tl.exp2(qk - m_i[:, None])
    l_i = tl.sum(pr, axis=1)
    acc = tl.dot(pr.to(v.dtype), v)
    if PDL:
        if TRIG == 2:
            gdc_launch_dependents()
    nsp = tl.num_programs(1)
    row = (hkv * G + g) * nsp + sp
    tl.store(m_ws + row, m_i, mask=g < G)
    tl.store(l_ws + row, l_i, mask=g < G)
    tl.store(acc_ws + row[:, None] * D + d[None, :], acc, mask=(g < G)[:, None])


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


# chain name -> (PDL, PRE, TRIG); "gemv+pre" is the first probe's (one tile, trigger first)
MODES = {"plain": (0, 0, 0), "wait": (1, 0, 0), "wait+late": (1, 0, 2), "pre": (1, 1, 0),
         "pre+late": (1, 1, 2), "pre2+late": (1, 2, 2), "pre+first": (1, 1, 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--batches", default="1,32", help="comma-separated: 1 (GEMV) and/or 32 (wgmma tile)")
    ap.add_argument("--attention", type=int, default=2048, metavar="S",
                    help="batch 1: split-KV attention over S cached tokens (64-token splits) and its "
                         "combine between q|k|v and o in every layer (0: none)")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    if a.attention and (a.attention % 64 or a.attention & (a.attention // 64 - 1)):
        ap.error("--attention: S must be 64 times a power of two (1024, 2048, 4096, ...), or 0")
    if not torch.cuda.is_available():
        print("pdl_probe: needs a CUDA GPU (sm_90+); nothing measured", file=sys.stderr)
        return 2
    if gdc_wait is None:
        print("pdl_probe: this triton has no gdc_wait; nothing measured", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    layers = [[(name, k, n, (torch.randn(n, k, device=dev, generator=g) / k ** 0.5).to(torch.bfloat16))
               for name, k, n in SHAPES] for _ in range(a.layers)]
    width = max(max(k, n) for _, k, n in SHAPES)
    wbytes = sum(w.numel() * w.element_size() for layer in layers for *_, w in layer)
    HQ, HKV, HD, BS = 32, 8, 128, 64
    S = a.attention
    nsp = triton.cdiv(S, BS) if S else 0
    caches = [(torch.randn(HKV, S, HD, device=dev, generator=g).to(torch.bfloat16),
               torch.randn(HKV, S, HD, device=dev, generator=g).to(torch.bfloat16)) for _ in layers] if S else []
    ws = (torch.empty(HQ * nsp, device=dev), torch.empty(HQ * nsp, device=dev),
          torch.empty(HQ * nsp * HD, device=dev)) if S else ()
    kvbytes = sum(c.numel() * c.element_size() for kv in caches for c in kv)
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
              "floor_ms": floor_ms, "floor_batch1_ms": floor_attn_ms, "attention_S": S,
              "batches": {}}
    print(f"pdl_probe: {torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}; "
          f"{a.layers} layers x 4 projections, bf16, weights {wbytes / 1e6:.0f} MB, copy {bw / 1e9:.0f} GB/s, "
          f"weight floor {floor_ms * 1e3:.1f} us; one CUDA graph a step, L2 flushed, median of {a.reps}")
    if S:
        print(f"batch 1 also runs split-KV attention over {S} cached tokens ({nsp} splits, then a combine) "
              f"between q|k|v and o: KV {kvbytes / 1e6:.0f} MB, floor {floor_attn_ms * 1e3:.1f} us")
    for M in (int(v) for v in a.batches.split(",")):
        # Activations: two ping-pong buffers wide enough for any K or N (x of a call = the
        # previous call's y); values stay O(1) because each weight row has norm ~1.
        bufs = [torch.randn(M * width, device=dev, generator=g).to(torch.bfloat16) for _ in range(2)]
        x0 = bufs[0].clone()

        def chain(impl):
            pdl, pre, trig = MODES.get(impl, (0, 0, 0))

            def step():
                i = 0
                for li, layer in enumerate(layers):
                    for name, k, n, w in layer:
                        x, y = bufs[i % 2][:M * k].view(M, k), bufs[(i + 1) % 2][:M * n].view(M, n)
                        if name == "o" and M == 1 and S:
                            # attention of the q|k|v just written (x); its output replaces q in x
                            kc, vc = caches[li]
                            _attn_split[(HKV, nsp)](x, kc, vc, *ws, S, 1.4426950408889634 / HD ** 0.5,
                                                    G=HQ // HKV, D=HD, BLOCK_S=BS, PDL=pdl, PRE=min(pre, 1),
                                                    TRIG=trig, num_warps=2, launch_pdl=bool(pdl))
                            _attn_combine[(HQ,)](*ws, x, NSP=nsp, D=HD, PDL=pdl, TRIG=trig, num_warps=2,
                                                 launch_pdl=bool(pdl))
                        if impl == "cublas":
                            torch.nn.functional.linear(x, w, out=y)
                        elif M == 1:
                            bn, bk, warps = BLOCKS[k]
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

        rows, outputs = [], {}
        order = ["cublas", *MODES, "plain", "wait"]   # the last two again: the spread
        for impl in order:
            step = chain(impl)
            row = {"impl": impl}
            try:
                for _ in range(3):
                    bufs[0].copy_(x0); step()
                torch.cuda.synchronize()
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
                del graph
            except Exception as exc:  # report, go on with the next chain
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            rows.append(row)
        base = outputs.get("plain")
        plain_ms = next((r["ms"] for r in rows if r["impl"] == "plain" and "ms" in r), None)
        for row in rows:
            if row["impl"] in MODES and row["impl"] != "plain" and row["impl"] in outputs and base is not None:
                row["bitwise_equal_to_plain"] = bool(torch.equal(outputs[row["impl"]], base))
            if "ms" in row and rows[0].get("ms"):
                row["speedup_vs_cublas"] = rows[0]["ms"] / row["ms"]
                row["speedup_vs_plain"] = plain_ms / row["ms"] if plain_ms else None
        print(f"batch {M}: {'GEMV' if M == 1 else 'tl.dot, weight tile left (wgmma)'}"
              + (" + Triton split-KV attention and combine (plain launches in the cublas chain)" if M == 1 and S else ""))
        print(f"{'chain':<11} {'us/step':>9} {'p10':>8} {'p90':>8} {'% floor':>8} {'us/kernel over floor':>21} "
              f"{'vs cublas':>9} {'vs plain':>9}  same bits")
        for r in rows:
            if "error" in r:
                print(f"{r['impl']:<11} error: {r['error']}")
                continue
            print(f"{r['impl']:<11} {r['ms'] * 1e3:9.1f} {r['p10'] * 1e3:8.1f} {r['p90'] * 1e3:8.1f} "
                  f"{r['pct_floor']:8.1f} {r['us_per_kernel_over_floor']:21.2f} {r['speedup_vs_cublas']:8.3f}x "
                  f"{r['speedup_vs_plain'] or 0:8.3f}x  {r.get('bitwise_equal_to_plain', '-')}")
        report["batches"][str(M)] = rows
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
