"""The daemon as a real child process on a simulated host, with a real AF_UNIX datagram
notify socket and a real HTTP scrape of /metrics."""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import ROOT, run_hwtune

WAIT_S = 60  # generous upper bound for anything to happen on a loaded 2-core machine


def _env(extra=None):
    env = dict(os.environ)
    env.pop("HWTUNE_READ_ONLY", None)
    for k in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
        env.pop(k, None)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def wait_until(pred, what, timeout=WAIT_S, step=0.05):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = pred()
        if value:
            return value
        time.sleep(step)
    raise AssertionError(f"timed out waiting for {what}")


class Host:
    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.sim = tmp / "host.json"
        self.state = Path(str(self.sim) + ".state")
        run_hwtune("sim", "init", self.sim, "--gpus", "2", check=True)
        self.original = self.status()

    def status(self):
        d = json.loads(run_hwtune("--sim", self.sim, "status", "--json", check=True).stdout)
        d.pop("journal", None)
        return d

    def set(self, *assignments):
        run_hwtune("sim", "set", self.sim, *assignments, check=True)

    def gpu(self, i=0):
        return json.loads(self.sim.read_text())["gpus"][i]

    def config(self, **kw) -> Path:
        data = {"profile": "efficiency", "poll_interval_s": 0.2, "reapply_min_interval_s": 0,
                "metrics": {"enabled": True, "address": "127.0.0.1", "port": 0}}
        data.update(kw)
        path = self.tmp / "hwtune.yaml"
        path.write_text(json.dumps(data))  # JSON is YAML
        os.chmod(path, 0o600)
        return path


class Daemon:
    """`hwtune daemon` in a child process, its notify socket bound by the test."""

    def __init__(self, host: Host, config: Path, watchdog_usec=300_000, args=()):
        self.host = host
        self.sock_path = host.tmp / "notify.sock"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(self.sock_path))
        self.sock.settimeout(0.2)
        self.messages: list[dict] = []
        # Drain continuously, like systemd: a full datagram queue would block the daemon's send.
        self._closing = False
        self._reader = threading.Thread(target=self._read, daemon=True)
        self.log = open(host.tmp / "daemon.log", "w+")
        env = _env({"NOTIFY_SOCKET": str(self.sock_path), "WATCHDOG_USEC": str(watchdog_usec)})
        self.proc = subprocess.Popen([sys.executable, "-m", "daemon.cli", "--sim", str(host.sim), "daemon",
                                      "--config", str(config), *args],
                                     cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        self._reader.start()

    def _read(self):
        while not self._closing:
            try:
                data = self.sock.recv(4096)
            except (socket.timeout, BlockingIOError):
                continue
            except OSError:
                return
            fields = dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)
            self.messages.append(fields)

    def _drain(self):
        pass  # the reader thread collects messages

    def wait_message(self, pred, what):
        def check():
            if self.proc.poll() is not None:
                raise AssertionError(f"daemon exited {self.proc.returncode} waiting for {what}:\n{self.output()}")
            self._drain()
            return any(pred(m) for m in list(self.messages))
        wait_until(check, what)

    def ready(self):
        self.wait_message(lambda m: m.get("READY") == "1", "READY=1")
        return json.loads((self.host.state / "daemon.json").read_text())

    def output(self):
        self.log.flush()
        return (self.host.tmp / "daemon.log").read_text()

    def scrape(self, port) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            return r.read().decode()

    def stop(self, sig=signal.SIGTERM):
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        rc = self.proc.wait(timeout=WAIT_S)
        time.sleep(0.3)  # let the reader pick up the last datagrams (STOPPING=1)
        return rc

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._closing = True
        self._reader.join(timeout=5)
        self.sock.close()
        self.log.close()


def metric(text, name, **labels):
    for line in text.splitlines():
        if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            rest = line[len(name):]
            if rest[:1] in ("{", " "):
                return float(line.rsplit(" ", 1)[1])
    return None


@pytest.fixture
def host(tmp_path):
    return Host(tmp_path)


@pytest.fixture
def daemons():
    started = []
    yield lambda *a, **kw: started.append(Daemon(*a, **kw)) or started[-1]
    for d in started:
        d.close()


def test_ready_watchdog_metrics_then_sigterm_restores_with_rollback_on_exit(host, daemons):
    d = daemons(host, host.config(rollback="on_exit"))
    info = d.ready()
    assert info["torch_imported"] is False
    n_ready = len(d.messages)
    d.wait_message(lambda m: sum(x.get("WATCHDOG") == "1" for x in d.messages[n_ready:]) >= 3,
                   "three WATCHDOG=1 after READY")
    assert any("STATUS" in m and "watching" in m["STATUS"] for m in d.messages)

    text = d.scrape(info["metrics_port"])
    # efficiency: 80% of 700 W, SM clocks locked to [1410, 1785].
    assert metric(text, "hwtune_gpu_power_limit_w", gpu="0") == 560
    assert 1410 <= metric(text, "hwtune_gpu_sm_clock_mhz", gpu="1") <= 1785
    assert metric(text, "hwtune_profile_applied", profile="efficiency") == 1
    assert metric(text, "hwtune_host_info", kind="sim") == 1
    assert host.gpu(0)["power_limit_w"] == 560

    assert d.stop() == 0
    assert any(m.get("STOPPING") == "1" for m in d.messages)
    assert host.status() == host.original


