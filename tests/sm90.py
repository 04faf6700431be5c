"""Our Triton kernels compiled for sm_90 here (no GPU needed: ptxas ships with triton): what the
kernel tests' PTX checks share.

A test hands `run_ptx_child` the code of a child process (run without TRITON_INTERPRET, whose
kernels are never compiled); the child imports `compile_ptx` and `ptxas_usage` from here and
prints one JSON line, which the test gets back.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def compile_ptx(fn, signature: dict, constexprs: dict, divisible, warps: int, stages: int):
    """(PTX text, shared memory bytes) of the @triton.jit `fn` for sm_90. signature: {argument:
    type} of the runtime arguments; constexprs: their values; divisible: the arguments the
    launcher specialises as multiples of 16 at the shapes in question (pointers, dims, strides)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = dict(signature)
    sig.update({k: "constexpr" for k in constexprs})
    names = list(fn.arg_names)
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs,
                    attrs={(names.index(n),): [["tt.divisibility", 16]] for n in divisible})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": warps, "num_stages": stages})
    return k.asm["ptx"], k.metadata.shared


def ptxas_usage(ptx: str):
    """(registers a thread, bytes of spill stores) that triton's ptxas reports for sm_90a."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as d:
        f = os.path.join(d, "k.ptx")
        with open(f, "w") as out:
            out.write(ptx)
        r = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name", "sm_90a", f, "-o",
                            os.path.join(d, "k.o")], capture_output=True, text=True)
    text = r.stdout + r.stderr
    regs = re.search(r"Used (\d+) registers", text)
    spills = re.search(r"(\d+) bytes spill stores", text)
    return (int(regs.group(1)) if regs else None), (int(spills.group(1)) if spills else None)


def run_ptx_child(code: str, timeout: int = 300, **env_extra):
    """Run `code` in a child process without TRITON_INTERPRET (FP fusion on, as triton's
    default; `env_extra` added) -> the JSON of its last stdout line. Skips the calling test where
    this triton has no NVIDIA backend or no ptxas."""
    import pytest

    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(ROOT), TRITON_DEFAULT_FP_FUSION="1", **env_extra)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode != 0 and "ptxas" in proc.stderr and "not found" in proc.stderr.lower():
        pytest.skip("no ptxas in this triton install")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
