"""Hugging Face LlamaForCausalLM patched by hwtune, on one GPU: correctness and decode speed.

    python3 bench/hf_patch_gpu.py [--layers 8] [--batch 1,32] [--context 2048] [--steps 64]
                                  [--table FILE | --state-dir DIR] [--search N] [--model-path DIR]
    python3 bench/hf_patch_gpu.py --device cpu --tiny     # smoke test (Triton interpreter, no timing value)

The model: transformers' LlamaForCausalLM built from a config with Llama-3-8B dimensions
(hidden 4096, 32 / 8 heads of 128, MLP 14336, untied 128256-row head), `--layers` decoder
layers, random weights, bf16; or `--model-path DIR`, a local checkpoint (nothing is downloaded).
The table: `--table FILE` (a dispatch table), else `--state-dir DIR`'s table for this GPU
(default /var/lib/hwtune); `--search N` first runs `kernelsearch.search` (grid, N evaluations
per shape) on exactly the model's decode shapes at each batch and uses what it kept.

Per batch size, on a StaticCache of `--context` positions, a prompt of random tokens is
prefilled eagerly (so that the last timed step reaches the end of the cache), then greedy
one-token steps: `--check` steps whose logits are kept, `--warmup` more, then `--steps` timed
steps (CUDA events around them, the argmax included), for:
  hf eager            the model as loaded, no compile
  hf compiled         model.forward under torch.compile(mode="reduce-overhead", fullgraph=True)
  hwtune + compiled   kernelsearch.integrations.transformers.patch(model, table), then the same
Correctness, bf16: the prefill logits of the patched model (eager) and the checked steps'
logits of each mode against hf eager from the same prompt: max |diff| / max |ref| over the
steps (fed hf eager's tokens, teacher-forced) and the share of steps whose greedy tokens all match. Exit 0 when the patched model is
within 5e-2 of max |logit| everywhere, else 1. Self-contained: results to stdout
(the table last), progress to stderr.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

_T0 = time.time()


def log(msg: str) -> None:
    print(f"[{time.time() - _T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


def llama3_8b_config(layers: int, tiny: bool):
    from transformers import LlamaConfig

    if tiny:
        return LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                           num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                           max_position_embeddings=256, tie_word_embeddings=False)
    return LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
                       num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                       max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
                       tie_word_embeddings=False, attn_implementation="sdpa")


def build_model(args, device, dtype):
    import torch
    from transformers import LlamaForCausalLM

    if args.model_path:
        model = LlamaForCausalLM.from_pretrained(args.model_path, local_files_only=True, dtype=dtype)
        return model.to(device).eval()
    config = llama3_8b_config(args.layers, args.tiny)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype).eval()
    with torch.no_grad():   # random norms, so that a norm kernel that ignores its weight shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
    return model


def cache_kwarg():
    import inspect

    import transformers

    # transformers 5.24 renamed past_key_values to cache
    return "cache" if "cache" in inspect.signature(transformers.LlamaModel.forward).parameters \
        else "past_key_values"


def decode_shapes(config, batch: int, context: int) -> dict[str, list[dict]]:
    """The shapes one decode step of this model calls each kernel with."""
    h, i = config.hidden_size, config.intermediate_size
    hq, hkv = config.num_attention_heads, config.num_key_value_heads
    d = getattr(config, "head_dim", None) or h // hq
    return {
        "rmsnorm": [{"M": batch, "N": h}],
        "linear": [{"M": batch, "K": h, "N": (hq + 2 * hkv) * d}, {"M": batch, "K": hq * d, "N": h},
                   {"M": batch, "K": h, "N": 2 * i}, {"M": batch, "K": i, "N": h},
                   {"M": batch, "K": h, "N": config.vocab_size}],
        "swiglu": [{"M": batch, "I": i}],
        "rope": [{"B": batch, "Hq": hq, "Hkv": hkv, "D": d}],
        "decode_attention": [{"B": batch, "Hq": hq, "Hkv": hkv, "S": context, "D": d}],
        # RoPE + the StaticCache write of k and v (the patch's decode path where tuned)
        "rope_kv_write": [{"B": batch, "Hq": hq, "Hkv": hkv, "D": d, "S": context}],
    }


def load_table(args, device):
    from kernelsearch.dispatch import DispatchTable

    if args.table:
        return DispatchTable.load(args.table), f"--table {args.table}"
    state_dir = args.state_dir or "/var/lib/hwtune"
    return DispatchTable.for_device(state_dir, device), f"state dir {state_dir}"


def run_search(args, config, device, dtype_name) -> str:
    """kernelsearch.search on the model's decode shapes; returns the state dir it wrote."""
    from kernelsearch.search import search

    state_dir = args.state_dir or tempfile.mkdtemp(prefix="hf-patch-search-")
    for batch in args.batches:
        for kernel, shapes in decode_shapes(config, batch, args.context).items():
            log(f"search {kernel} batch {batch}: {len(shapes)} shapes, {args.search} evaluations each")
            try:
                result = search(kernel, state_dir=state_dir, budget=args.search, device=device,
                                dtype=dtype_name, shapes=shapes, progress=lambda line: log("  " + line))
                for r in result.shapes:
                    log(f"  {kernel} {r.shape}: kept={r.kept} speedup={r.speedup}")
            except Exception as exc:  # a failed search is data: the op stays stock
                log(f"  search {kernel} failed: {type(exc).__name__}: {exc}")
    return state_dir


