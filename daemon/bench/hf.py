"""`hwtune bench --model hf-llama`: Hugging Face LlamaForCausalLM, stock and patched, in one run.

The model: transformers' LlamaForCausalLM built from a config with Llama-3-8B dimensions
(hidden 4096, 32 / 8 heads of 128, MLP 14336, untied 128256-row head, RoPE theta 500000 with
Llama 3.1's llama3 scaling), `--layers` decoder layers, random weights seeded by `--seed`; on a
CPU a tiny config of the same shape family (the Triton interpreter runs the kernels: timings,
not speeds). Or `--model-path DIR`: a local checkpoint, loaded with local_files_only (nothing
is downloaded).

Rows per (batch, context) of `--shapes`, each on a StaticCache of `context` positions (a prompt
of random tokens prefilled eagerly, so that the last timed step reaches the end of the cache):
  hf-eager      the model as loaded, no compile
  hf-compiled   model.forward under torch.compile(mode="reduce-overhead", fullgraph=True), the
                path transformers documents as fast (on a CPU: backend aot_eager, no graphs)
  hf-hwtune-unfused  patch(model, table, fused=False): issue 12's patch (separate norm,
                projection and SwiGLU ops), the previous tuned step, then the same compile
  hf-hwtune     kernelsearch.integrations.transformers.patch(model, table) with the fused decode
                kernels (norm+qkv, o+residual, norm+gate|up+SwiGLU, down+residual) where the
                table routes them, then the same compile
  hf-liger      liger_kernel's apply_liger_kernel_to_llama(model=...) (rope, rms_norm, swiglu;
                no loss kernels: the bench needs the logits), then the same compile; undone after
Each mode: `--check` greedy steps whose logits are kept, fed hf eager's tokens (teacher-forced,
so that a near-tie flipped in one of B sequences does not send it down another path), then
`--warmup` steps, then `--steps` steps each timed with CUDA events (the argmax included):
step_ms is their median. Errors against hf eager: max |diff| / max |ref| of the prefill's last
logits and over the checked steps, and the share of checked steps whose greedy tokens all match.
Energy (CUDA with NVML): the same timed steps repeated over >= --energy-window-s, the cache
rewound to the same positions before each repeat -> tokens/J. Floor: daemon.bench.run's
decode_floor on the same dimensions (weights + KV read + KV written over the measured copy
bandwidth), with the head (the rows are full steps, logits out).
A failing mode is a row with its status, never the end of the run.
"""
from __future__ import annotations

import json
import math
import statistics
import threading
import time
import traceback
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch

from daemon.bench.model import ModelConfig
from daemon.bench.run import (decode_floor, energy_window, error_status, log, measure_copy_bandwidth_gbs,
                              time_steps)
from kernelsearch.harness.run_plan import pdl_note

MODEL = "hf-llama"
VARIANTS = ("hf-eager", "hf-compiled", "hf-hwtune-unfused", "hf-hwtune", "hf-liger")
LABELS = {"hf-eager": "hf eager", "hf-compiled": "hf compiled",
          "hf-hwtune-unfused": "hwtune unfused + compiled", "hf-hwtune": "hwtune patched + compiled",
          "hf-liger": "liger + compiled"}
HWTUNE = {"hf-hwtune-unfused": False, "hf-hwtune": True}   # variant -> patch(..., fused=)
TOLERANCE = 5e-2   # of max |logit|: bf16 noise over a few layers, far below a wrong kernel
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
INTERPRETER_NOTE = ("cpu: Triton kernels ran under the interpreter and compile used aot_eager: "
                    "these rows prove the pipeline and the logits, their times are not speeds")


