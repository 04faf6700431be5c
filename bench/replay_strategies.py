"""How many evaluations each strategy needs to come within 2% of the exhaustive best.

Replays recorded per-config timings offline (no GPU, no harness): for every kernel and shape
the recorded table is the cost function, each strategy in kernelsearch.proposers.REGISTRY
searches it, and we count the evaluations until the first point within --within of the best
recorded time. Averaged over --seeds seeds (grid is deterministic).

    python3 bench/replay_strategies.py out/kernels_gpu/kernels_gpu.json [--seeds 20] [--json OUT]

Input: the JSON written by bench/kernels_gpu.py or bench/search_gpu.py:
  {"kernels": {KERNEL: {"shapes": [{"shape": {...}, "configs": [{"params": {...},
                                                                  "time_ms": float|"inf"|null}]}]}}}
The space is what was recorded: each param's distinct values, and only recorded configs are
allowed (a capped sweep replays as a smaller space).
"""
from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from kernelsearch.proposers import REGISTRY, key  # noqa: E402


class Reached(Exception):
    """Raised by the replayed cost function at the first point within the target."""


def _ms(value) -> float:
    if value is None or isinstance(value, str):
        return math.inf
    return float(value)


def space_of(configs: list[dict]) -> dict:
    space: dict[str, list] = {}
    for row in configs:
        for name, value in row["params"].items():
            space.setdefault(name, [])
            if value not in space[name]:
                space[name].append(value)
    return {n: sorted(v, key=lambda x: (x is None, x)) for n, v in space.items()}


def evals_to_reach(strategy: str, configs: list[dict], within: float, seed: int) -> int | None:
    table = {key(r["params"]): _ms(r.get("time_ms")) for r in configs}
    best = min(table.values())
    target = best * (1 + within)
    space = space_of(configs)
    count = 0

    def evaluate(points):
        nonlocal count
        times = []
        for p in points:
            count += 1
            t = table[key(p)]
            times.append(t)
            if t <= target:
                raise Reached()
        return times

    try:
        REGISTRY[strategy](space, evaluate, len(table), random.Random(seed),
                           allowed=lambda p: key(p) in table)
    except Reached:
        return count
    return None


def replay(doc: dict, seeds: int, within: float, strategies: list[str]) -> list[dict]:
    rows = []
    for kernel, res in doc.get("kernels", {}).items():
        for entry in res.get("shapes", []):
            configs = [c for c in entry.get("configs", []) if c.get("params") is not None]
            if not configs or not any(math.isfinite(_ms(c.get("time_ms"))) for c in configs):
                continue
            row = {"kernel": kernel, "shape": entry["shape"], "space": len(configs),
                   "failed": sum(not math.isfinite(_ms(c.get("time_ms"))) for c in configs)}
            for strategy in strategies:
                runs = [evals_to_reach(strategy, configs, within, s)
                        for s in range(1 if strategy == "grid" else seeds)]
                reached = [r for r in runs if r is not None]
                row[strategy] = {"mean": round(statistics.mean(reached), 1) if reached else None,
                                 "max": max(reached) if reached else None,
                                 "missed": len(runs) - len(reached)}
            rows.append(row)
    return rows


def render(rows: list[dict], strategies: list[str], within: float) -> str:
    head = ["kernel", "shape", "space", "failed"] + [f"{s} (mean/max)" for s in strategies]
    out = [head]
    for r in rows:
        cells = [r["kernel"], " ".join(f"{k}={v}" for k, v in r["shape"].items()), str(r["space"]),
                 str(r["failed"])]
        for s in strategies:
            x = r[s]
            cells.append("-" if x["mean"] is None else
                         f"{x['mean']:g}/{x['max']}" + (f" ({x['missed']} missed)" if x["missed"] else ""))
        out.append(cells)
    widths = [max(len(row[i]) for row in out) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in out]
    lines.insert(1, "  ".join("-" * w for w in widths))
    if rows:
        lines.append("")
        for s in strategies:
            means = [r[s]["mean"] / r["space"] for r in rows if r[s]["mean"] is not None]
            if means:
                lines.append(f"{s}: on average {100 * statistics.mean(means):.0f}% of the space evaluated "
                             f"to come within {100 * within:g}% of the exhaustive best")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("timings", type=Path, help="kernels_gpu.json / search_gpu.json")
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--within", type=float, default=0.02, help="relative distance to the best (0.02 = 2%%)")
    ap.add_argument("--strategies", default=",".join(REGISTRY))
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = ap.parse_args(argv)
    strategies = [s for s in args.strategies.split(",") if s]
    unknown = [s for s in strategies if s not in REGISTRY]
    if unknown:
        ap.error(f"unknown strategies {unknown}; known {list(REGISTRY)}")
    doc = json.loads(args.timings.read_text())
    rows = replay(doc, args.seeds, args.within, strategies)
    print(render(rows, strategies, args.within))
    if args.json:
        args.json.write_text(json.dumps({"within": args.within, "seeds": args.seeds, "rows": rows}, indent=1))
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
