"""The service loop behind `hwtune daemon`.

Start: restore a journal an interrupted apply left (engine.rollback, logged), apply the
configured profile, start the metrics endpoint, then READY=1. Watch every poll_interval_s:
per GPU telemetry and the profile's drift (engine.verify). Drift is re-applied, at most once
per reapply_min_interval_s. WATCHDOG=1 goes out at half of WATCHDOG_USEC; STATUS= says what
the daemon is doing. Without NOTIFY_SOCKET nothing is sent and everything else is the same.

Safety. A *tuning step* is either
  - the daemon's own apply, until PROBATION_POLLS clean polls have followed it, or
  - another process tuning: a live `hwtune tune` named in STATE_DIR/tuning.json, or another
    process holding the writer lock (the pid written in the lock file).
A thermal event (temperature >= thermal.max_temperature_c, or the SW/HW thermal slowdown
bits), a power brake (HW power brake bit) or a new XID during a tuning step restores the last
known-good settings within this poll and is recorded (log + hwtune_restore_total{reason}):
  - own step: engine.rollback (the journal's originals, i.e. the host before hwtune); the
    profile stays suspended (no drift re-apply) until SIGHUP or a restart;
  - another process: SIGTERM to it; `hwtune tune` restores the settings it started from (the
    daemon's known-good) and exits.
Outside a tuning step such an event is only logged (the settings were already known good).

Signals: SIGTERM/SIGINT stop (rollback: on_exit -> a live tune is asked to stop first, then
engine.rollback; never -> keep); SIGHUP
reloads the config and profile and lifts a suspension.

The watch path imports no torch: only hwtune (engine, backends), prometheus_client and the
standard library.
"""
from __future__ import annotations

import os
import selectors
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from daemon.config import Config, load_config
from daemon.notify import Notifier, watchdog_interval_s
from hwtune.errors import HwtuneError, LockBusyError, UsageError

THERMAL_BITS = 0x20 | 0x40      # SW thermal slowdown, HW thermal slowdown
POWER_BRAKE_BITS = 0x80         # HW power brake slowdown
PROBATION_POLLS = 2
TUNING_MARKER = "tuning.json"   # written by daemon/tune.py while a tuning cycle runs
RUNTIME_FILE = "daemon.json"    # pid and metrics port of the running daemon
DAEMON_LOCK = "daemon.lock"     # flock held by the running daemon (not --once, not read-only)
LAST_TUNE_FILE = "last_tune.json"
START_LOCK_WAIT_S = 60          # at start, wait this long for a live apply to release the lock
STOP_LOCK_WAIT_S = 10           # at stop (rollback: on_exit), this long
STOP_TUNE_WAIT_S = 60           # at stop (rollback: on_exit), for a live tune to restore and end


def _stderr(line: str) -> None:
    print(f"hwtune daemon: {line}", file=sys.stderr, flush=True)


def _lock_held_by_other(state_dir: Path) -> int | None:
    """Pid of another process holding the writer lock, read without touching the lock: the
    flock is visible in /proc/locks by device and inode (probing it with flock would make a
    concurrent writer fail with 'lock busy'). The pid comes from /proc/locks, not from the
    lock file: a new holder truncates the file before it writes its pid, and a released lock
    leaves the last holder's pid behind. -1: held, but by a pid this namespace cannot see."""
    path = state_dir / "lock"
    try:
        st = os.stat(path)
        with open("/proc/locks") as fh:
            locks = fh.read().splitlines()
    except OSError:
        return None
    # /proc/locks: "1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF" (major:minor in hex)
    want = (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)
    for parts in (line.split() for line in locks):
        if len(parts) < 6 or parts[1] != "FLOCK":
            continue  # "->" lines are waiters, not holders
        try:
            major, minor, ino = parts[5].split(":")
            if (int(major, 16), int(minor, 16), int(ino)) != want:
                continue
            pid = int(parts[4])
        except ValueError:
            continue
        if pid == os.getpid():
            return None
        return pid if pid > 0 else -1
    return None


