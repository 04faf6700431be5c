"""What of a candidate file the trusted harness ever runs: its @triton.jit kernels, from
source that passed an allowlist. The file itself is never imported here.

`KernelSource.parse(text)` reads the file's AST and checks:

- top level: a docstring; imports of triton, triton.language (any alias), libdevice, and --
  for host code only, which runs in the sandbox (kernelsearch.harness.jail) -- torch, math,
  functools, itertools, typing, __future__; assignments; function definitions. Nothing else
  (no class, no top-level call, loop, if or try).
- a @triton.jit body: triton.language names (not its submodules, bar math/libdevice, and not
  inline_asm_elementwise: inline PTX),
  arithmetic, comparisons, if/for/while, its parameters and locals, the file's other jit
  functions, constexpr literal globals, range/min/max, and an allowlist of value attributes
  (.to, .dtype, .element_ty, .shape, reductions, ...). No dunder, no other module, no
  lambda/comprehension/with/try/import/global, no call of a local. Defaults are literals.
- host code (launch and helpers): a deny-list (private and dunder attributes, open/eval/exec/
  getattr, host and frame attributes, torch compute names) as a second fence behind the sandbox.

`module_text()` is what the harness compiles: `from __future__ import annotations`, the
triton imports under the file's own aliases, the constexpr literal globals and the jit
functions, re-generated from the checked AST (ast.unparse) with normalised decorators.
Where this Triton has the grid-dependency ops (sm_90's programmatic dependent launch), every
jit function gets one more parameter, `_hwtune_pdl: tl.constexpr = False`, and, as its first
statement, `if _hwtune_pdl: gdc_wait()` (with `gdc_launch_dependents()` before or after the
wait where HWTUNE_PDL_TRIGGER asks; see pdl_trigger). The trusted launcher
(run_plan.pdl_kwargs) sets it, with launch_pdl, on sm_90+: the kernel may then be launched
before the previous one in the stream has finished, but nothing of it runs before that one
has finished and its writes are visible -- so a launch with PDL computes what a plain launch
does, and a candidate cannot place its own reads before the wait (names starting with
`_hwtune` are the harness's: a file that uses one is refused).
`load_kernels()` writes it into a directory the harness owns and executes it with a
restricted __builtins__; under TRITON_INTERPRET=1 the interpreter runs the bodies with those
globals, so even a name the check missed finds no open/eval/__import__.
"""
from __future__ import annotations

import ast
import atexit
import collections
import errno
import functools
import hashlib
import importlib.util
import os
import shutil
import stat
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from kernelsearch.harness.plan import TL_DTYPES

MAX_SOURCE_BYTES = 512 * 1024
# Deepest AST a candidate may have (the templates reach 19): every check below recurses along
# expressions, and a chain such as `w + 1 + 1 + ...` nests one level a term. Past this depth the
# file is refused as a whole, before any recursive check, whatever Python's recursion limit is.
MAX_AST_DEPTH = 100
# @triton.jit functions a file may define (the templates have 4 at most): each is checked against
# every other's name, and module_text's store analysis goes round them once per link of a call
# chain, so 13,000 one-line kernels in 512 KiB held the caller 25 s and the executor for minutes.
MAX_KERNELS = 64
RESERVED_PREFIX = "_hwtune"   # names the generated module adds (PDL_PARAM, the gdc aliases)
PDL_PARAM = "_hwtune_pdl"
EARLY_READS_ATTR = "_hwtune_early_reads"
_GDC_IMPORT = ("from triton.language.extra.cuda import gdc_launch_dependents as _hwtune_gdc_launch, "
               "gdc_wait as _hwtune_gdc_wait")

TRITON_MODULES = {"triton"}
LANG_MODULES = {"triton.language"}
LIBDEVICE_MODULES = {"triton.language.extra.libdevice", "triton.language.extra.cuda.libdevice"}
HOST_MODULES = {"torch", "math", "functools", "itertools", "typing", "__future__"}

JIT_BUILTINS = frozenset({"range", "min", "max", "float", "int"})
# What writes memory in a jit body (tensor methods and tl functions alike)
STORES = frozenset({"store", "atomic_add", "atomic_and", "atomic_cas", "atomic_max", "atomic_min",
                    "atomic_or", "atomic_xchg", "atomic_xor"})
# Attributes a jit body may read off a value (a tensor, a dtype, a constexpr): tensor methods
# that are triton.language functions, and type queries. Nothing that reaches the interpreter's
# handles (.handle, .data) or Python internals.
VALUE_ATTRS = frozenset({
    "to", "dtype", "element_ty", "scalar", "shape", "numel", "value", "T",
    "reshape", "view", "trans", "permute", "broadcast_to", "expand_dims", "ravel", "split",
    "flip", "sort", "gather", "histogram",
    "sum", "max", "min", "argmax", "argmin", "xor_sum", "reduce", "reduce_or", "cumsum",
    "cumprod", "associative_scan", "softmax",
    "abs", "exp", "exp2", "log", "log2", "sqrt", "sqrt_rn", "rsqrt", "sigmoid", "sin", "cos",
    "erf", "floor", "ceil", "cdiv", "logical_and", "logical_or", "cast", "advance",
    *STORES,
    "is_ptr", "is_floating", "is_int", "is_int_signed", "is_int_unsigned", "is_bool",
    "is_fp8", "is_fp16", "is_bf16", "is_fp32", "is_fp64", "is_block",
    "primitive_bitwidth", "int_bitwidth", "fp_mantissa_width",
})
JIT_DECORATOR_KWARGS = {"do_not_specialize", "do_not_specialize_on_alignment", "noinline"}
LANG_SUBMODULES = {"math"}  # tl.math.exp(...) is allowed; tl.core, tl.extra, ... are not
# triton.language names a kernel may not use: inline PTX runs instructions the harness does not
# see (the grid-dependency control it owns, timers, traps), and the CPU interpreter cannot run it;
# prints write, per program and per call, to the executor's output (a file on the host's disk,
# with no limit: a print in a loop filled it for as long as the case's deadline allowed).
LANG_DENIED = frozenset({"inline_asm_elementwise", "device_print", "static_print"})

