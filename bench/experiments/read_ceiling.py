"""Experiment: how fast can one kernel read a decode projection's weight bytes at all?

Trusted code, not a candidate and not a template. Issue 13 asks the 4096x4096 projection (33.5 MB
of bf16) for 85% of copy bandwidth. This measures the ceiling any kernel of that size meets: a
kernel that only reads the bytes (a sum, so that every byte is used; no x, no math to speak of,
one float stored a program), over a grid of launch shapes, for each decode weight of the
built-in Llama-3-8B-shaped model (O 33.5 MB, QKV 50 MB, down 117 MB, gate|up 235 MB):
  - plain: one CUDA graph of CALLS launches, each on its own weight, L2 flushed before each
    replay, median of the replays (kernelsearch.harness.timing, as the harness times);
  - pdl: the same chain launched with programmatic dependent launch, each kernel waiting first
    and letting the next one launch after its loop (the step's default "late" trigger): the
    next kernel's launch overlaps this one's tail, as in the decode step;
  - the linear_residual template's CONFIGS at the O shape, batch 1 and 32 (plain launches, the
    same timer), for the template's distance from the ceiling in the same run.
% of copy = bytes / time / the bench's copy bandwidth (daemon.bench.run: a 2 GB device copy,
read + written bytes over its median time), the figure the step's floor uses. Every sum is
checked against an fp64 sum first.

With --sweep it also times a wider slice of linear_residual's SPACE at the O shape than its
CONFIGS (batch 1: gemv tiles of 4-8 rows, up to 16 K splits, so that many programs each load one
or two tiles, as the fastest reads do; batch 32: swapab tiles with up to 8 K splits), each config
checked against fp64 first, plain launches, the same timer. With --rows it times only a "rows"
GEMV at batch 1 instead (R whole weight rows a program, all of K in one load: the fastest reads'
shape), at the O, QKV and down shapes, plain and PDL-chained.

    python3 bench/experiments/read_ceiling.py [--quick] [--sweep] [--rows] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import sys

import torch
import triton
import triton.language as tl

from kernelsearch.harness.timing import time_calls

CALLS = 8
SIZES = {"O 4096x4096": 4096 * 4096, "QKV 6144x4096": 6144 * 4096,
         "down 4096x14336": 4096 * 14336, "gate|up 28672x4096": 28672 * 4096}

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # no PDL in this Triton: the pdl rows are left out
    gdc_wait = gdc_launch_dependents = None


@triton.jit
def _read_sum(w_ptr, out_ptr, n, per_prog, BLOCK: tl.constexpr, STAGES: tl.constexpr,
              EVEN: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_wait()
    pid = tl.program_id(0)
    lo = pid * per_prog
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in tl.range(0, per_prog, BLOCK, num_stages=STAGES):
        offs = lo + i + tl.arange(0, BLOCK)
        if EVEN:
            v = tl.load(w_ptr + offs, eviction_policy="evict_first")
        else:
            v = tl.load(w_ptr + offs, mask=offs < n, other=0.0, eviction_policy="evict_first")
        acc += v.to(tl.float32)
    if PDL:
        gdc_launch_dependents()
    tl.store(out_ptr + pid, tl.sum(acc, axis=0))


@triton.jit
def _rows_gemv(x_ptr, w_ptr, r_ptr, c_ptr, N, K, R: tl.constexpr, KP: tl.constexpr, PDL: tl.constexpr):
    # out[n] = r[n] + sum_k x[k] w[n, k] for R rows n a program, all of K in one load (batch 1)
    if PDL:
        gdc_wait()
    pid = tl.program_id(0)
    rn = pid * R + tl.arange(0, R)
    rk = tl.arange(0, KP)
    w = tl.load(w_ptr + rn[:, None] * K + rk[None, :], mask=rk[None, :] < K, other=0.0,
                eviction_policy="evict_first")
    x = tl.load(x_ptr + rk, mask=rk < K, other=0.0)
    acc = tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    if PDL:
        gdc_launch_dependents()
    res = tl.load(r_ptr + rn)
    tl.store(c_ptr + rn, (acc + res.to(tl.float32)).to(c_ptr.dtype.element_ty))


def rows_launch(x, w, r, out, R, num_warps, pdl=False):
    N, K = w.shape
    kw = {"launch_pdl": True} if pdl else {}
    _rows_gemv[(N // R,)](x, w, r, out, N, K, R=R, KP=triton.next_power_of_2(K), PDL=pdl,
                          num_warps=num_warps, **kw)


def rows_experiment(pct):
    """Batch 1, R weight rows a program loaded whole (the fastest reads' shape: many programs,
    one load each), against the read ceiling above; plain and PDL-chained."""
    out = []
    for N, K in ((4096, 4096), (6144, 4096), (4096, 14336)):
        ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / 64 for _ in range(CALLS)]
        xs = [torch.randn(K, device="cuda", dtype=torch.bfloat16) for _ in range(CALLS)]
        rs = [torch.randn(N, device="cuda", dtype=torch.bfloat16) for _ in range(CALLS)]
        os_ = [torch.empty(N, device="cuda", dtype=torch.bfloat16) for _ in range(CALLS)]
        ref = rs[0].double() + ws[0].double() @ xs[0].double()
        print(f"\n== rows gemv, batch 1, {N}x{K}", flush=True)
        for R in (1, 2, 4, 8):
            for nw in (4, 8, 16):
                if R * K * 2 // (nw * 32) > 256:  # more than 256 bytes of weight a thread: spills
                    continue
                row = {"N": N, "K": K, "R": R, "num_warps": nw}
                try:
                    os_[0].fill_(float("nan"))
                    rows_launch(xs[0], ws[0], rs[0], os_[0], R, nw)
                    torch.cuda.synchronize()
                    err = (os_[0].double() - ref).abs().max().item()
                    if not err <= 2e-2 * ref.abs().max().item() + 1e-2:
                        raise ValueError(f"wrong: {err:.3g}")
                    row["plain_us"] = timed(lambda i: rows_launch(xs[i], ws[i], rs[i], os_[i], R, nw))
                    if gdc_wait is not None:
                        row["pdl_us"] = timed(lambda i: rows_launch(xs[i], ws[i], rs[i], os_[i], R, nw, pdl=True))
                    print(f"  R={R} warps={nw}: plain {row['plain_us']:.2f} us {pct(N * K, row['plain_us']):.1f}%"
                          + (f", pdl {row['pdl_us']:.2f} us {pct(N * K, row['pdl_us']):.1f}%" if "pdl_us" in row else ""),
                          flush=True)
                except Exception as exc:
                    row["error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
                    print(f"  R={R} warps={nw}: {row['error']}", flush=True)
                out.append(row)
        del ws
        torch.cuda.empty_cache()
    return out


def read_launch(w, out, P, BLOCK, STAGES, num_warps, pdl=False):
    n = w.numel()
    per_prog = triton.cdiv(triton.cdiv(n, P), BLOCK) * BLOCK
    even = per_prog * P == n
    kw = {"launch_pdl": True} if pdl else {}
    _read_sum[(P,)](w, out, n, per_prog, BLOCK=BLOCK, STAGES=STAGES, EVEN=even, PDL=pdl,
                    num_warps=num_warps, num_stages=STAGES, **kw)


def configs(n, sms, quick):
    out = []
    blocks = [4096] if quick else [2048, 4096, 8192]
    for BLOCK in blocks:
        tiles = n // BLOCK
        progs = {sms, 2 * sms, 4 * sms, 8 * sms, 16 * sms, tiles // 8, tiles // 4, tiles // 2, tiles}
        for P in sorted(p for p in progs if 0 < p <= tiles):
            for STAGES in ([2, 4] if quick else [1, 2, 4]):
                for num_warps in ([4] if quick else [4, 8]):
                    out.append({"P": P, "BLOCK": BLOCK, "STAGES": STAGES, "num_warps": num_warps})
    return out


def sweep_configs(M):
    from kernelsearch.kernels import linear_residual as lr
    out = []
    if M == 1:
        for bn in (4, 8):
            for bk in (256, 512, 1024):
                for sk in (1, 4, 8, 16):
                    pipes = [(1, 4), (1, 6)] if sk <= 4 else [(0, 3)]
                    for pipe, st in pipes:
                        for w in (4, 8):
                            for red in (["last", "launch"] if sk == 16 else ["last"]):
                                out.append({"variant": "gemv", "BLOCK_M": 8, "BLOCK_N": bn, "BLOCK_K": bk,
                                            "SPLIT_K": sk, "UNROLL": 1, "PIPE": pipe, "num_warps": w,
                                            "num_stages": st, "REDUCE": red})
    else:
        for bn in (64, 128):
            for bk in (64, 128):
                for sk in (1, 2, 4, 8):
                    for st in (4, 6):
                        out.append({"variant": "swapab", "BLOCK_M": 32, "BLOCK_N": bn, "BLOCK_K": bk,
                                    "SPLIT_K": sk, "UNROLL": 1, "PIPE": 0, "num_warps": 4,
                                    "num_stages": st, "REDUCE": "last"})
    return [p for p in out if lr._valid(p)]


def template_rows(M, ws, pct, configs):
    """linear_residual at M x 4096 x 4096 on the weights ws (each viewed 4096 x 4096)."""
    from kernelsearch.kernels import linear_residual as lr
    x = [torch.randn(M, 4096, device="cuda", dtype=torch.bfloat16) for _ in range(CALLS)]
    r_ = [torch.randn(M, 4096, device="cuda", dtype=torch.bfloat16) for _ in range(CALLS)]
    o = [torch.empty(M, 4096, device="cuda", dtype=torch.bfloat16) for _ in range(CALLS)]
    w2 = [w.view(4096, 4096) / 64 for w in ws]
    tref = r_[0].double() + x[0].double() @ w2[0].double().T
    trows = []
    for p in configs:
        o[0].fill_(float("nan"))
        try:
            lr.launch(x[0], w2[0], r_[0], o[0], **p)
            torch.cuda.synchronize()
        except Exception as exc:
            trows.append({"config": p, "error": f"{type(exc).__name__}: {str(exc)[:160]}"})
            continue
        err = (o[0].double() - tref).abs().max().item()
        if not err <= 2e-2 * tref.abs().max().item() + 1e-2:
            trows.append({"config": p, "error": f"wrong: {err:.3g}"})
            continue
        trows.append({"config": p, "plain_us": timed(lambda i, p=p: lr.launch(x[i], w2[i], r_[i], o[i], **p))})
    ok = sorted((r for r in trows if "plain_us" in r), key=lambda r: r["plain_us"])
    for r in ok[:8]:
        print(f"  M={M} {r['plain_us']:7.2f} us {pct(4096 * 4096, r['plain_us']):5.1f}%  "
              f"{json.dumps(r['config'], separators=(',', ':'))}", flush=True)
    bad = [r for r in trows if "error" in r]
    if bad:
        print(f"  ({len(bad)} of {len(trows)} configs failed: {bad[0]['error'][:120]})")
    return trows


def timed(fn_for, reps=30):
    def run():
        for i in range(CALLS):
            fn_for(i)
    t = time_calls(run, "cuda", reps=reps, calls=CALLS)
    return t.median_ms * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--rows", action="store_true", help="only the rows-gemv experiment (and the copy figure)")
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.manual_seed(0)
    dev = torch.cuda.get_device_properties(0)
    print(f"{dev.name}  torch {torch.__version__}  triton {triton.__version__}  {dev.multi_processor_count} SMs",
          flush=True)
    big = torch.empty(256 << 20, device="cuda", dtype=torch.bfloat16).normal_()
    big_dst = torch.empty_like(big)
    for _ in range(4000):  # a second of copying first: an idle card's first work runs at low clocks
        big_dst.copy_(big)
    torch.cuda.synchronize()
    t = time_calls(lambda: big_dst.copy_(big), "cuda", reps=20)
    graph_gbs = 2 * big.numel() * 2 / (t.median_ms * 1e-3) / 1e9
    del big, big_dst
    torch.cuda.empty_cache()
    from daemon.bench.run import measure_copy_bandwidth_gbs
    copy_gbs = measure_copy_bandwidth_gbs("cuda")
    print(f"copy bandwidth: {copy_gbs:.0f} GB/s (the bench's, which the step's floor uses: 2 GB, read + "
          f"written); {graph_gbs:.0f} GB/s for 1 GB in a CUDA graph after an L2 flush", flush=True)
    pct = lambda n, us: 100 * n * 2 / (copy_gbs * 1e3) / us
    results = []
    if args.rows:
        results.append({"rows_gemv": rows_experiment(pct)})
    for label, n in ({} if args.rows else SIZES).items():
        ws = [torch.empty(n, device="cuda", dtype=torch.bfloat16).normal_() for _ in range(CALLS)]
        ref = ws[0].double().sum().item()
        floor_us = n * 2 / (copy_gbs * 1e3)
        rows = []
        for p in configs(n, dev.multi_processor_count, args.quick):
            outs = [torch.full((p["P"],), float("nan"), device="cuda") for _ in range(CALLS)]
            try:
                read_launch(ws[0], outs[0], **p)
                torch.cuda.synchronize()
            except Exception as exc:
                rows.append({**p, "error": f"{type(exc).__name__}: {str(exc)[:160]}"})
                continue
            got = outs[0].double().sum().item()
            if not abs(got - ref) <= 1e-3 * ws[0].double().abs().sum().item():
                rows.append({**p, "error": f"wrong sum {got} against {ref}"})
                continue
            row = {**p, "plain_us": timed(lambda i: read_launch(ws[i], outs[i], **p))}
            rows.append(row)
        ok = sorted((r for r in rows if "plain_us" in r), key=lambda r: r["plain_us"])
        for r in ok[:6]:  # the six fastest plain, chained with PDL as well
            if gdc_wait is None:
                break
            outs = [torch.empty((r["P"],), device="cuda") for _ in range(CALLS)]
            p = {k: r[k] for k in ("P", "BLOCK", "STAGES", "num_warps")}
            try:
                r["pdl_us"] = timed(lambda i: read_launch(ws[i], outs[i], pdl=True, **p))
            except Exception as exc:
                r["pdl_error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
        print(f"\n== {label}: {n * 2 / 1e6:.1f} MB, at copy rate {floor_us:.2f} us", flush=True)
        for r in ok[:6]:
            extra = f"  pdl {r['pdl_us']:7.2f} us {pct(n, r['pdl_us']):5.1f}%" if "pdl_us" in r else ""
            print(f"  plain {r['plain_us']:7.2f} us {pct(n, r['plain_us']):5.1f}%{extra}   "
                  f"P={r['P']} BLOCK={r['BLOCK']} STAGES={r['STAGES']} warps={r['num_warps']}", flush=True)
        bad = [r for r in rows if "error" in r]
        if bad:
            print(f"  ({len(bad)} configs failed: {bad[0]['error'][:120]})")
        entry = {"label": label, "elements": n, "floor_us": floor_us, "rows": rows}
        if label.startswith("O "):
            from kernelsearch.kernels import linear_residual as lr
            print("  linear_residual CONFIGS (plain):")
            entry["template"] = {M: template_rows(M, ws, pct, [p for p in lr.CONFIGS if (p["variant"] == "gemv") == (M == 1)])
                                 for M in (1, 32)}
            if args.sweep:
                print("  linear_residual, a wider slice of SPACE (plain):")
                entry["sweep"] = {M: template_rows(M, ws, pct, sweep_configs(M)) for M in (1, 32)}
        results.append(entry)
        del ws
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": dev.name, "triton": triton.__version__, "copy_gbs": copy_gbs, "graph_copy_gbs": graph_gbs,
                       "results": results}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
