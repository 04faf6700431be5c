"""Measure prefill and decode throughput of the built-in model, per variant and shape.

Variants (decode): eager (stock ops, Python launches each step), graphed (the same step
captured in one CUDA graph and replayed), compile (torch.compile max-autotune of the same
step), tuned (the step graphed with hwtune's kernels substituted through TunedOps, the fused
decode kernels -- norm + projection, projection + residual add, norm + gate|up + SwiGLU --
wherever the table routes them), tuned-unfused (the same table without the fused kernels:
issue 12's tuned step, the fusion's baseline). All run the same fused weights (QKV as one
matrix, gate/up as one, nn.Linear's [N, K] layout) so the comparison is fair.

Timing: CUDA events around each step (or replay), warm-up first, median of >= 20 steps;
tokens/s = batch / step time. Energy: NVML's total-energy counter over a separate window of
>= 2 s of back-to-back steps -> tokens/J. Floor: bytes a decode step must move (weights +
KV read for the context + KV written) over the copy bandwidth measured in the same run.
A failing variant is a row with `status` and the error, never an abort.
"""
from __future__ import annotations

import logging
import math
import os
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

from daemon.bench.autotable import DEFAULT_EVALS, default_table_path, ensure_table
from daemon.bench.model import PRESETS, Model
from daemon.bench.ops import (DTYPE_NAMES, StockOps, TunedOps, cache_len, decode_shapes,
                              describe_fusions, describe_kernels, kernels_per_layer, rel_l2, time_in_graph_ms,
                              warm_up_for_capture)
from kernelsearch.harness.run_plan import pdl, pdl_note

VARIANTS = ("eager", "graphed", "compile", "tuned", "tuned-unfused")
# Asked for by name only (--variants), not run by default.
EXTRA_VARIANTS = ("tuned-nopdl",)
# The variants that run TunedOps on the dispatch table: variant -> (whether fused kernels are
# asked, whether the table's kernels launch with programmatic dependent launch where the device
# has it). tuned-nopdl is tuned launched plainly: what PDL gives, in the same run.
TUNED_VARIANTS = {"tuned": (True, True), "tuned-unfused": (False, True), "tuned-nopdl": (True, False)}
ALL_STOCK = "no tuned kernel ran: every call is stock (see its kernels)"
FAIR_NOTE = ("All variants run the same model with the same fused weights (one QKV matrix, "
             "one gate/up matrix) and the same static KV cache; eager, graphed and compile apply "
             "RoPE as one batched matmul before the KV-cache write; the tuned variant is the "
             "graphed step with the dispatch table's kernels (verified and kept by kernelsearch's "
             "search, e.g. a RoPE+KV-write kernel where the table has one) wherever the table has "
             "an entry for the call, stock everywhere else, and a fused decode kernel (norm + "
             "projection, projection + residual add, norm + gate/up + SwiGLU) in place of the "
             "unfused calls wherever the table has one; tuned-unfused is the same table without "
             "the fused kernels; they differ only in how the step is launched and which kernels run.")
# Without a table covering the decode shapes, the search gets at most this share of --budget-s.
SEARCH_SHARE = 0.5
# --judge-in-step: graph replays a timing of the step (a ~1 ms step: cheap), and the budget a
# shape needs left to start (plans of the ledger's configs, a capture and 3 rounds an alternative)
JUDGE_REPS = 50
JUDGE_MIN_S = 60
JUDGE_RESERVE_S = 30   # no entry is judged in the budget's last seconds: the rows still run


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def error_status(exc: BaseException) -> str:
    """A row's or a judge record's status when `exc` stopped it: "error: Type: message", the
    message cut at 300 characters."""
    return f"error: {type(exc).__name__}: {str(exc)[:300]}"


def fastest_stock_attention(model, batch: int, ctx: int, log=print) -> tuple[str, dict]:
    """(name, {name: ms}): the faster of StockOps' decode attentions ("sdpa", "bmm") for `model`
    at (batch, ctx), each timed in a CUDA graph on the model's layer-0 cache; "sdpa" when
    neither ran. The stock every variant of a run uses: eager in a CUDA graph is what a user
    would run, so it gets the faster one (bmm at batch 1 on Hopper, sdpa at batch 32)."""
    c = model.cfg
    q = torch.randn(batch, c.heads, c.head_dim, device=model.device).to(model.dtype)
    seq_lens = torch.full((batch,), ctx + 1, device=model.device, dtype=torch.int32)
    kc, vc = model.kv[0, 0], model.kv[0, 1]
    times = {}
    for name in ("sdpa", "bmm"):
        ops = StockOps(name)
        mask = ops.attention_mask(seq_lens, kc.shape[2], model.dtype)
        try:
            times[name] = time_in_graph_ms(lambda: ops.decode_attention(q, kc, vc, seq_lens, model.scale, mask))
        except Exception as exc:
            log(f"stock attention {name} failed: {type(exc).__name__}: {exc}")
    return (min(times, key=times.get) if times else "sdpa"), times


