"""status / plan / apply / verify / rollback over a Host (docs/ARCHITECTURE.md).

apply: lock -> refuse on a pending journal -> plan -> per change: journal the original
durably -> write -> read back. Changes are grouped per target (a GPU, a PCIe function, the
CPUs). A knob the device refuses (NoPermission / NotSupported) skips its whole target,
whose earlier changes are undone first: a GPU is never half-applied. Any other failure
undoes every change of this apply in reverse order and raises.

Never "done" while the host is changed: journal space is reserved before the first write;
signals are held while writing (hwtune.signals: undo or finish, then exit 128 + signo); a
closed terminal never stops the sequence; every restore is read back, and rollback keeps in
the journal whatever did not take or could not be read, naming it (exit 1). Rollback takes
the lock before it reads the journal, and checks every entry against its knob's own device
namespace before it writes anything.
"""
from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from hwtune import faults, signals, statefile
from hwtune import journal as journal_mod
from hwtune.errors import HwtuneError, KnobUnavailable, PendingJournalError, ReadOnlyError, UsageError
from hwtune.journal import COMMITTED, IN_PROGRESS, NAME as JOURNAL_NAME, Journal, read_journal
from hwtune.knobs import KNOBS, BadValue
from hwtune.knobs.pcie import decode_devctl
from hwtune.lock import WriterLock


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _fmt(value) -> str:
    if isinstance(value, dict):  # per-CPU / per-state originals: summarise
        kinds = sorted({str(v) for v in value.values()})
        if len(kinds) == 1:
            return f"{kinds[0]} (all {len(value)})"
        return f"{len(value)} per-CPU values ({', '.join(kinds)})"
    return str(value)


@dataclass
class Change:
    target: str
    knob: str  # the field, e.g. power_limit_w
    old: object
    new: object
    family: str = ""

    def to_json(self) -> dict:
        return {"target": self.target, "knob": self.knob, "old": self.old, "new": self.new,
                "family": self.family}

    def __str__(self) -> str:
        return f"{self.target} {self.knob}: {_fmt(self.old)} -> {_fmt(self.new)}"


@dataclass
class ApplyResult:
    changed: list = field(default_factory=list)
    skipped: list = field(default_factory=list)
    restored: list = field(default_factory=list)
    ok: bool = True

    def to_json(self) -> dict:
        return {"ok": self.ok, "changed": [c.to_json() for c in self.changed],
                "skipped": list(self.skipped), "restored": [c.to_json() for c in self.restored]}


class ApplyFailed(HwtuneError):
    exit_code = 1


class DeviceReadError(HwtuneError):
    """A device value plan needs could not be read (exit 1, before any write)."""

    exit_code = 1


def _bind(host, state_dir) -> None:
    host.state_dir = Path(state_dir)


# --- status ------------------------------------------------------------------------------
def _safe(errors: list, what: str, fn, *args):
    try:
        return fn(*args)
    except Exception as exc:  # one failing read never stops the rest (node_exporter rule)
        errors.append(f"{what}: {exc}")
        return None


def _gpu_status(host, i: int) -> dict:
    g = host.gpus
    errors: list = []
    entry = {"target": f"gpu{i}"}
    entry.update(_safe(errors, "info", g.info, i) or {"index": i})
    entry["persistence_mode"] = _safe(errors, "persistence_mode", g.get_persistence_mode, i)
    entry["power_limit_w"] = _safe(errors, "power_limit_w", g.get_power_limit_w, i)
    c = _safe(errors, "power_limit_constraints_w", g.get_power_limit_constraints_w, i)
    entry["power_limit_constraints_w"] = list(c) if c else None
    entry["power_limit_default_w"] = _safe(errors, "power_limit_default_w", g.get_power_limit_default_w, i)
    clocks = _safe(errors, "locked clocks", KNOBS["gpu_clocks"]().read, host, f"gpu{i}") or {}
    entry["sm_clock_mhz"] = clocks.get("sm_clock_mhz")
    entry["memory_clock_mhz"] = clocks.get("memory_clock_mhz")
    sm = _safe(errors, "supported_sm_clocks_mhz", g.get_supported_sm_clocks_mhz, i) or []
    entry["supported_sm_clocks_mhz"] = {"count": len(sm), "min": min(sm, default=None), "max": max(sm, default=None)}
    entry["supported_memory_clocks_mhz"] = _safe(errors, "supported_memory_clocks_mhz",
                                                 g.get_supported_memory_clocks_mhz, i)
    entry["telemetry"] = _safe(errors, "telemetry", g.telemetry, i)
    if errors:
        entry["errors"] = errors
    return entry


