"""What the README promises a newcomer (issue 11), and that the behaviour it documents is real."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

from conftest import ROOT, run_hwtune
from fixtures.simhost import make_sim

README = (ROOT / "README.md").read_text()


def test_readme_keeps_exactly_two_commands_and_says_what_the_tests_need():
    section = README.split("## Two commands", 1)[1].split("\n## ", 1)[0]
    commands = [ln for ln in section.splitlines() if ln.startswith("    ")]
    assert len(commands) == 2 and "hwtune demo" in commands[0] and "pytest" in commands[1]
    assert re.search(r"tests take about \d+ minutes", section)
    assert "../shared" in section and "HWTUNE_SHARED" in section
    assert "hwtune-demo/" in section and "ignored by git" in section


def test_readme_documents_exit_130_and_where_sim_keeps_its_state():
    assert re.search(r"130 interrupted", README)
    assert "HOST.json.state/" in README
    assert "Global options go before the command" in README


def test_an_interrupted_command_exits_130_with_one_line_and_no_traceback(tmp_path):
    sim = make_sim(tmp_path, write_delay_ms=50)
    before = run_hwtune("--sim", sim, "status", "--json", check=True).stdout
    cmd = [sys.executable, "-m", "daemon.cli", "--sim", str(sim), "tune", "--no-kernels"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("HWTUNE_READ_ONLY", None)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if "[  3]" in line:  # mid-search, a point applied
            proc.send_signal(signal.SIGINT)
            break
    _, err = proc.communicate(timeout=120)
    err = "".join(seen) + err
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("hwtune tune: interrupted")
    # and the cycle put the host back where it started
    from daemon.commands.demo import _same_settings

    after = run_hwtune("--sim", sim, "status", "--json", check=True).stdout
    assert _same_settings(json.loads(before), json.loads(after)) is True


def test_every_environment_variable_that_stands_for_a_global_option_is_in_help_and_readme():
    # Before: HWTUNE_SIM, HWTUNE_PROFILE_DIR and HWTUNE_SYSFS_ROOT changed what hwtune works on
    # without a word in --help or the README (and --help named a fixed profile directory).
    text = run_hwtune("--help", check=True).stdout
    help_text = " ".join(text.split())
    for var in ("HWTUNE_SIM", "HWTUNE_PROFILE_DIR", "HWTUNE_SYSFS_ROOT", "HWTUNE_READ_ONLY"):
        assert var in help_text and var in README, var
    shown = " ".join(run_hwtune("--help", env={"HWTUNE_PROFILE_DIR": "/srv/profiles"}, check=True).stdout.split())
    assert "(default /srv/profiles)" in shown and "/etc/hwtune/profiles" not in shown


def test_help_states_the_defaults_of_seed_shapes_prefill_and_out():
    # Before: a default of 0 went unsaid (0 == False to the formatter's check), and bench's
    # --shapes, --prefill and --out said nothing of what they are when not given.
    search = " ".join(run_hwtune("search", "--help", check=True).stdout.split())
    bench = " ".join(run_hwtune("bench", "--help", check=True).stdout.split())
    assert "seed of random, optuna and evolution (default 0)" in search
    assert "seed of the model weights and tokens (default 0)" in bench
    assert "(default 1x2048,8x2048,32x2048,1x8192 on CUDA, 1x32,2x32 on CPU)" in bench
    assert "(default 1x2048 on CUDA, 1x32 on CPU)" in bench
    assert "(default: with --baseline STATE_DIR/bench/<date-time>, else no files" in bench


def test_benchmarks_header_names_every_gpu_model_its_sections_ran_on():
    # Before: "Device for all GPU runs: NVIDIA H200", above sections measured on lent H100s.
    text = (ROOT / "BENCHMARKS.md").read_text()
    header = text.split("\n## ", 1)[0]
    for model in ("H200", "H100"):
        if re.search(rf"^#+ .*{model}", text, re.M):
            assert model in header, model
    assert "all GPU runs" not in header
