"""Idle footprint of `hwtune daemon`: CPU share and resident memory while it only watches.

Starts the daemon on a fresh simulated host (8 GPUs, profile `efficiency`, metrics on,
a notify socket drained like systemd's and a watchdog), waits for READY=1, then measures over
--seconds: CPU % = (user + system CPU time delta) / wall time, and RSS (psutil). Scrapes
/metrics once at the end so the exporter's thread is exercised as well.

    python bench/daemon_footprint.py --seconds 60 [--poll 5] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--poll", type=float, default=5, help="poll_interval_s of the daemon")
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("HWTUNE_READ_ONLY", None)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        sim = tmp / "host.json"
        subprocess.run([sys.executable, "-m", "daemon.cli", "sim", "init", str(sim), "--gpus", str(args.gpus)],
                       cwd=ROOT, env=env, check=True, capture_output=True)
        config = tmp / "hwtune.yaml"
        config.write_text(json.dumps({"profile": "efficiency", "poll_interval_s": args.poll, "rollback": "on_exit",
                                      "metrics": {"enabled": True, "address": "127.0.0.1", "port": 0}}))
        os.chmod(config, 0o600)
        sock_path = tmp / "notify.sock"
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind(str(sock_path))
        sock.settimeout(0.5)
        messages: list[str] = []
        done = threading.Event()

        def drain():
            while not done.is_set():
                try:
                    messages.append(sock.recv(4096).decode())
                except socket.timeout:
                    continue

        threading.Thread(target=drain, daemon=True).start()
        env.update(NOTIFY_SOCKET=str(sock_path), WATCHDOG_USEC="30000000")
        proc = subprocess.Popen([sys.executable, "-m", "daemon.cli", "--sim", str(sim), "daemon", "--config",
                                 str(config)], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        try:
            end = time.monotonic() + 120
            while not any("READY=1" in m for m in messages):
                if proc.poll() is not None or time.monotonic() > end:
                    raise SystemExit(f"daemon did not become ready (rc {proc.poll()})")
                time.sleep(0.05)
            p = psutil.Process(proc.pid)
            time.sleep(1.0)  # let the start-up settle (first poll, metrics thread)
            c0, w0 = p.cpu_times(), time.monotonic()
            rss_max = 0
            while time.monotonic() - w0 < args.seconds:
                rss_max = max(rss_max, p.memory_info().rss)
                time.sleep(1.0)
            c1, w1 = p.cpu_times(), time.monotonic()
            info = json.loads((Path(str(sim) + ".state") / "daemon.json").read_text())
            with urllib.request.urlopen(f"http://127.0.0.1:{info['metrics_port']}/metrics", timeout=10) as r:
                scrape_bytes = len(r.read())
            mem = p.memory_info()
        finally:
            proc.terminate()
            proc.wait(timeout=60)
            done.set()
    cpu_s = (c1.user - c0.user) + (c1.system - c0.system)
    result = {
        "host": "simulated, %d GPUs" % args.gpus, "poll_interval_s": args.poll, "wall_s": round(w1 - w0, 1),
        "cpu_s": round(cpu_s, 3), "cpu_percent": round(100 * cpu_s / (w1 - w0), 3),
        "rss_mib": round(mem.rss / 2 ** 20, 1), "rss_max_mib": round(max(rss_max, mem.rss) / 2 ** 20, 1),
        "watchdog_pings": sum("WATCHDOG=1" in m for m in messages), "metrics_bytes": scrape_bytes,
        "torch_imported": info.get("torch_imported"),
        "machine": f"{os.cpu_count()} CPUs, {psutil.cpu_freq().max if psutil.cpu_freq() else '?'} MHz max",
    }
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        for k, v in result.items():
            print(f"{k:16s} {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
