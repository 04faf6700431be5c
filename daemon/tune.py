"""The nested tuning cycle behind `hwtune tune`.

Outer loop: hwtune.hwloop over power limit x locked SM clocks, every point applied through
the engine (plan -> journal -> apply -> read back) and scored by a measured objective:
  - simulated host: the calibrated model in hwtune.backends.simperf, evaluated at the
    settings *read back from the host* after the apply (so the write path is exercised);
    every number is labelled "simulated";
  - GPU host: a decode-style bf16 GEMV (8192 x 28672, the weight-streaming shape of a decode
    step) timed with CUDA events, energy from NVML's counter.
Inner loop: the kernel search (`hwtune search KERNEL`, a child process) at the chosen point;
on a host without a GPU under the Triton interpreter (--device cpu) with a small budget.

While it runs, STATE_DIR/tuning.json names this process: the daemon pauses drift re-apply
and, on a thermal / power brake / XID event, sends SIGTERM, which makes this cycle stop at
the next safe point and restore the settings it started from. The cycle also checks the
telemetry itself after every measurement. At the end the best point is kept (journaled, so
`hwtune rollback` undoes it; STATE_DIR/tuned-profile.yaml records it for the daemon) or the
starting settings are restored (--restore).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from hwtune import hwloop
from hwtune.errors import HwtuneError, LockBusyError, PendingJournalError, UsageError
from hwtune.signals import Interrupted
from hwtune.signals import name as signal_name
from hwtune.hwloop import AbortSearch, Objective, Point, Space

TUNING_MARKER = "tuning.json"
LAST_TUNE_FILE = "last_tune.json"
TUNED_PROFILE = "tuned-profile.yaml"
TUNE_LOCK = "tune.lock"  # flock held by the live tune's hardware loop


def _stderr(line: str) -> None:
    print(f"hwtune tune: {line}", file=sys.stderr, flush=True)


@dataclass
class TuneOptions:
    objective: str = "energy"
    floor: float = 0.98
    budget: int = 12
    exhaustive: bool = False
    workload: str = "decode"
    kernels: tuple = ("rmsnorm",)
    kernel_budget: str = "2"
    keep: bool = True
    gpus: tuple | None = None
    nightly: bool = False


# -- measuring a point -----------------------------------------------------------------------

def sim_measure(host, gpus: list[int], workload: str):
    """Score a point with the simulated model at the settings the host reports now."""
    from hwtune.backends import simperf

    def measure(point: Point) -> dict:
        rows = []
        for i in gpus:
            lock = host.gpus.simulated_sm_lock_mhz(i)
            settings = simperf.Settings(power_limit_w=float(host.gpus.get_power_limit_w(i)),
                                        sm_clock_mhz=tuple(lock) if isinstance(lock, (tuple, list)) else None)
            rows.append(simperf.run(workload, settings))
        n = len(rows)
        tps = sum(r.tokens_per_s for r in rows) / n
        power = sum(r.power_w for r in rows) / n
        return {"tokens_per_s": tps, "tokens_per_j": tps / power, "power_w": power,
                "sm_clock_mhz": sum(r.sm_clock_mhz for r in rows) / n,
                "throttle": rows[0].throttle, "source": simperf.SIMULATED_LABEL}
    return measure


def gpu_measure(host, gpus: list[int], seconds: float = 2.0):
    """Decode-style GEMV on the first selected GPU: tokens/s = GEMVs/s, energy from NVML.
    Imports torch only here, on a GPU host."""
    import torch

    i = gpus[0]
    dev = torch.device(f"cuda:{i}")
    w = torch.randn(28672, 8192, dtype=torch.bfloat16, device=dev)
    x = torch.randn(8192, 1, dtype=torch.bfloat16, device=dev)
    out = torch.empty(28672, 1, dtype=torch.bfloat16, device=dev)

    def measure(point: Point) -> dict:
        for _ in range(20):
            torch.matmul(w, x, out=out)
        torch.cuda.synchronize(dev)
        e0 = host.gpus.telemetry(i).get("energy_mj")
        t0, n = time.perf_counter(), 0
        while time.perf_counter() - t0 < seconds:
            for _ in range(50):
                torch.matmul(w, x, out=out)
            torch.cuda.synchronize(dev)
            n += 50
        dt = time.perf_counter() - t0
        t = host.gpus.telemetry(i)
        joules = (t["energy_mj"] - e0) / 1000.0 if e0 is not None and t.get("energy_mj") is not None else None
        tps = n / dt
        return {"tokens_per_s": tps, "tokens_per_j": (n / joules) if joules else 0.0,
                "power_w": (joules / dt) if joules else t.get("power_w"), "sm_clock_mhz": t.get("sm_clock_mhz"),
                "source": "measured: bf16 GEMV 8192x28672 on " + host.gpus.info(i).get("name", f"gpu{i}")}
    return measure


# -- safety ----------------------------------------------------------------------------------

class Guard:
    """Stops the search at a safe point after SIGTERM or a safety event in the telemetry."""

    def __init__(self, host, gpus: list[int], max_temperature_c: float, restore_on, log, marker=None):
        from daemon.service import safety_events

        self.host, self.gpus, self.max_t, self.restore_on, self.log = host, gpus, max_temperature_c, restore_on, log
        self.marker = marker
        self._events = safety_events
        self.stop_reason: str | None = None
        self.last_xid = {}
        for i in gpus:
            self.last_xid[i] = self.host.gpus.telemetry(i).get("xid_errors")

    def on_sigterm(self, signum, frame) -> None:
        self.stop_reason = f"asked to stop ({signal_name(signum)})"

    def check(self) -> None:
        if self.marker is not None:
            self.marker.renew()  # still alive: the daemon keeps its drift checks paused
        if self.stop_reason:
            raise AbortSearch(self.stop_reason)
        for i in self.gpus:
            t = self.host.gpus.telemetry(i)
            for event, why in self._events(t, self.max_t, self.last_xid.get(i)):
                if event in self.restore_on:
                    self.stop_reason = f"gpu{i} {event}: {why}"
                    raise AbortSearch(self.stop_reason)


# -- the cycle -------------------------------------------------------------------------------

def _select_gpus(host, wanted) -> list[int]:
    n = host.gpus.count() if host.gpus is not None else 0
    if n == 0:
        raise UsageError(f"no GPUs to tune ({host.gpu_error or 'none found'}); "
                         "use --sim HOST.json for the simulated host")
    gpus = list(range(n)) if not wanted else list(wanted)
    for i in gpus:
        if not 0 <= i < n:
            raise UsageError(f"--gpus {i}: no such GPU (this host has {n})")
    return gpus


def _write_json(path: Path, data) -> None:
    from hwtune import statefile

    statefile.ensure_dir(path.parent)
    statefile.write_json(path, data)


def _write_yaml(path: Path, data: dict, comment: str) -> None:
    import yaml

    from hwtune.backends import write_text_atomic

    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, f"{comment}\n" + yaml.safe_dump(data, sort_keys=False, default_flow_style=None))


CHILD_STOP_S = 30  # within hwtune-retune.service's TimeoutStopSec=2min


def _run_streaming(cmd, cwd, env, timeout_s: float, echo) -> tuple[int, str, str]:
    """Run `cmd`, passing each stderr line to `echo` as it comes (a search's progress), and
    return (exit code, stdout, stderr). TimeoutExpired after `timeout_s`, the child killed."""
    import threading

    p = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out: list[str] = []
    err: list[str] = []

    def read_err():
        for line in p.stderr:
            err.append(line)
            echo(line.rstrip("\n"))

    readers = [threading.Thread(target=lambda: out.append(p.stdout.read()), daemon=True),
               threading.Thread(target=read_err, daemon=True)]
    for t in readers:
        t.start()
    try:
        rc = p.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        raise
    except BaseException:
        # A signal ending the tune (SIGTERM, SIGHUP, Ctrl-C) must not leave the child searching
        # on its own: `hwtune search` stops on SIGTERM as on Ctrl-C (workers stopped, its table
        # and ledger writes rolled back); killed if it does not, or if another signal comes.
        try:
            p.terminate()
            p.wait(timeout=CHILD_STOP_S)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        raise
    finally:
        for t in readers:
            t.join(timeout=5)
    return rc, "".join(out), "".join(err)


def run_kernels(ctx, kernels, device: str, budget: str, log) -> list[dict]:
    """The inner loop at the chosen point: `hwtune search KERNEL` in a child process."""
    rows = []
    for kernel in kernels:
        # absolute: the search runs from the checkout (--sim host.json's state is host.json.state here)
        cmd = [sys.executable, "-m", "daemon.cli", "--state-dir", str(Path(ctx.state_dir).resolve()), "search", kernel,
               "--device", device, "--budget", budget, "--json"]
        log(f"kernel search: {kernel} on {device} (budget {budget})")
        env = dict(os.environ)
        if device == "cpu":
            env["TRITON_INTERPRET"] = "1"
        root = Path(__file__).resolve().parents[1]
        env["PYTHONPATH"] = str(root) + os.pathsep + env.get("PYTHONPATH", "")
        t0 = time.monotonic()
        try:
            rc, stdout, stderr = _run_streaming(cmd, root, env, timeout_s=1800,
                                                echo=lambda line: log(f"  {kernel}: {line}"))
        except subprocess.TimeoutExpired:
            rows.append({"kernel": kernel, "device": device, "ok": False, "error": "timed out"})
            continue
        row = {"kernel": kernel, "device": device, "ok": rc == 0, "rc": rc,
               "seconds": round(time.monotonic() - t0, 1)}
        try:
            row["result"] = json.loads(stdout) if stdout.strip() else None
        except ValueError:
            row["result"] = None
        if rc != 0:
            row["error"] = (stderr.strip().splitlines() or ["(no output)"])[-1]
            log(f"kernel search {kernel}: failed ({row['error']})")
        rows.append(row)
    return rows


def dead_tune_restorer(host, state_dir, log):
    """`on_dead` for daemon.marker.live_tuner: a tune that died (kill -9, a crash) left the host
    at one of its trial points, and its marker names the settings it started from, on which GPUs.
    Put them back (the next tune would otherwise measure from the trial point as its baseline,
    and a daemon without a profile would hold it). True: done, or nothing to restore (the marker
    may go); False: not now (read-only, or another writer holds the lock), the marker stays."""
    def restore(record: dict) -> bool:
        start, gpus, lo = record.get("baseline"), record.get("gpus"), record.get("sm_clock_min_mhz")
        ints = lambda *v: all(isinstance(x, int) and not isinstance(x, bool) for x in v)
        if not (isinstance(start, dict) and isinstance(gpus, list) and gpus and ints(*gpus) and ints(lo)):
            return True   # a marker that names no starting settings: nothing to put back
        values = [start.get(k) for k in ("power_limit_w", "sm_clock_max_mhz", "sm_clock_min_mhz")]
        if not (ints(values[0]) and all(v is None or ints(v) for v in values[1:])):
            return True
        point = Point(*values)
        who = f"pid {record.get('pid')}'s tune"
        if host.read_only:
            log(f"{who} ended without restoring its starting settings ({point.label()}); read-only: "
                "not restored here")
            return False
        applier = hwloop.HostApplier(host, state_dir, gpus, lo)
        try:
            if applier.baseline() == point:
                return True
            log(f"{who} ended at a trial point without restoring: putting its starting settings back "
                f"({point.label()}, GPU {', '.join(map(str, gpus))})")
            applier(point, on_signal="finish")
        except LockBusyError:
            return False
        except (HwtuneError, IndexError, ValueError) as exc:
            log(f"could not put back {who}'s starting settings ({point.label()}): {exc}; "
                "`hwtune rollback` restores the settings from before hwtune")
        return True

    return restore


def tune(ctx, opts: TuneOptions, log=_stderr) -> dict:
    """Run the cycle; returns the JSON report."""
    from hwtune import engine

    host = ctx.open_host()
    gpus = _select_gpus(host, opts.gpus)
    if not host.read_only:
        ctx.ensure_state_dir()  # bad input (exit 2), said before a word about tuning
    space = Space.from_host(host, gpus)
    objective = Objective(opts.objective, opts.floor)
    simulated = host.kind == "sim"
    state_dir = Path(ctx.state_dir)
    source = "simulated" if simulated else "measured"
    report: dict = {"host": host.kind, "source": source, "gpus": gpus, "objective": opts.objective,
                    "floor": opts.floor, "budget": opts.budget, "workload": opts.workload if simulated else "gemv",
                    "space": space.to_json()}
    if simulated:
        log("simulated host: every number below comes from the calibrated H200 model (simperf), not a GPU")

    if host.read_only:
        # Refuse to write; on the sim the model can still say what tuning would find.
        report["read_only"] = True
        log("read-only: nothing will be written; reporting what tuning would do")
        if simulated:
            from hwtune.backends import simperf

            def predict(point):
                lock = (space.sm_clock_min_mhz, point.sm_clock_max_mhz) if point.sm_clock_max_mhz else None
                r = simperf.run(opts.workload, simperf.Settings(point.power_limit_w, lock))
                return {"tokens_per_s": r.tokens_per_s, "tokens_per_j": r.tokens_per_j, "power_w": r.power_w,
                        "source": simperf.SIMULATED_LABEL + ", predicted"}
            res = hwloop.search(space, predict, lambda p: None, objective, opts.budget, "boundary", log)
            report["search"] = res.to_json()
            report["would_keep"] = res.best.point.to_json() if res.best else None
        return report

    from daemon.marker import Marker, live_tuner
    from hwtune.lock import WriterLock

    # Held for the whole hardware loop: the marker alone is check-then-write, and two tunes
    # started together both found none, then tried each other's points and measured them.
    claim = WriterLock(state_dir, name=TUNE_LOCK)
    try:
        claim.__enter__()
    except LockBusyError:
        other = live_tuner(state_dir)
        raise LockBusyError(f"{f'pid {other}' if other else 'another hwtune tune'} is already tuning "
                            f"({state_dir / TUNE_LOCK})") from None
    try:
        if engine.pending_journal(state_dir) is not None:
            raise PendingJournalError(f"an interrupted apply left a journal in {state_dir}; "
                                      "run `hwtune rollback` (or start the daemon) first")
        problems = engine.journal_problems(host, state_dir)
        if problems:  # every point would be refused by apply: say it once, before the first
            raise PendingJournalError(f"{engine.journal_blocked(state_dir, problems)}; tune refused until then")
        _check_marker_readable(ctx, state_dir)
        other = live_tuner(state_dir, on_dead=dead_tune_restorer(host, state_dir, log))
        if other is not None:
            raise LockBusyError(f"pid {other} is already tuning ({state_dir / TUNING_MARKER})")
        if (state_dir / TUNING_MARKER).exists():
            # kept: the dead tune's starting settings could not be put back yet; measured
            # from here, its trial point would become this tune's baseline
            raise LockBusyError(f"a tune that died left {state_dir / TUNING_MARKER}, and its starting "
                                "settings could not be restored yet; try again")
        marker = Marker(state_dir, objective=opts.objective)

        from daemon.config import Config, load_config

        config = Config()
        if opts.nightly and ctx.config_path is not None:
            config = load_config(ctx.config_path)
        base_profile = config.profile or _daemon_base_profile(state_dir)
        guard = Guard(host, gpus, config.thermal.max_temperature_c, config.restore_on, log, marker)
        applier = hwloop.HostApplier(host, state_dir, gpus, space.sm_clock_min_mhz, log=lambda s: None)
        baseline = applier.baseline()
        for i in gpus[1:]:   # each point, and the restore, sets every selected GPU alike
            other = applier.baseline_of(i)
            if other != baseline:
                raise UsageError(f"gpu{i} starts from {other.label()}, gpu{gpus[0]} from {baseline.label()}: a tune "
                                 "sets every GPU alike and would put them all back at the latter; tune them "
                                 "one at a time (--gpus N) or give them one setting first; nothing was written")
        report["baseline"] = baseline.to_json()
        # what to put back should this process die at a trial point (dead_tune_restorer)
        marker.extra.update(baseline=baseline.to_json(), gpus=list(gpus), sm_clock_min_mhz=space.sm_clock_min_mhz)
        measure_fn = sim_measure(host, gpus, opts.workload) if simulated else gpu_measure(host, gpus)

        def apply_point(point: Point) -> None:
            guard.check()
            _waiting_for_the_lock(applier, point, stop=guard.check)

        def restore(point: Point) -> None:
            _waiting_for_the_lock(applier, point, on_signal="finish")

        def measure(point: Point) -> dict:
            guard.check()
            m = measure_fn(point)
            guard.check()
            return m

        old_term = signal.signal(signal.SIGTERM, guard.on_sigterm)
        old_hup = signal.signal(signal.SIGHUP, guard.on_sigterm)  # a dropped session: restore, too
        marker.write()
        keep_marker = False
        t0 = time.monotonic()
        try:
            result = hwloop.search(space, measure, apply_point, objective, opts.budget, "boundary", log)
            report["search"] = result.to_json()
            if opts.exhaustive and not result.aborted:
                log(f"exhaustive sweep of the same space ({len(space.points())} points) for comparison")
                full = hwloop.search(space, measure, apply_point, objective, opts.budget, "exhaustive",
                                     lambda s: None)
                report["exhaustive"] = full.to_json()
                # A stop during the comparison sweep (SIGTERM, a safety event) stops the tune too.
                result.aborted = result.aborted or full.aborted
            # Safety first: after an abort the starting settings come back regardless of --keep;
            # so does a SIGTERM that came after the last check of the search.
            result.aborted = result.aborted or guard.stop_reason
            kept = hwloop.finish(result, lambda p: _waiting_for_the_lock(applier, p), baseline,
                                 opts.keep and not result.aborted, log)
            if guard.stop_reason and kept != baseline:
                # Asked to stop while the kept point was written (the signal was held until the
                # apply was done): put the starting settings back, as after any other stop.
                result.aborted = guard.stop_reason
                kept = hwloop.finish(result, restore, baseline, False, log)
            report["kept"] = kept.to_json()
            report["aborted"] = result.aborted
            # Written before the marker goes: the daemon must learn the kept point before it
            # checks drift again, or it would put its profile back over it.
            _record(state_dir, report, result, kept, baseline, gpus, space, opts, source, base_profile)
        except BaseException:
            # Whatever went wrong, leave the host where it started; a signal during this restore
            # is held until it is done (on_signal="finish").
            try:
                hwloop.finish(hwloop.SearchResult("boundary", objective, space, aborted="error"),
                              restore, baseline, False, log)
            except Interrupted:
                pass  # restored; the signal that came meanwhile changes nothing more
            except HwtuneError as exc:
                # The marker stays: once this process has ended, the daemon (or the next tune)
                # puts the starting settings back (dead_tune_restorer).
                keep_marker = True
                log(f"could not restore {baseline.label()}: {exc}; to restore the settings from before "
                    f"hwtune: {ctx.command('rollback')}")
            raise
        finally:
            signal.signal(signal.SIGTERM, old_term)
            signal.signal(signal.SIGHUP, old_hup)
            if not keep_marker:
                marker.remove()
    finally:
        claim.__exit__(None, None, None)
    report["seconds"] = round(time.monotonic() - t0, 2)

    if opts.kernels and not result.aborted:
        device = "cuda" if not simulated and _has_cuda() else "cpu"
        report["kernels"] = _kernel_phase(ctx, opts, device, kept, baseline, log)
    return report


LOCK_WAIT_S = 60  # as the daemon at start: a shell's apply or the daemon's re-apply ends well within


def _waiting_for_the_lock(applier, point: Point, on_signal: str = "undo", stop=lambda: None) -> None:
    """Apply `point`, waiting for another writer (the daemon's re-apply or restore, a shell's
    `hwtune apply`) to release the lock: a point or a restore given up on 'lock busy' would
    leave the host at whatever trial point it was at. `stop` may raise to give up waiting (a
    trial point is not worth waiting for after SIGTERM)."""
    deadline = time.monotonic() + LOCK_WAIT_S
    attempt = 0
    while True:
        try:
            applier(point, on_signal=on_signal)
            return
        except LockBusyError:
            if time.monotonic() >= deadline:
                raise
            stop()
            attempt += 1
            time.sleep(min(0.1 * attempt, 1.0))


class _Stop(BaseException):
    pass


def _kernel_phase(ctx, opts, device, kept, baseline, log) -> list:
    """The inner loop. An interrupt here (Ctrl-C, SIGTERM, SIGHUP) leaves the kept point in
    place, journaled, and says exactly how to undo it."""
    def stop(signum, frame):
        raise _Stop(signum)

    old = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        return run_kernels(ctx, opts.kernels, device, opts.kernel_budget, log)
    except (KeyboardInterrupt, _Stop) as exc:
        signo = exc.args[0] if isinstance(exc, _Stop) else signal.SIGINT
        left = (f"the point the tune kept ({kept.label()}) stays applied and journaled"
                if kept != baseline else "the settings are the ones the tune started from")
        hint = f"; to restore the settings from before hwtune: {ctx.command('rollback')}" if kept != baseline else ""
        raise Interrupted(signo, f"interrupted by {signal_name(signo)} during the kernel search: {left}{hint}") from None
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _check_marker_readable(ctx, state_dir: Path) -> None:
    """A marker no tune can read (damaged, a link, another user's) names no starting settings
    to put back, and waiting does not change that: UsageError saying what to do, not 'try again'."""
    from hwtune import statefile

    try:
        statefile.read_json(state_dir / TUNING_MARKER, "tuning marker")
    except statefile.StateError as exc:
        raise UsageError(f"{exc}; it would name the settings a tune that died started from: if the host is "
                         f"not as it should be, {ctx.command('rollback')} restores the settings from before "
                         "hwtune; then remove it") from None


def _daemon_base_profile(state_dir: Path) -> str | None:
    """The configured profile of the daemon running on this state directory, if any: its
    daemon.json must be trusted and name the live daemon (pid and start time)."""
    from daemon.marker import matches
    from hwtune import statefile

    try:
        info = statefile.read_json(state_dir / "daemon.json", "daemon runtime file")
    except statefile.StateError:
        return None
    if not isinstance(info, dict) or not isinstance(info.get("pid"), int) or matches(info, info["pid"]):
        return None
    base = info.get("base_profile")
    return base if isinstance(base, str) else None


def _record(state_dir, report, result, kept, baseline, gpus, space, opts, source, base_profile) -> None:
    """STATE_DIR/tuned-profile.yaml (the kept point on top of the daemon's profile) and
    STATE_DIR/last_tune.json (what the daemon exports and adopts)."""
    best = result.best
    tuned = state_dir / TUNED_PROFILE
    if kept != baseline and best is not None:
        profile = {"description": f"kept by hwtune tune ({opts.objective}, {source})",
                   **({"include": [base_profile]} if base_profile else {}),
                   "gpu": kept.gpu_section(gpus, space.sm_clock_min_mhz)}
        _write_yaml(tuned, profile, f"# {TUNED_PROFILE}: the point `hwtune tune` kept ({opts.objective}, "
                                    f"{source}); `hwtune rollback` undoes it")
        report["tuned_profile"] = str(tuned)
    kept_profile = report.get("tuned_profile")
    if kept_profile is None and kept == baseline:
        # Left where it started: a point an earlier tune kept (the daemon holds it) stays the one
        # to hold; null here would make the daemon's next start drop it for the bare profile.
        kept_profile = _earlier_kept_profile(state_dir, base_profile)
    objective_value = None
    if best is not None and best.metrics:
        objective_value = best.metrics["tokens_per_j" if opts.objective == "energy" else "tokens_per_s"]
    _write_json(state_dir / LAST_TUNE_FILE, {
        "timestamp_s": time.time(), "objective": objective_value, "ok": not result.aborted,
        "source": source, "kept": kept.to_json(), "kept_profile": kept_profile,
        "base_profile": base_profile})


def _earlier_kept_profile(state_dir: Path, base_profile) -> str | None:
    """The tuned profile the last record names, when kept on top of the same base profile and
    still there (both trusted state files)."""
    from hwtune import statefile

    try:
        last = statefile.read_json(state_dir / LAST_TUNE_FILE, "last tune record")
        path = last.get("kept_profile") if isinstance(last, dict) else None
        if (not isinstance(path, str) or last.get("base_profile") != base_profile
                or Path(path).resolve() != (state_dir / TUNED_PROFILE).resolve()
                or statefile.read_bytes(path, "tuned profile") is None):
            return None
    except statefile.StateError:
        return None
    return path


def _has_cuda() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except Exception:
        return False


# -- report ----------------------------------------------------------------------------------

def summary(report: dict) -> dict:
    """Headline numbers: best vs stock, evaluations, and vs the exhaustive best."""
    s = report.get("search") or {}
    ref = (s.get("reference") or {}).get("metrics") or {}
    best = (s.get("best") or {}).get("metrics") or {}
    out = {"evaluations": s.get("evaluations_used"), "best": (s.get("best") or {}).get("label")}
    if ref and best:
        out["tokens_per_j_vs_stock"] = best["tokens_per_j"] / ref["tokens_per_j"] if ref.get("tokens_per_j") else None
        out["tokens_per_s_vs_stock"] = best["tokens_per_s"] / ref["tokens_per_s"]
    ex = report.get("exhaustive")
    if ex and ex.get("best") and best:
        eb = ex["best"]["metrics"]
        out["exhaustive_evaluations"] = ex["evaluations_used"]
        out["exhaustive_best"] = ex["best"]["label"]
        key = "tokens_per_j" if report["objective"] == "energy" else "tokens_per_s"
        out["found_vs_exhaustive"] = best[key] / eb[key]
    return out


def row_marks(report: dict) -> list[str]:
    """The status shown per evaluation: a point measured fine but under the throughput floor
    is not "ok" for an energy objective (it cannot be kept), so it says so."""
    s = report.get("search") or {}
    stock_tps = ((s.get("reference") or {}).get("metrics") or {}).get("tokens_per_s")
    best = (s.get("best") or {}).get("label")
    marks = []
    for e in s.get("evaluations", []):
        m = e.get("metrics") or {}
        status = e["status"]
        if e["status"] == "ok" and report.get("objective") == "energy" and stock_tps:
            share = m.get("tokens_per_s", 0.0) / stock_tps
            if share < report["floor"]:
                status = f"below floor ({share:.1%} of stock tokens/s)"
        if e["status"] == "ok" and e["label"] == best:
            status += ", best"
        marks.append(status)
    return marks


def format_table(report: dict) -> str:
    s = report.get("search") or {}
    goal = (f"floor {report['floor']:.0%} of stock tokens/s" if report["objective"] == "energy"
            else "most tokens/s")
    lines = [f"hwtune tune ({report['source']}, objective {report['objective']}, {goal}, GPUs {report['gpus']})",
             f"{'#':>3}  {'point':28s} {'tokens/s':>10} {'tokens/J':>9} {'power W':>8}  status"]
    for n, (e, mark) in enumerate(zip(s.get("evaluations", []), row_marks(report)), 1):
        m = e.get("metrics") or {}
        lines.append(f"{n:>3}  {e['label']:28s} {m.get('tokens_per_s', float('nan')):10.1f} "
                     f"{m.get('tokens_per_j', float('nan')):9.3f} {m.get('power_w') or float('nan'):8.0f}  "
                     f"{mark}")
    sm = summary(report)
    if sm.get("tokens_per_j_vs_stock") is not None:
        lines.append(f"best: {sm['best']}: {sm['tokens_per_j_vs_stock']:.3f}x tokens/J, "
                     f"{sm['tokens_per_s_vs_stock']:.1%} of stock tokens/s, in {sm['evaluations']} evaluations")
    if "exhaustive_best" in sm:
        lines.append(f"exhaustive ({sm['exhaustive_evaluations']} evaluations): {sm['exhaustive_best']}; "
                     f"found/exhaustive = {sm['found_vs_exhaustive']:.3f}")
    if report.get("kept"):
        lines.append(f"left at: {Point(**report['kept']).label()}"
                     + (" (kept, journaled: `hwtune rollback` undoes it)" if report["kept"] != report.get("baseline")
                        else " (the starting settings)"))
    if report.get("aborted"):
        lines.append(f"ABORTED: {report['aborted']}; starting settings restored")
    for k in report.get("kernels") or []:
        lines.append(f"kernel {k['kernel']} ({k['device']}): {'ok' if k['ok'] else 'failed: ' + k.get('error', '')}")
    if report.get("read_only"):
        lines.append("read-only: nothing was written" + ("; would keep " + Point(**report["would_keep"]).label()
                                                          if report.get("would_keep") else ""))
    return "\n".join(lines)