@dataclass
class HfOptions:
    device: str = "cuda"                 # resolved: cuda or cpu
    tiny: bool = False                   # a tiny config (default on CPU)
    layers: int | None = None            # default 8 (Llama-3-8B dims), 2 (tiny)
    vocab: int | None = None
    model_path: str | None = None
    dtype: str = "bf16"
    shapes: list = field(default_factory=list)   # [(batch, context)]
    variants: tuple = VARIANTS
    steps: int = 50
    warmup: int = 10
    check: int = 8
    energy_window_s: float = 2.0
    budget_s: float = 270.0
    table_path: str | None = None
    state_dir: str | None = None
    seed: int = 0
    search_evals: int | None = None      # ensure_table's evals per kernel (None: its default)
    judge_in_step: bool = False          # the step judge at this model's cache shapes first
    judge_top: int | None = None         # its alternatives an entry (None: stepjudge.TOP)


def check_model_path(path) -> str | None:
    """Why a --model-path cannot be loaded, or None. Read before anything is measured."""
    p = Path(path)
    if not p.is_dir():
        return f"--model-path {path}: no such directory (a local checkpoint: config.json + *.safetensors)"
    if not (p / "config.json").is_file():
        return f"--model-path {path}: no config.json (a local checkpoint: config.json + *.safetensors)"
    if not any(p.glob("*.safetensors")):
        return f"--model-path {path}: no *.safetensors weights"
    try:
        model_type = json.loads((p / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError) as exc:
        return f"--model-path {path}: config.json is not a model config ({type(exc).__name__})"
    if model_type != "llama":
        # LlamaForCausalLM.from_pretrained loads another family's checkpoint with a warning only:
        # weights it does not name (biases, other layouts) dropped or left random
        return f"--model-path {path}: model_type {model_type!r}; --model hf-llama benches a Llama checkpoint " \
               "(model_type 'llama'): another family would load into LlamaForCausalLM with weights dropped or random"
    return None


# ---- the model ------------------------------------------------------------------------------
def llama3_8b_config(layers: int | None = None, tiny: bool = False, vocab: int | None = None):
    """Llama-3-8B's dimensions (RoPE as in Llama 3.1 8B's config.json), `layers` decoder layers;
    tiny: the same family at hidden 64 (GQA 4/2 heads kept, the llama3 RoPE scaling too)."""
    from transformers import LlamaConfig

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    common = dict(rope_parameters=rope, max_position_embeddings=131072, rms_norm_eps=1e-5,
                  tie_word_embeddings=False, hidden_act="silu", attention_bias=False, mlp_bias=False,
                  attn_implementation="sdpa")
    if tiny:
        return LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers or 2,
                           num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab or 256, **common)
    return LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers or 8,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                       vocab_size=vocab or 128256, **common)


def build_model(opts: HfOptions):
    """-> (model in eval mode on opts.device, a one-line description)."""
    from transformers import LlamaForCausalLM

    dtype = DTYPES[opts.dtype]
    if opts.model_path:
        model = LlamaForCausalLM.from_pretrained(opts.model_path, local_files_only=True, dtype=dtype)
        return model.to(opts.device).eval(), f"checkpoint {opts.model_path}"
    config = llama3_8b_config(opts.layers, opts.tiny, opts.vocab)
    torch.manual_seed(opts.seed)
    with torch.device(opts.device):
        model = LlamaForCausalLM(config).to(dtype).eval()
    with torch.no_grad():   # random norms, so that a norm kernel that ignores its weight shows
        g = torch.Generator(device="cpu").manual_seed(opts.seed + 7)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g).to(p))
    kind = "tiny config" if opts.tiny else "Llama-3-8B dimensions"
    return model, f"random weights (seed {opts.seed}), {kind}"


def floor_config(config) -> ModelConfig:
    """The HF config as the built-in model's config, for decode_floor's byte counts."""
    hq = config.num_attention_heads
    d = getattr(config, "head_dim", None) or config.hidden_size // hq
    return ModelConfig(f"{MODEL}-L{config.num_hidden_layers}", hidden=config.hidden_size,
                       layers=config.num_hidden_layers, heads=hq, kv_heads=config.num_key_value_heads,
                       head_dim=d, ffn=config.intermediate_size, vocab=config.vocab_size)


