"""Kernel specs: one module per kernel, explicit registry SPECS = {name: spec}."""
from __future__ import annotations

from kernelsearch.specs.base import (DISTRIBUTIONS, DTYPES, KernelSpec, dtype_from_name,
                                     dtype_name)
from kernelsearch.specs import (add_rmsnorm, decode_attention, linear, linear_residual, matmul,
                               rmsnorm, rmsnorm_gate_up_swiglu, rmsnorm_linear, rmsnorm_qkv_rope,
                               rope, rope_kv_attention, rope_kv_write, softmax, swiglu)

SPECS: dict[str, KernelSpec] = {
    "rmsnorm": rmsnorm.SPEC,
    "add_rmsnorm": add_rmsnorm.SPEC,
    "softmax": softmax.SPEC,
    "matmul": matmul.SPEC,
    "decode_attention": decode_attention.SPEC,
    "linear": linear.SPEC,
    "swiglu": swiglu.SPEC,
    "rope": rope.SPEC,
    "rope_kv_write": rope_kv_write.SPEC,
    "rmsnorm_linear": rmsnorm_linear.SPEC,
    "rmsnorm_gate_up_swiglu": rmsnorm_gate_up_swiglu.SPEC,
    "linear_residual": linear_residual.SPEC,
    "rope_kv_attention": rope_kv_attention.SPEC,
    "rmsnorm_qkv_rope": rmsnorm_qkv_rope.SPEC,
}


def get_spec(name: str) -> KernelSpec:
    try:
        return SPECS[name]
    except KeyError:
        raise KeyError(f"unknown kernel {name!r}: expected one of {', '.join(SPECS)}") from None


__all__ = ["SPECS", "KernelSpec", "get_spec", "DTYPES", "DISTRIBUTIONS", "dtype_from_name",
           "dtype_name"]
