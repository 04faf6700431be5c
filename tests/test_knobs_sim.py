"""Each knob's read / plan / apply / restore round trip on the simulated host, fault
injection, and the sim file itself (atomic writes, sim set / show)."""
from __future__ import annotations

import json

import pytest

from conftest import run_hwtune
from fixtures.simhost import make_sim, status_json, write_profile
from hwtune import engine
from hwtune.host import open_host
from hwtune.knobs import KNOBS
from hwtune.profiles import Profile

ROUND_TRIPS = {
    # name: (profile section data, (target, field), expected old, expected new)
    "persistence": ({"gpu": {"persistence_mode": True}}, ("gpu1", "persistence_mode"), False, True),
    "power_limit": ({"gpu": {"power_limit_w": 550}}, ("gpu1", "power_limit_w"), 700, 550),
    "power_limit_percent": ({"gpu": {"power_limit_w": "50%"}}, ("gpu0", "power_limit_w"), 700, 350),
    "sm_clocks": ({"gpu": {"sm_clock_mhz": [1410, 1980]}}, ("gpu0", "sm_clock_mhz"), "reset", [1410, 1980]),
    "memory_clocks": ({"gpu": {"memory_clock_mhz": 2201}}, ("gpu1", "memory_clock_mhz"), "reset", [2201, 2201]),
    "pcie_relaxed_ordering": ({"pcie": {"select": "nvidia", "relaxed_ordering": True}},
                              ("pcie:0000:18:00.0", "relaxed_ordering"), False, True),
    "pcie_mrrs": ({"pcie": {"select": "class:0x0207", "max_read_request_bytes": 4096}},
                  ("pcie:0000:1a:00.0", "max_read_request_bytes"), 512, 4096),
    "cpu_governor": ({"cpu": {"governor": "performance"}}, ("cpu", "governor"), "powersave", "performance"),
    "cpu_cstate_limit": ({"cpu": {"max_cstate_latency_us": 10}}, ("cpu", "max_cstate_latency_us"), 133, 10),
}


@pytest.mark.parametrize("name", sorted(ROUND_TRIPS))
def test_knob_round_trip_read_plan_apply_verify_rollback(tmp_path, name):
    data, (target, field), old, new = ROUND_TRIPS[name]
    sim = make_sim(tmp_path)
    state = tmp_path / "state"
    host = open_host(sim_path=sim)
    profile = Profile.from_dict(data, f"<{name}>")
    before = engine.status(host, state)

    changes = engine.plan(host, profile, state)
    assert engine.Change(target, field, old, new, changes[0].family) in changes
    assert all(c.knob == field for c in changes)
    result = engine.apply(host, profile, state, log=lambda line: None)
    assert result.ok and len(result.changed) == len(changes)
    family = changes[0].family
    assert KNOBS[family]().read(host, target)[field] == new
    assert engine.verify(host, profile, state) == []

    written = sim.read_bytes()
    again = engine.apply(host, profile, state, log=lambda line: None)
    assert again.changed == [] and sim.read_bytes() == written  # a second apply writes nothing

    restored = engine.rollback(host, state, log=lambda line: None)
    assert len(restored) == len(changes)
    assert engine.status(host, state) == before
    assert engine.rollback(host, state, log=lambda line: None) == []


@pytest.mark.parametrize("encoding", [6, 7])
def test_a_reserved_max_read_request_encoding_found_on_the_device_is_rolled_back_exactly(tmp_path, encoding):
    # Firmware can leave DevCtl bits 14:12 at a reserved encoding (6, 7: "8192", "16384").
    # That is the original apply journals; rollback must put back those very bits, not keep
    # the entry as "not a max read request size" with the host left at 4096.
    devctl = (encoding << 12) | (1 << 11) | (1 << 8) | (1 << 5)
    sim = make_sim(tmp_path, **{"pcie.0.devctl": devctl})
    host = open_host(sim_path=sim)
    state = tmp_path / "state"
    profile = Profile.from_dict({"pcie": {"select": "nvidia", "max_read_request_bytes": 4096}})
    engine.apply(host, profile, state, log=lambda line: None)
    assert json.loads(sim.read_text())["pcie"][0]["devctl"] == (devctl & ~(7 << 12)) | (5 << 12)
    engine.rollback(host, state, log=lambda line: None)
    assert json.loads(sim.read_text())["pcie"][0]["devctl"] == devctl
    assert not (state / "journal.json").exists()


def test_cstate_limit_disables_only_deeper_states(tmp_path):
    sim = make_sim(tmp_path)
    host = open_host(sim_path=sim)
    engine.apply(host, Profile.from_dict({"cpu": {"max_cstate_latency_us": 2}}), tmp_path / "s", log=lambda line: None)
    states = host.cpu.cstates()
    assert {s["name"] for s in states if s["disabled"]} == {"C1E", "C6"}
    assert all(not s["disabled"] for s in states if s["latency_us"] <= 2)


