"""A parameter space and the value every strategy returns.

A space is a plain dict {param: [values]} (a template's SPACE). A point is a dict with one
value per param. Strategies see only points and times: `evaluate(points) -> [time_ms]`, with
`inf` for a point that failed (compile error, out of resources, rejected by a guard).
Batches let an executor run several points at once; a strategy sends what it may send
without waiting for results.
"""
from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass
from typing import Callable

Space = dict[str, list]
Evaluate = Callable[[list[dict]], list[float]]


@dataclass(frozen=True)
class Trial:
    params: dict
    time_ms: float

    @property
    def ok(self) -> bool:
        return math.isfinite(self.time_ms)


def key(params: dict) -> str:
    """Canonical text of a point: the identity used by memos, the ledger and resume."""
    return json.dumps(params, sort_keys=True, separators=(",", ":"))


def points(space: Space) -> list[dict]:
    """Every point of the space in a fixed order (params sorted by name, values as listed)."""
    names = sorted(space)
    return [dict(zip(names, combo)) for combo in itertools.product(*(space[n] for n in names))]


def size(space: Space) -> int:
    return math.prod(len(v) for v in space.values()) if space else 1


def best(trials: list[Trial]) -> Trial | None:
    finite = [t for t in trials if t.ok]
    return min(finite, key=lambda t: t.time_ms) if finite else None


def run_batch(evaluate: Evaluate, batch: list[dict], trials: list[Trial]) -> list[float]:
    """Evaluate a batch, append its trials, return the times (a strategy's one way to measure)."""
    if not batch:
        return []
    times = [float(t) for t in evaluate(batch)]
    if len(times) != len(batch):
        raise ValueError(f"evaluate returned {len(times)} times for {len(batch)} points")
    trials.extend(Trial(p, t if not math.isnan(t) else math.inf) for p, t in zip(batch, times))
    return times
