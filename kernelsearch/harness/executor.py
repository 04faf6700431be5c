"""The trusted executor: one process per device that makes inputs, poisons outputs, runs the
candidate's kernels through their launch plans, compares with the fp64 reference and times.
It never imports or executes the candidate's Python: of a candidate it has the kernels that
source.load_kernels compiled from checked source, and plans (data) it validates itself.

Started by kernelsearch.harness.runner (`python -m kernelsearch.harness.executor FD_IN FD_OUT
DEVICE`); JSON lines each way on dedicated pipes. Requests:
  load  {source}                                   -> {ok, sha}      (parse + compile kernels)
  case  {sha, kernel, shape, dtype, plan, time}    -> {ok, result} | {ok: false, guard, reason}
  stock {kernel, shape, dtype}                     -> {ok, stock_ms, noise_band, method}
  exit
Each check draws fresh inputs from a generator seeded by `secrets` (no seed leaves this
process), fresh scalar arguments (eps, scale) from the op's range, and a fresh poison (NaN,
huge finite or random values) for the outputs, for the rows of in/out tensors the op writes
(spec.written; every other byte of those must keep its input value) and for scratch
workspaces. Every buffer sits between canary zones checked after each call; under the Triton interpreter every load and
store is also bounds-checked against the launch's own buffers. The timed runs replay a CUDA
graph of `n` calls, each on its own buffers, with fresh inputs before every replay; every
replay's outputs are checked.
"""
from __future__ import annotations

import json
import math
import os
import random
import secrets
import sys
import time
import traceback

CANARY_BYTES = 512
DETERMINISM_BAND = 0.05      # run-to-run difference allowed, as a fraction of the tolerance
SLOT_MEMORY_BUDGET = 8 << 30  # bytes of buffers for the graph's calls (n copies of everything)
POISONS = ("nan", "huge", "random")
FULL_CHECKS = 3               # timed replays whose every call is checked (one call of the others)
# The CPU executor's data (heap) limit. Under the interpreter a kernel's body is Python run here,
# and Python values grow without Triton's tensor-size limit: a string doubled in a loop took
# what memory the host had before any deadline. The CPU sweep's buffers and a 1 GiB workspace fit
# well inside (torch itself: ~0.3 GiB). Not on CUDA: its driver's mappings count here too.
CPU_DATA_LIMIT_BYTES = 4 << 30


class Reject(Exception):
    def __init__(self, guard: str, reason: str):
        super().__init__(f"{guard}: {reason}")
        self.guard, self.reason = guard, reason


class OutOfBounds(Exception):
    pass


class InputWrite(OutOfBounds):
    pass


# --- interpreter bounds checks ---------------------------------------------------------------
_ALLOWED: list = []   # [(lo, hi, name, writable)] byte ranges the running launch may touch


class _GuardedInterpreter:
    """Stands in for triton's _interpreter module: every pointer a kernel loads from or stores
    to must lie inside one of the launch's own buffers (their canaries excluded), and a store or
    an atomic inside one it may write: never an input, not even with its own values put back
    before the call ends (the inputs were only compared after the call)."""

    def __init__(self, real):
        self._real = real

    def __getattr__(self, name):
        return getattr(self._real, name)

    @staticmethod
    def _check(ptrs, mask, itemsize, what, write=False):
        import numpy as np

        addrs = np.asarray(ptrs).astype(np.uint64, copy=False).reshape(-1)
        if mask is not None:
            m = np.broadcast_to(np.asarray(mask, dtype=bool), np.shape(ptrs)).reshape(-1)
            addrs = addrs[m]
        if addrs.size == 0:
            return
        ok = np.zeros(addrs.shape, dtype=bool)
        for lo, hi, _, writable in _ALLOWED:
            if writable or not write:
                ok |= (addrs >= np.uint64(lo)) & (addrs + np.uint64(itemsize) <= np.uint64(hi))
        if not ok.all():
            bad = int(addrs[~ok][0])
            inside = [r[2] for r in _ALLOWED if r[0] <= bad < r[1]]
            if inside:
                raise InputWrite(f"input {inside[0]} modified: {what} of {int((~ok).sum())} element(s) "
                                 "into it (inputs are read-only, even while the call runs)")
            near = min(_ALLOWED, key=lambda r: min(abs(bad - r[0]), abs(bad - r[1])), default=None)
            where = f" ({bad - near[1]:+d} bytes past the end of {near[2]})" if near and bad >= near[1] else \
                (f" ({bad - near[0]:+d} bytes before {near[2]})" if near else "")
            raise OutOfBounds(f"{what} of {int((~ok).sum())} element(s) outside the kernel's buffers{where}")

    def load(self, ptrs, mask, other, dtype):
        self._check(ptrs, mask, dtype().itemsize if callable(dtype) else 1, "load")
        return self._real.load(ptrs, mask, other, dtype)

    def store(self, ptrs, value, mask):
        self._check(ptrs, mask, getattr(value, "itemsize", 1), "store", write=True)
        return self._real.store(ptrs, value, mask)

    def atomic_cas(self, ptrs, cmp, val, sem):
        self._check(ptrs, None, getattr(val, "itemsize", 1), "atomic_cas", write=True)
        return self._real.atomic_cas(ptrs, cmp, val, sem)

    def atomic_rmw(self, op, ptrs, val, mask, sem):
        self._check(ptrs, mask, getattr(val, "itemsize", 1), "atomic", write=True)
        return self._real.atomic_rmw(op, ptrs, val, mask, sem)