def _pcie_status(host) -> list:
    out = []
    try:
        functions = {f["bdf"]: f for f in host.pcie.functions()}
        targets = KNOBS["pcie"]().targets(host, None)
    except Exception as exc:
        return [{"error": str(exc)}]
    for t in targets:
        bdf = t[len("pcie:"):]
        f = functions[bdf]
        entry = {"target": t, "bdf": bdf, "vendor": f["vendor"], "device": f["device"], "class": f["class"]}
        entry["link"] = _safe([], "link", host.pcie.link, bdf)
        try:
            devctl = host.pcie.read_devctl(bdf)
            entry["devctl"] = f"0x{devctl:04x}"
            entry.update(decode_devctl(devctl))
        except Exception as exc:
            entry.update({"devctl": None, "relaxed_ordering": None, "max_read_request_bytes": None,
                          "error": str(exc)})
        out.append(entry)
    return out


def _cpu_status(host) -> dict:
    errors: list = []
    values = {}
    for family in ("cpu_governor", "cpu_idle"):
        values.update(_safe(errors, family, KNOBS[family]().read, host, "cpu") or {})
    govs = _safe(errors, "governors", host.cpu.governors) or {}
    states = _safe(errors, "cstates", host.cpu.cstates) or []
    summary: dict = {}
    for s in states:
        row = summary.setdefault(s["state"], {"state": s["state"], "name": s["name"],
                                              "latency_us": s["latency_us"], "disabled_cpus": 0})
        row["disabled_cpus"] += int(s["disabled"])
    out = {"target": "cpu", "cpus": len(govs) or len({s["cpu"] for s in states}) or None, "governor": values.get("governor"),
           "available_governors": _safe(errors, "available_governors", host.cpu.available_governors),
           "max_cstate_latency_us": values.get("max_cstate_latency_us"),
           "cstates": list(summary.values())}
    if errors:
        out["errors"] = errors
    return out


def status(host, state_dir) -> dict:
    """Every knob's current value per device; JSON-ready with a stable key order."""
    _bind(host, state_dir)
    out: dict = {"host": {"kind": host.kind, "read_only": host.read_only}}
    n = _safe([], "gpus", host.gpus.count) or 0
    out["gpus"] = [_gpu_status(host, i) for i in range(n)]
    if host.gpu_error:
        out["gpu_error"] = host.gpu_error
    out["pcie"] = _pcie_status(host)
    out["cpu"] = _cpu_status(host)
    if host.bios is not None:
        errors: list = []
        attrs = _safe(errors, "bios", host.bios.attributes)
        out["bios"] = {"source": getattr(host.bios, "source", None), "attributes": attrs}
        if errors:
            out["bios"]["error"] = errors[0]
    else:
        out["bios"] = None
    try:
        j = read_journal(state_dir)
        out["journal"] = None if j is None else {"status": j.get("status"), "entries": len(j["entries"]),
                                                 "profiles": [p.get("profile") for p in j.get("profiles", [])]}
        problems = journal_problems(host, state_dir) if j is not None else []
        if problems:  # never shown as a journal rollback can undo
            out["journal"]["not_restorable"] = problems
    except HwtuneError as exc:
        out["journal"] = {"error": str(exc)}
    return out


# --- plan --------------------------------------------------------------------------------
def plan_report(host, profile, state_dir) -> tuple:
    """(changes, skipped lines). Raises ProfileError for values the device cannot take."""
    _bind(host, state_dir)
    changes: list = []
    skipped: list = []
    unreadable: list = []
    for family, cls in KNOBS.items():
        knob = cls()
        section = getattr(profile, knob.section)
        if section is None:
            continue
        try:
            targets = knob.targets(host, section)
        except BadValue as exc:
            raise profile.error(exc.key, exc.message) from None
        for target in targets:
            try:
                want = knob.desired(host, target, section)
                if not want:
                    continue
                current = knob.read(host, target)
            except BadValue as exc:
                raise profile.error(exc.key, exc.message) from None
            except UsageError:  # bad input (a malformed simulated host): exit 2 as it is
                raise
            except KnobUnavailable as exc:  # the device refuses this knob here: skip it, say why
                skipped.append(str(exc))  # the errors name their target and knob
                continue
            except HwtuneError as exc:  # a device that cannot be read: no plan can be trusted
                unreadable.append(f"{target} {family}: {exc}")
                continue
            for name, new in want.items():
                if not knob.same(host, target, name, current.get(name), new):
                    changes.append(Change(target, name, current.get(name), new, family))
    if unreadable:
        raise DeviceReadError(f"cannot read {'; '.join(unreadable)}; nothing was written")
    order = list(dict.fromkeys(c.target for c in changes))
    changes.sort(key=lambda c: order.index(c.target))  # stable: knob order within a target
    return changes, skipped


