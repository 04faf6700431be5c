"""No success claimed when nothing was checked (issue 11): every case through the real CLI in a
child process, the exit code and the first line of the message asserted, never a traceback."""
from __future__ import annotations

import json
import re

import pytest

from conftest import run_hwtune
from fixtures.simhost import make_sim, write_profile
from fixtures.sysfs_tree import build


def _lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.strip()]


def _messages(proc) -> list[str]:
    """stderr without the 'simulated host FILE' banner every --sim hardware command prints."""
    return [ln for ln in _lines(proc.stderr) if not ln.startswith("simulated host ")]


def _no_traceback(proc) -> None:
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr


def _nvml_present() -> bool:
    try:
        from hwtune.backends.nvml import NvmlGpus

        NvmlGpus()
        return True
    except Exception:
        return False


GPU_PROFILE = "gpu:\n  select: all\n  persistence_mode: true\n"
NVME_PROFILE = "pcie:\n  select: class:0x0108\n  relaxed_ordering: true\n"
BIOS_PROFILE = "bios:\n  source: redfish\n  expect: {PowerProfile: MaxPerf}\n"


@pytest.mark.skipif(_nvml_present(), reason="NVML is present: the 'NVML unavailable' case cannot happen here")
def test_status_on_a_host_without_a_gpu_points_to_the_demo_and_the_simulated_host(tmp_path):
    # Before: 'gpus: none (NVML unavailable: NVML Shared Library Not Found)' and nothing on what to do.
    proc = run_hwtune("--state-dir", tmp_path / "state", "status")
    _no_traceback(proc)
    assert proc.returncode == 0 and "gpus: none (NVML unavailable" in proc.stdout
    hint = _messages(proc)
    assert len(hint) == 1 and "hwtune demo" in hint[0] and "hwtune --sim host.json status" in hint[0]
    assert "hwtune demo" not in run_hwtune("--state-dir", tmp_path / "state", "status", "--json").stderr


@pytest.mark.skipif(_nvml_present(), reason="NVML is present: the 'NVML unavailable' case cannot happen here")
def test_gpu_section_without_nvml_is_a_warning_in_plan_and_apply_and_a_failure_in_verify(tmp_path):
    root = build(tmp_path / "root")
    prof = write_profile(tmp_path, "g", GPU_PROFILE)
    common = ("--sysfs-root", root, "--state-dir", tmp_path / "state")

    verify = run_hwtune(*common, "verify", "-p", prof)
    _no_traceback(verify)
    assert verify.returncode == 1, verify.stdout + verify.stderr
    first = _lines(verify.stdout)[0]
    assert first == "host does not match g: 1 not checked"
    assert "not checked: gpu: no device matched (NVML unavailable: " in verify.stdout
    assert "matches g" not in verify.stdout.replace("does not match", "")

    for command in ("plan", "apply"):
        proc = run_hwtune(*common, command, "-p", prof)
        _no_traceback(proc)
        assert proc.returncode == 0, proc.stderr
        assert _messages(proc)[0].startswith("warning: gpu: no device matched (NVML unavailable: ")
        assert "already matches" not in proc.stdout + proc.stderr

    doc = json.loads(run_hwtune(*common, "verify", "-p", prof, "--json").stdout)
    assert doc["matches"] is False and doc["not_checked"][0].startswith("gpu: no device matched")


def test_a_pcie_select_that_matches_nothing_is_named_and_fails_verify(tmp_path):
    sim = make_sim(tmp_path)
    prof = write_profile(tmp_path, "nvme", NVME_PROFILE)
    plan = run_hwtune("--sim", sim, "plan", "-p", prof)
    _no_traceback(plan)
    assert plan.returncode == 0
    assert _messages(plan)[0] == "warning: pcie: no device matched (select class:0x0108: no such device on this host)"
    assert _lines(plan.stdout)[0].startswith("profile nvme (") and "1 warning(s)" in plan.stdout

    apply = run_hwtune("--sim", sim, "apply", "-p", prof)
    assert apply.returncode == 0 and "matches" not in apply.stdout + apply.stderr
    assert _lines(apply.stdout)[0] == "applied nvme: 0 change(s), 0 skipped, 1 warning(s)"

    verify = run_hwtune("--sim", sim, "verify", "-p", prof)
    assert verify.returncode == 1
    assert _lines(verify.stdout)[0] == "host does not match nvme: 1 not checked"


