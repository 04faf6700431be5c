"""kernelsearch.ray_executor on a real local Ray cluster (127.0.0.1, 2 CPUs, no dashboard).

One cluster for the whole module, started by a separate process through the executor's own
`start_local_cluster` (the way an existing cluster looks to `--ray-address`) and shut down by
that process at the end. Token authentication on, with a token made here.
"""
import importlib.util
import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, run_hwtune
from test_pool import InProcess, _winners, job, recorded_verdict

if importlib.util.find_spec("ray") is None:  # find, not import: ray must be imported after our setup
    pytest.skip("ray is not installed (pip install 'ray[default]'): Ray executor not tested",
                allow_module_level=True)

TESTS = Path(__file__).resolve().parent
RUNNER = "test_pool:scripted_evaluate"
HOLDER = """
import sys
from kernelsearch.ray_executor import start_local_cluster
print(start_local_cluster(num_cpus=2), flush=True)
sys.stdin.read()            # until the test module closes our stdin
import ray
ray.shutdown()              # stops every process of the cluster this process started
"""


@pytest.fixture(scope="module")
def cluster():
    saved = {k: os.environ.get(k) for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN")}
    os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(16))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    holder = subprocess.Popen([sys.executable, "-c", HOLDER], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                              cwd=ROOT, env=env)
    try:
        address = holder.stdout.readline().strip()
        assert address.startswith("127.0.0.1:"), f"cluster did not start: {address!r}"
        yield address
    finally:
        holder.stdin.close()
        try:
            holder.wait(timeout=60)
        except subprocess.TimeoutExpired:
            holder.kill()
            holder.wait()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="module")
def executor(cluster):
    from kernelsearch.ray_executor import RayExecutor

    ex = RayExecutor(address=cluster, device="cpu", runner=RUNNER, env={"PYTHONPATH": str(TESTS)})
    yield ex
    ex.close()


@pytest.fixture
def scripted(executor):
    executor.runner, executor.job_timeout_s = RUNNER, None
    yield executor
    executor.runner, executor.job_timeout_s = RUNNER, None


def test_tasks_use_the_cluster_cpus_with_multicast_off(scripted):
    assert scripted.width == 2
    whoami, plain = scripted.map([job(do="whoami"), job(BLOCK=3)])
    seen = json.loads(whoami["reason"])
    assert (seen["nvls"], seen["symm"], seen["nvshmem"]) == ("0", "1", "1")
    assert plain == recorded_verdict(job(BLOCK=3))


def test_task_whose_worker_dies_is_retried_once_then_a_crash_verdict(scripted, tmp_path):
    marker = tmp_path / "crashed"
    once, always = scripted.map([job(do="crash_once", marker=str(marker)), job(do="crash")])
    assert marker.exists() and once["accepted"], once
    assert not always["accepted"] and always["guard"] == "crash"


def test_hung_task_is_cancelled_as_a_timeout_verdict(scripted):
    scripted.job_timeout_s = 8
    hung, fine = scripted.map([job(do="sleep"), job(BLOCK=5)])
    assert hung["guard"] == "timeout" and "cancelled" in hung["reason"]
    assert fine == recorded_verdict(job(BLOCK=5))


def test_exception_in_a_task_is_a_harness_verdict(scripted):
    [bad] = scripted.map([job(do="raise")])
    assert bad["guard"] == "harness" and "harness bug on purpose" in bad["reason"]


def test_ray_search_writes_the_same_ledger_rows_and_winners_as_local(scripted, tmp_path):
    from kernelsearch.ledger import Ledger
    from kernelsearch.search import search

    rows, tables = {}, {}
    for name, ex in (("local", InProcess()), ("ray", scripted)):
        state = tmp_path / name
        result = search("rmsnorm", state_dir=state, strategy="random", budget=6, device="cpu",
                        seed=3, executor=ex, ceilings={})
        with Ledger(state / "ledger.sqlite") as ledger:
            rows[name] = sorted((json.dumps(r["params"], sort_keys=True), json.dumps(r["shape"]),
                                 r["accepted"], r["candidate_ms"]) for r in ledger.attempts())
        tables[name] = _winners(result.table_path)
    assert rows["ray"] == rows["local"] and rows["ray"]
    assert tables["ray"] == tables["local"]


def test_hwtune_search_on_an_existing_cluster_runs_the_real_harness(cluster, tmp_path):
    # The candidate's source travels to the task as text (a path here means nothing on a node).
    proc = run_hwtune("--state-dir", tmp_path / "state", "search", "rmsnorm", "--device", "cpu",
                      "--executor", "ray", "--ray-address", cluster, "--budget", "2",
                      "--shape", "M=3,N=40", "--json", timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["evaluations"] == 2
    [shape] = result["shapes"]
    assert shape["attempts"] == 2 and sum(shape["verdicts"].values()) == 2
    assert shape["verdicts"].get("accepted", 0) >= 1, shape  # the built-in template passes the verifier