def test_a_notify_socket_gone_after_ready_is_logged_and_the_daemon_goes_on_and_restores_at_stop(host, daemons):
    d = daemons(host, host.config(rollback="on_exit"))
    d.ready()
    d.sock_path.unlink()  # systemd re-executing, or a socket removed under it: the pings fail
    wait_until(lambda: "cannot send" in d.output(), "a failed notify")
    assert d.proc.poll() is None, d.output()
    host.set("gpus.0.power_limit_w=650")
    wait_until(lambda: host.gpu(0)["power_limit_w"] == 560, "drift still corrected")
    assert d.output().count("cannot send") == 1  # said once, not per ping
    assert d.stop() == 0, d.output()
    assert host.status() == host.original  # rollback: on_exit still ran

def test_sigterm_with_rollback_never_keeps_the_profile(host, daemons):
    d = daemons(host, host.config(rollback="never"))
    d.ready()
    assert d.stop() == 0
    assert host.gpu(0)["power_limit_w"] == 560 and host.gpu(1)["locked_sm_clocks_mhz"] == [1410, 1785]
    assert run_hwtune("--sim", host.sim, "verify", "-p", "efficiency").returncode == 0


def test_thermal_event_during_the_daemons_own_apply_restores_known_good_settings(host, daemons):
    host.set("gpus.1.telemetry.temperature_c=95")
    d = daemons(host, host.config(rollback="never", thermal={"max_temperature_c": 87}))
    info = d.ready()
    d.wait_message(lambda m: "suspended" in m.get("STATUS", ""), "STATUS saying the profile is suspended")
    assert "thermal during the daemon's own tuning step" in d.output()
    text = d.scrape(info["metrics_port"])
    assert metric(text, "hwtune_restore_total", reason="thermal") == 1
    assert host.status() == {**host.original, "gpus": [
        {**g, "telemetry": {**g["telemetry"], "temperature_c": 95} if g["index"] == 1 else g["telemetry"]}
        for g in host.original["gpus"]]}
    # Suspended: neither drift checks nor a re-apply put the profile back.
    assert d.stop() == 0
    assert host.gpu(0)["power_limit_w"] == 700


def test_thermal_reason_bits_while_another_process_tunes_make_it_restore(host, daemons):
    d = daemons(host, host.config(rollback="never"))
    info = d.ready()
    # A stand-in tuning process: announces itself like `hwtune tune` (daemon.marker: pid, start
    # time, command line, expiry) and restores on SIGTERM.
    tuner = subprocess.Popen([sys.executable, "-c", (
        "import signal, sys, time\n"
        "from daemon.marker import Marker\n"
        f"Marker({str(host.state)!r}).write()\n"
        "signal.signal(signal.SIGTERM, lambda *a: sys.exit(42))\n"
        "print('ready', flush=True)\n"
        "time.sleep(600)\n")], stdout=subprocess.PIPE, text=True, cwd=ROOT, env=_env())
    try:
        assert tuner.stdout.readline().strip() == "ready"
        d.wait_message(lambda m: "is tuning" in m.get("STATUS", ""), "STATUS: another process is tuning")
        host.set("gpus.0.telemetry.clock_event_reasons=32")  # SW thermal slowdown
        assert tuner.wait(timeout=WAIT_S) == 42
    finally:
        if tuner.poll() is None:
            tuner.kill()
            tuner.wait()
    assert metric(d.scrape(info["metrics_port"]), "hwtune_restore_total", reason="thermal") == 1
    assert "asking it to restore" in d.output()


def test_drifted_value_is_reapplied(host, daemons):
    d = daemons(host, host.config(rollback="never"))
    info = d.ready()
    host.set("gpus.0.power_limit_w=650")  # behind the daemon's back
    wait_until(lambda: host.gpu(0)["power_limit_w"] == 560, "the daemon to re-apply 560 W")
    wait_until(lambda: (metric(d.scrape(info["metrics_port"]), "hwtune_reapply_total") or 0) >= 1,
               "hwtune_reapply_total >= 1")
    assert "re-applying efficiency" in d.output()