# Host code (sandbox only): a deny-list behind the sandbox, not the barrier itself.
HOST_FORBIDDEN_NAMES = {
    "open", "exec", "eval", "compile", "__import__", "getattr", "setattr", "delattr", "globals",
    "vars", "locals", "breakpoint", "input", "memoryview", "help", "exit", "quit",
    "type",   # type(f)(code, globals) makes a function of any code; type(n, b, {...}) a class
}
HOST_FORBIDDEN_ATTRS = {
    "sys", "os", "_os", "_sys", "posix", "builtins", "threading", "_thread", "subprocess",
    "ctypes", "importlib", "inspect", "signal", "environ", "backends", "modules",
    "_getframe", "f_globals", "f_locals", "f_back", "f_builtins", "f_code", "gi_frame",
    "cr_frame", "ag_frame", "tb_frame", "tb_next", "attrgetter", "methodcaller",
    "get_type_hints", "ForwardRef", "_evaluate", "system", "popen",
    # what reads or writes attributes named by strings (a dunder in a string is no dunder to this
    # check): str.format's "{0.__class__}" fields, update_wrapper/wraps's `assigned`, and code
    # objects whose names can be replaced (code.replace(co_names=...)) and run as functions
    "format", "format_map", "update_wrapper", "wraps", "gi_code", "cr_code", "ag_code", "types",
    "FunctionType", "CodeType",
    # what evaluates strings as code: singledispatch's register() calls typing.get_type_hints,
    # which evaluates every string an annotation's value holds (typing.List["..."] keeps one as
    # a ForwardRef; an alias bound by assignment is no annotation to the check above)
    "singledispatch", "singledispatchmethod",
}


@functools.lru_cache(maxsize=None)
def _module_attrs() -> frozenset:
    """Names under which a module host code may import holds another module (typing.sys,
    typing.stdlib_re, ... in this Python): through them host code reached modules it may not
    import (typing.stdlib_re.enum.bltns is builtins: its getattr and eval)."""
    import importlib
    import inspect

    found = set()
    for name in HOST_MODULES - {"torch"}:
        mod = importlib.import_module(name)
        found.update(n for n in dir(mod) if inspect.ismodule(getattr(mod, n, None)))
    return frozenset(found)


