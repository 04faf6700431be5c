"""The ops a decode step goes through: stock torch, or hwtune's kernels.

`StockOps` is what eager / graphed / compile use. `TunedOps` substitutes hwtune's kernels
(rmsnorm, add_rmsnorm, matmul, decode_attention) per op, from, in this order:
1. a dispatch table (`kernelsearch.dispatch.DispatchTable.load(path)`, `table.call(name, *args)`);
2. the built-in templates in kernelsearch/kernels/<name>.py with their first config;
3. stock.
Each substitution is checked against stock on the exact decode shapes before use, and on
CUDA the template is kept only when it is not slower than stock there; `used` says per op
what actually runs and why.
"""
from __future__ import annotations

import hashlib
import importlib.util
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from daemon.bench import fused

REPO_ROOT = Path(__file__).resolve().parents[2]
KERNEL_DIR = REPO_ROOT / "kernelsearch" / "kernels"
SUBSTITUTED = ("rmsnorm", "add_rmsnorm", "matmul", "decode_attention")


class StockOps:
    """torch ops. `attention`: "sdpa" (the q heads of one kv head become that head's query
    rows, one fused kernel) or "bmm" (baddbmm with the mask + softmax + bmm: cuBLAS spreads the
    score GEMM over the cache length, where SDPA's mem-efficient kernel gets only B*Hkv blocks).
    The bench times both at each shape and gives every variant the faster one."""

    name = "stock"

    def __init__(self, attention: str = "sdpa"):
        if attention not in ("sdpa", "bmm"):
            raise ValueError(f"stock attention {attention!r}: expected sdpa or bmm")
        self.attention = attention

    def rmsnorm(self, x, weight, eps):
        return F.rms_norm(x, (x.shape[-1],), weight, eps)

    def add_rmsnorm(self, x, residual, weight, eps):
        residual = x + residual
        return F.rms_norm(residual, (x.shape[-1],), weight, eps), residual

    def matmul(self, a, b):
        return torch.mm(a, b)

    def silu_mul(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def rope_context(self, model, positions):
        """Per-step RoPE state shared by every layer: rotation matrices [B, D, D] and the
        batch index of the cache write."""
        return {"rot": model.rope_matrices(positions),
                "batch_idx": torch.arange(positions.shape[0], device=positions.device)}

    def rope_kv_write(self, qkv, rope, positions, k_cache, v_cache, heads):
        """qkv [B, Hq+2Hkv, D] -> q [B, Hq, D] rotated; rotated k and v written into the caches
        at `positions` in place (one bmm for q and k heads, two index writes)."""
        hkv = k_cache.shape[1]
        qk = torch.bmm(qkv[:, :heads + hkv], rope["rot"])
        k_cache[rope["batch_idx"], :, positions] = qk[:, heads:]
        v_cache[rope["batch_idx"], :, positions] = qkv[:, heads + hkv:]
        return qk[:, :heads]

    def attention_mask(self, seq_lens, s_max, dtype):
        """Additive mask [B, 1, 1, S_max], built once per step and shared by every layer."""
        valid = torch.arange(s_max, device=seq_lens.device)[None, :] < seq_lens[:, None]
        zero = torch.zeros((), dtype=dtype, device=seq_lens.device)
        return torch.where(valid, zero, float("-inf")).view(seq_lens.shape[0], 1, 1, s_max)

    def decode_attention(self, q, k_cache, v_cache, seq_lens, scale, mask=None):
        """q [B, Hq, D]; caches [B, Hkv, S_max, D]; each cache is read once (no repeat)."""
        b, hq, d = q.shape
        hkv, s = k_cache.shape[1], k_cache.shape[2]
        g = hq // hkv
        if mask is None:
            mask = self.attention_mask(seq_lens, s, q.dtype)
        if self.attention == "sdpa":
            out = F.scaled_dot_product_attention(q.reshape(b, hkv, g, d), k_cache, v_cache,
                                                 attn_mask=mask, scale=scale)
            return out.reshape(b, hq, d)
        bias = mask.expand(b, hkv, g, s).reshape(b * hkv, g, s)
        scores = torch.baddbmm(bias, q.reshape(b * hkv, g, d),
                               k_cache.view(b * hkv, s, d).transpose(1, 2), alpha=scale)
        probs = torch.softmax(scores, dim=-1)
        return torch.bmm(probs, v_cache.view(b * hkv, s, d)).view(b, hq, d)


def rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    err = (out - ref).norm() / ref.norm().clamp_min(1e-30)
    return float("inf") if not torch.isfinite(err) else float(err)


def file_sha256(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _load_module(path: Path):
    name = f"hwtune_bench_kernel_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def default_table_path(state_dir, device: str):
    """Where kernelsearch keeps this device's table: STATE_DIR/dispatch/<fingerprint-id>.json."""
    try:
        from kernelsearch.dispatch import table_path
        from kernelsearch.fingerprint import collect, fingerprint_id
        return table_path(state_dir, fingerprint_id(collect(device)))
    except Exception:
        return None


def load_table(path):
    """-> (table | None, note). Never raises: a missing dispatch module is a recorded fact."""
    try:
        from kernelsearch.dispatch import DispatchTable
    except Exception as exc:  # module not there, or triton missing
        return None, f"kernelsearch.dispatch unavailable: {type(exc).__name__}: {exc}"
    if path is None or not Path(path).exists():
        return None, f"no dispatch table at {path}"
    try:
        return DispatchTable.load(str(path)), f"dispatch table {path}"
    except Exception as exc:
        return None, f"dispatch table {path} failed to load: {type(exc).__name__}: {exc}"


# Extra template configs worth a look at decode shapes when there is no table (used only when
# the template's own CONFIGS contains them). Why: the first config of matmul is a prefill
# tile; a weight-streaming GEMV needs split-K to put >= 132 programs on an H200 when N is small.
HINTS = {
    # [BLOCK_K, BLOCK_N] bf16 slabs x stages must fit Hopper's 227 KB of shared memory.
    "matmul": [dict(variant="splitk", BLOCK_M=16, BLOCK_N=bn, BLOCK_K=128, GROUP_M=8, SPLIT_K=sk,
                    FMA=0, num_warps=4, num_stages=st)
               for bn, sk, st in ((128, 1, 4), (128, 4, 4), (128, 8, 4), (64, 16, 4), (256, 1, 2))]
    + [dict(variant="splitk", BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, SPLIT_K=4,
            FMA=1, num_warps=4, num_stages=4)]
    # Best measured on the H200 at M=1..16 x 8192x28672 (bench/results/h200-run1/dispatch.json).
    + [dict(variant="tiled", BLOCK_M=16, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, SPLIT_K=1,
            FMA=0, num_warps=4, num_stages=4)],
    # Best measured on the H200 per (batch, context) in bench/results/h200-run1/dispatch.json:
    # B=1 wants many splits of short blocks, B>=8 few splits (B x Hkv programs already fill it).
    "decode_attention": [dict(BLOCK_S=bs, NUM_SPLITS=ns, num_warps=w, num_stages=st)
                         for bs, ns, w, st in ((16, 64, 2, 3), (64, 32, 2, 3), (64, 4, 4, 3),
                                               (64, 1, 8, 3), (128, 1, 4, 3))],
    "rmsnorm": [dict(ROWS_PER_PROG=1, BLOCK_N=0, PROGRAMS_PER_SM=0, num_warps=w, num_stages=1)
                for w in (8, 16)],
    "add_rmsnorm": [dict(ROWS_PER_PROG=1, BLOCK_N=0, PROGRAMS_PER_SM=0, num_warps=w, num_stages=1)
                    for w in (8, 16)],
}


# How much slower than stock (timed alone) a template may be and still be tried in the step.
# decode_attention: the template reads seq_lens itself, so the step then builds no mask and
# needs no q reshape; the whole-step check in run.py drops it if the step gets slower.
STOCK_MARGIN = {"decode_attention": 1.10}


def _shape_key(args) -> tuple:
    return tuple(tuple(a.shape) for a in args if torch.is_tensor(a))


def _alloc_outputs(op, inputs):
    x = inputs[0]
    if op in ("rmsnorm", "decode_attention"):
        return (torch.empty_like(x),)
    if op == "add_rmsnorm":
        return torch.empty_like(x), torch.empty_like(x)
    a, b = inputs
    return (torch.empty(a.shape[0], b.shape[1], device=a.device, dtype=a.dtype),)


def _template_fn(op, launch, params):
    """Destination-passing template -> fn(*inputs) -> tuple of outputs."""
    def fn(*inputs):
        outs = _alloc_outputs(op, inputs)
        launch(*inputs, *outs, **params)
        return outs
    return fn


def _table_fn(table, op):
    def fn(*inputs):
        out = table.call(op, *inputs)
        return out if isinstance(out, tuple) else (out,)
    return fn


class TunedOps(StockOps):
    """Stock ops with hwtune's kernels substituted where they were checked to work.

    Routes are per (op, input shapes): a kernel checked (and, on CUDA, timed) at the decode
    shapes of this model. With a dispatch table, shapes not checked here (prefill) go to the
    table, which falls back to stock on its own.
    """

    name = "tuned"

    def __init__(self, table=None, table_note: str = "", kernel_dir=KERNEL_DIR, quick_pick: int = 1,
                 attention: str = "sdpa"):
        super().__init__(attention)
        self.table, self.table_note, self.kernel_dir = table, table_note, kernel_dir
        self.quick_pick = max(1, int(quick_pick))
        self.routes: dict[tuple, object] = {}   # (op, shape key) -> fn(*inputs) -> outputs
        self.refused: set = set()                # (op, shape key) that must stay stock
        self.used: dict[str, dict] = {}
        self.fused: set = set()                  # FUSED ops checked for this batch
        self.disabled: set = set()               # ops sent back to stock for the whole step

    # ---- setup ----------------------------------------------------------------------------
    def _candidates(self, op: str) -> tuple[list, str]:
        """-> ([(description, fn)], note)."""
        if self.table is not None:
            return [("dispatch table", _table_fn(self.table, op))], self.table_note
        if self.kernel_dir is None:
            return [], self.table_note
        path = Path(self.kernel_dir) / f"{op}.py"
        if not path.exists():
            return [], f"no template {op}.py in kernelsearch/kernels"
        try:
            module = _load_module(path)
            configs = list(getattr(module, "CONFIGS", None) or [{}])
            launch = module.launch
        except Exception as exc:
            return [], f"template {path.name} failed to import: {type(exc).__name__}: {exc}"
        picks = [configs[0]]
        hints = HINTS.get(op) or [configs[len(configs) // 2], configs[-1]]
        for h in hints:
            if len(picks) >= self.quick_pick:
                break
            if (h in configs or not HINTS.get(op)) and h not in picks:
                picks.append(h)
        return [(f"template {path.name} {p}", _template_fn(op, launch, dict(p))) for p in picks], ""

    def prepare(self, model, batch: int, time_it: bool) -> dict:
        """Check each substitutable op at this model's decode shapes (cache must be allocated)."""
        c, dev, dt = model.cfg, model.device, model.dtype
        g = torch.Generator(device=dev)
        g.manual_seed(1234)

        def rnd(*shape):
            return torch.randn(*shape, generator=g, device=dev, dtype=torch.float32).to(dt)

        h = c.hidden
        w0 = model.layers[0]
        kc, vc = model.kv[0, 0], model.kv[0, 1]
        seq_lens = torch.full((batch,), max(1, model.s_max - 7), device=dev, dtype=torch.int32)
        cases = {
            "rmsnorm": [("x", (rnd(batch, h), model.final_norm, c.eps))],
            "add_rmsnorm": [("x", (rnd(batch, h), rnd(batch, h), model.final_norm, c.eps))],
            "matmul": [(n, (rnd(batch, w0[n].shape[0]), w0[n]))
                       for n in ("w_qkv", "w_o", "w_gate_up", "w_down")]
            + [("lm_head", (rnd(batch, h), model.lm_head))],
            "decode_attention": [("attn", (rnd(batch, c.heads, c.head_dim), kc, vc, seq_lens,
                                           model.scale))],
        }
        self.used = {op: self._prepare_op(op, op_cases, time_it) for op, op_cases in cases.items()}
        if self.kernel_dir is not None:
            self.used.update(self._prepare_fused(model, batch, rnd, time_it))
        return self.used

    def _prepare_fused(self, model, batch, rnd, time_it) -> dict:
        """Check the fused kernels (daemon/bench/fused.py) against stock at this batch's real
        shapes (a clone of layer 0's cache); on CUDA keep each only where it is not slower."""
        c, dev = model.cfg, model.device
        half = model.dtype in (torch.bfloat16, torch.float16)
        tol = 2e-2 if half else 1e-5
        kc0, vc0 = model.kv[0, 0], model.kv[0, 1]
        positions = torch.full((batch,), max(0, model.s_max - 9), device=dev, dtype=torch.int64)
        positions[0] = 0  # two different positions when batch > 1
        qkv = rnd(batch, c.qkv_heads, c.head_dim)
        gate_up = rnd(batch, 2 * c.ffn)
        # Clones made once, outside any timed call (a clone per call would be timed too).
        caches = {"stock": (kc0.clone(), vc0.clone()), "fused": (kc0.clone(), vc0.clone())}

        def stock_rope():
            k, v = caches["stock"]
            return StockOps.rope_kv_write(self, qkv, StockOps.rope_context(self, model, positions),
                                          positions, k, v, c.heads), k, v

        def fused_rope():
            k, v = caches["fused"]
            return fused.rope_kv_write(qkv, positions, model.inv_freq, k, v, c.heads), k, v

        def stock_silu():
            return (StockOps.silu_mul(self, gate_up),)

        def fused_silu():
            return (fused.silu_mul(gate_up),)

        out = {}
        for op, stock_fn, fused_fn in (("rope_kv_write", stock_rope, fused_rope),
                                       ("silu_mul", stock_silu, fused_silu)):
            entry = {"impl": "stock"}
            try:
                ref, got = stock_fn(), fused_fn()
                err = max(rel_l2(o, r) for o, r in zip(got, ref))
                if op == "rope_kv_write":  # the written slots match, every other is untouched
                    rows = torch.arange(batch, device=dev)
                    for a, b in zip(caches["stock"], caches["fused"]):
                        err = max(err, rel_l2(b[rows, :, positions], a[rows, :, positions]))
                        a[rows, :, positions] = 0
                        b[rows, :, positions] = 0
                        if not torch.equal(a, b):
                            err = float("inf")
                entry["rel_l2"] = err
                if not err <= tol:
                    entry["reason"] = f"rel_l2 {err:.2e} > {tol:g}"
                elif time_it and dev.type == "cuda":
                    entry["stock_ms"] = time_in_graph_ms(stock_fn)
                    entry["ms"] = time_in_graph_ms(fused_fn)
                    if entry["ms"] > 1.02 * entry["stock_ms"]:
                        entry["reason"] = f"stock faster ({entry['stock_ms']:.4f} ms vs {entry['ms']:.4f} ms)"
                if "reason" not in entry:
                    entry["impl"] = f"fused {op} (daemon/bench/fused.py)"
                    self.fused.add(op)
            except Exception as exc:
                entry["reason"] = f"fused kernel failed: {type(exc).__name__}: {str(exc)[:200]}"
            out[op] = entry
        caches.clear()
        return out

    def _prepare_op(self, op, op_cases, time_it):
        candidates, note = self._candidates(op)
        if not candidates:
            return {"impl": "stock", "reason": note}
        half = op_cases[0][1][0].dtype in (torch.bfloat16, torch.float16)
        tol = 2e-2 if half else 1e-4
        report = {"impl": None, "shapes": {}}
        for label, args in op_cases:
            key = (op, _shape_key(args))
            ref = self._stock(op, *args)
            stock_ms = time_in_graph_ms(lambda: self._stock(op, *args)) if time_it and args[0].is_cuda else None
            best, tried = None, []
            for desc, fn in candidates:
                try:
                    out = fn(*args)
                    err = max(rel_l2(o, r) for o, r in zip(out, ref))
                except Exception as exc:
                    tried.append({"impl": desc, "error": f"{type(exc).__name__}: {str(exc)[:160]}"})
                    continue
                if not err <= tol:
                    tried.append({"impl": desc, "error": f"rel_l2 {err:.2e} > {tol:g}"})
                    continue
                ms = time_in_graph_ms(lambda: fn(*args)) if stock_ms is not None else None
                tried.append({"impl": desc, "rel_l2": err, "ms": ms})
                if best is None or (ms is not None and ms < best[2]):
                    best = (desc, fn, ms if ms is not None else float("inf"))
            entry = {"stock_ms": stock_ms, "tried": tried}
            if best is None:
                entry["impl"] = "stock"
                entry["reason"] = "no candidate passed the check"
                self.refused.add(key)
            elif stock_ms is not None and self.table is None and best[2] > STOCK_MARGIN.get(op, 1.02) * stock_ms:
                # A template that loses to stock here is not what a tuned run means.
                entry["impl"] = "stock"
                entry["reason"] = f"stock faster ({stock_ms:.4f} ms vs {best[2]:.4f} ms)"
                self.refused.add(key)
            else:
                entry["impl"] = best[0]
                entry["ms"] = None if best[2] == float("inf") else best[2]
                self.routes[key] = best[1]
            report["shapes"][label] = entry
        impls = sorted({e["impl"] for e in report["shapes"].values()})
        report["impl"] = impls[0] if len(impls) == 1 else "mixed: " + " | ".join(impls)
        return report

    def _stock(self, op, *args):
        if op == "add_rmsnorm":
            return StockOps.add_rmsnorm(self, *args)
        return (getattr(StockOps, op)(self, *args),)

    def _route(self, op, args):
        if op in self.disabled:
            return None
        key = (op, _shape_key(args))
        fn = self.routes.get(key)
        if fn is None and self.table is not None and key not in self.refused:
            fn = _table_fn(self.table, op)
        return fn

    # ---- the ops --------------------------------------------------------------------------
    def rmsnorm(self, x, weight, eps):
        fn = self._route("rmsnorm", (x, weight))
        return fn(x, weight, eps)[0] if fn else StockOps.rmsnorm(self, x, weight, eps)

    def add_rmsnorm(self, x, residual, weight, eps):
        fn = self._route("add_rmsnorm", (x, residual, weight))
        return tuple(fn(x, residual, weight, eps)) if fn else StockOps.add_rmsnorm(self, x, residual, weight, eps)

    def matmul(self, a, b):
        fn = self._route("matmul", (a, b))
        return fn(a, b)[0] if fn else StockOps.matmul(self, a, b)

    def silu_mul(self, gate_up):
        if "silu_mul" in self.fused and "silu_mul" not in self.disabled:
            return fused.silu_mul(gate_up)
        return StockOps.silu_mul(self, gate_up)

    def rope_context(self, model, positions):
        if "rope_kv_write" in self.fused and "rope_kv_write" not in self.disabled:
            return {"inv_freq": model.inv_freq}  # angles computed in the kernel: no table gather
        return StockOps.rope_context(self, model, positions)

    def rope_kv_write(self, qkv, rope, positions, k_cache, v_cache, heads):
        if "inv_freq" in rope:
            return fused.rope_kv_write(qkv, positions, rope["inv_freq"], k_cache, v_cache, heads)
        return StockOps.rope_kv_write(self, qkv, rope, positions, k_cache, v_cache, heads)

    def routed_ops(self) -> list[str]:
        """Ops that run a substituted kernel in this step (before `disabled`)."""
        return sorted({k[0] for k in self.routes} | self.fused)

    def attention_mask(self, seq_lens, s_max, dtype):
        if "decode_attention" not in self.disabled and any(k[0] == "decode_attention" for k in self.routes):
            return None  # the kernel reads seq_lens itself
        return StockOps.attention_mask(self, seq_lens, s_max, dtype)

    def decode_attention(self, q, k_cache, v_cache, seq_lens, scale, mask=None):
        fn = self._route("decode_attention", (q, k_cache, v_cache, seq_lens))
        if fn:
            return fn(q if q.is_contiguous() else q.contiguous(), k_cache, v_cache, seq_lens, scale)[0]
        return StockOps.decode_attention(self, q, k_cache, v_cache, seq_lens, scale, mask)


def warm_up_for_capture(fn, calls: int = 3) -> None:
    """Run `fn` on a side stream and wait for it, as torch requires before a graph capture."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(calls):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()


def time_in_graph_ms(fn, reps: int = 20) -> float:
    """Per-call time inside a CUDA graph of `reps` calls, as the decode step will run it
    (eager timing would charge Triton's larger Python launch cost to the kernel)."""
    warm_up_for_capture(fn)
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(reps):
                fn()
        run = graph.replay
    except Exception:
        torch.cuda.synchronize()
        def run():
            for _ in range(reps):
                fn()
    run()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / reps)
    return sorted(times)[len(times) // 2]