def test_locked_clocks_are_journaled_as_reset(tmp_path):
    sim = make_sim(tmp_path)
    run_hwtune("--sim", sim, "apply", "-p", "throughput", check=True)
    journal = json.loads((tmp_path / "host.json.state" / "journal.json").read_text())
    clocks = [e for e in journal["entries"] if e["family"] == "gpu_clocks"]
    assert clocks and all(e["original"] == "reset" for e in clocks)
    assert journal["status"] == "committed"


def test_full_profile_cli_round_trip_and_later_profile_keeps_earliest_originals(tmp_path):
    sim = make_sim(tmp_path)
    original = status_json(sim)
    run_hwtune("--sim", sim, "apply", "-p", "throughput", check=True)
    assert run_hwtune("--sim", sim, "verify", "-p", "throughput").returncode == 0
    proc = run_hwtune("--sim", sim, "apply", "-p", "efficiency", "--json", check=True)
    assert {c["knob"] for c in json.loads(proc.stdout)["changed"]} == {"power_limit_w", "sm_clock_mhz", "memory_clock_mhz"}
    drift = run_hwtune("--sim", sim, "verify", "-p", "throughput", "--json")
    assert drift.returncode == 1 and json.loads(drift.stdout)["drift"]
    run_hwtune("--sim", sim, "rollback", check=True)
    assert status_json(sim) == original


def test_setter_failure_on_gpu1_restores_every_value(tmp_path):
    sim = make_sim(tmp_path, faults=[{"op": "set_power_limit", "gpu": 1, "error": "Unknown"}])
    original = status_json(sim)
    prof = write_profile(tmp_path, "capped", "include: [throughput]\ngpu:\n  power_limit_w: 550\n")
    proc = run_hwtune("--sim", sim, "apply", "-p", prof)
    assert proc.returncode == 1
    assert "gpu1 set_power_limit: Unknown" in proc.stderr and "the host is as it was" in proc.stderr
    assert status_json(sim) == original
    assert not (tmp_path / "host.json.state" / "journal.json").exists()


def test_no_permission_skips_that_gpu_whole_and_applies_the_rest(tmp_path):
    sim = make_sim(tmp_path, faults=[{"op": "set_locked_sm_clocks", "gpu": 1, "error": "NoPermission"}])
    original = status_json(sim)
    proc = run_hwtune("--sim", sim, "apply", "-p", "throughput", "--json")
    assert proc.returncode == 0, proc.stderr
    skips = [line for line in proc.stderr.splitlines() if "NoPermission" in line]
    assert len(skips) == 1 and "gpu1" in skips[0] and "left as it was" in skips[0]
    now = status_json(sim)
    assert now["gpus"][1] == original["gpus"][1]  # persistence (written first) was put back
    assert now["gpus"][0]["sm_clock_mhz"] == [1755, 1980] and now["gpus"][0]["persistence_mode"] is True
    run_hwtune("--sim", sim, "rollback", check=True)
    assert status_json(sim) == original


def test_a_gpu_that_reports_no_supported_clocks_gets_no_clock_lock(tmp_path):
    # Before: an empty supported list skipped the check, so [1755, 1980] was planned and
    # written to a GPU that reports no clock it supports (NVML answers NotSupported with none).
    sim = make_sim(tmp_path)
    run_hwtune("sim", "set", sim, "gpus.1.supported_sm_clocks_mhz=[]", check=True)
    plan = json.loads(run_hwtune("--sim", sim, "plan", "-p", "throughput", "--json", check=True).stdout)
    assert not [c for c in plan["changes"] if c["target"] == "gpu1" and c["knob"] == "sm_clock_mhz"]
    assert any("gpu1" in s and "sm_clock_mhz" in s and "no supported clocks" in s for s in plan["skipped"]), plan
    verify = run_hwtune("--sim", sim, "verify", "-p", "throughput", "--json")
    assert verify.returncode == 1 and json.loads(verify.stdout)["matches"] is False
    run_hwtune("--sim", sim, "apply", "-p", "throughput", check=True)
    assert status_json(sim)["gpus"][1]["sm_clock_mhz"] == "reset"
    assert status_json(sim)["gpus"][0]["sm_clock_mhz"] == [1755, 1980]


def test_a_value_rollback_could_not_put_back_is_never_changed(tmp_path):
    # Before: gpu0 at 900 W with constraints 200..700 was set to 500 W and its original
    # journaled; rollback then refused that original (outside the constraints), so the host
    # could never go back and every later apply was refused (exit 3).
    sim = make_sim(tmp_path)
    run_hwtune("sim", "set", sim, "gpus.0.power_limit_w=900", check=True)
    prof = write_profile(tmp_path, "p", "gpu:\n  persistence_mode: true\n  power_limit_w: 500\n")
    proc = run_hwtune("--sim", sim, "apply", "-p", prof, "--json")
    assert proc.returncode == 0, proc.stderr
    skips = [line for line in proc.stderr.splitlines() if line.startswith("skip gpu0")]
    assert len(skips) == 1 and "900" in skips[0] and "left as it was" in skips[0], proc.stderr
    now = status_json(sim)
    assert now["gpus"][0]["power_limit_w"] == 900 and now["gpus"][0]["persistence_mode"] is False
    assert now["gpus"][1]["power_limit_w"] == 500
    run_hwtune("--sim", sim, "rollback", check=True)
    assert status_json(sim)["gpus"][1]["power_limit_w"] == 700
    assert not (tmp_path / "host.json.state" / "journal.json").exists()


