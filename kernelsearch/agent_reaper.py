"""Runs one agent command and ends everything it started. Trusted; standard library only.

Run as `python3 -I -S -B agent_reaper.py STATUS_FD PARENT_PID TIMEOUT_S MAX_FILE_BYTES
MAX_PROCESSES UID GID HIDE -- COMMAND...` by kernelsearch.agent, as the user hwtune runs as, in
the round's work directory, with the agent's environment and its stdout/stderr (agent.log). It

  - is a child subreaper: whatever the agent starts (a double fork with setsid included) stays
    its descendant, so that once the agent has exited or timed out every one of them is killed;
    a process group alone lets a helper that called setsid() live on;
  - ends (killing the agent and its helpers first) on SIGTERM, and gets SIGTERM when the
    process that started it dies;
  - as root: runs the agent as UID:GID with no supplementary groups, in PID, IPC and mount
    namespaces of its own: no process outside to signal or see (its /proc is its namespace's),
    every file system read-only but its work dir and its tmp/, which is /tmp, /var/tmp and
    /dev/shm there (nothing it leaves outlives the round outside its work dir; one that holds
    the work dir or a file the command names stays the host's, read-only), TMPDIR that tmp/;
  - runs the agent with no file larger than MAX_FILE_BYTES (its log included: RLIMIT_FSIZE),
    as UID: at most MAX_PROCESSES processes of that user (RLIMIT_NPROC, against a fork bomb),
    and umask 077 (its work dir is its HOME: no other user reads what it keeps there), with no
    new privileges (a setuid program runs with the agent's rights) and oom_score_adj 1000 (its
    memory is not bounded: out of memory, the kernel kills the agent first, not hwtune);
  - writes one JSON line to STATUS_FD: {"exited", "rc", "exec_error", "left"}.

UID "-" runs the agent as this user. Not root, it then gets the same namespaces inside a user
namespace mapped to this same user, where user namespaces are allowed; elsewhere it may do
whatever this user may.
"""
from __future__ import annotations

import ctypes
import json
import os
import resource
import signal
import sys
import time

PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 4, 36, 38
CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWPID = 0x00020000, 0x08000000, 0x10000000, 0x20000000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_REC, MS_PRIVATE = 2, 4, 8, 4096, 16384, 1 << 18
SYS_MOUNT_SETATTR, AT_FDCWD, AT_RECURSIVE, MOUNT_ATTR_RDONLY = 442, -100, 0x8000, 0x1   # Linux >= 5.12
PRIVATE_DIRS = ("/tmp", "/var/tmp", "/dev/shm")

_libc = ctypes.CDLL(None, use_errno=True)
_stop = []


def _prctl(option: int, value: int) -> bool:
    return _libc.prctl(option, ctypes.c_ulong(value), 0, 0, 0) == 0


