import json
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from daemon.metrics import CLOCK_EVENT_REASONS, Metrics, MetricsError, clock_event_reason_names


@pytest.fixture
def served():
    m = Metrics()
    port = m.serve("127.0.0.1", 0)
    yield m, port
    m.close()


def scrape(port) -> dict:
    """name{labels} -> value, from a real HTTP scrape."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        assert resp.status == 200
        text = resp.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}"] = s.value
    return out


TELEMETRY = {"temperature_c": 61, "power_w": 412.5, "sm_clock_mhz": 1980, "memory_clock_mhz": 3201,
             "clock_event_reasons": 0x4 | 0x80, "energy_mj": 123456, "xid_errors": 2,
             "power_limit_w": 700, "persistence_mode": True}


def test_gpu_telemetry_is_scraped_over_http_with_hwtune_namespace(served):
    m, port = served
    assert port > 0 and m.port == port
    m.set_gpu_info(0, {"uuid": "GPU-abc", "name": "NVIDIA H200", "pci_bus_id": "00000000:19:00.0"})
    m.update_gpu(0, TELEMETRY)
    v = scrape(port)
    assert v["hwtune_gpu_info{gpu=0,name=NVIDIA H200,pci_bus_id=00000000:19:00.0,uuid=GPU-abc}"] == 1
    assert v["hwtune_gpu_sm_clock_mhz{gpu=0}"] == 1980
    assert v["hwtune_gpu_memory_clock_mhz{gpu=0}"] == 3201
    assert v["hwtune_gpu_power_w{gpu=0}"] == 412.5
    assert v["hwtune_gpu_temperature_c{gpu=0}"] == 61
    assert v["hwtune_gpu_power_limit_w{gpu=0}"] == 700
    assert v["hwtune_gpu_persistence_mode{gpu=0}"] == 1
    assert v["hwtune_gpu_clock_event_reasons{gpu=0}"] == 0x84
    assert v["hwtune_gpu_clock_event_reason_active{gpu=0,reason=sw_power_cap}"] == 1
    assert v["hwtune_gpu_clock_event_reason_active{gpu=0,reason=hw_power_brake_slowdown}"] == 1
    assert v["hwtune_gpu_clock_event_reason_active{gpu=0,reason=sw_thermal_slowdown}"] == 0
    assert v["hwtune_gpu_clock_event_reason_active{gpu=0,reason=gpu_idle}"] == 0
    # The first XID count is the baseline; later increases advance the counter.
    assert v["hwtune_xid_errors_total{gpu=0}"] == 0
    m.update_gpu(0, {"xid_errors": 5, "clock_event_reasons": 0})
    v = scrape(port)
    assert v["hwtune_xid_errors_total{gpu=0}"] == 3
    assert v["hwtune_gpu_clock_event_reason_active{gpu=0,reason=hw_power_brake_slowdown}"] == 0
    assert v["hwtune_gpu_sm_clock_mhz{gpu=0}"] == 1980  # absent keys leave the gauge


def test_service_state_profile_drift_counters_and_last_tune(served):
    m, port = served
    m.set_host_kind("sim")
    m.set_profile("throughput")
    m.set_profile("efficiency")
    m.set_drift(2)
    m.inc_reapply()
    m.inc_reapply()
    m.inc_restore("thermal")
    m.inc_xid(1)
    m.set_last_tune({"timestamp_s": 1_700_000_000, "objective": 3.25, "ok": True})
    v = scrape(port)
    assert v["hwtune_host_info{kind=sim}"] == 1
    assert v["hwtune_profile_applied{profile=efficiency}"] == 1
    assert "hwtune_profile_applied{profile=throughput}" not in v
    assert v["hwtune_drifted_knobs{}"] == 2
    assert v["hwtune_reapply_total{}"] == 2
    assert v["hwtune_restore_total{reason=thermal}"] == 1
    assert v["hwtune_xid_errors_total{gpu=1}"] == 1
    assert v["hwtune_last_tune_timestamp_seconds{}"] == 1_700_000_000
    assert v["hwtune_last_tune_objective{}"] == 3.25
    assert v["hwtune_last_tune_ok{}"] == 1
    m.set_profile(None)
    assert not any(k.startswith("hwtune_profile_applied{") for k in scrape(port))


def test_kernel_speedups_come_from_the_dispatch_table_file(served, tmp_path):
    m, port = served
    table = {"entries": [
        {"kernel": "rmsnorm", "shape": {"M": 4096, "N": 8192}, "dtype": "bfloat16", "speedup": 1.8,
         "against": "torch.nn.functional.rms_norm"},
        {"kernel": "softmax", "shape": {"M": 1, "N": 4096}, "range": {"M": [1, 16]}, "dtype": "float16",
         "stock_ms": 0.3, "candidate_ms": 0.2},
        {"kernel": "matmul", "shape": {"M": 1, "K": 4096, "N": 4096}, "dtype": "bfloat16"},  # no speedup
        {"kernel": "matmul", "shape": [1, 4096, 4096], "dtype": "bfloat16", "speedup": 9.0},  # not an entry
    ]}
    path = tmp_path / "dispatch.json"
    path.write_text(json.dumps(table))
    assert m.load_dispatch_table(path) == 2
    v = scrape(port)
    assert v["hwtune_kernel_speedup{against=torch.nn.functional.rms_norm,dtype=bfloat16,kernel=rmsnorm,"
             "shape=M=4096,N=8192}"] == 1.8
    assert v["hwtune_kernel_speedup{against=stock,dtype=float16,kernel=softmax,shape=M=1,N=4096 Min[1,16]}"] \
        == pytest.approx(1.5)
    # A reload replaces the rows: stale winners disappear.
    m.set_kernel_speedups([])
    assert not any(k.startswith("hwtune_kernel_speedup") for k in scrape(port))
    with pytest.raises(MetricsError, match="missing.json"):
        m.load_dispatch_table(tmp_path / "missing.json")


def test_each_metrics_instance_has_its_own_registry():
    a, b = Metrics(), Metrics()
    a.set_drift(3)
    assert b"hwtune_drifted_knobs 3.0" in a.render()
    assert b"hwtune_drifted_knobs 0.0" in b.render()


def test_busy_port_is_a_clear_error(served):
    m, port = served
    other = Metrics()
    with pytest.raises(MetricsError, match=f"127.0.0.1:{port}: cannot listen"):
        other.serve("127.0.0.1", port)


def test_clock_event_reason_bits_match_nvml():
    import pynvml

    assert CLOCK_EVENT_REASONS["sw_power_cap"] == pynvml.nvmlClocksEventReasonSwPowerCap
    assert CLOCK_EVENT_REASONS["hw_thermal_slowdown"] == pynvml.nvmlClocksEventReasonHwThermalSlowdown
    assert CLOCK_EVENT_REASONS["hw_power_brake_slowdown"] == pynvml.nvmlClocksEventReasonHwPowerBrakeSlowdown
    assert CLOCK_EVENT_REASONS["sw_thermal_slowdown"] == pynvml.nvmlClocksEventReasonSwThermalSlowdown
    assert CLOCK_EVENT_REASONS["hw_slowdown"] == pynvml.nvmlClocksEventReasonHwSlowdown
    assert CLOCK_EVENT_REASONS["gpu_idle"] == pynvml.nvmlClocksEventReasonGpuIdle
    assert clock_event_reason_names(0x41) == ["gpu_idle", "hw_thermal_slowdown"]


def test_last_tune_with_a_non_numeric_value_is_a_metrics_error_and_sets_nothing():
    from daemon.metrics import Metrics, MetricsError

    m = Metrics()
    for bad in ({"timestamp_s": 1.0, "objective": "fast"}, {"timestamp_s": "yesterday"}, ["not", "a", "dict"]):
        with pytest.raises(MetricsError):
            m.set_last_tune(bad)
    text = m.render().decode()
    assert "hwtune_last_tune_timestamp_seconds 0.0" in text
    assert "hwtune_last_tune_objective 0.0" in text


def test_idle_connections_cannot_take_a_thread_and_a_descriptor_each(served):
    # Any local user may connect to 127.0.0.1: a thread and a descriptor per idle connection,
    # for ever, used up the daemon's file descriptors (the sim file, the journal and the
    # restore at stop then failed with 'Too many open files').
    import socket
    import threading
    import time

    m, port = served
    before = threading.active_count()
    idle = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(100)]
    try:
        time.sleep(0.5)
        assert threading.active_count() - before <= 32, threading.active_count() - before
        idle[0].settimeout(30)
        assert idle[0].recv(1) == b""   # closed by the server: no request within the timeout
    finally:
        for s in idle:
            s.close()
    time.sleep(0.2)
    assert "hwtune_drifted_knobs{}" in scrape(port)


def test_a_dispatch_table_that_is_a_fifo_or_nested_too_deeply_is_a_metrics_error(tmp_path):
    # The daemon loads it before READY=1, with its signal handlers in place: opening a FIFO
    # blocked for ever and SIGTERM could not end it; deep nesting was a RecursionError traceback.
    import os
    import threading

    m = Metrics()
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(MetricsError, match="deep.json"):
        m.load_dispatch_table(deep)
    fifo = tmp_path / "dispatch.json"
    os.mkfifo(fifo)
    errors = []

    def load():
        try:
            m.load_dispatch_table(fifo)
        except MetricsError as exc:
            errors.append(str(exc))
    t = threading.Thread(target=load, daemon=True)
    t.start()
    t.join(timeout=5)
    if t.is_alive():  # let the blocked open return before failing
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        t.join(timeout=5)
        pytest.fail("load_dispatch_table blocked on a FIFO")
    assert errors and "not a regular file" in errors[0]


def test_an_ipv6_address_is_served(tmp_path):
    # The config takes an IPv6 metrics.address; the server was IPv4 only ('Address family for
    # hostname not supported') and the daemon refused to start.
    import socket

    try:
        socket.socket(socket.AF_INET6).close()
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    m = Metrics()
    try:
        port = m.serve("::1", 0)
        m.set_drift(2)
        with urllib.request.urlopen(f"http://[::1]:{port}/metrics", timeout=10) as resp:
            assert b"hwtune_drifted_knobs 2.0" in resp.read()
    finally:
        m.close()