def test_apply_with_bios_drift_never_says_the_host_matches(tmp_path):
    sim = make_sim(tmp_path)
    prof = write_profile(tmp_path, "b", BIOS_PROFILE)
    apply = run_hwtune("--sim", sim, "apply", "-p", prof)
    _no_traceback(apply)
    assert apply.returncode == 0
    assert "matches" not in apply.stdout + apply.stderr
    assert _lines(apply.stdout)[0] == "applied b: 0 change(s), 0 skipped, BIOS differs in 1 attribute(s) (never written)"
    assert "bios drift (not written): bios PowerProfile: SysDbpm -> MaxPerf" in apply.stderr
    verify = run_hwtune("--sim", sim, "verify", "-p", prof)
    assert verify.returncode == 1 and _lines(verify.stdout)[0] == "host does not match b: 1 setting(s) differ"


def test_a_profile_that_matches_says_so_only_when_everything_was_checked(tmp_path):
    sim = make_sim(tmp_path)
    run_hwtune("--sim", sim, "apply", "-p", "throughput", check=True)
    again = run_hwtune("--sim", sim, "apply", "-p", "throughput", check=True)
    assert _lines(again.stdout)[0] == "applied throughput: 0 change(s): the host already matches throughput"
    verify = run_hwtune("--sim", sim, "verify", "-p", "throughput")
    assert verify.returncode == 0 and _lines(verify.stdout) == ["host matches throughput"]


def test_an_empty_profile_is_warned_about_and_verifies_nothing(tmp_path):
    sim = make_sim(tmp_path)
    prof = write_profile(tmp_path, "empty", "")
    for command in ("plan", "apply"):
        proc = run_hwtune("--sim", sim, command, "-p", prof)
        _no_traceback(proc)
        assert proc.returncode == 0
        assert _messages(proc)[0] == "warning: profile empty sets nothing (no gpu, pcie, cpu or bios section)"
    verify = run_hwtune("--sim", sim, "verify", "-p", prof)
    assert verify.returncode == 1 and "host matches" not in verify.stdout
    assert "not checked: profile empty sets nothing" in verify.stdout


def test_daemon_once_without_a_config_says_no_profile_configured(tmp_path):
    sim = make_sim(tmp_path)
    proc = run_hwtune("--sim", sim, "daemon", "--once", timeout=60)
    _no_traceback(proc)
    assert proc.returncode == 0
    first = _lines(proc.stderr)[0]
    assert first.startswith("hwtune daemon: --once: no profile configured"), proc.stderr
    assert "nothing applied or checked" in first


def test_tune_table_marks_points_below_the_throughput_floor(tmp_path):
    sim = make_sim(tmp_path)
    proc = run_hwtune("--sim", sim, "tune", "--no-kernels", "--restore", "--budget", "12", "--json", timeout=120)
    _no_traceback(proc)
    assert proc.returncode == 0, proc.stderr
    evaluations = json.loads(proc.stdout)["search"]["evaluations"]
    stock = evaluations[0]["metrics"]["tokens_per_s"]
    table = proc.stderr[proc.stderr.index("hwtune tune (simulated"):]
    assert table.startswith("hwtune tune (simulated, objective energy, floor 98% of stock tokens/s")
    rows = [m.groups() for m in re.finditer(r"^ *(\d+)  (.{28}) +[\d.]+ +[\d.]+ +\d+  (.*)$", table, re.M)]
    assert len(rows) == len(evaluations)
    for (n, label, status), e in zip(rows, evaluations):
        assert label.strip() == e["label"]
        below = e["metrics"]["tokens_per_s"] / stock < 0.98
        assert status.startswith("below floor (") == below, (n, label, status)
        assert below or status.startswith("ok")
    assert any(status.startswith("below floor") for _, _, status in rows)  # the search probes under it
    assert sum(status.endswith(", best") for _, _, status in rows) == 1


