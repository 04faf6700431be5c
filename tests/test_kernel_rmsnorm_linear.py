"""The rmsnorm_linear template: accepted by the trusted harness (CPU sweep, Triton interpreter)
in each of its paths, split-K and one-split results agree, its configs are listed in the grid
strategy's walk order, and its weight loads compile to 16-byte vectors (16-byte cp.async with
PIPE=1) for sm_90 without spills."""
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
TEMPLATE = ROOT / "kernelsearch" / "kernels" / "rmsnorm_linear.py"



def _template():
    from kernelsearch.kernels import rmsnorm_linear  # defines kernels only: no launch, no interpreter needed

    return rmsnorm_linear


def _cfg(variant, bn, bk, sk, warps, reduce="last", bm=None, stages=3, pipe=0):
    return {"variant": variant, "BLOCK_M": bm or (8 if variant == "gemv" else 32), "BLOCK_N": bn,
            "BLOCK_K": bk, "SPLIT_K": sk, "PIPE": pipe, "num_warps": warps, "num_stages": stages,
            "REDUCE": reduce}


# One of each path: the GEMV writing `out` directly (register loads, and the pipelined
# tl.range loop of PIPE=1), the GEMV split over K reduced by the last program and by a second
# kernel, and the tl.dot split-K. Small BLOCK_K so that the CPU
# sweep's K (40..128) takes several steps and splits; 8 warps and BLOCK_N 32 keep the number
# of interpreted programs (and the test's time) small.
PATHS = {
    "gemv_direct": _cfg("gemv", 32, 64, 1, 8),
    "gemv_pipe_direct": _cfg("gemv", 32, 64, 1, 8, stages=4, pipe=1),
    "gemv_split_last": _cfg("gemv", 32, 64, 2, 8, "last"),
    "gemv_split_launch": _cfg("gemv", 32, 64, 2, 8, "launch"),
    "dot_split_last": _cfg("splitk", 32, 64, 2, 4, "last"),
    "swapab_split_last": _cfg("swapab", 64, 64, 2, 4, "last"),
}


@pytest.mark.parametrize("path", sorted(PATHS))
def test_each_path_is_accepted_by_the_harness_over_the_cpu_sweep(path):
    from kernelsearch.harness import evaluate
    from kernelsearch.specs import SPECS

    v = evaluate("rmsnorm_linear", TEMPLATE, params=PATHS[path], device="cpu", time_it=False)
    assert v.accepted, f"{v.guard}: {v.reason}"
    sweep = SPECS["rmsnorm_linear"].shapes("cpu")
    assert len(v.shapes) == len(sweep) + 1 and all(s.status == "ok" for s in v.shapes)
    assert any(s.dtype == "bfloat16" for s in v.shapes)
    if PATHS[path]["REDUCE"] == "last" and PATHS[path]["SPLIT_K"] > 1:
        # the arrival counters are a persistent workspace the harness checks is left zeroed
        assert any(b.startswith("p") for s in v.shapes if s.plan for b in s.plan["buffers"])


_AGREE_CHILD = r"""
import json, os
assert os.environ.get("TRITON_INTERPRET") == "1"
import torch
from kernelsearch.kernels import rmsnorm_linear as T
from kernelsearch.specs import SPECS

spec = SPECS["rmsnorm_linear"]
gen = torch.Generator().manual_seed(13)
out = {}
for variant, bn in (("gemv", 32), ("splitk", 32), ("swapab", 64)):
    for m, k, n in ((1, 300, 40), (5, 193, 24)):
        inputs = spec.make_inputs({"M": m, "K": k, "N": n}, torch.float32, "cpu", gen, "huge")
        args = (inputs["x"], inputs["norm_weight"], inputs["weight"], inputs["eps"])
        ref = spec.reference(inputs)["out"]
        res = {}
        runs = [(1, "last", 0), (4, "last", 0), (4, "launch", 0)]
        if variant == "gemv":
            runs += [(1, "last", 1), (4, "last", 1)]  # the pipelined K loop, direct and split
        for sk, red, pipe in runs:
            o = torch.full((m, n), float("nan"))
            T.launch(*args, o, variant=variant, BLOCK_M=8 if variant == "gemv" else 32, BLOCK_N=bn,
                     BLOCK_K=64, SPLIT_K=sk, PIPE=pipe, num_warps=8, num_stages=4 if pipe else 3,
                     REDUCE=red)
            res[f"{sk}{red}" + ("pipe" if pipe else "")] = o
        direct = res.pop("1last")
        rel = {key: ((o - direct).norm() / direct.norm()).item() for key, o in res.items()}
        rel["direct_vs_fp64"] = ((direct.double() - ref).norm() / ref.norm()).item()
        out[f"{variant} M{m} K{k} N{n}"] = rel
print(json.dumps({"rel": out, "counters_zero": int(T._counters["cpu"].abs().sum()) == 0}))
"""


