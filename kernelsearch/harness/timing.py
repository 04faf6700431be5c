"""Honest timing. DO NOT CHANGE casually: this is the fixed metric of the inner loop.

CUDA: warm-up (compilation, autotune caches and handles stay out of the numbers), then one
CUDA graph holding `launches_per_replay` back-to-back calls, each on its own buffers
(amortises launch gaps for microsecond kernels), timed by CUDA events around each replay.
Between replays, outside the timed region: every call's inputs are refilled with a fresh draw
and its outputs poisoned (`refresh`), L2 is flushed by zeroing a buffer of twice the device's
L2 size, and after the replay every call's outputs are checked (`check`). Median of >= 20
replays, per call.

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

CUDA_REPS = 20
CUDA_WARMUP = 3
CPU_REPS = 3
TARGET_REPLAY_MS = 0.5   # launches per replay chosen so one replay lasts about this long
MAX_LAUNCHES_PER_REPLAY = 10


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
    """Keep the candidate only if faster than the incumbent by more than the noise band. An
    incumbent with no time (inf: its timing failed, or NULL from the ledger) is never shown
    slower, so nothing is kept against it."""
    if not (math.isfinite(candidate_ms) and math.isfinite(incumbent_ms)):
        return False
    band = noise_band if (noise_band is not None and math.isfinite(noise_band)) else 0.0
    return candidate_ms * (1.0 + band) < incumbent_ms


def default_reps(device: str) -> int:
    return CUDA_REPS if str(device).startswith("cuda") else CPU_REPS


def eager_ms(fn) -> float:
    """One warm eager call, timed with CUDA events (sets how many calls a replay holds)."""
    fn()
    _synchronize()
    start, end = _Event(enable_timing=True), _Event(enable_timing=True)
    _record(start)
    fn()
    _record(end)
    _synchronize()
    return max(_elapsed(start, end), 1e-3)


def calls_per_replay(eager_call_ms: float, max_calls: int) -> int:
    """So that one replay lasts about TARGET_REPLAY_MS: amortises launch gaps of microsecond
    kernels, bounded by MAX_LAUNCHES_PER_REPLAY and by the memory the calls' buffers take."""
    return max(1, min(MAX_LAUNCHES_PER_REPLAY, int(max_calls), int(TARGET_REPLAY_MS / eager_call_ms)))


def time_cpu(fn, reps: int = CPU_REPS, refresh=None, check=None, calls: int = 1) -> Timing:
    fn()  # warm-up: the interpreter rewrites the kernel on first use
    times = []
    for i in range(reps):
        if refresh:
            refresh(i)
        t0 = _perf_counter()
        fn()
        times.append((_perf_counter() - t0) * 1e3 / calls)
        if check:
            check(i)
    return Timing(times, "cpu_interpreter (not a speed)", calls)


_flush_buffers: dict = {}


def l2_flush_buffer(device) -> torch.Tensor:
    dev = torch.device(device)
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    if index not in _flush_buffers:
        l2 = getattr(torch.cuda.get_device_properties(index), "L2_cache_size", 0) or (64 << 20)
        _flush_buffers[index] = torch.empty(2 * l2, dtype=torch.uint8, device=f"cuda:{index}")
    return _flush_buffers[index]


def time_cuda(fn, device="cuda", reps: int = CUDA_REPS, refresh=None, check=None, calls: int = 1) -> Timing:
    """Graph-replay timing of `fn` (which makes `calls` calls, each on its own buffers); raises
    CaptureError when fn cannot live in a CUDA graph. Before each replay, outside the timed
    region: `refresh(i)` (fresh inputs, poison) and an L2 flush; after it, `check(i)`."""
    flush = l2_flush_buffer(device)
    for _ in range(CUDA_WARMUP):
        fn()
    _synchronize()
    graph = _CUDAGraph()
    try:
        with _graph(graph):
            fn()
        graph.replay()
        _synchronize()
    except Exception as exc:
        raise CaptureError(f"{type(exc).__name__}: {exc}".strip()[:500]) from exc
    times = []
    start, end = _Event(enable_timing=True), _Event(enable_timing=True)
    for i in range(reps):
        if refresh:
            refresh(i)
        flush.zero_()
        _record(start)
        graph.replay()
        _record(end)
        _synchronize()
        times.append(_elapsed(start, end) / calls)
        if check:
            check(i)
    del graph
    return Timing(times, "cuda_graph_replay", calls)


def time_calls(fn, device: str, reps: int | None = None, refresh=None, check=None, calls: int = 1) -> Timing:
    """`refresh(i)` runs before rep i and `check(i)` after it, both outside the timed region."""
    if str(device).startswith("cuda"):
        return time_cuda(fn, device, reps or CUDA_REPS, refresh, check, calls)
    return time_cpu(fn, reps or CPU_REPS, refresh, check, calls)
