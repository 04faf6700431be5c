"""Evolution: mutate the best points so far, one generation at a time.

A mutation moves one or two params to a neighbouring value in their list (the lists are
ordered: block sizes, warps, stages), and now and then jumps to any value so the search can
leave a local basin. Points already seen are never measured twice.
"""
from __future__ import annotations

import random

from kernelsearch.proposers.space import Allowed, Evaluate, Space, Trial, domain, key, run_batch

POPULATION = 6      # first generation: random points
PARENTS = 3         # best points that breed each generation
JUMP_PROBABILITY = 0.2


def _mutate(parent: dict, space: Space, rng: random.Random) -> dict:
    child = dict(parent)
    movable = [n for n in sorted(space) if len(space[n]) > 1]
    if not movable:
        return child
    for name in rng.sample(movable, min(len(movable), rng.choice((1, 1, 2)))):
        values = space[name]
        if rng.random() < JUMP_PROBABILITY:
            child[name] = rng.choice(values)
            continue
        i = values.index(parent[name])
        step = rng.choice((-1, 1))
        j = i + step if 0 <= i + step < len(values) else i - step
        child[name] = values[j]
    return child


def search(space: Space, evaluate: Evaluate, budget: int, rng: random.Random,
           allowed: Allowed = None) -> list[Trial]:
    grid = domain(space, allowed)
    budget = min(budget, len(grid))
    trials: list[Trial] = []
    seen: set[str] = set()

    def submit(batch: list[dict]) -> None:
        for p in batch:
            seen.add(key(p))
        run_batch(evaluate, batch, trials)

    submit(rng.sample(grid, min(POPULATION, budget)))
    while len(trials) < budget:
        ranked = sorted(trials, key=lambda t: t.time_ms)
        parents = [t.params for t in ranked[:PARENTS] if t.ok] or [rng.choice(grid)]
        want = min(POPULATION, budget - len(trials))
        batch: list[dict] = []
        tries = 0
        while len(batch) < want and tries < 50 * want:
            tries += 1
            child = _mutate(rng.choice(parents), space, rng)
            if (key(child) not in seen and key(child) not in {key(b) for b in batch}
                    and (allowed is None or allowed(child))):
                batch.append(child)
        if len(batch) < want:  # neighbourhood exhausted: fill from unseen points
            unseen = [p for p in grid if key(p) not in seen and p not in batch]
            batch += rng.sample(unseen, min(want - len(batch), len(unseen)))
        if not batch:
            break
        submit(batch)
    return trials
