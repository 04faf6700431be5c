"""Device ceilings, measured once and cached, and where a kernel run sits under them.

Ceilings are measured, not taken from a datasheet: copy bandwidth from a large
device-to-device copy (read + write counted), bf16 matmul rate from a large random matmul.
% of ceiling is then honest for this host (on our H200, copy reaches ~4.3 TB/s of the
4.8 TB/s datasheet figure).
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

# Below this much ideal work a kernel is dominated by launch and sync, not by the roofline.
OVERHEAD_WORK_MS = 0.005
OVERHEAD_FACTOR = 2.0

GPU_COPY_BYTES = 2 * 1024**3      # 2 GiB: far beyond L2, so HBM is what is measured
GPU_MATMUL_N = 8192
CPU_COPY_BYTES = 64 * 1024**2
CPU_MATMUL_N = 512


def _best_ms(fn, device: str, repeats: int) -> float:
    import torch

    fn()  # warm-up (cuBLAS heuristics, allocator)
    best = math.inf
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            best = min(best, (time.perf_counter() - t0) * 1e3)
    return best


def measure(device: str = "cuda") -> dict:
    """Measure copy GB/s and matmul TFLOP/s on this device (bf16 on GPU; fp32 on CPU)."""
    import torch

    gpu = device == "cuda"
    nbytes = GPU_COPY_BYTES if gpu else CPU_COPY_BYTES
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).uniform_()
    dst = torch.empty_like(src)
    copy_ms = _best_ms(lambda: dst.copy_(src), device, 20 if gpu else 5)
    del src, dst
    n = GPU_MATMUL_N if gpu else CPU_MATMUL_N
    dtype = torch.bfloat16 if gpu else torch.float32   # CPU bf16 matmul is not a fair ceiling
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, dtype=dtype, device=device, generator=gen)
    b = torch.randn(n, n, dtype=dtype, device=device, generator=gen)
    mm_ms = _best_ms(lambda: a @ b, device, 20 if gpu else 3)
    return {
        "device": device,
        "copy_gb_s": 2 * nbytes / (copy_ms * 1e-3) / 1e9,
        "matmul_tflops": 2 * n**3 / (mm_ms * 1e-3) / 1e12,
        "matmul_dtype": str(dtype).replace("torch.", ""),
        "method": f"copy {nbytes >> 20} MiB (read+write), matmul {n}^3; best of repeats",
        "measured_at": time.time(),
    }


def load_or_measure(cache_path, device: str = "cuda", fingerprint_id: str | None = None) -> dict:
    """Cached ceilings for this fingerprint; measured and written (atomically) when absent."""
    cache_path = Path(cache_path)
    if cache_path.exists():
        cached = json.loads(cache_path.read_text())
        if cached.get("fingerprint") == fingerprint_id:
            return cached
    ceilings = measure(device)
    ceilings["fingerprint"] = fingerprint_id
    cache_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(ceilings, indent=2, sort_keys=True))
    tmp.replace(cache_path)
    return ceilings


def classify(flops: float, bytes: float, time_ms: float, ceilings: dict) -> tuple[str, float]:
    """("memory" | "compute" | "overhead", % of the binding ceiling reached) for one timing."""
    if not time_ms or not math.isfinite(time_ms) or time_ms <= 0:
        return "unknown", 0.0
    memory_ms = bytes / (ceilings["copy_gb_s"] * 1e9) * 1e3
    compute_ms = flops / (ceilings["matmul_tflops"] * 1e12) * 1e3
    roof_ms = max(memory_ms, compute_ms)
    pct = 100.0 * roof_ms / time_ms
    if roof_ms < OVERHEAD_WORK_MS and time_ms > OVERHEAD_FACTOR * roof_ms:
        return "overhead", pct
    return ("memory" if memory_ms >= compute_ms else "compute"), pct
