"""--read-only / HWTUNE_READ_ONLY=1 refuses every write before it happens; reads still work."""
from __future__ import annotations

import json

import pytest

from conftest import run_hwtune
from fixtures.simhost import make_sim
from fixtures.sysfs_tree import build, snapshot
from hwtune.errors import ReadOnlyError
from hwtune.host import Host

READ_ONLY = [("flag", ["--read-only"], None), ("env", [], {"HWTUNE_READ_ONLY": "1"})]


@pytest.mark.parametrize("how,flag,env", READ_ONLY, ids=[r[0] for r in READ_ONLY])
def test_apply_exits_4_and_writes_nothing_while_reads_work(tmp_path, how, flag, env):
    sim = make_sim(tmp_path)
    before = sim.read_bytes()
    proc = run_hwtune(*flag, "--sim", sim, "apply", "-p", "throughput", env=env)
    assert proc.returncode == 4 and "read-only" in proc.stderr
    assert sim.read_bytes() == before
    assert not (tmp_path / "host.json.state" / "journal.json").exists()
    status = json.loads(run_hwtune(*flag, "--sim", sim, "status", "--json", env=env, check=True).stdout)
    assert status["host"]["read_only"] is True
    plan = json.loads(run_hwtune(*flag, "--sim", sim, "plan", "-p", "throughput", "--json", env=env, check=True).stdout)
    assert len(plan["changes"]) == 12
    assert run_hwtune(*flag, "--sim", sim, "verify", "-p", "throughput", env=env).returncode == 1
    assert sim.read_bytes() == before


def test_rollback_with_a_journal_is_refused_in_read_only(tmp_path):
    sim = make_sim(tmp_path)
    run_hwtune("--sim", sim, "apply", "-p", "throughput", check=True)
    applied = sim.read_bytes()
    proc = run_hwtune("--read-only", "--sim", sim, "rollback")
    assert proc.returncode == 4 and sim.read_bytes() == applied
    assert (tmp_path / "host.json.state" / "journal.json").exists()


def test_real_path_read_only_never_touches_sysfs(tmp_path):
    root = build(tmp_path / "root")
    original = snapshot(root)
    common = ("--read-only", "--sysfs-root", root, "--state-dir", tmp_path / "state")
    assert run_hwtune(*common, "apply", "-p", "throughput").returncode == 4
    assert run_hwtune(*common, "plan", "-p", "throughput", check=True).stdout.count("->") == 4 + 2
    assert snapshot(root) == original


def test_backend_setters_refuse_before_calling_the_device(tmp_path):
    from hwtune.backends.sysfs import SysfsCpu, SysfsPcie
    from fixtures.fake_nvml import FakeNvml  # NVML writes cannot run here
    from hwtune.backends.nvml import NvmlGpus

    host = Host("real", read_only=True)
    nvml = FakeNvml()
    gpus = NvmlGpus(host.guard_write, nvml=nvml)
    for call in (lambda: gpus.set_power_limit_w(0, 500), lambda: gpus.set_persistence_mode(0, True),
                 lambda: gpus.set_locked_sm_clocks_mhz(0, 1410, 1980), lambda: gpus.reset_locked_memory_clocks(0)):
        with pytest.raises(ReadOnlyError):
            call()
    assert nvml.writes == []
    root = build(tmp_path / "root")
    original = snapshot(root)
    with pytest.raises(ReadOnlyError):
        SysfsPcie(root, host.guard_write).update_devctl("0000:18:00.0", 0x10, 0x10)
    with pytest.raises(ReadOnlyError):
        SysfsCpu(root, host.guard_write).set_governors({"cpu0": "performance"})
    assert snapshot(root) == original


@pytest.mark.parametrize("how,flag,env", READ_ONLY, ids=[r[0] for r in READ_ONLY])
def test_sim_set_and_sim_init_force_change_no_simulated_host_in_read_only(tmp_path, how, flag, env):
    sim = make_sim(tmp_path)
    before = sim.read_bytes()
    for cmd in (["sim", "set", sim, "write_delay_ms=5"], ["sim", "set", sim, "gpus.0.power_limit_w=300", "--json"],
                ["sim", "init", sim, "--force"]):
        r = run_hwtune(*flag, *cmd, env=env)
        assert r.returncode == 4, (cmd, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1 and "read-only mode" in r.stderr, r.stderr
        if "--json" in cmd:
            assert json.loads(r.stdout) == {"ok": False, "error": r.stderr.split(": ", 1)[1].strip(), "exit_code": 4}
        assert sim.read_bytes() == before
    run_hwtune(*flag, "sim", "show", sim, env=env, check=True)  # reading it still works


def test_a_read_only_daemon_once_names_a_pending_journal_and_writes_no_setting(tmp_path):
    sim = make_sim(tmp_path)
    run_hwtune("--sim", sim, "apply", "-p", "throughput", check=True)
    journal = tmp_path / "host.json.state" / "journal.json"
    data = json.loads(journal.read_text())
    data["status"] = "in_progress"  # as an apply killed half way leaves it
    journal.write_text(json.dumps(data))
    host, kept = sim.read_bytes(), journal.read_bytes()
    config = tmp_path / "hwtune.yaml"
    config.write_text("profile: throughput\nmetrics: {enabled: false}\n")
    config.chmod(0o600)
    r = run_hwtune("--read-only", "--sim", sim, "daemon", "--config", config, "--once")
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "interrupted apply" in r.stderr and "not restored" in r.stderr.splitlines()[-1], r.stderr
    assert sim.read_bytes() == host and journal.read_bytes() == kept
