"""Count a rope_kv_attention split kernel's SASS before, in and after its K/V loop, offline.

    python3 bench/experiments/sass_count.py [MODULE] [--block-s 16] [--warps 4] [--stages 3]

MODULE: kernelsearch.kernels.rope_kv_attention (default), kernelsearch.kernels.decode_attention
(its `_split_kernel`: the attention alone, q already rotated and the new token already in the
cache, as after rmsnorm_qkv_rope) or a candidate's file path. Compiles
`_rope_attn_kernel` for sm_90 (bf16, D 128, a GQA group padded to 16 rows, REDUCE launch) with
`triton.compile` and triton's own ptxas and nvdisasm: no GPU needed. Prints the registers, the
static count, each branch and where it goes. The loop is the span a backward branch closes: the
instructions a warp runs are about prologue + iterations x loop + epilogue (ncu's "Executed
Instructions" / warps, run 18: ~1660 for the template at 5 iterations). A measure of the code,
not a time. It imports MODULE, so it is for our own files: never point it at a candidate an
agent wrote (the harness compiles those from checked source, and this tool does not).
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, ".")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.compiler import get_ptxas  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

POINTERS = {"qkv_ptr": "*bf16", "cos_ptr": "*bf16", "sin_ptr": "*bf16", "pos_ptr": "*i64",
            "k_ptr": "*bf16", "v_ptr": "*bf16", "m_ws": "*fp32", "l_ws": "*fp32", "acc_ws": "*fp32",
            "out_ptr": "*bf16", "cnt_ptr": "*i32", "q_ptr": "*bf16", "lens_ptr": "*i32"}


def load(module: str):
    if module.endswith(".py"):
        spec = importlib.util.spec_from_file_location("candidate", module)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    return importlib.import_module(module)


def sass(fn, consts: dict, warps: int, stages: int) -> tuple[str, str]:
    sig = {}
    for n in fn.arg_names:
        if n in consts:
            sig[n] = "constexpr"
        elif n in POINTERS:
            sig[n] = POINTERS[n]
        elif n == "qk_scale":
            sig[n] = "fp32"
        else:
            sig[n] = "i32"
    div = [i for i, n in enumerate(fn.arg_names)
           if n in POINTERS or n in ("D", "S") or n.startswith("s_")]   # what the launcher specialises (128, ...)
    src = ASTSource(fn=fn, signature=sig, constexprs=consts,
                    attrs={(i,): [["tt.divisibility", 16]] for i in div})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": warps, "num_stages": stages})
    ptxas = get_ptxas(90).path
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "k.ptx"), "w") as f:
            f.write(k.asm["ptx"])
        r = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", os.path.join(d, "k.ptx"), "-o",
                            os.path.join(d, "k.cubin")], capture_output=True, text=True, check=True)
        nvdisasm = os.path.join(os.path.dirname(ptxas), "nvdisasm")
        out = subprocess.run([nvdisasm, "-c", "-g", os.path.join(d, "k.cubin")], capture_output=True,
                             text=True, check=True).stdout
    regs = re.search(r"Used (\d+) registers", r.stdout + r.stderr)
    return (regs.group(1) if regs else "?"), out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("module", nargs="?", default="kernelsearch.kernels.rope_kv_attention")
    ap.add_argument("--block-s", type=int, default=16)
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--stages", type=int, default=3)
    args = ap.parse_args(argv)
    mod = load(args.module)
    consts = dict(BLOCK_G=16, BLOCK_S=args.block_s, BLOCK_D=128, UPCAST=False, DOT_PRECISION="tf32",
                  LAST_REDUCES=False, GROUP_P2=4, BLOCK_SPLITS=32, SPLIT_CHUNK=32)
    fn = getattr(mod, "_rope_attn_kernel", None)
    if fn is None:   # decode_attention: no RoPE, no cache write, no one-split path
        fn = mod._split_kernel
    else:
        consts.update(RNE_BF16=False, DIRECT=False)
    regs, text = sass(fn, consts, args.warps, args.stages)
    ins, labels = [], {}
    for line in text.splitlines():
        m = re.match(r"\s+/\*[0-9a-f]{4}\*/\s+(.*?);", line)
        if m:
            ins.append(m.group(1).strip())
            continue
        m = re.match(r"\s*(\.L_x_\d+):", line)
        if m:
            labels[m.group(1)] = len(ins)
    print(f"{args.module}: BLOCK_S {args.block_s}, {args.warps} warps, {args.stages} stages: "
          f"{regs} registers, {len(ins)} SASS instructions")
    for i, t in enumerate(ins):
        if "BRA" in t or "EXIT" in t:
            target = re.search(r"\.L_x_\d+", t)
            to = labels.get(target.group(0)) if target else None
            kind = "loop back" if to is not None and to < i else ""
            print(f"  {i:5d}  {t[:60]:60s} -> {to if to is not None else ''} {kind}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
