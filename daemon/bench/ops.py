"""The ops a decode step goes through: stock torch, or hwtune's kernels.

`StockOps` is what eager / graphed / compile use: the unfused sequence a user writes
(`fuses` is always False). `TunedOps` asks the dispatch table
(`kernelsearch.dispatch.DispatchTable`) for each substitutable call -- rmsnorm, add_rmsnorm,
linear, decode_attention, swiglu (the model's silu_mul), rope_kv_write and, unless built with
fused=False, the fused decode kernels rmsnorm_linear, rmsnorm_qkv_rope, rmsnorm_gate_up_swiglu,
linear_residual and rope_kv_attention (`fuses`: the model calls a fused kernel only where the
table routes it) --
and runs the table's verified kernel where the table routes that (kernel, shape, dtype) to
one, and the stock op everywhere else. It has no picker of its own: kernelsearch is the only
judge of which kernel is kept (one keep rule, one timer); `used` says per op and shape what
runs, and for a tuned entry its `Entry` fields (source, params, speedup against which stock).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from daemon.bench.model import StepTensors
# kernel -> fn(args) -> the shape keys its spec sweeps and the table stores (spec.call_shape)
from kernelsearch.dispatch import SHAPE_OF

# What TunedOps routes through the table: kernel (spec) name -> the StockOps method it replaces.
ROUTED = {"rmsnorm": "rmsnorm", "add_rmsnorm": "add_rmsnorm", "linear": "linear",
          "decode_attention": "decode_attention", "swiglu": "silu_mul",
          "rope_kv_write": "rope_kv_write", "rmsnorm_linear": "rmsnorm_linear",
          "rmsnorm_gate_up_swiglu": "rmsnorm_gate_up_swiglu", "linear_residual": "linear_residual",
          "rope_kv_attention": "rope_kv_attention", "rmsnorm_qkv_rope": "rmsnorm_qkv_rope"}
# The fused decode kernels: TunedOps(fused=False) never routes (nor asks about) these.
FUSED = ("rmsnorm_linear", "rmsnorm_gate_up_swiglu", "linear_residual", "rope_kv_attention",
         "rmsnorm_qkv_rope")


def _mask(mask):
    return mask["mask"] if isinstance(mask, StepTensors) else mask


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

    def linear(self, x, weight):
        """x [M, K] @ weight.T, weight [N, K] (nn.Linear's layout)."""
        return F.linear(x, weight)

    def silu_mul(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def residual_add(self, x, residual):
        return x + residual

    # ---- the fused decode kernels' contracts, as the unfused stock ops -----------------------
    def fuses(self, kernel, *args) -> bool:
        """Whether the step should call the fused `kernel` on these arguments: never for stock,
        whose step is the unfused sequence."""
        return False

    def rmsnorm_linear(self, x, norm_weight, weight, eps):
        return F.linear(StockOps.rmsnorm(self, x, norm_weight, eps), weight)

    def rmsnorm_gate_up_swiglu(self, x, norm_weight, weight, eps):
        return StockOps.silu_mul(self, F.linear(StockOps.rmsnorm(self, x, norm_weight, eps), weight))

    def linear_residual(self, x, weight, residual):
        return residual + F.linear(x, weight)

    def rmsnorm_qkv_rope(self, x, norm_weight, weight, eps, rope, positions, k_cache, v_cache, heads):
        """norm, q|k|v, RoPE and the cache write: x [B, K] -> q [B, Hq, D] rotated."""
        qkv = StockOps.rmsnorm_linear(self, x, norm_weight, weight, eps)
        return self.rope_kv_write(qkv.view(x.shape[0], -1, k_cache.shape[3]), rope, positions, k_cache,
                                  v_cache, heads)

    def rope_context(self, model, positions, **more):
        """Per-step RoPE state shared by every layer (StepTensors): rotation matrices
        [B, D, D] and the batch index of the cache write (plus the makers in `more`)."""
        return StepTensors(rot=lambda: model.rope_matrices(positions),
                           batch_idx=lambda: torch.arange(positions.shape[0], device=positions.device),
                           **more)

    def rope_kv_write(self, qkv, rope, positions, k_cache, v_cache, heads):
        """qkv [B, Hq+2Hkv, D] -> q [B, Hq, D] rotated; rotated k and v written into the caches
        at `positions` in place (one bmm for q and k heads, two index writes)."""
        hkv = k_cache.shape[1]
        qk = torch.bmm(qkv[:, :heads + hkv], rope["rot"])
        k_cache[rope["batch_idx"], :, positions] = qk[:, heads:]
        v_cache[rope["batch_idx"], :, positions] = qkv[:, heads + hkv:]
        return qk[:, :heads]

    def attention_mask(self, seq_lens, s_max, dtype):
        """Additive mask [B, 1, 1, S_max], shared by every layer (the model makes it at its first
        use: StepTensors)."""
        valid = torch.arange(s_max, device=seq_lens.device)[None, :] < seq_lens[:, None]
        zero = torch.zeros((), dtype=dtype, device=seq_lens.device)
        return torch.where(valid, zero, float("-inf")).view(seq_lens.shape[0], 1, 1, s_max)

    def decode_attention(self, q, k_cache, v_cache, seq_lens, scale, mask=None):
        """q [B, Hq, D]; caches [B, Hkv, S_max, D]; each cache is read once (no repeat).
        mask: attention_mask's tensor (or StepTensors holding it as "mask"), else built here."""
        b, hq, d = q.shape
        hkv, s = k_cache.shape[1], k_cache.shape[2]
        g = hq // hkv
        mask = _mask(mask if mask is not None else self.attention_mask(seq_lens, s, q.dtype))
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
# Where a fused decode kernel can replace unfused calls (Model.decode_step, in step order).
# "qkv_rope" (norm + q|k|v + RoPE + the cache write, then decode_attention) takes the place of
# both "qkv" and "attention" where it runs: the step asks for it first.
FUSION_POINTS = ("qkv_rope", "qkv", "attention", "o", "gate_up", "down", "head")


def fused_calls(cfg, batch: int, s_max: int) -> dict[str, tuple[str, str, dict]]:
    """fusion point -> (label, kernel, shape) of the fused call that runs there when routed."""
    h, d = cfg.hidden, cfg.head_dim
    return {
        "qkv_rope": ("rmsnorm + qkv + rope + kv write", "rmsnorm_qkv_rope",
                     {"B": batch, "K": h, "Hq": cfg.heads, "Hkv": cfg.kv_heads, "D": d, "S": s_max}),
        "qkv": ("rmsnorm_linear qkv", "rmsnorm_linear", {"M": batch, "K": h, "N": cfg.qkv_heads * d}),
        "attention": ("rope + kv write + attention", "rope_kv_attention",
                      {"B": batch, "Hq": cfg.heads, "Hkv": cfg.kv_heads, "D": d, "S": s_max}),
        "o": ("linear_residual o", "linear_residual", {"M": batch, "K": cfg.heads * d, "N": h}),
        "gate_up": ("rmsnorm_gate_up_swiglu", "rmsnorm_gate_up_swiglu", {"M": batch, "K": h, "I": cfg.ffn}),
        "down": ("linear_residual down", "linear_residual", {"M": batch, "K": cfg.ffn, "N": h}),
        "head": ("rmsnorm_linear lm_head", "rmsnorm_linear", {"M": batch, "K": h, "N": cfg.vocab}),
    }


def _norm_and_proj(where: str, point: str, pending: bool, fused, cfg, batch: int,
                   proj: list, s_max: int) -> list:
    """The calls of a norm and the projection after it (Model._norm_linear and the MLP's first
    half): fused (a torch add first when a sublayer output is pending), else the unfused norm
    (add_rmsnorm when pending, rmsnorm otherwise) and `proj`."""
    norm = {"M": batch, "N": cfg.hidden}
    if point in fused:
        return ([(f"residual add ({where})", None, norm)] if pending else []) + [fused_calls(cfg, batch, s_max)[point]]
    first = (f"add_rmsnorm ({where})", "add_rmsnorm", norm) if pending else (f"rmsnorm ({where})", "rmsnorm", norm)
    return [first] + proj


def layer_calls(cfg, batch: int, s_max: int, fused=frozenset()) -> list[tuple[str, str | None, dict]]:
    """(label, kernel, shape) of every call in one decoder layer after layer 0, in call order,
    with the fused kernels at the points in `fused` (FUSION_POINTS; empty: the unfused step).
    kernel None: a torch add with no kernel spec (the residual a fused norm needs summed)."""
    h, d = cfg.hidden, cfg.head_dim
    fc = fused_calls(cfg, batch, s_max)
    pending = "down" not in fused  # the previous layer's down output, unless summed in its epilogue
    attention = ("decode_attention", "decode_attention",
                 {"B": batch, "Hq": cfg.heads, "Hkv": cfg.kv_heads, "S": s_max, "D": d})
    if "qkv_rope" in fused:  # norm, q|k|v, RoPE and the cache write in one; then the attention
        calls = _norm_and_proj("attention", "qkv_rope", pending, fused, cfg, batch, [], s_max) + [attention]
    else:
        calls = _norm_and_proj("attention", "qkv", pending, fused, cfg, batch,
                               [("linear qkv", "linear", {"M": batch, "K": h, "N": cfg.qkv_heads * d})], s_max)
        if "attention" in fused:
            calls.append(fc["attention"])
        else:
            calls += [("rope + kv write", "rope_kv_write",
                       {"B": batch, "Hq": cfg.heads, "Hkv": cfg.kv_heads, "D": d, "S": s_max}), attention]
    calls.append(fc["o"] if "o" in fused else ("linear o", "linear", {"M": batch, "K": cfg.heads * d, "N": h}))
    calls += _norm_and_proj("mlp", "gate_up", "o" not in fused, fused, cfg, batch,
                            [("linear gate_up", "linear", {"M": batch, "K": h, "N": 2 * cfg.ffn}),
                             ("swiglu", "swiglu", {"M": batch, "I": cfg.ffn})], s_max)
    calls.append(fc["down"] if "down" in fused else ("linear down", "linear", {"M": batch, "K": cfg.ffn, "N": h}))
    return calls


def step_calls(cfg, batch: int, s_max: int, fused=frozenset()) -> list[tuple[str, str | None, dict]]:
    """Every call of a whole decode step (logits out) by label: layer 0's first norm where it
    differs from the other layers', one layer, the final norm and LM head."""
    first = [] if {"qkv", "qkv_rope"} & set(fused) else [("rmsnorm (layer 0)", "rmsnorm", {"M": batch, "N": cfg.hidden})]
    head = _norm_and_proj("final", "head", "down" not in fused, fused, cfg, batch,
                          [("lm_head", "linear", {"M": batch, "K": cfg.hidden, "N": cfg.vocab})], s_max)
    return first + layer_calls(cfg, batch, s_max, fused) + head


def decode_shapes(cfg, shapes, fused: bool = True, s_max: int | None = None) -> dict[str, list[dict]]:
    """{kernel: [shape dict]} of every call the tuned decode step may make at these
    (batch, context) shapes, fused and unfused (with fused=False: the unfused step's only):
    what the search must look at for this model (autotable). s_max: the cache's slots, where
    not the bench's cache_len(context) (a transformers StaticCache holds exactly its context)."""
    out: dict[str, list[dict]] = {}
    for batch, ctx in shapes:
        # unfused; every fused kernel but qkv_rope (the qkv and attention points it replaces);
        # all of them
        every = frozenset(FUSION_POINTS)
        variants = [frozenset(), every - {"qkv_rope"}, every] if fused else [frozenset()]
        for points in variants:
            for _, kernel, shape in step_calls(cfg, batch, s_max or cache_len(ctx), points):
                if kernel is not None and shape not in out.setdefault(kernel, []):
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

    def __init__(self, table=None, table_note: str = "", attention: str = "sdpa", fused: bool = True):
        super().__init__(attention)
        self.table, self.table_note = table, table_note
        self.fused = fused  # False: issue 12's tuned step (the fused kernels never asked about)
        if not fused:
            self.name = "tuned-unfused"
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

    def runs_tuned(self, kernel: str, shape: dict, dtype: str) -> bool:
        """Whether calls of (kernel, shape, dtype) run the table's kernel (False before the
        first call)."""
        record = self.record(kernel, shape, dtype)
        return (record is not None and record["impl"].startswith("tuned") and kernel not in self.stock_only
                and (self.fused or kernel not in FUSED))

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

    def linear(self, x, weight):
        if self._routed("linear", (x, weight)):
            return self.table.call("linear", x, weight)
        return StockOps.linear(self, x, weight)

    def fuses(self, kernel, *args) -> bool:
        """True where the table routes the fused `kernel` for these arguments (decided once per
        shape, recorded in `used` as every call is); never with fused=False."""
        if kernel in FUSED and not self.fused:
            return False
        return self._routed(kernel, args)

    def rmsnorm_linear(self, x, norm_weight, weight, eps):
        if self.fuses("rmsnorm_linear", x, norm_weight, weight, eps):
            return self.table.call("rmsnorm_linear", x, norm_weight, weight, eps)
        return StockOps.rmsnorm_linear(self, x, norm_weight, weight, eps)

    def rmsnorm_gate_up_swiglu(self, x, norm_weight, weight, eps):
        if self.fuses("rmsnorm_gate_up_swiglu", x, norm_weight, weight, eps):
            return self.table.call("rmsnorm_gate_up_swiglu", x, norm_weight, weight, eps)
        return StockOps.rmsnorm_gate_up_swiglu(self, x, norm_weight, weight, eps)

    def linear_residual(self, x, weight, residual):
        if self.fuses("linear_residual", x, weight, residual):
            return self.table.call("linear_residual", x, weight, residual)
        return StockOps.linear_residual(self, x, weight, residual)

    def rope_kv_attention(self, qkv, cos, sin, positions, k_cache, v_cache, scale):
        """RoPE, the cache write and decode attention in one kernel: only where `fuses` said so
        for these arguments (the step calls rope_kv_write and decode_attention elsewhere)."""
        return self.table.call("rope_kv_attention", qkv, cos, sin, positions, k_cache, v_cache, scale)

    def rmsnorm_qkv_rope(self, x, norm_weight, weight, eps, rope, positions, k_cache, v_cache, heads):
        """Norm, q|k|v, RoPE and the cache write in one kernel where the table routes it for
        these arguments (`fuses` with rope's cos and sin), else the stock composition."""
        if "cos" in rope:
            args = (x, norm_weight, weight, eps, rope["cos"], rope["sin"], positions, k_cache, v_cache)
            if self.fuses("rmsnorm_qkv_rope", *args):
                return self.table.call("rmsnorm_qkv_rope", *args)
        return StockOps.rmsnorm_qkv_rope(self, x, norm_weight, weight, eps, rope, positions, k_cache,
                                         v_cache, heads)

    def silu_mul(self, gate_up):
        if self._routed("swiglu", (gate_up,)):
            return self.table.call("swiglu", gate_up)
        return StockOps.silu_mul(self, gate_up)

    def rope_context(self, model, positions):
        """Stock's rotation matrices (made only if a layer runs stock RoPE), plus cos/sin [B, D]
        in the model's dtype (Hugging Face's rotate_half convention, shared by every layer;
        one gather from the model's table) when the table has a rope_kv_write or (fused)
        rope_kv_attention or rmsnorm_qkv_rope entry for this step's shape: the specs' inputs."""
        c = model.cfg
        shape = {"B": int(positions.shape[0]), "Hq": c.heads, "Hkv": c.kv_heads, "D": c.head_dim,
                 "S": int(model.kv.shape[4])}
        shapes = {"rope_kv_write": shape, "rope_kv_attention": shape,
                  "rmsnorm_qkv_rope": {"B": shape["B"], "K": c.hidden, **{k: shape[k] for k in ("Hq", "Hkv", "D", "S")}}}
        dtype = DTYPE_NAMES.get(model.dtype, str(model.dtype))
        kernels = ("rope_kv_write", "rope_kv_attention", "rmsnorm_qkv_rope") if self.fused else ("rope_kv_write",)
        listed = [k for k in kernels if k not in self.stock_only and self.table is not None
                  and self.table.lookup(k, shapes[k], dtype) is not None]
        for k in kernels[1:]:
            if k not in listed:  # the step will not ask: say why here
                self.used.setdefault(_shape_key(k, shapes[k], dtype), {
                    "impl": "stock", "reason": "no table entry" if self.table is not None
                    else self.table_note or "no dispatch table"})
        if not listed:
            return StockOps.rope_context(self, model, positions)
        rope = StockOps.rope_context(self, model, positions, cos_sin=lambda: model.rope_cos_sin(positions),
                                     cos=lambda: rope["cos_sin"][0], sin=lambda: rope["cos_sin"][1])
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


def fused_points(ops, cfg, batch: int, dtype: str, s_max: int) -> frozenset:
    """The FUSION_POINTS where the step ran (runs) a fused kernel: read from TunedOps' decisions
    after at least one step; empty for stock."""
    if not isinstance(ops, TunedOps):
        return frozenset()
    return frozenset(p for p, (_, kernel, shape) in fused_calls(cfg, batch, s_max).items()
                     if ops.runs_tuned(kernel, shape, dtype))


def describe_fusions(ops, cfg, batch: int, dtype: str, s_max: int) -> dict[str, str]:
    """Per fusion point: the fused kernel that runs there, or why the unfused calls run."""
    out = {}
    calls = fused_calls(cfg, batch, s_max)
    _, qkv_rope, qkv_rope_shape = calls["qkv_rope"]
    replaced = isinstance(ops, TunedOps) and ops.runs_tuned(qkv_rope, qkv_rope_shape, dtype)
    for point, (_, kernel, shape) in calls.items():
        record = ops.record(kernel, shape, dtype) if isinstance(ops, TunedOps) else None
        if not isinstance(ops, TunedOps):
            why = "unfused (stock variant)"
        elif replaced and point in ("qkv", "attention"):
            why = f"in {qkv_rope} (norm + q|k|v + RoPE + the cache write), then decode_attention"
        elif not ops.fused:
            why = "unfused (fused kernels off in this variant)"
        elif record is None:
            why = "unfused (not asked)"
        elif ops.runs_tuned(kernel, shape, dtype):
            why = f"fused: {kernel}"
        else:
            why = f"unfused ({kernel}: {record.get('reason') or record['impl']})"
        out[point] = why
    return out


def describe_kernels(ops, cfg, batch: int, s_max: int, dtype: str) -> dict[str, dict]:
    """Per call of the decode step (label): what runs -- the tuned entry's fields, or stock and
    why. Read after at least one step (TunedOps decides on the first call)."""
    out = {}
    for label, kernel, shape in step_calls(cfg, batch, s_max, fused_points(ops, cfg, batch, dtype, s_max)):
        record = ops.record(kernel, shape, dtype) if isinstance(ops, TunedOps) and kernel else None
        if kernel is None:
            record = {"impl": "stock", "reason": "torch add: the pending residual, summed before a fused norm"}
        elif record is None:
            record = {"impl": "stock", "reason": "not routed (stock variant)"
                      if not isinstance(ops, TunedOps) else "not called"}
        elif isinstance(ops, TunedOps) and kernel in ops.stock_only:
            record = {**record, "impl": "stock", "reason": "forced to stock (failed-check diagnosis)"}
        out[label] = {**record, "kernel": kernel, "shape": dict(shape)}
    return out


def kernels_per_layer(ops, cfg, batch: int, s_max: int, dtype: str) -> dict:
    """Kernel launches per decoder layer (after layer 0), counted from what runs: a tuned entry
    launches what its verified plan launches; stock counts are torch's usual CUDA launches
    (torch.profiler on a CPU cannot see CUDA kernels): rms_norm 1 (+ the residual add 1), a
    GEMV 1, RoPE bmm 1 (+1 copy of the strided q/k slice when batch > 1) + 2 index writes, SDPA
    1 (+1 q copy for batch > 1; bmm attention 4), silu 1 + mul 1, a residual add 1."""
    stock = {"rmsnorm": 1, "add_rmsnorm": 2, "linear": 1, "rope_kv_write": 3 if batch == 1 else 4,
             "decode_attention": (1 if batch == 1 else 2) if ops.attention == "sdpa" else 4,
             "swiglu": 2, None: 1,
             # the fused kernels' stock compositions (listed only where a tuned entry runs)
             "rmsnorm_linear": 2, "rmsnorm_gate_up_swiglu": 4, "linear_residual": 2,
             "rope_kv_attention": (3 if batch == 1 else 4) + (1 if batch == 1 else 2),
             "rmsnorm_qkv_rope": 2 + (3 if batch == 1 else 4)}
    fused = fused_points(ops, cfg, batch, dtype, s_max)
    described = describe_kernels(ops, cfg, batch, s_max, dtype)
    counts = {}
    for label, kernel, _ in layer_calls(cfg, batch, s_max, fused):
        d = described[label]
        counts[label] = d["launches"] if d["impl"].startswith("tuned") else stock[kernel]
    if not {"attention", "qkv_rope"} & fused:
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
