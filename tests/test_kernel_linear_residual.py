"""The linear_residual template (out = residual + x @ weight.T): the trusted harness accepts each
kind of config over the spec's CPU sweep (Triton interpreter, child processes), the split-K and
direct paths compute the same thing, the configs are in the grid strategy's walk order, and the
weight loads compile to 16-byte vectors (or 16-byte cp.async) for sm_90."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import CP_ASYNC_KEEPS_L2_POLICY
from tests.sm90 import run_ptx_child

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = ROOT / "kernelsearch" / "kernels" / "linear_residual.py"



def _template():
    from kernelsearch.kernels import linear_residual  # defines kernels only: no launch

    return linear_residual


def _p(variant, bm, bn, bk, sk, reduce="last", unroll=1, pipe=0, warps=4, stages=3):
    return {"variant": variant, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": sk,
            "UNROLL": unroll, "PIPE": pipe, "num_warps": warps, "num_stages": stages,
            "REDUCE": reduce}


# Small BLOCK_K so that the CPU sweep's K (40..150) runs whole UNROLL groups, single rest steps,
# ragged (masked) ends and several splits.
HARNESS_CASES = {
    "gemv_direct_unroll2": _p("gemv", 8, 32, 16, 1, unroll=2),
    "gemv_split3_last_pipelined": _p("gemv", 8, 32, 16, 3, "last", pipe=1, stages=3),
    "gemv_split2_launch": _p("gemv", 8, 32, 32, 2, "launch"),
    "splitk_dot_direct": _p("splitk", 32, 32, 32, 1),
    "splitk_dot_split3_last": _p("splitk", 16, 32, 32, 3, "last"),
    "swapab_dot_split3_last": _p("swapab", 16, 64, 32, 3, "last"),
}


@pytest.mark.parametrize("case", sorted(HARNESS_CASES))
def test_the_harness_accepts_the_config_over_the_cpu_sweep(case):
    from kernelsearch.harness import evaluate
    from kernelsearch.specs import SPECS

    v = evaluate("linear_residual", TEMPLATE, params=HARNESS_CASES[case], device="cpu",
                 time_it=False)
    assert v.accepted, f"{v.guard}: {v.reason}"
    sweep = SPECS["linear_residual"].shapes("cpu")
    assert len(v.shapes) == len(sweep) + 1  # + one shape drawn at random
    assert all(s.status == "ok" for s in v.shapes), [(s.shape, s.status) for s in v.shapes]


def test_configs_are_listed_in_the_order_the_grid_strategy_walks_them():
    from kernelsearch.proposers import allowed_from_configs, domain, key

    mod = _template()
    walk = domain(mod.SPACE, allowed_from_configs(mod.CONFIGS))
    assert [key(p) for p in walk] == [key(p) for p in mod.CONFIGS]
    assert all(mod._valid(p) for p in mod.CONFIGS)


@pytest.mark.parametrize("budget", [2, 3, 4, 5, 6, 7, 8])
def test_a_small_grid_search_tries_batch_1_and_batch_32_configs(budget):
    from kernelsearch.proposers import REGISTRY, allowed_from_configs

    mod = _template()
    seen: list[dict] = []

    def evaluate(points):
        seen.extend(points)
        return [1.0] * len(points)

    REGISTRY["grid"](mod.SPACE, evaluate, budget, random.Random(0),
                     allowed=allowed_from_configs(mod.CONFIGS))
    n1 = sum(p["variant"] == "gemv" for p in seen)
    n32 = sum(p["variant"] in ("splitk", "swapab") and p["BLOCK_M"] >= 32 for p in seen)
    assert len(seen) == budget and n1 >= 1 and n32 >= 1, seen
    if budget >= 6:
        assert n1 >= 3 and n32 >= 3, seen
    assert mod.CONFIGS[0]["variant"] == "gemv" and not mod.CONFIGS[0]["PIPE"]


_AGREE_CHILD = r"""
import json, torch
from kernelsearch.kernels import linear_residual as L

