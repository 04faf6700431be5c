"""One evaluation worker process per GPU, fed from one queue; the parent keeps the one ledger.

    with Pool(device="cuda") as pool:             # one worker per visible GPU
        search("rmsnorm", state_dir=..., executor=pool)

The executor contract of `kernelsearch.search`: `map(jobs) -> verdicts` in job order, where a
job is a JSON-ready dict of `kernelsearch.harness.evaluate` keyword arguments; `width` is how
many jobs are worth sending at once (one per worker). Results come back to the parent, which
alone writes the ledger, so N workers never contend for the SQLite file.

Each worker is `python -m kernelsearch.pool WORKER RUNNER` in its own session, pinned with
CUDA_VISIBLE_DEVICES=<that GPU> (with `device="cpu"` the "GPUs" are N CPU slots and
CUDA_VISIBLE_DEVICES is empty) and with NVLink multicast off. It reads one JSON job per line on
stdin and answers one JSON line on stdout: `{"id", "verdict": Verdict JSON}` (no pickle). The
worker calls the harness, which already runs every candidate in its own child with a
per-request deadline; the pool's own deadline is the safety net around the worker itself.

Failure policy (Inductor's autotune_process, one level up):
- a worker that exits while it holds a job (segfault in the parent side of the harness, the
  OOM killer, a driver fault) is restarted and the job is retried ONCE on the fresh worker:
  the harness already isolates the candidate, so a worker death is more often collateral
  (memory pressure from a neighbour) than the candidate's doing. A second death makes the job
  a `crash` verdict. A death is cheap to retry; a hang is not:
- a worker that gives no answer within the job's deadline is killed with SIGKILL (with every
  process it started) and the job becomes a `timeout` verdict, never retried (a retry would
  double the worst case). The worker restarts on the next job that slot takes.
- an exception escaping the runner (a harness bug: `evaluate` never raises for a candidate)
  becomes a `harness` verdict; the worker lives on.
"""
from __future__ import annotations

import contextlib
import importlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections import deque
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_RUNNER = "kernelsearch.harness:evaluate"
# Keep NVLink multicast off in every process we start (a program using it can take a shared
# host's GPUs out of service); workers and the harness children they start inherit these.
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                 "NVSHMEM_DISABLE_NVLS": "1"}
# The harness's own limits (kernelsearch.harness.verify): per-request timeout and start-up.
HARNESS_REQUEST_S = 120.0
HARNESS_STARTUP_S = 300.0
CRASH_RETRIES = 1
EXECUTORS = ("local", "pool", "ray")


class ExecutorError(ValueError):
    """The executor asked for cannot be made here (no GPU, too many workers, no ray, ...)."""


def load_runner(spec: str):
    """'package.module:function' -> the function (explicit, no discovery)."""
    module_name, _, name = spec.partition(":")
    if not module_name or not name:
        raise ValueError(f"runner {spec!r}: expected 'module:function'")
    return getattr(importlib.import_module(module_name), name)


def job_deadline_s(job: dict) -> float:
    """Generous bound on one whole evaluation: the harness bounds each request, not the sweep.

    Per shape the harness makes two checks and one timing; plus one load (start-up) and slack
    per shape for the reference and stock timing done in the worker itself.
    """
    per_request = float(job.get("timeout_s") or HARNESS_REQUEST_S)
    n_shapes = max(1, len(job.get("shapes") or []) or 4)
    return HARNESS_STARTUP_S + per_request * 3 * n_shapes + 60.0 * n_shapes


def failure_verdict(job: dict, guard: str, reason: str) -> dict:
    """Verdict JSON for an evaluation that produced none (worker died, hung, raised)."""
    return {"accepted": False, "guard": guard, "reason": reason, "kernel": job.get("kernel", ""),
            "source_path": str(job.get("source_path", "")), "device": str(job.get("device", "cpu")),
            "params": dict(job.get("params") or {}), "shapes": []}


def to_verdict_json(result) -> dict:
    """A runner may return a Verdict or its JSON already."""
    if hasattr(result, "to_json"):
        return result.to_json()
    return dict(result)


