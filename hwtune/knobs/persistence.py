"""GPU persistence mode (keeps the driver loaded, so settings survive an idle GPU)."""
from __future__ import annotations

from hwtune.knobs import Knob, gpu_index, gpu_targets, is_gpu_target


class PersistenceKnob(Knob):
    family = "persistence"
    section = "gpu"
    fields = ("persistence_mode",)

    def targets(self, host, section):
        return gpu_targets(host, section)

    def read(self, host, target):
        return {"persistence_mode": host.gpus.get_persistence_mode(gpu_index(target))}

    def desired(self, host, target, section):
        if section.persistence_mode is None:
            return {}
        return {"persistence_mode": bool(section.persistence_mode)}

    def write(self, host, target, field, value):
        host.gpus.set_persistence_mode(gpu_index(target), bool(value))

    def known_target(self, host, target):
        return is_gpu_target(host, target)

    def original_problem(self, host, target, field, original):
        return None if isinstance(original, bool) else f"original {original!r:.60} is not true or false"
