"""Tuning profiles: YAML with `include:` inheritance, validated once into frozen objects.

Lookup of a name: a path if it ends in .yaml/.yml or holds a "/", else PROFILE_DIR/NAME.yaml,
else the shipped hwtune/profiles/NAME.yaml. Includes are resolved the same way, but first
beside the including file (relative paths too). Includes come first, in order; the including file last: later
wins, merged key by key inside each section.

Every error names file, line and key; a typo gets a "did you mean". Values the device must
judge (power limit constraints, supported clocks, offered governors) are checked by
`Profile.validate_for(host)` at plan time.
"""
from __future__ import annotations

import difflib
import math
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

import yaml

from hwtune import yamlguard
from hwtune.errors import ProfileError

SHIPPED_DIR = Path(__file__).resolve().parent / "profiles"

SECTION_KEYS = {
    "gpu": ("select", "persistence_mode", "power_limit_w", "sm_clock_mhz", "memory_clock_mhz"),
    "pcie": ("select", "relaxed_ordering", "max_read_request_bytes"),
    "cpu": ("governor", "max_cstate_latency_us"),
    "bios": ("source", "endpoint", "credentials_file", "expect", "system_id", "command", "verify_tls",
             "allow_insecure_http"),
}
TOP_KEYS = ("include", "description") + tuple(SECTION_KEYS)
BIOS_SOURCES = ("redfish", "racadm", "ilorest")
PERCENT = re.compile(r"^\d+(\.\d+)?%$")
BDF = re.compile(r"^([0-9a-fA-F]{4}:)?[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]$")
CLASS_SELECT = re.compile(r"^class:0x[0-9a-fA-F]{2,6}$")


@dataclass(frozen=True)
class GpuSection:
    select: object = "all"  # "all" | tuple of int indices / UUID strings
    persistence_mode: bool | None = None
    power_limit_w: object = None  # number | "max" | "default" | "NN%"
    sm_clock_mhz: object = None  # (lo, hi) | "reset"
    memory_clock_mhz: object = None


@dataclass(frozen=True)
class PcieSection:
    select: object = "nvidia"  # "nvidia" | "mellanox" | "class:0x0207" | tuple of BDFs
    relaxed_ordering: bool | None = None
    max_read_request_bytes: int | None = None


@dataclass(frozen=True)
class CpuSection:
    governor: str | None = None
    max_cstate_latency_us: int | None = None


@dataclass(frozen=True)
class BiosSection:
    source: str = "redfish"
    endpoint: str | None = None
    credentials_file: str | None = None
    expect: MappingProxyType = field(default_factory=lambda: MappingProxyType({}))
    system_id: str | None = None
    command: str | None = None
    verify_tls: bool | None = None
    allow_insecure_http: bool | None = None  # plain http with credentials only when this says so
    base_dir: str = "."  # where relative paths (credentials_file) are resolved from


SECTION_CLASSES = {"gpu": GpuSection, "pcie": PcieSection, "cpu": CpuSection, "bios": BiosSection}


@dataclass(frozen=True)
class Profile:
    name: str
    source: str
    description: str = ""
    gpu: GpuSection | None = None
    pcie: PcieSection | None = None
    cpu: CpuSection | None = None
    bios: BiosSection | None = None
    # (dotted key, file, line) of the value that won, for error messages at plan time.
    marks: tuple = ()

    def where(self, key: str) -> tuple:
        """(file, line) of a dotted key, or of its closest parent that has a mark."""
        table = {k: (f, ln) for k, f, ln in self.marks}
        probe = key
        while probe:
            if probe in table:
                return table[probe]
            probe = probe.rpartition(".")[0]
        return (self.source, None)

    def error(self, key: str, message: str) -> ProfileError:
        file, line = self.where(key)
        return ProfileError(message, file=file, line=line, key=key)

    def validate_for(self, host) -> None:
        """Check device-dependent values (constraints, supported clocks, governors)."""
        from hwtune.errors import KnobUnavailable
        from hwtune.knobs import KNOBS, BadValue

        for family, cls in KNOBS.items():
            knob = cls()
            section = getattr(self, knob.section)
            if section is None:
                continue
            try:
                for target in knob.targets(host, section):
                    try:
                        knob.desired(host, target, section)
                    except KnobUnavailable:
                        continue
            except BadValue as exc:
                raise self.error(exc.key, exc.message) from None

    def to_dict(self) -> dict:
        """Plain data that `Profile.from_dict` accepts (candidate profiles are built from it)."""
        out: dict = {}
        if self.description:
            out["description"] = self.description
        for name in SECTION_KEYS:
            section = getattr(self, name)
            if section is None:
                continue
            d = {}
            for key in SECTION_KEYS[name]:
                v = getattr(section, key)
                if v is None or (key == "expect" and not v):
                    continue
                d[key] = dict(v) if isinstance(v, MappingProxyType) else list(v) if isinstance(v, tuple) else v
            out[name] = d
        return out

    @staticmethod
    def from_dict(data: dict, source: str = "<dict>", profile_dir=None) -> "Profile":
        """Validate plain data (as a YAML file would hold) into a Profile; includes allowed."""
        marks = {}
        merged = _merge_includes(data, marks, source, None, profile_dir, [source])
        return _build(merged, marks, source, Path(source).stem if source != "<dict>" else source)


