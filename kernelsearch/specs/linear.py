"""linear (nn.Linear without bias): `launch(x, weight, out, **params)`.

x `[M, K]` contiguous, weight `[N, K]` contiguous (nn.Linear's layout: one row per output
feature, so each row of the weight is read along K), out `[M, N]`: out = x @ weight.T.
Accumulate in fp32, store in x's dtype. Decode projections (M = batch) stream the weight once:
they are bandwidth bound, prefill ones (M = batch x tokens) compute bound.
The fp32 tolerance admits tf32 dots (as the matmul spec does).
"""
from __future__ import annotations

import torch

from kernelsearch.specs.base import KernelSpec, draw, dtype_from_name, itemsize

# Llama-3-8B projections at decode as (K, N): fused q/k/v 4096 -> 4096 + 2 x 1024, o_proj
# 4096 -> 4096, fused gate/up 4096 -> 2 x 14336, down 14336 -> 4096, untied lm_head
# 4096 -> 128256 rows.
LLAMA3_8B_KN = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096), (4096, 128256)]


class LinearSpec(KernelSpec):
    name = "linear"
    arg_names = ("x", "weight")
    out_names = ("out",)
    static_inputs = ("weight",)
    stock_name = "torch.nn.functional.linear (cuBLAS)"

    def shapes(self, device: str) -> list[dict]:
        if device == "cpu":
            return [{"M": 1, "K": 64, "N": 96}, {"M": 4, "K": 100, "N": 72},
                    {"M": 16, "K": 128, "N": 200}, {"M": 33, "K": 65, "N": 47},
                    {"M": 5, "K": 40, "N": 24, "dtype": "bfloat16"}]
        decode = [{"M": m, "K": k, "N": n} for m in (1, 32) for k, n in LLAMA3_8B_KN]
        return decode + [{"M": 2048, "K": 4096, "N": 6144}, {"M": 1000, "K": 3000, "N": 5121}]

    def distributions_for(self, dtype):
        # fp16 overflows at 65504: 1e3-scaled activations summed over K would overflow.
        if dtype_from_name(dtype) == torch.float16:
            return ("normal", "tiny")
        return self.distributions

    def input_meta(self, shape, dtype):
        return {"x": ((shape["M"], shape["K"]), dtype), "weight": ((shape["N"], shape["K"]), dtype)}

    def random_shape(self, rng, device):
        if device == "cpu":
            return {"M": rng.randint(1, 40), "K": rng.randint(1, 150), "N": rng.randint(1, 300)}
        return {"M": rng.choice([rng.randint(1, 32), rng.randint(33, 600)]),
                "K": rng.randint(1, 3000), "N": rng.randint(1, 3000)}

    def call_shape(self, args):
        (m, k), n = args[0].shape, args[1].shape[0]
        return {"M": int(m), "K": int(k), "N": int(n)}

    def stock_call(self, inputs):
        return {"out": torch.nn.functional.linear(inputs["x"], inputs["weight"])}

    def make_inputs(self, shape, dtype, device, generator, dist):
        x = draw((shape["M"], shape["K"]), dist, generator, device).to(dtype)
        weight = draw((shape["N"], shape["K"]), "normal", generator, device).to(dtype)
        return {"x": x, "weight": weight}

    def make_outputs(self, shape, dtype, device):
        return {"out": torch.empty((shape["M"], shape["N"]), dtype=dtype, device=device)}

    def reference(self, inputs):
        return {"out": inputs["x"].to(torch.float64) @ inputs["weight"].to(torch.float64).T}

    def stock(self, inputs, outputs):
        torch.matmul(inputs["x"], inputs["weight"].T, out=outputs["out"])

    def flops(self, shape):
        return 2 * shape["M"] * shape["N"] * shape["K"]

    def bytes(self, shape, dtype):
        m, n, k = shape["M"], shape["N"], shape["K"]
        return (m * k + n * k + m * n) * itemsize(dtype)

    def tolerance(self, dtype):
        if dtype_from_name(dtype) == torch.float32:
            return 2e-3  # tf32 dots land near 3e-4
        return super().tolerance(dtype)


SPEC = LinearSpec()
