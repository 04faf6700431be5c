"""Runtime dispatch: the tuned kernel where the search found a winner, stock everywhere else.

Importable at inference time without the search machinery: it imports torch, json,
importlib, the kernel contracts (kernelsearch.specs: stock fallback and output allocation,
torch only), kernelsearch.fingerprint, and triton only through a tuned module when one is used.

Table (JSON, one per device fingerprint: STATE_DIR/dispatch/<fingerprint-id>.json):
  {"format": 1, "fingerprint_id": ..., "fingerprint": {...}, "triton": ..., "torch": ...,
   "entries": [{"kernel", "dtype", "shape": {...}, "range": {dim: [lo, hi]} (optional),
                "source": {"module": "kernelsearch.kernels.rmsnorm"} | {"path": "/.../x.py"},
                "source_hash", "params", "candidate_ms", "stock_ms", "speedup"}]}

Lookup rule: an entry whose shape equals the call's shape wins; otherwise an entry with a
`range` matches when every dimension not named in the range is equal and each ranged
dimension lies in [lo, hi] inclusive (e.g. one decode GEMM winner for M in 1..16). No match,
a fingerprint other than this device's, or a tuned source whose hash changed -> stock.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib
import importlib.util
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

FORMAT = 1


def _x_shape(args) -> dict:
    m, n = args[0].shape
    return {"M": int(m), "N": int(n)}


def _matmul_shape(args) -> dict:
    (m, k), n = args[0].shape, args[1].shape[1]
    return {"M": int(m), "K": int(k), "N": int(n)}


def _decode_attention_shape(args) -> dict:
    b, hq, d = args[0].shape
    _, hkv, s, _ = args[1].shape
    return {"B": int(b), "Hq": int(hq), "Hkv": int(hkv), "S": int(s), "D": int(d)}


# How a call's arguments give the shape keys the specs' sweeps use.
SHAPE_OF = {
    "rmsnorm": _x_shape,
    "add_rmsnorm": _x_shape,
    "softmax": _x_shape,
    "matmul": _matmul_shape,
    "decode_attention": _decode_attention_shape,
}


def file_sha256(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


def table_path(state_dir, fingerprint_id: str) -> Path:
    return Path(state_dir) / "dispatch" / f"{fingerprint_id}.json"


def shape_matches(entry: dict, shape: dict) -> bool:
    if entry["shape"] == shape:
        return True
    ranges = entry.get("range") or {}
    if not ranges or set(entry["shape"]) != set(shape):
        return False
    for dim, value in shape.items():
        if dim in ranges:
            lo, hi = ranges[dim]
            if not lo <= value <= hi:
                return False
        elif entry["shape"][dim] != value:
            return False
    return True


class DispatchTable:
    def __init__(self, data: dict, path: Path | None = None):
        self.data = data
        self.path = path
        self.entries: list[dict] = list(data.get("entries", []))
        self.counts: dict[tuple[str, str], int] = {}
        self._device_ok: dict[str, bool] = {}
        self._launch: dict[str, object] = {}

    @classmethod
    def load(cls, path) -> "DispatchTable":
        path = Path(path)
        data = json.loads(path.read_text())
        if data.get("format") != FORMAT:
            raise ValueError(f"{path}: dispatch table format {data.get('format')!r}, expected {FORMAT}")
        return cls(data, path)

    @classmethod
    def empty(cls) -> "DispatchTable":
        return cls({"format": FORMAT, "entries": []})

    @classmethod
    def for_device(cls, state_dir, device: str = "cuda") -> "DispatchTable":
        """This device's table from STATE_DIR/dispatch/, or an empty one (all stock)."""
        from kernelsearch.fingerprint import collect, fingerprint_id

        path = table_path(state_dir, fingerprint_id(collect(device)))
        return cls.load(path) if path.exists() else cls.empty()

    # --- lookup -------------------------------------------------------------------------
    def lookup(self, kernel: str, shape: dict, dtype: str) -> dict | None:
        shape = {k: v for k, v in shape.items() if k != "dtype"}
        candidates = [e for e in self.entries if e["kernel"] == kernel and e["dtype"] == dtype]
        for e in candidates:
            if e["shape"] == shape:
                return e
        for e in candidates:
            if shape_matches(e, shape):
                return e
        return None

    def _fingerprint_ok(self, device_type: str) -> bool:
        if device_type not in self._device_ok:
            from kernelsearch.fingerprint import collect, fingerprint_id

            want = self.data.get("fingerprint_id")
            self._device_ok[device_type] = bool(want) and want == fingerprint_id(collect(device_type))
        return self._device_ok[device_type]

    def _tuned_launch(self, entry: dict):
        """The entry's launch function, or None when its source is missing or changed."""
        ident = json.dumps([entry.get("source"), entry.get("source_hash")], sort_keys=True)
        if ident not in self._launch:  # one import per source file, however many entries use it
            self._launch[ident] = _load_launch(entry)
        return self._launch[ident]

    def route(self, kernel: str, *args):
        """(launch, params, why): launch is None when the call must go to stock."""
        if kernel not in SHAPE_OF:
            raise KeyError(f"dispatch: unknown kernel {kernel!r}")
        first = args[0]
        if not self._fingerprint_ok(first.device.type):
            return None, None, "fingerprint mismatch"
        from kernelsearch.specs import dtype_name

        entry = self.lookup(kernel, SHAPE_OF[kernel](args), dtype_name(first.dtype))
        if entry is None:
            return None, None, "no entry for shape"
        launch = self._tuned_launch(entry)
        if launch is None:
            return None, None, "tuned source missing or changed"
        return launch, dict(entry.get("params") or {}), "tuned"

    def call(self, kernel: str, *args):
        """Run `kernel` on `args` (inputs in contract order); returns its output(s)."""
        from kernelsearch.specs import get_spec

        spec = get_spec(kernel)
        shape = SHAPE_OF[kernel](args)
        outputs = spec.make_outputs(shape, args[0].dtype, args[0].device)
        launch, params, why = self.route(kernel, *args)
        route = "tuned" if launch is not None else "stock"
        self.counts[(kernel, route)] = self.counts.get((kernel, route), 0) + 1
        if launch is not None:
            launch(*args, *(outputs[n] for n in spec.out_names), **params)
        else:
            spec.stock(dict(zip(spec.arg_names, args)), outputs)
        result = tuple(outputs[n] for n in spec.out_names)
        return result[0] if len(result) == 1 else result

    # --- writing (used by the search; kept here so the format lives in one file) ----------
    def to_json(self) -> dict:
        return {**self.data, "format": FORMAT, "entries": self.entries}

    def save(self, path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        # A private temporary name: two writers never share (and tear) one temporary file.
        fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(self.to_json(), indent=2, sort_keys=True) + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return path

    @staticmethod
    @contextlib.contextmanager
    def updating(path):
        """Load-merge-save under an exclusive lock (PATH.lock), so that two searches, or a search
        and a `share import`, never lose each other's winners. Yields the current table (empty
        when there is none); the caller saves it before leaving the block."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_name(path.name + ".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield DispatchTable.load(path) if path.exists() else DispatchTable.empty()


def _load_launch(entry: dict):
    source = entry.get("source") or {}
    try:
        if "module" in source:
            module = importlib.import_module(source["module"])
            path = Path(module.__file__)
        else:
            path = Path(source["path"])
            if entry.get("source_hash") and file_sha256(path) != entry["source_hash"]:
                return None
            name = f"hwtune_tuned_{entry.get('source_hash') or file_sha256(path)}"
            spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module  # triton's jit looks the module up while compiling
            spec.loader.exec_module(module)
        if entry.get("source_hash") and file_sha256(path) != entry["source_hash"]:
            return None
        return getattr(module, "launch", None)
    except (ImportError, OSError, SyntaxError, KeyError, AttributeError):
        return None


_DEFAULT: DispatchTable | None = None


def call(kernel: str, *args):
    """Module-level entry point: the table set by `use(table)`, else all stock."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = DispatchTable.empty()
    return _DEFAULT.call(kernel, *args)


def use(table: DispatchTable) -> None:
    global _DEFAULT
    _DEFAULT = table
