"""Probe: the decode_attention template at full cache length (a decode step's workload), by config.

Not a kernel search (kernelsearch is the judge of what is kept): a fact for the next template
change. For each (B, config) it times the built-in template on caches [B, 8, S, 128] bf16 with
every sequence at length L (default S = 2112, L = 2049: the built-in model at context 2048),
in one CUDA graph of N calls over N distinct caches (N * cache bytes >= 4x L2, so no call
reads another's bytes from L2), median of 30 replays, and prints us per call and the KV bytes
over that time against the copy bandwidth measured here. `--one B:CONFIG_JSON` instead runs that
one config a few times (for ncu). Read-only: changes no GPU setting.

    python3 bench/attn_probe.py [--json F]
    ncu --clock-control none -k regex:_split_kernel -c 1 python3 bench/attn_probe.py --one '32:{...}'
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

sys.path.insert(0, ".")
from kernelsearch.kernels import decode_attention as T  # noqa: E402  (our own template)

HQ, HKV, D = 32, 8, 128
CONFIGS = [
    {"BLOCK_S": 64, "NUM_SPLITS": 64, "num_warps": 4, "num_stages": 3, "REDUCE": "launch"},
    {"BLOCK_S": 128, "NUM_SPLITS": 32, "num_warps": 8, "num_stages": 1, "REDUCE": "last"},
    {"BLOCK_S": 64, "NUM_SPLITS": 32, "num_warps": 4, "num_stages": 2, "REDUCE": "last"},
    {"BLOCK_S": 64, "NUM_SPLITS": 16, "num_warps": 4, "num_stages": 3, "REDUCE": "last"},
    {"BLOCK_S": 16, "NUM_SPLITS": 4, "num_warps": 2, "num_stages": 3, "REDUCE": "last"},
    {"BLOCK_S": 64, "NUM_SPLITS": 4, "num_warps": 4, "num_stages": 2, "REDUCE": "last"},
    {"BLOCK_S": 64, "NUM_SPLITS": 8, "num_warps": 4, "num_stages": 3, "REDUCE": "last"},
    {"BLOCK_S": 128, "NUM_SPLITS": 4, "num_warps": 8, "num_stages": 2, "REDUCE": "last"},
    {"BLOCK_S": 32, "NUM_SPLITS": 8, "num_warps": 4, "num_stages": 3, "REDUCE": "last"},
    {"BLOCK_S": 64, "NUM_SPLITS": 2, "num_warps": 4, "num_stages": 3, "REDUCE": "last"},
]


def copy_gbps() -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    ts = []
    for _ in range(10):
        ev[0].record(); dst.copy_(src); ev[1].record(); torch.cuda.synchronize()
        ts.append(ev[0].elapsed_time(ev[1]))
    return 2 * src.numel() / (statistics.median(ts) * 1e-3) / 1e9


def sets_for(b: int, s: int, length: int, n: int):
    g = torch.Generator(device="cuda").manual_seed(0)
    out = []
    for _ in range(n):
        q = torch.randn(b, HQ, D, generator=g, device="cuda").to(torch.bfloat16)
        k = torch.randn(b, HKV, s, D, generator=g, device="cuda").to(torch.bfloat16)
        v = torch.randn(b, HKV, s, D, generator=g, device="cuda").to(torch.bfloat16)
        lens = torch.full((b,), length, dtype=torch.int32, device="cuda")
        out.append((q, k, v, lens, torch.empty(b, HQ, D, dtype=torch.bfloat16, device="cuda")))
    return out


def time_config(sets, params) -> float:
    scale = D ** -0.5

    def run():
        for q, k, v, lens, o in sets:
            T.launch(q, k, v, lens, scale, o, **params)
    run(); torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    ts = []
    for _ in range(30):
        ev[0].record(); graph.replay(); ev[1].record(); torch.cuda.synchronize()
        ts.append(ev[0].elapsed_time(ev[1]) * 1e3 / len(sets))
    return statistics.median(ts)


def check(sets, params) -> float:
    q, k, v, lens, o = sets[0]
    T.launch(q, k, v, lens, D ** -0.5, o, **params)
    L = int(lens[0])
    qg = q.double().view(q.shape[0], HKV, HQ // HKV, D)
    sc = torch.einsum("bhgd,bhsd->bhgs", qg, k[:, :, :L].double()) * D ** -0.5
    ref = torch.einsum("bhgs,bhsd->bhgd", sc.softmax(-1), v[:, :, :L].double()).reshape(q.shape)
    return float((o.double() - ref).norm() / ref.norm())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--s", type=int, default=2112)
    ap.add_argument("--length", type=int, default=2049)
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--one", help="B:CONFIG_JSON: run one config 5 times (for ncu)")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.one:
        b, cfg = args.one.split(":", 1)
        sets = sets_for(int(b), args.s, args.length, 1)
        q, k, v, lens, o = sets[0]
        for _ in range(5):
            T.launch(q, k, v, lens, D ** -0.5, o, **json.loads(cfg))
        torch.cuda.synchronize()
        return 0
    bw = copy_gbps()
    print(f"copy {bw:.0f} GB/s; S={args.s} L={args.length}")
    rows = []
    for b in (int(x) for x in args.batches.split(",")):
        kv_bytes = 2 * b * HKV * args.length * D * 2
        n = max(1, -(-4 * 60 * 2**20 // (2 * b * HKV * args.s * D * 2)))
        sets = sets_for(b, args.s, args.length, n)
        for p in CONFIGS:
            err = check(sets, p)
            us = time_config(sets, p)
            row = {"B": b, "params": p, "us": round(us, 2), "pct_copy": round(100 * kv_bytes / (us * 1e-6) / 1e9 / bw, 1),
                   "rel_l2": err, "calls_per_graph": n}
            rows.append(row)
            print(f"B={b:3d} {json.dumps(p):90s} {us:8.2f} us {row['pct_copy']:5.1f}% of copy  err {err:.1e}", flush=True)
        del sets
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_gbps": bw, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
