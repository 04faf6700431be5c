"""The rmsnorm_gate_up_swiglu template: accepted by the trusted harness over the CPU sweep in each
reduction path and with the pipelined gemv loop (Triton interpreter), split-K and direct paths
agree, its CONFIGS are walked in list order, its weight loads are 16-byte vectors (PIPE=0) or
16-byte cp.async copies (PIPE=1) in the sm_90 PTX with nothing spilled, and PIPE=0 compiles to
the PTX of a plain range loop."""
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
KERNEL = "rmsnorm_gate_up_swiglu"
TEMPLATE = ROOT / "kernelsearch" / "kernels" / f"{KERNEL}.py"



def _template():
    from kernelsearch.kernels import rmsnorm_gate_up_swiglu  # defines kernels only: no launch

    return rmsnorm_gate_up_swiglu


def _cfg(variant, bm, bn, bk, sk, warps=4, stages=3, reduce="last", pipe=0):
    return {"variant": variant, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": sk,
            "PIPE": pipe, "num_warps": warps, "num_stages": stages, "REDUCE": reduce}


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
    n32 = sum(p["variant"] in ("splitk", "swapab") and p["BLOCK_M"] >= 32 for p in seen)
    assert n1 >= 1 and n32 >= 1, seen
    if budget >= 6:
        assert n1 >= 3 and n32 >= 3, seen


