"""Engine rules: the single-writer lock, the pending journal, the durable journal, and the
NVML backend's conversions (against a fake pynvml: NVML cannot run here)."""
from __future__ import annotations

import json

import pytest

from conftest import run_hwtune
from fixtures.simhost import make_sim, status_json
from hwtune import engine
from hwtune.backends.nvml import NvmlGpus
from hwtune.errors import KnobUnavailable, LockBusyError
from hwtune.host import open_host
from hwtune.journal import Journal
from hwtune.lock import WriterLock
from hwtune.profiles import Profile
from fixtures.fake_nvml import FakeNvml


def test_nvml_backend_converts_units_and_reads_robustly():
    nvml = FakeNvml(deny={"energy": 3})
    g = NvmlGpus(lambda op: None, nvml=nvml)
    assert g.info(0) == {"index": 0, "uuid": "GPU-1234", "name": "NVIDIA H200", "pci_bus_id": "00000000:18:00.0"}
    assert g.get_power_limit_w(0) == 550.0 and g.get_power_limit_constraints_w(0) == (200.0, 700.0)
    assert g.get_power_limit_default_w(0) == 700.0 and g.get_persistence_mode(0) is True
    assert g.get_supported_sm_clocks_mhz(0) == [345, 1965, 1980]
    assert g.get_locked_sm_clocks_mhz(0) == "unknown"  # NVML has no getter
    t = g.telemetry(0)
    # No ClocksEventReasons in this binding: falls back to ThrottleReasons; energy NotSupported -> None.
    assert t == {"temperature_c": 41, "power_w": 123.456, "sm_clock_mhz": 1980, "memory_clock_mhz": 3201,
                 "clock_event_reasons": 4, "energy_mj": None, "xid_errors": None}
    g.set_power_limit_w(0, 612.5)
    g.set_persistence_mode(0, True)
    assert nvml.writes == [("power", "h0", 612500), ("persistence", "h0", 1)]


def test_nvml_no_permission_is_knob_unavailable():
    g = NvmlGpus(lambda op: None, nvml=FakeNvml(deny={"nvmlDeviceSetGpuLockedClocks": 4}))
    with pytest.raises(KnobUnavailable) as exc:
        g.set_locked_sm_clocks_mhz(0, 1410, 1980)
    assert exc.value.reason == "NoPermission" and exc.value.target == "gpu0"


def test_second_writer_is_refused_naming_the_holder(tmp_path):
    sim = make_sim(tmp_path)
    with WriterLock(tmp_path / "host.json.state"):
        proc = run_hwtune("--sim", sim, "apply", "-p", "throughput")
        import os
        assert proc.returncode == 5 and f"pid {os.getpid()}" in proc.stderr
    with WriterLock(tmp_path / "host.json.state"):
        with pytest.raises(LockBusyError):
            WriterLock(tmp_path / "host.json.state").__enter__()


def test_interrupted_journal_blocks_apply_until_rollback(tmp_path):
    sim = make_sim(tmp_path)
    state = tmp_path / "host.json.state"
    original = status_json(sim)
    host = open_host(sim_path=sim)
    # What a killed apply leaves: the original journaled, the write done, no commit.
    j = Journal(state)
    j.begin("throughput")
    j.record("gpu0", "gpu_power", "power_limit_w", 700)
    host.gpus.set_power_limit_w(0, 400)
    assert engine.pending_journal(state)["entries"][0]["original"] == 700
    proc = run_hwtune("--sim", sim, "apply", "-p", "throughput")
    assert proc.returncode == 3 and "interrupted apply" in proc.stderr and "hwtune rollback" in proc.stderr
    plan = run_hwtune("--sim", sim, "plan", "-p", "throughput")
    assert plan.returncode == 0 and "interrupted apply" in plan.stderr
    run_hwtune("--sim", sim, "rollback", check=True)
    assert status_json(sim) == original
    again = run_hwtune("--sim", sim, "rollback")
    assert again.returncode == 0 and "nothing to roll back" in again.stderr


def test_journal_holds_each_original_before_its_write(tmp_path):
    sim = make_sim(tmp_path)
    state = tmp_path / "s"
    host = open_host(sim_path=sim)
    seen = []

    def log(line):
        if line.startswith("set "):
            seen.append(json.loads((state / "journal.json").read_text()))
    engine.apply(host, Profile.from_dict({"gpu": {"power_limit_w": 500, "persistence_mode": True}}), state, log)
    assert [len(j["entries"]) for j in seen] == [1, 2, 3, 4]
    assert all(j["status"] == "in_progress" for j in seen)
    final = json.loads((state / "journal.json").read_text())
    assert final["status"] == "committed"
    assert {(e["target"], e["field"], e["original"]) for e in final["entries"]} == {
        ("gpu0", "persistence_mode", False), ("gpu1", "persistence_mode", False),
        ("gpu0", "power_limit_w", 700), ("gpu1", "power_limit_w", 700)}


def test_read_back_mismatch_restores_everything(tmp_path, monkeypatch):
    sim = make_sim(tmp_path)
    host = open_host(sim_path=sim)
    before = engine.status(host, tmp_path / "s")
    # A device that accepts the write but keeps another value (clamped firmware limit).
    real_set = host.gpus.set_power_limit_w
    monkeypatch.setattr(host.gpus, "set_power_limit_w", lambda i, w: real_set(i, w - 50 if (i, w) == (1, 500) else w))
    with pytest.raises(engine.ApplyFailed, match="gpu1 power_limit_w: read back 450 after writing 500"):
        engine.apply(host, Profile.from_dict({"gpu": {"power_limit_w": 500, "persistence_mode": True}}),
                     tmp_path / "s", log=lambda line: None)
    assert engine.status(host, tmp_path / "s") == before


def test_journal_profiles_stay_bounded_over_many_applies(tmp_path):
    from hwtune.journal import MAX_PROFILES

    sim = make_sim(tmp_path)
    state = tmp_path / "s"
    host = open_host(sim_path=sim)
    # A tune applies one profile per point; the same point again must not add a row either.
    for w in list(range(300, 300 + 10 * (MAX_PROFILES + 2), 10)) + [300, 300]:
        engine.apply(host, Profile.from_dict({"gpu": {"power_limit_w": w}}, f"<point {w}W>"), state,
                     log=lambda line: None)
    runs = json.loads((state / "journal.json").read_text())["profiles"]
    names = [r["profile"] for r in runs]
    assert len(names) == MAX_PROFILES and len(set(names)) == len(names) and names[-1] == "<point 300W>"
    assert engine.status(host, state)["journal"]["profiles"] == names
    engine.rollback(host, state, log=lambda line: None)
    assert engine.status(host, state)["gpus"][0]["power_limit_w"] == 700
