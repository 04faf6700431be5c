"""Outer search over hardware points: power limit x locked SM clock maximum.

The space comes from what the host reports (NVML power limit constraints, supported SM
clocks). Every point is scored by a measured objective through a callback
`measure(point) -> {"tokens_per_s": ..., "tokens_per_j": ..., ...}` after it has been applied
with `apply_point(point)` (on a host: plan -> journal -> apply through hwtune.engine, see
`HostApplier`). At the end the best point is kept or the baseline restored, again through
`apply_point`, so every write is journaled.

Objectives:
- `energy`: the most tokens/J among points whose tokens/s is at least `floor` x the stock
  point's tokens/s.
- `throughput`: the most tokens/s; points within `tie` (0.5%) of the best tokens/s measured
  count as equal and the one with more tokens/J wins (measurements are never more exact).

Strategies (name -> function, each `(space, evaluate, objective, budget) -> None`, calling
`evaluate(point)` which returns the score and caches repeats):
- `boundary` (default, <= 12 evaluations): throughput never rises when the clock cap or the
  power limit falls, and for memory-bound work energy per token improves as either falls, so
  the answer lies on the floor's boundary. Measure stock; binary-search the lowest clock cap
  meeting the floor at the highest power limit; binary-search the lowest power limit meeting
  it with clocks unlocked; spend what is left on the best point's untried neighbours.
- `exhaustive`: every point of the same space (for comparison).

No torch, no device access here: pure logic plus the engine calls in `HostApplier`.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

from hwtune.errors import HwtuneError, UsageError
from hwtune.signals import Interrupted

OBJECTIVES = ("throughput", "energy")


@dataclass(frozen=True, order=True)
class Point:
    """A hardware setting: power limit, and a locked SM clock range [min, max] or None."""

    power_limit_w: int
    sm_clock_max_mhz: int | None = None  # None: SM clocks not locked
    # The lock's lower end when it is not the space's (a baseline read from the host, e.g. a
    # profile's [1410, 1785]); None: the space's lowest supported clock.
    sm_clock_min_mhz: int | None = None

    def label(self) -> str:
        if not self.sm_clock_max_mhz:
            clocks = "SM unlocked"
        elif self.sm_clock_min_mhz is not None:
            clocks = f"SM {self.sm_clock_min_mhz}-{self.sm_clock_max_mhz} MHz"
        else:
            clocks = f"SM <= {self.sm_clock_max_mhz} MHz"
        return f"{self.power_limit_w} W, {clocks}"

    def to_json(self) -> dict:
        out = {"power_limit_w": self.power_limit_w, "sm_clock_max_mhz": self.sm_clock_max_mhz}
        if self.sm_clock_min_mhz is not None:
            out["sm_clock_min_mhz"] = self.sm_clock_min_mhz
        return out

    def gpu_section(self, select, sm_clock_min_mhz: int) -> dict:
        """The `gpu:` section of a profile that sets this point."""
        lo = self.sm_clock_min_mhz if self.sm_clock_min_mhz is not None else sm_clock_min_mhz
        return {
            "select": select,
            "power_limit_w": self.power_limit_w,
            "sm_clock_mhz": [lo, self.sm_clock_max_mhz] if self.sm_clock_max_mhz else "reset",
        }


@dataclass(frozen=True)
class Space:
    power_limits_w: tuple[int, ...]        # ascending
    sm_clocks_mhz: tuple[int, ...]         # locked maxima, ascending (coarse steps)
    sm_clock_min_mhz: int                  # lower end of every locked range
    stock: Point

    @classmethod
    def from_limits(cls, power_min_w: float, power_max_w: float, power_default_w: float,
                    supported_sm_clocks_mhz, power_steps: int = 10, clock_steps: int = 16) -> "Space":
        if power_min_w > power_max_w:
            raise UsageError(f"power limit constraints {power_min_w}..{power_max_w}: min above max")
        clocks = sorted({int(c) for c in supported_sm_clocks_mhz})
        if not clocks:
            raise UsageError("the GPU reports no supported SM clocks")
        n = max(2, power_steps)
        step_w = (power_max_w - power_min_w) / (n - 1)
        # Whole watts, inside the constraints: NVML takes milliwatts but nobody tunes below 1 W.
        powers = sorted({int(min(power_max_w, max(power_min_w, round(power_min_w + i * step_w))))
                         for i in range(n)})
        stride = max(1, math.ceil(len(clocks) / max(1, clock_steps)))
        coarse = sorted({clocks[i] for i in range(len(clocks) - 1, -1, -stride)} - {clocks[0]} or {clocks[-1]})
        stock_w = int(min(power_max_w, max(power_min_w, power_default_w)))
        if stock_w not in powers:
            powers = sorted(set(powers) | {stock_w})
        return cls(tuple(powers), tuple(coarse), clocks[0], Point(stock_w, None))

    @classmethod
    def from_host(cls, host, gpus: list[int], **kw) -> "Space":
        """The space every selected GPU accepts: the tightest power constraints, the clocks
        all of them support."""
        if not gpus:
            raise UsageError("no GPU selected")
        lo, hi, default, clocks = -math.inf, math.inf, None, None
        for i in gpus:
            cmin, cmax = host.gpus.get_power_limit_constraints_w(i)
            lo, hi = max(lo, cmin), min(hi, cmax)
            d = host.gpus.get_power_limit_default_w(i)
            default = d if default is None else min(default, d)
            s = set(host.gpus.get_supported_sm_clocks_mhz(i))
            clocks = s if clocks is None else clocks & s
        return cls.from_limits(lo, hi, default, clocks or [], **kw)

    def points(self) -> list[Point]:
        """Every point of the space: each power limit x (each clock cap, and unlocked)."""
        return [Point(w, c) for w in self.power_limits_w for c in (*self.sm_clocks_mhz, None)]

    def to_json(self) -> dict:
        return {"power_limits_w": list(self.power_limits_w), "sm_clocks_mhz": list(self.sm_clocks_mhz),
                "sm_clock_min_mhz": self.sm_clock_min_mhz, "stock": self.stock.to_json(),
                "size": len(self.points())}


@dataclass(frozen=True)
class Objective:
    name: str = "energy"
    floor: float = 0.98
    tie: float = 0.005

    def __post_init__(self):
        if self.name not in OBJECTIVES:
            raise UsageError(f"objective {self.name!r}: not one of {', '.join(OBJECTIVES)}")
        if not 0 < self.floor <= 1:
            raise UsageError(f"floor {self.floor}: expected a fraction in (0, 1]")

    def required_tokens_per_s(self, reference_tokens_per_s: float) -> float:
        if self.name == "throughput":
            return (1 - self.tie) * reference_tokens_per_s
        return self.floor * reference_tokens_per_s

    def feasible(self, metrics: dict | None, reference_tokens_per_s: float) -> bool:
        return bool(metrics) and metrics.get("tokens_per_s", 0) >= self.required_tokens_per_s(reference_tokens_per_s)

    def key(self, metrics: dict | None, reference_tokens_per_s: float) -> tuple:
        """Sort key, larger is better; an infeasible or failed point sorts below all others."""
        if not metrics or not math.isfinite(metrics.get("tokens_per_s", math.nan)):
            return (-1, -math.inf, -math.inf)
        tps, tpj = metrics["tokens_per_s"], metrics.get("tokens_per_j", 0.0)
        # Within the floor (throughput: the tie band) throughput counts as met; energy decides.
        return (1 if self.feasible(metrics, reference_tokens_per_s) else 0, tpj, tps)


@dataclass
class Evaluation:
    point: Point
    metrics: dict | None
    status: str                 # "ok" | "failed" | "aborted"
    error: str | None = None
    seconds: float = 0.0

    def to_json(self) -> dict:
        return {"point": self.point.to_json(), "label": self.point.label(), "status": self.status,
                "error": self.error, "metrics": self.metrics, "seconds": round(self.seconds, 3)}


class AbortSearch(HwtuneError):
    """A safety event (thermal, power brake, XID) during a step: stop and restore."""


@dataclass
class SearchResult:
    strategy: str
    objective: Objective
    space: Space
    evaluations: list[Evaluation] = field(default_factory=list)
    reference: Evaluation | None = None
    aborted: str | None = None

    @property
    def reference_tokens_per_s(self) -> float:
        """What the floor is relative to: stock (energy) or the best measured (throughput)."""
        if self.objective.name == "throughput":
            return max([e.metrics.get("tokens_per_s", 0.0) for e in self.evaluations if e.status == "ok"],
                       default=0.0)
        return (self.reference.metrics or {}).get("tokens_per_s", 0.0) if self.reference else 0.0

    @property
    def best(self) -> Evaluation | None:
        ok = [e for e in self.evaluations if e.status == "ok"]
        if not ok:
            return None
        ref = self.reference_tokens_per_s
        best = max(ok, key=lambda e: self.objective.key(e.metrics, ref))
        if not self.objective.feasible(best.metrics, ref):
            return self.reference if self.reference and self.reference.status == "ok" else None
        return best

    def to_json(self) -> dict:
        best = self.best
        return {"strategy": self.strategy, "objective": self.objective.name, "floor": self.objective.floor,
                "evaluations_used": len(self.evaluations), "space": self.space.to_json(),
                "reference": self.reference.to_json() if self.reference else None,
                "best": best.to_json() if best else None, "aborted": self.aborted,
                "evaluations": [e.to_json() for e in self.evaluations]}


# -- strategies ------------------------------------------------------------------------------

def _lowest_meeting(candidates: list, make_point, evaluate, meets) -> int | None:
    """Binary search over ascending `candidates` for the lowest index whose point meets the
    floor, assuming the highest one does (it is checked last only if never evaluated)."""
    lo, hi = 0, len(candidates) - 1
    found = None
    while lo <= hi:
        mid = (lo + hi) // 2
        if evaluate(make_point(candidates[mid])) is None:
            return found  # budget spent
        if meets(make_point(candidates[mid])):
            found, hi = mid, mid - 1
        else:
            lo = mid + 1
    return found


def boundary(space: Space, evaluate, objective: Objective, budget: int, results: dict, reference) -> None:
    meets = lambda p: objective.feasible(results.get(p), reference())  # noqa: E731
    pmax = space.power_limits_w[-1]
    clocks, powers = list(space.sm_clocks_mhz), list(space.power_limits_w)
    ci = _lowest_meeting(clocks, lambda c: Point(pmax, c), evaluate, meets)
    pi = _lowest_meeting(powers, lambda w: Point(w, None), evaluate, meets)
    # Spend the rest on neighbours of the best point so far, best-first.
    tried: set[Point] = set()
    while True:
        ok = [p for p, m in results.items() if m is not None]
        if not ok:
            return
        best = max(ok, key=lambda p: objective.key(results[p], reference()))
        neighbours = []
        w_idx = powers.index(best.power_limit_w) if best.power_limit_w in powers else len(powers) - 1
        c_list = clocks + [None]
        c_idx = c_list.index(best.sm_clock_max_mhz) if best.sm_clock_max_mhz in c_list else len(c_list) - 1
        for dw, dc in ((0, -1), (-1, 0), (0, 1), (1, 0), (-1, -1)):
            wi, cj = w_idx + dw, c_idx + dc
            if 0 <= wi < len(powers) and 0 <= cj < len(c_list):
                neighbours.append(Point(powers[wi], c_list[cj]))
        if ci is not None and pi is not None:
            # A clock cap and a power limit that each just meet the floor: try both at once.
            neighbours.append(Point(powers[pi], clocks[ci]))
        fresh = [p for p in neighbours if p not in results and p not in tried]
        if not fresh:
            return
        p = fresh[0]
        tried.add(p)
        if evaluate(p) is None:
            return


def exhaustive(space: Space, evaluate, objective: Objective, budget: int, results: dict, reference) -> None:
    for p in space.points():
        if evaluate(p) is None:
            return


STRATEGIES: dict[str, Callable] = {"boundary": boundary, "exhaustive": exhaustive}


def search(space: Space, measure: Callable[[Point], dict], apply_point: Callable[[Point], None],
           objective: Objective = Objective(), budget: int = 12, strategy: str = "boundary",
           log: Callable[[str], None] = lambda s: None) -> SearchResult:
    """Evaluate points (apply, then measure) chosen by `strategy`, at most `budget` of them
    (exhaustive: the whole space). The stock point is measured first: it is the reference
    for the throughput floor. A failed apply or measurement is data (status "failed"); an
    `AbortSearch` from either stops the search. Leaves the host at the last applied point:
    the caller keeps the best or restores (see `finish`)."""
    if strategy not in STRATEGIES:
        raise UsageError(f"strategy {strategy!r}: not one of {', '.join(STRATEGIES)}")
    if budget < 1:
        raise UsageError(f"budget {budget}: need at least 1 evaluation")
    limit = len(space.points()) + 1 if strategy == "exhaustive" else budget
    result = SearchResult(strategy, objective, space)
    results: dict[Point, dict | None] = {}

    reference = lambda: result.reference_tokens_per_s  # noqa: E731

    def evaluate(point: Point):
        """The point's metrics (cached), {} for a failed point, None when out of budget."""
        if point in results:
            return results[point] or {}
        if len(result.evaluations) >= limit or result.aborted:
            return None
        t0 = time.monotonic()
        try:
            apply_point(point)
            metrics = dict(measure(point))
            ev = Evaluation(point, metrics, "ok")
        except AbortSearch as exc:
            result.aborted = str(exc)
            ev = Evaluation(point, None, "aborted", str(exc))
        except Interrupted:
            raise  # Ctrl-C / SIGTERM held through an apply: the caller restores, not a failed point
        except HwtuneError as exc:
            ev = Evaluation(point, None, "failed", str(exc))
        ev.seconds = time.monotonic() - t0
        result.evaluations.append(ev)
        results[point] = ev.metrics
        if ev.status == "ok":
            m = ev.metrics
            log(f"[{len(result.evaluations):3d}] {point.label():28s} {m.get('tokens_per_s', 0):10.1f} tok/s "
                f"{m.get('tokens_per_j', 0):8.3f} tok/J {m.get('power_w', float('nan')):6.0f} W")
        else:
            log(f"[{len(result.evaluations):3d}] {point.label():28s} {ev.status}: {ev.error}")
        return None if result.aborted else (ev.metrics or {})

    evaluate(space.stock)
    if result.evaluations and result.evaluations[0].status == "ok":
        result.reference = result.evaluations[0]
        STRATEGIES[strategy](space, evaluate, objective, budget, results, reference)
    return result


