"""rmsnorm_linear (RMSNorm fused into the projection that follows it, e.g. norm + QKV, the final
norm + lm_head): `launch(x, norm_weight, weight, eps, out, **params)`.

x `[M, K]` contiguous (the residual stream), norm_weight `[K]`, weight `[N, K]` contiguous
(nn.Linear's layout), eps a Python float, out `[M, N]`:
out = (x / sqrt(mean(x^2, over K) + eps) * norm_weight) @ weight.T.
Compute in fp32, store in x's dtype. The normalised x need not exist in memory: a template may
scale the accumulated dot products by each row's 1/rms once, at the end (the rms is over the
whole row of K even where a program covers only a slice of K).
"""
from __future__ import annotations

import torch

from kernelsearch.specs.base import KernelSpec, draw, dtype_from_name, itemsize, rms_norm_fp64
from kernelsearch.specs.linear import LinearSpec
from kernelsearch.specs.rmsnorm import EPS, rms_norm_native

# Llama-3-8B at decode as (K, N): input_layernorm + fused q|k|v 4096 -> 6144, final norm +
# untied lm_head 4096 -> 128256; Qwen2.5-7B's q|k|v 3584 -> 4608 (K not a power of two).
DECODE_KN = [(4096, 6144), (4096, 128256), (3584, 4608)]


class RmsNormLinearSpec(KernelSpec):
    name = "rmsnorm_linear"
    arg_names = ("x", "norm_weight", "weight", "eps")
    out_names = ("out",)
    static_inputs = ("norm_weight", "weight")
    stock_name = "torch.nn.functional.rms_norm, then torch.nn.functional.linear (cuBLAS)"
    scalar_ranges = {"eps": (1e-6, 1e-2)}

    def shapes(self, device: str) -> list[dict]:
        if device == "cpu":
            return [{"M": 1, "K": 64, "N": 96}, {"M": 4, "K": 100, "N": 72},
                    {"M": 16, "K": 128, "N": 200}, {"M": 33, "K": 65, "N": 47},
                    {"M": 5, "K": 40, "N": 24, "dtype": "bfloat16"}]
        return [{"M": m, "K": k, "N": n} for m in (1, 32) for k, n in DECODE_KN] + \
            [{"M": 16, "K": 4096, "N": 6144}, {"M": 3, "K": 3000, "N": 5121}]

    def distributions_for(self, dtype):
        return LinearSpec().distributions_for(dtype)

    def input_meta(self, shape, dtype):
        m, k, n = shape["M"], shape["K"], shape["N"]
        return {"x": ((m, k), dtype), "norm_weight": ((k,), dtype), "weight": ((n, k), dtype)}

    def random_shape(self, rng, device):
        return LinearSpec().random_shape(rng, device)

    def call_shape(self, args):
        (m, k), n = args[0].shape, args[2].shape[0]
        return {"M": int(m), "K": int(k), "N": int(n)}

    def stock_call(self, inputs):
        normed = rms_norm_native(inputs["x"], inputs["norm_weight"], inputs["eps"])
        return {"out": torch.nn.functional.linear(normed, inputs["weight"])}

    def make_inputs(self, shape, dtype, device, generator, dist):
        m, k, n = shape["M"], shape["K"], shape["N"]
        x = draw((m, k), dist, generator, device).to(dtype)
        norm_weight = (1.0 + 0.5 * draw((k,), "normal", generator, device)).to(dtype)
        weight = draw((n, k), "normal", generator, device).to(dtype)
        return {"x": x, "norm_weight": norm_weight, "weight": weight, "eps": EPS}

    def make_outputs(self, shape, dtype, device):
        return {"out": torch.empty((shape["M"], shape["N"]), dtype=dtype, device=device)}

    def reference(self, inputs):
        normed = rms_norm_fp64(inputs["x"], inputs["norm_weight"], inputs["eps"])
        return {"out": normed @ inputs["weight"].to(torch.float64).T}

    def stock(self, inputs, outputs):
        normed = rms_norm_native(inputs["x"], inputs["norm_weight"], inputs["eps"])
        torch.matmul(normed, inputs["weight"].T, out=outputs["out"])

    def flops(self, shape):
        m, k, n = shape["M"], shape["K"], shape["N"]
        return 2 * m * n * k + 4 * m * k

    def bytes(self, shape, dtype):
        m, k, n = shape["M"], shape["K"], shape["N"]
        return (m * k + k + n * k + m * n) * itemsize(dtype)

    def tolerance(self, dtype):
        if dtype_from_name(dtype) == torch.float32:
            return 2e-3  # tf32 dots, as the linear spec admits
        return super().tolerance(dtype)


SPEC = RmsNormLinearSpec()