def tuning_pid(state_dir: Path, log=None, on_dead=None) -> int | None:
    """Pid of a live tuning cycle (STATE_DIR/tuning.json, its identity checked: daemon.marker)
    or of another lock holder. `on_dead`: see daemon.marker.live_tuner."""
    from daemon.marker import live_tuner

    pid = live_tuner(state_dir, log, on_dead)
    if pid is not None:
        return pid
    return _lock_held_by_other(state_dir)


def safety_events(telemetry: dict, max_temperature_c: float, last_xid: int | None) -> list[tuple[str, str]]:
    """(event, why) pairs in one GPU's telemetry: thermal, power_brake, xid."""
    events = []
    temp = telemetry.get("temperature_c")
    reasons = int(telemetry.get("clock_event_reasons") or 0)
    if temp is not None and temp >= max_temperature_c:
        events.append(("thermal", f"{temp} C >= {max_temperature_c:g} C"))
    elif reasons & THERMAL_BITS:
        events.append(("thermal", f"clock event reasons 0x{reasons:x} (thermal slowdown)"))
    if reasons & POWER_BRAKE_BITS:
        events.append(("power_brake", f"clock event reasons 0x{reasons:x} (HW power brake)"))
    xid = telemetry.get("xid_errors")
    if xid is not None and last_xid is not None and int(xid) > last_xid:
        events.append(("xid", f"XID errors {last_xid} -> {xid}"))
    return events


@dataclass
class State:
    profile: object | None = None
    profile_name: str | None = None
    probation: int = 0                 # clean polls still needed after the daemon's own apply
    suspended: str | None = None       # why the profile is not kept applied
    last_apply: float = -1e18
    last_xid: dict = field(default_factory=dict)
    active: dict = field(default_factory=dict)     # gpu -> set of events currently seen
    signalled: set = field(default_factory=set)    # (pid, event) already asked to restore
    drift: int = 0
    last_tune_mtime: float | None = None
    profile_tune_mtime: float = 0.0  # last_tune.json's mtime when the profile was chosen
    resume_when_clear: bool = False  # a reload came during a safety event: apply once it clears
    pending: bool = False            # read-only: an interrupted apply's journal stands, unrestored
    tuned: bool = False              # the profile held is the point hwtune tune kept