def plan(host, profile, state_dir) -> list:
    return plan_report(host, profile, state_dir)[0]


def unmatched(host, profile) -> list:
    """What of the profile this host cannot check at all, one line per section, named: a
    section whose devices matched nothing (no NVML, a select that names no function), a bios
    section without a BMC reader, a profile that sets nothing. Nothing of these is read or
    written, so no command may say the host matches them."""
    if all(getattr(profile, s) is None for s in ("gpu", "pcie", "cpu", "bios")):
        return [f"profile {profile.name} sets nothing (no gpu, pcie, cpu or bios section)"]
    found: dict = {}   # section -> any target matched
    errors: dict = {}  # section -> why its devices could not be listed
    for cls in KNOBS.values():
        knob = cls()
        section = getattr(profile, knob.section)
        if section is None:
            continue
        try:
            targets = knob.targets(host, section)
        except BadValue:
            targets = [None]  # a select naming a missing GPU: plan's error, not "no device"
        except HwtuneError as exc:
            targets = []
            errors.setdefault(knob.section, str(exc))
        found[knob.section] = found.get(knob.section, False) or bool(targets)
    out = []
    for name in (n for n, any_target in found.items() if not any_target):
        why = errors.get(name)
        if why is None and name == "gpu":
            why = host.gpu_error or "no GPUs found"
            if not why.startswith("NVML unavailable"):
                why = f"NVML unavailable: {why}" if host.gpu_error else why
        elif why is None:
            why = f"select {getattr(getattr(profile, name), 'select', None)}: no such device on this host"
        out.append(f"{name}: no device matched ({why})")
    if profile.bios is not None and profile.bios.expect and host.bios is None:
        out.append("bios: not checked (no BIOS reader for this host)")
    return out


def bios_drift(host, profile) -> list:
    """BIOS is checked, never written: expected attributes that differ."""
    if profile.bios is None or not profile.bios.expect or host.bios is None:
        return []
    from hwtune.knobs.bios import check  # imports Change from here: a late import

    return list(check(dict(profile.bios.expect), host.bios.attributes()))


def verify(host, profile, state_dir) -> list:
    """The drift between host and profile (empty: the host matches)."""
    return plan(host, profile, state_dir) + bios_drift(host, profile)


def pending_journal(state_dir) -> dict | None:
    """The journal an interrupted apply (or an incomplete rollback) left, else None."""
    j = read_journal(state_dir)
    return j if j is not None and (j.get("status") == IN_PROGRESS or j.get("unreadable")) else None


def journal_problems(host, state_dir) -> list:
    """One line per journal entry rollback could not restore on this host now (a GPU index or
    a PCIe function that is gone, an entry outside its knob's namespace, a damaged entry);
    [] without a journal. Apply refuses over these: what it adds would stand on a journal
    that cannot be undone in full."""
    loaded = journal_mod.load(state_dir)
    return [] if loaded is None else _check_entries(host, loaded)[1]


def journal_blocked(state_dir, problems: list) -> str:
    path = Path(state_dir) / JOURNAL_NAME
    n = len(problems)
    return (f"journal {path}: {n} entr{'y' if n == 1 else 'ies'} rollback cannot restore on this host: "
            f"{_summary(problems)}; bring the device back and run `hwtune rollback`, or run `hwtune rollback` "
            f"(it restores every other entry) and, once the device is gone for good, remove {path}")


# --- apply -------------------------------------------------------------------------------
class _Stopped(Exception):
    """A held signal asks the sequence to stop at this step boundary."""

    def __init__(self, signo: int):
        self.signo = signo
        super().__init__(f"interrupted by {signals.name(signo)}")


