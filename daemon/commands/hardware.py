"""hwtune status | plan | apply | verify | rollback: the hardware loop's commands.

Human-readable results go to stdout, progress and reasons to stderr; --json prints one JSON
document on stdout instead.
"""
from __future__ import annotations

import json
import os
import sys

from hwtune.errors import HwtuneError

DEFAULT_PROFILE = "throughput"


def _emit(data) -> None:
    json.dump(data, sys.stdout, indent=2)
    sys.stdout.write("\n")


def _log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _after_writes(text: str) -> None:
    """Print once the write sequence is over; a reader that went away (`| head`, a dropped
    ssh session) changes nothing about the result or the exit code."""
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except (OSError, ValueError):
        try:  # so the interpreter's own flush at exit does not fail either
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
        except (OSError, ValueError):
            pass


def _add_profile(p) -> None:
    p.add_argument("-p", "--profile", default=None,
                   help=f"profile name or YAML path (default: the config's profile, else {DEFAULT_PROFILE})")


def _add_json(p) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON document on stdout")


def _profile_name(args, ctx) -> str:
    """-p, else the config's profile, else the default. The config is held to the daemon's
    rule when run as root (owned by root, not group/world-writable): it drives root's
    writes. A config that cannot be used is an error (exit 2), never a silent fallback."""
    if args.profile:
        return args.profile
    if ctx.config_path:
        from daemon.config import load_config

        name = load_config(ctx.config_path, require_secure=os.geteuid() == 0).profile
        if name:
            return name
    return DEFAULT_PROFILE


def _bios_backend(profile, ctx):
    """The BMC reader a profile's bios: section asks for (the sim brings its own)."""
    if profile is None or profile.bios is None or ctx.sim_path:
        return None
    try:
        from hwtune.backends.redfish import bios_from_config
    except ImportError:
        _log("note: BIOS backends not available in this build; BIOS not checked")
        return None
    return bios_from_config(profile.bios, profile.bios.base_dir)


def _load(args, ctx):
    """Profile first (bad input exits 2 before anything is opened), then the host."""
    from hwtune import profiles

    ctx.check_state_dir()
    profile = profiles.load(_profile_name(args, ctx), ctx.profile_dir)
    host = ctx.open_host(bios=_bios_backend(profile, ctx))
    if host.kind == "sim":
        _log(f"simulated host {ctx.sim_path}")
    return profile, host


# --- status ------------------------------------------------------------------------------
def add_status_arguments(p) -> None:
    _add_json(p)


def _cpu_line(c: dict) -> str:
    """The CPU line; a host without cpufreq / cpuidle (common on cloud-style kernels) says so."""
    g = c.get("governor")
    if g is None:
        gov = "governor=n/a (no cpufreq)"
    else:
        if isinstance(g, dict):  # CPUs disagree: count them per governor
            g = "mixed (" + ", ".join(f"{name} on {list(g.values()).count(name)}" for name in sorted(set(g.values()))) + ")"
        gov = f"governor={g} (offered: {', '.join(c.get('available_governors') or []) or '?'})"
    if c.get("max_cstate_latency_us") is not None:
        idle = f"max_cstate_latency_us={c['max_cstate_latency_us']}"
    else:
        idle = "max_cstate_latency_us=n/a (no cpuidle)"
    count = f" ({c['cpus']} cpus)" if c.get("cpus") else ""
    return f"cpu{count}: {gov} {idle}"


def _journal_line(j: dict) -> str:
    if "error" in j:
        return f"journal: {j['error']}"
    text = f"journal: {j['status']}, {j['entries']} original value(s)"
    if j.get("profiles"):
        text += f" from {', '.join(map(str, j['profiles']))}"
    if j["status"] != "committed":
        text += " (an interrupted apply: run `hwtune rollback`)"
    bad = j.get("not_restorable") or []
    if bad:
        text += (f"; ! {len(bad)} entr{'y' if len(bad) == 1 else 'ies'} rollback cannot restore on this host "
                 f"(apply refuses until it can): " + "; ".join(bad[:6]) + (f"; and {len(bad) - 6} more" if len(bad) > 6 else ""))
    return text


