"""decode_attention (one query token per sequence against a KV cache, GQA):
`launch(q, k_cache, v_cache, seq_lens, scale, out, **params)`.

q `[B, Hq, D]`; k_cache, v_cache `[B, Hkv, S_max, D]` (contiguous); seq_lens int32 `[B]` on the
same device, 1 <= seq_lens[b] <= S_max (only the first seq_lens[b] cache positions of
sequence b are valid: the rest holds garbage the kernel must ignore); scale a Python float
(usually 1/sqrt(D); the harness draws it per trial in [0.5, 2] / sqrt(D)); D a power of two; Hq % Hkv == 0 and query head h reads kv head h // (Hq // Hkv);
out `[B, Hq, D]` like q:
  out[b, h] = softmax(scale * q[b, h] . k_cache[b, h // G, :L]) @ v_cache[b, h // G, :L],
  L = seq_lens[b], G = Hq // Hkv. Compute in fp32, store in q's dtype.
"""
from __future__ import annotations

import math

import torch

from kernelsearch.specs.base import KernelSpec, draw, itemsize


def sdpa_decode(q, k_cache, v_cache, valid, scale):
    """What a user runs for one decode token: SDPA over the whole cache with a bool mask
    `valid` [B, S] (True = attend), GQA through enable_gqa (repeat_interleave on a torch
    without it). q [B, Hq, D] -> [B, Hq, D]."""
    import torch.nn.functional as F

    mask = valid[:, None, None, :]
    try:
        o = F.scaled_dot_product_attention(q.unsqueeze(2), k_cache, v_cache, attn_mask=mask,
                                           scale=scale, enable_gqa=True)
    except TypeError:  # torch without enable_gqa
        g = q.shape[1] // k_cache.shape[1]
        o = F.scaled_dot_product_attention(q.unsqueeze(2), k_cache.repeat_interleave(g, dim=1),
                                           v_cache.repeat_interleave(g, dim=1), attn_mask=mask, scale=scale)
    return o.squeeze(2)


def _lengths(b: int, s: int, full: bool, generator, device) -> torch.Tensor:
    """Sequence lengths (int32 [b], in 1..s). `full`: one sequence, at a random index, has the
    whole cache (the longest context exercised); else every length is below s (when s > 1).
    Sequence 0 at s in every call left a kernel that never reads seq_lens[0] right on every
    check (with B = 1, every length was s): both kinds of call are drawn, one per distribution."""
    top = s if full or s == 1 else s - 1
    lens = torch.randint(1, top + 1, (b,), generator=generator, device=device, dtype=torch.int32)
    if full:
        lens[int(torch.randint(0, b, (1,), generator=generator, device=device))] = s
    return lens


