"""Runtime dispatch: the tuned kernel where the search found a winner, stock everywhere else.

Importable at inference time without the search machinery: it imports torch, json,
the kernel contracts (kernelsearch.specs: stock fallback and output allocation, torch only),
kernelsearch.fingerprint, the built-in templates' registry (kernelsearch.kernels), and -- only when a tuned entry is used -- triton and
the harness's source checker, plan validator and plan runner (no sandbox, no executor).

Table (JSON, one per device fingerprint: STATE_DIR/dispatch/<fingerprint-id>.json):
  {"format": 1, "fingerprint_id": ..., "fingerprint": {...}, "triton": ..., "torch": ...,
   "entries": [{"kernel", "dtype", "shape": {...}, "range": {dim: [lo, hi]} (optional),
                "source": {"module": "kernelsearch.kernels.rmsnorm"} | {"path": "/.../x.py"},
                "source_hash", "params", "plan", "candidate_ms", "stock_ms", "speedup",
                "against" (what stock_ms timed, e.g. "torch.nn.functional.rms_norm"),
                "noise_band"}]}
Every entry is read and written as an `Entry` (frozen; `Entry.from_json` / `to_json`): search,
share, metrics and bench go through it, nothing else parses entries.

A tuned entry runs its `plan`: the launch plan the harness verified at that shape (see
kernelsearch.harness.plan), re-validated against the re-checked source when the table is
loaded, executed by kernelsearch.harness.run_plan on the caller's tensors. The source file is
read, never imported: no Python of a candidate runs at inference time.

Lookup rule: an entry whose shape equals the call's shape wins; otherwise an entry with a
`range` matches when every dimension not named in the range is equal and each ranged
dimension lies in [lo, hi] inclusive (e.g. one decode GEMM winner for M in 1..16). No match,
a fingerprint other than this device's, or a tuned source whose hash changed -> stock.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import stat
import sys
import tempfile
from pathlib import Path

import torch

from kernelsearch.entry import Entry, EntryError, _thaw, file_sha256, text_sha256  # noqa: F401 -- the table's row type

FORMAT = 1


class TableError(ValueError):
    """A file that is not a dispatch table this version reads (names the file)."""


class TableWriteError(TableError):
    """A table that could not be saved (a full disk, a read-only file system): the file is as it
    was before (names the file)."""


class _ShapeOf(dict):
    """kernel -> fn(args) -> shape dict: each spec's own `call_shape` (a new kernel adds
    nothing here)."""

    def __missing__(self, kernel):
        from kernelsearch.specs import SPECS

        if kernel not in SPECS:
            raise KeyError(kernel)
        self[kernel] = SPECS[kernel].call_shape
        return self[kernel]

    def __contains__(self, kernel):
        from kernelsearch.specs import SPECS

        return kernel in SPECS


# How a call's arguments give the shape keys the specs' sweeps use.
SHAPE_OF = _ShapeOf()


def table_path(state_dir, fingerprint_id: str) -> Path:
    return Path(state_dir) / "dispatch" / f"{fingerprint_id}.json"


def shape_matches(entry: "Entry", shape: dict) -> bool:
    if dict(entry.shape) == shape:
        return True
    ranges = entry.range or {}
    if not ranges or set(entry.shape) != set(shape):
        return False
    for dim, value in shape.items():
        if dim in ranges:
            lo, hi = ranges[dim]
            if not lo <= value <= hi:
                return False
        elif entry.shape[dim] != value:
            return False
    return True


class DispatchTable:
    def __init__(self, data: dict, path: Path | None = None):
        self.data = data
        self.path = path
        self.entries: list[Entry] = []
        self.invalid: list[str] = []        # entries that did not parse: left out (stock there)
        for raw in data.get("entries", []):
            try:
                self.entries.append(raw if isinstance(raw, Entry) else Entry.from_json(raw))
            except EntryError as exc:
                self.invalid.append(str(exc))
            except RecursionError:
                self.invalid.append("dispatch entry: nested too deeply")
        self.counts: dict[tuple[str, str], int] = {}
        self._device_ok: dict[str, bool] = {}
        self._launch: dict[str, object] = {}

    def __getstate__(self):
        """Pickled (with a patched model): the entries, not the kernels compiled from them, which
        are loaded (and their sources checked) again where the table is used."""
        return {**self.__dict__, "counts": {}, "_device_ok": {}, "_launch": {}}

    @classmethod
    def load(cls, path) -> "DispatchTable":
        """The table in `path`; TableError (a ValueError naming the file) when it is not one."""
        path = Path(path)
        try:
            data = json.loads(_read_trusted(path).decode("utf-8"))
        except TableError:
            raise
        except (ValueError, RecursionError) as exc:   # UnicodeDecodeError and JSON's errors are ValueErrors
            raise TableError(f"{path}: not a dispatch table ({type(exc).__name__}: {str(exc)[:200]})") from None
        if not isinstance(data, dict) or not isinstance(data.get("entries", []), list):
            raise TableError(f"{path}: not a dispatch table (expected an object with a list of entries)")
        if data.get("format") != FORMAT:
            raise TableError(f"{path}: dispatch table format {data.get('format')!r}, expected {FORMAT}")
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
    def lookup(self, kernel: str, shape: dict, dtype: str) -> Entry | None:
        shape = {k: v for k, v in shape.items() if k != "dtype"}
        candidates = [e for e in self.entries if e.kernel == kernel and e.dtype == dtype]
        for e in candidates:
            if dict(e.shape) == shape:
                return e
        for e in candidates:
            if shape_matches(e, shape):
                return e
        return None

    def routes_on(self, device_type: str) -> bool:
        """Whether this table was made on this device (its fingerprint): `route` sends no call
        to an entry elsewhere."""
        if device_type not in self._device_ok:
            from kernelsearch.fingerprint import collect, fingerprint_id

            want = self.data.get("fingerprint_id")
            self._device_ok[device_type] = bool(want) and want == fingerprint_id(collect(device_type))
        return self._device_ok[device_type]

    def usable(self, entry: Entry) -> bool:
        """Whether `entry` routes at all: its source present and unchanged since the search
        (source_hash, which it must have), its plan valid against it. A stale entry is ignored by `route` (stock)."""
        return self._tuned(entry) is not None

    def _tuned(self, entry: Entry):
        """The entry's verified plan as a callable, or None when its source is missing or
        changed, or its plan does not validate against the source."""
        ident = json.dumps([_thaw(entry.source), entry.source_hash, _thaw(entry.params),
                            _thaw(entry.shape), entry.dtype], sort_keys=True)
        if ident not in self._launch:
            self._launch[ident] = _load_tuned(entry)
        return self._launch[ident]

    def prepare(self, device) -> int:
        """Load every entry's verified plan and allocate its persistent workspaces on `device`
        now, outside any CUDA graph: allocated lazily, the first call under
        torch.compile(mode="reduce-overhead") would put them in the graphs' private pool, which
        refuses live tensors that are not graph outputs. Returns the entries made ready."""
        device = torch.device(device)
        ready = 0
        for entry in self.entries:
            tuned = self._tuned(entry)
            if tuned is not None:
                tuned.persistent_buffers(device)
                ready += 1
        return ready

    def route(self, kernel: str, *args):
        """(tuned, params, why): tuned is None when the call must go to stock."""
        if kernel not in SHAPE_OF:
            raise KeyError(f"dispatch: unknown kernel {kernel!r}")
        first = args[0]
        if not self.entries:
            return None, None, "empty table"
        if not self.routes_on(first.device.type):
            return None, None, "fingerprint mismatch"
        from kernelsearch.specs import dtype_name

        entry = self.lookup(kernel, SHAPE_OF[kernel](args), dtype_name(first.dtype))
        if entry is None:
            return None, None, "no entry for shape"
        tuned = self._tuned(entry)
        if tuned is None:
            return None, None, "tuned source missing, changed or without a valid plan"
        if not tuned.accepts(args):
            return None, None, "arguments differ from the verified layout (strides, dtype, device, 16-byte alignment) or scalar range"
        return tuned, _thaw(entry.params), "tuned"

    def call(self, kernel: str, *args):
        """Run `kernel` on `args` (inputs in contract order); returns its output(s)."""
        from kernelsearch.specs import get_spec

        spec = get_spec(kernel)
        tuned, params, why = self.route(kernel, *args)
        route = "tuned" if tuned is not None else "stock"
        self.counts[(kernel, route)] = self.counts.get((kernel, route), 0) + 1
        if tuned is not None:
            outputs = spec.make_outputs(SHAPE_OF[kernel](args), args[0].dtype, args[0].device)
            tuned(args, outputs)
        else:
            # Stock as a user calls it (new tensors): the fallback costs what stock costs,
            # not stock plus a copy into preallocated outputs.
            outputs = spec.stock_call(dict(zip(spec.arg_names, args)))
        result = tuple(outputs[n] for n in spec.out_names)
        return result[0] if len(result) == 1 else result

    # --- writing (used by the search; kept here so the format lives in one file) ----------
    def to_json(self) -> dict:
        return {**self.data, "format": FORMAT, "entries": [e.to_json() for e in self.entries]}

    def save(self, path) -> Path:
        path = Path(path)
        text = json.dumps(self.to_json(), indent=2, sort_keys=True) + "\n"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_whole(path, text)
        except OSError as exc:
            raise TableWriteError(f"{path}: cannot be written ({exc.strerror or exc}); "
                                  "the table is as it was") from None
        return path

    @staticmethod
    @contextlib.contextmanager
    def updating(path):
        """Load-merge-save under an exclusive lock (PATH.lock), so that two searches, or a search
        and a `share import`, never lose each other's winners. Yields the current table (empty
        when there is none); the caller saves it before leaving the block."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        lock_path = path.with_name(path.name + ".lock")
        try:
            # never through a link: one planted beside --dispatch-out would have root create or
            # open a file elsewhere
            fd = os.open(lock_path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise TableError(f"{lock_path}: cannot open the table's lock: {exc.strerror or exc}") from None
        with os.fdopen(fd, "w") as lock:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise TableError(f"{lock_path}: the table's lock is not a regular file")
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield DispatchTable.load(path) if path.exists() else DispatchTable.empty()


def write_whole(path: Path, text: str, mode: int | None = None) -> None:
    """`text` into a temporary beside `path` (a private name: two writers never share, and tear,
    one), fsynced, then renamed over `path`: the file holds all of it or what it held before.
    `mode` for the result (mkstemp's 0600 otherwise). Errors are raised; the temporary is gone."""
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _read_trusted(path: Path) -> bytes:
    """A table's bytes, refused (TableError) when another user owns it or group or others may
    write it: its plans are what runs on the GPU (hwtune runs as root, so what another user can
    write must not steer it)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):   # before fdopen: on a directory it says "Is a directory: 3"
        os.close(fd)
        raise TableError(f"{path}: not a regular file" + (" (a directory)" if stat.S_ISDIR(st.st_mode) else ""))
    with os.fdopen(fd, "rb") as f:
        if st.st_uid not in (0, os.geteuid()):
            raise TableError(f"{path}: owned by uid {st.st_uid}, not by this user or root; refusing to "
                             "trust it (inspect it, then remove it)")
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise TableError(f"{path}: mode {stat.S_IMODE(st.st_mode):04o} lets other users write it; "
                             "refusing to trust it (inspect it, then chmod go-w it)")
        return f.read()


def source_text(source: dict) -> tuple[str, Path] | None:
    """(text, path) of an entry's source, read without importing it. A module source names a
    built-in template (kernelsearch.kernels.<kernel>), nothing else: finding any other module
    would import its parent packages, running Python that a table names."""
    if "module" in source:
        from kernelsearch.kernels import TEMPLATES, template_path

        kernel = {module: k for k, module in TEMPLATES.items()}.get(source["module"])
        if kernel is None:
            return None
        path = template_path(kernel)
    else:
        path = Path(source["path"])
    # as the harness reads a candidate: a FIFO named as a source hung the model's first call,
    # /dev/zero filled its memory
    from kernelsearch.harness.source import MAX_SOURCE_BYTES, read_source

    data = read_source(path)
    if len(data) > MAX_SOURCE_BYTES:
        raise OSError(f"{path}: larger than {MAX_SOURCE_BYTES} bytes")
    return data.decode("utf-8"), path


ALIGN_BYTES = 16   # every buffer the harness checks on starts at such an address (executor.Slot)


class TunedKernel:
    """One table entry: its verified launch plan, run on the caller's tensors. Kernels are
    compiled from the checked source (kernelsearch.harness.source); no Python of the file runs."""

    _kernel_dir = None

    def __init__(self, entry: Entry, spec, text: str):
        from kernelsearch.harness import plan as plan_mod, source as source_mod

        if TunedKernel._kernel_dir is None:
            TunedKernel._kernel_dir = source_mod.private_dir("hwtune-dispatch-")
        checked = source_mod.KernelSource.parse(text)
        self.kernels = source_mod.load_kernels(checked, TunedKernel._kernel_dir)
        self.spec = spec
        shape = dict(entry.shape)
        self.signature = spec.signature(shape, entry.dtype)
        self.scalar_bounds = spec.scalar_bounds(shape)
        roles = {a["name"]: plan_mod.DTYPE_SIZES[a["dtype"]] * _numel(a["shape"])
                 for a in self.signature if a["kind"] == "tensor"}
        self.plan = plan_mod.validate(
            _thaw(entry.plan), kernels=checked.kernels, roles=roles,
            inputs={a["name"] for a in self.signature if a.get("role") == "input"},
            inouts={a["name"] for a in self.signature if a.get("role") == "inout"},
            scalars={a["name"] for a in self.signature if a["kind"] == "scalar"},
            workspace_budget_bytes=max(1 << 30, 4 * sum(roles.values())))
        self.persistent: dict = {}   # (device, buffer id) -> zeroed tensor kept across calls
        # the weights: what a kernel may read before the previous one ends (run_plan.bind, where
        # early reads are on); only true inputs, never an inout
        self.static = frozenset(n for n in getattr(spec, "static_inputs", ())
                                if any(a["name"] == n and a.get("role") == "input" for a in self.signature))

    def accepts(self, args) -> bool:
        """The layout the harness verified: shape, dtype, contiguous, and an address that is a
        multiple of 16 bytes, as every buffer it checks on is (Triton specialises on it: a view
        at an odd offset would run a compilation no check ran); scalars within the checked range."""
        tensors = [a for a in self.signature if a["kind"] == "tensor" and a["role"] in ("input", "inout")]
        by_name = dict(zip(self.spec.arg_names, args))
        for meta in tensors:
            t = by_name.get(meta["name"])
            if not isinstance(t, torch.Tensor) or list(t.shape) != meta["shape"] or \
                    str(t.dtype).removeprefix("torch.") != meta["dtype"] or not t.is_contiguous() or \
                    t.data_ptr() % ALIGN_BYTES:
                return False
        # a scalar argument outside the range the checks drew it from (eps 1e-8) ran no check
        for name, (lo, hi) in self.scalar_bounds.items():
            v = by_name.get(name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
                return False
        return True

    def __call__(self, args, outputs: dict) -> None:
        from kernelsearch.harness.run_plan import bind

        device = args[0].device
        values = dict(zip(self.spec.arg_names, args))
        values.update(outputs)
        buffers, scalars = {}, {}
        for name, v in values.items():
            if isinstance(v, torch.Tensor):
                buffers[name] = v.reshape(-1).view(torch.uint8)
            else:
                scalars[name] = v
        buffers.update(self.persistent_buffers(device))
        for b in self.plan.buffers:
            if not b.persistent:
                buffers[b.id] = torch.empty(b.nbytes, dtype=torch.uint8, device=device)
        bind(self.plan, self.kernels, buffers, scalars, static=self.static)()

    def persistent_buffers(self, device) -> dict:
        """{buffer id: zeroed tensor kept across calls} on `device` (allocated once)."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        out = {}
        for b in self.plan.buffers:
            if b.persistent:
                key = (str(device), b.id)
                if key not in self.persistent:
                    self.persistent[key] = torch.zeros(b.nbytes, dtype=torch.uint8, device=device)
                out[b.id] = self.persistent[key]
        return out


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _load_tuned(entry: Entry):
    from kernelsearch.harness.plan import PlanInvalid
    from kernelsearch.harness.source import SourceError
    from kernelsearch.specs import get_spec

    source = _thaw(entry.source) or {}
    try:
        found = source_text(source) if source else None
        if found is None or not entry.plan:
            return None
        text, _path = found
        # the hash of the text compiled, not of the file read again: it may change in between;
        # an entry without one names no verified text, so whatever file is there is not it
        if not entry.source_hash or text_sha256(text) != entry.source_hash:
            return None
        return TunedKernel(entry, get_spec(entry.kernel), text)
    except (ImportError, OSError, UnicodeDecodeError, KeyError, ValueError, TypeError, SourceError, PlanInvalid):
        return None


_DEFAULT: DispatchTable | None = None
_EMPTY = DispatchTable.empty()


def call(kernel: str, *args):
    """Module-level entry point: the table set by `use(table)`, else all stock."""
    return (_DEFAULT if _DEFAULT is not None else _EMPTY).call(kernel, *args)


def use(table: DispatchTable | None) -> None:
    """Set the table that `call` (and the hwtune torch ops) route through; None: all stock."""
    global _DEFAULT
    _DEFAULT = table


def current() -> DispatchTable | None:
    """The table set by `use(table)`, None when none is set."""
    return _DEFAULT
