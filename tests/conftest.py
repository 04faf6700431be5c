import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("HWTUNE_SHARED", ROOT.parent / "shared"))


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