def p(variant, bm, bn, bk, sk, reduce="last", unroll=1, pipe=0, stages=3):
    return dict(variant=variant, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=sk, UNROLL=unroll,
                PIPE=pipe, num_warps=4, num_stages=stages, REDUCE=reduce)

configs = {
    "gemv_direct": p("gemv", 8, 16, 32, 1),
    "gemv_direct_unroll2": p("gemv", 8, 16, 16, 1, unroll=2),
    "gemv_split4_last": p("gemv", 8, 16, 16, 4, "last"),
    "gemv_split3_launch_unroll2_pipe": p("gemv", 8, 16, 16, 3, "launch", unroll=2, pipe=1, stages=4),
    "splitk_direct": p("splitk", 32, 16, 32, 1),
    "splitk_split4_last": p("splitk", 16, 16, 32, 4, "last"),
    "splitk_split3_launch": p("splitk", 16, 16, 32, 3, "launch"),
    "swapab_direct": p("swapab", 32, 64, 32, 1),
    "swapab_split3_last": p("swapab", 16, 64, 32, 3, "last"),
}
g = torch.Generator().manual_seed(7)
report = {}
# M=1: the gemv's one-row path; M=20: gemv row blocks of 8 (rows past M), splitk 32 rows;
# K=200 and 101 with BLOCK_K 16/32: ragged ends, whole unroll groups, splits of unequal length
for (m, k, n) in [(1, 200, 40), (20, 101, 37)]:
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g)
    r = torch.randn(m, n, generator=g) * 10
    r_before = r.clone()
    ref = r.double() + x.double() @ w.double().T
    outs = {}
    for name, cfg in configs.items():
        for _ in range(2):  # twice: the arrival counters must be back at zero after a launch
            out = torch.full((m, n), float("nan"))
            L.launch(x, w, r, out, **cfg)
            outs.setdefault(name, []).append(out)
    direct = outs["gemv_direct"][0]
    for name, (a, b) in outs.items():
        report[f"{m}x{k}x{n} {name}"] = {
            "vs_ref": ((a.double() - ref).norm() / ref.norm()).item(),
            "vs_direct": ((a - direct).norm() / direct.norm()).item(),
            "repeat_bits_equal": bool(torch.equal(a, b)),
        }
    report[f"{m}x{k}x{n} residual unchanged"] = bool(torch.equal(r, r_before))
report["counters zero"] = all(int(c.abs().sum()) == 0 for c in L._counters.values())
print(json.dumps(report))
"""


def test_split_k_and_direct_paths_agree_with_each_other_and_the_fp64_reference():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", _AGREE_CHILD], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report.pop("counters zero") is True
    for key, row in report.items():
        if key.endswith("residual unchanged"):
            assert row is True, key
            continue
        assert row["vs_ref"] < 1e-5 and row["vs_direct"] < 1e-5, (key, row)
        assert row["repeat_bits_equal"], key


_PTX_CHILD = r"""
import json, re
from kernelsearch.kernels import linear_residual as L
from tests.sm90 import compile_ptx as _compile, ptxas_usage as ptxas_spills

NAMES = ["x_ptr", "w_ptr", "r_ptr", "ws_ptr", "c_ptr", "cnt_ptr", "M", "N", "K", "split_steps",
         "s_xm", "s_xk", "s_wn", "s_wk", "s_rm", "s_rn", "s_cm", "s_cn"]

def compile_ptx(fn, consts, warps, stages):
    sig = dict(zip(NAMES, ["*bf16", "*bf16", "*bf16", "*fp32", "*bf16", "*i32"] + ["i32"] * 12))
    consts = dict(consts, s_xk=1, s_wk=1, s_rn=1, s_cn=1)
    # what the launcher specializes at the decode shapes: pointers, N, K and row strides % 16
    return _compile(fn, sig, consts, ("x_ptr", "w_ptr", "r_ptr", "ws_ptr", "c_ptr", "cnt_ptr", "N", "K",
                                      "s_xm", "s_wn", "s_rm", "s_cm"), warps, stages)[0]

