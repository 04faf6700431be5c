"""The harness's answer: data, never an exception. JSON round-trip (workers and Ray ship JSON)."""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields

_MS_FIELDS = ("candidate_ms", "candidate_p20_ms", "candidate_p80_ms", "stock_ms")


@dataclass
class ShapeResult:
    shape: dict
    dtype: str
    status: str = "pending"          # "ok" | "rejected" | "pending"
    error_rel_l2: float | None = None  # worst row of the worst output over the checked trials
    candidate_ms: float = math.inf     # median per call; inf when not timed or failed
    candidate_p20_ms: float = math.inf
    candidate_p80_ms: float = math.inf
    stock_ms: float = math.inf
    noise_band: float | None = None    # relative: |t1 - t2| / min(t1, t2) of two stock timings
    speedup: float | None = None       # stock_ms / candidate_ms
    flops: int = 0
    bytes: int = 0
    timing: str = ""                   # "cuda_graph_replay" | "cpu_interpreter (not a speed)"
    launches_per_replay: int = 0       # calls of launch() captured in one timed graph replay
    random: bool = False               # drawn at random from the op's domain (checked, not timed)
    plan: dict | None = None           # the launch plan verified at this shape (dispatch runs it)
    profile_s: dict | None = None      # harness wall seconds: compile_wait, checks, timed, stock

    def to_json(self) -> dict:
        d = asdict(self)
        for k in _MS_FIELDS:
            if not math.isfinite(d[k]):
                d[k] = None  # JSON has no infinity
        return d

    @classmethod
    def from_json(cls, d: dict) -> "ShapeResult":
        known = {f.name for f in fields(cls)}
        kw = {k: v for k, v in d.items() if k in known}
        for k in _MS_FIELDS:
            if kw.get(k) is None:
                kw[k] = math.inf
        return cls(**kw)


@dataclass
class Verdict:
    accepted: bool
    guard: str | None = None   # the guard that rejected (see GUARDS in kernelsearch.harness)
    reason: str = ""
    kernel: str = ""
    source_path: str = ""
    device: str = "cpu"
    params: dict = field(default_factory=dict)
    shapes: list[ShapeResult] = field(default_factory=list)
    isolation: list = field(default_factory=list)   # how the sandbox ran the host code

    @property
    def time_ms(self) -> float:
        """Sum of the per-shape medians; inf unless accepted and every shape was timed."""
        timed = [s for s in self.shapes if not s.random]
        if not self.accepted or not timed:
            return math.inf
        return sum(s.candidate_ms for s in timed)

    def to_json(self) -> dict:
        """JSON-ready dict (use json.dumps on it); `from_json` takes it back (or its text)."""
        return {"accepted": self.accepted, "guard": self.guard, "reason": self.reason,
                "kernel": self.kernel, "source_path": self.source_path, "device": self.device,
                "params": self.params, "shapes": [s.to_json() for s in self.shapes],
                "isolation": self.isolation}

    @classmethod
    def from_json(cls, data) -> "Verdict":
        if isinstance(data, (str, bytes)):
            data = json.loads(data)
        return cls(accepted=bool(data["accepted"]), guard=data.get("guard"),
                   reason=data.get("reason", ""), kernel=data.get("kernel", ""),
                   source_path=data.get("source_path", ""), device=data.get("device", "cpu"),
                   params=dict(data.get("params") or {}),
                   shapes=[ShapeResult.from_json(s) for s in data.get("shapes", [])],
                   isolation=list(data.get("isolation") or []))
