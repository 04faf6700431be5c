"""bench/pdl_probe.py's persistent step (one launch whose programs claim tiles in dependency order
and wait on per-phase counters) and its chains whose attention also reads the next weight into
L2. The GPU times them; these check on the CPU (Triton's interpreter, then sm_90 code from
Triton's own compiler) what would otherwise cost a device run to find out: that they compute
the plain chain's bits, that the persistent step leaves its counters zeroed, counts every
phase's tiles, gives up instead of hanging when a wait cannot be met, and compiles for the H200
with the memory orderings its waits rely on."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def child(code: str, timeout: int = 240, interpret: bool = True) -> dict:
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'bench'}{os.pathsep}{ROOT}")
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    else:
        env.pop("TRITON_INTERPRET", None)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=timeout, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_persistent_step_and_l2_prefetch_chains_compute_the_chains_bits():
    rep = child("import json, pdl_probe; print(json.dumps(pdl_probe.check_small()))")
    assert set(rep) == {"persist", "persist+pre", "plain+pf50", "plain+pf100"}
    for name, r in rep.items():
        assert r["bits_equal"], (name, r["max_abs_diff"])
    for name in ("persist", "persist+pre"):
        r = rep[name]
        assert not any(r["counters_after"]), r
        # two layers: each phase counted exactly its tiles done (the next phase's `need`)
        assert r["done_per_phase"] == r["tiles"] * 2, r
        assert not r["gave_up"]


GIVE_UP = r"""
import json, torch, pdl_probe as P
gen = torch.Generator().manual_seed(2)
m = P.build(P.small(), 2, 30, "cpu", gen)
x0 = torch.randn(m["width"], generator=gen).to(torch.bfloat16)
bufs = [x0.clone(), torch.full_like(x0, float("nan"))]
step = P.persistent(m, bufs, 3, 1, num_warps=4, spins=25)
# skip layer 0's q|k|v tiles: the attention's wait for them can never be met
step.counters[0] = step.tiles[0]
step()
after = step.counters[:-1].tolist()
gave_up = step.gave_up()
print(json.dumps({"gave_up": gave_up, "counters_after": after, "flag_cleared": step.counters[-1].item()}))
"""


def test_a_wait_that_cannot_be_met_gives_up_and_is_reported_instead_of_hanging():
    rep = child(GIVE_UP, timeout=180)
    assert rep["gave_up"] is True
    assert not any(rep["counters_after"]) and rep["flag_cleared"] == 0


PTX = r"""
import json, os, re, subprocess, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource
import pdl_probe as P

d, layers, S = P.LLAMA, 8, 2048
(_, dim, nqkv), _, (_, _, ngu), (_, ni, _) = P.shapes(d)
bn, bk, _ = d["blocks"][dim]
bn_d, bk_d, _ = d["blocks"][ni]
nsp = S // d["block_s"]
ptrs = dict(b0="*bf16", b1="*bf16", wqkv="*bf16", wo="*bf16", wgu="*bf16", wd="*bf16", kc="*bf16",
            vc="*bf16", m_ws="*fp32", l_ws="*fp32", acc_ws="*fp32", queue="*i32", exit_cnt="*i32",
            done="*i32", S="i32", qk_scale="fp32")
