import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import ROOT

UNITS = ROOT / "systemd"
NAMES = ["hwtune.service", "hwtune-retune.service", "hwtune-retune.timer"]
INSTALLED_BINARY = "/usr/local/bin/hwtune"

needs_systemd_analyze = pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                                           reason="systemd-analyze is not installed on this host")


def directives(name: str) -> dict[str, list[str]]:
    """'Section.Key' -> every value it is given (systemd keys may repeat)."""
    out: dict[str, list[str]] = {}
    section = ""
    for raw in (UNITS / name).read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        out.setdefault(f"{section}.{key.strip()}", []).append(value.strip())
    return out


def verify(tmp_path: Path, files: dict[str, str]) -> subprocess.CompletedProcess:
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    return subprocess.run(["systemd-analyze", "verify", *[str(tmp_path / n) for n in files]],
                          capture_output=True, text=True, timeout=60)


def installed_copies(tmp_path: Path) -> dict[str, str]:
    # verify checks that ExecStart's binary exists and is executable: point it at a shim.
    shim = tmp_path / "bin" / "hwtune"
    shim.parent.mkdir()
    shim.write_text("#!/bin/sh\nexit 0\n")
    shim.chmod(0o755)
    return {n: (UNITS / n).read_text().replace(INSTALLED_BINARY, str(shim)) for n in NAMES}


@needs_systemd_analyze
def test_systemd_analyze_verify_passes_without_warnings(tmp_path):
    proc = verify(tmp_path, installed_copies(tmp_path))
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    assert not [line for line in output.splitlines() if "hwtune" in line], output


@needs_systemd_analyze
def test_verify_would_catch_a_misspelled_directive(tmp_path):
    files = installed_copies(tmp_path)
    files["hwtune.service"] = files["hwtune.service"].replace("ProtectSystem=", "ProtectSystm=")
    proc = verify(tmp_path, files)
    assert "Unknown key 'ProtectSystm'" in proc.stdout + proc.stderr


def test_service_is_notify_with_watchdog_restart_and_directories():
    d = directives("hwtune.service")
    assert d["Service.Type"] == ["notify"]
    assert d["Service.NotifyAccess"] == ["main"]
    assert d["Service.ExecStart"] == [f"{INSTALLED_BINARY} daemon"]
    assert d["Service.WatchdogSec"] == ["30s"]
    assert d["Service.Restart"] == ["on-failure"]
    assert d["Service.StateDirectory"] == ["hwtune"]
    assert d["Service.ConfigurationDirectory"] == ["hwtune"]
    assert d["Install.WantedBy"] == ["multi-user.target"]


def test_service_hardening_keeps_nvml_and_sysfs_writes_possible():
    d = directives("hwtune.service")
    assert d["Service.ProtectSystem"] == ["strict"]  # leaves /dev, /proc, /sys writable
    assert d["Service.ProtectHome"] == ["yes"]
    assert d["Service.PrivateTmp"] == ["yes"]
    assert d["Service.NoNewPrivileges"] == ["yes"]
    assert "CAP_SYS_ADMIN" in d["Service.CapabilityBoundingSet"][0].split()
    allowed = d["Service.DeviceAllow"]
    assert "char-nvidia-frontend rw" in allowed and "char-nvidia-uvm rw" in allowed
    # Each of these would break a knob: hidden /dev/nvidia*, read-only /sys, no JIT.
    for forbidden in ("PrivateDevices", "ProtectKernelTunables", "MemoryDenyWriteExecute"):
        assert f"Service.{forbidden}" not in d, forbidden


def test_retune_is_a_oneshot_under_a_nightly_persistent_randomized_timer():
    s = directives("hwtune-retune.service")
    assert s["Service.Type"] == ["oneshot"]
    assert s["Service.ExecStart"][0].startswith(f"{INSTALLED_BINARY} tune")
    assert s["Service.StateDirectory"] == ["hwtune"]  # same state dir, hence the same lock
    t = directives("hwtune-retune.timer")
    assert t["Timer.OnCalendar"] == ["*-*-* 03:00:00"]
    assert t["Timer.Persistent"] == ["true"]
    assert t["Timer.RandomizedDelaySec"] == ["30min"]
    assert t["Timer.Unit"] == ["hwtune-retune.service"]
    assert t["Install.WantedBy"] == ["timers.target"]


def test_retune_lets_the_kernel_sandbox_make_its_namespaces():
    # The nightly tune runs the kernel search, whose sandbox (kernelsearch/harness/jail.py)
    # unshares net, IPC and mount namespaces before it runs a candidate's host code.
    # RestrictNamespaces=yes made every unshare fail with EPERM, which the jail takes quietly:
    # candidates ran with the host's network and /tmp under the timer.
    jail = (ROOT / "kernelsearch" / "harness" / "jail.py").read_text()
    assert all(f"unshare(CLONE_NEW{ns})" in jail for ns in ("NET", "IPC", "NS"))
    value = directives("hwtune-retune.service")["Service.RestrictNamespaces"]
    assert len(value) == 1 and set(value[0].split()) == {"net", "ipc", "mnt"}, value
