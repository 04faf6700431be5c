"""add_rmsnorm (residual add fused with rmsnorm, both outputs):
`launch(x, residual, weight, eps, out, residual_out, **params)`.

x, residual `[M, N]` contiguous, weight `[N]`, eps a Python float; out and residual_out like x.
residual_out = x + residual; out = residual_out / sqrt(mean(residual_out^2) + eps) * weight.
Compute in fp32, store both in x's dtype. Inputs must not be modified (the harness checks), so
the update is out of place: residual_out is a separate buffer.
"""
from __future__ import annotations

import torch

from kernelsearch.specs.base import KernelSpec, draw, itemsize, rms_norm_fp64
from kernelsearch.specs.rmsnorm import EPS, RmsNormSpec, rms_norm_native


class AddRmsNormSpec(KernelSpec):
    name = "add_rmsnorm"
    arg_names = ("x", "residual", "weight", "eps")
    out_names = ("out", "residual_out")
    static_inputs = ("weight",)
    stock_name = "x + residual, then torch.nn.functional.rms_norm"

    def shapes(self, device: str) -> list[dict]:
        return RmsNormSpec().shapes(device)

    scalar_ranges = {"eps": (1e-6, 1e-2)}

    def input_meta(self, shape, dtype):
        mn = (shape["M"], shape["N"])
        return {"x": (mn, dtype), "residual": (mn, dtype), "weight": ((shape["N"],), dtype)}

    def random_shape(self, rng, device):
        return RmsNormSpec().random_shape(rng, device)

    def call_shape(self, args):
        m, n = args[0].shape
        return {"M": int(m), "N": int(n)}

    def stock_call(self, inputs):
        r = inputs["x"] + inputs["residual"]  # rounded to the input dtype, as a model does
        return {"out": rms_norm_native(r, inputs["weight"], inputs["eps"]), "residual_out": r}

    def make_inputs(self, shape, dtype, device, generator, dist):
        m, n = shape["M"], shape["N"]
        x = draw((m, n), dist, generator, device).to(dtype)
        residual = draw((m, n), dist, generator, device).to(dtype)
        weight = (1.0 + 0.5 * draw((n,), "normal", generator, device)).to(dtype)
        return {"x": x, "residual": residual, "weight": weight, "eps": EPS}

    def make_outputs(self, shape, dtype, device):
        size = (shape["M"], shape["N"])
        return {"out": torch.empty(size, dtype=dtype, device=device),
                "residual_out": torch.empty(size, dtype=dtype, device=device)}

    def reference(self, inputs):
        r = inputs["x"].to(torch.float64) + inputs["residual"].to(torch.float64)
        return {"out": rms_norm_fp64(r, inputs["weight"], inputs["eps"]), "residual_out": r}

    def stock(self, inputs, outputs):
        r = inputs["x"] + inputs["residual"]  # rounded to the input dtype, as a model does
        outputs["residual_out"].copy_(r)
        outputs["out"].copy_(rms_norm_native(r, inputs["weight"], inputs["eps"]))

    def flops(self, shape):
        return 5 * shape["M"] * shape["N"]

    def bytes(self, shape, dtype):
        return (4 * shape["M"] * shape["N"] + shape["N"]) * itemsize(dtype)


SPEC = AddRmsNormSpec()
