"""Built-in Triton templates: one candidate file per kernel, with its parameter space.

Each template follows the candidate-file contract in docs/ARCHITECTURE.md: at least one
``@triton.jit`` kernel, ``launch(<contract args>, **params)`` and ``CONFIGS`` (the product of
``SPACE`` filtered for validity). This package imports nothing heavy: ``TRITON_INTERPRET`` must
be set before triton is imported, so the registry holds module paths, not modules.
"""
from __future__ import annotations

import importlib
from pathlib import Path

# kernel name -> module: every kernels/<name>.py is the built-in template of spec <name> (a new
# kernel's template file is all it takes; no list to edit).
TEMPLATES = {p.stem: f"kernelsearch.kernels.{p.stem}"
             for p in sorted(Path(__file__).resolve().parent.glob("*.py")) if not p.stem.startswith("_")}


def template_path(kernel: str) -> Path:
    """The candidate file of the built-in template for ``kernel``."""
    if kernel not in TEMPLATES:
        raise KeyError(f"no built-in template for kernel {kernel!r}; known: {sorted(TEMPLATES)}")
    return Path(__file__).resolve().parent / (TEMPLATES[kernel].rsplit(".", 1)[1] + ".py")


def load_template(kernel: str):
    """Import the template module (imports triton: set TRITON_INTERPRET first on a CPU)."""
    if kernel not in TEMPLATES:
        raise KeyError(f"no built-in template for kernel {kernel!r}; known: {sorted(TEMPLATES)}")
    return importlib.import_module(TEMPLATES[kernel])
