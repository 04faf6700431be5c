"""Numerical comparison, done in the parent on copied outputs (guards 3, 4, 6, 8, 10).

Per row (the last dimension): relative L2 error ||out - ref|| / ||ref|| <= tol, and the largest
absolute error <= 5 * tol * max|ref| of that row. Rows are judged one by one so that a row of
scale 1e-3 next to a row of scale 1e3 is held to the same relative standard. NaN never passes:
a NaN where the reference is finite is the poison of an element the candidate did not write.
Magnitudes below float32's smallest normal (1.18e-38) count as zero on both sides: a GPU may
flush them (silu(-100) * 1e3 is 3.7e-39 in the fp64 reference, -0 in any fp32 kernel, stock
included), and a row made only of such values would otherwise be judged by its rounding alone.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

_ROW_FLOOR = 1e-300
_FLUSH = torch.finfo(torch.float32).tiny  # below this, a value counts as 0 (either side)


@dataclass
class Mismatch:
    guard: str     # "unwritten_output" | "correctness"
    reason: str


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1]) if t.dim() > 0 else t.reshape(1, 1)


def row_errors(out: torch.Tensor, ref: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(relative L2 error per row, max-abs error / max|ref| per row), both fp64. A NaN or an
    infinity in `out` makes its row's errors NaN or infinite."""
    diff = _rows(out.to(torch.float64, copy=True))
    diff.masked_fill_(diff.abs() < _FLUSH, 0.0)
    r = _rows(ref.to(device=diff.device, dtype=torch.float64))
    r = r.masked_fill(r.abs() < _FLUSH, 0.0)
    diff.sub_(r)
    norm = torch.linalg.vector_norm
    rel = norm(diff, 2, dim=1) / norm(r, 2, dim=1).clamp_min(_ROW_FLOOR)
    absr = norm(diff, float("inf"), dim=1) / norm(r, float("inf"), dim=1).clamp_min(_ROW_FLOOR)
    return rel, absr


def compare(name: str, out: torch.Tensor, ref: torch.Tensor, tol: float) -> tuple[float, Mismatch | None]:
    """Worst row error, and what is wrong (None when within tolerance). Within tolerance is
    decided with one read-back from the device; only a failure takes the detailed path."""
    if tuple(out.shape) != tuple(ref.shape):
        return float("inf"), Mismatch("correctness", f"{name}: shape {tuple(out.shape)} != {tuple(ref.shape)}")
    if out.numel() == 0:
        return 0.0, None
    rel, absr = row_errors(out, ref)
    worst, worst_abs = torch.stack([rel.max(), absr.max()]).tolist()
    if math.isfinite(worst) and math.isfinite(worst_abs) and worst <= tol and worst_abs <= 5 * tol:
        return worst, None
    nan = torch.isnan(out)
    if bool(nan.any()):
        count, total = int(nan.sum()), out.numel()
        first = [int(i) for i in torch.nonzero(nan)[0].tolist()]
        return float("inf"), Mismatch(
            "unwritten_output",
            f"{name}: {count} of {total} elements still NaN (poison not overwritten, or NaN "
            f"produced); first at index {first}")
    if bool(torch.isinf(out).any()):
        return float("inf"), Mismatch("correctness", f"{name}: infinite values where the reference is finite")
    row = int(rel.argmax()) if not worst <= tol else int(absr.argmax())
    return worst, Mismatch(
        "correctness",
        f"{name}: row {row} relative L2 error {worst:.3g} (bound {tol:.3g}), max-abs/max|ref| "
        f"{worst_abs:.3g} (bound {5 * tol:.3g})")


def run_to_run_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest per-row relative L2 difference between two runs' outputs (NaN -> inf)."""
    if bool(torch.isnan(a).any()) or bool(torch.isnan(b).any()):
        return float("inf")
    rel, _ = row_errors(a, b)
    return float(rel.max())