def _print_status(s: dict, sim_path=None) -> None:
    kind = f"simulated ({sim_path})" if s["host"]["kind"] == "sim" and sim_path else s["host"]["kind"]
    print(f"host: {kind}{' (read-only)' if s['host']['read_only'] else ''}")
    if s.get("gpu_error"):
        print(f"gpus: none ({s['gpu_error']})")
    for g in s["gpus"]:
        t = g.get("telemetry") or {}
        print(f"{g['target']} {g.get('name')} {g.get('pci_bus_id')}: persistence={g['persistence_mode']} "
              f"power_limit_w={g['power_limit_w']} (range {g['power_limit_constraints_w']}, default "
              f"{g['power_limit_default_w']}) sm_clock_mhz={g['sm_clock_mhz']} memory_clock_mhz={g['memory_clock_mhz']} "
              f"| {t.get('temperature_c')} C {t.get('power_w')} W sm {t.get('sm_clock_mhz')} MHz")
        for e in g.get("errors", []):
            print(f"  ! {e}")
    for f in s["pcie"]:
        if "bdf" not in f:
            print(f"pcie: {f.get('error')}")
            continue
        extra = f" ! {f['error']}" if f.get("error") else ""
        print(f"{f['target']} {f['vendor']}:{f['device']} class {f['class']} {f.get('link') or ''}: devctl={f['devctl']} "
              f"relaxed_ordering={f['relaxed_ordering']} max_read_request_bytes={f['max_read_request_bytes']}{extra}")
    print(_cpu_line(s["cpu"]))
    for e in s["cpu"].get("errors", []):
        print(f"  ! {e}")
    b = s.get("bios")
    if b:
        if b.get("error"):
            print(f"bios ({b['source']}): ! {b['error']}")
        else:
            attrs = b.get("attributes") or {}
            print(f"bios ({b['source']}): " + (" ".join(f"{k}={v}" for k, v in attrs.items()) or "no attributes reported"))
    if s.get("journal"):
        print(_journal_line(s["journal"]))


def run_status(args, ctx) -> int:
    from hwtune import engine

    ctx.check_state_dir()
    host = ctx.open_host()
    s = engine.status(host, ctx.state_dir)
    if args.json:
        _emit(s)
    else:
        _print_status(s, ctx.sim_path)
        if s["host"]["kind"] == "real" and s.get("gpu_error") and not s["gpus"]:
            print("no NVIDIA GPU or driver here: `hwtune demo` runs the whole cycle on a simulated H200 "
                  "host; or `hwtune sim init host.json`, then `hwtune --sim host.json status`", file=sys.stderr)
    return 0


# --- plan --------------------------------------------------------------------------------
def add_plan_arguments(p) -> None:
    _add_profile(p)
    _add_json(p)


def _bios(engine, host, profile) -> tuple:
    """(BIOS drift, None) or ([], why the BMC could not be read)."""
    try:
        return engine.bios_drift(host, profile), None
    except Exception as exc:  # a BMC that does not answer is a fact to report, not a crash
        return [], f"bios: not checked ({exc})"


def run_plan(args, ctx) -> int:
    from hwtune import engine

    profile, host = _load(args, ctx)
    unmatched = engine.unmatched(host, profile)
    changes, skipped = engine.plan_report(host, profile, ctx.state_dir)
    bios, bios_error = _bios(engine, host, profile)
    if bios_error:
        skipped.append(bios_error)
    try:
        pending = engine.pending_journal(ctx.state_dir)
        problems = engine.journal_problems(host, ctx.state_dir)
        if problems:  # apply refuses over a journal it could not undo in full: say it here too
            skipped.append(f"journal: {len(problems)} entr{'y' if len(problems) == 1 else 'ies'} rollback cannot "
                           f"restore on this host: {'; '.join(problems[:6])}")
            pending = True
    except HwtuneError as exc:  # a damaged or untrusted journal: plan still answers, and says so
        skipped.append(f"journal: {exc}")
        pending = True
    if args.json:
        _emit({"profile": profile.name, "source": profile.source, "changes": [c.to_json() for c in changes],
               "skipped": skipped, "unmatched": unmatched, "bios_drift": [c.to_json() for c in bios],
               "pending_journal": pending is not None})
        return 0
    for line in unmatched:
        _log(f"warning: {line}")
    for line in skipped:
        _log(f"skip {line}")
    if pending is not None and not any(line.startswith("journal: ") for line in skipped):
        _log("note: an interrupted apply left a journal; apply will refuse until `hwtune rollback`")
    elif pending is not None:
        _log("note: apply will refuse until the journal above can be rolled back in full")
    print(f"profile {profile.name} ({profile.source}): {len(changes)} change(s)"
          + (f", {len(unmatched)} warning(s) (nothing of those is checked or written)" if unmatched else ""))
    for c in changes:
        print(f"  {c}")
    for c in bios:
        print(f"  {c}  (BIOS: checked, not written)")
    return 0


