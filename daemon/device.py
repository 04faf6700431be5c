"""Which device a kernel command runs on: one rule for search, check-kernel, share and bench.

`auto` (every default) is the GPU when torch sees one, else the CPU, where Triton kernels run
under the interpreter. Asking for a GPU the host does not have is an environment error, exit
2, said before anything runs (not a rejected candidate, not a traceback from deep inside).
"""
from __future__ import annotations

from hwtune.errors import UsageError

DEVICE_HELP = "auto (default): cuda when torch sees a GPU, else cpu (the Triton interpreter)"


def resolve_device(name: str, flag: str = "--device") -> str:
    """auto | cpu | cuda | cuda:N -> cpu | cuda | cuda:N, checked against this host."""
    if name not in ("auto", "cpu", "cuda") and not (name.startswith("cuda:") and name[5:].isdigit()):
        raise UsageError(f"{flag} {name}: expected auto, cpu, cuda or cuda:N")
    if name == "cpu":
        return "cpu"
    try:
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        count = 0
    if name == "auto":
        return "cuda" if count else "cpu"
    if count == 0:
        raise UsageError(f"{flag} {name}: torch sees no CUDA GPU on this host "
                         f"(use {flag} cpu for the Triton interpreter)")
    index = int(name[5:]) if ":" in name else 0
    if index >= count:
        raise UsageError(f"{flag} {name}: this host has {count} CUDA GPU(s) (cuda:0..cuda:{count - 1})")
    return name
