"""evaluate(): one candidate through every guard and the timed runs -> Verdict.

    static check (source.py)    the file's AST against the allowlist; nothing is imported
    plans (plan_client/jail)    launch() runs in the sandbox on symbolic tensors: one launch
                                plan per (shape, params), all CONFIGS in one sandbox run
    executor (executor.py)      validates each plan, runs it on fresh inputs, poisoned
                                outputs and canaried buffers, compares with the fp64
                                reference, checks determinism, times by CUDA graph replay

Per shape of the published sweep, plus one shape drawn at random from the op's domain
(checked, not timed): one trial per input distribution of the spec (fresh inputs, fresh
scalar arguments), the first repeated; then the timed runs, every replay checked. The first
failure rejects. Stock is timed as a user calls it (spec.stock_call) in the same executor, and
cached per (kernel, shape, dtype, device) for the process.

`Session` keeps one file's plans and the executor between evaluations (the search uses it);
`evaluate()` is one session, one evaluation.
"""
from __future__ import annotations

import math
import random
import secrets
import time
from pathlib import Path

from kernelsearch.entry import text_sha256
from kernelsearch.harness import plan_client, runner
from kernelsearch.harness.source import KernelSource, SourceError, read_source
from kernelsearch.harness.verdict import ShapeResult, Verdict
from kernelsearch.specs import SPECS, dtype_from_name

DEFAULT_TIMEOUT_S = {"cpu": 120.0, "cuda": 120.0}
RANDOM_SHAPES = 1
MAX_CONFIGS = 4096            # CONFIGS entries, and values of one SPACE parameter (the sandbox's limit)
MAX_SPACE_POINTS = 1 << 20    # SPACE's grid, which the strategies list whole (templates: 207,360 at most)

_stock_cache: dict = {}


def _device_kind(device: str) -> str:
    return "cuda" if str(device).startswith("cuda") else "cpu"


