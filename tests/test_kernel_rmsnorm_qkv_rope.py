"""The rmsnorm_qkv_rope template (RMSNorm + q|k|v + RoPE + the KV-cache write in one launch): the
trusted harness accepts its configs over the spec's CPU sweep (Triton interpreter), and rejects
the template changed the ways a wrong kernel would be, each by the guard that should catch it."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.sm90 import run_ptx_child
from tests.template_edits import evaluate_edited

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = ROOT / "kernelsearch" / "kernels" / "rmsnorm_qkv_rope.py"


def _p(bn, bk, pipe=0, warps=4, stages=2, bm=8):
    return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "PIPE": pipe, "num_warps": warps,
            "num_stages": stages}


# The CPU sweep: K 40..100 (a ragged last step), D 8..34 (a head of 17 pairs: pairs that straddle
# two heads in one program), batch 1..9 (two row blocks), bf16; tiles of 2, 4 and 16 pairs
HARNESS_CASES = {
    "first_config": None,            # CONFIGS[0]
    "pipelined_16_rows": _p(16, 64, pipe=1, stages=3),
    "one_row_of_x": _p(4, 64, bm=1),
    "two_rows_of_x_32_rows": _p(32, 64, bm=2),
}


@pytest.mark.parametrize("case", sorted(HARNESS_CASES))
def test_the_harness_accepts_the_config_over_the_cpu_sweep(case):
    from kernelsearch.harness import evaluate
    from kernelsearch.kernels import rmsnorm_qkv_rope
    from kernelsearch.specs import SPECS

    params = HARNESS_CASES[case] or rmsnorm_qkv_rope.CONFIGS[0]
    v = evaluate("rmsnorm_qkv_rope", TEMPLATE, params=params, device="cpu", time_it=False)
    assert v.accepted, f"{v.guard}: {v.reason}"
    assert len(v.shapes) == len(SPECS["rmsnorm_qkv_rope"].shapes("cpu")) + 1  # + one drawn at random
    assert all(s.status == "ok" for s in v.shapes), [(s.shape, s.status) for s in v.shapes]


# (what is changed, the replacement, the guard that must reject it, words in its reason)
HACKS = {
    # k written into the cache without RoPE
    "k_not_rotated": ("    tl.store(k_ptr + slot, lo_r.to(ty), mask=k_mask)\n    tl.store(k_ptr + slot + HALF, hi_r.to(ty), mask=k_mask)\n",
                      "    tl.store(k_ptr + slot, lo.to(ty), mask=k_mask)\n    tl.store(k_ptr + slot + HALF, hi.to(ty), mask=k_mask)\n",
                      "correctness", ["k_cache"]),
    # half of each v row never written: the harness's poison is still there
    "v_half_unwritten": ("    tl.store(v_ptr + slot + HALF, hi_r.to(ty), mask=v_mask)\n", "", "unwritten_output", ["v_cache"]),
    # rotate_half's sign dropped
    "sin_sign": ("lo * c_lo - hi * s_lo", "lo * c_lo + hi * s_lo", "correctness", ["q_out"]),
    # the two halves of a pair swapped in the tile
    "halves_swapped": ("row = (pair // HALF) * D + pair % HALF + (t % 2) * HALF",
                       "row = (pair // HALF) * D + pair % HALF + (1 - t % 2) * HALF", "correctness", []),
    # a hard-coded eps
    "fixed_eps": ("inv = 1.0 / tl.sqrt(tl.sum(sq1, axis=0) / K + eps)",
                  "inv = 1.0 / tl.sqrt(tl.sum(sq1, axis=0) / K + 1e-6)", "correctness", []),
    # the cache slot taken as 0 whatever the position: rows the op must not touch change
    "slot_ignores_position": ("tl.where(slot_ok, pos, 0)[:, None]", "tl.where(slot_ok, 0, 0)[:, None]",
                              "inout_mutated", ["k_cache"]),
}


@pytest.mark.parametrize("hack", sorted(HACKS))
def test_the_harness_rejects_the_template_changed_into_a_wrong_kernel(hack, tmp_path):
    old, new, guard, words = HACKS[hack]
    v = evaluate_edited("rmsnorm_qkv_rope", TEMPLATE, old, new, tmp_path, name=hack, params=_p(8, 64, bm=1),
                        shape={"B": 1, "K": 64, "Hq": 4, "Hkv": 2, "D": 16, "S": 8})
    assert not v.accepted and v.guard == guard, f"{v.guard}: {v.reason}"
    for w in words:
        assert w in v.reason, v.reason


def test_configs_are_valid_points_of_the_space():
    from kernelsearch.kernels import rmsnorm_qkv_rope as t

    for p in t.CONFIGS:
        assert set(p) == set(t.SPACE) and all(p[k] in t.SPACE[k] for k in p) and t._valid(p), p
        assert p["BLOCK_N"] % 2 == 0   # whole RoPE pairs


_PTX_CHILD = r"""
import json, re
from kernelsearch.kernels import rmsnorm_qkv_rope as Q
from tests.sm90 import compile_ptx, ptxas_usage