def _install_interpreter_guard() -> None:
    from triton.runtime import interpreter

    if not isinstance(interpreter._interpreter, _GuardedInterpreter):
        interpreter._interpreter = _GuardedInterpreter(interpreter._interpreter)
    _shuffle_program_order(interpreter.interpreter_builder)
    _unwrap_device_call_errors(interpreter)


def _unwrap_device_call_errors(interpreter) -> None:
    """Let an exception raised in a jit function called from a kernel pass through each call
    unwrapped. The interpreter wraps it as InterpreterError(repr(e)) at every level, and repr
    doubles the backslashes escaping the level below's quotes: a failure at the bottom of a
    chain of 48 calls was a message of 2^48 bytes, built in this process until the host's
    memory ran out (a recursive helper grew it the same way until the deadline)."""
    cls = interpreter.InterpretedFunction
    if getattr(cls.__call__, "_hwtune_unwrapped", False):
        return
    real = cls.__call__

    def __call__(self, *args, **kwargs):
        try:
            return real(self, *args, **kwargs)
        except interpreter.InterpreterError as exc:
            if exc.__cause__ is None:
                raise
            raise exc.__cause__ from None

    __call__._hwtune_unwrapped = True
    cls.__call__ = __call__


def _shuffle_program_order(builder) -> None:
    """Make the interpreter run a launch's programs in a fresh order each launch. It runs them
    one after the other, program 0 first: a kernel whose programs read what another wrote, with
    no synchronisation (program 0 fills a scratch buffer, the others read it), was always right
    on the CPU and is a race on a GPU. The order is an affine bijection of the linear program
    index, (a * i + c) mod n with a coprime to n, drawn per launch: no table of n entries."""
    if getattr(builder, "_hwtune_shuffled", False):
        return
    real_dim, real_idx = builder.set_grid_dim, builder.set_grid_idx
    rng = random.Random(secrets.randbits(64))
    order = {}

    def set_grid_dim(nx, ny, nz):
        n = nx * ny * nz
        a = 1
        while n > 2:
            a = rng.randrange(1, n)
            if math.gcd(a, n) == 1:
                break
        order.update(dims=(nx, ny, nz), n=max(n, 1), a=a, c=rng.randrange(max(n, 1)))
        return real_dim(nx, ny, nz)

    def set_grid_idx(x, y, z):
        _, ny, nz = order["dims"]
        j = (order["a"] * ((x * ny + y) * nz + z) + order["c"]) % order["n"]
        return real_idx(j // (ny * nz), j // nz % ny, j % nz)

    builder.set_grid_dim, builder.set_grid_idx = set_grid_dim, set_grid_idx
    builder._hwtune_shuffled = True


# --- buffers ------------------------------------------------------------------------------------
class Slot:
    """One call's buffers: every contract tensor and workspace in its own allocation with a
    random canary zone before and after the data."""

    def __init__(self, torch, plan, signature: list, device: str, gen):
        self.torch, self.device, self.gen = torch, device, gen
        self.raw, self.data, self.canary = {}, {}, {}
        self.meta = {}            # contract tensor name -> (shape, dtype)
        self.persistent, self.scratch, self.outputs_names, self.input_names = [], [], [], []
        self.inout_names = []     # read and written in place: only their written rows may change
        self.rows = {}            # in/out name -> flat indices of the rows this call writes
        from kernelsearch.harness.run_plan import TORCH_DTYPES

        for arg in signature:
            if arg["kind"] != "tensor":
                continue
            dt = TORCH_DTYPES[arg["dtype"]]
            numel = 1
            for d in arg["shape"]:
                numel *= d
            self._alloc(arg["name"], numel * torch.empty((), dtype=dt).element_size())
            self.meta[arg["name"]] = (tuple(arg["shape"]), dt)
            role = arg["role"]
            (self.outputs_names if role == "output" else self.inout_names if role == "inout"
             else self.input_names).append(arg["name"])
        for b in plan.buffers:
            self._alloc(b.id, b.nbytes)
            if b.persistent:
                self.data[b.id].zero_()
                self.persistent.append(b.id)
            else:
                self.scratch.append(b.id)

    def _alloc(self, name: str, nbytes: int) -> None:
        t = self.torch
        raw = t.empty(CANARY_BYTES + nbytes + CANARY_BYTES, dtype=t.uint8, device=self.device)
        pattern = t.randint(0, 256, (2 * CANARY_BYTES,), dtype=t.uint8, generator=self.gen,
                            device=self.device)
        raw[:CANARY_BYTES].copy_(pattern[:CANARY_BYTES])
        raw[CANARY_BYTES + nbytes:].copy_(pattern[CANARY_BYTES:])
        self.raw[name], self.canary[name] = raw, pattern
        self.data[name] = raw[CANARY_BYTES:CANARY_BYTES + nbytes]

    def ranges(self) -> list:
        return [(int(d.data_ptr()), int(d.data_ptr()) + d.numel(), n, n not in self.input_names)
                for n, d in self.data.items()]

    def typed(self, name: str):
        shape, dt = self.meta[name]
        return self.data[name].view(dt).view(shape)

    def load_inputs(self, inputs: dict, written: dict) -> None:
        """Copy the inputs and in/out tensors in; `written` (spec.written) names the rows of
        each in/out tensor the call writes: poison() poisons them, judge() compares them."""
        for name in self.input_names + self.inout_names:
            self.typed(name).copy_(inputs[name])
        self.rows = {}
        for name in self.inout_names:
            mask = written.get(name)
            shape = self.meta[name][0]
            if mask is None:
                mask = self.torch.zeros(shape[:-1], dtype=self.torch.bool, device=self.device)
            if tuple(mask.shape) != tuple(shape[:-1]) or mask.dtype != self.torch.bool:
                raise ValueError(f"spec.written()[{name!r}]: expected a bool mask of shape {shape[:-1]}")
            self.rows[name] = mask.reshape(-1).nonzero().reshape(-1).to(self.device)

    def row_view(self, name: str):
        """An in/out tensor as [rows, last dim]."""
        shape, _ = self.meta[name]
        return self.typed(name).view(-1, shape[-1] if shape else 1)

    def written_rows(self, name: str):
        """A copy of the rows of in/out tensor `name` this call writes, [rows, last dim]."""
        return self.row_view(name).index_select(0, self.rows[name])

    def poison(self, kind: str) -> "Poison":
        """Fill outputs and scratch workspaces. Returns a record of the outputs' poison that
        regenerates it on demand (only a failed comparison needs it, to spot unwritten
        elements), so no copy of every output is made on every call."""
        t = self.torch
        seed = secrets.randbits(62)
        g = t.Generator(device=self.device)
        for name in self.outputs_names:
            _fill_poison(t, self.typed(name), kind, g.manual_seed(seed ^ hash(name) & 0xFFFFFFFF))
        for name in self.inout_names:  # only the rows the call writes: the rest is input
            view, rows = self.row_view(name), self.rows[name]
            p = t.empty((rows.numel(), view.shape[1]), dtype=view.dtype, device=self.device)
            _fill_poison(t, p, kind, g.manual_seed(seed ^ hash(name) & 0xFFFFFFFF))
            view.index_copy_(0, rows, p)
        for name in self.scratch:
            d = self.data[name]
            d.copy_(t.randint(0, 256, d.shape, dtype=t.uint8, generator=self.gen, device=self.device))
        return Poison(self, kind, seed)

    def damaged(self, inputs: dict) -> tuple[list[str], list[str], list[str], list[str]]:
        """(canary zones changed, inputs modified, persistent workspaces not all-zero, in/out
        tensors changed outside their written rows), decided on the device and read back with
        one synchronisation."""
        t, names, flags = self.torch, [], []
        for name, raw in self.raw.items():
            c = self.canary[name]
            names.append(("canary", name))
            flags.append((raw[:CANARY_BYTES] != c[:CANARY_BYTES]).any()
                         | (raw[raw.numel() - CANARY_BYTES:] != c[CANARY_BYTES:]).any())
        for n in self.input_names:
            want = _bytes(inputs[n])
            names.append(("input", n))
            flags.append((self.data[n] != want).any() if want.numel() == self.data[n].numel()
                         else t.ones((), dtype=t.bool, device=self.device))
        for n in self.persistent:
            names.append(("persistent", n))
            flags.append(self.data[n].any())
        for n in self.inout_names:
            names.append(("inout", n))
            flags.append(self.changed_rows(n, inputs[n]).any())
        found = {"canary": [], "input": [], "persistent": [], "inout": []}
        for (kind, name), bad in zip(names, t.stack(flags).tolist() if flags else []):
            if bad:
                found[kind].append(name)
        return found["canary"], found["input"], found["persistent"], found["inout"]

    def changed_rows(self, name: str, want):
        """Bool per row of in/out tensor `name`: a row the call does not write whose bytes
        differ from the input's (bitwise: a NaN written back over a NaN still counts)."""
        t = self.torch
        nrows = self.row_view(name).shape[0]
        have = self.data[name].view(nrows, -1)
        want = _bytes(want)
        if want.numel() != self.data[name].numel():
            return t.ones(nrows, dtype=t.bool, device=self.device)
        differ = (have != want.view(nrows, -1)).any(dim=1)
        differ[self.rows[name]] = False
        return differ


def _fill_poison(t, out, kind: str, g) -> None:
    if kind == "nan":
        out.fill_(float("nan"))
    elif kind == "huge":
        big = t.finfo(out.dtype).max / 2 if out.dtype.is_floating_point else 2**30
        signs = t.randint(0, 2, out.shape, generator=g, device=out.device) * 2 - 1
        out.copy_(signs.to(out.dtype) * big)
    else:
        out.copy_(t.randn(out.shape, generator=g, device=out.device, dtype=t.float32)
                  .mul_(100.0).to(out.dtype))


class Poison:
    """What one call's outputs were filled with: `get(name)` rebuilds that output's poison from
    the recorded kind and seed (the draw is deterministic given the generator's seed)."""

    def __init__(self, slot, kind: str, seed: int):
        self.slot, self.kind, self.seed = slot, kind, seed

    def get(self, name):
        """An output's poison, or that of the written rows of an in/out tensor ([rows, D])."""
        slot = self.slot
        t = slot.torch
        if name in slot.outputs_names:
            out = t.empty_like(slot.typed(name))
        elif name in slot.inout_names:
            out = t.empty((slot.rows[name].numel(), slot.row_view(name).shape[1]),
                          dtype=slot.meta[name][1], device=slot.device)
        else:
            return None
        g = t.Generator(device=slot.device).manual_seed(self.seed ^ hash(name) & 0xFFFFFFFF)
        _fill_poison(t, out, self.kind, g)
        return out


def _bytes(t):
    return t.contiguous().reshape(-1).view(__import__("torch").uint8)


# --- parallel compilation (CUDA) -------------------------------------------------------------------
def compile_jobs(plan, kdefs: dict) -> list[tuple[str, dict]]:
    """(key, job) per launch: what Triton specialises on (kernel, constexprs, options, pointer
    dtypes, ints ==1 / %16), so that one compile serves every plan that shares it."""
    from kernelsearch.harness.plan import Launch, Ref

    out = []
    for step in plan.steps:
        if not isinstance(step, Launch):
            continue
        kdef = kdefs[step.kernel]
        args, sig = {}, []
        for name, value in step.args:
            if isinstance(value, Ref):
                args[name] = ["ref", value.dtype]
                sig.append((name, "ref", value.dtype))
            elif value[0] == "scalar":
                args[name] = ["float", 1.0]
                sig.append((name, "fp32"))
            elif value[0] == "int" and name not in kdef.constexprs:
                v = value[1]
                args[name] = ["int", v]
                sig.append((name, "int", v == 1, v % 16 == 0, -2**31 <= v < 2**31))
            else:
                args[name] = list(value)
                sig.append((name, *value))
        job = {"kernel": step.kernel, "args": args, "options": dict(step.options), "grid": list(step.grid)}
        out.append((json.dumps([step.kernel, sig, sorted(step.options)], default=str), job))
    return out


class CompilePool:
    """Worker processes that compile a batch of launches at once (Triton compiles one kernel
    at a time per process); started on the first batch worth it, kept for the executor's life."""

    MIN_JOBS = 4

    def __init__(self, cache_dir: str):
        self.cache_dir, self.pool, self.futures = cache_dir, None, {}

    def start(self) -> None:
        """Start the workers now (they import torch and triton and open CUDA while the sandbox
        plans), not when the first batch arrives."""
        if self.pool is not None:
            return
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        from kernelsearch.harness import compile_worker

        workers = max(1, min(16, (os.cpu_count() or 2) - 1))
        self.pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                        initializer=compile_worker.init, initargs=(self.cache_dir,))
        for _ in range(workers):
            self.pool.submit(compile_worker.ready)

    def submit(self, source_text: str, jobs: list) -> int:
        fresh = [(k, j) for k, j in jobs if k not in self.futures]
        if len(fresh) < self.MIN_JOBS and self.pool is None:
            return 0
        self.start()
        from kernelsearch.harness import compile_worker

        for k, j in fresh:
            self.futures[k] = self.pool.submit(compile_worker.compile_one, source_text, j)
        return len(fresh)

    def wait(self, keys, timeout_s: float = 300.0) -> None:
        from concurrent.futures import wait

        # A job still queued (behind the warm-up of every other config) is taken back: the
        # case's own first launch compiles it now, beside the pool, instead of waiting its
        # turn past the case's time limit (seen on the H200: a 288-config template's first
        # case waited > 120 s and was killed). Only jobs a worker has started are waited for.
        pending = [f for f in (self.futures[k] for k in keys if k in self.futures) if not f.cancel()]
        if pending:
            wait(pending, timeout=timeout_s)  # a failed compile is redone (and judged) in-process


