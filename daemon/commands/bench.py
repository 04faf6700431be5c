"""`hwtune bench`: end-to-end tokens/s and tokens/J, or a user's workload; optional baseline report.

Read-only for hardware: it reads NVML (energy, clocks, power limit) and hwtune's status, and
never sets anything.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from daemon.bench.autotable import DEFAULT_EVALS
from daemon.device import DEVICE_HELP, resolve_device
from hwtune.errors import UsageError


def add_bench_arguments(p) -> None:
    m = p.add_argument_group("built-in model")
    m.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto", help=DEVICE_HELP)
    m.add_argument("--preset", choices=["tiny", "llama3-8b-8l"], default=None,
                   help="model size (default llama3-8b-8l on CUDA, tiny on CPU)")
    m.add_argument("--layers", type=int, default=None, help="override the preset's layer count")
    m.add_argument("--vocab", type=int, default=None, help="override the preset's vocabulary size")
    m.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None,
                   help="default bf16 on CUDA, fp32 on CPU")
    m.add_argument("--shapes", default=None, metavar="BxCTX,...",
                   help="decode batch x context, e.g. 1x2048,8x2048,32x2048,1x8192")
    m.add_argument("--prefill", default=None, metavar="BxT,...", help="prefill batch x tokens")
    m.add_argument("--variants", default="eager,graphed,compile,tuned",
                   help="comma list of eager, graphed, compile, tuned")
    m.add_argument("--steps", type=int, default=50, help="timed decode steps (median; >= 20)")
    m.add_argument("--warmup", type=int, default=10, help="untimed decode steps before the timed ones")
    m.add_argument("--energy-window-s", type=float, default=2.0,
                   help="NVML energy window per measurement (>= 2 s; 0 skips energy)")
    m.add_argument("--budget-s", type=float, default=270.0,
                   help="stop starting new measurements after this many seconds")
    m.add_argument("--table", default=None, metavar="PATH",
                   help="dispatch table (default STATE_DIR/dispatch/<fingerprint-id>.json)")
    m.add_argument("--search-evals", type=int, default=DEFAULT_EVALS,
                   help="where the dispatch table lacks a decode shape of the model, the tuned "
                        "variant first runs the kernel search there (within half of --budget-s): "
                        "evaluations per kernel, each measuring all its missing shapes")
    m.add_argument("--seed", type=int, default=0, help="seed of the model weights and tokens")
    w = p.add_argument_group("your workload instead of the built-in model")
    # dest differs from "command": the CLI keeps the subcommand's name there.
    w.add_argument("--command", dest="workload_command", default=None, metavar="CMD",
                   help="run CMD (no shell; split like a shell would) and read its metric")
    w.add_argument("--metric-regex", default=None,
                   help=r"regex whose first group is the metric (default tokens/s[:=]\s*([0-9.]+))")
    w.add_argument("--command-timeout-s", type=float, default=None, help="stop CMD after this many seconds (default none)")
    o = p.add_argument_group("output")
    o.add_argument("--baseline", type=Path, default=None, metavar="FILE",
                   help="results JSON of an earlier run (e.g. a cloud VM) to compare with")
    o.add_argument("--from-results", type=Path, default=None, metavar="FILE",
                   help="do not measure: report on this results JSON")
    o.add_argument("--out", type=Path, default=None, metavar="DIR",
                   help="write results.json, report.md, report.png here")
    o.add_argument("--json", action="store_true", help="print the results document on stdout")


def _load_json(path: Path, what: str) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except OSError as exc:
        raise UsageError(f"{what} {path}: {exc.strerror or exc}") from exc
    except ValueError as exc:
        raise UsageError(f"{what} {path}: not JSON ({exc})") from exc


def run_bench(args, ctx) -> int:
    from daemon.context import ensure_writable_dir

    if args.search_evals < 1:
        raise UsageError(f"--search-evals {args.search_evals}: at least 1 evaluation per kernel")
    if args.steps < 20:
        raise UsageError(f"--steps {args.steps}: at least 20 steps for a median")
    baseline = _load_json(args.baseline, "--baseline") if args.baseline else None
    out_dir = args.out
    if out_dir is None and baseline is not None:
        out_dir = Path(ctx.state_dir) / "bench" / time.strftime("%Y%m%d-%H%M%S")
    if not args.from_results:
        args.device = resolve_device(args.device)
        if args.device == "cpu" and not args.workload_command:
            # The tuned variant runs Triton kernels, on a CPU only under the interpreter: the
            # same as `hwtune search --device cpu`, so the table a search wrote is used here.
            os.environ.setdefault("TRITON_INTERPRET", "1")
    if out_dir is not None:  # before measuring: minutes of work must not end in "cannot write"
        ensure_writable_dir(out_dir, "--out" if args.out else "report directory",
                            "choose another with --out DIR")
    if args.from_results:
        doc = _load_json(args.from_results, "--from-results")
    else:
        doc = _measure(args, ctx)
    doc.setdefault("created", time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    if baseline is not None:
        doc["baseline"] = {"path": str(args.baseline), "label": baseline.get("label"),
                           "created": baseline.get("created")}

    if out_dir is not None:
        from daemon.bench.report import write_report
        (out_dir / "results.json").write_text(json.dumps(doc, indent=2, default=str) + "\n")
        paths = write_report(doc, baseline, out_dir)
        print(f"hwtune bench: wrote {out_dir / 'results.json'}, {paths['markdown']}, {paths['png']}",
              file=sys.stderr)

    if args.json:
        print(json.dumps(doc, indent=2, default=str))
    else:
        from daemon.bench.run import format_table
        if doc.get("decode") or doc.get("prefill"):
            print(format_table(doc))
        w = doc.get("workload")
        if w:
            print(f"workload: {w.get('status')}: metric {w.get('metric')}")
    w = doc.get("workload")
    if w and w.get("status") != "ok":
        return 1
    ok_rows = [r for r in doc.get("decode", []) + doc.get("prefill", []) if r.get("status") == "ok"]
    if not w and not ok_rows:
        return 1
    return 0


def _measure(args, ctx) -> dict:
    from daemon.bench import fingerprint

    reader = None
    if args.workload_command:
        from daemon.bench.workload import DEFAULT_METRIC_REGEX, run_workload
        reader = _gpu_reader(args.device)
        print(f"hwtune bench: running {args.workload_command}", file=sys.stderr)
        doc = {"label": "workload", "workload": run_workload(
            args.workload_command, args.metric_regex or DEFAULT_METRIC_REGEX, args.command_timeout_s, reader)}
        table_path = args.table
    else:
        from daemon.bench.run import Bench, BenchOptions, parse_shapes
        try:
            opts = BenchOptions(
                device=args.device, preset=args.preset, layers=args.layers, vocab=args.vocab,
                dtype=args.dtype, shapes=parse_shapes(args.shapes or ""),
                prefill_shapes=parse_shapes(args.prefill or ""),
                variants=tuple(v.strip() for v in args.variants.split(",") if v.strip()),
                steps=args.steps, warmup=args.warmup, energy_window_s=args.energy_window_s,
                budget_s=args.budget_s, table_path=args.table, state_dir=str(ctx.state_dir),
                search_evals=args.search_evals, seed=args.seed)
        except ValueError as exc:
            raise UsageError(str(exc)) from exc
        unknown = set(opts.variants) - {"eager", "graphed", "compile", "tuned"}
        if unknown:
            raise UsageError(f"--variants: unknown {', '.join(sorted(unknown))}")
        try:
            import torch
            cuda = torch.cuda.is_available() and args.device != "cpu"
        except ImportError as exc:
            raise UsageError("hwtune bench needs torch for the built-in model (or use --command)") from exc
        reader = _gpu_reader(args.device) if cuda else None
        doc = Bench(opts, reader=reader).run()
        table_path = opts.table_path
    gpu_facts = reader.facts() if reader is not None and reader.available else None
    doc["fingerprint"] = fingerprint.collect(ctx, gpu_facts=gpu_facts, table_path=table_path)
    return doc


def _gpu_reader(device: str):
    if device == "cpu":
        return None
    from daemon.bench.gpu_readings import GpuReader
    reader = GpuReader(0)
    return reader if reader.available else None
