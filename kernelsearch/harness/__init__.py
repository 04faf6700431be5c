"""The verifier and timer every caller uses. Read-only to every proposer.

    from kernelsearch.harness import evaluate, Session, Verdict
    v = evaluate("rmsnorm", "cand.py", device="cpu")   # -> Verdict (data, never raises)
    v.accepted, v.guard, v.reason, v.shapes[i].candidate_ms, Verdict.from_json(v.to_json())

Trust boundary: the process that makes inputs, poisons outputs, runs kernels, compares and
times (executor.py) never imports or executes the candidate's Python. It compiles the file's
@triton.jit kernels from source that passed an allowlist (source.py) and runs launch plans
(plan.py) that the candidate's launch() produced in a sandbox (jail.py + planner.py: another
process, unprivileged, no data) and that it validates itself.

Guards (Verdict.guard):
  static          the AST allowlist (imports, top-level statements, kernel bodies, host code)
  contract        unknown kernel, unreadable file, no launch(), bad CONFIGS, no GPU
  plan            launch() did what a plan cannot hold (torch compute, data access, branching on
                  a scalar argument), or an invalid plan (unknown kernel, bad args, too much memory)
  not_triton      the plan launches no @triton.jit kernel
  left_process    the host code left a process running (killed by the jail)
  timeout, crash, exception, out_of_memory   sandbox or kernel; killed, restarted, a verdict
  unwritten_output  outputs, and the rows of in/out tensors the op writes, poisoned (NaN,
                  huge, random) before every call
  input_mutated   inputs compared bitwise after every call
  inout_mutated   an in/out tensor (a KV cache) changed outside the rows the op writes
                  (compared bitwise after every call), or zeroed by a plan step
  out_of_bounds   canary zones around every buffer; interpreter loads/stores bounds-checked
  workspace_state a buffer kept across calls not left all-zero (state carried between calls)
  correctness     fp64 reference, the whole sweep + a shape drawn at random + scalars drawn per trial
  nondeterministic  same inputs twice: bitwise, or within 5% of the tolerance
  timed_path / cuda_graph   every timed call's outputs checked; capture failures
  harness         the harness itself failed (not the candidate's fault)
"""
__all__ = ["evaluate", "Session", "Verdict", "ShapeResult", "keep", "noise_band"]

_LAZY = {"evaluate": "verify", "Session": "verify", "Verdict": "verdict", "ShapeResult": "verdict",
         "keep": "timing", "noise_band": "timing"}


def __getattr__(name):
    # Lazy: the dispatch runtime imports harness.source/plan/run_plan without the verifier.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"kernelsearch.harness.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'kernelsearch.harness' has no attribute {name!r}")
