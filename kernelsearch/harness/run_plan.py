"""Execute a validated launch plan on the caller's buffers. Trusted; used by the harness's
executor and by the dispatch runtime (the same code runs what was verified).

    bound = bind(plan, kernels, buffers, scalars)   # buffers: {id: 1-D uint8 tensor (the data)}
    bound()                                           # zero steps and kernel launches, in order

Only the file's @triton.jit kernels (compiled by the harness from checked source, see
source.load_kernels) and zero fills ever run; nothing of the candidate's Python.

On sm_90+ every kernel is launched with programmatic dependent launch (PDL): the generated
module makes `gdc_wait()` each kernel's first statement behind a flag only this launcher sets
(source._with_grid_dependency_wait), so a kernel's launch and the previous kernel's end
overlap and it starts the moment that one is done; the results are those of a plain launch.
HWTUNE_PDL=0 in the environment, or `with pdl(False):`, launches plainly.

Early reads (off unless HWTUNE_PDL_EARLY=1 or `with early_reads(True):`): a kernel whose first
statements only load (source.early_prefix) may run them before its wait, so that its first
weight bytes are on their way while the kernel before it ends. `bind(..., static=...)` names the
buffers its caller vouches no kernel writes while these launches may run (a spec's
static_inputs: model weights, in a decode step; with an early HWTUNE_PDL_TRIGGER the kernel two
back may still run, so "the kernel before" is not enough); a launch reads early only where
every buffer its prefix loads through is one of them and no earlier step of the plan passes that
buffer to a kernel or zeroes it. The harness's executor never passes any: what it verifies and
times runs the wait first.
"""
from __future__ import annotations

import contextlib
import os

import torch

from kernelsearch.harness.plan import DTYPE_SIZES, Launch, Plan, Ref, Zero, eval_expr
from kernelsearch.harness.source import EARLY_READS_ATTR

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                "float64": torch.float64, "int8": torch.int8, "int16": torch.int16,
                "int32": torch.int32, "int64": torch.int64, "uint8": torch.uint8, "bool": torch.bool}
for _name in ("float8_e4m3fn", "float8_e5m2"):
    if hasattr(torch, _name):
        TORCH_DTYPES[_name] = getattr(torch, _name)


def ref_tensor(buffers: dict, ref: Ref) -> torch.Tensor:
    """The plan's view of a buffer: a 1-D tensor of ref.dtype from ref.offset to the end."""
    raw = buffers[ref.buf]
    size = DTYPE_SIZES[ref.dtype]
    n = (raw.numel() - ref.offset) // size
    return raw[ref.offset:ref.offset + n * size].view(TORCH_DTYPES[ref.dtype])


class Bound:
    """A plan with its arguments resolved: calling it runs the steps."""

    def __init__(self, calls: list):
        self.calls = calls

    def __call__(self) -> None:
        for fn, args, kwargs in self.calls:
            fn(*args, **kwargs)


_pdl = os.environ.get("HWTUNE_PDL", "1").strip() not in ("0", "off", "false", "no")


def _early_from_env() -> bool:
    value = os.environ.get("HWTUNE_PDL_EARLY", "0").strip().lower()
    if value in ("1", "on", "true", "yes"):
        return True
    if value not in ("", "0", "off", "false", "no"):
        import warnings

        warnings.warn(f"HWTUNE_PDL_EARLY={value!r} is not 1/on or 0/off: early reads stay off",
                      RuntimeWarning, stacklevel=2)
    return False


_early = _early_from_env()
_sm90: dict = {}


@contextlib.contextmanager
def pdl(enabled: bool):
    """Launch with PDL (where the device and the kernel allow it) or not, inside the block:
    what a launch captured into a CUDA graph in the block keeps."""
    global _pdl
    before, _pdl = _pdl, bool(enabled)
    try:
        yield
    finally:
        _pdl = before


def pdl_enabled() -> bool:
    return _pdl


