"""Test helper: a dispatch table whose entries the harness verified, made on this machine.

`verified_table(entries, device)` runs each built-in template through `harness.evaluate` at the
entry's shape (every check, no timing), then asks the sandbox for its launch plan at that shape,
the same two steps the search takes before it writes an entry. Call it where TRITON_INTERPRET=1
was set before triton was imported (a child process in these tests).
"""
from __future__ import annotations


def verified_table(entries, device: str = "cpu"):
    """entries: [(kernel, shape dict, dtype name, params dict)] -> DispatchTable."""
    from kernelsearch.dispatch import DispatchTable, file_sha256
    from kernelsearch.fingerprint import collect, fingerprint_id
    from kernelsearch.harness import evaluate
    from kernelsearch.harness.verify import make_plan
    from kernelsearch.kernels import TEMPLATES, template_path

    fp = collect(device)
    rows = []
    for kernel, shape, dtype, params in entries:
        path = template_path(kernel)
        verdict = evaluate(kernel, path, params=params, device=device,
                           shapes=[dict(shape, dtype=dtype)], time_it=False)
        if not verdict.accepted:
            raise AssertionError(f"{kernel} {shape} {dtype} {params}: {verdict.guard}: {verdict.reason}")
        plan = make_plan(kernel, path, shape, dtype, params, device)
        if plan is None:
            raise AssertionError(f"{kernel} {shape} {dtype} {params}: no launch plan")
        rows.append({"kernel": kernel, "dtype": dtype, "shape": dict(shape),
                     "source": {"module": TEMPLATES[kernel]}, "source_hash": file_sha256(path),
                     "params": dict(params), "plan": plan, "candidate_ms": None, "stock_ms": None,
                     "speedup": None})
    return DispatchTable({"format": 1, "fingerprint_id": fingerprint_id(fp), "fingerprint": fp,
                          "entries": rows})
