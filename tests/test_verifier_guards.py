"""The verifier against hostile candidates (CPU: Triton interpreter in the trusted executor).

The property under test: the process that makes inputs, poisons outputs, runs kernels,
compares and times never imports or executes a candidate's Python. Each hack lives in
tests/candidates/hack_*.py (one attack class of the verifier issue each); honest candidates
must pass (tests/test_check_kernel_cli.py runs every spec's through the CLI). Tests named
`test_jail_*` feed the sandbox directly with code the static check would refuse, to prove the
sandbox holds on its own.
"""
import json
import math
import os
import socket
import time
from pathlib import Path

import pytest

from kernelsearch.harness import Verdict, evaluate, keep, noise_band
from kernelsearch.harness import plan as plan_mod
from kernelsearch.harness.plan_client import device_info, request_plans
from kernelsearch.harness.source import KernelSource, SourceError, load_kernels, private_dir
from kernelsearch.specs import SPECS

CANDIDATES = Path(__file__).parent / "candidates"
SMALL = [{"M": 5, "N": 1000}]
ROOT_ONLY = os.geteuid() == 0


def check(name, kernel="rmsnorm", shapes=SMALL, time_it=False, **kw) -> Verdict:
    return evaluate(kernel, CANDIDATES / f"{name}.py", device="cpu", shapes=shapes, time_it=time_it,
                    fresh=True, **kw)


def rejected(v: Verdict, guard: str, *words: str) -> None:
    assert not v.accepted, v
    assert v.guard == guard, f"expected guard {guard}, got {v.guard}: {v.reason}"
    for w in words:
        assert w in v.reason, (w, v.reason)


# --- crash, hang, exception are verdicts ------------------------------------------------------
def test_hanging_host_code_is_killed_at_the_timeout():
    started = time.monotonic()
    rejected(check("hack_hang", timeout_s=3), "timeout", "killed")
    assert time.monotonic() - started < 30


def test_kernel_reading_wild_addresses_is_stopped_by_the_interpreter_bounds_check():
    rejected(check("hack_segfault"), "out_of_bounds", "outside the kernel's buffers")
    assert check("honest_rmsnorm").accepted  # the harness goes on to the next candidate


def test_exception_and_memory_error_in_launch_become_verdicts():
    rejected(check("hack_exception"), "exception", "blew up on purpose")
    rejected(check("hack_oom"), "exception", "MemoryError")


def test_an_executor_whose_parent_is_killed_removes_its_work_directory(tmp_path):
    """SIGKILL skips the runner's cleanup; the executor, finding its requests' pipe closed,
    removes the work directory itself (it stayed in /tmp for ever: 120 were found)."""
    import subprocess
    import sys

    script = ("import time\nfrom kernelsearch.harness import runner\n"
              "ex = runner.ExecutorProcess('cpu')\nex.request({'op': 'warm'}, 300)\n"
              "print(ex.workdir, flush=True)\ntime.sleep(600)\n")
    env = dict(os.environ, TMPDIR=str(tmp_path), PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env)
    try:
        workdir = Path(parent.stdout.readline().strip())
        assert workdir.name.startswith("hwtune-executor-") and workdir.is_dir(), workdir
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 60
    while workdir.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not workdir.exists(), sorted(p.name for p in workdir.iterdir())


# --- forging the reply --------------------------------------------------------------------------
def test_a_forged_verdict_printed_by_launch_changes_nothing():
    rejected(check("hack_forge_reply"), "unwritten_output", "poison")


def test_a_reason_from_the_sandbox_is_one_line():
    """launch()'s exception message is part of the reason check-kernel prints: one with newlines
    printed, after the rejection, a line saying the file was accepted."""
    v = check("hack_forge_verdict_line")
    rejected(v, "exception", "accepted (params {})")
    assert "\n" not in v.reason and "\r" not in v.reason, v.reason


@pytest.mark.parametrize("bad, guard", [
    ({"buffers": {}, "steps": [{"op": "launch", "kernel": "print", "grid": [1], "args": {}, "options": {}}]}, "plan"),
    ({"buffers": {}, "steps": []}, "not_triton"),
    ({"buffers": {"w1": {"nbytes": 1 << 40, "dtype": "uint8", "init": "empty", "persistent": False}},
      "steps": []}, "plan"),
    ({"buffers": {"p1": {"nbytes": 64, "dtype": "uint8", "init": "empty", "persistent": True}},
      "steps": []}, "workspace_state"),
    ({"buffers": {}, "steps": [{"op": "zero", "ref": {"buf": "x", "offset": 0, "dtype": "uint8"},
                                "nbytes": 4}]}, "input_mutated"),
])
def test_a_forged_or_broken_plan_is_refused_before_anything_runs(bad, guard):
    src = KernelSource.parse((CANDIDATES / "honest_rmsnorm.py").read_text())
    with pytest.raises(plan_mod.PlanInvalid) as info:
        plan_mod.validate(bad, kernels=src.kernels, roles={"x": 20000, "weight": 4000, "out": 20000},
                          inputs={"x", "weight"}, scalars={"eps"}, workspace_budget_bytes=1 << 30)
    assert info.value.guard == guard