def test_first_config_is_a_batch_1_gemv_and_the_middle_one_a_batch_32_dot():
    configs = _template().CONFIGS
    assert configs[0]["variant"] == "gemv" and not configs[0]["PIPE"]
    mid = configs[len(configs) // 2]
    assert mid["variant"] in ("splitk", "swapab") and mid["BLOCK_M"] >= 32


def test_a_budget_of_8_tries_the_register_gemv_and_two_pipelined_ones_at_batch_1():
    """bench/issue13_gpu.sh's search mode takes 8 points a shape (6 before the swapab block):
    the measured best register-loading gemv (4x512) stays the baseline, next to pipelined
    configs that must beat it."""
    from kernelsearch.proposers import REGISTRY, allowed_from_configs

    mod = _template()
    seen: list[dict] = []
    REGISTRY["grid"](mod.SPACE, lambda pts: seen.extend(pts) or [1.0] * len(pts), 8,
                     random.Random(0), allowed=allowed_from_configs(mod.CONFIGS))
    gemv = [p for p in seen if p["variant"] == "gemv"]
    assert [p["PIPE"] for p in gemv] == [0, 1, 1], gemv
    assert (gemv[0]["BLOCK_N"], gemv[0]["BLOCK_K"], gemv[0]["SPLIT_K"]) == (4, 512, 1)
    assert all(p["num_stages"] >= 3 and p["SPLIT_K"] == 1 for p in gemv[1:]), gemv


def test_pipelined_configs_are_gemv_only_and_fit_their_shared_memory():
    mod = _template()
    piped = [p for p in mod.CONFIGS if p["PIPE"]]
    assert len(piped) >= 2 and all(p["variant"] == "gemv" for p in piped), piped
    for p in piped:
        # num_stages - 1 buffers of gate + up (2 BLOCK_N rows), x (8 rows at most), norm_weight
        smem = (2 * p["BLOCK_N"] + 8 + 1) * p["BLOCK_K"] * 2 * (p["num_stages"] - 1)
        assert p["num_stages"] >= 3 and smem <= 220 * 1024, p
    assert not mod._valid(_cfg("splitk", 32, 16, 256, 1, pipe=1))  # tl.dot pipelines itself
    assert mod._valid(_cfg("gemv", 8, 8, 1024, 1, warps=8, stages=4, pipe=1))  # 150 KB
    assert not mod._valid(_cfg("gemv", 8, 8, 1024, 1, warps=8, stages=6, pipe=1))  # 250 KB


def test_gemv_configs_keep_both_accumulators_within_64_registers_a_thread():
    for p in _template().CONFIGS:
        if p["variant"] == "gemv":
            assert 2 * p["BLOCK_N"] * p["BLOCK_K"] <= 2048 * p["num_warps"], p
            assert p["BLOCK_K"] >= 64, p  # 16-byte bf16 loads along K


def test_launch_pipelines_the_gemv_loop_only_with_pipe(monkeypatch):
    """PIPE=1: the K loop's LOOP_STAGES is num_stages; PIPE=0: 1 (the plain loop's code); the
    kernel itself is recorded here, not run (what it compiles to: the PTX test)."""
    import torch

    mod = _template()
    launched: list[dict] = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kw: launched.append(dict(kw, grid=grid))

    monkeypatch.setattr(mod, "_gemv_kernel", Recorder())
    x, nw, w = torch.randn(1, 64), torch.ones(64), torch.randn(2 * 12, 64)
    out = torch.empty(1, 12)
    for pipe in (0, 1):
        mod.launch(x, nw, w, 1e-5, out, **_cfg("gemv", 8, 4, 32, 1, stages=4, pipe=pipe))
    assert [k["LOOP_STAGES"] for k in launched] == [1, 4]
    assert [k["num_stages"] for k in launched] == [4, 4]
    with pytest.raises(ValueError, match="PIPE"):
        mod.launch(x, nw, w, 1e-5, out, **_cfg("splitk", 32, 16, 32, 1, pipe=1))
    with pytest.raises(ValueError, match="PIPE"):
        mod.launch(x, nw, w, 1e-5, out, **_cfg("gemv", 8, 4, 32, 1, pipe=2))


# Small tiles, few programs: the interpreter's time grows with the padded tile and the number of
# programs, not with the shape. BLOCK_N 16: I of the sweep (12..100) mostly not a multiple of it
# (the wrap within each half). Each split config splits K at every shape of the CPU sweep
# (K 40..128 into 2-3 ranges of 32 or 64: the test below holds it).
HARNESS_CASES = {
    "gemv_direct": _cfg("gemv", 8, 16, 64, 1, warps=8),
    "gemv_split_last": _cfg("gemv", 8, 16, 32, 3, reduce="last"),
    "gemv_split_launch": _cfg("gemv", 8, 16, 32, 2, reduce="launch"),
    "gemv_direct_pipelined": _cfg("gemv", 8, 16, 32, 1, stages=4, pipe=1),
    "gemv_split_last_pipelined": _cfg("gemv", 8, 16, 32, 2, stages=3, reduce="last", pipe=1),
    "dot_direct": _cfg("splitk", 32, 16, 64, 1),
    "dot_split_last": _cfg("splitk", 32, 16, 32, 3, reduce="last"),
    "swapab_split_last": _cfg("swapab", 32, 64, 32, 3, reduce="last"),
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
        ("swapab", cfg("swapab", 32, 64, 64, 1), [cfg("swapab", 32, 64, 32, 3, "last"),
                                                   cfg("swapab", 32, 64, 32, 3, "launch")]),
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
    assert len(doc["cases"]) == 12
    for c in doc["cases"]:
        # fp32 throughout: only the order of the sums differs
        assert c["finite"] and c["rel"] < 1e-5, c
    assert doc["counters_zero"], "the last-arriving programs must set their counters back to 0"


_PTX_CHILD = r"""
import importlib.util, json, os, re, tempfile
from kernelsearch.kernels import rmsnorm_gate_up_swiglu as T
from tests.sm90 import compile_ptx, ptxas_usage as ptxas

NAMES = ["x_ptr", "nw_ptr", "w_ptr", "ws_ptr", "ss_ptr", "c_ptr", "cnt_ptr", "M", "I", "K",
         "split_steps", "eps", "s_xm", "s_xk", "s_nk", "s_wn", "s_wk", "s_cm", "s_cn"]
TYPES = ["*bf16", "*bf16", "*bf16", "*fp32", "*fp32", "*bf16", "*i32", "i32", "i32", "i32",
         "i32", "fp32"] + ["i32"] * 7

def ptx(fn, consts, warps, stages):
    consts = dict(consts, s_xk=1, s_nk=1, s_wk=1, s_cn=1)
    # what the launcher specializes at the decode shapes: pointers, I, K and row strides % 16
    return compile_ptx(fn, dict(zip(NAMES, TYPES)), consts, ("x_ptr", "nw_ptr", "w_ptr", "ws_ptr", "ss_ptr",
                       "c_ptr", "cnt_ptr", "I", "K", "s_xm", "s_wn", "s_cm"), warps, stages)

# the template's gemv with its K loop a plain range loop: what PIPE=0 must compile to
LOOP = "tl.range(k_lo, k_hi, BLOCK_K, num_stages=LOOP_STAGES)"
text = open(T.__file__).read()
assert text.count(LOOP) == 1, "the gemv K loop is no longer the tl.range this test rewrites"
tmp = tempfile.mkdtemp()
path = os.path.join(tmp, "plain_gemv.py")
open(path, "w").write(text.replace(LOOP, "range(k_lo, k_hi, BLOCK_K)"))
spec = importlib.util.spec_from_file_location("plain_gemv", path)
P = importlib.util.module_from_spec(spec)
spec.loader.exec_module(P)

# split into 2 (the runtime split offset) with the last-arriving reduction: the hardest case
split = dict(EVEN_K=True, DIRECT=False, LAST_REDUCES=True, SPLITS=2)
direct = dict(EVEN_K=True, DIRECT=True, LAST_REDUCES=False, SPLITS=1)
out = {}
# (name, BLOCK_N, BLOCK_K, warps, num_stages, PIPE, path)
for name, bn, bk, warps, stages, pipe, c in [("G2", 4, 512, 4, 3, 0, split),
                                             ("G4", 8, 256, 4, 3, 0, split),
                                             ("P1", 4, 512, 4, 4, 1, direct),
                                             ("P3", 4, 256, 4, 6, 1, direct),
                                             ("P1_split", 4, 512, 4, 4, 1, split)]:
    consts = dict(c, BLOCK_M=1, BLOCK_N=bn, BLOCK_K=bk, LOOP_STAGES=stages if pipe else 1)
    p, shared = ptx(T._gemv_kernel, consts, warps, stages)
    regs, spills = ptxas(p)
    per_step = 2 * bn * bk * 2 // 16 // (32 * warps)  # 16-byte gate and up pieces a thread
    out[name] = {"pipe": pipe, "stages": stages, "regs": regs, "spills": spills, "shared": shared,
                 "per_step": per_step, "tile": 2 * bn * bk * 2,
                 "v4_evict_first": len(re.findall(r"ld\.global[\w.:]*evict_first[\w.:]*\.v4\.b32", p)),
                 "b16": len(re.findall(r"ld\.global[\w.:]*\.b16\b", p)),
                 "weight_cp_16": len(re.findall(r"cp\.async\.cg\.shared\.global\.L2::cache_hint[^;]*0x10", p)),
                 "weight_cp_narrow": len(re.findall(r"cp\.async[.\w]*\.L2::cache_hint(?![^;]*0x10)[^;]*;", p)),
                 "cp_async": len(re.findall(r"cp\.async\.c[ag]\.shared\.global", p)),
                 "evict_first_policy": "createpolicy.fractional.L2::evict_first" in p}
same = []
for bm, c in [(1, direct), (1, split), (2, dict(direct, EVEN_K=False))]:
    consts = dict(c, BLOCK_M=bm, BLOCK_N=4, BLOCK_K=512, LOOP_STAGES=1)
    same.append(ptx(T._gemv_kernel, consts, 4, 3)[0] == ptx(P._gemv_kernel, consts, 4, 3)[0])
out["pipe0_is_plain_range"] = same
# the control: the comparison sees a pipelined loop (LOOP_STAGES 3: cp.async buffers)
consts = dict(direct, BLOCK_M=1, BLOCK_N=4, BLOCK_K=512)
out["pipelined_differs"] = (ptx(T._gemv_kernel, dict(consts, LOOP_STAGES=3), 4, 3)[0]
                            != ptx(P._gemv_kernel, dict(consts, LOOP_STAGES=1), 4, 3)[0])
p = ptx(T._splitk_kernel, dict(split, BLOCK_M=32, BLOCK_N=16, BLOCK_K=256, UPCAST=False,
                               DOT_PRECISION="tf32", RED_M=32, SWAP=False), 4, 3)[0]
out["D1"] = {"cp16_evict": len(re.findall(r"cp\.async\.cg\.shared\.global\.L2::cache_hint[^;]*0x10", p)),
             "cp16": len(re.findall(r"cp\.async\.cg\.shared\.global[^;]*0x10", p)),
             "b16": len(re.findall(r"ld\.global[\w.:]*\.b16\b", p)),
             "mma": len(re.findall(r"mma\.sync", p))}
# swapab (the gate and up tiles as the dots' left operands), as CONFIGS has it at batch 32
p = ptx(T._splitk_kernel, dict(direct, BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, UPCAST=False,
                               DOT_PRECISION="tf32", RED_M=32, SWAP=True), 4, 6)[0]
out["W"] = {"cp16_evict": len(re.findall(r"cp\.async\.cg\.shared\.global\.L2::cache_hint[^;]*0x10", p)),
            "cp16": len(re.findall(r"cp\.async\.cg\.shared\.global[^;]*0x10", p)),
            "b16": len(re.findall(r"ld\.global[\w.:]*\.b16\b", p)),
            "wgmma": len(re.findall(r"wgmma\.mma_async", p)),
            "spills": ptxas(p)[1]}
print(json.dumps(out))
"""


def test_weight_loads_are_16_byte_vectors_in_the_sm90_ptx():
    """As linear's: the runtime split offset must leave the compiler proof that k_lo is a
    multiple of BLOCK_K, and the up rows' offset (I + row) x row stride must stay 16-byte
    aligned. PIPE=0: evict_first ld.global.v4, no cp.async; PIPE=1: the weight as 16-byte
    cp.async copies under an L2 evict_first policy (x and norm_weight, from L2, may go narrower),
    nothing spilled, and PIPE=0 compiles to the PTX of a plain range loop (line info off).
    Compiled for sm_90 here, no GPU needed (ptxas ships with triton)."""
    counts = run_ptx_child(_PTX_CHILD, TRITON_DISABLE_LINE_INFO="1")
    assert counts["pipe0_is_plain_range"] == [True, True, True], counts["pipe0_is_plain_range"]
    assert counts["pipelined_differs"]
    for name in ("G2", "G4", "P1", "P3", "P1_split"):
        c = counts[name]
        assert c["spills"] == 0 and c["regs"] is not None, (name, c)
        assert c["b16"] == 0, (name, c)  # no 2-byte weight (or x) loads
        if not c["pipe"]:
            # every gate and up weight byte of a step in one 16-byte evict_first load
            assert c["v4_evict_first"] == c["per_step"] and c["cp_async"] == 0, (name, c)
        else:
            # the weight streams through shared memory: 16-byte copies, num_stages - 1 steps
            # ahead plus the one in the loop, none narrower, none loaded into registers
            copies = c["weight_cp_16"] if CP_ASYNC_KEEPS_L2_POLICY else c["cp_async"]
            assert copies >= c["per_step"] * c["stages"], (name, c)
            assert c["weight_cp_narrow"] == 0 and c["v4_evict_first"] == 0, (name, c)
            if CP_ASYNC_KEEPS_L2_POLICY:
                assert c["evict_first_policy"], (name, c)
            # num_stages - 1 shared-memory buffers of the weight tile (and x, norm_weight)
            assert c["shared"] >= (c["stages"] - 1) * c["tile"], (name, c)
    d = counts["D1"]
    # per stage and thread: 8 x 16 B of weight (evict_first), 8 x 16 B of x; 2 stages ahead + 1
    assert d["cp16"] >= 32 and d["b16"] == 0 and d["mma"] > 0, d
    if CP_ASYNC_KEEPS_L2_POLICY:
        assert d["cp16_evict"] >= 16, d
    w = counts["W"]
    assert w["cp16"] >= 8 and w["b16"] == 0 and w["wgmma"] > 0 and w["spills"] == 0, w
    if CP_ASYNC_KEEPS_L2_POLICY:
        assert w["cp16_evict"] >= 8, w


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
