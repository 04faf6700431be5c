"""A Llama-style decoder with random weights, built for benchmarking decode steps.

Layout choices that make the decode step lean and graph-capturable:
- fused weights: one [(Hq+2Hkv)*D, H] QKV matrix and one [2F, H] gate/up matrix (gate rows
  first), every projection stored [N, K] (nn.Linear's layout, the `linear` kernel contract and
  the fused decode specs' `weight`), so a decode step is four GEMVs per layer;
- a static KV cache [L, 2, B, Hkv, S_max, D] (K and V of a layer side by side, each
  [B, Hkv, S_max, D] contiguous) written in place at device-tensor positions, so one
  captured step can be replayed without any host-side state;
- RoPE + the KV-cache write go through `ops.rope_kv_write` (stock: one batched matmul per
  layer, q and k heads together, by a per-position rotation matrix gathered once per step
  from a table, then two in-place index writes; tuned: the dispatch table's `rope_kv_write`
  kernel on cos/sin [B, D] computed once per step, `rope_cos_sin`);
- every op with a tunable kernel goes through an `ops` object (see daemon/bench/ops.py);
  where `ops.fuses(kernel, *args)` says a fused decode kernel runs for the call (TunedOps with a
  routed table entry), the step calls it instead of the unfused ops: rmsnorm_linear (norm +
  QKV, final norm + LM head), linear_residual (o and down projections with the residual add),
  rmsnorm_gate_up_swiglu (norm + gate|up + SwiGLU), rmsnorm_qkv_rope (norm + q|k|v + RoPE + the
  cache write, then decode_attention; asked first), rope_kv_attention (RoPE + the cache write +
  attention). The residual stream is kept as `stream` plus a `pending` sublayer output not yet
  added to it: with no fused kernel the step is the unfused sequence (add_rmsnorm adds the
  pending output), a linear_residual leaves nothing pending, and a fused norm that finds a
  pending output adds it first (`ops.residual_add`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F


class StepTensors:
    """Per-step tensors every layer shares (RoPE state, the attention mask), each made by its
    maker on first use: inside a captured step, a tensor that no layer reads (the rotation
    matrices where the tuned RoPE kernel runs, the mask where the tuned attention runs) costs
    no kernel. `name in x` says whether x can make `name`."""

    def __init__(self, **makers):
        self._makers, self._values = makers, {}

    def __contains__(self, name) -> bool:
        return name in self._makers

    def __getitem__(self, name):
        if name not in self._values:
            self._values[name] = self._makers[name]()
        return self._values[name]

    def made(self) -> list[str]:
        return sorted(self._values)


@dataclass(frozen=True)
class ModelConfig:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    eps: float = 1e-5
    rope_theta: float = 500000.0

    def with_overrides(self, layers: int | None = None, vocab: int | None = None) -> "ModelConfig":
        out = self
        if layers:
            out = replace(out, layers=int(layers), name=f"{out.name}-L{layers}")
        if vocab:
            out = replace(out, vocab=int(vocab), name=f"{out.name}-V{vocab}")
        return out

    @property
    def qkv_heads(self) -> int:
        return self.heads + 2 * self.kv_heads

    def weight_bytes(self, dtype_bytes: int) -> int:
        """Bytes a decode step reads from weights (embedding rows excluded: B rows only)."""
        per_layer = (self.hidden * self.qkv_heads * self.head_dim      # qkv
                     + self.heads * self.head_dim * self.hidden        # o
                     + self.hidden * 2 * self.ffn                      # gate/up
                     + self.ffn * self.hidden                          # down
                     + 2 * self.hidden)                                # two norms
        return dtype_bytes * (self.layers * per_layer + self.hidden + self.hidden * self.vocab)

    def head_weight_bytes(self, dtype_bytes: int) -> int:
        """Final norm + LM head: the part of weight_bytes that the no-head floor leaves out."""
        return dtype_bytes * (self.hidden + self.hidden * self.vocab)

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V of one token over all layers."""
        return dtype_bytes * self.layers * 2 * self.kv_heads * self.head_dim

    def to_json(self) -> dict:
        return dict(self.__dict__)


PRESETS: dict[str, ModelConfig] = {
    # Small enough for CPU tests in fp32: GQA (2 q heads per kv head) kept on purpose.
    "tiny": ModelConfig("tiny", hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16,
                        ffn=128, vocab=256),
    # Llama-3-8B dimensions, 8 of its 32 layers.
    "llama3-8b-8l": ModelConfig("llama3-8b-8l", hidden=4096, layers=8, heads=32, kv_heads=8,
                                head_dim=128, ffn=14336, vocab=128256),
}


