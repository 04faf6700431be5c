"""The linear template's decode configs: the order a small grid search meets them in, and the
bench/linear_gpu.py smoke run (Triton interpreter, tiny shapes) computing every one of them."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import CP_ASYNC_KEEPS_L2_POLICY
from tests.sm90 import run_ptx_child

ROOT = Path(__file__).resolve().parents[1]


def _linear():
    from kernelsearch.kernels import linear  # defines kernels only: no launch, no interpreter needed

    return linear


def _grid_picks(mod, budget: int) -> list[dict]:
    from kernelsearch.proposers import REGISTRY, allowed_from_configs

    seen: list[dict] = []

    def evaluate(points):
        seen.extend(points)
        return [1.0] * len(points)

    import random
    REGISTRY["grid"](mod.SPACE, evaluate, budget, random.Random(0),
                     allowed=allowed_from_configs(mod.CONFIGS))
    return seen


def test_configs_are_listed_in_the_order_the_grid_strategy_walks_them():
    from kernelsearch.proposers import allowed_from_configs, domain, key

    mod = _linear()
    walk = domain(mod.SPACE, allowed_from_configs(mod.CONFIGS))
    assert [key(p) for p in walk] == [key(p) for p in mod.CONFIGS]


def _is_batch1(p):
    return p["variant"] == "gemv"


def _is_batch32(p):
    return p["variant"] in ("splitk", "swapab") and p["BLOCK_M"] >= 32 and not p["FMA"]


@pytest.mark.parametrize("budget", [2, 3, 4, 5, 6, 7, 8])
def test_a_small_grid_search_tries_batch_1_and_batch_32_decode_configs(budget):
    picks = _grid_picks(_linear(), budget)
    assert len(picks) == budget
    n1, n32 = sum(map(_is_batch1, picks)), sum(map(_is_batch32, picks))
    assert n1 >= 1 and n32 >= 1, picks
    if budget >= 8:  # 5 gemv configs of 19: a budget of 8 meets 3 of them (6 met 3 of 13)
        assert n1 >= 3 and n32 >= 3, picks


def test_the_first_config_is_the_batch_1_gemv_and_the_middle_one_a_batch_32_dot():
    # the bench without a dispatch table takes CONFIGS[0] and CONFIGS[len // 2]
    configs = _linear().CONFIGS
    assert _is_batch1(configs[0])
    assert _is_batch32(configs[len(configs) // 2])


def test_gemv_configs_keep_the_accumulator_within_64_registers_a_thread():
    mod = _linear()
    for p in mod.CONFIGS:
        if p["variant"] == "gemv":
            assert p["BLOCK_N"] * p["BLOCK_K"] <= 2048 * p["num_warps"], p
            assert p["BLOCK_K"] >= 64, p  # 16-byte bf16 loads along K with room for 8 lanes


def test_bench_linear_gpu_smoke_run_checks_every_config_on_the_interpreter(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "linear_gpu.py"), "--device", "cpu",
                           "--quick", "--out", str(tmp_path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr[-3000:]}"
    report = json.loads((tmp_path / "linear_gpu.json").read_text())
    n_configs = min(12, len(_linear().CONFIGS))
    assert [r["shape"]["M"] for r in report["rows"]] == [1, 3, 33]
    for row in report["rows"]:
        assert len(row["results"]) == 1 + n_configs
        for res in row["results"]:
            assert res["ok"] and res["rel_l2"] < 1e-2, (row["shape"], res)
    assert "best config vs cuBLAS" in proc.stdout


def test_bench_linear_gpu_refuses_cpu_without_the_interpreter():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "linear_gpu.py"), "--device", "cpu",
                           "--quick"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "TRITON_INTERPRET=1" in proc.stderr


_PTX_CHILD = r"""
import json, re
from kernelsearch.kernels import linear as L
from tests.sm90 import compile_ptx

def ptx(fn, consts, warps, stages):
    names = ["x_ptr", "w_ptr", "ws_ptr", "c_ptr", "cnt_ptr", "M", "N", "K", "split_steps",
             "s_xm", "s_xk", "s_wn", "s_wk", "s_cm", "s_cn"]
    types = ["*bf16", "*bf16", "*fp32", "*bf16", "*i32"] + ["i32"] * 10
    consts = dict(consts, s_xk=1, s_wk=1, s_cn=1)
    # what the launcher specializes at the decode shapes: pointers, N, K and row strides % 16
    return compile_ptx(fn, dict(zip(names, types)), consts, ("x_ptr", "w_ptr", "ws_ptr", "c_ptr", "cnt_ptr",
                       "N", "K", "s_xm", "s_wn", "s_cm"), warps, stages)[0]

common = dict(EVEN_K=True, DIRECT=False, LAST_REDUCES=True, SPLITS=4)
gemv = ptx(L._gemv_kernel, dict(common, BLOCK_M=1, BLOCK_N=8, BLOCK_K=512), 4, 3)
dot = ptx(L._splitk_kernel, dict(common, BLOCK_M=32, BLOCK_N=32, BLOCK_K=256, FMA=0, UPCAST=False,
                                 DOT_PRECISION="tf32", RED_M=32, SWAP=False), 4, 3)
# swapab (the weight tile as the dot's left operand), 2 splits, as CONFIGS has it at K = 14336
swap = ptx(L._splitk_kernel, dict(common, SPLITS=2, BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, FMA=0,
                                  UPCAST=False, DOT_PRECISION="tf32", RED_M=32, SWAP=True), 4, 6)
print(json.dumps({
    "swap_cp16_evict": len(re.findall(r"cp\.async\.cg\.shared\.global\.L2::cache_hint[^;]*0x10", swap)),
    "swap_cp16": len(re.findall(r"cp\.async\.cg\.shared\.global[^;]*0x10", swap)),
    "swap_b16": len(re.findall(r"ld\.global[\w.:]*\.b16\b", swap)),
    "swap_wgmma": len(re.findall(r"wgmma\.mma_async", swap)),
    "gemv_v4": len(re.findall(r"ld\.global[\w.:]*evict_first[\w.:]*\.v4\.b32", gemv)),
    "gemv_b16": len(re.findall(r"ld\.global[\w.:]*\.b16\b", gemv)),
    "dot_cp16": len(re.findall(r"cp\.async\.cg\.shared\.global[^;]*0x10", dot)),
    "dot_b16": len(re.findall(r"ld\.global[\w.:]*\.b16\b", dot))}))
"""


def test_weight_loads_are_16_byte_vectors_in_the_sm90_ptx():
    """A split offset the compiler cannot prove aligned made every weight load 2 bytes wide
    (ld.global.b16): the kernels compiled for sm_90 here, no GPU needed (ptxas ships with triton)."""
    counts = run_ptx_child(_PTX_CHILD)
    assert counts["gemv_v4"] >= 2 and counts["gemv_b16"] == 0, counts
    assert counts["dot_cp16"] >= 8 and counts["dot_b16"] == 0, counts
    # swapab: the weight through 16-byte cp.async, the products on wgmma (not mma.sync)
    assert counts["swap_cp16"] >= 8 and counts["swap_b16"] == 0 and counts["swap_wgmma"] > 0, counts
    if CP_ASYNC_KEEPS_L2_POLICY:
        assert counts["swap_cp16_evict"] >= 4, counts
