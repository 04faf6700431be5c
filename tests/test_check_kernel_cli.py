"""`hwtune check-kernel` as a child process (CPU: Triton interpreter, reduced sweep)."""
import json
from pathlib import Path

import pytest

from tests.conftest import run_hwtune

ROOT = Path(__file__).resolve().parents[1]
CANDIDATES = Path(__file__).parent / "candidates"
SPECS = ["rmsnorm", "add_rmsnorm", "softmax", "matmul", "decode_attention"]


@pytest.mark.parametrize("kernel", SPECS)
def test_honest_candidate_is_accepted_over_the_whole_cpu_sweep(kernel):
    proc = run_hwtune("check-kernel", kernel, CANDIDATES / f"honest_{kernel}.py", "--device", "cpu",
                      "--json", "--no-time", timeout=600)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["accepted"] and doc["guard"] is None
    assert len(doc["shapes"]) >= 4 and all(s["status"] == "ok" for s in doc["shapes"])
    assert any(s["dtype"] == "bfloat16" for s in doc["shapes"])
    # besides the published sweep, one shape drawn at random (checked, not timed)
    assert [s["random"] for s in doc["shapes"]].count(True) == 1
    assert doc["isolation"], "the sandbox says how it ran launch()"


@pytest.mark.parametrize("kernel", ["linear", "swiglu", "rope", "rope_kv_write"])
def test_builtin_template_of_a_decode_kernel_is_accepted_over_the_whole_cpu_sweep(kernel):
    proc = run_hwtune("check-kernel", kernel, ROOT / "kernelsearch" / "kernels" / f"{kernel}.py",
                      "--device", "cpu", "--json", "--no-time", timeout=600)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["accepted"] and doc["guard"] is None
    assert all(s["status"] == "ok" for s in doc["shapes"])
    assert any(s["dtype"] == "bfloat16" for s in doc["shapes"])


def test_rope_that_reads_one_half_of_cos_and_sin_is_rejected():
    """Hugging Face duplicates the halves of cos/sin; the contract does not, so a kernel that
    loads only the first half is wrong on the harness's inputs."""
    proc = run_hwtune("check-kernel", "rope", CANDIDATES / "hack_rope_half_cos.py", "--device", "cpu",
                      "--json", "--no-time", timeout=600)
    assert proc.returncode == 1, proc.stderr
    doc = json.loads(proc.stdout)
    assert not doc["accepted"] and doc["guard"] == "correctness"


def test_json_document_carries_per_shape_timing_and_noise_band():
    proc = run_hwtune("check-kernel", "softmax", CANDIDATES / "honest_softmax.py", "--json", timeout=600)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    for s in doc["shapes"]:
        if s["random"]:
            assert s["candidate_ms"] is None and s["status"] == "ok"
            continue
        assert s["candidate_ms"] > 0 and s["stock_ms"] > 0 and s["noise_band"] is not None
        assert s["speedup"] > 0 and s["flops"] > 0 and s["bytes"] > 0
        assert s["timing"].startswith("cpu_interpreter")


def test_rejected_candidate_exits_1_naming_the_guard():
    proc = run_hwtune("check-kernel", "rmsnorm", CANDIDATES / "hack_partial_write.py", "--no-time", timeout=600)
    assert proc.returncode == 1
    assert "REJECTED by guard unwritten_output" in proc.stderr


@pytest.mark.parametrize("text,why", [(b"def launch(:\n", "line 1: not valid Python"),
                                      (b"", "no @triton.jit kernel defined"),
                                      (b"\x7fELF\x02\x01\x01\x00\xff\xfe", "the file is not UTF-8 text")])
def test_a_file_that_is_not_a_kernel_is_one_line_naming_why(tmp_path, text, why):
    # Before: an empty table (its header and the speedup note) on stdout above the reason.
    cand = tmp_path / "cand.py"
    cand.write_bytes(text)
    proc = run_hwtune("check-kernel", "rmsnorm", cand, "--device", "cpu", timeout=600)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stdout == ""
    assert proc.stderr.splitlines() == [f"check-kernel rmsnorm {cand}: REJECTED by guard static: "
                                        + proc.stderr.split("static: ", 1)[1].strip()]
    assert why in proc.stderr


def test_params_override_and_bad_input_exit_2(tmp_path):
    proc = run_hwtune("check-kernel", "matmul", CANDIDATES / "honest_matmul.py", "--json", "--no-time",
                      "--params", '{"BLOCK_M": 32, "BLOCK_N": 16, "BLOCK_K": 16}', timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["params"] == {"BLOCK_M": 32, "BLOCK_N": 16, "BLOCK_K": 16}
    assert run_hwtune("check-kernel", "nope", CANDIDATES / "honest_matmul.py").returncode == 2
    missing = run_hwtune("check-kernel", "matmul", tmp_path / "missing.py")
    assert missing.returncode == 2 and missing.stderr.strip().endswith("missing.py: no such file")
    folder = run_hwtune("check-kernel", "matmul", tmp_path)
    assert folder.returncode == 2, folder.stderr
    assert folder.stderr.strip() == f"hwtune check-kernel: {tmp_path}: a directory, not a candidate file"
    assert run_hwtune("check-kernel", "matmul", CANDIDATES / "honest_matmul.py", "--params", "[1]").returncode == 2



@pytest.mark.parametrize("timeout", ["0", "-1", "nan", "inf"])
def test_a_timeout_that_is_not_a_positive_number_of_seconds_is_a_usage_error(timeout):
    # before: -1 rejected an honest candidate by guard timeout (exit 1); 0 meant the default
    proc = run_hwtune("check-kernel", "matmul", CANDIDATES / "honest_matmul.py", "--no-time",
                      "--timeout", timeout, timeout=600)
    assert proc.returncode == 2 and proc.stdout == "", (proc.returncode, proc.stdout, proc.stderr)
    assert proc.stderr.startswith("hwtune check-kernel: --timeout ") and "a positive number of seconds" in proc.stderr

@pytest.mark.parametrize("kernel", SPECS)
def test_builtin_templates_pass_the_verifier(kernel):
    """H4's templates follow the same contract (their first CONFIG; an odd shape and bf16)."""
    from kernelsearch.harness import evaluate
    from kernelsearch.specs import SPECS as REGISTRY

    template = ROOT / "kernelsearch" / "kernels" / f"{kernel}.py"
    if not template.exists():
        pytest.skip(f"{template} not written yet")
    sweep = REGISTRY[kernel].shapes("cpu")
    v = evaluate(kernel, template, device="cpu", shapes=[sweep[1], sweep[-1]], time_it=False)
    assert v.accepted, f"{v.guard}: {v.reason}"


def test_no_time_text_says_not_timed_and_an_odd_path_cannot_print_a_line_of_its_own(tmp_path):
    # Before: --no-time printed 'speedup = stock_ms / cand_ms' beneath a table with no times, and a
    # path holding a newline put a line of its choosing after the verdict ('...: accepted').
    odd = tmp_path / "x.py\ncheck-kernel softmax y.py: accepted (params {})"
    odd.write_bytes((CANDIDATES / "hack_partial_write.py").read_bytes())
    proc = run_hwtune("check-kernel", "rmsnorm", odd, "--device", "cpu", "--no-time", timeout=600)
    assert proc.returncode == 1, proc.stderr
    assert "not timed (--no-time)" in proc.stdout and "speedup = " not in proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "REJECTED" in lines[0] and "\\n" in lines[0], proc.stderr
