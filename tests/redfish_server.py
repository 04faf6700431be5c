"""A real Redfish server for tests: sushy-static (PyPI sushy-tools) serving the DMTF
public-rackmount1 mockup on 127.0.0.1.

Use it by importing the fixture into a test module:
    from tests.redfish_server import redfish_server  # noqa: F401
    def test_x(redfish_server): ... redfish_server.url ...
"""
from __future__ import annotations

import importlib.util
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import SHARED

MOCKUP = SHARED / "redfish-mockups" / "public-rackmount1"
START_TIMEOUT_S = 30


@dataclass
class RedfishServer:
    url: str  # the BMC address, e.g. http://127.0.0.1:PORT
    port: int
    mockup: Path
    process: subprocess.Popen


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/redfish/v1/", timeout=2) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def start_redfish_server(mockup: Path = MOCKUP) -> RedfishServer:
    """Start sushy-static on a free port and wait until the service root answers."""
    last_output = ""
    for _attempt in range(3):  # the free port can be taken between probe and bind
        port = _free_port()
        # sushy-static logs every request with its headers: a file, not a pipe nobody reads.
        log = tempfile.TemporaryFile()
        proc = subprocess.Popen(
            [sys.executable, "-m", "sushy_tools.static.main", "-i", "127.0.0.1", "-p", str(port),
             "-m", str(mockup)],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline and proc.poll() is None:
            if _answers(url):
                log.close()
                return RedfishServer(url, port, mockup, proc)
            time.sleep(0.1)
        stop_redfish_server_process(proc)
        log.seek(0)
        last_output = log.read().decode(errors="replace")[-2000:]
        log.close()
    raise RuntimeError(f"sushy-static on {mockup} did not answer within {START_TIMEOUT_S} s:\n{last_output}")


def stop_redfish_server_process(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@pytest.fixture(scope="module")
def redfish_server():
    if importlib.util.find_spec("sushy_tools") is None:
        pytest.skip("sushy-tools is not installed (pip install sushy-tools)")
    if not (MOCKUP / "index.json").exists():
        pytest.skip(f"Redfish mockup not found at {MOCKUP} (set HWTUNE_SHARED)")
    server = start_redfish_server()
    try:
        yield server
    finally:
        stop_redfish_server_process(server.process)
