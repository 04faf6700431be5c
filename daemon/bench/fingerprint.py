"""The environment a benchmark ran in, so that two results can be compared honestly.

Roots are injectable (`proc_root`, `sys_root`) so tests read a fixture tree; every part is
read on its own and a failing part is recorded, never fatal.
"""
from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
from pathlib import Path

# DMI strings that name a hypervisor or a cloud VM (lower-cased substrings).
VM_DMI_MARKERS = {
    "firecracker": "firecracker",
    "kvm": "kvm",
    "qemu": "qemu",
    "amazon ec2": "amazon-ec2",
    "vmware": "vmware",
    "virtualbox": "virtualbox",
    "microsoft corporation": "hyperv-or-azure",
    "google compute engine": "gce",
    "xen": "xen",
    "bochs": "bochs",
    "openstack": "openstack",
    "cloud hypervisor": "cloud-hypervisor",
}
DMI_FIELDS = ("sys_vendor", "product_name", "bios_vendor", "board_vendor", "chassis_vendor")


def _read(path: Path) -> str | None:
    try:
        return path.read_text(errors="replace").strip()
    except OSError:
        return None


def detect_virtualization(proc_root="/", sys_root="/", detect_virt_cmd: str | None = "auto") -> dict:
    """-> {virtualized, hypervisor_flag, dmi, dmi_hint, systemd_detect_virt, evidence}.

    `detect_virt_cmd`: "auto" runs systemd-detect-virt only when reading the real root;
    None skips it; a path runs that program (tests).
    """
    proc_root, sys_root = Path(proc_root), Path(sys_root)
    evidence = []
    cpuinfo = _read(proc_root / "proc" / "cpuinfo") or ""
    flag = None
    for line in cpuinfo.splitlines():
        if line.lower().startswith("flags"):
            flag = "hypervisor" in line.split(":", 1)[-1].split()
            break
    if flag:
        evidence.append("cpu flag 'hypervisor'")

    dmi = {f: _read(sys_root / "sys" / "class" / "dmi" / "id" / f) for f in DMI_FIELDS}
    hint = None
    for value in dmi.values():
        low = (value or "").lower()
        for marker, name in VM_DMI_MARKERS.items():
            if marker in low:
                hint = hint or name
    if hint:
        evidence.append(f"DMI names {hint}")

    sdv = None
    cmd = detect_virt_cmd
    if cmd == "auto":
        cmd = shutil.which("systemd-detect-virt") if str(proc_root) == "/" else None
    if cmd:
        try:
            p = subprocess.run([cmd], capture_output=True, text=True, timeout=10)
            sdv = p.stdout.strip() or "none"
        except (OSError, subprocess.SubprocessError) as exc:
            sdv = f"error: {type(exc).__name__}"
    if sdv and sdv not in ("none",) and not sdv.startswith("error"):
        evidence.append(f"systemd-detect-virt says {sdv}")

    sdv_answered = bool(sdv) and not sdv.startswith("error")
    virtualized = bool(flag) or hint is not None or (sdv_answered and sdv != "none")
    if not virtualized and flag is None and not any(dmi.values()) and not sdv_answered:
        # Nothing was read (no cpu flags line, no DMI, no systemd-detect-virt): unknown, not
        # a claim of bare metal.
        virtualized = None
        evidence.append("nothing readable: unknown")
    return {"virtualized": virtualized, "hypervisor_flag": flag, "dmi": dmi, "dmi_hint": hint,
            "systemd_detect_virt": sdv, "evidence": evidence}


def git_commit(repo_root: Path) -> str | None:
    try:
        p = subprocess.run(["git", "-C", str(repo_root), "rev-parse", "HEAD"],
                           capture_output=True, text=True, timeout=10)
        if p.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", str(repo_root), "status", "--porcelain",
                                "--untracked-files=no"], capture_output=True, text=True, timeout=10)
        return p.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def software() -> dict:
    out = {"python": platform.python_version(), "kernel": platform.release(),
           "machine": platform.machine()}
    try:
        import torch
        out["torch"] = torch.__version__
        out["cuda_runtime"] = torch.version.cuda
        out["cuda_available"] = torch.cuda.is_available()
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            out["gpu_name_torch"] = p.name
            out["sm_count"] = p.multi_processor_count
            out["compute_capability"] = f"{p.major}.{p.minor}"
            out["gpu_memory_gib"] = round(p.total_memory / 2**30, 1)
    except Exception as exc:
        out["torch_error"] = f"{type(exc).__name__}: {exc}"
    try:
        import triton
        out["triton"] = triton.__version__
    except Exception:
        out["triton"] = None
    try:
        import psutil
        out["cpu_count"] = psutil.cpu_count()
    except Exception:
        out["cpu_count"] = os.cpu_count()
    return out


def hardware_status(ctx) -> dict | None:
    """hwtune's own read-only status (knobs, PCIe, CPU) when that library is there."""
    if ctx is None:
        return None
    try:
        from hwtune import engine
        from hwtune.host import open_host
        host = open_host(sim_path=ctx.sim_path, sysfs_root=ctx.sysfs_root, read_only=True, bios=None)
        return engine.status(host, ctx.state_dir)
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}


def locked_clocks(ctx) -> object:
    """NVML has no getter for locked clocks: hwtune's own record, if it wrote one."""
    if ctx is None:
        return None
    from hwtune import statefile

    try:  # a trusted state file only: never a link to something else
        data = statefile.read_json(Path(ctx.state_dir) / "locks.json", "clock record")
    except Exception as exc:
        return f"unreadable: {type(exc).__name__}"
    return "unknown" if data is None else data


def table_fingerprint(path) -> dict:
    if path is None:
        return {"path": None, "sha256": None}
    p = Path(path)
    if not p.exists():
        return {"path": str(p), "sha256": None, "exists": False}
    return {"path": str(p), "sha256": hashlib.sha256(p.read_bytes()).hexdigest(), "exists": True}


def collect(ctx=None, gpu_facts: dict | None = None, table_path=None, repo_root: Path | None = None,
            proc_root="/", sys_root="/") -> dict:
    repo_root = repo_root or Path(__file__).resolve().parents[2]
    return {
        "host": platform.node(),
        "virtualization": detect_virtualization(proc_root, sys_root),
        "gpu": gpu_facts,
        "software": software(),
        "locked_clocks": locked_clocks(ctx),
        "hardware_status": hardware_status(ctx),
        "kernel_table": table_fingerprint(table_path),
        "hwtune_commit": git_commit(repo_root),
    }
