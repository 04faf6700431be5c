"""Every verifier guard, fed the hack it stops (CPU: Triton interpreter in the child).

Guard numbers follow issue 3 / kernelsearch.harness's docstring. Each hack lives in
tests/candidates/hack_*.py; the honest candidates must pass (tests/test_check_kernel_cli.py
runs them through the CLI).
"""
import json
import math
import os
from pathlib import Path

import pytest
import torch

from kernelsearch.harness import Verdict, evaluate, keep, noise_band
from kernelsearch.harness import sandbox, static_check, tensor_io
from kernelsearch.harness.runner import ChildFailure, ChildProcess

CANDIDATES = Path(__file__).parent / "candidates"
SMALL = [{"M": 5, "N": 1000}]


def check(name, kernel="rmsnorm", shapes=SMALL, time_it=False, **kw) -> Verdict:
    return evaluate(kernel, CANDIDATES / f"{name}.py", device="cpu", shapes=shapes, time_it=time_it, **kw)


def rejected(v: Verdict, guard: str) -> None:
    assert not v.accepted, v
    assert v.guard == guard, f"expected guard {guard}, got {v.guard}: {v.reason}"


# -- 1: child process, hard timeout, crash / exception / OOM are verdicts -----------------
def test_guard1_hanging_candidate_is_killed_at_the_timeout():
    v = check("hack_hang", timeout_s=5)
    rejected(v, "timeout")
    assert "SIGKILL" in v.reason


def test_guard1_segfaulting_kernel_is_a_crash_verdict_not_a_harness_failure():
    v = check("hack_segfault")
    rejected(v, "crash")
    assert "SIGSEGV" in v.reason
    # the harness survives and goes on to the next candidate
    assert check("honest_rmsnorm").accepted


def test_guard1_exception_and_memory_error_become_verdicts():
    v = check("hack_exception")
    rejected(v, "exception")
    assert "blew up on purpose" in v.reason
    rejected(check("hack_oom"), "out_of_memory")


def test_guard1_child_that_exits_without_answering_is_a_crash(tmp_path):
    child = ChildProcess("cpu", str(tmp_path))
    try:
        with pytest.raises(ChildFailure) as info:
            child.request({"op": "load", "kernel": "rmsnorm",
                           "source_path": str(CANDIDATES / "hack_exit_at_import.py")}, 300)
    finally:
        child.close()
    assert info.value.guard == "crash" and "exited with code 3" in info.value.reason


# -- 2: fresh inputs per trial --------------------------------------------------------
def test_guard2_memoizing_candidate_fails_on_the_second_fresh_draw():
    v = check("hack_memoize")
    rejected(v, "correctness")
    assert "trial 2" in v.reason


# -- 3: reference and comparison live in the parent ----------------------------------
def test_guard3_patching_comparison_functions_in_the_child_gains_nothing():
    v = check("hack_patch_compare")
    rejected(v, "correctness")
    assert "relative L2 error 0.5" in v.reason


# -- 4: outputs poisoned, every element checked --------------------------------------
def test_guard4_partial_write_leaves_poison_and_is_rejected():
    v = check("hack_partial_write")
    rejected(v, "unwritten_output")
    assert "1000 of 5000 elements" in v.reason


# -- 5: inputs unchanged --------------------------------------------------------------
def test_guard5_candidate_that_overwrites_its_input_is_rejected():
    v = check("hack_mutate_input")
    rejected(v, "input_mutated")
    assert "x modified" in v.reason


# -- 6: the whole sweep ---------------------------------------------------------------
def test_guard6_candidate_right_only_for_small_rows_fails_on_the_wide_shape():
    v = check("hack_small_only", shapes=[{"M": 1, "N": 128}, {"M": 4, "N": 3000}])
    rejected(v, "correctness")
    assert "N=3000" in v.reason
    assert v.shapes[0].status == "ok" and v.shapes[1].status == "rejected"


# -- 7: must be Triton (static + launch counter + aten op recorder) -------------------
def test_guard7_static_check_refuses_torch_matmul_and_host_escapes():
    v = check("hack_torch_matmul", kernel="matmul", shapes=[{"M": 1, "K": 8, "N": 8}])
    rejected(v, "static")
    assert ".matmul" in v.reason
    src = "import triton\n@triton.jit\ndef k(x):\n    pass\n"
    for bad in ("import ctypes", "import subprocess", "import os", "import torch.nn.functional as F",
                "from kernelsearch.harness import compare", "f = open('/etc/passwd')",
                "y = a @ b", "torch.backends.cuda.matmul.allow_tf32 = True", "x.__class__"):
        assert static_check.check_source(src + bad + "\n"), bad
    assert static_check.check_source("import torch\ndef launch(x):\n    pass\n") == ["no @triton.jit kernel defined"]
    assert static_check.check_source((CANDIDATES / "honest_matmul.py").read_text()) == []