names = ["x_ptr", "g_ptr", "w_ptr", "cos_ptr", "sin_ptr", "pos_ptr", "k_ptr", "v_ptr", "q_ptr",
         "M", "K", "Hq", "Hkv", "S", "D", "HALF", "n_pairs", "eps"]
types = ["*bf16"] * 5 + ["*i64"] + ["*bf16"] * 3 + ["i32"] * 8 + ["fp32"]
rows = []
for p in Q.CONFIGS:   # batch 1, as the launcher compiles each config at Llama-3-8B's q|k|v
    consts = dict(BLOCK_M=1, BLOCK_N=p["BLOCK_N"], BLOCK_K=p["BLOCK_K"], EVEN_K=True,
                  LOOP_STAGES=p["num_stages"] if p["PIPE"] else 1,
                  SQ_R=max(1, min(8, p["BLOCK_K"] // (32 * p["num_warps"]))))
    # what the launcher specializes at the decode shapes: pointers, K, D and n_pairs % 16
    text, _ = compile_ptx(Q._qkv_rope_kernel, dict(zip(names, types)), consts, names[:9] + ["K", "D", "n_pairs"],
                          p["num_warps"], p["num_stages"])
    regs, spills = ptxas_usage(text)
    rows.append({"params": p, "regs": regs, "spills": spills,
                 "v4": len(re.findall(r"ld\.global[\w.:]*evict_first[\w.:]*\.v4\.b32", text)),
                 "ef": len(re.findall(r"ld\.global[\w.:]*evict_first[\w.:]*", text)),
                 "cp16": len(re.findall(r"cp\.async\.cg\.shared\.global[^;]*0x10", text)),
                 "weight_cp_narrow": len(re.findall(r"cp\.async[.\w]*\.L2::cache_hint(?![^;]*0x10)[^;]*;", text)),
                 "cp_any": len(re.findall(r"cp\.async\.c[ag]\.shared\.global", text))})
print(json.dumps(rows))
"""


def test_weight_loads_are_16_byte_vectors_in_the_sm90_ptx_and_nothing_spills():
    """The pair-interleaved tile must not cost the weight stream anything: every config compiled
    for sm_90 here (no GPU needed) loads the weight in 16-byte vectors (PIPE=0: evict_first
    ld.global.v4; PIPE=1: 16-byte cp.async, none narrower) and spills nothing."""
    from kernelsearch.kernels import rmsnorm_qkv_rope

    rows = run_ptx_child(_PTX_CHILD)
    assert len(rows) == len(rmsnorm_qkv_rope.CONFIGS)
    for c in rows:
        p = c["params"]
        assert c["spills"] == 0 and c["regs"] is not None and c["regs"] <= 128, c
        if p["PIPE"]:
            assert c["cp16"] >= 4 and c["weight_cp_narrow"] == 0 and c["ef"] == 0, c
        else:
            assert c["v4"] >= 2 and c["ef"] == c["v4"] and c["cp_any"] == 0, c
