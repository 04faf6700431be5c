"""Grid: every point in a fixed order; under a smaller budget, points evenly spread over it."""
from __future__ import annotations

import random

from kernelsearch.proposers.space import Allowed, Evaluate, Space, Trial, domain, run_batch


def search(space: Space, evaluate: Evaluate, budget: int, rng: random.Random,
           allowed: Allowed = None) -> list[Trial]:
    del rng  # the grid is the same for every seed
    grid = domain(space, allowed)
    if budget < len(grid):
        stride = len(grid) / max(budget, 1)
        grid = [grid[int(i * stride)] for i in range(budget)]
    trials: list[Trial] = []
    run_batch(evaluate, grid, trials)
    return trials
