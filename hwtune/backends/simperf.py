"""Performance and power model of the simulated H200, calibrated from measured figures.

Everything this module returns is *simulated*: `hwtune tune` on a host without a GPU scores
hardware points with it, and labels the results so. It never touches a device.

Calibration (../shared/calibration/h200-2026-12-02.json, stock settings: 700 W, no lock):
    deep idle                  78 W at 345 MHz
    idle after work           145 W at 1980 MHz (clocks stay up, nothing runs)
    bf16 GEMM 8192^3          633.8 TFLOP/s, 691 W, SM ~1457 MHz, reason 0x4 (SW power cap)
    copy 2 GiB                4.247 TB/s, 632 W, 1980 MHz, no throttle
    decode GEMV 8192x28672    4.213 TB/s, 630 W, 1980 MHz, no throttle
The issue quotes "bf16 ~ 700 TFLOP/s at 1980 MHz"; the measurement is what the model honours:
a GEMM that reaches 633.8 TFLOP/s at 1457 MHz scales to ~861 TFLOP/s at 1980 MHz, which the
700 W limit never lets it reach (that is why the measured run is power-capped).

Equations (x = f / f_max, f the SM clock, m = memory clock / 3201 MHz):

    voltage      v(x) = v0                                  for x <= x_knee
                 v(x) = v0 + (1 - v0) (x - x_knee) / (1 - x_knee)   above the knee
    switching    s(x) = x v(x)^2            (dynamic power ~ f V^2; s(1) = 1; above the knee
                                             it grows like x^2.4 near f_max)
    compute rate R_c(x) = peak_flops_per_mhz * f * eta_c
    memory rate  R_m(x) = hbm_bytes_per_s * m * eta_m * (1 + k) x / (x + k)
                 (k small: the SMs issuing loads barely limit bandwidth until clocks are low)
    time         t = max(F / R_c, B / R_m)                     (roofline, per unit of work)
    utilisation  u_c = (F / R_c) / t,   u_m = (B / R_m) / t
    power        P(x) = P_idle + (P_clock + A_sm u_c + A_ld u_m) s(x) + A_mem u_m m

Achieved clock: the highest clock allowed (the locked maximum, else f_max) if P fits under the
power limit; otherwise the clock falls until P(x) = limit (bisection; the real GPU dithers
between bins and reports a mean, so the clock is continuous here), never below f_min. When the
cap holds the clock down, the clock event reason is 0x4 (SW power cap); when a lock holds it
below f_max, 0x2 (the applications-clocks/locked-clocks bit).

Fitted constants and what pins them:
    P_idle = 78, P_clock = 67              deep idle; 145 W idle at 1980 MHz
    A_ld + A_mem = 483                     copy 628 W, decode 634 W at 1980 MHz (measured 632, 630)
    A_mem = 280                            split chosen so that decode at ~1300 MHz draws
                                           ~75% of stock: HBM power does not follow SM clocks
    A_sm = 1165                            GEMM at 700 W settles at ~1457 MHz
    v0 = 0.65, x_knee = 0.5                flat voltage below ~990 MHz
    eta_c(gemm) = 0.87 of 989.4 TFLOP/s    633.8 TFLOP/s at 1457 MHz
    hbm 4.8 TB/s; eta_m copy 0.885,        4.247 and 4.213 TB/s at 1980 MHz
        decode 0.878
    k = 0.04                               memory-bound work loses ~2% at ~1300 MHz
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

# NVML clock event reason bits (nvml.h).
REASON_LOCKED_CLOCKS = 0x2
REASON_SW_POWER_CAP = 0x4

SIMULATED_LABEL = "simulated (hwtune.backends.simperf H200 model)"


@dataclass(frozen=True)
class H200Model:
    sm_clock_min_mhz: float = 345
    sm_clock_max_mhz: float = 1980
    memory_clock_max_mhz: float = 3201
    peak_tflops_bf16: float = 989.4          # dense bf16 at f_max (tensor cores, spec sheet)
    hbm_tbps: float = 4.8                    # spec-sheet HBM3e bandwidth
    idle_w: float = 78.0
    clock_w: float = 67.0
    sm_w: float = 1165.0
    load_w: float = 203.0
    memory_w: float = 280.0
    v0: float = 0.65
    knee: float = 0.5
    k_mem: float = 0.04

    def switching(self, x: float) -> float:
        v = self.v0 if x <= self.knee else self.v0 + (1 - self.v0) * (x - self.knee) / (1 - self.knee)
        return x * v * v  # s(1) = 1 because v(1) = 1


@dataclass(frozen=True)
class Workload:
    """One unit of work: `flops` and DRAM `bytes`, how close it gets to the ceilings, and how
    many tokens (or other items) one unit yields."""

    name: str
    flops: float
    bytes: float
    compute_efficiency: float = 0.87
    memory_efficiency: float = 0.88
    tokens: float = 1.0
    description: str = ""


def _llama8b_decode(batch: int = 1, layers: int = 8, context: int = 2048) -> Workload:
    # Llama-3-8B dimensions: hidden 4096, 32 q heads / 8 kv heads of 128, MLP 14336, bf16.
    hidden, kv_dim, mlp = 4096, 1024, 14336
    params_per_layer = hidden * (hidden + 2 * kv_dim + hidden) + 3 * hidden * mlp
    weight_bytes = 2 * params_per_layer * layers
    kv_bytes = 2 * 2 * layers * kv_dim * context * batch
    flops = 2 * params_per_layer * layers * batch + 4 * layers * hidden * context * batch
    return Workload("decode", flops=flops, bytes=weight_bytes + kv_bytes, memory_efficiency=0.878,
                    tokens=batch, description=f"Llama-3-8B-dims decode step, {layers} layers, batch {batch}, "
                                              f"context {context}, bf16 (GEMV-bound)")


WORKLOADS: dict[str, Workload] = {
    "decode": _llama8b_decode(),
    "gemm": Workload("gemm", flops=2 * 8192 ** 3, bytes=3 * 8192 ** 2 * 2, compute_efficiency=0.87,
                     tokens=1, description="bf16 GEMM 8192x8192x8192"),
    "copy": Workload("copy", flops=0, bytes=2 * 2 * 2 ** 30, memory_efficiency=0.885, tokens=1,
                     description="device-to-device copy of 2 GiB (read + write bytes)"),
}


def workload(name_or_workload: str | Workload) -> Workload:
    if isinstance(name_or_workload, Workload):
        return name_or_workload
    try:
        return WORKLOADS[name_or_workload]
    except KeyError:
        raise ValueError(f"unknown workload {name_or_workload!r} (known: {', '.join(WORKLOADS)})") from None


@dataclass(frozen=True)
class Settings:
    """What the GPU is set to: power limit, locked SM clock range (None = not locked) and
    memory clock (None = default)."""

    power_limit_w: float = 700
    sm_clock_mhz: tuple[float, float] | None = None
    memory_clock_mhz: float | None = None


@dataclass(frozen=True)
class Result:
    workload: str
    sm_clock_mhz: float
    memory_clock_mhz: float
    power_w: float
    time_s: float                 # per unit of work
    tflops: float
    tbps: float
    tokens_per_s: float
    tokens_per_j: float
    energy_j: float               # per unit of work
    clock_event_reasons: int
    throttle: str                 # "sw_power_cap" | "locked_clocks" | "none"
    simulated: str = field(default=SIMULATED_LABEL)

    def to_json(self) -> dict:
        return asdict(self)


def _operating_point(model: H200Model, w: Workload, f_mhz: float, mem_scale: float):
    x = f_mhz / model.sm_clock_max_mhz
    rate_c = model.peak_tflops_bf16 * 1e12 * x * w.compute_efficiency
    rate_m = model.hbm_tbps * 1e12 * mem_scale * w.memory_efficiency * (1 + model.k_mem) * x / (x + model.k_mem)
    t_c = w.flops / rate_c if w.flops else 0.0
    t_m = w.bytes / rate_m if w.bytes else 0.0
    t = max(t_c, t_m, 1e-12)
    u_c, u_m = t_c / t, t_m / t
    power = (model.idle_w + (model.clock_w + model.sm_w * u_c + model.load_w * u_m) * model.switching(x)
             + model.memory_w * u_m * mem_scale)
    return t, power


def run(work: str | Workload, settings: Settings = Settings(), model: H200Model = H200Model()) -> Result:
    """Steady state of `work` running back to back under `settings`."""
    w = workload(work)
    mem_mhz = settings.memory_clock_mhz or model.memory_clock_max_mhz
    mem_scale = min(1.0, mem_mhz / model.memory_clock_max_mhz)
    f_hi = model.sm_clock_max_mhz
    reasons = 0
    if settings.sm_clock_mhz is not None:
        f_hi = max(model.sm_clock_min_mhz, min(f_hi, float(settings.sm_clock_mhz[1])))
    f = f_hi
    t, p = _operating_point(model, w, f, mem_scale)
    if p > settings.power_limit_w:
        # The power cap wins over a locked minimum, as on the real GPU.
        lo, hi = model.sm_clock_min_mhz, f_hi
        for _ in range(60):
            mid = (lo + hi) / 2
            if _operating_point(model, w, mid, mem_scale)[1] > settings.power_limit_w:
                hi = mid
            else:
                lo = mid
        f = lo
        t, p = _operating_point(model, w, f, mem_scale)
        reasons |= REASON_SW_POWER_CAP
    elif f_hi < model.sm_clock_max_mhz:
        reasons |= REASON_LOCKED_CLOCKS
    throttle = ("sw_power_cap" if reasons & REASON_SW_POWER_CAP
                else "locked_clocks" if reasons & REASON_LOCKED_CLOCKS else "none")
    energy = p * t
    return Result(workload=w.name, sm_clock_mhz=round(f, 1), memory_clock_mhz=mem_mhz, power_w=round(p, 2),
                  time_s=t, tflops=w.flops / t / 1e12, tbps=w.bytes / t / 1e12,
                  tokens_per_s=w.tokens / t, tokens_per_j=w.tokens / energy, energy_j=energy,
                  clock_event_reasons=reasons, throttle=throttle)


def idle_power_w(sm_clock_mhz: float, model: H200Model = H200Model()) -> float:
    """Power of a GPU doing nothing at this clock (78 W deep idle, 145 W at 1980 MHz)."""
    x = sm_clock_mhz / model.sm_clock_max_mhz
    if sm_clock_mhz <= model.sm_clock_min_mhz:
        return model.idle_w
    return model.idle_w + model.clock_w * model.switching(x)


def is_finite(result: Result) -> bool:
    return math.isfinite(result.tokens_per_s) and math.isfinite(result.power_w)
