"""Optuna's TPE sampler over the categorical space, one point at a time (ask / tell).

TPE proposes repeats and points the template refuses; those cost no budget (a refused point
is told a failure). A repeat is told its known time and costs no budget. A failed point
is told a huge finite time: TPE then learns to avoid its region, whereas a FAIL state would
be ignored and the region proposed again.
"""
from __future__ import annotations

import math
import random

from kernelsearch.proposers.space import Allowed, Evaluate, Space, Trial, domain, key, run_batch

FAILED_VALUE = 1e30
MAX_MISSES = 5   # refused or repeated proposals in a row before an unseen point is enqueued


def search(space: Space, evaluate: Evaluate, budget: int, rng: random.Random,
           allowed: Allowed = None) -> list[Trial]:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sampler = optuna.samplers.TPESampler(seed=rng.randrange(2**31),
                                         n_startup_trials=max(3, min(10, budget // 4)))
    study = optuna.create_study(direction="minimize", sampler=sampler)
    distributions = {n: optuna.distributions.CategoricalDistribution(space[n]) for n in sorted(space)}
    budget = min(budget, len(domain(space, allowed)))
    trials: list[Trial] = []
    known: dict[str, float] = {}
    grid = domain(space, allowed)
    misses = 0
    while len(trials) < budget:
        if misses >= MAX_MISSES:
            # TPE keeps landing on refused or known points (small or sparse domain):
            # hand it an unseen point so the run always progresses
            unseen = [p for p in grid if key(p) not in known]
            study.enqueue_trial(rng.choice(unseen))
            misses = 0
        t = study.ask(distributions)
        params = {n: t.params[n] for n in sorted(space)}
        k = key(params)
        if allowed is not None and not allowed(params):
            study.tell(t, FAILED_VALUE)  # never measured, never counted against the budget
            misses += 1
            continue
        if k in known:
            misses += 1
        else:
            known[k] = run_batch(evaluate, [params], trials)[0]
            misses = 0
        value = known[k]
        study.tell(t, value if math.isfinite(value) else FAILED_VALUE)
    return trials
