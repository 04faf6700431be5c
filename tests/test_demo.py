"""The README's main job, end to end on the simulated host: every step runs and the host is restored."""
import json

from tests.conftest import run_hwtune


def test_demo_runs_the_whole_cycle_on_the_simulated_host_and_restores_it(tmp_path):
    out = tmp_path / "demo"
    proc = run_hwtune("demo", "--simulated", "--out", out, "--json", timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads(proc.stdout)
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
    report = (out / "report.md").read_text()
    assert "SIMULATED" in report and "restored to the starting point: **True**" in report