def _rotate_half_matrix(d: int, dtype, device) -> torch.Tensor:
    """P with (x @ P) == rotate_half(x) == cat(-x[d/2:], x[:d/2])."""
    half = d // 2
    p = torch.zeros(d, d, dtype=dtype, device=device)
    idx = torch.arange(half, device=device)
    p[idx + half, idx] = -1.0
    p[idx, idx + half] = 1.0
    return p


class Model:
    """Weights, KV cache and the two entry points (prefill, decode_step)."""

    def __init__(self, cfg: ModelConfig, device="cpu", dtype=torch.float32, seed: int = 0):
        self.cfg, self.device, self.dtype = cfg, torch.device(device), dtype
        g = torch.Generator(device=self.device)
        g.manual_seed(seed)

        def randn(*shape, std):
            # Random, never zeros: zeros hide wrong indexing and can run faster than real data.
            return (torch.randn(*shape, generator=g, device=self.device, dtype=torch.float32)
                    .mul_(std).to(dtype))

        def norm_weight():
            return (1.0 + randn(cfg.hidden, std=0.1).float()).to(dtype)

        h, d = cfg.hidden, cfg.head_dim
        self.embedding = randn(cfg.vocab, h, std=1.0)
        self.layers = []
        for _ in range(cfg.layers):
            self.layers.append({
                "attn_norm": norm_weight(),
                # [N, K]: out = x @ w.T (nn.Linear's layout)
                "w_qkv": randn(cfg.qkv_heads * d, h, std=1.0 / math.sqrt(h)),
                "w_o": randn(h, cfg.heads * d, std=1.0 / math.sqrt(cfg.heads * d)),
                "mlp_norm": norm_weight(),
                "w_gate_up": randn(2 * cfg.ffn, h, std=1.0 / math.sqrt(h)),
                "w_down": randn(h, cfg.ffn, std=1.0 / math.sqrt(cfg.ffn)),
            })
        self.final_norm = norm_weight()
        self.lm_head = randn(cfg.vocab, h, std=1.0 / math.sqrt(h))
        self.inv_freq = 1.0 / (cfg.rope_theta ** (
            torch.arange(0, d, 2, device=self.device, dtype=torch.float32) / d))
        self.rot = _rotate_half_matrix(d, torch.float32, self.device)
        self.scale = 1.0 / math.sqrt(d)
        self.kv: torch.Tensor | None = None
        self.rope_table: torch.Tensor | None = None
        self.cos_sin_table: torch.Tensor | None = None

    # ---- KV cache -------------------------------------------------------------------------
    def allocate_cache(self, batch: int, s_max: int) -> torch.Tensor:
        c = self.cfg
        self.kv = None  # free the old one first: the big configs do not fit twice
        if self.rope_table is not None and self.rope_table.shape[0] < s_max:
            self.rope_table = None
        # Zeros, not empty: stock masked attention multiplies masked-out V rows by 0, and
        # 0 * NaN garbage would still be NaN.
        self.kv = torch.zeros(c.layers, 2, batch, c.kv_heads, s_max, c.head_dim,
                              device=self.device, dtype=self.dtype)
        if self.rope_table is None:
            self.rope_table = self._build_rope_table(s_max)
        return self.kv

    def fill_cache_random(self, seed: int = 1) -> None:
        """Random keys and values for a decode benchmark at a given context (no prefill needed)."""
        g = torch.Generator(device=self.device)
        g.manual_seed(seed)
        for layer in range(self.kv.shape[0]):  # per layer: no fp32 copy of the whole cache
            self.kv[layer].copy_(torch.randn(self.kv[layer].shape, generator=g,
                                             device=self.device, dtype=torch.float32))

    @property
    def s_max(self) -> int:
        return self.kv.shape[4]

    # ---- RoPE -----------------------------------------------------------------------------
    def _cos_sin(self, positions: torch.Tensor):
        freqs = positions.to(torch.float32)[..., None] * self.inv_freq  # [..., D/2]
        ang = torch.cat([freqs, freqs], dim=-1)
        return ang.cos(), ang.sin()

    def rope_cos_sin(self, positions: torch.Tensor):
        """cos, sin [B, D] in the model's dtype, Hugging Face's rotate_half convention
        (cos = cat(c, c), c = cos(pos * inv_freq)): x * cos + rotate_half(x) * sin is what
        `rope_matrices` applies as x @ R, from the same fp32 angles rounded once. One gather
        from a [2, S_max, D] table built with the cache (one launch per step instead of ~7);
        each of the two is contiguous."""
        if self.cos_sin_table is None or self.cos_sin_table.shape[1] < self.kv.shape[4]:
            self.rope_table = self._build_rope_table(self.kv.shape[4])
        both = self.cos_sin_table.index_select(1, positions)
        return both[0], both[1]

    def rope_matrices(self, positions: torch.Tensor) -> torch.Tensor:
        """[B, D, D] with x @ R == x * cos + rotate_half(x) * sin at each sequence's position.

        Gathered from a table built with the cache (one launch per step instead of ~6);
        S_max * D * D elements: 270 MB in bf16 for S_max 8256, D 128."""
        if self.rope_table is None or self.rope_table.shape[0] < self.kv.shape[4]:
            self.rope_table = self._build_rope_table(self.kv.shape[4])
        return self.rope_table.index_select(0, positions)

    def _build_rope_table(self, s_max: int) -> torch.Tensor:
        """The rotation matrices [S_max, D, D]; also sets cos_sin_table [2, S_max, D] (model
        dtype) from the same fp32 cos and sin, so both paths round the same values."""
        d = self.cfg.head_dim
        table = torch.empty(s_max, d, d, device=self.device, dtype=self.dtype)
        cos_sin = torch.empty(2, s_max, d, device=self.device, dtype=self.dtype)
        for lo in range(0, s_max, 1024):  # chunks: bounded fp32 temporaries
            pos = torch.arange(lo, min(lo + 1024, s_max), device=self.device)
            cos, sin = self._cos_sin(pos)
            table[lo:lo + pos.shape[0]] = torch.diag_embed(cos) + self.rot[None] * sin[:, None, :]
            cos_sin[0, lo:lo + pos.shape[0]] = cos
            cos_sin[1, lo:lo + pos.shape[0]] = sin
        self.cos_sin_table = cos_sin
        return table

    # ---- forward --------------------------------------------------------------------------
    def decode_step(self, tokens: torch.Tensor, positions: torch.Tensor, ops,
                    head: bool = True) -> torch.Tensor:
        """One token per sequence. tokens, positions: int64 [B] device tensors. -> logits [B, V],
        or with head=False the final hidden state [B, H] (the residual stream, its last residual
        add included) before the final norm and LM head (the step whose bytes the no-head floor
        counts).

        Writes K/V at `positions` in place and attends over positions+1 entries. No host sync:
        safe to capture in a CUDA graph and replay. Each projection goes through a fused kernel
        where `ops.fuses` says so for the call, through the unfused ops otherwise (module
        docstring; daemon/bench/ops.py `layer_calls` lists the resulting calls).
        """
        c, kv = self.cfg, self.kv
        b = tokens.shape[0]
        hq, d = c.heads, c.head_dim
        # made at first use (StepTensors): a step whose layers all run the fused attention
        # kernel reads neither the lengths nor the mask. One kernel: the add casts into its
        # int32 output (`(positions + 1).to(torch.int32)` is two launches in a captured step)
        lens = StepTensors(seq_lens=lambda: torch.add(
            positions, 1, out=torch.empty_like(positions, dtype=torch.int32)))
        rope = ops.rope_context(self, positions)
        mask = StepTensors(mask=lambda: ops.attention_mask(lens["seq_lens"], kv.shape[4], self.dtype))
        stream = self.embedding.index_select(0, tokens)
        pending = None  # a sublayer's output not yet added to `stream`
        for i, w in enumerate(self.layers):
            k_cache, v_cache = kv[i, 0], kv[i, 1]
            if "cos" in rope and ops.fuses("rmsnorm_qkv_rope", stream, w["attn_norm"], w["w_qkv"], c.eps,
                                           rope["cos"], rope["sin"], positions, k_cache, v_cache):
                # norm, q|k|v, RoPE and the cache write in one kernel, then the attention. The
                # lengths are made first: no torch kernel between the two (PDL-launched) ones
                seq_lens = lens["seq_lens"]
                stream, pending = self._settle(ops, stream, pending), None
                q = ops.rmsnorm_qkv_rope(stream, w["attn_norm"], w["w_qkv"], c.eps, rope, positions,
                                         k_cache, v_cache, hq)
                attn = ops.decode_attention(q, k_cache, v_cache, seq_lens, self.scale, mask)
            else:
                qkv, stream, pending = self._norm_linear(ops, stream, pending, w["attn_norm"], w["w_qkv"])
                qkv = qkv.view(b, c.qkv_heads, d)
                if "cos" in rope and ops.fuses("rope_kv_attention", qkv, rope["cos"], rope["sin"], positions,
                                               k_cache, v_cache, self.scale):
                    attn = ops.rope_kv_attention(qkv, rope["cos"], rope["sin"], positions, k_cache, v_cache,
                                                 self.scale)
                else:
                    q = ops.rope_kv_write(qkv, rope, positions, k_cache, v_cache, hq)
                    attn = ops.decode_attention(q, k_cache, v_cache, lens["seq_lens"], self.scale, mask)
            stream, pending = self._linear_residual(ops, attn.reshape(b, hq * d), w["w_o"], stream)
            if ops.fuses("rmsnorm_gate_up_swiglu", stream, w["mlp_norm"], w["w_gate_up"], c.eps):
                stream, pending = self._settle(ops, stream, pending), None
                act = ops.rmsnorm_gate_up_swiglu(stream, w["mlp_norm"], w["w_gate_up"], c.eps)
            else:
                x, stream, pending = self._norm(ops, stream, pending, w["mlp_norm"])
                act = ops.silu_mul(ops.linear(x, w["w_gate_up"]))
            stream, pending = self._linear_residual(ops, act, w["w_down"], stream)
        if not head:
            return self._settle(ops, stream, pending)
        logits, _, _ = self._norm_linear(ops, stream, pending, self.final_norm, self.lm_head)
        return logits

    # The pieces of decode_step. Every one takes and returns (stream, pending); `stream` is
    # complete (nothing pending) whenever a fused kernel reads it.
    def _norm(self, ops, stream, pending, weight):
        """-> (normed, stream, None): rmsnorm of a complete stream, else add_rmsnorm of the
        pending output onto it (which completes it)."""
        if pending is None:
            return ops.rmsnorm(stream, weight, self.cfg.eps), stream, None
        x, stream = ops.add_rmsnorm(pending, stream, weight, self.cfg.eps)
        return x, stream, None

    @staticmethod
    def _settle(ops, stream, pending):
        return stream if pending is None else ops.residual_add(pending, stream)

    def _norm_linear(self, ops, stream, pending, norm_weight, weight):
        """norm, then x @ weight.T -> (out, stream, None): rmsnorm_linear where it runs fused
        (asked with the stream's metadata: a pending add leaves shape, dtype and layout as they
        are), else the unfused norm and linear."""
        eps = self.cfg.eps
        if ops.fuses("rmsnorm_linear", stream, norm_weight, weight, eps):
            stream = self._settle(ops, stream, pending)
            return ops.rmsnorm_linear(stream, norm_weight, weight, eps), stream, None
        x, stream, pending = self._norm(ops, stream, pending, norm_weight)
        return ops.linear(x, weight), stream, pending

    @staticmethod
    def _linear_residual(ops, x, weight, stream):
        """x @ weight.T onto a complete stream -> (stream, pending): summed in the epilogue of
        linear_residual where it runs fused (nothing pending), else the product left pending."""
        if ops.fuses("linear_residual", x, weight, stream):
            return ops.linear_residual(x, weight, stream), None
        return stream, ops.linear(x, weight)

    def prefill(self, tokens: torch.Tensor, ops, all_logits: bool = False) -> torch.Tensor:
        """tokens int64 [B, T] at positions 0..T-1; fills kv[:, :, :, :, :T].

        -> logits [B, V] of the last position, or [B, T, V] with all_logits.
        """
        c, kv = self.cfg, self.kv
        b, t = tokens.shape
        hq, hkv, d = c.heads, c.kv_heads, c.head_dim
        cos, sin = self._cos_sin(torch.arange(t, device=tokens.device))
        cos, sin = cos.to(self.dtype)[None, None], sin.to(self.dtype)[None, None]  # [1,1,T,D]
        h = self.embedding.index_select(0, tokens.reshape(-1))  # [B*T, H]
        residual = None
        for i, w in enumerate(self.layers):
            if residual is None:
                x, residual = ops.rmsnorm(h, w["attn_norm"], c.eps), h
            else:
                x, residual = ops.add_rmsnorm(h, residual, w["attn_norm"], c.eps)
            qkv = ops.linear(x, w["w_qkv"]).view(b, t, c.qkv_heads, d).transpose(1, 2)
            q, k, v = qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            kv[i, 0, :, :, :t] = k
            kv[i, 1, :, :, :t] = v
            group = hq // hkv
            attn = F.scaled_dot_product_attention(
                q, k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1),
                is_causal=True, scale=self.scale)  # [B, Hq, T, D]
            h = ops.linear(attn.transpose(1, 2).reshape(b * t, hq * d), w["w_o"])
            x, residual = ops.add_rmsnorm(h, residual, w["mlp_norm"], c.eps)
            h = ops.linear(ops.silu_mul(ops.linear(x, w["w_gate_up"])), w["w_down"])
        if not all_logits:
            h = h.view(b, t, -1)[:, -1]
            residual = residual.view(b, t, -1)[:, -1]
        x, _ = ops.add_rmsnorm(h.contiguous(), residual.contiguous(), self.final_norm, c.eps)
        logits = ops.linear(x, self.lm_head)
        return logits.view(b, t, -1) if all_logits else logits


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)
