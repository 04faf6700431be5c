"""Guard 7 (static half): what a candidate's source may contain.

A candidate is a Triton kernel plus a thin Python `launch`. Outside `@triton.jit` bodies it may
allocate and reshape tensors and launch kernels; it may not compute with torch, reach the host
(ctypes, subprocess, os), read or patch the harness, or touch global switches. The dynamic half
(sandbox.OpRecorder, the launch counter) catches what slips through by indirection.
"""
from __future__ import annotations

import ast

ALLOWED_IMPORTS = ("torch", "triton", "triton.language", "math", "functools", "itertools",
                   "typing", "dataclasses", "__future__", "operator", "enum")
FORBIDDEN_NAMES = {"open", "exec", "eval", "compile", "__import__", "getattr", "setattr",
                   "delattr", "globals", "vars", "locals", "breakpoint", "input", "memoryview",
                   "__builtins__", "__loader__", "__spec__"}
# Attribute names forbidden outside @triton.jit bodies: torch compute, host escapes, switches.
FORBIDDEN_ATTRS = {
    "matmul", "mm", "bmm", "addmm", "addmv", "mv", "baddbmm", "einsum", "tensordot", "dot",
    "softmax", "log_softmax", "scaled_dot_product_attention", "rms_norm", "layer_norm",
    "linear", "functional", "nn", "ops", "_C", "library",
    "numpy", "tolist", "item", "untyped_storage", "storage", "_storage", "cpu",
    "compile", "manual_seed", "seed", "set_rng_state", "environ", "backends",
    "set_default_dtype", "set_float32_matmul_precision", "use_deterministic_algorithms",
    "set_flush_denormal", "set_num_threads", "system", "popen", "modules",
    # the host and the harness through module attributes (torch.sys, torch.os, typing.sys, ...)
    "sys", "os", "_os", "_sys", "posix", "builtins", "threading", "_thread", "subprocess",
    "ctypes", "importlib", "inspect", "signal",
    # frames: the caller's (the harness's) locals and module globals
    "_getframe", "f_globals", "f_locals", "f_back", "f_builtins", "gi_frame", "cr_frame",
    "ag_frame", "tb_frame", "tb_next",
    # attribute access by string (bypasses every name above) and strings evaluated as code
    "attrgetter", "methodcaller", "get_type_hints", "ForwardRef", "_evaluate",
}


def _is_jit(fn: ast.FunctionDef) -> bool:
    for dec in fn.decorator_list:
        node = dec.func if isinstance(dec, ast.Call) else dec
        name = node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")
        if name == "jit":
            return True
    return False


def _import_allowed(module: str) -> bool:
    if module in ALLOWED_IMPORTS:
        return True
    return module.startswith("triton.language.")


def check_source(text: str, filename: str = "<candidate>") -> list[str]:
    """Problems found (empty list = passes). Each names the line."""
    try:
        tree = ast.parse(text, filename=filename)
    except SyntaxError as exc:
        return [f"line {exc.lineno}: syntax error: {exc.msg}"]
    problems: list[str] = []
    jit_nodes: set[int] = set()
    n_jit = 0
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _is_jit(node):
            n_jit += 1
            for sub in ast.walk(node):
                jit_nodes.add(id(sub))
    if n_jit == 0:
        problems.append("no @triton.jit kernel defined")
    for node in ast.walk(tree):
        line = getattr(node, "lineno", "?")
        if isinstance(node, ast.Import):
            for alias in node.names:
                if not _import_allowed(alias.name):
                    problems.append(f"line {line}: import {alias.name} not allowed")
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level or not _import_allowed(module):
                problems.append(f"line {line}: from {'.' * node.level}{module} import not allowed")
            else:
                for alias in node.names:
                    if alias.name in FORBIDDEN_ATTRS or alias.name in FORBIDDEN_NAMES:
                        problems.append(f"line {line}: from {module} import {alias.name} not allowed")
        elif isinstance(node, ast.Name) and node.id in FORBIDDEN_NAMES:
            problems.append(f"line {line}: use of {node.id}() not allowed")
        elif isinstance(node, ast.Name) and node.id.startswith("__") and node.id.endswith("__"):
            # __name__ / __file__ tell the harness's load from the dispatch table's: a candidate
            # could be honest only where it is checked.
            problems.append(f"line {line}: dunder name {node.id} not allowed")
        elif isinstance(node, ast.Attribute):
            if node.attr.startswith("__") and node.attr.endswith("__"):
                problems.append(f"line {line}: dunder attribute .{node.attr} not allowed")
            elif node.attr in FORBIDDEN_ATTRS and id(node) not in jit_nodes:
                problems.append(f"line {line}: .{node.attr} not allowed outside a @triton.jit kernel")
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.MatMult) and id(node) not in jit_nodes:
            problems.append(f"line {line}: the @ operator (torch matmul) not allowed outside a kernel")
        elif isinstance(node, ast.Global):
            pass  # module-level state is allowed; patching others' is caught by the names above
    return problems
