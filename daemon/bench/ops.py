"""The ops a decode step goes through: stock torch, or hwtune's kernels.

`StockOps` is what eager / graphed / compile use. `TunedOps` asks the dispatch table
(`kernelsearch.dispatch.DispatchTable`) for each substitutable call -- rmsnorm, add_rmsnorm,
matmul, decode_attention, swiglu (the model's silu_mul) and rope_kv_write -- and runs the
table's verified kernel where the table routes that (kernel, shape, dtype) to one, and the
stock op everywhere else. It has no picker of its own: kernelsearch is the only judge of which
kernel is kept (one keep rule, one timer); `used` says per op and shape what runs, and for a
tuned entry its `Entry` fields (source, params, speedup against which stock).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

# kernel -> fn(args) -> the shape keys its spec sweeps and the table stores (spec.call_shape)
from kernelsearch.dispatch import SHAPE_OF

# What TunedOps routes through the table: kernel (spec) name -> the StockOps method it replaces.
ROUTED = {"rmsnorm": "rmsnorm", "add_rmsnorm": "add_rmsnorm", "matmul": "matmul",
          "decode_attention": "decode_attention", "swiglu": "silu_mul",
          "rope_kv_write": "rope_kv_write"}

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


def cache_len(ctx: int) -> int:
    """S_max of the static cache the bench allocates for a context: ctx + 1 rounded up to 64."""
    return -(-(ctx + 1) // 64) * 64


# ---- the calls a decode step makes, by kernel and shape (the dispatch table's keys) ----------
def layer_calls(cfg, batch: int, s_max: int) -> list[tuple[str, str, dict]]:
    """(label, kernel, shape) of every substitutable call in one decoder layer (after layer 0,
    whose first norm is an rmsnorm), in call order."""
    h, d = cfg.hidden, cfg.head_dim
    norm = {"M": batch, "N": h}
    attn = {"B": batch, "Hq": cfg.heads, "Hkv": cfg.kv_heads, "S": s_max, "D": d}
    return [
        ("add_rmsnorm (attention)", "add_rmsnorm", norm),
        ("matmul qkv", "matmul", {"M": batch, "K": h, "N": cfg.qkv_heads * d}),
        ("rope + kv write", "rope_kv_write",
         {"B": batch, "Hq": cfg.heads, "Hkv": cfg.kv_heads, "D": d, "S": s_max}),
        ("decode_attention", "decode_attention", attn),
        ("matmul o", "matmul", {"M": batch, "K": cfg.heads * d, "N": h}),
        ("add_rmsnorm (mlp)", "add_rmsnorm", norm),
        ("matmul gate_up", "matmul", {"M": batch, "K": h, "N": 2 * cfg.ffn}),
        ("swiglu", "swiglu", {"M": batch, "I": cfg.ffn}),
        ("matmul down", "matmul", {"M": batch, "K": cfg.ffn, "N": h}),
    ]


def step_calls(cfg, batch: int, s_max: int) -> list[tuple[str, str, dict]]:
    """Every distinct substitutable call of a whole decode step (logits out)."""
    return ([("rmsnorm (layer 0)", "rmsnorm", {"M": batch, "N": cfg.hidden})]
            + layer_calls(cfg, batch, s_max)
            + [("lm_head", "matmul", {"M": batch, "K": cfg.hidden, "N": cfg.vocab})])


def decode_shapes(cfg, shapes) -> dict[str, list[dict]]:
    """{kernel: [shape dict]} of every call the tuned decode step makes at these
    (batch, context) shapes: what the search must look at for this model (autotable)."""
    out: dict[str, list[dict]] = {}
    for batch, ctx in shapes:
        for _, kernel, shape in step_calls(cfg, batch, cache_len(ctx)):
            if shape not in out.setdefault(kernel, []):
                out[kernel].append(dict(shape))
    return out


DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def shape_label(shape: dict, dtype: str) -> str:
    return " ".join(f"{k}={v}" for k, v in shape.items()) + f" {dtype}"


def _shape_key(kernel: str, shape: dict, dtype: str) -> tuple:
    return kernel, dtype, tuple(sorted(shape.items()))


def entry_record(entry, launches: int | None = None) -> dict:
    """What the report says about a tuned entry: the `Entry` fields a person checks."""
    data = entry.to_json()  # plain JSON values (the entry's own mappings are read-only views)
    steps = (data.get("plan") or {}).get("steps") or ()
    source = data.get("source") or {}
    where = source.get("module") or source.get("path") or "?"
    params = data.get("params") or {}
    return {"impl": f"tuned {where} {params}, {entry.describe_speedup()}",
            "source": source, "params": params, "candidate_ms": entry.candidate_ms,
            "stock_ms": entry.stock_ms, "speedup": entry.speedup, "against": entry.against,
            "launches": launches if launches is not None else
            sum(1 for s in steps if s.get("op") == "launch")}


class TunedOps(StockOps):
    """Stock ops, with the dispatch table's verified kernel wherever the table routes the call.

    Per (kernel, shape, dtype), decided on the first call and recorded in `used`: the table's
    `lookup` finds an entry and its `route` accepts the call (this device's fingerprint, source
    unchanged, plan valid, arguments in the verified layout) -> `table.call(kernel, *args)`;
    otherwise the StockOps op, exactly as the stock variants run it. `stock_only` forces
    kernels back to stock (used only to find which op a failed whole-step check is about).
    """

    name = "tuned"

    def __init__(self, table=None, table_note: str = "", attention: str = "sdpa"):
        super().__init__(attention)
        self.table, self.table_note = table, table_note
        self.used: dict[tuple, dict] = {}    # _shape_key -> record ("impl", reason or Entry fields)
        self.stock_only: set[str] = set()

    # ---- routing ---------------------------------------------------------------------------
    def _decide(self, kernel: str, shape: dict, dtype: str, args) -> dict:
        if self.table is None:
            return {"impl": "stock", "reason": self.table_note or "no dispatch table"}
        entry = self.table.lookup(kernel, shape, dtype)
        if entry is None:
            return {"impl": "stock", "reason": "no table entry"}
        try:
            tuned, _, why = self.table.route(kernel, *args)
        except KeyError as exc:  # a kernel this checkout's dispatch (or specs) do not know yet
            return {"impl": "stock", "reason": f"dispatch cannot route {kernel}: {exc}"}
        if tuned is None:
            return {"impl": "stock", "reason": f"table entry not used: {why}"}
        return entry_record(entry, getattr(getattr(tuned, "plan", None), "launches", None))

    def _routed(self, kernel: str, args) -> bool:
        shape = SHAPE_OF[kernel](args)
        dtype = DTYPE_NAMES.get(args[0].dtype, str(args[0].dtype))
        key = _shape_key(kernel, shape, dtype)
        record = self.used.get(key)
        if record is None:
            record = self.used[key] = self._decide(kernel, shape, dtype, args)
        return record["impl"].startswith("tuned") and kernel not in self.stock_only

    def record(self, kernel: str, shape: dict, dtype: str) -> dict | None:
        """The decision for a call already made (None before its first call)."""
        return self.used.get(_shape_key(kernel, shape, dtype))

    def tuned_kernels(self) -> list[str]:
        """Kernels with at least one call on a tuned entry (before `stock_only`)."""
        return sorted({k[0] for k, r in self.used.items() if r["impl"].startswith("tuned")})

    # ---- the ops ---------------------------------------------------------------------------
    def rmsnorm(self, x, weight, eps):
        if self._routed("rmsnorm", (x, weight, eps)):
            return self.table.call("rmsnorm", x, weight, eps)
        return StockOps.rmsnorm(self, x, weight, eps)

    def add_rmsnorm(self, x, residual, weight, eps):
        if self._routed("add_rmsnorm", (x, residual, weight, eps)):
            return tuple(self.table.call("add_rmsnorm", x, residual, weight, eps))
        return StockOps.add_rmsnorm(self, x, residual, weight, eps)

    def matmul(self, a, b):
        if self._routed("matmul", (a, b)):
            return self.table.call("matmul", a, b)
        return StockOps.matmul(self, a, b)

    def silu_mul(self, gate_up):
        if self._routed("swiglu", (gate_up,)):
            return self.table.call("swiglu", gate_up)
        return StockOps.silu_mul(self, gate_up)

    def rope_context(self, model, positions):
        """Stock's rotation matrices, plus cos/sin [B, D] in the model's dtype (Hugging Face's
        rotate_half convention, shared by every layer) when the table has a rope_kv_write
        entry for this step's shape: the spec's inputs."""
        rope = StockOps.rope_context(self, model, positions)
        c = model.cfg
        shape = {"B": int(positions.shape[0]), "Hq": c.heads, "Hkv": c.kv_heads, "D": c.head_dim,
                 "S": int(model.kv.shape[4])}
        if self.table is not None and "rope_kv_write" not in self.stock_only and \
                self.table.lookup("rope_kv_write", shape, DTYPE_NAMES.get(model.dtype, "")) is not None:
            rope["cos"], rope["sin"] = model.rope_cos_sin(positions)
        return rope

    def rope_kv_write(self, qkv, rope, positions, k_cache, v_cache, heads):
        if "cos" in rope:
            args = (qkv, rope["cos"], rope["sin"], positions, k_cache, v_cache)
            if self._routed("rope_kv_write", args):
                return self.table.call("rope_kv_write", *args)
        else:  # rope_context found no entry: record that, as _routed does for the other ops
            shape = SHAPE_OF["rope_kv_write"]((qkv, None, None, None, k_cache))
            key = _shape_key("rope_kv_write", shape, DTYPE_NAMES.get(qkv.dtype, str(qkv.dtype)))
            self.used.setdefault(key, {"impl": "stock", "reason": "no table entry" if self.table is not None
                                       else self.table_note or "no dispatch table"})
        return StockOps.rope_kv_write(self, qkv, rope, positions, k_cache, v_cache, heads)

    def decode_attention(self, q, k_cache, v_cache, seq_lens, scale, mask=None):
        # The verified layout is contiguous; stock's RoPE leaves q a strided slice.
        qc = q if q.is_contiguous() else q.contiguous()
        if self._routed("decode_attention", (qc, k_cache, v_cache, seq_lens, scale)):
            return self.table.call("decode_attention", qc, k_cache, v_cache, seq_lens, scale)
        return StockOps.decode_attention(self, q, k_cache, v_cache, seq_lens, scale, mask)


def describe_kernels(ops, cfg, batch: int, s_max: int, dtype: str) -> dict[str, dict]:
    """Per call of the decode step (label): what runs -- the tuned entry's fields, or stock and
    why. Read after at least one step (TunedOps decides on the first call)."""
    out = {}
    for label, kernel, shape in step_calls(cfg, batch, s_max):
        record = ops.record(kernel, shape, dtype) if isinstance(ops, TunedOps) else None
        if record is None:
            record = {"impl": "stock", "reason": "not routed (stock variant)"
                      if not isinstance(ops, TunedOps) else "not called"}
        elif isinstance(ops, TunedOps) and kernel in ops.stock_only:
            record = {**record, "impl": "stock", "reason": "forced to stock (failed-check diagnosis)"}
        out[label] = {**record, "kernel": kernel, "shape": dict(shape)}
    return out


def kernels_per_layer(ops, cfg, batch: int, s_max: int, dtype: str) -> dict:
    """Kernel launches per decoder layer, counted from what runs: a tuned entry launches what
    its verified plan launches; stock counts are torch's usual CUDA launches (torch.profiler on
    a CPU cannot see CUDA kernels): rms_norm 1 + the residual add 1, a GEMV 1, RoPE bmm 1
    (+1 copy of the strided q/k slice when batch > 1) + 2 index writes, SDPA 1 (+1 q copy for
    batch > 1; bmm attention 4), silu 1 + mul 1."""
    stock = {"add_rmsnorm": 2, "matmul": 1, "rope_kv_write": 3 if batch == 1 else 4,
             "decode_attention": (1 if batch == 1 else 2) if ops.attention == "sdpa" else 4,
             "swiglu": 2}
    described = describe_kernels(ops, cfg, batch, s_max, dtype)
    counts = {}
    for label, kernel, _ in layer_calls(cfg, batch, s_max):
        d = described[label]
        counts[label] = d["launches"] if d["impl"].startswith("tuned") else stock[kernel]
    rope_stock = not described["rope + kv write"]["impl"].startswith("tuned")
    if described["decode_attention"]["impl"].startswith("tuned") and rope_stock and batch > 1:
        counts["decode_attention"] += 1  # q made contiguous for the verified layout
    counts["total"] = sum(counts.values())
    return counts


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
