"""Profiles: shipped and user profiles, include inheritance, and every bad-input case
(exit 2, file/line/key named, nothing written)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from conftest import ROOT, run_hwtune
from fixtures.simhost import make_sim, write_profile
from hwtune import profiles
from hwtune.errors import ProfileError


def test_shipped_profiles_load_and_efficiency_inherits_throughput():
    tp = profiles.load("throughput")
    eff = profiles.load("efficiency")
    assert profiles.load("defaults").gpu.power_limit_w == "default"
    assert tp.gpu.power_limit_w == "max" and eff.gpu.power_limit_w == "80%"
    assert eff.pcie == tp.pcie and eff.cpu == tp.cpu  # inherited sections
    assert eff.gpu.persistence_mode is True  # merged key by key inside the section
    with pytest.raises(Exception):
        eff.gpu.power_limit_w = 1  # frozen


def test_from_dict_round_trips_to_dict():
    eff = profiles.load("efficiency")
    again = profiles.Profile.from_dict(eff.to_dict(), "<test>")
    assert (again.gpu, again.pcie, again.cpu) == (eff.gpu, eff.pcie, eff.cpu)
    p = profiles.Profile.from_dict({"gpu": {"power_limit_w": 500, "sm_clock_mhz": 1410}})
    assert p.gpu.sm_clock_mhz == (1410, 1410) and p.pcie is None


def test_from_dict_rejects_unknown_key_with_hint():
    with pytest.raises(ProfileError) as exc:
        profiles.Profile.from_dict({"gpu": {"powr_limit_w": 500}}, "<candidate>")
    assert "gpu.powr_limit_w" in str(exc.value) and "power_limit_w" in str(exc.value)


def test_user_profile_includes_shipped_one_and_later_include_wins(tmp_path):
    udir = tmp_path / "profiles"
    udir.mkdir()
    (udir / "low.yaml").write_text("gpu:\n  power_limit_w: 400\n")
    (udir / "mine.yaml").write_text("include: [throughput, low]\ngpu:\n  sm_clock_mhz: reset\n")
    p = profiles.load("mine", udir)
    assert p.gpu.power_limit_w == 400 and p.gpu.sm_clock_mhz == "reset"
    assert p.gpu.memory_clock_mhz == (3201, 3201) and p.cpu.governor == "performance"
    assert p.where("gpu.power_limit_w") == (str(udir / "low.yaml"), 2)


def test_user_profile_dir_is_used_by_the_cli(tmp_path):
    sim = make_sim(tmp_path)
    udir = tmp_path / "profiles"
    udir.mkdir()
    (udir / "capped.yaml").write_text("include: [throughput]\ngpu:\n  power_limit_w: 550\n")
    proc = run_hwtune("--sim", sim, "--profile-dir", udir, "plan", "-p", "capped", "--json", check=True)
    changes = json.loads(proc.stdout)["changes"]
    assert {"target": "gpu1", "knob": "power_limit_w", "old": 700, "new": 550, "family": "gpu_power"} in changes


BAD = {
    # name: (profile files {name: text}, line, key, words in the message)
    "malformed_yaml": ({"p": "gpu:\n  power_limit_w: 500\n   sm_clock_mhz: [1, 2\n"}, 3, None, ["malformed YAML"]),
    "unknown_key": ({"p": "gpu:\n  persistence_mode: true\n  power_limt_w: 500\n"}, 3, "gpu.power_limt_w",
                    ["unknown key", "did you mean 'power_limit_w'"]),
    "unknown_section": ({"p": "gpus:\n  power_limit_w: 500\n"}, 1, "gpus", ["did you mean 'gpu'"]),
    "wrong_type": ({"p": "gpu:\n  persistence_mode: maybe\n"}, 2, "gpu.persistence_mode", ["true or false"]),
    "bad_power_word": ({"p": "cpu:\n  governor: performance\ngpu:\n  power_limit_w: maxx\n"}, 4,
                       "gpu.power_limit_w", ["did you mean 'max'"]),
    "include_cycle": ({"p": "include: [q]\n", "q": "gpu:\n  persistence_mode: true\ninclude: [p]\n"}, 3,
                      "include", ["include cycle", "p.yaml -> q.yaml -> p.yaml"]),
    "missing_include": ({"p": "description: x\ninclude: [throughputt]\n"}, 2, "include",
                        ["not found", "did you mean 'throughput'"]),
    "power_outside_constraints": ({"p": "gpu:\n  select: all\n  power_limit_w: 900\n"}, 3, "gpu.power_limit_w",
                                  ["gpu0 power_limit_w=900", "outside 200..700"]),
    "percent_outside_constraints": ({"p": "gpu:\n  power_limit_w: 10%\n"}, 2, "gpu.power_limit_w", ["outside 200..700"]),
    # 10**400 W: float() of it was an OverflowError traceback at plan time (exit 1)
    "power_too_large": ({"p": "gpu:\n  power_limit_w: 1" + "0" * 400 + "\n"}, 2, "gpu.power_limit_w",
                        ["must be watts"]),
    "power_nan": ({"p": "gpu:\n  power_limit_w: .nan\n"}, 2, "gpu.power_limit_w", ["must be watts"]),
    "clock_not_supported": ({"p": "gpu:\n  sm_clock_mhz: [1410, 1981]\n"}, 2, "gpu.sm_clock_mhz",
                            ["1981 MHz", "not a supported clock", "nearest 1965, 1980"]),
    "memory_clock_not_supported": ({"p": "gpu:\n  memory_clock_mhz: [1000, 3201]\n"}, 2, "gpu.memory_clock_mhz",
                                   ["1000 MHz", "not a supported clock"]),
    "min_above_max": ({"p": "gpu:\n  sm_clock_mhz: [1980, 1410]\n"}, 2, "gpu.sm_clock_mhz", ["min 1980 > max 1410"]),
    "mrrs_not_power_of_two": ({"p": "pcie:\n  max_read_request_bytes: 1000\n"}, 2, "pcie.max_read_request_bytes",
                              ["power of two in 128..4096"]),
    "mrrs_too_large": ({"p": "pcie:\n  max_read_request_bytes: 8192\n"}, 2, "pcie.max_read_request_bytes",
                       ["power of two in 128..4096"]),
    "governor_not_offered": ({"p": "cpu:\n  governor: ondemand\n"}, 2, "cpu.governor",
                             ["not offered", "performance, powersave"]),
    "gpu_index_absent": ({"p": "gpu:\n  select: [0, 5]\n  persistence_mode: true\n"}, 2, "gpu.select",
                         ["gpu5: no such GPU"]),
    "pcie_bdf_absent": ({"p": "pcie:\n  select: ['0000:99:00.0']\n  relaxed_ordering: true\n"}, 2, "pcie.select",
                        ["no such PCI function"]),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_profile_exits_2_names_file_line_key_and_writes_nothing(tmp_path, case):
    files, line, key, words = BAD[case]
    sim = make_sim(tmp_path)
    before = sim.read_bytes()
    for name, text in files.items():
        path = write_profile(tmp_path, name, text)
    main = tmp_path / "p.yaml"
    proc = run_hwtune("--sim", sim, "apply", "-p", main)
    assert proc.returncode == 2, proc.stderr
    err = proc.stderr
    expected_file = tmp_path / ("q.yaml" if case == "include_cycle" else "p.yaml")
    assert f"{expected_file}:{line}" in err, err
    if key:
        assert f": {key}:" in err, err
    for w in words:
        assert w in err, err
    assert sim.read_bytes() == before
    assert not (tmp_path / "host.json.state" / "journal.json").exists()
    assert path.exists()


def test_unknown_profile_name_suggests_a_shipped_one(tmp_path):
    sim = make_sim(tmp_path)
    proc = run_hwtune("--sim", sim, "plan", "-p", "efficency")
    assert proc.returncode == 2 and "did you mean 'efficiency'" in proc.stderr


def test_a_profile_or_profile_dir_that_cannot_be_looked_at_is_one_line_not_a_traceback(tmp_path, monkeypatch,
                                                                                           capsys):
    # Before: Path.exists() raised (Permission denied for a user under a 0700 directory such as
    # a root-only /etc/hwtune/profiles, File name too long for a long HWTUNE_PROFILE_DIR): an
    # OSError traceback, exit 1. In process: root enters any directory, so the stat's answer
    # is what a user would get.
    from daemon.cli import main

    sim = make_sim(tmp_path)
    real_exists = profiles.Path.exists

    def exists(self):
        if str(self).startswith("/root/hwtune-private"):
            raise PermissionError(13, "Permission denied", str(self))
        return real_exists(self)

    monkeypatch.setattr(profiles.Path, "exists", exists)
    assert main(["--sim", str(sim), "--profile-dir", "/root/hwtune-private/profiles", "plan"]) == 0  # shipped one
    assert main(["--sim", str(sim), "--profile-dir", "a" * 5000, "plan"]) == 0
    capsys.readouterr()
    assert main(["--sim", str(sim), "plan", "-p", "/root/hwtune-private/p.yaml", "--json"]) == 2
    got = capsys.readouterr()
    assert got.err.strip().splitlines()[-1].startswith("hwtune plan: /root/hwtune-private/p.yaml: cannot read")
    assert json.loads(got.out)["exit_code"] == 2


@pytest.mark.skipif(os.geteuid() != 0, reason="the rule holds for root")
@pytest.mark.parametrize("how", ["other-owner", "world-writable", "group-writable", "included"])
def test_root_refuses_a_profile_another_user_could_have_written(tmp_path, how):
    # Before: root applied any profile file, as the config file is not: one another user can
    # write chose root's writes and the BMC endpoint root sends bios.credentials_file's password to.
    sim = make_sim(tmp_path)
    before = sim.read_bytes()
    theirs = write_profile(tmp_path, "theirs", "gpu:\n  power_limit_w: 300\n")
    main = theirs
    if how == "other-owner":
        os.chown(theirs, 65534, 65534)
    elif how == "world-writable":
        theirs.chmod(0o666)
    elif how == "group-writable":
        theirs.chmod(0o664)
    else:
        os.chown(theirs, 65534, 65534)
        main = write_profile(tmp_path, "mine", "include: [theirs]\n")
    for command in ("plan", "apply", "verify"):
        proc = run_hwtune("--sim", sim, command, "-p", main)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert f"{theirs}: " in proc.stderr and ("owned by uid 65534" in proc.stderr or "lets other users write" in
                                                 proc.stderr), proc.stderr
    assert sim.read_bytes() == before
    theirs.chmod(0o644)
    os.chown(theirs, 0, 0)
    assert run_hwtune("--sim", sim, "plan", "-p", main).returncode == 0


def test_a_profile_file_here_without_yaml_suffix_is_pointed_to_as_a_path(tmp_path):
    sim = make_sim(tmp_path)
    (tmp_path / "myprofile").write_text("cpu:\n  governor: performance\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT))

    def plan(profile):   # run from the profile's directory, as a user who just wrote it
        return subprocess.run([sys.executable, "-m", "daemon.cli", "--sim", str(sim), "plan", "-p", profile],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)

    proc = plan("myprofile")
    assert proc.returncode == 2 and "profile 'myprofile' not found" in proc.stderr
    assert "the file myprofile here is read as a path only: -p ./myprofile" in proc.stderr
    assert plan("./myprofile").returncode == 0


def test_percent_power_limit_is_of_the_default_limit(tmp_path):
    sim = make_sim(tmp_path)
    prof = write_profile(tmp_path, "pct", textwrap.dedent("""\
        gpu:
          power_limit_w: "80%"
        """))
    proc = run_hwtune("--sim", sim, "plan", "-p", prof, "--json", check=True)
    assert {c["new"] for c in json.loads(proc.stdout)["changes"]} == {560}


def test_a_profile_path_that_does_not_exist_says_no_such_file(tmp_path):
    # Before: '-p /missing.yaml' said "profile '/missing.yaml' not found (looked in
    # /etc/hwtune/profiles and the shipped profiles ...)": a path is never looked up there.
    sim = make_sim(tmp_path)
    for path, hint in ((tmp_path / "missing.yaml", None), ("./nosuch/x", None),
                       ("throughput.yaml", "-p throughput names the profile 'throughput'")):
        proc = run_hwtune("--sim", sim, "plan", "-p", path)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert f"{path}: no such file" in proc.stderr and "looked in" not in proc.stderr, proc.stderr
        assert hint is None or hint in proc.stderr
    proc = run_hwtune("--sim", sim, "plan", "-p", "nosuch")   # a name is still looked up
    assert proc.returncode == 2 and "profile 'nosuch' not found (looked in" in proc.stderr