def cache_kwarg() -> str:
    import inspect

    import transformers

    # transformers 5.24 renamed past_key_values to cache
    return "cache" if "cache" in inspect.signature(transformers.LlamaModel.forward).parameters \
        else "past_key_values"


def rewind(cache, n: int) -> bool:
    """Move every layer of a StaticCache back by n positions in place (the tensors keep their
    addresses, so compiled graphs stay valid). False where this transformers keeps the position
    some other way (then energy is not measured)."""
    layers = getattr(cache, "layers", None)
    if not layers or not all(isinstance(getattr(layer, "cumulative_length", None), torch.Tensor)
                             for layer in layers):
        return False
    for layer in layers:
        layer.cumulative_length.sub_(n)
    return True


# ---- liger ----------------------------------------------------------------------------------
def liger_apply(model):
    """apply_liger_kernel_to_llama on the instance; -> (undo, report lines). It also rebinds
    module-level names of transformers' modeling_llama (apply_rotary_pos_emb, LlamaRMSNorm,
    LlamaMLP) and the instances' methods: undo puts every one of them back."""
    import importlib.metadata

    from liger_kernel.transformers import apply_liger_kernel_to_llama
    from transformers.models.llama import modeling_llama

    names = ("apply_rotary_pos_emb", "LlamaRMSNorm", "LlamaMLP")
    module_saved = {n: getattr(modeling_llama, n) for n in names if hasattr(modeling_llama, n)}
    forward_saved = modeling_llama.LlamaForCausalLM.forward
    saved = [(m, dict(vars(m))) for m in model.modules()]   # the model itself included

    def undo():
        for n, v in module_saved.items():
            setattr(modeling_llama, n, v)
        modeling_llama.LlamaForCausalLM.forward = forward_saved
        for m, before in saved:
            for k in [k for k in vars(m) if k not in before]:
                del m.__dict__[k]
            for k, v in before.items():
                if m.__dict__.get(k) is not v:
                    m.__dict__[k] = v

    try:
        # The loss kernels are for training (fused_linear_cross_entropy never materialises the
        # logits the bench compares): off. rope, rms_norm, swiglu: liger's defaults.
        apply_liger_kernel_to_llama(rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                    fused_linear_cross_entropy=False, model=model)
    except BaseException:
        undo()
        raise
    version = importlib.metadata.version("liger_kernel")
    lines = [f"liger_kernel {version}: apply_liger_kernel_to_llama(model=...) rope, rms_norm, swiglu",
             "  stock: attention, the projections and lm_head (liger has no inference kernels for "
             "them); cross entropy off (a loss kernel, no logits)"]
    return undo, lines


def liger_problem() -> str | None:
    try:
        import liger_kernel.transformers  # noqa: F401
    except Exception as exc:   # not installed, or its triton / transformers imports fail
        return f"skipped: liger_kernel not importable: {type(exc).__name__}: {str(exc)[:200]}"
    return None


# ---- the table ------------------------------------------------------------------------------
def resolve_table(opts: HfOptions, config, left_s: float):
    """(table | None, note, search details) from ensure_table: --table as it is; else the state
    dir's table for this device, the model's missing decode shapes searched first within half of
    what is left of the budget (the built-in tuned variant's rule)."""
    from daemon.bench.autotable import ensure_table
    from kernelsearch.integrations.transformers import decode_shapes

    if opts.table_path is not None and not Path(opts.table_path).exists():
        return None, f"--table {opts.table_path}: no such file (the patched model runs stock)", []
    shapes = decode_shapes(config, sorted({b for b, _ in opts.shapes}), sorted({c for _, c in opts.shapes}))
    budget = max(0.0, min(left_s, opts.budget_s) * 0.5)
    details: list = []
    extra = {} if opts.search_evals is None else {"evals": opts.search_evals}
    log(f"hf-llama: dispatch table for the decode shapes (search budget {budget:.0f}s where missing)")
    try:
        table, note = ensure_table(state_dir=opts.state_dir, device=opts.device, dtype=DTYPE_NAMES[opts.dtype],
                                   shapes=shapes, budget_s=budget, table_path=opts.table_path,
                                   progress=lambda line: log("  " + line), details=details, **extra)
    except Exception as exc:   # a failed search is a note: the patched model runs stock
        return None, f"no table: the search failed: {type(exc).__name__}: {str(exc)[:200]}", details
    return table, note, details