def read_source(path) -> bytes:
    """A kernel source file's bytes (a candidate's, or a table entry's), read no further than one
    byte past MAX_SOURCE_BYTES: a larger file is refused by the check below and never read into
    memory whole. Opened without blocking; OSError when it is not a regular file (a FIFO would
    hang the reader, /dev/zero never end)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        return f.read(MAX_SOURCE_BYTES + 1)


def _private(name: str) -> bool:
    """A module's or object's internals (`typing._eval_type` evaluates a string with the real
    builtins): host code reads no attribute and imports no name that starts with an underscore."""
    return name.startswith("_")


class SourceError(ValueError):
    """The file breaks the allowlist; `problems` name the lines."""

    def __init__(self, problems: list[str]):
        super().__init__("; ".join(problems[:6]))
        self.problems = problems


@dataclass(frozen=True)
class KernelDef:
    name: str
    params: tuple[str, ...]
    constexprs: tuple[str, ...]
    defaults: tuple[str, ...]          # params that have a (literal) default
    default_values: tuple = ()         # ((param, literal value), ...)


@dataclass
class KernelSource:
    text: str
    sha256: str
    kernels: dict[str, KernelDef]
    configs: list | None               # a literal CONFIGS, else None (the sandbox reports it)
    space: dict | None                 # a literal SPACE, else None
    has_launch: bool
    _nodes: list = field(default_factory=list, repr=False)     # jit FunctionDefs, checked
    _globals: list = field(default_factory=list, repr=False)   # constexpr literal assignments
    _imports: list = field(default_factory=list, repr=False)   # lines for the generated module
    # kernel -> (statements in its early prefix, the parameters its loads there read through):
    # kernels whose first statements load only through pointers (see early_prefix)
    early: dict = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str, filename: str = "<candidate>") -> "KernelSource":
        return _Checker(text, filename).run()

    def module_text(self) -> str:
        lines = [f"# generated by hwtune's harness from a candidate (sha256 {self.sha256}):",
                 "# its checked @triton.jit kernels and constexpr literals only.",
                 "from __future__ import annotations", "import triton", *self._imports]
        nodes = self._nodes
        if gdc_available():
            lines.append(_GDC_IMPORT)
            trigger = pdl_trigger()
            helpers = _storing_helpers(nodes) if trigger == "late" else frozenset()
            nodes = [_with_grid_dependency_wait(fn, trigger, helpers, self.early.get(fn.name, (0,))[0])
                     for fn in nodes]
        body = ast.Module(body=[*self._globals, *nodes], type_ignores=[])
        return "\n".join(lines) + "\n\n" + ast.unparse(body) + "\n"


def gdc_available() -> bool:
    """Whether this Triton has gdc_wait / gdc_launch_dependents (programmatic dependent launch)."""
    try:
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401
    except ImportError:
        return False
    return True


PDL_TRIGGERS = ("first", "after-wait", "late", "none")
PDL_TRIGGER_DEFAULT = "late"


def pdl_trigger() -> str:
    """Where a kernel lets the next one launch (HWTUNE_PDL_TRIGGER): "late", the default, each
    program's trigger just before its first top-level statement that stores (after its main
    loop, in the templates: the next kernel is placed while this one's last programs write);
    "none" (no early trigger: the next kernel is placed as this one's programs exit, and its
    launch and this one's memory flush overlap); "after-wait" (the next kernel's programs are
    placed while this one runs); "first", before its own wait (placed while this one's
    predecessor may still run). No placement lets the next kernel read or write anything
    earlier: its own wait still comes first and waits for this grid to end. Measured on the H200
    (the built-in decode step, BENCHMARKS.md 10e and 10h): "after-wait" and "first" lost 9% at
    batch 32; "late" against "none", early reads off, on two lent machines: 1.3% faster at
    batch 1 each time (hf-llama patched 1.1%), and at batch 32 from 0.2% faster to 0.9% slower
    (hf-llama patched 0.2% faster); the previous tuned step faster at both. An unknown value
    warns and takes the default."""
    value = os.environ.get("HWTUNE_PDL_TRIGGER", PDL_TRIGGER_DEFAULT).strip() or PDL_TRIGGER_DEFAULT
    if value not in PDL_TRIGGERS:
        import warnings

        warnings.warn(f"HWTUNE_PDL_TRIGGER={value!r} is not one of {', '.join(PDL_TRIGGERS)}: "
                      f"using {PDL_TRIGGER_DEFAULT}", RuntimeWarning, stacklevel=2)
        return PDL_TRIGGER_DEFAULT
    return value


def _with_grid_dependency_wait(fn: ast.FunctionDef, trigger: str = "none",
                               helpers: frozenset = frozenset(), early: int = 0) -> ast.FunctionDef:
    """fn with a trailing `_hwtune_pdl: tl.constexpr = False` parameter and, before anything
    else, `if _hwtune_pdl: _hwtune_gdc_wait()` (with `_hwtune_gdc_launch()` before or after the
    wait, per `trigger`; "late": a `_hwtune_gdc_launch()` before the first statement that stores,
    `helpers` being the file's jit functions that store). The wait is the first thing every
    program does (unconditionally, when the launcher sets the flag), so no load, store or atomic
    of the kernel can run before the previous kernel in the stream is done. With `early` > 0 (the
    statements of fn's early prefix, see early_prefix) the wait is guarded by `_hwtune_pdl ==
    PDL_WAIT` first and repeated after the prefix under `_hwtune_pdl == PDL_EARLY`: only a launch
    with the early flag runs the prefix's loads before it."""
    import copy

    new = copy.deepcopy(fn)
    # The annotation's text, never evaluated (the module has `from __future__ import
    # annotations`): Triton reads "constexpr" in it; Triton 3.6's interpreter only takes the text
    # "tl.constexpr" or "constexpr" (with "triton.language.constexpr" it passed the default
    # False as an int1 tensor and failed every kernel on the CPU).
    constexpr = ast.Attribute(value=ast.Name(id="tl", ctx=ast.Load()), attr="constexpr", ctx=ast.Load())
    new.args.args.append(ast.arg(arg=PDL_PARAM, annotation=constexpr))
    new.args.defaults.append(ast.Constant(False))
    call = lambda name: ast.Expr(ast.Call(func=ast.Name(id=name, ctx=ast.Load()), args=[], keywords=[]))
    body = {"first": [call("_hwtune_gdc_launch"), call("_hwtune_gdc_wait")],
            "after-wait": [call("_hwtune_gdc_wait"), call("_hwtune_gdc_launch")]}.get(
                trigger, [call("_hwtune_gdc_wait")])
    flag = lambda: ast.Name(id=PDL_PARAM, ctx=ast.Load())
    guard = lambda calls, test=None: ast.If(test=test or flag(), body=calls, orelse=[])
    equals = lambda v: ast.Compare(left=flag(), ops=[ast.Eq()], comparators=[ast.Constant(v)])
    prefix, rest = list(new.body[:early]), list(new.body[early:])
    if trigger == "late":
        at = next((i for i, stmt in enumerate(rest) if _stores(stmt, helpers)), len(rest))
        rest.insert(at, guard([call("_hwtune_gdc_launch")]))
    if prefix:
        # PDL_EARLY: the loads of the prefix (only through pointers the launcher vouches nothing
        # right before this kernel writes) go out before the wait; any other flag: after it
        new.body = [guard(body, equals(PDL_WAIT)), *prefix, guard(copy.deepcopy(body), equals(PDL_EARLY)), *rest]
    else:
        new.body = [guard(body), *rest]
    return ast.fix_missing_locations(new)


PDL_WAIT, PDL_EARLY = 1, 2   # the flag's values: wait first (True == 1), wait after the early prefix
# What an early prefix may call: tl functions that compute from their arguments (no memory, no
# side effect), and tl.load.
_EARLY_TL = {"program_id", "num_programs", "arange", "zeros", "full", "cdiv", "multiple_of",
             "max_contiguous", "max_constancy", "maximum", "minimum", "where", "load"}
_EARLY_LOAD_KW = {"mask", "other", "boundary_check", "padding_option", "cache_modifier", "eviction_policy",
                  "volatile"}


def early_prefix(fn: ast.FunctionDef, params, lang_aliases, triton_aliases, constexpr_globals,
                 constexprs=()) -> tuple:
    """(n, reads): fn's first n statements form its early prefix -- simple assignments to names
    of expressions built from parameters, literals, constexpr globals, arithmetic, `[:, None]`
    indexing, `.to(tl.<dtype>)`, the tl functions of _EARLY_TL and `min`/`max`, and `if`s on
    constexpr parameters and literals alone whose branches are such assignments; nothing else
    (no store, atomic, helper call, loop or runtime branch) -- and `reads` is the set of parameters that the
    pointers of its tl.load calls (and their masks and `other`s) derive from: the only memory
    the prefix can touch. Empty `reads`: no load, nothing to gain, no early form. The launcher
    (run_plan.bind) runs the prefix before the grid-dependency wait only where every tensor among
    `reads` is one its caller vouches the kernel before this one does not write."""
    taint = {p: frozenset([p]) for p in params}
    reads: set = set()

    def tl_name(func):
        return _lang_tail(func, lang_aliases, triton_aliases)

    def expr(node, names):  # -> frozenset of parameters it derives from, or None (not allowed)
        if isinstance(node, ast.Constant):
            return frozenset() if isinstance(node.value, (int, float, bool, str, type(None))) else None
        if isinstance(node, ast.Name):
            if node.id in names:
                return names[node.id]
            return frozenset() if node.id in constexpr_globals else None
        if isinstance(node, ast.BinOp):
            return _union(expr(node.left, names), expr(node.right, names))
        if isinstance(node, ast.UnaryOp):
            return expr(node.operand, names)
        if isinstance(node, ast.Compare):
            return _union(expr(node.left, names), *[expr(c, names) for c in node.comparators])
        if isinstance(node, ast.Subscript):
            idx = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
            plain = all((isinstance(i, ast.Constant) and i.value is None)
                        or (isinstance(i, ast.Slice) and i.lower is None and i.upper is None and i.step is None)
                        for i in idx)
            return expr(node.value, names) if plain else None
        if isinstance(node, ast.Attribute):
            # tl.int64 and the like (never a pointer type: nothing in the prefix can make an
            # integer into a pointer)
            return frozenset() if node.attr in TL_DTYPES and tl_name(node) == node.attr else None
        if isinstance(node, ast.Call):
            if any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords):
                return None
            parts = [expr(a, names) for a in node.args] + [expr(k.value, names) for k in node.keywords]
            name = tl_name(node.func)
            if name in _EARLY_TL:
                if name == "load" and not all(k.arg in _EARLY_LOAD_KW for k in node.keywords):
                    return None
                got = _union(*parts)
                if name == "load" and got is not None:
                    loads.update(got)
                return got
            if isinstance(node.func, ast.Name) and node.func.id in ("min", "max") and not node.keywords:
                return _union(*parts)
            if isinstance(node.func, ast.Attribute) and node.func.attr == "to":
                # x.to(tl.float32): a tl dtype, nothing else (no bitcast, no pointer type)
                if len(node.args) != 1 or node.keywords or not (
                        isinstance(node.args[0], ast.Attribute) and node.args[0].attr in TL_DTYPES
                        and tl_name(node.args[0]) == node.args[0].attr):
                    return None
                return expr(node.func.value, names)
            return None
        return None

    def compile_time(node):  # a test Triton decides while compiling: constexpr params, literals
        if isinstance(node, ast.Constant):
            return True
        if isinstance(node, ast.Name):
            return node.id in constexprs and node.id not in assigned
        if isinstance(node, ast.Compare):
            return compile_time(node.left) and all(compile_time(c) for c in node.comparators)
        if isinstance(node, ast.BoolOp):
            return all(compile_time(v) for v in node.values)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            return compile_time(node.operand)
        return False

    def block(stmts) -> dict | None:  # the names a list of assignments binds, or None
        env: dict = {}
        names = collections.ChainMap(env, taint)   # its own bindings first, then the prefix's
        for stmt in stmts:
            if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1
                    and isinstance(stmt.targets[0], ast.Name)) or stmt.targets[0].id in reserved:
                return None
            got = expr(stmt.value, names)
            if got is None:
                return None
            env[stmt.targets[0].id] = got
        return env

    reserved = set(lang_aliases) | set(triton_aliases) | {"min", "max"}   # never rebound in a prefix
    n = 0
    assigned: set = set()   # names bound in the prefix (a constexpr shadowed there is not one)
    loads: set = set()      # the parameters the current statement's loads read through
    for stmt in fn.body:
        loads.clear()
        if isinstance(stmt, ast.If) and compile_time(stmt.test):
            # either branch may be the one compiled: both must be prefix statements; a name
            # either binds carries what both derive from
            then, other = block(stmt.body), block(stmt.orelse)
            if then is None or other is None:
                break
            for name in set(then) | set(other):
                taint[name] = _union(then.get(name, frozenset()), other.get(name, frozenset()),
                                     taint.get(name, frozenset()))
            assigned.update(then, other)
        else:
            env = block([stmt])
            if env is None:
                break
            taint.update(env)
            assigned.update(env)
        reads.update(loads)
        n += 1
    if not reads:
        return 0, frozenset()
    return n, frozenset(reads)