def visible_gpus() -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES entries (honours an existing mask)."""
    mask = os.environ.get("CUDA_VISIBLE_DEVICES")
    if mask is not None:
        return [d.strip() for d in mask.split(",") if d.strip() and d.strip() != "-1"]
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        if out.returncode == 0:
            return [line.strip() for line in out.stdout.splitlines() if line.strip()]
    except (OSError, subprocess.TimeoutExpired):
        pass
    try:
        import torch

        return [str(i) for i in range(torch.cuda.device_count())]
    except Exception:
        return []


def _descendants(pid: int) -> list[int]:
    """Every live process below `pid`. The harness puts its candidate child in a session of its
    own, so killing the worker's process group alone would leave that child running."""
    try:
        import psutil
    except ImportError:  # a GPU image without psutil: read /proc directly
        return _descendants_from_proc(pid)
    try:
        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


def _descendants_from_proc(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()  # after "pid (comm) ": state, ppid, ...
        if len(fields) > 1:
            children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _kill_tree(proc: subprocess.Popen) -> None:
    below = _descendants(proc.pid) if proc.poll() is None else []
    for pid in [proc.pid, *below]:
        for kill in (os.killpg, os.kill):
            try:
                kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=30)


class _Slot:
    """One worker place: a GPU (or a CPU slot). The process is started on first use."""

    def __init__(self, index: int, gpu: str | None, pool: "Pool"):
        self.index, self.gpu, self.pool = index, gpu, pool
        self.proc: subprocess.Popen | None = None
        self.buffer = b""
        self.job = None            # (position, job, attempt) while busy
        self.deadline = 0.0
        self.starts = 0

    @property
    def name(self) -> str:
        return f"worker {self.index} ({'CUDA_VISIBLE_DEVICES=' + self.gpu if self.gpu is not None else 'cpu slot'})"

    @property
    def log_path(self) -> Path:
        return self.pool.log_dir / f"worker-{self.index}.log"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        env = dict(os.environ)
        env.update(MULTICAST_OFF)
        env.update(self.pool.env)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(REPO_ROOT), self.pool.env.get("PYTHONPATH"), os.environ.get("PYTHONPATH")) if p)
        if self.pool.device == "cpu":
            env["CUDA_VISIBLE_DEVICES"] = ""
            env["TRITON_INTERPRET"] = "1"
        else:
            env["CUDA_VISIBLE_DEVICES"] = self.gpu
            env.pop("TRITON_INTERPRET", None)
        with open(self.log_path, "ab") as log:
            log.write(f"--- start {self.starts + 1} at {time.strftime('%H:%M:%S')}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kernelsearch.pool", "worker", self.pool.runner],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env,
                cwd=str(REPO_ROOT), start_new_session=True)
        self.buffer = b""
        self.starts += 1

    def send(self, position: int, job: dict, attempt: int) -> bool:
        if not self.alive():
            self.start()
        self.job = (position, job, attempt)
        self.deadline = time.monotonic() + (self.pool.job_timeout_s or job_deadline_s(job))
        try:
            self.proc.stdin.write((json.dumps({"id": position, "job": job}) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            return False
        return True

    def stderr_tail(self, limit: int = 600) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - limit))
                return " ".join(f.read().decode(errors="replace").split())
        except OSError:
            return ""

    def exit_description(self) -> str:
        code = self.proc.wait() if self.proc is not None else None
        if code is not None and code < 0:
            try:
                return f"killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"killed by signal {-code}"
        return f"exited with code {code}"

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(b'{"op": "exit"}\n')
                self.proc.stdin.flush()
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                pass
        _kill_tree(self.proc)
        for stream in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError):
                stream.close()
        self.proc = None