def honest_rmsnorm_step() -> dict:
    """A valid launch step of candidates/honest_rmsnorm.py's kernel (a fresh dict each call)."""
    return {"op": "launch", "kernel": "_rmsnorm_row", "grid": [5], "options": {"num_warps": 4},
            "args": {"x_ptr": {"ref": {"buf": "x", "offset": 0, "dtype": "float32"}},
                     "w_ptr": {"ref": {"buf": "weight", "offset": 0, "dtype": "float32"}},
                     "out_ptr": {"ref": {"buf": "out", "offset": 0, "dtype": "float32"}},
                     "n_cols": {"int": 1000}, "eps": {"scalar": ["arg", "eps"]}, "BLOCK_N": {"int": 1024}}}


def validate_honest_rmsnorm(step: dict):
    """plan.validate of a one-step plan against honest_rmsnorm.py's kernels and rmsnorm's roles."""
    src = KernelSource.parse((CANDIDATES / "honest_rmsnorm.py").read_text())
    return plan_mod.validate({"buffers": {}, "steps": [step]}, kernels=src.kernels,
                             roles={"x": 20000, "weight": 4000, "out": 20000}, inputs={"x", "weight"},
                             scalars={"eps"}, workspace_budget_bytes=1 << 30)


def test_plan_arguments_are_checked_against_the_kernel_signature():
    ok = honest_rmsnorm_step()
    attempt = validate_honest_rmsnorm
    assert attempt(ok).launches == 1
    for change in ({"BLOCK_N": {"ref": {"buf": "x", "offset": 0, "dtype": "float32"}}},   # constexpr = buffer
                   {"extra": {"int": 1}},                                                   # unknown parameter
                   {"eps": {"scalar": ["arg", "seed"]}},                                    # unknown scalar
                   {"eps": {"scalar": ["exec", ["const", 1.0]]}},                          # unknown operator
                   {"x_ptr": {"ref": {"buf": "x", "offset": 3, "dtype": "float32"}}},     # misaligned view
                   {"x_ptr": {"ref": {"buf": "elsewhere", "offset": 0, "dtype": "float32"}}}):
        step = json.loads(json.dumps(ok))
        step["args"].update(change)
        with pytest.raises(plan_mod.PlanInvalid):
            attempt(step)
    for bad_opts in ({"num_warps": 3}, {"num_stages": 99}, {"pre_hook": 1}):
        with pytest.raises(plan_mod.PlanInvalid):
            attempt(dict(ok, options=bad_opts))
    with pytest.raises(plan_mod.PlanInvalid):
        attempt(dict(ok, grid=[1, 1, 1, 1]))


# --- compute outside Triton, in or around a kernel body ----------------------------------------
@pytest.mark.parametrize("name, words", [
    ("hack_fake_jit", ["decorator jit is not triton.jit"]),
    ("hack_numpy_in_kernel", ["name 'np' not allowed", ".data"]),
    ("hack_torch_in_kernel", ["name 'torch' not allowed"]),
    ("hack_handle_in_kernel", [".handle"]),
    ("hack_tl_internals", ["tl.core.tensor"]),
    ("hack_dunder_in_kernel", ["__globals__"]),
    ("hack_import_by_string", ["__import__"]),
    ("hack_thread_compute", ["import threading"]),
    ("hack_setprofile", ["import sys"]),
    ("hack_typing_sys", [".sys"]),
    ("hack_tl_math_wraps", ["tl.math.wraps is not an allowed"]),
    ("hack_device_print_flood", ["tl.device_print is not an allowed"]),
    ("hack_default_list_state", ["default of CALLS must be a literal"]),
])
def test_compute_outside_triton_is_refused_by_the_allowlist(name, words):
    rejected(check(name), "static", *words)


def test_torch_compute_in_launch_cannot_be_planned():
    rejected(check("hack_torch_compute"), "plan", "mul_", "no torch compute")
    rejected(check("hack_torch_matmul", kernel="matmul", shapes=[{"M": 1, "K": 8, "N": 8}]), "exception",
             "matmul")
    rejected(check("hack_no_launch"), "plan", "no torch compute")


@pytest.mark.parametrize("snippet", [
    "import ctypes", "import subprocess", "import os", "import torch.nn.functional as F",
    "from kernelsearch.harness import compare", "f = open('/etc/passwd')", "y = a @ b",
    "torch.backends.cuda.matmul.allow_tf32 = True", "x.__class__", "class A: pass",
    "import operator\nf = operator.attrgetter('cpu')", "print('hi')", "exec('1')",
    "if __name__ == '__main__': pass", "import numpy", "from triton.runtime import interpreter",
    "from typing import _eval_type", "import functools\nf = functools._lru_cache_wrapper",
    "f = '{0.__class__}'.format", "f = '{0.__class__}'.format_map", "from functools import wraps",
    "import typing\nf = typing.types", "f = type",
])
def test_static_allowlist_refuses_host_escapes(snippet):
    base = (CANDIDATES / "honest_rmsnorm.py").read_text()
    with pytest.raises(SourceError):
        KernelSource.parse(base + "\n" + snippet + "\n")