# ---- the step judge at the model's cache shapes ---------------------------------------------
JUDGE_SHARE = 0.5   # of the budget left when the table is resolved: the rows still run


def judge_table(opts: HfOptions, fcfg, table, note, left_s: float):
    """-> (table, {shape: record}): kernelsearch.stepjudge at each of opts.shapes, run by the
    built-in bench on its step with this model's dimensions (fcfg) on a cache of exactly `context`
    slots: the calls and shapes of the patched model's one-token step on its StaticCache
    (max_cache_len = context), whose S-keyed entries (rmsnorm_qkv_rope, decode_attention,
    rope_kv_attention) the built-in bench's own judge (cache_len(ctx) slots) never sees. One
    judge, one keep rule: the table is judged and written back as `hwtune bench --judge-in-step`
    does; the patched rows then run it."""
    from daemon.bench.run import Bench, BenchOptions

    bench = Bench(BenchOptions(device=opts.device, dtype=opts.dtype, shapes=list(opts.shapes),
                               variants=("tuned",), budget_s=max(0.0, left_s * JUDGE_SHARE),
                               state_dir=opts.state_dir, seed=opts.seed, judge_in_step=True,
                               judge_top=opts.judge_top))
    doc: dict = {}
    table = bench.judge_at_cache(fcfg, table, note, doc)
    return table, doc.get("step_judge", {})


# ---- one mode -------------------------------------------------------------------------------
HEARTBEAT_S = 30.0   # a compile still running says so this often


@contextmanager
def heartbeat(what: str, every_s: float = HEARTBEAT_S):
    """Log "WHAT: still running after N s" every `every_s` while the block runs: a first
    torch.compile of a model takes seconds to minutes, and silence looks like a hang."""
    stop = threading.Event()
    t0 = time.monotonic()

    def beat():
        while not stop.wait(every_s):
            log(f"{what}: still running after {time.monotonic() - t0:.0f}s")

    thread = threading.Thread(target=beat, name="hwtune-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def run_mode(model, mode: str, opts: HfOptions, prompt, forced=None, reader=None,
             fullgraph: bool = True) -> dict:
    """Prefill eagerly, `check` teacher-forced steps (kept; they also compile), `warmup`, then
    `steps` timed steps. -> {times_ms, checked, prefill, fed, compile_s, energy}."""
    from transformers import StaticCache

    cuda = opts.device == "cuda"
    kw = cache_kwarg()
    context = prompt.shape[1] + opts.check + opts.warmup + opts.steps + 1
    cache = StaticCache(config=model.config, max_cache_len=context)
    forward = model.forward
    graphs = cuda and mode != "hf-eager"
    if mode != "hf-eager":
        torch._dynamo.reset()
        compile_kw = dict(mode="reduce-overhead", fullgraph=fullgraph) if cuda else \
            dict(fullgraph=fullgraph, backend="aot_eager")   # CPU: no CUDA graphs, no C++ toolchain
        forward = torch.compile(model.forward, **compile_kw)

    def step(token):
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        return forward(token, **{kw: cache}, use_cache=True).logits[:, -1]

    out = {"checked": [], "compile_s": None, "energy": None}
    state = {}
    with torch.no_grad():
        first = model(prompt, **{kw: cache}, use_cache=True, logits_to_keep=1)
        out["prefill"] = first.logits[:, -1].float().clone()
        token = forced[0] if forced is not None else first.logits[:, -1:].argmax(-1)
        fed = [token]
        for i in range(opts.check):
            t = time.monotonic()
            compiling = i == 0 and mode != "hf-eager"
            with heartbeat(f"hf-llama {mode}: compiling (torch.compile, the first step)") if compiling \
                    else nullcontext():
                logits = step(token)
            out["checked"].append(logits.float().clone())   # out of the graph pool before the next replay
            if compiling:
                if cuda:
                    torch.cuda.synchronize()
                out["compile_s"] = time.monotonic() - t
                log(f"hf-llama {mode}: compiled in {out['compile_s']:.1f}s")
            token = forced[i + 1] if forced is not None and i + 1 < len(forced) else \
                logits.argmax(-1, keepdim=True)
            fed.append(token)
        out["fed"] = fed
        state["token"] = token

        def one():
            state["token"] = step(state["token"]).argmax(-1, keepdim=True)

        out["times_ms"] = time_steps(one, opts.steps, opts.warmup, cuda)

        def segment():   # the timed steps again, at the same cache positions
            if not rewind(cache, opts.steps):
                raise _NoRewind()
            for _ in range(opts.steps):
                one()

        if cuda and reader is not None and opts.energy_window_s > 0:
            try:
                out["energy"] = energy_window(segment, reader, opts.energy_window_s, 1)
            except _NoRewind:
                out["energy"] = {"energy_j": None, "note": "this transformers' StaticCache has no "
                                 "cumulative_length tensor to rewind: no energy window"}
    return out


