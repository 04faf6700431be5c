"""PCIe DevCtl and CPU knobs on a sysfs fixture tree, through the real (non-sim) host path."""
from __future__ import annotations

import json
import os

import pytest

from conftest import run_hwtune
from fixtures.sysfs_tree import PCIE_CAP, build, config_space, snapshot
from fixtures.simhost import write_profile
from hwtune.backends.sysfs import ConfigSpaceError, find_pcie_capability

PROFILE = """\
pcie:
  select: nvidia
  relaxed_ordering: true
  max_read_request_bytes: 4096
cpu:
  governor: performance
  max_cstate_latency_us: 2
"""


def _cli(root, state, *args, **kw):
    return run_hwtune("--sysfs-root", root, "--state-dir", state, *args, **kw)


def test_capability_walk_finds_pcie_capability_after_pm_and_msi():
    cfg = config_space(0x10DE, 0x2335, 0x030200, 0x2920)
    assert find_pcie_capability(cfg) == PCIE_CAP
    with pytest.raises(ConfigSpaceError, match="only 64 bytes"):
        find_pcie_capability(cfg[:64], "pcie 0000:18:00.0")
    legacy = bytearray(cfg)
    legacy[6] = 0  # no capability list
    with pytest.raises(ConfigSpaceError, match="no capability list"):
        find_pcie_capability(bytes(legacy))


def test_status_reads_devctl_governor_and_cstates_from_sysfs(tmp_path):
    root = build(tmp_path / "root")
    s = json.loads(_cli(root, tmp_path / "state", "status", "--json", check=True).stdout)
    assert s["host"]["kind"] == "real"
    pcie = {f["bdf"]: f for f in s["pcie"]}
    assert set(pcie) == {"0000:18:00.0", "0000:2a:00.0", "0000:1a:00.0"}  # NVIDIA + Mellanox only
    gpu = pcie["0000:18:00.0"]
    assert (gpu["devctl"], gpu["relaxed_ordering"], gpu["max_read_request_bytes"], gpu["link"]) == \
        ("0x2920", False, 512, "gen5 x16")
    assert s["cpu"]["governor"] == "powersave" and s["cpu"]["cpus"] == 4
    assert s["cpu"]["max_cstate_latency_us"] == 133
    assert s["gpus"] == [] and s["gpu_error"]  # no NVML here: said, not crashed


def test_apply_writes_only_devctl_and_sysfs_files_and_rollback_restores_bytes(tmp_path):
    root = build(tmp_path / "root")
    state = tmp_path / "state"
    original = snapshot(root)
    prof = write_profile(tmp_path, "p", PROFILE)
    _cli(root, state, "apply", "-p", prof, check=True)
    now = snapshot(root)
    changed = {k for k in original if original[k] != now[k]}
    configs = {k for k in changed if k.endswith("/config")}
    assert configs == {"sys/bus/pci/devices/0000:18:00.0/config", "sys/bus/pci/devices/0000:2a:00.0/config"}
    for k in configs:
        diff = [i for i, (a, b) in enumerate(zip(original[k], now[k])) if a != b]
        assert set(diff) <= {PCIE_CAP + 8, PCIE_CAP + 9}
        devctl = int.from_bytes(now[k][PCIE_CAP + 8:PCIE_CAP + 10], "little")
        assert devctl == (0x2920 & ~0x7010) | (5 << 12) | 0x10  # MRRS 4096, RO on, rest kept
    governors = {k for k in changed if k.endswith("scaling_governor")}
    assert len(governors) == 4 and all(now[k] == b"performance" for k in governors)
    disabled = {k for k in changed if k.endswith("/disable")}
    assert disabled == {f"sys/devices/system/cpu/cpu{n}/cpuidle/state{s}/disable" for n in range(4) for s in (2, 3)}
    assert _cli(root, state, "verify", "-p", prof).returncode == 0
    assert _cli(root, state, "apply", "-p", prof, "--json", check=True).stdout.count('"target"') == 0
    _cli(root, state, "rollback", check=True)
    restored = snapshot(root)
    assert {k: restored[k].strip() for k in restored} == {k: original[k].strip() for k in original}


@pytest.mark.parametrize("planted", ["config", "scaling_governor", "disable"])
def test_a_link_that_leaves_the_sysfs_root_is_never_written_through(tmp_path, planted):
    # A fixture tree someone else can edit: an attribute replaced by a link to a file outside
    # the root. hwtune (root) must not write that file; the apply fails and is undone.
    root = build(tmp_path / "root")
    state = tmp_path / "state"
    inside = {"config": "sys/bus/pci/devices/0000:18:00.0/config",
              "scaling_governor": "sys/devices/system/cpu/cpu1/cpufreq/scaling_governor",
              "disable": "sys/devices/system/cpu/cpu2/cpuidle/state3/disable"}[planted]
    outside = tmp_path / "outside" / planted
    outside.parent.mkdir()
    outside.write_bytes((root / inside).read_bytes())
    (root / inside).unlink()
    (root / inside).symlink_to(outside)
    before, original = outside.read_bytes(), snapshot(root)
    r = _cli(root, state, "apply", "-p", write_profile(tmp_path, "p", PROFILE))
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "outside the sysfs root" in r.stderr.strip().splitlines()[-1]
    assert outside.read_bytes() == before
    assert {k: v.strip() for k, v in snapshot(root).items()} == {k: v.strip() for k, v in original.items()}