def test_trusted_module_holds_only_the_checked_kernels_and_literals(tmp_path):
    text = (Path(__file__).parents[1] / "kernelsearch" / "kernels" / "matmul.py").read_text()
    src = KernelSource.parse(text)
    generated = src.module_text()
    for absent in ("def launch", "import torch", "def _valid", "CONFIGS", "_arrival_counters", "_cfg"):
        assert absent not in generated, absent
    kernels = load_kernels(src, private_dir())
    assert set(kernels) == {"_tiled_kernel", "_splitk_kernel", "_splitk_reduce_kernel"}
    module = __import__("sys").modules[f"hwtune_kernels_{src.sha256[:16]}"]
    assert "launch" not in vars(module) and "torch" not in vars(module)
    assert "open" not in module.__builtins__ and "__import__" not in module.__builtins__


def test_a_docstring_holding_a_second_def_of_the_kernel_never_runs():
    """Triton's interpreter compiles a kernel from the last line of its source that starts with
    "def ": a kernel docstring holding one ran unchecked Python in the trusted process. On this
    Triton the grid-dependency wait the harness puts first hid it (the docstring was then a plain
    string); a Triton without the gdc ops (triton>=3.0 is allowed) had no such wait."""
    import subprocess
    import sys

    code = ("import os, torch; from kernelsearch.harness import source; "
            "source.gdc_available = lambda: False; "
            f"src = source.KernelSource.parse(open({str(CANDIDATES / 'hack_docstring_second_def.py')!r}).read()); "
            "k = source.load_kernels(src, source.private_dir())['_rmsnorm_row']; out = torch.full((2, 8), 7.0); "
            "k[(2,)](torch.randn(2, 8), torch.ones(8), out, 8, 1e-6, BLOCK_N=8); "
            "print(os.environ.get('HWTUNE_RED_SECOND_DEF', 'not run'), bool(out.eq(0).all()))")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env.pop("HWTUNE_RED_SECOND_DEF", None)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).parents[1])
    assert done.stdout.split() == ["not", "run", "True"], (done.stdout, done.stderr[-2000:])
    rejected(check("hack_docstring_second_def"), "correctness")


# --- patching what the harness relies on ---------------------------------------------------------
@pytest.mark.parametrize("name", ["hack_patch_tensor_methods", "hack_patch_builtins",
                                  "hack_replace_interpreter", "hack_setattr_patch",
                                  "hack_patch_harness_clock", "hack_tf32_flag", "hack_pre_run_hook",
                                  "hack_detect_harness", "hack_patch_timer", "hack_patch_compare"])
def test_patching_the_harness_is_refused(name):
    rejected(check(name), "static")


@pytest.mark.parametrize("name", ["hack_rng_at_import", "hack_background_thread", "hack_flush_denormal"])
def test_what_the_allowlist_lets_through_stays_in_the_sandbox(name):
    """These only reach the stand-in torch of the sandbox, which has no such functions."""
    v = check(name)
    assert not v.accepted and v.guard == "exception", (v.guard, v.reason)


# --- seeds, inputs, state ---------------------------------------------------------------------
def test_host_code_sees_no_data():
    rejected(check("hack_seed_hunt"), "plan", "tolist", "no data")
    rejected(check("hack_gc_hunt"), "static", "import gc")


def test_the_sandbox_request_holds_shapes_only(monkeypatch):
    import subprocess

    sent = {}
    real = subprocess.Popen.communicate

    def spy(self, input=None, timeout=None):
        sent["request"] = json.loads(input)
        return real(self, input, timeout)
    monkeypatch.setattr(subprocess.Popen, "communicate", spy)
    check("honest_rmsnorm")
    req = sent["request"]
    text = json.dumps(req)
    assert "seed" not in text and "rep_seeds" not in text
    tensors = [a for case in req["cases"] for a in case["args"] if a["kind"] == "tensor"]
    assert tensors and all(set(a) == {"name", "kind", "shape", "strides", "dtype", "role"} for a in tensors)


def test_configs_and_space_are_checked_before_the_harness_uses_them():
    """CONFIGS and SPACE are the candidate's data, as literals or as the sandbox reports them: a
    CONFIGS that is not a list of dicts was indexed (a TypeError, no verdict), and a search listed
    a SPACE of 4096^3 points whole in the trusted process."""
    rejected(check("hack_configs_not_a_list"), "contract", "CONFIGS must be a list")
    rejected(check("hack_space_bomb"), "contract", f"SPACE has {4096 ** 3} points")


def test_a_file_of_gigabytes_is_refused_without_being_read_whole(tmp_path):
    """The verifier read a candidate file whole before its size check, and the search hashed it
    whole: a sparse file of 3 GiB under a 2 GiB address-space limit was a MemoryError traceback."""
    import subprocess
    import sys

    big = tmp_path / "big.py"
    with open(big, "wb") as f:
        f.truncate(3 << 30)
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))\n"
            "from kernelsearch.harness import evaluate; from kernelsearch.ledger import file_hash\n"
            "v = evaluate('rmsnorm', sys.argv[1], device='cpu', shapes=[{'M': 5, 'N': 1000}], time_it=False)\n"
            "print(v.guard, v.reason, len(file_hash(sys.argv[1])))\n")
    out = subprocess.run([sys.executable, "-c", code, str(big)], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).parent.parent)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["static", "file", "larger", "than", "524288", "bytes", "16"], out.stdout


