"""CPU frequency governor and C-state exit-latency limit (one target, "cpu": all CPUs).

`governor` reads as one name when every CPU agrees, else as {cpuN: name}; its journaled
original is always the per-CPU map, so restore is exact.
`max_cstate_latency_us` = L means: every idle state with exit latency > L is disabled and
every other state enabled. It reads as the largest latency among enabled states; its
journaled original is the per-state disable map {"cpuN/stateK": bool}.
"""
from __future__ import annotations

import re

from hwtune.errors import KnobUnavailable
from hwtune.knobs import BadValue, Knob

CPU_NAME = re.compile(r"cpu(0|[1-9][0-9]{0,4})")
STATE_KEY = re.compile(r"cpu(0|[1-9][0-9]{0,4})/state(0|[1-9][0-9]{0,2})")
GOVERNOR_NAME = re.compile(r"[A-Za-z0-9_-]{1,32}")


def _key(state: dict) -> str:
    return f"{state['cpu']}/{state['state']}"


def _split(original, present: set, name: re.Pattern):
    """A per-CPU original whose CPUs are partly gone (offline since the apply): (the part this
    host has now, the rest); None when nothing or everything of it is here, or when a key is
    not a CPU (state) name at all: a tampered entry is held whole, never half written."""
    if not isinstance(original, dict) or not all(isinstance(k, str) and name.fullmatch(k) for k in original):
        return None
    here = {k: v for k, v in original.items() if k in present}
    if not here or len(here) == len(original):
        return None
    return here, {k: v for k, v in original.items() if k not in present}


class CpuGovernorKnob(Knob):
    family = "cpu_governor"
    section = "cpu"
    fields = ("governor",)

    def targets(self, host, section):
        return ["cpu"]

    def read(self, host, target):
        govs = host.cpu.governors()
        values = set(govs.values())
        return {"governor": None if not govs else (values.pop() if len(values) == 1 else dict(govs))}

    def desired(self, host, target, section):
        if section.governor is None:
            return {}
        offered = host.cpu.available_governors()
        if offered is None:
            raise KnobUnavailable("cpu", "governor",
                                  "NotSupported (no cpufreq under /sys/devices/system/cpu/cpu*/cpufreq)")
        if section.governor not in offered:
            raise BadValue("cpu.governor",
                           f"cpu governor={section.governor}: not offered by this CPU (offered: {', '.join(offered)})")
        return {"governor": section.governor}

    def original(self, host, target, field):
        return host.cpu.governors()

    def write(self, host, target, field, value):
        host.cpu.set_governors({cpu: value for cpu in host.cpu.governors()})

    def restore(self, host, target, field, original):
        if isinstance(original, str):
            original = {cpu: original for cpu in host.cpu.governors()}
        host.cpu.set_governors(original)

    def same(self, host, target, field, current, wanted):
        if isinstance(wanted, dict):  # a journaled original: compare the CPUs it names
            govs = host.cpu.governors()
            return all(govs.get(cpu) == gov for cpu, gov in wanted.items())
        return current == wanted

    def split_original(self, host, target, field, original):
        return _split(original, set(host.cpu.governors()), CPU_NAME)

    def show(self, host, target, field, value):
        if isinstance(value, dict) and len(set(value.values())) == 1:
            return next(iter(value.values()))
        return value

    def known_target(self, host, target):
        return target == "cpu"

    def original_problem(self, host, target, field, original):
        offered = host.cpu.available_governors()
        names = original.values() if isinstance(original, dict) else [original]
        if isinstance(original, dict):
            cpus = host.cpu.governors()
            for cpu in original:
                if not isinstance(cpu, str) or not CPU_NAME.fullmatch(cpu) or cpu not in cpus:
                    return f"original names {str(cpu)[:60]!r}, not a CPU of this host"
        for gov in names:
            if not isinstance(gov, str) or not GOVERNOR_NAME.fullmatch(gov):
                return f"original governor {gov!r:.60} is not a governor name"
            if offered is not None and gov not in offered:
                return f"original governor {gov!r:.60} is not offered by this CPU"
        return None


class CpuIdleKnob(Knob):
    family = "cpu_idle"
    section = "cpu"
    fields = ("max_cstate_latency_us",)

    def targets(self, host, section):
        return ["cpu"]

    def read(self, host, target):
        states = host.cpu.cstates()
        enabled = [s["latency_us"] for s in states if not s["disabled"]]
        return {"max_cstate_latency_us": None if not states else (max(enabled) if enabled else -1)}

    def desired(self, host, target, section):
        if section.max_cstate_latency_us is None:
            return {}
        if not host.cpu.cstates():
            raise KnobUnavailable("cpu", "max_cstate_latency_us",
                                  "NotSupported (no cpuidle states under /sys/devices/system/cpu/cpu*/cpuidle)")
        return {"max_cstate_latency_us": int(section.max_cstate_latency_us)}

    def original(self, host, target, field):
        return {_key(s): s["disabled"] for s in host.cpu.cstates()}

    def write(self, host, target, field, value):
        limit = int(value)
        flips = {_key(s): s["latency_us"] > limit for s in host.cpu.cstates()
                 if s["disabled"] != (s["latency_us"] > limit)}
        if flips:
            host.cpu.set_cstates_disabled(flips)

    def restore(self, host, target, field, original):
        if isinstance(original, dict):
            host.cpu.set_cstates_disabled(original)
        else:
            self.write(host, target, field, original)

    def same(self, host, target, field, current, wanted):
        if isinstance(wanted, dict):  # a journaled original: compare the flags of the states it names
            now = self.original(host, target, field)
            return all(key in now and now[key] == disabled for key, disabled in wanted.items())
        if wanted is None:
            return current is None
        return all(s["disabled"] == (s["latency_us"] > int(wanted)) for s in host.cpu.cstates())

    def show(self, host, target, field, value):
        """A journaled per-state map reads as the limit it amounts to (as `read` reports it)
        and how many states it disables, e.g. "133 (0 of 16 idle states disabled)"."""
        if not isinstance(value, dict):
            return value
        latency = {_key(s): s["latency_us"] for s in host.cpu.cstates()}
        enabled = [latency[k] for k, disabled in value.items() if not disabled and k in latency]
        limit = max(enabled) if enabled else -1
        return f"{limit} ({sum(map(bool, value.values()))} of {len(value)} idle states disabled)"

    def split_original(self, host, target, field, original):
        return _split(original, {_key(s) for s in host.cpu.cstates()}, STATE_KEY)

    def known_target(self, host, target):
        return target == "cpu"

    def original_problem(self, host, target, field, original):
        if isinstance(original, dict):
            states = {_key(s) for s in host.cpu.cstates()}
            for key, disabled in original.items():
                if not isinstance(key, str) or not STATE_KEY.fullmatch(key) or key not in states:
                    return f"original names {str(key)[:60]!r}, not an idle state of this host"
                if not isinstance(disabled, bool):
                    return f"original {key}: {disabled!r:.60} is not true or false"
            return None
        if isinstance(original, bool) or not isinstance(original, int) or original < -1:
            return f"original {original!r:.60} is not a latency in microseconds"
        return None
