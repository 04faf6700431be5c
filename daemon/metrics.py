"""Prometheus metrics of the service (namespace `hwtune_`), on its own registry.

The daemon feeds plain dicts (a GPU backend's `telemetry(i)`, a tuning result, the dispatch
table) and `serve()` exposes them over HTTP, on 127.0.0.1 by default: the values describe a
root-controlled host and nobody else needs them unless the owner says so.
"""
from __future__ import annotations

import json
import os
import socket
import stat
import threading
from pathlib import Path
from socketserver import ThreadingMixIn
from typing import Any, Mapping
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest, make_wsgi_app

from hwtune.errors import HwtuneError

# NVML clock event (throttle) reason bits, as nvml.h defines them. Kept here rather than
# imported from pynvml: the watch path must not need NVML to label a mask.
CLOCK_EVENT_REASONS: dict[str, int] = {
    "gpu_idle": 0x1,
    "applications_clocks_setting": 0x2,
    "sw_power_cap": 0x4,
    "hw_slowdown": 0x8,
    "sync_boost": 0x10,
    "sw_thermal_slowdown": 0x20,
    "hw_thermal_slowdown": 0x40,
    "hw_power_brake_slowdown": 0x80,
    "display_clock_setting": 0x100,
}


def clock_event_reason_names(mask: int) -> list[str]:
    """Named reasons set in an NVML clock event reasons mask."""
    return [name for name, bit in CLOCK_EVENT_REASONS.items() if mask & bit]


class MetricsError(HwtuneError):
    """The metrics endpoint could not start, or the dispatch table could not be read."""


# Any local user may connect: without a limit every idle connection kept a thread and a
# descriptor for ever, and enough of them left the daemon no descriptor to read the host,
# write the journal or restore at stop. A scrape takes milliseconds.
MAX_CONNECTIONS = 16
REQUEST_TIMEOUT_S = 10
MAX_TABLE_BYTES = 64 << 20  # a table is kilobytes; /dev/zero-sized reads are cut here


class _QuietHandler(WSGIRequestHandler):
    timeout = REQUEST_TIMEOUT_S  # per read and write on the connection

    # Scrapes every few seconds would otherwise fill the journal with access lines.
    def log_message(self, format: str, *args: Any) -> None:
        pass


class _ThreadingWSGIServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True

    def __init__(self, *args, **kwargs):
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        super().__init__(*args, **kwargs)

    def process_request(self, request, client_address):
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)  # full: closed at once, the scraper retries
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request, client_address) -> None:
        pass  # a client that timed out or went away: not the daemon's error, no traceback


class _ThreadingWSGIServer6(_ThreadingWSGIServer):
    address_family = socket.AF_INET6