def test_select_by_class_and_by_bdf(tmp_path):
    root = build(tmp_path / "root")
    by_class = write_profile(tmp_path, "c", "pcie:\n  select: class:0x0207\n  relaxed_ordering: true\n")
    changes = json.loads(_cli(root, tmp_path / "s", "plan", "-p", by_class, "--json", check=True).stdout)["changes"]
    assert [c["target"] for c in changes] == ["pcie:0000:1a:00.0"]
    by_bdf = write_profile(tmp_path, "b", "pcie:\n  select: ['2a:00.0']\n  max_read_request_bytes: 256\n")
    changes = json.loads(_cli(root, tmp_path / "s", "plan", "-p", by_bdf, "--json", check=True).stdout)["changes"]
    assert [(c["target"], c["old"], c["new"]) for c in changes] == [("pcie:0000:2a:00.0", 512, 256)]


def test_config_space_truncated_for_non_root_is_reported_clearly(tmp_path):
    root = build(tmp_path / "root", config_size=64)
    s = json.loads(_cli(root, tmp_path / "state", "status", "--json", check=True).stdout)
    assert all(f["devctl"] is None and "only 64 bytes" in f["error"] and "root" in f["error"] for f in s["pcie"])
    plan = _cli(root, tmp_path / "state", "plan", "-p", write_profile(tmp_path, "p", PROFILE))
    assert plan.returncode == 0 and "only 64 bytes" in plan.stderr


def test_an_idle_state_latency_of_5000_digits_is_an_unreadable_knob_not_a_traceback(tmp_path):
    # Before: int() of it raised ValueError (Python's 4300-digit limit): a traceback from
    # plan, apply and verify, exit 1.
    root = build(tmp_path / "root")
    (root / "sys/devices/system/cpu/cpu0/cpuidle/state1/latency").write_text("9" * 5000 + "\n")
    prof = write_profile(tmp_path, "p", PROFILE)
    before = snapshot(root)
    for command in ("plan", "verify", "apply"):
        proc = _cli(root, tmp_path / "state", command, "-p", prof, "--json")
        assert "Traceback" not in proc.stderr, proc.stderr
        assert proc.returncode == 1 and "is not a latency" in proc.stderr, proc.stderr
        json.loads(proc.stdout)
    assert snapshot(root) == before


def test_host_without_cpufreq_or_cpuidle_skips_cpu_knobs_with_a_reason(tmp_path):
    root = build(tmp_path / "root", cpufreq=False, cpuidle=False)
    proc = _cli(root, tmp_path / "state", "plan", "-p", write_profile(tmp_path, "p", PROFILE), "--json", check=True)
    out = json.loads(proc.stdout)
    assert {c["target"] for c in out["changes"]} == {"pcie:0000:18:00.0", "pcie:0000:2a:00.0"}
    assert any("no cpufreq" in s for s in out["skipped"]) and any("no cpuidle" in s for s in out["skipped"])


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write a read-only file")
def test_unwritable_config_space_is_skipped_as_no_permission(tmp_path):
    root = build(tmp_path / "root")
    cfg = root / "sys/bus/pci/devices/0000:18:00.0/config"
    cfg.chmod(0o444)
    original = snapshot(root)
    prof = write_profile(tmp_path, "p", "pcie:\n  select: nvidia\n  relaxed_ordering: true\n  max_read_request_bytes: 4096\n")
    proc = _cli(root, tmp_path / "state", "apply", "-p", prof)
    assert proc.returncode == 0 and "pcie:0000:18:00.0" in proc.stderr and "NoPermission" in proc.stderr
    assert snapshot(root)[str(cfg.relative_to(root))] == original[str(cfg.relative_to(root))]


def test_status_text_on_a_host_without_cpufreq_says_so(tmp_path):
    root = build(tmp_path / "root", cpufreq=False)
    out = _cli(root, tmp_path / "state", "status", check=True).stdout
    assert "cpu (4 cpus): governor=n/a (no cpufreq) max_cstate_latency_us=133\n" in out
    bare = build(tmp_path / "bare", cpufreq=False, cpuidle=False)
    out = _cli(bare, tmp_path / "state", "status", check=True).stdout
    assert "cpu: governor=n/a (no cpufreq) max_cstate_latency_us=n/a (no cpuidle)\n" in out
    assert "None" not in out


@pytest.mark.parametrize("denied_cpu,outcome", [(0, "skipped"), (2, "restored")])
def test_governor_write_denied_part_way_never_leaves_cpus_half_written(tmp_path, monkeypatch, denied_cpu, outcome):
    # Root writes a 0444 file, so the denial is injected: sysfs refuses some CPUs' files.
    from pathlib import Path

    from hwtune import engine
    from hwtune.host import open_host
    from hwtune.profiles import Profile

    root = build(tmp_path / "root")
    original = snapshot(root)
    denied = root / f"sys/devices/system/cpu/cpu{denied_cpu}/cpufreq/scaling_governor"
    real_write = Path.write_text

    def write_text(self, text, *a, **kw):
        if self == denied:
            raise PermissionError(13, "Permission denied", str(self))
        return real_write(self, text, *a, **kw)
    monkeypatch.setattr(Path, "write_text", write_text)
    host = open_host(sysfs_root=root)
    profile = Profile.from_dict({"cpu": {"governor": "performance"}})
    state = tmp_path / "state"
    if outcome == "skipped":  # nothing written yet: NoPermission skips the knob
        result = engine.apply(host, profile, state, log=lambda line: None)
        assert result.changed == [] and any("NoPermission" in line for line in result.skipped)
    else:  # cpu0 and cpu1 were written: a failure, and they are put back
        with pytest.raises(engine.ApplyFailed, match="permission denied after other CPUs"):
            engine.apply(host, profile, state, log=lambda line: None)
    now = snapshot(root)
    assert {k: now[k].strip() for k in now} == {k: original[k].strip() for k in original}
    assert not (state / "journal.json").exists()