# --- YAML with line numbers --------------------------------------------------------------
def _to_python(node, path: str, file: str, marks: dict):
    marks[path] = (file, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        out = {}
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode):
                raise ProfileError("keys must be plain names", file, key_node.start_mark.line + 1, path or None)
            key = key_node.value
            child = f"{path}.{key}" if path else key
            if key in out:
                raise ProfileError("duplicate key", file, key_node.start_mark.line + 1, child)
            out[key] = _to_python(value_node, child, file, marks)
            marks[child] = (file, key_node.start_mark.line + 1)
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_to_python(n, f"{path}.{i}", file, marks) for i, n in enumerate(node.value)]
    return yaml.constructor.SafeConstructor().construct_object(node)


def _read_text(path: Path) -> str:
    """The file's text (yamlguard.read_input: a regular file only, size-capped); bytes that are
    not UTF-8 are one line, not a traceback."""
    file = str(path)
    try:
        raw, st = yamlguard.read_input(path)
    except yamlguard.Unreadable as exc:
        raise ProfileError(exc.problem, file) from None
    _check_trusted(path, st)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ProfileError(f"not UTF-8 text (byte {exc.start})", file) from None


def _check_trusted(path: Path, st) -> None:
    """As root, a profile (or an include) must be root's and writable by nobody else, as the
    service config is: it chooses root's writes, and the BMC endpoint root sends
    bios.credentials_file's password to. The shipped profiles are part of the code itself."""
    if os.geteuid() != 0 or SHIPPED_DIR in Path(os.path.abspath(path)).parents:
        return
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid != 0:
        raise ProfileError(f"owned by uid {st.st_uid}, not root: a profile drives root's writes; refusing it "
                           f"(chown root {path})", str(path))
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ProfileError(f"mode {mode:04o} lets other users write it: a profile drives root's writes; refusing "
                           f"it (chmod go-w {path})", str(path))


def _parse(path: Path, marks: dict) -> dict:
    file = str(path)
    text = _read_text(path)
    try:
        yamlguard.check(text)  # deep nesting, aliases: refused before the recursive composer
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yamlguard.Refused as exc:
        raise ProfileError(exc.problem, file, exc.line, exc.key) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        problem = getattr(exc, "problem", None) or str(exc)
        raise ProfileError(f"malformed YAML: {problem}", file, mark.line + 1 if mark else None) from None
    if node is None:
        return {}
    if not isinstance(node, yaml.MappingNode):
        raise ProfileError("a profile is a mapping of sections (gpu, pcie, cpu, bios)", file, node.start_mark.line + 1)
    own: dict = {}
    data = _to_python(node, "", file, own)
    own.pop("", None)
    marks.update(own)
    return data


MAX_NAME_BYTES = 255


def name_problem(name) -> str | None:
    """Why `name` cannot name a profile file (checked before any lookup)."""
    if not isinstance(name, str) or not name.strip():
        return "expected a profile name or path"
    if any(ord(c) < 32 for c in name):
        return "control characters in the name"
    parts = name.split("/")
    longest = max(len(p.encode()) for p in parts)
    if longest > MAX_NAME_BYTES:
        return f"a name (or path component) of {longest} bytes; at most {MAX_NAME_BYTES}"
    if len(name.encode()) > 4096:
        return f"a path of {len(name.encode())} bytes; at most 4096"
    return None


def _find(name: str, base_dir: Path | None, profile_dir) -> Path | None:
    """A path, or a bare name looked up beside the including file, in PROFILE_DIR, shipped."""
    if name_problem(name):
        return None
    p = Path(name)
    if p.suffix in (".yaml", ".yml") or "/" in name:
        p = p if p.is_absolute() or base_dir is None else base_dir / p
        for cand in (p, Path(name)):
            found = _exists(cand)
            if found is None:
                return cand  # reading it names why (Permission denied)
            if found:
                return cand
        return None
    dirs = [base_dir] if base_dir is not None else []
    for d in dirs + ([Path(profile_dir)] if profile_dir else []) + [SHIPPED_DIR]:
        cand = d / f"{name}.yaml"
        if _exists(cand):  # a profile dir this user cannot look in holds none of its profiles
            return cand
    return None


