"""Early reads: a kernel's first statements may load its static inputs (weights) before its
grid-dependency wait, where the trusted launcher allows it -- never anything the kernel before
it may still be writing.

CPU: which leading statements form the early prefix and what they read (source.early_prefix),
hostile prefixes that try to read an activation or make a pointer from an integer, the
generated module's two waits, the launcher's decision (run_plan.bind), and the sm_90 PTX of the
linear_residual GEMV (its first weight step's L2 fetch before `griddepcontrol.wait` only with
the early flag). GPU (sm_90+): a producer writes x late; a kernel whose prefix loads only the weight, bound
with the weight static, reads x after the producer is done; the same kernel shape with x loaded
in its prefix is never launched early by bind, and launched early by hand reads stale values
(the control).
"""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernelsearch.harness import plan as plan_mod
from kernelsearch.harness import run_plan
from kernelsearch.harness.source import (EARLY_READS_ATTR, PDL_EARLY, PDL_PARAM, KernelSource, gdc_available,
                                         load_kernels, private_dir)

ROOT = Path(__file__).parents[1]
HEAD = "import triton\nimport triton.language as tl\n\n\ndef launch(w, x, out):\n    pass\n\n\n"
needs_gdc = pytest.mark.skipif(not gdc_available(), reason="this triton has no gdc_wait (no PDL)")


def _early(body: str, params: str = "w_ptr, x_ptr, out_ptr, n, BLOCK: tl.constexpr, EVEN: tl.constexpr"):
    """(statements in the early prefix, sorted parameters its loads read through) of a kernel."""
    text = HEAD + f"@triton.jit\ndef _k({params}):\n" + "".join(f"    {line}\n" for line in body.splitlines())
    src = KernelSource.parse(text)
    n, reads = src.early.get("_k", (0, frozenset()))
    return n, sorted(reads)


OFFS = "offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)\n"
TAIL = "tl.store(out_ptr + offs, acc, mask=offs < n)"


def test_a_weight_load_at_the_top_is_an_early_prefix_and_reads_only_through_the_weight():
    n, reads = _early(OFFS + "acc = tl.load(w_ptr + offs, mask=offs < n, other=0.0, eviction_policy='evict_first')\n"
                      "acc += tl.load(x_ptr + offs, mask=offs < n)\n" + TAIL)
    assert n == 2 and reads == ["BLOCK", "n", "w_ptr"]     # the x load after the AugAssign is not in it
    # a constexpr branch with loads on both sides: both sides' pointers count
    n, reads = _early(OFFS + "if EVEN:\n    acc = tl.load(w_ptr + offs)\nelse:\n    acc = tl.load(w_ptr + offs, mask=offs < n)\n"
                      "acc += tl.load(x_ptr + offs)\n" + TAIL)
    assert n == 2 and reads == ["BLOCK", "n", "w_ptr"]


@pytest.mark.parametrize("body, why", [
    ("acc = tl.load(x_ptr + offs)\n", "an activation loaded"),
    ("p = w_ptr + (x_ptr - w_ptr)\nacc = tl.load(p + offs)\n", "x's address through w's"),
    ("p = tl.where(offs < n, w_ptr + offs, x_ptr + offs)\nacc = tl.load(p)\n", "a select of two pointers"),
    ("i = tl.load(x_ptr + offs).to(tl.int32)\nacc = tl.load(w_ptr + i)\n", "an index loaded from x"),
    ("w = w_ptr\nw = x_ptr\nacc = tl.load(w + offs)\n", "a name rebound to x"),
    ("if EVEN:\n    p = w_ptr\nelse:\n    p = x_ptr\nacc = tl.load(p + offs)\n", "either branch may compile"),
])
def test_every_parameter_a_prefix_load_derives_from_is_reported(body, why):
    n, reads = _early(OFFS + body + TAIL)
    assert n >= 2 and "x_ptr" in reads, why      # the launcher then never runs it early


