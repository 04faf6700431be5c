"""Does the patched model's first torch.compile write out the hwtune ops' IR? (BENCHMARKS 10f)

    PYTHONPATH=. python3 bench/compile_fallback_check.py [--layers 8] [--no-register] [--limit-s 90]

A tiny LlamaForCausalLM (`--layers` decoder layers) patched by hwtune with every call through the
ops (stock inside: no GPU, no Triton needed), one decode step compiled by inductor on the CPU
(fullgraph, a fresh inductor cache directory: a cached graph skips lowering). Counts inductor's
`OperatorIssue.operator_str` calls (the text of an op's IR arguments, which torch 2.11 builds for
every implicit fallback whatever the log level) and the longest such text. `--no-register`
patches without ops.register_inductor_fallbacks (what patch() did before 10f): on torch 2.11 the
text grows ~5x a layer and the compile does not finish; past `--limit-s` every thread's stack is
printed and the process exits. Needs a C++ compiler (inductor's CPU code).
"""
from __future__ import annotations

import argparse
import faulthandler
import os
import sys
import tempfile
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--no-register", action="store_true")
    ap.add_argument("--limit-s", type=int, default=90)
    args = ap.parse_args(argv)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="hwtune-inductor-")
    import torch
    import torch._inductor.exc as inductor_exc
    from transformers import StaticCache

    import kernelsearch.ops as kops
    if args.no_register:
        kops.register_inductor_fallbacks = lambda: []
    from daemon.bench.hf import HfOptions, build_model, cache_kwarg
    from kernelsearch.dispatch import DispatchTable
    from kernelsearch.integrations.transformers import patch

    formatted = []
    real = inductor_exc.OperatorIssue.operator_str

    def counted(target, op_args, kwargs):
        text = real(target, op_args, kwargs)
        formatted.append((str(target), len(text)))
        return text

    inductor_exc.OperatorIssue.operator_str = staticmethod(counted)
    faulthandler.dump_traceback_later(args.limit_s, exit=True)
    model, _ = build_model(HfOptions(device="cpu", layers=args.layers, tiny=True))
    print(f"torch {torch.__version__}:", patch(model, DispatchTable.empty(), stock_through_ops=True), flush=True)
    kw = cache_kwarg()
    cache = StaticCache(config=model.config, max_cache_len=64)
    forward = torch.compile(model.forward, fullgraph=True)
    with torch.no_grad():
        first = model(torch.randint(0, model.config.vocab_size, (2, 20)), **{kw: cache}, use_cache=True,
                      logits_to_keep=1)
        t0 = time.monotonic()
        forward(first.logits[:, -1:].argmax(-1), **{kw: cache}, use_cache=True)
    faulthandler.cancel_dump_traceback_later()
    longest = max(formatted, key=lambda f: f[1], default=("-", 0))
    print(f"{'without' if args.no_register else 'with'} the registration, {args.layers} layers: first compile "
          f"{time.monotonic() - t0:.1f} s; operator_str {len(formatted)} calls, longest {longest[1]} "
          f"characters ({longest[0]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
