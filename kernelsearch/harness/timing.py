"""Honest timing. DO NOT CHANGE casually: this is the fixed metric of the inner loop.

CUDA: warm-up (compilation, autotune caches and handles stay out of the numbers), then one
CUDA graph holding `launches_per_replay` back-to-back calls (amortises launch gaps for
microsecond kernels), timed by CUDA events around each replay. Between replays, outside the
timed region: the inputs are refilled with a fresh draw (`refresh`: a kernel that replays a
result saved while it was warmed up or captured, or cached by input, is wrong on them), the
outputs are poisoned (NaN; guard 8 checks the last replay's outputs) and L2 is flushed by zeroing
a buffer of twice the device's L2 size. Median of >= 20 replays, per call.

CPU: the Triton interpreter; perf_counter around each call. Those numbers only keep the path
exercised (labelled "cpu_interpreter (not a speed)").

References to the clocks are taken at import, before any candidate is imported.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

_perf_counter = time.perf_counter
_Event = torch.cuda.Event
_elapsed = torch.cuda.Event.elapsed_time
_record = torch.cuda.Event.record
_synchronize = torch.cuda.synchronize
_CUDAGraph = torch.cuda.CUDAGraph
_graph = torch.cuda.graph

CUDA_REPS = 25
CUDA_WARMUP = 3
CPU_REPS = 3
TARGET_REPLAY_MS = 1.0   # launches per replay chosen so one replay lasts about this long
MAX_LAUNCHES_PER_REPLAY = 20


class CaptureError(RuntimeError):
    """The callable could not be captured into / replayed from a CUDA graph."""


@dataclass
class Timing:
    times_ms: list[float] = field(default_factory=list)  # per call, one entry per rep
    method: str = ""
    launches_per_replay: int = 1

    @property
    def median_ms(self) -> float:
        return percentile(self.times_ms, 50)

    @property
    def p20_ms(self) -> float:
        return percentile(self.times_ms, 20)

    @property
    def p80_ms(self) -> float:
        return percentile(self.times_ms, 80)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return math.inf
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def noise_band(first_ms: float, second_ms: float) -> float:
    """Relative spread of two independent timings of the same kernel."""
    if not (math.isfinite(first_ms) and math.isfinite(second_ms)) or min(first_ms, second_ms) <= 0:
        return math.inf
    return abs(first_ms - second_ms) / min(first_ms, second_ms)


def keep(candidate_ms: float, incumbent_ms: float, noise_band: float) -> bool:
    """Keep the candidate only if faster than the incumbent by more than the noise band."""
    if not math.isfinite(candidate_ms):
        return False
    if not math.isfinite(incumbent_ms):
        return True
    band = noise_band if (noise_band is not None and math.isfinite(noise_band)) else 0.0
    return candidate_ms * (1.0 + band) < incumbent_ms


def default_reps(device: str) -> int:
    return CUDA_REPS if str(device).startswith("cuda") else CPU_REPS


def time_cpu(fn, poison=None, reps: int = CPU_REPS, refresh=None) -> Timing:
    fn()  # warm-up: the interpreter rewrites the kernel on first use
    times = []
    for i in range(reps):
        if refresh:
            refresh(i)
        if poison:
            poison()
        t0 = _perf_counter()
        fn()
        times.append((_perf_counter() - t0) * 1e3)
    return Timing(times, "cpu_interpreter (not a speed)", 1)


_flush_buffers: dict = {}


def l2_flush_buffer(device) -> torch.Tensor:
    dev = torch.device(device)
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    if index not in _flush_buffers:
        l2 = getattr(torch.cuda.get_device_properties(index), "L2_cache_size", 0) or (64 << 20)
        _flush_buffers[index] = torch.empty(2 * l2, dtype=torch.uint8, device=f"cuda:{index}")
    return _flush_buffers[index]


def time_cuda(fn, device="cuda", poison=None, reps: int = CUDA_REPS, refresh=None) -> Timing:
    """Graph-replay timing; raises CaptureError when fn cannot live in a CUDA graph."""
    flush = l2_flush_buffer(device)
    for _ in range(CUDA_WARMUP):
        fn()
    _synchronize()
    start, end = _Event(enable_timing=True), _Event(enable_timing=True)
    _record(start)
    fn()
    _record(end)
    _synchronize()
    eager_ms = max(_elapsed(start, end), 1e-3)
    n = max(1, min(MAX_LAUNCHES_PER_REPLAY, int(TARGET_REPLAY_MS / eager_ms)))

    graph = _CUDAGraph()
    try:
        with _graph(graph):
            for _ in range(n):
                fn()
        graph.replay()
        _synchronize()
    except Exception as exc:
        raise CaptureError(f"{type(exc).__name__}: {exc}".strip()[:500]) from exc

    starts = [_Event(enable_timing=True) for _ in range(reps)]
    ends = [_Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        if refresh:
            refresh(i)
        if poison:
            poison()
        flush.zero_()
        _record(starts[i])
        graph.replay()
        _record(ends[i])
    _synchronize()
    times = [_elapsed(s, e) / n for s, e in zip(starts, ends)]
    del graph
    return Timing(times, "cuda_graph_replay", n)


def time_calls(fn, device: str, poison=None, reps: int | None = None, refresh=None) -> Timing:
    """`refresh(i)`, when given, runs before rep i outside the timed region (new input values)."""
    if str(device).startswith("cuda"):
        return time_cuda(fn, device, poison, reps or CUDA_REPS, refresh)
    return time_cpu(fn, poison, reps or CPU_REPS, refresh)