class Pool:
    """N long-lived evaluation workers, one per GPU (or CPU slot), fed from one queue.

    `workers`: how many (default: every visible GPU; on "cpu", 2). `runner`: what a worker
    calls with each job's keywords ('module:function', default the harness's `evaluate`; tests
    pass recorded, crashing or hanging runners). `job_timeout_s`: the pool's deadline per job
    (default `job_deadline_s(job)`). `env`: extra environment for the workers.
    """

    def __init__(self, workers: int | None = None, device: str = "cuda", runner: str = DEFAULT_RUNNER,
                 job_timeout_s: float | None = None, crash_retries: int = CRASH_RETRIES,
                 env: dict | None = None, log_dir=None):
        self.device = "cpu" if device == "cpu" else "cuda"
        self.runner = runner
        self.job_timeout_s = job_timeout_s
        self.crash_retries = crash_retries
        self.env = {k: str(v) for k, v in (env or {}).items()}
        if self.device == "cpu":
            gpus: list[str | None] = [None] * (workers or 2)
        else:
            visible = visible_gpus()
            if not visible:
                raise ExecutorError("pool: --device cuda but no GPU is visible "
                                   "(CUDA_VISIBLE_DEVICES / nvidia-smi / torch)")
            if workers and workers > len(visible):
                raise ExecutorError(f"pool: {workers} workers asked for, {len(visible)} GPU(s) visible: "
                                 f"{','.join(visible)} (one worker per GPU)")
            gpus = visible[:workers] if workers else visible
        if not gpus:
            raise ExecutorError("pool: needs at least one worker")
        self.slots = [_Slot(i, g, self) for i, g in enumerate(gpus)]
        # worker stderr; a temporary folder unless given (crash verdicts quote its tail anyway)
        self._own_log_dir = not log_dir
        self.log_dir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="hwtune-pool-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.stats = {"jobs": 0, "crashes": 0, "retries": 0, "timeouts": 0, "harness_errors": 0}

    @property
    def width(self) -> int:
        return len(self.slots)

    @property
    def restarts(self) -> int:
        return sum(max(0, s.starts - 1) for s in self.slots)

    def describe(self) -> str:
        return f"pool of {len(self.slots)} {self.device} worker(s): " + ", ".join(s.name for s in self.slots)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        try:
            for slot in self.slots:
                slot.stop()
        finally:
            # a Ctrl-C while a worker is asked to exit (its wait can be seconds) stopped the loop:
            # every worker is still killed and the folder removed
            for slot in self.slots:
                if slot.proc is not None:
                    _kill_tree(slot.proc)
                    slot.proc = None
            if self._own_log_dir:
                shutil.rmtree(self.log_dir, ignore_errors=True)

    # --- the queue ------------------------------------------------------------------------
    def map(self, jobs: list[dict]) -> list[dict]:
        """Evaluate every job on the first free worker; Verdict JSON per job, in job order."""
        results: list[dict | None] = [None] * len(jobs)
        queue = deque((i, job, 0) for i, job in enumerate(jobs))
        self.stats["jobs"] += len(jobs)
        while queue or any(s.job for s in self.slots):
            for slot in self.slots:
                if slot.job is None and queue:
                    position, job, attempt = queue.popleft()
                    try:
                        sent = slot.send(position, job, attempt)
                    except OSError as exc:  # could not even start a process
                        results[position] = failure_verdict(job, "harness", f"{slot.name} could not start: {exc}")
                        slot.job = None
                        continue
                    if not sent:
                        self._worker_died(slot, queue, results)
            busy = [s for s in self.slots if s.job is not None]
            if not busy:
                continue
            wait = max(0.0, min(s.deadline for s in busy) - time.monotonic())
            ready, _, _ = select.select([s.proc.stdout for s in busy], [], [], min(wait, 5.0))
            for slot in busy:
                if slot.proc.stdout in ready:
                    self._read(slot, queue, results)
            now = time.monotonic()
            for slot in busy:
                if slot.job is not None and now >= slot.deadline:
                    self._worker_hung(slot, results)
        return results  # type: ignore[return-value]

    def _read(self, slot: _Slot, queue: deque, results: list) -> None:
        chunk = os.read(slot.proc.stdout.fileno(), 1 << 16)
        if not chunk:
            self._worker_died(slot, queue, results)
            return
        slot.buffer += chunk
        while b"\n" in slot.buffer and slot.job is not None:
            line, slot.buffer = slot.buffer.split(b"\n", 1)
            position, job, _ = slot.job
            try:
                reply = json.loads(line)
            except ValueError:
                reply = {"id": position, "error": f"unreadable reply: {line[:200]!r}"}
            if reply.get("id") != position:
                continue  # a stale answer cannot happen on a fresh worker; ignore defensively
            if "verdict" in reply:
                results[position] = reply["verdict"]
            else:
                self.stats["harness_errors"] += 1
                results[position] = failure_verdict(
                    job, "harness", f"{slot.name}: the evaluation raised: {reply.get('error', '')[-800:]}")
            slot.job = None

    def _worker_died(self, slot: _Slot, queue: deque, results: list) -> None:
        position, job, attempt = slot.job
        how = slot.exit_description()
        tail = slot.stderr_tail()
        slot.stop()
        slot.job = None
        self.stats["crashes"] += 1
        if attempt < self.crash_retries:
            self.stats["retries"] += 1
            queue.appendleft((position, job, attempt + 1))
            return
        results[position] = failure_verdict(
            job, "crash", f"{slot.name} {how} during the evaluation"
            f"{f' (after {attempt} retry)' if attempt else ''}; worker stderr tail: {tail}")

    def _worker_hung(self, slot: _Slot, results: list) -> None:
        position, job, _ = slot.job
        limit = self.job_timeout_s or job_deadline_s(job)
        _kill_tree(slot.proc)
        slot.stop()
        slot.job = None
        self.stats["timeouts"] += 1
        results[position] = failure_verdict(
            job, "timeout", f"{slot.name} gave no verdict within {limit:g} s; killed with SIGKILL "
                            "(restarted on next use)")