def _too_deep(tree):
    """The first node found deeper than MAX_AST_DEPTH in tree, or None (an explicit stack: no
    recursion, so no depth can crash it)."""
    stack = [(tree, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_AST_DEPTH:
            return node
        stack.extend((child, depth + 1) for child in ast.iter_child_nodes(node))
    return None


def _annotations(node) -> list:
    """The annotations node carries itself (a parameter's, a function's return, an annotated
    assignment's)."""
    if isinstance(node, ast.arg):
        return [node.annotation] if node.annotation is not None else []
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return [node.returns] if node.returns is not None else []
    if isinstance(node, ast.AnnAssign):
        return [node.annotation]
    return []


def _union(*parts):
    if any(p is None for p in parts):
        return None
    return frozenset().union(*parts)


def _storing_helpers(fns) -> frozenset:
    """The jit functions of a file that store, directly or through another one that does."""
    calls: dict = {}   # name -> the names it calls; each body walked once
    found: set = set()
    for fn in fns:
        calls[fn.name] = {node.func.id for node in ast.walk(fn) if isinstance(node, ast.Call)
                          and isinstance(node.func, ast.Name)}
        if any(_stores(stmt, frozenset()) for stmt in fn.body):
            found.add(fn.name)
    while True:
        more = {name for name, called in calls.items() if name not in found and called & found}
        if not more:
            return frozenset(found)
        found |= more


def _stores(stmt, helpers: frozenset) -> bool:
    """Whether stmt may store: a call named like a store or an atomic, or of one of the file's
    jit functions that stores (`helpers`)."""
    for node in ast.walk(stmt):
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Attribute) and f.attr in STORES:
                return True
            if isinstance(f, ast.Name) and (f.id in helpers or f.id in STORES):
                return True
    return False


def _is_literal(node) -> bool:
    try:
        ast.literal_eval(node)
        return True
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False


def _lang_tail(node, lang_aliases, triton_aliases) -> str | None:
    """`name` where node is `<alias of triton.language>.name` (tl.load, triton.language.load),
    else None."""
    dotted = _dotted(node)
    if not dotted:
        return None
    head, _, tail = dotted.rpartition(".")
    if head in lang_aliases or head in {f"{t}.language" for t in triton_aliases}:
        return tail
    return None


def _dotted(node) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def _dunder(name: str) -> bool:
    return name.startswith("__") and name.endswith("__")


@functools.lru_cache(maxsize=None)
def _lang_names() -> tuple[frozenset, dict]:
    """Public triton.language names that are not modules, and those of its allowed submodules;
    none that a module of it imported from elsewhere (tl.math.wraps is functools.wraps, which
    sets attributes named by strings; tl.math.List is typing's)."""
    import inspect

    import triton.language as tl

    def own(mod, n):
        obj = getattr(mod, n)
        return not n.startswith("_") and not inspect.ismodule(obj) and (
            not callable(obj) or str(getattr(obj, "__module__", "")).startswith("triton"))

    top = frozenset(n for n in dir(tl) if own(tl, n))
    subs = {}
    for sub in LANG_SUBMODULES:
        mod = getattr(tl, sub, None)
        if mod is not None:
            subs[sub] = frozenset(n for n in dir(mod) if own(mod, n))
    return top, subs


@functools.lru_cache(maxsize=None)
def _libdevice_names(module: str) -> frozenset:
    import importlib
    import inspect

    try:
        mod = importlib.import_module(module)
    except ImportError:
        return frozenset()
    return frozenset(n for n in dir(mod) if not n.startswith("_") and not inspect.ismodule(getattr(mod, n)))


class _Checker:
    def __init__(self, text: str, filename: str):
        self.text, self.filename = text, filename
        self.problems: list[str] = []
        self.triton_aliases: set[str] = set()
        self.lang_aliases: set[str] = set()
        self.libdevice_aliases: dict[str, str] = {}
        self.jit_decorator_names: set[str] = set()     # `from triton import jit` -> "jit"
        self.imports: list[str] = []

    def bad(self, node, what: str) -> None:
        self.problems.append(f"line {getattr(node, 'lineno', '?')}: {what}")

    # --- top level ------------------------------------------------------------------------
    def run(self) -> KernelSource:
        if len(self.text.encode("utf-8", "replace")) > MAX_SOURCE_BYTES:
            raise SourceError([f"file larger than {MAX_SOURCE_BYTES} bytes"])
        try:
            tree = ast.parse(self.text, filename=self.filename)
        except (SyntaxError, ValueError, MemoryError, RecursionError) as exc:
            raise SourceError([f"line {getattr(exc, 'lineno', '?')}: not valid Python: "
                               f"{getattr(exc, 'msg', exc)}"]) from None
        deep = _too_deep(tree)
        if deep is not None:
            raise SourceError([f"line {getattr(deep, 'lineno', '?')}: nested deeper than "
                               f"{MAX_AST_DEPTH} levels (split the expression)"])
        for sub in ast.walk(tree):
            name = (sub.id if isinstance(sub, ast.Name) else sub.arg if isinstance(sub, ast.arg)
                    else sub.name if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                    else sub.asname or sub.name if isinstance(sub, ast.alias)
                    else sub.attr if isinstance(sub, ast.Attribute)
                    else sub.arg if isinstance(sub, ast.keyword) else None)
            if isinstance(name, str) and name.startswith(RESERVED_PREFIX):
                self.bad(sub, f"name {name} is reserved for the harness (names starting with "
                              f"{RESERVED_PREFIX})")
        jit_defs, host_defs, assigns = [], [], []
        self.declared_global = {n for sub in ast.walk(tree) if isinstance(sub, (ast.Global, ast.Nonlocal))
                                for n in sub.names}
        for i, node in enumerate(tree.body):
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and \
                    isinstance(node.value.value, str) and i == 0:
                continue  # module docstring
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                self.top_import(node)
            elif isinstance(node, ast.FunctionDef):
                (jit_defs if self.is_jit(node) else host_defs).append(node)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                assigns.append(node)
            else:
                self.bad(node, f"{type(node).__name__} at top level (allowed: imports, assignments, "
                               "function definitions)")
        if not jit_defs:
            self.problems.append("no @triton.jit kernel defined")
        if len(jit_defs) > MAX_KERNELS:
            raise SourceError([f"{len(jit_defs)} @triton.jit functions, more than {MAX_KERNELS}"])
        kernel_names = {f.name for f in jit_defs}
        if len(kernel_names) != len(jit_defs):
            self.problems.append("two @triton.jit functions share a name")
        constexpr_globals, glob_nodes, configs, space = self.top_assignments(assigns, kernel_names)
        kernels = {}
        for fn in jit_defs:
            kernels[fn.name] = self.check_jit(fn, kernel_names, constexpr_globals)
        for fn in host_defs:
            if fn.name in kernel_names:
                self.bad(fn, f"host function {fn.name} shadows a kernel")
            self.check_host(fn)
        for node in assigns:
            self.check_host(node)
        has_launch = any(f.name == "launch" for f in host_defs)
        if not has_launch:
            self.problems.append("the file defines no launch() function")
        if self.problems:
            raise SourceError(self.problems)
        nodes = [self.normalised(fn) for fn in jit_defs]
        early = {}
        for fn in nodes:   # at most MAX_AST_DEPTH deep (checked above): no recursion limit to catch
            n, reads = early_prefix(fn, kernels[fn.name].params, self.lang_aliases, self.triton_aliases,
                                    constexpr_globals, kernels[fn.name].constexprs)
            if reads:
                early[fn.name] = (n, reads)
        return KernelSource(self.text, hashlib.sha256(self.text.encode()).hexdigest(), kernels,
                            configs, space, has_launch, nodes, glob_nodes, self.imports, early)

    def top_import(self, node) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                name, bound = alias.name, alias.asname or alias.name.split(".")[0]
                if name in TRITON_MODULES:
                    self.triton_aliases.add(bound)
                    if bound != "triton":
                        self.imports.append(f"import triton as {bound}")
                elif name in LANG_MODULES:
                    if alias.asname:
                        self.lang_aliases.add(alias.asname)
                        self.imports.append(f"import triton.language as {alias.asname}")
                    else:
                        self.triton_aliases.add("triton")
                elif name in LIBDEVICE_MODULES and alias.asname:
                    self.libdevice_aliases[alias.asname] = name
                    self.imports.append(f"import {name} as {alias.asname}")
                elif name in HOST_MODULES:
                    pass  # host code only: the sandbox provides it
                else:
                    self.bad(node, f"import {name} not allowed")
            return
        module = node.module or ""
        if node.level:
            self.bad(node, "relative import not allowed")
            return
        for alias in node.names:
            bound = alias.asname or alias.name
            full = f"{module}.{alias.name}"
            if alias.name == "*":
                self.bad(node, f"from {module} import * not allowed")
            elif module == "triton" and alias.name == "language":
                self.lang_aliases.add(bound)
                self.imports.append(f"import triton.language as {bound}")
            elif module == "triton" and alias.name == "jit":
                self.jit_decorator_names.add(bound)
            elif full in LIBDEVICE_MODULES:
                self.libdevice_aliases[bound] = full
                self.imports.append(f"import {full} as {bound}")
            elif module == "__future__" or (module in HOST_MODULES and module != "torch"):
                if _private(alias.name) or alias.name in HOST_FORBIDDEN_ATTRS or alias.name in _module_attrs():
                    self.bad(node, f"from {module} import {alias.name} not allowed")
            else:
                self.bad(node, f"from {module} import {alias.name} not allowed")

    def is_jit(self, fn: ast.FunctionDef) -> bool:
        for dec in fn.decorator_list:
            node = dec.func if isinstance(dec, ast.Call) else dec
            dotted = _dotted(node)
            if dotted is None:
                continue
            head, _, tail = dotted.rpartition(".")
            if (head in self.triton_aliases and tail == "jit") or dotted in self.jit_decorator_names:
                if len(fn.decorator_list) != 1:
                    self.bad(fn, f"@triton.jit {fn.name} has other decorators too "
                                 "(autotune/heuristics: use CONFIGS)")
                return True
            if tail in ("jit", "autotune", "heuristics"):
                self.bad(fn, f"decorator {dotted} is not triton.jit (import triton, use @triton.jit)")
        return False

    def top_assignments(self, assigns, kernel_names):
        constexpr_globals: set[str] = set()
        glob_nodes = []
        configs = space = None
        # A name bound more than once (or declared global in a function) is host state: the
        # generated module would freeze its first value while the sandbox sees the last.
        counts: dict[str, int] = {}
        for node in assigns:
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                for sub in ast.walk(t):
                    if isinstance(sub, ast.Name):
                        counts[sub.id] = counts.get(sub.id, 0) + 1
        rebound = {n for n, c in counts.items() if c > 1}
        for node in assigns:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            value = node.value
            if isinstance(node, ast.AugAssign):
                continue  # host-side (CONFIGS += ...): the sandbox reports the result
            if len(targets) != 1 or not isinstance(targets[0], ast.Name) or value is None:
                continue  # host-side assignment (sandbox only)
            name = targets[0].id
            if name in kernel_names:
                self.bad(node, f"{name} rebinds a kernel")
                continue
            if name in rebound or name in self.declared_global:
                continue
            literal = self.constexpr_literal(node, name)
            if literal is not None:
                constexpr_globals.add(name)
                glob_nodes.append(literal)
            if name == "CONFIGS" and _is_literal(value):
                configs = ast.literal_eval(value)
            if name == "SPACE" and _is_literal(value):
                space = ast.literal_eval(value)
        return constexpr_globals, glob_nodes, configs, space

    def constexpr_literal(self, node, name: str):
        """`X = <number|str|bool>`, `X = tl.constexpr(<literal>)` or `X: tl.constexpr = <literal>`:
        the assignment to copy into the generated module, else None (a host-side global)."""
        value = node.value
        wrapped = False
        if isinstance(value, ast.Call) and not value.keywords and len(value.args) == 1 \
                and self.is_lang_attr(value.func, "constexpr"):
            value, wrapped = value.args[0], True
        if not isinstance(value, ast.Constant) or isinstance(value.value, bytes) or \
                not isinstance(value.value, (int, float, bool, str)):
            return None
        if isinstance(node, ast.AnnAssign) and "constexpr" in ast.unparse(node.annotation):
            wrapped = True
        new_value = ast.Constant(value.value)
        if wrapped:
            lang = ast.Attribute(value=ast.Name(id="triton", ctx=ast.Load()), attr="language", ctx=ast.Load())
            new_value = ast.Call(func=ast.Attribute(value=lang, attr="constexpr", ctx=ast.Load()),
                                 args=[new_value], keywords=[])
        return ast.fix_missing_locations(ast.Assign(targets=[ast.Name(id=name, ctx=ast.Store())],
                                                    value=new_value, lineno=0))

    def is_lang_attr(self, node, attr: str) -> bool:
        return _lang_tail(node, self.lang_aliases, self.triton_aliases) == attr

    # --- jit bodies -----------------------------------------------------------------------
    def check_jit(self, fn: ast.FunctionDef, kernel_names: set, constexpr_globals: set) -> KernelDef:
        lang_top, lang_subs = _lang_names()
        args = fn.args
        if args.vararg or args.kwarg or args.kwonlyargs or args.posonlyargs:
            self.bad(fn, f"kernel {fn.name}: only plain positional parameters")
        params = [a.arg for a in args.args]
        constexprs, defaults, default_values = [], [], []
        for a in args.args:
            if _dunder(a.arg):
                self.bad(a, f"kernel {fn.name}: dunder parameter {a.arg}")
            if a.annotation is not None:
                if not self.jit_annotation(a.annotation):
                    self.bad(a, f"kernel {fn.name}: annotation of {a.arg} must be tl.constexpr or a "
                                "tl type")
                elif "constexpr" in ast.unparse(a.annotation):
                    constexprs.append(a.arg)
        for a, d in zip(args.args[len(args.args) - len(args.defaults):], args.defaults):
            if not _is_literal(d) or any(isinstance(n, (ast.List, ast.Dict, ast.Set)) for n in ast.walk(d)):
                # a list default is one object for every call: the kernel's .sort() kept state
                # in it from one call to the next, in the trusted process
                self.bad(d, f"kernel {fn.name}: default of {a.arg} must be a literal (a number, string, "
                            "bool, None or a tuple of them)")
            else:
                default_values.append((a.arg, ast.literal_eval(d)))
            defaults.append(a.arg)
        if fn.returns is not None and not self.jit_annotation(fn.returns):
            self.bad(fn, f"kernel {fn.name}: return annotation not allowed")
        dec = fn.decorator_list[0]
        if isinstance(dec, ast.Call):
            if dec.args:
                self.bad(dec, f"kernel {fn.name}: @triton.jit takes keyword arguments only")
            for kw in dec.keywords:
                if kw.arg not in JIT_DECORATOR_KWARGS or not _is_literal(kw.value):
                    self.bad(dec, f"kernel {fn.name}: @triton.jit({kw.arg}=...) not allowed "
                                  f"(allowed, as literals: {', '.join(sorted(JIT_DECORATOR_KWARGS))})")
        local = set(params)
        for sub in ast.walk(fn):
            if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store):
                local.add(sub.id)
        allowed_names = (local | kernel_names | constexpr_globals | JIT_BUILTINS | self.lang_aliases
                         | set(self.libdevice_aliases))
        walker = _JitBody(self, fn.name, allowed_names, local, kernel_names, lang_top, lang_subs)
        for stmt in fn.body:
            walker.stmt(stmt)
        return KernelDef(fn.name, tuple(params), tuple(constexprs), tuple(defaults), tuple(default_values))

    def jit_annotation(self, node) -> bool:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value.replace(" ", "").isidentifier() or \
                all(p.isidentifier() for p in node.value.split("."))
        tail = _lang_tail(node, self.lang_aliases, self.triton_aliases)
        return tail is not None and not _dunder(tail)

    def normalised(self, fn: ast.FunctionDef) -> ast.FunctionDef:
        dec = fn.decorator_list[0]
        keywords = dec.keywords if isinstance(dec, ast.Call) else []
        jit = ast.Attribute(value=ast.Name(id="triton", ctx=ast.Load()), attr="jit", ctx=ast.Load())
        # String statements (a docstring) are dropped: unparsed as a docstring, text with a line
        # "def <name>(...):" became lines of the function's source, and Triton's interpreter
        # compiles a kernel from the last line of its source that starts with "def ".
        body = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant)
                                           and isinstance(s.value.value, str))] or [ast.Pass()]
        new = ast.FunctionDef(name=fn.name, args=fn.args, body=body,
                              decorator_list=[ast.Call(func=jit, args=[], keywords=keywords)
                                              if keywords else jit],
                              returns=fn.returns, type_comment=None, lineno=fn.lineno)
        return ast.fix_missing_locations(new)

    # --- host code (sandbox only) -----------------------------------------------------------
    def check_host(self, node) -> None:
        for sub in ast.walk(node):
            for ann in _annotations(sub):
                for const in ast.walk(ann):
                    if isinstance(const, ast.Constant) and isinstance(const.value, str) and not \
                            all(p.isidentifier() and not _private(p) for p in const.value.split(".")):
                        # typing evaluates a string annotation as code (functools.singledispatch's
                        # register calls get_type_hints), code this check never saw
                        self.bad(const, "a string annotation must be a plain dotted name")
            if isinstance(sub, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
                targets = sub.targets if isinstance(sub, (ast.Assign, ast.Delete)) else [sub.target]
                for t in targets:
                    if any(isinstance(x, ast.Attribute) for x in ast.walk(t)):
                        self.bad(sub, "assignment to an attribute not allowed (no monkeypatching)")
            if isinstance(sub, (ast.Import, ast.ImportFrom)):
                self.bad(sub, "import inside a function not allowed (imports go at top level)")
            elif isinstance(sub, (ast.Global, ast.Nonlocal)):
                pass
            elif isinstance(sub, ast.Name) and (sub.id in HOST_FORBIDDEN_NAMES or _dunder(sub.id)):
                self.bad(sub, f"name {sub.id} not allowed")
            elif isinstance(sub, ast.Attribute) and (sub.attr in HOST_FORBIDDEN_ATTRS or _private(sub.attr)):
                self.bad(sub, f"attribute .{sub.attr} not allowed")
            elif isinstance(sub, ast.Attribute) and sub.attr in _module_attrs():
                self.bad(sub, f"attribute .{sub.attr} not allowed (a module held by a module host code may "
                              "import: import what you need at top level)")
            elif isinstance(sub, ast.ClassDef):
                self.bad(sub, "class definitions not allowed")
            elif isinstance(sub, ast.Match):
                # a class pattern reads the attributes it names as plain strings
                # (`case object(__class__=c)`), out of reach of the checks on names and attributes
                self.bad(sub, "match statements not allowed (use if/elif)")
            elif isinstance(sub, ast.BinOp) and isinstance(sub.op, ast.MatMult):
                self.bad(sub, "the @ operator (torch matmul) outside a kernel")
            elif isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) and sub is not node:
                for dec in getattr(sub, "decorator_list", []):
                    if "jit" in (ast.unparse(dec)):
                        self.bad(sub, "a @triton.jit kernel must be defined at top level")


