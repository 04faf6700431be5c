"""External agent proposer: a configured command writes a candidate file; the harness judges it.

Each round gets a fresh work directory holding the context pack:
  TASK.md            what to write, the contract, the shapes, dtype and tolerance
  baseline.py        the current template (a working starting point)
  context/*.md       notes for the detected GPU generation and the model family
  roofline.json      this device's measured ceilings
  ledger.json        what was tried for this kernel on this device and why it failed
  best.json          the best times so far per shape, and stock's
The command runs without a shell, with cwd = the work dir, under agent_reaper.py (a child
subreaper: at the hard timeout, at a stop of the search, and once the agent has exited, every
process it started is killed, setsid() helpers included), no file larger than
MAX_AGENT_FILE_BYTES (agent.log included), and -- when hwtune runs as root and a user is
configured -- as that user. Either way (not root: in a user namespace mapped to hwtune's own
user, where allowed) it runs in PID, IPC and mount namespaces of its own: no process outside
to signal, every file system read-only but its work dir and its tmp/ (TMPDIR), which is its
/tmp, /var/tmp and /dev/shm (but one holding the work dir or a file its command names: that
one stays the host's, read-only) and is removed when the round ends.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import pwd
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from kernelsearch.harness.source import MAX_AST_DEPTH, MAX_SOURCE_BYTES

CONTEXT_DIR = Path(__file__).resolve().parent.parent / "context"
CANDIDATE_NAME = "candidate.py"
REAPER = Path(__file__).resolve().parent / "agent_reaper.py"
MAX_AGENT_FILE_BYTES = 64 << 20   # any file the agent writes, agent.log included (RLIMIT_FSIZE)
# processes (threads too) of the agent user, host-wide (RLIMIT_NPROC; not set when the agent is
# hwtune's own user, whose own processes would count): against a fork bomb, not a limit to meet
MAX_AGENT_PROCESSES = 4096
LOG_TAIL_BYTES = 4000

# compute capability major -> note; consumer cards (no NVLink) are recognised by name
GENERATION_NOTES = {8: "ampere-a100.md", 9: "hopper-h100-h200.md", 10: "blackwell-b200.md",
                    12: "blackwell-b200.md"}
CONSUMER_MARKERS = ("geforce", "rtx", "titan")
MODEL_NOTES = {"llama": ["llama-gqa.md"], "deepseek": ["deepseek-mla-sparse.md"],
               "all": ["llama-gqa.md", "deepseek-mla-sparse.md"]}


@dataclass
class AgentConfig:
    argv: list[str]
    timeout_s: float = 900.0
    user: str | None = None          # drop to this user when running as root
    model_family: str = "llama"      # which context/models notes to include
    env_passthrough: tuple[str, ...] = ()   # e.g. an API key variable the agent needs

    @classmethod
    def from_command(cls, command: str, **kw) -> "AgentConfig":
        return cls(argv=shlex.split(command), **kw)


@dataclass
class AgentOutcome:
    status: str                      # "ok" | "timeout" | "failed" | "missing"
    reason: str
    candidate_path: Path | None = None
    returncode: int | None = None
    elapsed_s: float = 0.0
    data: bytes = b""                # the candidate's bytes, read without following links
    isolation: list = dataclasses.field(default_factory=list)   # namespaces it ran in (the reaper's)


def context_notes(fingerprint: dict, model_family: str = "llama",
                  context_dir: Path = CONTEXT_DIR) -> list[Path]:
    """The notes for this GPU (by compute capability and name) and model family, README first."""
    names = ["README.md"]
    gpu = str(fingerprint.get("gpu", "")).lower()
    try:
        major = int(str(fingerprint.get("capability", "")).split(".")[0])
    except ValueError:
        major = None
    if any(m in gpu for m in CONSUMER_MARKERS):
        names.append("gpu/consumer-no-nvlink.md")
    if major in GENERATION_NOTES:
        names.append("gpu/" + GENERATION_NOTES[major])
    names += ["models/" + n for n in MODEL_NOTES.get(model_family, MODEL_NOTES["all"])]
    return [context_dir / n for n in names if (context_dir / n).exists()]


def _task_text(kernel: str, spec, shapes: list[dict], dtype: str | None, device: str) -> str:
    import importlib

    doc = importlib.import_module(type(spec).__module__).__doc__ or ""
    lines = [f"# Task: a faster `{kernel}` kernel for {device}", "",
             f"Write `{CANDIDATE_NAME}` in this directory: a Python file with at least one "
             "`@triton.jit` kernel and a `launch(...)` function following the contract below; "
             "launch's default keyword values are the parameters used.",
             "Outputs are passed in (destination-passing); compute in fp32, cast on store.",
             "It is verified on fresh random inputs of every shape (every shape on every input "
             "distribution: normal, tiny, huge, per-row scales; exact zeros among them), for "
             "unwritten outputs, input mutation, determinism and global state, then timed "
             "against stock. Start from `baseline.py`; see context/ for the hardware.",
             "You run with this directory writable and nothing else on the file system (its tmp/ "
             "is $TMPDIR and, mostly, /tmp), no file over "
             f"{MAX_AGENT_FILE_BYTES >> 20} MiB, and every process you start ends with the "
             "round: only what is in this directory when you exit is read.", "",
             "## Rules (checked before and while it runs; a breach is a rejection)",
             "- The harness never imports your file. It checks the source, compiles your "
             "`@triton.jit` kernels from it, and runs `launch()` in a sandbox (another process, "
             "an unprivileged user, no data) on tensors that have shape, strides, dtype and "
             "device but no values: what launch() allocates and launches is recorded as a plan, "
             "and the harness runs that plan on its own buffers.",
             "- top level: imports of triton, triton.language (any alias), libdevice; for host "
             "code only torch, math, functools, itertools, typing; assignments; functions. No "
             "classes, no top-level calls/loops, no attribute assignment (monkeypatching); "
             f"at most {MAX_SOURCE_BYTES // 1024} KiB and {MAX_AST_DEPTH} levels of syntax "
             "nesting (split a long expression).",
             "- launch() may allocate (torch.empty/zeros/empty_like), make views (view, reshape, "
             "slicing, transpose, ...), zero a workspace (.zero_()) and launch kernels "
             "(`kernel[grid](...)`), nothing else: no torch compute, no data access (.item, "
             "printing values), no torch.cuda streams or events, no attribute or imported name "
             "that starts with an underscore (a module's internals) or is a module another one "
             "holds (typing.sys, typing.stdlib_re), no `type`, `.format` "
             "(use f-strings), `functools.wraps`, `functools.singledispatch`, code objects or "
             "`match` statements, and "
             "string annotations only as plain dotted names.",
             "- scalar arguments (eps, scale) are drawn per trial, and some trials pass the values "
             "models pass (eps 1e-5, 1e-6; scale 1/sqrt(D)): pass them, or arithmetic on "
             "them (scale * 1.4427), to a kernel; don't branch on them or convert them to int.",
             "- launch() must plan the same on repeated calls with the same arguments (no memo, "
             "no call counter); a buffer kept across calls must be torch.zeros and left all-zero.",
             "- kernel bodies: triton.language (tl.* and tl.math.*), arithmetic, comparisons, "
             "if/for/while, their parameters and locals, the file's other kernels, constexpr "
             "literals, range/min/max/float/int; parameter defaults only numbers, strings, bools, "
             "None or tuples of them; no other module, no dunder names, no lambda, "
             "no tl.inline_asm_elementwise or tl.device_print, no name starting with _hwtune "
             "(the harness's); at most 64 @triton.jit functions a file. On sm_90+ the harness "
             "launches every kernel with programmatic dependent launch and "
             "makes a wait for the previous kernel its first instruction: write none yourself "
             "(where the spec names static inputs, e.g. weights, a kernel whose first statements "
             "only compute offsets and load those may have them run before the wait: load the "
             "first weight tile at the top, before anything that reads an activation; this op's "
             f"static inputs: {', '.join(getattr(spec, 'static_inputs', ())) or 'none'}).",
             "- a launch's programs run in any order, on the CPU too (the interpreter draws one per "
             "launch): no program may read what another wrote in the same launch, bar through "
             "atomics (an arrival counter).",
             "- every output element written on every call (outputs are poisoned with NaN, huge "
             "or random values), inputs untouched (never stored to, not even restored after), nothing outside the buffers (canaries), "
             "deterministic, capturable in a CUDA graph; lengths and positions (seq_lens, "
             "positions) are drawn per call, any sequence at any length, B = 1 included; it is "
             "checked on one extra shape drawn "
             "at random from the op's domain, not only on the shapes below.", "",
             "## Contract", doc.strip(), "",
             # the harness's rule: an explicit dtype wins over a shape's own
             f"## Shapes ({'all in ' + dtype if dtype else 'primary dtype unless a shape names its own'})"]
    lines += [f"- {json.dumps(s, sort_keys=True)}" for s in shapes]
    tol = {d: spec.tolerance(d) for d in spec.dtypes.get("cuda" if device.startswith("cuda") else "cpu", ())}
    lines += ["", "## Tolerance (relative L2 error per row)", json.dumps(tol), ""]
    return "\n".join(lines)


def write_context_pack(work_dir: Path, *, kernel: str, spec, shapes, dtype, device, fingerprint,
                       ceilings, ledger_summary, recent_attempts, best, baseline_path,
                       model_family="llama", context_dir: Path = CONTEXT_DIR) -> list[str]:
    """Fill `work_dir` with everything the agent is given; returns the file names written."""
    work_dir.mkdir(parents=True, exist_ok=True)
    (work_dir / "context").mkdir(exist_ok=True)
    written = []

    def put(name: str, text: str) -> None:
        (work_dir / name).write_text(text)
        written.append(name)

    put("TASK.md", _task_text(kernel, spec, shapes, dtype, device))
    put("baseline.py", Path(baseline_path).read_text())
    for note in context_notes(fingerprint, model_family, context_dir):
        put(f"context/{note.name}", note.read_text())
    put("roofline.json", json.dumps(ceilings or {}, indent=2, sort_keys=True, default=str))
    tried = [{"params": a["params"], "source_hash": a["source_hash"], "shape": a["shape"],
              "accepted": a["accepted"], "guard": a["guard"], "reason": (a["reason"] or "")[:300],
              "candidate_ms": a["candidate_ms"] if math.isfinite(a["candidate_ms"]) else None,
              "stock_ms": a["stock_ms"] if math.isfinite(a["stock_ms"]) else None}
             for a in recent_attempts]
    put("ledger.json", json.dumps({"summary": ledger_summary, "recent": tried}, indent=2))
    put("best.json", json.dumps(best, indent=2, sort_keys=True))
    return written


def _demote(user: str | None):
    """`user=` for Popen when running as root and a user is configured; None otherwise."""
    if user and hasattr(os, "geteuid") and os.geteuid() == 0:
        return user
    return None


def _identity(user: str) -> dict:
    """Popen keywords that run as `user` with its own group and no supplementary groups:
    `user=` alone keeps root's group 0 and root's supplementary groups."""
    entry = pwd.getpwnam(user)
    if entry.pw_uid == 0:
        raise KeyError(f"agent user {user!r} is root")
    return {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": []}


def _end_reaper(proc: subprocess.Popen) -> None:
    """Stop the reaper (it kills the agent and its helpers first); SIGKILL it after 10 s."""
    try:
        proc.send_signal(signal.SIGTERM)
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
    except BaseException:   # a second Ctrl-C while waiting: kill now, still wait for it
        proc.kill()
        proc.wait()
        raise
    finally:
        try:   # not root: the agent, this same user, may have killed the reaper; its group goes
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def command_problem(config: AgentConfig) -> str | None:
    """Why the agent command cannot start, or None: checked before a search, where every round
    would otherwise fail the same way (and, run as another user, a program under a directory
    only root may enter reads as "Permission denied" rather than as not found)."""
    if not config.argv:
        return "an empty command"
    path = os.environ.get("PATH", "/usr/bin:/bin")
    exe = shutil.which(config.argv[0], path=path)
    if exe is None:
        return f"{config.argv[0]!r}: no such program on PATH"
    user = _demote(config.user)
    if not user:
        return None
    try:
        uid, gid = _identity(user)["user"], pwd.getpwnam(user).pw_gid
    except KeyError as exc:
        return f"agent user {user!r}: {exc.args[0] if exc.args else 'no such user'}"

    def allows(st, bits: int) -> bool:   # bits among r=4, x=1, as uid/gid (no other groups)
        shift = 6 if st.st_uid == uid else 3 if st.st_gid == gid else 0
        return (st.st_mode >> shift) & bits == bits

    for name in dict.fromkeys([os.path.abspath(exe), os.path.realpath(exe)]):
        parts = Path(name).parts
        for depth in range(1, len(parts)):
            where = Path(*parts[:depth])
            try:
                st = os.stat(where)
            except OSError:
                continue
            if not allows(st, 1):
                return f"{exe}: the agent user {user!r} cannot enter {where} (run as {user!r}; see --agent-user)"
    if not allows(os.stat(exe), 5):
        return f"{exe}: the agent user {user!r} cannot read and run it (see --agent-user)"
    return None


def run_agent(config: AgentConfig, work_dir: Path, hide: Path | None = None) -> AgentOutcome:
    """Run the agent command once in `work_dir`; never raises for the agent's own failures.
    `hide`: a directory above it (the state directory) the agent sees as empty but for its
    work dir, which it reaches by its path even where `hide` is root's 0700."""
    user = _demote(config.user)
    identity = {}
    if user:
        try:
            identity = _identity(user)
        except KeyError as exc:
            return AgentOutcome("failed", f"agent user {user!r}: {exc.args[0] if exc.args else 'unknown'}")
        shutil.chown(work_dir, user=user)
        for path in work_dir.rglob("*"):
            shutil.chown(path, user=user)
    # the agent's HOME, where agent CLIs keep logins and transcripts: no other user reads it
    # (and the agent writes with umask 077, see agent_reaper.py)
    for path in [work_dir, *work_dir.rglob("*")]:
        if not path.is_symlink():
            os.chmod(path, stat.S_IMODE(path.stat().st_mode) & 0o700)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(work_dir),
           "LANG": os.environ.get("LANG", "C.UTF-8"), "HWTUNE_AGENT_WORKDIR": str(work_dir)}
    env.update({k: os.environ[k] for k in config.env_passthrough if k in os.environ})
    argv = [a.replace("{workdir}", str(work_dir)) for a in config.argv]
    # Root keeps this descriptor and reads the log's tail through it: the agent user owns the
    # work dir and may replace agent.log with a link to a file only root can read.
    try:
        os.unlink(work_dir / "agent.log")  # a reused work dir: never open what is there
    except FileNotFoundError:
        pass
    log_fd = os.open(work_dir / "agent.log", os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    log = os.fdopen(log_fd, "w+b")
    started = time.time()
    status_r, status_w = os.pipe2(os.O_CLOEXEC)
    who = [str(identity["user"]), str(identity["group"])] if identity else ["-", "-"]
    # The reaper (trusted, this user) runs the agent and, as a child subreaper, ends whatever the
    # agent started, setsid() helpers included: none lives past the round.
    reaper = [sys.executable, "-I", "-S", "-B", str(REAPER), str(status_w), str(os.getpid()),
              repr(float(config.timeout_s)), str(MAX_AGENT_FILE_BYTES), str(MAX_AGENT_PROCESSES), *who,
              str(hide) if hide else "-", "--", *argv]
    try:
        proc = subprocess.Popen(reaper, cwd=work_dir, env=env, stdin=subprocess.DEVNULL,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                pass_fds=(status_w,))
    except OSError as exc:
        log.close()
        os.close(status_r)
        os.close(status_w)
        return AgentOutcome("failed", f"cannot start {argv[0]!r}: {exc.strerror or exc}")
    os.close(status_w)
    try:
        # the reaper ends the agent at its timeout; the margin covers its start and clean-up
        proc.wait(config.timeout_s + 60)
    except subprocess.TimeoutExpired:
        pass
    finally:
        if proc.returncode is None:   # stopped here (Ctrl-C, SIGTERM): the agent goes first
            _end_reaper(proc)
        raw = os.read(status_r, 4096)
        os.close(status_r)
    try:
        status = json.loads(raw)
    except ValueError:
        status = {"exited": False, "rc": None, "exec_error": None}
    tail = _tail(log)
    log.close()
    # the agent's /tmp (agent_reaper.py): it goes with the round, as a /tmp does; every process
    # that could write it is gone, and rmtree neither follows nor removes through a link
    try:
        shutil.rmtree(work_dir / "tmp")
    except OSError:
        pass
    elapsed = time.time() - started
    isolation = [str(x) for x in status.get("isolation") or []]
    out = _outcome(status, config, argv, tail, elapsed, work_dir, identity)
    out.isolation = isolation
    return out


def _outcome(status: dict, config: AgentConfig, argv, tail: str, elapsed: float, work_dir: Path,
             identity: dict) -> AgentOutcome:
    if status.get("exec_error"):
        return AgentOutcome("failed", f"cannot start {argv[0]!r}: {status['exec_error']}", elapsed_s=elapsed)
    if not status.get("exited"):
        return AgentOutcome("timeout", f"agent killed after {config.timeout_s:g} s", elapsed_s=elapsed)
    rc = status.get("rc")
    if rc != 0:
        return AgentOutcome("failed", f"agent exited {rc}: {tail}", returncode=rc, elapsed_s=elapsed)
    try:
        data = read_candidate(work_dir / CANDIDATE_NAME, identity.get("user"))
    except FileNotFoundError:
        return AgentOutcome("missing", f"agent exited 0 but wrote no {CANDIDATE_NAME}",
                            returncode=rc, elapsed_s=elapsed)
    except PermissionError as exc:
        return AgentOutcome("failed", f"{CANDIDATE_NAME} refused: {exc}", returncode=rc, elapsed_s=elapsed)
    out = AgentOutcome("ok", "", work_dir / CANDIDATE_NAME, rc, elapsed)
    out.data = data
    return out


MAX_CANDIDATE_BYTES = MAX_SOURCE_BYTES   # what the checker would refuse is not read either


def read_candidate(path: Path, owner_uid: int | None) -> bytes:
    """The agent's file, read through one descriptor opened without following links: a regular
    file with one link, owned by the agent user (or by us), at most MAX_CANDIDATE_BYTES. Raises
    FileNotFoundError when absent, PermissionError for anything else."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as exc:  # ELOOP: a symbolic link
        raise PermissionError(f"cannot open without following links ({exc.strerror})") from None
    try:
        st = os.fstat(fd)
        import stat as stat_mod

        if not stat_mod.S_ISREG(st.st_mode):
            raise PermissionError("not a regular file")
        if st.st_nlink != 1:
            raise PermissionError("a hard link to another file")
        allowed = {os.geteuid()} | ({owner_uid} if owner_uid is not None else set())
        if st.st_uid not in allowed:
            raise PermissionError(f"owned by uid {st.st_uid}, not by the agent user")
        if st.st_size > MAX_CANDIDATE_BYTES:
            raise PermissionError(f"larger than {MAX_CANDIDATE_BYTES} bytes")
        chunks, total = [], 0
        while True:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                break
            total += len(chunk)
            if total > MAX_CANDIDATE_BYTES:
                raise PermissionError(f"larger than {MAX_CANDIDATE_BYTES} bytes")
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _tail(log) -> str:
    log.flush()
    size = os.fstat(log.fileno()).st_size
    data = os.pread(log.fileno(), LOG_TAIL_BYTES, max(0, size - LOG_TAIL_BYTES))
    last = data.decode(errors="replace").strip().splitlines()[-1:]
    # the agent's text: printed as a verdict's reason, a terminal control in it (ESC [1A: the
    # line above rewritten) would forge what the search printed
    line = "".join(ch if ch.isprintable() else "?" for ch in last[0]).strip() if last else ""
    return line or "(no output)"


def agent_rounds(loop, config: AgentConfig, *, spec, rounds: int, ceilings, state_dir: Path,
                 baseline_path: Path) -> None:
    """Drive `rounds` agent attempts through the search loop's measure/record (same harness)."""
    from kernelsearch.harness.verdict import Verdict
    from kernelsearch.ledger import file_hash
    from kernelsearch.search import Candidate, OutOfTime

    if config is None:
        raise ValueError("strategy 'agent' needs an agent command (--agent-command)")
    state_dir = Path(state_dir)
    keep_dir = state_dir / "candidates"
    keep_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    warned = False
    for i in range(rounds):
        if loop.deadline is not None and time.monotonic() >= loop.deadline:
            raise OutOfTime(f"{rounds - i} agent round(s) not started")
        work_dir = state_dir / "agent" / loop.run_id / f"round-{i + 1}"
        write_context_pack(
            work_dir, kernel=loop.kernel, spec=spec, shapes=loop.shapes, dtype=loop.dtype,
            device=loop.device, fingerprint=loop.fingerprint, ceilings=ceilings,
            ledger_summary=loop.ledger.summary(kernel=loop.kernel, fingerprint=loop.fingerprint_id),
            recent_attempts=loop.ledger.attempts(kernel=loop.kernel, fingerprint=loop.fingerprint_id,
                                                 limit=40),
            best=loop.best_so_far(), baseline_path=baseline_path, model_family=config.model_family)
        loop.progress(f"agent round {i + 1}/{rounds}: {' '.join(config.argv)} in {work_dir}")
        round_config = config
        if loop.deadline is not None and loop.deadline - time.monotonic() < config.timeout_s:
            # the search's time limit bounds a round as well as when rounds start
            round_config = dataclasses.replace(config, timeout_s=max(0.1, loop.deadline - time.monotonic()))
        outcome = run_agent(round_config, work_dir, hide=state_dir)
        if not warned and not any(i.startswith("mount(read-only but") for i in outcome.isolation):
            # not root without user namespaces (or a unit that forbids them): nothing holds it
            warned = True
            who = _demote(config.user) or "this user"
            loop.progress(f"warning: the agent ran without its namespaces "
                          f"({', '.join(outcome.isolation) or 'none could be made here'}): it has "
                          f"{who}'s rights on the whole host (state directory, other processes, /tmp)")
        if outcome.status == "timeout" and round_config is not config:
            outcome.reason = f"agent killed at the search's time limit ({outcome.reason})"
        if outcome.status != "ok":
            # no file to judge: record the agent's failure itself, once per shape
            ghost = Candidate(work_dir / CANDIDATE_NAME, f"agent-{outcome.status}-{i + 1}", {},
                              {"path": str(work_dir / CANDIDATE_NAME)})
            loop.candidates[ghost.ident] = ghost
            loop.memo.setdefault(ghost.ident, {})
            loop.record(ghost, loop.shapes, Verdict(accepted=False, guard="agent", reason=outcome.reason,
                                                    kernel=loop.kernel), time.time())
            continue
        import hashlib

        digest = hashlib.sha256(outcome.data).hexdigest()[:16]
        kept = keep_dir / f"{loop.kernel}-{digest}.py"
        if not kept.exists():
            fd = os.open(kept, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(outcome.data)
        if file_hash(kept) != digest:
            raise RuntimeError(f"{kept}: kept candidate does not match what the agent wrote")
        loop.measure([Candidate(kept, digest, {}, {"path": str(kept)})])