class Session:
    """One candidate file on one device."""

    def __init__(self, kernel: str, source_path, device: str = "cpu", shapes: list[dict] | None = None,
                 dtype: str | None = None, timeout_s: float | None = None, sandbox_user="default"):
        self.kernel, self.device, self.dtype = kernel, str(device), dtype
        self.source_path = str(Path(source_path).resolve())
        self.kind = _device_kind(self.device)
        self.timeout_s = float(timeout_s or DEFAULT_TIMEOUT_S[self.kind])
        self.sandbox_user = sandbox_user
        self.failure: tuple[str, str] | None = None
        self.spec = SPECS.get(kernel)
        self.source: KernelSource | None = None
        self.text = ""
        self.plans: dict[str, list] = {}        # params key -> [raw plan per case]
        self.configs: list | None = None
        self.space: dict | None = None
        self.isolation: list = []
        self.sandbox_s = 0.0                    # wall seconds in sandbox runs (planning)
        self._described = False
        if self.spec is None:
            self.failure = ("contract", f"unknown kernel {kernel!r} (known: {', '.join(SPECS)})")
            return
        try:
            raw = read_source(self.source_path)
            self.text = raw.decode("utf-8")
        except OSError as exc:
            self.failure = ("contract", f"cannot read {self.source_path}: {exc.strerror}")
            return
        except UnicodeDecodeError:
            self.failure = ("static", "the file is not UTF-8 text")
            return
        try:
            self.source = KernelSource.parse(self.text, self.source_path)
        except SourceError as exc:
            self.failure = ("static", "; ".join(exc.problems[:6]))
            return
        self.configs, self.space, self.failure = _configs_and_space(self.source.configs, self.source.space)
        if self.failure:
            return
        if self.kind == "cuda":
            import torch

            if not torch.cuda.is_available():
                self.failure = ("contract", "--device cuda but torch sees no CUDA device")
                return
        sweep = list(shapes) if shapes is not None else self.spec.shapes(self.kind)
        rng = random.Random(secrets.randbits(64))
        published = {tuple(sorted((k, v) for k, v in s.items() if k != "dtype")) for s in self.spec.shapes(self.kind)}
        extra = []
        while len(extra) < RANDOM_SHAPES:
            s = self.spec.random_shape(rng, self.kind)
            if tuple(sorted(s.items())) not in published and self.spec.valid_shape(s) is None:
                extra.append(s)
        self.cases = [(dict(s), False) for s in sweep] + [(s, True) for s in extra]

    def _dtype_of(self, shape: dict) -> str:
        # an explicit dtype, else the shape's pinned one, else the primary
        name = self.dtype or shape.get("dtype") or self.spec.primary_dtype(self.kind)
        return str(dtype_from_name(name)).removeprefix("torch.")

    @staticmethod
    def _key(params: dict) -> str:
        import json

        return json.dumps(params, sort_keys=True)

    def prepare(self, params_list: list[dict] | None = None) -> None:
        """Plans for these params and every CONFIGS entry, in one sandbox run (the first call);
        later calls plan only params not seen yet."""
        if self.failure:
            return
        todo = [p for p in (params_list or []) if self._key(p) not in self.plans]
        if self._described and not todo:
            return
        cases = [({k: v for k, v in s.items() if k != "dtype"}, self._dtype_of(s)) for s, _ in self.cases]
        if self.kind == "cuda":
            runner.executor(self.device)  # starts (imports torch, opens CUDA) while the sandbox plans
        started = time.perf_counter()
        reply = plan_client.request_plans(self.text, self.spec, cases, todo,
                                          plan_client.device_info(self.device),
                                          all_configs=not self._described, user=self.sandbox_user,
                                          timeout_s=min(self.timeout_s, plan_client.SANDBOX_TIMEOUT_S))
        self.sandbox_s += time.perf_counter() - started
        isolation = reply.get("isolation")
        if isinstance(isolation, list) and all(isinstance(x, str) for x in isolation):
            self.isolation = isolation or self.isolation
        if reply.get("leftover"):
            names = _one_line(", ".join(f"{p['comm']}[{p['pid']}]" for p in reply["leftover"][:5]))
            self.failure = ("left_process", f"the host code left process(es) running after launch(): {names} "
                                            "(killed)")
            return
        if not reply.get("ok"):
            self.failure = (reply.get("guard") or "exception", _one_line(reply.get("reason", "sandbox failed")))
            return
        # written by the sandbox, where the candidate's code ran: data to check like a plan
        params, plans = reply.get("params"), reply.get("plans")
        if not (isinstance(params, list) and all(isinstance(p, dict) for p in params)
                and isinstance(plans, list) and len(plans) == len(self.cases)
                and all(isinstance(row, list) and len(row) == len(params)
                        and all(isinstance(raw, dict) for raw in row) for row in plans)):
            self.failure = ("plan", "the sandbox's reply does not hold one plan per shape and params")
            return
        self._described = True
        self.configs, self.space, self.failure = _configs_and_space(
            reply.get("configs") if self.configs is None else self.configs,
            reply.get("space") if self.space is None else self.space)
        if self.failure:
            return
        for j, params in enumerate(params):
            self.plans[self._key(params)] = [row[j] for row in plans]

    def warm(self, params_list: list[dict] | None = None) -> None:
        """Start compiling every launch of these params' plans (default: all CONFIGS) in the
        executor's compile workers, so evaluations that follow find their kernels built."""
        if self.kind != "cuda":
            return
        self.prepare(params_list)
        if self.failure:
            return
        keys = [self._key(p) for p in params_list] if params_list else list(self.plans)
        cases = []
        for key in keys:
            for (shape, _), raw in zip(self.cases, self.plans.get(key, [])):
                if "error" not in raw:
                    dims = {k: v for k, v in shape.items() if k != "dtype"}
                    cases.append({"shape": dims, "dtype": self._dtype_of(shape), "plan": raw})
        try:
            ex = runner.executor(self.device)
            reply = ex.request({"op": "load", "source": self.text}, self.timeout_s)
            if reply.get("ok"):
                ex.request({"op": "warm", "sha": reply["sha"], "kernel": self.kernel, "cases": cases},
                           self.timeout_s)
        except runner.ChildFailure:
            runner.discard(self.device)

    def default_params(self) -> dict:
        self.prepare()
        return dict(self.configs[0]) if self.configs else {}

    def evaluate(self, params: dict | None = None, time_it: bool = True,
                 shapes: list[dict] | None = None) -> Verdict:
        verdict = Verdict(accepted=False, kernel=self.kernel, source_path=self.source_path,
                          device=self.device, params=dict(params or {}))
        if self.failure is None and params is None:
            params = self.default_params()
            verdict.params = dict(params)
        if self.failure is None:
            self.prepare([params])
            self.warm([params])
        if self.failure is not None:
            verdict.guard, verdict.reason = self.failure
            return verdict
        verdict.isolation = list(self.isolation)
        plans = self.plans.get(self._key(params))
        if plans is None:
            verdict.guard, verdict.reason = "plan", "the sandbox's reply holds no plan for these params"
            return verdict
        wanted = None if shapes is None else {self._shape_key(s) for s in shapes}
        try:
            ex = runner.executor(self.device)
            reply = ex.request({"op": "load", "source": self.text}, self.timeout_s)
            if not reply.get("ok"):
                verdict.guard, verdict.reason = reply.get("guard", "harness"), reply.get("reason", "")
                return verdict
            sha = reply["sha"]
            for i, ((shape, is_random), raw_plan) in enumerate(zip(self.cases, plans)):
                if wanted is not None and not is_random and self._shape_key(shape) not in wanted:
                    continue
                if not self._case(ex, sha, verdict, i, shape, is_random, raw_plan, time_it):
                    break
            else:
                verdict.accepted = True
        except runner.ChildFailure as exc:
            runner.discard(self.device)
            verdict.guard, verdict.reason = exc.guard, exc.reason
        for result in verdict.shapes:
            if result.status == "pending":
                result.status = "rejected" if not verdict.accepted else "ok"
        return verdict

    @staticmethod
    def _shape_key(shape: dict) -> tuple:
        return tuple(sorted((k, v) for k, v in shape.items() if k != "dtype"))

    def _case(self, ex, sha, verdict, i, shape, is_random, raw_plan, time_it) -> bool:
        spec = self.spec
        dims = {k: v for k, v in shape.items() if k != "dtype"}
        dtype = self._dtype_of(shape)
        dt = dtype_from_name(dtype)
        result = ShapeResult(shape=dict(shape), dtype=dtype, flops=spec.flops(dims), bytes=spec.bytes(dims, dt),
                             random=is_random, plan=None if "error" in raw_plan else raw_plan)
        verdict.shapes.append(result)
        label = f"shape {spec.describe(dims)} {dtype}" + (" (drawn at random)" if is_random else "")
        if "error" in raw_plan:
            verdict.guard = raw_plan.get("guard") if raw_plan.get("guard") in ("plan", "exception") else "plan"
            verdict.reason = f"{label}: launch() while planning: {_one_line(raw_plan['error'])}"
            result.status = "rejected"
            return False
        reply = ex.request({"op": "case", "sha": sha, "kernel": spec.name, "shape": dims, "dtype": dtype,
                            "plan": raw_plan, "time": bool(time_it and not is_random), "dist_offset": i,
                            "random": is_random},
                           self.timeout_s)
        if not reply.get("ok"):
            verdict.guard, verdict.reason = reply.get("guard", "harness"), reply.get("reason", "")
            result.status = "rejected"
            if verdict.guard in ("crash",):
                runner.discard(self.device)
            return False
        r = reply["result"]
        result.profile_s = dict(r.get("profile_s") or {})
        result.error_rel_l2 = r.get("error_rel_l2")
        result.launches_per_replay = int(r.get("launches_per_replay") or 0)
        if time_it and not is_random:
            result.candidate_ms = r["candidate_ms"]
            result.candidate_p20_ms = r["candidate_p20_ms"]
            result.candidate_p80_ms = r["candidate_p80_ms"]
            result.timing = r["timing"]
            t0 = time.perf_counter()
            result.stock_ms, result.noise_band = self._stock(ex, dims, dtype)
            result.profile_s["stock"] = round(time.perf_counter() - t0, 4)
            if math.isfinite(result.candidate_ms) and result.candidate_ms > 0 and math.isfinite(result.stock_ms):
                result.speedup = result.stock_ms / result.candidate_ms
        result.status = "ok"
        return True

    def _stock(self, ex, dims: dict, dtype: str) -> tuple[float, float]:
        key = (self.spec.name, self._shape_key(dims), dtype, self.device)
        if key not in _stock_cache:
            reply = ex.request({"op": "stock", "kernel": self.spec.name, "shape": dims, "dtype": dtype},
                               self.timeout_s)
            if not reply.get("ok"):
                return math.inf, math.inf
            _stock_cache[key] = (reply["stock_ms"], reply["noise_band"])
        return _stock_cache[key]