def _quiet(log: Callable[[str], None]) -> Callable[[str], None]:
    """`log` that never raises: a closed terminal or pipe (`| head`, a dropped ssh session)
    must not stop a write sequence half way. After the first failure it stays silent."""
    dead = []

    def out(line: str) -> None:
        if dead:
            return
        try:
            log(line)
        except (OSError, ValueError):
            dead.append(True)
    return out


def _entry_name(change) -> str:
    return f"{change.target} {change.knob}"


def _restore(host, knob, target: str, name: str, value) -> tuple:
    """Put `value` back unless a real read shows it in place ("reset" of locked clocks is
    always re-issued), then read back. Returns (restored?, read-back problem or None)."""
    current = knob.read(host, target).get(name)
    if not knob.must_reissue(name, value) and knob.same(host, target, name, current, value):
        return False, None
    faults.hit("restore.write")
    knob.restore(host, target, name, value)
    faults.hit("restore.written")
    after = knob.read(host, target).get(name)
    if not knob.restored(host, target, name, after, value):
        return True, f"read back {_fmt(after)} after restoring {_fmt(knob.show(host, target, name, value))}"
    return True, None


def _undo(host, items: list, log) -> list:
    """Put back (change, value) pairs in reverse order, each read back; returns the failures."""
    failures = []
    for change, value in reversed(items):
        knob = KNOBS[change.family]()
        try:
            wrote, problem = _restore(host, knob, change.target, change.knob, value)
            if problem:
                failures.append(f"{_entry_name(change)}: {problem}")
            elif wrote:
                log(f"restored {change.target} {change.knob} = {_fmt(knob.show(host, change.target, change.knob, value))}")
        except BaseException as exc:  # keep restoring the rest
            failures.append(f"{_entry_name(change)}: {exc}")
    return failures


def _undo_value(knob, host, target, name):
    """What to put back if this apply fails: the exact value when readable (the sim knows its
    locked clocks; NVML does not, then the journaled original)."""
    value = knob.original(host, target, name)
    if value == "reset":
        current = knob.read(host, target).get(name)
        if current not in (None, "unknown"):
            return current
    return value


def _reserve_bytes(journal: Journal, changes: list) -> int:
    """Room for the journal at its largest (temp file + old file) and the clock record."""
    probe = [{"target": c.target, "family": c.family, "field": c.knob, "original": c.old,
              "recorded_at": 0.0} for c in changes]
    clocks = sum(1 for c in changes if c.family == "gpu_clocks")
    return 2 * (journal.size_with(probe) + 160 * clocks + 4096) + 16384


def apply(host, profile, state_dir, log: Callable[[str], None] = _stderr, on_signal: str = "undo") -> ApplyResult:
    """Journal, write, read back. SIGTERM / SIGHUP / SIGINT are held while it writes: with
    on_signal="undo" the changes made so far are undone at the next step, with "finish" the
    apply completes; either way Interrupted (exit 128 + signo) is raised at the end."""
    _bind(host, state_dir)
    log = _quiet(log)
    if host.read_only:
        raise ReadOnlyError("read-only mode: apply refused before any write (`hwtune plan` shows what it would change)")
    with WriterLock(state_dir), signals.Deferred() as sig:
        statefile.clean_leftovers(state_dir, (JOURNAL_NAME, "locks.json"))
        try:
            pending = pending_journal(state_dir)
        except HwtuneError as exc:
            raise PendingJournalError(f"{exc}; apply refused until then") from None
        problems = journal_problems(host, state_dir)
        if problems:
            raise PendingJournalError(f"{journal_blocked(state_dir, problems)}; apply refused until then")
        if pending is not None:
            raise PendingJournalError(
                f"an interrupted apply left {len(pending['entries'])} journaled original value(s) in "
                f"{Path(state_dir) / 'journal.json'}; run `hwtune rollback` first")
        changes, skipped = plan_report(host, profile, state_dir)
        for line in skipped:
            log(f"skip {line}")
        result = ApplyResult(skipped=list(skipped))
        if not changes:
            # Not "matches": BIOS drift, skipped knobs or sections that matched no device
            # are the caller's to report (hwtune apply says whether the host matches).
            log(f"nothing to write for profile {profile.name}")
            _stop_if_signalled(sig, "before any write; nothing was written")
            return result
        journal = Journal(state_dir)
        # A full disk is found here, before the first write, not half way through.
        try:
            statefile.reserve(state_dir, _reserve_bytes(journal, changes))
            _apply_changes(host, profile, journal, changes, result, log, sig, on_signal)
            _stop_if_signalled(sig, f"as the apply finished: {len(result.changed)} change(s) applied and "
                                    "journaled (`hwtune rollback` undoes them)")
        finally:
            statefile.release(state_dir)
        return result


