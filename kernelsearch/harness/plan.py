"""A launch plan: what one call of a candidate's launch() does, as data.

Made in the sandbox (planner.py) from symbolic tensors, validated here before anything runs,
executed by the trusted side (run_plan.py) on its own buffers -- in the harness and, with
the same code, in the dispatch runtime.

    {"buffers": {"w3": {"nbytes", "dtype", "init": "empty"|"zeros", "persistent": bool}},
     "steps": [{"op": "zero", "ref": REF, "nbytes": n},
               {"op": "launch", "kernel": NAME, "grid": [x, y, z],
                "args": {param: VALUE}, "options": {"num_warps": 4, "num_stages": 2}}]}
    REF   = {"buf": "x" | "out" | "w3" | "p7", "offset": bytes, "dtype": "bfloat16"}
    VALUE = {"ref": REF} | {"int": n} | {"float": x} | {"bool": b} | {"none": true}
          | {"str": s} | {"tl_dtype": "float32"} | {"scalar": EXPR}
    EXPR  = ["arg", "eps"] | ["const", 1.44] | [op, EXPR, EXPR] (op: add sub mul div pow)
          | ["neg", EXPR]

Workspace ids: "w<n>" allocated by this call, "p<n>" persistent (allocated by an earlier call
or at import and kept across calls: it must be zero-initialised and left all-zero by every
call, which the harness checks, so no state is carried from one call to the next).
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass

DTYPE_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "float8_e4m3fn": 1,
               "float8_e5m2": 1, "int8": 1, "int16": 2, "int32": 4, "int64": 8, "uint8": 1, "bool": 1}
TL_DTYPES = {"float32", "float16", "bfloat16", "float64", "int8", "int16", "int32", "int64", "uint8",
             "uint16", "uint32", "uint64", "int1", "float8e4nv", "float8e5"}
NUM_WARPS = {1, 2, 4, 8, 16, 32}
MAX_STEPS = 64
MAX_EXPR_NODES = 64
EXPR_OPS = {"add": 2, "sub": 2, "mul": 2, "div": 2, "pow": 2, "neg": 1}
MAX_GRID = (2**31 - 1, 65535, 65535)
_WS_ID = re.compile(r"^[wp][0-9]{1,12}$")


class PlanInvalid(ValueError):
    def __init__(self, guard: str, reason: str):
        super().__init__(reason)
        self.guard, self.reason = guard, reason


@dataclass(frozen=True)
class Ref:
    buf: str
    offset: int
    dtype: str


@dataclass(frozen=True)
class BufferSpec:
    id: str
    nbytes: int
    dtype: str
    init: str
    persistent: bool


@dataclass(frozen=True)
class Zero:
    ref: Ref
    nbytes: int


@dataclass(frozen=True)
class Launch:
    kernel: str
    grid: tuple
    args: tuple          # ((param, value), ...) value: Ref | ("int", v) | ... | ("scalar", expr)
    options: tuple       # ((name, int), ...)


@dataclass(frozen=True)
class Plan:
    buffers: tuple       # BufferSpec
    steps: tuple         # Zero | Launch

    @property
    def launches(self) -> int:
        return sum(isinstance(s, Launch) for s in self.steps)

    def to_json(self) -> dict:
        def value(v):
            if isinstance(v, Ref):
                return {"ref": _ref_json(v)}
            kind = v[0]
            return {kind: True} if kind == "none" else {kind: v[1]}
        steps = []
        for s in self.steps:
            if isinstance(s, Zero):
                steps.append({"op": "zero", "ref": _ref_json(s.ref), "nbytes": s.nbytes})
            else:
                steps.append({"op": "launch", "kernel": s.kernel, "grid": list(s.grid),
                              "args": {k: value(v) for k, v in s.args}, "options": dict(s.options)})
        return {"buffers": {b.id: {"nbytes": b.nbytes, "dtype": b.dtype, "init": b.init,
                                   "persistent": b.persistent} for b in self.buffers},
                "steps": steps}

    def digest(self) -> str:
        import hashlib

        return hashlib.sha256(json.dumps(self.to_json(), sort_keys=True).encode()).hexdigest()[:16]


def _ref_json(r: Ref) -> dict:
    return {"buf": r.buf, "offset": r.offset, "dtype": r.dtype}


def _int(v, what: str, lo: int = 0, hi: int = 2**62) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise PlanInvalid("plan", f"{what}: expected an int in {lo}..{hi}, got {v!r}"[:200])
    return v


def _expr(e, scalars: set, budget: list) -> list:
    budget[0] += 1
    if budget[0] > MAX_EXPR_NODES or not isinstance(e, list) or not e:
        raise PlanInvalid("plan", "scalar expression malformed or too large")
    op = e[0]
    if op == "arg":
        if len(e) != 2 or e[1] not in scalars:
            raise PlanInvalid("plan", f"scalar expression names an unknown argument {e[1:]!r}"[:200])
        return ["arg", e[1]]
    if op == "const":
        if len(e) != 2 or isinstance(e[1], bool) or not isinstance(e[1], (int, float)) or not math.isfinite(e[1]):
            raise PlanInvalid("plan", "scalar expression constant not a finite number")
        return ["const", float(e[1])]
    if op not in EXPR_OPS or len(e) != 1 + EXPR_OPS[op]:
        raise PlanInvalid("plan", f"scalar expression operator {op!r}"[:100])
    return [op] + [_expr(x, scalars, budget) for x in e[1:]]


def eval_expr(e: list, values: dict) -> float:
    op = e[0]
    if op == "arg":
        return float(values[e[1]])
    if op == "const":
        return e[1]
    if op == "neg":
        return -eval_expr(e[1], values)
    a, b = eval_expr(e[1], values), eval_expr(e[2], values)
    try:
        r = {"add": a + b, "sub": a - b, "mul": a * b}.get(op)
        if r is None:
            r = a / b if op == "div" else a ** b
    except (ZeroDivisionError, OverflowError, ValueError):
        return math.nan
    return float(r) if isinstance(r, (int, float)) else math.nan


def validate(raw, *, kernels: dict, roles: dict, inputs: set, scalars: set,
             workspace_budget_bytes: int, inouts: set = frozenset()) -> Plan:
    """Check a sandbox-made plan against the checked source and the call's contract.

    kernels: {name: source.KernelDef}; roles: {contract name: nbytes} for every contract tensor;
    inputs: those not to be written; inouts: those only the kernels may write (a zero step
    would wipe the rows the op keeps); scalars: names of contract scalars.
    """
    if not isinstance(raw, dict) or not isinstance(raw.get("buffers"), dict) or \
            not isinstance(raw.get("steps"), list):
        raise PlanInvalid("plan", "not a plan (buffers/steps)")
    buffers, sizes = [], dict(roles)
    total = 0
    for bid, b in raw["buffers"].items():
        if not isinstance(bid, str) or not _WS_ID.match(bid) or not isinstance(b, dict):
            raise PlanInvalid("plan", f"workspace id {bid!r}"[:100])
        nbytes = _int(b.get("nbytes"), f"workspace {bid} nbytes", 0, 1 << 42)
        if b.get("dtype") not in DTYPE_SIZES or b.get("init") not in ("empty", "zeros"):
            raise PlanInvalid("plan", f"workspace {bid}: dtype/init")
        persistent = b.get("persistent") is True
        if persistent != bid.startswith("p"):
            raise PlanInvalid("plan", f"workspace {bid}: persistence flag")
        if persistent and b["init"] != "zeros":
            raise PlanInvalid("workspace_state",
                              f"workspace {bid} is kept across launch() calls but not zero-initialised: "
                              "a buffer that outlives a call must be made with torch.zeros and left "
                              "all-zero (state carried between calls is not allowed)")
        total += nbytes
        buffers.append(BufferSpec(bid, nbytes, b["dtype"], b["init"], persistent))
        sizes[bid] = nbytes
    if total > workspace_budget_bytes:
        raise PlanInvalid("plan", f"workspaces of {total} bytes exceed the budget of "
                                  f"{workspace_budget_bytes} bytes")
    if len(raw["steps"]) > MAX_STEPS:
        raise PlanInvalid("plan", f"more than {MAX_STEPS} steps")

    def ref(r, where) -> Ref:
        if not isinstance(r, dict) or r.get("buf") not in sizes or r.get("dtype") not in DTYPE_SIZES:
            raise PlanInvalid("plan", f"{where}: unknown buffer or dtype {r!r}"[:200])
        off = _int(r.get("offset"), f"{where} offset", 0, sizes[r["buf"]])
        if off % DTYPE_SIZES[r["dtype"]]:
            raise PlanInvalid("plan", f"{where}: offset {off} not a multiple of {r['dtype']}'s size")
        return Ref(r["buf"], off, r["dtype"])

    steps = []
    for i, s in enumerate(raw["steps"]):
        where = f"step {i}"
        if not isinstance(s, dict):
            raise PlanInvalid("plan", f"{where}: not an object")
        if s.get("op") == "zero":
            r = ref(s.get("ref"), where)
            if r.buf in inputs:
                raise PlanInvalid("input_mutated", f"{where}: zero_() of input {r.buf}")
            if r.buf in inouts:
                raise PlanInvalid("inout_mutated", f"{where}: zero_() of in/out tensor {r.buf} (only "
                                                   "its written rows may change, by a kernel)")
            n = _int(s.get("nbytes"), f"{where} nbytes", 0, sizes[r.buf] - r.offset)
            steps.append(Zero(r, n))
        elif s.get("op") == "launch":
            steps.append(_launch(s, where, kernels, ref, scalars))
        else:
            raise PlanInvalid("plan", f"{where}: unknown op {s.get('op')!r}"[:100])
    plan = Plan(tuple(buffers), tuple(steps))
    if plan.launches == 0:
        raise PlanInvalid("not_triton", "launch() ran no @triton.jit kernel")
    return plan


def _launch(s: dict, where: str, kernels: dict, ref, scalars: set) -> Launch:
    name = s.get("kernel")
    if name not in kernels:
        raise PlanInvalid("plan", f"{where}: {name!r} is not a @triton.jit kernel of the file"[:200])
    kdef = kernels[name]
    grid = s.get("grid")
    if not isinstance(grid, list) or not 1 <= len(grid) <= 3:
        raise PlanInvalid("plan", f"{where}: grid must be 1 to 3 ints")
    grid = tuple(_int(g, f"{where} grid[{j}]", 0, MAX_GRID[j]) for j, g in enumerate(grid))
    args = s.get("args")
    if not isinstance(args, dict):
        raise PlanInvalid("plan", f"{where}: args")
    unknown = set(args) - set(kdef.params)
    if unknown:
        raise PlanInvalid("plan", f"{where}: {name} has no parameter(s) {sorted(unknown)}"[:200])
    missing = [p for p in kdef.params if p not in args and p not in kdef.defaults]
    if missing:
        raise PlanInvalid("plan", f"{where}: {name} missing argument(s) {missing}"[:200])
    out = []
    for p in kdef.params:
        if p not in args:
            continue
        v = args[p]
        if not isinstance(v, dict) or len(v) != 1:
            raise PlanInvalid("plan", f"{where}: {name}({p}=...) malformed")
        (kind, val), = v.items()
        constexpr = p in kdef.constexprs
        if kind == "ref" and not constexpr:
            out.append((p, ref(val, f"{where} {name}({p})")))
        elif kind == "int":
            out.append((p, ("int", _int(val, f"{where} {name}({p})", -2**63, 2**64 - 1))))
        elif kind == "float" and isinstance(val, (int, float)) and not isinstance(val, bool) \
                and math.isfinite(val):
            out.append((p, ("float", float(val))))
        elif kind == "bool" and isinstance(val, bool):
            out.append((p, ("bool", val)))
        elif kind == "none":
            out.append((p, ("none",)))
        elif kind == "str" and constexpr and isinstance(val, str) and len(val) <= 64:
            out.append((p, ("str", val)))
        elif kind == "tl_dtype" and constexpr and val in TL_DTYPES:
            out.append((p, ("tl_dtype", val)))
        elif kind == "scalar" and not constexpr:
            out.append((p, ("scalar", _expr(val, scalars, [0]))))
        else:
            raise PlanInvalid("plan", f"{where}: {name}({p}) cannot take a {kind} value"
                                      + (" (a constexpr must be a literal)" if constexpr else ""))
    options = s.get("options") or {}
    if not isinstance(options, dict):
        raise PlanInvalid("plan", f"{where}: options")
    opts = []
    for k, v in options.items():
        if k == "num_warps" and v in NUM_WARPS and not isinstance(v, bool):
            opts.append((k, v))
        elif k == "num_stages":
            opts.append((k, _int(v, f"{where} num_stages", 1, 16)))  # Hopper: 10+ stages
        elif k == "num_ctas" and v == 1 and not isinstance(v, bool):
            opts.append((k, 1))
        elif k == "maxnreg":
            opts.append((k, _int(v, f"{where} maxnreg", 16, 255)))
        else:
            raise PlanInvalid("plan", f"{where}: launch option {k}={v!r} not allowed"[:200])
    return Launch(name, grid, tuple(out), tuple(sorted(opts)))


def from_json(raw: dict) -> Plan:
    """A plan the harness already validated (e.g. stored in a dispatch table), rebuilt as is."""
    def value(v):
        (kind, val), = v.items()
        if kind == "ref":
            return Ref(val["buf"], int(val["offset"]), val["dtype"])
        return ("none",) if kind == "none" else (kind, val)
    buffers = tuple(BufferSpec(k, int(b["nbytes"]), b["dtype"], b["init"], bool(b["persistent"]))
                    for k, b in raw["buffers"].items())
    steps = []
    for s in raw["steps"]:
        if s["op"] == "zero":
            r = s["ref"]
            steps.append(Zero(Ref(r["buf"], int(r["offset"]), r["dtype"]), int(s["nbytes"])))
        else:
            steps.append(Launch(s["kernel"], tuple(s["grid"]),
                                tuple((k, value(v)) for k, v in s["args"].items()),
                                tuple(sorted(s["options"].items()))))
    return Plan(buffers, tuple(steps))
