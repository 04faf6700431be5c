"""kernelsearch.pool: one worker process per GPU (CPU slots here), JSON over pipes.

The workers are real child processes. Most tests give them `scripted_evaluate` below instead of
the harness: it answers from a recorded, deterministic table, or crashes, hangs or raises on
purpose. One test runs the real harness (Triton interpreter) through `hwtune search`.
"""
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import run_hwtune

TESTS = Path(__file__).resolve().parent
RUNNER = "test_pool:scripted_evaluate"
WORKER_ENV = {"PYTHONPATH": str(TESTS)}


# --- the scripted runner (imported by the workers) --------------------------------------------
def recorded_time_ms(params: dict, shape: dict) -> float:
    """A deterministic 'measurement': the same point and shape always give the same time."""
    text = json.dumps([params, {k: v for k, v in shape.items() if k != "dtype"}], sort_keys=True)
    return 0.5 + int(hashlib.sha256(text.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF


def recorded_verdict(job: dict) -> dict:
    params = dict(job.get("params") or {})
    # a recorded failure: some points are rejected, as most tries are in a real search
    if "do" not in params and int(hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:4], 16) % 5 == 0:
        return {"accepted": False, "guard": "correctness", "reason": "recorded rejection",
                "kernel": job["kernel"], "params": params, "shapes": []}
    shapes = []
    for shape in job.get("shapes") or [{"M": 1, "N": 1}]:
        shapes.append({"shape": shape, "dtype": job.get("dtype") or shape.get("dtype") or "float32",
                       "status": "ok", "candidate_ms": recorded_time_ms(params, shape),
                       "stock_ms": 1.0, "noise_band": 0.01})
    return {"accepted": True, "guard": None, "reason": "", "kernel": job["kernel"],
            "source_path": job.get("source_path", ""), "device": job.get("device", "cpu"),
            "params": params, "shapes": shapes}


def scripted_evaluate(**job):
    action = (job.get("params") or {}).get("do")
    if action == "whoami":
        verdict = recorded_verdict(job)
        verdict["reason"] = json.dumps({"pid": os.getpid(),
                                        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
                                        "nvls": os.environ.get("NCCL_NVLS_ENABLE"),
                                        "symm": os.environ.get("TORCH_SYMM_MEM_DISABLE_MULTICAST"),
                                        "nvshmem": os.environ.get("NVSHMEM_DISABLE_NVLS")})
        time.sleep(0.5)  # keep this worker busy so the next job goes to another one
        return verdict
    if action == "crash":
        os._exit(3)
    if action == "crash_once":
        marker = Path(job["params"]["marker"])
        if not marker.exists():
            marker.write_text("crashed once")
            os._exit(3)
    if action == "hang":
        # like the harness: a grandchild in its own session, which the pool must kill too
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                                 start_new_session=True)
        Path(job["params"]["pid_file"]).write_text(str(child.pid))
        time.sleep(600)
    if action == "sleep":  # a hang with nothing below it
        time.sleep(600)
    if action == "raise":
        raise RuntimeError("harness bug on purpose")
    return recorded_verdict(job)


# --- tests ------------------------------------------------------------------------------------
def job(**params) -> dict:
    return {"kernel": "rmsnorm", "source_path": "unused.py", "params": params, "device": "cpu",
            "shapes": [{"M": 4, "N": 64}], "dtype": None, "timeout_s": None, "time_it": True}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purpose
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture
def pool_factory(tmp_path):
    from kernelsearch.pool import Pool

    pools = []

    def make(**kw):
        kw.setdefault("device", "cpu")
        kw.setdefault("runner", RUNNER)
        kw.setdefault("env", WORKER_ENV)
        kw.setdefault("log_dir", tmp_path / "logs")
        pools.append(Pool(**kw))
        return pools[-1]

    yield make
    for p in pools:
        p.close()


def test_each_gpu_gets_its_own_worker_pinned_with_multicast_off(pool_factory, monkeypatch):
    # No GPU needed to prove the pinning: the workers only report what they were given.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    pool = pool_factory(device="cuda")
    assert pool.width == 2
    verdicts = pool.map([job(do="whoami", i=i) for i in range(4)])
    seen = [json.loads(v["reason"]) for v in verdicts]
    assert {s["cuda_visible_devices"] for s in seen} == {"3", "5"}
    assert len({s["pid"] for s in seen}) == 2  # long-lived: 4 jobs, 2 processes
    assert all((s["nvls"], s["symm"], s["nvshmem"]) == ("0", "1", "1") for s in seen)


def test_more_workers_than_gpus_is_refused(monkeypatch):
    from kernelsearch.pool import ExecutorError, Pool

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with pytest.raises(ExecutorError, match="1 GPU"):
        Pool(workers=2, device="cuda")


def test_hwtune_search_refuses_scale_out_options_that_do_not_fit_with_exit_2(tmp_path):
    got = run_hwtune("--state-dir", tmp_path, "search", "rmsnorm", "--device", "cpu", "--workers", "2")
    assert got.returncode == 2 and "--executor pool or ray" in got.stderr


def test_one_worker_runs_every_job_in_order(pool_factory):
    pool = pool_factory(workers=1)
    jobs = [job(BLOCK=b) for b in (1, 2, 4, 8, 16)]
    assert pool.map(jobs) == [recorded_verdict(j) for j in jobs]