class DecodeAttentionSpec(KernelSpec):
    name = "decode_attention"
    arg_names = ("q", "k_cache", "v_cache", "seq_lens", "scale")
    out_names = ("out",)
    stock_name = "torch.nn.functional.scaled_dot_product_attention with a length mask"
    # 1e3-scaled q and k give scores ~1e6: every kernel degenerates to argmax; "wide" (x10)
    # keeps the softmax peaked but meaningful.
    distributions = ("normal", "tiny", "wide", "rows")
    upper_scalars = False   # scale is drawn as u / sqrt(D): its own range, see draw_scalars

    def shapes(self, device: str) -> list[dict]:
        if device == "cpu":
            return [{"B": 1, "Hq": 4, "Hkv": 4, "S": 32, "D": 64},
                    {"B": 3, "Hq": 8, "Hkv": 2, "S": 100, "D": 64},
                    {"B": 2, "Hq": 4, "Hkv": 1, "S": 257, "D": 32},
                    {"B": 2, "Hq": 4, "Hkv": 2, "S": 50, "D": 32, "dtype": "bfloat16"}]
        return [{"B": 1, "Hq": 32, "Hkv": 8, "S": 4096, "D": 128},
                {"B": 16, "Hq": 32, "Hkv": 8, "S": 8192, "D": 128},
                {"B": 3, "Hq": 28, "Hkv": 4, "S": 1000, "D": 128},
                {"B": 4, "Hq": 32, "Hkv": 8, "S": 32768, "D": 128}]

    # scale = u / sqrt(D), u in [0.5, 2]: drawn per trial (see draw_scalars)
    scalar_ranges = {"scale": (0.5, 2.0)}

    def draw_scalars(self, rng, shape):
        u = super().draw_scalars(rng, shape)["scale"]
        return {"scale": u / math.sqrt(shape["D"])}

    def typical_scalars(self, shape):
        return [{"scale": 1.0 / math.sqrt(shape["D"])}]

    def scalar_bounds(self, shape):
        lo, hi = self.scalar_ranges["scale"]
        return {"scale": (lo / math.sqrt(shape["D"]), hi / math.sqrt(shape["D"]))}

    def input_meta(self, shape, dtype):
        b, hq, hkv, s, d = shape["B"], shape["Hq"], shape["Hkv"], shape["S"], shape["D"]
        return {"q": ((b, hq, d), dtype), "k_cache": ((b, hkv, s, d), dtype),
                "v_cache": ((b, hkv, s, d), dtype), "seq_lens": ((b,), torch.int32)}

    def random_shape(self, rng, device):
        hkv = rng.choice([1, 2, 4])
        if device == "cpu":
            return {"B": rng.randint(1, 3), "Hq": hkv * rng.choice([1, 2, 4]), "Hkv": hkv,
                    "S": rng.randint(1, 300), "D": rng.choice([16, 32, 64])}
        return {"B": rng.randint(1, 8), "Hq": hkv * rng.choice([1, 4, 8]), "Hkv": hkv,
                "S": rng.randint(1, 3000), "D": rng.choice([64, 128])}

    def valid_shape(self, shape):
        return super().valid_shape(shape) or self.attention_problem(shape)

    @staticmethod
    def attention_problem(shape) -> str | None:
        """Why (Hq, Hkv, D) are outside what the attention kernels take, or None."""
        if shape["Hq"] % shape["Hkv"]:
            return "Hq must be a multiple of Hkv"
        if shape["D"] & (shape["D"] - 1):
            return "D must be a power of two"
        return None

    def call_shape(self, args):
        b, hq, d = args[0].shape
        _, hkv, s, _ = args[1].shape
        return {"B": int(b), "Hq": int(hq), "Hkv": int(hkv), "S": int(s), "D": int(d)}

    def stock_call(self, inputs):
        q, k = inputs["q"], inputs["k_cache"]
        valid = torch.arange(k.shape[2], device=q.device)[None, :] < inputs["seq_lens"].long()[:, None]
        return {"out": sdpa_decode(q, k, inputs["v_cache"], valid, inputs["scale"])}

    def make_inputs(self, shape, dtype, device, generator, dist):
        b, hq, hkv, s, d = shape["B"], shape["Hq"], shape["Hkv"], shape["S"], shape["D"]
        q = draw((b, hq, d), dist, generator, device).to(dtype)
        k = draw((b, hkv, s, d), dist, generator, device).to(dtype)
        v = draw((b, hkv, s, d), dist, generator, device).to(dtype)
        lens = _lengths(b, s, dist == self.distributions[0], generator, device)
        return {"q": q, "k_cache": k, "v_cache": v, "seq_lens": lens, "scale": 1.0 / math.sqrt(d)}

    def timed_inputs(self, inputs):
        # Timed at the full cache length, the bytes `bytes()` counts and the length a decode
        # step's sequences have: random lengths (mean S/2) time another workload, and picked
        # configs for it that ran at 82% of copy bandwidth in the H200's batch-32 step.
        inputs["seq_lens"].fill_(inputs["k_cache"].shape[2])
        return inputs

    def make_outputs(self, shape, dtype, device):
        return {"out": torch.empty((shape["B"], shape["Hq"], shape["D"]), dtype=dtype, device=device)}

    def reference(self, inputs):
        q, k, v = (inputs[n].to(torch.float64) for n in ("q", "k_cache", "v_cache"))
        b, hq, d = q.shape
        hkv, s = k.shape[1], k.shape[2]
        qg = q.view(b, hkv, hq // hkv, d)
        scores = torch.einsum("bhgd,bhsd->bhgs", qg, k) * inputs["scale"]
        pos = torch.arange(s, device=q.device)
        invalid = pos[None, :] >= inputs["seq_lens"].to(q.device).long()[:, None]  # [B, S]
        scores = scores.masked_fill(invalid[:, None, None, :], float("-inf"))
        out = torch.einsum("bhgs,bhsd->bhgd", torch.softmax(scores, dim=-1), v)
        return {"out": out.reshape(b, hq, d)}

    def stock(self, inputs, outputs):
        outputs["out"].copy_(self.stock_call(inputs)["out"])

    def flops(self, shape):
        # QK^T and PV over the full cache length (S_max bounds the work; sequences are shorter)
        return 4 * shape["B"] * shape["Hq"] * shape["S"] * shape["D"]

    def bytes(self, shape, dtype):
        b, hq, hkv, s, d = shape["B"], shape["Hq"], shape["Hkv"], shape["S"], shape["D"]
        return (2 * b * hq * d + 2 * b * hkv * s * d) * itemsize(dtype) + 4 * b


SPEC = DecodeAttentionSpec()
