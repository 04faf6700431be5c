"""The rmsnorm_gate_up_swiglu template: accepted by the trusted harness over the CPU sweep in each
reduction path (Triton interpreter), split-K and direct paths agree, its CONFIGS are walked in
list order, and its weight loads are 16-byte vectors in the sm_90 PTX."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KERNEL = "rmsnorm_gate_up_swiglu"
TEMPLATE = ROOT / "kernelsearch" / "kernels" / f"{KERNEL}.py"


def _template():
    from kernelsearch.kernels import rmsnorm_gate_up_swiglu  # defines kernels only: no launch

    return rmsnorm_gate_up_swiglu


def _cfg(variant, bm, bn, bk, sk, warps=4, stages=3, reduce="last"):
    return {"variant": variant, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": sk,
            "num_warps": warps, "num_stages": stages, "REDUCE": reduce}


def test_configs_are_listed_in_the_order_the_grid_strategy_walks_them():
    from kernelsearch.proposers import allowed_from_configs, domain, key

    mod = _template()
    walk = domain(mod.SPACE, allowed_from_configs(mod.CONFIGS))
    assert [key(p) for p in walk] == [key(p) for p in mod.CONFIGS]


@pytest.mark.parametrize("budget", [2, 3, 4, 5, 6, 7, 8])
def test_a_small_grid_search_tries_batch_1_and_batch_32_decode_configs(budget):
    from kernelsearch.proposers import REGISTRY, allowed_from_configs

    mod = _template()
    seen: list[dict] = []

    def evaluate(points):
        seen.extend(points)
        return [1.0] * len(points)

    REGISTRY["grid"](mod.SPACE, evaluate, budget, random.Random(0),
                     allowed=allowed_from_configs(mod.CONFIGS))
    assert len(seen) == budget
    n1 = sum(p["variant"] == "gemv" for p in seen)
    n32 = sum(p["variant"] == "splitk" and p["BLOCK_M"] >= 32 for p in seen)
    assert n1 >= 1 and n32 >= 1, seen
    if budget >= 6:
        assert n1 >= 3 and n32 >= 3, seen


def test_first_config_is_a_batch_1_gemv_and_the_middle_one_a_batch_32_dot():
    configs = _template().CONFIGS
    assert configs[0]["variant"] == "gemv"
    mid = configs[len(configs) // 2]
    assert mid["variant"] == "splitk" and mid["BLOCK_M"] >= 32


def test_gemv_configs_keep_both_accumulators_within_64_registers_a_thread():
    for p in _template().CONFIGS:
        if p["variant"] == "gemv":
            assert 2 * p["BLOCK_N"] * p["BLOCK_K"] <= 2048 * p["num_warps"], p
            assert p["BLOCK_K"] >= 64, p  # 16-byte bf16 loads along K


# Small tiles, few programs: the interpreter's time grows with the padded tile and the number of
# programs, not with the shape. BLOCK_N 16: I of the sweep (12..100) mostly not a multiple of it
# (the wrap within each half). Each split config splits K at every shape of the CPU sweep
# (K 40..128 into 2-3 ranges of 32 or 64: the test below holds it).
HARNESS_CASES = {
    "gemv_direct": _cfg("gemv", 8, 16, 64, 1, warps=8),
    "gemv_split_last": _cfg("gemv", 8, 16, 32, 3, reduce="last"),
    "gemv_split_launch": _cfg("gemv", 8, 16, 32, 2, reduce="launch"),
    "dot_direct": _cfg("splitk", 32, 16, 64, 1),
    "dot_split_last": _cfg("splitk", 32, 16, 32, 3, reduce="last"),
}


@pytest.mark.parametrize("case", list(HARNESS_CASES))
def test_template_is_accepted_by_the_harness_over_the_cpu_sweep(case):
    from kernelsearch.harness import evaluate
    from kernelsearch.specs import SPECS

    params = HARNESS_CASES[case]
    v = evaluate(KERNEL, TEMPLATE, params=params, device="cpu", time_it=False)
    assert v.accepted, f"{case}: {v.guard}: {v.reason}"
    assert v.guard is None and v.params == params
    sweep = SPECS[KERNEL].shapes("cpu")
    assert len(v.shapes) == len(sweep) + 1  # the sweep and one shape drawn at random
    assert all(s.status == "ok" for s in v.shapes), [(s.shape, s.status) for s in v.shapes]
    assert any(s.dtype == "bfloat16" for s in v.shapes)


def test_split_configs_split_every_shape_of_the_cpu_sweep():
    """Else the harness cases above would check the direct path under a split config's name."""
    from kernelsearch.specs import SPECS

    def cdiv(a, b):
        return -(-a // b)

    for case, p in HARNESS_CASES.items():
        for shape in SPECS[KERNEL].shapes("cpu"):
            k = shape["K"]
            k_per_split = cdiv(cdiv(k, p["SPLIT_K"]), p["BLOCK_K"]) * p["BLOCK_K"]  # as launch()
            splits = cdiv(k, k_per_split)
            assert (splits > 1) == (p["SPLIT_K"] > 1), (case, shape, splits)


_AGREE_CHILD = r"""
import json, os
assert os.environ.get("TRITON_INTERPRET") == "1"
import torch
from kernelsearch.kernels import rmsnorm_gate_up_swiglu as T

def cfg(variant, bm, bn, bk, sk, reduce="last", warps=4):
    return dict(variant=variant, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=sk, REDUCE=reduce,
                num_warps=warps, num_stages=3)

g = torch.Generator().manual_seed(7)
report = []
# (M, K, I): I not a multiple of BLOCK_N, K not a multiple of BLOCK_K, rows of very different
# scales (the 1/rms of each row must be its own)
for (m, k, i) in [(3, 200, 37), (20, 97, 21)]:
    x = torch.randn(m, k, generator=g) * torch.logspace(-2, 2, m)[:, None]
    nw = 1.0 + 0.5 * torch.randn(k, generator=g)
    w = torch.randn(2 * i, k, generator=g) / k ** 0.5
    eps = 1e-5
    def run(p):
        out = torch.full((m, i), float("nan"))
        T.launch(x, nw, w, eps, out, **p)
        return out
    pairs = [
        ("gemv", cfg("gemv", 8, 4, 64, 1), [cfg("gemv", 8, 4, 32, 4, "last"),
                                             cfg("gemv", 8, 4, 32, 4, "launch")]),
        ("splitk", cfg("splitk", 32, 16, 64, 1), [cfg("splitk", 32, 16, 32, 3, "last"),
                                                   cfg("splitk", 32, 16, 32, 3, "launch")]),
    ]
    for name, direct, splits in pairs:
        ref = run(direct)
        for p in splits:
            out = run(p)
            rel = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
            report.append({"shape": [m, k, i], "variant": name, "reduce": p["REDUCE"],
                           "finite": bool(torch.isfinite(out).all() and torch.isfinite(ref).all()),
                           "rel": rel})
print(json.dumps({"cases": report,
                  "counters_zero": all(int(c.abs().sum()) == 0 for c in T._counters.values())}))
"""


def test_split_k_and_direct_paths_agree_and_counters_return_to_zero():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", _AGREE_CHILD], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(doc["cases"]) == 8
    for c in doc["cases"]:
        # fp32 throughout: only the order of the sums differs
        assert c["finite"] and c["rel"] < 1e-5, c
    assert doc["counters_zero"], "the last-arriving programs must set their counters back to 0"


_PTX_CHILD = r"""
import json, re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernelsearch.kernels import rmsnorm_gate_up_swiglu as T

NAMES = ["x_ptr", "nw_ptr", "w_ptr", "ws_ptr", "ss_ptr", "c_ptr", "cnt_ptr", "M", "I", "K",
         "split_steps", "eps", "s_xm", "s_xk", "s_nk", "s_wn", "s_wk", "s_cm", "s_cn"]
TYPES = ["*bf16", "*bf16", "*bf16", "*fp32", "*fp32", "*bf16", "*i32", "i32", "i32", "i32",
         "i32", "fp32"] + ["i32"] * 7

def ptx(fn, consts, warps, stages):
    sig = dict(zip(NAMES, TYPES))
    consts = dict(consts, s_xk=1, s_nk=1, s_wk=1, s_cn=1)
    sig.update({k: "constexpr" for k in consts})
    # what the launcher specializes at the decode shapes: pointers, I, K and row strides % 16
    div = [NAMES.index(n) for n in ("x_ptr", "nw_ptr", "w_ptr", "ws_ptr", "ss_ptr", "c_ptr",
                                      "cnt_ptr", "I", "K", "s_xm", "s_wn", "s_cm")]
    src = ASTSource(fn=fn, signature=sig, constexprs=consts,
                    attrs={(i,): [["tt.divisibility", 16]] for i in div})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": warps, "num_stages": stages})
    return k.asm["ptx"]

# split into 2 (the runtime split offset) with the last-arriving reduction: the hardest case
common = dict(EVEN_K=True, DIRECT=False, LAST_REDUCES=True, SPLITS=2)
out = {}
for name, bn, bk, warps in [("G1", 4, 1024, 4), ("G3", 8, 512, 4)]:
    p = ptx(T._gemv_kernel, dict(common, BLOCK_M=1, BLOCK_N=bn, BLOCK_K=bk), warps, 3)
    out[name] = {"v4_evict_first": len(re.findall(r"ld\.global[\w.:]*evict_first[\w.:]*\.v4\.b32", p)),
                 "b16": len(re.findall(r"ld\.global[\w.:]*\.b16\b", p)),
                 "expected_v4": 2 * bn * bk * 2 // 16 // (32 * warps)}
p = ptx(T._splitk_kernel, dict(common, BLOCK_M=32, BLOCK_N=16, BLOCK_K=256, UPCAST=False,
                               DOT_PRECISION="tf32", RED_M=32), 4, 3)
out["D1"] = {"cp16_evict": len(re.findall(r"cp\.async\.cg\.shared\.global\.L2::cache_hint[^;]*0x10", p)),
             "cp16": len(re.findall(r"cp\.async\.cg\.shared\.global[^;]*0x10", p)),
             "b16": len(re.findall(r"ld\.global[\w.:]*\.b16\b", p)),
             "mma": len(re.findall(r"mma\.sync", p))}
print(json.dumps(out))
"""


def test_weight_loads_are_16_byte_vectors_in_the_sm90_ptx():
    """As linear's: the runtime split offset must leave the compiler proof that k_lo is a
    multiple of BLOCK_K, and the up rows' offset (I + row) x row stride must stay 16-byte
    aligned; compiled for sm_90 here, no GPU needed (ptxas ships with triton)."""
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(ROOT), TRITON_DEFAULT_FP_FUSION="1")
    proc = subprocess.run([sys.executable, "-c", _PTX_CHILD], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    if proc.returncode != 0 and "ptxas" in proc.stderr and "not found" in proc.stderr.lower():
        pytest.skip("no ptxas in this triton install")
    assert proc.returncode == 0, proc.stderr[-3000:]
    counts = json.loads(proc.stdout.strip().splitlines()[-1])
    for name in ("G1", "G3"):
        # every gate and up weight byte of a step in one 16-byte evict_first load, none narrower
        c = counts[name]
        assert c["v4_evict_first"] == c["expected_v4"] and c["b16"] == 0, (name, c)
    d = counts["D1"]
    # per stage and thread: 8 x 16 B of weight (evict_first), 8 x 16 B of x; 2 stages ahead + 1
    assert d["cp16_evict"] >= 16 and d["cp16"] >= 32 and d["b16"] == 0 and d["mma"] > 0, d


_DISPATCH_CHILD = r"""
import json
import torch
from kernelsearch.specs import SPECS
from tests.tuned_tables import verified_table

spec = SPECS["rmsnorm_gate_up_swiglu"]
shape = {"M": 2, "K": 70, "I": 19}
params = {"variant": "gemv", "BLOCK_M": 8, "BLOCK_N": 16, "BLOCK_K": 32, "SPLIT_K": 3,
          "num_warps": 4, "num_stages": 3, "REDUCE": "last"}
table = verified_table([("rmsnorm_gate_up_swiglu", shape, "float32", params)])
report = {"prepared": table.prepare("cpu"), "err": []}
g = torch.Generator().manual_seed(5)
for _ in range(2):  # the second call finds the counters the first one set back to zero
    inp = spec.make_inputs(shape, torch.float32, "cpu", g, "rows")
    out = table.call("rmsnorm_gate_up_swiglu", inp["x"], inp["norm_weight"], inp["weight"], inp["eps"])
    ref = spec.reference(inp)["out"]
    report["err"].append(((out.double() - ref).norm() / ref.norm()).item())
report["counts"] = {f"{k}:{r}": n for (k, r), n in table.counts.items()}
print(json.dumps(report))
"""


def test_a_verified_split_k_entry_runs_through_the_dispatch_table():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", _DISPATCH_CHILD], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    assert doc["counts"] == {"rmsnorm_gate_up_swiglu:tuned": 2}, doc
    assert doc["prepared"] == 1, doc  # its plan loaded, the arrival counters allocated, before any call
    assert all(e < 1e-5 for e in doc["err"]), doc