@contextlib.contextmanager
def early_reads(enabled: bool):
    """Let kernels read their static inputs before the wait (see the module's docstring) inside
    the block, or not: what a launch captured into a CUDA graph in the block keeps."""
    global _early
    before, _early = _early, bool(enabled)
    try:
        yield
    finally:
        _early = before


def early_reads_enabled() -> bool:
    return _early


def pdl_note() -> str:
    """How launches are made now, for a benchmark row: PDL, early reads, the trigger."""
    from kernelsearch.harness.source import pdl_trigger

    if not _pdl:
        return "off (HWTUNE_PDL=0)"
    return (f"on (sm_90+); early reads {'on' if _early else 'off'} (HWTUNE_PDL_EARLY); "
            f"trigger {pdl_trigger()} (HWTUNE_PDL_TRIGGER)")


def _reads_early(step, fn, static: frozenset, touched: set) -> bool:
    """Whether this launch may run fn's early prefix before its wait: every buffer the prefix
    loads through is in `static` and was not handed to an earlier step of the plan (`touched`)."""
    reads = getattr(fn, EARLY_READS_ATTR, None)
    if not _early or not reads or not static:
        return False
    args = dict(step.args)
    for name in reads:
        value = args.get(name)
        if isinstance(value, Ref) and (value.buf not in static or value.buf in touched):
            return False
    return True


def pdl_kwargs(fn, device, early: bool = False) -> dict:
    """The launch arguments that turn on PDL for kernel `fn` (a compiled jit function of a
    generated module) on `device`: {} where PDL is off, the device is not sm_90+ CUDA, the
    kernel has no grid-dependency wait (a Triton without the gdc ops), or it is not compiled
    (TRITON_INTERPRET=1, even with CUDA tensors: the interpreter has no gdc ops)."""
    from triton.runtime.jit import JITFunction

    from kernelsearch.harness.source import PDL_EARLY, PDL_PARAM

    if not _pdl or not isinstance(fn, JITFunction) or PDL_PARAM not in (fn.arg_names or ()):
        return {}
    device = torch.device(device)
    if device.type != "cuda":
        return {}
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _sm90:
        _sm90[index] = torch.cuda.get_device_capability(index) >= (9, 0)
    if not _sm90[index]:
        return {}
    return {PDL_PARAM: PDL_EARLY if early else True, "launch_pdl": True}


def _zero(t: torch.Tensor) -> None:
    t.zero_()


def bind(plan: Plan, kernels: dict, buffers: dict, scalars: dict, static=frozenset()) -> Bound:
    """The plan's calls on these buffers. `static`: the buffer ids (a spec's static inputs) the
    caller vouches no kernel writes while these run: a kernel may read those early."""
    import triton.language as tl

    calls = []
    device = next(iter(buffers.values())).device if buffers else torch.device("cpu")
    static = frozenset(static)
    touched: set = set()   # buffers an earlier step of this plan was given or zeroed
    for step in plan.steps:
        if isinstance(step, Zero):
            raw = buffers[step.ref.buf]
            calls.append((_zero, (raw[step.ref.offset:step.ref.offset + step.nbytes],), {}))
            touched.add(step.ref.buf)
            continue
        assert isinstance(step, Launch)
        kwargs = {}
        for name, value in step.args:
            if isinstance(value, Ref):
                kwargs[name] = ref_tensor(buffers, value)
            elif value[0] == "scalar":
                kwargs[name] = float(eval_expr(value[1], scalars))
            elif value[0] == "none":
                kwargs[name] = None
            elif value[0] == "tl_dtype":
                kwargs[name] = getattr(tl, value[1])
            else:
                kwargs[name] = value[1]
        kwargs.update(dict(step.options))
        grid = tuple(step.grid)
        if 0 in grid:
            continue  # an empty grid launches nothing (Triton would refuse it)
        fn = kernels[step.kernel]
        kwargs.update(pdl_kwargs(fn, device, early=_reads_early(step, fn, static, touched)))
        touched.update(v.buf for _, v in step.args if isinstance(v, Ref))
        calls.append((fn[grid], (), kwargs))
    return Bound(calls)
