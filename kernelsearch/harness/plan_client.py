"""Trusted side of the sandbox: ask jail.py for launch plans, get data back.

    reply = request_plans(source_text, spec, cases, params_list, device_info)
    reply["plans"][case][params] -> raw plan dict (validate with kernelsearch.harness.plan)

The jail runs as `python3 -I -S -B jail.py` (isolated mode, no site-packages: the sandbox gets
no torch, no triton, no project code but the planner) in its own session, with a hard wall
clock limit; a jail that overruns is killed with its process group.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

JAIL = Path(__file__).resolve().parent / "jail.py"
DEFAULT_USER = "nobody"
SANDBOX_TIMEOUT_S = 60.0
MAX_REPLY_BYTES = 80 << 20


def sandbox_user() -> str | None:
    """The unprivileged user the sandbox drops to when hwtune runs as root (HWTUNE_SANDBOX_USER,
    default nobody); None when not root (no drop is possible)."""
    if os.geteuid() != 0:
        return None
    return os.environ.get("HWTUNE_SANDBOX_USER") or DEFAULT_USER


def device_info(device: str) -> dict:
    """What the host code may know of the device (device properties, no data)."""
    if not str(device).startswith("cuda"):
        return {"type": "cpu", "index": None, "sm_count": 4, "capability": [0, 0]}
    import torch

    dev = torch.device(device)
    index = dev.index if dev.index is not None else 0
    p = torch.cuda.get_device_properties(index)
    return {"type": "cuda", "index": 0, "name": p.name, "sm_count": p.multi_processor_count,
            "l2_bytes": getattr(p, "L2_cache_size", 0), "total_memory": p.total_memory,
            "capability": [p.major, p.minor],
            "smem_optin": getattr(p, "shared_memory_per_block_optin", 0)}


def request_plans(source_text: str, spec, cases: list[tuple[dict, str]], params_list: list[dict] | None,
                  device: dict, *, all_configs: bool = False, user: str | None = "default",
                  timeout_s: float = SANDBOX_TIMEOUT_S) -> dict:
    """One sandbox run: the candidate's CONFIGS/SPACE and a plan per (case, params): for
    `params_list`, plus every CONFIGS entry when `all_configs` (plus CONFIGS[0] when the list is
    empty). `cases` are (shape dims, dtype name). Never raises for the candidate's doing."""
    if user == "default":
        user = sandbox_user()
    request = {"source": source_text, "kernel": spec.name, "device": device,
               "cases": [{"args": spec.signature(shape, dtype)} for shape, dtype in cases],
               "params": params_list, "all_configs": all_configs, "user": user, "timeout_s": timeout_s}
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
    try:
        proc = subprocess.Popen([sys.executable, "-I", "-S", "-B", str(JAIL)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd="/",
                                start_new_session=True)
    except OSError as exc:
        return {"ok": False, "guard": "harness", "reason": f"cannot start the sandbox: {exc}"}
    try:
        out, err = proc.communicate(json.dumps(request).encode(), timeout=timeout_s + 30)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.communicate()
        return {"ok": False, "guard": "timeout", "reason": f"sandbox did not answer within {timeout_s + 30:g} s"}
    if len(out) > MAX_REPLY_BYTES:
        return {"ok": False, "guard": "plan", "reason": "sandbox reply too large"}
    try:
        reply = json.loads(out.decode("utf-8"))
        if not isinstance(reply, dict):
            raise ValueError
    except (UnicodeDecodeError, ValueError):
        tail = " ".join(err.decode(errors="replace").split())[-400:]
        return {"ok": False, "guard": "harness",
                "reason": f"sandbox jail failed (exit {proc.returncode}): {tail}"}
    return reply