def test_sighup_reloads_config_and_applies_the_new_profile(host, daemons):
    config = host.config(rollback="never")
    d = daemons(host, config)
    d.ready()
    host.config(rollback="never", profile="throughput")
    d.proc.send_signal(signal.SIGHUP)
    wait_until(lambda: host.gpu(0)["locked_sm_clocks_mhz"] == [1755, 1980], "throughput clocks after SIGHUP")
    assert host.gpu(0)["power_limit_w"] == 700


def test_kill9_mid_apply_next_start_restores_the_journal_before_applying(host, tmp_path):
    host.set("write_delay_ms=150")
    config = host.config(rollback="never", metrics={"enabled": False})
    proc = subprocess.Popen([sys.executable, "-m", "daemon.cli", "--sim", str(host.sim), "daemon",
                             "--config", str(config)], cwd=ROOT, env=_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    journal = host.state / "journal.json"

    def mid_apply():
        try:
            j = json.loads(journal.read_text())
        except (OSError, ValueError):
            return False
        return j["status"] == "in_progress" and len(j["entries"]) >= 3
    try:
        wait_until(mid_apply, "the daemon's apply to be half done")
        proc.kill()
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert host.status() != host.original
    host.set("write_delay_ms=0")

    r = run_hwtune("--sim", host.sim, "daemon", "--config", config, "--once", check=True)
    log = r.stderr
    assert "journal left by an interrupted apply" in log
    assert log.index("recovered:") < log.index("profile efficiency applied")
    assert run_hwtune("--sim", host.sim, "verify", "-p", "efficiency").returncode == 0
    # What was journaled is the true original: a rollback now gives exactly the host we began with.
    run_hwtune("--sim", host.sim, "rollback", check=True)
    assert host.status() == host.original


def test_watch_path_imports_no_torch(host):
    config = host.config(metrics={"enabled": True, "address": "127.0.0.1", "port": 0})
    env = _env()
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "daemon.cli", "--sim", str(host.sim),
                        "daemon", "--config", str(config), "--once"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=WAIT_S)
    assert r.returncode == 0, r.stderr[-2000:]
    imported = {line.split("|")[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")}
    assert "daemon.service" in imported and "hwtune.engine" in imported
    assert not {m for m in imported if m == "torch" or m.startswith("torch.") or m == "triton"}


def test_config_writable_by_others_is_refused(host):
    config = host.config()
    os.chmod(config, 0o666)
    r = run_hwtune("--sim", host.sim, "daemon", "--config", config, "--once")
    assert r.returncode == 2
    assert "group- or world-writable" in r.stderr
    assert host.status() == host.original


def test_lock_holder_pid_comes_from_the_kernel_not_the_lock_file(tmp_path):
    # A new holder truncates the lock file before writing its pid, and a released lock leaves
    # a stale pid behind: the daemon must name (and signal) the real holder, never pid -1.
    from daemon.service import _lock_held_by_other, tuning_pid

    state = tmp_path / "state"
    state.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import fcntl, os, sys, time\n"
         f"fd = os.open({str(state / 'lock')!r}, os.O_RDWR | os.O_CREAT, 0o644)\n"
         "fcntl.flock(fd, fcntl.LOCK_EX)\n"
         "os.ftruncate(fd, 0)\n"  # held, pid not written yet
         "print('held', flush=True)\n"
         "time.sleep(60)\n"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert (state / "lock").read_text() == ""
        assert _lock_held_by_other(state) == holder.pid
        (state / "lock").write_text("999999999\n")  # a stale pid from an earlier holder
        assert tuning_pid(state) == holder.pid
    finally:
        holder.kill()
        holder.wait()
    assert _lock_held_by_other(state) is None


def test_a_reapply_that_fails_is_rate_limited_like_one_that_succeeds(host, daemons):
    d = daemons(host, host.config(rollback="never", reapply_min_interval_s=3))
    d.ready()
    # A driver that answers success and keeps its value: every re-apply fails its read-back.
    host.set('faults=[{"op": "set_power_limit", "gpu": 0, "error": "Ignored"}]', "gpus.0.power_limit_w=650")
    wait_until(lambda: "poll: apply failed" in d.output(), "the first re-apply to fail")
    time.sleep(1.5)  # several polls at 0.2 s, all within reapply_min_interval_s of that attempt
    out = d.output()
    assert out.count("re-applying efficiency") == 1, out
    assert host.gpu(0)["power_limit_w"] == 650


def test_a_poll_error_that_stands_is_logged_once_not_at_every_poll(host, daemons):
    d = daemons(host, host.config(rollback="never"))
    d.ready()
    journal = host.state / "journal.json"
    good = journal.read_bytes()
    journal.write_text('{"version": 1, "status": "committed", "profiles": [], "entries": [5]}')
    host.set("gpus.0.power_limit_w=650")   # drift: the re-apply reads the damaged journal
    wait_until(lambda: "poll: " in d.output(), "the poll to meet the damaged journal")
    time.sleep(1.5)  # several polls at 0.2 s
    assert d.output().count("poll: ") == 1, d.output()
    journal.write_bytes(good)
    wait_until(lambda: "poll: ok again" in d.output(), "the poll to recover")


def test_a_sighup_whose_profile_cannot_load_or_apply_keeps_the_daemon_running(host, daemons):
    d = daemons(host, host.config(rollback="on_exit"))
    d.ready()

    def answered_reload():
        n = len(d.messages)
        d.proc.send_signal(signal.SIGHUP)
        d.wait_message(lambda m: any(x.get("READY") == "1" for x in d.messages[n:]), "READY=1 after the reload")
        assert d.proc.poll() is None, d.output()

    host.config(rollback="on_exit", profile="no-such-profile")
    answered_reload()
    assert "reload refused" in d.output()
    # A device that answers success and keeps its value: the new profile's apply fails.
    host.set('faults=[{"op": "set_power_limit", "gpu": 0, "error": "Ignored"}]')
    host.config(rollback="on_exit", profile="throughput")
    answered_reload()
    assert "reload: apply failed" in d.output()
    host.set("faults=[]")
    assert d.stop() == 0, d.output()
    assert host.status() == host.original  # rollback: on_exit still ran


def test_a_read_only_daemon_reports_drift_and_keeps_watching(host):
    config = host.config(rollback="never", metrics={"enabled": False})
    env = _env({"HWTUNE_READ_ONLY": "1"})
    once = subprocess.run([sys.executable, "-m", "daemon.cli", "--sim", str(host.sim), "daemon", "--config",
                           str(config), "--once"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=WAIT_S)
    assert once.returncode == 1 and "nothing applied: 12 drifted" in once.stderr, once.stderr
    log = open(host.tmp / "ro.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "daemon.cli", "--sim", str(host.sim), "daemon", "--config",
                             str(config)], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: "not re-applied" in (host.tmp / "ro.log").read_text(), "the drift to be reported")
        time.sleep(1.0)  # several polls
        assert proc.poll() is None, (host.tmp / "ro.log").read_text()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=WAIT_S) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    assert (host.tmp / "ro.log").read_text().count("not re-applied") == 1
    assert host.status() == host.original


def test_bios_drift_is_reported_once_and_never_re_applied(host, daemons):
    # BIOS settings are checked, never written: a BIOS that differs made the daemon 're-apply'
    # (0 changes) at every reapply interval and log 'drift ... re-apply rate-limited' at every
    # poll in between, for ever (17,000 lines a day at the default 5 s poll).
    profile = host.tmp / "bios-check.yaml"
    profile.write_text("include: [efficiency]\nbios:\n  source: redfish\n  endpoint: https://bmc.example\n"
                       "  expect: {PowerProfile: MaxPerf}\n")
    d = daemons(host, host.config(rollback="never", profile=str(profile), reapply_min_interval_s=0.5))
    info = d.ready()
    time.sleep(2.0)  # ten polls at 0.2 s, four reapply intervals
    out = d.output()
    assert out.count("PowerProfile") == 1, out
    assert "re-appl" not in out, out
    assert metric(d.scrape(info["metrics_port"]), "hwtune_drifted_knobs") == 1
    host.set("gpus.0.power_limit_w=650")  # a knob hwtune writes is still put back
    wait_until(lambda: host.gpu(0)["power_limit_w"] == 560, "the re-apply of 560 W")


def test_a_gpu_whose_telemetry_cannot_be_read_is_said_once_while_it_stands(host, monkeypatch):
    # A GPU fallen off the bus answers every NVML call with an error: 'gpu1 telemetry: ...' was
    # logged at every poll (17,000 lines a day at 5 s). NVML errors cannot be made here, so the
    # sim's telemetry getter is made to fail.
    from daemon.context import Context
    from daemon.notify import Notifier
    from daemon.service import Service
    from hwtune.errors import HwtuneError

    ctx = Context(config_path=None, state_dir=host.state, sim_path=host.sim, sysfs_root=Path("/"),
                  read_only=False, profile_dir=host.tmp)
    lines = []
    service = Service(ctx, once=True, log=lines.append, notifier=Notifier(None))
    service.host = ctx.open_host()
    real = service.host.gpus.telemetry
    broken = {"now": True}

    def telemetry(i):
        if i == 1 and broken["now"]:
            raise HwtuneError("gpu1: NVML_ERROR_GPU_IS_LOST")
        return real(i)
    monkeypatch.setattr(service.host.gpus, "telemetry", telemetry)
    for _ in range(5):
        service.poll()
    assert sum("GPU_IS_LOST" in line for line in lines) == 1, lines
    broken["now"] = False
    service.poll()
    service.poll()
    assert sum("gpu1 telemetry" in line for line in lines) == 2, lines  # and once when it is back