def test_a_failure_deep_in_nested_jit_calls_is_one_short_message():
    """Triton's interpreter wraps an exception from a nested jit call as InterpreterError(repr(e))
    at every level, doubling the backslashes each time: a failure under 48 nested helpers built a
    message of 2^48 bytes in the trusted executor, which took what memory the host had. Under a
    4 GiB address-space limit the verdict names the failure at the bottom, soon."""
    import subprocess
    import sys

    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))\n"
            "from kernelsearch.harness import evaluate\n"
            "v = evaluate('rmsnorm', sys.argv[1], device='cpu', shapes=[{'M': 2, 'N': 64}], time_it=False, "
            "timeout_s=60)\nprint(v.guard, v.reason[:300])\n")
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code, str(CANDIDATES / "hack_nested_error_bomb.py")],
                         capture_output=True, text=True, timeout=300, cwd=Path(__file__).parent.parent)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("exception ") and "Unsupported ptr type" in out.stdout, out.stdout[:600]
    assert time.monotonic() - started < 120


def test_the_cpu_executor_runs_under_a_data_limit():
    """Under the interpreter a kernel's body is Python run in the executor, and Python values
    (a string doubled in a loop) have no tensor-size limit: hack_string_doubling took what memory
    the host had. The CPU executor now has a data limit: the same kernel is out of memory there.
    (Run under a 6 GiB address-space limit, so that a harness without the limit harms nothing.)"""
    import subprocess
    import sys

    from kernelsearch.harness import executor, runner

    ex = runner.ExecutorProcess("cpu")
    try:
        ex.request({"op": "load", "source": (CANDIDATES / "honest_rmsnorm.py").read_text()}, 300)
        limits = Path(f"/proc/{ex.proc.pid}/limits").read_text()
    finally:
        ex.close()
    line = next(l for l in limits.splitlines() if l.startswith("Max data size"))
    assert line.split()[3] == str(executor.CPU_DATA_LIMIT_BYTES), line
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))\n"
            "from kernelsearch.harness import evaluate\n"
            "v = evaluate('rmsnorm', sys.argv[1], device='cpu', shapes=[{'M': 2, 'N': 64}], time_it=False, "
            "timeout_s=60)\nprint(v.guard, v.reason[:300])\n")
    out = subprocess.run([sys.executable, "-c", code, str(CANDIDATES / "hack_string_doubling.py")],
                         capture_output=True, text=True, timeout=300, cwd=Path(__file__).parent.parent)
    assert out.stdout.startswith("out_of_memory ") and "MemoryError" in out.stdout, (out.stdout, out.stderr[-2000:])


def test_a_file_of_thousands_of_kernels_is_refused_at_once():
    """Each kernel's check rebuilt the table of triton.language names and the set of every other
    kernel's name, and the generated module's store analysis went round all kernels once per link
    of a call chain: 13,000 one-line kernels (512 KiB) held the caller 25 s in the static check and
    the executor for minutes, outside any deadline of the first."""
    from kernelsearch.harness.source import MAX_KERNELS

    kernels = "".join(f"@triton.jit\ndef k{i}(p):\n    k{i - 1}(p)\n" for i in range(1, 3000))
    text = ("import triton\nimport triton.language as tl\n\n\n@triton.jit\ndef k0(p):\n    tl.store(p, 1)\n"
            + kernels + "def launch(x, weight, eps, out):\n    k0[(1,)](out)\n")
    started = time.monotonic()
    with pytest.raises(SourceError) as info:
        KernelSource.parse(text)
    assert f"more than {MAX_KERNELS}" in str(info.value)
    assert time.monotonic() - started < 10


def test_a_file_replaced_after_it_was_listed_is_not_checked_in_its_place(tmp_path):
    """The search lists a file under its hash, then its jobs evaluate the path: a file swapped in
    between (honest while checked, the listed one again at inference: the dispatch table held the
    listed hash, so dispatch ran that unchecked text) was checked and recorded under the other's
    hash. A job names the hash it records under; a file that no longer has it is rejected."""
    from kernelsearch.entry import file_sha256

    path = tmp_path / "cand.py"
    path.write_text((CANDIDATES / "hack_partial_write.py").read_text())
    listed = file_sha256(path)
    path.write_text((CANDIDATES / "honest_rmsnorm.py").read_text())
    v = evaluate("rmsnorm", path, device="cpu", shapes=SMALL, time_it=False, fresh=True, source_hash=listed)
    rejected(v, "contract", "changed since it was listed", listed)
    v = evaluate("rmsnorm", path, device="cpu", shapes=SMALL, time_it=False, fresh=True,
                 source_hash=file_sha256(path))
    assert v.accepted, v.reason


def test_memo_and_call_counters_are_not_functions_of_their_arguments():
    rejected(check("hack_memoize"), "workspace_state", "not zero-initialised")
    rejected(check("hack_noise"), "plan", "planned differently")
    rejected(check("hack_call_counter"), "not_triton")


