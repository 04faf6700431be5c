"""Child-side instruments, installed before the candidate is imported (guards 7 and 11).

- LaunchCounter: wraps Triton's JITFunction.run (and the interpreter's InterpretedFunction.run)
  at class level, so every real kernel launch is counted, whatever path the candidate takes.
  While a launch runs, the op recorder is paused: under TRITON_INTERPRET=1 the kernel body
  itself executes through numpy/torch on the CPU and must not be mistaken for torch compute.
- OpRecorder: a TorchDispatchMode that records every aten op the candidate's launch() dispatches
  outside kernel launches. Allocation, views and zero-filling are allowed; anything that computes
  (copy_, add, mul, mm, softmax, ...) is recorded as a violation.
- snapshot_state / diff_state: global switches, RNG states, environment and the identity of the
  functions the harness relies on (a candidate patching time.perf_counter,
  torch.cuda.Event.elapsed_time or the timer's own references to look fast is caught here), and
  the number of live Python threads (work left running after launch() returns).
"""
from __future__ import annotations

import hashlib
import os
import sys
import threading

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# aten overload packets a launch() may dispatch outside kernels: allocation and metadata only.
ALLOWED_OPS = frozenset({
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
    "view", "_unsafe_view", "reshape", "_reshape_alias", "as_strided", "t", "transpose",
    "permute", "expand", "unsqueeze", "squeeze", "select", "slice", "detach", "alias",
    "lift_fresh", "view_as", "unflatten", "flatten", "split", "split_with_sizes", "chunk",
    "unbind", "narrow", "is_same_size", "sym_size", "sym_stride", "sym_numel",
    "sym_storage_offset", "record_stream",
})
ZERO_FILL_OPS = frozenset({"zero_", "fill_", "zeros", "zeros_like"})  # workspaces

_local = threading.local()


def _paused() -> bool:
    return getattr(_local, "in_launch", 0) > 0


_HOOK_KNOBS = ("launch_enter_hook", "launch_exit_hook", "jit_cache_hook", "jit_post_compile_hook")


def _launch_hooks() -> dict:
    """Triton's process-wide launch/compile hooks, comparable (None, or the ids of a chain's calls)."""
    try:
        from triton import knobs
        runtime = knobs.runtime
    except (ImportError, AttributeError):  # triton without knobs
        return {}
    hooks = {}
    for name in _HOOK_KNOBS:
        value = getattr(runtime, name, None)
        calls = getattr(value, "calls", None)
        hooks[name] = tuple(id(c) for c in calls) if isinstance(calls, list) else id(value)
    return hooks


class LaunchCounter:
    """Counts launches; `violations` names code a launch would run besides the kernel (a pre-run
    hook on the kernel, a Triton launch or compile hook): it runs while the op recorder is
    paused, so torch compute there would pass as Triton."""

    def __init__(self):
        self.launches = 0
        self.violations: list[str] = []
        self._installed = []
        self._hooks0: dict = {}

    def install(self) -> None:
        from triton.runtime import jit as jit_mod

        self._hooks0 = _launch_hooks()

        targets = [jit_mod.JITFunction]
        try:
            from triton.runtime.interpreter import InterpretedFunction
            targets.append(InterpretedFunction)
        except ImportError:
            pass
        for cls in targets:
            original = cls.run
            counter = self

            def run(self, *args, _original=original, **kwargs):
                if not kwargs.get("warmup", False):
                    counter.launches += 1
                counter.inspect(self)
                _local.in_launch = getattr(_local, "in_launch", 0) + 1
                try:
                    return _original(self, *args, **kwargs)
                finally:
                    _local.in_launch -= 1

            cls.run = run
            self._installed.append((cls, run))

    def inspect(self, kernel) -> None:
        if getattr(kernel, "pre_run_hooks", None):
            self.violations.append(f"pre-run hook on {getattr(kernel, 'fn', kernel)!r}"[:120])
        hooks = _launch_hooks()
        for name, value in hooks.items():
            if value != self._hooks0.get(name):
                self.violations.append(f"triton.knobs.runtime.{name} set")

    def intact(self) -> bool:
        return all(cls.__dict__.get("run") is fn for cls, fn in self._installed)


class OpRecorder(TorchDispatchMode):
    """Records forbidden aten ops dispatched outside Triton launches."""

    def __init__(self):
        super().__init__()
        self.forbidden: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not _paused():
            name = func.overloadpacket.__name__
            if name in ZERO_FILL_OPS:
                value = args[1] if len(args) > 1 else kwargs.get("value", 0)
                if name in ("fill_",) and not (isinstance(value, (int, float)) and value == 0):
                    self.forbidden.append(f"{name}({value!r})")
            elif name not in ALLOWED_OPS:
                self.forbidden.append(name)
        return func(*args, **kwargs)


def _safe(fn):
    try:
        return repr(fn())
    except Exception as exc:  # a getter that does not exist on this torch
        return f"<{type(exc).__name__}>"


def _rng_digest(state_fn) -> str:
    try:
        states = state_fn()
    except Exception as exc:
        return f"<{type(exc).__name__}>"
    if isinstance(states, torch.Tensor):
        states = [states]
    h = hashlib.blake2b(digest_size=12)
    for s in states:
        h.update(s.cpu().numpy().tobytes())
    return h.hexdigest()


