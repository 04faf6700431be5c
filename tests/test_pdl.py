"""Programmatic dependent launch (PDL): the harness's grid-dependency wait in every kernel it
compiles, set only by the trusted launcher, never by a candidate.

CPU: the generated module's shape (the wait is every kernel's first statement), the reserved
names, the plan and launcher sides. GPU (sm_90+): a producer that lets the next kernel launch
at once and writes its output late; a kernel launched by the harness's own bind() reads only
what it wrote, while the same kernel without the wait, launched the same way, reads the stale
values (the control that shows the test can fail).
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
from kernelsearch.harness.source import (PDL_EARLY, PDL_PARAM, PDL_WAIT, KernelSource, SourceError, gdc_available,
                                         load_kernels, pdl_trigger, private_dir)

ROOT = Path(__file__).parents[1]
CANDIDATES = Path(__file__).parent / "candidates"
TEMPLATES = sorted((ROOT / "kernelsearch" / "kernels").glob("*.py"))
needs_gdc = pytest.mark.skipif(not gdc_available(), reason="this triton has no gdc_wait (no PDL)")


def _is_call(stmt, name: str) -> bool:
    return (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call)
            and isinstance(stmt.value.func, ast.Name) and stmt.value.func.id == name and not stmt.value.args)


def _assert_only_assigns_and_loads(stmts):
    for st in stmts:
        for node in ast.walk(st):
            assert not isinstance(node, (ast.For, ast.While, ast.AugAssign, ast.Return, ast.With))
            if isinstance(node, ast.Call):
                name = node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id
                assert "store" not in name and "atomic" not in name and "asm" not in name, ast.unparse(node)


@needs_gdc
@pytest.mark.parametrize("path", [p for p in TEMPLATES if p.name != "__init__.py"], ids=lambda p: p.stem)
def test_every_generated_kernel_waits_for_the_previous_grid_before_anything_else(path):
    src = KernelSource.parse(path.read_text())
    tree = ast.parse(src.module_text())
    fns = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
    assert {f.name for f in fns} == set(src.kernels)
    for fn in fns:
        # the text Triton 3.6's interpreter also takes as constexpr ("triton.language.constexpr"
        # it did not: the default False became an int1 tensor and every kernel failed on the CPU)
        assert fn.args.args[-1].arg == PDL_PARAM and ast.unparse(fn.args.args[-1].annotation) == "tl.constexpr"
        assert ast.literal_eval(fn.args.defaults[-1]) is False     # off unless the launcher sets it
        first = fn.body[0]
        assert not first.orelse and len(first.body) == 1 and _is_call(first.body[0], "_hwtune_gdc_wait")
        n_early = src.early.get(fn.name, (0,))[0]
        if not n_early:
            assert isinstance(first, ast.If) and isinstance(first.test, ast.Name) and first.test.id == PDL_PARAM
        else:
            # the early form: the wait first (flag True == 1), or after the prefix (flag 2), and
            # the prefix between them only assigns and loads
            assert ast.unparse(first.test) == f"{PDL_PARAM} == {PDL_WAIT}"
            second = fn.body[1 + n_early]
            assert ast.unparse(second.test) == f"{PDL_PARAM} == {PDL_EARLY}" and _is_call(second.body[0], "_hwtune_gdc_wait")
            _assert_only_assigns_and_loads(fn.body[1:1 + n_early])
            assert sum(ast.unparse(st).count("_hwtune_gdc_wait") for st in fn.body) == 2
        # the candidate's signature (what a plan may set) does not have it
        assert PDL_PARAM not in src.kernels[fn.name].params
    imports = [n for n in tree.body if isinstance(n, ast.ImportFrom) and n.module == "triton.language.extra.cuda"]
    assert {(a.name, a.asname) for i in imports for a in i.names} == {
        ("gdc_launch_dependents", "_hwtune_gdc_launch"), ("gdc_wait", "_hwtune_gdc_wait")}


@needs_gdc
@pytest.mark.parametrize("trigger, calls", [("first", ["_hwtune_gdc_launch", "_hwtune_gdc_wait"]),
                                            ("after-wait", ["_hwtune_gdc_wait", "_hwtune_gdc_launch"]),
                                            ("none", ["_hwtune_gdc_wait"])])
def test_the_trigger_goes_where_hwtune_pdl_trigger_says_and_nothing_precedes_the_wait(monkeypatch, trigger, calls):
    monkeypatch.setenv("HWTUNE_PDL_TRIGGER", trigger)
    src = KernelSource.parse((CANDIDATES / "honest_rmsnorm.py").read_text())
    fn = next(n for n in ast.parse(src.module_text()).body if isinstance(n, ast.FunctionDef))
    assert [s.value.func.id for s in fn.body[0].body] == calls
    text = ast.unparse(fn)   # a trigger beside each wait (the early prefix's two guards), no late one too
    assert text.count("_hwtune_gdc_launch()") == (0 if trigger == "none" else text.count("_hwtune_gdc_wait()"))


@needs_gdc
def test_without_hwtune_pdl_trigger_and_with_an_unknown_one_the_trigger_is_late(monkeypatch):
    src = KernelSource.parse((CANDIDATES / "honest_rmsnorm.py").read_text())
    monkeypatch.setenv("HWTUNE_PDL_TRIGGER", "late")
    late = src.module_text()
    monkeypatch.delenv("HWTUNE_PDL_TRIGGER", raising=False)
    assert pdl_trigger() == "late" and src.module_text() == late
    monkeypatch.setenv("HWTUNE_PDL_TRIGGER", "early")   # not a placement: warned, and the default
    with pytest.warns(RuntimeWarning, match="HWTUNE_PDL_TRIGGER='early'.*using late"):
        assert src.module_text() == late
    fn = next(n for n in ast.parse(late).body if isinstance(n, ast.FunctionDef))
    assert [s.value.func.id for s in fn.body[0].body] == ["_hwtune_gdc_wait"]   # the wait first, alone
    assert ast.unparse(fn).count("_hwtune_gdc_launch()") == 1


def _guards(fn, name):
    """Indices of fn's top-level `if _hwtune_pdl: <name>()` statements."""
    return [i for i, s in enumerate(fn.body) if isinstance(s, ast.If) and isinstance(s.test, ast.Name)
            and s.test.id == PDL_PARAM and any(_is_call(b, name) for b in s.body)]