def open_executor(kind: str, device: str = "cuda", workers: int | None = None,
                  ray_address: str | None = None, **kw):
    """The executor `hwtune search --executor` names: None for "local" (the loop's sequential
    default), a Pool, or a RayExecutor. Use as a context manager (it closes its workers).
    Raises ExecutorError when that executor cannot be made here."""
    if kind == "local":
        if workers is not None or ray_address:
            raise ExecutorError("--workers / --ray-address need --executor pool or ray")
        return contextlib.nullcontext(None)
    if workers is not None and workers < 1:
        raise ExecutorError(f"--workers {workers}: at least 1")
    if kind == "pool":
        if ray_address:
            raise ExecutorError("--ray-address needs --executor ray")
        return Pool(workers=workers, device=device, **kw)
    if kind == "ray":
        try:
            from kernelsearch.ray_executor import RayExecutor

            return RayExecutor(address=ray_address, device=device, workers=workers, **kw)
        except ImportError as exc:
            raise ExecutorError(f"--executor ray: {exc} (install with: pip install 'hwtune[ray]')") from None
        except (ConnectionError, RuntimeError) as exc:
            raise ExecutorError(f"--executor ray: {exc}") from None
    raise ExecutorError(f"unknown executor {kind!r}: expected one of {', '.join(EXECUTORS)}")


# --- the worker side ---------------------------------------------------------------------------
def worker_main(runner_spec: str) -> int:
    # The protocol owns the real stdout; anything the runner prints goes to stderr (the log).
    channel = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    runner = None
    while True:
        line = sys.stdin.readline()
        if not line:
            return 0
        message = json.loads(line)
        if message.get("op") == "exit":
            return 0
        try:
            if runner is None:
                runner = load_runner(runner_spec)
            reply = {"id": message["id"], "verdict": to_verdict_json(runner(**message["job"]))}
        except Exception:
            reply = {"id": message["id"], "error": traceback.format_exc(limit=8)}
        channel.write(json.dumps(reply) + "\n")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "worker":
        sys.exit(worker_main(sys.argv[2]))
    print("usage: python -m kernelsearch.pool worker MODULE:FUNCTION", file=sys.stderr)
    sys.exit(2)
