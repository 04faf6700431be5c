"""Search strategies: one module per strategy, one function each, an explicit registry.

Every strategy is `search(space, evaluate, budget, rng, allowed=None) -> list[Trial]`:
  space     {param: [values]} (a template's SPACE)
  evaluate  list of points -> list of time_ms (inf = failed); the strategy never sees the harness
  budget    most distinct points to measure
  rng       random.Random; a seed makes the run repeatable
  allowed   optional point -> bool (the template's CONFIGS): refused points are never measured
The trials come back in evaluation order. The agent proposer (kernelsearch/agent.py) writes
source files instead of points and is driven by the search loop directly.
"""
from kernelsearch.proposers import evolution, grid, optuna_tpe, random_search
from kernelsearch.proposers.space import Trial, allowed_from_configs, best, domain, key, points, size

REGISTRY = {
    "grid": grid.search,
    "random": random_search.search,
    "optuna": optuna_tpe.search,
    "evolution": evolution.search,
}

__all__ = ["REGISTRY", "Trial", "allowed_from_configs", "best", "domain", "key", "points", "size"]
