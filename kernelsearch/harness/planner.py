"""Runs INSIDE the sandbox (kernelsearch.harness.jail): the candidate's host code against
symbolic tensors, recorded as launch plans. Standard library only (the sandbox has no torch,
no triton, no numpy): this file is loaded by path, never through the kernelsearch package.

The candidate sees stand-ins: `torch` (dtypes, devices, empty/zeros/empty_like, device
properties, finfo/iinfo), `triton` (jit, cdiv, next_power_of_2) and `triton.language`
(constexpr and dtypes). Its tensors have shape, strides, dtype and device but no data; its
scalar arguments (eps, scale) are symbols: arithmetic on them is recorded as an expression the
trusted side evaluates with each trial's value. `kernel[grid](...)` records a launch.

What comes out is data (`plan_request` returns a JSON-ready dict) and is validated again by
the trusted side (kernelsearch.harness.plan); nothing here is trusted.
"""
from __future__ import annotations

import builtins
import itertools
import json
import math
import sys
import types

_py_float = float
_py_int = int

DTYPES = {  # name: (itemsize, kind)
    "float32": (4, "f"), "float16": (2, "f"), "bfloat16": (2, "f"), "float64": (8, "f"),
    "float8_e4m3fn": (1, "f"), "float8_e5m2": (1, "f"),
    "int8": (1, "i"), "int16": (2, "i"), "int32": (4, "i"), "int64": (8, "i"), "uint8": (1, "u"),
    "bool": (1, "b"),
}
ALIASES = {"float": "float32", "half": "float16", "double": "float64", "int": "int32",
           "long": "int64", "short": "int16"}
LAUNCH_OPTIONS = {"num_warps", "num_stages", "num_ctas", "maxnreg"}
MAX_EXPR_NODES = 64
CANDIDATE_FILENAME = "candidate.py"


class PlanError(Exception):
    """The host code did something a plan cannot hold (torch compute, data access, ...)."""


# --- dtypes, devices ---------------------------------------------------------------------------
class dtype:
    def __init__(self, name):
        self.name = name
        self.itemsize = DTYPES[name][0]
        self.is_floating_point = DTYPES[name][1] == "f"
        self.is_signed = DTYPES[name][1] in "fi"

    def __repr__(self):
        return f"torch.{self.name}"

    def to_json(self):
        return self.name


_DTYPE_OBJS = {n: dtype(n) for n in DTYPES}


class device:
    def __init__(self, type="cpu", index=None):
        if isinstance(type, device):
            type, index = type.type, type.index
        if isinstance(type, _py_int):
            type, index = "cuda", type
        if isinstance(type, str) and ":" in type:
            type, _, idx = type.partition(":")
            index = _py_int(idx)
        self.type, self.index = type, index

    def __eq__(self, other):
        other = device(other) if isinstance(other, (str, device)) else other
        return isinstance(other, device) and (self.type, self.index or 0) == (other.type, other.index or 0)

    def __hash__(self):
        return hash((self.type, self.index or 0))

    def __repr__(self):
        return f"device(type={self.type!r}, index={self.index})" if self.index is not None \
            else f"device(type={self.type!r})"

    def __str__(self):
        return self.type if self.index is None else f"{self.type}:{self.index}"


class Size(tuple):
    def numel(self):
        n = 1
        for d in self:
            n *= d
        return n


def _dt(value) -> dtype:
    if isinstance(value, dtype):
        return value
    raise PlanError(f"expected a torch dtype, got {type(value).__name__}")


# --- symbolic scalars ---------------------------------------------------------------------------
def _expr(v):
    if isinstance(v, SymFloat):
        return v.expr
    if isinstance(v, bool) or not isinstance(v, (_py_int, _py_float)):
        raise PlanError(f"scalar arithmetic with a {type(v).__name__}")
    if not math.isfinite(v):
        raise PlanError("non-finite constant in scalar arithmetic")
    return ["const", _py_float(v)]


def _size(e) -> int:
    return 1 + sum(_size(x) for x in e[1:] if isinstance(x, list))


