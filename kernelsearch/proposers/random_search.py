"""Random: distinct points drawn without replacement."""
from __future__ import annotations

import random

from kernelsearch.proposers.space import Evaluate, Space, Trial, points, run_batch


def search(space: Space, evaluate: Evaluate, budget: int, rng: random.Random) -> list[Trial]:
    grid = points(space)
    trials: list[Trial] = []
    run_batch(evaluate, rng.sample(grid, min(budget, len(grid))), trials)
    return trials