@dataclass
class BenchOptions:
    device: str = "auto"
    preset: str | None = None
    layers: int | None = None
    vocab: int | None = None
    dtype: str | None = None
    shapes: list = field(default_factory=list)          # [(batch, ctx)] decode
    prefill_shapes: list = field(default_factory=list)  # [(batch, tokens)]
    variants: tuple = VARIANTS
    steps: int = 50
    warmup: int = 10
    energy_window_s: float = 2.0
    budget_s: float = 270.0
    table_path: str | None = None
    state_dir: str | None = None
    search_evals: int = DEFAULT_EVALS
    seed: int = 0
    judge_in_step: bool = False   # kernelsearch.stepjudge on each shape's tuned step first
    judge_top: int | None = None  # its alternatives an entry from the ledger (None: stepjudge.TOP)


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """'1x2048,8x2048' -> [(1, 2048), (8, 2048)]"""
    out = []
    for part in (text or "").split(","):
        part = part.strip().lower()
        if not part:
            continue
        b, _, n = part.partition("x")
        if not (b.isdigit() and n.isdigit()) or int(b) < 1 or int(n) < 1:
            raise ValueError(f"shape {part!r}: expected BATCHxLENGTH, e.g. 8x2048")
        out.append((int(b), int(n)))
    return out


def resolve_defaults(opts: BenchOptions) -> BenchOptions:
    cuda = torch.cuda.is_available() and opts.device in ("auto", "cuda")
    if opts.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda: torch sees no CUDA device")
    opts.device = "cuda" if cuda else "cpu"
    if opts.preset is None:
        opts.preset = "llama3-8b-8l" if cuda else "tiny"
    if opts.dtype is None:
        opts.dtype = "bf16" if cuda else "fp32"
    if not opts.shapes:
        opts.shapes = [(1, 2048), (8, 2048), (32, 2048), (1, 8192)] if cuda else [(1, 32), (2, 32)]
    if not opts.prefill_shapes:
        opts.prefill_shapes = [(1, 2048)] if cuda else [(1, 32)]
    if not cuda:
        opts.energy_window_s = 0.0
    return opts


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


# ---- timing ---------------------------------------------------------------------------------
def time_steps(fn, steps: int, warmup: int, cuda: bool) -> list[float]:
    for _ in range(warmup):
        fn()
    if not cuda:
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return times
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(steps)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in events]


def energy_window(fn, reader, window_s: float, calls_per_check: int) -> dict | None:
    """Back-to-back calls for >= window_s; -> {energy_j, calls, wall_s} or None."""
    if window_s <= 0 or reader is None or not reader.available:
        return None
    torch.cuda.synchronize()
    e0, t0 = reader.energy_mj(), time.perf_counter()
    if e0 is None:
        return None
    calls = 0
    while True:
        for _ in range(calls_per_check):
            fn()
        calls += calls_per_check
        torch.cuda.synchronize()
        if time.perf_counter() - t0 >= window_s:
            break
    wall = time.perf_counter() - t0
    e1 = reader.energy_mj()
    if e1 is None or e1 <= e0:
        return {"energy_j": None, "calls": calls, "wall_s": wall,
                "note": "energy counter did not advance"}
    return {"energy_j": (e1 - e0) / 1000.0, "calls": calls, "wall_s": wall}


def measure_copy_bandwidth_gbs(device, nbytes: int = 2 << 30) -> float:
    """Device-to-device copy; bytes read + bytes written over the median time."""
    n = nbytes // 2
    src = torch.randn(n, device=device, dtype=torch.float32).to(torch.bfloat16)
    dst = torch.empty_like(src)
    times = time_steps(lambda: dst.copy_(src), steps=10, warmup=3, cuda=True)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * n * 2 / (statistics.median(times) * 1e-3) / 1e9


FLOOR_NOTE = ("floor_ms: the layers' weights (QKV, O, gate/up, down, two norms per layer) + the "
              "KV cache read for the context + the KV written, over the measured copy bandwidth "
              "(read+write bytes / time of a 2 GB device copy); no LM head, no final norm. "
              "floor_with_head_ms adds the final norm and the LM head. pct_of_floor = floor_ms / "
              "step_ms_no_head (the decode step timed without final norm and LM head); "
              "pct_of_floor_with_head = floor_with_head_ms / step_ms (the full step, logits out).")


def decode_floor(cfg, batch: int, ctx: int, dtype_bytes: int, copy_gbs: float | None) -> dict:
    w = cfg.weight_bytes(dtype_bytes)
    w_head = cfg.head_weight_bytes(dtype_bytes)
    per_tok = cfg.kv_bytes_per_token(dtype_bytes)
    kv_read, kv_write = batch * ctx * per_tok, batch * per_tok
    total = w + kv_read + kv_write
    no_head = total - w_head

    def ms(nbytes):
        return nbytes / (copy_gbs * 1e9) * 1e3 if copy_gbs else None

    return {"batch": batch, "ctx": ctx, "weight_bytes": w, "head_weight_bytes": w_head,
            "kv_read_bytes": kv_read, "kv_write_bytes": kv_write, "total_bytes": total,
            "total_bytes_no_head": no_head, "floor_ms": ms(no_head),
            "floor_with_head_ms": ms(total)}


def capture_graph(fn):
    """Warm up on a side stream (as torch requires), then capture one call."""
    warm_up_for_capture(fn)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    torch.cuda.synchronize()
    return graph, out