# --- apply -------------------------------------------------------------------------------
def add_apply_arguments(p) -> None:
    _add_profile(p)
    _add_json(p)


def run_apply(args, ctx) -> int:
    from hwtune import engine

    ctx.check_can_write("apply")
    profile, host = _load(args, ctx)
    unmatched = engine.unmatched(host, profile)
    if not host.read_only:
        ctx.ensure_state_dir()
    for line in unmatched:
        _log(f"warning: {line}")
    result = engine.apply(host, profile, ctx.state_dir, _log)
    bios, bios_error = _bios(engine, host, profile)
    try:
        for c in bios:
            _log(f"bios drift (not written): {c}")
        if bios_error:
            _log(bios_error)
    except (OSError, ValueError):
        pass
    if args.json:
        # "bios_drift": [] alone would read as "the BIOS matches" when the BMC was not read.
        _after_writes(json.dumps({"profile": profile.name, **result.to_json(), "unmatched": unmatched,
                                  "bios_drift": [c.to_json() for c in bios],
                                  "not_checked": [bios_error] if bios_error else []}, indent=2) + "\n")
        return 0
    parts = [f"{len(result.changed)} change(s)", f"{len(result.skipped)} skipped"]
    if unmatched:
        parts.append(f"{len(unmatched)} warning(s)")
    if bios or bios_error:
        parts.append(f"BIOS {'not checked' if bios_error else f'differs in {len(bios)} attribute(s)'} (never written)")
    text = f"applied {profile.name}: {', '.join(parts)}"
    if not (result.changed or result.skipped or unmatched or bios or bios_error):
        text = f"applied {profile.name}: 0 change(s): the host already matches {profile.name}"
    _after_writes(text + "\n")
    return 0


# --- verify ------------------------------------------------------------------------------
def add_verify_arguments(p) -> None:
    _add_profile(p)
    _add_json(p)


def run_verify(args, ctx) -> int:
    """Exit 0 only when everything the profile sets was read and has its value: a section that
    matched no device, an unreadable knob or an unreadable BMC is a failure, named."""
    from hwtune import engine

    profile, host = _load(args, ctx)
    unchecked = engine.unmatched(host, profile)
    changes, skipped = engine.plan_report(host, profile, ctx.state_dir)
    bios, bios_error = _bios(engine, host, profile)
    drift = changes + bios
    unchecked += skipped + ([bios_error] if bios_error else [])
    if args.json:
        _emit({"profile": profile.name, "matches": not drift and not unchecked,
               "drift": [c.to_json() for c in drift], "not_checked": unchecked})
    elif drift or unchecked:
        head = [f"{len(drift)} setting(s) differ"] if drift else []
        head += [f"{len(unchecked)} not checked"] if unchecked else []
        print(f"host does not match {profile.name}: {', '.join(head)}")
        for c in drift:
            print(f"  {c.target} {c.knob}: is {c.old}, profile wants {c.new}")
        for line in unchecked:
            print(f"  not checked: {line}")
    else:
        print(f"host matches {profile.name}")
    return 1 if drift or unchecked else 0


# --- rollback ----------------------------------------------------------------------------
def add_rollback_arguments(p) -> None:
    _add_json(p)


def run_rollback(args, ctx) -> int:
    from hwtune import engine

    ctx.check_can_write("rollback")
    ctx.check_state_dir()
    host = ctx.open_host()
    try:
        restored = engine.rollback(host, ctx.state_dir, _log)
    except engine.RollbackIncomplete as exc:
        if args.json:  # what was restored and what stays, not only the error's one line
            _after_writes(json.dumps({"ok": False, "restored": [c.to_json() for c in exc.restored],
                                      "not_restored": exc.not_restored, "journal": exc.journal,
                                      "error": str(exc), "exit_code": exc.exit_code}, indent=2) + "\n")
        raise
    if args.json:
        _after_writes(json.dumps({"ok": True, "restored": [c.to_json() for c in restored]}, indent=2) + "\n")
    elif restored:
        _after_writes(f"rolled back {len(restored)} value(s)\n")
    return 0