def _private_tmp(uid: int, gid: int, command: list[str]) -> list[str]:
    """/tmp, /var/tmp, /dev/shm bound to WORKDIR/tmp (in a mount namespace of our own), but
    one that holds the work dir (a --state-dir under /tmp) or a file the command names (the
    agent's program or script): that one stays the host's, read-only (TMPDIR is WORKDIR/tmp)."""
    tmp = os.path.join(os.getcwd(), "tmp")
    try:
        os.mkdir(tmp, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(tmp)
    if not os.path.isdir(tmp) or os.path.islink(tmp) or st.st_uid not in (0, uid):
        return []
    os.chown(tmp, uid, gid)
    needed = [os.path.realpath(os.getcwd())]
    needed += [os.path.realpath(a) for a in command if a.startswith("/") and os.path.exists(a)]
    bound = []
    for d in PRIVATE_DIRS:
        top = os.path.realpath(d).rstrip("/") + "/"
        if os.path.isdir(d) and not any(path.startswith(top) for path in needed):
            if _libc.mount(tmp.encode(), d.encode(), None, MS_BIND, None) == 0:
                bound.append(d)
    return bound


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


def _set_readonly(path: str, readonly: bool, recursive: bool) -> bool:
    attr = _MountAttr(MOUNT_ATTR_RDONLY if readonly else 0, 0 if readonly else MOUNT_ATTR_RDONLY, 0, 0)
    return _libc.syscall(SYS_MOUNT_SETATTR, AT_FDCWD, path.encode(), AT_RECURSIVE if recursive else 0,
                         ctypes.byref(attr), ctypes.sizeof(attr)) == 0


def _isolate(uid: int, gid: int, same_user: bool, hide: str | None, command: list[str]) -> list[str]:
    """Namespaces for the agent (what was done, by name). As root (the agent then runs as
    UID:GID) or, not root, in a user namespace mapped to this same user (where allowed): its
    own PID namespace (no process outside it to signal, the agent's end ends all it started),
    IPC, and a mount namespace in which every file system is read-only but its work dir and its
    private /tmp (device nodes such as /dev/null still open for writing; /dev/mqueue does not):
    the ledger, the dispatch table, the kept candidates, the harness's code and any
    world-writable directory stay as they are. `hide` (the state directory that holds the work
    dir): an empty tmpfs there, the work dir alone bound back at its own path: the agent reaches
    it by that path (HOME) though the state directory is root's 0700, and sees nothing else
    there (the ledger, the tables)."""
    done = []
    if same_user:
        if _libc.unshare(CLONE_NEWUSER) != 0:
            return done
        try:
            for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"),
                               ("gid_map", f"{gid} {gid} 1")):
                with open(f"/proc/self/{name}", "w") as f:
                    f.write(text)
        except OSError:
            return done
        done.append("user")
    for flag, name in ((CLONE_NEWPID, "pid"), (CLONE_NEWIPC, "ipc")):
        if _libc.unshare(flag) == 0:
            done.append(name)
    if _libc.unshare(CLONE_NEWNS) != 0 or _libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) != 0:
        return done
    hidden = bool(hide) and _hide_around(hide)
    writable = _private_tmp(uid, gid, command)
    here = os.getcwd()
    if not hidden:
        if _libc.mount(here.encode(), here.encode(), None, MS_BIND, None) != 0:
            return done
        os.chdir(here)   # into the bind mount (the directory below it turns read-only)
    if not _set_readonly("/", True, recursive=True):
        return done
    ok = all([_set_readonly(here, False, recursive=False), *(_set_readonly(d, False, False) for d in writable)])
    if os.path.isdir("/proc"):   # its own /proc/self (oom_score_adj below); the rest is by permission
        ok = _set_readonly("/proc", False, recursive=False) and ok
    done.append("mount(read-only but the work dir)" if ok else "mount(read-only, some writable dirs not)")
    return done


def _hide_around(top: str) -> bool:
    """An empty tmpfs on `top`, the work dir (cwd, below it) bound back at its own path."""
    here, top = os.path.realpath(os.getcwd()), os.path.realpath(top)
    rel = os.path.relpath(here, top)
    if rel == "." or rel.startswith(".."):
        return False
    fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY)
    try:
        if _libc.mount(b"tmpfs", top.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, b"size=64k,mode=755") != 0:
            return False
        path = top
        for part in rel.split(os.sep):
            path = os.path.join(path, part)
            os.mkdir(path, 0o755)
        if _libc.mount(f"/proc/self/fd/{fd}".encode(), path.encode(), None, MS_BIND, None) != 0:
            return False
        os.chdir(path)
        return True
    finally:
        os.close(fd)


def _own_proc() -> bool:
    """In the agent (pid 1 of its PID namespace), before its exec: a /proc of that namespace in
    a mount namespace of its own (the reaper's /proc must stay the host's, to find the agent's
    processes): no other process of the host to look at (command lines, /proc/PID/mem of one
    of the agent user's). Where it cannot be made the host's /proc stays."""
    if _libc.unshare(CLONE_NEWNS) != 0:
        return False
    return _libc.mount(b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None) == 0


def _children() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                raw = f.read().decode(errors="replace")
        except OSError:
            continue
        fields = raw[raw.rfind(")") + 2:].split()
        if len(fields) >= 2:
            children.setdefault(int(fields[1]), []).append(int(name))
    return children


def _descendants(root: int) -> set[int]:
    children = _children()
    out, todo = set(), list(children.get(root, []))
    while todo:
        pid = todo.pop()
        if pid not in out and pid != root:
            out.add(pid)
            todo.extend(children.get(pid, []))
    return out


