"""The sandbox around a candidate's host code. Trusted; standard library only.

Run as `python3 -I -S -B jail.py` by kernelsearch.harness.plan_client: it reads one request
(JSON) on stdin and writes one reply (JSON) on stdout. It loads planner.py by path, then
forks the sandbox child, which

  - starts its own session; as root: new network, IPC and mount namespaces (no network; fresh
    1 MiB tmpfs on /tmp, /var/tmp, /dev/shm), then drops to the configured unprivileged user
    (nobody by default) with no supplementary groups;
  - has an empty working directory, an empty environment, no inherited descriptors (stdin,
    stdout and stderr are /dev/null; the reply goes through one pipe), no new privileges, and
    resource limits: CPU seconds, 1 GiB of address space, no file writes (RLIMIT_FSIZE 0: a
    write is SIGXFSZ, a crash verdict), no core files, few descriptors and processes;
  - executes the candidate against symbolic tensors (planner.plan_request) and writes plans.

The jail is a child subreaper: whatever the candidate starts (double fork + setsid included)
stays its descendant. After the reply (or the deadline) every descendant is killed, and any
that was still alive besides the sandbox itself is reported: a process left behind is a
rejection. The sandbox never sees input data, seeds, outputs or the trusted process.
"""
from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import pwd
import resource
import select
import signal
import sys
import tempfile
import time

# Loaded now, while the jail can still read the interpreter's files: after the drop the
# sandbox user may not be able to (e.g. a Python under /root).
import functools  # noqa: F401
import itertools  # noqa: F401
import math  # noqa: F401
import typing  # noqa: F401

MAX_REQUEST_BYTES = 8 << 20
MAX_REPLY_BYTES = 64 << 20
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 4, 36, 38
CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWNET = 0x00020000, 0x08000000, 0x40000000
MS_NOSUID, MS_NODEV, MS_REC, MS_PRIVATE = 2, 4, 16384, 1 << 18
TMPFS_DIRS = ("/tmp", "/var/tmp", "/dev/shm")

_libc = ctypes.CDLL(None, use_errno=True)


def _prctl(option: int, value: int) -> bool:
    return _libc.prctl(option, ctypes.c_ulong(value), 0, 0, 0) == 0


def _load_planner():
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "planner.py")
    spec = importlib.util.spec_from_file_location("hwtune_planner", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _isolate_namespaces() -> list[str]:
    """As root: no network, private IPC, private mounts with fresh small tmpfs dirs."""
    done = []
    if _libc.unshare(CLONE_NEWNET) == 0:
        done.append("net")
    if _libc.unshare(CLONE_NEWIPC) == 0:
        done.append("ipc")
    if _libc.unshare(CLONE_NEWNS) == 0 and \
            _libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) == 0:
        mounted = [d for d in TMPFS_DIRS if os.path.isdir(d) and
                   _libc.mount(b"tmpfs", d.encode(), b"tmpfs", MS_NOSUID | MS_NODEV,
                               b"size=1m,mode=1777") == 0]
        done.append("mount(tmpfs " + ",".join(mounted) + ")")
    return done


def _limits(cpu_s: int, other_uid: bool) -> None:
    def lim(what, value):
        try:
            resource.setrlimit(what, (value, value))
        except (ValueError, OSError):
            pass
    lim(resource.RLIMIT_CPU, max(2, cpu_s))
    lim(resource.RLIMIT_AS, 1 << 30)
    lim(resource.RLIMIT_FSIZE, 0)
    lim(resource.RLIMIT_CORE, 0)
    lim(resource.RLIMIT_NOFILE, 16)
    if other_uid:
        # counts every process of that user on the host: generous, only against fork bombs
        lim(resource.RLIMIT_NPROC, 256)


def _child(write_fd: int, request: dict, planner, identity, jail_pid: int) -> None:
    data = None
    try:
        os.setsid()
        isolation = _isolate_namespaces() if os.geteuid() == 0 else []
        workdir = tempfile.mkdtemp(prefix="hwtune-sandbox-", dir="/tmp" if os.path.isdir("/tmp") else None)
        if identity:
            os.chown(workdir, identity[0], identity[1])
        os.chdir(workdir)
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        os.closerange(3, write_fd)
        os.closerange(write_fd + 1, 1 << 16)
        _limits(int(request.get("timeout_s", 60)) + 1, bool(identity))
        _prctl(PR_SET_NO_NEW_PRIVS, 1)
        if identity:
            uid, gid, name = identity
            os.setgroups([])
            os.setresgid(gid, gid, gid)
            os.setresuid(uid, uid, uid)
            isolation.append(f"user {name} (uid {uid})")
        else:
            isolation.append(f"same user (uid {os.getuid()}): not root, no privilege drop")
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # after the drop: a credential change clears it
        if os.getppid() != jail_pid:
            os._exit(3)
        os.environ.clear()
        os.environ.update({"PATH": "/usr/bin:/bin", "HOME": workdir, "LANG": "C.UTF-8"})
        reply = planner.plan_request(request)
        reply["isolation"] = isolation
        data = json.dumps(reply).encode()
    except BaseException as exc:  # noqa: BLE001 -- whatever happens here is reported, not raised
        try:
            data = json.dumps({"ok": False, "guard": "exception",
                               "reason": f"sandbox: {type(exc).__name__}: {exc}"[:600]}).encode()
        except BaseException:  # noqa: BLE001
            data = b'{"ok": false, "guard": "exception", "reason": "sandbox failed"}'
    try:
        # Length first: a process the candidate started may hold the pipe open past our exit,
        # so the jail reads exactly this many bytes instead of waiting for end of file.
        view = memoryview(len(data).to_bytes(8, "big") + data)
        while view:
            n = os.write(write_fd, view)
            view = view[n:]
    finally:
        os._exit(0)


