"""A write sequence is never left half done: kill -9, signals, a dead terminal, a device
that ignores a restore, a full disk. Real child processes, stopped at named fault points
(HWTUNE_FAULT, hwtune/faults.py)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, run_hwtune
from fixtures.simhost import make_sim, status_json
from hwtune.backends.sim import SimFile

WAIT_S = 60


def _env(fault=None):
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    env.pop("HWTUNE_READ_ONLY", None)
    env.pop("HWTUNE_FAULT", None)
    if fault:
        env["HWTUNE_FAULT"] = fault
    return env


def _start(sim, *args, fault=None, **kw):
    kw.setdefault("stdout", subprocess.PIPE)
    kw.setdefault("stderr", subprocess.PIPE)
    return subprocess.Popen([sys.executable, "-m", "daemon.cli", "--sim", str(sim), *args], cwd=ROOT,
                            env=_env(fault), text=True, **kw)


def _wait_pause(proc) -> list:
    """Read stderr until the child says it is paused at its fault point."""
    lines = []
    for line in proc.stderr:
        lines.append(line)
        if line.startswith("hwtune-fault: paused at"):
            return lines
    proc.wait(timeout=WAIT_S)
    raise AssertionError(f"child exited {proc.returncode} before its fault point:\n{''.join(lines)}")


def _journal(sim):
    path = Path(str(sim) + ".state") / "journal.json"
    return json.loads(path.read_text()) if path.exists() else None


def _gpus(sim):
    return json.loads(Path(sim).read_text())["gpus"]


def _no_traceback(text):
    assert "Traceback" not in text, text


# -- 3: signals and a dead terminal -------------------------------------------------------

@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_signal_mid_apply_undoes_the_apply_then_exits_with_the_signal_code(tmp_path, sig):
    sim = make_sim(tmp_path)
    original = status_json(sim)
    proc = _start(sim, "apply", "-p", "throughput", fault="device.write@5=pause:30")
    _wait_pause(proc)
    assert _journal(sim)["status"] == "in_progress"
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=WAIT_S)
    assert proc.returncode == 128 + sig, err
    _no_traceback(err)
    assert f"interrupted by {signal.Signals(sig).name}" in err and "the host is as it was" in err
    assert status_json(sim) == original
    assert _journal(sim) is None


def test_signal_mid_rollback_finishes_the_rollback_then_exits_with_the_signal_code(tmp_path):
    sim = make_sim(tmp_path)
    original = status_json(sim)
    run_hwtune("--sim", sim, "apply", "-p", "throughput", check=True)
    proc = _start(sim, "rollback", fault="restore.write@3=pause:30")
    _wait_pause(proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=WAIT_S)
    assert proc.returncode == 143, err
    _no_traceback(err)
    assert status_json(sim) == original
    assert _journal(sim) is None


def test_sigterm_sent_to_itself_at_the_last_write_still_leaves_a_whole_apply(tmp_path):
    # The signal lands while the last write is in flight: nothing is left to undo it at, so
    # the apply is whole (journaled, verify 0), and the exit code still says SIGTERM.
    sim = make_sim(tmp_path)
    proc = _start(sim, "apply", "-p", "throughput", fault="device.written@12=term")
    _, err = proc.communicate(timeout=WAIT_S)
    assert proc.returncode == 143, err
    assert "SIGTERM arrived as the apply finished" in err
    assert _journal(sim)["status"] == "committed"
    assert run_hwtune("--sim", sim, "verify", "-p", "throughput").returncode == 0


@pytest.mark.parametrize("command", ["apply", "rollback"])
def test_a_closed_pipe_never_stops_the_write_sequence(tmp_path, command):
    # `hwtune apply 2>&1 | head -1`: the reader goes away after the first line.
    sim = make_sim(tmp_path, write_delay_ms=20)
    original = status_json(sim)
    if command == "rollback":
        run_hwtune("--sim", sim, "apply", "-p", "throughput", check=True)
    args = ["apply", "-p", "throughput", "--json"] if command == "apply" else ["rollback", "--json"]
    proc = _start(sim, *args, stderr=subprocess.STDOUT)
    proc.stdout.readline()
    proc.stdout.close()
    assert proc.wait(timeout=WAIT_S) == 0
    if command == "apply":
        assert _journal(sim)["status"] == "committed"
        assert run_hwtune("--sim", sim, "verify", "-p", "throughput").returncode == 0
    else:
        assert _journal(sim) is None and status_json(sim) == original


# -- 1: locked clocks on a host without a getter (NVML) -------------------------------------

def _nvml_like_sim(tmp_path):
    return make_sim(tmp_path, locked_clocks_getter=False)


def test_kill9_between_clock_lock_and_its_record_never_reads_as_reset(tmp_path):
    sim = _nvml_like_sim(tmp_path)
    # Earlier runs leave a record saying "reset": the stale cache of the bug.
    run_hwtune("--sim", sim, "apply", "-p", "throughput", check=True)
    run_hwtune("--sim", sim, "rollback", check=True)
    proc = _start(sim, "apply", "-p", "throughput", fault="clocks.written@1=kill")
    proc.communicate(timeout=WAIT_S)
    assert proc.returncode == -signal.SIGKILL
    assert _gpus(sim)[0]["locked_sm_clocks_mhz"] == [1755, 1980]  # the device took the lock
    s = status_json(sim)
    assert s["gpus"][0]["sm_clock_mhz"] == "unknown"  # not "reset"
    rb = run_hwtune("--sim", sim, "rollback")
    assert rb.returncode == 0, rb.stderr
    assert all(g["locked_sm_clocks_mhz"] is None and g["locked_memory_clocks_mhz"] is None for g in _gpus(sim))
    assert status_json(sim)["gpus"][0]["sm_clock_mhz"] == "reset"
    assert _journal(sim) is None


def test_rollback_reissues_a_journaled_reset_even_when_the_record_says_reset(tmp_path):
    sim = _nvml_like_sim(tmp_path)
    run_hwtune("--sim", sim, "apply", "-p", "throughput", check=True)
    locks = Path(str(sim) + ".state") / "locks.json"
    record = json.loads(locks.read_text())
    for fields in record["gpus"].values():
        for name in fields:
            fields[name] = "reset"  # a stale record: the clocks are still locked
    locks.write_text(json.dumps(record))
    rb = run_hwtune("--sim", sim, "rollback")
    assert rb.returncode == 0, rb.stderr
    assert all(g["locked_sm_clocks_mhz"] is None and g["locked_memory_clocks_mhz"] is None for g in _gpus(sim))


def test_full_disk_between_clock_lock_and_its_record_is_undone_in_one_line(tmp_path):
    sim = _nvml_like_sim(tmp_path)
    original = status_json(sim)
    # locks.json write 1 is the "unknown" made durable before the lock, write 2 the record after
    # it; from there on the disk stays full (the reserve freed for the journal does not help).
    proc = _start(sim, "apply", "-p", "throughput", fault="state.write:locks.json@2+=enospc")
    _, err = proc.communicate(timeout=WAIT_S)
    assert proc.returncode == 1, err
    _no_traceback(err)
    last = err.strip().splitlines()[-1]
    assert "no space left on device" in last and "the host is as it was" in last
    assert all(g["locked_sm_clocks_mhz"] is None for g in _gpus(sim))
    assert status_json(sim) == original
    assert _journal(sim) is None
    assert not [p for p in Path(str(sim) + ".state").iterdir() if p.name.endswith(".tmp")]


# -- 2: every restore is read back ----------------------------------------------------------

def test_a_restore_the_device_ignores_stays_in_the_journal_and_fails_naming_it(tmp_path):
    sim = make_sim(tmp_path)
    original = status_json(sim)
    run_hwtune("--sim", sim, "apply", "-p", "efficiency", check=True)
    assert _gpus(sim)[0]["power_limit_w"] == 560
    SimFile(sim).update(lambda d: d.__setitem__("faults", [{"op": "set_power_limit", "error": "Ignored"},
                                                           {"op": "set_devctl", "bdf": "0000:18:00.0",
                                                            "error": "Ignored"}]))
    rb = run_hwtune("--sim", sim, "rollback")
    assert rb.returncode == 1, rb.stderr
    _no_traceback(rb.stderr)
    last = rb.stderr.strip().splitlines()[-1]
    assert "gpu0 power_limit_w" in last and "gpu1 power_limit_w" in last and "pcie:0000:18:00.0" in last
    assert "read back 560" in last
    kept = {(e["target"], e["field"]) for e in _journal(sim)["entries"]}
    assert kept == {("gpu0", "power_limit_w"), ("gpu1", "power_limit_w"),
                    ("pcie:0000:18:00.0", "relaxed_ordering"), ("pcie:0000:18:00.0", "max_read_request_bytes")}
    assert _gpus(sim)[0]["persistence_mode"] is False  # the rest was restored
    SimFile(sim).update(lambda d: d.__setitem__("faults", []))
    assert run_hwtune("--sim", sim, "rollback").returncode == 0
    assert status_json(sim) == original and _journal(sim) is None


# -- 6: a full disk -------------------------------------------------------------------------

@pytest.fixture
def small_tmpfs(tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,mode=0700", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def _fill(mnt: Path, leave_bytes: int) -> Path:
    """Fill the filesystem, then give back about `leave_bytes`."""
    filler = mnt / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError:
        pass
    finally:
        os.close(fd)
    os.truncate(filler, max(0, os.path.getsize(filler) - leave_bytes))
    return filler


def test_full_disk_refuses_before_the_first_hardware_write(tmp_path, small_tmpfs):
    sim = make_sim(tmp_path)
    original = status_json(sim)
    state = small_tmpfs / "state"
    written = os.stat(sim)
    filler = _fill(small_tmpfs, 8192)  # room for the lock and the first journal write, not the rest
    r = run_hwtune("--sim", sim, "--state-dir", state, "apply", "-p", "throughput")
    assert r.returncode == 1, r.stderr
    _no_traceback(r.stderr)
    assert "no space left on device" in r.stderr.strip().splitlines()[-1]
    assert "restor" not in r.stderr  # refused, not written and undone
    now = os.stat(sim)  # every simulated write replaces the file: not one happened
    assert (now.st_ino, now.st_mtime_ns) == (written.st_ino, written.st_mtime_ns)
    assert not (state / "journal.json").exists()
    assert [p.name for p in state.iterdir() if p.name != "lock"] == []
    filler.unlink()
    assert run_hwtune("--sim", sim, "--state-dir", state, "apply", "-p", "throughput").returncode == 0
    assert run_hwtune("--sim", sim, "--state-dir", state, "rollback").returncode == 0
    assert status_json(sim) == original


def test_a_disk_with_not_one_byte_free_refuses_in_one_line_not_at_the_lock(tmp_path, small_tmpfs):
    # The lock file is made (an inode) but its pid cannot be written: the lock still works
    # and the journal's reserve refuses, before any write.
    sim = make_sim(tmp_path)
    original = status_json(sim)
    state = small_tmpfs / "state"
    filler = _fill(small_tmpfs, 0)
    r = run_hwtune("--sim", sim, "--state-dir", state, "apply", "-p", "throughput")
    assert r.returncode == 1, r.stderr
    _no_traceback(r.stderr)
    assert "nothing was written" in r.stderr.strip().splitlines()[-1]
    assert status_json(sim) == original
    filler.unlink()
    assert run_hwtune("--sim", sim, "--state-dir", state, "apply", "-p", "throughput").returncode == 0
    assert run_hwtune("--sim", sim, "--state-dir", state, "rollback").returncode == 0
    assert status_json(sim) == original


def test_a_disk_that_fills_up_mid_apply_is_absorbed_by_the_reserve(tmp_path, small_tmpfs):
    # The space set aside before the first write is what the rest of the journal uses when
    # something else fills the disk meanwhile: the apply completes, nothing is left behind.
    sim = make_sim(tmp_path)
    state = small_tmpfs / "state"
    proc = _start(sim, "--state-dir", str(state), "apply", "-p", "throughput", fault="device.write@3=pause:2")
    _wait_pause(proc)
    _fill(small_tmpfs, 0)
    _, err = proc.communicate(timeout=WAIT_S)
    assert proc.returncode == 0, err
    assert json.loads((state / "journal.json").read_text())["status"] == "committed"
    assert sorted(p.name for p in state.iterdir()) == ["journal.json", "lock", "locks.json"]
    assert run_hwtune("--sim", sim, "--state-dir", state, "verify", "-p", "throughput").returncode == 0


def test_disk_full_mid_apply_undoes_commits_and_leaves_no_temp_files(tmp_path):
    sim = make_sim(tmp_path)
    original = status_json(sim)
    proc = _start(sim, "apply", "-p", "throughput", fault="state.write:journal.json@6+=enospc")
    _, err = proc.communicate(timeout=WAIT_S)
    assert proc.returncode == 1, err
    _no_traceback(err)
    assert len([ln for ln in err.splitlines() if ln.startswith("hwtune apply:")]) == 1
    assert status_json(sim) == original
    state = Path(str(sim) + ".state")
    assert _journal(sim) is None
    assert sorted(p.name for p in state.iterdir()) in (["lock"], ["lock", "locks.json"])


# -- 4: Ctrl-C in `hwtune demo` or in tune's kernel phase ------------------------------------

def _as_argv(command: str) -> list:
    import shlex

    words = shlex.split(command)
    assert words[0] == "hwtune"
    return [sys.executable, "-m", "daemon.cli", *words[1:]]


def test_ctrl_c_in_the_kernel_phase_of_tune_prints_the_exact_rollback_command(tmp_path):
    sim = make_sim(tmp_path)
    original = status_json(sim)
    proc = _start(sim, "tune", "--budget", "3", "--kernels", "rmsnorm", "--kernel-budget", "1")
    lines = []
    for line in proc.stderr:
        lines.append(line)
        if "kernel search: rmsnorm" in line:
            break
    else:
        raise AssertionError("".join(lines))
    assert _gpus(sim)[0]["locked_sm_clocks_mhz"] is not None  # the kept point is on the host
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=WAIT_S)
    assert proc.returncode == 130, err
    _no_traceback(err)
    last = err.strip().splitlines()[-1]
    assert "during the kernel search" in last and "stays applied and journaled" in last
    command = last.split("to restore the settings from before hwtune: ", 1)[1]
    assert f"--sim {sim.resolve()}" in command and f"--state-dir {Path(str(sim) + '.state').resolve()}" in command
    r = subprocess.run(_as_argv(command), cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=WAIT_S)
    assert r.returncode == 0, r.stderr
    assert status_json(sim) == original


@pytest.mark.parametrize("signo", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_to_tune_alone_ends_its_kernel_search_before_the_tune_exits(tmp_path, signo):
    """`kill PID` (or -INT) reaches the tune, not its search child: the tune exited and said
    'interrupted' while the search ran on, its executor folder still in /tmp."""
    import psutil

    sim = make_sim(tmp_path)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "daemon.cli", "--sim", str(sim), "tune", "--budget", "3",
                             "--kernels", "rmsnorm", "--kernel-budget", "large"], cwd=ROOT,
                            env=dict(_env(), TMPDIR=str(tmp)), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    lines = []
    for line in proc.stderr:
        lines.append(line)
        if "rmsnorm: [1 " in line:   # the search is evaluating: its executor is running
            break
    else:
        raise AssertionError("".join(lines))
    search = psutil.Process(proc.pid).children()
    assert search, "".join(lines)
    proc.send_signal(signo)
    _, err = proc.communicate(timeout=WAIT_S)
    assert proc.returncode == 128 + signo, err
    _no_traceback(err)
    assert not [p for p in search if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert list(tmp.iterdir()) == []


def test_ctrl_c_in_the_demo_restores_the_host_and_says_how(tmp_path):
    out = tmp_path / "demo"
    proc = subprocess.Popen([sys.executable, "-m", "daemon.cli", "demo", "--simulated", "--out", str(out)], cwd=ROOT,
                            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    lines = []
    for line in proc.stderr:
        lines.append(line)
        if line.startswith("$ hwtune") and " tune " in line:
            break
    else:
        raise AssertionError("".join(lines))
    sim = out / "host.json"

    def tuned():
        try:
            return any(g["locked_sm_clocks_mhz"] for g in json.loads(sim.read_text())["gpus"])
        except (OSError, ValueError):
            return False
    import time
    end = time.monotonic() + WAIT_S
    while not tuned() and time.monotonic() < end:
        time.sleep(0.05)
    assert tuned(), "the tune step never changed the host"
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does: the whole group
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err[-3000:]
    _no_traceback(err)
    assert f"hwtune --sim {sim} --state-dir {out / 'state'} rollback" in err
    assert "host restored" in err
    gpus = json.loads(sim.read_text())["gpus"]
    assert all(g["locked_sm_clocks_mhz"] is None and g["power_limit_w"] == 700 and not g["persistence_mode"]
               for g in gpus)
    assert not (out / "state" / "journal.json").exists()


def test_a_dropped_session_sighup_and_a_dead_terminal_still_undo_and_exit_129(tmp_path):
    # ssh goes away: SIGHUP, and every later write to the terminal fails.
    sim = make_sim(tmp_path)
    original = status_json(sim)
    proc = _start(sim, "apply", "-p", "throughput", fault="device.write@4=pause:30", stdout=subprocess.PIPE,
                  stderr=subprocess.STDOUT)
    for line in proc.stdout:
        if line.startswith("hwtune-fault: paused at"):
            break
    proc.stdout.close()
    proc.send_signal(signal.SIGHUP)
    assert proc.wait(timeout=WAIT_S) == 129
    assert status_json(sim) == original and _journal(sim) is None


def _settings(sim):
    d = json.loads(Path(sim).read_text())
    return ([(g["persistence_mode"], g["power_limit_w"], g["locked_sm_clocks_mhz"], g["locked_memory_clocks_mhz"])
             for g in d["gpus"]], [p["devctl"] for p in d["pcie"]],
            [(c["governor"], [s["disable"] for s in c["cstates"]]) for c in d["cpu"]["cpus"]])


KILL_POINTS = ([f"device.write@{n}" for n in (1, 4, 7, 12)] + [f"device.written@{n}" for n in (1, 6, 12)]
               + ["journal.record@1", "journal.record@9", "clocks.written@1", "clocks.written@4",
                  "clocks.recorded@3", "state.write:journal.json@1", "state.write:journal.json@13",
                  "state.write:locks.json@2", "state.reserve"])


@pytest.mark.parametrize("point", KILL_POINTS)
@pytest.mark.parametrize("action", ["kill", "term", "enospc"])
def test_any_crash_signal_or_full_disk_inside_apply_leaves_a_host_rollback_restores_exactly(tmp_path, point, action):
    sim = _nvml_like_sim(tmp_path)
    original = _settings(sim)
    proc = _start(sim, "apply", "-p", "throughput", fault=f"{point}={action}")
    _, err = proc.communicate(timeout=WAIT_S)
    _no_traceback(err)
    assert proc.returncode in {"kill": (-9,), "term": (143,), "enospc": (0, 1)}[action], err
    journal = _journal(sim)
    if action != "kill":  # nothing half done: undone (no journal) or whole (committed)
        assert journal is None or journal["status"] == "committed", err
        assert journal is not None or _settings(sim) == original
    rb = run_hwtune("--sim", sim, "rollback")
    assert rb.returncode == 0, rb.stderr
    assert _settings(sim) == original
    assert _journal(sim) is None