def test_a_counter_kept_across_calls_to_skip_work_is_caught():
    rejected(check("hack_skip_reps"), "workspace_state", "not left all-zero")


def test_caching_per_input_object_gains_nothing():
    """Every plan call gets new symbolic tensors: the id() cache never hits, the plan is the
    honest computation plus a copy, and its time includes both."""
    v = check("hack_cache_same_inputs", time_it=True)
    assert v.accepted, v.reason
    assert all(s.plan is not None and len(s.plan["steps"]) == 2 for s in v.shapes)


def test_poison_sniffing_kernel_leaves_outputs_unwritten():
    rejected(check("hack_sniff_poison"), "unwritten_output", "poison")


def test_partial_write_is_caught_whatever_the_poison():
    for _ in range(3):
        rejected(check("hack_partial_write"), "unwritten_output", "1000 of 5000")


def test_input_mutation_is_caught():
    rejected(check("hack_mutate_input"), "input_mutated", "x modified")


def test_an_input_used_as_scratch_and_put_back_is_caught():
    """Inputs were compared only after the call, and any store inside the launch's buffers
    passed the interpreter's bounds check: x scribbled on and restored was accepted."""
    rejected(check("hack_scribble_input", time_it=True), "input_mutated", "input x modified", "store")


def test_write_past_the_output_is_out_of_bounds():
    rejected(check("hack_oob_write"), "out_of_bounds", "past the end of out")


def test_a_kernel_relying_on_the_interpreters_program_order_is_caught():
    """The interpreter ran a grid's programs in order, program 0 first: a kernel whose other
    programs read, unsynchronised, what program 0 wrote into a scratch buffer (a race on a GPU)
    was accepted on the CPU. Programs now run in an order drawn per launch."""
    v = check("hack_program_order", shapes=[{"M": 5, "N": 1000}, {"M": 33, "N": 257}])
    assert not v.accepted and v.guard in ("unwritten_output", "correctness", "nondeterministic"), v


def test_nondeterministic_kernel_is_rejected_even_within_tolerance():
    rejected(check("hack_scratch_noise"), "nondeterministic", "differs between two runs")


# --- specialising to the test -----------------------------------------------------------------
def test_candidate_right_only_on_published_widths_fails_on_the_shape_drawn_at_random():
    v = check("hack_published_only", shapes=SPECS["rmsnorm"].shapes("cpu"))
    assert not v.accepted and "drawn at random" in v.reason, v.reason
    assert all(s.status == "ok" for s in v.shapes if not s.random)


@pytest.mark.parametrize("kernel", ["rmsnorm", "add_rmsnorm", "softmax", "swiglu"])
def test_the_cpu_shape_drawn_at_random_reaches_past_the_published_sizes(kernel):
    """Drawn below the published sweep's largest sizes (M 1..6 against 33, N 1..700 against
    3000), the random shape left every size between unchecked on the CPU."""
    import random

    spec = SPECS[kernel]
    rng = random.Random(0)
    draws = [spec.random_shape(rng, "cpu") for _ in range(300)]
    for dim in draws[0]:
        assert max(d[dim] for d in draws) > max(s[dim] for s in spec.shapes("cpu")), dim


def test_candidate_right_only_on_the_rows_the_cpu_drew_fails():
    for _ in range(6):   # M drawn past 6 and not 33: 82% of draws
        v = check("hack_rows_between", shapes=SMALL)
        if not v.accepted:
            break
    rejected(v, "unwritten_output", "drawn at random")


def test_candidate_right_only_for_small_rows_fails_on_the_wide_shape():
    v = check("hack_small_only", shapes=[{"M": 1, "N": 128}, {"M": 4, "N": 3000}])
    rejected(v, "correctness", "N=3000")
    assert v.shapes[0].status == "ok" and v.shapes[1].status == "rejected"


def test_every_shape_is_checked_on_every_input_distribution():
    """Two distributions per shape, chosen by its place in the sweep: the first shape saw only
    normal and tiny inputs, and a softmax without its max subtraction there was accepted."""
    v = check("hack_dist_per_shape", kernel="softmax", shapes=[{"M": 1, "N": 128}])
    rejected(v, "unwritten_output", "M=1 N=128", "NaN")
    assert "huge inputs" in v.reason or "rows inputs" in v.reason, v.reason


def test_hard_coded_eps_fails_because_eps_is_drawn_per_trial():
    for _ in range(3):
        rejected(check("hack_fixed_eps"), "correctness")


def test_a_kernel_wrong_only_at_the_eps_models_pass_is_caught():
    """eps was drawn log-uniformly in 1e-6..1e-2 for every check, never exactly 1e-5 or 1e-6:
    a kernel writing zeros at just those values was accepted."""
    rejected(check("hack_typical_eps"), "correctness", "eps=1e-06")


def test_a_kernel_wrong_only_at_exact_zeros_is_caught():
    """Inputs came from randn, which never holds an exact zero: a kernel writing NaN where
    x == 0 was accepted."""
    rejected(check("hack_exact_zero"), "unwritten_output", "NaN")


def test_branching_on_a_scalar_argument_cannot_be_planned():
    rejected(check("hack_branch_on_eps"), "plan", "scalar argument")


