import pytest

from hwtune import hwloop
from hwtune.backends import simperf
from hwtune.errors import HwtuneError, UsageError
from hwtune.hwloop import AbortSearch, Objective, Point, Space

H200_CLOCKS = list(range(1980, 344, -15))


def space() -> Space:
    return Space.from_limits(200, 700, 700, H200_CLOCKS)


def simulated(workload="decode"):
    def measure(p: Point) -> dict:
        lock = (345, p.sm_clock_max_mhz) if p.sm_clock_max_mhz else None
        r = simperf.run(workload, simperf.Settings(p.power_limit_w, lock))
        return {"tokens_per_s": r.tokens_per_s, "tokens_per_j": r.tokens_per_j, "power_w": r.power_w}
    return measure


def test_space_comes_from_the_reported_limits_and_includes_stock():
    s = space()
    assert s.power_limits_w[0] == 200 and s.power_limits_w[-1] == 700 and len(s.power_limits_w) == 10
    assert s.sm_clocks_mhz[-1] == 1980 and all(c in H200_CLOCKS for c in s.sm_clocks_mhz)
    assert s.stock == Point(700, None) and s.stock in s.points()
    assert len(s.points()) == 10 * (len(s.sm_clocks_mhz) + 1)


def test_energy_search_finds_exhaustive_best_within_twelve_evaluations():
    applied = []
    fast = hwloop.search(space(), simulated(), applied.append, Objective("energy", 0.98), budget=12)
    full = hwloop.search(space(), simulated(), lambda p: None, Objective("energy", 0.98), strategy="exhaustive")
    assert len(fast.evaluations) <= 12 and len(applied) == len(fast.evaluations)
    assert len(full.evaluations) == len(space().points())
    ref = fast.reference.metrics
    best = fast.best.metrics
    assert best["tokens_per_s"] >= 0.98 * ref["tokens_per_s"]
    assert best["tokens_per_j"] >= 1.25 * ref["tokens_per_j"]
    assert best["tokens_per_j"] >= 0.97 * full.best.metrics["tokens_per_j"]


def test_throughput_objective_never_gives_up_more_than_the_tie_band():
    r = hwloop.search(space(), simulated("gemm"), lambda p: None, Objective("throughput"), budget=12)
    top = max(e.metrics["tokens_per_s"] for e in r.evaluations if e.metrics)
    assert r.best.metrics["tokens_per_s"] >= 0.995 * top


def test_failed_point_is_data_and_search_goes_on():
    def apply(p):
        if p.sm_clock_max_mhz == 1140:
            raise HwtuneError("gpu0 sm_clock_mhz: NoPermission")
    r = hwloop.search(space(), simulated(), apply, Objective("energy"), budget=12)
    failed = [e for e in r.evaluations if e.status == "failed"]
    assert failed and "NoPermission" in failed[0].error
    assert r.best is not None and r.best.status == "ok"


def test_abort_stops_the_search_and_finish_restores_the_baseline():
    calls = []

    def apply(p):
        calls.append(p)
        if len(calls) == 3:
            raise AbortSearch("gpu0 thermal slowdown")
    r = hwloop.search(space(), simulated(), apply, Objective("energy"), budget=12)
    assert r.aborted and len(r.evaluations) == 3
    baseline = Point(650, None)
    assert hwloop.finish(r, apply, baseline, keep=True) == baseline
    assert calls[-1] == baseline


def test_finish_keeps_the_best_when_asked_and_restores_otherwise():
    r = hwloop.search(space(), simulated(), lambda p: None, Objective("energy"), budget=12)
    applied = []
    assert hwloop.finish(r, applied.append, space().stock, keep=True) == r.best.point
    assert hwloop.finish(r, applied.append, space().stock, keep=False) == space().stock
    assert applied == [r.best.point, space().stock]


def test_no_feasible_point_falls_back_to_stock():
    def measure(p):
        # Every non-stock point is much slower.
        tps = 100.0 if p == Point(700, None) else 10.0
        return {"tokens_per_s": tps, "tokens_per_j": 1.0 if tps == 100 else 5.0}
    r = hwloop.search(space(), measure, lambda p: None, Objective("energy"), budget=6)
    assert r.best.point == Point(700, None)