def _stop_if_signalled(sig, what: str) -> None:
    if sig.stop is not None:
        raise signals.Interrupted(sig.stop, f"{signals.name(sig.stop)} arrived {what}")


def _apply_changes(host, profile, journal: Journal, changes: list, result: ApplyResult, log, sig, on_signal) -> None:
    if on_signal == "undo":
        _stop_if_signalled(sig, "before the first write; nothing was written")
    journal.begin(profile.name)
    done: list = []  # (change, value to put back) of this apply, in order
    added: list = []  # journal keys this apply created
    groups: dict = {}
    for c in changes:
        groups.setdefault(c.target, []).append(c)
    for target, group in groups.items():
        target_done: list = []
        target_added: list = []
        current = None
        try:
            for change in group:
                if on_signal == "undo" and sig.stop is not None:
                    raise _Stopped(sig.stop)
                knob = KNOBS[change.family]()
                original = knob.original(host, target, change.knob)
                problem = knob.journal_problem(host, target, change.knob, original)
                if problem is not None and journal.find(target, change.knob) is None:
                    # an original rollback would refuse (900 W outside 200..700 W): never changed
                    raise KnobUnavailable(target, change.knob, f"NotSupported (rollback could not put it back: "
                                                               f"{problem})")
                before = _undo_value(knob, host, target, change.knob)
                current = (change, before)
                if journal.record(target, change.family, change.knob, original):
                    target_added.append((target, change.knob))
                faults.hit("device.write")
                knob.write(host, target, change.knob, change.new)
                target_done.append((change, before))
                faults.hit("device.written")
                now = knob.read(host, target).get(change.knob)
                if not knob.same(host, target, change.knob, now, change.new):
                    raise HwtuneError(f"{target} {change.knob}: read back {_fmt(now)} after writing {_fmt(change.new)}")
                log(f"set {change}")
        except KnobUnavailable as exc:
            failures = _undo(host, target_done, log)
            if not failures:
                journal.forget(target_added)
                try:
                    journal.save()
                except HwtuneError as save_exc:
                    _fail(host, journal, done, added + target_added, f"{exc}; then {save_exc}", log, sig)
                line = f"{target}: {exc.knob} {exc.reason}; skipped {target}, left as it was"
                log(f"skip {line}")
                result.skipped.append(line)
                continue
            why = f"{exc}; undoing {target} failed: {'; '.join(failures)}"
            _fail(host, journal, done, added + target_added, why, log, sig)
        except BaseException as exc:
            # The failing write may have happened: put it back too.
            tried = current is not None and current not in target_done
            if tried:
                target_done.append(current)
            why = str(exc) or type(exc).__name__
            _fail(host, journal, done + target_done, added + target_added, why, log, sig,
                  exc.signo if isinstance(exc, _Stopped) else None, tried)
        done.extend(target_done)
        added.extend(target_added)
        result.changed.extend(c for c, _ in target_done)
    journal.finish(COMMITTED)


def _fail(host, journal: Journal, done: list, added: list, why: str, log, sig, signo: int | None = None,
          tried: bool = False) -> None:
    """`tried`: the last of `done` is the write that failed, which may have happened."""
    signo = signo if signo is not None else sig.stop
    head = f"interrupted by {signals.name(signo)}" if signo is not None and why.startswith("interrupted") else f"apply failed: {why}"
    count = f"{len(done) - 1 if tried else len(done)} change(s)" + (" and the setting whose write failed" if tried else "")
    log(f"{head}; restoring {count}")
    failures = _undo(host, done, log)
    if failures:
        try:
            journal.save()  # stays in_progress: rollback restores the originals
        except HwtuneError:
            pass  # the journal on disk is in progress and holds every original already
        text = f"{head}; could not restore {'; '.join(failures)}; run `hwtune rollback`"
        raise signals.Interrupted(signo, text) if signo is not None else ApplyFailed(text)
    journal.forget(added)
    try:
        journal.finish(COMMITTED)
        end = "the host is as it was"
    except HwtuneError as exc:
        end = f"the host is as it was, but the journal could not be updated ({exc}); `hwtune rollback` clears it"
    text = f"{head}; restored {count}, {end}"
    raise signals.Interrupted(signo, text) if signo is not None else ApplyFailed(text)


