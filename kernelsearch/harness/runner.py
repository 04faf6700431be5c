"""Parent side of the trusted executor process (kernelsearch.harness.executor).

One executor per device per process, kept between evaluations (its CUDA context and compiled
kernels are reused), started on first use and again after it dies. Every request has a hard
deadline; past it the executor gets SIGKILL. A hang, a crash (an illegal address, the OOM
killer) or garbage on the pipe becomes a ChildFailure carrying a verdict, never an exception
that escapes the harness.
"""
from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 300.0   # importing torch + triton (+ CUDA init) on a loaded host


class ChildFailure(Exception):
    def __init__(self, guard: str, reason: str):
        super().__init__(f"{guard}: {reason}")
        self.guard, self.reason = guard, reason


class ExecutorProcess:
    def __init__(self, device: str):
        self.device = device
        self.workdir = tempfile.mkdtemp(prefix="hwtune-executor-")
        os.chmod(self.workdir, 0o700)
        self.stderr_path = os.path.join(self.workdir, "stderr.txt")
        to_child_r, self._to_child = os.pipe()
        self._from_child, from_child_w = os.pipe()
        env = dict(os.environ)
        env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        if device == "cpu":
            env["TRITON_INTERPRET"] = "1"
        else:
            env.pop("TRITON_INTERPRET", None)
        # Compiled kernels (and Triton's launcher .so) land in a directory only we can write.
        env.setdefault("TRITON_CACHE_DIR", os.path.join(self.workdir, "triton-cache"))
        # The executor's (and its compile workers') kernel files live here: close() removes it
        # even when the executor was killed.
        env["HWTUNE_WORK_DIR"] = self.workdir
        with open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kernelsearch.harness.executor", str(to_child_r),
                 str(from_child_w), device],
                pass_fds=(to_child_r, from_child_w), env=env, cwd=str(REPO_ROOT),
                stdin=subprocess.DEVNULL, stdout=err, stderr=err, start_new_session=True)
        os.close(to_child_r)
        os.close(from_child_w)
        self._buffer = b""
        self.started = False

    def alive(self) -> bool:
        return self.proc.poll() is None

    def request(self, message: dict, timeout_s: float) -> dict:
        if not self.started:
            timeout_s = max(timeout_s, STARTUP_TIMEOUT_S)
        try:
            os.write(self._to_child, (json.dumps(message) + "\n").encode())
        except OSError:
            raise self._died() from None
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                self.kill()
                raise ChildFailure("timeout", f"no answer to '{message.get('op')}' within {timeout_s:g} s "
                                              "(the executor was killed with SIGKILL)")
            ready, _, _ = select.select([self._from_child], [], [], left)
            if not ready:
                continue
            chunk = os.read(self._from_child, 1 << 16)
            if not chunk:
                raise self._died()
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        self.started = True
        try:
            return json.loads(line)
        except ValueError:
            self.kill()
            raise ChildFailure("harness", f"unreadable reply from the executor: {line[:200]!r}") from None

    def _died(self) -> ChildFailure:
        try:
            code = self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.kill()
            code = self.proc.returncode
        if code is not None and code < 0:
            try:
                how = f"killed by {signal.Signals(-code).name}"
            except ValueError:
                how = f"killed by signal {-code}"
        else:
            how = f"exited with code {code}"
        return ChildFailure("crash", f"the executor running the kernel {how}; stderr tail: {self.stderr_tail()}")

    def stderr_tail(self, limit: int = 600) -> str:
        try:
            text = Path(self.stderr_path).read_text(errors="replace")
        except OSError:
            return ""
        return " ".join(text[-limit:].split())

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                os.write(self._to_child, b'{"op": "exit"}\n')
                self.proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self.kill()
        for fd in (self._to_child, self._from_child):
            try:
                os.close(fd)
            except OSError:
                pass
        import shutil

        shutil.rmtree(self.workdir, ignore_errors=True)


_executors: dict[str, ExecutorProcess] = {}
_lock = threading.Lock()


def executor(device: str) -> ExecutorProcess:
    """This process's executor for `device`, started (again) when needed."""
    with _lock:
        ex = _executors.get(device)
        if ex is None or not ex.alive():
            if ex is not None:
                ex.close()
            ex = _executors[device] = ExecutorProcess(device)
        return ex


def discard(device: str) -> None:
    """Kill and forget the executor (after a timeout or crash its state is unknown)."""
    with _lock:
        ex = _executors.pop(device, None)
    if ex is not None:
        ex.close()


@atexit.register
def _close_all() -> None:
    for device in list(_executors):
        discard(device)
