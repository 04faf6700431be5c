"""Roofline: ceilings measured once per fingerprint and cached; every timing gets a bound class."""
import json

from kernelsearch import roofline
from kernelsearch.roofline import classify, load_or_measure

H200 = {"copy_gb_s": 4300.0, "matmul_tflops": 800.0}


def test_large_copy_like_kernel_is_memory_bound_with_percent_of_copy_bandwidth():
    nbytes = 2 * 32768 * 8192 * 2                    # rmsnorm 32768x8192 bf16: read + write
    ideal_ms = nbytes / 4300e9 * 1e3
    kind, pct = classify(4 * 32768 * 8192, nbytes, ideal_ms / 0.96, H200)
    assert kind == "memory" and round(pct) == 96


def test_big_matmul_is_compute_bound():
    flops = 2 * 4096**3
    kind, pct = classify(flops, 3 * 4096 * 4096 * 2, flops / 800e12 * 1e3 / 0.5, H200)
    assert kind == "compute" and round(pct) == 50


def test_tiny_shape_far_above_its_roofline_is_overhead_bound():
    kind, pct = classify(4 * 4096, 2 * 4096 * 2, 0.004, H200)   # 16 KB moved in 4 us
    assert kind == "overhead" and pct < 5


def test_failed_timing_is_unknown():
    assert classify(1, 1, float("inf"), H200) == ("unknown", 0.0)


def test_ceilings_are_measured_once_per_fingerprint(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(roofline, "measure", lambda device: calls.append(device) or dict(H200))
    cache = tmp_path / "roofline.json"
    assert load_or_measure(cache, "cpu", "cpu-1")["copy_gb_s"] == 4300.0
    assert load_or_measure(cache, "cpu", "cpu-1")["fingerprint"] == "cpu-1"
    assert calls == ["cpu"]
    load_or_measure(cache, "cpu", "cpu-2")
    assert calls == ["cpu", "cpu"] and json.loads(cache.read_text())["fingerprint"] == "cpu-2"


def test_cpu_measurement_gives_positive_ceilings():
    c = roofline.measure("cpu")
    assert c["copy_gb_s"] > 0 and c["matmul_tflops"] > 0