def test_split_k_and_one_split_results_agree():
    """Each split sees a part of K: its sums of squares must be combined before the 1/rms scale
    (a split scaling by its own partial rms, or by a wrong split's, misses by far more than
    1e-5); fp32, 1e3-scaled x, odd K over 4 splits of 64-wide steps, M 1 and 5 (odd N)."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", _AGREE_CHILD], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    assert doc["counters_zero"], "the last-arriving programs left arrival counters non-zero"
    assert len(doc["rel"]) == 6  # gemv, splitk, swapab at M 1 and 5
    for case, rel in doc["rel"].items():
        assert rel["direct_vs_fp64"] < 1e-5, (case, rel)
        assert rel["4last"] < 1e-5 and rel["4launch"] < 1e-5, (case, rel)
        if case.startswith("gemv"):
            assert rel["1lastpipe"] < 1e-5 and rel["4lastpipe"] < 1e-5, (case, rel)


def test_configs_are_listed_in_the_order_the_grid_strategy_walks_them():
    from kernelsearch.proposers import allowed_from_configs, domain, key

    mod = _template()
    assert len(mod.CONFIGS) == 17, "a config failed _valid"
    walk = domain(mod.SPACE, allowed_from_configs(mod.CONFIGS))
    assert [key(p) for p in walk] == [key(p) for p in mod.CONFIGS]
    assert sum(p["variant"] == "gemv" for p in mod.CONFIGS) == 6
    assert sum(p["PIPE"] for p in mod.CONFIGS) == 2
    assert all(p["variant"] == "gemv" for p in mod.CONFIGS if p["PIPE"])


def test_pipe_is_a_gemv_option_bounded_by_shared_memory():
    mod = _template()
    p1 = next(p for p in mod.CONFIGS if p["PIPE"])
    assert mod._valid(p1)
    assert not mod._valid(dict(mod.CONFIGS[-1], PIPE=1)), "splitk pipelines its tl.dot loop itself"
    # (16 weight rows + 8 rows of x + norm_weight) x 1024 x 2 bytes x 5 buffers = 250 KB > 220
    # KB; 4 buffers fit (200 KB), which the PIPE=0 rule (the tl.dot's 5 full stages) refuses
    assert not mod._valid(dict(p1, BLOCK_N=16, BLOCK_K=1024, num_warps=8, num_stages=6))
    assert mod._valid(dict(p1, BLOCK_N=16, BLOCK_K=1024, num_warps=8, num_stages=5))


def test_launch_pipelines_the_gemv_loop_only_with_pipe(monkeypatch):
    """The interpreter ignores tl.range's num_stages, so on the CPU only the launcher's choice
    can be seen: PIPE=1 asks the K loop for num_stages, PIPE=0 for 1 (the register loop)."""
    import torch

    mod = _template()
    calls = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kw: calls.append(kw)

    monkeypatch.setattr(mod, "_gemv_kernel", Recorder())
    x, g, w = torch.zeros(1, 1024), torch.ones(1024), torch.zeros(24, 1024)
    for pipe in (0, 1):
        mod.launch(x, g, w, 1e-6, torch.empty(1, 24), variant="gemv", BLOCK_N=8, BLOCK_K=512,
                   PIPE=pipe, num_warps=4, num_stages=4)
    assert [c["LOOP_STAGES"] for c in calls] == [1, 4]
    assert all(c["num_stages"] == 4 for c in calls)


@pytest.mark.parametrize("budget", [8])
def test_the_bench_default_budget_measures_the_first_gemv_and_the_pipelined_ones(budget):
    """bench/issue13_gpu.sh's search mode takes 8 evaluations per kernel: the grid's evenly
    spread sample must reach G1 and both PIPE=1 configs, not only the register-loading ones
    (6 did while the batch-32 block had no swapab configs)."""
    from kernelsearch.proposers import REGISTRY, allowed_from_configs, key

    mod = _template()
    seen: list[dict] = []

    def evaluate(points):
        seen.extend(points)
        return [1.0] * len(points)

    REGISTRY["grid"](mod.SPACE, evaluate, budget, random.Random(0),
                     allowed=allowed_from_configs(mod.CONFIGS))
    keys = [key(p) for p in seen]
    assert key(mod.CONFIGS[0]) in keys
    assert sum(p["PIPE"] for p in seen) == 2, seen
    assert sum(p["variant"] in ("splitk", "swapab") for p in seen) >= 2, seen


def test_the_first_config_is_the_batch_1_gemv_and_the_middle_one_a_batch_32_dot():
    configs = _template().CONFIGS
    assert configs[0]["variant"] == "gemv" and configs[0]["SPLIT_K"] == 1
    mid = configs[len(configs) // 2]
    assert mid["variant"] in ("splitk", "swapab") and mid["BLOCK_M"] >= 32


_PTX_CHILD = r"""
import json, re
from kernelsearch.kernels import rmsnorm_linear as L
from tests.sm90 import compile_ptx, ptxas_usage as ptxas

