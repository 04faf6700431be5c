"""The rope_kv_attention template (RoPE + KV-cache write + split-KV decode attention in one
launch): the trusted harness accepts each kind of config over the spec's CPU sweep (Triton
interpreter), and rejects the template changed the ways a wrong kernel would be (the new token
not written, not attended to, k written without RoPE), each by the guard that should catch it."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.template_edits import evaluate_edited

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = ROOT / "kernelsearch" / "kernels" / "rope_kv_attention.py"


def _p(block_s, splits, reduce="launch", warps=4, stages=2):
    return {"BLOCK_S": block_s, "NUM_SPLITS": splits, "num_warps": warps, "num_stages": stages,
            "REDUCE": reduce}


# The CPU sweep's S (1..130) over one split, a few, and more splits than chunks; both reduces.
HARNESS_CASES = {
    "one_split_launch": _p(32, 1),
    "four_splits_last": _p(16, 4, "last"),
    "many_splits_last": _p(16, 64, "last"),
    "many_splits_launch": _p(16, 64),
}


@pytest.mark.parametrize("case", sorted(HARNESS_CASES))
def test_the_harness_accepts_the_config_over_the_cpu_sweep(case):
    from kernelsearch.harness import evaluate
    from kernelsearch.specs import SPECS

    v = evaluate("rope_kv_attention", TEMPLATE, params=HARNESS_CASES[case], device="cpu", time_it=False)
    assert v.accepted, f"{v.guard}: {v.reason}"
    assert len(v.shapes) == len(SPECS["rope_kv_attention"].shapes("cpu")) + 1  # + one drawn at random
    assert all(s.status == "ok" for s in v.shapes), [(s.shape, s.status) for s in v.shapes]


# (what is changed, the replacement, the guard that must reject it, words in its reason)
HACKS = {
    # the caches never written: their written rows still hold the harness's poison
    "no_cache_write": ("    tl.store(k_ptr + slot + d, k_new.to(ty), mask=write)\n    tl.store(v_ptr + slot + d, v_new, mask=write)\n",
                       "", "unwritten_output", ["k_cache"]),
    # the new token left out of the softmax (attention over slots before it only)
    "new_token_ignored": ("    m_i = tl.where(owns, s_new, -float(\"inf\"))\n    l_i = tl.where(owns, 1.0, 0.0)",
                          "    m_i = tl.where(owns & False, s_new, -float(\"inf\"))\n    l_i = tl.where(owns & False, 1.0, 0.0)",
                          "correctness", ["out"]),
    # k written (and attended to) without RoPE
    "k_not_rotated": ("    k_new = _as_stored(tl.load(k_row + d, mask=d_ok, other=0.0).to(tl.float32) * c\n"
                      "                       + tl.load(k_row + partner, mask=d_ok, other=0.0).to(tl.float32) * sn, ty, RNE_BF16)\n",
                      "    k_new = tl.load(k_row + d, mask=d_ok, other=0.0).to(tl.float32)\n",
                      "correctness", []),
}


@pytest.mark.parametrize("hack", sorted(HACKS))
def test_the_harness_rejects_the_template_changed_into_a_wrong_kernel(hack, tmp_path):
    old, new, guard, words = HACKS[hack]
    v = evaluate_edited("rope_kv_attention", TEMPLATE, old, new, tmp_path, name=hack, params=_p(16, 4, "last"),
                        shape={"B": 2, "Hq": 4, "Hkv": 2, "D": 16, "S": 20})
    assert not v.accepted and v.guard == guard, f"{v.guard}: {v.reason}"
    for w in words:
        assert w in v.reason, v.reason


def test_configs_are_the_decode_attention_space_and_valid():
    from kernelsearch.kernels import decode_attention, rope_kv_attention

    assert rope_kv_attention.SPACE == decode_attention.SPACE
    assert rope_kv_attention.CONFIGS == decode_attention.CONFIGS


def test_timed_inputs_read_the_whole_cache_and_the_checked_ones_a_random_prefix():
    from kernelsearch.specs import SPECS

    spec = SPECS["rope_kv_attention"]
    shape = {"B": 4, "Hq": 4, "Hkv": 2, "D": 16, "S": 50}
    g = torch.Generator().manual_seed(5)
    drawn = spec.make_inputs(shape, torch.float32, "cpu", g, "normal")
    assert int(drawn["positions"].max()) == 49 and 0 <= int(drawn["positions"].min()) < 49
    short = spec.make_inputs(shape, torch.float32, "cpu", g, "tiny")["positions"]
    assert int(short.max()) < 49   # no sequence at the last slot: positions[0] is read too
    assert spec.timed_inputs(drawn)["positions"].tolist() == [49] * 4


def test_a_compile_still_queued_behind_the_warm_up_is_taken_back_by_the_case_that_needs_it():
    """The executor's compile pool (CUDA) compiles every config of a template at the start; a
    case must not wait for its kernel behind all of them (on the H200 a 288-config template's
    first case waited past its 120 s limit): a queued job is cancelled and the case's own first
    launch compiles it; a job a worker has started is waited for."""
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    from kernelsearch.harness.executor import CompilePool

    pool = CompilePool("/nonexistent")
    pool.pool = ThreadPoolExecutor(1)
    gate = threading.Event()
    running = pool.futures["busy"] = pool.pool.submit(gate.wait, 30)
    queued = pool.futures["queued"] = pool.pool.submit(lambda: True)
    started = time.monotonic()
    pool.wait(["queued"])
    assert time.monotonic() - started < 5 and queued.cancelled()
    threading.Timer(0.3, gate.set).start()
    pool.wait(["busy"])
    assert running.done() and not running.cancelled()
    pool.pool.shutdown()


_PTX_CHILD = r"""
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernelsearch.kernels import rope_kv_attention as T