def _watched_functions() -> dict:
    import time

    import triton

    watched = {
        "time.perf_counter": lambda: time.perf_counter,
        "time.time": lambda: time.time,
        "torch.allclose": lambda: torch.allclose,
        "torch.equal": lambda: torch.equal,
        "torch.isnan": lambda: torch.isnan,
        "torch.Tensor.copy_": lambda: torch.Tensor.copy_,
        "torch.Tensor.fill_": lambda: torch.Tensor.fill_,
        "torch.Tensor.cpu": lambda: torch.Tensor.cpu,
        "torch.Tensor.numpy": lambda: torch.Tensor.numpy,
        "torch.Tensor.view": lambda: torch.Tensor.view,
        "torch.empty": lambda: torch.empty,
        "torch.randn": lambda: torch.randn,
        "torch.cuda.synchronize": lambda: torch.cuda.synchronize,
        "torch.cuda.Event.record": lambda: torch.cuda.Event.record,
        "torch.cuda.Event.elapsed_time": lambda: torch.cuda.Event.elapsed_time,
        "torch.cuda.CUDAGraph.replay": lambda: torch.cuda.CUDAGraph.replay,
        "torch.cuda.graph": lambda: torch.cuda.graph,
        "triton.jit": lambda: triton.jit,
    }
    # The references the timer took at import (its clocks) and the timer itself: reachable
    # from a launch() through the caller's frames, and patched there, they would fake a speed.
    from kernelsearch.harness import timing

    for ref in ("_perf_counter", "_Event", "_elapsed", "_record", "_synchronize", "_CUDAGraph",
                "_graph", "time_calls", "time_cpu", "time_cuda"):
        watched[f"kernelsearch.harness.timing.{ref}"] = lambda ref=ref: timing.__dict__.get(ref)
    return watched


def snapshot_state() -> dict:
    """Everything a candidate must leave as it found it, as comparable strings."""
    b = torch.backends
    state = {
        "torch.backends.cuda.matmul.allow_tf32": _safe(lambda: b.cuda.matmul.allow_tf32),
        "torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction":
            _safe(lambda: b.cuda.matmul.allow_fp16_reduced_precision_reduction),
        "torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction":
            _safe(lambda: b.cuda.matmul.allow_bf16_reduced_precision_reduction),
        "torch.backends.cudnn.allow_tf32": _safe(lambda: b.cudnn.allow_tf32),
        "torch.backends.cudnn.benchmark": _safe(lambda: b.cudnn.benchmark),
        "torch.backends.cudnn.deterministic": _safe(lambda: b.cudnn.deterministic),
        "torch.get_default_dtype()": _safe(torch.get_default_dtype),
        "torch.get_float32_matmul_precision()": _safe(torch.get_float32_matmul_precision),
        "torch.are_deterministic_algorithms_enabled()": _safe(torch.are_deterministic_algorithms_enabled),
        "torch.is_grad_enabled()": _safe(torch.is_grad_enabled),
        "torch.get_num_threads()": _safe(torch.get_num_threads),
        "torch RNG state": _rng_digest(torch.get_rng_state),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["torch.cuda RNG state"] = _rng_digest(torch.cuda.get_rng_state_all)
    # A thread the candidate leaves running after launch() returns (or after import) can write
    # the outputs later, racing the harness, and makes the call look free to a timer.
    state["live Python threads"] = str(len(sys._current_frames()))
    env = hashlib.blake2b(repr(sorted(os.environ.items())).encode(), digest_size=12).hexdigest()
    state["os.environ"] = env
    state["_env_items"] = dict(os.environ)
    for name, get in _watched_functions().items():
        state[f"identity of {name}"] = _safe(lambda get=get: id(get()))
    return state


def diff_state(before: dict, after: dict) -> list[str]:
    """Human-readable changes, e.g. 'torch.backends.cuda.matmul.allow_tf32: False -> True'."""
    changes = []
    for key in before:
        if key == "_env_items":
            continue
        if key == "os.environ" and before[key] != after.get(key):
            old, new = before["_env_items"], after["_env_items"]
            for var in sorted(set(old) | set(new)):
                if old.get(var) != new.get(var):
                    changes.append(f"os.environ[{var!r}]: {old.get(var)!r} -> {new.get(var)!r}")
            continue
        if before[key] != after.get(key):
            if key.startswith("identity of"):
                changes.append(f"{key.removeprefix('identity of ')} was replaced (monkeypatched)")
            else:
                changes.append(f"{key}: {before[key]} -> {after.get(key)}")
    return changes


def warm_up(device: str) -> None:
    """Run the instruments once on a harness-owned kernel before the state snapshot.

    First use of the dispatch mode and of Triton's launcher sets things lazily (torch sets
    TORCHINDUCTOR_CACHE_DIR, Triton loads its driver): that is the harness's doing, not the
    candidate's, so it must happen before the snapshot that guard 11 compares against.
    """
    import triton
    import triton.language as tl

    @triton.jit
    def _harness_copy(src, dst, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(dst + offs, tl.load(src + offs, mask=offs < n, other=0.0), mask=offs < n)

    src = torch.arange(8, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    with OpRecorder():
        _harness_copy[(1,)](src, dst, 8, BLOCK=8)
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()
