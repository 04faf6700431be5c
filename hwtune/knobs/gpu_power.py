"""GPU power limit, inside the constraints NVML reports.

Profile values: a number of watts, "max" (the upper constraint), "default" (the board's
default limit) or "NN%" (a percentage of the default limit).
"""
from __future__ import annotations

from hwtune.knobs import BadValue, Knob, gpu_index, gpu_targets, is_gpu_target, is_number


def resolve_power_limit_w(value, lo: float, hi: float, default: float, target: str) -> float:
    key = "gpu.power_limit_w"
    if value == "max":
        w = hi
    elif value == "default":
        w = default
    elif isinstance(value, str) and value.endswith("%"):
        w = round(default * float(value[:-1]) / 100.0)
    else:
        w = float(value)
    if not lo <= w <= hi:
        raise BadValue(key, f"{target} power_limit_w={value}: {w:g} W outside {lo:g}..{hi:g} (NVML constraints)")
    return int(w) if float(w).is_integer() else w


class GpuPowerKnob(Knob):
    family = "gpu_power"
    section = "gpu"
    fields = ("power_limit_w",)

    def targets(self, host, section):
        return gpu_targets(host, section)

    def read(self, host, target):
        return {"power_limit_w": host.gpus.get_power_limit_w(gpu_index(target))}

    def desired(self, host, target, section):
        if section.power_limit_w is None:
            return {}
        i = gpu_index(target)
        constraints = host.gpus.get_power_limit_constraints_w(i)
        default = host.gpus.get_power_limit_default_w(i)
        if constraints is None or default is None:
            from hwtune.errors import KnobUnavailable
            raise KnobUnavailable(target, "power_limit_w", "NotSupported (no power limit constraints)")
        lo, hi = constraints
        return {"power_limit_w": resolve_power_limit_w(section.power_limit_w, lo, hi, default, target)}

    def write(self, host, target, field, value):
        host.gpus.set_power_limit_w(gpu_index(target), value)

    def known_target(self, host, target):
        return is_gpu_target(host, target)

    def original_problem(self, host, target, field, original):
        if not is_number(original):
            return f"original {original!r:.60} is not a number of watts"
        constraints = host.gpus.get_power_limit_constraints_w(gpu_index(target))
        if constraints is not None and not constraints[0] <= original <= constraints[1]:
            return f"original {original:g} W outside {constraints[0]:g}..{constraints[1]:g} W"
        return None

    def same(self, host, target, field, current, wanted):
        # NVML works in mW; anything within half a watt is the same setting.
        return current is not None and wanted is not None and abs(float(current) - float(wanted)) < 0.5