# --- rollback ----------------------------------------------------------------------------
class RollbackIncomplete(HwtuneError):
    """Rollback restored what it could; the rest stays in the journal. `restored` (Changes),
    `not_restored` ({target, field, why} dicts; an unreadable entry has only `why`) and `journal`
    (its path) let `rollback --json` say which is which."""
    exit_code = 1

    def __init__(self, text: str, restored=(), not_restored=(), journal: str | None = None):
        super().__init__(text)
        self.restored, self.not_restored, self.journal = list(restored), list(not_restored), journal


def _check_entries(host, loaded) -> tuple:
    """(entries rollback may restore, unreadable lines, entries held back): each entry is
    checked against its knob's own device namespace before anything is written. An entry held
    back is whole (its original is known) but not for this host now, e.g. a GPU that fell off
    the bus: it stays an entry in the journal, so a rollback once the device is back restores it."""
    valid, bad, held = [], list(loaded.unreadable), []
    for n, e in enumerate(loaded.entries, 1):
        label = f"{str(e['target'])[:60]} {str(e['field'])[:60]}"
        cls = KNOBS.get(e["family"])
        if cls is None:
            bad.append(f"{label}: unknown family {str(e['family'])[:40]!r}")
            held.append(e)
            continue
        try:
            knob = cls()
            part = knob.split_original(host, e["target"], e["field"], e["original"])
            if part is not None and knob.journal_problem(host, e["target"], e["field"], part[0]) is None:
                # CPUs gone since the apply: restore those that are here, keep the rest
                bad.append(f"{label}: {knob.journal_problem(host, e['target'], e['field'], part[1])}")
                valid.append(dict(e, original=part[0]))
                held.append(dict(e, original=part[1]))
                continue
            why = knob.journal_problem(host, e["target"], e["field"], e["original"])
        except Exception as exc:
            why = f"cannot be checked against this host ({exc})"
        if why:
            bad.append(f"{label}: {why}")
            held.append(e)
        else:
            valid.append(e)
    return valid, bad, held


def _summary(items: list, limit: int = 6) -> str:
    shown = "; ".join(items[:limit])
    return shown + (f"; and {len(items) - limit} more" if len(items) > limit else "")


