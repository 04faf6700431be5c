"""A user's own workload as the benchmark: run it, read its metric from stdout.

The command is split with shlex and run without a shell. The metric is the last stdout line
that is either a JSON object with a "metric" key, or matches the regex (first group).
"""
from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import time

DEFAULT_METRIC_REGEX = r"tokens/s[:=]\s*([0-9.]+)"


def parse_metric(text: str, regex: str = DEFAULT_METRIC_REGEX) -> tuple[float | None, str | None]:
    """-> (metric, the line it came from); the last matching line wins."""
    pattern = re.compile(regex)
    found = (None, None)
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("{"):
            try:
                obj = json.loads(stripped)
            except ValueError:
                obj = None
            if isinstance(obj, dict) and isinstance(obj.get("metric"), (int, float)) \
                    and not isinstance(obj.get("metric"), bool):
                found = (float(obj["metric"]), stripped)
                continue
        m = pattern.search(line)
        if m:
            try:
                found = (float(m.group(1) if m.groups() else m.group(0)), stripped)
            except ValueError:
                pass
    return found


def run_workload(command: str, regex: str = DEFAULT_METRIC_REGEX, timeout_s: float | None = None,
                 energy_reader=None) -> dict:
    argv = shlex.split(command)
    if not argv:
        raise ValueError("--command is empty")
    e0 = energy_reader.energy_mj() if energy_reader is not None and energy_reader.available else None
    t0 = time.monotonic()
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
        rc, out, err = proc.returncode, proc.stdout, proc.stderr
    except FileNotFoundError as exc:
        return {"command": command, "argv": argv, "status": f"error: {exc}", "metric": None}
    except subprocess.TimeoutExpired as exc:
        rc, out, err = None, exc.stdout or "", exc.stderr or ""
        out = out.decode(errors="replace") if isinstance(out, bytes) else out
        err = err.decode(errors="replace") if isinstance(err, bytes) else err
    wall = time.monotonic() - t0
    if err:
        sys.stderr.write(err[-4000:])
    metric, line = parse_metric(out, regex)
    result = {"command": command, "argv": argv, "returncode": rc, "wall_s": wall,
              "metric_regex": regex, "metric": metric, "metric_line": line,
              "stdout_tail": out[-2000:]}
    if rc is None:
        result["status"] = f"error: timed out after {timeout_s}s"
    elif rc != 0:
        result["status"] = f"error: exit code {rc}"
    elif metric is None:
        result["status"] = "error: no line matched the metric regex or had a JSON 'metric'"
    else:
        result["status"] = "ok"
    if e0 is not None:
        e1 = energy_reader.energy_mj()
        if e1 is not None and e1 > e0:
            result["energy_j"] = (e1 - e0) / 1000.0
            result["avg_power_w"] = result["energy_j"] / wall if wall > 0 else None
    return result
