"""Bad input is one line on stderr and exit 2, before anything is touched (issue 11): each case
through the real CLI in a child process; the first line of the message asserted, never a
traceback, and where something could have been written, proof that nothing was."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, run_hwtune
from fixtures.simhost import make_sim


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def one_line(proc, prefix: str) -> str:
    """The whole of stderr is one line that starts with `prefix`; exit 2; no traceback."""
    text = proc.stdout + proc.stderr
    assert "Traceback" not in text, text
    assert proc.returncode == 2, (proc.returncode, text)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip() and not ln.startswith("simulated host ")]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(prefix), lines[0]
    return lines[0]


def _immutable_dir(tmp_path):
    d = tmp_path / "immutable"
    d.mkdir()
    if subprocess.run(["chattr", "+i", str(d)], capture_output=True).returncode != 0:
        return None
    return d


@pytest.fixture
def bad_state_dirs(tmp_path):
    """State directories that cannot be created: under /proc, under a regular file, inside an
    immutable directory (where chattr works)."""
    regular = tmp_path / "regular-file"
    regular.write_text("not a directory\n")
    dirs = [("/proc/hwtune-state", "No such file or directory"), (regular / "state", "Not a directory"),
            (regular, "exists and is not a directory")]
    imm = _immutable_dir(tmp_path)
    if imm is not None:
        dirs.append((imm / "state", "Operation not permitted"))
    yield dirs
    if imm is not None:
        subprocess.run(["chattr", "-i", str(imm)])


def test_a_state_dir_that_cannot_be_created_is_one_line_and_exit_2_before_any_write(tmp_path, bad_state_dirs):
    sim = make_sim(tmp_path)
    before = sim.read_bytes()
    commands = [("apply", "-p", "throughput"), ("tune", "--no-kernels"),
                ("search", "rmsnorm", "--device", "cpu", "--budget", "1"), ("daemon", "--once")]
    for state, reason in bad_state_dirs:
        for command in commands:
            proc = run_hwtune("--sim", sim, "--state-dir", state, *command, timeout=120)
            line = one_line(proc, f"hwtune {command[0]}: state directory {state} cannot be created or written: ")
            assert reason in line and "--state-dir" in line
        init = run_hwtune("--state-dir", state, "sim", "init", tmp_path / "other.json")
        one_line(init, f"hwtune sim: state directory {state} cannot be created or written: ")
        assert not (tmp_path / "other.json").exists()
    assert sim.read_bytes() == before  # not one setting written


def test_commands_that_only_read_state_refuse_a_state_dir_under_a_regular_file(tmp_path):
    sim = make_sim(tmp_path)
    regular = tmp_path / "regular-file"
    regular.write_text("x")
    for state in (regular, regular / "state"):
        for command in (("status",), ("plan", "-p", "throughput"), ("verify", "-p", "throughput"), ("rollback",),
                        ("share", "export")):
            proc = run_hwtune("--sim", sim, "--state-dir", state, *command, timeout=120)
            one_line(proc, f"hwtune {command[0]}: state directory {state}")
    # a state directory that does not exist yet holds nothing: reading it is fine
    assert run_hwtune("--sim", sim, "--state-dir", "/proc/hwtune-none", "status").returncode == 0


def test_sim_init_into_a_place_that_cannot_hold_the_file_is_one_line(tmp_path):
    regular = tmp_path / "f"
    regular.write_text("x")
    for target in ("/proc/hwtune-sim/host.json", regular / "host.json"):
        one_line(run_hwtune("sim", "init", target), "hwtune sim: directory ")


def test_bench_out_that_cannot_be_written_is_refused_before_measuring(tmp_path):
    regular = tmp_path / "f"
    regular.write_text("x")
    for out in ("/proc/hwtune-bench", regular / "bench"):
        proc = run_hwtune("bench", "--device", "cpu", "--out", out, timeout=120)
        one_line(proc, f"hwtune bench: --out {out} cannot be created or written: ")
        assert "decode" not in proc.stderr  # nothing was measured first


@pytest.mark.skipif(_has_cuda(), reason="this host has a GPU")
def test_device_cuda_without_a_gpu_is_an_environment_error_exit_2(tmp_path):
    honest = ROOT / "kernelsearch" / "kernels" / "rmsnorm.py"
    cases = [("bench", "--device", "cuda"), ("check-kernel", "rmsnorm", honest, "--device", "cuda"),
             ("search", "rmsnorm", "--device", "cuda"), ("share", "export", "--device", "cuda")]
    for args in cases:
        proc = run_hwtune("--state-dir", tmp_path / "state", *args, timeout=120)
        line = one_line(proc, f"hwtune {args[0]}: --device cuda: torch sees no CUDA GPU on this host")
        assert "REJECTED" not in line and "--device cpu" in line
    assert not (tmp_path / "state").exists()


@pytest.mark.parametrize("shape,why", [("M=2", "rmsnorm shapes have dims M, N (got M)"),
                                       ("Q=1", "rmsnorm shapes have dims M, N (got Q)"),
                                       ("M=0,N=8", "M must be a positive integer"),
                                       ("M=x", "shape 'M=x': expected")])
def test_search_shape_with_the_wrong_dims_is_a_usage_error(tmp_path, shape, why):
    proc = run_hwtune("--state-dir", tmp_path / "state", "search", "rmsnorm", "--device", "cpu", "--shape", shape)
    line = one_line(proc, "hwtune search: ")
    assert why in line
    assert not (tmp_path / "state").exists()


def test_tune_kernels_and_budget_are_checked_before_the_hardware_loop(tmp_path):
    sim = make_sim(tmp_path)
    before = sim.read_bytes()
    line = one_line(run_hwtune("--sim", sim, "tune", "--kernels", "rmsnrm"), "hwtune tune: --kernels rmsnrm: no such kernel")
    assert "did you mean rmsnorm?" in line
    one_line(run_hwtune("--sim", sim, "tune", "--budget", "0"), "hwtune tune: --budget 0: at least 1")
    one_line(run_hwtune("--sim", sim, "tune", "--kernel-budget", "0"), "hwtune tune: --kernel-budget '0'")
    one_line(run_hwtune("--sim", sim, "tune", "--floor", "1.5"), "hwtune tune: --floor 1.5")
    assert sim.read_bytes() == before
    assert not (tmp_path / "host.json.state" / "journal.json").exists()


@pytest.mark.parametrize("assignment,first", [
    ("gpus.0.telemetry.temperature_c=hot", 'hwtune sim: gpus.0.telemetry.temperature_c="hot": expected a number'),
    ("gpus.0.telemetry.temprature_c=90", "hwtune sim: gpus.0.telemetry.temprature_c: no key 'temprature_c'"),
    ("nosuchkey=1", "hwtune sim: nosuchkey: no key 'nosuchkey' in the top level"),
    ("gpus.0.persistence_mode=1", "hwtune sim: gpus.0.persistence_mode=1: expected true/false"),
    ("gpus.0.locked_sm_clocks_mhz=5", "hwtune sim: gpus.0.locked_sm_clocks_mhz=5: expected [min_mhz, max_mhz]"),
    ("gpus.7.power_limit_w=500", "hwtune sim: gpus.7.power_limit_w: gpus has no element '7'"),
])
def test_sim_set_refuses_an_unknown_key_or_a_wrong_type_and_writes_nothing(tmp_path, assignment, first):
    sim = make_sim(tmp_path)
    before = sim.read_bytes()
    # a valid assignment first: the refused one must take it down too (all or nothing)
    one_line(run_hwtune("sim", "set", sim, "write_delay_ms=5", assignment), first)
    assert sim.read_bytes() == before


@pytest.mark.parametrize("assignment,first", [
    ("gpus.0.power_limit_w=NaN", "hwtune sim: simulated host"),
    ("gpus.0.power_limit_w=Infinity", "hwtune sim: simulated host"),
    ("gpus.0.power_limit_w=-5", "hwtune sim: simulated host"),
    ("write_delay_ms=-1", "hwtune sim: simulated host"),
    ('faults=[{"op": "set_power_limit", "gpu": NaN}]', "hwtune sim: simulated host"),
])
def test_sim_set_refuses_a_value_no_command_could_read_back_and_writes_nothing(tmp_path, assignment, first):
    # NaN, Infinity (JSON only Python reads) and a negative limit or delay were written, exit 0;
    # every later command then refused the file (exit 2) until `sim init --force`.
    sim = make_sim(tmp_path)
    before = sim.read_bytes()
    one_line(run_hwtune("sim", "set", sim, assignment), first)
    assert sim.read_bytes() == before
    run_hwtune("--sim", sim, "status", check=True)


def test_sim_set_still_takes_values_of_the_right_type(tmp_path):
    sim = make_sim(tmp_path)
    run_hwtune("sim", "set", sim, "gpus.1.telemetry.temperature_c=95", "gpus.0.locked_sm_clocks_mhz=[1410, 1980]",
               "bios.PowerProfile=MaxPerf", "bios.VendorKnob=1", "write_delay_ms=2.5",
               'faults=[{"op": "set_power_limit", "gpu": 1, "error": "NoPermission"}]', check=True)
    data = json.loads(sim.read_text())
    assert data["gpus"][1]["telemetry"]["temperature_c"] == 95
    assert data["gpus"][0]["locked_sm_clocks_mhz"] == [1410, 1980]
    assert data["bios"]["PowerProfile"] == "MaxPerf" and data["bios"]["VendorKnob"] == "1"
    status = run_hwtune("--sim", sim, "status", check=True).stdout
    assert "95 C" in status


def test_share_export_of_an_unknown_kernel_is_a_usage_error(tmp_path):
    out = tmp_path / "bundle.json"
    line = one_line(run_hwtune("--state-dir", tmp_path, "share", "export", "--kernel", "rmsnrm", "-o", out),
                    "hwtune share: --kernel rmsnrm: no such kernel")
    assert "rmsnorm" in line and not out.exists()


def test_share_export_to_a_directory_or_under_a_missing_one_is_one_line(tmp_path):
    state = tmp_path / "state"
    run_hwtune("--state-dir", state, "search", "rmsnorm", "--device", "cpu", "--budget", "1",
               "--shape", "M=1,N=128", check=True, timeout=300)   # something to export
    for out, why in ((tmp_path, "Is a directory"), (tmp_path / "no" / "b.json", "No such file or directory")):
        line = one_line(run_hwtune("--state-dir", state, "share", "export", "-o", out),
                        f"hwtune share: --output {out}: ")
        assert line.endswith(why)


@pytest.mark.parametrize("argv,hint", [
    (("status", "--sim", "{sim}"), "hwtune status: --sim is a global option: global options go before the command: "
                                   "hwtune --sim {sim} status"),
    (("plan", "-p", "throughput", "--read-only"), "hwtune plan: --read-only is a global option"),
    (("status", "--state-dir={sim}.s"), "hwtune status: --state-dir={sim}.s is a global option"),
    (("--json", "status"), "hwtune status: --json is an option of status: it goes after the command"),
    (("search", "rmsnorm", "--device", "gpu"), "hwtune search: argument --device: invalid choice: 'gpu'"),
    # before: argparse took the option's value for the command ("invalid choice: 'throughput'")
    (("-p", "throughput", "plan"), "hwtune plan: -p is an option of plan: it goes after the command: "
                                   "hwtune plan -p throughput"),
    (("--sim", "{sim}", "--budget", "2", "tune"), "hwtune tune: --budget is an option of tune: it goes after the "
                                                  "command: hwtune --sim {sim} tune --budget 2"),
    # before: "unknown kernel 'cand.py'"
    (("check-kernel", "{sim}", "rmsnorm"), "hwtune check-kernel: the kernel goes first, then the file: "
                                          "hwtune check-kernel rmsnorm {sim}"),
])
def test_a_misplaced_or_bad_option_says_where_it_goes_in_one_line(tmp_path, argv, hint):
    sim = make_sim(tmp_path)
    argv = [str(a).replace("{sim}", str(sim)) for a in argv]
    one_line(run_hwtune(*argv), hint.replace("{sim}", str(sim)))


def test_version_prints_the_installed_version_and_exits_0():
    from daemon.cli import _version

    proc = run_hwtune("--version")
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert proc.stdout == f"hwtune {_version()}\n"


def test_help_as_a_command_shows_the_help_of_hwtune_or_of_the_command_named():
    # Before: 'hwtune help' was "invalid choice: 'help'", exit 2.
    top = run_hwtune("help")
    assert top.returncode == 0 and top.stdout == run_hwtune("--help").stdout
    plan = run_hwtune("help", "plan")
    assert plan.returncode == 0 and plan.stdout.startswith("usage: hwtune plan ")
    assert run_hwtune("help", "stauts").returncode == 2


def test_a_refusal_caused_by_an_exported_environment_variable_names_it(tmp_path):
    # Before: 'read-only mode: apply refused' and 'simulated host x.json: no such file' for a
    # command line with neither --read-only nor --sim on it.
    sim = make_sim(tmp_path)
    proc = run_hwtune("--sim", sim, "sim", "set", sim, "write_delay_ms=1", env={"HWTUNE_READ_ONLY": "1"})
    assert proc.returncode == 4 and proc.stderr.strip().endswith("(HWTUNE_READ_ONLY=1 is set)"), proc.stderr
    assert "HWTUNE_READ_ONLY" not in run_hwtune("--read-only", "sim", "set", sim, "write_delay_ms=1").stderr
    missing = tmp_path / "gone.json"
    line = one_line(run_hwtune("status", env={"HWTUNE_SIM": str(missing)}), "hwtune status: simulated host ")
    assert line.endswith(f"(HWTUNE_SIM={missing} is set)")
    assert "HWTUNE_SIM" not in run_hwtune("--sim", missing, "status").stderr


def test_python_m_hwtune_is_the_hwtune_command(tmp_path):
    # Before: "No module named hwtune.__main__; 'hwtune' is a package and cannot be directly executed".
    from daemon.cli import _version

    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "hwtune", "--version"], capture_output=True, text=True,
                          cwd=tmp_path, env=env, timeout=60)
    assert proc.returncode == 0 and proc.stdout == f"hwtune {_version()}\n", proc.stderr
    bad = subprocess.run([sys.executable, "-m", "hwtune", "stauts"], capture_output=True, text=True,
                         cwd=tmp_path, env=env, timeout=60)
    assert bad.returncode == 2 and bad.stderr.startswith("hwtune: argument COMMAND: invalid choice: 'stauts'"), bad.stderr


def test_status_into_a_closed_pipe_exits_quietly(tmp_path):
    sim = make_sim(tmp_path, gpus=8)
    for extra in ((), ("--json",)):
        r, w = os.pipe()
        os.close(r)  # the reader is gone before the first write, like `| head -0`
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        proc = subprocess.run([sys.executable, "-m", "daemon.cli", "--sim", str(sim), "status", *extra],
                              stdout=w, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env, timeout=60)
        os.close(w)
        assert proc.stderr == "" and proc.returncode == 0, proc.stderr
    shell = subprocess.run(["bash", "-c", f"set -o pipefail; {sys.executable} -m daemon.cli --sim {sim} "
                            "status | head -3"], capture_output=True, text=True, cwd=ROOT, env=env, timeout=60)
    assert shell.returncode == 0 and shell.stderr == "" and len(shell.stdout.splitlines()) == 3



@pytest.mark.parametrize("command", [("apply",), ("rollback",), ("tune", "--no-kernels"), ("daemon", "--once")])
def test_a_user_without_root_is_told_that_writing_the_real_host_needs_root(command, tmp_path, monkeypatch, capsys):
    # Before: apply skipped every knob as NoPermission and said "applied", exit 0. In process,
    # as a user other than root (root's interpreter here is not one `nobody` may run); the
    # real host is never opened, whatever the check does.
    import daemon.context
    from daemon.cli import main

    def no_real_host(self, bios=None):
        raise AssertionError("the real host was opened")

    monkeypatch.setattr(daemon.context.os, "geteuid", lambda: 65534)
    monkeypatch.setattr(daemon.context.Context, "open_host", no_real_host)
    monkeypatch.delenv("HWTUNE_READ_ONLY", raising=False)
    monkeypatch.delenv("HWTUNE_SIM", raising=False)
    monkeypatch.delenv("HWTUNE_SYSFS_ROOT", raising=False)
    monkeypatch.setattr(daemon.context, "DEFAULT_CONFIG", ROOT / "no-such-config.yaml")
    assert main(["--state-dir", str(tmp_path / "state"), *command]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"hwtune {command[0]}: writing the real host's settings needs root: run it with sudo"), err
    assert "\n" not in err and f"hwtune --sim host.json {command[0]}" in err
    assert not (tmp_path / "state").exists()
    # --read-only writes nothing: it is not refused for want of root
    if command[0] == "apply":
        with pytest.raises(AssertionError, match="the real host was opened"):
            main(["--read-only", "--state-dir", str(tmp_path / "state"), *command])
        assert "needs root" not in capsys.readouterr().err


def test_a_simulated_host_this_user_cannot_write_is_refused_before_any_write(tmp_path):
    # Before: apply journaled its first change, failed on the lock (Permission denied) and
    # restored; tune left that journal behind (exit 3 at every later point); sim set was a
    # PermissionError traceback. Root passes permission bits, so the directory is immutable.
    d = tmp_path / "theirs"
    d.mkdir()
    sim = make_sim(d)
    run_hwtune("--sim", sim, "status", check=True)   # the lock file exists, as after any use
    before = sim.read_bytes()
    if subprocess.run(["chattr", "+i", str(d)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i does not work here")
    try:
        state = tmp_path / "state"
        for command in (("apply",), ("rollback",), ("tune", "--no-kernels"), ("daemon", "--once"),
                        ("sim", "set", sim, "write_delay_ms=3")):
            args = command if command[0] == "sim" else ("--sim", sim, "--state-dir", state, *command)
            line = one_line(run_hwtune(*args), f"hwtune {command[0]}: simulated host {sim}: {d} is not writable")
            assert "hwtune sim init FILE" in line
        assert sim.read_bytes() == before and not (state / "journal.json").exists()
        assert run_hwtune("--read-only", "--sim", sim, "--state-dir", state, "apply").returncode == 4
    finally:
        subprocess.run(["chattr", "-i", str(d)])


@pytest.mark.parametrize("kind", ["dangling link", "link to a file", "directory", "fifo"])
def test_a_simulated_hosts_lock_that_is_no_plain_file_is_refused_and_never_followed(tmp_path, kind):
    # Before: FILE.lock was opened with open('a+'), following links: root running apply on a
    # host file in someone else's directory created the link's target (any path) and applied;
    # a directory or a FIFO there journaled the first change, then failed on the lock.
    sim = make_sim(tmp_path)
    lock = tmp_path / "host.json.lock"
    lock.unlink(missing_ok=True)
    victim = tmp_path / "victim"
    if kind == "dangling link":
        lock.symlink_to(victim)
    elif kind == "link to a file":
        victim.write_text("keep\n")
        lock.symlink_to(victim)
    elif kind == "directory":
        lock.mkdir()
    else:
        os.mkfifo(lock)
    before = sim.read_bytes()
    state = tmp_path / "state"
    for command in (("apply",), ("rollback",), ("sim", "set", sim, "write_delay_ms=3")):
        args = command if command[0] == "sim" else ("--sim", sim, "--state-dir", state, *command)
        one_line(run_hwtune(*args), f"hwtune {command[0]}: simulated host {sim}: {lock}")
    assert sim.read_bytes() == before and not (state / "journal.json").exists()
    assert (not victim.exists()) if kind == "dangling link" else True
    if kind == "link to a file":
        assert victim.read_text() == "keep\n"


def test_a_kernel_command_without_the_kernels_extra_says_what_to_install(tmp_path):
    # Before: a ModuleNotFoundError traceback (an install of hwtune without '[kernels]').
    shadow = tmp_path / "site" / "torch"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'torch'\", name='torch')\n")
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT), str(tmp_path / "site")])}
    for command in (("search", "rmsnorm", "--device", "cpu", "--json"), ("check-kernel", "rmsnorm", tmp_path / "k.py"),
                    ("bench", "--device", "cpu"), ("share", "export")):
        proc = run_hwtune("--state-dir", tmp_path / "state", *command, env=env)
        one_line(proc, f"hwtune {command[0]}: needs torch, which is not installed: pip install 'hwtune[kernels]'")
        if command[0] == "search":
            assert json.loads(proc.stdout)["exit_code"] == 2


def test_names_a_non_utf8_terminal_cannot_show_are_escaped_not_a_traceback(tmp_path):
    # Before: UnicodeEncodeError traceback from status and plan on PYTHONIOENCODING=ascii.
    d = tmp_path / "sp ü"
    d.mkdir()
    sim = d / "hé.json"
    run_hwtune("sim", "init", sim, check=True)
    prof = d / "é.yaml"
    prof.write_text("gpu:\n  power_limit_w: 500\n")
    env = {"PYTHONIOENCODING": "ascii"}
    status = run_hwtune("--sim", sim, "status", env=env)
    assert status.returncode == 0 and "Traceback" not in status.stderr, status.stderr
    assert status.stdout.startswith("host: simulated (") and "h\\xe9.json" in status.stdout.splitlines()[0]
    plan = run_hwtune("--sim", sim, "plan", "-p", prof, env=env)
    assert plan.returncode == 0 and "Traceback" not in plan.stderr, plan.stderr
    assert plan.stdout.startswith("profile \\xe9 (")


@pytest.mark.parametrize("argv,line", [
    (("stauts",), "hwtune: argument COMMAND: invalid choice: 'stauts' (choose from "),
    (("tune", "--budgt", "3"), "hwtune tune: unrecognized arguments: --budgt 3 (did you mean --budget?)"),
    (("search", "rmsnorm", "--strategy", "grdi"), "hwtune search: argument --strategy: invalid choice: 'grdi'"),
    (("status", "--jsn"), "hwtune status: unrecognized arguments: --jsn (did you mean --json?)"),
    # an option of share import / sim init (a subcommand's): no suggestion before
    (("share", "import", "--forse", "b.json"), "hwtune share: unrecognized arguments: --forse (did you mean --force?)"),
    (("sim", "init", "h.json", "--gpuss", "3"), "hwtune sim: unrecognized arguments: --gpuss 3 (did you mean --gpus?)"),
])
def test_a_typo_in_a_command_option_or_choice_names_the_one_meant(tmp_path, argv, line):
    # Before: the choices listed, or just 'unrecognized arguments', with no suggestion.
    sim = make_sim(tmp_path)
    got = one_line(run_hwtune("--sim", sim, *argv), line)
    meant = {"stauts": "status", "tune": "--budget", "search": "grid", "status": "--json", "share": "--force",
             "sim": "--gpus"}[argv[0]]
    assert f"did you mean {meant}?" in got
    assert "did you mean" not in run_hwtune("search", "rmsnorm", "--device", "gpu").stderr  # not 'cpu'


@pytest.mark.parametrize("argv,line", [
    (("search", "rmsnrm"), "hwtune search: unknown kernel 'rmsnrm'; did you mean rmsnorm?"),
    (("check-kernel", "decode_atention", "{cand}"), "hwtune check-kernel: unknown kernel 'decode_atention'; "
                                                    "did you mean decode_attention?"),
    (("share", "export", "--kernel", "sofmax"), "hwtune share: --kernel sofmax: no such kernel; did you mean softmax?"),
])
def test_a_mistyped_kernel_name_names_the_kernel_meant(tmp_path, argv, line):
    # Before: search and check-kernel listed all fourteen kernels, share export too, with no suggestion
    # (tune --kernels already gave one).
    cand = tmp_path / "cand.py"
    cand.write_text("def launch(x, weight, eps, out):\n    pass\n")
    argv = [str(a).replace("{cand}", str(cand)) for a in argv]
    got = one_line(run_hwtune("--state-dir", tmp_path / "state", *argv), line)
    assert "rmsnorm_linear" in got   # the kernels known are still listed


@pytest.mark.parametrize("command,why", [("", "--command is empty"), ('"unterminated', "No closing quotation"),
                                         ("/nonexistent-prog --x", "/nonexistent-prog: no such program"),
                                         ("{tmp}", "{tmp}: no such program, or not an executable file")])
def test_bench_command_that_cannot_run_is_one_line_exit_2_before_measuring(tmp_path, command, why):
    # Before: '' ran the built-in model instead; an open quote and a directory were tracebacks
    # (ValueError, PermissionError); a missing program was a result with metric None, exit 1.
    command, why = command.replace("{tmp}", str(tmp_path)), why.replace("{tmp}", str(tmp_path))
    proc = run_hwtune("--state-dir", tmp_path / "state", "bench", "--device", "cpu", "--command", command, "--json")
    assert why in one_line(proc, "hwtune bench: --command")
    assert json.loads(proc.stdout)["exit_code"] == 2


def test_a_state_dir_under_a_directory_this_user_cannot_enter_is_one_line(tmp_path, monkeypatch, capsys):
    # Before: a PermissionError traceback from Path.exists (--state-dir /root/x as a user).
    # In process: root enters any directory, so the refusal is what the stat answers.
    import daemon.context
    from daemon.cli import main

    sim = make_sim(tmp_path)
    real_exists = daemon.context.Path.exists

    def exists(self):
        if str(self).startswith("/root/hwtune-x"):
            raise PermissionError(13, "Permission denied", str(self))
        return real_exists(self)

    monkeypatch.setattr(daemon.context.Path, "exists", exists)
    for command in (("status",), ("plan",), ("verify",), ("rollback",)):
        assert main(["--sim", str(sim), "--state-dir", "/root/hwtune-x/state", *command, "--json"]) == 2
        got = capsys.readouterr()
        assert got.err.strip() == (f"hwtune {command[0]}: state directory /root/hwtune-x/state cannot be read: "
                                   "Permission denied; choose another with --state-dir DIR, before the command")
        assert json.loads(got.out)["exit_code"] == 2


def test_a_candidate_or_template_that_is_a_fifo_or_a_device_is_not_called_missing(tmp_path):
    # Before: 'fifo.py: no such file' for a file that is there.
    fifo = tmp_path / "fifo.py"
    os.mkfifo(fifo)
    for path in (fifo, "/dev/null"):
        one_line(run_hwtune("check-kernel", "rmsnorm", path), f"hwtune check-kernel: {path}: not a regular file")
        one_line(run_hwtune("--state-dir", tmp_path / "s", "search", "rmsnorm", "--source", path),
                 f"hwtune search: --source {path}: not a regular file")
    one_line(run_hwtune("check-kernel", "rmsnorm", tmp_path / "nope.py"), f"hwtune check-kernel: {tmp_path}/nope.py: no such file")


@pytest.mark.parametrize("argv", [("--state-dir", "", "status"), ("--sim", "", "status"), ("--config", "", "plan"),
                                  ("--profile-dir", "", "plan"), ("--sysfs-root", "", "status"),
                                  ("bench", "--out", ""), ("demo", "--out", ""), ("daemon", "--config", "")])
def test_an_empty_path_option_is_refused_not_taken_as_the_current_directory(tmp_path, argv):
    # Before: --state-dir '' (an unset "$STATE") put journal.json and the lock in the current
    # directory; demo --out '' and bench --out '' wrote the host file, state and report there.
    option = next(a for a in argv if a.startswith("--"))
    proc = subprocess.run([sys.executable, "-m", "daemon.cli", *argv], cwd=tmp_path, capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=120)
    prog = "hwtune" if argv[0].startswith("--") else f"hwtune {argv[0]}"
    one_line(proc, f"{prog}: argument {option}: an empty path (an unset shell variable?)")
    assert list(tmp_path.iterdir()) == []


def test_tune_with_its_kernel_step_and_no_torch_is_refused_before_the_hardware_loop(tmp_path):
    # Before: every hardware point was applied and measured, then the kernel step failed (exit 1).
    shadow = tmp_path / "site" / "torch"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'torch'\", name='torch')\n")
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT), str(tmp_path / "site")])}
    sim = make_sim(tmp_path)
    before = sim.read_bytes()
    line = one_line(run_hwtune("--sim", sim, "tune", "--budget", "2", env=env),
                    "hwtune tune: the kernel step needs torch, which is not installed")
    assert "--no-kernels" in line and sim.read_bytes() == before


def test_a_zero_agent_timeout_is_refused():
    for value in ("0", "-5", "nan"):
        one_line(run_hwtune("search", "rmsnorm", "--device", "cpu", "--agent-timeout-s", value),
                 f"hwtune search: --agent-timeout-s {value}: a positive number of seconds")


def test_an_empty_environment_variable_is_unset_not_the_current_directory(monkeypatch):
    # Before: HWTUNE_SYSFS_ROOT='' (an unset shell variable exported) read ./sys as the host's /sys.
    from daemon.cli import build_parser
    from daemon.context import DEFAULT_PROFILE_DIR, Context

    monkeypatch.setenv("HWTUNE_SYSFS_ROOT", "")
    monkeypatch.setenv("HWTUNE_PROFILE_DIR", "")
    ctx = Context.from_args(build_parser().parse_args(["status"]))
    assert str(ctx.sysfs_root) == "/" and str(ctx.profile_dir) == str(DEFAULT_PROFILE_DIR)


@pytest.mark.parametrize("value", [":", ":/var/lib/other", " "])
def test_a_state_directory_variable_with_an_empty_first_path_is_not_the_current_directory(monkeypatch, value):
    # Before: STATE_DIRECTORY=':...' gave Path('') (the first of its ':'-separated paths): the
    # journal and lock went wherever the command ran.
    from daemon.context import default_state_dir

    monkeypatch.setenv("STATE_DIRECTORY", value)
    monkeypatch.delenv("XDG_STATE_HOME", raising=False)
    got = default_state_dir(None)
    assert str(got) not in ("", ".", " ") and got.is_absolute(), got