def rollback(host, state_dir, log: Callable[[str], None] = _stderr, wait_s: float = 0,
             only_pending: bool = False):
    """Restore every journaled original in reverse order, each read back, then remove the
    journal. The lock is taken (waiting up to `wait_s`) before the journal is read. Entries
    that did not take, and any the journal could not give back, stay in it: RollbackIncomplete
    (exit 1) names them. Signals are held until the sequence is done (then Interrupted).
    only_pending: restore only a journal an interrupted apply left (the daemon at start);
    returns None when there is none."""
    _bind(host, state_dir)
    log = _quiet(log)
    if host.read_only:
        loaded = journal_mod.load(state_dir)
        if loaded is None or (not loaded.entries and not loaded.unreadable) or (
                only_pending and loaded.data.get("status") != IN_PROGRESS and not loaded.torn):
            if not only_pending:
                log("nothing to roll back: no journal")
            return None if only_pending else []
        raise ReadOnlyError(f"read-only mode: rollback of {len(loaded.entries)} journaled value(s) refused; "
                            "nothing was written")
    with WriterLock(state_dir, wait_s):
        statefile.clean_leftovers(state_dir, (JOURNAL_NAME, "locks.json"))
        loaded = journal_mod.load(state_dir)
        if loaded is None:
            if not only_pending:
                log("nothing to roll back: no journal")
            return None if only_pending else []
        if only_pending and loaded.data.get("status") != IN_PROGRESS and not loaded.torn and not loaded.unreadable:
            return None
        journal = Journal(state_dir, loaded.data)
        valid, unreadable, held = _check_entries(host, loaded)
        if not valid and not unreadable:
            log("nothing to roll back: the journal is empty")
            journal.remove()
            return None if only_pending else []
        if only_pending:
            who = ", ".join(f"{p.get('profile')} (pid {p.get('pid')})" for p in loaded.data.get("profiles", [])
                            if isinstance(p, dict)) or "unknown"
            log(f"journal left by an interrupted apply of {who}: restoring {len(valid)} original value(s)")
        with signals.Deferred() as sig:
            restored, failed = [], []
            for entry in reversed(valid):
                knob = KNOBS[entry["family"]]()
                target, name, original = entry["target"], entry["field"], entry["original"]
                try:
                    before = knob.read(host, target).get(name)
                    wrote, problem = _restore(host, knob, target, name, original)
                    if problem:
                        failed.append((entry, problem))
                        log(f"could not restore {target} {name}: {problem}")
                    elif wrote:
                        restored.append(Change(target, name, before, original, entry["family"]))
                        log(f"restored {target} {name}: {_fmt(before)} -> {_fmt(knob.show(host, target, name, original))}")
                except Exception as exc:
                    failed.append((entry, str(exc) or type(exc).__name__))
                    log(f"could not restore {target} {name}: {exc}")
            if failed or unreadable:
                _keep(journal, loaded, _merged(loaded.entries, held + [e for e, _ in failed]), log)
                parts = []
                if failed:
                    parts.append(f"{len(failed)} value(s) not restored: "
                                 + _summary([f"{e['target']} {e['field']} ({why})" for e, why in failed]))
                if unreadable:
                    parts.append(f"{len(unreadable)} journal entr{'y' if len(unreadable) == 1 else 'ies'} "
                                 f"unreadable, not restored: " + _summary(unreadable))
                text = (f"rollback: {len(restored)} value(s) restored; " + "; ".join(parts)
                        + f"; they stay in {journal.path}")
                if unreadable:   # no rollback can read them: say how to get out
                    text += (f" (to go on: put those settings back by hand, `hwtune status` shows them, "
                             f"then move the file aside, e.g. mv {shlex.quote(str(journal.path))} "
                             f"{shlex.quote(str(journal.path) + '.damaged')}; apply is refused while it is there)")
                if sig.stop is not None:
                    raise signals.Interrupted(sig.stop, f"{signals.name(sig.stop)} during rollback (finished first): {text}")
                raise RollbackIncomplete(
                    text, restored,
                    [{"target": e["target"], "field": e["field"], "why": why} for e, why in failed]
                    + [{"why": line} for line in unreadable], str(journal.path))
            journal.remove()
            if sig.stop is not None:
                raise signals.Interrupted(sig.stop, f"{signals.name(sig.stop)} during rollback: finished first, "
                                                    f"{len(restored)} value(s) restored, journal removed")
        return restored


def _merged(order: list, entries: list) -> list:
    """`entries` in journal order, the parts of one split per-CPU original joined again."""
    out: dict = {}
    for e in entries:
        key = (e["target"], e["field"])
        if key in out and isinstance(out[key]["original"], dict) and isinstance(e["original"], dict):
            out[key] = dict(out[key], original={**out[key]["original"], **e["original"]})
        else:
            out.setdefault(key, e)
    rank = {(e["target"], e["field"]): n for n, e in reversed(list(enumerate(order)))}
    return sorted(out.values(), key=lambda e: rank.get((e["target"], e["field"]), len(rank)))


def _keep(journal: Journal, loaded, entries: list, log) -> None:
    """Rewrite the journal with what is still to restore: the entries, and the lines of what
    could not be read as one (loaded.unreadable). A damaged file is kept as
    journal.json.damaged first; on a full disk the old journal (a superset) stays."""
    try:
        if loaded.torn:
            raw = statefile.read_bytes(journal.path, "journal")
            if raw is not None:
                statefile.write_bytes(journal.path.with_name(JOURNAL_NAME + ".damaged"), raw)
        journal.data = dict(loaded.data, status=IN_PROGRESS, entries=entries, unreadable=list(loaded.unreadable))
        journal.save()
    except HwtuneError as exc:
        log(f"journal {journal.path} left as it was ({exc})")


def recover(host, state_dir, log: Callable[[str], None] = _stderr, wait_s: float = 0):
    """The daemon at start: with the lock held (waiting up to wait_s for a live apply to end),
    restore a journal an interrupted apply left. None when there is none."""
    return rollback(host, state_dir, log, wait_s=wait_s, only_pending=True)
