"""The verifier and timer every caller uses. Read-only to every proposer.

    from kernelsearch.harness import evaluate, Verdict
    v = evaluate("rmsnorm", "cand.py", device="cpu")   # -> Verdict (data, never raises)
    v.accepted, v.guard, v.reason, v.shapes[i].candidate_ms, Verdict.from_json(v.to_json())

Guards (Verdict.guard names; the number is issue 3's list):
  1  timeout, crash, exception, out_of_memory  child process per candidate, hard deadline, SIGKILL
  2  fresh_inputs (and correctness on trial 2) new seed per trial from `secrets`, several distributions
  3  (no name: patching the child gains nothing) reference and comparison in the parent
  4  unwritten_output                          outputs poisoned with NaN before every call
  5  input_mutated                             input digests before/after each call
  6  correctness (on the shape named)          the whole sweep, large shapes included
  7  static, not_triton, torch_compute         AST check; launch counter; aten op recorder
  8  timed_path                                outputs of the timed runs are checked (CPU)
  9  cuda_graph                                capture + replay timing; replayed outputs checked
  10 nondeterministic                          same inputs twice: bitwise, or within 5% of tol
  11 global_state                              torch flags, default dtype, RNG, env, patched functions
  also: contract (no launch(), bad CONFIGS, unknown kernel), harness (child could not start)
"""
from kernelsearch.harness.timing import keep, noise_band
from kernelsearch.harness.verdict import ShapeResult, Verdict
from kernelsearch.harness.verify import evaluate

__all__ = ["evaluate", "Verdict", "ShapeResult", "keep", "noise_band"]
