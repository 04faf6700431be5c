"""The service config (default /etc/hwtune/hwtune.yaml), validated once into frozen objects.

The file drives root actions (which profile is applied, what runs as the agent user), so it
must be owned by root and writable by nobody else; `load_config` refuses it otherwise.

    profile: throughput
    poll_interval_s: 5
    rollback: on_exit            # on_exit | never  (like tuned's not_on_exit)
    reapply_min_interval_s: 60
    metrics: {enabled: true, address: 127.0.0.1, port: 9835}
    dispatch_table: /var/lib/hwtune/dispatch.json
    agent_user: nobody
    thermal: {max_temperature_c: 87}
    restore_on: [thermal, power_brake, xid]
"""
from __future__ import annotations

import difflib
import ipaddress
import os
import pwd
import re
import stat
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from hwtune import yamlguard
from hwtune.errors import UsageError

DEFAULT_CONFIG_PATH = Path("/etc/hwtune/hwtune.yaml")
ROLLBACK_POLICIES = ("on_exit", "never")
MAX_NAME_BYTES = 255  # a file name: a profile name longer than this cannot name a file
HOSTNAME = re.compile(r"(?=.{1,253}$)([A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*")
RESTORE_EVENTS = ("thermal", "power_brake", "xid")


@dataclass(frozen=True)
class MetricsConfig:
    enabled: bool = True
    address: str = "127.0.0.1"
    port: int = 9835


@dataclass(frozen=True)
class ThermalConfig:
    max_temperature_c: float = 87


@dataclass(frozen=True)
class Config:
    profile: str | None = None
    poll_interval_s: float = 5
    rollback: str = "on_exit"
    reapply_min_interval_s: float = 60
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    dispatch_table: Path | None = None
    agent_user: str = "nobody"
    thermal: ThermalConfig = field(default_factory=ThermalConfig)
    restore_on: tuple[str, ...] = RESTORE_EVENTS
    source: str = "<defaults>"

    @classmethod
    def from_dict(cls, data: Any, source: str = "<config>") -> "Config":
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise UsageError(f"{source}: expected a mapping at the top level, got {type(data).__name__}")
        top = {"profile", "poll_interval_s", "rollback", "reapply_min_interval_s", "metrics",
               "dispatch_table", "agent_user", "thermal", "restore_on"}
        _reject_unknown(data, top, source, "")

        profile = data.get("profile")
        if profile is not None and (not isinstance(profile, str) or not profile.strip()):
            raise UsageError(f"{source}: profile: expected a profile name or path, got {_show(profile)}")
        if profile is not None:
            if len(profile.encode()) > MAX_NAME_BYTES and "/" not in profile:
                raise UsageError(f"{source}: profile: a name of {len(profile.encode())} bytes "
                                 f"(at most {MAX_NAME_BYTES}: it names a file)")
            if any(len(part.encode()) > MAX_NAME_BYTES for part in profile.split("/")) or len(profile) > 4096:
                raise UsageError(f"{source}: profile: a path component longer than {MAX_NAME_BYTES} bytes")
            if any(ord(c) < 32 for c in profile):
                raise UsageError(f"{source}: profile: control characters in the name")

        rollback = data.get("rollback", "on_exit")
        if not isinstance(rollback, str) or rollback not in ROLLBACK_POLICIES:
            raise UsageError(f"{source}: rollback: {_show(rollback)} is not one of {', '.join(ROLLBACK_POLICIES)}"
                             + _did_you_mean(str(rollback), ROLLBACK_POLICIES))

        metrics_raw = data.get("metrics") or {}
        if not isinstance(metrics_raw, dict):
            raise UsageError(f"{source}: metrics: expected a mapping, got {_show(metrics_raw)}")
        _reject_unknown(metrics_raw, {"enabled", "address", "port"}, source, "metrics.")
        port = metrics_raw.get("port", 9835)
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise UsageError(f"{source}: metrics.port: expected an integer in 0..65535, got {_show(port)}")
        address = _address(metrics_raw.get("address", "127.0.0.1"), source)
        metrics = MetricsConfig(enabled=_bool(metrics_raw.get("enabled", True), source, "metrics.enabled"),
                                address=address, port=port)

        thermal_raw = data.get("thermal") or {}
        if not isinstance(thermal_raw, dict):
            raise UsageError(f"{source}: thermal: expected a mapping, got {_show(thermal_raw)}")
        _reject_unknown(thermal_raw, {"max_temperature_c"}, source, "thermal.")
        thermal = ThermalConfig(max_temperature_c=_number(
            thermal_raw.get("max_temperature_c", 87), source, "thermal.max_temperature_c", 1, 150))

        restore_on = data.get("restore_on", list(RESTORE_EVENTS))
        if not isinstance(restore_on, list):
            raise UsageError(f"{source}: restore_on: expected a list of {', '.join(RESTORE_EVENTS)}, "
                             f"got {_show(restore_on)}")
        for event in restore_on:
            if not isinstance(event, str) or event not in RESTORE_EVENTS:
                raise UsageError(f"{source}: restore_on: unknown event {_show(event)} "
                                 f"(known: {', '.join(RESTORE_EVENTS)})" + _did_you_mean(str(event), RESTORE_EVENTS))

        dispatch = data.get("dispatch_table")
        if dispatch is not None and not isinstance(dispatch, str):
            raise UsageError(f"{source}: dispatch_table: expected a file path, got {_show(dispatch)}")

        agent_user = data.get("agent_user", "nobody")
        if not isinstance(agent_user, str) or not agent_user:
            raise UsageError(f"{source}: agent_user: expected a user name, got {_show(agent_user)}")
        if agent_user == "root":
            # The external agent proposer runs arbitrary generated code; never as root.
            raise UsageError(f"{source}: agent_user: must be an unprivileged user, not root")
        if "agent_user" in data:
            try:
                uid = pwd.getpwnam(agent_user).pw_uid
            except (KeyError, ValueError):
                raise UsageError(f"{source}: agent_user: no such user {_show(agent_user)} on this host") from None
            if uid == 0:
                raise UsageError(f"{source}: agent_user: {_show(agent_user)} has uid 0; must be an unprivileged user")

        return cls(
            profile=profile,
            poll_interval_s=_number(data.get("poll_interval_s", 5), source, "poll_interval_s", 0.05, 3600),
            rollback=rollback,
            reapply_min_interval_s=_number(data.get("reapply_min_interval_s", 60), source,
                                           "reapply_min_interval_s", 0, 86400),
            metrics=metrics,
            dispatch_table=Path(dispatch) if dispatch else None,
            agent_user=agent_user,
            thermal=thermal,
            restore_on=tuple(dict.fromkeys(restore_on)),
            source=source,
        )

    def to_json(self) -> dict:
        out = asdict(self)
        out["dispatch_table"] = str(self.dispatch_table) if self.dispatch_table else None
        out["restore_on"] = list(self.restore_on)
        return out


