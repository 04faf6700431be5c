"""Where the built-in decoder's decode step spends its time on a GPU, per variant (issue 13).

    python3 bench/gaps_gpu.py --table DISPATCH.json --shapes 1x2048,32x2048 --out DIR

For eager in a CUDA graph (stock, with the faster stock attention, as `hwtune bench` picks it
for every variant), the previous tuned step (tuned-unfused), the fused tuned step launched
plainly (tuned-nopdl) and with programmatic dependent launch (tuned), each at each
(batch, context), without the LM head (the step the no-head floor counts):
daemon.bench.gaps.profile_and_breakdown -- the step captured in a CUDA graph, its time by CUDA events (median of back-to-back replays), its kernels by torch.profiler over graph replays --
against the bandwidth floor of the same step at the copy bandwidth measured here. Writes
DIR/gaps.md (one breakdown per row) and DIR/gaps.json. Read-only: changes no GPU setting.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch


def layer_positions(steps, layers: int) -> list[dict]:
    """Each kernel position within a layer, its name and its median duration over the steps and
    layers 1..L-1: which of a layer's kernels takes how long inside the step. A layer is the
    longest period whose kernel names repeat over layers - 1 consecutive layers ending at most
    a period before the end of the step (layer 0 is left out: the step makes some per-step
    tensors at first use, inside it; after the last layer may come a residual add)."""
    import statistics

    rows: dict[int, dict] = {}
    tail = max(1, layers - 1)
    for events in steps:
        names = [e["name"] for e in events]
        n = len(names)
        found = next(((k, n - trail - tail * k) for k in range(n // layers, 0, -1)
                      for trail in range(k) if n - trail - tail * k >= 0
                      and all(names[n - trail - tail * k + i] == names[n - trail - tail * k + i + k]
                              for i in range((tail - 1) * k))), None)
        if found is None:
            continue
        per, first = found
        for i, e in enumerate(events[first:first + per * tail]):
            pos = i % per
            row = rows.setdefault(pos, {"position": pos, "name": e["name"], "durs": []})
            row["durs"].append(float(e["dur_us"]))
    out = []
    for pos in sorted(rows):
        durs = rows[pos].pop("durs")
        out.append(dict(rows[pos], median_us=statistics.median(durs), n=len(durs)))
    return out


def position_table(rows) -> str:
    if not rows:
        return "(no layer pattern repeating over the layers: no per-position table)\n"
    lines = ["| position in a layer | kernel | median us (layers 1..L-1, all steps) |", "|---:|---|---:|"]
    lines += [f"| {r['position']} | `{r['name'][:60]}` | {r['median_us']:.2f} |" for r in rows]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--table", required=True)
    ap.add_argument("--shapes", default="1x2048,32x2048")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--out", required=True)
    ap.add_argument("--preset", default="llama3-8b-8l")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args(argv)
    from daemon.bench import gaps
    from daemon.bench.model import PRESETS, Model
    from daemon.bench.ops import DTYPE_NAMES, StockOps, TunedOps, cache_len, kernels_per_layer, rel_l2
    from daemon.bench.run import decode_floor, fastest_stock_attention, measure_copy_bandwidth_gbs
    from kernelsearch.dispatch import DispatchTable
    from kernelsearch.harness.run_plan import pdl, pdl_enabled

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = args.device
    copy_gbs = measure_copy_bandwidth_gbs(dev) if dev == "cuda" else None
    cfg = PRESETS[args.preset].with_overrides(layers=args.layers)
    model = Model(cfg, device=dev, dtype=torch.bfloat16 if dev == "cuda" else torch.float32)
    table = DispatchTable.load(args.table)
    if table.entries:
        table.prepare(torch.device(dev))
    md = [f"# decode-step gap breakdown, {torch.cuda.get_device_name()}, copy {copy_gbs:.0f} GB/s, "
          f"{args.layers} layers, no LM head\n"] if dev == "cuda" else [f"# {dev}: no profile\n"]
    doc = {"copy_gbs": copy_gbs, "rows": []}
    for text in args.shapes.split(","):
        batch, ctx = (int(v) for v in text.split("x"))
        model.allocate_cache(batch, cache_len(ctx))
        model.fill_cache_random()
        g = torch.Generator(device=dev).manual_seed(5)
        tokens = torch.randint(0, cfg.vocab, (batch,), device=dev, generator=g)
        positions = torch.full((batch,), ctx, dtype=torch.int64, device=dev)
        floor = decode_floor(cfg, batch, ctx, 2, copy_gbs)
        # the stock attention `hwtune bench` gives every variant: the faster one here (on Hopper
        # bmm at batch 1: sdpa there made "graphed" ~20% slower than the bench's row)
        attention = "sdpa"
        if dev == "cuda":
            attention, times = fastest_stock_attention(model, batch, ctx)
            md.append(f"stock attention at {batch}x{ctx}: " + ", ".join(f"{k} {v * 1e3:.1f} us" for k, v in
                                                                       times.items()) + f" -> {attention}\n")
        stock = StockOps(attention)
        ref = model.decode_step(tokens, positions, stock, head=False).float()
        for name, ops in (("graphed", stock), ("tuned-unfused", TunedOps(table, attention=attention, fused=False)),
                          ("tuned-nopdl", TunedOps(table, attention=attention)),
                          ("tuned", TunedOps(table, attention=attention))):
            got = model.decode_step(tokens, positions, ops, head=False).float()   # routes decided here
            err = rel_l2(got, ref)
            fn = lambda ops=ops: model.decode_step(tokens, positions, ops, head=False)
            try:
                with pdl(name != "tuned-nopdl"):
                    result, text_md = gaps.profile_and_breakdown(fn, args.steps, args.layers,
                                                                 floor_ms=floor["floor_ms"], copy_gbs=copy_gbs)
            except Exception as exc:
                md.append(f"## {name} b{batch} ctx{ctx}: failed: {type(exc).__name__}: {exc}\n")
                continue
            kpl = kernels_per_layer(ops, cfg, batch, model.kv.shape[4], DTYPE_NAMES[model.dtype])
            md.append(f"## {name}, batch {batch}, context {ctx} (no-head rel_l2 vs eager {err:.2e}; "
                      f"kernels per layer by the op count: {kpl.get('total')})\n")
            if name in ("tuned", "tuned-unfused") and pdl_enabled():
                md.append("(launched with programmatic dependent launch where the device has it: a "
                          "kernel may be placed before the previous one has finished, and its time "
                          "then holds some of that wait; tuned-nopdl's are plain launches)\n")
            md.append(text_md + "\n")
            raw = result.pop("raw")
            if name != "graphed":
                per_pos = layer_positions(raw.get("steps") or [], args.layers)
                result["per_layer_position"] = per_pos
                md.append(position_table(per_pos))
            doc["rows"].append({"variant": name, "batch": batch, "ctx": ctx, "rel_l2": err,
                                "kernels_per_layer_counted": kpl, "breakdown": result})
            (out / f"events-{name}-b{batch}.json").write_text(json.dumps(raw)) if batch == 1 and name == "tuned" else None
            print(f"{name} b{batch}: step {result.get('step_ms')} ms", flush=True)
    (out / "gaps.md").write_text("\n".join(md))
    (out / "gaps.json").write_text(json.dumps(doc, indent=1, default=str))
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
