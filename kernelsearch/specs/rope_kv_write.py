"""rope_kv_write (one decode token: RoPE on q and k, k and v written into the KV cache):
`launch(qkv, cos, sin, positions, k_cache, v_cache, q_out, **params)`.

qkv `[B, Hq + 2*Hkv, D]` contiguous: the fused q|k|v projection of one token per sequence, as
heads (q heads first, then k, then v); cos and sin `[B, D]` (Hugging Face's rotate_half
convention, exactly as in the rope spec: any RoPE variant arrives folded into them, both halves
drawn independently); positions int64 `[B]`, the cache slot of each sequence, any value in
[0, S); k_cache, v_cache `[B, Hkv, S, D]` contiguous, read and written in place (in/out);
q_out `[B, Hq, D]`. Hkv = k_cache.shape[1], Hq = qkv.shape[1] - 2 * Hkv; no scalars.
  q_out[b, h]                          = rope(qkv[b, h])
  k_cache[b, j, positions[b]]          = rope(qkv[b, Hq + j])
  v_cache[b, j, positions[b]]          = qkv[b, Hq + Hkv + j]
and nothing else of the caches changes (the harness checks every other byte). Compute in
fp32, store in q's dtype.
"""
from __future__ import annotations

import math

import torch

from kernelsearch.specs.base import KernelSpec, draw, itemsize
from kernelsearch.specs.rope import rotate_half


def _split(qkv, hkv):
    hq = qkv.shape[1] - 2 * hkv
    return qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]


def _rope(x, cos, sin):
    """transformers' apply_rotary_pos_emb on [B, H, D] with cos/sin [B, D], in x's dtype."""
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * c + rotate_half(x) * s