def _show(value: Any) -> str:
    """A value in an error message: short, and a container is never printed whole."""
    if isinstance(value, dict):
        return f"a mapping of {len(value)} key(s)"
    if isinstance(value, (list, tuple)):
        return f"a list of {len(value)} item(s)"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _address(value: Any, source: str) -> str:
    """metrics.address: an IPv4 / IPv6 address or a host name (checked before binding)."""
    if not isinstance(value, str) or not value:
        raise UsageError(f"{source}: metrics.address: expected a host address, got {_show(value)}")
    try:
        ipaddress.ip_address(value.strip("[]"))
        return value.strip("[]")
    except ValueError:
        pass
    if re.fullmatch(r"[0-9.]+", value) or not HOSTNAME.fullmatch(value):
        raise UsageError(f"{source}: metrics.address: {_show(value)} is not an IP address or a host name")
    return value


def _did_you_mean(word: str, known) -> str:
    close = difflib.get_close_matches(word, list(known), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _reject_unknown(data: dict, known: set[str], source: str, prefix: str) -> None:
    for key in data:
        if key not in known:
            shown = str(key) if len(str(key)) <= 60 else str(key)[:57] + "..."
            raise UsageError(f"{source}: {prefix}{shown}: unknown key" + _did_you_mean(str(key)[:200], sorted(known))
                             + f"; known keys: {', '.join(sorted(known))}")


def _bool(value: Any, source: str, key: str) -> bool:
    if not isinstance(value, bool):
        raise UsageError(f"{source}: {key}: expected true or false, got {_show(value)}")
    return value


def _number(value: Any, source: str, key: str, lo: float, hi: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UsageError(f"{source}: {key}: expected a number, got {_show(value)}")
    if not lo <= value <= hi:
        raise UsageError(f"{source}: {key}={value}: outside {lo:g}..{hi:g}")
    return value


def check_secure(path: Path, st: os.stat_result) -> None:
    """Refuse a config that someone other than root (or, run as a user, that user) could have
    written: as root it drives root actions; as a user (a --sim host) only that user's."""
    mode = stat.S_IMODE(st.st_mode)
    me = os.geteuid()
    if st.st_uid not in (0, me):
        owner = "root" if me == 0 else f"root or uid {me} (this user)"
        raise UsageError(f"{path}: refusing the config: owned by uid {st.st_uid}, must be owned by {owner} "
                         f"(it drives {'root ' if me == 0 else ''}actions; chown {'root' if me == 0 else me} {path})")
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UsageError(f"{path}: refusing the config: mode {mode:04o} is group- or world-writable "
                         f"(it drives root actions; chmod go-w {path})")


def load_config(path: Path | str | None = None, require_secure: bool = True) -> Config:
    """Read and validate the service config. `path=None` reads the default file when it
    exists and otherwise returns the defaults."""
    if path is None:
        if not DEFAULT_CONFIG_PATH.exists():
            return Config()
        path = DEFAULT_CONFIG_PATH
    path = Path(path)
    try:
        # the mode checked is the file's actually read (fstat on the open descriptor), not
        # whatever the path points at a moment later
        raw, st = yamlguard.read_input(path)
    except yamlguard.Unreadable as exc:
        raise UsageError(f"{path}: config file not found" if exc.missing
                         else f"{path}: {exc.problem}") from None
    if require_secure:
        check_secure(path, st)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise UsageError(f"{path}: cannot read the config: not UTF-8 text") from None
    try:
        yamlguard.check(text)  # deep nesting, aliases, duplicate keys: refused before composing
        data = yaml.safe_load(text)
    except yamlguard.Refused as exc:
        where = f"{path}:{exc.line}" if exc.line else str(path)
        raise UsageError(f"{where}: {exc.key + ': ' if exc.key else ''}{exc.problem}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        raise UsageError(f"{where}: malformed YAML: {getattr(exc, 'problem', None) or type(exc).__name__}") from None
    except RecursionError:
        raise UsageError(f"{path}: nested too deeply") from None
    return Config.from_dict(data, source=str(path))
