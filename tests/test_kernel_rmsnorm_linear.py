"""The rmsnorm_linear template: accepted by the trusted harness (CPU sweep, Triton interpreter)
in each of its paths, split-K and one-split results agree, its configs are listed in the grid
strategy's walk order, and its weight loads compile to 16-byte vectors for sm_90."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = ROOT / "kernelsearch" / "kernels" / "rmsnorm_linear.py"


def _template():
    from kernelsearch.kernels import rmsnorm_linear  # defines kernels only: no launch, no interpreter needed

    return rmsnorm_linear


def _cfg(variant, bn, bk, sk, warps, reduce="last", bm=None, stages=3):
    return {"variant": variant, "BLOCK_M": bm or (8 if variant == "gemv" else 32), "BLOCK_N": bn,
            "BLOCK_K": bk, "SPLIT_K": sk, "num_warps": warps, "num_stages": stages, "REDUCE": reduce}


# One of each path: the GEMV writing `out` directly, the GEMV split over K reduced by the last
# program and by a second kernel, and the tl.dot split-K. Small BLOCK_K so that the CPU
# sweep's K (40..128) takes several steps and splits; 8 warps and BLOCK_N 32 keep the number
# of interpreted programs (and the test's time) small.
PATHS = {
    "gemv_direct": _cfg("gemv", 32, 64, 1, 8),
    "gemv_split_last": _cfg("gemv", 32, 64, 2, 8, "last"),
    "gemv_split_launch": _cfg("gemv", 32, 64, 2, 8, "launch"),
    "dot_split_last": _cfg("splitk", 32, 64, 2, 4, "last"),
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
for variant, bn in (("gemv", 32), ("splitk", 32)):
    for m, k, n in ((1, 300, 40), (5, 193, 24)):
        inputs = spec.make_inputs({"M": m, "K": k, "N": n}, torch.float32, "cpu", gen, "huge")
        args = (inputs["x"], inputs["norm_weight"], inputs["weight"], inputs["eps"])
        ref = spec.reference(inputs)["out"]
        res = {}
        for sk, red in ((1, "last"), (4, "last"), (4, "launch")):
            o = torch.full((m, n), float("nan"))
            T.launch(*args, o, variant=variant, BLOCK_M=8 if variant == "gemv" else 32, BLOCK_N=bn,
                     BLOCK_K=64, SPLIT_K=sk, num_warps=8, num_stages=3, REDUCE=red)
            res[f"{sk}{red}"] = o
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
    assert len(doc["rel"]) == 4
    for case, rel in doc["rel"].items():
        assert rel["direct_vs_fp64"] < 1e-5, (case, rel)
        assert rel["4last"] < 1e-5 and rel["4launch"] < 1e-5, (case, rel)


def test_configs_are_listed_in_the_order_the_grid_strategy_walks_them():
    from kernelsearch.proposers import allowed_from_configs, domain, key

    mod = _template()
    assert len(mod.CONFIGS) == 11, "a config failed _valid"
    walk = domain(mod.SPACE, allowed_from_configs(mod.CONFIGS))
    assert [key(p) for p in walk] == [key(p) for p in mod.CONFIGS]


def test_the_first_config_is_the_batch_1_gemv_and_the_middle_one_a_batch_32_dot():
    configs = _template().CONFIGS
    assert configs[0]["variant"] == "gemv" and configs[0]["SPLIT_K"] == 1
    mid = configs[len(configs) // 2]
    assert mid["variant"] == "splitk" and mid["BLOCK_M"] >= 32


_PTX_CHILD = r"""
import json, re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernelsearch.kernels import rmsnorm_linear as L

def ptx(fn, consts, warps, stages):
    names = ["x_ptr", "g_ptr", "w_ptr", "ws_ptr", "ss_ptr", "c_ptr", "cnt_ptr", "M", "N", "K",
             "split_steps", "eps", "s_xm", "s_xk", "s_gk", "s_wn", "s_wk", "s_cm", "s_cn"]
    types = ["*bf16", "*bf16", "*bf16", "*fp32", "*fp32", "*bf16", "*i32"] + ["i32"] * 4 + ["fp32"] + ["i32"] * 7
    sig = dict(zip(names, types))
    consts = dict(consts, s_xk=1, s_gk=1, s_wk=1, s_cn=1)
    sig.update({k: "constexpr" for k in consts})
    # what the launcher specializes at the decode shapes: pointers, N, K and row strides % 16
    div = [names.index(n) for n in ("x_ptr", "g_ptr", "w_ptr", "ws_ptr", "ss_ptr", "c_ptr", "cnt_ptr",
                                      "N", "K", "s_xm", "s_wn", "s_cm")]
    src = ASTSource(fn=fn, signature=sig, constexprs=consts,
                    attrs={(i,): [["tt.divisibility", 16]] for i in div})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": warps, "num_stages": stages})
    return k.asm["ptx"]

# G1 at batch 1 (one split) and G5-like split 4 with the last-arriving reducer; D2 at batch 32.
g1 = ptx(L._gemv_kernel, dict(EVEN_K=True, DIRECT=True, LAST_REDUCES=False, SPLITS=1, BLOCK_M=1,
                              BLOCK_N=8, BLOCK_K=1024, SQ_R=4), 8, 3)
g4 = ptx(L._gemv_kernel, dict(EVEN_K=True, DIRECT=False, LAST_REDUCES=True, SPLITS=2, BLOCK_M=1,
                              BLOCK_N=16, BLOCK_K=256, SQ_R=2), 4, 3)
d2 = ptx(L._splitk_kernel, dict(EVEN_K=True, DIRECT=False, LAST_REDUCES=True, SPLITS=4, BLOCK_M=32,
                                BLOCK_N=32, BLOCK_K=256, UPCAST=False, DOT_PRECISION="tf32", RED_M=32), 4, 3)
ef_v4 = r"ld\.global[\w.:]*evict_first[\w.:]*\.v4\.b32"
ef_all = r"ld\.global[\w.:]*evict_first[\w.:]*"
print(json.dumps({
    "g1_v4": len(re.findall(ef_v4, g1)), "g1_ef": len(re.findall(ef_all, g1)),
    "g1_b16": len(re.findall(r"ld\.global[\w.:]*\.b16\b", g1)),
    "g4_v4": len(re.findall(ef_v4, g4)), "g4_ef": len(re.findall(ef_all, g4)),
    "d2_cp16": len(re.findall(r"cp\.async\.cg\.shared\.global[^;]*0x10", d2)),
    "d2_b16": len(re.findall(r"ld\.global[\w.:]*\.b16\b", d2))}))
"""


def test_weight_loads_are_16_byte_vectors_in_the_sm90_ptx():
    """As the linear template's test: a split offset the compiler cannot prove aligned would make
    the weight loads 2 bytes wide; compiled for sm_90 here, no GPU needed."""
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(ROOT), TRITON_DEFAULT_FP_FUSION="1")
    proc = subprocess.run([sys.executable, "-c", _PTX_CHILD], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    if proc.returncode != 0 and "ptxas" in proc.stderr and "not found" in proc.stderr.lower():
        pytest.skip("no ptxas in this triton install")
    assert proc.returncode == 0, proc.stderr[-3000:]
    counts = json.loads(proc.stdout.strip().splitlines()[-1])
    assert counts["g1_v4"] >= 2 and counts["g1_ef"] == counts["g1_v4"] and counts["g1_b16"] == 0, counts
    assert counts["g4_v4"] >= 2 and counts["g4_ef"] == counts["g4_v4"], counts
    assert counts["d2_cp16"] >= 8 and counts["d2_b16"] == 0, counts