def _exists(path: Path) -> bool | None:
    """Whether `path` exists; None when it cannot be looked at (a directory this user may not
    enter, a name too long): Path.exists() raises those as OSError."""
    try:
        return path.exists()
    except OSError:
        return None


def _known_names(profile_dir) -> list:
    names = {p.stem for p in SHIPPED_DIR.glob("*.yaml")}
    try:
        if profile_dir and Path(profile_dir).is_dir():
            names |= {p.stem for p in Path(profile_dir).glob("*.yaml")}
    except OSError:
        pass
    return sorted(names)


def _hint(word: str, choices) -> str | None:
    close = difflib.get_close_matches(str(word), list(choices), n=1, cutoff=0.6)
    return f"did you mean {close[0]!r}?" if close else None


def _deep_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def _merge_includes(data: dict, marks: dict, file: str, base_dir: Path, profile_dir, stack: list) -> dict:
    includes = data.get("include", [])
    if isinstance(includes, str):
        includes = [includes]
    if not isinstance(includes, list) or not all(isinstance(i, str) for i in includes):
        line = marks.get("include", (file, None))[1]
        raise ProfileError("must be a profile name or a list of names", file, line, "include")
    merged: dict = {}
    own_marks = dict(marks)
    for n, inc in enumerate(includes):
        line = own_marks.get(f"include.{n}", own_marks.get("include", (file, None)))[1]
        path = _find(inc, base_dir, profile_dir)
        if path is None:
            raise ProfileError(f"included profile {inc!r} not found (in {profile_dir or '-'} or shipped)",
                               file, line, "include", _hint(inc, _known_names(profile_dir)))
        key = str(path.resolve())
        if key in stack:
            chain = " -> ".join(Path(s).name for s in stack[stack.index(key):] + [key])
            raise ProfileError(f"include cycle: {chain}", file, line, "include")
        sub_marks: dict = {}
        sub = _merge_includes(_parse(path, sub_marks), sub_marks, str(path), path.parent, profile_dir, stack + [key])
        merged = _deep_merge(merged, sub)
        marks.update(sub_marks)
    marks.update(own_marks)
    return _deep_merge(merged, {k: v for k, v in data.items() if k != "include"})


# --- validation into frozen objects ------------------------------------------------------
def _build(data: dict, marks: dict, source: str, name: str) -> Profile:
    def fail(key, message, hint=None):
        file, line = marks.get(key, (source, None))
        return ProfileError(message, file, line, key, hint)

    for key in data:
        if key not in TOP_KEYS:
            raise fail(key, "unknown key", _hint(key, TOP_KEYS))
    sections = {}
    for sname, keys in SECTION_KEYS.items():
        raw = data.get(sname)
        if raw is None:
            continue
        if not isinstance(raw, dict):
            raise fail(sname, f"must be a mapping of {', '.join(keys)}")
        for key in raw:
            if key not in keys:
                raise fail(f"{sname}.{key}", "unknown key", _hint(key, keys))
        values = {k: _check(sname, k, v, fail) for k, v in raw.items()}
        if sname == "bios":
            bios_file = marks.get("bios.credentials_file", marks.get("bios", (source, None)))[0]
            values["base_dir"] = str(Path(bios_file).parent)
        sections[sname] = SECTION_CLASSES[sname](**values)
    desc = data.get("description", "")
    if not isinstance(desc, str):
        raise fail("description", "must be text")
    flat = tuple(sorted((k, f, ln) for k, (f, ln) in marks.items() if k))
    return Profile(name=name, source=source, description=desc, marks=flat, **sections)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _finite(v) -> bool:
    """A number float() can hold (10**400 overflows it) that is not NaN or infinite."""
    try:
        return math.isfinite(float(v))
    except OverflowError:
        return False


