import json

import pytest

from hwtune.backends import simperf
from hwtune.backends.simperf import Settings, run
from tests.conftest import SHARED

CAL = json.loads((SHARED / "calibration" / "h200-2026-12-02.json").read_text()) \
    if (SHARED / "calibration" / "h200-2026-12-02.json").exists() else None
needs_cal = pytest.mark.skipif(CAL is None, reason="calibration file not present")


@needs_cal
def test_stock_gemm_is_power_capped_near_the_measured_clock_and_throughput():
    r = run("gemm")
    m = CAL["gemm_bf16_8192"]
    assert r.throttle == "sw_power_cap" and r.clock_event_reasons & 0x4
    assert r.sm_clock_mhz == pytest.approx(m["sm_mhz_mean"], rel=0.02)
    assert r.tflops == pytest.approx(m["tflops"], rel=0.02)
    assert r.power_w == pytest.approx(m["power_w_mean"], rel=0.02)


@needs_cal
@pytest.mark.parametrize("name,key", [("copy", "copy_2GiB"), ("decode", "gemv_decode_8192x28672_bf16")])
def test_stock_memory_bound_work_runs_at_full_clock_and_measured_bandwidth(name, key):
    r = run(name)
    m = CAL[key]
    assert r.sm_clock_mhz == 1980 and r.throttle == "none"
    assert r.tbps == pytest.approx(m["tbps"], rel=0.02)
    assert r.power_w == pytest.approx(m["power_w_mean"], rel=0.02)


@needs_cal
def test_idle_power_matches_deep_idle_and_idle_after_work():
    assert simperf.idle_power_w(345) == pytest.approx(CAL["idle_deep"]["power_w"], abs=1)
    assert simperf.idle_power_w(1980) == pytest.approx(CAL["idle_after_work"]["power_w_mean"], abs=2)


def test_locking_sm_clocks_low_cuts_decode_power_much_more_than_throughput():
    stock = run("decode")
    low = run("decode", Settings(power_limit_w=700, sm_clock_mhz=(345, 1320)))
    assert low.throttle == "locked_clocks"
    assert low.tokens_per_s >= 0.98 * stock.tokens_per_s
    assert low.power_w <= 0.8 * stock.power_w
    assert low.tokens_per_j >= 1.25 * stock.tokens_per_j


def test_compute_bound_throughput_scales_with_the_locked_clock():
    a = run("gemm", Settings(sm_clock_mhz=(345, 1200)))
    b = run("gemm", Settings(sm_clock_mhz=(345, 900)))
    assert a.tflops / b.tflops == pytest.approx(1200 / 900, rel=0.01)


def test_lower_power_limit_lowers_clock_and_reports_the_cap():
    r = run("decode", Settings(power_limit_w=450))
    assert r.power_w == pytest.approx(450, abs=0.5)
    assert r.sm_clock_mhz < 1980 and r.throttle == "sw_power_cap"


def test_lower_memory_clock_slows_memory_bound_work():
    assert run("copy", Settings(memory_clock_mhz=2201)).tbps < 0.75 * run("copy").tbps


def test_results_are_labelled_simulated():
    assert "simulated" in run("decode").to_json()["simulated"]


def test_unknown_workload_names_the_known_ones():
    with pytest.raises(ValueError, match="decode"):
        run("nope")