@needs_gdc
def test_a_late_trigger_goes_before_the_first_statement_that_stores_and_the_wait_stays_first(monkeypatch):
    monkeypatch.setenv("HWTUNE_PDL_TRIGGER", "late")
    snippet = ("@triton.jit\ndef _put(p, v):\n    tl.store(p, v)\n\n\n"
               "@triton.jit\ndef _k(x_ptr, n):\n    a = 0.0\n    for i in range(n):\n        a += tl.load(x_ptr + i)\n"
               "    _put(x_ptr + 1, a)\n    tl.store(x_ptr, a)\n")
    base = "import triton\nimport triton.language as tl\n\n\ndef launch(x):\n    pass\n\n\n"
    fns = {n.name: n for n in ast.parse(KernelSource.parse(base + snippet).module_text()).body
           if isinstance(n, ast.FunctionDef)}
    k = fns["_k"]
    assert _guards(k, "_hwtune_gdc_wait") == [0] and len(k.body[0].body) == 1   # the wait, first, alone
    (i,) = _guards(k, "_hwtune_gdc_launch")
    assert isinstance(k.body[i - 1], ast.For) and ast.unparse(k.body[i + 1]).startswith("_put(")  # a helper that stores
    # the templates: after the main loop (a For), before the epilogue
    src = KernelSource.parse((ROOT / "kernelsearch" / "kernels" / "linear.py").read_text())
    gemv = next(n for n in ast.parse(src.module_text()).body if isinstance(n, ast.FunctionDef)
                and n.name == "_gemv_kernel")
    (i,) = _guards(gemv, "_hwtune_gdc_launch")
    assert _guards(gemv, "_hwtune_gdc_wait") == [0]
    assert any(isinstance(s, ast.For) for s in gemv.body[:i]) and not any(isinstance(s, ast.For) for s in gemv.body[i:])


@pytest.mark.parametrize("snippet", [
    # a parameter, a local, a global, a keyword and a host name the harness's own names would meet
    ("@triton.jit\ndef _k(x_ptr, _hwtune_pdl: tl.constexpr = True):\n    tl.store(x_ptr, 1.0)\n"),
    ("@triton.jit\ndef _k(x_ptr):\n    _hwtune_gdc_wait = 1\n    tl.store(x_ptr, 1.0)\n"),
    "_hwtune_gdc_wait = 0\n",
    ("@triton.jit\ndef _k(x_ptr):\n    _rmsnorm_row(x_ptr, x_ptr, x_ptr, 1, 1.0, 2, _hwtune_pdl=True)\n"),
    "def _hwtune_helper():\n    return 1\n",
])
def test_names_the_harness_adds_are_refused_in_a_candidate(snippet):
    base = (CANDIDATES / "honest_rmsnorm.py").read_text()
    with pytest.raises(SourceError, match="reserved for the harness"):
        KernelSource.parse(base + "\n" + snippet)


