"""rmsnorm_gate_up_swiglu (a Llama-family MLP's first half in one kernel: RMSNorm, the fused
gate|up projection, SwiGLU in its epilogue): `launch(x, norm_weight, weight, eps, out, **params)`.

x `[M, K]` contiguous (the residual stream), norm_weight `[K]`, weight `[2I, K]` contiguous: the
gate projection's rows [0, I), the up projection's rows [I, 2I) (nn.Linear's layout, the two
weights concatenated); eps a Python float; out `[M, I]`:
n = x / sqrt(mean(x^2, over K) + eps) * norm_weight; g = n @ weight[:I].T; u = n @ weight[I:].T;
out = silu(g) * u, silu(a) = a * sigmoid(a).
Compute in fp32, store only out, in x's dtype (the [M, 2I] gate|up never needs to exist).
"""
from __future__ import annotations

import torch

from kernelsearch.specs.base import KernelSpec, draw, dtype_from_name, itemsize, rms_norm_fp64
from kernelsearch.specs.linear import LinearSpec
from kernelsearch.specs.rmsnorm import EPS, rms_norm_native
from kernelsearch.specs.swiglu import silu_mul_native

# (K, I) at decode: Llama-3-8B 4096 -> 2 x 14336, Qwen2.5-7B 3584 -> 2 x 18944.
DECODE_KI = [(4096, 14336), (3584, 18944)]


class RmsNormGateUpSwigluSpec(KernelSpec):
    name = "rmsnorm_gate_up_swiglu"
    arg_names = ("x", "norm_weight", "weight", "eps")
    out_names = ("out",)
    static_inputs = ("norm_weight", "weight")
    stock_name = "torch.nn.functional.rms_norm, F.linear (cuBLAS) on gate|up, then F.silu(gate) * up"
    scalar_ranges = {"eps": (1e-6, 1e-2)}

    def shapes(self, device: str) -> list[dict]:
        if device == "cpu":
            return [{"M": 1, "K": 64, "I": 48}, {"M": 4, "K": 100, "I": 36},
                    {"M": 16, "K": 128, "I": 100}, {"M": 33, "K": 65, "I": 23},
                    {"M": 5, "K": 40, "I": 12, "dtype": "bfloat16"}]
        return [{"M": m, "K": k, "I": i} for m in (1, 32) for k, i in DECODE_KI] + \
            [{"M": 16, "K": 4096, "I": 14336}, {"M": 3, "K": 3000, "I": 5121}]

    def distributions_for(self, dtype):
        return LinearSpec().distributions_for(dtype)

    def input_meta(self, shape, dtype):
        m, k, i = shape["M"], shape["K"], shape["I"]
        return {"x": ((m, k), dtype), "norm_weight": ((k,), dtype), "weight": ((2 * i, k), dtype)}

    def random_shape(self, rng, device):
        s = LinearSpec().random_shape(rng, device)
        return {"M": s["M"], "K": s["K"], "I": max(1, s["N"] // 2)}

    def call_shape(self, args):
        (m, k), two_i = args[0].shape, args[2].shape[0]
        return {"M": int(m), "K": int(k), "I": int(two_i) // 2}

    def stock_call(self, inputs):
        normed = rms_norm_native(inputs["x"], inputs["norm_weight"], inputs["eps"])
        return {"out": silu_mul_native(torch.nn.functional.linear(normed, inputs["weight"]))}

    def make_inputs(self, shape, dtype, device, generator, dist):
        m, k, i = shape["M"], shape["K"], shape["I"]
        x = draw((m, k), dist, generator, device).to(dtype)
        norm_weight = (1.0 + 0.5 * draw((k,), "normal", generator, device)).to(dtype)
        # 1/sqrt(K): gate values of order one, where silu is neither linear nor zero
        weight = (draw((2 * i, k), "normal", generator, device) / k ** 0.5).to(dtype)
        return {"x": x, "norm_weight": norm_weight, "weight": weight, "eps": EPS}

    def make_outputs(self, shape, dtype, device):
        return {"out": torch.empty((shape["M"], shape["I"]), dtype=dtype, device=device)}

    def reference(self, inputs):
        normed = rms_norm_fp64(inputs["x"], inputs["norm_weight"], inputs["eps"])
        gate, up = (normed @ inputs["weight"].to(torch.float64).T).chunk(2, dim=-1)
        return {"out": gate * torch.sigmoid(gate) * up}

    def stock(self, inputs, outputs):
        outputs["out"].copy_(self.stock_call(inputs)["out"])

    def flops(self, shape):
        m, k, i = shape["M"], shape["K"], shape["I"]
        return 2 * m * 2 * i * k + 4 * m * k + 5 * m * i

    def bytes(self, shape, dtype):
        m, k, i = shape["M"], shape["K"], shape["I"]
        return (m * k + k + 2 * i * k + m * i) * itemsize(dtype)

    def tolerance(self, dtype):
        if dtype_from_name(dtype) == torch.float32:
            return 2e-3  # tf32 dots, as the linear spec admits
        return super().tolerance(dtype)


SPEC = RmsNormGateUpSwigluSpec()