def _one_line(text) -> str:
    """Text the sandbox wrote (the candidate's exception messages, process names) as one line:
    printed as a verdict's reason, its newlines made lines of check-kernel's output (a forged
    'accepted' line after the rejection)."""
    return " ".join(str(text).split())


def _configs_and_space(configs, space) -> tuple:
    """(CONFIGS, SPACE, failure): the file's literals or what its sandboxed import reported --
    the candidate's data either way, checked here before anything indexes or enumerates it.
    CONFIGS: a list of dicts of str -> int/float/bool/str/None; SPACE: str -> a list of those
    values, at most MAX_SPACE_POINTS points in all."""
    scalar = (type(None), bool, int, float, str)
    if configs is not None:
        if not isinstance(configs, (list, tuple)) or len(configs) > MAX_CONFIGS or not all(
                isinstance(c, dict) and all(isinstance(k, str) and isinstance(v, scalar) for k, v in c.items())
                for c in configs):
            return None, None, ("contract", f"CONFIGS must be a list of at most {MAX_CONFIGS} dicts of "
                                            "str -> int/float/bool/str/None")
        configs = [dict(c) for c in configs]
    if space is not None:
        if not isinstance(space, dict) or not all(
                isinstance(k, str) and isinstance(v, (list, tuple)) and len(v) <= MAX_CONFIGS
                and all(isinstance(x, scalar) for x in v) for k, v in space.items()):
            return None, None, ("contract", f"SPACE must be a dict of str -> a list of at most {MAX_CONFIGS} "
                                            "int/float/bool/str/None values")
        space = {k: list(v) for k, v in space.items()}
        points = math.prod(len(v) for v in space.values())
        if points > MAX_SPACE_POINTS:
            return None, None, ("contract", f"SPACE has {points} points, more than {MAX_SPACE_POINTS} (the "
                                            "strategies list every point)")
    return configs, space, None


