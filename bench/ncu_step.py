"""Run the built-in decoder's tuned decode step (no LM head) a few times, eagerly, for ncu.

    ncu --clock-control none --profile-from-start off -k regex:'_gemv|_splitk|_rope_attn|_combine' \
        --launch-count 12 --section SpeedOfLight ... \
        python3 bench/ncu_step.py --table DISPATCH.json --batch 1

Not a benchmark: no timing here. ncu serialises and replays each kernel it profiles (its
caches flushed between replays by default), so what it reports is each kernel alone, cold,
with plain launches (PDL off here): the per-kernel half of issue 13's gap breakdown, where
gaps_gpu.py's CUDA events give the kernels in the step. The first step routes every call and
compiles; the last step runs between cudaProfilerStart and cudaProfilerStop, so with
`--profile-from-start off` ncu sees that step's kernels only, layer 0 first. Read-only:
changes no GPU setting.
"""
from __future__ import annotations

import argparse
import sys

import torch

sys.path.insert(0, ".")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--table", required=True)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--preset", default="llama3-8b-8l")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args(argv)
    from daemon.bench.model import PRESETS, Model
    from daemon.bench.ops import TunedOps, cache_len
    from kernelsearch.dispatch import DispatchTable
    from kernelsearch.harness.run_plan import pdl

    cfg = PRESETS[args.preset].with_overrides(layers=args.layers)
    dev = args.device
    model = Model(cfg, device=dev, dtype=torch.bfloat16 if dev == "cuda" else torch.float32)
    table = DispatchTable.load(args.table)
    if table.entries:
        table.prepare(torch.device(dev))
    model.allocate_cache(args.batch, cache_len(args.ctx))
    model.fill_cache_random()
    g = torch.Generator(device=dev).manual_seed(5)
    tokens = torch.randint(0, cfg.vocab, (args.batch,), device=dev, generator=g)
    positions = torch.full((args.batch,), args.ctx, dtype=torch.int64, device=dev)
    ops = TunedOps(table)
    with pdl(False):
        for i in range(args.steps):
            last = i == args.steps - 1 and dev == "cuda"
            if last:   # ncu --profile-from-start off: only the last step's kernels
                torch.cuda.synchronize()
                torch.cuda.cudart().cudaProfilerStart()
            model.decode_step(tokens, positions, ops, head=False)
            if last:
                torch.cuda.synchronize()
                torch.cuda.cudart().cudaProfilerStop()
    if dev == "cuda":
        torch.cuda.synchronize()
    for key, rec in sorted(ops.used.items(), key=lambda kv: str(kv[0])):
        print(key[0], rec.get("impl"), {k: v for k, v in rec.items() if k in ("params", "reason")})
    return 0


if __name__ == "__main__":
    sys.exit(main())
