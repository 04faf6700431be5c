#!/usr/bin/env python3
"""Scaling of the kernel search over GPUs (issue 6): the same search on 1 GPU and on every GPU.

For each kernel, the same search (strategy, budget, seed, shapes) runs twice through
`kernelsearch.pool.Pool`: once with one worker (GPU 0), once with one worker per visible GPU.
Each leg has a fresh ledger and a fresh Triton cache, so neither leg compiles for the other.
Printed: wall time, evaluations per minute, speedup and scaling efficiency (speedup / GPUs),
worker restarts / crashes / timeouts, and per shape whether both legs chose the same winner;
when they did not, how far apart the two winners are in the 1-GPU leg's own measurements
(timing noise between near-equal candidates is the usual reason).

On a one-GPU machine the 1-GPU leg runs and the table says the multi-GPU leg needs a machine
with several GPUs. NVLink multicast stays off in this process and every worker.

    python3 bench/scaling_gpu.py --kernel rmsnorm --budget 8 --out $OUT/scaling.json
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
os.environ.update(MULTICAST_OFF)  # before torch or anything else starts


def _shape(text: str) -> dict:
    out = {}
    for part in text.split(","):
        k, v = part.split("=", 1)
        out[k.strip()] = v.strip() if k.strip() == "dtype" else int(v)
    return out


def run_leg(kernel: str, gpus: int, args, workdir: Path) -> dict:
    from kernelsearch.ledger import Ledger
    from kernelsearch.pool import Pool
    from kernelsearch.search import search

    state = workdir / f"{kernel}-{gpus}gpu"
    env = {"TRITON_CACHE_DIR": str(workdir / f"triton-cache-{kernel}-{gpus}gpu")}
    print(f"== {kernel}: {gpus} GPU leg", file=sys.stderr, flush=True)
    started = time.perf_counter()
    with Pool(workers=gpus, device=args.device, env=env, log_dir=state / "worker-logs") as pool:
        result = search(kernel, state_dir=state, strategy=args.strategy, budget=args.budget, device=args.device,
                        shapes=args.shape, seed=args.seed, executor=pool, ceilings={},
                        timeout_s=args.timeout_s,
                        progress=lambda line: print(f"  [{gpus} gpu] {line}", file=sys.stderr, flush=True))
        stats = dict(pool.stats, restarts=pool.restarts, workers=pool.describe())
    wall_s = time.perf_counter() - started
    winners = {}
    for r in result.shapes:
        key = json.dumps({k: v for k, v in r.shape.items() if k != "dtype"}, sort_keys=True) + f" {r.dtype}"
        winners[key] = {"params": r.best["params"] if r.best else None,
                        "candidate_ms": r.best["candidate_ms"] if r.best else None,
                        "stock_ms": r.stock_ms if math.isfinite(r.stock_ms) else None,
                        "kept": r.kept, "attempts": r.attempts, "verdicts": r.verdicts}
    with Ledger(state / "ledger.sqlite") as ledger:
        measured = {}
        for row in ledger.attempts(kernel=kernel):
            if row["accepted"]:
                key = json.dumps(row["shape"], sort_keys=True) + f" {row['dtype']}"
                measured[(key, json.dumps(row["params"], sort_keys=True))] = row["candidate_ms"]
    return {"kernel": kernel, "gpus": gpus, "wall_s": wall_s, "evaluations": result.evaluations,
            "evals_per_min": 60.0 * result.evaluations / wall_s if wall_s > 0 else None,
            "fingerprint_id": result.fingerprint_id, "stats": stats, "winners": winners,
            "_measured": measured}


def compare_winners(one: dict, many: dict) -> list[dict]:
    out = []
    for key, w1 in one["winners"].items():
        wn = many["winners"].get(key, {})
        same = w1["params"] == wn.get("params")
        row = {"shape": key, "same": same, "winner_1gpu": w1["params"], "winner_ngpu": wn.get("params")}
        if not same and w1["params"] is not None and wn.get("params") is not None:
            # both winners as the 1-GPU leg measured them: how far apart are they really?
            t_other = one["_measured"].get((key, json.dumps(wn["params"], sort_keys=True)))
            if t_other and w1["candidate_ms"]:
                row["gap_pct_in_1gpu_leg"] = round(100.0 * (t_other / w1["candidate_ms"] - 1.0), 2)
        out.append(row)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    p.add_argument("--kernel", action="append", default=None, help="repeatable (default rmsnorm)")
    p.add_argument("--strategy", default="grid")
    p.add_argument("--budget", default="8", help="points per shape (grid: spread over the space)")
    p.add_argument("--shape", type=_shape, action="append", default=None,
                   help="e.g. M=4096,N=4096 (repeatable; default the spec's GPU sweep)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=None, help="per harness request")
    p.add_argument("--gpus", type=int, default=None, help="the multi-GPU leg's GPUs (default: all visible)")
    p.add_argument("--skip-multi", action="store_true", help="run only the 1-GPU leg")
    p.add_argument("--workdir", type=Path, default=None, help="ledgers, caches, worker logs (default: a temp dir)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: a smoke test of this script (CPU slots, Triton interpreter; not a measurement)")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")) / "scaling_gpu.json")
    args = p.parse_args()
    kernels = args.kernel or ["rmsnorm"]

    import torch

    from kernelsearch.pool import visible_gpus

    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
        visible = [str(i) for i in range(args.gpus or 2)]
    elif not torch.cuda.is_available():
        print("scaling_gpu: needs CUDA GPUs (torch sees none)", file=sys.stderr)
        return 2
    else:
        visible = visible_gpus()
    n = min(args.gpus or len(visible), len(visible))
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="hwtune-scaling-"))
    report = {"gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu slots (smoke test)", "visible_gpus": len(visible), "budget": args.budget,
              "strategy": args.strategy, "seed": args.seed, "kernels": {}, "env": MULTICAST_OFF}
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def save():  # after every leg, so a run cut short still leaves what it measured
        args.out.write_text(json.dumps(report, indent=2, sort_keys=True, default=str) + "\n")

    for kernel in kernels:
        legs = [run_leg(kernel, 1, args, workdir)]
        entry = report["kernels"][kernel] = {"legs": []}
        entry["legs"].append({k: v for k, v in legs[0].items() if not k.startswith("_")})
        save()
        if n > 1 and not args.skip_multi:
            legs.append(run_leg(kernel, n, args, workdir))
            entry["legs"].append({k: v for k, v in legs[1].items() if not k.startswith("_")})
            one, many = legs
            speedup = one["wall_s"] / many["wall_s"]
            entry.update(speedup=speedup, efficiency=speedup / many["gpus"],
                         winners=compare_winners(one, many))
            save()

    print(f"\nkernel search scaling on {report['gpu']} x{len(visible)} "
          f"(strategy {args.strategy}, budget {args.budget}, seed {args.seed})")
    head = f"{'kernel':<18}{'GPUs':>5}{'evals':>7}{'wall s':>9}{'evals/min':>11}{'speedup':>9}" \
           f"{'efficiency':>12}{'restarts':>10}{'crashes':>9}{'timeouts':>10}"
    print(head)
    print("-" * len(head))
    for kernel, entry in report["kernels"].items():
        for i, leg in enumerate(entry["legs"]):
            sp = f"{entry['speedup']:.2f}x" if i == 1 else "1.00x"
            eff = f"{100 * entry['efficiency']:.0f}%" if i == 1 else "-"
            s = leg["stats"]
            print(f"{kernel:<18}{leg['gpus']:>5}{leg['evaluations']:>7}{leg['wall_s']:>9.1f}"
                  f"{leg['evals_per_min']:>11.1f}{sp:>9}{eff:>12}{s['restarts']:>10}{s['crashes']:>9}{s['timeouts']:>10}")
        if "winners" in entry:
            same = sum(w["same"] for w in entry["winners"])
            print(f"  same winners: {same}/{len(entry['winners'])} shapes")
            for w in entry["winners"]:
                if not w["same"]:
                    gap = w.get("gap_pct_in_1gpu_leg")
                    print(f"    {w['shape']}: 1 GPU {w['winner_1gpu']} vs {n} GPUs {w['winner_ngpu']}"
                          + (f" ({gap:+.2f}% apart in the 1-GPU leg's timings)" if gap is not None else ""))
        else:
            print(f"  multi-GPU leg not run: this machine has {len(visible)} visible GPU(s); it needs a "
                  "machine with several GPUs (e.g. nvidia-h200-x2 or larger)")
    print(f"\nresults: {args.out}  (ledgers and worker logs under {workdir})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