def test_guard7_static_check_refuses_harness_detection_frames_and_attribute_access_by_string():
    rejected(check("hack_detect_harness"), "static")     # honest only under the harness's module name
    v = check("hack_patch_harness_clock")                 # operator.attrgetter("sys._getframe")
    rejected(v, "static")
    assert ".attrgetter" in v.reason
    src = "import torch\nimport triton\n@triton.jit\ndef k(x):\n    pass\n"
    for bad in ("if __name__ == 'hwtune_candidate': pass", "p = __file__", "argv = torch.sys.argv",
                "torch.os.kill(1, 9)", "t = torch.threading.Thread", "from operator import attrgetter",
                "import operator\nf = operator.methodcaller('cpu')", "g = torch.sys._getframe(1).f_globals",
                "from typing import get_type_hints"):
        assert static_check.check_source(src + bad + "\n"), bad


def test_guard7_candidate_that_launches_no_triton_kernel_is_rejected():
    rejected(check("hack_no_launch"), "not_triton")


def test_guard7_torch_compute_op_during_launch_is_recorded_and_rejected():
    v = check("hack_torch_compute")
    rejected(v, "torch_compute")
    assert "mul_" in v.reason


def test_guard7_torch_compute_in_a_pre_run_hook_of_the_kernel_is_rejected():
    v = check("hack_pre_run_hook")
    rejected(v, "torch_compute")
    assert "pre-run hook" in v.reason


# -- 8: the timed path is the checked path ---------------------------------------------
def test_guard8_candidate_that_stops_working_after_three_calls_fails_in_the_timed_runs():
    v = check("hack_call_counter", time_it=True)
    rejected(v, "timed_path")
    assert "timed runs" in v.reason


def test_guard8_candidate_that_replays_a_result_cached_for_the_same_inputs_fails_in_the_timed_runs():
    """Each check trial has new tensors, so caching by input object is right there; the timed
    calls reuse the buffers, and get fresh values in them, so the cached copy is stale."""
    v = check("hack_cache_same_inputs", time_it=True)
    rejected(v, "timed_path")
    assert "timed runs" in v.reason


# -- 9: CUDA graph capture and replay (GPU only) ----------------------------------------
@pytest.mark.gpu
def test_guard9_device_sync_inside_launch_breaks_graph_capture():
    v = evaluate("rmsnorm", CANDIDATES / "hack_sync_in_launch.py", device="cuda",
                 shapes=[{"M": 64, "N": 4096}])
    rejected(v, "cuda_graph")


@pytest.mark.gpu
def test_guard9_private_stream_candidate_is_caught_by_replayed_outputs():
    v = evaluate("rmsnorm", CANDIDATES / "hack_private_stream.py", device="cuda",
                 shapes=[{"M": 64, "N": 4096}])
    rejected(v, "cuda_graph")


@pytest.mark.gpu
def test_guard9_graph_that_replays_an_output_saved_before_capture_is_caught_on_fresh_inputs():
    v = evaluate("rmsnorm", CANDIDATES / "hack_capture_replay_cache.py", device="cuda",
                 shapes=[{"M": 64, "N": 4096}])
    rejected(v, "cuda_graph")
    assert "timed runs" in v.reason


@pytest.mark.gpu
def test_guard9_honest_candidate_is_timed_by_graph_replay():
    v = evaluate("rmsnorm", CANDIDATES / "honest_rmsnorm.py", device="cuda", shapes=[{"M": 4096, "N": 4096}])
    assert v.accepted, v.reason
    assert v.shapes[0].timing == "cuda_graph_replay" and math.isfinite(v.shapes[0].candidate_ms)


# -- 10: same inputs, same result -----------------------------------------------------
def test_guard10_nondeterministic_candidate_is_rejected_even_within_tolerance():
    v = check("hack_noise")
    rejected(v, "nondeterministic")


# -- 11: global state -------------------------------------------------------------------
def test_guard11_rng_drawn_at_import_is_rejected():
    v = check("hack_rng_at_import")
    rejected(v, "global_state")
    assert "RNG" in v.reason and "at import" in v.reason


