"""`hwtune tune` on the simulated host, as child processes."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT, run_hwtune
from tests.test_daemon import WAIT_S, Daemon, Host, _env, wait_until


@pytest.fixture
def host(tmp_path):
    return Host(tmp_path)


def tune(host, *args, check=True):
    r = run_hwtune("--sim", host.sim, "tune", "--json", *args, check=check, timeout=600)
    return r, (json.loads(r.stdout) if r.stdout.strip() else None)


def test_energy_tuning_beats_stock_by_125x_within_12_evaluations_and_matches_exhaustive(host):
    r, report = tune(host, "--objective", "energy", "--floor", "0.98", "--budget", "12", "--exhaustive",
                     "--no-kernels")
    s = report["summary"]
    assert report["source"] == "simulated" and "simulated" in r.stderr
    assert s["evaluations"] <= 12
    assert s["tokens_per_j_vs_stock"] >= 1.25 and s["tokens_per_s_vs_stock"] >= 0.98
    assert s["exhaustive_evaluations"] == report["space"]["size"]
    assert s["found_vs_exhaustive"] >= 0.97
    # The best point is kept, journaled: the host holds it, and rollback undoes it exactly.
    kept = report["kept"]
    assert kept != report["baseline"]
    gpu = host.gpu(0)
    assert gpu["power_limit_w"] == kept["power_limit_w"]
    assert gpu["locked_sm_clocks_mhz"][1] == kept["sm_clock_max_mhz"]
    run_hwtune("--sim", host.sim, "rollback", check=True)
    assert host.status() == host.original


def test_restore_leaves_the_host_as_it_started(host):
    _, report = tune(host, "--restore", "--no-kernels", "--budget", "6")
    assert report["kept"] == report["baseline"]
    assert len(report["search"]["evaluations"]) <= 6
    run_hwtune("--sim", host.sim, "rollback", check=True)
    assert host.status() == host.original


def test_gpus_that_start_from_different_settings_are_refused_not_restored_to_the_first_ones(host):
    # Before: the baseline was read from the first selected GPU only, and --restore (or an
    # abort) put every GPU back at it: gpu1, at 500 W with SM locked to 1410-1785 MHz, was left
    # at 700 W unlocked while the tune said 'left at: ... (the starting settings)'.
    run_hwtune("sim", "set", host.sim, "gpus.1.power_limit_w=500", "gpus.1.locked_sm_clocks_mhz=[1410, 1785]",
               check=True)
    before = host.sim.read_bytes()
    r, _ = tune(host, "--restore", "--no-kernels", "--budget", "4", check=False)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "gpu1 starts from 500 W, SM 1410-1785 MHz" in r.stderr and "--gpus" in r.stderr, r.stderr
    assert json.loads(r.stdout)["exit_code"] == 2
    assert host.sim.read_bytes() == before and not (host.state / "journal.json").exists()
    _, report = tune(host, "--restore", "--no-kernels", "--budget", "4", "--gpus", "1")
    assert report["kept"] == report["baseline"] == {"power_limit_w": 500, "sm_clock_max_mhz": 1785,
                                                    "sm_clock_min_mhz": 1410}
    assert host.gpu(1)["power_limit_w"] == 500 and host.gpu(1)["locked_sm_clocks_mhz"] == [1410, 1785]


def test_read_only_tune_writes_nothing_and_says_what_it_would_keep(host):
    before = host.sim.read_bytes()
    r = run_hwtune("--sim", host.sim, "--read-only", "tune", "--json", "--no-kernels", check=True)
    report = json.loads(r.stdout)
    assert report["read_only"] is True and report["would_keep"]
    assert host.sim.read_bytes() == before
    assert not (host.state / "journal.json").exists()


def test_throughput_objective_keeps_throughput_within_half_a_percent(host):
    _, report = tune(host, "--objective", "throughput", "--workload", "gemm", "--no-kernels")
    assert report["summary"]["tokens_per_s_vs_stock"] >= 0.995


def test_kernel_search_runs_at_the_chosen_point_under_the_interpreter(host):
    _, report = tune(host, "--budget", "3", "--kernels", "rmsnorm", "--kernel-budget", "1")
    assert [k["kernel"] for k in report["kernels"]] == ["rmsnorm"]
    assert report["kernels"][0]["device"] == "cpu" and report["kernels"][0]["ok"]


def test_kernel_search_of_a_tune_on_a_relative_sim_path_keeps_its_results_beside_the_file(tmp_path):
    # Before: the search child ran from the checkout with --state-dir host.json.state as given,
    # so its ledger and dispatch table went into ROOT/host.json.state.
    name = f"{tmp_path.name}-host.json"   # unique: the test looks for it in ROOT
    run_hwtune("sim", "init", tmp_path / name, check=True)
    proc = subprocess.run([sys.executable, "-m", "daemon.cli", "--sim", name, "tune", "--budget", "2",
                           "--kernels", "rmsnorm", "--kernel-budget", "1", "--restore"], cwd=tmp_path, env=_env(),
                          capture_output=True, text=True, timeout=600)
    try:
        assert proc.returncode == 0, proc.stderr
        assert (tmp_path / f"{name}.state" / "ledger.sqlite").is_file()
        assert not (ROOT / f"{name}.state").exists()
    finally:
        import shutil

        shutil.rmtree(ROOT / f"{name}.state", ignore_errors=True)


def _start_tune(host, *args):
    return subprocess.Popen([sys.executable, "-m", "daemon.cli", "--sim", str(host.sim), "tune", "--no-kernels",
                             "--json", *args], cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _evaluations_started(host, n):
    try:
        j = json.loads((host.state / "journal.json").read_text())
    except (OSError, ValueError):
        return False
    return len(j.get("profiles", [])) >= n


def test_kill9_mid_tune_leaves_nothing_the_next_daemon_start_does_not_restore(host):
    host.set("write_delay_ms=60")
    proc = _start_tune(host)
    try:
        wait_until(lambda: _evaluations_started(host, 3) and
                   json.loads((host.state / "journal.json").read_text())["status"] == "in_progress",
                   "the tune to be in the middle of an apply")
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    host.set("write_delay_ms=0")
    config = host.config(rollback="never", metrics={"enabled": False})
    r = run_hwtune("--sim", host.sim, "daemon", "--config", config, "--once", check=True)
    assert "journal left by an interrupted apply" in r.stderr
    assert r.stderr.index("recovered:") < r.stderr.index("profile efficiency applied")
    assert run_hwtune("--sim", host.sim, "verify", "-p", "efficiency").returncode == 0
    run_hwtune("--sim", host.sim, "rollback", check=True)
    assert host.status() == host.original


def _tune_killed_at_a_trial_point(host):
    """Start a tune and SIGKILL it while it sits at a trial point other than where it started
    (its journal committed: not mid-apply)."""
    host.set("write_delay_ms=30")
    proc = _start_tune(host)
    try:
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            proc.send_signal(signal.SIGSTOP)
            try:
                committed = json.loads((host.state / "journal.json").read_text()).get("status") == "committed"
            except (OSError, ValueError):
                committed = False
            if committed and host.status() != host.original:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                break
            proc.send_signal(signal.SIGCONT)
            time.sleep(0.02)
        else:
            raise AssertionError("the tune never sat at a trial point")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    host.set("write_delay_ms=0")
    assert host.status() != host.original   # left at a trial point


def test_a_tune_killed_at_a_trial_point_has_its_starting_settings_put_back_by_the_next(host):
    """kill -9 between trials left the host at a trial point, and a committed journal: the next
    tune took that point as its baseline (and the daemon without a profile held it)."""
    _tune_killed_at_a_trial_point(host)
    r, report = tune(host, "--budget", "1")
    assert "ended at a trial point without restoring" in r.stderr, r.stderr[-2000:]
    assert host.status() == host.original and not (host.state / "tuning.json").exists()
    first = report["baseline"]
    # the same through the daemon, with no profile of its own
    _tune_killed_at_a_trial_point(host)
    config = host.config(rollback="never", metrics={"enabled": False}, profile=None)
    d = run_hwtune("--sim", host.sim, "daemon", "--config", config, "--once")
    assert "ended at a trial point without restoring" in d.stderr, d.stderr[-2000:]
    assert host.status() == host.original and first == tune(host, "--budget", "1")[1]["baseline"]


def test_thermal_event_during_a_tune_restores_the_daemons_settings(host):
    config = host.config(rollback="never")
    d = Daemon(host, config)
    try:
        d.ready()
        host.set("write_delay_ms=60")
        proc = _start_tune(host, "--exhaustive")
        wait_until(lambda: _evaluations_started(host, 4), "the tune to be running")
        d.wait_message(lambda m: "is tuning" in m.get("STATUS", ""), "the daemon to see the tune")
        host.set("gpus.0.telemetry.temperature_c=96")
        out, err = proc.communicate(timeout=WAIT_S)
        assert proc.returncode == 1, err[-3000:]
        report = json.loads(out)
        assert report["aborted"] and report["kept"] == report["baseline"]
        host.set("write_delay_ms=0")
        # A poll after the tune, with the temperature still high, must not undo the daemon's
        # profile: that event was the tune's, and the tune answered it.
        def polled_after_tune():
            d._drain()
            statuses = [m["STATUS"] for m in d.messages if "STATUS" in m]
            last_tuning = max(i for i, text in enumerate(statuses) if "is tuning" in text)
            return any("watching" in text for text in statuses[last_tuning + 1:])
        wait_until(polled_after_tune, "a daemon poll after the tune ended")
        # Back at the daemon's profile (its known-good), and the daemon did not fight the tune.
        assert run_hwtune("--sim", host.sim, "verify", "-p", "efficiency").returncode == 0
        assert d.proc.poll() is None
    finally:
        d.close()


def test_daemon_holds_the_point_a_tune_kept_instead_of_reverting_it(host):
    d = Daemon(host, host.config(rollback="never"))
    try:
        info = d.ready()
        _, report = tune(host, "--no-kernels", "--nightly", "--budget", "8")
        kept = report["kept"]
        d.wait_message(lambda m: "efficiency+tuned" in m.get("STATUS", ""), "the daemon to adopt the tuned point")
        n = len(d.messages)
        d.wait_message(lambda m: sum("watching" in x.get("STATUS", "") or "WATCHDOG" in x
                                     for x in d.messages[n:]) >= 5, "a few more polls")
        gpu = host.gpu(0)
        assert gpu["power_limit_w"] == kept["power_limit_w"]
        assert gpu["locked_sm_clocks_mhz"][1] == kept["sm_clock_max_mhz"]
        assert "hwtune_last_tune_ok 1.0" in d.scrape(info["metrics_port"])
    finally:
        d.close()


def _sigterm_after(proc, line_part):
    """SIGTERM `proc` as soon as its stderr says `line_part`; returns (stdout, stderr)."""
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if line_part in line:
            proc.send_signal(signal.SIGTERM)
            break
    out, err = proc.communicate(timeout=WAIT_S)
    return out, "".join(seen) + err


@pytest.mark.parametrize("args, when, delay_ms", [
    (("--exhaustive",), "exhaustive sweep", 20),   # during the comparison sweep
    (("--budget", "5"), "keeping", 200),            # while the kept point is written
])
def test_sigterm_after_the_search_restores_the_starting_settings_and_exits_1(host, args, when, delay_ms):
    host.set(f"write_delay_ms={delay_ms}")
    proc = _start_tune(host, *args)
    try:
        out, err = _sigterm_after(proc, when)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1, err[-3000:]
    report = json.loads(out)
    assert "SIGTERM" in report["aborted"]
    assert report["kept"] == report["baseline"]
    host.set("write_delay_ms=0")
    assert host.status() == host.original


def test_two_tunes_started_together_one_runs_the_other_is_refused(tmp_path):
    # A large host file makes every read slow, so both tunes are between their "anyone
    # tuning?" check and their first write at the same time, as two timers firing at once.
    sim = tmp_path / "host.json"
    run_hwtune("sim", "init", sim, "--cpus", "3000", check=True)
    run_hwtune("sim", "set", sim, "write_delay_ms=1000", check=True)  # the winner holds on while the other starts
    state = tmp_path / "state"
    cmd = [sys.executable, "-m", "daemon.cli", "--sim", str(sim), "--state-dir", str(state), "tune",
           "--no-kernels", "--budget", "2", "--json"]
    procs = [subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    try:
        results = [(p.communicate(timeout=WAIT_S * 4), p.returncode) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    codes = sorted(rc for _, rc in results)
    assert codes == [0, 5], [err[-2000:] for (_, err), _ in results]
    refused = next(err for (_, err), rc in results if rc == 5)
    assert "already tuning" in refused


def test_a_daemon_restarted_during_a_tune_holds_the_point_the_tune_kept(host):
    config = host.config(rollback="never")
    first = Daemon(host, config)
    try:
        first.ready()
        host.set("write_delay_ms=60")
        proc = _start_tune(host, "--budget", "6", "--nightly")
        wait_until(lambda: _evaluations_started(host, 2), "the tune to be running")
        assert first.stop() == 0  # e.g. a package upgrade restarts the service mid-tune
    finally:
        first.close()
        first.sock_path.unlink()
    second = Daemon(host, config)
    try:
        out, err = proc.communicate(timeout=WAIT_S)
        assert proc.returncode == 0, err[-3000:]
        kept = json.loads(out)["kept"]
        second.ready()
        host.set("write_delay_ms=0")
        second.wait_message(lambda m: "watching" in m.get("STATUS", "") and "is tuning" not in m["STATUS"],
                            "a poll after the tune")
        # the profile it holds, as its status says: a log line names it only where an apply was
        # needed (a daemon that started while the tune ran finds the host at the kept point)
        second.wait_message(lambda m: "profile efficiency+tuned;" in m.get("STATUS", ""),
                            "the daemon to hold the tuned profile")
        time.sleep(1.0)  # a few more polls
        gpu = host.gpu(0)
        assert gpu["power_limit_w"] == kept["power_limit_w"]
        assert gpu["locked_sm_clocks_mhz"][1] == kept["sm_clock_max_mhz"]
    finally:
        second.close()


def test_a_writer_holding_the_lock_as_the_tune_ends_delays_its_restore_instead_of_failing_it(host, monkeypatch):
    # `hwtune apply` from a shell (or the daemon's re-apply) holding the lock just as the tune
    # wrote its last point: the restore was tried once, failed 'lock busy', and the tune exited
    # with the host at its last trial point and no marker left for anyone to put it back.
    from daemon import tune as tune_mod
    from daemon.context import Context

    holders = []
    real_finish = tune_mod.hwloop.finish

    def finish_with_the_lock_held(*args, **kwargs):
        if not holders:
            holders.append(subprocess.Popen(
                [sys.executable, "-c",
                 "import fcntl, os, time\n"
                 f"fd = os.open({str(host.state / 'lock')!r}, os.O_RDWR)\n"
                 "fcntl.flock(fd, fcntl.LOCK_EX)\nprint('held', flush=True)\ntime.sleep(1.5)\n"],
                stdout=subprocess.PIPE, text=True))
            assert holders[0].stdout.readline().strip() == "held"
        return real_finish(*args, **kwargs)

    monkeypatch.setattr(tune_mod.hwloop, "finish", finish_with_the_lock_held)
    ctx = Context(config_path=None, state_dir=host.state, sim_path=host.sim, sysfs_root=ROOT / "nonexistent",
                  read_only=False, profile_dir=host.tmp / "profiles")
    lines = []
    try:
        report = tune_mod.tune(ctx, tune_mod.TuneOptions(budget=3, kernels=(), keep=False), log=lines.append)
    finally:
        for p in holders:
            p.kill()
            p.wait()
    assert holders, "the tune never reached its end"
    assert report["kept"] == report["baseline"], lines
    assert host.status() == host.original
    assert not (host.state / "tuning.json").exists()


def test_a_signal_during_the_kernel_search_ends_the_search_child_too(tmp_path):
    # SIGTERM to `hwtune tune` in its kernel step raised out of the wait for `hwtune search`
    # and left that child running on its own (orphaned, still searching and writing the table).
    from daemon.tune import _run_streaming

    class Stop(BaseException):
        pass

    def stop(signum, frame):
        raise Stop()

    pid_file = tmp_path / "child.pid"
    child = ("import os, sys, time\n"
             f"open({str(pid_file)!r}, 'w').write(str(os.getpid()))\n"
             "print('searching', file=sys.stderr, flush=True)\n"
             "time.sleep(120)\n")
    old = signal.signal(signal.SIGALRM, stop)
    try:
        signal.setitimer(signal.ITIMER_REAL, 2.0)
        t0 = time.monotonic()
        with pytest.raises(Stop):
            _run_streaming([sys.executable, "-c", child], tmp_path, dict(os.environ), 600, lambda line: None)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    pid = int(pid_file.read_text())
    try:
        alive = os.waitpid(pid, os.WNOHANG) == (0, 0)
    except ChildProcessError:
        alive = False
    if alive:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    assert not alive, "the child outlived the signal"
    assert time.monotonic() - t0 < 15


@pytest.mark.parametrize("plant", ["corrupt", "symlink", "foreign"])
def test_a_marker_that_cannot_be_read_is_named_with_what_to_do_not_try_again(host, plant):
    # It said 'its starting settings could not be restored yet; try again' (exit 5, lock busy)
    # every night for ever: trying again never helps with a marker no tune can read.
    host.state.mkdir(mode=0o700, exist_ok=True)
    marker = host.state / "tuning.json"
    if plant == "symlink":
        marker.symlink_to("/etc/passwd")
    else:
        marker.write_text('{"pid": 12' if plant == "corrupt" else '{"pid": 12}')
        os.chmod(marker, 0o600)
        if plant == "foreign":
            os.chown(marker, 65534, -1)
    r, _ = tune(host, "--no-kernels", "--budget", "2", check=False)
    assert r.returncode == 2, r.stderr
    assert "try again" not in r.stderr and str(marker) in r.stderr and "remove it" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert host.status() == host.original


def test_a_nightly_that_keeps_nothing_new_leaves_the_daemon_on_the_point_kept_before(host):
    # A nightly that found nothing better than where it started (the point an earlier night
    # kept) wrote kept_profile: null, so the daemon's next start dropped that point and put
    # the bare base profile back, moving the host away from what every tune had left.
    config = host.config(rollback="never", metrics={"enabled": False})
    nightly = ("--sim", host.sim, "--config", config, "tune", "--nightly", "--no-kernels")
    run_hwtune("--sim", host.sim, "daemon", "--config", config, "--once", check=True)
    first = json.loads(run_hwtune(*nightly, "--budget", "6", "--json", check=True, timeout=600).stdout)
    assert first["kept"] != first["baseline"], "the first night kept nothing: nothing to hold"
    second = json.loads(run_hwtune(*nightly, "--budget", "3", "--restore", "--json", check=True,
                                   timeout=600).stdout)
    assert second["kept"] == second["baseline"] == first["kept"]
    r = run_hwtune("--sim", host.sim, "daemon", "--config", config, "--once", check=True)
    assert "efficiency+tuned applied" in r.stderr, r.stderr
    gpu = host.gpu(0)
    assert gpu["power_limit_w"] == first["kept"]["power_limit_w"]


def test_a_restore_that_still_finds_the_lock_held_keeps_the_marker_for_the_next_to_restore(host, monkeypatch):
    # The marker names the starting settings: removed after a failed restore, nothing was left
    # that could put them back (the daemon's and the next tune's dead_tune_restorer read it).
    from daemon import tune as tune_mod
    from daemon.context import Context
    from hwtune.errors import LockBusyError

    monkeypatch.setattr(tune_mod, "LOCK_WAIT_S", 0.3)
    holders = []
    real_finish = tune_mod.hwloop.finish

    def finish_with_the_lock_held(*args, **kwargs):
        if not holders:
            holders.append(subprocess.Popen(
                [sys.executable, "-c",
                 "import fcntl, os, time\n"
                 f"fd = os.open({str(host.state / 'lock')!r}, os.O_RDWR)\n"
                 "fcntl.flock(fd, fcntl.LOCK_EX)\nprint('held', flush=True)\ntime.sleep(60)\n"],
                stdout=subprocess.PIPE, text=True))
            assert holders[0].stdout.readline().strip() == "held"
        return real_finish(*args, **kwargs)

    monkeypatch.setattr(tune_mod.hwloop, "finish", finish_with_the_lock_held)
    ctx = Context(config_path=None, state_dir=host.state, sim_path=host.sim, sysfs_root=ROOT / "nonexistent",
                  read_only=False, profile_dir=host.tmp / "profiles")
    try:
        with pytest.raises(LockBusyError):
            tune_mod.tune(ctx, tune_mod.TuneOptions(budget=3, kernels=(), keep=False), log=lambda s: None)
    finally:
        for p in holders:
            p.kill()
            p.wait()
    marker = json.loads((host.state / "tuning.json").read_text())
    assert marker["baseline"] and marker["gpus"] == [0, 1]


def test_a_daemon_stopped_with_rollback_on_exit_during_a_tune_leaves_the_host_as_before_hwtune(host):
    # The stop restored the journal between two of the tune's points, and the tune went on
    # writing points and ended at its baseline (the daemon's profile): the host stayed tuned
    # although the daemon had stopped with rollback: on_exit.
    config = host.config(rollback="on_exit")
    d = Daemon(host, config)
    try:
        d.ready()
        host.set("write_delay_ms=60")
        proc = _start_tune(host, "--budget", "12", "--restore")
        d.wait_message(lambda m: "is tuning" in m.get("STATUS", ""), "the daemon to see the tune")
        assert d.stop() == 0, d.output()
        out, err = proc.communicate(timeout=WAIT_S)
        assert proc.returncode == 1, err[-3000:]   # aborted: asked to stop
        assert "asked to stop" in json.loads(out)["aborted"]
    finally:
        d.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    host.set("write_delay_ms=0")
    assert host.status() == host.original