class _NoRewind(Exception):
    pass


def compare(ref: list, got: list) -> tuple[float, float]:
    """(max |diff| / max |ref| over the steps, share of steps with the same greedy tokens)."""
    err = max(float((g - r).abs().max() / r.abs().max().clamp_min(1e-30)) for r, g in zip(ref, got))
    same = sum(bool((g.argmax(-1) == r.argmax(-1)).all()) for r, g in zip(ref, got)) / max(1, len(ref))
    return err, same


# ---- the run --------------------------------------------------------------------------------
class HfBench:
    def __init__(self, opts: HfOptions, reader=None, copy_bandwidth_gbs: float | None = None):
        self.opts = opts
        self.reader = reader
        self.copy_gbs = copy_bandwidth_gbs
        self.t0 = time.monotonic()

    def left_s(self) -> float:
        return self.opts.budget_s - (time.monotonic() - self.t0)

    compile_s: float | None = None   # the last compile's seconds, to plan the budget

    def budget_problem(self, mode: str) -> str | None:
        left = self.left_s()
        if mode == "hf-eager" or left >= 10 and (self.compile_s is None or left >= 1.5 * self.compile_s + 20):
            return None
        return "skipped: time budget spent" + (f" (the last compile took {self.compile_s:.0f}s; "
                                               "raise --budget-s)" if self.compile_s else "")

    def run(self) -> dict:
        """-> {"decode": [rows], "hf": {the section}} in the built-in rows' structure."""
        import transformers

        from kernelsearch.integrations.transformers import patch, unpatch

        o = self.opts
        cuda = o.device == "cuda"
        log(f"hf-llama: building LlamaForCausalLM ({o.model_path or ('tiny' if o.tiny else 'Llama-3-8B dims')}, "
            f"{o.dtype}) on {o.device}, transformers {transformers.__version__}")
        model, source = build_model(o)
        config = model.config
        dtype_bytes = torch.empty(0, dtype=DTYPES[o.dtype]).element_size()
        if cuda and self.copy_gbs is None:
            torch.cuda.synchronize()
            self.copy_gbs = measure_copy_bandwidth_gbs(o.device)
            log(f"copy bandwidth {self.copy_gbs:.0f} GB/s (read+write)")
        fcfg = floor_config(config)
        section = {"model": {"name": f"{MODEL}-L{config.num_hidden_layers}", "source": source,
                             "class": type(model).__name__, "hidden": config.hidden_size,
                             "layers": config.num_hidden_layers, "heads": config.num_attention_heads,
                             "kv_heads": config.num_key_value_heads, "ffn": config.intermediate_size,
                             "vocab": config.vocab_size,
                             "rope": dict(getattr(config, "rope_parameters", None) or {})},
                   "dtype": o.dtype, "transformers": transformers.__version__, "torch": torch.__version__,
                   "variants": list(o.variants), "labels": {v: LABELS[v] for v in o.variants},
                   "steps": o.steps, "warmup": o.warmup, "check": o.check,
                   "copy_bandwidth_gbs": self.copy_gbs, "floors": [], "patch_reports": {},
                   "tolerance": TOLERANCE}
        if not cuda:
            section["note"] = INTERPRETER_NOTE
        hwtune_rows = bool(set(HWTUNE) & set(o.variants))
        if hwtune_rows:
            table, note, searched = resolve_table(o, config, self.left_s())
            section["kernel_table"] = {"path": str(o.table_path) if o.table_path else None,
                                       "loaded": table is not None, "note": note, "search": searched}
            log(f"hf-llama: kernels for {', '.join(v for v in HWTUNE if v in o.variants)}: {note}")
            if table is not None and o.judge_in_step:
                table = self._judge(fcfg, table, note, section)
        liger_skip = liger_problem() if "hf-liger" in o.variants else None
        rows = []
        for batch, ctx in o.shapes:
            floor = decode_floor(fcfg, batch, ctx, dtype_bytes, self.copy_gbs)
            section["floors"].append(floor)
            try:
                rows += self._shape(model, batch, ctx, floor, table if hwtune_rows else None,
                                    section, liger_skip, patch, unpatch)
            except Exception as exc:   # e.g. out of memory at this shape: the others still run
                log(f"hf-llama {batch}x{ctx} failed: {type(exc).__name__}: {exc}")
                rows.append({"model": MODEL, "variant": ",".join(o.variants), "batch": batch, "ctx": ctx,
                             "status": error_status(exc)})
            finally:
                torch._dynamo.reset()
                if cuda:
                    torch.cuda.empty_cache()
        section["wall_s"] = time.monotonic() - self.t0
        return {"decode": rows, "hf": section}

    def _judge(self, fcfg, table, note, section):
        """judge_table on this run's table; its records in section["step_judge"]; a judge that
        fails leaves the table as it was (the rows still run)."""
        log("hf-llama: step judge at the model's cache shapes (the built-in step with its dimensions, "
            "a cache of exactly the context)")
        try:
            table, section["step_judge"] = judge_table(self.opts, fcfg, table, note, self.left_s())
        except Exception as exc:
            section["step_judge"] = {"status": error_status(exc)}
            log(f"hf-llama: step judge failed: {section['step_judge']['status']}")
        return table

    def _shape(self, model, batch, ctx, floor, table, section, liger_skip, patch, unpatch) -> list:
        o = self.opts
        cuda = o.device == "cuda"
        prompt_len = ctx - o.check - o.warmup - o.steps - 1
        if prompt_len < 1:
            raise ValueError(f"context {ctx} is shorter than check + warmup + steps + 2 "
                             f"({o.check + o.warmup + o.steps + 2})")
        g = torch.Generator(device="cpu").manual_seed(o.seed * 1000 + batch)
        prompt = torch.randint(0, model.config.vocab_size, (batch, prompt_len), generator=g).to(o.device)
        # hf eager first, always: its tokens feed every other mode, its logits are the reference
        modes = ["hf-eager"] + [v for v in VARIANTS if v in o.variants and v != "hf-eager"]
        results, rows = {}, {}
        for mode in modes:
            row = {"model": MODEL, "variant": mode, "label": LABELS[mode], "batch": batch, "ctx": ctx,
                   "status": "ok"}
            if not cuda:
                row["interpreter_timing"] = True
            skip = self.budget_problem(mode)
            if skip:
                row["status"] = skip
                rows[mode] = row
                continue
            undo = None
            t_start = time.monotonic()
            try:
                if mode in HWTUNE:
                    if table is not None:
                        table.counts.clear()
                    report = patch(model, table, fused=HWTUNE[mode])
                    row["patch_report"] = report.lines()
                    row["patched"] = dict(report.patched)
                    row["pdl"] = pdl_note()
                    key = f"{batch}x{ctx}" if mode == "hf-hwtune" else f"{batch}x{ctx} {mode}"
                    section["patch_reports"][key] = report.lines()
                    undo = lambda: unpatch(model)  # noqa: E731
                elif mode == "hf-liger":
                    if liger_skip:
                        row["status"] = liger_skip
                        rows[mode] = row
                        log(f"hf-llama {batch}x{ctx}: {LABELS[mode]}: {liger_skip}")
                        continue
                    undo, row["patch_report"] = liger_apply(model)
                log(f"hf-llama {batch}x{ctx}: {LABELS[mode]}")
                forced = results["hf-eager"]["fed"] if "hf-eager" in results else None
                try:
                    res = run_mode(model, mode, o, prompt, forced, self.reader)
                except Exception as exc:
                    if mode != "hf-liger" or not type(exc).__module__.startswith("torch._dynamo"):
                        raise
                    # Liger's modules are autograd.Functions around Triton kernels, which a
                    # torch.compile may not trace in one graph: what a user would do next.
                    row["fullgraph_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                    log(f"hf-llama {mode}: fullgraph=True failed ({row['fullgraph_error'][:120]}); "
                        "again with fullgraph=False")
                    res = run_mode(model, mode, o, prompt, forced, self.reader, fullgraph=False)
                    row["note"] = "compiled with fullgraph=False (graph breaks allowed)"
                results[mode] = res
                if mode in HWTUNE and table is not None:
                    # op calls by route while the mode ran (traced, eager prefill, steps); under
                    # CUDA graphs a replay calls nothing: the routes are those of the captures
                    row["table_routes"] = {f"{k}:{r}": n for (k, r), n in sorted(table.counts.items())}
                if res["compile_s"] is not None:
                    self.compile_s = res["compile_s"]
                ms = statistics.median(res["times_ms"])
                row.update(step_ms=ms, step_ms_mean=statistics.fmean(res["times_ms"]),
                           tokens_per_s=batch / (ms * 1e-3), compile_s=res["compile_s"])
                if floor.get("floor_with_head_ms"):
                    row["floor_with_head_ms"] = floor["floor_with_head_ms"]
                    row["pct_of_floor_with_head"] = 100.0 * floor["floor_with_head_ms"] / ms
                e = res["energy"]
                row["tokens_per_j"] = None
                if e is None:
                    row["energy_note"] = "n/a: no NVML energy counter on a CPU" if not cuda else (
                        "n/a: --energy-window-s 0" if o.energy_window_s <= 0 else "n/a: no NVML energy reader")
                if e:
                    row["energy"] = e
                    if e.get("energy_j"):
                        row["tokens_per_j"] = batch * o.steps * e["calls"] / e["energy_j"]
            except Exception as exc:   # a failing mode is a row
                row["status"] = error_status(exc)
                row["traceback"] = traceback.format_exc(limit=6)[-2000:]
            finally:
                if undo is not None:
                    undo()
                torch._dynamo.reset()
                row["wall_s"] = time.monotonic() - t_start
            rows[mode] = row
        ref = results.get("hf-eager")
        compiled = rows.get("hf-compiled", {}).get("step_ms")
        unfused = rows.get("hf-hwtune-unfused", {}).get("step_ms")
        for mode, row in rows.items():
            res = results.get(mode)
            if res is not None and ref is not None and res["checked"]:
                err, same = compare(ref["checked"], res["checked"])
                prefill = float((res["prefill"] - ref["prefill"]).abs().max()
                                / ref["prefill"].abs().max().clamp_min(1e-30))
                row.update(decode_err_vs_hf_eager=err, prefill_err_vs_hf_eager=prefill,
                           same_token_share=same)
                if mode != "hf-eager" and not (err <= TOLERANCE and prefill <= TOLERANCE):
                    row["warning"] = f"logits differ from hf eager beyond {TOLERANCE:g} of max |logit|"
            if compiled and row.get("step_ms"):
                row["speedup_vs_hf_compiled"] = compiled / row["step_ms"]
            if mode == "hf-hwtune" and unfused and row.get("step_ms"):
                # the fused kernels against the previous tuned step (issue 12's patch), same run
                row["speedup_vs_hwtune_unfused"] = unfused / row["step_ms"]
            if row["status"] == "ok":
                tj = f"{row['tokens_per_j']:.1f} tok/J" if row.get("tokens_per_j") else "no energy"
                log(f"hf-llama {mode:17s} B={batch:<3d} ctx={ctx:<5d} {row['step_ms']:.3f} ms "
                    f"{row['tokens_per_s']:.0f} tok/s {tj} (decode err {row.get('decode_err_vs_hf_eager', 0):.1e})")
            else:
                log(f"hf-llama {mode:17s} B={batch:<3d} ctx={ctx:<5d} {row['status']}")
        return [rows[m] for m in modes if m in o.variants]