def run_mode(model, mode, args, device, prompt, compile_kw, forced=None):
    """Prefill eagerly; `--check` steps whose logits are kept (they also warm up and compile),
    fed hf eager's greedy tokens (`forced`) so that a near-tie flipped in one of B sequences does
    not send that sequence down another path; `--warmup` more; then `--steps` timed greedy
    steps. -> (ms per step, checked logits, prefill logits, the check steps' tokens)."""
    import torch
    from transformers import StaticCache

    kw = cache_kwarg()
    cache = StaticCache(config=model.config, max_cache_len=args.context)
    forward = model.forward
    graphs = device == "cuda" and mode != "hf eager"
    if mode != "hf eager":
        torch._dynamo.reset()
        forward = torch.compile(model.forward, **compile_kw)

    def step(token):
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        return forward(token, **{kw: cache}, use_cache=True).logits[:, -1]

    checked = []
    with torch.no_grad():
        out = model(prompt, **{kw: cache}, use_cache=True, logits_to_keep=1)
        prefill = out.logits[:, -1].float().clone()
        token = forced[0] if forced is not None else out.logits[:, -1:].argmax(-1)
        fed = [token]
        for i in range(args.check):
            logits = step(token)
            checked.append(logits.float().clone())   # out of the CUDA graph pool before the next replay
            token = forced[i + 1] if forced is not None and i + 1 < len(forced) else logits.argmax(-1, keepdim=True)
            fed.append(token)
        for _ in range(args.warmup):
            token = step(token).argmax(-1, keepdim=True)
        if device == "cuda":
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            token = step(token).argmax(-1, keepdim=True)
        if device == "cuda":
            end.record()
            torch.cuda.synchronize()
            ms = start.elapsed_time(end) / args.steps
        else:
            ms = (time.perf_counter() - t0) * 1e3 / args.steps
    return ms, checked, prefill, fed