def test_crashed_worker_is_restarted_and_the_job_retried_once(pool_factory, tmp_path):
    pool = pool_factory(workers=1)
    marker = tmp_path / "crashed"
    [verdict] = pool.map([job(do="crash_once", marker=str(marker))])
    assert marker.exists()
    assert verdict["accepted"], verdict
    assert pool.stats["crashes"] == 1 and pool.stats["retries"] == 1
    assert pool.restarts == 1


def test_worker_that_crashes_twice_gives_a_crash_verdict_and_the_pool_goes_on(pool_factory):
    pool = pool_factory(workers=2)
    crash, fine = pool.map([job(do="crash"), job(BLOCK=64)])
    assert not crash["accepted"] and crash["guard"] == "crash"
    assert "exited with code 3" in crash["reason"] and "retry" in crash["reason"]
    assert fine == recorded_verdict(job(BLOCK=64))
    # the slot that lost its worker starts a fresh one on next use
    assert pool.map([job(BLOCK=1), job(BLOCK=2)]) == [recorded_verdict(job(BLOCK=b)) for b in (1, 2)]


def test_hung_worker_becomes_a_timeout_verdict_and_everything_it_started_is_killed(pool_factory, tmp_path):
    pool = pool_factory(workers=1, job_timeout_s=3)
    pid_file = tmp_path / "grandchild.pid"
    hang, after = pool.map([job(do="hang", pid_file=str(pid_file)), job(BLOCK=8)])
    assert not hang["accepted"] and hang["guard"] == "timeout"
    assert "SIGKILL" in hang["reason"]
    assert after == recorded_verdict(job(BLOCK=8))  # restarted on next use
    assert pool.stats["timeouts"] == 1 and pool.stats["retries"] == 0
    grandchild = int(pid_file.read_text())
    for _ in range(100):  # reaping by init is asynchronous
        if not _alive(grandchild):
            break
        time.sleep(0.1)
    assert not _alive(grandchild)


def test_exception_in_the_evaluation_is_a_harness_verdict_and_the_worker_lives(pool_factory):
    pool = pool_factory(workers=1)
    bad, good = pool.map([job(do="raise"), job(BLOCK=2)])
    assert bad["guard"] == "harness" and "harness bug on purpose" in bad["reason"]
    assert good == recorded_verdict(job(BLOCK=2))
    assert pool.restarts == 0


class InProcess:
    """The local executor's behaviour with the scripted runner (no worker processes)."""
    width = 1

    def map(self, jobs):
        return [scripted_evaluate(**j) for j in jobs]


def _winners(table_path) -> dict:
    table = json.loads(Path(table_path).read_text())
    return {json.dumps(e["shape"], sort_keys=True): e["params"] for e in table["entries"]}


def test_pool_search_lands_in_one_ledger_with_the_same_winners_as_local(pool_factory, tmp_path):
    from kernelsearch.ledger import Ledger
    from kernelsearch.search import search

    results = {}
    for name, executor in (("local", InProcess()), ("pool", pool_factory(workers=2))):
        state = tmp_path / name
        results[name] = search("rmsnorm", state_dir=state, strategy="random", budget=10, device="cpu",
                               seed=7, executor=executor, ceilings={})
        with Ledger(state / "ledger.sqlite") as ledger:
            rows = ledger.attempts(kernel="rmsnorm")
        results[name + "_rows"] = sorted((json.dumps(r["params"], sort_keys=True), json.dumps(r["shape"]),
                                          r["accepted"], r["candidate_ms"]) for r in rows)
    local, pooled = results["local"], results["pool"]
    assert pooled.evaluations == local.evaluations > 0
    assert results["pool_rows"] == results["local_rows"]
    assert _winners(pooled.table_path) == _winners(local.table_path)
    assert _winners(pooled.table_path)  # the recorded table has real winners to compare


def test_hwtune_search_with_a_pool_runs_the_real_harness(tmp_path):
    proc = run_hwtune("--state-dir", tmp_path, "search", "rmsnorm", "--device", "cpu", "--executor", "pool",
                      "--workers", "2", "--strategy", "grid", "--budget", "2", "--shape", "M=3,N=40",
                      "--json", timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["evaluations"] == 2
    [shape] = result["shapes"]
    assert shape["attempts"] == 2
    assert sum(shape["verdicts"].values()) == 2
    assert shape["verdicts"].get("accepted", 0) >= 1, shape  # the built-in template passes the verifier


def test_a_ctrl_c_while_closing_still_kills_every_worker_and_removes_the_log_folder(monkeypatch):
    """Ctrl-C while close() waited for the first worker to exit skipped the other workers and
    left the pool's hwtune-pool-* folder (worker logs) in /tmp."""
    from kernelsearch.pool import Pool

    pool = Pool(device="cpu", workers=2, runner=RUNNER, env=WORKER_ENV)
    pool.map([job(BLOCK=b) for b in (1, 2, 4, 8)])
    pids = [s.proc.pid for s in pool.slots]
    first = pool.slots[0]

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(first, "stop", interrupted)
    with pytest.raises(KeyboardInterrupt):
        pool.close()
    assert not any(_alive(pid) for pid in pids)
    assert not pool.log_dir.exists()
