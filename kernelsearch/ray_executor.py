"""The same evaluations as Ray tasks: one GPU per task on a Ray cluster (or CPUs for tests).

    with RayExecutor(address="10.0.0.5:6379", device="cuda") as ex:   # an existing cluster
        search("rmsnorm", state_dir=..., executor=ex)
    RayExecutor(device="cpu")   # no address: starts a local cluster, shut down on close()

Same executor contract as `kernelsearch.pool` (`map(jobs) -> Verdict JSON` in order, `width`).
A task calls the same code as every other executor, `kernelsearch.harness.evaluate` (verifier
and timing unchanged), and returns the Verdict as JSON text; the job goes in as JSON text too,
so our data never crosses Ray as pickled objects (Ray serialises the task itself, its business).
Ray puts CUDA_VISIBLE_DEVICES on each task for its one GPU; the harness's candidate child
inherits it.

What travels to the cluster: the `kernelsearch` package (runtime_env py_modules, so every node
runs this verifier, whatever is installed there) and the candidate's source text (written to
a temporary file on the node; a path on this host means nothing on another). Nodes need torch
and triton. NVLink multicast is switched off in every task's environment and, for a local
cluster, in every process Ray starts.

Failures, as in the pool: a task whose worker process dies is retried once by Ray
(`max_retries=1`), then becomes a `crash` verdict; a task past its deadline is cancelled with
force (its worker killed) and becomes a `timeout` verdict, not retried; an exception escaping
the evaluation is a `harness` verdict.

`ray` is imported only inside this module, and only when an executor is made.
"""
from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

from kernelsearch.pool import (CRASH_RETRIES, DEFAULT_RUNNER, MULTICAST_OFF, ExecutorError,
                               failure_verdict, job_deadline_s, load_runner, to_verdict_json)

PACKAGE_DIR = Path(__file__).resolve().parent


def evaluate_task(runner_spec: str, job_text: str, source_text: str | None, source_name: str) -> str:
    """Body of one Ray task: JSON job in, Verdict JSON out."""
    job = json.loads(job_text)
    original = job.get("source_path", "")
    workdir = None
    if source_text is not None:
        workdir = tempfile.mkdtemp(prefix="hwtune-ray-")
        path = Path(workdir) / source_name
        path.write_text(source_text)
        job["source_path"] = str(path)
    if job.get("device") == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        verdict = to_verdict_json(load_runner(runner_spec)(**job))
    finally:
        if workdir:
            import shutil

            shutil.rmtree(workdir, ignore_errors=True)
    if source_text is not None:
        verdict["source_path"] = original  # report the candidate by its name on the searching host
    return json.dumps(verdict)


def task_env(device: str, extra: dict | None = None) -> dict:
    env = dict(MULTICAST_OFF)
    if device == "cpu":
        env["TRITON_INTERPRET"] = "1"
    env.update({k: str(v) for k, v in (extra or {}).items()})
    return env


def _local_only_environment() -> None:
    """Before `import ray`: a cluster this process starts stays on 127.0.0.1 and keeps NVLink
    multicast off in every process Ray starts. (Ray resolves 127.0.0.1 to the host's reachable
    address unless its 'single machine' switch is off; the switch is read when ray is imported.)"""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.update(MULTICAST_OFF)


def _init_local(num_cpus: int | None, num_gpus: int | None = None, runtime_env: dict | None = None):
    _local_only_environment()
    import ray

    return ray.init(num_cpus=num_cpus, num_gpus=num_gpus, include_dashboard=False,
                    _node_ip_address="127.0.0.1", namespace="hwtune", runtime_env=runtime_env,
                    log_to_driver=False, configure_logging=False)


def start_local_cluster(num_cpus: int | None = None, num_gpus: int | None = None) -> str:
    """Start a Ray cluster on 127.0.0.1 owned by this process; returns its GCS address, which
    other processes (a `hwtune search --ray-address`) can connect to while this one lives."""
    return _init_local(num_cpus, num_gpus).address_info["gcs_address"]


