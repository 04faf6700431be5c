"""linear_residual (the residual add in a projection's epilogue, e.g. o_proj and down_proj of a
decoder layer): `launch(x, weight, residual, out, **params)`.

x `[M, K]` contiguous, weight `[N, K]` contiguous (nn.Linear's layout), residual `[M, N]`
contiguous, out `[M, N]`: out = residual + x @ weight.T. Accumulate in fp32, add the residual in
fp32, store once in x's dtype. Out of place: the residual is an input and must not change.
"""
from __future__ import annotations

import torch

from kernelsearch.specs.base import KernelSpec, draw, dtype_from_name, itemsize
from kernelsearch.specs.linear import LinearSpec

# (K, N) at decode: Llama-3-8B o_proj 4096 -> 4096 and down_proj 14336 -> 4096; Qwen2.5-7B's
# o_proj 3584 -> 3584 and down_proj 18944 -> 3584.
DECODE_KN = [(4096, 4096), (14336, 4096), (3584, 3584), (18944, 3584)]


class LinearResidualSpec(KernelSpec):
    name = "linear_residual"
    arg_names = ("x", "weight", "residual")
    out_names = ("out",)
    static_inputs = ("weight",)
    stock_name = "residual + torch.nn.functional.linear (cuBLAS)"

    def shapes(self, device: str) -> list[dict]:
        if device == "cpu":
            return [{"M": 1, "K": 64, "N": 96}, {"M": 4, "K": 100, "N": 72},
                    {"M": 16, "K": 128, "N": 200}, {"M": 33, "K": 65, "N": 47},
                    {"M": 5, "K": 40, "N": 24, "dtype": "bfloat16"}]
        return [{"M": m, "K": k, "N": n} for m in (1, 32) for k, n in DECODE_KN] + \
            [{"M": 16, "K": 4096, "N": 4096}, {"M": 3, "K": 3000, "N": 5121}]

    def distributions_for(self, dtype):
        return LinearSpec().distributions_for(dtype)

    def input_meta(self, shape, dtype):
        m, k, n = shape["M"], shape["K"], shape["N"]
        return {"x": ((m, k), dtype), "weight": ((n, k), dtype), "residual": ((m, n), dtype)}

    def random_shape(self, rng, device):
        return LinearSpec().random_shape(rng, device)

    def call_shape(self, args):
        (m, k), n = args[0].shape, args[1].shape[0]
        return {"M": int(m), "K": int(k), "N": int(n)}

    def stock_call(self, inputs):
        return {"out": inputs["residual"] + torch.nn.functional.linear(inputs["x"], inputs["weight"])}

    def make_inputs(self, shape, dtype, device, generator, dist):
        m, k, n = shape["M"], shape["K"], shape["N"]
        x = draw((m, k), dist, generator, device)
        weight = draw((n, k), "normal", generator, device)
        # Each row's residual as large as that row's product (|x_m| for unit-variance weights):
        # a kernel that drops either term is off by ~70%, which a tolerance cannot hide.
        scale = x.norm(dim=1, keepdim=True).clamp_min(1e-30)
        residual = draw((m, n), "normal", generator, device) * scale
        return {"x": x.to(dtype), "weight": weight.to(dtype), "residual": residual.to(dtype)}

    def make_outputs(self, shape, dtype, device):
        return {"out": torch.empty((shape["M"], shape["N"]), dtype=dtype, device=device)}

    def reference(self, inputs):
        prod = inputs["x"].to(torch.float64) @ inputs["weight"].to(torch.float64).T
        return {"out": inputs["residual"].to(torch.float64) + prod}

    def stock(self, inputs, outputs):
        outputs["out"].copy_(self.stock_call(inputs)["out"])

    def flops(self, shape):
        m, k, n = shape["M"], shape["K"], shape["N"]
        return 2 * m * n * k + m * n

    def bytes(self, shape, dtype):
        m, k, n = shape["M"], shape["K"], shape["N"]
        return (m * k + n * k + 2 * m * n) * itemsize(dtype)

    def tolerance(self, dtype):
        if dtype_from_name(dtype) == torch.float32:
            return 2e-3  # tf32 dots, as the linear spec admits
        return super().tolerance(dtype)


SPEC = LinearResidualSpec()