def test_guard11_monkeypatched_timer_is_rejected():
    v = check("hack_patch_timer")
    rejected(v, "global_state")
    assert "elapsed_time" in v.reason


def test_guard11_work_left_running_in_a_thread_after_launch_returns_is_rejected():
    v = check("hack_background_thread")
    rejected(v, "global_state")
    assert "live Python threads" in v.reason


def test_guard11_state_snapshot_sees_the_timers_own_clock_replaced():
    from kernelsearch.harness import timing

    before = sandbox.snapshot_state()
    saved = timing._perf_counter
    timing._perf_counter = lambda: 0.0
    try:
        changes = " | ".join(sandbox.diff_state(before, sandbox.snapshot_state()))
    finally:
        timing._perf_counter = saved
    assert "kernelsearch.harness.timing._perf_counter was replaced" in changes
    assert sandbox.diff_state(before, sandbox.snapshot_state()) == []


def test_guard11_flag_flip_at_import_is_refused_statically():
    rejected(check("hack_tf32_flag"), "static")


def _flip_every_listed_switch():
    """Flip each switch guard 11 lists; returns the undo function."""
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
             torch.get_default_dtype(), torch.get_float32_matmul_precision(),
             torch.get_rng_state(), torch.are_deterministic_algorithms_enabled())
    torch.backends.cuda.matmul.allow_tf32 = not saved[0]
    torch.backends.cudnn.allow_tf32 = not saved[1]
    torch.set_default_dtype(torch.float64)
    torch.set_float32_matmul_precision("medium" if saved[3] != "medium" else "highest")
    torch.randn(3)
    torch.use_deterministic_algorithms(not saved[5])
    os.environ["HWTUNE_TEST_SNEAKY"] = "1"

    def undo():
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[0], saved[1]
        torch.set_default_dtype(saved[2])
        torch.set_float32_matmul_precision(saved[3])
        torch.set_rng_state(saved[4])
        torch.use_deterministic_algorithms(saved[5])
        os.environ.pop("HWTUNE_TEST_SNEAKY", None)
    return undo


def test_guard11_state_snapshot_sees_each_listed_switch():
    _flip_every_listed_switch()()  # first use of some setters makes torch set env vars lazily
    before = sandbox.snapshot_state()
    undo = _flip_every_listed_switch()
    try:
        changes = " | ".join(sandbox.diff_state(before, sandbox.snapshot_state()))
    finally:
        undo()
    for expected in ("cuda.matmul.allow_tf32", "cudnn.allow_tf32", "get_default_dtype",
                     "get_float32_matmul_precision", "RNG", "deterministic", "HWTUNE_TEST_SNEAKY"):
        assert expected in changes, (expected, changes)
    assert sandbox.diff_state(before, sandbox.snapshot_state()) == []


# -- the rest of the contract ----------------------------------------------------------
def test_honest_candidate_passes_every_guard_including_timed_runs():
    v = check("honest_rmsnorm", shapes=[{"M": 1, "N": 128}, {"M": 3, "N": 130, "dtype": "bfloat16"}],
              time_it=True)
    assert v.accepted, v.reason
    assert v.params == {"num_warps": 4}  # CONFIGS[0] when no params are given
    for s in v.shapes:
        assert s.status == "ok" and math.isfinite(s.candidate_ms) and math.isfinite(s.stock_ms)
        assert s.flops > 0 and s.bytes > 0 and s.noise_band is not None
    assert v.shapes[1].dtype == "bfloat16"


def test_verdict_round_trips_through_json_text():
    v = check("hack_partial_write")
    back = Verdict.from_json(json.dumps(v.to_json()))
    assert back.to_json() == v.to_json()
    assert back.shapes[0].candidate_ms == math.inf and back.time_ms == math.inf


def test_keep_requires_a_win_larger_than_the_noise_band():
    assert keep(0.90, 1.0, 0.05)
    assert not keep(0.97, 1.0, 0.05)
    assert not keep(math.inf, 1.0, 0.0)
    assert noise_band(1.0, 1.1) == pytest.approx(0.1)


def test_digest_is_bitwise():
    a = torch.randn(100)
    b = a.clone()
    assert tensor_io.digest(a) == tensor_io.digest(b)
    b[37] = torch.nextafter(b[37], torch.tensor(1e9))
    assert tensor_io.digest(a) != tensor_io.digest(b)