def test_json_is_one_document_on_every_error_path_with_the_exit_code(tmp_path):
    # --json promises one JSON document on stdout: a failure is one too, never an empty stdout.
    from hwtune.backends.sim import SimFile

    sim = make_sim(tmp_path)
    bad = tmp_path / "bad.yaml"
    bad.write_text("gpu:\n  power_limit_w: -5\n")

    def doc(*args, env=None):
        r = run_hwtune("--sim", sim, *args, "--json", env=env)
        d = json.loads(r.stdout)
        assert r.returncode != 0 and d["ok"] is False and d["exit_code"] == r.returncode, (r.stdout, r.stderr)
        assert d["error"] in r.stderr
        return r.returncode

    assert doc("plan", "-p", bad) == 2
    assert doc("verify", "-p", "no-such-profile") == 2
    assert doc("apply", env={"HWTUNE_READ_ONLY": "1"}) == 4
    SimFile(sim).update(lambda d: d.__setitem__("faults", [{"op": "set_locked_sm_clocks", "gpu": 1,
                                                            "error": "GpuIsLost"}]))
    assert doc("apply") == 1
    SimFile(sim).update(lambda d: d.__setitem__("faults", []))
    assert run_hwtune("--sim", sim, "apply").returncode == 0
    SimFile(sim).update(lambda d: d.__setitem__("faults", [{"op": "set_persistence_mode", "error": "Unknown"}]))
    assert doc("rollback") == 1  # incomplete: the journal stays
    assert doc("apply") == 3  # and apply refuses until it is rolled back
    assert doc("plan", "--bogus") == 2  # a usage error too (argparse's own and hwtune's)
    assert doc("plan", "-p") == 2


def test_apply_json_names_a_bmc_it_could_not_read_instead_of_an_empty_bios_drift(tmp_path):
    root = build(tmp_path / "root")
    prof = write_profile(tmp_path, "bmc-down", "cpu:\n  governor: performance\nbios:\n  endpoint: http://127.0.0.1:9\n"
                                               "  expect: {PowerProfile: MaxPerf}\n")
    common = ("--sysfs-root", root, "--state-dir", tmp_path / "state")
    proc = run_hwtune(*common, "apply", "-p", prof, "--json")
    _no_traceback(proc)
    doc = json.loads(proc.stdout)
    assert doc["bios_drift"] == [] and len(doc["not_checked"]) == 1
    assert doc["not_checked"][0].startswith("bios: not checked (redfish http://127.0.0.1:9: BMC unreachable")
    run_hwtune(*common, "rollback", check=True)


def test_share_export_takes_json_like_every_command_that_prints_for_scripts(tmp_path):
    # Before: `share export --json` was refused (unrecognized arguments), and with -o FILE
    # nothing on stdout said what was written.
    state = tmp_path / "state"
    run_hwtune("--state-dir", state, "search", "rmsnorm", "--device", "cpu", "--budget", "1",
               "--shape", "M=1,N=128", check=True, timeout=300)   # something to export
    out = tmp_path / "bundle.json"
    proc = run_hwtune("--state-dir", state, "share", "export", "--device", "cpu", "--json", "-o", out)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["file"] == str(out) and doc["rows"] == len(json.loads(out.read_text())["attempts"])
    plain = run_hwtune("--state-dir", state, "share", "export", "--device", "cpu", "--json")
    assert plain.returncode == 0 and "attempts" in json.loads(plain.stdout)
    bad = run_hwtune("--state-dir", state, "share", "export", "--device", "cpu", "--json", "-o", tmp_path / "no" / "b")
    assert bad.returncode == 2 and json.loads(bad.stdout)["exit_code"] == 2


def test_a_failed_apply_counts_the_changes_it_made_apart_from_the_write_that_failed(tmp_path):
    # Before: 3 settings changed, the 4th write failed, and apply said 'restoring 4 change(s)' and
    # 'restored 4 change(s)': the failed write (put back in case it happened) counted as a change.
    from hwtune.backends.sim import SimFile

    sim = make_sim(tmp_path)
    SimFile(sim).update(lambda d: d.__setitem__("faults", [{"op": "set_power_limit", "gpu": 1, "error": "Unknown"}]))
    before = SimFile(sim).read()
    profile = write_profile(tmp_path, "p", "gpu:\n  power_limit_w: 500\n  persistence_mode: true\n")
    proc = run_hwtune("--sim", sim, "apply", "-p", profile)
    _no_traceback(proc)
    assert proc.returncode == 1
    assert "restoring 3 change(s) and the setting whose write failed" in proc.stderr, proc.stderr
    last = _messages(proc)[-1]
    assert last.startswith("hwtune apply: apply failed: gpu1 set_power_limit: Unknown; restored 3 change(s) and "
                           "the setting whose write failed, the host is as it was"), last
    assert SimFile(sim).read()["gpus"] == before["gpus"]