class Metrics:
    """Every metric hwtune exports; update methods take plain values and dicts."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r, ns = self.registry, "hwtune"
        gpu = ["gpu"]
        self.gpu_info = Gauge("gpu_info", "GPU identity (value is always 1)",
                              ["gpu", "uuid", "name", "pci_bus_id"], namespace=ns, registry=r)
        self.sm_clock_mhz = Gauge("gpu_sm_clock_mhz", "Current SM clock", gpu, namespace=ns, registry=r)
        self.memory_clock_mhz = Gauge("gpu_memory_clock_mhz", "Current memory clock", gpu,
                                      namespace=ns, registry=r)
        self.power_w = Gauge("gpu_power_w", "Current power draw", gpu, namespace=ns, registry=r)
        self.temperature_c = Gauge("gpu_temperature_c", "GPU core temperature", gpu, namespace=ns, registry=r)
        self.power_limit_w = Gauge("gpu_power_limit_w", "Enforced power limit", gpu, namespace=ns, registry=r)
        self.persistence_mode = Gauge("gpu_persistence_mode", "Persistence mode (1 on, 0 off)", gpu,
                                      namespace=ns, registry=r)
        self.clock_event_reasons = Gauge("gpu_clock_event_reasons",
                                         "NVML clock event reasons bit mask", gpu, namespace=ns, registry=r)
        self.clock_event_reason = Gauge("gpu_clock_event_reason_active",
                                        "1 while this NVML clock event reason holds clocks down",
                                        ["gpu", "reason"], namespace=ns, registry=r)
        self.xid_errors = Counter("xid_errors", "XID errors seen since the daemon started", gpu,
                                  namespace=ns, registry=r)
        self.host_info = Gauge("host_info", "Which host is tuned: kind is sim or real (value 1)",
                               ["kind"], namespace=ns, registry=r)
        self.profile_applied = Gauge("profile_applied", "1 for the profile the daemon keeps applied",
                                     ["profile"], namespace=ns, registry=r)
        self.drifted_knobs = Gauge("drifted_knobs", "Knobs that differ from the profile at the last check",
                                   namespace=ns, registry=r)
        self.reapply = Counter("reapply", "Re-applies of the profile after drift", namespace=ns, registry=r)
        self.restore = Counter("restore", "Restores of known-good settings, by reason", ["reason"],
                               namespace=ns, registry=r)
        self.last_tune_timestamp_seconds = Gauge("last_tune_timestamp_seconds",
                                                 "Unix time the last tuning cycle ended",
                                                 namespace=ns, registry=r)
        self.last_tune_objective = Gauge("last_tune_objective", "Objective value of the last tuning cycle",
                                         namespace=ns, registry=r)
        self.last_tune_ok = Gauge("last_tune_ok", "1 when the last tuning cycle succeeded", namespace=ns,
                                  registry=r)
        self.kernel_speedup = Gauge("kernel_speedup", "Dispatch-table winner's speedup over stock "
                                    "(`against` names the stock, as a user calls it)",
                                    ["kernel", "shape", "dtype", "against"], namespace=ns, registry=r)
        self._xid_seen: dict[str, int] = {}
        self._profile: str | None = None
        self._host_kind: str | None = None
        self._lock = threading.Lock()
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    # -- GPUs ---------------------------------------------------------------------------
    def set_gpu_info(self, gpu: int | str, info: Mapping[str, Any]) -> None:
        self.gpu_info.labels(str(gpu), str(info.get("uuid", "")), str(info.get("name", "")),
                             str(info.get("pci_bus_id", ""))).set(1)

    def update_gpu(self, gpu: int | str, telemetry: Mapping[str, Any]) -> None:
        """Take one GPU's `telemetry(i)` dict; optional extra keys `power_limit_w` and
        `persistence_mode`. Absent keys leave their gauge as it was. `xid_errors` is the
        backend's running count: the counter advances by the difference."""
        g = str(gpu)
        for key, gauge in (("sm_clock_mhz", self.sm_clock_mhz), ("memory_clock_mhz", self.memory_clock_mhz),
                           ("power_w", self.power_w), ("temperature_c", self.temperature_c),
                           ("power_limit_w", self.power_limit_w)):
            if telemetry.get(key) is not None:
                gauge.labels(g).set(float(telemetry[key]))
        if telemetry.get("persistence_mode") is not None:
            self.persistence_mode.labels(g).set(1 if telemetry["persistence_mode"] else 0)
        if telemetry.get("clock_event_reasons") is not None:
            mask = int(telemetry["clock_event_reasons"])
            self.clock_event_reasons.labels(g).set(mask)
            for name, bit in CLOCK_EVENT_REASONS.items():
                self.clock_event_reason.labels(g, name).set(1 if mask & bit else 0)
        if telemetry.get("xid_errors") is not None:
            self.set_xid_count(g, int(telemetry["xid_errors"]))

    def set_xid_count(self, gpu: int | str, count: int) -> None:
        g = str(gpu)
        with self._lock:
            seen = self._xid_seen.get(g)
            self._xid_seen[g] = count
        # The first reading is a baseline: the counter counts what happened while watched.
        # A lower count means the source was reset (driver reload, new sim file): rebaseline.
        if seen is None:
            self.xid_errors.labels(g).inc(0)
        elif count > seen:
            self.xid_errors.labels(g).inc(count - seen)

    def inc_xid(self, gpu: int | str, n: int = 1) -> None:
        self.xid_errors.labels(str(gpu)).inc(n)

    # -- service state ------------------------------------------------------------------
    def set_host_kind(self, kind: str) -> None:
        with self._lock:
            if self._host_kind is not None and self._host_kind != kind:
                self.host_info.remove(self._host_kind)
            self._host_kind = kind
        self.host_info.labels(kind).set(1)

    def set_profile(self, name: str | None) -> None:
        """The applied profile (None: none applied, e.g. after a rollback on exit)."""
        with self._lock:
            if self._profile is not None and self._profile != name:
                self.profile_applied.remove(self._profile)
            self._profile = name
        if name is not None:
            self.profile_applied.labels(name).set(1)

    def set_drift(self, drifted_knobs: int) -> None:
        self.drifted_knobs.set(drifted_knobs)

    def inc_reapply(self) -> None:
        self.reapply.inc()

    def inc_restore(self, reason: str) -> None:
        self.restore.labels(reason).inc()

    def set_last_tune(self, result: Mapping[str, Any]) -> None:
        """`{timestamp_s, objective, ok}`; objective may be None when the cycle failed.
        Raises MetricsError (nothing set) for anything else: the file is on disk, not ours."""
        if not isinstance(result, Mapping):
            raise MetricsError(f"last tune: expected a mapping, got {type(result).__name__}")
        numbers = {}
        for key in ("timestamp_s", "objective"):
            value = result.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise MetricsError(f"last tune: {key}: expected a number, got {value!r}")
            numbers[key] = value
        if numbers["timestamp_s"] is not None:
            self.last_tune_timestamp_seconds.set(float(numbers["timestamp_s"]))
        if numbers["objective"] is not None:
            self.last_tune_objective.set(float(numbers["objective"]))
        if result.get("ok") is not None:
            self.last_tune_ok.set(1 if result["ok"] else 0)

    # -- dispatch table -----------------------------------------------------------------
    def set_kernel_speedups(self, table: Any) -> int:
        """Replace the per-kernel speedups with the entries of a dispatch table (the parsed
        JSON: a dict with `entries`, or the list of them), each read as a
        kernelsearch.entry.Entry; entries that do not parse, or have no speedup, are skipped.
        Returns the entries exported."""
        from kernelsearch.entry import Entry, EntryError

        rows = table.get("entries", []) if isinstance(table, Mapping) else table
        if not isinstance(rows, list):
            raise MetricsError(f"dispatch table: expected a list of entries or {{'entries': [...]}}, "
                               f"got {type(rows).__name__}")
        self.kernel_speedup.clear()
        exported = 0
        for row in rows:
            try:
                entry = Entry.from_json(row)
            except EntryError:
                continue
            speedup = entry.speedup
            if speedup is None and entry.stock_ms and entry.candidate_ms:
                speedup = entry.stock_ms / entry.candidate_ms
            if speedup is None:
                continue
            shape = _shape_label(dict(entry.shape))
            if entry.range:
                shape += " " + ",".join(f"{k}in[{lo},{hi}]" for k, (lo, hi) in entry.range.items())
            self.kernel_speedup.labels(entry.kernel, shape, entry.dtype, entry.against or "stock").set(speedup)
            exported += 1
        return exported

    def load_dispatch_table(self, path: Path | str) -> int:
        try:
            # O_NONBLOCK: a FIFO named here would block the daemon's start beyond SIGTERM's reach.
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            with os.fdopen(fd, "rb") as f:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise MetricsError(f"dispatch table {path}: not a regular file")
                table = json.loads(f.read(MAX_TABLE_BYTES + 1).decode("utf-8"))
        except (OSError, ValueError, RecursionError) as exc:
            raise MetricsError(f"dispatch table {path}: cannot read: {type(exc).__name__}: {str(exc)[:200]}") from None
        return self.set_kernel_speedups(table)

    # -- exposition ---------------------------------------------------------------------
    def render(self) -> bytes:
        return generate_latest(self.registry)

    def serve(self, address: str = "127.0.0.1", port: int = 9835) -> int:
        """Start the /metrics HTTP server in a daemon thread; port 0 picks a free port.
        Returns the bound port."""
        if self._server is not None:
            raise MetricsError(f"metrics already served on port {self._server.server_port}")
        server_class = _ThreadingWSGIServer6 if ":" in address else _ThreadingWSGIServer  # an IPv6 literal
        try:
            server = make_server(address, port, make_wsgi_app(self.registry),
                                 server_class, handler_class=_QuietHandler)
        except OSError as exc:
            raise MetricsError(f"metrics on {address}:{port}: cannot listen: {exc}") from exc
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, name="hwtune-metrics", daemon=True)
        self._thread.start()
        return server.server_port

    @property
    def port(self) -> int | None:
        return self._server.server_port if self._server is not None else None

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None


def _shape_label(shape: Any) -> str:
    # Stable text for a shape given as a dict ({"M": 4096, "N": 8192}), a list or a string.
    if isinstance(shape, Mapping):
        return ",".join(f"{k}={v}" for k, v in shape.items())
    if isinstance(shape, (list, tuple)):
        return "x".join(str(v) for v in shape)
    return str(shape)
