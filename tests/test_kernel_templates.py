"""The built-in Triton templates compute their contract's function for every kind of config.

Each kernel is checked in a child process running this file under the Triton interpreter
(TRITON_INTERPRET must be set before triton is imported, and other tests import triton without
it). The child poisons outputs with NaN, compares with an fp64 reference by relative L2 error,
checks that inputs are unchanged and that two runs give the same bits, and prints one JSON line.
"""
from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KERNELS = ["rmsnorm", "add_rmsnorm", "softmax", "matmul", "decode_attention", "linear", "swiglu", "rope",
           "rope_kv_write"]
# The fused decode templates are judged by the harness in their own files
# (tests/test_kernel_<name>.py): every CONFIGS kind over the spec's CPU sweep, split-K against one split.
FUSED = ["rmsnorm_linear", "rmsnorm_gate_up_swiglu", "linear_residual", "rope_kv_attention", "rmsnorm_qkv_rope"]
INOUT = {"rope_kv_write": ("k_cache", "v_cache")}   # written in place: judged on what they must hold
FP32_TOL = 1e-5
BF16_TOL = 2e-2  # the interpreter rounds fp32 -> bf16 by truncation


def _run_child(kernel: str) -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, __file__, kernel], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"child for {kernel} failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("kernel", KERNELS)
def test_template_matches_fp64_reference_on_odd_and_tiny_shapes(kernel):
    report = _run_child(kernel)
    assert report["cases"] >= 6
    assert report["failures"] == [], "\n".join(report["failures"])


def test_registry_names_a_file_for_every_kernel():
    from kernelsearch.kernels import TEMPLATES, template_path
    assert sorted(TEMPLATES) == sorted(KERNELS + FUSED)
    for kernel in KERNELS + FUSED:
        assert template_path(kernel).is_file()
    with pytest.raises(KeyError):
        template_path("nope")


# ----------------------------------------------------------------------------- child side

def _rel(out, ref):
    import torch
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out.double() - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def _rms_ref(x, w, eps):
    xd = x.double()
    return xd / (xd.pow(2).mean(-1, keepdim=True) + eps).sqrt() * w.double()


def _attn_ref(q, k, v, lens, scale):
    import torch
    B, Hq, D = q.shape
    G = Hq // k.shape[1]
    out = torch.empty(B, Hq, D, dtype=torch.float64)
    for b in range(B):
        n = int(lens[b])
        kk = k[b, :, :n].double().repeat_interleave(G, 0)
        vv = v[b, :, :n].double().repeat_interleave(G, 0)
        s = torch.einsum("hd,hsd->hs", q[b].double(), kk) * scale
        out[b] = torch.einsum("hs,hsd->hd", torch.softmax(s, -1), vv)
    return out