def compare(ref: list, got: list) -> tuple[float, float]:
    """(max |diff| / max |ref| over the steps, share of steps with the same greedy token)."""
    err = max(float((g - r).abs().max() / r.abs().max().clamp_min(1e-30)) for r, g in zip(ref, got))
    same = sum(bool((g.argmax(-1) == r.argmax(-1)).all()) for r, g in zip(ref, got)) / max(1, len(ref))
    return err, same


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", default="1,32", help="comma list of batch sizes")
    p.add_argument("--context", type=int, default=2048, help="StaticCache length")
    p.add_argument("--steps", type=int, default=64, help="timed decode steps")
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--check", type=int, default=8, help="decode steps whose logits are compared")
    p.add_argument("--table", help="dispatch table JSON")
    p.add_argument("--state-dir", help="hwtune state dir: its table for this GPU (and where --search writes)")
    p.add_argument("--search", type=int, default=0, help="search the decode shapes first, N evaluations per shape")
    p.add_argument("--model-path", help="local checkpoint directory (from_pretrained, local files only)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tiny", action="store_true", help="a tiny config (smoke test)")
    args = p.parse_args(argv)
    args.batches = [int(b) for b in args.batch.split(",") if b]
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")   # before triton is imported

    import torch
    import transformers

    from kernelsearch.integrations.transformers import patch, unpatch

    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --device cpu --tiny for the smoke test", file=sys.stderr)
        return 2
    dtype = torch.bfloat16
    if device == "cuda":
        compile_kw = dict(mode="reduce-overhead", fullgraph=True)
        gpu = torch.cuda.get_device_name()
    else:   # no CUDA graphs, no C++ toolchain needed: trace the same graph, run it eagerly
        compile_kw = dict(fullgraph=True, backend="aot_eager")
        gpu = "cpu (Triton interpreter; times are not speeds)"
    log(f"transformers {transformers.__version__}, torch {torch.__version__}, {gpu}")
    model = build_model(args, device, dtype)
    config = model.config
    if args.search:
        args.state_dir = run_search(args, config, device, "bfloat16")
    table, source = load_table(args, device)
    log(f"dispatch table from {source}: {len(table.entries)} entries")

    rows, checks = [], []
    for batch in args.batches:
        prompt_len = max(1, args.context - args.check - args.warmup - args.steps - 1)
        g = torch.Generator(device="cpu").manual_seed(batch)
        prompt = torch.randint(0, config.vocab_size, (batch, prompt_len), generator=g).to(device)
        results = {}
        for mode in ("hf eager", "hf compiled", "hwtune + compiled"):
            report = None
            if mode == "hwtune + compiled":
                report = patch(model, table)
                print(f"batch {batch}: {report}")
            try:
                log(f"batch {batch}: {mode}")
                forced = results["hf eager"][3] if "hf eager" in results else None
                results[mode] = run_mode(model, mode, args, device, prompt, compile_kw, forced)
            except Exception as exc:   # a failing mode is a row, not the end of the run
                log(f"batch {batch}: {mode} failed: {type(exc).__name__}: {exc}")
                results[mode] = (math.inf, None, None, None)
            finally:
                if report is not None:
                    unpatch(model)
                torch._dynamo.reset()
        ref_ms, ref_logits, ref_prefill, _ = results["hf eager"]
        compiled_ms = results["hf compiled"][0]
        for mode, (ms, logits, prefill, _) in results.items():
            err = same = prefill_err = None
            if logits is not None and ref_logits is not None:
                err, same = compare(ref_logits, logits)
                prefill_err = float((prefill - ref_prefill).abs().max() / ref_prefill.abs().max())
            rows.append((batch, mode, ms, batch * 1e3 / ms if math.isfinite(ms) else 0.0,
                         compiled_ms / ms if math.isfinite(ms) else 0.0, prefill_err, err, same))
        if results["hwtune + compiled"][1] is not None:
            checks.append((batch, rows[-1][5], rows[-1][6], rows[-1][7]))

    print()
    print(f"hf LlamaForCausalLM, {config.num_hidden_layers} layers, bf16, StaticCache {args.context}, "
          f"{args.steps} timed steps, {gpu}, transformers {transformers.__version__}, table: {source}")
    print(f"{'batch':>5}  {'mode':<18} {'ms/step':>9} {'tokens/s':>10} {'vs hf compiled':>15} "
          f"{'prefill err':>12} {'decode err':>11} {'same token':>11}")
    for batch, mode, ms, tps, vs, perr, err, same in rows:
        fmt = lambda x, f: "-" if x is None else format(x, f)
        print(f"{batch:>5}  {mode:<18} {ms:>9.3f} {tps:>10.1f} {vs:>14.2f}x {fmt(perr, '>12.2e')} "
              f"{fmt(err, '>11.2e')} {fmt(same, '>10.0%')}")
    ok = all(e is not None and e < 5e-2 and pe < 5e-2 for _, pe, e, _ in checks) and len(checks) == len(args.batches)
    print("logits of the patched model within bf16 tolerance (5e-2 of max |logit|) of hf eager: "
          + ("yes" if ok else "NO"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
