"""A compile worker of the trusted executor (CUDA): Triton's warm-up of launches from checked
source, filling the executor's private Triton cache so that its own first launch only loads
the binary. Trusted code; it compiles kernels and runs none of them."""
from __future__ import annotations

import os

_worker_kernels: dict = {}


def init(cache_dir: str) -> None:
    os.environ["TRITON_CACHE_DIR"] = cache_dir
    import torch  # noqa: F401
    import triton  # noqa: F401


def ready() -> bool:
    """A no-op job: the pool's workers start (import torch and triton, open CUDA) before the
    first real batch arrives."""
    import torch

    torch.cuda.current_device()
    return True


def compile_one(source_text: str, job: dict) -> bool:
    """In a compile worker: Triton's warm-up of one launch fills the shared (private) cache, so
    the executor's own first launch only loads the binary."""
    import torch

    from kernelsearch.harness import source as source_mod
    from kernelsearch.harness.run_plan import TORCH_DTYPES, pdl_kwargs

    src = source_mod.KernelSource.parse(source_text)
    if src.sha256 not in _worker_kernels:
        _worker_kernels[src.sha256] = source_mod.load_kernels(src, source_mod.private_dir("hwtune-compile-"))
    fn = _worker_kernels[src.sha256][job["kernel"]]
    kdef = src.kernels[job["kernel"]]
    defaults = dict(kdef.default_values)
    positional = []
    import triton.language as tl

    for p in kdef.params:
        if p not in job["args"]:
            positional.append(defaults[p])
            continue
        kind, *rest = job["args"][p]
        if kind == "ref":
            positional.append(TORCH_DTYPES[rest[0]])   # warmup wraps dtypes in aligned mock tensors
        elif kind == "none":
            positional.append(None)
        elif kind == "tl_dtype":
            positional.append(getattr(tl, rest[0]))
        else:
            positional.append(rest[0])
    device = torch.device("cuda", torch.cuda.current_device())
    fn.warmup(*positional, grid=tuple(job["grid"]), **job["options"], **pdl_kwargs(fn, device))
    return True
