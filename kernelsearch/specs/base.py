"""What every kernel spec shares: dtypes, tolerances, input distributions, the KernelSpec base.

A spec is the fixed metric of the inner loop (like autoresearch's prepare.py): the harness
reads it, no proposer edits it.
"""
from __future__ import annotations

import math

import torch

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

# Relative L2 error bound ||out - ref|| / ||ref|| per row (see harness/compare.py).
# fp32: far under 1e-3 unless tf32 dots (matmul overrides); bf16 output rounding alone is
# ~2e-3; fp16 ~3e-4.
TOLERANCE_REL_L2: dict[torch.dtype, float] = {
    torch.float32: 1e-4,
    torch.bfloat16: 1e-2,
    torch.float16: 2e-3,
}

# Input distributions, all drawn in fp32 from the harness's generator and then cast.
# "rows": each row (leading index) gets its own scale, log-uniform in 1e-3..1e3, so a kernel
# that is only right for unit-scale data, or mixes rows up, fails.
DISTRIBUTIONS = ("normal", "tiny", "huge", "rows")
ZERO_BELOW = 0.0376   # P(|z| < this) = 3% for a standard normal z: those are drawn as exact zeros


def dtype_from_name(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype {name!r}: expected one of {', '.join(DTYPES)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    for name, value in DTYPES.items():
        if value == dtype:
            return name
    raise ValueError(f"unsupported dtype {dtype}")


def draw(shape, dist: str, generator: torch.Generator, device) -> torch.Tensor:
    """fp32 random tensor of `shape` drawn with `dist`; negative values always present, and
    exact zeros (about 3% of the elements: activations hold them, a continuous draw never did,
    and a kernel wrong only at x == 0 was accepted)."""
    t = torch.randn(tuple(shape), generator=generator, device=device, dtype=torch.float32)
    # from the draw itself (|z| < 0.0376), so no other value moves and the stream is unchanged
    t.masked_fill_(t.abs() < ZERO_BELOW, 0.0)
    if dist == "normal":
        return t
    if dist == "tiny":
        return t * 1e-3
    if dist == "huge":
        return t * 1e3
    if dist == "rows":
        lead = (shape[0],) + (1,) * (len(shape) - 1)
        exps = torch.rand(lead, generator=generator, device=device, dtype=torch.float32) * 6.0 - 3.0
        return t * torch.pow(10.0, exps)
    if dist == "wide":
        return t * 10.0
    raise ValueError(f"unknown distribution {dist!r}")


class KernelSpec:
    """One kernel's contract. Subclasses set the class attributes and the methods below.

    shape dicts are plain JSON (ints, and optionally "dtype" for a sweep entry pinned to a
    dtype, e.g. the CPU sweep's bf16 case that exercises upcasting under the interpreter).
    """

    name: str = ""
    arg_names: tuple[str, ...] = ()
    out_names: tuple[str, ...] = ()
    # In/out tensors: among arg_names, read and written in place (a KV cache). make_inputs
    # draws them like inputs; `written(inputs)` says which rows the op writes; reference()
    # gives those rows' fp64 values; every other byte must keep its input value.
    inout_names: tuple[str, ...] = ()
    # Inputs that nothing writes where the op runs in a decode step (model weights): a kernel
    # may load them before the previous kernel has ended, where the caller allows early reads
    # (harness/run_plan.py; off unless HWTUNE_PDL_EARLY=1). Never an inout or an activation.
    static_inputs: tuple[str, ...] = ()
    # first entry is the primary dtype on that device
    dtypes: dict[str, tuple[str, ...]] = {"cpu": ("float32", "bfloat16"),
                                          "cuda": ("bfloat16", "float16", "float32")}
    distributions: tuple[str, ...] = DISTRIBUTIONS

    # --- sweep ------------------------------------------------------------------------
    def shapes(self, device: str) -> list[dict]:
        raise NotImplementedError

    def describe(self, shape: dict) -> str:
        return " ".join(f"{k}={v}" for k, v in shape.items())

    def primary_dtype(self, device: str) -> str:
        return self.dtypes["cuda" if device.startswith("cuda") else "cpu"][0]

    def distributions_for(self, dtype: torch.dtype) -> tuple[str, ...]:
        return self.distributions

    # --- tensors ----------------------------------------------------------------------
    def make_inputs(self, shape: dict, dtype, device, generator: torch.Generator,
                    dist: str) -> dict:
        raise NotImplementedError

    def make_outputs(self, shape: dict, dtype, device) -> dict:
        raise NotImplementedError

    def timed_inputs(self, inputs: dict) -> dict:
        """Fresh inputs (from make_inputs) made into what a timed call gets, candidate and stock
        alike; the calls are checked all the same. By default unchanged. A spec whose work
        depends on the data makes it the work `bytes()` counts (decode attention: every
        sequence at the full cache length, as in a decode step; the checked calls draw
        lengths at random)."""
        return inputs

    def reference(self, inputs: dict) -> dict:
        """fp64 outputs, computed on the inputs' device."""
        raise NotImplementedError

    def stock(self, inputs: dict, outputs: dict) -> None:
        """The torch / cuBLAS fallback; writes into `outputs` (and in/out tensors in place)."""
        raise NotImplementedError

    def written(self, inputs: dict) -> dict:
        """{in/out name: bool tensor of that tensor's shape[:-1]}: the rows (vectors along the
        last dimension) one call writes. reference() returns, under the same name, the fp64
        values of exactly those rows, in the order `tensor[mask]` lists them ([rows, last
        dim]). The written rows' new values must not depend on their old ones: the harness
        poisons them before every call (a scatter into a buffer, e.g. a KV-cache write)."""
        return {}

    # --- cost -------------------------------------------------------------------------
    def flops(self, shape: dict) -> int:
        raise NotImplementedError

    def bytes(self, shape: dict, dtype) -> int:
        """Fewest bytes moved: each input read once, each output written once."""
        raise NotImplementedError

    def tolerance(self, dtype) -> float:
        return TOLERANCE_REL_L2[dtype_from_name(dtype)]

    def call_args(self, inputs: dict, outputs: dict) -> list:
        """Positional arguments of the candidate's launch(), in contract order."""
        return [inputs[n] for n in self.arg_names] + [outputs[n] for n in self.out_names]

    # --- what the harness needs besides data --------------------------------------------
    # Contract scalars (eps, scale): drawn per trial from the op's valid range, so a kernel
    # that ignores one (a hard-coded eps) fails. name -> (low, high), log-uniform.
    scalar_ranges: dict[str, tuple[float, float]] = {}
    # The second checked trial moves each scalar into the upper half of its range (a hard-coded
    # eps fails there if not before); False where draw_scalars maps the range itself.
    upper_scalars: bool = True

    def draw_scalars(self, rng, shape: dict) -> dict:
        """One trial's scalar arguments (rng: random.Random the candidate never sees)."""
        return {name: math.exp(rng.uniform(math.log(lo), math.log(hi)))
                for name, (lo, hi) in self.scalar_ranges.items()}

    def scalar_bounds(self, shape: dict) -> dict:
        """{name: (low, high)}: the values the checks pass a scalar argument at this shape
        (draw_scalars' range); the dispatch table routes no call outside them to a tuned kernel."""
        return dict(self.scalar_ranges)

    def typical_scalars(self, shape: dict) -> list[dict]:
        """The scalar arguments models pass (eps 1e-6 and 1e-5; attention's 1/sqrt(D)), each
        one checked trial's: drawn from a continuous range, no check ever had one exactly, and
        a kernel wrong only at `eps == 1e-5` was right on every check and wrong in every model."""
        return [{"eps": e} for e in (1e-6, 1e-5)] if "eps" in self.scalar_ranges else []

    def input_meta(self, shape: dict, dtype) -> dict:
        """{input name: (shape tuple, dtype)} of the tensor inputs (contiguous)."""
        raise NotImplementedError

    def signature(self, shape: dict, dtype) -> list[dict]:
        """launch()'s arguments for the sandbox, in contract order: tensors as shape/strides/
        dtype (no data), scalars by name."""
        dtype = dtype_from_name(dtype)
        metas = dict(self.input_meta(shape, dtype))
        for name, t in self.make_outputs(shape, dtype, "meta").items():
            metas[name] = (tuple(t.shape), t.dtype)
        out = []
        for name in self.arg_names + self.out_names:
            if name not in metas:
                out.append({"name": name, "kind": "scalar"})
                continue
            shp, dt = metas[name]
            strides, acc = [], 1
            for d in reversed(shp):
                strides.append(acc)
                acc *= max(d, 1)
            out.append({"name": name, "kind": "tensor", "shape": list(shp), "strides": strides[::-1],
                        "dtype": str(dt).removeprefix("torch."), "role": self.role(name)})
        return out

    def role(self, name: str) -> str:
        """The tensor's role: "output", "inout" (read and written in place) or "input"."""
        if name in self.out_names:
            return "output"
        return "inout" if name in self.inout_names else "input"

    def random_shape(self, rng, device: str) -> dict:
        """A shape from the op's valid domain that the published sweep does not list: a
        candidate correct only on the published shapes fails on it."""
        raise NotImplementedError

    def valid_shape(self, shape: dict) -> str | None:
        """None when `shape` is in the op's domain, else why not."""
        keys = [k for k in self.shapes("cpu")[0] if k != "dtype"]
        dims = {k: v for k, v in shape.items() if k != "dtype"}
        if sorted(dims) != sorted(keys):
            return f"{self.name} shapes have dims {', '.join(keys)} (got {', '.join(dims) or 'none'})"
        bad = [k for k, v in dims.items() if isinstance(v, bool) or not isinstance(v, int) or v < 1]
        if bad:
            return f"{', '.join(bad)} must be " + ("a positive integer" if len(bad) == 1 else "positive integers")
        return None

    def call_shape(self, args) -> dict:
        """The shape dict (the sweep's keys) of one call with `args` in arg_names order: what
        the dispatch table looks a call up by."""
        raise NotImplementedError

    def stock_call(self, inputs: dict) -> dict:
        """What a user runs (returns new tensors: no copy charged to stock). Timed as stock."""
        raise NotImplementedError

    # What stock_call is, as a user would name it: every speedup printed or stored says it is
    # against this.
    stock_name: str = "stock"


def itemsize(dtype) -> int:
    return torch.empty((), dtype=dtype_from_name(dtype)).element_size()


def rms_norm_fp64(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x64 = x.to(torch.float64)
    inv = torch.rsqrt(x64.pow(2).mean(dim=-1, keepdim=True) + eps)
    return x64 * inv * weight.to(torch.float64)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


__all__ = ["KernelSpec", "DTYPES", "TOLERANCE_REL_L2", "DISTRIBUTIONS", "draw", "dtype_from_name",
           "dtype_name", "itemsize", "rms_norm_fp64", "ceil_div", "math"]