def format_lines(doc: dict) -> list[str]:
    """The hf rows' own columns, for the terminal table."""
    hf = doc.get("hf")
    if not hf:
        return []
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    m = hf.get("model", {})
    lines = [f"{m.get('name')} ({m.get('source')}), {hf.get('dtype')}, transformers {hf.get('transformers')}"
             + (f"; {hf['note']}" if hf.get("note") else ""),
             f"{'hf variant':26s} {'batch':>5s} {'ctx':>6s} {'ms/step':>9s} {'tokens/s':>10s} {'tokens/J':>9s} "
             f"{'% floor':>8s} {'vs hf compiled':>14s} {'prefill err':>11s} {'decode err':>10s} "
             f"{'same tok':>8s}  status"]
    for r in doc.get("decode", []):
        if r.get("model") != MODEL:
            continue
        same = r.get("same_token_share")
        lines.append(
            f"{LABELS.get(r['variant'], r['variant']):26s} {r['batch']:5d} {r['ctx']:6d} "
            f"{fmt(r.get('step_ms'), '.3f'):>9s} {fmt(r.get('tokens_per_s'), '.0f'):>10s} "
            f"{fmt(r.get('tokens_per_j'), '.1f') if r.get('tokens_per_j') or r.get('status') != 'ok' else 'n/a':>9s} "
            f"{(fmt(r.get('pct_of_floor_with_head'), '.0f') + '%') if r.get('pct_of_floor_with_head') else '-':>8s} "
            f"{(fmt(r.get('speedup_vs_hf_compiled'), '.2f') + 'x') if r.get('speedup_vs_hf_compiled') else '-':>14s} "
            f"{fmt(r.get('prefill_err_vs_hf_eager'), '.2e'):>11s} {fmt(r.get('decode_err_vs_hf_eager'), '.2e'):>10s} "
            f"{(format(same, '.0%') if same is not None else '-'):>8s}  {r.get('status', '')[:70]}")
    if hf.get("step_judge"):   # judged before the rows above ran: they ran the judged table
        from daemon.bench.run import judge_lines
        st = hf["step_judge"]
        lines += judge_lines(st if "status" not in st else {"(the model's cache shapes)": st})
    for r in doc.get("decode", []):
        if r.get("model") == MODEL and r.get("speedup_vs_hwtune_unfused"):
            lines.append(f"hwtune fused vs unfused (the previous tuned step) {r['batch']}x{r['ctx']}: "
                         f"{r['speedup_vs_hwtune_unfused']:.2f}x")
    table = hf.get("kernel_table")
    if table:
        lines.append(f"hwtune kernels: {table.get('note')}")
    for r in doc.get("decode", []):
        if r.get("model") == MODEL and r.get("patch_report"):
            lines.append(f"{LABELS[r['variant']]} {r['batch']}x{r['ctx']}:")
            lines += [f"  {line}" for line in r["patch_report"]]
    return lines