# --- process state, processes, files ------------------------------------------------------------
@pytest.mark.parametrize("name, words", [
    ("hack_backends_flag", [".backends"]), ("hack_switch_interval", ["import sys"]),
    ("hack_putenv", ["import os"]), ("hack_detached_process", ["import os"]),
    ("hack_write_outside", ["open"]), ("hack_typing_eval_type", ["._eval_type"]),
    ("hack_match_dunder", ["match statements"]), ("hack_string_annotation", ["string annotation"]),
    ("hack_code_replace", [".gi_code", "name type"]), ("hack_update_wrapper", [".update_wrapper", "name type"]),
    ("hack_forward_ref_alias", [".singledispatch"]), ("hack_typing_builtins", [".stdlib_re"]),
])
def test_process_state_and_host_escapes_are_refused(name, words):
    rejected(check(name), "static", *words)


HOSTILE_PREFIX = "import typing\n_os = typing.sys.modules['os']\n"   # what the static check refuses


def _jail(body: str, timeout_s=20, user="default"):
    text = HOSTILE_PREFIX + (CANDIDATES / "honest_rmsnorm.py").read_text() + "\n" + body
    return request_plans(text, SPECS["rmsnorm"], [({"M": 2, "N": 8}, "float32")], [{}], device_info("cpu"),
                         timeout_s=timeout_s, user=user)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_jail_kills_and_reports_a_detached_process_left_behind(tmp_path):
    pidfile = tmp_path / "pid"
    os.chmod(tmp_path, 0o777)
    reply = _jail(f"""
_pr, _pw = _os.pipe()
if _os.fork() == 0:
    _os.setsid()
    if _os.fork() == 0:
        _os.write(_pw, str(_os.getpid()).encode())
        while True:
            pass
    _os._exit(0)
_os.wait()
LEAK = _os.read(_pr, 20).decode()
""")
    assert reply["leftover"], reply
    pid = reply["leftover"][0]["pid"]
    time.sleep(0.2)
    assert not _alive(pid), "the jail must kill what the candidate left behind"
    v_reason = check("hack_detached_process").reason
    assert "import os" in v_reason


@pytest.mark.skipif(not ROOT_ONLY, reason="dropping to an unprivileged user needs root")
def test_jail_runs_host_code_as_nobody_without_network_or_writable_files(tmp_path):
    secret = tmp_path / "root-only.txt"
    secret.write_text("secret")
    os.chmod(secret, 0o600)
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    outside = Path("/tmp") / f"hwtune-jail-probe-{os.getpid()}"
    reply = _jail(f"""
facts = [str(_os.getuid()), str(_os.getgid()), str(_os.getgroups())]
try:
    _os.open({str(secret)!r}, _os.O_RDONLY)
    facts.append("read-secret")
except OSError:
    facts.append("no-secret")
try:
    fd = _os.open({str(outside)!r}, _os.O_WRONLY | _os.O_CREAT, 0o644)
    _os.write(fd, b"x")
    facts.append("wrote")
except OSError:
    facts.append("no-write")
_socket = typing.sys.modules.get("socket")
facts.append("socket-module" if _socket else "no-socket-module")
raise RuntimeError("|".join(facts))
""")
    server.close()
    assert not outside.exists(), "a write outside its directory must not reach the host"
    reason = reply.get("reason", "")
    if reply.get("guard") == "crash":  # SIGXFSZ: RLIMIT_FSIZE stopped the write
        return
    assert "65534" in reason and "no-secret" in reason, reason
    assert "user nobody" in " ".join(reply.get("isolation") or ["user nobody"])


@pytest.mark.skipif(not ROOT_ONLY, reason="network namespaces need root")
def test_jail_has_no_network():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.5)
    port = server.getsockname()[1]
    reply = _jail(f"""
try:
    _socket = typing.sys.modules["importlib"].import_module("socket")
    try:
        _socket.create_connection(("127.0.0.1", {port}), timeout=2)
        raise RuntimeError("connected")
    except OSError as exc:
        raise RuntimeError("connect-failed")
except ImportError:
    raise RuntimeError("import-failed")
""")
    try:
        server.accept()
        connected = True
    except OSError:
        connected = False
    server.close()
    assert not connected and "connected" not in reply.get("reason", "").replace("connect-failed", "")
    assert "net" in reply.get("isolation", ["net"])


def test_jail_patching_its_stand_ins_only_breaks_its_own_plans():
    reply = _jail("""
import torch as _t
_t.empty = lambda *a, **k: 42
_t.zeros = _t.empty
""")
    assert reply["ok"]
    # the honest launch() allocates nothing, so its plan still validates
    src = KernelSource.parse((CANDIDATES / "honest_rmsnorm.py").read_text())
    plan = plan_mod.validate(reply["plans"][0][0], kernels=src.kernels,
                             roles={"x": 64, "weight": 32, "out": 64}, inputs={"x", "weight"},
                             scalars={"eps"}, workspace_budget_bytes=1 << 30)
    assert plan.launches == 1