class Service:
    def __init__(self, ctx, config_path: Path | None = None, once: bool = False, log=_stderr,
                 notifier: Notifier | None = None):
        self.ctx = ctx
        self.config_path = config_path if config_path is not None else ctx.config_path
        self.once = once
        self.log = log
        self.notifier = notifier or Notifier.from_env()
        self.state_dir = Path(ctx.state_dir)
        self.state = State()
        self.config = Config()
        self.host = None
        self.metrics = None
        self._status = None
        self._stop = False
        self._reload = False
        self._wake_r = self._wake_w = None
        self._said: set = set()
        self._notify_failed = False
        self._rate_limited: str | None = None  # the drift last said to be rate-limited
        self._claim = None
        self._telemetry_error: dict[int, str] = {}  # gpu -> the error last said

    # -- helpers ---------------------------------------------------------------------------
    def _log_once(self, line: str) -> None:
        if line not in self._said:
            self._said.add(line)
            self.log(line)

    def status(self, text: str) -> None:
        if text != self._status:
            self._status = text
            self._notify(self.notifier.status, text)

    def _notify(self, send, *args, **kwargs) -> None:
        """sd_notify once running: a socket that fails (gone, refused) is logged once and never
        stops a restore, a stop or the loop; a systemd that no longer hears the watchdog pings
        answers that itself. The socket is checked before the first hardware write (run)."""
        try:
            send(*args, **kwargs)
            self._notify_failed = False
        except HwtuneError as exc:
            if not self._notify_failed:
                self._notify_failed = True
                self.log(f"{exc}; going on without it")

    def _load_config(self) -> Config:
        if self.config_path is None:
            return Config()
        return load_config(self.config_path, require_secure=True)

    def _load_profile(self) -> None:
        from hwtune.profiles import load

        name = self.config.profile
        self.state.profile_tune_mtime = self._last_tune_stamp()
        tuned = self._tuned_profile_path()
        if tuned is not None:
            # The nightly tune kept a better point on top of this profile: keep that instead.
            try:
                profile = load(str(tuned), self.ctx.profile_dir)
            except HwtuneError as exc:
                # Damaged, or no longer fits this hardware (a GPU swapped or gone): the configured
                # profile is still one to hold; refusing to start would leave the host unwatched.
                self._log_once(f"{exc}; the point hwtune tune kept cannot be used: holding profile {name}")
            else:
                self.log(f"using {tuned} (kept by hwtune tune on top of {name})")
                self.state.profile, self.state.profile_name = profile, f"{name}+tuned"
                self.state.tuned = True
                return
        self.state.tuned = False
        self.state.profile = load(name, self.ctx.profile_dir) if name else None
        self.state.profile_name = getattr(self.state.profile, "name", name) if name else None

    def _last_tune_stamp(self) -> float:
        try:
            return (self.state_dir / LAST_TUNE_FILE).stat().st_mtime
        except OSError:
            return 0.0

    def _tuned_profile_path(self) -> Path | None:
        """STATE_DIR/tuned-profile.yaml when the last tune kept it for the configured profile.
        Both files must be trusted state files (ours, not writable by others) and the kept
        profile must lie in the state directory: a planted last_tune.json names nothing."""
        from hwtune import statefile

        try:
            last = statefile.read_json(self.state_dir / LAST_TUNE_FILE, "last tune record")
        except statefile.StateError as exc:
            self._log_once(f"{exc}; ignored")
            return None
        path = last.get("kept_profile") if isinstance(last, dict) else None
        if not isinstance(path, str) or last.get("base_profile") != self.config.profile or not self.config.profile:
            return None
        path = Path(path)
        if path.parent.resolve() != self.state_dir.resolve() or path.name != "tuned-profile.yaml":
            self._log_once(f"{LAST_TUNE_FILE} names {path}, not the tuned profile of {self.state_dir}; ignored")
            return None
        try:
            if statefile.read_bytes(path, "tuned profile") is None:
                return None
        except statefile.StateError as exc:
            self._log_once(f"{exc}; ignored")
            return None
        return path

    def _write_runtime(self) -> None:
        from daemon.marker import identity
        from hwtune import statefile

        statefile.ensure_dir(self.state_dir)
        statefile.clean_leftovers(self.state_dir, (RUNTIME_FILE,), reserves=False)  # a killed daemon's
        statefile.write_json(self.state_dir / RUNTIME_FILE, {
            "pid": os.getpid(), **(identity(os.getpid()) or {}), "started_at": time.time(), "host": self.host.kind,
            "metrics_port": self.metrics.port if self.metrics else None,
            "profile": self.state.profile_name, "base_profile": self.config.profile,
            "torch_imported": "torch" in sys.modules})

    def _claim_single_daemon(self) -> None:
        """Held for the daemon's life (the kernel drops it when the process ends): two daemons
        on one state directory would re-apply each other's profile at every poll."""
        from hwtune.lock import WriterLock

        claim = WriterLock(self.state_dir, name=DAEMON_LOCK)
        try:
            claim.__enter__()
        except LockBusyError:
            try:
                holder = (self.state_dir / DAEMON_LOCK).read_text().strip() or "unknown"
            except OSError:
                holder = "unknown"
            raise LockBusyError(f"another hwtune daemon (pid {holder}) runs on {self.state_dir} "
                                f"({self.state_dir / DAEMON_LOCK}); nothing was applied") from None
        self._claim = claim

    # -- hardware --------------------------------------------------------------------------
    def recover(self, wait_s: float = 0) -> None:
        """Restore a journal an interrupted apply left. The lock comes first (waiting up to
        wait_s for a live apply to finish): a live apply's journal is never taken for a dead one."""
        from hwtune import engine

        restored = engine.recover(self.host, self.state_dir, self.log, wait_s=wait_s)
        if restored is not None:
            self.log(f"recovered: {len(restored)} value(s) restored")

    def _recover_at_start(self) -> None:
        """recover(), waiting up to START_LOCK_WAIT_S for a live apply to release the lock, in
        short tries: a stop asked meanwhile (systemctl stop) ends the wait, nothing applied."""
        deadline = time.monotonic() + START_LOCK_WAIT_S
        while True:
            try:
                self.recover()
                return
            except LockBusyError as exc:
                if self._stop:
                    self.log("asked to stop while waiting for the writer lock: nothing recovered or applied")
                    return
                if time.monotonic() >= deadline:
                    raise LockBusyError(f"{exc} (waited {START_LOCK_WAIT_S} s)") from None
                time.sleep(0.1)

    def _dead_tune(self, record: dict) -> bool:
        from daemon.tune import dead_tune_restorer

        return dead_tune_restorer(self.host, self.state_dir, self._log_once)(record)

    def apply_profile(self, why: str) -> bool:
        from hwtune import engine

        if self.state.profile is None:
            return False
        tuner = tuning_pid(self.state_dir, self._log_once, self._dead_tune)
        if tuner is not None:
            # A start or a reload during a tune would write over the point it is measuring;
            # the drift check applies the profile once the tune has ended.
            self.log(f"apply of {self.state.profile_name} ({why}) postponed: "
                     f"{f'pid {tuner}' if tuner > 0 else 'another process'} is tuning")
            return False
        self.status(f"applying profile {self.state.profile_name} ({why})")
        self.state.probation = PROBATION_POLLS  # a tuning step from here on
        try:
            result = engine.apply(self.host, self.state.profile, self.state_dir, self.log)
        except LockBusyError as exc:
            self.log(f"apply of {self.state.profile_name} postponed: {exc}")
            return False
        except UsageError as exc:
            if not self.state.tuned:
                self.state.last_apply = time.monotonic()
                raise
            # Refused before any write: the kept point no longer fits this hardware (a GPU
            # swapped for one with other limits, or gone). The configured profile still does.
            name = self.config.profile
            self._log_once(f"{exc}; the point hwtune tune kept cannot be applied: holding profile {name}")
            from hwtune.profiles import load

            self.state.profile, self.state.profile_name, self.state.tuned = load(name, self.ctx.profile_dir), name, False
            return self.apply_profile(why)
        except HwtuneError:
            # A failed apply wrote and undid: the next attempt waits reapply_min_interval_s too,
            # or a knob that does not take is written (and undone) at every poll.
            self.state.last_apply = time.monotonic()
            raise
        self.state.last_apply = time.monotonic()
        skipped = f", {len(result.skipped)} skipped" if result.skipped else ""
        self.log(f"profile {self.state.profile_name} applied ({why}): {len(result.changed)} change(s){skipped}")
        if self.metrics:
            self.metrics.set_profile(self.state.profile_name)
        return True

    def restore_known_good(self, event: str, why: str) -> None:
        from hwtune import engine

        self.log(f"{event} during the daemon's own tuning step ({why}): restoring the settings from before hwtune")
        self.status(f"restoring known-good settings after {event}")
        # Suspended first: even a restore that fails part way never lets drift re-apply.
        self.state.suspended = f"{event}: {why}"
        self.state.probation = 0
        engine.rollback(self.host, self.state_dir, self.log)
        if self.metrics:
            self.metrics.inc_restore(event)
            self.metrics.set_profile(None)
        self.log(f"profile {self.state.profile_name} suspended until SIGHUP or restart")

    # -- one poll --------------------------------------------------------------------------
    def poll(self) -> None:
        from hwtune import engine
        from hwtune.journal import journal_path

        tuner = tuning_pid(self.state_dir, self._log_once, self._dead_tune)
        gpus = self.host.gpus.count() if self.host.gpus is not None else 0
        events_now: list[tuple[int, str, str]] = []
        for i in range(gpus):
            try:
                t = self.host.gpus.telemetry(i)
            except HwtuneError as exc:
                if self._telemetry_error.get(i) != str(exc):  # once while it stands, not per poll
                    self._telemetry_error[i] = str(exc)
                    self.log(f"gpu{i} telemetry: {exc}")
                continue
            if self._telemetry_error.pop(i, None) is not None:
                self.log(f"gpu{i} telemetry: readable again")
            if self.metrics:
                extra = dict(t)
                try:
                    extra["power_limit_w"] = self.host.gpus.get_power_limit_w(i)
                    extra["persistence_mode"] = self.host.gpus.get_persistence_mode(i)
                except HwtuneError:
                    pass
                self.metrics.update_gpu(i, extra)
            for event, why in safety_events(t, self.config.thermal.max_temperature_c, self.state.last_xid.get(i)):
                if event in self.config.restore_on:
                    events_now.append((i, event, why))
            if t.get("xid_errors") is not None:
                self.state.last_xid[i] = int(t["xid_errors"])

        seen: dict = {}
        for i, event, why in events_now:
            seen.setdefault(i, set()).add(event)
            fresh = event not in self.state.active.get(i, set())
            if tuner is not None:
                if (tuner, event) not in self.state.signalled:
                    self.state.signalled.add((tuner, event))
                    if tuner <= 0:
                        # os.kill(-1, ...) would signal every process we may signal.
                        self.log(f"gpu{i} {event} ({why}) while another process holds the writer lock "
                                 f"(pid not visible here): cannot ask it to restore")
                    else:
                        self.log(f"gpu{i} {event} ({why}) while pid {tuner} is tuning: asking it to restore (SIGTERM)")
                        try:
                            os.kill(tuner, signal.SIGTERM)
                        except ProcessLookupError:
                            pass
                        if self.metrics:
                            self.metrics.inc_restore(event)
            elif self.state.probation > 0 and self.state.suspended is None and fresh:
                # Only an event that starts while the daemon's own apply is on probation is
                # ours to answer; one still standing from a tune it already signalled is not.
                self.restore_known_good(event, f"gpu{i} {why}")
            elif fresh:
                self.log(f"gpu{i} {event} ({why}); settings already known good, nothing restored")
        self.state.active = seen

        if tuner is not None:
            self.status(f"watching {gpus} GPU(s); pid {tuner} is tuning, drift checks paused")
            return
        if self.state.probation > 0 and not events_now:
            self.state.probation -= 1
        pending = self.state.suspended is None and engine.pending_journal(self.state_dir) is not None
        self.state.pending = pending and self.host.read_only
        if self.state.pending:  # watching only: said once, never restored, never "ok"
            self._log_once(f"an interrupted apply left {journal_path(self.state_dir)}; "
                           "read-only mode, not restored (`hwtune rollback` restores it)")
        elif pending:
            # A tuning run died mid-apply while we watched: restore, then re-apply.
            try:
                self.recover()
            except LockBusyError as exc:
                self.log(f"recovery postponed: {exc}")
                return
            self.apply_profile("after recovering an interrupted apply")
            return
        if self.state.resume_when_clear and not events_now:
            self.state.resume_when_clear = False
            self.state.suspended = None
            self.log("the safety event cleared: applying the reloaded profile")
            self.apply_profile("reload, after the safety event cleared")
            return
        self._read_last_tune()
        self.check_drift()
        what = (f"profile {self.state.profile_name} suspended ({self.state.suspended})" if self.state.suspended
                else f"profile {self.state.profile_name}" if self.state.profile else "no profile")
        self.status(f"watching {gpus} GPU(s); {what}; drift {self.state.drift}")

    def check_drift(self) -> None:
        from hwtune import engine

        if self.state.profile is None or self.state.suspended:
            return
        drift = engine.plan(self.host, self.state.profile, self.state_dir)
        # BIOS settings are checked, never written: counted and said once, never "re-applied".
        bios = engine.bios_drift(self.host, self.state.profile)
        self.state.drift = len(drift) + len(bios)
        if self.metrics:
            self.metrics.set_drift(self.state.drift)
        if bios:
            self._log_once(f"BIOS differs from profile {self.state.profile_name} (checked, never written): "
                           f"{'; '.join(map(str, bios))}")
        if not drift:
            self._rate_limited = None
            return
        if self.host.read_only:  # watching only: the drift is reported, never re-applied
            self._log_once(f"drift: {'; '.join(map(str, drift))}; read-only mode, not re-applied")
            return
        since = time.monotonic() - self.state.last_apply
        if since < self.config.reapply_min_interval_s:
            text = "; ".join(map(str, drift))
            if text != self._rate_limited:  # once per drift, not at every poll until the re-apply
                self._rate_limited = text
                self.log(f"drift ({text}); re-apply rate-limited "
                         f"({since:.0f} s < {self.config.reapply_min_interval_s:g} s since the last apply)")
            return
        self._rate_limited = None
        self.log(f"drift: {'; '.join(map(str, drift))}; re-applying {self.state.profile_name}")
        if self.apply_profile("drift") and self.metrics:
            self.metrics.inc_reapply()
            self.state.drift = 0
            self.metrics.set_drift(0)

    def _read_last_tune(self) -> None:
        path = self.state_dir / LAST_TUNE_FILE
        try:
            mtime = path.stat().st_mtime
        except OSError:
            if self.state.last_tune_mtime is None:
                self.state.last_tune_mtime = 0.0  # none at start: the next one is news
            return
        if mtime == self.state.last_tune_mtime:
            return
        self.state.last_tune_mtime = mtime
        if self.metrics is not None:
            from hwtune import statefile

            try:
                last = statefile.read_json(path, "last tune record")
                if isinstance(last, dict):
                    self.metrics.set_last_tune(last)
            except (OSError, ValueError, HwtuneError) as exc:
                self.log(f"{path}: {exc}")
        if mtime != self.state.profile_tune_mtime and self._tuned_profile_path() is not None:
            # A tune kept a point since the profile was chosen (also one that ended while
            # this daemon started): that is the setting to hold now.
            self._load_profile()
            if self.metrics is not None:
                self.metrics.set_profile(self.state.profile_name)

    # -- lifecycle -------------------------------------------------------------------------
    def _on_signal(self, signum, frame) -> None:
        if signum == signal.SIGHUP:
            self._reload = True
        else:
            self._stop = True

    def reload(self) -> None:
        self._notify(self.notifier.reloading)
        running = self.config
        try:
            self.config = self._load_config()
            self._load_profile()  # a profile that does not load: the running one stays too
        except HwtuneError as exc:
            self.config = running
            self.log(f"reload refused, keeping the running config: {exc}")
            # RELOADING=1 is answered by READY=1 whatever came of it.
            self._notify(self.notifier.ready, status=f"reload refused; profile {self.state.profile_name}")
            return
        self.log(f"config reloaded from {self.config_path or '<defaults>'}: profile {self.state.profile_name}")
        self.state.last_apply = -1e18
        standing = self.standing_events()
        if standing:
            # Never re-apply into a thermal event or a power brake: wait until it clears.
            why = "; ".join(standing)
            self.state.suspended = f"reload during a safety event ({why})"
            self.state.resume_when_clear = True
            self.log(f"reload: a safety event stands ({why}): profile {self.state.profile_name} is not "
                     "re-applied until it clears")
            if self.metrics:
                self.metrics.set_profile(None)
            self._notify(self.notifier.ready, status=f"reloaded; profile {self.state.profile_name} waits for the "
                                                     "safety event to clear")
            return
        self.state.suspended = None
        self.state.resume_when_clear = False
        try:
            self.apply_profile("reload")
        except HwtuneError as exc:  # undone by the engine; the drift check tries again later
            self.log(f"reload: {exc}")
            self._notify(self.notifier.ready, status=f"reloaded; profile {self.state.profile_name} not applied")
            return
        self._notify(self.notifier.ready, status=f"reloaded; profile {self.state.profile_name}")

    def standing_events(self) -> list[str]:
        """Thermal / power-brake events standing now on any GPU (those restore_on answers)."""
        out = []
        n = self.host.gpus.count() if self.host.gpus is not None else 0
        for i in range(n):
            try:
                t = self.host.gpus.telemetry(i)
            except HwtuneError as exc:
                out.append(f"gpu{i} telemetry unreadable ({exc})")
                continue
            for event, why in safety_events(t, self.config.thermal.max_temperature_c, None):
                if event in self.config.restore_on:
                    out.append(f"gpu{i} {event}: {why}")
        return out

    def stop(self) -> bool:
        """Stop (rollback: on_exit restores first). False when the restore was not complete."""
        from hwtune import engine

        ok = True
        if self.config.rollback == "on_exit" and not self.host.read_only:
            self._notify(self.notifier.stopping,
                         status="stopping: restoring the settings from before hwtune (rollback: on_exit)")
            self.log("stopping: rollback on_exit, restoring journaled originals")
            self._stop_live_tune()
            try:
                engine.rollback(self.host, self.state_dir, self.log, wait_s=STOP_LOCK_WAIT_S)
            except LockBusyError as exc:
                ok = False
                self.log(f"stopping: rollback skipped, another writer holds the lock ({exc}); "
                         f"run: {self.ctx.command('rollback')}")
            except HwtuneError as exc:
                ok = False
                self.log(f"stopping: {exc}")
        else:
            self._notify(self.notifier.stopping, status="stopping: keeping the settings (rollback: never)")
            self.log("stopping: rollback never, settings kept")
        if self.metrics:
            self.metrics.close()
        try:
            (self.state_dir / RUNTIME_FILE).unlink()
        except OSError:
            pass
        return ok

    def _stop_live_tune(self) -> None:
        """A live `hwtune tune` would go on writing its points over the restore (and end at its
        baseline, the daemon's profile): asked to stop first (SIGTERM: it restores where it
        started and exits), waited for up to STOP_TUNE_WAIT_S."""
        from daemon.marker import live_tuner

        pid = live_tuner(self.state_dir, self._log_once)
        if pid is None:
            return
        self.log(f"stopping: asking pid {pid}'s tune to stop first (SIGTERM)")
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + STOP_TUNE_WAIT_S
        while live_tuner(self.state_dir) == pid and time.monotonic() < deadline:
            time.sleep(0.1)
        if live_tuner(self.state_dir) == pid:
            self.log(f"stopping: pid {pid}'s tune still runs after {STOP_TUNE_WAIT_S} s; restoring anyway")

    def run(self) -> int:
        self.config = self._load_config()
        self.host = self.ctx.open_host()
        if self.host.read_only:
            self.log("read-only mode: watching only; nothing will be applied or restored")
        self._load_profile()
        if self.state.profile is None and not self.once:
            self.log("no profile configured (config key `profile`): watching telemetry only, nothing applied")
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self._on_signal)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        signal.set_wakeup_fd(self._wake_w.fileno(), warn_on_full_buffer=False)

        # Everything that can fail is checked and bound before the first hardware write: a
        # daemon that cannot serve its metrics exits with the host untouched.
        if not self.host.read_only and not self.once:
            self._claim_single_daemon()
        if self.config.metrics.enabled and not self.once:
            from daemon.metrics import Metrics

            self.metrics = Metrics()
            self.metrics.set_host_kind(self.host.kind)
            n = self.host.gpus.count() if self.host.gpus is not None else 0
            for i in range(n):
                self.metrics.set_gpu_info(i, self.host.gpus.info(i))
            if self.config.dispatch_table and Path(self.config.dispatch_table).exists():
                try:
                    self.metrics.load_dispatch_table(self.config.dispatch_table)
                except HwtuneError as exc:
                    self.log(str(exc))
            try:
                port = self.metrics.serve(self.config.metrics.address, self.config.metrics.port)
            except HwtuneError as exc:
                raise HwtuneError(f"{exc}; nothing was applied") from None
            host = self.config.metrics.address
            self.log(f"metrics on http://{f'[{host}]' if ':' in host else host}:{port}/metrics")
        applied = False
        if not self.host.read_only:
            self._write_runtime()  # the state directory takes writes: checked before the hardware
            self._status = "waiting for the writer lock" if _lock_held_by_other(self.state_dir) else "recovering"
            self.notifier.status(self._status)  # a notify socket that does not work: refused before any write
            self._recover_at_start()
            if not self._stop:  # asked to stop while waiting for the lock: apply nothing
                if self._last_tune_stamp() != self.state.profile_tune_mtime:
                    self._load_profile()  # a tune that held the lock meanwhile kept a point
                applied = self.apply_profile("start")
        if self.metrics and self.state.profile_name and self.state.suspended is None:
            self.metrics.set_profile(self.state.profile_name)
        try:
            self._write_runtime()
        except HwtuneError as exc:  # the host is tuned and watched: keep going, say it
            self.log(f"{exc}; `hwtune tune` will not see this daemon's profile")
        self.poll()
        if self.once:
            if self.state.profile is None:
                self.log("--once: no profile configured (a config with `profile: NAME`, e.g. "
                         f"{self.config_path or '/etc/hwtune/hwtune.yaml'}): nothing applied or checked")
            elif self.host.read_only:
                self.log(f"--once: read-only, profile {self.state.profile_name} checked once, nothing applied: "
                         f"{self.state.drift} drifted knob(s)"
                         + ("; an interrupted apply's journal is not restored" if self.state.pending else ""))
                return 1 if self.state.drift or self.state.pending else 0
            elif not applied:
                self.log(f"--once: profile {self.state.profile_name} not applied (see above)")
                return 1
            else:
                self.log(f"--once: profile {self.state.profile_name} applied and checked once, "
                         "exiting with the settings in place")
            return 0
        self._notify(self.notifier.ready, status=self._status or "watching")
        return self._loop()

    def _loop(self) -> int:
        interval = watchdog_interval_s()
        sel = selectors.DefaultSelector()
        sel.register(self._wake_r, selectors.EVENT_READ)
        now = time.monotonic()
        next_poll = now + self.config.poll_interval_s
        next_ping = now if interval else float("inf")
        poll_error = None
        while not self._stop:
            now = time.monotonic()
            if now >= next_ping:
                self._notify(self.notifier.watchdog)
                next_ping = now + interval
            if now >= next_poll:
                try:
                    self.poll()
                    if poll_error is not None:
                        self.log("poll: ok again")
                    poll_error = None
                except HwtuneError as exc:
                    if str(exc) != poll_error:  # said once while it stands, not at every poll
                        self.log(f"poll: {exc}")
                    poll_error = str(exc)
                next_poll = time.monotonic() + self.config.poll_interval_s
            if self._reload:
                self._reload = False
                self.reload()
                next_poll = time.monotonic()
            timeout = max(0.0, min(next_poll, next_ping) - time.monotonic())
            for key, _ in sel.select(timeout):
                try:
                    while key.fileobj.recv(64):
                        pass
                except (BlockingIOError, InterruptedError):
                    pass
        return 0 if self.stop() else 1
