"""matmul: `launch(a, b, out, **params)`; a `[M, K]`, b `[K, N]` (both contiguous), out `[M, N]`.

Accumulate in fp32. The fp32 tolerance admits tf32 dots (Triton's default for fp32 tl.dot);
changing torch's allow_tf32 flags is rejected by the harness (global state).
"""
from __future__ import annotations

import torch

from kernelsearch.specs.base import KernelSpec, draw, itemsize, dtype_from_name

# Llama-3-8B-ish projections (K, N): qkvo 4096x4096, gate/up 4096x14336, down 14336x4096,
# plus a 70B-ish up projection 8192x28672.
_LLAMA_KN = [(4096, 4096), (4096, 14336), (14336, 4096)]


class MatmulSpec(KernelSpec):
    name = "matmul"
    arg_names = ("a", "b")
    out_names = ("out",)
    stock_name = "a @ b (cuBLAS)"

    def shapes(self, device: str) -> list[dict]:
        if device == "cpu":
            return [{"M": 1, "K": 64, "N": 96}, {"M": 4, "K": 100, "N": 72},
                    {"M": 16, "K": 128, "N": 256}, {"M": 33, "K": 65, "N": 47},
                    {"M": 5, "K": 40, "N": 24, "dtype": "bfloat16"}]
        decode = [{"M": m, "K": k, "N": n} for m in (1, 16) for k, n in _LLAMA_KN]
        return decode + [{"M": 4, "K": 4096, "N": 4096}, {"M": 1000, "K": 3000, "N": 5121},
                         {"M": 4096, "K": 4096, "N": 4096}, {"M": 2048, "K": 8192, "N": 28672}]

    def distributions_for(self, dtype):
        # fp16 overflows at 65504: 1e3-scaled operands summed over K would overflow.
        if dtype_from_name(dtype) == torch.float16:
            return ("normal", "tiny")
        return self.distributions

    def input_meta(self, shape, dtype):
        return {"a": ((shape["M"], shape["K"]), dtype), "b": ((shape["K"], shape["N"]), dtype)}

    def random_shape(self, rng, device):
        if device == "cpu":
            return {"M": rng.randint(1, 40), "K": rng.randint(1, 150), "N": rng.randint(1, 300)}
        return {"M": rng.choice([rng.randint(1, 16), rng.randint(17, 600)]),
                "K": rng.randint(1, 3000), "N": rng.randint(1, 3000)}

    def call_shape(self, args):
        (m, k), n = args[0].shape, args[1].shape[1]
        return {"M": int(m), "K": int(k), "N": int(n)}

    def stock_call(self, inputs):
        return {"out": inputs["a"] @ inputs["b"]}

    def make_inputs(self, shape, dtype, device, generator, dist):
        a = draw((shape["M"], shape["K"]), dist, generator, device).to(dtype)
        b = draw((shape["K"], shape["N"]), "normal", generator, device).to(dtype)
        return {"a": a, "b": b}

    def make_outputs(self, shape, dtype, device):
        return {"out": torch.empty((shape["M"], shape["N"]), dtype=dtype, device=device)}

    def reference(self, inputs):
        return {"out": inputs["a"].to(torch.float64) @ inputs["b"].to(torch.float64)}

    def stock(self, inputs, outputs):
        torch.matmul(inputs["a"], inputs["b"], out=outputs["out"])

    def flops(self, shape):
        return 2 * shape["M"] * shape["N"] * shape["K"]

    def bytes(self, shape, dtype):
        m, n, k = shape["M"], shape["N"], shape["K"]
        return (m * k + k * n + m * n) * itemsize(dtype)

    def tolerance(self, dtype):
        if dtype_from_name(dtype) == torch.float32:
            return 2e-3  # tf32 dots land near 3e-4
        return super().tolerance(dtype)


SPEC = MatmulSpec()