def _check(section: str, key: str, v, fail):
    dotted = f"{section}.{key}"
    if key in ("persistence_mode", "relaxed_ordering", "verify_tls", "allow_insecure_http"):
        if not isinstance(v, bool):
            raise fail(dotted, f"must be true or false, got {v!r}")
        return v
    if section == "gpu" and key == "select":
        if v == "all":
            return v
        if isinstance(v, (int, str)) and not isinstance(v, bool):
            v = [v]
        if not isinstance(v, list) or not v or not all(
                (_is_int(x) and x >= 0) or (isinstance(x, str) and x.startswith("GPU-")) for x in v):
            raise fail(dotted, f"must be all, a list of GPU indices, or a list of GPU-UUIDs; got {v!r}")
        return tuple(v)
    if key == "power_limit_w":
        if v in ("max", "default") or (isinstance(v, str) and PERCENT.match(v)):
            if isinstance(v, str) and v.endswith("%") and not 0 < float(v[:-1]) <= 100:
                raise fail(dotted, f"{v}: a percentage of the default limit must be in 1..100%")
            return v
        if not _is_num(v) or not _finite(v) or v <= 0:
            raise fail(dotted, f"must be watts (a number), max, default or a percentage like \"80%\"; got {v!r}",
                       _hint(v, ("max", "default")) if isinstance(v, str) else None)
        return v
    if key in ("sm_clock_mhz", "memory_clock_mhz"):
        if v == "reset":
            return v
        if _is_int(v):
            v = [v, v]
        if not isinstance(v, list) or len(v) != 2 or not all(_is_int(x) and x > 0 for x in v):
            raise fail(dotted, f"must be [min, max] in MHz, one MHz value, or reset; got {v!r}",
                       _hint(v, ("reset",)) if isinstance(v, str) else None)
        if v[0] > v[1]:
            raise fail(dotted, f"min {v[0]} > max {v[1]}")
        return tuple(v)
    if section == "pcie" and key == "select":
        if v in ("nvidia", "mellanox") or (isinstance(v, str) and CLASS_SELECT.match(v)):
            return v.lower()
        if isinstance(v, list) and v and all(isinstance(x, str) and BDF.match(x) for x in v):
            return tuple(x.lower() for x in v)
        raise fail(dotted, f"must be nvidia, mellanox, class:0xCCSS or a list of BDFs (0000:18:00.0); got {v!r}",
                   _hint(v, ("nvidia", "mellanox")) if isinstance(v, str) else None)
    if key == "max_read_request_bytes":
        if not _is_int(v) or v < 128 or v > 4096 or v & (v - 1):
            raise fail(dotted, f"{v!r}: must be a power of two in 128..4096")
        return v
    if key == "governor":
        if not isinstance(v, str) or not v:
            raise fail(dotted, f"must be a governor name, got {v!r}")
        return v
    if key == "max_cstate_latency_us":
        if not _is_int(v) or v < 0:
            raise fail(dotted, f"must be a whole number of microseconds >= 0, got {v!r}")
        return v
    if section == "bios":
        if key == "source":
            if v not in BIOS_SOURCES:
                raise fail(dotted, f"must be one of {', '.join(BIOS_SOURCES)}; got {v!r}", _hint(v, BIOS_SOURCES))
            return v
        if key == "expect":
            if not isinstance(v, dict) or not all(isinstance(x, (str, int, bool)) for x in v.values()):
                raise fail(dotted, "must be a mapping of BIOS attribute: value")
            return MappingProxyType(dict(v))
        if not isinstance(v, str):
            raise fail(dotted, f"must be text, got {v!r}")
        return v
    raise fail(dotted, "unknown key")


def load(name_or_path: str, profile_dir=None) -> Profile:
    """Load, merge includes and validate a profile by name or path."""
    why = name_problem(str(name_or_path))
    if why:
        shown = str(name_or_path) if len(str(name_or_path)) <= 60 else str(name_or_path)[:57] + "..."
        raise ProfileError(why, shown, None, "profile")
    path = _find(str(name_or_path), None, profile_dir)
    if path is None:
        hint = _hint(name_or_path, _known_names(profile_dir))
        if Path(name_or_path).is_file():
            # a bare name is a profile name: a file of that name here is read only as a path
            hint = f"the file {name_or_path} here is read as a path only: -p ./{name_or_path}"
        if Path(name_or_path).suffix in (".yaml", ".yml") or "/" in str(name_or_path):
            # a path is read as a path only: where profiles are looked up does not matter to it
            stem = Path(name_or_path).stem
            raise ProfileError("no such file", str(name_or_path), None, None,
                               f"-p {stem} names the profile {stem!r}" if stem in _known_names(profile_dir) else None)
        raise ProfileError(f"profile {name_or_path!r} not found (looked in {profile_dir or '-'} and the shipped profiles: "
                           f"{', '.join(_known_names(profile_dir))})", str(name_or_path), None, None, hint)
    marks: dict = {}
    data = _parse(path, marks)
    key = str(path.resolve())
    merged = _merge_includes(data, marks, str(path), path.parent, profile_dir, [key])
    return _build(merged, marks, str(path), path.stem)


def names(profile_dir=None) -> list:
    return _known_names(profile_dir)
