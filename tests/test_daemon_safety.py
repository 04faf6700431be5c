"""The daemon never writes before it can run, never takes a live apply's journal for a dead
one, never trusts a stale tuning marker, and never re-applies into a safety event."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT, run_hwtune
from tests.test_daemon import WAIT_S, Daemon, Host, _env, wait_until


@pytest.fixture
def host(tmp_path):
    return Host(tmp_path)


@pytest.fixture
def daemons():
    started = []
    yield lambda *a, **kw: started.append(Daemon(*a, **kw)) or started[-1]
    for d in started:
        d.close()


def _journal(host):
    path = host.state / "journal.json"
    return json.loads(path.read_text()) if path.exists() else None


# -- 5: validate and bind before the first hardware write -----------------------------------

def test_metrics_port_in_use_exits_before_any_write(host):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        config = host.config(metrics={"enabled": True, "address": "127.0.0.1", "port": port})
        r = run_hwtune("--sim", host.sim, "daemon", "--config", config, timeout=WAIT_S)
    assert r.returncode == 1, r.stderr
    assert "cannot listen" in r.stderr and "nothing was applied" in r.stderr and "Traceback" not in r.stderr
    assert host.status() == host.original and _journal(host) is None


def test_metrics_bind_failure_does_not_even_recover_a_journal_first(host):
    # What an interrupted apply leaves: the original journaled, the write done.
    proc = subprocess.Popen([sys.executable, "-m", "daemon.cli", "--sim", str(host.sim), "apply", "-p", "throughput"],
                            cwd=ROOT, env=_env({"HWTUNE_FAULT": "device.written@2=kill"}))
    proc.wait(timeout=WAIT_S)
    left = json.loads(host.sim.read_text())
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        config = host.config(metrics={"enabled": True, "address": "127.0.0.1", "port": busy.getsockname()[1]})
        r = run_hwtune("--sim", host.sim, "daemon", "--config", config, timeout=WAIT_S)
    assert r.returncode == 1 and "cannot listen" in r.stderr
    assert json.loads(host.sim.read_text()) == left and _journal(host)["status"] == "in_progress"


@pytest.mark.parametrize("address", ["not an address!!", "256.1.1.1", "1.2.3", "-bad-.example"])
def test_a_metrics_address_that_is_not_one_is_refused_naming_the_key(host, address):
    config = host.config(metrics={"enabled": True, "address": address, "port": 0})
    r = run_hwtune("--sim", host.sim, "daemon", "--config", config, timeout=WAIT_S)
    assert r.returncode == 2 and "metrics.address" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert host.status() == host.original


# -- 11: a stale tuning.json neither pauses drift correction nor gets a process killed -------

def _sleeper():
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])


def test_a_marker_naming_a_reused_pid_is_ignored_and_that_process_left_alone(host, daemons):
    d = daemons(host, host.config(rollback="never"))
    d.ready()
    innocent = _sleeper()
    try:
        # What a killed tune (or one before a reboot) leaves, its pid now reused by another process.
        marker = {"pid": innocent.pid, "start_time": 1, "boot_id": "x", "cmdline": ["python3", "-m", "daemon.cli", "tune"],
                  "started_at": time.time(), "expires_at": time.time() + 3600}
        (host.state / "tuning.json").write_text(json.dumps(marker))
        os.chmod(host.state / "tuning.json", 0o600)
        wait_until(lambda: "stale" in d.output(), "the daemon to see the stale marker")
        host.set("gpus.0.telemetry.clock_event_reasons=32")  # a thermal slowdown
        host.set("gpus.1.power_limit_w=650")  # drift: still corrected
        wait_until(lambda: host.gpu(1)["power_limit_w"] == 560, "the drift to be corrected")
        time.sleep(1.0)
        assert innocent.poll() is None, "the daemon signalled an unrelated process"
        assert "asking it to restore" not in d.output()
        assert not (host.state / "tuning.json").exists()
    finally:
        innocent.kill()
        innocent.wait()


def test_an_expired_marker_of_a_live_process_is_ignored(host, daemons):
    d = daemons(host, host.config(rollback="never"))
    d.ready()
    tuner = subprocess.Popen([sys.executable, "-c", (
        "import json, signal, sys, time\n"
        "from daemon.marker import Marker\n"
        f"m = Marker({str(host.state)!r}); m.write()\n"
        "data = json.loads(m.path.read_text()); data['expires_at'] = time.time() - 1\n"
        "from hwtune import statefile; statefile.write_json(m.path, data)\n"
        "signal.signal(signal.SIGTERM, lambda *a: sys.exit(42))\n"
        "print('ready', flush=True)\n"
        "time.sleep(300)\n")], stdout=subprocess.PIPE, text=True, cwd=ROOT, env=_env())
    try:
        assert tuner.stdout.readline().strip() == "ready"
        wait_until(lambda: "expired" in d.output(), "the daemon to see the expired marker")
        host.set("gpus.0.power_limit_w=650")
        wait_until(lambda: host.gpu(0)["power_limit_w"] == 560, "drift correction to go on")
        host.set("gpus.0.telemetry.clock_event_reasons=32")
        time.sleep(1.0)
        assert tuner.poll() is None
    finally:
        tuner.kill()
        tuner.wait()


# -- 12: the lock before the journal ----------------------------------------------------------

def test_a_daemon_started_during_a_live_apply_waits_and_never_restores_its_journal(host):
    apply = subprocess.Popen([sys.executable, "-m", "daemon.cli", "--sim", str(host.sim), "apply", "-p", "throughput"],
                             cwd=ROOT, env=_env({"HWTUNE_FAULT": "device.write@3=pause:3"}),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in apply.stderr:
        if line.startswith("hwtune-fault: paused"):
            break
    assert _journal(host)["status"] == "in_progress"  # live, mid-apply, holding the lock
    config = host.config(rollback="never", metrics={"enabled": False})
    r = run_hwtune("--sim", host.sim, "daemon", "--config", config, "--once", timeout=WAIT_S)
    assert apply.wait(timeout=WAIT_S) == 0
    assert r.returncode == 0, r.stderr
    assert "interrupted apply" not in r.stderr and "Traceback" not in r.stderr
    assert "profile efficiency applied" in r.stderr
    assert run_hwtune("--sim", host.sim, "verify", "-p", "efficiency").returncode == 0
    run_hwtune("--sim", host.sim, "rollback", check=True)
    assert host.status() == host.original


# -- 13: SIGHUP never re-applies while a safety event stands ----------------------------------

def test_sighup_during_a_thermal_event_waits_for_it_to_clear(host, daemons):
    host.set("gpus.1.telemetry.temperature_c=95")
    d = daemons(host, host.config(rollback="never", thermal={"max_temperature_c": 87}))
    d.ready()
    d.wait_message(lambda m: "suspended" in m.get("STATUS", ""), "the profile suspended by the thermal event")
    assert host.gpu(0)["power_limit_w"] == 700
    d.proc.send_signal(signal.SIGHUP)
    wait_until(lambda: "a safety event stands" in d.output(), "the reload to be answered")
    time.sleep(1.5)  # several polls at 95 C
    assert host.gpu(0)["power_limit_w"] == 700 and host.gpu(1)["locked_sm_clocks_mhz"] is None
    host.set("gpus.1.telemetry.temperature_c=60")
    wait_until(lambda: host.gpu(0)["power_limit_w"] == 560, "the profile once the event cleared")


def test_sighup_during_an_event_outside_a_tuning_step_does_not_apply_either(host, daemons):
    d = daemons(host, host.config(rollback="never"))
    d.ready()
    time.sleep(1.0)  # the daemon's probation after its own apply is over
    host.set("gpus.0.telemetry.clock_event_reasons=64")  # HW thermal slowdown: logged, known good
    wait_until(lambda: "settings already known good" in d.output(), "the event to be seen")
    host.config(rollback="never", profile="throughput")
    d.proc.send_signal(signal.SIGHUP)
    wait_until(lambda: "a safety event stands" in d.output(), "the reload to be answered")
    time.sleep(1.5)
    assert host.gpu(0)["locked_sm_clocks_mhz"] == [1410, 1785]  # still efficiency: nothing re-applied
    host.set("gpus.0.telemetry.clock_event_reasons=0")
    wait_until(lambda: host.gpu(0)["locked_sm_clocks_mhz"] == [1755, 1980], "throughput once it cleared")


# -- a start or a reload never writes over a live tune ----------------------------------------

def _live_tuner(host):
    """A process that names itself in tuning.json, as a live `hwtune tune` does."""
    tuner = subprocess.Popen([sys.executable, "-c", (
        "import time\n"
        "from daemon.marker import Marker\n"
        f"Marker({str(host.state)!r}).write()\n"
        "print('ready', flush=True)\n"
        "time.sleep(300)\n")], stdout=subprocess.PIPE, text=True, cwd=ROOT, env=_env())
    assert tuner.stdout.readline().strip() == "ready"
    return tuner


def test_a_daemon_started_or_reloaded_during_a_tune_writes_nothing_until_it_ends(host, daemons):
    host.state.mkdir(mode=0o700, exist_ok=True)
    tuner = _live_tuner(host)
    try:
        host.set("gpus.0.power_limit_w=650")  # the point the tune is measuring
        once = run_hwtune("--sim", host.sim, "daemon", "--config", host.config(rollback="never"), "--once",
                          timeout=WAIT_S)
        assert once.returncode == 1 and "not applied" in once.stderr, once.stderr
        assert host.gpu(0)["power_limit_w"] == 650 and host.gpu(1)["power_limit_w"] == 700
        d = daemons(host, host.config(rollback="never"))
        d.ready()
        assert "postponed: pid" in d.output()
        d.proc.send_signal(signal.SIGHUP)
        wait_until(lambda: d.output().count("postponed: pid") >= 2, "the reload to be answered")
        time.sleep(1.0)  # several polls
        assert host.gpu(0)["power_limit_w"] == 650 and host.gpu(1)["power_limit_w"] == 700
    finally:
        tuner.kill()
        tuner.wait()
    wait_until(lambda: host.gpu(0)["power_limit_w"] == 560 and host.gpu(1)["power_limit_w"] == 560,
               "the profile once the tune ended")


def test_sigterm_while_waiting_for_the_lock_at_start_stops_without_waiting_the_minute_out(host, daemons):
    # The daemon waits up to 60 s for a live apply at start; SIGTERM (systemctl stop) during
    # that wait was ignored until the minute was up, then the daemon exited 5 'lock busy'.
    host.state.mkdir(exist_ok=True)
    holder = subprocess.Popen([sys.executable, "-c",
                               "import fcntl, os, time\n"
                               f"fd = os.open({str(host.state / 'lock')!r}, os.O_RDWR | os.O_CREAT, 0o600)\n"
                               "fcntl.flock(fd, fcntl.LOCK_EX)\nprint('held', flush=True)\ntime.sleep(120)\n"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        d = daemons(host, host.config(rollback="never"))
        d.wait_message(lambda m: "writer lock" in m.get("STATUS", ""), "STATUS: waiting for the writer lock")
        t0 = time.monotonic()
        d.proc.send_signal(signal.SIGTERM)
        rc = d.proc.wait(timeout=WAIT_S + 30)
        took = time.monotonic() - t0
    finally:
        holder.kill()
        holder.wait()
    assert took < 20, f"{took:.0f} s to stop\n{d.output()}"
    assert rc == 0, d.output()
    assert host.status() == host.original and _journal(host) is None


@pytest.mark.parametrize("tuned", ["gpu:\n  power_limit_w: [\n", "gpu:\n  select: [0, 1]\n  power_limit_w: 5000\n"])
def test_a_tuned_profile_that_no_longer_loads_leaves_the_daemon_on_its_configured_profile(host, tuned):
    # A kept point that is damaged, or no longer fits the hardware (a GPU swapped for one with
    # other limits), made every start exit 2: no profile held, no thermal watch, a restart loop.
    host.state.mkdir(mode=0o700, exist_ok=True)
    (host.state / "tuned-profile.yaml").write_text(tuned)
    (host.state / "last_tune.json").write_text(json.dumps({
        "timestamp_s": time.time(), "objective": 1.0, "ok": True, "source": "simulated",
        "kept": {"power_limit_w": 650, "sm_clock_max_mhz": None},
        "kept_profile": str(host.state / "tuned-profile.yaml"), "base_profile": "efficiency"}))
    for name in ("tuned-profile.yaml", "last_tune.json"):
        os.chmod(host.state / name, 0o600)
    config = host.config(rollback="never", metrics={"enabled": False})
    r = run_hwtune("--sim", host.sim, "daemon", "--config", config, "--once", timeout=WAIT_S)
    assert r.returncode == 0, r.stderr
    assert "profile efficiency applied" in r.stderr and "tuned-profile.yaml" in r.stderr
    assert "Traceback" not in r.stderr
    assert run_hwtune("--sim", host.sim, "verify", "-p", "efficiency").returncode == 0


def test_a_second_daemon_on_the_same_state_directory_is_refused_before_any_write(host, daemons):
    # The daemon is the single writer: a second one (run by hand beside the service, metrics
    # off or on another port) applied its own profile, and the two re-applied each other's
    # settings at every poll, each write journaled.
    d = daemons(host, host.config(rollback="never", metrics={"enabled": False}))
    d.ready()
    other = host.tmp / "other.yaml"
    other.write_text(json.dumps({"profile": "throughput", "poll_interval_s": 0.2, "metrics": {"enabled": False}}))
    os.chmod(other, 0o600)
    r = run_hwtune("--sim", host.sim, "daemon", "--config", other, timeout=20)
    assert r.returncode == 5, r.stderr
    assert f"pid {d.proc.pid}" in r.stderr and "Traceback" not in r.stderr
    assert "set gpu0" not in r.stderr
    assert host.gpu(0)["power_limit_w"] == 560
    assert "re-applying" not in d.output()
    assert d.proc.poll() is None
