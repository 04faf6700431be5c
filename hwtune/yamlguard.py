"""YAML that drives root actions (profiles, the service config) is checked before it is
composed: PyYAML builds nested nodes recursively and expands aliases, so a file 20000 levels
deep or a "billion laughs" of aliases would crash or hang the loader. The event stream is
read without recursion and refused on the first of: anchors or aliases (neither file needs
them), nesting deeper than MAX_DEPTH, more than MAX_NODES values, a key that is not a plain
scalar, a duplicate key. The answer names the line and the dotted key, never the value.
"""
from __future__ import annotations

import yaml

MAX_BYTES = 1 << 20
MAX_DEPTH = 32
MAX_NODES = 20000


class Refused(Exception):
    def __init__(self, problem: str, line: int | None = None, key: str | None = None):
        self.problem, self.line, self.key = problem, line, key
        super().__init__(problem)


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


def _path(stack: list) -> str:
    return stack[-1][1] if stack else ""