class RayExecutor:
    """Evaluations as Ray tasks. `address`: an existing cluster (e.g. 'head:6379', 'auto');
    None starts a local one (shut down again on close). `workers`: tasks in flight at once
    (default: the cluster's GPUs, or its CPUs / `cpus_per_task` on "cpu")."""

    def __init__(self, address: str | None = None, device: str = "cuda", workers: int | None = None,
                 runner: str = DEFAULT_RUNNER, job_timeout_s: float | None = None,
                 crash_retries: int = CRASH_RETRIES, env: dict | None = None, cpus_per_task: int = 1,
                 ship_code: bool = True, local_num_cpus: int | None = None):
        if not address or address.split(":")[0] in ("127.0.0.1", "localhost"):
            _local_only_environment()
        import ray

        self.device = "cpu" if device == "cpu" else "cuda"
        self.runner, self.job_timeout_s = runner, job_timeout_s
        self._owns_connection = False
        self._owns_cluster = False
        if not ray.is_initialized():
            runtime_env = {"env_vars": task_env(self.device, env)}
            if ship_code:
                runtime_env["py_modules"] = [str(PACKAGE_DIR)]
            if address:
                ray.init(address=address, namespace="hwtune", runtime_env=runtime_env,
                         log_to_driver=False, configure_logging=False)
            else:
                _init_local(local_num_cpus, runtime_env=runtime_env)
                self._owns_cluster = True
            self._owns_connection = True
        resources = ray.cluster_resources()
        if self.device == "cuda":
            gpus = int(resources.get("GPU", 0))
            if gpus < 1:
                self.close()
                raise ExecutorError(f"ray: --device cuda but the cluster at {address or 'local'} has no GPU "
                                   f"resources ({resources})")
            options = {"num_gpus": 1, "num_cpus": 1}
            capacity = gpus
        else:
            options = {"num_cpus": cpus_per_task}
            capacity = max(1, int(resources.get("CPU", 1)) // cpus_per_task)
        self.width = workers or capacity
        self.address = address or "local"
        # max_retries: Ray re-runs a task whose worker process died (our crash retry);
        # exceptions are not retried: they are verdicts.
        self._task = ray.remote(evaluate_task).options(max_retries=crash_retries, retry_exceptions=False,
                                                       **options)
        self._ray = ray
        self.stats = {"jobs": 0, "crashes": 0, "timeouts": 0, "harness_errors": 0}

    def describe(self) -> str:
        return f"ray executor on {self.address}: {self.width} {self.device} task(s) at once"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        """Disconnect (and stop the local cluster when this executor started it)."""
        import ray

        if self._owns_connection and ray.is_initialized():
            ray.shutdown()
        self._owns_connection = False

    def map(self, jobs: list[dict]) -> list[dict]:
        ray = self._ray
        self.stats["jobs"] += len(jobs)
        refs, deadlines = [], {}
        for job in jobs:
            path = Path(job.get("source_path", ""))
            source_text = path.read_text() if path.is_file() else None
            ref = self._task.remote(self.runner, json.dumps(job), source_text, path.name or "candidate.py")
            refs.append(ref)
            deadlines[ref] = time.monotonic() + (self.job_timeout_s or job_deadline_s(job))
        results: dict = {}
        waiting = list(refs)
        while waiting:
            timeout = max(0.0, min(deadlines[r] for r in waiting) - time.monotonic())
            done, waiting = ray.wait(waiting, num_returns=1, timeout=min(timeout, 5.0))
            for ref in done:
                results[ref] = self._collect(ref, jobs[refs.index(ref)])
            now = time.monotonic()
            for ref in [r for r in waiting if now >= deadlines[r]]:
                ray.cancel(ref, force=True)
                job = jobs[refs.index(ref)]
                limit = self.job_timeout_s or job_deadline_s(job)
                self.stats["timeouts"] += 1
                results[ref] = failure_verdict(job, "timeout", f"ray task gave no verdict within {limit:g} s; "
                                                               "cancelled with force (its worker killed)")
                waiting.remove(ref)
        return [results[r] for r in refs]

    def _collect(self, ref, job: dict) -> dict:
        ray = self._ray
        try:
            return json.loads(ray.get(ref))
        except ray.exceptions.TaskCancelledError:
            self.stats["timeouts"] += 1
            return failure_verdict(job, "timeout", "ray task was cancelled")
        except (ray.exceptions.WorkerCrashedError, ray.exceptions.NodeDiedError,
                ray.exceptions.LocalRayletDiedError) as exc:
            self.stats["crashes"] += 1
            return failure_verdict(job, "crash", f"ray worker died during the evaluation (retried once): "
                                                 f"{' '.join(str(exc).split())[:600]}")
        except ray.exceptions.RayTaskError as exc:
            self.stats["harness_errors"] += 1
            return failure_verdict(job, "harness", f"the evaluation raised in a ray task: "
                                                   f"{' '.join(str(exc).split())[-800:]}")
        except ray.exceptions.RayError as exc:
            self.stats["crashes"] += 1
            return failure_verdict(job, "crash", f"ray could not run the evaluation: "
                                                 f"{' '.join(str(exc).split())[:600]}")
