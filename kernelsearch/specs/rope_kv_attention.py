"""rope_kv_attention (one decode token: RoPE on q and k, k and v written into the KV cache, then
attention of the rotated q over the cache up to and including that token):
`launch(qkv, cos, sin, positions, k_cache, v_cache, scale, out, **params)`.

rope_kv_write followed by decode_attention with seq_lens = positions + 1, as one contract:
qkv `[B, Hq + 2*Hkv, D]` contiguous (q heads, then k, then v, of one token per sequence); cos and
sin `[B, D]` (Hugging Face's rotate_half convention, as in rope_kv_write); positions int64 `[B]`,
each sequence's cache slot, any value in [0, S); k_cache, v_cache `[B, Hkv, S, D]` contiguous,
read and written in place (in/out); scale a Python float (the harness draws it per trial in
[0.5, 2] / sqrt(D)); Hq % Hkv == 0, query head h reads kv head h // (Hq // Hkv); D a power of
two; out `[B, Hq, D]`:
  k_cache[b, j, positions[b]] = rope(qkv[b, Hq + j]),  v_cache[b, j, positions[b]] = qkv[b, Hq + Hkv + j]
  out[b, h] = softmax(scale * rope(q[b, h]) . K[b, h // G, :L]) @ V[b, h // G, :L],  L = positions[b] + 1
where K and V are the caches after the write (row positions[b] is the new token, rows past it
are garbage the kernel must ignore), and nothing else of the caches changes. The written rows
are poisoned before every call: the new token's k and v must come from qkv, not from the cache.
As in the two-kernel path it replaces, rope(q) and rope(k) are attended to as values of q's
dtype (rope_kv_write's q_out and the cache row): the reference rounds them once before its fp64
attention (with 10x inputs the scores reach ~100, where one bf16 rounding of q moves the
softmax by more than the tolerance, in the unfused path and here alike). Compute in fp32, store
in q's dtype.
"""
from __future__ import annotations

import math

import torch

from kernelsearch.specs.base import KernelSpec, itemsize
from kernelsearch.specs.decode_attention import SPEC as DECODE_ATTENTION
from kernelsearch.specs.decode_attention import sdpa_decode
from kernelsearch.specs.rope_kv_write import SPEC as ROPE_KV_WRITE
from kernelsearch.specs.rope_kv_write import _rope, _split