class RopeKvWriteSpec(KernelSpec):
    name = "rope_kv_write"
    arg_names = ("qkv", "cos", "sin", "positions", "k_cache", "v_cache")
    out_names = ("q_out",)
    inout_names = ("k_cache", "v_cache")
    stock_name = "apply_rotary_pos_emb (x * cos + rotate_half(x) * sin) then StaticCache's " \
                 "index_copy_ of k and v into the caches"

    def shapes(self, device: str) -> list[dict]:
        if device == "cpu":
            return [{"B": 1, "Hq": 4, "Hkv": 2, "D": 16, "S": 8},
                    {"B": 3, "Hq": 6, "Hkv": 3, "D": 34, "S": 5},
                    {"B": 2, "Hq": 8, "Hkv": 1, "D": 64, "S": 17},
                    {"B": 5, "Hq": 3, "Hkv": 3, "D": 8, "S": 1},
                    {"B": 3, "Hq": 4, "Hkv": 2, "D": 32, "S": 7, "dtype": "bfloat16"}]
        # Llama-3-8B (32 / 8 heads of 128) at batch 1 and 32 with a 2048 cache, batch 256 with
        # 512; Qwen2-7B's 28 / 4 heads
        return [{"B": 1, "Hq": 32, "Hkv": 8, "D": 128, "S": 2048},
                {"B": 32, "Hq": 32, "Hkv": 8, "D": 128, "S": 2048},
                {"B": 256, "Hq": 32, "Hkv": 8, "D": 128, "S": 512},
                {"B": 16, "Hq": 28, "Hkv": 4, "D": 128, "S": 2048}]

    def valid_shape(self, shape):
        problem = super().valid_shape(shape)
        if problem:
            return problem
        if shape["D"] % 2:
            return "D must be even"
        return None

    def input_meta(self, shape, dtype):
        b, hq, hkv, d, s = shape["B"], shape["Hq"], shape["Hkv"], shape["D"], shape["S"]
        return {"qkv": ((b, hq + 2 * hkv, d), dtype), "cos": ((b, d), dtype), "sin": ((b, d), dtype),
                "positions": ((b,), torch.int64), "k_cache": ((b, hkv, s, d), dtype),
                "v_cache": ((b, hkv, s, d), dtype)}

    def random_shape(self, rng, device):
        if device == "cpu":
            return {"B": rng.randint(1, 6), "Hq": rng.randint(1, 9), "Hkv": rng.randint(1, 4),
                    "D": 2 * rng.randint(1, 34), "S": rng.randint(1, 20)}
        return {"B": rng.randint(1, 64), "Hq": rng.randint(1, 64), "Hkv": rng.randint(1, 16),
                "D": 2 * rng.randint(1, 128), "S": rng.randint(1, 4096)}

    def make_inputs(self, shape, dtype, device, generator, dist):
        b, hq, hkv, d, s = shape["B"], shape["Hq"], shape["Hkv"], shape["D"], shape["S"]
        qkv = draw((b, hq + 2 * hkv, d), dist, generator, device).to(dtype)
        angle = (torch.rand((b, d), generator=generator, device=device) * 2 - 1) * math.pi
        factor = 0.5 + torch.rand((b, 1), generator=generator, device=device)
        positions = torch.randint(0, s, (b,), generator=generator, device=device, dtype=torch.int64)
        # the caches hold earlier tokens' values: random data, not zeros (bar draw's few)
        k_cache = draw((b, hkv, s, d), dist, generator, device).to(dtype)
        v_cache = draw((b, hkv, s, d), dist, generator, device).to(dtype)
        return {"qkv": qkv, "cos": (angle.cos() * factor).to(dtype), "sin": (angle.sin() * factor).to(dtype),
                "positions": positions, "k_cache": k_cache, "v_cache": v_cache}

    def make_outputs(self, shape, dtype, device):
        return {"q_out": torch.empty((shape["B"], shape["Hq"], shape["D"]), dtype=dtype, device=device)}

    def written(self, inputs):
        b, hkv, s, _ = inputs["k_cache"].shape
        mask = torch.zeros((b, hkv, s), dtype=torch.bool, device=inputs["k_cache"].device)
        mask[torch.arange(b, device=mask.device), :, inputs["positions"].to(mask.device)] = True
        return {"k_cache": mask, "v_cache": mask.clone()}

    def reference(self, inputs):
        hkv = inputs["k_cache"].shape[1]
        q, k, v = (x.to(torch.float64) for x in _split(inputs["qkv"], hkv))
        cos, sin = inputs["cos"].to(torch.float64), inputs["sin"].to(torch.float64)
        d = q.shape[-1]
        # the written rows in k_cache[mask] order: (b, j) row-major, one slot per sequence
        return {"q_out": _rope(q, cos, sin), "k_cache": _rope(k, cos, sin).reshape(-1, d),
                "v_cache": v.reshape(-1, d)}

    def call_shape(self, args):
        b, h_all, d = args[0].shape
        _, hkv, s, _ = args[4].shape   # k_cache
        return {"B": int(b), "Hq": int(h_all) - 2 * int(hkv), "Hkv": int(hkv), "D": int(d), "S": int(s)}

    def stock_call(self, inputs):
        """What a transformers user runs: apply_rotary_pos_emb in the input dtype, then the
        cache write of StaticCache.update (index_copy_, in place). StaticCache gives the whole
        batch one position; here each sequence has its own, so the copy goes through the cache
        viewed as rows [B * Hkv * S, D], one index per (sequence, kv head)."""
        k_cache, v_cache = inputs["k_cache"], inputs["v_cache"]
        b, hkv, s, d = k_cache.shape
        q, k, v = _split(inputs["qkv"], hkv)
        q_out = _rope(q, inputs["cos"], inputs["sin"])
        k_rot = _rope(k, inputs["cos"], inputs["sin"])
        heads = torch.arange(b * hkv, device=k_cache.device).view(b, hkv)
        rows = (heads * s + inputs["positions"].view(b, 1)).reshape(-1)
        k_cache.view(-1, d).index_copy_(0, rows, k_rot.reshape(-1, d))
        v_cache.view(-1, d).index_copy_(0, rows, v.reshape(-1, d))
        return {"q_out": q_out}

    def stock(self, inputs, outputs):
        outputs["q_out"].copy_(self.stock_call(inputs)["q_out"])

    def flops(self, shape):
        # two products and one add per element of q and k
        return 3 * shape["B"] * (shape["Hq"] + shape["Hkv"]) * shape["D"]

    def bytes(self, shape, dtype):
        b, hq, hkv, d = shape["B"], shape["Hq"], shape["Hkv"], shape["D"]
        # read q|k|v, cos, sin and the positions; write q_out and one slot of k and v per head
        return (b * (hq + 2 * hkv) * d + 2 * b * d + b * (hq + 2 * hkv) * d) * itemsize(dtype) + 8 * b


SPEC = RopeKvWriteSpec()
