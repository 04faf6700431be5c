"""YAML that drives root actions (profiles, the service config) is checked before it is
composed: PyYAML builds nested nodes recursively and expands aliases, so a file 20000 levels
deep or a "billion laughs" of aliases would crash or hang the loader. The event stream is
read without recursion and refused on the first of: anchors or aliases (neither file needs
them), nesting deeper than MAX_DEPTH, more than MAX_NODES values, a key that is not a plain
scalar, a duplicate key, an integer of more than MAX_DIGITS digits (int() refuses 4300 with
a ValueError). The answer names the line and the dotted key, never the value.
"""
from __future__ import annotations

import os
import re
import stat

import yaml

MAX_BYTES = 1 << 20
MAX_DEPTH = 32
MAX_NODES = 20000
MAX_DIGITS = 1000  # int() refuses more than 4300; no setting has a tenth of this


class Refused(Exception):
    def __init__(self, problem: str, line: int | None = None, key: str | None = None):
        self.problem, self.line, self.key = problem, line, key
        super().__init__(problem)


class Unreadable(Exception):
    """The input file could not be read as one (`missing`: it does not exist)."""

    def __init__(self, problem: str, missing: bool = False):
        self.problem, self.missing = problem, missing
        super().__init__(problem)


def read_input(path, limit: int = MAX_BYTES) -> tuple[bytes, os.stat_result]:
    """(bytes, fstat) of an input file that drives root actions (a profile, the service config,
    the BMC credentials, the simulated host). Opened without blocking and read only when it is
    a regular file: a FIFO or a device (`-p /dev/zero`) would block or never end; a file past
    `limit` bytes is refused without being read whole. Raises Unreadable with one phrase."""
    try:
        fd = os.open(str(path), os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise Unreadable(f"cannot read: {exc.strerror or exc}", isinstance(exc, FileNotFoundError)) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Unreadable(f"cannot read: {'Is a directory' if stat.S_ISDIR(st.st_mode) else 'not a regular file'}")
        chunks, size = [], 0
        while size <= limit:
            chunk = os.read(fd, min(1 << 16, limit + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        raw = b"".join(chunks)
    except OSError as exc:
        raise Unreadable(f"cannot read: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    if len(raw) > limit:
        raise Unreadable(f"larger than {limit >> 20} MiB" if limit % (1 << 20) == 0 else f"larger than {limit >> 10} KiB")
    return raw, st


def check(text: str) -> None:
    """Raise Refused (problem, line, key) for YAML that must not reach the composer;
    yaml.YAMLError for text that is not YAML at all."""
    if len(text) > MAX_BYTES:
        raise Refused(f"larger than {MAX_BYTES >> 10} KiB")
    # frames: [kind, path, keys seen, expecting a key, current key]
    stack: list = []
    nodes = 0
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        line = event.start_mark.line + 1 if event.start_mark is not None else None
        if isinstance(event, yaml.AliasEvent):
            raise Refused("aliases (*name) are not allowed here", line, _path(stack))
        if isinstance(event, (yaml.ScalarEvent, yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            nodes += 1
            if nodes > MAX_NODES:
                raise Refused(f"more than {MAX_NODES} values", line)
            if event.anchor:
                raise Refused("anchors (&name) are not allowed here", line, _path(stack))
            top = stack[-1] if stack else None
            key_path = _path(stack)
            if isinstance(event, yaml.ScalarEvent):
                problem = _scalar_problem(event)
                if problem is not None:
                    here = key_path if top is None or top[0] != "map" or top[3] else (
                        f"{top[1]}.{top[4]}" if top[1] else top[4])
                    raise Refused(problem, line, here or None)
            if top is not None and top[0] == "map":
                if top[3]:  # this node is a key
                    if not isinstance(event, yaml.ScalarEvent):
                        raise Refused("keys must be plain names", line, key_path or None)
                    key = event.value
                    child = f"{top[1]}.{key}" if top[1] else key
                    if key in top[2]:
                        raise Refused("duplicate key", line, child)
                    top[2].add(key)
                    top[4] = key
                    top[3] = False
                    continue
                top[3] = True  # a value: the next node is a key again
                here = f"{top[1]}.{top[4]}" if top[1] else top[4]
            elif top is not None:
                top[4] += 1
                here = f"{top[1]}.{top[4]}" if top[1] else str(top[4])
            else:
                here = ""
            if isinstance(event, yaml.MappingStartEvent):
                stack.append(["map", here, set(), True, None])
            elif isinstance(event, yaml.SequenceStartEvent):
                stack.append(["seq", here, None, False, -1])
            if len(stack) > MAX_DEPTH:
                raise Refused(f"nested deeper than {MAX_DEPTH} levels", line)
        elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            stack.pop()


_DECIMAL = re.compile(r"[-+]?[0-9][0-9_]*")


def _is_int(event) -> bool:
    """A scalar the loader turns into an int through int(text), which refuses more than 4300
    decimal digits (a ValueError, not a YAML error): plain, or tagged !!int."""
    return (event.style is None or event.tag == "tag:yaml.org,2002:int") and _DECIMAL.fullmatch(event.value) is not None


_RESOLVER = yaml.resolver.Resolver()
_STR = "tag:yaml.org,2002:str"


def _scalar_problem(event) -> str | None:
    """Why the loader could not build this scalar, found here: PyYAML's constructors raise
    ValueError (2023-02-30, !!float abc), KeyError (!!bool maybe) or AttributeError, not a
    YAMLError, and a tag it has no constructor for (!!python/...) is a ConstructorError. The
    value itself is never named (it may be a password)."""
    if len(event.value) > MAX_DIGITS and _is_int(event):
        return f"a number of {len(event.value)} digits"
    tag = event.tag
    if tag is None or tag == "!":
        tag = _RESOLVER.resolve(yaml.ScalarNode, event.value, event.implicit)
    if tag == _STR:
        return None
    if tag not in yaml.constructor.SafeConstructor.yaml_constructors:
        return f"unsupported tag {tag.replace('tag:yaml.org,2002:', '!!')[:60]}"
    node = yaml.ScalarNode(tag, event.value, event.start_mark, event.end_mark, event.style)
    try:
        yaml.constructor.SafeConstructor().construct_object(node)
    except Exception:
        return f"not a valid {tag.rsplit(':', 1)[-1][:40]}"
    return None


def _path(stack: list) -> str:
    return stack[-1][1] if stack else ""