@pytest.mark.parametrize("body", [
    "tl.store(out_ptr + offs, 1.0)\nacc = tl.load(w_ptr + offs)\n",                    # a store first
    "acc = tl.atomic_add(out_ptr + offs, 1.0)\n",                                       # an atomic
    "acc = _helper(w_ptr + offs)\n",                                                     # a helper (may store)
    "acc = tl.load((n + offs).to(tl.pointer_type(tl.float32)))\n",                      # an integer made a pointer
    "acc = tl.load(n.to(w_ptr.dtype) + offs)\n",                                         # the same through a dtype
    "acc = tl.load(w_ptr + offs) if n > 0 else 0.0\n",                                  # not an expression it takes
    "if n > 0:\n    acc = tl.load(w_ptr + offs)\n",                                      # a branch decided at run time
    "for i in range(2):\n    acc = tl.load(w_ptr + offs)\n",                             # a loop
    "acc = tl.load(w_ptr + offs, mask=(y := tl.load(x_ptr + offs)) > 0)\n",             # a name bound in passing
    "acc = b = tl.load(w_ptr + offs)\n",                                                 # two targets
    "acc, b = tl.load(w_ptr + offs), 0\n",                                               # a tuple target
    "acc: tl.tensor = tl.load(w_ptr + offs)\n",                                          # annotated
    "acc = tl.load(*[w_ptr + offs])\n",                                                  # starred
    "acc = tl.load(w_ptr[0])\n",                                                         # indexed by a value
    "acc = tl.load(w_ptr + offs).to(tl.float32, bitcast=True)\n",                       # a bitcast
    "tl = w_ptr\nacc = tl.load(offs)\n",                                                 # tl rebound
    "max = w_ptr\nacc = tl.load(w_ptr + max(offs, 0))\n",                                # max rebound
    "acc = tl.inline_asm_elementwise('mov.b32 $0, $1;', '=r,r', [n], dtype=tl.int32, is_pure=True, pack=1)\n",
])
def test_anything_else_ends_the_prefix_before_it(body):
    helper = "@triton.jit\ndef _helper(p):\n    return tl.load(p)\n\n\n"
    text = HEAD + helper + "@triton.jit\ndef _k(w_ptr, x_ptr, out_ptr, n, BLOCK: tl.constexpr):\n" + \
        "".join(f"    {line}\n" for line in (OFFS + body + TAIL).splitlines())
    try:
        src = KernelSource.parse(text)
    except Exception:   # refused outright by the allowlist: no prefix either
        return
    n, reads = src.early.get("_k", (0, frozenset()))
    assert n <= 1 and not reads, (n, reads)


def test_an_expression_nested_past_the_recursion_limit_is_no_prefix_and_no_crash():
    deep = "w_ptr" + " + 1" * 3000
    try:
        src = KernelSource.parse(HEAD + "@triton.jit\ndef _k(w_ptr, out_ptr):\n"
                                 f"    acc = tl.load({deep})\n    tl.store(out_ptr, acc)\n")
    except Exception as exc:   # the allowlist may refuse it first: a SourceError, not a crash
        assert type(exc).__name__ == "SourceError", exc
        return
    assert "_k" not in src.early