out = {}
for maxnreg in (None, 128):
    consts = dict(LAYERS=layers, DIM=dim, NQKV=nqkv, NGU=ngu, NI=ni, HKV=d["hkv"], G=d["hq"] // d["hkv"],
                  D=d["hd"], BLOCK_S=d["block_s"], NSP=nsp, BN=bn, BK=bk, BN_D=bn_d, BK_D=bk_d,
                  T0=nqkv // bn, T1=d["hkv"] * nsp, T2=d["hq"], T3=dim // bn, T4=ngu // bn, T5=dim // bn_d,
                  NPH2=64, PRE=1, SPINS=1 << 20)
    names = P._persist.arg_names
    sig = {n: ptrs.get(n, "constexpr") for n in names}
    div = [names.index(n) for n in names if sig[n] != "constexpr" and n != "qk_scale"]
    src = ASTSource(fn=P._persist, signature=sig, constexprs=consts,
                    attrs={(i,): [["tt.divisibility", 16]] for i in div})
    opts = {"num_warps": 8, "num_stages": 1}
    if maxnreg:
        opts["maxnreg"] = maxnreg
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts).asm["ptx"]
    with tempfile.TemporaryDirectory() as t:
        f = os.path.join(t, "k.ptx")
        open(f, "w").write(ptx)
        r = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name", "sm_90a", f, "-o", os.path.join(t, "k.o")],
                           capture_output=True, text=True)
    regs = re.search(r"Used (\d+) registers", r.stdout + r.stderr)
    out[str(maxnreg)] = {"rc": r.returncode, "regs": int(regs.group(1)) if regs else None,
                         "acquire_loads": len(re.findall(r"ld\.global\.gpu\.acquire", ptx)),
                         "release_adds": len(re.findall(r"(?:atom|red)\.global\.gpu\.release\.add", ptx)),
                         "relaxed_adds": len(re.findall(r"(?:atom|red)\.global(?:\.gpu)?(?:\.relaxed)?\.add", ptx)),
                         "cg_loads": len(re.findall(r"ld\.global\.cg", ptx)),
                         "weight_v4": len(re.findall(r"ld\.global[^;]*evict_first[^;]*\.v4", ptx))}
# the attention split with and without its L2 prefetch programs
asig = dict(qkv_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", m_ws="*fp32", l_ws="*fp32", acc_ws="*fp32",
            S="i32", qk_scale="fp32", pf_ptr="*bf16")
for part in (0, 65536):
    consts = dict(G=4, D=128, BLOCK_S=64, NSP=32, PDL=1, PRE=1, TRIG=0, PF_PART=part, PF_BLOCK=2048)
    sig = dict(asig, **{k: "constexpr" for k in consts})
    names = P._attn_split.arg_names
    div = [names.index(n) for n in names if sig[n].startswith("*")]
    src = ASTSource(fn=P._attn_split, signature=sig, constexprs=consts,
                    attrs={(i,): [["tt.divisibility", 16]] for i in div})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 2}).asm["ptx"]
    out[f"split-pf{part}"] = {"volatile_v4": len(re.findall(r"ld\.volatile\.global\.v4", ptx)),
                              "waits": len(re.findall(r"griddepcontrol\.wait", ptx))}
print(json.dumps(out))
"""


def test_the_probe_compiles_for_sm90_with_acquire_waits_release_counts_and_kept_prefetches():
    pytest.importorskip("triton.backends.nvidia.compiler")
    rep = child(PTX, timeout=300, interpret=False)
    # the prefetch programs' reads survive compilation (volatile, values dropped): a round of
    # 4 x 2048 bf16 over 64 threads is 16 16-byte loads; the attention programs still wait
    assert rep.pop("split-pf65536") == {"volatile_v4": 16, "waits": 1}
    assert rep.pop("split-pf0") == {"volatile_v4": 0, "waits": 1}
    for cap, r in rep.items():
        assert r["rc"] == 0, r
        # a poll of the phase before (acquire) in each of the six kinds of tile, twice (the
        # first poll and the loop's); tiles counted done with release (the compiler may merge
        # the six kinds' increments), and no counter touched without an ordering
        assert r["acquire_loads"] == 12 and 1 <= r["release_adds"] <= 6, r
        assert r["relaxed_adds"] == 0, r
        # what other SMs wrote in this launch (activations, attention partials) is read
        # through L2; the weights as 16-byte vectors
        assert r["cg_loads"] >= 6 and r["weight_v4"] > 0, r
    assert rep["128"]["regs"] <= 128, rep   # two programs of 8 warps fit an SM