@pytest.mark.parametrize("snippet, words", [
    ("from triton.language.extra.cuda import gdc_launch_dependents\n", "not allowed"),
    ("import triton.language.extra.cuda as cu\n", "not allowed"),
    ("@triton.jit\ndef _k(x_ptr):\n    tl.extra.cuda.gdc_launch_dependents()\n    tl.store(x_ptr, 1.0)\n",
     "not an allowed triton.language name"),
    # nor through inline PTX (which could also read timers or trap): refused outright
    ("@triton.jit\ndef _k(x_ptr):\n    v = tl.load(x_ptr)\n    w = tl.inline_asm_elementwise("
     "'griddepcontrol.launch_dependents; mov.b32 $0, $1;', '=r,r', [v], dtype=tl.int32, is_pure=False, "
     "pack=1)\n    tl.store(x_ptr, w)\n", "inline_asm_elementwise is not an allowed"),
    ("@triton.jit\ndef _k(x_ptr):\n    f = triton.language.inline_asm_elementwise\n    tl.store(x_ptr, 1.0)\n",
     "not an allowed"),
])
def test_a_candidate_cannot_call_the_grid_dependency_ops_itself(snippet, words):
    # a kernel that let the next one launch early, or waited where it chose, is the harness's
    # business only
    base = (CANDIDATES / "honest_rmsnorm.py").read_text()
    with pytest.raises(SourceError, match=words):
        KernelSource.parse(base + "\n" + snippet)


def test_a_plan_cannot_set_the_wait_flag_or_launch_pdl_itself():
    from test_verifier_guards import honest_rmsnorm_step, validate_honest_rmsnorm as attempt

    step = honest_rmsnorm_step()
    assert attempt(step).launches == 1
    forged = json.loads(json.dumps(step))
    forged["args"][PDL_PARAM] = {"bool": False}
    with pytest.raises(plan_mod.PlanInvalid, match="no parameter"):
        attempt(forged)
    for opts in ({"launch_pdl": True}, {"launch_pdl": False}, {"launch_cooperative_grid": True}):
        with pytest.raises(plan_mod.PlanInvalid, match="not allowed"):
            attempt(dict(step, options=opts))


def _jit(params: str):
    """A compiled (not interpreted) jit function with these parameters, as load_kernels gives."""
    import triton.runtime.jit as jit_mod

    fn = jit_mod.JITFunction.__new__(jit_mod.JITFunction)
    fn.arg_names = params.split(",")
    return fn


def test_the_launcher_sets_pdl_only_on_sm90_cuda_for_compiled_kernels_that_wait(monkeypatch):
    waits = _jit(f"x_ptr,{PDL_PARAM}")
    assert run_plan.pdl_kwargs(waits, torch.device("cpu")) == {}
    monkeypatch.setattr(run_plan, "_sm90", {0: True, 1: False})
    assert run_plan.pdl_kwargs(waits, torch.device("cuda", 0)) == {PDL_PARAM: True, "launch_pdl": True}
    assert run_plan.pdl_kwargs(waits, torch.device("cuda", 1)) == {}        # older than sm_90
    assert run_plan.pdl_kwargs(_jit("x_ptr"), torch.device("cuda", 0)) == {}   # a Triton without gdc ops

    class Interpreted:   # TRITON_INTERPRET=1: the interpreter has no gdc ops, whatever the tensors
        arg_names = ["x_ptr", PDL_PARAM]
    assert run_plan.pdl_kwargs(Interpreted(), torch.device("cuda", 0)) == {}
    with run_plan.pdl(False):
        assert not run_plan.pdl_enabled()
        assert run_plan.pdl_kwargs(waits, torch.device("cuda", 0)) == {}
    assert run_plan.pdl_enabled()


