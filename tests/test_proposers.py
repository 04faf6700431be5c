"""Strategies replay a recorded results table offline (Kernel Tuner style): no harness, no GPU."""
import math
import random

import pytest

from kernelsearch.proposers import REGISTRY, best, key, points, size

SPACE = {"BLOCK_N": [256, 512, 1024, 2048, 4096], "ROWS": [1, 2, 4, 8], "num_warps": [1, 2, 4, 8, 16]}


def _recorded_table() -> dict[str, float]:
    """A timing table shaped like a real sweep: a smooth bowl, a few configs that fail."""
    table = {}
    for p in points(SPACE):
        b = math.log2(p["BLOCK_N"]) - 10.0     # best near 1024
        r = math.log2(p["ROWS"]) - 2.0         # best at 4 rows
        w = math.log2(p["num_warps"]) - 2.0    # best at 4 warps
        t = 0.05 + 0.004 * b * b + 0.003 * r * r + 0.002 * w * w + 0.0005 * b * w
        if p["BLOCK_N"] == 4096 and p["num_warps"] == 1:
            t = math.inf                       # out of registers
        if p["ROWS"] == 8 and p["BLOCK_N"] >= 2048:
            t = math.inf                       # out of shared memory
        table[key(p)] = t
    return table


TABLE = _recorded_table()
BEST_MS = min(TABLE.values())


class Replay:
    def __init__(self):
        self.calls = []

    def __call__(self, batch):
        self.calls.extend(key(p) for p in batch)
        return [TABLE[key(p)] for p in batch]


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_strategy_finds_the_best_point_when_budget_covers_the_space(name):
    replay = Replay()
    trials = REGISTRY[name](SPACE, replay, size(SPACE), random.Random(1))
    assert best(trials).time_ms == BEST_MS


@pytest.mark.parametrize("name", ["random", "optuna", "evolution"])
def test_strategy_comes_within_ten_percent_of_best_on_a_third_of_the_space(name):
    hits = 0
    for seed in range(5):
        trials = REGISTRY[name](SPACE, Replay(), size(SPACE) // 3, random.Random(seed))
        hits += best(trials).time_ms <= BEST_MS * 1.10
    assert hits >= 3


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_strategy_respects_budget_and_never_measures_a_point_twice(name):
    replay = Replay()
    trials = REGISTRY[name](SPACE, replay, 17, random.Random(3))
    assert len(trials) == len(replay.calls) <= 17
    assert len(set(replay.calls)) == len(replay.calls)


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_same_seed_gives_the_same_trials(name):
    a = REGISTRY[name](SPACE, Replay(), 15, random.Random(7))
    b = REGISTRY[name](SPACE, Replay(), 15, random.Random(7))
    assert [key(t.params) for t in a] == [key(t.params) for t in b]


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_failed_points_are_recorded_but_never_chosen_as_best(name):
    all_failed = {k: math.inf for k in TABLE}
    trials = REGISTRY[name](SPACE, lambda batch: [all_failed[key(p)] for p in batch], 8, random.Random(0))
    assert trials and all(not t.ok for t in trials)
    assert best(trials) is None


def test_grid_under_a_small_budget_spreads_over_the_space():
    trials = REGISTRY["grid"](SPACE, Replay(), 10, random.Random(0))
    assert len({t.params["BLOCK_N"] for t in trials}) >= 4


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_points_the_template_refuses_are_never_measured(name):
    def allowed(p):
        return not (p["ROWS"] == 8 or p["num_warps"] == 16)
    replay = Replay()
    trials = REGISTRY[name](SPACE, replay, 30, random.Random(2), allowed=allowed)
    assert len(trials) == 30 and all(allowed(t.params) for t in trials)


def test_replay_bench_counts_evaluations_to_reach_two_percent_of_the_exhaustive_best(tmp_path):
    import json
    import subprocess
    import sys

    from conftest import ROOT

    configs = [{"params": p, "time_ms": (t if math.isfinite(t) else "inf")}
               for p, t in ((p, TABLE[key(p)]) for p in points(SPACE))]
    recorded = tmp_path / "kernels_gpu.json"
    recorded.write_text(json.dumps({"kernels": {"rmsnorm": {"shapes": [
        {"shape": {"M": 4096, "N": 4096}, "configs": configs}]}}}))
    out = tmp_path / "replay.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "replay_strategies.py"), str(recorded),
                           "--seeds", "4", "--json", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    row = json.loads(out.read_text())["rows"][0]
    assert row["space"] == size(SPACE) and row["failed"] == sum(math.isinf(t) for t in TABLE.values())
    for name in REGISTRY:
        assert row[name]["missed"] == 0 and 1 <= row[name]["mean"] <= size(SPACE)
    assert "within 2% of the exhaustive best" in proc.stdout
