import os
import socket
import uuid

import pytest

from daemon.notify import Notifier, NotifyError, watchdog_interval_s


@pytest.fixture
def notify_socket(tmp_path):
    path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(5)
    yield str(path), sock
    sock.close()


def _messages(sock):
    return sock.recv(4096).decode()


def test_ready_status_watchdog_stopping_arrive_on_a_path_socket(notify_socket):
    path, sock = notify_socket
    n = Notifier.from_env({"NOTIFY_SOCKET": path})
    assert n.enabled
    assert n.ready(status="applied throughput")
    msg = _messages(sock)
    assert "READY=1\n" in msg
    assert "STATUS=applied throughput\n" in msg
    assert f"MAINPID={os.getpid()}\n" in msg
    assert n.status("watching 8 GPUs")
    assert _messages(sock) == "STATUS=watching 8 GPUs\n"
    assert n.watchdog()
    assert _messages(sock) == "WATCHDOG=1\n"
    assert n.stopping()
    assert _messages(sock) == "STOPPING=1\n"
    n.close()


def test_abstract_socket_name_with_at_sign_is_reached():
    name = f"hwtune-test-{uuid.uuid4().hex}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(b"\0" + name.encode())
    sock.settimeout(5)
    try:
        with Notifier.from_env({"NOTIFY_SOCKET": "@" + name}) as n:
            n.watchdog()
        assert _messages(sock) == "WATCHDOG=1\n"
    finally:
        sock.close()


def test_newline_in_status_cannot_inject_another_assignment(notify_socket):
    path, sock = notify_socket
    Notifier(path).status("bad\nREADY=1")
    assert _messages(sock) == "STATUS=bad READY=1\n"


def test_without_notify_socket_every_call_is_a_noop():
    n = Notifier.from_env({})
    assert not n.enabled
    assert n.ready() is False
    assert n.status("x") is False
    assert n.watchdog() is False
    assert n.stopping() is False


def test_unreachable_socket_raises_an_error_naming_it(tmp_path):
    missing = str(tmp_path / "gone.sock")
    with pytest.raises(NotifyError, match="gone.sock"):
        Notifier(missing).ready()


def test_watchdog_interval_is_half_of_watchdog_usec():
    assert watchdog_interval_s({"WATCHDOG_USEC": "30000000"}) == 15.0
    assert watchdog_interval_s({}) is None
    assert watchdog_interval_s({"WATCHDOG_USEC": "0"}) is None
    assert watchdog_interval_s({"WATCHDOG_USEC": "junk"}) is None


def test_watchdog_pid_of_another_process_disables_the_watchdog():
    env = {"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": str(os.getpid())}
    assert watchdog_interval_s(env) == 1.0
    env["WATCHDOG_PID"] = str(os.getpid() + 1)
    assert watchdog_interval_s(env) is None
    assert watchdog_interval_s(env, pid=os.getpid() + 1) == 1.0


def test_ready_and_stopping_wait_briefly_for_a_full_queue_instead_of_being_dropped(notify_socket):
    # Every message was sent MSG_DONTWAIT and dropped on a full queue: right for WATCHDOG=1
    # and STATUS= (the next one comes), but a dropped READY=1 fails the start at
    # TimeoutStartSec, and a dropped STOPPING=1 leaves systemd waiting for a daemon that stops.
    import threading
    import time

    path, sock = notify_socket
    n = Notifier(path)
    while n.status("x" * 200):   # fill the receiver's queue
        pass
    assert not n.watchdog()      # a ping is still dropped, never waited for

    def drain_later():
        time.sleep(0.3)
        sock.setblocking(False)
        try:
            while True:
                got.append(sock.recv(4096).decode())
        except BlockingIOError:
            pass
    got: list = []
    t = threading.Thread(target=drain_later)
    t.start()
    assert n.ready()
    t.join()
    sock.settimeout(5)
    got.append(sock.recv(4096).decode())
    assert any("READY=1" in m for m in got)
    n.close()