def ptx(fn, consts, warps, stages):
    names = ["x_ptr", "g_ptr", "w_ptr", "ws_ptr", "ss_ptr", "c_ptr", "cnt_ptr", "M", "N", "K",
             "split_steps", "eps", "s_xm", "s_xk", "s_gk", "s_wn", "s_wk", "s_cm", "s_cn"]
    types = ["*bf16", "*bf16", "*bf16", "*fp32", "*fp32", "*bf16", "*i32"] + ["i32"] * 4 + ["fp32"] + ["i32"] * 7
    consts = dict(consts, s_xk=1, s_gk=1, s_wk=1, s_cn=1)
    # what the launcher specializes at the decode shapes: pointers, N, K and row strides % 16
    return compile_ptx(fn, dict(zip(names, types)), consts, ("x_ptr", "g_ptr", "w_ptr", "ws_ptr", "ss_ptr",
                       "c_ptr", "cnt_ptr", "N", "K", "s_xm", "s_wn", "s_cm"), warps, stages)

ef_v4 = r"ld\.global[\w.:]*evict_first[\w.:]*\.v4\.b32"
ef_all = r"ld\.global[\w.:]*evict_first[\w.:]*"
rows = []
# Every gemv config at batch 1 as the launcher compiles it, and D2 at batch 32.
for p in L.CONFIGS:
    split = p["SPLIT_K"] > 1
    c = dict(EVEN_K=True, DIRECT=not split, LAST_REDUCES=split and p["REDUCE"] == "last",
             SPLITS=p["SPLIT_K"], BLOCK_N=p["BLOCK_N"], BLOCK_K=p["BLOCK_K"])
    if p["variant"] == "gemv":
        c.update(BLOCK_M=1, LOOP_STAGES=p["num_stages"] if p["PIPE"] else 1,
                 SQ_R=max(1, min(8, p["BLOCK_K"] // (32 * p["num_warps"]))))
        fn = L._gemv_kernel
    elif (p["BLOCK_N"] == 32 and p["SPLIT_K"] == 4 and p["BLOCK_K"] == 256) or p["variant"] == "swapab":
        c.update(BLOCK_M=32, UPCAST=False, DOT_PRECISION="tf32", RED_M=32,
                 SWAP=p["variant"] == "swapab")
        fn = L._splitk_kernel
    else:
        continue
    text, shared = ptx(fn, c, p["num_warps"], p["num_stages"])
    regs, spills = ptxas(text)
    rows.append({
        "params": p, "regs": regs, "spills": spills, "shared": shared,
        "v4": len(re.findall(ef_v4, text)), "ef": len(re.findall(ef_all, text)),
        "b16": len(re.findall(r"ld\.global[\w.:]*\.b16\b", text)),
        "cp16": len(re.findall(r"cp\.async\.cg\.shared\.global[^;]*0x10", text)),
        "cp_any": len(re.findall(r"cp\.async\.c[ag]\.shared\.global", text)),
        # the pipelined gemv's weight copies carry an L2 evict_first policy (x and norm_weight
        # copies carry none and may be narrower: BLOCK_K / (32 x warps) values a thread)
        "weight_cp16": len(re.findall(r"cp\.async\.cg\.shared\.global\.L2::cache_hint[^;]*0x10", text)),
        "weight_cp_narrow": len(re.findall(r"cp\.async[.\w]*\.L2::cache_hint(?![^;]*0x10)[^;]*;", text)),
        "evict_first_policy": "createpolicy.fractional.L2::evict_first" in text,
        "wgmma": len(re.findall(r"wgmma\.mma_async", text))})
print(json.dumps(rows))
"""


def test_weight_loads_are_16_byte_vectors_in_the_sm90_ptx_and_nothing_spills():
    """As the linear template's test: a split offset the compiler cannot prove aligned would make
    the weight loads 2 bytes wide. PIPE=0 gemv: evict_first ld.global.v4 and no cp.async (the
    register-loading loop, unchanged); PIPE=1 gemv: the weight through 16-byte cp.async under
    an L2 evict_first policy, into the shared memory _valid budgets; the tl.dot split-K (D2):
    16-byte cp.async. ptxas: no spills. Compiled for sm_90 here, no GPU needed."""
    rows = run_ptx_child(_PTX_CHILD)
    configs = _template().CONFIGS
    assert len(rows) == sum(p["variant"] in ("gemv", "swapab") for p in configs) + 1, rows
    assert sum(c["params"]["PIPE"] for c in rows) == 2
    for c in rows:
        p = c["params"]
        assert c["spills"] == 0 and c["regs"] is not None, (p, c)
        if p["variant"] == "swapab":  # the weight as wgmma's operand through 16-byte cp.async
            # (norm_weight, BLOCK_K values over 128 threads, may go one 2-byte value a thread)
            assert c["cp16"] >= 8 and c["b16"] <= 1 and c["wgmma"] > 0, (p, c)
            if CP_ASYNC_KEEPS_L2_POLICY:
                assert c["weight_cp16"] >= 4 and c["evict_first_policy"], (p, c)
        elif p["variant"] == "splitk":
            assert c["cp16"] >= 8 and c["b16"] == 0, (p, c)
        elif not p["PIPE"]:
            # every evict_first (weight) load 16 bytes; x and norm_weight may be narrower (G5:
            # BLOCK_K 256 over 256 threads, one value a thread)
            assert c["v4"] >= 2 and c["ef"] == c["v4"] and c["cp_any"] == 0, (p, c)
            if p["BLOCK_K"] >= 1024:
                assert c["b16"] == 0, (p, c)
        else:  # the pipelined loop streams the weight through shared memory
            assert c["cp16"] >= 4 and c["weight_cp_narrow"] == 0 and c["ef"] == 0, (p, c)
            if CP_ASYNC_KEEPS_L2_POLICY:
                assert c["weight_cp16"] >= 4 and c["evict_first_policy"], (p, c)
            # num_stages - 1 buffers of the weight, x and norm_weight tiles (batch 1)
            want = (p["BLOCK_N"] + 2) * p["BLOCK_K"] * 2 * (p["num_stages"] - 1)
            assert want <= c["shared"] <= want + 1024, (p, c)