class SymFloat:
    """A contract scalar (eps, scale) or arithmetic on one: its value is drawn per trial by the
    trusted side, so host code may pass it (or a product, sum, quotient of it) to a kernel but
    cannot branch on it."""

    def __init__(self, expr):
        if _size(expr) > MAX_EXPR_NODES:
            raise PlanError("scalar expression too large")
        self.expr = expr

    def _bin(op, swap=False):
        def f(self, other):
            a, b = (_expr(other), self.expr) if swap else (self.expr, _expr(other))
            return SymFloat([op, a, b])
        return f

    __add__, __radd__ = _bin("add"), _bin("add", True)
    __sub__, __rsub__ = _bin("sub"), _bin("sub", True)
    __mul__, __rmul__ = _bin("mul"), _bin("mul", True)
    __truediv__, __rtruediv__ = _bin("div"), _bin("div", True)
    __pow__, __rpow__ = _bin("pow"), _bin("pow", True)

    def __neg__(self):
        return SymFloat(["neg", self.expr])

    def __pos__(self):
        return self

    def _refuse(self, *_):
        raise PlanError("branching on, or converting, a scalar argument (its value is drawn per "
                        "trial); pass it to the kernel and compute there")

    __lt__ = __le__ = __gt__ = __ge__ = __eq__ = __ne__ = __bool__ = __int__ = __index__ = _refuse
    __hash__ = None

    def __float__(self):
        self._refuse()

    def __repr__(self):
        return f"SymFloat({self.expr})"


def _sym_float(x=0.0):
    """`float(...)` inside the sandbox: a SymFloat stays symbolic."""
    if isinstance(x, SymFloat):
        return x
    return _py_float(x)


# --- symbolic tensors ---------------------------------------------------------------------------
class Buffer:
    _ids = itertools.count()

    def __init__(self, nbytes, dtype_, role, init="empty", call=None):
        self.nbytes, self.dtype, self.role, self.init = nbytes, dtype_, role, init
        self.call = call          # the Recorder that created it (None: at import)
        self.uid = next(Buffer._ids)


def _contiguous_strides(shape):
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(strides))


def _shape_arg(args):
    if len(args) == 1 and isinstance(args[0], (tuple, list, Size)):
        args = tuple(args[0])
    out = []
    for a in args:
        if isinstance(a, bool) or not isinstance(a, _py_int):
            raise PlanError(f"tensor sizes must be ints, got {type(a).__name__}")
        out.append(a)
    return tuple(out)


