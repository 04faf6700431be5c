"""The dispatch table's row: `Entry`, frozen, to and from JSON. Standard library only, so that
the daemon's metrics read tables without importing torch. kernelsearch.dispatch holds the
table around it."""
from __future__ import annotations

import hashlib
import json
import math
import types
from dataclasses import dataclass, field


class EntryError(ValueError):
    """A dispatch entry that does not have the table's form (names the field)."""


def _freeze(value):
    if isinstance(value, dict):
        return types.MappingProxyType({k: _freeze(v) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    return value


def _thaw(value):
    if isinstance(value, types.MappingProxyType | dict):
        return {k: _thaw(v) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return [_thaw(v) for v in value]
    return value


_ENTRY_FIELDS = ("kernel", "dtype", "shape", "range", "source", "source_hash", "params", "plan",
                 "candidate_ms", "stock_ms", "speedup", "against", "noise_band")


def file_sha256(path) -> str:
    """An entry's source_hash: the first 16 hex digits of the file's SHA-256, read in blocks (a
    candidate file may be huge)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:16]


def text_sha256(text: str) -> str:
    """file_sha256 of the file that holds `text` (UTF-8): the hash of what is compiled."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


@dataclass(frozen=True)
class Entry:
    """One row of a dispatch table: at (kernel, dtype, shape[, range]) run `plan` (verified from
    `source` with `params`) instead of stock; `speedup` = stock_ms / candidate_ms, stock being
    `against` as a user calls it. Frozen (mappings are read-only views); `extra` keeps keys this
    version does not know (e.g. `imported_from`) so that a round trip loses nothing."""

    kernel: str
    dtype: str
    shape: types.MappingProxyType
    source: types.MappingProxyType | None = None
    source_hash: str | None = None
    params: types.MappingProxyType = field(default_factory=lambda: types.MappingProxyType({}))
    plan: types.MappingProxyType | None = None
    candidate_ms: float | None = None
    stock_ms: float | None = None
    speedup: float | None = None
    against: str | None = None
    noise_band: float | None = None
    range: types.MappingProxyType | None = None
    extra: types.MappingProxyType = field(default_factory=lambda: types.MappingProxyType({}))

    def __hash__(self) -> int:
        return hash(self.key)

    @classmethod
    def make(cls, **fields) -> "Entry":
        """From plain values (dicts, lists): validated and frozen."""
        return cls.from_json(fields)

    @classmethod
    def from_json(cls, data) -> "Entry":
        if not isinstance(data, dict | types.MappingProxyType):
            raise EntryError(f"dispatch entry: expected an object, got {type(data).__name__}")
        data = _thaw(data)
        for name in ("kernel", "dtype"):
            if not isinstance(data.get(name), str) or not data[name]:
                raise EntryError(f"dispatch entry: '{name}' must be a non-empty string")
        shape = data.get("shape")
        if not isinstance(shape, dict) or not all(
                isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v >= 0
                for k, v in shape.items()):
            raise EntryError(f"dispatch entry {data['kernel']}: 'shape' must map dimension names to integers")
        shape = {k: v for k, v in shape.items() if k != "dtype"}
        rng = data.get("range")
        if rng is not None and not (isinstance(rng, dict) and all(
                isinstance(v, list) and len(v) == 2 and all(isinstance(x, int) for x in v) for v in rng.values())):
            raise EntryError(f"dispatch entry {data['kernel']}: 'range' must map dimensions to [lo, hi]")
        source = data.get("source")
        if source is not None and not (isinstance(source, dict) and len(source) == 1 and
                                       set(source) <= {"module", "path"} and
                                       all(isinstance(v, str) for v in source.values())):
            raise EntryError(f"dispatch entry {data['kernel']}: 'source' must be {{module: ...}} or {{path: ...}}")
        for name in ("source_hash", "against"):
            if data.get(name) is not None and not isinstance(data[name], str):
                raise EntryError(f"dispatch entry {data['kernel']}: '{name}' must be a string")
        if not isinstance(data.get("params") or {}, dict):
            raise EntryError(f"dispatch entry {data['kernel']}: 'params' must be an object")
        if data.get("plan") is not None and not isinstance(data["plan"], dict):
            raise EntryError(f"dispatch entry {data['kernel']}: 'plan' must be an object")
        numbers = {}
        for name in ("candidate_ms", "stock_ms", "speedup", "noise_band"):
            v = data.get(name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int | float)):
                raise EntryError(f"dispatch entry {data['kernel']}: '{name}' must be a number")
            # a time or speedup that is not positive (or a negative band) is no measurement: unknown,
            # as inf and NaN are; -1 ms would win every "faster than" comparison
            try:
                v = None if v is None else float(v)
            except OverflowError:   # an int past a float's range: no time either
                v = None
            low_ok = v is not None and math.isfinite(v) and (v >= 0 if name == "noise_band" else v > 0)
            numbers[name] = v if low_ok else None
        extra = {k: v for k, v in data.items() if k not in _ENTRY_FIELDS}
        return cls(kernel=data["kernel"], dtype=data["dtype"], shape=_freeze(shape),
                   source=_freeze(source), source_hash=data.get("source_hash"),
                   params=_freeze(data.get("params") or {}), plan=_freeze(data.get("plan")),
                   against=data.get("against"), range=_freeze(rng), extra=_freeze(extra), **numbers)

    def to_json(self) -> dict:
        out = {"kernel": self.kernel, "dtype": self.dtype, "shape": _thaw(self.shape),
               "source": _thaw(self.source), "source_hash": self.source_hash,
               "params": _thaw(self.params), "plan": _thaw(self.plan),
               "candidate_ms": self.candidate_ms, "stock_ms": self.stock_ms, "speedup": self.speedup,
               "against": self.against, "noise_band": self.noise_band}
        if self.range is not None:
            out["range"] = _thaw(self.range)
        out.update(_thaw(self.extra))
        return out

    def replace(self, **changes) -> "Entry":
        return Entry.from_json({**self.to_json(), **changes})

    @property
    def key(self) -> str:
        """Where it applies: kernel, dtype, shape and range (two entries with one key conflict)."""
        return json.dumps([self.kernel, self.dtype, _thaw(self.shape), _thaw(self.range) or {}],
                          sort_keys=True, separators=(",", ":"))

    def describe_speedup(self) -> str:
        if self.speedup is None:
            return "no speedup recorded"
        return f"{self.speedup:.2f}x against {self.against or 'stock (unnamed)'}"
