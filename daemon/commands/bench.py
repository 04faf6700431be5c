"""`hwtune bench`: end-to-end tokens/s and tokens/J, or a user's workload; optional baseline report.

Read-only for hardware: it reads NVML (energy, clocks, power limit) and hwtune's status, and
never sets anything.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

from daemon.bench.autotable import DEFAULT_EVALS
from daemon.context import path_arg
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
                   help="decode batch x context (default 1x2048,8x2048,32x2048,1x8192 on CUDA, 1x32,2x32 on CPU)")
    m.add_argument("--prefill", default=None, metavar="BxT,...",
                   help="prefill batch x tokens (default 1x2048 on CUDA, 1x32 on CPU)")
    m.add_argument("--variants", default=None,
                   help="comma list of eager, graphed, compile, tuned, tuned-unfused (built-in, all by default; "
                        "tuned-nopdl, the tuned step without programmatic dependent launch, by name only) and "
                        "hf-eager, hf-compiled, hf-hwtune-unfused, hf-hwtune, hf-liger (hf-llama, all by default)")
    m.add_argument("--steps", type=int, default=50, help="timed decode steps (median; >= 20)")
    m.add_argument("--warmup", type=int, default=10, help="untimed decode steps before the timed ones")
    m.add_argument("--energy-window-s", type=float, default=2.0,
                   help="NVML energy window per measurement (>= 2 s; 0 skips energy)")
    m.add_argument("--budget-s", type=float, default=270.0,
                   help="stop starting new measurements after this many seconds (per model)")
    m.add_argument("--table", default=None, metavar="PATH",
                   help="dispatch table (default STATE_DIR/dispatch/<fingerprint-id>.json)")
    m.add_argument("--search-evals", type=int, default=DEFAULT_EVALS,
                   help="where the dispatch table lacks a decode shape of the model, the tuned "
                        "variant first runs the kernel search there (within half of --budget-s): "
                        "evaluations per kernel, each measuring all its missing shapes")
    m.add_argument("--judge-in-step", action="store_true",
                   help="before the tuned rows of each decode shape, re-time the table's entries "
                        "inside this step against their leading configs in the ledger and stock "
                        "(kernelsearch.stepjudge; only CUDA timings change the table) and keep the fastest; "
                        "the judged table is written back to its file (--table's too). With --model "
                        "hf-llama: judged in the built-in step with the model's dimensions on a cache of "
                        "exactly the context (the StaticCache the patched model decodes on)")
    m.add_argument("--judge-top", type=int, default=None, metavar="N",
                   help="--judge-in-step: the ledger's N leading configs of each entry are tried "
                        "(default 3; each costs about a second of the step timed on a GPU)")
    m.add_argument("--seed", type=int, default=0, help="seed of the model weights and tokens")
    h = p.add_argument_group("Hugging Face model")
    h.add_argument("--model", default="builtin", metavar="builtin,hf-llama",
                   help="builtin (the built-in decoder), hf-llama (transformers' LlamaForCausalLM: "
                        "eager, compiled, patched by hwtune, Liger), or both in one run and report")
    h.add_argument("--model-path", default=None, metavar="DIR",
                   help="hf-llama: a local Llama checkpoint (config.json + *.safetensors; nothing is "
                        "downloaded) instead of random weights with Llama-3-8B dimensions")
    h.add_argument("--check", type=int, default=8,
                   help="hf-llama: decode steps whose logits are compared with hf eager's (teacher-forced)")
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
    o.add_argument("--out", type=path_arg, default=None, metavar="DIR",
                   help="write results.json, report.md, report.png here (default: with --baseline "
                        "STATE_DIR/bench/<date-time>, else no files: the results are printed)")
    o.add_argument("--json", action="store_true", help="print the results document on stdout")


def _load_json(path: Path, what: str) -> dict:
    try:
        doc = json.loads(Path(path).read_text())
    except OSError as exc:
        raise UsageError(f"{what} {path}: {exc.strerror or exc}") from exc
    except ValueError as exc:
        raise UsageError(f"{what} {path}: not JSON ({exc})") from exc
    if not isinstance(doc, dict) or not any(doc.get(k) for k in ("decode", "prefill", "workload")):
        raise UsageError(f"{what} {path}: not a results document of hwtune bench "
                         "(its results.json: decode, prefill or workload results)")
    return doc


MODELS = ("builtin", "hf-llama")


def _models(args) -> tuple:
    """--model, --model-path and --variants checked before anything is measured."""
    models = tuple(m.strip() for m in (args.model or "builtin").split(",") if m.strip())
    unknown = [m for m in models if m not in MODELS]
    if unknown or not models:
        raise UsageError(f"--model {args.model}: expected builtin, hf-llama or builtin,hf-llama")
    top = getattr(args, "judge_top", None)
    if top is not None and not getattr(args, "judge_in_step", False):
        raise UsageError("--judge-top is for --judge-in-step")
    if top is not None and not 1 <= top <= 32:
        raise UsageError(f"--judge-top {top}: 1 to 32 configs an entry")
    if getattr(args, "judge_in_step", False) and (args.from_results or args.workload_command):
        raise UsageError("--judge-in-step judges the built-in model's step: not with "
                         + ("--from-results" if args.from_results else "--command"))
    if args.from_results or args.workload_command:
        return models
    from daemon.bench import hf
    from daemon.bench.run import EXTRA_VARIANTS, VARIANTS

    if args.model_path is not None:
        if "hf-llama" not in models:
            raise UsageError("--model-path is for --model hf-llama")
        problem = hf.check_model_path(args.model_path)
        if problem:
            raise UsageError(problem)
    if args.check < 1:
        raise UsageError(f"--check {args.check}: at least 1 compared step")
    if getattr(args, "judge_in_step", False) and args.variants is not None:
        names = [v.strip() for v in args.variants.split(",")]
        from daemon.bench.hf import HWTUNE
        if not ("builtin" in models and "tuned" in names) and not ("hf-llama" in models and set(HWTUNE) & set(names)):
            raise UsageError(f"--judge-in-step judges the tuned step: --variants {args.variants} has no "
                             + " or ".join(["tuned"] * ("builtin" in models) + ["hf-hwtune"] * ("hf-llama" in models)))
    if args.variants is not None:
        names = [v.strip() for v in args.variants.split(",") if v.strip()]
        unknown = sorted(set(names) - set(VARIANTS) - set(EXTRA_VARIANTS) - set(hf.VARIANTS))
        if unknown:
            raise UsageError(f"--variants: unknown {', '.join(unknown)}")
        for model, known in (("builtin", VARIANTS + EXTRA_VARIANTS), ("hf-llama", hf.VARIANTS)):
            if model in models and not set(names) & set(known):
                raise UsageError(f"--variants {args.variants}: none for --model {model} "
                                 f"({', '.join(known)})")
    return models


def _variants(args, known, extra=()) -> tuple:
    """--variants, those of this model only; all of `known` by default (`extra` by name only)."""
    if args.variants is None:
        return tuple(known)
    return tuple(v for v in (x.strip() for x in args.variants.split(",")) if v in known or v in extra)


def run_bench(args, ctx) -> int:
    from daemon.context import ensure_writable_dir

    if args.search_evals < 1:
        raise UsageError(f"--search-evals {args.search_evals}: at least 1 evaluation per kernel")
    if args.table is not None and not args.from_results:
        if Path(args.table).is_dir():
            raise UsageError(f"--table {args.table}: a directory, not a dispatch table file")
        if not Path(args.table).exists():   # not a different table in its place, silently
            raise UsageError(f"--table {args.table}: no such file")
    if args.steps < 20:
        raise UsageError(f"--steps {args.steps}: at least 20 steps for a median")
    for flag, value, least in (("--layers", args.layers, 1), ("--vocab", args.vocab, 1),
                               ("--warmup", args.warmup, 0)):
        if value is not None and value < least:
            raise UsageError(f"{flag} {value}: at least {least}")
    if not (math.isfinite(args.budget_s) and args.budget_s > 0):
        raise UsageError(f"--budget-s {args.budget_s:g}: a positive number of seconds")
    if not (args.energy_window_s == 0 or (math.isfinite(args.energy_window_s) and args.energy_window_s >= 2)):
        # NVML's energy counter needs a window of seconds to say anything (see the help)
        raise UsageError(f"--energy-window-s {args.energy_window_s:g}: 0 (no energy) or at least 2 seconds")
    if args.metric_regex is not None:
        import re

        try:
            re.compile(args.metric_regex)
        except re.error as exc:
            raise UsageError(f"--metric-regex {args.metric_regex!r}: not a regular expression ({exc})") from None
    if args.workload_command is not None:   # checked now: not a traceback, nor the built-in model for ''
        import shlex
        import shutil

        try:
            argv = shlex.split(args.workload_command)
        except ValueError as exc:
            raise UsageError(f"--command {args.workload_command!r}: {exc} (it is split as a shell would)") from None
        if not argv:
            raise UsageError("--command is empty: name the program to run")
        if shutil.which(argv[0]) is None:
            raise UsageError(f"--command: {argv[0]}: no such program, or not an executable file "
                             "(it runs without a shell)")
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
    args.models = _models(args)   # after TRITON_INTERPRET: this imports torch
    # read before --out is made: a bad file must leave nothing behind
    doc = _load_json(args.from_results, "--from-results") if args.from_results else None
    if out_dir is not None:  # before measuring: minutes of work must not end in "cannot write"
        ensure_writable_dir(out_dir, "--out" if args.out else "report directory",
                            "choose another with --out DIR")
    if doc is None:
        doc = _measure(args, ctx)
    doc.setdefault("created", time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    if baseline is not None:
        doc["baseline"] = {"path": str(args.baseline), "label": baseline.get("label"),
                           "created": baseline.get("created"), "differences": _baseline_differences(doc, baseline)}
        for line in doc["baseline"]["differences"]:
            print(f"hwtune bench: against {args.baseline}: {line}", file=sys.stderr)

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
        if baseline is not None:
            from daemon.bench.report import comparison_text
            print(comparison_text(doc, baseline))
    w = doc.get("workload")
    if w and w.get("status") != "ok":
        return 1
    ok_rows = [r for r in doc.get("decode", []) + doc.get("prefill", []) if r.get("status") == "ok"]
    if not w and not ok_rows:
        return 1
    return 0


def _baseline_differences(doc: dict, baseline: dict) -> list[str]:
    """What makes the comparison with `baseline` other than like for like (the report's notes on
    it: GPUs, virtualization, model, dtype; and how many fingerprint fields differ), said on the
    terminal and kept in results.json, not only in report.md."""
    from daemon.bench.report import fingerprint_diff, notes

    own = notes(doc, None)
    out = [line for line in notes(doc, baseline) if line not in own]
    diff = fingerprint_diff(doc.get("fingerprint"), baseline.get("fingerprint"))
    if diff:
        fields = ", ".join(k for k, _, _ in diff[:4]) + (", ..." if len(diff) > 4 else "")
        out.append(f"environment fields that differ: {len(diff)} ({fields}; report.md lists them)")
    return out


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
    elif args.models == ("hf-llama",):
        reader = _gpu_reader(args.device) if _cuda(args) else None
        doc = _measure_hf(args, ctx, reader, None)
        table_path = args.table
    else:
        from daemon.bench.run import EXTRA_VARIANTS, VARIANTS, Bench, BenchOptions, parse_shapes
        try:
            opts = BenchOptions(
                device=args.device, preset=args.preset, layers=args.layers, vocab=args.vocab,
                dtype=args.dtype, shapes=parse_shapes(args.shapes or ""),
                prefill_shapes=parse_shapes(args.prefill or ""),
                variants=_variants(args, VARIANTS, EXTRA_VARIANTS),
                steps=args.steps, warmup=args.warmup, energy_window_s=args.energy_window_s,
                budget_s=args.budget_s, table_path=args.table, state_dir=str(ctx.state_dir),
                search_evals=args.search_evals, seed=args.seed, judge_in_step=args.judge_in_step,
                judge_top=args.judge_top)
        except ValueError as exc:
            raise UsageError(str(exc)) from exc
        try:
            import torch
            cuda = torch.cuda.is_available() and args.device != "cpu"
        except ImportError as exc:
            raise UsageError("hwtune bench needs torch for the built-in model (or use --command)") from exc
        reader = _gpu_reader(args.device) if cuda else None
        doc = Bench(opts, reader=reader).run()
        table_path = opts.table_path
        if "hf-llama" in args.models:   # one run, one report: the hf rows join the built-in ones
            hf_doc = _measure_hf(args, ctx, reader, doc.get("copy_bandwidth_gbs"))
            doc["decode"] += hf_doc["decode"]
            doc["hf"] = hf_doc["hf"]
            doc["models"] = list(args.models)
    gpu_facts = reader.facts() if reader is not None and reader.available else None
    doc["fingerprint"] = fingerprint.collect(ctx, gpu_facts=gpu_facts, table_path=table_path)
    return doc


def _cuda(args) -> bool:
    try:
        import torch
    except ImportError as exc:
        raise UsageError("hwtune bench needs torch for --model hf-llama (or use --command)") from exc
    return torch.cuda.is_available() and args.device != "cpu"


def _measure_hf(args, ctx, reader, copy_bandwidth_gbs) -> dict:
    """The hf-llama rows; alone, a document of the built-in rows' structure."""
    try:
        import transformers  # noqa: F401
    except ImportError as exc:
        raise UsageError(f"--model hf-llama needs transformers: {exc}") from exc
    from daemon.bench import hf
    from daemon.bench.run import parse_shapes

    cuda = _cuda(args)
    try:
        shapes = parse_shapes(args.shapes or "")
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    dtype = args.dtype or ("bf16" if cuda else "fp32")
    opts = hf.HfOptions(
        device="cuda" if cuda else "cpu", tiny=(args.preset == "tiny") if args.preset else not cuda,
        layers=args.layers, vocab=args.vocab, model_path=args.model_path, dtype=dtype,
        shapes=shapes or ([(1, 2048), (8, 2048), (32, 2048)] if cuda else [(1, 96)]),
        variants=_variants(args, hf.VARIANTS), steps=args.steps, warmup=args.warmup, check=args.check,
        energy_window_s=args.energy_window_s if cuda else 0.0, budget_s=args.budget_s,
        table_path=args.table, state_dir=str(ctx.state_dir), seed=args.seed,
        search_evals=args.search_evals, judge_in_step=getattr(args, "judge_in_step", False),
        judge_top=getattr(args, "judge_top", None))
    out = hf.HfBench(opts, reader=reader, copy_bandwidth_gbs=copy_bandwidth_gbs).run()
    section = out["hf"]
    return {"label": "cuda" if cuda else "cpu", "device": opts.device, "model": section["model"],
            "dtype": dtype, "variants": list(opts.variants), "steps": opts.steps, "warmup": opts.warmup,
            "energy_window_s": opts.energy_window_s, "decode": out["decode"], "prefill": [], "floors": [],
            "copy_bandwidth_gbs": section["copy_bandwidth_gbs"], "models": ["hf-llama"],
            "energy_source": reader.source if (reader is not None and reader.available) else None,
            "hf": section}


def _gpu_reader(device: str):
    if device == "cpu":
        return None
    from daemon.bench.gpu_readings import GpuReader
    reader = GpuReader(0)
    return reader if reader.available else None