_sessions: dict = {}
MAX_SESSIONS = 64


def session(kernel: str, source_path, device: str = "cpu", shapes: list[dict] | None = None,
            dtype: str | None = None, timeout_s: float | None = None) -> Session:
    """A cached Session for this file (same bytes), device, sweep and dtype: its plans (all
    CONFIGS from one sandbox run) and its random shape serve every evaluation of the file."""
    import hashlib
    import json

    try:
        digest = hashlib.sha256(read_source(source_path)).hexdigest()
    except OSError:
        digest = None
    if shapes is None and kernel in SPECS:
        shapes = SPECS[kernel].shapes(_device_kind(device))
    key = json.dumps([kernel, str(Path(source_path).resolve()), digest, str(device), shapes, dtype,
                      timeout_s], sort_keys=True, default=str)
    s = _sessions.get(key)
    if s is None or digest is None:
        if len(_sessions) >= MAX_SESSIONS:
            _sessions.pop(next(iter(_sessions)))
        s = _sessions[key] = Session(kernel, source_path, device, shapes, dtype, timeout_s)
    return s


def evaluate(kernel: str, source_path, params: dict | None = None, device: str = "cpu",
             shapes: list[dict] | None = None, dtype: str | None = None,
             timeout_s: float | None = None, time_it: bool = True, fresh: bool = False,
             source_hash: str | None = None) -> Verdict:
    """Run one candidate file through every guard (and the timed runs). Never raises for a bad
    candidate: the result is a Verdict. `params=None` uses the file's CONFIGS[0] (or {}).
    `timeout_s` bounds each request (one sandbox run, one shape's checks and timing).
    Evaluations of one file reuse its session (plans, random shape) unless `fresh`. With
    `source_hash` (entry.file_sha256's digest, under which the caller records the verdict) the
    text checked must hash to it: a file replaced since it was listed is rejected."""
    s = Session(kernel, source_path, device, shapes, dtype, timeout_s) if fresh else \
        session(kernel, source_path, device, shapes, dtype, timeout_s)
    if source_hash is not None and s.failure is None:
        got = text_sha256(s.text)
        if got != source_hash:
            return Verdict(accepted=False, kernel=kernel, source_path=s.source_path, device=s.device,
                           params=dict(params or {}), guard="contract",
                           reason=f"{s.source_path} changed since it was listed (sha256 {got}, not {source_hash})")
    return s.evaluate(params, time_it)


def verified_plan(kernel: str, source_path, shape: dict, dtype: str, params: dict, device: str,
                  source_hash: str | None = None) -> tuple[dict | None, str | None]:
    """(the launch plan of `params` at one shape as this host's harness verifies it: every guard,
    not timed; None) or (None, why it was refused). For a config known only from a ledger row (a
    winner a search resumes, the step judge's alternatives): a row's `accepted` is no proof, since
    `share import` stores a bundle's rows as given."""
    dims = {k: v for k, v in shape.items() if k != "dtype"}
    v = evaluate(kernel, source_path, dict(params), device=device, shapes=[dims], dtype=dtype,
                 time_it=False, source_hash=source_hash)
    plans = [sr.plan for sr in v.shapes if not sr.random and sr.plan]
    if v.accepted and plans:
        return plans[0], None
    return None, (f"rejected by this host's {v.guard} check: {v.reason}"[:300] if not v.accepted
                  else "no launch plan from the harness")


def make_plan(kernel: str, source_path, shape: dict, dtype: str, params: dict, device: str) -> dict | None:
    """The launch plan of `params` at one shape, from one sandbox run (None on any failure)."""
    spec = SPECS[kernel]
    try:
        text = read_source(source_path).decode("utf-8")
        KernelSource.parse(text)
    except (OSError, UnicodeDecodeError, SourceError):
        return None
    dims = {k: v for k, v in shape.items() if k != "dtype"}
    reply = plan_client.request_plans(text, spec, [(dims, dtype)], [dict(params)],
                                      plan_client.device_info(device))
    if not reply.get("ok") or reply.get("leftover"):
        return None
    plan = reply["plans"][0][0]
    return None if "error" in plan else plan