rows = []
for p in L.CONFIGS:
    split = p["SPLIT_K"] > 1
    c = dict(EVEN_K=True, DIRECT=not split, LAST_REDUCES=split and p["REDUCE"] == "last",
             SPLITS=p["SPLIT_K"], BLOCK_N=p["BLOCK_N"], BLOCK_K=p["BLOCK_K"])
    if p["variant"] == "gemv":
        c.update(BLOCK_M=1, UNROLL=p["UNROLL"], LOOP_STAGES=p["num_stages"] if p["PIPE"] else 1)
        fn = L._gemv_kernel
    else:
        c.update(BLOCK_M=32, UPCAST=False, DOT_PRECISION="tf32", RED_M=32,
                 SWAP=p["variant"] == "swapab")
        fn = L._splitk_kernel
    ptx = compile_ptx(fn, c, p["num_warps"], p["num_stages"])
    loads = re.findall(r"ld\.global[^;]*", ptx)
    regs, spills = ptxas_spills(ptx)
    rows.append({"params": p, "regs": regs, "spills": spills,
                 "weight_v4": sum("evict_first" in l and ".v4.b32" in l for l in loads),
                 "weight_narrow": sum("evict_first" in l and ".v4" not in l for l in loads),
                 "cp_async_16": len(re.findall(r"cp\.async\.cg\.shared\.global[^;]*0x10", ptx)),
                 "cp_async_narrow": len(re.findall(r"cp\.async\.ca\.shared\.global", ptx)),
                 # the pipelined gemv's weight copies carry an L2 evict_first policy
                 "weight_cp_16": len(re.findall(r"cp\.async\.cg\.shared\.global\.L2::cache_hint[^;]*0x10", ptx)),
                 "weight_cp_narrow": len(re.findall(r"cp\.async[.\w]*\.L2::cache_hint(?![^;]*0x10)[^;]*;", ptx)),
                 "evict_first_policy": "createpolicy.fractional.L2::evict_first" in ptx,
                 "wgmma": len(re.findall(r"wgmma\.mma_async", ptx))})
print(json.dumps(rows))
"""


def test_weight_loads_are_16_byte_vectors_in_the_sm90_ptx_and_nothing_spills():
    """PIPE=0 gemv: evict_first ld.global.v4 (the residual epilogue's narrow loads are not
    weight loads); PIPE=1 gemv: 16-byte cp.async (0x10) under an L2 evict_first policy (x, an
    eighth of the bytes from L2, may go 8 bytes at a time); the tl.dot configs: 16-byte
    cp.async only. Compiled for sm_90 here, no GPU needed (ptxas ships with triton)."""
    rows = run_ptx_child(_PTX_CHILD)
    assert len(rows) == len(_template().CONFIGS)
    for row in rows:
        p = row["params"]
        assert row["spills"] == 0 and row["regs"] is not None, row
        assert row["weight_narrow"] == 0, row
        if p["variant"] == "swapab":  # the weight tile as wgmma's operand, 16-byte cp.async
            assert row["cp_async_16"] >= 8 and row["cp_async_narrow"] == 0 and row["wgmma"] > 0, row
            if CP_ASYNC_KEEPS_L2_POLICY:
                assert row["weight_cp_16"] >= 4 and row["evict_first_policy"], row
        elif p["variant"] == "splitk":
            assert row["cp_async_16"] >= 8 and row["cp_async_narrow"] == 0, row
        elif not p["PIPE"]:
            assert row["weight_v4"] >= 2 and row["cp_async_16"] == 0, row
        else:  # the pipelined main loop streams the weight through shared memory
            assert row["cp_async_16"] >= 4 and row["weight_cp_narrow"] == 0, row
            if CP_ASYNC_KEEPS_L2_POLICY:
                assert row["weight_cp_16"] >= 4 and row["evict_first_policy"], row