class _CudagraphLog(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record):
        try:
            msg = record.getMessage()
        except Exception:
            return
        if "cudagraph" in msg.lower() and msg not in self.messages:
            self.messages.append(msg[:300])


def _inductor_counters() -> dict:
    try:
        from torch._dynamo.utils import counters
        return {k: dict(v) for k, v in counters.items() if k == "inductor"}.get("inductor", {})
    except Exception:
        return {}


# ---- the benchmark ----------------------------------------------------------------------------
class Bench:
    def __init__(self, opts: BenchOptions, reader=None):
        self.opts = resolve_defaults(opts)
        self.cuda = self.opts.device == "cuda"
        self.reader = reader
        self.t0 = time.monotonic()
        self.compile_s: float | None = None
        self.stock_attention: dict = {}
        self.cg_log = None

    def left_s(self) -> float:
        return self.opts.budget_s - (time.monotonic() - self.t0)

    def run(self) -> dict:
        o = self.opts
        cfg = PRESETS[o.preset].with_overrides(o.layers, o.vocab)
        dtype = DTYPES[o.dtype]
        dtype_bytes = torch.empty(0, dtype=dtype).element_size()
        doc = {"label": "cuda" if self.cuda else "cpu", "device": o.device, "model": cfg.to_json(),
               "dtype": o.dtype, "fair_note": FAIR_NOTE, "variants": list(o.variants),
               "steps": o.steps, "warmup": o.warmup, "energy_window_s": o.energy_window_s,
               "decode": [], "prefill": [], "floors": [], "tuned_kernels": {}, "compile": {},
               "floor_note": FLOOR_NOTE}
        log(f"{doc['label']}: model {cfg.name} {o.dtype}, shapes {o.shapes}, variants {list(o.variants)}, "
            f"budget {o.budget_s:.0f}s")
        table, table_note, details = None, "tuned variant not run: no table needed", []
        if set(TUNED_VARIANTS) & set(o.variants):
            search_budget_s = SEARCH_SHARE * o.budget_s
            table, table_note = ensure_table(
                state_dir=o.state_dir, device=o.device, dtype=DTYPE_NAMES[dtype],
                shapes=decode_shapes(cfg, o.shapes, fused=any(
                    TUNED_VARIANTS[v][0] for v in o.variants if v in TUNED_VARIANTS)),
                budget_s=search_budget_s, table_path=o.table_path,
                progress=log, evals=o.search_evals, details=details)
        if o.table_path is None and o.state_dir is not None:
            o.table_path = default_table_path(o.state_dir, o.device)
        doc["kernel_table"] = {"path": str(o.table_path) if o.table_path else None,
                               "loaded": table is not None, "note": table_note, "search": details,
                               "search_evals": o.search_evals}
        log(f"kernels for tuned: {table_note}")
        torch.manual_seed(o.seed)
        model = Model(cfg, device=o.device, dtype=dtype, seed=o.seed)
        if self.cuda:
            torch.cuda.synchronize()
            doc["copy_bandwidth_gbs"] = measure_copy_bandwidth_gbs(o.device)
            log(f"copy bandwidth {doc['copy_bandwidth_gbs']:.0f} GB/s (read+write)")
        else:
            doc["copy_bandwidth_gbs"] = None
        doc["energy_source"] = self.reader.source if (self.reader and self.reader.available) else None
        if self.cuda and doc["energy_source"] is None:
            doc["energy_note"] = getattr(self.reader, "error", "no NVML reader")

        floors = {}
        for batch, ctx in o.shapes:
            floors[(batch, ctx)] = decode_floor(cfg, batch, ctx, dtype_bytes, doc["copy_bandwidth_gbs"])
            doc["floors"].append(floors[(batch, ctx)])
        # torch.compile last: its compile time is the least predictable part of the budget.
        first = [v for v in o.variants if v != "compile"]
        passes = [first] + ([["compile"]] if "compile" in o.variants else [])
        for i, variants in enumerate(passes):
            for batch, ctx in o.shapes:
                if not variants:
                    continue
                try:
                    table = self._decode_shape(model, batch, ctx, floors[(batch, ctx)], variants, table,
                                               table_note, doc)
                except Exception as exc:  # e.g. out of memory for this shape: the rest still runs
                    log(f"decode {batch}x{ctx} failed: {type(exc).__name__}: {exc}")
                    doc["decode"].append({"variant": ",".join(variants), "batch": batch, "ctx": ctx,
                                          "status": error_status(exc)})
                finally:
                    model.kv = None
                    if self.cuda:
                        torch.cuda.empty_cache()
            if i > 0:
                continue
            for batch, tokens in o.prefill_shapes:
                try:
                    self._prefill_shape(model, batch, tokens, table, doc)
                except Exception as exc:
                    log(f"prefill {batch}x{tokens} failed: {type(exc).__name__}: {exc}")
                    doc["prefill"].append({"variant": "*", "batch": batch, "tokens": tokens,
                                           "status": error_status(exc)})
                finally:
                    model.kv = None
                    if self.cuda:
                        torch.cuda.empty_cache()
        order = {v: i for i, v in enumerate(o.variants)}
        doc["decode"].sort(key=lambda r: (o.shapes.index((r["batch"], r["ctx"])),
                                          order.get(r["variant"], 99)))
        doc["stock_attention"] = {f"{b}x{c}": v for (b, c), v in self.stock_attention.items()}
        if self.cg_log is not None:
            logging.getLogger("torch").removeHandler(self.cg_log)
        doc["wall_s"] = time.monotonic() - self.t0
        return doc

    # ---- decode -------------------------------------------------------------------------------
    def _choose_stock_attention(self, model, batch, ctx) -> str:
        """The faster stock decode attention at this shape, for every variant alike."""
        key = (batch, ctx)
        if key in self.stock_attention:
            return self.stock_attention[key]
        choice = "sdpa"
        if self.cuda:
            choice, times = fastest_stock_attention(model, batch, ctx, log=log)
            log(f"stock attention at {batch}x{ctx}: " +
                ", ".join(f"{k} {v * 1e3:.1f} us" for k, v in times.items()) + f" -> {choice}")
        self.stock_attention[key] = choice
        return choice

    def _step_inputs(self, model, batch, s_max, position):
        """A decode step's inputs on `model`: a cache of s_max random slots, random tokens at
        `position` (every row), the stock ops (the faster stock attention there), stock's
        logits and the tolerance against them -> (tokens, positions, stock, ref, tol)."""
        o = self.opts
        model.allocate_cache(batch, s_max)
        model.fill_cache_random(seed=o.seed + 1)
        g = torch.Generator(device=o.device)
        g.manual_seed(o.seed + 2)
        tokens = torch.randint(1, model.cfg.vocab, (batch,), generator=g, device=o.device)
        positions = torch.full((batch,), position, device=o.device, dtype=torch.int64)
        stock = StockOps(self._choose_stock_attention(model, batch, position))
        ref = model.decode_step(tokens, positions, stock).float()
        return tokens, positions, stock, ref, 5e-2 if model.dtype != torch.float32 else 1e-3

    def _decode_shape(self, model, batch, ctx, floor, variants, table, table_note, doc):
        o = self.opts
        s_max = cache_len(ctx)
        tokens, positions, stock, ref, tol = self._step_inputs(model, batch, s_max, ctx)
        ref_no_head = model.decode_step(tokens, positions, stock, head=False).float()
        if o.judge_in_step and "tuned" in variants:
            table = self._judge_in_step(model, tokens, positions, stock, table, table_note, doc, batch,
                                        ctx, ref, tol)
        for variant in variants:
            row = {"variant": variant, "batch": batch, "ctx": ctx, "s_max": s_max}
            if variant in ("eager", "graphed"):  # the stock step (compile's are inductor's own)
                row["kernels_per_layer"] = kernels_per_layer(stock, model.cfg, batch, s_max,
                                                             DTYPE_NAMES[model.dtype])
            if self.left_s() < 15:
                row["status"] = "skipped: time budget spent"
                doc["decode"].append(row)
                continue
            t_start = time.monotonic()
            try:
                fn, out, extra = self._make_step(variant, model, tokens, positions, stock, table,
                                                 table_note, doc, batch, ctx, ref, tol)
                fn_nh = extra.pop("_no_head", None)
                if fn is None:
                    row.update(extra)
                    doc["decode"].append(row)
                    log(f"decode {variant:13s} B={batch:<3d} ctx={ctx:<5d} {row['status']}")
                    continue
                row.update(extra)
                out_now = fn()
                logits = (out if out is not None else out_now).float()
                row["rel_l2_vs_eager"] = rel_l2(logits, ref)
                times = time_steps(fn, o.steps, o.warmup, self.cuda)
                step_ms = statistics.median(times)
                row.update(status="ok", step_ms=step_ms, step_ms_min=min(times),
                           step_ms_max=max(times), tokens_per_s=batch / (step_ms * 1e-3))
                if floor["floor_with_head_ms"]:
                    row["pct_of_floor_with_head"] = 100.0 * floor["floor_with_head_ms"] / step_ms
                if fn_nh is not None:
                    f_nh, out_nh = fn_nh
                    now = f_nh()
                    row["rel_l2_no_head_vs_eager"] = rel_l2((out_nh if out_nh is not None else now).float(),
                                                            ref_no_head)
                    times_nh = time_steps(f_nh, o.steps, o.warmup, self.cuda)
                    row["step_ms_no_head"] = statistics.median(times_nh)
                    row["tokens_per_s_no_head"] = batch / (row["step_ms_no_head"] * 1e-3)
                    if floor["floor_ms"]:
                        row["pct_of_floor"] = 100.0 * floor["floor_ms"] / row["step_ms_no_head"]
                if self.cuda:
                    calls = max(1, int(0.2 / (step_ms * 1e-3)))
                    e = energy_window(fn, self.reader, o.energy_window_s, calls)
                    if e:
                        row["energy"] = e
                        if e.get("energy_j"):
                            row["tokens_per_j"] = batch * e["calls"] / e["energy_j"]
                            row["avg_power_w"] = e["energy_j"] / e["wall_s"]
                if row["rel_l2_vs_eager"] > tol:
                    row["warning"] = "logits differ from eager beyond bf16 noise"
                if variant in TUNED_VARIANTS and row.get("kernels") and not any(
                        str(v).startswith("tuned") for v in row["kernels"].values()):
                    # timed, but it is the stock step: say so where the row is read
                    row["warning"] = "; ".join(filter(None, [row.get("warning"), ALL_STOCK]))
            except Exception as exc:
                row["status"] = error_status(exc)
                row["traceback"] = traceback.format_exc(limit=6)[-2000:]
            finally:
                row["wall_s"] = time.monotonic() - t_start
                if self.cuda:
                    try:
                        torch.cuda.synchronize()
                    except Exception as exc:  # a broken context: the shape loop records it
                        row["status"] = f"error after run: {type(exc).__name__}: {str(exc)[:200]}"
            doc["decode"].append(row)
            if row.get("status") == "ok":
                tj = f"{row['tokens_per_j']:.1f} tok/J" if row.get("tokens_per_j") else "no energy"
                pf = (f"no head {row['step_ms_no_head']:.3f} ms = {row['pct_of_floor']:.0f}% of floor"
                      if row.get("pct_of_floor") else "")
                log(f"decode {variant:13s} B={batch:<3d} ctx={ctx:<5d} {row['step_ms']:.3f} ms "
                    f"{row['tokens_per_s']:.0f} tok/s {tj} {pf} (err {row['rel_l2_vs_eager']:.1e})"
                    + (f"; {row['warning']}" if row.get("warning") else ""))
            else:
                log(f"decode {variant:13s} B={batch:<3d} ctx={ctx:<5d} {row['status']}")
            fn = out = None
            if self.cuda:
                torch.cuda.empty_cache()
        return table

    def _judge_in_step(self, model, tokens, positions, stock, table, table_note, doc, batch, ctx, ref, tol,
                       key=None):
        """kernelsearch.stepjudge on this shape's tuned step (PDL as the tuned row launches it):
        -> the table the tuned rows then run, written back to its file (--table's too: a given
        table is not searched into, but --judge-in-step asks for it to be judged)."""
        from kernelsearch import stepjudge

        key = key or f"{batch}x{ctx}"
        section = doc.setdefault("step_judge", {})
        why = None
        if table is None:
            why = f"no dispatch table ({table_note})"
        elif not self.cuda and os.environ.get("TRITON_INTERPRET") != "1":
            why = "cpu without TRITON_INTERPRET=1 (the table's kernels cannot run)"
        elif self.left_s() < JUDGE_MIN_S:
            why = f"under {JUDGE_MIN_S} s of the budget left"
        if why:
            section[key] = {"status": f"not run: {why}"}
            log(f"step judge {key}: {section[key]['status']}")
            return table
        cfg, dt = model.cfg, DTYPE_NAMES[model.dtype]

        def make_step(t):
            ops = TunedOps(t, table_note, attention=stock.attention, fused=True)
            return lambda: model.decode_step(tokens, positions, ops)

        def check(out):
            err = rel_l2(out.float(), ref)
            return None if err <= tol else f"logits differ from stock's (rel_l2 {err:.2e} > {tol:g})"

        ledger = Path(self.opts.state_dir) / "ledger.sqlite" if self.opts.state_dir else None
        t0 = time.monotonic()
        try:
            probe = TunedOps(table, table_note, attention=stock.attention, fused=True)
            model.decode_step(tokens, positions, probe)   # the calls the step routes to the table
            calls = [(k, s, dt) for k, shapes in decode_shapes(cfg, [(batch, ctx)], fused=True,
                                                               s_max=model.s_max).items()
                     for s in shapes if probe.runs_tuned(k, s, dt)]
            with pdl(TUNED_VARIANTS["tuned"][1]):
                result = stepjudge.judge(table, make_step=make_step, calls=calls, device=self.opts.device,
                                         ledger_path=ledger, check=check, progress=log,
                                         top=self.opts.judge_top or stepjudge.TOP,
                                         reps=JUDGE_REPS if self.cuda else None,
                                         deadline=self.t0 + self.opts.budget_s - JUDGE_RESERVE_S)
        except Exception as exc:  # the rows still run, on the table as it was
            section[key] = {"status": error_status(exc),
                            "traceback": traceback.format_exc(limit=6)[-2000:]}
            log(f"step judge {key}: {section[key]['status']}")
            return table
        record = {"status": "ok", **result.to_json(), "wall_s": round(time.monotonic() - t0, 2),
                  "ledger": str(ledger) if ledger is not None and ledger.exists() else None}
        changed = [d for d in result.decisions if d.changed]
        if not result.decisions:
            record["written"] = ("nothing to judge: the step routes none of the table's entries at this "
                                 "shape (none there, or none that routes: see the tuned row's kernels)")
        elif not result.method:
            record["written"] = "not written: no entry was judged (see the decisions)"
        elif not result.changes_applied:
            record["written"] = f"not written: the judge's times are {result.method}"
        elif table.path is None:
            record["written"] = "not written: the table has no file (judged for this run only)"
        else:
            try:
                n, notes = stepjudge.write(table.path, result)
                record["written"] = f"{n} decision(s) written to {table.path}" + (
                    f"; {'; '.join(notes)}" if notes else "")
            except (OSError, ValueError) as exc:   # the rows still run on the judged table
                why = exc.strerror if isinstance(exc, OSError) and exc.strerror else f"{type(exc).__name__}: {exc}"
                record["written"] = f"not written to {table.path}: {why}"
        section[key] = record
        log(f"step judge {key}: {len(changed)} of {len(result.decisions)} entries changed ({record['written']})")
        return result.table

    def judge_at_cache(self, cfg, table, table_note, doc):
        """The step judge (kernelsearch.stepjudge) on the built-in step with `cfg`'s dimensions
        at each of opts.shapes' (batch, ctx) on a cache of exactly ctx slots, the new token in
        the last: a transformers StaticCache(max_cache_len=ctx), whose S the patched model's
        rmsnorm_qkv_rope, rope_kv_attention and decode_attention entries are keyed by (the
        built-in bench's own cache is cache_len(ctx) slots, other entries). The same layer
        calls at the same shapes as the patched model's one-token step. -> the judged table,
        written back as the built-in judge writes; each shape's record in doc["step_judge"]."""
        o = self.opts
        torch.manual_seed(o.seed)
        model = Model(cfg, device=o.device, dtype=DTYPES[o.dtype], seed=o.seed)
        try:
            for batch, ctx in o.shapes:
                key = f"{batch}x{ctx} (cache {ctx})"
                try:
                    tokens, positions, stock, ref, tol = self._step_inputs(model, batch, ctx, ctx - 1)
                    table = self._judge_in_step(model, tokens, positions, stock, table, table_note, doc,
                                                batch, ctx, ref, tol, key=key)
                except Exception as exc:   # e.g. out of memory at this shape: the others are judged
                    doc.setdefault("step_judge", {})[key] = {"status": error_status(exc)}
                    log(f"step judge {key}: {doc['step_judge'][key]['status']}")
                finally:
                    model.kv = None
        finally:
            del model
            if self.cuda:
                torch.cuda.empty_cache()
        return table

    def _make_step(self, variant, model, tokens, positions, stock, table, table_note, doc, batch, ctx,
                   ref, tol):
        """-> (callable, static output or None, row fields). callable None = not run.
        Row field "_no_head": (callable, static output) of the same step without final norm and
        LM head (popped by the caller)."""
        if variant == "eager":
            return (lambda: model.decode_step(tokens, positions, stock)), None, {
                "_no_head": ((lambda: model.decode_step(tokens, positions, stock, head=False)), None)}
        if variant == "graphed":
            if not self.cuda:
                return None, None, {"status": "skipped: needs CUDA"}
            graph, out = capture_graph(lambda: model.decode_step(tokens, positions, stock))
            g_nh, out_nh = capture_graph(lambda: model.decode_step(tokens, positions, stock, head=False))
            return graph.replay, out, {"_no_head": (g_nh.replay, out_nh)}
        if variant in TUNED_VARIANTS:
            fused, pdl_on = TUNED_VARIANTS[variant]
            with pdl(pdl_on):  # captured launches keep the setting they were captured with
                step = self._tuned_step(model, tokens, positions, stock, table, table_note, doc, batch,
                                        ctx, ref, tol, fused=fused, name=variant)
            if not pdl_on and step[0] is not None:
                step[2]["pdl"] = "off (HWTUNE_PDL=0 equivalent): the table's kernels launched plainly"
            elif step[0] is not None:
                step[2]["pdl"] = pdl_note()
            return step
        if variant == "compile":
            if not self.cuda:
                return None, None, {"status": "skipped: needs CUDA (compile is a GPU measurement here)"}
            if self.compile_s is None and self.left_s() < 90:
                return None, None, {"status": "skipped: time budget (under 90 s left for a first compile)"}
            if self.compile_s is not None and self.left_s() < 1.5 * self.compile_s + 20:
                return None, None, {"status": f"skipped: time budget (last compile took {self.compile_s:.0f}s)"}
            return self._compiled_step(model, tokens, positions, stock, doc)
        return None, None, {"status": f"skipped: unknown variant {variant!r}"}

    def _tuned_step(self, model, tokens, positions, stock, table, table_note, doc, batch, ctx, ref, tol,
                    fused=True, name=None):
        """The graphed step with TunedOps on the dispatch table (fused=False: without the fused
        decode kernels). One check, of the whole step's logits against stock's (not a keep rule:
        nothing is dropped for being slow); when it fails, the row says so and which op(s) it is
        about, and is not timed."""
        cfg, s_max, dt = model.cfg, model.kv.shape[4], DTYPE_NAMES[model.dtype]
        if table is not None and not self.cuda and os.environ.get("TRITON_INTERPRET") != "1":
            ops = TunedOps(None, "cpu without TRITON_INTERPRET=1: the table's Triton kernels cannot run",
                           attention=stock.attention, fused=fused)
        else:
            ops = TunedOps(table, table_note, attention=stock.attention, fused=fused)
        failure = self._check_tuned(model, tokens, positions, ops, ref, tol)
        used = describe_kernels(ops, cfg, batch, s_max, dt)
        # "BxCTX" for tuned (the key earlier results use), "BxCTX variant" for the others
        name = name or ops.name
        doc["tuned_kernels"][f"{batch}x{ctx}" + ("" if name == "tuned" else f" {name}")] = used
        fields = {"kernels": {label: u["impl"] + (f" ({u['reason']})" if u.get("reason") else "")
                              for label, u in used.items()},
                  "fusions": describe_fusions(ops, cfg, batch, dt, s_max),
                  "kernel_source": table_note,
                  "kernels_per_layer": kernels_per_layer(ops, cfg, batch, s_max, dt),
                  "kernels_per_layer_stock": kernels_per_layer(stock, cfg, batch, s_max, dt)}
        if failure:
            return None, None, {**fields, "status": f"error: {failure}"}
        if not self.cuda:
            fields["_no_head"] = ((lambda: model.decode_step(tokens, positions, ops, head=False)), None)
            return (lambda: model.decode_step(tokens, positions, ops)), None, fields
        if table is not None:
            table.counts.clear()
        graph, out = capture_graph(lambda: model.decode_step(tokens, positions, ops))
        if table is not None:  # what the table routed while the graph was captured (4 calls)
            fields["table_routes"] = {f"{k}:{r}": n for (k, r), n in sorted(table.counts.items())}
        graph.replay()  # capture records work without running it: replay once before reading `out`
        torch.cuda.synchronize()
        err = rel_l2(out.float(), ref)
        if not err <= tol:
            return None, None, {**fields, "status": f"error: the captured tuned step's logits differ from "
                                                    f"stock's (rel_l2 {err:.2e} > {tol:g})"}
        g_nh, out_nh = capture_graph(lambda: model.decode_step(tokens, positions, ops, head=False))
        fields["_no_head"] = (g_nh.replay, out_nh)
        return graph.replay, out, fields

    @staticmethod
    def _check_tuned(model, tokens, positions, ops, ref, tol) -> str | None:
        """None when one eager tuned step gives stock's logits; else what is wrong and, by
        forcing one tuned kernel at a time back to stock, which op it is about."""
        def error() -> str | None:
            try:
                err = rel_l2(model.decode_step(tokens, positions, ops).float(), ref)
            except Exception as exc:
                return f"{type(exc).__name__}: {str(exc)[:200]}"
            return None if err <= tol else f"logits differ from stock's (rel_l2 {err:.2e} > {tol:g})"

        problem = error()
        if problem is None:
            return None
        tuned = ops.tuned_kernels()
        at_fault = []
        for kernel in tuned:
            ops.stock_only = {kernel}
            if error() is None:
                at_fault.append(kernel)
        ops.stock_only = set()
        where = (f"the tuned {', '.join(at_fault)} kernel(s)" if at_fault else
                 f"no single op (tuned: {', '.join(tuned) or 'none'})")
        log(f"tuned step check failed: {problem}; at fault: {where}")
        return f"tuned step check failed: {problem}; at fault: {where}"

    def _compiled_step(self, model, tokens, positions, stock, doc):
        if self.cg_log is None:
            self.cg_log = _CudagraphLog()
            logging.getLogger("torch").addHandler(self.cg_log)
            try:
                torch._logging.set_logs(perf_hints=True)
            except Exception:
                pass
        before = _inductor_counters()
        compiled = torch.compile(lambda t, p: model.decode_step(t, p, stock),
                                 mode="max-autotune", dynamic=False)
        mark = getattr(getattr(torch, "compiler", None), "cudagraph_mark_step_begin", None)

        def step():
            if mark is not None:
                mark()
            return compiled(tokens, positions)

        t = time.monotonic()
        step()
        torch.cuda.synchronize()
        self.compile_s = time.monotonic() - t
        after = _inductor_counters()
        skips = after.get("cudagraph_skips", 0) - before.get("cudagraph_skips", 0)
        info = {"compile_s": self.compile_s, "cudagraph_skips": skips,
                "cudagraphs": "skipped by torch.compile" if skips else "used (or not reported)",
                "messages": list(self.cg_log.messages)}
        doc["compile"].setdefault("runs", []).append(info)
        log(f"compile: {self.compile_s:.0f}s, cudagraph skips {skips} {self.cg_log.messages[-1:] or ''}")
        return step, None, {"compile_s": self.compile_s, "cudagraphs": info["cudagraphs"]}

    # ---- prefill ------------------------------------------------------------------------------
    def _prefill_shape(self, model, batch, tokens_n, table, doc):
        o = self.opts
        model.allocate_cache(batch, int(math.ceil(tokens_n / 64) * 64))
        g = torch.Generator(device=o.device)
        g.manual_seed(o.seed + 3)
        tokens = torch.randint(1, model.cfg.vocab, (batch, tokens_n), generator=g, device=o.device)
        variants = [("eager", StockOps())]
        if table is not None:
            variants.append(("tuned", TunedOps(table, "dispatch table")))
        for name, ops in variants:
            row = {"variant": name, "batch": batch, "tokens": tokens_n}
            if self.left_s() < 10:
                row["status"] = "skipped: time budget spent"
                doc["prefill"].append(row)
                continue
            try:
                fn = lambda: model.prefill(tokens, ops)  # noqa: E731
                times = time_steps(fn, max(5, o.steps // 10), 2, self.cuda)
                ms = statistics.median(times)
                row.update(status="ok", time_ms=ms, tokens_per_s=batch * tokens_n / (ms * 1e-3))
                if self.cuda:
                    e = energy_window(fn, self.reader, o.energy_window_s, max(1, int(0.2 / (ms * 1e-3))))
                    if e and e.get("energy_j"):
                        row["energy"] = e
                        row["tokens_per_j"] = batch * tokens_n * e["calls"] / e["energy_j"]
                log(f"prefill {name:8s} B={batch} T={tokens_n} {ms:.2f} ms {row['tokens_per_s']:.0f} tok/s")
            except Exception as exc:
                row["status"] = error_status(exc)
                log(f"prefill {name} failed: {row['status']}")
            doc["prefill"].append(row)


def judge_lines(section: dict | None) -> list[str]:
    """The step judge's records ({shape: record}), for the terminal table."""
    lines = []
    for key, j in (section or {}).items():
        if j.get("status") != "ok":
            lines.append(f"step judge {key}: {j.get('status')}")
            continue
        changed = [d for d in j["decisions"] if d["outcome"] in ("replaced", "removed")]
        summary = j.get("summary") or {}
        gain = (f"; the step as given {summary['as_given']['median_ms']:.4f} ms, as judged "
                f"{summary['as_judged']['median_ms']:.4f} ms" if summary.get("as_given") else "")
        lines.append(f"step judge {key}: {len(changed)} of {len(j['decisions'])} entries changed{gain} "
                     f"({j.get('written')})")
        for d in changed:
            shape = " ".join(f"{k}={v}" for k, v in d["shape"].items())
            lines.append(f"  {d['kernel']} {shape}: {d['outcome']} {d['before_params']} -> {d['after_params']}")
    return lines


def format_table(doc: dict) -> str:
    hf_rows = [r for r in doc["decode"] if r.get("model") == "hf-llama"]   # their own table, below
    builtin = [r for r in doc["decode"] if r.get("model") != "hf-llama"]
    lines = [f"{'variant':13s} {'batch':>5s} {'ctx':>6s} {'step ms':>9s} {'tokens/s':>10s} "
             f"{'tokens/J':>9s} {'%fl+head':>8s} {'no-head ms':>10s} {'% floor':>8s}  status"] \
        if builtin or not hf_rows else []
    for r in builtin:
        ok = r.get("status") == "ok"
        lines.append(
            f"{r['variant']:13s} {r['batch']:5d} {r['ctx']:6d} "
            f"{(format(r['step_ms'], '.3f') if ok else '-'):>9s} "
            f"{(format(r['tokens_per_s'], '.0f') if ok else '-'):>10s} "
            f"{(format(r['tokens_per_j'], '.1f') if r.get('tokens_per_j') else '-'):>9s} "
            f"{(format(r['pct_of_floor_with_head'], '.0f') + '%' if r.get('pct_of_floor_with_head') else '-'):>8s} "
            f"{(format(r['step_ms_no_head'], '.3f') if r.get('step_ms_no_head') else '-'):>10s} "
            f"{(format(r['pct_of_floor'], '.0f') + '%' if r.get('pct_of_floor') else '-'):>8s}  "
            f"{r.get('status', '')[:60]}{'; ' + r['warning'] if ok and r.get('warning') else ''}")
    for f in doc.get("floors", []):
        if f.get("floor_ms"):
            lines.append(f"floor B={f['batch']} ctx={f['ctx']}: {f['floor_ms']:.3f} ms without LM head "
                         f"({f['total_bytes_no_head'] / 1e9:.2f} GB), {f['floor_with_head_ms']:.3f} ms with "
                         f"({f['total_bytes'] / 1e9:.2f} GB) at {doc.get('copy_bandwidth_gbs', 0):.0f} GB/s")
    if doc.get("floor_note"):
        lines.append(doc["floor_note"])
    if (doc.get("kernel_table") or {}).get("note"):
        lines.append(f"kernels of the tuned variant: {doc['kernel_table']['note']}")
    for r in doc["decode"]:
        if r["variant"] in TUNED_VARIANTS and r.get("kernels"):
            lines.append(f"{r['variant']} B={r['batch']} ctx={r['ctx']} kernels/layer "
                         f"{r.get('kernels_per_layer', {}).get('total', '?')} (stock "
                         f"{r.get('kernels_per_layer_stock', {}).get('total', '?')}):")
            for op, impl in r["kernels"].items():
                lines.append(f"  {op:23s} {str(impl)[:150]}")
    lines += judge_lines(doc.get("step_judge"))
    for r in doc.get("prefill", []):
        if r.get("status") == "ok":
            tj = f", {r['tokens_per_j']:.1f} tok/J" if r.get("tokens_per_j") else ""
            lines.append(f"prefill {r['variant']} {r['batch']}x{r['tokens']}: {r['time_ms']:.2f} ms, "
                         f"{r['tokens_per_s']:.0f} tok/s{tj}")
        else:
            lines.append(f"prefill {r['variant']} {r['batch']}x{r['tokens']}: {r.get('status')}")
    if doc.get("hf"):
        from daemon.bench.hf import format_lines
        lines += format_lines(doc)
    return "\n".join(lines)