def _proc_table() -> dict[int, tuple[int, str, str]]:
    """pid -> (ppid, state, comm) for every process we can see."""
    table = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                raw = f.read().decode(errors="replace")
        except OSError:
            continue
        lpar, rpar = raw.find("("), raw.rfind(")")
        fields = raw[rpar + 2:].split()
        if len(fields) < 2:
            continue
        table[int(name)] = (int(fields[1]), fields[0], raw[lpar + 1:rpar])
    return table


def _descendants(root: int) -> dict[int, tuple[str, str]]:
    table = _proc_table()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = {}, list(children.get(root, []))
    while todo:
        pid = todo.pop()
        if pid in out or pid == root:
            continue
        out[pid] = (table[pid][1], table[pid][2])
        todo.extend(children.get(pid, []))
    return out


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _kill_all(root: int) -> None:
    for _ in range(200):
        alive = _descendants(root)
        if not alive:
            return
        for pid in alive:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _reap()
        time.sleep(0.005)


def _identity(user):
    if not user or os.geteuid() != 0:
        return None
    try:
        entry = pwd.getpwnam(user)
    except KeyError:
        raise LookupError(f"sandbox user {user!r} does not exist") from None
    if entry.pw_uid == 0:
        raise LookupError(f"sandbox user {user!r} is root")
    return entry.pw_uid, entry.pw_gid, user


def run(request: dict) -> dict:
    planner = _load_planner()
    try:
        identity = _identity(request.get("user"))
    except LookupError as exc:
        return {"ok": False, "guard": "harness", "reason": str(exc)}
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    _prctl(PR_SET_DUMPABLE, 0)
    timeout_s = float(request.get("timeout_s", 60))
    read_fd, write_fd = os.pipe()
    jail_pid = os.getpid()
    pid = os.fork()
    if pid == 0:
        os.close(read_fd)
        _child(write_fd, request, planner, identity, jail_pid)
    os.close(write_fd)
    started = time.monotonic()
    chunks, size, timed_out, expected = [], 0, False, None
    while expected is None or size < expected + 8:
        left = timeout_s - (time.monotonic() - started)
        if left <= 0:
            timed_out = True
            break
        ready, _, _ = select.select([read_fd], [], [], left)
        if not ready:
            continue
        chunk = os.read(read_fd, 1 << 20)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
        if expected is None and size >= 8:
            expected = int.from_bytes(b"".join(chunks)[:8], "big")
        if size > MAX_REPLY_BYTES:
            break
    os.close(read_fd)
    # The sandbox exits right after writing; give it a moment, then see who is still there.
    deadline = time.monotonic() + 0.5
    status = None
    while time.monotonic() < deadline:
        done, st = os.waitpid(pid, os.WNOHANG)
        if done:
            status = st
            break
        time.sleep(0.005)
    left_behind = {p: c for p, (state, c) in _descendants(jail_pid).items()
                   if state != "Z" and not (p == pid and status is None and timed_out)}
    _kill_all(jail_pid)
    _reap()
    if timed_out:
        return {"ok": False, "guard": "timeout",
                "reason": f"the sandboxed host code gave no plan within {timeout_s:g} s (killed)",
                "leftover": []}
    if size > MAX_REPLY_BYTES:
        return {"ok": False, "guard": "plan", "reason": f"plan larger than {MAX_REPLY_BYTES >> 20} MiB"}
    raw = b"".join(chunks)[8:]
    if expected is None or len(raw) < expected:
        raw = b""
    raw = raw[:expected or 0]
    try:
        reply = json.loads(raw.decode("utf-8")) if raw else None
    except (UnicodeDecodeError, ValueError, RecursionError):  # RecursionError: [[[[...]]]]
        reply = None
    if not isinstance(reply, dict):
        how = ""
        if status is not None and os.WIFSIGNALED(status):
            try:
                how = f" (killed by {signal.Signals(os.WTERMSIG(status)).name})"
            except ValueError:
                how = f" (killed by signal {os.WTERMSIG(status)})"
        elif status is not None:
            how = f" (exit code {os.WEXITSTATUS(status)})"
        reply = {"ok": False, "guard": "crash", "reason": f"the sandbox ended without a plan{how}"}
    reply["leftover"] = [{"pid": p, "comm": c} for p, c in sorted(left_behind.items())]
    return reply


def main() -> int:
    raw = sys.stdin.buffer.read(MAX_REQUEST_BYTES + 1)
    if len(raw) > MAX_REQUEST_BYTES:
        reply = {"ok": False, "guard": "harness", "reason": "sandbox request too large"}
    else:
        reply = run(json.loads(raw))
    sys.stdout.write(json.dumps(reply))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
