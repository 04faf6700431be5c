"""hwtune runs as root: nothing another user wrote steers what it writes. Symlinks and
planted files are made by an unprivileged uid (a forked child that drops to nobody); torn
journals are restored entry by entry; configs and secrets follow the daemon's rules."""
from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from conftest import ROOT, run_hwtune
from fixtures.simhost import make_sim, status_json, write_profile
from fixtures.sysfs_tree import build, snapshot

NOBODY = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="the attacks need root as the victim and another uid")


def as_user(action, uid: int = NOBODY) -> None:
    """Run `action()` in a forked child as `uid` (no groups); fail the test if it fails."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            action()
            code = 0
        except BaseException as exc:  # noqa: BLE001 - report and exit the child
            try:
                os.write(2, f"as uid {uid}: {exc!r}\n".encode())
            except OSError:
                pass
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the unprivileged action failed"


@pytest.fixture
def open_dir():
    """A directory other users can reach (pytest's tmp_path is 0700)."""
    d = Path(tempfile.mkdtemp(prefix="hwtune-trust-", dir="/tmp"))
    d.chmod(0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _victim(d: Path) -> Path:
    v = d / "victim"
    v.write_text("precious\n")
    v.chmod(0o600)
    return v


def _loose_state(d: Path) -> Path:
    """A state directory others may write in (what umask 000 used to give)."""
    state = d / "state"
    state.mkdir()
    state.chmod(0o777)
    return state


def _mode(p: Path) -> int:
    return stat.S_IMODE(os.lstat(p).st_mode)


# -- 7: state files never follow links; modes are set whatever the umask ---------------------

@needs_root
def test_a_symlink_planted_at_the_lock_path_is_refused_and_never_followed(open_dir, tmp_path):
    sim = make_sim(tmp_path)
    original = status_json(sim)
    victim = _victim(open_dir)
    state = _loose_state(open_dir)
    as_user(lambda: os.symlink(victim, state / "lock"))
    r = run_hwtune("--sim", sim, "--state-dir", state, "apply", "-p", "throughput")
    assert r.returncode == 2 and "lets other users write in it" in r.stderr and "Traceback" not in r.stderr
    # Even in a directory that is only ours, a link at the lock path is never followed.
    state.chmod(0o700)
    r = run_hwtune("--sim", sim, "--state-dir", state, "apply", "-p", "throughput")
    assert r.returncode != 0 and "symbolic link" in r.stderr and "Traceback" not in r.stderr
    assert victim.read_text() == "precious\n" and _mode(victim) == 0o600
    assert status_json(sim) == original


@needs_root
def test_symlinks_at_the_old_predictable_temp_names_are_never_followed(open_dir):
    simdir = _loose_state(open_dir).rename(open_dir / "simdir")  # the simulated host's dir: others may write
    sim = make_sim(simdir)
    victim = _victim(open_dir)
    state = _loose_state(open_dir)
    # The old temp name was .NAME.<pid>.tmp: plant it for the pids coming next, while the state
    # directory still let others in; it is made 0700 afterwards, the links stay.
    probe = subprocess.Popen(["true"])
    probe.wait()
    pids = range(probe.pid, probe.pid + 300)

    def plant():
        for pid in pids:
            for name in ("journal.json", "locks.json", "daemon.json"):
                os.symlink(victim, state / f".{name}.{pid}.tmp")
            os.symlink(victim, simdir / f".host.json.{pid}.tmp")
    as_user(plant)
    state.chmod(0o700)
    proc = subprocess.Popen([sys.executable, "-m", "daemon.cli", "--sim", str(sim), "--state-dir", str(state),
                             "apply", "-p", "throughput"], cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, err = proc.communicate(timeout=120)
    if proc.pid not in pids:
        pytest.skip(f"the apply got pid {proc.pid}, outside the planted range (a busy machine)")
    assert proc.returncode == 0, err
    assert victim.read_text() == "precious\n" and _mode(victim) == 0o600
    assert json.loads((state / "journal.json").read_text())["status"] == "committed"
    assert not (state / "journal.json").is_symlink() and not sim.is_symlink()
    assert json.loads(sim.read_text())["gpus"][0]["persistence_mode"] is True


def test_state_modes_are_explicit_whatever_the_umask(tmp_path):
    sim = make_sim(tmp_path)
    state = tmp_path / "fresh" / "state"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-m", "daemon.cli", "--sim", str(sim), "--state-dir", str(state),
                        "apply", "-p", "throughput"], cwd=ROOT, env=env, capture_output=True, text=True,
                       preexec_fn=lambda: os.umask(0), timeout=120)
    assert p.returncode == 0, p.stderr
    assert _mode(state) == 0o700
    assert _mode(state.parent) & 0o022 == 0  # a parent it had to create is not world-writable either
    for name in ("journal.json", "lock", "locks.json"):
        assert _mode(state / name) == 0o600, name


# -- 8: a journal is trusted only when it is ours, and each entry is checked ------------------

def _planted_journal(entries) -> str:
    return json.dumps({"version": 1, "status": "in_progress", "profiles": [], "entries": entries})


POWER_200 = [{"target": f"gpu{i}", "family": "gpu_power", "field": "power_limit_w", "original": 200}
             for i in range(2)]


@needs_root
def test_a_journal_planted_by_another_user_is_refused_before_any_write(open_dir, tmp_path):
    sim = make_sim(tmp_path)
    state = _loose_state(open_dir)
    as_user(lambda: (state / "journal.json").write_text(_planted_journal(POWER_200)))
    assert (state / "journal.json").stat().st_uid == NOBODY
    r = run_hwtune("--sim", sim, "--state-dir", state, "rollback")
    assert r.returncode == 2 and "lets other users write in it" in r.stderr  # the directory first
    state.chmod(0o700)  # tightened later: the planted file is still there
    r = run_hwtune("--sim", sim, "--state-dir", state, "rollback")
    assert r.returncode == 1 and "owned by uid 65534" in r.stderr and "Traceback" not in r.stderr
    assert all(g["power_limit_w"] == 700 for g in json.loads(sim.read_text())["gpus"])
    d = run_hwtune("--sim", sim, "--state-dir", state, "daemon", "--config", _config(tmp_path), "--once")
    assert d.returncode != 0 and "owned by uid 65534" in d.stderr
    assert all(g["power_limit_w"] == 700 for g in json.loads(sim.read_text())["gpus"])


def _config(tmp_path) -> Path:
    c = tmp_path / "hwtune.yaml"
    c.write_text("profile: throughput\nmetrics: {enabled: false}\n")
    c.chmod(0o600)
    return c


def test_a_journal_others_may_write_is_refused(tmp_path):
    sim = make_sim(tmp_path)
    state = tmp_path / "host.json.state"
    state.mkdir(mode=0o700)
    j = state / "journal.json"
    j.write_text(_planted_journal(POWER_200))
    j.chmod(0o666)
    r = run_hwtune("--sim", sim, "rollback")
    assert r.returncode == 1 and "mode 0666" in r.stderr
    assert all(g["power_limit_w"] == 700 for g in json.loads(sim.read_text())["gpus"])


def test_journal_entries_outside_their_knobs_namespace_are_never_written(tmp_path):
    root = build(tmp_path / "root")
    outside = tmp_path / "root" / "sys" / "devices" / "system" / "escaped"
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    entries = [
        {"target": "cpu", "family": "cpu_governor", "field": "governor",
         "original": {"../../escaped/x": "performance", "cpu0": "performance"}},
        {"target": "cpu", "family": "cpu_idle", "field": "max_cstate_latency_us",
         "original": {"cpu0/../../../escaped": True}},
        {"target": "pcie:0000:18:00.0/../../../..", "family": "pcie", "field": "relaxed_ordering", "original": True},
        {"target": "gpu0", "family": "gpu_power", "field": "power_limit_w", "original": 200},  # no GPU here
        {"target": "cpu", "family": "cpu_governor", "field": "governor", "original": "performance\n../x"},
        {"target": "cpu", "family": "firmware", "field": "flash", "original": 1},
    ]
    (state / "journal.json").write_text(_planted_journal(entries))
    (state / "journal.json").chmod(0o600)
    before = snapshot(root)
    r = run_hwtune("--sysfs-root", root, "--state-dir", state, "rollback")
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert "6 journal entries unreadable" in last and "not a CPU of this host" in last
    assert "unknown family 'firmware'" in last and "not a gpu_power device" in last
    assert not outside.exists()
    assert snapshot(root) == before  # not one write
    assert json.loads((state / "journal.json").read_text())["status"] == "in_progress"


# -- torn or corrupt journals ----------------------------------------------------------------

def _applied(tmp_path):
    sim = make_sim(tmp_path)
    original = status_json(sim)
    run_hwtune("--sim", sim, "apply", "-p", "throughput", check=True)
    return sim, original, Path(str(sim) + ".state") / "journal.json"


def test_a_truncated_journal_restores_every_intact_entry_and_says_what_it_lost(tmp_path):
    sim, original, journal = _applied(tmp_path)
    text = journal.read_text()
    cut = text.index('"target": "cpu"')  # inside the CPU governor entry: 10 GPU/PCIe entries intact
    journal.write_text(text[:cut + 10])
    r = run_hwtune("--sim", sim, "rollback")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "unreadable" in r.stderr and "truncated" in r.stderr
    now = status_json(sim)
    assert now["gpus"] == original["gpus"] and now["pcie"] == original["pcie"]
    assert now["cpu"]["governor"] == "performance"  # its entry was lost: not claimed restored
    assert (journal.parent / "journal.json.damaged").read_text() == text[:cut + 10]
    again = run_hwtune("--sim", sim, "rollback")
    assert again.returncode == 1 and "unreadable" in again.stderr  # never "nothing to roll back"
    assert run_hwtune("--sim", sim, "apply", "-p", "throughput").returncode == 3


def test_bad_bytes_unknown_families_and_missing_fields_spoil_only_their_own_entries(tmp_path):
    sim, original, journal = _applied(tmp_path)
    data = json.loads(journal.read_text())
    entries = data["entries"]
    entries[0]["family"] = "nonsense"          # gpu0 persistence_mode
    del entries[1]["original"]                 # gpu0 sm_clock_mhz
    entries[2]["surprise"] = 1                 # gpu0 memory_clock_mhz
    raw = json.dumps(data, indent=2).encode()
    pos = raw.index(b'"gpu1"') + 2
    raw = raw[:pos] + b"\xff\xfe" + raw[pos:]  # invalid UTF-8 inside the next target name
    journal.write_bytes(raw)
    r = run_hwtune("--sim", sim, "rollback")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert "4 journal entries unreadable" in last
    assert "unknown family 'nonsense'" in last and "missing field 'original'" in last
    assert "unknown field 'surprise'" in last
    now = status_json(sim)
    assert now["pcie"] == original["pcie"] and now["cpu"] == original["cpu"]
    assert now["gpus"][1]["power_limit_w"] == original["gpus"][1]["power_limit_w"]


@pytest.mark.parametrize("content", [b"", b"\x00\x01garbage", b"[]", b'{"entries": 5}', b"{" * 100000],
                         ids=["empty", "binary", "a-list", "entries-not-a-list", "100000-deep"])
def test_a_journal_that_is_not_one_is_one_line_and_exit_1(tmp_path, content):
    sim = make_sim(tmp_path)
    state = tmp_path / "host.json.state"
    state.mkdir(mode=0o700)
    (state / "journal.json").write_bytes(content)
    (state / "journal.json").chmod(0o600)
    for cmd in (["rollback"], ["apply", "-p", "throughput"], ["status"]):
        r = run_hwtune("--sim", sim, *cmd)
        assert "Traceback" not in r.stderr, r.stderr
        if cmd[0] != "status":
            assert r.returncode in (1, 3) and len(r.stderr.strip().splitlines()) <= 2, r.stderr
    assert json.loads(sim.read_text())["gpus"][0]["persistence_mode"] is False


@pytest.mark.parametrize("journal", [
    {"status": "committed", "entries": [1]},
    {"status": "committed", "entries": [{"target": "gpu0"}]},
    {"status": "committed", "entries": [], "profiles": [1]},
    {"status": "committed", "entries": [], "profiles": 5},
], ids=["entry-not-an-object", "entry-missing-fields", "run-not-an-object", "runs-not-a-list"])
def test_a_committed_journal_with_a_damaged_entry_is_refused_by_apply_and_shown_by_status(tmp_path, journal):
    # A committed journal parses as a whole, so it is not "torn"; apply adds to it and status
    # lists its runs: a damaged entry or run must be refused there, not a TypeError mid-apply.
    sim = make_sim(tmp_path)
    original = status_json(sim)
    state = tmp_path / "host.json.state"
    state.mkdir(mode=0o700)
    (state / "journal.json").write_text(json.dumps(journal))
    (state / "journal.json").chmod(0o600)
    s = run_hwtune("--sim", sim, "status", "--json")
    assert s.returncode == 0 and "Traceback" not in s.stderr, s.stderr
    assert "error" in json.loads(s.stdout)["journal"]
    r = run_hwtune("--sim", sim, "apply", "-p", "throughput")
    assert r.returncode == 3 and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 2 and "hwtune rollback" in r.stderr  # sim line + reason
    assert status_json(sim)["gpus"] == original["gpus"]
    assert json.loads((state / "journal.json").read_text()) == journal  # left for rollback to name


# -- 9: the CLI takes its profile only from a config the daemon would take -------------------

@needs_root
@pytest.mark.parametrize("how", ["0664", "0666", "other-owner"])
def test_cli_refuses_an_insecure_config_as_the_daemon_does(tmp_path, how):
    sim = make_sim(tmp_path)
    original = status_json(sim)
    config = tmp_path / "hwtune.yaml"
    config.write_text("profile: efficiency\n")
    if how == "other-owner":
        config.chmod(0o644)
        os.chown(config, NOBODY, NOBODY)
    else:
        config.chmod(int(how, 8))
    for cmd in (["apply"], ["plan"], ["verify"]):
        r = run_hwtune("--sim", sim, "--config", config, *cmd)
        assert r.returncode == 2, (cmd, r.stderr)
        assert "refusing the config" in r.stderr and "Traceback" not in r.stderr
    d = run_hwtune("--sim", sim, "daemon", "--config", config, "--once")
    assert d.returncode == 2
    assert status_json(sim) == original
    config.chmod(0o600)
    os.chown(config, 0, 0)
    assert run_hwtune("--sim", sim, "--config", config, "apply").returncode == 0
    assert json.loads(sim.read_text())["gpus"][0]["power_limit_w"] == 560


# -- 10: secrets never printed; plain http with credentials refused --------------------------

def test_racadm_failure_never_prints_its_password(tmp_path):
    from hwtune.backends.redfish import BiosError
    from hwtune.backends.vendor import RacadmBios

    fake = tmp_path / "racadm"
    fake.write_text("#!/bin/sh\necho \"login failed for root with password $6\" >&2\nexit 2\n")
    fake.chmod(0o755)
    for command in (f"{fake} -r 10.0.0.5 -u root -p Sup3rS3cret", f"{fake} -r 10.0.0.5 -u root --password=Sup3rS3cret"):
        with pytest.raises(BiosError) as err:
            RacadmBios(command=command).attributes()
        assert "Sup3rS3cret" not in str(err.value) and "***" in str(err.value), str(err.value)
        assert "exited 2" in str(err.value)


def test_a_password_in_the_endpoint_url_is_never_echoed(tmp_path):
    import socket

    from hwtune.backends.redfish import BiosError, RedfishBios

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    bios = RedfishBios(f"https://admin:Hunter2pw@127.0.0.1:{port}", timeout_s=3, verify_tls=False)
    assert bios.username == "admin" and bios.password == "Hunter2pw"
    assert "Hunter2pw" not in repr(bios) and "Hunter2pw" not in bios.endpoint
    with pytest.raises(BiosError) as err:
        bios.attributes()
    assert "Hunter2pw" not in str(err.value) and f"127.0.0.1:{port}" in str(err.value)


def test_plain_http_with_credentials_is_refused_unless_the_profile_allows_it(tmp_path):
    root = build(tmp_path / "root")
    creds = tmp_path / "bmc.yaml"
    creds.write_text("username: admin\npassword: Hunter2pw\n")
    creds.chmod(0o600)
    prof = write_profile(tmp_path, "with-bmc", "bios:\n  endpoint: http://127.0.0.1:9\n  credentials_file: bmc.yaml\n"
                                          "  expect: {PowerProfile: MaxPerf}\n")
    r = run_hwtune("--sysfs-root", root, "--state-dir", tmp_path / "s", "plan", "-p", prof)
    assert r.returncode == 2 and "clear text" in r.stderr and "Hunter2pw" not in r.stderr + r.stdout
    inline = write_profile(tmp_path, "inline", "bios:\n  endpoint: http://admin:Hunter2pw@127.0.0.1:9\n"
                                               "  expect: {PowerProfile: MaxPerf}\n")
    r = run_hwtune("--sysfs-root", root, "--state-dir", tmp_path / "s", "plan", "-p", inline)
    assert r.returncode == 2 and "clear text" in r.stderr and "Hunter2pw" not in r.stderr + r.stdout
    allowed = write_profile(tmp_path, "allowed", "bios:\n  endpoint: http://127.0.0.1:9\n  credentials_file: bmc.yaml\n"
                                                 "  allow_insecure_http: true\n  expect: {PowerProfile: MaxPerf}\n")
    r = run_hwtune("--sysfs-root", root, "--state-dir", tmp_path / "s", "plan", "-p", allowed)
    assert r.returncode == 0 and "BMC unreachable" in r.stderr and "Hunter2pw" not in r.stderr + r.stdout


def test_a_journal_entry_for_a_device_that_is_gone_blocks_apply_and_is_restored_once_it_is_back(tmp_path):
    # A committed journal, well-formed, whose gpu1 and its PCIe function left the host (a GPU
    # that fell off the bus): apply must not add to a journal it cannot undo, rollback restores
    # all else and keeps those entries (with their originals) for when the device is back.
    sim, original, journal = _applied(tmp_path)
    applied = json.loads(sim.read_text())
    gone = json.loads(sim.read_text())
    gone["gpus"].pop()
    gone["pcie"] = [f for f in gone["pcie"] if f["bdf"] != "0000:2a:00.0"]
    sim.write_text(json.dumps(gone))
    s = status_json(sim)["journal"]
    assert len(s["not_restorable"]) == 5 and all("gpu1" in x or "0000:2a:00.0" in x for x in s["not_restorable"])
    assert "rollback cannot restore" in run_hwtune("--sim", sim, "status", check=True).stdout
    before = sim.read_bytes()
    r = run_hwtune("--sim", sim, "apply", "-p", "efficiency")
    assert r.returncode == 3 and "gpu1" in r.stderr and "hwtune rollback" in r.stderr, r.stderr
    r = run_hwtune("--sim", sim, "apply", "-p", "efficiency", "--json")
    assert r.returncode == 3 and json.loads(r.stdout)["exit_code"] == 3
    r = run_hwtune("--sim", sim, "tune", "--no-kernels", "--budget", "2")
    assert r.returncode == 3 and "gpu1" in r.stderr and "could not restore" not in r.stderr, r.stderr
    assert sim.read_bytes() == before
    r = run_hwtune("--sim", sim, "rollback")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert "7 value(s) restored" in last and "gpu1 persistence_mode" in last and "0000:2a:00.0" in last
    now = status_json(sim)
    assert now["gpus"] == original["gpus"][:1] and now["cpu"] == original["cpu"]
    assert [e["target"] for e in json.loads(journal.read_text())["entries"]].count("gpu1") == 3  # originals kept
    r = run_hwtune("--sim", sim, "rollback", "--json")
    doc = json.loads(r.stdout)  # one document: what was restored, what stays and why
    assert r.returncode == 1 and doc["ok"] is False and doc["exit_code"] == 1 and doc["restored"] == []
    assert len(doc["not_restored"]) == 5 and doc["journal"] == str(journal)
    assert all("gpu1" in x["why"] or "0000:2a:00.0" in x["why"] for x in doc["not_restored"])
    assert run_hwtune("--sim", sim, "apply", "-p", "efficiency").returncode == 3
    back = json.loads(sim.read_text())
    back["gpus"].append(applied["gpus"][1])
    back["pcie"].insert(1, applied["pcie"][1])
    sim.write_text(json.dumps(back))
    r = run_hwtune("--sim", sim, "rollback", check=True)
    assert "rolled back 5 value(s)" in r.stdout and not journal.exists()
    assert status_json(sim)["gpus"] == original["gpus"] and status_json(sim)["pcie"] == original["pcie"]


def test_cpus_gone_since_the_apply_are_kept_and_every_other_cpu_is_restored(tmp_path):
    sim, original, journal = _applied(tmp_path)
    applied = json.loads(sim.read_text())
    gone = json.loads(sim.read_text())
    gone["cpu"]["cpus"].pop()  # cpu7 went offline after the apply
    sim.write_text(json.dumps(gone))
    r = run_hwtune("--sim", sim, "rollback")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert "'cpu7'" in last and "'cpu7/state0'" in last, last
    now = status_json(sim)["cpu"]
    assert now["governor"] == "powersave" and now["max_cstate_latency_us"] == 133  # cpu0..6 restored
    kept = {e["field"]: e["original"] for e in json.loads(journal.read_text())["entries"]}
    assert kept["governor"] == {"cpu7": "powersave"} and set(kept["max_cstate_latency_us"]) == {
        f"cpu7/state{k}" for k in range(4)}
    back = json.loads(sim.read_text())
    back["cpu"]["cpus"].append(applied["cpu"]["cpus"][-1])
    sim.write_text(json.dumps(back))
    run_hwtune("--sim", sim, "rollback", check=True)
    assert status_json(sim)["cpu"] == original["cpu"] and not journal.exists()


def test_a_cpu_brought_online_since_the_apply_does_not_fail_the_rollback_of_the_others(tmp_path):
    sim, original, journal = _applied(tmp_path)
    more = json.loads(sim.read_text())
    more["cpu"]["cpus"].append(json.loads(json.dumps(more["cpu"]["cpus"][0])))  # cpu8, as the apply left cpu0
    sim.write_text(json.dumps(more))
    r = run_hwtune("--sim", sim, "rollback")
    assert r.returncode == 0 and not journal.exists(), r.stderr
    cpus = json.loads(sim.read_text())["cpu"]["cpus"]
    assert [c["governor"] for c in cpus] == ["powersave"] * 8 + ["performance"]  # cpu8 had no original