class _JitBody:
    """Walks one jit function's statements against the allowlist."""

    STMTS = (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Expr, ast.If, ast.For, ast.While,
             ast.Break, ast.Continue, ast.Return, ast.Pass, ast.Assert)

    def __init__(self, checker: _Checker, fname, allowed_names, local, kernel_names, lang_top, lang_subs):
        self.c, self.fname = checker, fname
        self.allowed_names, self.local, self.kernel_names = allowed_names, local, kernel_names
        self.lang_top, self.lang_subs = lang_top, lang_subs

    def bad(self, node, what):
        self.c.bad(node, f"kernel {self.fname}: {what}")

    def stmt(self, node) -> None:
        if not isinstance(node, self.STMTS):
            self.bad(node, f"{type(node).__name__} statement not allowed in a kernel")
            return
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            return  # docstring / comment string
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                self.target(t)
            if isinstance(node, ast.AnnAssign) and not self.c.jit_annotation(node.annotation):
                self.bad(node, "annotation must be a tl type")
            if node.value is not None:
                self.expr(node.value)
            return
        if isinstance(node, ast.For):
            self.target(node.target)
            if node.orelse:
                self.bad(node, "for-else not allowed")
            self.expr(node.iter)
        elif isinstance(node, (ast.If, ast.While)):
            self.expr(node.test)
            if isinstance(node, ast.While) and node.orelse:
                self.bad(node, "while-else not allowed")
        elif isinstance(node, (ast.Expr, ast.Return)):
            if node.value is not None:
                self.expr(node.value)
            return
        elif isinstance(node, ast.Assert):
            self.expr(node.test)
            if node.msg is not None:
                self.expr(node.msg)
            return
        for child in getattr(node, "body", []) + getattr(node, "orelse", []):
            self.stmt(child)

    def target(self, node) -> None:
        if isinstance(node, ast.Name):
            if _dunder(node.id):
                self.bad(node, f"dunder name {node.id}")
        elif isinstance(node, (ast.Tuple, ast.List)):
            for elt in node.elts:
                self.target(elt)
        else:
            self.bad(node, f"assignment to {type(node).__name__} not allowed (only names)")

    def expr(self, node) -> None:
        if isinstance(node, ast.Constant):
            if isinstance(node.value, bytes) or (isinstance(node.value, str) and len(node.value) > 256):
                self.bad(node, "bytes / long string constant")
        elif isinstance(node, ast.Name):
            if _dunder(node.id) or node.id not in self.allowed_names:
                self.bad(node, f"name {node.id!r} not allowed (parameters, locals, the file's kernels, "
                               "constexpr globals, tl and range/min/max/float/int only)")
        elif isinstance(node, ast.Attribute):
            self.attribute(node)
        elif isinstance(node, ast.Call):
            self.call(node)
        elif isinstance(node, (ast.BinOp,)):
            if isinstance(node.op, ast.MatMult):
                self.bad(node, "the @ operator (use tl.dot)")
            self.expr(node.left)
            self.expr(node.right)
        elif isinstance(node, ast.UnaryOp):
            self.expr(node.operand)
        elif isinstance(node, ast.BoolOp):
            for v in node.values:
                self.expr(v)
        elif isinstance(node, ast.Compare):
            self.expr(node.left)
            for v in node.comparators:
                self.expr(v)
        elif isinstance(node, ast.IfExp):
            for v in (node.test, node.body, node.orelse):
                self.expr(v)
        elif isinstance(node, ast.Subscript):
            self.expr(node.value)
            self.expr(node.slice)
        elif isinstance(node, ast.Slice):
            for v in (node.lower, node.upper, node.step):
                if v is not None:
                    self.expr(v)
        elif isinstance(node, (ast.Tuple, ast.List)):
            for v in node.elts:
                if isinstance(v, ast.Starred):
                    self.bad(v, "starred expression")
                else:
                    self.expr(v)
        else:
            self.bad(node, f"{type(node).__name__} not allowed in a kernel")

    def lang_chain(self, node) -> bool | None:
        """True for an allowed tl.X / tl.math.X / libdevice.X chain, False for a forbidden one,
        None when the chain does not start at tl or libdevice."""
        dotted = _dotted(node)
        if dotted is None:
            return None
        parts = dotted.split(".")
        if parts[0] in self.c.libdevice_aliases:
            names = _libdevice_names(self.c.libdevice_aliases[parts[0]])
            return len(parts) == 2 and parts[1] in names
        if parts[0] in self.c.lang_aliases:
            rest = parts[1:]
        elif parts[0] in self.c.triton_aliases and len(parts) > 1 and parts[1] == "language":
            rest = parts[2:]
        else:
            return None
        if len(rest) == 1:
            return rest[0] in self.lang_top and rest[0] not in LANG_DENIED
        if len(rest) == 2 and rest[0] in self.lang_subs:
            return rest[1] in self.lang_subs[rest[0]]
        return False

    def attribute(self, node: ast.Attribute) -> None:
        if _dunder(node.attr):
            self.bad(node, f"dunder attribute .{node.attr}")
            return
        chain = self.lang_chain(node)
        if chain is True:
            return
        if chain is False:
            self.bad(node, f"{_dotted(node)} is not an allowed triton.language name")
            return
        if node.attr not in VALUE_ATTRS:
            self.bad(node, f"attribute .{node.attr} not allowed in a kernel")
        self.expr(node.value)

    def call(self, node: ast.Call) -> None:
        func = node.func
        if isinstance(func, ast.Name):
            if func.id in self.local or func.id not in (self.kernel_names | JIT_BUILTINS):
                self.bad(node, f"call of {func.id!r} not allowed (tl functions, the file's kernels, "
                               "range/min/max/float/int)")
        elif isinstance(func, ast.Attribute):
            self.attribute(func)
        else:
            self.bad(node, "call of an expression")
        for a in node.args:
            if isinstance(a, ast.Starred):
                self.bad(a, "starred argument")
            else:
                self.expr(a)
        for kw in node.keywords:
            if kw.arg is None:
                self.bad(node, "**kwargs argument")
            else:
                self.expr(kw.value)