class RopeKvAttentionSpec(KernelSpec):
    name = "rope_kv_attention"
    arg_names = ("qkv", "cos", "sin", "positions", "k_cache", "v_cache", "scale")
    out_names = ("out",)
    inout_names = ("k_cache", "v_cache")
    stock_name = ("apply_rotary_pos_emb, StaticCache's index_copy_ of k and v, then "
                  "torch.nn.functional.scaled_dot_product_attention with a length mask")
    # as decode_attention: "wide" keeps the softmax peaked but meaningful (1e3 would be argmax)
    distributions = ("normal", "tiny", "wide", "rows")
    upper_scalars = False   # scale is drawn as u / sqrt(D): its own range, see draw_scalars

    def shapes(self, device: str) -> list[dict]:
        if device == "cpu":
            return [{"B": 1, "Hq": 4, "Hkv": 4, "D": 16, "S": 9},
                    {"B": 3, "Hq": 8, "Hkv": 2, "D": 32, "S": 70},
                    {"B": 2, "Hq": 4, "Hkv": 1, "D": 16, "S": 1},
                    {"B": 2, "Hq": 6, "Hkv": 3, "D": 64, "S": 130},
                    {"B": 2, "Hq": 4, "Hkv": 2, "D": 32, "S": 40, "dtype": "bfloat16"}]
        # Llama-3-8B (32 / 8 heads of 128) at batch 1 and 32 with a 2048 cache; Qwen2-7B's 28 / 4
        return [{"B": 1, "Hq": 32, "Hkv": 8, "D": 128, "S": 2048},
                {"B": 32, "Hq": 32, "Hkv": 8, "D": 128, "S": 2048},
                {"B": 3, "Hq": 28, "Hkv": 4, "D": 128, "S": 1000},
                {"B": 4, "Hq": 32, "Hkv": 8, "D": 128, "S": 16384}]

    scalar_ranges = DECODE_ATTENTION.scalar_ranges

    def draw_scalars(self, rng, shape):
        return DECODE_ATTENTION.draw_scalars(rng, shape)

    def typical_scalars(self, shape):
        return DECODE_ATTENTION.typical_scalars(shape)

    def scalar_bounds(self, shape):
        return DECODE_ATTENTION.scalar_bounds(shape)

    def valid_shape(self, shape):
        return KernelSpec.valid_shape(self, shape) or DECODE_ATTENTION.attention_problem(shape) or \
            ("D must be at least 2 (RoPE rotates halves)" if shape["D"] < 2 else None)

    def input_meta(self, shape, dtype):
        return ROPE_KV_WRITE.input_meta(shape, dtype)

    def random_shape(self, rng, device):
        hkv = rng.choice([1, 2, 4])
        if device == "cpu":
            return {"B": rng.randint(1, 3), "Hq": hkv * rng.choice([1, 2, 4]), "Hkv": hkv,
                    "D": rng.choice([8, 16, 32, 64]), "S": rng.randint(1, 300)}
        return {"B": rng.randint(1, 8), "Hq": hkv * rng.choice([1, 4, 8]), "Hkv": hkv,
                "D": rng.choice([64, 128]), "S": rng.randint(1, 3000)}

    def make_inputs(self, shape, dtype, device, generator, dist):
        inputs = ROPE_KV_WRITE.make_inputs(shape, dtype, device, generator, dist)
        # as decode_attention's lengths: one sequence at the last slot (at an index drawn from
        # the positions) in the first distribution's calls, every position below it in the
        # others. Sequence 0 at the last slot in every call left a kernel that ignores
        # positions[0] (with B = 1: every position) right on every check.
        s, pos = shape["S"], inputs["positions"]
        if dist == self.distributions[0]:
            pos[int(pos.sum()) % shape["B"]] = s - 1
        elif s > 1:
            pos.remainder_(s - 1)
        inputs["scale"] = 1.0 / math.sqrt(shape["D"])
        return inputs

    def timed_inputs(self, inputs):
        # every sequence at the last slot: the full cache read, as decode_attention is timed
        inputs["positions"].fill_(inputs["k_cache"].shape[2] - 1)
        return inputs

    def make_outputs(self, shape, dtype, device):
        return {"out": torch.empty((shape["B"], shape["Hq"], shape["D"]), dtype=dtype, device=device)}

    def written(self, inputs):
        return ROPE_KV_WRITE.written(inputs)

    def reference(self, inputs):
        k_cache = inputs["k_cache"]
        b, hkv, s, d = k_cache.shape
        q, k, v = (x.to(torch.float64) for x in _split(inputs["qkv"], hkv))
        cos, sin = inputs["cos"].to(torch.float64), inputs["sin"].to(torch.float64)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        keys, values = k_cache.to(torch.float64), inputs["v_cache"].to(torch.float64)
        rows = torch.arange(b, device=k_cache.device)
        pos = inputs["positions"].to(k_cache.device)
        # attended to as stored: rope(k) in the cache's dtype, rope(q) as rope_kv_write's q_out
        keys[rows, :, pos] = k.to(k_cache.dtype).to(torch.float64)
        values[rows, :, pos] = v
        q_attn = q.to(k_cache.dtype).to(torch.float64)
        hq = q.shape[1]
        qg = q_attn.view(b, hkv, hq // hkv, d)
        scores = torch.einsum("bhgd,bhsd->bhgs", qg, keys) * inputs["scale"]
        invalid = torch.arange(s, device=k_cache.device)[None, :] > pos[:, None]   # [B, S]
        scores = scores.masked_fill(invalid[:, None, None, :], float("-inf"))
        out = torch.einsum("bhgs,bhsd->bhgd", torch.softmax(scores, dim=-1), values)
        # the written rows in k_cache[mask] order: (b, j) row-major, one slot per sequence
        return {"out": out.reshape(b, hq, d), "k_cache": k.reshape(-1, d), "v_cache": v.reshape(-1, d)}

    def call_shape(self, args):
        return ROPE_KV_WRITE.call_shape(args)

    def stock_call(self, inputs):
        """What a transformers user runs at a StaticCache decode step: apply_rotary_pos_emb,
        the cache write of StaticCache.update (index_copy_), then SDPA over the whole cache
        with a mask of each sequence's valid slots (GQA through enable_gqa)."""
        q = ROPE_KV_WRITE.stock_call(inputs)["q_out"]
        k = inputs["k_cache"]
        valid = torch.arange(k.shape[2], device=q.device)[None, :] <= inputs["positions"][:, None]
        return {"out": sdpa_decode(q, k, inputs["v_cache"], valid, inputs["scale"])}

    def stock(self, inputs, outputs):
        outputs["out"].copy_(self.stock_call(inputs)["out"])

    def flops(self, shape):
        # QK^T and PV over the full cache length, plus RoPE on q and k
        return 4 * shape["B"] * shape["Hq"] * shape["S"] * shape["D"] + \
            3 * shape["B"] * (shape["Hq"] + shape["Hkv"]) * shape["D"]

    def bytes(self, shape, dtype):
        b, hq, hkv, d, s = shape["B"], shape["Hq"], shape["Hkv"], shape["D"], shape["S"]
        # read q|k|v, cos, sin, the positions and the caches; write out and one slot of k and v
        return (b * (hq + 2 * hkv) * d + 2 * b * d + 2 * b * hkv * s * d + b * hq * d
                + 2 * b * hkv * d) * itemsize(dtype) + 8 * b


SPEC = RopeKvAttentionSpec()