class Tensor:
    """No data: shape, strides (elements), dtype, device, and where it lives in a buffer."""

    def __init__(self, buffer, offset, shape, strides, dtype_, device_):
        self._buffer, self._offset = buffer, offset          # offset in bytes
        self._shape, self._strides = tuple(shape), tuple(strides)
        self._dtype, self._device = dtype_, device_

    # metadata
    @property
    def shape(self):
        return Size(self._shape)

    @property
    def dtype(self):
        return self._dtype

    @property
    def device(self):
        return self._device

    @property
    def ndim(self):
        return len(self._shape)

    @property
    def is_cuda(self):
        return self._device.type == "cuda"

    @property
    def requires_grad(self):
        return False

    @property
    def itemsize(self):
        return self._dtype.itemsize

    @property
    def nbytes(self):
        return self.numel() * self._dtype.itemsize

    def size(self, dim=None):
        return self.shape if dim is None else self._shape[dim]

    def stride(self, dim=None):
        return self._strides if dim is None else self._strides[dim]

    def dim(self):
        return len(self._shape)

    def numel(self):
        return Size(self._shape).numel()

    def element_size(self):
        return self._dtype.itemsize

    def storage_offset(self):
        return self._offset // self._dtype.itemsize

    def data_ptr(self):
        # Buffers are at least 256-byte aligned on the trusted side.
        return (self._buffer.uid + 1) * (1 << 32) + self._offset

    def is_contiguous(self, memory_format=None):
        expect = _contiguous_strides(self._shape)
        return all(s == e for d, s, e in zip(self._shape, self._strides, expect) if d != 1)

    def __len__(self):
        if not self._shape:
            raise TypeError("len() of a 0-d tensor")
        return self._shape[0]

    def __repr__(self):
        return f"SymTensor(shape={list(self._shape)}, dtype={self._dtype!r}, device={self._device})"

    # views
    def _view(self, offset, shape, strides, dtype_=None):
        return Tensor(self._buffer, offset, shape, strides, dtype_ or self._dtype, self._device)

    def view(self, *shape):
        if len(shape) == 1 and isinstance(shape[0], dtype):
            new = shape[0]
            if self._shape and self._strides[-1] != 1:
                raise PlanError("view(dtype) of a tensor with a non-unit last stride")
            old = self._dtype.itemsize
            if self._offset % new.itemsize:
                raise PlanError("view(dtype) at a misaligned offset")
            last = self._shape[-1] * old if self._shape else old
            if last % new.itemsize:
                raise PlanError("view(dtype): last dimension not divisible")
            sh = self._shape[:-1] + (last // new.itemsize,) if self._shape else (old // new.itemsize,)
            st = tuple(s * old // new.itemsize for s in self._strides[:-1]) + (1,)
            return self._view(self._offset, sh, st, new)
        shape = list(_shape_arg(shape))
        if not self.is_contiguous():
            raise PlanError("view() of a non-contiguous tensor")
        n = self.numel()
        if shape.count(-1) > 1:
            raise PlanError("view(): more than one -1")
        if -1 in shape:
            known = 1
            for d in shape:
                if d != -1:
                    known *= d
            if known == 0 or n % known:
                raise PlanError(f"view {shape} of {n} elements")
            shape[shape.index(-1)] = n // known
        if Size(shape).numel() != n:
            raise PlanError(f"view {shape} of {n} elements")
        return self._view(self._offset, shape, _contiguous_strides(shape))

    reshape = view

    def flatten(self):
        return self.view(-1)

    def contiguous(self, memory_format=None):
        if not self.is_contiguous():
            raise PlanError("contiguous() would copy (torch compute outside a kernel)")
        return self

    def detach(self):
        return self

    def unsqueeze(self, dim):
        dim = dim if dim >= 0 else dim + self.ndim + 1
        sh, st = list(self._shape), list(self._strides)
        stride = st[dim] * sh[dim] if dim < len(sh) else 1
        sh.insert(dim, 1)
        st.insert(dim, stride)
        return self._view(self._offset, sh, st)

    def squeeze(self, dim=None):
        pairs = list(zip(self._shape, self._strides))
        if dim is None:
            pairs = [p for p in pairs if p[0] != 1]
        else:
            dim = dim if dim >= 0 else dim + self.ndim
            if pairs[dim][0] == 1:
                pairs.pop(dim)
        return self._view(self._offset, [p[0] for p in pairs], [p[1] for p in pairs])

    def transpose(self, a, b):
        sh, st = list(self._shape), list(self._strides)
        sh[a], sh[b] = sh[b], sh[a]
        st[a], st[b] = st[b], st[a]
        return self._view(self._offset, sh, st)

    def t(self):
        if self.ndim != 2:
            raise PlanError("t() of a tensor that is not 2-d")
        return self.transpose(0, 1)

    @property
    def T(self):
        return self._view(self._offset, self._shape[::-1], self._strides[::-1])

    def permute(self, *dims):
        dims = _shape_arg(dims)
        return self._view(self._offset, [self._shape[d] for d in dims], [self._strides[d] for d in dims])

    def expand(self, *shape):
        shape = _shape_arg(shape)
        lead = len(shape) - self.ndim
        sh, st = [], []
        for i, d in enumerate(shape):
            if i < lead:
                sh.append(d)
                st.append(0)
                continue
            od, os_ = self._shape[i - lead], self._strides[i - lead]
            if d == -1 or d == od:
                sh.append(od)
                st.append(os_)
            elif od == 1:
                sh.append(d)
                st.append(0)
            else:
                raise PlanError(f"expand {shape} of {self._shape}")
        return self._view(self._offset, sh, st)

    def narrow(self, dim, start, length):
        sh = list(self._shape)
        if not 0 <= start <= start + length <= sh[dim]:
            raise PlanError("narrow() out of range")
        sh[dim] = length
        return self._view(self._offset + start * self._strides[dim] * self.itemsize, sh, self._strides)

    def select(self, dim, index):
        sh, st = list(self._shape), list(self._strides)
        if index < 0:
            index += sh[dim]
        if not 0 <= index < sh[dim]:
            raise PlanError("select() out of range")
        off = self._offset + index * st[dim] * self.itemsize
        del sh[dim], st[dim]
        return self._view(off, sh, st)

    def __getitem__(self, key):
        if not isinstance(key, tuple):
            key = (key,)
        if any(k is Ellipsis for k in key):
            i = key.index(Ellipsis)
            fill = self.ndim - (len(key) - 1 - sum(1 for k in key if k is None))
            key = key[:i] + (slice(None),) * fill + key[i + 1:]
        t, dim = self, 0
        for k in key:
            if k is None:
                t = t.unsqueeze(dim)
                dim += 1
            elif isinstance(k, bool) or isinstance(k, Tensor):
                raise PlanError("indexing with a tensor or bool (data access)")
            elif isinstance(k, _py_int):
                t = t.select(dim, k)
            elif isinstance(k, slice):
                start, stop, step = k.indices(t._shape[dim])
                length = max(0, (stop - start + (step - (1 if step > 0 else -1))) // step)
                if step <= 0:
                    raise PlanError("slice step must be positive")
                sh, st = list(t._shape), list(t._strides)
                off = t._offset + start * st[dim] * t.itemsize
                sh[dim], st[dim] = length, st[dim] * step
                t = t._view(off, sh, st)
                dim += 1
            else:
                raise PlanError(f"index of type {type(k).__name__}")
        return t

    def as_strided(self, size, stride, storage_offset=None):
        off = self._offset if storage_offset is None else storage_offset * self.itemsize
        return self._view(off, _shape_arg((size,)), _shape_arg((stride,)))

    # allocation from a tensor
    def new_empty(self, *size, dtype=None, device=None):
        return empty(*size, dtype=dtype or self._dtype, device=device or self._device)

    def new_zeros(self, *size, dtype=None, device=None):
        return zeros(*size, dtype=dtype or self._dtype, device=device or self._device)

    # the one write host code may do: zero a workspace or an output (a memset, timed)
    def zero_(self):
        rec = Recorder.current
        if rec is None:
            if self._buffer.role != "workspace" or self._buffer.call is not None:
                raise PlanError("zero_() outside launch()")
            self._buffer.init = "zeros"  # at import: a zero-initialised persistent buffer
            return self
        rec.zero(self)
        return self

    def fill_(self, value):
        if value == 0:
            return self.zero_()
        raise PlanError("fill_ with a non-zero value (torch compute outside a kernel)")

    def __getattr__(self, name):
        raise PlanError(f"tensor.{name} is not available while planning: launch() may only "
                        "allocate, view and launch @triton.jit kernels (no data, no torch compute)")


def _alloc(shape, dtype_, device_, init):
    shape = _shape_arg(shape)  # the *size of empty(2, 3) or empty((2, 3))
    dtype_ = _dt(dtype_ or _DTYPE_OBJS["float32"])
    device_ = device(device_) if device_ is not None else Recorder.default_device
    if any(d < 0 for d in shape):
        raise PlanError("negative size")
    nbytes = Size(shape).numel() * dtype_.itemsize
    rec = Recorder.current
    buf = Buffer(nbytes, dtype_, "workspace", init, rec)
    t = Tensor(buf, 0, shape, _contiguous_strides(shape), dtype_, device_)
    if rec is not None:
        rec.allocate(buf)
        if init == "zeros":
            rec.zero(t)
    return t


def empty(*size, dtype=None, device=None, **_):
    return _alloc(size, dtype, device, "empty")


def zeros(*size, dtype=None, device=None, **_):
    return _alloc(size, dtype, device, "zeros")


def empty_like(t, dtype=None, device=None, **_):
    return _alloc((t.shape,), dtype or t.dtype, device or t.device, "empty")


def zeros_like(t, dtype=None, device=None, **_):
    return _alloc((t.shape,), dtype or t.dtype, device or t.device, "zeros")


def empty_strided(size, stride, dtype=None, device=None, **_):
    size, stride = _shape_arg((size,)), _shape_arg((stride,))
    span = 1 + sum((d - 1) * s for d, s in zip(size, stride)) if all(size) else 0
    t = _alloc(((span,),), dtype, device, "empty")
    return t.as_strided(size, stride, 0)


# --- the recorder ------------------------------------------------------------------------------
def _arg_value(v, rec):
    if isinstance(v, Tensor):
        return {"ref": rec.ref(v)}
    if isinstance(v, SymFloat):
        return {"scalar": v.expr}
    if isinstance(v, bool):
        return {"bool": v}
    if isinstance(v, _py_int):
        return {"int": v}
    if isinstance(v, _py_float):
        if not math.isfinite(v):
            raise PlanError("non-finite float argument")
        return {"float": v}
    if v is None:
        return {"none": True}
    if isinstance(v, str):
        return {"str": v}
    if isinstance(v, LangDtype):
        return {"tl_dtype": v.name}
    if isinstance(v, constexpr):
        return _arg_value(v.value, rec)
    raise PlanError(f"kernel argument of type {type(v).__name__} (tensors, ints, floats, bools, "
                    "strings, tl dtypes only)")


class Recorder:
    """Collects one launch() call's steps."""

    current: "Recorder | None" = None
    default_device = device("cpu")

    def __init__(self, roles: dict, inputs: set, inouts: set = frozenset()):
        self.roles = roles            # Buffer -> contract name (inputs and outputs of this call)
        self.inputs = inputs          # the names among them that must not be written
        self.inouts = inouts          # those only kernels may write (never zero_())
        self.steps: list = []
        self.local: list[Buffer] = []
        self.persistent: dict[int, Buffer] = {}

    def allocate(self, buf: Buffer) -> None:
        self.local.append(buf)

    def buffer_id(self, buf: Buffer) -> str:
        if buf in self.roles:
            return self.roles[buf]
        if buf.role != "workspace":
            raise PlanError("a tensor of another launch() call (a stale input or output) was used")
        if buf.call is not self:
            self.persistent[buf.uid] = buf
            return f"p{buf.uid}"
        return f"w{buf.uid}"

    def ref(self, t: Tensor) -> dict:
        return {"buf": self.buffer_id(t._buffer), "offset": t._offset, "dtype": t._dtype.name}

    def zero(self, t: Tensor) -> None:
        if t._buffer in self.roles and self.roles[t._buffer] in self.inputs:
            raise PlanError(f"zero_() of input {self.roles[t._buffer]!r} (inputs must not be modified)")
        if t._buffer in self.roles and self.roles[t._buffer] in self.inouts:
            raise PlanError(f"zero_() of in/out tensor {self.roles[t._buffer]!r} (only the rows the op "
                            "writes may change, by a kernel)")
        if not t.is_contiguous():
            raise PlanError("zero_() of a non-contiguous view")
        self.steps.append({"op": "zero", "ref": self.ref(t), "nbytes": t.nbytes})

    def launch(self, kernel: "JITFunction", grid, args, kwargs) -> None:
        names = kernel.params
        if len(args) > len(names):
            raise PlanError(f"{kernel.name}: {len(args)} positional arguments for {len(names)} parameters")
        bound = dict(zip(names, args))
        options = {}
        for k, v in kwargs.items():
            if k in LAUNCH_OPTIONS:
                options[k] = v
            elif k in names:
                if k in bound:
                    raise PlanError(f"{kernel.name}: {k} given twice")
                bound[k] = v
            else:
                raise PlanError(f"{kernel.name}: unknown argument {k!r}")
        if callable(grid) and not isinstance(grid, (tuple, list)):
            grid = grid(dict(bound))
        if isinstance(grid, (_py_int, constexpr)):
            grid = (grid,)
        if not isinstance(grid, (tuple, list)) or not 1 <= len(grid) <= 3:
            raise PlanError(f"{kernel.name}: grid must be 1 to 3 ints")
        grid_ints = []
        for g in grid:
            g = g.value if isinstance(g, constexpr) else g
            if isinstance(g, bool) or not isinstance(g, _py_int):
                raise PlanError(f"{kernel.name}: grid entries must be ints")
            grid_ints.append(g)
        for k, v in options.items():
            if isinstance(v, bool) or not isinstance(v, _py_int):
                raise PlanError(f"{kernel.name}: {k} must be an int")
        self.steps.append({"op": "launch", "kernel": kernel.name, "grid": grid_ints,
                           "args": {k: _arg_value(v, self) for k, v in bound.items()},
                           "options": options})

    def plan(self) -> dict:
        buffers = {}
        for buf in self.local:
            buffers[f"w{buf.uid}"] = {"nbytes": buf.nbytes, "dtype": buf.dtype.name, "init": buf.init,
                                      "persistent": False}
        for uid, buf in self.persistent.items():
            buffers[f"p{uid}"] = {"nbytes": buf.nbytes, "dtype": buf.dtype.name, "init": buf.init,
                                  "persistent": True}
        return {"buffers": buffers, "steps": self.steps}


# --- stand-in modules ----------------------------------------------------------------------------
class constexpr:
    def __init__(self, value):
        self.value = value.value if isinstance(value, constexpr) else value

    def __repr__(self):
        return f"constexpr({self.value!r})"

    def __index__(self):
        return self.value

    def __int__(self):
        return _py_int(self.value)

    def __bool__(self):
        return bool(self.value)

    def __eq__(self, other):
        return self.value == (other.value if isinstance(other, constexpr) else other)

    def __hash__(self):
        return hash(self.value)


class LangDtype:
    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return f"triton.language.{self.name}"


class JITFunction:
    def __init__(self, fn, **kwargs):
        code = fn.__code__
        self.fn, self.name = fn, fn.__name__
        self.params = code.co_varnames[:code.co_argcount]

    def __getitem__(self, grid):
        def launcher(*args, **kwargs):
            rec = Recorder.current
            if rec is None:
                raise PlanError(f"{self.name} launched outside launch()")
            rec.launch(self, grid, args, kwargs)
        return launcher

    def __call__(self, *a, **k):
        raise PlanError(f"{self.name} called directly: launch it as {self.name}[grid](...)")

    def run(self, *a, **k):
        raise PlanError(f"{self.name}.run(...): launch it as {self.name}[grid](...)")


def _jit(fn=None, **kwargs):
    if fn is None:
        return lambda f: JITFunction(f, **kwargs)
    return JITFunction(fn, **kwargs)


def _unsupported(what):
    def f(*a, **k):
        raise PlanError(f"{what} is not supported (use CONFIGS for the parameters to search)")
    return f


class _Props:
    def __init__(self, info):
        self.name = info.get("name", "")
        self.multi_processor_count = info.get("sm_count", 4)
        self.L2_cache_size = info.get("l2_bytes", 0)
        self.total_memory = info.get("total_memory", 0)
        self.major, self.minor = info.get("capability", (0, 0))
        self.warp_size = 32
        self.max_shared_memory_per_block_optin = info.get("smem_optin", 0)


class _finfo:
    _TABLE = {"float32": (3.4028234663852886e38, 1.1920928955078125e-07, 1.1754943508222875e-38, 32),
              "float16": (65504.0, 0.0009765625, 6.103515625e-05, 16),
              "bfloat16": (3.3895313892515355e38, 0.0078125, 1.1754943508222875e-38, 16),
              "float64": (1.7976931348623157e308, 2.220446049250313e-16, 2.2250738585072014e-308, 64)}

    def __init__(self, d):
        mx, eps, tiny, bits = self._TABLE[_dt(d).name]
        self.max, self.min, self.eps, self.tiny, self.bits = mx, -mx, eps, tiny, bits
        self.smallest_normal = tiny


class _iinfo:
    def __init__(self, d):
        d = _dt(d)
        bits = d.itemsize * 8
        if DTYPES[d.name][1] == "u":
            self.min, self.max = 0, 2 ** bits - 1
        else:
            self.min, self.max = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
        self.bits = bits


def make_modules(device_info: dict) -> dict:
    """{name: module} for torch, torch.cuda, triton, triton.language."""
    torch = types.ModuleType("torch")
    for name, obj in _DTYPE_OBJS.items():
        setattr(torch, name, obj)
    for alias, name in ALIASES.items():
        setattr(torch, alias, _DTYPE_OBJS[name])
    torch.dtype, torch.device, torch.Size, torch.Tensor = dtype, device, Size, Tensor
    torch.empty, torch.zeros, torch.empty_like, torch.zeros_like = empty, zeros, empty_like, zeros_like
    torch.empty_strided = empty_strided
    torch.finfo, torch.iinfo = _finfo, _iinfo
    cuda = types.ModuleType("torch.cuda")
    is_cuda = device_info.get("type") == "cuda"
    cuda.is_available = lambda: is_cuda
    cuda.device_count = lambda: 1 if is_cuda else 0
    cuda.current_device = lambda: 0
    cuda.get_device_properties = lambda d=None: _Props(device_info)
    cuda.get_device_capability = lambda d=None: tuple(device_info.get("capability", (0, 0)))
    cuda.get_device_name = lambda d=None: device_info.get("name", "")
    torch.cuda = cuda

    lang = types.ModuleType("triton.language")
    lang.constexpr = constexpr
    for name in ("float32", "float16", "bfloat16", "float64", "int8", "int16", "int32", "int64",
                 "uint8", "uint16", "uint32", "uint64", "int1", "float8e4nv", "float8e5"):
        setattr(lang, name, LangDtype(name))
    lang.dtype = LangDtype
    triton = types.ModuleType("triton")
    triton.jit = _jit
    triton.cdiv = lambda a, b: -(-a // b)
    triton.next_power_of_2 = lambda n: 1 if n <= 1 else 1 << (_py_int(n) - 1).bit_length()
    triton.autotune = _unsupported("@triton.autotune")
    triton.heuristics = _unsupported("@triton.heuristics")
    triton.Config = _unsupported("triton.Config")
    triton.language = lang
    extra = types.ModuleType("triton.language.extra")
    libdevice = types.ModuleType("triton.language.extra.libdevice")
    extra.libdevice = libdevice
    extra_cuda = types.ModuleType("triton.language.extra.cuda")
    extra_cuda.libdevice = libdevice
    extra.cuda = extra_cuda
    lang.extra = extra
    return {"torch": torch, "torch.cuda": cuda, "triton": triton, "triton.language": lang,
            "triton.language.extra": extra, "triton.language.extra.libdevice": libdevice,
            "triton.language.extra.cuda": extra_cuda,
            "triton.language.extra.cuda.libdevice": libdevice}


ALLOWED_STDLIB = ("math", "functools", "itertools", "typing", "__future__")


def sandbox_builtins(modules: dict) -> dict:
    """The candidate's builtins: no open/eval/exec/compile/input/breakpoint, an __import__ that
    gives only the stand-ins and a few pure modules, and a float() that keeps symbols."""
    allowed = {k: v for k, v in vars(builtins).items()
               if k not in {"open", "eval", "exec", "compile", "input", "breakpoint", "help",
                            "__import__", "globals", "locals", "vars", "getattr", "setattr",
                            "delattr", "memoryview", "exit", "quit", "copyright", "credits", "license"}}
    allowed["float"] = _sym_float

    def _import(name, globals=None, locals=None, fromlist=(), level=0):
        if level:
            raise ImportError("relative imports are not available in the sandbox")
        if name in modules:
            if fromlist or "." not in name:
                return modules[name]
            return modules[name.split(".")[0]]
        if name in ALLOWED_STDLIB:
            return sys.modules[name] if name in sys.modules else __import__(name)
        raise ImportError(f"module {name!r} is not available in the sandbox")

    allowed["__import__"] = _import
    return allowed


def _configs_json(value):
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or len(value) > 4096:
        raise PlanError("CONFIGS must be a list of at most 4096 dicts")
    out = []
    for c in value:
        if not isinstance(c, dict):
            raise PlanError("CONFIGS entries must be dicts")
        item = {}
        for k, v in c.items():
            if not isinstance(k, str) or not (v is None or isinstance(v, (bool, _py_int, _py_float, str))):
                raise PlanError("CONFIGS values must be str -> int/float/bool/str/None")
            item[k] = v
        out.append(item)
    return out


def plan_request(request: dict) -> dict:
    """Execute the candidate and record one plan per (case, params). Errors are data."""
    device_info = request.get("device") or {"type": "cpu"}
    modules = make_modules(device_info)
    Recorder.default_device = device(device_info.get("type", "cpu"), device_info.get("index"))
    module = types.ModuleType("candidate")
    module.__dict__["__builtins__"] = sandbox_builtins(modules)
    try:
        code = builtins.compile(request["source"], CANDIDATE_FILENAME, "exec", dont_inherit=True)
        exec(code, module.__dict__)
    except BaseException as exc:  # noqa: BLE001 -- the candidate's failure is a verdict
        return {"ok": False, "guard": "exception", "reason": f"import failed: {_exc(exc)}"}
    launch = module.__dict__.get("launch")
    if not callable(launch):
        return {"ok": False, "guard": "contract", "reason": "the file defines no launch() function"}
    try:
        configs = _configs_json(module.__dict__.get("CONFIGS"))
        space = module.__dict__.get("SPACE")
        if space is not None:
            space = {str(k): _configs_json([{"v": x} for x in v]) and list(v) for k, v in dict(space).items()}
    except BaseException as exc:  # noqa: BLE001
        return {"ok": False, "guard": "contract", "reason": f"CONFIGS/SPACE: {_exc(exc)}"}
    params_list = list(request.get("params") or [])
    if request.get("all_configs") or not params_list:
        keys = {json.dumps(p, sort_keys=True) for p in params_list}
        for c in (configs or [{}]):
            if json.dumps(c, sort_keys=True) not in keys:
                params_list.append(c)
                keys.add(json.dumps(c, sort_keys=True))
                if not request.get("all_configs"):
                    break
    plans = []
    for case in request["cases"]:
        row = []
        for params in params_list:
            row.append(_steady_plan(launch, case, dict(params)))
        plans.append(row)
    return {"ok": True, "configs": configs, "space": space, "params": params_list, "plans": plans}


def _canonical(plan: dict) -> str:
    """The plan with workspace ids renumbered by first use: two calls that allocate the same
    buffers compare equal."""
    names: dict[str, str] = {}

    def walk(v):
        if isinstance(v, dict):
            if "buf" in v and isinstance(v["buf"], str) and v["buf"][:1] in "wp" and v["buf"][1:].isdigit():
                v = dict(v, buf=names.setdefault(v["buf"], f"{v['buf'][0]}{len(names)}"))
            return {k: walk(x) for k, x in v.items()}
        if isinstance(v, list):
            return [walk(x) for x in v]
        return v
    steps = walk(plan["steps"])
    buffers = {names.get(k, k): b for k, b in plan["buffers"].items()}
    return json.dumps({"buffers": buffers, "steps": steps}, sort_keys=True)


def _steady_plan(launch, case: dict, params: dict) -> dict:
    """launch() is called three times with the same arguments: the first call may set up what
    later calls keep (a zeroed counter buffer); the second and third must agree. A launch()
    that plans differently on repeated calls (a memo, a call counter, a varying seed) is not a
    function of its arguments and is rejected; the second call's plan is the one used."""
    first = _plan_one(launch, case, params)
    if "error" in first:
        return first
    second = _plan_one(launch, case, params)
    if "error" in second:
        return second
    third = _plan_one(launch, case, params)
    if "error" in third:
        return third
    if _canonical(second) != _canonical(third):
        return {"error": "launch() planned differently on two calls with the same arguments "
                         "(state kept between calls: a memo, a counter, a seed)", "guard": "plan"}
    return second


def _plan_one(launch, case: dict, params: dict) -> dict:
    dev = Recorder.default_device
    inputs, inouts, args, rec_roles = set(), set(), [], {}
    for spec in case["args"]:
        name = spec["name"]
        if spec["kind"] == "scalar":
            args.append(SymFloat(["arg", name]))
            continue
        dt = _DTYPE_OBJS[spec["dtype"]]
        shape, strides = tuple(spec["shape"]), tuple(spec["strides"])
        span = (1 + sum((d - 1) * s for d, s in zip(shape, strides))) if all(shape) else 0
        buf = Buffer(span * dt.itemsize, dt, spec["role"], "empty", None)
        rec_roles[buf] = name
        if spec["role"] == "input":
            inputs.add(name)
        elif spec["role"] == "inout":
            inouts.add(name)
        args.append(Tensor(buf, 0, shape, strides, dt, dev))
    rec = Recorder(rec_roles, inputs, inouts)
    Recorder.current = rec
    try:
        launch(*args, **params)
    except PlanError as exc:
        return {"error": str(exc), "guard": "plan"}
    except RecursionError:
        return {"error": "RecursionError in launch()", "guard": "exception"}
    except BaseException as exc:  # noqa: BLE001
        return {"error": _exc(exc), "guard": "exception"}
    finally:
        Recorder.current = None
    try:
        return rec.plan()
    except PlanError as exc:
        return {"error": str(exc), "guard": "plan"}


def _exc(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    tb, where = exc.__traceback__, ""
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == CANDIDATE_FILENAME:
            where = f" (candidate line {tb.tb_lineno})"
        tb = tb.tb_next
    return (text[:400] + where).strip()
