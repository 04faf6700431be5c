"""Tensors between the child and the parent: raw bytes in a file + a JSON header. No pickle.

The files live in a private temporary directory (on /dev/shm when it exists, so large outputs
are a memory copy rather than disk I/O).
"""
from __future__ import annotations

import hashlib
import os
import tempfile

import numpy as np
import torch

_INT_BY_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_CHUNK = 1 << 24


def private_dir() -> str:
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    return tempfile.mkdtemp(prefix="hwtune-harness-", dir=base)


def dtype_str(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def write_tensor(t: torch.Tensor, path: str) -> dict:
    host = t.detach().contiguous().cpu()
    host.view(-1).view(torch.uint8).numpy().tofile(path)
    return {"path": path, "dtype": dtype_str(t.dtype), "shape": list(t.shape)}


def read_tensor(header: dict, device="cpu") -> torch.Tensor:
    raw = np.fromfile(header["path"], dtype=np.uint8)
    dtype = getattr(torch, header["dtype"])
    t = torch.from_numpy(raw).view(dtype).reshape(header["shape"])
    return t.to(device) if str(device) != "cpu" else t


def digest(t: torch.Tensor) -> str:
    """Bitwise fingerprint of a tensor's contents, computed where the tensor lives.

    CPU: blake2b of the bytes. CUDA: two position-weighted integer sums over the bit patterns,
    chunked (copying gigabytes to the host per check would dominate the run).
    """
    flat = t.detach().contiguous().view(-1)
    if flat.device.type == "cpu":
        return hashlib.blake2b(flat.view(torch.uint8).numpy().tobytes(), digest_size=16).hexdigest()
    bits = flat.view(_INT_BY_SIZE[flat.element_size()])
    s1 = torch.zeros((), dtype=torch.int64, device=flat.device)
    s2 = torch.zeros((), dtype=torch.int64, device=flat.device)
    for start in range(0, bits.numel(), _CHUNK):
        chunk = bits[start:start + _CHUNK].to(torch.int64)
        idx = torch.arange(start, start + chunk.numel(), device=flat.device, dtype=torch.int64)
        s1 += chunk.sum()
        s2 += (chunk * ((idx * 2654435761) % 4294967291 + 1)).sum()
    return f"{int(s1)}:{int(s2)}:{bits.numel()}"
