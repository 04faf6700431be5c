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
Allowed = Callable[[dict], bool] | None   # a template's validity rule (its CONFIGS); None = all


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


def domain(space: Space, allowed: Allowed = None) -> list[dict]:
    """The points a strategy may propose: the whole grid, less what `allowed` refuses."""
    grid = points(space)
    return [p for p in grid if allowed(p)] if allowed else grid


def allowed_from_configs(configs: list[dict] | None) -> Allowed:
    """A template's CONFIGS as a validity rule (None when the template lists none)."""
    if not configs:
        return None
    keys = {key(c) for c in configs}
    return lambda p: key(p) in keys


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
