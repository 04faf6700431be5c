import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("HWTUNE_SHARED", ROOT.parent / "shared"))


def triton_version() -> tuple[int, int]:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return tuple(int(p) for p in version("triton").split(".")[:2])
    except (PackageNotFoundError, ValueError):
        return (0, 0)


# Read from sm_90 PTX on 2026-12-04: triton 3.9 gives the pipelined weight copies (cp.async,
# 16 bytes) an L2 evict_first cache policy; triton 3.6 (the H200's) pipelines the same loop
# into 16-byte cp.async as well but drops the policy. Older versions: the policy is not required.
CP_ASYNC_KEEPS_L2_POLICY = triton_version() >= (3, 9)


def run_hwtune(*args, env=None, check=False, timeout=120, **kw) -> subprocess.CompletedProcess:
    """Run the real CLI in a child process (python -m daemon.cli), from the repo root."""
    full_env = dict(os.environ)
    full_env.pop("HWTUNE_READ_ONLY", None)
    full_env["PYTHONPATH"] = str(ROOT) + os.pathsep + full_env.get("PYTHONPATH", "")
    if env:
        full_env.update(env)
    proc = subprocess.run([sys.executable, "-m", "daemon.cli", *map(str, args)], cwd=ROOT,
                          env=full_env, capture_output=True, text=True, timeout=timeout, **kw)
    if check and proc.returncode != 0:
        raise AssertionError(f"hwtune {' '.join(map(str, args))} -> {proc.returncode}\n"
                             f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    return proc


@pytest.fixture
def hwtune_cli():
    return run_hwtune


def _has_cuda() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