FORGED_REPLIES = {
    "plans not a list": {"ok": True, "params": [{"num_warps": 4}], "plans": 5},
    "no plan for the params asked": {"ok": True, "params": [{"zzz": 1}], "plans": [[{}], [{}]]},
    "isolation not a list": {"ok": True, "params": [{"num_warps": 4}], "plans": [[{}], [{}]], "isolation": 5},
    "nested 100000 deep": "[" * 100000 + "]" * 100000,
}


@pytest.mark.parametrize("what", list(FORGED_REPLIES))
def test_jail_a_forged_sandbox_reply_is_a_verdict(monkeypatch, what):
    """Host code that got past the static check can write the sandbox's reply itself: the
    trusted side checks its shape (it indexed it, and the jail parsed it, with no verdict)."""
    from kernelsearch.harness import verify

    forged = FORGED_REPLIES[what]
    text = forged if isinstance(forged, str) else json.dumps(forged)
    body = f"""
_data = {text!r}.encode()
for _fd in range(3, 16):
    try:
        _os.write(_fd, len(_data).to_bytes(8, "big") + _data)
    except OSError:
        pass
_os._exit(0)
"""
    real = verify.plan_client.request_plans
    monkeypatch.setattr(verify.plan_client, "request_plans",
                        lambda source, *a, **k: real(HOSTILE_PREFIX + source + body, *a, **k))
    v = check("honest_rmsnorm")
    assert not v.accepted and v.guard in ("plan", "crash"), (v.guard, v.reason)


def test_jail_enforces_its_deadline_on_a_busy_loop():
    started = time.monotonic()
    reply = _jail("while True:\n    pass\n", timeout_s=2)
    assert reply["guard"] == "timeout" and time.monotonic() - started < 15


# --- the rest of the contract ------------------------------------------------------------------
def test_honest_candidate_passes_every_guard_including_timed_runs():
    v = check("honest_rmsnorm", shapes=[{"M": 1, "N": 128}, {"M": 3, "N": 130, "dtype": "bfloat16"}],
              time_it=True)
    assert v.accepted, v.reason
    assert v.params == {"num_warps": 4}  # CONFIGS[0] when no params are given
    timed = [s for s in v.shapes if not s.random]
    assert len(timed) == 2 and len(v.shapes) == 3
    for s in timed:
        assert s.status == "ok" and math.isfinite(s.candidate_ms) and math.isfinite(s.stock_ms)
        assert s.flops > 0 and s.bytes > 0 and s.noise_band is not None and s.plan is not None
    assert timed[1].dtype == "bfloat16"
    assert v.isolation


def test_honest_template_with_a_persistent_zeroed_counter_is_accepted():
    """matmul's split-K REDUCE=last keeps arrival counters across calls and resets them: allowed."""
    template = Path(__file__).parents[1] / "kernelsearch" / "kernels" / "matmul.py"
    params = {"variant": "splitk", "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8,
              "SPLIT_K": 4, "FMA": 0, "num_warps": 4, "num_stages": 2, "REDUCE": "last"}
    v = evaluate("matmul", template, params=params, device="cpu",
                 shapes=[{"M": 1, "K": 256, "N": 96}, {"M": 3, "K": 300, "N": 40}], time_it=True, fresh=True)
    assert v.accepted, v.reason
    assert any(b.startswith("p") for s in v.shapes for b in s.plan["buffers"])


# --- decode attention: lengths and positions ---------------------------------------------------
def test_decode_attention_that_never_reads_the_first_length_is_caught():
    """Sequence 0 was at the full cache length in every checked call: a kernel attending over
    the whole cache for it (with B = 1, ignoring seq_lens altogether) was accepted."""
    v = check("hack_first_seq_full", kernel="decode_attention",
              shapes=[{"B": 1, "Hq": 4, "Hkv": 4, "S": 32, "D": 64}])
    rejected(v, "correctness", "B=1")


@pytest.mark.parametrize("kernel, key, last", [("decode_attention", "seq_lens", 0),
                                               ("rope_kv_attention", "positions", 1)])
def test_attention_draws_calls_with_and_without_a_full_length_sequence(kernel, key, last):
    import torch

    spec = SPECS[kernel]
    shape = {"B": 1, "Hq": 2, "Hkv": 1, "S": 9, "D": 16}
    full, short = 0, 0
    for dist in spec.distributions:
        for seed in range(5):
            x = spec.make_inputs(shape, torch.float32, "cpu", torch.Generator().manual_seed(seed), dist)[key]
            top = shape["S"] - last
            full += int(x.max()) == top
            short += int(x.max()) < top
    assert full and short, (full, short)


# --- in/out tensors (rope_kv_write's KV caches) ---------------------------------------------------
KV_SHAPES = [{"B": 2, "Hq": 4, "Hkv": 2, "D": 16, "S": 6}]


def test_honest_kv_cache_writer_is_accepted_including_timed_runs():
    v = check("honest_rope_kv_write", kernel="rope_kv_write", shapes=KV_SHAPES, time_it=True)
    assert v.accepted, v.reason
    assert all(s.status == "ok" for s in v.shapes)