def _reap() -> dict[int, int]:
    done = {}
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return done
        if pid == 0:
            return done
        done[pid] = status


def _kill_all(me: int, limit_s: float = 30.0) -> int:
    """SIGKILL every descendant until none is left; how many there were at the first look."""
    first = None
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        alive = _descendants(me)
        if first is None:
            first = len(alive)
        if not alive:
            break
        for pid in alive:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _reap()
        time.sleep(0.005)
    _reap()
    return first or 0


def main(argv: list[str]) -> int:
    status_fd, parent, timeout_s, max_file = int(argv[1]), int(argv[2]), float(argv[3]), int(argv[4])
    max_procs = int(argv[5])
    uid, gid = (None, None) if argv[6] == "-" else (int(argv[6]), int(argv[7]))
    hide = None if argv[8] == "-" else argv[8]
    command = argv[argv.index("--") + 1:]
    os.set_inheritable(status_fd, False)
    signal.signal(signal.SIGTERM, lambda *_: _stop.append(1))
    _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:
        _stop.append(1)
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    isolation = []
    if uid is not None and os.geteuid() == 0:
        isolation = _isolate(uid, gid, same_user=False, hide=hide, command=command)
    elif uid is None and os.geteuid() != 0:
        isolation = _isolate(os.getuid(), os.getgid(), same_user=True, hide=hide,
                             command=command)
    _prctl(PR_SET_DUMPABLE, 0)   # after: not dumpable, /proc/self/uid_map is root's to write
    me = os.getpid()
    err_r, err_w = os.pipe2(os.O_CLOEXEC)
    leader = os.fork()
    if leader == 0:
        try:
            os.close(err_r)
            os.close(status_fd)
            if "pid" in isolation:
                _own_proc()
            if os.path.isdir("tmp"):
                os.environ["TMPDIR"] = os.path.join(os.getcwd(), "tmp")
            for sig in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGTERM):
                signal.signal(sig, signal.SIG_DFL)
            resource.setrlimit(resource.RLIMIT_FSIZE, (max_file, max_file))
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            os.umask(0o077)
            _prctl(PR_SET_NO_NEW_PRIVS, 1)   # no setuid program runs with its owner's rights
            _prctl(PR_SET_DUMPABLE, 1)   # as after its exec; the reaper's 0 made /proc/self root's
            try:   # memory is not bounded: out of memory, the agent goes first, not hwtune
                with open("/proc/self/oom_score_adj", "w") as f:
                    f.write("1000")
            except OSError:
                pass
            if uid is not None:
                # counts every process of that user on the host (not settable for our own user)
                resource.setrlimit(resource.RLIMIT_NPROC, (max_procs, max_procs))
                os.setgroups([])
                os.setresgid(gid, gid, gid)
                os.setresuid(uid, uid, uid)
            # after the drop (a credential change clears it): should the reaper die, the agent,
            # pid 1 of its namespace, dies and takes every process there with it
            _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
            if os.getppid() not in (me, 0):   # 0: pid 1 of a namespace, its parent outside
                os._exit(125)
            os.execvp(command[0], command)
        except BaseException as exc:  # noqa: BLE001 -- told to the reaper, which reports it
            why = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
            try:
                os.write(err_w, why.encode(errors="replace")[:500])
            finally:
                os._exit(127)
    os.close(err_w)
    exec_error = b""
    while chunk := os.read(err_r, 512):   # end of file: exec succeeded (close-on-exec) or failed
        exec_error += chunk
    os.close(err_r)
    deadline = time.monotonic() + timeout_s
    rc = None
    while not _stop and time.monotonic() < deadline:
        done = _reap()
        if leader in done:
            st = done[leader]
            rc = os.WEXITSTATUS(st) if os.WIFEXITED(st) else -os.WTERMSIG(st)
            break
        time.sleep(0.01)
    left = _kill_all(me)
    os.write(status_fd, json.dumps({"exited": rc is not None, "rc": rc, "left": left, "isolation": isolation,
                                    "exec_error": exec_error.decode(errors="replace") or None}).encode())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
