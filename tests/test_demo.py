"""The README's main job, end to end on the simulated host: every step runs and the host is
restored; the output streams while it runs; the report explains itself (issue 11)."""
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """One demo run, its stderr lines with the second each arrived, and its summary."""
    out = tmp_path_factory.mktemp("demo") / "demo"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("HWTUNE_READ_ONLY", None)
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "daemon.cli", "demo", "--simulated", "--out", str(out), "--json"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stdout: list[str] = []
    reader = threading.Thread(target=lambda: stdout.append(proc.stdout.read()), daemon=True)
    reader.start()  # the summary on stdout is larger than a pipe holds
    lines = [(time.monotonic() - started, line) for line in proc.stderr]
    rc = proc.wait(timeout=900)
    reader.join()
    stdout = "".join(stdout)
    return {"out": out, "rc": rc, "stdout": stdout, "lines": lines, "seconds": time.monotonic() - started}


def test_demo_runs_the_whole_cycle_on_the_simulated_host_and_restores_it(demo):
    stderr = "".join(line for _, line in demo["lines"])
    assert demo["rc"] == 0, stderr[-4000:]
    assert "Traceback" not in stderr
    summary = json.loads(demo["stdout"])
    assert summary["simulated"] is True
    assert "SIMULATED" in summary["label"]
    names = [s["name"] for s in summary["steps"]]
    for step in ("plan", "apply", "verify", "tune", "bench", "rollback", "status-after"):
        assert step in names
    assert all(s["ok"] for s in summary["steps"]), summary["steps"]
    assert summary["restored"] is True
    tune = next(s for s in summary["steps"] if s["name"] == "tune")["result"]
    assert tune["source"] == "simulated"
    assert tune["summary"]["evaluations"] <= 12
    report = (demo["out"] / "report.md").read_text()
    assert "SIMULATED" in report and "restored to the starting point: **True**" in report


def test_demo_streams_each_steps_output_while_it_runs(demo):
    """Bench takes most of a minute: its progress lines must arrive while it runs, not all at
    its end; the tune table arrives whole, header included."""
    lines = demo["lines"]
    bench_start = next(t for t, line in lines if line.startswith("$ hwtune") and " bench " in line)
    bench_lines = [t for t, line in lines if line.lstrip().startswith("[bench ")]
    bench_end = next(t for t, line in lines if t > bench_start and line.strip().startswith("-> exit"))
    assert len(bench_lines) >= 4
    assert bench_end - bench_start > 10, "bench ran too fast to tell streaming from buffering"
    assert bench_lines[0] - bench_start < 0.5 * (bench_end - bench_start), (bench_start, bench_lines, bench_end)
    text = "".join(line for _, line in lines)
    assert re.search(r"hwtune tune \(simulated, objective energy, floor 98% of stock tokens/s", text)
    assert re.search(r"#\s+point\s+tokens/s\s+tokens/J\s+power W\s+status", text)
    assert "rmsnorm: " in text  # the inner kernel search's own progress, streamed through tune


