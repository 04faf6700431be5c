"""swiglu (the gated MLP activation of Llama-family models): `launch(gate_up, out, **params)`.

gate_up `[M, 2I]` contiguous: the output of the fused gate/up projection, the gate in columns
[0, I) and the up projection in [I, 2I). out `[M, I]`:
out[m, i] = silu(gate_up[m, i]) * gate_up[m, I + i], silu(a) = a * sigmoid(a).
Compute in fp32, store in gate_up's dtype (one rounding; stock rounds twice).
"""
from __future__ import annotations

import torch

from kernelsearch.specs.base import KernelSpec, draw, dtype_from_name, itemsize


def silu_mul_native(gate_up):
    """What a user runs: F.silu on the gate half times the up half, in the input dtype."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


class SwigluSpec(KernelSpec):
    name = "swiglu"
    arg_names = ("gate_up",)
    out_names = ("out",)
    stock_name = "torch.nn.functional.silu(gate) * up"

    def shapes(self, device: str) -> list[dict]:
        if device == "cpu":
            return [{"M": 1, "I": 128}, {"M": 5, "I": 1000}, {"M": 33, "I": 257},
                    {"M": 4, "I": 3001}, {"M": 3, "I": 130, "dtype": "bfloat16"}]
        # Llama-3-8B's intermediate size 14336 at decode (batch 1 and 32) and prefill; Llama-2-7B's
        # 11008; an odd width.
        return [{"M": 1, "I": 14336}, {"M": 32, "I": 14336}, {"M": 2048, "I": 14336},
                {"M": 16, "I": 11008}, {"M": 1000, "I": 5121}]

    def distributions_for(self, dtype):
        # fp16: 1e3-scaled inputs overflow (1e3 x 1e3 > 65504) and 1e-3-scaled ones give
        # subnormal products (1e-6): neither is a case a model runs in fp16.
        if dtype_from_name(dtype) == torch.float16:
            return ("normal", "wide")
        return self.distributions

    def input_meta(self, shape, dtype):
        return {"gate_up": ((shape["M"], 2 * shape["I"]), dtype)}

    def random_shape(self, rng, device):
        if device == "cpu":
            # up to past the published sweep's largest (M 33, I 3000): drawn below it only, a
            # kernel right for the small sizes and the published ones alone was accepted
            return {"M": rng.randint(1, 40),
                    "I": rng.choice([rng.randint(1, 64), rng.randint(65, 700), rng.randint(701, 3100)])}
        return {"M": rng.randint(1, 300), "I": rng.randint(1, 9000)}

    def call_shape(self, args):
        m, two_i = args[0].shape
        return {"M": int(m), "I": int(two_i) // 2}

    def stock_call(self, inputs):
        return {"out": silu_mul_native(inputs["gate_up"])}

    def make_inputs(self, shape, dtype, device, generator, dist):
        return {"gate_up": draw((shape["M"], 2 * shape["I"]), dist, generator, device).to(dtype)}

    def make_outputs(self, shape, dtype, device):
        return {"out": torch.empty((shape["M"], shape["I"]), dtype=dtype, device=device)}

    def reference(self, inputs):
        gate, up = inputs["gate_up"].to(torch.float64).chunk(2, dim=-1)
        return {"out": gate * torch.sigmoid(gate) * up}

    def stock(self, inputs, outputs):
        gate, up = inputs["gate_up"].chunk(2, dim=-1)
        torch.mul(torch.nn.functional.silu(gate), up, out=outputs["out"])

    def flops(self, shape):
        # silu: exp, add, divide, multiply; then the product with up
        return 5 * shape["M"] * shape["I"]

    def bytes(self, shape, dtype):
        return 3 * shape["M"] * shape["I"] * itemsize(dtype)


SPEC = SwigluSpec()