@pytest.mark.parametrize("value, on", [("0", False), ("off", False), ("1", True), ("", True)])
def test_hwtune_pdl_in_the_environment_turns_it_off(value, on):
    env = dict(os.environ, HWTUNE_PDL=value)
    out = subprocess.run([sys.executable, "-c", "from kernelsearch.harness import run_plan; "
                          "print(run_plan.pdl_enabled())"], env=env, cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout.strip()
    assert out == str(on)


@needs_gdc
def test_bind_on_the_cpu_interpreter_runs_the_kernel_without_pdl():
    # TRITON_INTERPRET must be set before triton is imported: a child process
    script = f"""
import torch
from kernelsearch.harness import run_plan
from kernelsearch.harness.source import PDL_PARAM, KernelSource, load_kernels, private_dir
from tests.test_pdl import COPY_CANDIDATE, _copy_plan
kernels = load_kernels(KernelSource.parse(COPY_CANDIDATE), private_dir())
x = torch.randn(3000)
out = torch.full_like(x, float("nan"))
bound = run_plan.bind(_copy_plan(x.numel()), kernels, {{"x": x.view(torch.uint8), "out": out.view(torch.uint8)}}, {{}})
assert all(PDL_PARAM not in kw and "launch_pdl" not in kw for _, _, kw in bound.calls)
bound()
assert torch.equal(out, x)
print("ok")
"""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


# --- GPU --------------------------------------------------------------------------------------
COPY_CANDIDATE = '''"""A copy kernel in the form of a candidate file."""
import triton
import triton.language as tl


@triton.jit
def _copy(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)


def launch(x, out):
    _copy[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), BLOCK=1024)
'''


def _copy_plan(n: int) -> plan_mod.Plan:
    launch = plan_mod.Launch("_copy", (-(-n // 1024), 1, 1),
                             (("x_ptr", plan_mod.Ref("x", 0, "float32")), ("out_ptr", plan_mod.Ref("out", 0, "float32")),
                              ("n", ("int", n)), ("BLOCK", ("int", 1024))), (("num_warps", 4),))
    return plan_mod.Plan((), (launch,))


try:
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents
except ImportError:  # pragma: no cover - a Triton without gdc ops: the GPU test skips
    late_writer = None
else:
    @triton.jit
    def late_writer(src_ptr, dst_ptr, sink_ptr, n, SPIN: tl.constexpr, BLOCK: tl.constexpr):
        """Lets the next kernel in the stream launch at once, spins, then writes dst."""
        gdc_launch_dependents()
        acc = tl.load(sink_ptr)
        for _ in range(SPIN):
            acc = acc * 0.999999 + 1e-6
        tl.store(sink_ptr, acc)
        for start in range(0, n, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=offs < n), mask=offs < n)


@pytest.mark.gpu
def test_gpu_a_kernel_launched_with_pdl_reads_only_what_the_previous_kernel_wrote():
    if torch.cuda.get_device_capability() < (9, 0) or late_writer is None:
        pytest.skip("PDL needs sm_90+ and a Triton with gdc ops")
    dev = torch.device("cuda")
    src = KernelSource.parse(COPY_CANDIDATE)
    kernels = load_kernels(src, private_dir())
    n = 1 << 20
    plan = _copy_plan(n)
    writer = late_writer
    source = torch.randn(n, device=dev)
    sink = torch.zeros(1, device=dev)

    stream = torch.cuda.Stream()   # on the legacy default stream the control saw no stale value (H200)

    def eager(launch, dst, out):
        with torch.cuda.stream(stream):
            dst.fill_(float("nan"))
            out.fill_(-1.0)
            writer[(1,)](source, dst, sink, n, SPIN=200_000, BLOCK=1024)   # ~0.1-1 ms of spinning first
            launch()
        torch.cuda.synchronize()
        return out.clone()

    def graphed(launch, dst, out):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            with torch.cuda.graph(graph, stream=stream):
                writer[(1,)](source, dst, sink, n, SPIN=200_000, BLOCK=1024)
                launch()
        results = []
        for _ in range(3):
            dst.fill_(float("nan"))
            out.fill_(-1.0)
            torch.cuda.synchronize()
            graph.replay()
            torch.cuda.synchronize()
            results.append(out.clone())
        return results

    dst, out = torch.empty(n, device=dev), torch.empty(n, device=dev)
    bound = run_plan.bind(plan, kernels, {"x": dst.view(torch.uint8), "out": out.view(torch.uint8)}, {})
    assert all(kw.get("launch_pdl") and kw.get(PDL_PARAM) for _, _, kw in bound.calls)
    # the control: the same compiled kernel launched with PDL, its wait switched off (the flag
    # left at its default): it reads dst before the writer has written it
    fn = kernels["_copy"]
    no_wait = lambda: fn[plan.steps[0].grid](dst, out, n, BLOCK=1024, num_warps=4, launch_pdl=True)
    for _ in range(3):
        assert torch.equal(eager(bound, dst, out), source)
    controls = [eager(no_wait, dst, out)]
    for got in graphed(bound, dst, out):          # as the dispatch runtime runs it
        assert torch.equal(got, source)
    controls += graphed(no_wait, dst, out)
    stale = [bool(torch.isnan(c).any()) for c in controls]
    assert any(stale), "no control saw a stale value: this test could not catch a missing wait"
