"""Where the patched transformers model's decode step spends its time on a GPU (issue 13).

    PYTHONPATH=. python3 bench/hf_gaps_gpu.py --table DISPATCH.json --shapes 1x2048,32x2048 \
        --variants hf-hwtune,hf-compiled --out DIR

The step `hwtune bench --model hf-llama` times (daemon.bench.hf: LlamaForCausalLM with Llama-3-8B
dimensions, 8 layers, random weights, a StaticCache of `context` positions, model.forward under
torch.compile(mode="reduce-overhead", fullgraph=True), the argmax after it), patched as the
variant says, is timed by CUDA events over back-to-back steps (median), then run again under
torch.profiler with a synchronize and a 2 ms sleep after each step, which splits the trace into
steps. Per variant and shape: daemon.bench.gaps.breakdown against the floor with the head (the
step makes logits), each kernel's position in a layer with its median time where the layers
repeat one pattern (bench/gaps_gpu.py's layer_positions; inductor's glue kernels often break it),
and one step's kernels in order: what the built-in step's profile (bench/gaps_gpu.py) does
not show, the kernels that transformers' own code and the patch's glue add. Writes DIR/hf-gaps.md
and DIR/hf-gaps.json. Read-only: changes no GPU setting. Progress lines go to stderr with
seconds since the start.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

T0 = time.monotonic()


def say(text: str) -> None:
    print(f"[hf-gaps {time.monotonic() - T0:6.1f}s] {text}", file=sys.stderr, flush=True)


def profile_steps(one, steps: int, cuda: bool = True, pause_s: float = 0.002) -> list[list[dict]]:
    """Kernels of `steps` calls of one() (each followed by a synchronize and a sleep) from
    torch.profiler, split per call; the first call is dropped."""
    from torch.profiler import ProfilerActivity, profile

    from daemon.bench.gaps import steps_from_trace

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps + 1):
            one()
            if cuda:
                torch.cuda.synchronize()
            time.sleep(pause_s)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
    return steps_from_trace(trace.get("traceEvents", []), min_gap_us=pause_s * 1e6 / 2)[1:]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--table", required=True)
    ap.add_argument("--shapes", default="1x2048,32x2048")
    ap.add_argument("--variants", default="hf-hwtune,hf-compiled")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10, help="profiled steps")
    ap.add_argument("--timed", type=int, default=30, help="timed steps (CUDA events, median)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--stack-dump-s", type=float, default=0,
                    help="print every thread's stack to stderr every N seconds (0: off): where a hang is")
    ap.add_argument("--short-lowering-errors", action="store_true",
                    help="inductor's implicit-fallback log lines and lowering errors name the op without "
                         "printing its IR arguments (whose text can take minutes to build)")
    ap.add_argument("--device", default="cuda",
                    help="cpu: a tiny model, aot_eager, no kernels traced (a smoke run of this script)")
    args = ap.parse_args(argv)
    cuda = args.device == "cuda"
    if args.short_lowering_errors:
        import torch._inductor.exc as inductor_exc
        import torch._inductor.graph as inductor_graph

        def short(target, args, kwargs=None):
            return f"{target} ({len(args)} args, {len(kwargs or {})} kwargs; IR text left out)"

        # graph.py logs every implicit fallback (an op with no lowering: hwtune's custom ops)
        # with OperatorIssue.operator_str, evaluated whatever the log level
        for mod in (inductor_exc, inductor_graph):
            if hasattr(mod, "operator_str"):
                mod.operator_str = short
        inductor_exc.OperatorIssue.operator_str = staticmethod(short)
    if args.stack_dump_s > 0:
        import faulthandler
        faulthandler.dump_traceback_later(args.stack_dump_s, repeat=True)
    if cuda and not torch.cuda.is_available():
        print("hf_gaps_gpu: needs a CUDA device (--device cpu for a smoke run)", file=sys.stderr)
        return 2
    from transformers import StaticCache

    from bench.gaps_gpu import layer_positions, position_table
    from daemon.bench import gaps
    from daemon.bench.hf import HWTUNE, HfOptions, build_model, cache_kwarg, floor_config, rewind
    from daemon.bench.run import decode_floor, measure_copy_bandwidth_gbs, time_steps
    from kernelsearch.dispatch import DispatchTable
    from kernelsearch.integrations.transformers import patch, unpatch

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in ("hf-compiled", *HWTUNE)]
    if unknown:
        print(f"hf_gaps_gpu: unknown variants {unknown} (hf-compiled, {', '.join(HWTUNE)})", file=sys.stderr)
        return 2
    copy_gbs = measure_copy_bandwidth_gbs("cuda") if cuda else 1.0
    opts = HfOptions(device=args.device, layers=args.layers, tiny=not cuda)
    model, desc = build_model(opts)
    say(f"model built ({desc}); copy {copy_gbs:.0f} GB/s")
    table = DispatchTable.load(args.table)
    table.prepare(torch.device(args.device))
    kw = cache_kwarg()
    md = [f"# hf-llama decode-step breakdown, {torch.cuda.get_device_name() if cuda else 'cpu'}, copy {copy_gbs:.0f} GB/s, "
          f"{args.layers} layers, with the LM head and the argmax (the step hwtune bench times)\n"]
    doc = {"copy_gbs": copy_gbs, "rows": []}
    for text in args.shapes.split(","):
        batch, ctx = (int(v) for v in text.split("x"))
        floor = decode_floor(floor_config(model.config), batch, ctx, 2, copy_gbs)
        spare = args.timed + args.steps + 24
        g = torch.Generator(device="cpu").manual_seed(batch)
        prompt = torch.randint(0, model.config.vocab_size, (batch, ctx - spare), generator=g).to(args.device)
        for variant in variants:
            say(f"{variant} {batch}x{ctx}: patch, prefill, compile")
            if variant in HWTUNE:
                report = patch(model, table, fused=HWTUNE[variant])
                say("  " + "; ".join(report.lines()[:3]))
            try:
                cache = StaticCache(config=model.config, max_cache_len=ctx)
                torch._dynamo.reset()
                forward = torch.compile(model.forward, fullgraph=True,
                                        **(dict(mode="reduce-overhead") if cuda else dict(backend="aot_eager")))
                state = {}

                def one():
                    if cuda:
                        torch.compiler.cudagraph_mark_step_begin()
                    logits = forward(state["token"], **{kw: cache}, use_cache=True).logits[:, -1]
                    state["token"] = logits.argmax(-1, keepdim=True)

                with torch.no_grad():
                    first = model(prompt, **{kw: cache}, use_cache=True, logits_to_keep=1)
                    state["token"] = first.logits[:, -1:].argmax(-1)
                    t = time.monotonic()
                    for _ in range(4):
                        one()
                    if cuda:
                        torch.cuda.synchronize()
                    say(f"  compiled + 4 steps in {time.monotonic() - t:.1f}s")
                    times = time_steps(one, args.timed, 4, cuda)
                    step_ms = statistics.median(times)
                    say(f"  step {step_ms:.3f} ms (median of {len(times)})")
                    if not rewind(cache, args.timed + 4):
                        say("  (no rewind: profiling further on)")
                    steps = profile_steps(one, args.steps, cuda)
                say(f"  profiled {len(steps)} steps, kernels per step {[len(s) for s in steps]}")
                b = gaps.breakdown(steps, step_ms, args.layers, floor_ms=floor["floor_with_head_ms"],
                                   copy_gbs=copy_gbs)
                per_pos = layer_positions(steps, args.layers)
                md.append(f"## {variant}, batch {batch}, context {ctx}\n")
                md.append(gaps.markdown(b) + "\n")
                md.append(position_table(per_pos))
                first_step = steps[len(steps) // 2] if steps else []
                md.append("\nOne step's kernels in order (name, us):\n")
                md.append("\n".join(f"{i:3d} {e['dur_us']:8.2f}  {e['name'][:90]}" for i, e in enumerate(first_step)))
                md.append("")
                doc["rows"].append({"variant": variant, "batch": batch, "ctx": ctx, "step_ms": step_ms,
                                    "times_ms": times, "breakdown": b, "per_layer_position": per_pos,
                                    "one_step": first_step})
            except Exception as exc:   # a failed row is a row
                import traceback
                md.append(f"## {variant} {batch}x{ctx}: failed: {type(exc).__name__}: {str(exc)[:3000]}\n")
                md.append("```\n" + traceback.format_exc(limit=-12)[-6000:] + "```\n")
                say(f"  failed: {type(exc).__name__}: {exc}")
            finally:
                if variant in HWTUNE:
                    unpatch(model)
                torch._dynamo.reset()
            (out / "hf-gaps.md").write_text("\n".join(md))
            (out / "hf-gaps.json").write_text(json.dumps(doc, indent=1, default=str))
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