def finish(result: SearchResult, apply_point: Callable[[Point], None], baseline: Point, keep: bool,
           log: Callable[[str], None] = lambda s: None) -> Point:
    """Keep the best point (apply it again, journaled) or restore `baseline`; returns what the
    host is left at. After an abort, or with nothing better than stock, the baseline."""
    best = result.best
    target = best.point if (keep and best is not None and not result.aborted) else baseline
    log(f"{'keeping' if target != baseline else 'restoring'} {target.label()}")
    apply_point(target)
    return target


# -- applying points on a host through the engine --------------------------------------------

class HostApplier:
    """Applies a point to the selected GPUs with hwtune.engine (plan -> journal -> apply ->
    read back), one profile per point built with Profile.from_dict."""

    def __init__(self, host, state_dir, gpus: list[int], sm_clock_min_mhz: int,
                 log: Callable[[str], None] = lambda s: None):
        self.host, self.state_dir, self.gpus = host, state_dir, list(gpus)
        self.sm_clock_min_mhz = sm_clock_min_mhz
        self.log = log
        self.applied = 0

    def profile(self, point: Point):
        from hwtune.profiles import Profile

        data = {"gpu": point.gpu_section(list(self.gpus), self.sm_clock_min_mhz)}
        return Profile.from_dict(data, source=f"<hwloop {point.label()}>")

    def baseline(self) -> Point:
        """What the first selected GPU is set to now, the whole locked range included (restoring
        [space min, max] instead of a profile's [1410, 1785] would leave drift behind). A lock
        NVML cannot read back ("unknown") counts as unlocked: the knob restores locked clocks by
        reset anyway."""
        return self.baseline_of(self.gpus[0])

    def baseline_of(self, i: int) -> Point:
        """baseline() of GPU i: a point applies to every selected GPU, so the tune checks
        that they all start from the same one (restoring the first one's to all would be wrong)."""
        w = int(round(self.host.gpus.get_power_limit_w(i)))
        lock = self.host.gpus.get_locked_sm_clocks_mhz(i)
        if not isinstance(lock, (tuple, list)):
            return Point(w, None)
        lo, hi = int(lock[0]), int(lock[1])
        return Point(w, hi, None if lo == self.sm_clock_min_mhz else lo)

    def __call__(self, point: Point, on_signal: str = "undo") -> None:
        """Apply `point` to every selected GPU or raise: a knob the engine skipped
        (NoPermission, NotSupported) leaves that GPU where it was, and measuring it would
        score settings other than the point's."""
        from hwtune import engine

        result = engine.apply(self.host, self.profile(point), self.state_dir, self.log, on_signal=on_signal)
        self.applied += 1
        if result.skipped:
            raise HwtuneError(f"{point.label()}: not applied as asked ({'; '.join(result.skipped)})")
