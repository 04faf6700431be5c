"""status / plan / apply / verify / rollback over a Host (docs/ARCHITECTURE.md).

apply: lock -> refuse on a pending journal -> plan -> per change: journal the original
durably -> write -> read back. Changes are grouped per target (a GPU, a PCIe function, the
CPUs). A knob the device refuses (NoPermission / NotSupported) skips its whole target,
whose earlier changes are undone first: a GPU is never half-applied. Any other failure
undoes every change of this apply in reverse order and raises.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from hwtune.errors import HwtuneError, KnobUnavailable, PendingJournalError, ReadOnlyError
from hwtune.journal import COMMITTED, IN_PROGRESS, Journal, read_journal
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
    except HwtuneError as exc:
        out["journal"] = {"error": str(exc)}
    return out


# --- plan --------------------------------------------------------------------------------
def plan_report(host, profile, state_dir) -> tuple:
    """(changes, skipped lines). Raises ProfileError for values the device cannot take."""
    _bind(host, state_dir)
    changes: list = []
    skipped: list = []
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
            except HwtuneError as exc:  # unavailable, unreadable: skip this knob, say why
                skipped.append(str(exc))  # the errors name their target and knob
                continue
            for name, new in want.items():
                if not knob.same(host, target, name, current.get(name), new):
                    changes.append(Change(target, name, current.get(name), new, family))
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
    j = read_journal(state_dir)
    return j if j is not None and j.get("status") == IN_PROGRESS else None


# --- apply -------------------------------------------------------------------------------
def _undo(host, items: list, log) -> list:
    """Put back (change, value) pairs in reverse order; returns the failures."""
    failures = []
    for change, value in reversed(items):
        knob = KNOBS[change.family]()
        try:
            now = knob.read(host, change.target).get(change.knob)
            if knob.same(host, change.target, change.knob, now, value):
                continue  # never changed (the failing write did not happen)
            knob.restore(host, change.target, change.knob, value)
            log(f"restored {change.target} {change.knob} = {_fmt(knob.show(host, change.target, change.knob, value))}")
        except BaseException as exc:  # keep restoring the rest
            failures.append(f"{change.target} {change.knob}: {exc}")
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


def apply(host, profile, state_dir, log: Callable[[str], None] = _stderr) -> ApplyResult:
    _bind(host, state_dir)
    if host.read_only:
        raise ReadOnlyError("read-only mode: apply refused before any write (`hwtune plan` shows what it would change)")
    with WriterLock(state_dir):
        pending = pending_journal(state_dir)
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
            return result
        journal = Journal(state_dir)
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
                    knob = KNOBS[change.family]()
                    before = _undo_value(knob, host, target, change.knob)
                    current = (change, before)
                    if journal.record(target, change.family, change.knob, knob.original(host, target, change.knob)):
                        target_added.append((target, change.knob))
                    knob.write(host, target, change.knob, change.new)
                    target_done.append((change, before))
                    now = knob.read(host, target).get(change.knob)
                    if not knob.same(host, target, change.knob, now, change.new):
                        raise HwtuneError(f"{target} {change.knob}: read back {_fmt(now)} after writing {_fmt(change.new)}")
                    log(f"set {change}")
            except KnobUnavailable as exc:
                failures = _undo(host, target_done, log)
                if not failures:
                    journal.forget(target_added)
                    journal.save()
                    line = f"{target}: {exc.knob} {exc.reason}; skipped {target}, left as it was"
                    log(f"skip {line}")
                    result.skipped.append(line)
                    continue
                why = f"{exc}; undoing {target} failed: {'; '.join(failures)}"
                _fail(host, journal, done, added, why, log)
            except BaseException as exc:
                # The failing write may have happened: put it back too.
                if current is not None and current not in target_done:
                    target_done.append(current)
                _fail(host, journal, done + target_done, added + target_added, str(exc) or type(exc).__name__, log)
            done.extend(target_done)
            added.extend(target_added)
            result.changed.extend(c for c, _ in target_done)
        journal.finish(COMMITTED)
        return result


def _fail(host, journal: Journal, done: list, added: list, why: str, log) -> None:
    log(f"apply failed: {why}; restoring {len(done)} change(s)")
    failures = _undo(host, done, log)
    if failures:
        journal.save()  # stays in_progress: rollback restores the originals
        raise ApplyFailed(f"apply failed: {why}; could not restore {'; '.join(failures)}; run `hwtune rollback`")
    journal.forget(added)
    journal.finish(COMMITTED)
    raise ApplyFailed(f"apply failed: {why}; restored {len(done)} change(s), the host is as it was")


# --- rollback ----------------------------------------------------------------------------
def rollback(host, state_dir, log: Callable[[str], None] = _stderr) -> list:
    """Restore every journaled original in reverse order, then remove the journal."""
    _bind(host, state_dir)
    j = read_journal(state_dir)
    if j is None or not j["entries"]:
        log("nothing to roll back: no journal")
        if j is not None and not host.read_only:
            Journal(state_dir).remove()
        return []
    if host.read_only:
        raise ReadOnlyError(f"read-only mode: rollback of {len(j['entries'])} journaled value(s) refused; nothing was written")
    with WriterLock(state_dir):
        journal = Journal(state_dir)
        restored, failed = [], []
        for entry in reversed(journal.entries):
            knob = KNOBS[entry["family"]]()
            target, name, original = entry["target"], entry["field"], entry["original"]
            try:
                current = knob.read(host, target).get(name)
                if not knob.same(host, target, name, current, original):
                    knob.restore(host, target, name, original)
                    restored.append(Change(target, name, current, original, entry["family"]))
                    log(f"restored {target} {name}: {_fmt(current)} -> {_fmt(knob.show(host, target, name, original))}")
            except BaseException as exc:
                failed.append((entry, exc))
                log(f"could not restore {target} {name}: {exc}")
        if failed:
            journal.data["entries"] = [e for e in journal.entries if any(e is f for f, _ in failed)]
            journal.data["status"] = IN_PROGRESS
            journal.save()
            raise HwtuneError(f"rollback: {len(failed)} value(s) not restored ({failed[0][1]}); "
                              f"they stay in {journal.path}")
        journal.remove()
        return restored