def test_a_source_nested_past_the_depth_limit_is_refused_before_any_recursive_check():
    from kernelsearch.harness.source import MAX_AST_DEPTH, SourceError

    def kernel(terms: int) -> str:
        return (HEAD + "@triton.jit\ndef _k(w_ptr, out_ptr):\n"
                f"    acc = tl.load(w_ptr{' + 1' * terms})\n    tl.store(out_ptr, acc)\n")

    assert "_k" in KernelSource.parse(kernel(MAX_AST_DEPTH - 20)).kernels   # a long chain, still checked
    with pytest.raises(SourceError, match=f"nested deeper than {MAX_AST_DEPTH} levels"):
        KernelSource.parse(kernel(MAX_AST_DEPTH))
    # the same answer where Python's recursion limit is low: the depth is measured without recursion
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(max(200, old // 4))
    try:
        with pytest.raises(SourceError):
            KernelSource.parse(kernel(3000))
    finally:
        sys.setrecursionlimit(old)


def test_a_constexpr_rebound_in_the_prefix_is_not_a_compile_time_test():
    n, reads = _early(OFFS + "EVEN = n > 0\nacc = tl.load(w_ptr + offs)\nif EVEN:\n    acc = tl.load(x_ptr + offs)\n"
                      + TAIL)
    assert n == 3 and reads == ["BLOCK", "w_ptr"]   # the branch on EVEN, now decided at run time, ends it


@needs_gdc
def test_the_generated_module_waits_first_or_after_the_prefix_by_the_flag_alone():
    text = HEAD + "@triton.jit\ndef _k(w_ptr, x_ptr, out_ptr, n, BLOCK: tl.constexpr):\n" + "".join(
        f"    {line}\n" for line in (OFFS + "acc = tl.load(w_ptr + offs, mask=offs < n)\n"
                                     "acc += tl.load(x_ptr + offs, mask=offs < n)\n" + TAIL).splitlines())
    fn = next(n for n in ast.parse(KernelSource.parse(text).module_text()).body if isinstance(n, ast.FunctionDef))
    src = [ast.unparse(s) for s in fn.body]
    assert src[0] == f"if {PDL_PARAM} == 1:\n    _hwtune_gdc_wait()"
    assert src[1].startswith("offs =") and src[2].startswith("acc = tl.load(w_ptr")
    assert src[3] == f"if {PDL_PARAM} == {PDL_EARLY}:\n    _hwtune_gdc_wait()"
    assert src[4].startswith("acc += tl.load(x_ptr")


# --- the launcher -----------------------------------------------------------------------------
def _fake_kernel(reads):
    import triton.runtime.jit as jit_mod

    fn = jit_mod.JITFunction.__new__(jit_mod.JITFunction)
    fn.arg_names = ["w_ptr", "x_ptr", "out_ptr", "n", PDL_PARAM]
    setattr(fn, EARLY_READS_ATTR, frozenset(reads))
    return fn


def _launch(kernel, w="w", x="x"):
    return plan_mod.Launch(kernel, (1, 1, 1), (("w_ptr", plan_mod.Ref(w, 0, "float32")),
                                               ("x_ptr", plan_mod.Ref(x, 0, "float32")),
                                               ("out_ptr", plan_mod.Ref("out", 0, "float32")), ("n", ("int", 4))), ())


def _early_flags(monkeypatch, plan, kernels, static, on=True):
    seen = []
    monkeypatch.setattr(run_plan, "pdl_kwargs", lambda fn, device, early=False: seen.append(early) or {})
    buffers = {k: torch.zeros(16, dtype=torch.uint8) for k in ("w", "x", "out")}
    with run_plan.early_reads(on):
        run_plan.bind(plan, kernels, buffers, {}, static=static)
    return seen


def test_bind_lets_a_kernel_read_early_only_through_static_buffers_no_earlier_step_was_given(monkeypatch):
    kernels = {"w_only": _fake_kernel({"w_ptr", "n"}), "reads_x": _fake_kernel({"w_ptr", "x_ptr"}),
               "none": _fake_kernel(())}
    one = plan_mod.Plan((), (_launch("w_only"),))
    assert _early_flags(monkeypatch, one, kernels, {"w"}) == [True]
    assert _early_flags(monkeypatch, one, kernels, {"w"}, on=False) == [False]   # off: HWTUNE_PDL_EARLY unset
    assert _early_flags(monkeypatch, one, kernels, set()) == [False]             # the caller vouches nothing
    assert _early_flags(monkeypatch, one, kernels, {"x"}) == [False]             # not the buffer it reads
    assert _early_flags(monkeypatch, plan_mod.Plan((), (_launch("reads_x"),)), kernels, {"w"}) == [False]
    assert _early_flags(monkeypatch, plan_mod.Plan((), (_launch("none"),)), kernels, {"w"}) == [False]
    # a second step whose weight an earlier step was given (and may have written): waits first
    two = plan_mod.Plan((), (_launch("w_only"), _launch("w_only")))
    assert _early_flags(monkeypatch, two, kernels, {"w"}) == [True, False]
    zeroed = plan_mod.Plan((), (plan_mod.Zero(plan_mod.Ref("w", 0, "uint8"), 4), _launch("w_only")))
    assert _early_flags(monkeypatch, zeroed, kernels, {"w"}) == [False]
    # the weight bound to the x parameter: the prefix reads x's buffer, which is not static
    swapped = plan_mod.Plan((), (_launch("w_only", w="x", x="w"),))
    assert _early_flags(monkeypatch, swapped, kernels, {"w"}) == [False]


def test_the_launcher_passes_the_early_flag_value_only_when_asked(monkeypatch):
    fn = _fake_kernel({"w_ptr"})
    monkeypatch.setattr(run_plan, "_sm90", {0: True})
    assert run_plan.pdl_kwargs(fn, torch.device("cuda", 0)) == {PDL_PARAM: True, "launch_pdl": True}
    assert run_plan.pdl_kwargs(fn, torch.device("cuda", 0), early=True) == {PDL_PARAM: PDL_EARLY, "launch_pdl": True}
    assert run_plan.pdl_kwargs(fn, torch.device("cpu"), early=True) == {}


@pytest.mark.parametrize("value, on, warned", [("1", True, False), ("on", True, False), ("0", False, False),
                                              ("", False, False), ("yes", True, False), ("2", False, True)])
def test_hwtune_pdl_early_in_the_environment(value, on, warned):
    env = dict(os.environ, HWTUNE_PDL_EARLY=value)
    done = subprocess.run([sys.executable, "-c", "from kernelsearch.harness import run_plan; "
                           "print(run_plan.early_reads_enabled())"], env=env, cwd=ROOT, capture_output=True,
                          text=True, check=True)
    assert done.stdout.strip() == str(on)
    assert ("HWTUNE_PDL_EARLY='2'" in done.stderr) == warned, done.stderr


def test_a_benchmark_row_says_how_its_kernels_were_launched(monkeypatch):
    monkeypatch.setenv("HWTUNE_PDL_TRIGGER", "late")
    with run_plan.early_reads(True):
        assert "early reads on" in run_plan.pdl_note() and "trigger late" in run_plan.pdl_note()
    with run_plan.early_reads(False):
        assert "early reads off" in run_plan.pdl_note()
    with run_plan.pdl(False):
        assert run_plan.pdl_note().startswith("off")


def test_specs_vouch_only_for_true_inputs():
    from kernelsearch.specs import SPECS

    for name, spec in SPECS.items():
        for arg in spec.static_inputs:
            assert arg in spec.arg_names and arg not in spec.inout_names and arg not in spec.out_names, (name, arg)
    assert SPECS["linear_residual"].static_inputs == ("weight",)


_DISPATCH_CHILD = r"""
import json, sys, torch
from kernelsearch.dispatch import DispatchTable
from kernelsearch.harness import run_plan
seen = []
real = run_plan.bind
run_plan.bind = lambda *a, **k: seen.append(sorted(k.get("static", ()))) or real(*a, **k)
table = DispatchTable.load(sys.argv[1])
x, w = torch.randn(4, 100), torch.rand(100) + 0.5
out = table.call("rmsnorm", x, w, 1e-6)
ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
print(json.dumps({"static": seen, "err": float((out - ref).abs().max())}))
"""


def test_the_dispatch_runtime_vouches_for_the_specs_static_inputs(tmp_path, monkeypatch):
    from kernelsearch.fingerprint import collect
    from tests.test_dispatch import _table

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    path = _table(tmp_path, collect("cpu"))
    proc = subprocess.run([sys.executable, "-c", _DISPATCH_CHILD, str(path)], cwd=ROOT, text=True,
                          capture_output=True, timeout=180,
                          env={"TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["static"] == [["weight"]] and got["err"] < 1e-4, got     # rmsnorm's weight, not x


_PTX_CHILD = r"""
import json, re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from pathlib import Path
from kernelsearch.harness.source import PDL_PARAM, KernelSource, load_kernels, private_dir

src = KernelSource.parse(Path("kernelsearch/kernels/linear_residual.py").read_text())
fn = load_kernels(src, private_dir())["_gemv_kernel"]
NAMES = ["x_ptr", "w_ptr", "r_ptr", "ws_ptr", "c_ptr", "cnt_ptr", "M", "N", "K", "split_steps",
         "s_xm", "s_xk", "s_wn", "s_wk", "s_rm", "s_rn", "s_cm", "s_cn"]
out = {}
for flag in (True, 2):
    sig = dict(zip(NAMES, ["*bf16", "*bf16", "*bf16", "*fp32", "*bf16", "*i32"] + ["i32"] * 12))
    consts = dict(BLOCK_M=1, BLOCK_N=8, BLOCK_K=512, UNROLL=1, LOOP_STAGES=1, DIRECT=True, EVEN_K=True,
                  LAST_REDUCES=False, SPLITS=1, s_xk=1, s_wk=1, s_rn=1, s_cn=1)
    consts[PDL_PARAM] = flag
    sig.update({k: "constexpr" for k in consts})
    div = [NAMES.index(n) for n in ("x_ptr", "w_ptr", "r_ptr", "ws_ptr", "c_ptr", "N", "K", "s_xm", "s_wn")]
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts,
                                 attrs={(i,): [["tt.divisibility", 16]] for i in div}),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 1})
    ptx = k.asm["ptx"]
    wait = ptx.find("griddepcontrol.wait")
    loads = [m.start() for m in re.finditer(r"ld\.(?:volatile\.)?global", ptx)]
    out[str(flag)] = {"waits": ptx.count("griddepcontrol.wait"),
                      "weight_loads_before_wait": sum(1 for m in re.finditer(r"ld\.volatile\.global\.v4", ptx)
                                                       if m.start() < wait),
                      "loads_before_wait": sum(1 for p in loads if p < wait),
                      "volatile_loads": len(re.findall(r"ld\.volatile\.global", ptx))}
print(json.dumps(out))
"""


@needs_gdc
def test_the_sm90_ptx_fetches_the_first_weight_step_before_the_wait_only_with_the_early_flag():
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", _PTX_CHILD], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["True"]["waits"] == 1 and got["True"]["loads_before_wait"] == 0, got
    # the first step's 16-byte volatile loads (8 x 512 bf16 over 128 threads: 4 a thread), kept
    # by the compiler though their values are dropped, and nothing else, before the wait
    assert got["2"]["waits"] == 1 and got["2"]["weight_loads_before_wait"] == 4, got
    assert got["2"]["loads_before_wait"] == got["2"]["weight_loads_before_wait"], got
    assert got["True"]["volatile_loads"] == got["2"]["volatile_loads"] == 4, got


# --- GPU --------------------------------------------------------------------------------------
EARLY_CANDIDATE = '''"""w + x, with the weight loaded first (an early prefix) or x loaded first (not one)."""
import triton
import triton.language as tl


@triton.jit
def _w_first(w_ptr, x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    acc = tl.load(w_ptr + offs, mask=offs < n, other=0.0)
    acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    tl.store(out_ptr + offs, acc, mask=offs < n)


@triton.jit
def _x_first(w_ptr, x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    xs = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    acc = tl.load(w_ptr + offs, mask=offs < n, other=0.0)
    acc += xs
    tl.store(out_ptr + offs, acc, mask=offs < n)


def launch(w, x, out):
    _w_first[(triton.cdiv(x.numel(), 1024),)](w, x, out, x.numel(), BLOCK=1024)
'''


def _plan(kernel: str, n: int) -> plan_mod.Plan:
    launch = plan_mod.Launch(kernel, (-(-n // 1024), 1, 1),
                             (("w_ptr", plan_mod.Ref("w", 0, "float32")), ("x_ptr", plan_mod.Ref("x", 0, "float32")),
                              ("out_ptr", plan_mod.Ref("out", 0, "float32")), ("n", ("int", n)),
                              ("BLOCK", ("int", 1024))), (("num_warps", 4),))
    return plan_mod.Plan((), (launch,))


@pytest.mark.gpu
def test_gpu_an_early_prefix_reads_the_weight_before_the_wait_and_x_after_it():
    from tests.test_pdl import late_writer

    if torch.cuda.get_device_capability() < (9, 0) or late_writer is None:
        pytest.skip("PDL needs sm_90+ and a Triton with gdc ops")
    dev = torch.device("cuda")
    src = KernelSource.parse(EARLY_CANDIDATE)
    assert set(src.early) == {"_w_first", "_x_first"}
    assert "x_ptr" not in src.early["_w_first"][1] and "x_ptr" in src.early["_x_first"][1]
    kernels = load_kernels(src, private_dir())
    n = 1 << 20
    source, w, sink = torch.randn(n, device=dev), torch.randn(n, device=dev), torch.zeros(1, device=dev)
    x, out = torch.empty(n, device=dev), torch.empty(n, device=dev)
    buffers = {"w": w.view(torch.uint8), "x": x.view(torch.uint8), "out": out.view(torch.uint8)}
    stream = torch.cuda.Stream()
    expect = w + source

    def run(launch):
        with torch.cuda.stream(stream):
            x.fill_(float("nan"))
            out.fill_(-1.0)
            late_writer[(1,)](source, x, sink, n, SPIN=200_000, BLOCK=1024)   # x written late
            launch()
        torch.cuda.synchronize()
        return out.clone()

    with run_plan.early_reads(True):
        early = run_plan.bind(_plan("_w_first", n), kernels, buffers, {}, static={"w"})
        waits = run_plan.bind(_plan("_x_first", n), kernels, buffers, {}, static={"w"})
    assert [kw[PDL_PARAM] for _, _, kw in early.calls] == [PDL_EARLY]
    assert [kw[PDL_PARAM] for _, _, kw in waits.calls] == [True]          # its prefix reads x: waits first
    for _ in range(3):
        assert torch.equal(run(early), expect)
        assert torch.equal(run(waits), expect)
    # the control: _x_first launched early by hand reads x before the writer has written it
    fn = kernels["_x_first"]
    control = lambda: fn[(n // 1024,)](w, x, out, n, BLOCK=1024, num_warps=4, launch_pdl=True,
                                       **{PDL_PARAM: PDL_EARLY})
    stale = [bool(torch.isnan(run(control)).any()) for _ in range(3)]
    assert any(stale), "the control never read a stale x: this test could not catch an early read of x"


@pytest.mark.parametrize("kernel, pointers", [("linear_residual", {"w_ptr"}),
                                              ("rmsnorm_linear", {"w_ptr"}),
                                              ("rmsnorm_gate_up_swiglu", {"w_ptr"})])
def test_the_projection_templates_gemv_plans_are_granted_early_reads_of_their_weights(kernel, pointers):
    """The templates' gemv prefixes load only weight pointers, and the plan their launch()
    makes (validated as the dispatch runtime validates it) binds those to the spec's static
    inputs: the launcher grants the early form. A reordered template that loses it fails here,
    not silently in the step."""
    import importlib

    from kernelsearch.harness.verify import make_plan
    from kernelsearch.kernels import template_path
    from kernelsearch.specs import SPECS

    spec, path = SPECS[kernel], template_path(kernel)
    src = KernelSource.parse(Path(path).read_text())
    reads = src.early["_gemv_kernel"][1]
    assert {r for r in reads if r.endswith("_ptr")} == pointers
    params = next(p for p in importlib.import_module(f"kernelsearch.kernels.{kernel}").CONFIGS
                  if p["variant"] == "gemv" and p.get("SPLIT_K", 1) == 1)
    shape = {"M": 1, "K": 256, "N": 64} if kernel != "rmsnorm_gate_up_swiglu" else {"M": 1, "K": 256, "I": 64}
    sig = spec.signature(shape, "float32")
    plan = plan_mod.validate(
        make_plan(kernel, path, shape, "float32", params, "cpu"), kernels=src.kernels,
        roles={a["name"]: plan_mod.DTYPE_SIZES[a["dtype"]] * max(1, int(torch.tensor(a["shape"]).prod()))
               for a in sig if a["kind"] == "tensor"},
        inputs={a["name"] for a in sig if a.get("role") == "input"},
        inouts={a["name"] for a in sig if a.get("role") == "inout"},
        scalars={a["name"] for a in sig if a["kind"] == "scalar"}, workspace_budget_bytes=1 << 30)
    step = next(st for st in plan.steps if getattr(st, "kernel", None) == "_gemv_kernel")
    fn = _fake_kernel(reads)
    with run_plan.early_reads(True):
        assert run_plan._reads_early(step, fn, frozenset(spec.static_inputs), set())
        assert not run_plan._reads_early(step, fn, frozenset(["x"]), set())   # x is no weight


@pytest.mark.parametrize("kernel", ["linear_residual", "rmsnorm_linear", "rmsnorm_gate_up_swiglu"])
def test_the_projection_templates_batch32_paths_have_no_early_prefix(kernel):
    """An L2 fetch of the first weight tile at the top of the batch-32 (splitk / swapab) kernel
    made it an early prefix, and early reads then cost the built-in step 2% at batch 32 on the
    H200 (0.7% with the late trigger; BENCHMARKS.md 10g): it was taken out. Put one back only
    with a measurement that says otherwise."""
    from kernelsearch.kernels import template_path

    src = KernelSource.parse(Path(template_path(kernel)).read_text())
    assert "_gemv_kernel" in src.early and "_splitk_kernel" not in src.early