def test_demo_report_says_what_tuning_gained_and_cost_and_links_its_files(demo):
    out = demo["out"]
    report = (out / "report.md").read_text()
    summary = json.loads((out / "summary.json").read_text())
    tune = next(s for s in summary["steps"] if s["name"] == "tune")["result"]
    sm = tune["summary"]
    m = re.search(r"Simulated tuning gained (\d+\.\d\d)\u00d7 tokens per joule at (\d+\.\d)% of stock "
                  r"throughput, drawing (\d+) W instead of (\d+) W per GPU, found in (\d+) of (\d+) points", report)
    assert m, report[:2000]
    assert float(m[1]) == pytest.approx(sm["tokens_per_j_vs_stock"], abs=0.006)
    assert float(m[2]) == pytest.approx(100 * sm["tokens_per_s_vs_stock"], abs=0.06)
    assert float(m[1]) > 1.0 and float(m[2]) >= 98.0  # a gain, within the 98% floor
    assert int(m[5]) == sm["evaluations"] and int(m[6]) == tune["space"]["size"]
    assert summary["headline"] in report

    # every link in the report points at a file the run wrote
    links = re.findall(r"\]\(([^)]+)\)", report)
    for link in links:
        assert (out / link).exists(), link
    assert "bench/report.png" in links
    assert (out / "bench" / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    logs = [link for link in links if link.startswith("logs/") and link.endswith(".log")]
    assert len(logs) == len(summary["steps"])
    assert (out / logs[0]).read_text().startswith("$ hwtune ")
    kept = next(link for link in links if link.endswith("tuned-profile.yaml"))
    text = (out / kept).read_text()
    with pytest.raises(ValueError):
        json.loads(text)  # YAML, not JSON in a .yaml file
    import yaml

    profile = yaml.safe_load(text)
    assert profile["gpu"]["power_limit_w"] == tune["kept"]["power_limit_w"]


def test_demo_report_labels_cpu_figures_as_interpreter_timings_not_speeds(demo):
    report = (demo["out"] / "report.md").read_text()
    assert "every hardware figure" not in report  # not above a real CPU run
    assert "the benchmark ran for real on this CPU" in report
    # the bench searched the tiny model's decode shapes first; under the interpreter the search
    # keeps stock, so the tuned rows run stock kernels and are labelled as CPU timings, not as
    # interpreter timings of kernels that did not run
    doc = json.loads((demo["out"] / "bench" / "results.json").read_text())
    tuned = [r for r in doc["decode"] if r["variant"] == "tuned"]
    assert tuned and all(r["status"] == "ok" for r in tuned)
    assert doc["kernel_table"]["search"] and all(not d.get("kept") for d in doc["kernel_table"]["search"])
    assert all(impl.startswith("stock") for r in tuned for impl in r["kernels"].values())
    rows = [ln for ln in report.splitlines() if ln.startswith("| tuned |")]
    assert rows and all("CPU timing of the tiny model (pipeline check)" in ln for ln in rows)
    assert "the search kept stock" in report and "not speeds" in report
    bench = (demo["out"] / "bench" / "report.md").read_text()
    assert "interpreter timing" not in bench and "## Kernels the tuned variant used" in bench


def test_demo_writes_into_a_folder_the_repository_ignores():
    if subprocess.run(["git", "-C", str(ROOT), "rev-parse"], capture_output=True).returncode != 0:
        pytest.skip("not a git checkout")
    for path in ("hwtune-demo/report.md", "hwtune-demo/state/tuned-profile.yaml"):
        assert subprocess.run(["git", "-C", str(ROOT), "check-ignore", "-q", path]).returncode == 0, path


def test_bench_chart_axes_start_at_zero_or_say_log_scale():
    from daemon.bench.report import figure

    def doc(values):
        return {"label": "cpu", "model": {"name": "tiny"},
                "decode": [{"variant": v, "batch": 1, "ctx": 32, "status": "ok", "tokens_per_s": t}
                           for v, t in values]}
    close = figure(doc([("eager", 1500.0), ("tuned", 1200.0)]), None)
    ax = close.axes[0]
    assert ax.get_yscale() == "linear" and ax.get_ylim()[0] == 0 and "log" not in ax.get_ylabel()
    spread = figure(doc([("eager", 6651.0), ("tuned", 4.0)]), None)
    ax = spread.axes[0]
    assert ax.get_yscale() == "log" and ax.get_ylabel() == "tokens/s (log scale)"


def test_demo_profile_that_does_not_exist_is_refused_before_any_step(tmp_path):
    # Before: plan, apply and verify failed, then the tune and the bench ran anyway (100 s), exit 1.
    from tests.conftest import run_hwtune

    proc = run_hwtune("demo", "--simulated", "--profile", "throughpt", "--out", tmp_path / "d")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "hwtune demo: throughpt: profile 'throughpt' not found (looked in /etc/hwtune/profiles and the shipped "
        "profiles: defaults, efficiency, throughput) (did you mean 'throughput'?)"]
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize("options", [("--profile-dir", "profs", "demo", "--profile", "mine"),
                                     ("demo", "--profile", "./profs/mine.yaml"),
                                     ("demo", "--profile", "mine.yaml")])
def test_demo_passes_relative_paths_and_the_profile_dir_on_to_its_steps(tmp_path, options):
    # Before: the steps run from the checkout got --sim host.json and ./profs/mine.yaml as given
    # (no such file there) and no --profile-dir: every step from status on failed.
    import signal

    from tests.conftest import run_hwtune

    run_hwtune("sim", "init", tmp_path / "host.json", check=True)
    (tmp_path / "profs").mkdir()
    (tmp_path / "profs" / "mine.yaml").write_text("include: [throughput]\n")
    (tmp_path / "mine.yaml").write_text("include: [throughput]\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("HWTUNE_READ_ONLY", None)
    proc = subprocess.Popen([sys.executable, "-m", "daemon.cli", "--sim", "host.json", *options, "--out", "d"],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if line.startswith("$ hwtune") and " tune " in line:   # status, plan, apply, verify, rollback done
            proc.send_signal(signal.SIGINT)
            break
    proc.communicate(timeout=120)
    exits = [line.split()[2] for line in seen if line.strip().startswith("-> exit")]
    assert exits == ["0"] * 5, "".join(seen)
