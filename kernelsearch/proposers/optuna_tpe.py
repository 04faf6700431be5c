"""Optuna's TPE sampler over the categorical space, one point at a time (ask / tell).

TPE proposes repeats; a repeat is told its known time and costs no budget. A failed point
is told a huge finite time: TPE then learns to avoid its region, whereas a FAIL state would
be ignored and the region proposed again.
"""
from __future__ import annotations

import math
import random

from kernelsearch.proposers.space import Evaluate, Space, Trial, key, run_batch, size

FAILED_VALUE = 1e30


def search(space: Space, evaluate: Evaluate, budget: int, rng: random.Random) -> list[Trial]:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    budget = min(budget, size(space))
    sampler = optuna.samplers.TPESampler(seed=rng.randrange(2**31),
                                         n_startup_trials=max(3, min(10, budget // 4)))
    study = optuna.create_study(direction="minimize", sampler=sampler)
    distributions = {n: optuna.distributions.CategoricalDistribution(space[n]) for n in sorted(space)}
    trials: list[Trial] = []
    known: dict[str, float] = {}
    asks = 0
    while len(trials) < budget and asks < 20 * budget:
        asks += 1
        t = study.ask(distributions)
        params = {n: t.params[n] for n in sorted(space)}
        k = key(params)
        if k not in known:
            known[k] = run_batch(evaluate, [params], trials)[0]
        value = known[k]
        study.tell(t, value if math.isfinite(value) else FAILED_VALUE)
    return trials