NAMES = ["qkv_ptr", "cos_ptr", "sin_ptr", "pos_ptr", "k_ptr", "v_ptr", "m_ws", "l_ws", "acc_ws", "out_ptr",
         "cnt_ptr", "Hq", "Hkv", "S", "G", "D", "HALF", "chunk", "splits", "qk_scale"]
TYPES = ["*bf16", "*bf16", "*bf16", "*i64", "*bf16", "*bf16", "*fp32", "*fp32", "*fp32", "*bf16", "*i32"] + \
        ["i32"] * 8 + ["fp32"]
rows = []
for direct, last, block_s, warps, stages in [(True, False, 128, 4, 2), (False, True, 64, 4, 3),
                                             (False, False, 32, 2, 1)]:
    consts = dict(BLOCK_G=16, BLOCK_S=block_s, BLOCK_D=128, UPCAST=False, DOT_PRECISION="tf32",
                  LAST_REDUCES=last, GROUP_P2=4, BLOCK_SPLITS=64, SPLIT_CHUNK=8, RNE_BF16=False, DIRECT=direct)
    sig = dict(zip(NAMES, TYPES))
    sig.update({k: "constexpr" for k in consts})
    k = triton.compile(ASTSource(fn=T._rope_attn_kernel, signature=sig, constexprs=consts),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
    ptx = k.asm["ptx"]
    rows.append({"direct": direct, "last": last, "atomics": "atom." in ptx, "mma": "mma.sync" in ptx or "wgmma" in ptx})
print(json.dumps(rows))
"""


def test_the_kernel_compiles_for_sm90_with_one_split_written_directly_and_atomics_only_for_last():
    """Compiled for the H200 (sm_90) here, without a GPU: the one-split path (no workspace, no
    combine, no counter), the REDUCE="last" path (its arrival counter) and the launch path."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run([sys.executable, "-c", _PTX_CHILD], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    if proc.returncode != 0 and "ptxas" in proc.stderr.lower() and "not found" in proc.stderr.lower():
        pytest.skip("no ptxas for sm_90 in this triton")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [(r["direct"], r["last"], r["atomics"]) for r in rows] == [(True, False, False), (False, True, True),
                                                                      (False, False, False)]
    assert all(r["mma"] for r in rows)   # q . K and p . V on the tensor cores
