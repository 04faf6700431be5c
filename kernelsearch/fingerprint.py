"""What a timing is valid for: GPU model, SM count, driver, CUDA, triton and torch versions.

A dispatch table or a ledger row measured under one fingerprint says nothing about another
(a driver or triton upgrade changes generated code and timings). Imports torch and triton
only; the driver version is read from /proc so that no NVML binding is needed here.
"""
from __future__ import annotations

import hashlib
import json
import platform
from pathlib import Path

DRIVER_VERSION_FILE = Path("/proc/driver/nvidia/version")


def _driver_version() -> str:
    try:
        text = DRIVER_VERSION_FILE.read_text()
    except OSError:
        return "unknown"
    # "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 ..."
    for word in text.split():
        parts = word.split(".")
        if len(parts) >= 2 and all(p.isdigit() for p in parts):
            return word
    return "unknown"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def collect(device: str = "cuda", index: int = 0) -> dict:
    """The fingerprint as a JSON-ready dict. `device="cpu"` gives the interpreter's fingerprint."""
    import torch
    import triton

    fp = {"triton": triton.__version__, "torch": torch.__version__.split("+")[0]}
    if device == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(index)
        fp.update(device="cuda", gpu=props.name, sm_count=props.multi_processor_count,
                  capability=f"{props.major}.{props.minor}", cuda=torch.version.cuda or "unknown",
                  driver=_driver_version())
    else:
        # One CPU fingerprint whatever TRITON_INTERPRET says in this process: on a CPU a Triton
        # kernel only ever runs under the interpreter (search sets it, bench's tuned variant
        # needs it), so a table a search wrote is the table bench looks up. (The key stays, and
        # true, so ids recorded by `search --device cpu` keep their value.)
        fp.update(device="cpu", cpu=_cpu_model(), interpreter=True)
    return fp


def fingerprint_id(fp: dict) -> str:
    """Short stable id: the model in words plus a hash of everything, e.g. `nvidia-h200-3f9a1c2b`."""
    digest = hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:8]
    name = fp.get("gpu") if fp.get("device") == "cuda" else "cpu"
    slug = "".join(c if c.isalnum() else "-" for c in str(name).lower()).strip("-")
    while "--" in slug:
        slug = slug.replace("--", "-")
    return f"{slug[:40]}-{digest}"