def test_sim_set_injects_telemetry_and_status_reports_it(tmp_path):
    sim = make_sim(tmp_path)
    run_hwtune("sim", "set", sim, "gpus.1.telemetry.temperature_c=95", "gpus.1.telemetry.xid_errors=2", check=True)
    gpu = status_json(sim)["gpus"][1]
    assert gpu["telemetry"]["temperature_c"] == 95 and gpu["telemetry"]["xid_errors"] == 2
    bad = run_hwtune("sim", "set", sim, "gpus.9.telemetry.temperature_c=1")
    assert bad.returncode == 2 and "no element '9'" in bad.stderr
    shown = json.loads(run_hwtune("sim", "show", sim, check=True).stdout)
    assert len(shown["gpus"]) == 2 and len(shown["gpus"][0]["supported_sm_clocks_mhz"]) == 110


def test_sim_init_is_an_h200_like_node(tmp_path):
    s = status_json(make_sim(tmp_path, gpus=8))
    assert len(s["gpus"]) == 8
    g = s["gpus"][0]
    assert g["power_limit_constraints_w"] == [200, 700] and g["power_limit_default_w"] == 700
    assert g["supported_sm_clocks_mhz"] == {"count": 110, "min": 345, "max": 1980}
    assert g["supported_memory_clocks_mhz"] == [2201, 3201]
    nvidia = [f for f in s["pcie"] if f["vendor"] == "0x10de"]
    assert len(nvidia) == 8 and all(f["link"] == "gen5 x16" and f["max_read_request_bytes"] == 512
                                    and f["relaxed_ordering"] is False for f in nvidia)
    assert s["cpu"]["governor"] == "powersave" and s["bios"]["attributes"]["ProcTurboMode"] == "Enabled"


def test_bios_expectation_is_checked_never_written(tmp_path):
    sim = make_sim(tmp_path)
    prof = write_profile(tmp_path, "b", "bios:\n  source: redfish\n  expect: {PowerProfile: MaxPerf, ProcTurboMode: Enabled}\n")
    before = sim.read_bytes()
    proc = run_hwtune("--sim", sim, "verify", "-p", prof, "--json")
    assert proc.returncode == 1
    drift = json.loads(proc.stdout)["drift"]
    assert [(d["target"], d["knob"], d["new"]) for d in drift] == [("bios", "PowerProfile", "MaxPerf")]
    assert run_hwtune("--sim", sim, "apply", "-p", prof).returncode == 0
    assert sim.read_bytes() == before


def test_gpu_select_by_index_or_uuid_limits_the_targets(tmp_path):
    sim = make_sim(tmp_path, gpus=4)
    host = open_host(sim_path=sim)
    uuid = host.gpus.info(2)["uuid"]
    for select in ([2], [uuid]):
        p = Profile.from_dict({"gpu": {"select": select, "power_limit_w": 600}})
        assert [c.target for c in engine.plan(host, p, tmp_path / "s")] == ["gpu2"]


def test_rollback_lines_say_what_was_restored_in_profile_terms(tmp_path):
    sim = make_sim(tmp_path)
    host = open_host(sim_path=sim)
    profile = Profile.from_dict({"cpu": {"governor": "performance", "max_cstate_latency_us": 2}})
    engine.apply(host, profile, tmp_path / "s", log=lambda line: None)
    lines = []
    engine.rollback(host, tmp_path / "s", log=lines.append)
    n = len(host.cpu.cstates())
    assert lines == [f"restored cpu max_cstate_latency_us: 2 -> 133 (0 of {n} idle states disabled)",
                     "restored cpu governor: performance -> powersave"]


def test_status_text_names_the_sim_file_and_prints_bios_and_journal_lines(tmp_path):
    sim = make_sim(tmp_path)
    run_hwtune("--sim", sim, "apply", "-p", "throughput", check=True)
    lines = run_hwtune("--sim", sim, "status", check=True).stdout.splitlines(keepends=True)
    assert lines[0] == f"host: simulated ({sim})\n"
    assert "cpu (8 cpus): governor=performance (offered: performance, powersave) max_cstate_latency_us=2\n" in lines
    assert "bios (sim): PowerProfile=SysDbpm ProcTurboMode=Enabled LogicalProc=Enabled SriovGlobalEnable=Enabled\n" in lines
    assert lines[-1] == "journal: committed, 12 original value(s) from throughput\n"
    assert all(line.endswith("\n") for line in lines)