def test_point_builds_a_profile_gpu_section():
    assert Point(450, 1350).gpu_section([0, 1], 345) == {
        "select": [0, 1], "power_limit_w": 450, "sm_clock_mhz": [345, 1350]}
    assert Point(700).gpu_section("all", 345)["sm_clock_mhz"] == "reset"


def test_bad_inputs_are_usage_errors():
    with pytest.raises(UsageError):
        Objective("speed")
    with pytest.raises(UsageError):
        Objective("energy", floor=1.5)
    with pytest.raises(UsageError):
        hwloop.search(space(), simulated(), lambda p: None, strategy="magic")


def test_host_applier_refuses_a_point_the_engine_only_partly_applied(tmp_path):
    # A GPU whose clock lock is NotSupported is skipped by the engine and left as it was:
    # the point must fail, not be measured as if it were set.
    import json

    from hwtune.host import open_host
    from tests.conftest import run_hwtune

    sim = tmp_path / "host.json"
    run_hwtune("sim", "init", sim, "--gpus", "1", check=True)
    data = json.loads(sim.read_text())
    data["faults"] = [{"op": "set_locked_sm_clocks", "error": "NotSupported"}]
    sim.write_text(json.dumps(data))
    host = open_host(sim_path=sim)
    state = tmp_path / "state"
    sp = Space.from_host(host, [0])
    applier = hwloop.HostApplier(host, state, [0], sp.sm_clock_min_mhz)
    with pytest.raises(HwtuneError, match="not applied as asked"):
        applier(Point(600, sp.sm_clocks_mhz[0]))
    assert host.gpus.get_locked_sm_clocks_mhz(0) is None
    applier(Point(600, None))  # what the GPU can take still applies
    assert host.gpus.get_power_limit_w(0) == 600


def test_baseline_keeps_the_whole_locked_range_so_restoring_it_leaves_no_drift(tmp_path):
    from hwtune import engine
    from hwtune.host import open_host
    from hwtune.profiles import Profile
    from tests.conftest import run_hwtune

    sim = tmp_path / "host.json"
    run_hwtune("sim", "init", sim, "--gpus", "1", check=True)
    host, state = open_host(sim_path=sim), tmp_path / "state"
    profile = Profile.from_dict({"gpu": {"select": "all", "power_limit_w": 560, "sm_clock_mhz": [1410, 1785]}},
                                source="<test>")
    engine.apply(host, profile, state, lambda s: None)
    sp = Space.from_host(host, [0])
    applier = hwloop.HostApplier(host, state, [0], sp.sm_clock_min_mhz)
    baseline = applier.baseline()
    assert baseline == Point(560, 1785, 1410)
    applier(Point(700, sp.sm_clocks_mhz[0]))
    applier(baseline)
    assert engine.verify(host, profile, state) == []
    assert Point(**baseline.to_json()) == baseline


def test_a_signal_held_through_an_apply_stops_the_search_instead_of_failing_a_point():
    """signals.Interrupted is an HwtuneError, but not a failed point: swallowing it would keep
    tuning after Ctrl-C (the caller restores and exits 130)."""
    import signal

    from hwtune.signals import Interrupted

    applied = []

    def apply_point(p):
        applied.append(p)
        if len(applied) == 3:
            raise Interrupted(signal.SIGINT, "interrupted by SIGINT as the apply finished")

    with pytest.raises(Interrupted):
        hwloop.search(space(), simulated(), apply_point, Objective("energy", 0.98), budget=12)
    assert len(applied) == 3


def test_ctrl_c_between_taking_the_lock_and_naming_the_holder_releases_it(tmp_path, monkeypatch):
    import os

    from hwtune.lock import WriterLock

    real = os.pwrite

    def interrupted(*a):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "pwrite", interrupted)
    with pytest.raises(KeyboardInterrupt):
        WriterLock(tmp_path).__enter__()
    monkeypatch.setattr(os, "pwrite", real)
    with WriterLock(tmp_path):  # not "held by pid unknown" by our own leaked fd
        pass