# --- the executor ---------------------------------------------------------------------------------
class Executor:
    def __init__(self, device: str, compiler: "CompilePool | None" = None):
        import torch

        self.torch, self.device = torch, device
        self.cuda = device.startswith("cuda")
        if self.cuda:
            torch.cuda.init()
            dev = torch.device(device)
            torch.cuda.set_device(dev.index if dev.index is not None else 0)
        else:
            torch.set_num_threads(1)
            _install_interpreter_guard()
        from kernelsearch.harness import source as source_mod
        from kernelsearch.specs import SPECS, dtype_from_name

        self.source_mod, self.SPECS, self.dtype_from_name = source_mod, SPECS, dtype_from_name
        self.kernel_dir = source_mod.private_dir("hwtune-executor-")
        self.sources: dict = {}        # sha -> (KernelSource, {name: kernel})
        self.rng = random.Random(secrets.randbits(64))
        self.compiler = compiler if self.cuda else None

    # helpers
    def gen(self):
        return self.torch.Generator(device=self.device).manual_seed(secrets.randbits(62))

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize()

    def load(self, request):
        try:
            src = self.source_mod.KernelSource.parse(request["source"])
        except self.source_mod.SourceError as exc:
            return {"ok": False, "guard": "static", "reason": "; ".join(exc.problems[:6])}
        if src.sha256 not in self.sources:
            try:
                kernels = self.source_mod.load_kernels(src, self.kernel_dir)
            except Exception as exc:  # a kernel Triton itself refuses to define
                return {"ok": False, "guard": "static", "reason": f"kernel definition failed: {_short(exc)}"}
            self.sources[src.sha256] = (src, kernels)
        return {"ok": True, "sha": src.sha256}

    def warm(self, request):
        """Compile every launch of these plans in parallel (CUDA; a no-op on the interpreter)."""
        if self.compiler is None or not os.environ.get("TRITON_CACHE_DIR"):
            return {"ok": True, "jobs": 0}
        from kernelsearch.harness.plan import PlanInvalid, validate

        src, _ = self.sources[request["sha"]]
        spec = self.SPECS[request["kernel"]]
        jobs = []
        for case in request["cases"]:
            dt = self.dtype_from_name(case["dtype"])
            signature = spec.signature(case["shape"], dt)
            roles = {a["name"]: _nbytes(a) for a in signature if a["kind"] == "tensor"}
            try:
                plan = validate(case["plan"], kernels=src.kernels, roles=roles,
                                inputs={a["name"] for a in signature if a.get("role") == "input"},
                                inouts={a["name"] for a in signature if a.get("role") == "inout"},
                                scalars={a["name"] for a in signature if a["kind"] == "scalar"},
                                workspace_budget_bytes=max(1 << 30, 4 * sum(roles.values())))
            except PlanInvalid:
                continue
            jobs += compile_jobs(plan, src.kernels)
        return {"ok": True, "jobs": self.compiler.submit(src.text, jobs)}

    # one shape of one candidate
    def case(self, request):
        from kernelsearch.harness import compare, timing
        from kernelsearch.harness.plan import PlanInvalid, validate
        from kernelsearch.harness.run_plan import bind

        src, kernels = self.sources[request["sha"]]
        spec = self.SPECS[request["kernel"]]
        shape, dt = request["shape"], self.dtype_from_name(request["dtype"])
        signature = spec.signature(shape, dt)
        roles = {a["name"]: _nbytes(a) for a in signature if a["kind"] == "tensor"}
        io_bytes = sum(roles.values())
        try:
            plan = validate(request["plan"], kernels=src.kernels, roles=roles,
                            inputs={a["name"] for a in signature if a.get("role") == "input"},
                            inouts={a["name"] for a in signature if a.get("role") == "inout"},
                            scalars={a["name"] for a in signature if a["kind"] == "scalar"},
                            workspace_budget_bytes=max(1 << 30, 4 * io_bytes))
        except PlanInvalid as exc:
            raise Reject(exc.guard, exc.reason) from None
        t0 = time.perf_counter()
        if self.compiler is not None:
            self.compiler.wait([k for k, _ in compile_jobs(plan, src.kernels)])
        t1 = time.perf_counter()
        tol = spec.tolerance(dt)
        dists = spec.distributions_for(dt)
        offset = int(request.get("dist_offset", 0))
        result = {"error_rel_l2": 0.0, "launches": plan.launches, "plan": plan.digest()}
        label = f"{spec.describe(shape)} {request['dtype']}" + (" (drawn at random)" if request.get("random") else "")

        # One trial per distribution, every shape: two of them, chosen by the shape's place in
        # the sweep, told a launch which shapes never saw huge or per-row-scaled inputs (a
        # softmax without its max subtraction on those shapes only was accepted).
        # Trials from the third on pass the scalars models pass (spec.typical_scalars), in turn.
        typical = spec.typical_scalars(shape)
        for trial in range(max(2, len(dists))):
            dist = dists[(offset + trial) % len(dists)]
            where = f"shape {label} trial {trial + 1} ({dist} inputs)"
            inputs = self.draw_inputs(spec, shape, dt, dist, upper=trial % 2 == 1)
            if trial >= 2 and typical:
                chosen = typical[(trial - 2) % len(typical)]
                inputs.update(chosen)
                where += " at " + ", ".join(f"{k}={v:.6g}" for k, v in chosen.items())
            slot = Slot(self.torch, plan, signature, self.device, self.gen())
            slot.load_inputs(inputs, spec.written(inputs))
            bound = bind(plan, kernels, slot.data, inputs)
            outputs = self.call_checked(bound, slot, inputs, where)
            reference = spec.reference(inputs)
            err = self.judge(spec, slot, outputs, reference, tol, where)
            result["error_rel_l2"] = max(result["error_rel_l2"], err)
            if trial == 0:  # same inputs again: bitwise, or within a small band
                first = {n: slot.typed(n).clone() for n in slot.outputs_names}
                first.update({n: slot.written_rows(n) for n in slot.inout_names})
                again = self.call_checked(bound, slot, inputs, where + " (repeat)")
                self.judge(spec, slot, again, reference, tol, where + " (repeat)")
                band = DETERMINISM_BAND * tol
                for name in slot.outputs_names + slot.inout_names:
                    a = first[name]
                    b = slot.typed(name) if name in slot.outputs_names else slot.written_rows(name)
                    if not self.torch.equal(a, b):
                        diff = compare.run_to_run_difference(a, b)
                        if diff > band:
                            raise Reject("nondeterministic", f"{where}: {name} differs between two runs on the "
                                                             f"same inputs by {diff:.3g} (band {band:.3g})")
            del slot, bound, inputs, reference
        t2 = time.perf_counter()
        if request.get("time"):
            result.update(self.time_case(spec, plan, kernels, signature, shape, dt, tol, dists, offset, label))
        t3 = time.perf_counter()
        result["profile_s"] = {"compile_wait": round(t1 - t0, 4), "checks": round(t2 - t1, 4),
                               "timed": round(t3 - t2, 4)}
        return {"ok": True, "result": result}

    def draw_inputs(self, spec, shape, dt, dist, upper=False, timed=False):
        inputs = spec.make_inputs(shape, dt, self.device, self.gen(), dist)
        if timed:
            inputs = spec.timed_inputs(inputs)
        scalars = spec.draw_scalars(self.rng, shape)
        if upper:  # the upper half of each range: a hard-coded eps fails here if not before
            scalars = {k: math.sqrt(v * spec.scalar_ranges[k][1]) if k in spec.scalar_ranges and
                       spec.upper_scalars else v for k, v in scalars.items()}
        inputs.update(scalars)
        return inputs

    def call_checked(self, bound, slot, inputs, where):
        self.poison = slot.poison(self.rng.choice(POISONS))
        self.run_guarded(bound, slot, where)
        self.integrity(slot, inputs, where)
        return {n: slot.typed(n) for n in slot.outputs_names}

    def run_guarded(self, bound, slot, where):
        _ALLOWED[:] = slot.ranges()
        try:
            bound()
            self.sync()
        except BaseException as exc:
            raise self.kernel_failure(exc, where) from None
        finally:
            _ALLOWED[:] = []

    def kernel_failure(self, exc, where):
        seen, cause = set(), exc
        while cause is not None and id(cause) not in seen:
            seen.add(id(cause))
            if isinstance(cause, InputWrite):
                return Reject("input_mutated", f"{where}: {cause}")
            if isinstance(cause, OutOfBounds):
                return Reject("out_of_bounds", f"{where}: {cause}")
            if isinstance(cause, MemoryError):   # the CPU executor's data limit, under the interpreter
                return Reject("out_of_memory", f"{where}: {_short(exc)}")
            cause = cause.__cause__ or cause.__context__
        text = _short(exc)
        if isinstance(exc, MemoryError) or "out of memory" in text.lower():
            return Reject("out_of_memory", f"{where}: {text}")
        if "OutOfBounds" in text:
            return Reject("out_of_bounds", f"{where}: {text}")
        if self.cuda and ("CUDA error" in text or "illegal" in text.lower()):
            self.broken = True  # the context is gone: this executor exits after replying
            return Reject("crash", f"{where}: {text}")
        return Reject("exception", f"{where}: {text}")

    def integrity(self, slot, inputs, where):
        damaged, mutated, dirty, scribbled = slot.damaged(inputs)
        if damaged:
            raise Reject("out_of_bounds", f"{where}: wrote outside its buffers (canary zone of "
                                          f"{', '.join(damaged)} changed)")
        if mutated:
            raise Reject("input_mutated", f"{where}: input(s) {', '.join(mutated)} modified by the call")
        if dirty:
            raise Reject("workspace_state", f"{where}: persistent workspace {', '.join(dirty)} not left "
                                            "all-zero (state carried from one call to the next)")
        if scribbled:
            name = scribbled[0]
            changed = slot.changed_rows(name, inputs[name])
            first = int(changed.nonzero()[0, 0])
            shape = slot.meta[name][0][:-1]
            index = []
            for d in reversed(shape):
                index.append(first % d)
                first //= d
            raise Reject("inout_mutated", f"{where}: {', '.join(scribbled)} changed outside the rows the op "
                                          f"writes ({int(changed.sum())} row(s) of {name}, first at "
                                          f"{name}[{', '.join(map(str, reversed(index)))}])")

    def judge(self, spec, slot, outputs, reference, tol, where, guard_override=None):
        from kernelsearch.harness import compare

        worst = 0.0
        for name in spec.out_names + spec.inout_names:
            # an in/out tensor is judged on the rows the call writes (the rest is checked
            # bitwise by integrity()), so an error in a few rows is not diluted by the others
            out = outputs[name] if name in spec.out_names else slot.written_rows(name)
            err, problem = compare.compare(name, out, reference[name], tol)
            if problem:
                guard = problem.guard
                poison = self.poison.get(name)
                if poison is not None and guard == "correctness":
                    same = (out.view(self.torch.uint8) if out.element_size() == 1 else
                            out.view({2: self.torch.int16, 4: self.torch.int32, 8: self.torch.int64}[out.element_size()]))
                    ref_bits = (poison.view(same.dtype))
                    left = int((same == ref_bits).sum())
                    # bf16 has 65536 values: a wrong but written output meets the random poison
                    # by chance in a few elements per 10^4; unwritten means more than that.
                    if left >= max(16, out.numel() // 1000):
                        guard = "unwritten_output"
                        problem = compare.Mismatch(guard, f"{name}: {left} of {out.numel()} elements still hold "
                                                          "the poison (not written)")
                raise Reject(guard_override or guard, f"{where}: {problem.reason}")
            worst = max(worst, err)
        return worst

    # timing ----------------------------------------------------------------------------------
    def time_case(self, spec, plan, kernels, signature, shape, dt, tol, dists, offset, label):
        from kernelsearch.harness import timing
        from kernelsearch.harness.run_plan import bind

        where = f"shape {label} timed runs"
        guard = "cuda_graph" if self.cuda else "timed_path"
        dist = dists[offset % len(dists)]
        scalars = spec.draw_scalars(self.rng, shape)
        slots = [Slot(self.torch, plan, signature, self.device, self.gen())]
        first = self.draw_inputs(spec, shape, dt, dist, timed=True)
        first.update(scalars)
        slots[0].load_inputs(first, spec.written(first))
        bounds = [bind(plan, kernels, slots[0].data, scalars)]
        # warm-up (compilation) and an eager timing that sets how many calls one replay holds
        self.run_guarded(bounds[0], slots[0], where)
        n = 1
        if self.cuda:
            eager_ms = timing.eager_ms(bounds[0])
            slot_bytes = sum(d.numel() for d in slots[0].data.values()) + 2 * CANARY_BYTES * len(slots[0].data)
            n = timing.calls_per_replay(eager_ms, max(1, SLOT_MEMORY_BUDGET // max(1, 2 * slot_bytes)))
            for _ in range(n - 1):
                s = Slot(self.torch, plan, signature, self.device, self.gen())
                s.load_inputs(first, spec.written(first))
                slots.append(s)
                bounds.append(bind(plan, kernels, s.data, scalars))
                self.run_guarded(bounds[-1], s, where)
        state = {}

        def refresh(rep):
            state["inputs"] = []
            state["poison"] = []
            for s in slots:
                inputs = self.draw_inputs(spec, shape, dt, dist, timed=True)
                inputs.update(scalars)
                s.load_inputs(inputs, spec.written(inputs))
                state["inputs"].append(inputs)
                state["poison"].append(s.poison(self.rng.choice(POISONS)))

        # Which calls are checked is drawn here, where no candidate code runs: one call of
        # every replay and every call of FULL_CHECKS replays. Every call got fresh inputs and
        # fresh poison alike, so a kernel cannot tell a checked call from another.
        reps = timing.default_reps(self.device)
        full = set(self.rng.sample(range(reps), min(FULL_CHECKS, reps)))

        def check(rep):
            chosen = range(len(slots)) if rep in full else [self.rng.randrange(len(slots))]
            for j in chosen:
                s = slots[j]
                self.poison = state["poison"][j]
                w = f"{where} (replay {rep + 1}, call {j + 1} of {len(slots)})"
                self.integrity(s, state["inputs"][j], w)
                outputs = {name: s.typed(name) for name in s.outputs_names}
                self.judge(spec, s, outputs, spec.reference(state["inputs"][j]), tol, w, guard)

        ranges = [r for s in slots for r in s.ranges()]

        def run_all():
            _ALLOWED[:] = ranges
            try:
                for b in bounds:
                    b()
            finally:
                _ALLOWED[:] = []

        rng_state = self.torch.cuda.get_rng_state_all() if self.cuda else None
        try:
            t = timing.time_calls(run_all, self.device, reps=None, refresh=refresh, check=check,
                                  calls=len(slots))
        except timing.CaptureError as exc:
            raise Reject("cuda_graph", f"{where}: not capturable in a CUDA graph: {exc}") from None
        except Reject:
            raise
        except BaseException as exc:
            raise self.kernel_failure(exc, where) from None
        if rng_state is not None:
            self.torch.cuda.set_rng_state_all(rng_state)
        return {"candidate_ms": timing.percentile(t.times_ms, 50),
                "candidate_p20_ms": timing.percentile(t.times_ms, 20),
                "candidate_p80_ms": timing.percentile(t.times_ms, 80),
                "timing": t.method, "launches_per_replay": t.launches_per_replay}

    def stock(self, request):
        from kernelsearch.harness import timing

        spec = self.SPECS[request["kernel"]]
        shape, dt = request["shape"], self.dtype_from_name(request["dtype"])
        dist = spec.distributions_for(dt)[0]
        sets = [self.draw_inputs(spec, shape, dt, dist, timed=True)]
        fn = lambda: spec.stock_call(sets[0])  # noqa: E731
        n = 1
        if self.cuda:
            fn()
            n = timing.calls_per_replay(timing.eager_ms(fn), 20)
            sets += [self.draw_inputs(spec, shape, dt, dist, timed=True) for _ in range(n - 1)]

        def run_all():
            for s in sets:
                spec.stock_call(s)

        def refresh(rep):
            for s in sets:
                fresh = self.draw_inputs(spec, shape, dt, dist, timed=True)
                for k, v in fresh.items():
                    if hasattr(s[k], "copy_"):
                        s[k].copy_(v)

        reps = None if self.cuda else 5
        a = timing.time_calls(run_all, self.device, reps=reps, refresh=refresh, calls=n)
        b = timing.time_calls(run_all, self.device, reps=reps, refresh=refresh, calls=n)
        return {"ok": True, "stock_ms": (a.median_ms + b.median_ms) / 2,
                "noise_band": timing.noise_band(a.median_ms, b.median_ms), "method": a.method}


def _nbytes(arg: dict) -> int:
    from kernelsearch.harness.plan import DTYPE_SIZES

    n = DTYPE_SIZES[arg["dtype"]]
    for d in arg["shape"]:
        n *= d
    return n


def _short(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return " ".join(text.split())[:600]


def _limit_data(nbytes: int) -> None:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    if hard != resource.RLIM_INFINITY:
        nbytes = min(nbytes, hard)
    if soft == resource.RLIM_INFINITY or soft > nbytes:
        resource.setrlimit(resource.RLIMIT_DATA, (nbytes, hard))


def main(argv: list[str]) -> int:
    fd_in, fd_out, device = int(argv[0]), int(argv[1]), argv[2]
    if not device.startswith("cuda"):
        _limit_data(CPU_DATA_LIMIT_BYTES)
    requests, replies = os.fdopen(fd_in, "r"), os.fdopen(fd_out, "w")

    def reply(msg):
        replies.write(json.dumps(msg) + "\n")
        replies.flush()

    try:
        compiler = None
        if device.startswith("cuda") and os.environ.get("TRITON_CACHE_DIR"):
            # Its workers start now, importing torch and triton and opening CUDA while this
            # process does the same.
            compiler = CompilePool(os.environ["TRITON_CACHE_DIR"])
            compiler.start()
        ex = Executor(device, compiler)
    except BaseException as exc:  # noqa: BLE001
        reply({"ok": False, "guard": "harness", "reason": f"executor setup: {_short(exc)}"})
        return 1
    ex.broken = False
    handlers = {"load": ex.load, "case": ex.case, "stock": ex.stock, "warm": ex.warm}
    for line in requests:
        request = json.loads(line)
        op = request.get("op")
        if op == "exit":
            return 0
        try:
            msg = handlers[op](request)
        except Reject as exc:
            msg = {"ok": False, "guard": exc.guard, "reason": exc.reason}
        except BaseException as exc:  # noqa: BLE001 -- a harness bug is still an answer
            tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)[-3:])
            msg = {"ok": False, "guard": "harness", "reason": f"{_short(exc)} | {' '.join(tb.split())[-600:]}"}
        try:
            reply(msg)
        except OSError:  # BrokenPipeError: the parent is gone
            break
        if ex.broken:
            return 3
    # End of requests without an "exit": the parent died (SIGKILL skips its cleanup), so its
    # work directory (stderr, compiled kernels, Triton's cache) would stay in /tmp for ever.
    _remove_work_dir()
    return 0


def _remove_work_dir() -> None:
    """Remove $HWTUNE_WORK_DIR, the runner's directory for this executor, when it is one."""
    import shutil

    path = os.environ.get("HWTUNE_WORK_DIR", "")
    if os.path.basename(path).startswith("hwtune-executor-") and os.path.isdir(path) \
            and not os.path.islink(path) and os.stat(path).st_uid == os.getuid():
        shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    _profile_to = os.environ.pop("HWTUNE_EXECUTOR_PROFILE", "")  # bench/verifier_speed_gpu.py --profile
    if _profile_to:
        import cProfile

        _prof = cProfile.Profile()
        _code = _prof.runcall(main, sys.argv[1:])
        _prof.dump_stats(_profile_to)
        sys.exit(_code)
    sys.exit(main(sys.argv[1:]))