@pytest.mark.parametrize("name, guard, words", [
    # right slot written, the next slot of every head zeroed: bytes it does not own changed
    ("hack_kv_zero_other_slot", "inout_mutated", ["changed outside the rows the op writes", "k_cache["]),
    # the caches never written: their written rows still hold the poison
    ("hack_kv_no_write", "unwritten_output", ["k_cache", "poison"]),
    # k stored without RoPE: judged on the written rows only, so one wrong slot is not diluted
    ("hack_kv_no_rope_k", "correctness", ["k_cache"]),
    # one row stored past the end of k_cache
    ("hack_kv_write_past", "out_of_bounds", ["k_cache"]),
])
def test_kv_cache_attacks_are_caught_by_the_inout_guards(name, guard, words):
    rejected(check(name, kernel="rope_kv_write", shapes=KV_SHAPES), guard, *words)


def test_an_inout_tensor_cannot_be_zeroed_by_host_code_or_a_forged_plan(tmp_path):
    src_text = (CANDIDATES / "honest_rope_kv_write.py").read_text()
    hacked = src_text.replace("    Hq = H_all - 2 * Hkv\n", "    Hq = H_all - 2 * Hkv\n    k_cache.zero_()\n", 1)
    assert hacked != src_text
    (tmp_path / "hack_zero_cache.py").write_text(hacked)
    v = evaluate("rope_kv_write", tmp_path / "hack_zero_cache.py", device="cpu", shapes=KV_SHAPES,
                 time_it=False, fresh=True)
    rejected(v, "plan", "in/out tensor 'k_cache'")
    src = KernelSource.parse(src_text)
    bad = {"buffers": {}, "steps": [{"op": "zero", "ref": {"buf": "k_cache", "offset": 0, "dtype": "uint8"},
                                     "nbytes": 4}]}
    with pytest.raises(plan_mod.PlanInvalid) as info:
        plan_mod.validate(bad, kernels=src.kernels, roles={"k_cache": 1536, "q_out": 512},
                          inputs={"qkv"}, inouts={"k_cache", "v_cache"}, scalars=set(),
                          workspace_budget_bytes=1 << 30)
    assert info.value.guard == "inout_mutated"


def test_verdict_round_trips_through_json_text():
    v = check("hack_partial_write")
    back = Verdict.from_json(json.dumps(v.to_json()))
    assert back.to_json() == v.to_json()
    assert back.shapes[0].candidate_ms == math.inf and back.time_ms == math.inf


def test_keep_requires_a_win_larger_than_the_noise_band():
    assert keep(0.90, 1.0, 0.05)
    assert not keep(0.97, 1.0, 0.05)
    assert not keep(math.inf, 1.0, 0.0)
    assert not keep(0.5, math.inf, 0.05)     # an incumbent with no time is never beaten
    assert noise_band(1.0, 1.1) == pytest.approx(0.1)


# --- GPU (the H200) ------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("name", ["hack_sync_in_launch", "hack_private_stream", "hack_capture_replay_cache"])
def test_gpu_stream_and_capture_tricks_cannot_be_planned(name):
    v = evaluate("rmsnorm", CANDIDATES / f"{name}.py", device="cuda", shapes=[{"M": 64, "N": 4096}], fresh=True)
    assert not v.accepted and v.guard in ("exception", "plan"), (v.guard, v.reason)


@pytest.mark.gpu
@pytest.mark.parametrize("name, guard", [("hack_oob_write", "out_of_bounds"), ("hack_skip_reps", "workspace_state"),
                                         ("hack_sniff_poison", "unwritten_output"),
                                         ("hack_scratch_noise", "nondeterministic")])
def test_gpu_kernel_attacks_are_caught(name, guard):
    shape = {"M": 64, "N": 4096}
    if name == "hack_scratch_noise":
        # Its noise (1e-5 relative) is below bf16's resolution: in bf16 only the few elements near
        # a rounding boundary flip, at about the run-to-run band. In fp32 it is always visible.
        shape["dtype"] = "float32"
    v = evaluate("rmsnorm", CANDIDATES / f"{name}.py", device="cuda", shapes=[shape], fresh=True)
    rejected(v, guard)


@pytest.mark.gpu
def test_gpu_honest_candidate_is_timed_by_graph_replay():
    v = evaluate("rmsnorm", CANDIDATES / "honest_rmsnorm.py", device="cuda", shapes=[{"M": 4096, "N": 4096}],
                 fresh=True)
    assert v.accepted, v.reason
    assert v.shapes[0].timing == "cuda_graph_replay" and math.isfinite(v.shapes[0].candidate_ms)


def test_an_evaluation_leaves_no_temporary_directories(tmp_path):
    """The executor, its compile workers and the dispatch loader make private directories; none
    outlives the process that made it (an earlier version left one per compile worker)."""
    import subprocess
    import sys

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    code = ("from pathlib import Path; from kernelsearch.harness import evaluate; "
            f"v = evaluate('rmsnorm', Path({str(CANDIDATES / 'honest_rmsnorm.py')!r}), device='cpu', "
            "shapes=[{'M': 2, 'N': 64}], fresh=True); assert v.accepted, v.reason")
    env = {**os.environ, "TMPDIR": str(tmp), "TRITON_INTERPRET": "1"}
    env.pop("HWTUNE_WORK_DIR", None)
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=300,
                   cwd=Path(__file__).parents[1])
    assert sorted(p.name for p in tmp.iterdir()) == []