# --- the trusted module ---------------------------------------------------------------------
_RESTRICTED_BUILTINS = {name: __builtins__[name] if isinstance(__builtins__, dict) else getattr(__builtins__, name)
                        for name in ("range", "min", "max", "len", "abs", "int", "float", "bool",
                                     "tuple", "list", "ValueError", "TypeError", "AssertionError",
                                     "RuntimeError", "NotImplementedError", "Exception")}


def private_dir(prefix: str = "hwtune-kernels-") -> Path:
    """A fresh directory only this user can enter (mode 0700 whatever the umask), removed when
    this process exits. Inside $HWTUNE_WORK_DIR where the parent gave one (the runner does, and
    removes it even when this process is killed), else in the temporary directory."""
    parent = os.environ.get("HWTUNE_WORK_DIR")
    if not (parent and os.path.isdir(parent)):
        parent = None
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    os.chmod(path, stat.S_IRWXU)
    atexit.register(shutil.rmtree, path, True)
    return path


def load_kernels(source: KernelSource, directory: Path) -> dict:
    """Write the generated module into `directory` (owned by this process) and execute it with
    restricted builtins; returns {kernel name: JITFunction (or InterpretedFunction)}."""
    directory = Path(directory)
    name = f"hwtune_kernels_{source.sha256[:16]}"
    path = directory / f"{name}.py"
    text = source.module_text()
    if not path.exists() or path.read_text() != text:
        fd, tmp = tempfile.mkstemp(dir=directory, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    module = sys.modules.get(name)
    if module is None or getattr(module, "_hwtune_sha", None) != source.sha256:
        spec = importlib.util.spec_from_loader(name, loader=None, origin=str(path))
        module = importlib.util.module_from_spec(spec)
        module.__file__ = str(path)
        module.__dict__["__builtins__"] = dict(_RESTRICTED_BUILTINS, __import__=_import_triton_only)
        code = compile(text, str(path), "exec", dont_inherit=True)
        sys.modules[name] = module  # triton resolves a kernel's module while compiling
        exec(code, module.__dict__)
        module.__dict__["__builtins__"] = dict(_RESTRICTED_BUILTINS)
        module._hwtune_sha = source.sha256
    kernels = {k: getattr(module, k) for k in source.kernels}
    for name, (_n, reads) in source.early.items():
        # what run_plan.bind checks before it lets the kernel's prefix run before its wait
        setattr(kernels[name], EARLY_READS_ATTR, frozenset(reads))
    return kernels


def _import_triton_only(name, globals=None, locals=None, fromlist=(), level=0):
    if level or not (name == "__future__" or name == "triton" or name.startswith("triton.language")):
        raise ImportError(f"generated kernel module may import triton only, not {name!r}")
    return __import__(name, globals, locals, fromlist, level)


__all__ = ["KernelSource", "KernelDef", "SourceError", "gdc_available", "load_kernels", "private_dir", "read_source",
           "PDL_PARAM", "PDL_WAIT", "PDL_EARLY", "EARLY_READS_ATTR", "early_prefix"]
