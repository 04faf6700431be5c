"""SIGKILL `hwtune apply` at many random points; `hwtune rollback` must always bring
`hwtune status --json` back to exactly the original."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

from conftest import ROOT, run_hwtune
from fixtures.simhost import make_sim, status_json
from hwtune.backends.sim import SimFile

KILLS = 30


def _start_apply(sim):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("HWTUNE_READ_ONLY", None)
    return subprocess.Popen([sys.executable, "-m", "daemon.cli", "--sim", str(sim), "apply", "-p", "throughput"],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _set_delay(sim, delay_ms):
    SimFile(sim).update(lambda data: data.__setitem__("write_delay_ms", delay_ms))


def test_sigkill_at_random_points_then_rollback_restores_status_exactly(tmp_path):
    sim = make_sim(tmp_path, gpus=2)
    journal = tmp_path / "host.json.state" / "journal.json"
    rng = random.Random(20240611)
    _set_delay(sim, 30)
    original = status_json(sim)

    # One undisturbed run tells how long an apply takes here (the kill window), not a check.
    t0 = time.monotonic()
    assert _start_apply(sim).wait(timeout=60) == 0
    window_s = (time.monotonic() - t0) * 1.1
    run_hwtune("--sim", sim, "rollback", check=True)
    assert status_json(sim) == original

    interrupted = 0
    refused_checked = False
    for n in range(KILLS):
        _set_delay(sim, rng.choice([20, 25, 30, 35, 40]))
        proc = _start_apply(sim)
        time.sleep(rng.uniform(0.0, window_s))
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        pending = journal.exists() and json.loads(journal.read_text())["status"] == "in_progress"
        if pending:
            interrupted += 1
            if not refused_checked:  # the next apply finds the journal and refuses
                again = run_hwtune("--sim", sim, "apply", "-p", "throughput")
                assert again.returncode == 3 and "hwtune rollback" in again.stderr, again.stderr
                refused_checked = True
        rb = run_hwtune("--sim", sim, "rollback")
        assert rb.returncode == 0, f"kill {n}: rollback failed\n{rb.stderr}"
        # status carries the sim's write_delay_ms nowhere, so it must match exactly
        assert status_json(sim) == original, f"kill {n}: status differs after rollback"
        assert not journal.exists()
    assert interrupted >= 3, f"only {interrupted} of {KILLS} kills landed inside an apply"