def _cases(kernel, mod):
    """(label, inputs dict, make_outputs, call, reference outputs) for each check."""
    import torch
    g = torch.Generator().manual_seed(1234)

    def rnd(*shape, dtype=torch.float32, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    if kernel in ("rmsnorm", "add_rmsnorm", "softmax"):
        # (2, 33000): a row wider than a register tile, chunked whatever BLOCK_N says
        # (7, 1001) and (3, 5121): odd widths, rows not 16-byte aligned (the ALIGN=1 path)
        shapes = [(1, 37), (5, 300), (3, 1500), (9, 64), (2, 33000), (7, 1001), (3, 5121)]
        configs = [{}, dict(ROWS_PER_PROG=2, BLOCK_N=256, PROGRAMS_PER_SM=1, num_warps=2),
                   dict(ROWS_PER_PROG=4, BLOCK_N=1024, PROGRAMS_PER_SM=2, num_warps=4),
                   dict(ROWS_PER_PROG=8, BLOCK_N=0, PROGRAMS_PER_SM=0),
                   dict(ROWS_PER_PROG=1, BLOCK_N=0, PROGRAMS_PER_SM=0, ALIGN=1),
                   dict(ROWS_PER_PROG=4, BLOCK_N=256, PROGRAMS_PER_SM=1, num_warps=2, ALIGN=1)]
    elif kernel == "matmul":
        shapes = [(1, 70, 200), (4, 64, 256), (16, 96, 128), (20, 33, 100)]
        configs = [dict(variant="tiled", BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, GROUP_M=2),
                   dict(variant="tiled", BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, GROUP_M=8),
                   dict(variant="splitk", BLOCK_N=64, BLOCK_K=64, SPLIT_K=1),
                   dict(variant="splitk", BLOCK_N=32, BLOCK_K=32, SPLIT_K=3),
                   dict(variant="splitk", BLOCK_N=64, BLOCK_K=16, SPLIT_K=4, FMA=1),
                   # the last-arriving program reduces: counters must come back to zero
                   dict(variant="splitk", BLOCK_N=32, BLOCK_K=32, SPLIT_K=3, REDUCE="last"),
                   dict(variant="splitk", BLOCK_N=64, BLOCK_K=16, SPLIT_K=16, FMA=1, REDUCE="last")]
    elif kernel == "linear":
        # (M, N, K); (20, 33, 100): K not a multiple of any BLOCK_K, N odd
        shapes = [(1, 70, 200), (4, 64, 256), (16, 96, 128), (20, 33, 100), (40, 50, 64)]
        configs = [dict(variant="tiled", BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, GROUP_M=2),
                   dict(variant="tiled", BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, GROUP_M=8),
                   dict(variant="splitk", BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, SPLIT_K=1),
                   dict(variant="splitk", BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, SPLIT_K=3),
                   dict(variant="splitk", BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, SPLIT_K=4, FMA=1),
                   dict(variant="splitk", BLOCK_M=64, BLOCK_N=32, BLOCK_K=32, SPLIT_K=3, REDUCE="last"),
                   dict(variant="splitk", BLOCK_M=16, BLOCK_N=64, BLOCK_K=16, SPLIT_K=16, FMA=1, REDUCE="last"),
                   # gemv: one row (M=1), 4 rows (M=4), row blocks capped at 8 (M=16, 20, 40);
                   # the last two split K (3 and 2-3 ranges) and run in bf16 too
                   dict(variant="gemv", BLOCK_M=8, BLOCK_N=16, BLOCK_K=64, SPLIT_K=1),
                   dict(variant="gemv", BLOCK_M=8, BLOCK_N=8, BLOCK_K=32, SPLIT_K=3, REDUCE="launch"),
                   dict(variant="gemv", BLOCK_M=8, BLOCK_N=4, BLOCK_K=16, SPLIT_K=3, REDUCE="last")]
    elif kernel == "swiglu":
        shapes = [(1, 37), (5, 300), (3, 1500), (9, 64), (7, 1001)]
        configs = [{}, dict(BLOCK=256, ROWS_PER_PROG=4, num_warps=2), dict(BLOCK=512, ROWS_PER_PROG=2),
                   dict(BLOCK=4096, ROWS_PER_PROG=1, num_warps=8)]
    elif kernel == "rope":
        shapes = [(1, 4, 2, 64), (3, 6, 3, 34), (2, 3, 5, 16), (4, 32, 8, 128), (1, 1, 1, 2)]
        configs = [{}, dict(HEADS_PER_PROG=1, num_warps=1), dict(HEADS_PER_PROG=4, num_warps=2),
                   dict(HEADS_PER_PROG=32, num_warps=8)]
    elif kernel == "rope_kv_write":
        # (B, Hq, Hkv, D, S); Hq > Hkv, Hq < Hkv, one head, S = 1
        shapes = [(1, 4, 2, 64, 8), (3, 6, 3, 34, 5), (2, 3, 5, 16, 3), (2, 32, 8, 128, 4), (1, 1, 1, 2, 1)]
        configs = [{}, dict(HEADS_PER_PROG=1, num_warps=1), dict(HEADS_PER_PROG=4, num_warps=2),
                   dict(HEADS_PER_PROG=32, num_warps=8)]
    else:
        shapes = [(2, 4, 2, 50, 16), (1, 6, 2, 130, 24), (3, 2, 2, 33, 32), (1, 8, 1, 16, 8)]
        # REDUCE="last": the split program that arrives last combines (one split, some, more
        # splits than the shortest sequence has chunks: empty splits arrive too)
        configs = [dict(BLOCK_S=16, NUM_SPLITS=1), dict(BLOCK_S=32, NUM_SPLITS=4),
                   dict(BLOCK_S=16, NUM_SPLITS=64), dict(BLOCK_S=16, NUM_SPLITS=1, REDUCE="last"),
                   dict(BLOCK_S=16, NUM_SPLITS=4, REDUCE="last"),
                   dict(BLOCK_S=16, NUM_SPLITS=64, REDUCE="last")]

    for shape, params, dtype in itertools.chain(
            ((s, p, torch.float32) for s in shapes for p in configs),
            ((shapes[1], p, torch.bfloat16) for p in configs[:2]),
            ((shapes[-1], p, torch.bfloat16) for p in configs[-2:])):
        tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
        label = f"{kernel} {shape} {dtype} {params}"
        if kernel == "rmsnorm":
            M, N = shape
            inp = dict(x=rnd(M, N, dtype=dtype, scale=3.0), weight=rnd(N, dtype=dtype), eps=1e-6)
            outs = dict(out=(M, N))
            ref = lambda i: dict(out=_rms_ref(i["x"], i["weight"], i["eps"]))
            call = lambda i, o, p: mod.launch(i["x"], i["weight"], i["eps"], o["out"], **p)
        elif kernel == "add_rmsnorm":
            M, N = shape
            inp = dict(x=rnd(M, N, dtype=dtype), residual=rnd(M, N, dtype=dtype, scale=10.0),
                       weight=rnd(N, dtype=dtype), eps=1e-6)
            outs = dict(out=(M, N), residual_out=(M, N))

            def ref(i):
                s = i["x"].double() + i["residual"].double()
                return dict(out=_rms_ref(s, i["weight"], i["eps"]), residual_out=s)
            call = lambda i, o, p: mod.launch(i["x"], i["residual"], i["weight"], i["eps"],
                                              o["out"], o["residual_out"], **p)
        elif kernel == "softmax":
            M, N = shape
            inp = dict(x=rnd(M, N, dtype=dtype, scale=4.0))
            outs = dict(out=(M, N))
            ref = lambda i: dict(out=torch.softmax(i["x"].double(), -1))
            call = lambda i, o, p: mod.launch(i["x"], o["out"], **p)
        elif kernel == "matmul":
            M, N, K = shape
            inp = dict(a=rnd(M, K, dtype=dtype), b=rnd(K, N, dtype=dtype))
            outs = dict(out=(M, N))
            ref = lambda i: dict(out=i["a"].double() @ i["b"].double())
            call = lambda i, o, p: mod.launch(i["a"], i["b"], o["out"], **p)
        elif kernel == "linear":
            M, N, K = shape
            inp = dict(x=rnd(M, K, dtype=dtype), weight=rnd(N, K, dtype=dtype))
            outs = dict(out=(M, N))
            ref = lambda i: dict(out=i["x"].double() @ i["weight"].double().T)
            call = lambda i, o, p: mod.launch(i["x"], i["weight"], o["out"], **p)
        elif kernel == "swiglu":
            M, I = shape
            inp = dict(gate_up=rnd(M, 2 * I, dtype=dtype, scale=3.0))
            outs = dict(out=(M, I))

            def ref(i):
                g, u = i["gate_up"].double().chunk(2, dim=-1)
                return dict(out=g * torch.sigmoid(g) * u)
            call = lambda i, o, p: mod.launch(i["gate_up"], o["out"], **p)
        elif kernel == "rope":
            B, Hq, Hkv, D = shape
            ang = rnd(B, D, scale=3.0)
            inp = dict(q=rnd(B, Hq, D, dtype=dtype), k=rnd(B, Hkv, D, dtype=dtype),
                       cos=ang.cos().to(dtype), sin=ang.sin().to(dtype))
            outs = dict(q_out=(B, Hq, D), k_out=(B, Hkv, D))

            def ref(i):
                c, s_ = i["cos"].double()[:, None], i["sin"].double()[:, None]
                rot = lambda x: torch.cat((-x[..., D // 2:], x[..., :D // 2]), -1)
                q, k = i["q"].double(), i["k"].double()
                return dict(q_out=q * c + rot(q) * s_, k_out=k * c + rot(k) * s_)
            call = lambda i, o, p: mod.launch(i["q"], i["k"], i["cos"], i["sin"], o["q_out"],
                                              o["k_out"], **p)
        elif kernel == "rope_kv_write":
            B, Hq, Hkv, D, S = shape
            ang = rnd(B, D, scale=3.0)
            inp = dict(qkv=rnd(B, Hq + 2 * Hkv, D, dtype=dtype), cos=ang.cos().to(dtype),
                       sin=ang.sin().to(dtype), positions=torch.randint(0, S, (B,), generator=g),
                       k_cache=rnd(B, Hkv, S, D, dtype=dtype), v_cache=rnd(B, Hkv, S, D, dtype=dtype))
            outs = dict(q_out=(B, Hq, D))

            def ref(i):
                c, s_ = i["cos"].double()[:, None], i["sin"].double()[:, None]
                rot = lambda x: torch.cat((-x[..., D // 2:], x[..., :D // 2]), -1)
                x = i["qkv"].double()
                q, k, v = x[:, :Hq], x[:, Hq:Hq + Hkv], x[:, Hq + Hkv:]
                kc, vc = i["k_cache"].double().clone(), i["v_cache"].double().clone()
                for b in range(B):
                    kc[b, :, i["positions"][b]] = (k * c + rot(k) * s_)[b]
                    vc[b, :, i["positions"][b]] = v[b]
                return dict(q_out=q * c + rot(q) * s_, k_cache=kc, v_cache=vc)
            call = lambda i, o, p: mod.launch(i["qkv"], i["cos"], i["sin"], i["positions"], i["k_cache"],
                                              i["v_cache"], o["q_out"], **p)
        else:
            B, Hq, Hkv, S, D = shape
            lens = torch.randint(1, S + 1, (B,), generator=g, dtype=torch.int32)
            lens[0] = S
            inp = dict(q=rnd(B, Hq, D, dtype=dtype), k_cache=rnd(B, Hkv, S, D, dtype=dtype),
                       v_cache=rnd(B, Hkv, S, D, dtype=dtype), seq_lens=lens, scale=D ** -0.5)
            outs = dict(out=(B, Hq, D))
            ref = lambda i: dict(out=_attn_ref(i["q"], i["k_cache"], i["v_cache"], i["seq_lens"],
                                               i["scale"]))
            call = lambda i, o, p: mod.launch(i["q"], i["k_cache"], i["v_cache"], i["seq_lens"],
                                              i["scale"], o["out"], **p)
        yield label, inp, outs, call, ref(inp), params, dtype, tol


def _check_space(mod, failures):
    import inspect
    keys = set(mod.SPACE)
    sig = inspect.signature(mod.launch).parameters
    for p in mod.CONFIGS:
        if set(p) != keys:
            failures.append(f"config {p} does not cover SPACE keys {sorted(keys)}")
        if not set(p) <= set(sig):
            failures.append(f"config {p} has keys launch() does not take")
        if any(p[k] not in mod.SPACE[k] for k in p):
            failures.append(f"config {p} is outside SPACE")
    if len({json.dumps(p, sort_keys=True) for p in mod.CONFIGS}) != len(mod.CONFIGS):
        failures.append("CONFIGS has duplicates")
    if not mod.CONFIGS:
        failures.append("CONFIGS is empty")


def _child_main(kernel: str) -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    import torch
    from kernelsearch.kernels import load_template
    mod = load_template(kernel)
    failures: list[str] = []
    _check_space(mod, failures)
    n = 0
    for label, inp, outs, call, ref, params, dtype, tol in _cases(kernel, mod):
        n += 1
        inout = INOUT.get(kernel, ())
        before = {k: v.clone() for k, v in inp.items() if isinstance(v, torch.Tensor)}
        results = []
        for _ in range(2):
            o = {k: torch.full(s, float("nan"), dtype=dtype) for k, s in outs.items()}
            for k in inout:   # each run starts from the same cache contents
                inp[k] = before[k].clone()
            try:
                call(inp, o, params)
            except Exception as exc:  # a failure is data: report it with its case
                failures.append(f"{label}: raised {type(exc).__name__}: {exc}")
                break
            o.update({k: inp[k] for k in inout})
            results.append(o)
        if len(results) < 2:
            continue
        for k, r in ref.items():
            if k in inout:   # the written slots against fp64, every other element unchanged
                slot = (r != before[k].double()).any(-1)
                err = _rel(results[0][k][slot], r[slot])
                if not torch.equal(results[0][k][~slot], before[k][~slot]):
                    failures.append(f"{label}: {k} changed outside the slots the op writes")
            else:
                err = _rel(results[0][k], r)
            if not err <= tol:
                failures.append(f"{label}: {k} relative L2 error {err:.3g} > {tol}")
            if not torch.equal(results[0][k], results[1][k]):
                failures.append(f"{label}: {k} differs between two runs")
        for k, v in before.items():
            if k not in inout and not torch.equal(v, inp[k]):
                failures.append(f"{label}: input {k} was modified")
    for dev, counters in getattr(mod, "_counters", {}).items():  # matmul REDUCE="last"
        if int(counters.abs().sum()) != 0:
            failures.append(f"{kernel}: arrival counters on {dev} not back to zero after the launches")
    print(json.dumps({"kernel": kernel, "cases": n, "failures": failures}))


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    _child_main(sys.argv[1])
