"""Probe: does programmatic dependent launch (PDL) close the per-kernel gap of a decode step?

A decode step at batch 1 is a chain of GEMVs, each reading the previous one's output. Every
kernel boundary costs a launch, a ramp (the first weight bytes arrive ~1 us after the start) and
a tail (the last programs finish while most SMs idle). With PDL (sm_90+) the next kernel is
launched while the previous one still runs; it may read its weights (never written during
decode) before `gdc_wait()`, and must read its input and write its output only after it.

This probe times one Llama-3-8B-shaped step without the head (per layer: q|k|v 4096->6144,
o 4096->4096, gate|up 4096->28672, down 14336->4096; bf16; batch 1) as one CUDA graph of
4 x LAYERS kernels, L2 flushed before each replay, median of REPS replays:

  cublas      F.linear(out=) chain (what torch runs)
  gemv        a plain Triton GEMV chain
  gemv+wait   the same kernels launched with launch_pdl=True, gdc_wait() before any load
  gemv+pre    launch_pdl=True; each program loads its first weight tile and calls
              gdc_launch_dependents() before gdc_wait(), then reads x

and checks that every PDL chain's final output equals the plain chain's bit for bit (a missing
or misplaced wait would race and differ). Not a kernel search: a fact for the next design step.
Read-only: changes no GPU setting.   python3 bench/pdl_probe.py [--layers 8] [--json F]
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
          MODE: tl.constexpr):
    # MODE 0: no PDL calls; 1: gdc_wait() first; 2: first weight tile, launch_dependents, wait
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + (rn % N).to(tl.int64)[:, None] * K + rk[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    if MODE == 2:
        w = tl.load(w_ptrs, eviction_policy="evict_first")
        gdc_launch_dependents()
        gdc_wait()
        x = tl.load(x_ptr + rk)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        k0 = BLOCK_K
    else:
        if MODE == 1:
            gdc_wait()
        k0 = 0
    for k in range(k0, K, BLOCK_K):
        w = tl.load(w_ptrs + k, eviction_policy="evict_first")
        x = tl.load(x_ptr + k + rk)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    tl.store(y_ptr + rn, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty), mask=rn < N)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("pdl_probe: needs a CUDA GPU (sm_90+); nothing measured", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    layers = [[(name, k, n, (torch.randn(n, k, device=dev, generator=g) / k ** 0.5).to(torch.bfloat16))
               for name, k, n in SHAPES] for _ in range(a.layers)]
    # Activations: two ping-pong buffers wide enough for any K or N (x of a call = the
    # previous call's y); values stay O(1) because each weight row has norm ~1.
    width = max(max(k, n) for _, k, n in SHAPES)
    bufs = [torch.randn(width, device=dev, generator=g).to(torch.bfloat16) for _ in range(2)]
    x0 = bufs[0].clone()
    wbytes = sum(w.numel() * w.element_size() for layer in layers for *_, w in layer)

    def chain(impl):
        def step():
            i = 0
            for layer in layers:
                for _name, k, n, w in layer:
                    x, y = bufs[i % 2], bufs[(i + 1) % 2]
                    if impl == "cublas":
                        torch.nn.functional.linear(x[:k].view(1, k), w, out=y[:n].view(1, n))
                    else:
                        bn, bk, warps = BLOCKS[k]
                        mode = {"gemv": 0, "gemv+wait": 1, "gemv+pre": 2}[impl]
                        _gemv[(triton.cdiv(n, bn),)](x, w, y, n, k, BLOCK_N=bn, BLOCK_K=bk, MODE=mode,
                                                     num_warps=warps, launch_pdl=mode > 0)
                    i += 1
            return bufs[i % 2]
        return step

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
    rows, outputs = [], {}
    for impl in ("cublas", "gemv", "gemv+wait", "gemv+pre"):
        step = chain(impl)
        row = {"impl": impl}
        try:
            if impl.startswith("gemv+") and gdc_wait is None:
                raise RuntimeError("this triton has no gdc_wait")
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
            outputs[impl] = out.clone()
            med = statistics.median(times)
            q = statistics.quantiles(times, n=10)
            row.update(ms=med, p10=q[0], p90=q[-1], pct_floor=100 * floor_ms / med,
                       us_per_kernel_over_floor=(med - floor_ms) * 1e3 / (4 * a.layers))
            del graph
        except Exception as exc:  # report, go on with the next chain
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        rows.append(row)
    base = outputs.get("gemv")
    for row in rows:
        if row["impl"].startswith("gemv+") and row["impl"] in outputs and base is not None:
            row["bitwise_equal_to_gemv"] = bool(torch.equal(outputs[row["impl"]], base))
        if "ms" in row and rows[0].get("ms"):
            row["speedup_vs_cublas"] = rows[0]["ms"] / row["ms"]
    print(f"pdl_probe: {torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}; "
          f"{a.layers} layers x 4 GEMVs, batch 1, bf16, weights {wbytes / 1e6:.0f} MB, copy {bw / 1e9:.0f} GB/s, "
          f"floor {floor_ms * 1e3:.1f} us; CUDA graph, L2 flushed, median of {a.reps}")
    print(f"{'chain':<11} {'us/step':>9} {'p10':>8} {'p90':>8} {'% floor':>8} {'us/kernel over floor':>21} "
          f"{'vs cublas':>9}  same bits")
    for r in rows:
        if "error" in r:
            print(f"{r['impl']:<11} error: {r['error']}")
            continue
        print(f"{r['impl']:<11} {r['ms'] * 1e3:9.1f} {r['p10'] * 1e3:8.1f} {r['p90'] * 1e3:8.1f} "
              f"{r['pct_floor']:8.1f} {r['us_per_kernel_over_floor']:21.2f} {r['speedup_vs_cublas']:8.2f}x  "
              f"{r.get('bitwise_equal_to_gemv', '-')}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "triton": triton.__version__, "layers": a.layers, "weight_bytes": wbytes,
                       "copy_bytes_per_s": bw, "floor_ms": floor_ms, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
