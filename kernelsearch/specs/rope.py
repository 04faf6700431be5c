"""rope (rotary position embedding of one decode token, Hugging Face's rotate_half convention):
`launch(q, k, cos, sin, q_out, k_out, **params)`.

q `[B, Hq, D]`, k `[B, Hkv, D]`, cos and sin `[B, D]` (one row per sequence: the angles of its
position, shared by all heads), all contiguous, D even, h = D / 2:
  x_out = x * cos + rotate_half(x) * sin,  rotate_half(x) = cat(-x[h:], x[:h]),
for x = q[b, head] and x = k[b, head], i.e. for i < h
  x_out[i]     = x[i] * cos[i] - x[i + h] * sin[i]
  x_out[i + h] = x[i + h] * cos[i + h] + x[i] * sin[i + h].
cos and sin are inputs, not angles: every RoPE variant a model computes (scaled, llama3, yarn's
attention factor) arrives already folded in. The two halves of a row are drawn independently:
a kernel that reads only one half (Hugging Face duplicates them) is wrong here.
Compute in fp32, store in q's dtype. RoPE fused with the KV-cache write is rope_kv_write.
"""
from __future__ import annotations

import math

import torch

from kernelsearch.specs.base import KernelSpec, draw, itemsize


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def rope_native(q, k, cos, sin):
    """What Hugging Face's apply_rotary_pos_emb runs, in the input dtype."""
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * c + rotate_half(q) * s, k * c + rotate_half(k) * s


class RopeSpec(KernelSpec):
    name = "rope"
    arg_names = ("q", "k", "cos", "sin")
    out_names = ("q_out", "k_out")
    stock_name = "x * cos + rotate_half(x) * sin (transformers' apply_rotary_pos_emb)"

    def shapes(self, device: str) -> list[dict]:
        if device == "cpu":
            return [{"B": 1, "Hq": 4, "Hkv": 2, "D": 64}, {"B": 3, "Hq": 6, "Hkv": 3, "D": 34},
                    {"B": 5, "Hq": 8, "Hkv": 1, "D": 128}, {"B": 2, "Hq": 3, "Hkv": 3, "D": 16},
                    {"B": 3, "Hq": 4, "Hkv": 2, "D": 32, "dtype": "bfloat16"}]
        # Llama-3-8B (32 / 8 heads of 128) at batch 1, 32 and 256; Qwen2-7B's 28 / 4 heads
        return [{"B": 1, "Hq": 32, "Hkv": 8, "D": 128}, {"B": 32, "Hq": 32, "Hkv": 8, "D": 128},
                {"B": 256, "Hq": 32, "Hkv": 8, "D": 128}, {"B": 16, "Hq": 28, "Hkv": 4, "D": 128}]

    def valid_shape(self, shape):
        problem = super().valid_shape(shape)
        if problem:
            return problem
        if shape["D"] % 2:
            return "D must be even"
        return None

    def input_meta(self, shape, dtype):
        b, d = shape["B"], shape["D"]
        return {"q": ((b, shape["Hq"], d), dtype), "k": ((b, shape["Hkv"], d), dtype),
                "cos": ((b, d), dtype), "sin": ((b, d), dtype)}

    def random_shape(self, rng, device):
        if device == "cpu":
            return {"B": rng.randint(1, 6), "Hq": rng.randint(1, 9), "Hkv": rng.randint(1, 4),
                    "D": 2 * rng.randint(1, 70)}
        return {"B": rng.randint(1, 64), "Hq": rng.randint(1, 64), "Hkv": rng.randint(1, 16),
                "D": 2 * rng.randint(1, 128)}

    def call_shape(self, args):
        b, hq, d = args[0].shape
        return {"B": int(b), "Hq": int(hq), "Hkv": int(args[1].shape[1]), "D": int(d)}

    def stock_call(self, inputs):
        q_out, k_out = rope_native(inputs["q"], inputs["k"], inputs["cos"], inputs["sin"])
        return {"q_out": q_out, "k_out": k_out}

    def make_inputs(self, shape, dtype, device, generator, dist):
        b, d = shape["B"], shape["D"]
        q = draw((b, shape["Hq"], d), dist, generator, device).to(dtype)
        k = draw((b, shape["Hkv"], d), dist, generator, device).to(dtype)
        # cos/sin of angles anywhere on the circle, times an attention factor in [0.5, 1.5]
        # (yarn scales both): each half of a row drawn on its own
        angle = (torch.rand((b, d), generator=generator, device=device) * 2 - 1) * math.pi
        factor = 0.5 + torch.rand((b, 1), generator=generator, device=device)
        return {"q": q, "k": k, "cos": (angle.cos() * factor).to(dtype),
                "sin": (angle.sin() * factor).to(dtype)}

    def make_outputs(self, shape, dtype, device):
        b, d = shape["B"], shape["D"]
        return {"q_out": torch.empty((b, shape["Hq"], d), dtype=dtype, device=device),
                "k_out": torch.empty((b, shape["Hkv"], d), dtype=dtype, device=device)}

    def reference(self, inputs):
        q, k, cos, sin = (inputs[n].to(torch.float64) for n in ("q", "k", "cos", "sin"))
        q_out, k_out = rope_native(q, k, cos, sin)
        return {"q_out": q_out, "k_out": k_out}

    def stock(self, inputs, outputs):
        q_out, k_out = rope_native(inputs["q"], inputs["k"], inputs["cos"], inputs["sin"])
        outputs["q_out"].copy_(q_out)
        outputs["k_out"].copy_(k_out)

    def flops(self, shape):
        # two products and one add per element of q and k
        return 3 * shape["B"] * (shape["Hq"] + shape["Hkv"]) * shape["D"]

    def bytes(self, shape, dtype):
        b, d = shape["B"], shape["D"]
        return (2 * b * (shape["Hq"] + shape["Hkv"]) * d + 2 * b * d) * itemsize(dtype)


SPEC = RopeSpec()
