"""Random: distinct points drawn without replacement."""
from __future__ import annotations

import random

from kernelsearch.proposers.space import Allowed, Evaluate, Space, Trial, domain, run_batch


def search(space: Space, evaluate: Evaluate, budget: int, rng: random.Random,
           allowed: Allowed = None) -> list[Trial]:
    grid = domain(space, allowed)
    trials: list[Trial] = []
    run_batch(evaluate, rng.sample(grid, min(budget, len(grid))), trials)
    return trials
