"""Bad input is one line, exit 2 (1 for a device error), no traceback, nothing written:
malformed simulated hosts, hostile service configs, an unreadable sysfs file, a BMC that
answers 401 with an odd body."""
from __future__ import annotations

import http.server
import json
import os
import threading
import time
from pathlib import Path

import pytest

from conftest import run_hwtune
from fixtures.simhost import make_sim
from fixtures.sysfs_tree import build, snapshot


def _one_line_error(proc, code):
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == code, (proc.returncode, proc.stderr)
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    return proc.stderr.strip()


# -- malformed simulated host files ------------------------------------------------------

def _edit(key_path, value):
    def change(d):
        node = d
        for k in key_path[:-1]:
            node = node[k]
        if value is _DELETE:
            del node[key_path[-1]]
        else:
            node[key_path[-1]] = value
    return change


_DELETE = object()
MALFORMED = {
    "not-json": b"{ this is not json",
    "empty": b"",
    "a-list": b"[]",
    "an-empty-object": b"{}",
    "invalid-utf8": b'{"gpus": "\xff\xfe"}',
    "deep": b"[" * 50000 + b"]" * 50000,
    "nan": None,  # built below from a real host
}
EDITS = {
    "gpus-not-a-list": (("gpus",), {"0": 1}),
    "gpu-not-an-object": (("gpus", 0), 7),
    "no-power-limit": (("gpus", 0, "power_limit_w"), _DELETE),
    "power-limit-text": (("gpus", 0, "power_limit_w"), "lots"),
    "constraints-one-number": (("gpus", 1, "power_limit_constraints_w"), [200]),
    "supported-clocks-text": (("gpus", 0, "supported_sm_clocks_mhz"), "fast"),
    "locked-clocks-one": (("gpus", 0, "locked_sm_clocks_mhz"), [1410]),
    "telemetry-text": (("gpus", 0, "telemetry", "temperature_c"), "hot"),
    "no-pcie": (("pcie",), _DELETE),
    "pcie-no-bdf": (("pcie", 0, "bdf"), _DELETE),
    "pcie-bdf-path": (("pcie", 0, "bdf"), "../../etc"),
    "devctl-text": (("pcie", 0, "devctl"), "0x2920"),
    "no-cpus": (("cpu", "cpus"), _DELETE),
    "cstate-no-latency": (("cpu", "cpus", 0, "cstates", 0, "latency_us"), _DELETE),
    "governors-not-names": (("cpu", "available_governors"), [1, 2]),
    "faults-not-a-list": (("faults",), "all"),
    "delay-negative": (("write_delay_ms",), -5),
    "bios-a-list": (("bios",), [1]),
    "getter-text": (("locked_clocks_getter",), "no"),
}


def _malformed(tmp_path, name) -> Path:
    sim = make_sim(tmp_path)
    if name in EDITS:
        data = json.loads(sim.read_text())
        path, value = EDITS[name]
        _edit(path, value)(data)
        sim.write_text(json.dumps(data))
    elif name == "nan":
        sim.write_text(sim.read_text().replace('"power_limit_w": 700', '"power_limit_w": NaN', 1))
    else:
        sim.write_bytes(MALFORMED[name])
    return sim


@pytest.mark.parametrize("name", sorted(set(MALFORMED) | set(EDITS)))
def test_a_malformed_sim_file_is_one_line_exit_2_and_nothing_written(tmp_path, name):
    sim = _malformed(tmp_path, name)
    before = sim.read_bytes()
    for cmd in (["plan", "-p", "throughput"], ["apply", "-p", "throughput"], ["status"], ["verify"],
                ["rollback"], ["tune", "--no-kernels", "--budget", "2"]):
        t0 = time.monotonic()
        r = run_hwtune("--sim", sim, *cmd)
        assert time.monotonic() - t0 < 30
        line = _one_line_error(r, 2)
        assert line.startswith(f"hwtune {cmd[0]}: simulated host {sim}"), line
    assert sim.read_bytes() == before
    assert not (Path(str(sim) + ".state") / "journal.json").exists()


def test_a_sim_path_that_is_a_directory_is_bad_input(tmp_path):
    d = tmp_path / "dir.json"
    d.mkdir()
    _one_line_error(run_hwtune("--sim", d, "plan"), 2)


@pytest.mark.parametrize("how", ["fifo", "device"])
def test_a_sim_path_that_is_a_fifo_or_a_device_is_bad_input_never_a_hang(tmp_path, how):
    path = tmp_path / "host.json"
    if how == "fifo":
        os.mkfifo(path)  # nobody writes it: reading would wait forever
    else:
        path = Path("/dev/null")
    for cmd in (["status"], ["plan"], ["apply"], ["rollback"]):
        line = _one_line_error(run_hwtune("--sim", path, "--state-dir", tmp_path / "s", *cmd, timeout=30), 2)
        assert "not a regular file" in line, line


# -- hostile service configs -------------------------------------------------------------

def _config(tmp_path, text: str) -> Path:
    path = tmp_path / "hwtune.yaml"
    path.write_text(text)
    path.chmod(0o600)
    return path


BILLION_LAUGHS = "\n".join(
    ["a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    + [f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 9)}]" for i in range(8)]
    + ["profile: *i"]) + "\n"


@pytest.mark.parametrize("text,key", [
    (BILLION_LAUGHS, "anchors (&name) are not allowed"),
    ("profile: " + "[" * 20000 + "]" * 20000 + "\n", "nested deeper"),
    ("metrics: " + "{a: " * 20000 + "1" + "}" * 20000 + "\n", "nested deeper"),
    ("profile: throughput\nprofile: efficiency\n", "profile: duplicate key"),
    ("metrics:\n  port: 1\n  port: 2\n", "metrics.port: duplicate key"),
    ("agent_user: no-such-user-here\n", "agent_user: no such user"),
    ("profile: " + "x" * 300 + "\n", "profile: a name of 300 bytes"),
    ("profile: " + "é" * 200 + "\n", "profile: a name of 400 bytes"),
    ("profile: [" + ", ".join(["1"] * 5000) + "]\n", "profile: expected a profile name or path, got a list of 5000"),
    # int() refuses more than 4300 digits: a ValueError traceback from PyYAML's constructor
    ("poll_interval_s: " + "9" * 5000 + "\n", "poll_interval_s: a number of 5000 digits"),
    ("poll_interval_s: !!int '" + "9" * 5000 + "'\n", "poll_interval_s: a number of 5000 digits"),
    # PyYAML's constructors raise ValueError / KeyError / AttributeError, not YAMLError
    ("poll_interval_s: 2023-02-30\n", "poll_interval_s: not a valid timestamp"),
    ("rollback: !!bool maybe\n", "rollback: not a valid bool"),
    ("poll_interval_s: !!float abc\n", "poll_interval_s: not a valid float"),
], ids=["billion-laughs", "deep-list", "deep-map", "duplicate-profile", "duplicate-port", "agent-user",
        "long-profile", "long-utf8-profile", "huge-value", "5000-digits", "5000-digits-tagged", "bad-date",
        "bad-bool-tag", "bad-float-tag"])
def test_a_hostile_config_is_answered_within_a_second_naming_the_key(tmp_path, text, key):
    sim = make_sim(tmp_path)
    before = sim.read_bytes()
    config = _config(tmp_path, text)
    for cmd in (["daemon", "--config", str(config), "--once"], ["--config", str(config), "apply"]):
        t0 = time.monotonic()
        r = run_hwtune("--sim", sim, *cmd)
        elapsed = time.monotonic() - t0
        line = _one_line_error(r, 2)
        assert key in line, line
        assert len(line) < 400  # the value is never printed whole
        assert elapsed < 1.0 + _startup_s(), elapsed
    assert sim.read_bytes() == before


_STARTUP: list = []


def _startup_s() -> float:
    """How long the CLI takes to start here (the budget is one second on top of it)."""
    if not _STARTUP:
        t0 = time.monotonic()
        run_hwtune("--help")
        _STARTUP.append(time.monotonic() - t0)
    return _STARTUP[0]


def test_a_profile_name_too_long_for_a_file_is_refused_on_the_command_line(tmp_path):
    sim = make_sim(tmp_path)
    line = _one_line_error(run_hwtune("--sim", sim, "apply", "-p", "y" * 300), 2)
    assert "profile" in line and "at most 255" in line


def test_a_profile_path_too_long_is_refused_naming_its_length_not_a_component(tmp_path):
    # Before: 'a name (or path component) of 6 bytes; at most 255' for a 6006-byte path of short parts
    sim = make_sim(tmp_path)
    line = _one_line_error(run_hwtune("--sim", sim, "plan", "-p", "a/" * 3000 + "x.yaml"), 2)
    assert "a path of 6006 bytes; at most 4096" in line, line


def test_a_deeply_nested_profile_is_refused_not_a_recursion_error(tmp_path):
    sim = make_sim(tmp_path)
    prof = tmp_path / "deep.yaml"
    prof.write_text("gpu: " + "[" * 20000 + "]" * 20000 + "\n")
    line = _one_line_error(run_hwtune("--sim", sim, "plan", "-p", prof), 2)
    assert "nested deeper" in line


def test_a_profile_or_credentials_file_with_a_5000_digit_number_is_one_line(tmp_path):
    # Before: a ValueError traceback (Python's 4300-digit int limit) from PyYAML's constructor.
    sim = make_sim(tmp_path)
    prof = tmp_path / "big.yaml"
    prof.write_text("gpu:\n  power_limit_w: " + "9" * 5000 + "\n")
    line = _one_line_error(run_hwtune("--sim", sim, "plan", "-p", prof), 2)
    assert "gpu.power_limit_w: a number of 5000 digits" in line and len(line) < 400, line
    creds = tmp_path / "bmc.yaml"
    creds.write_text("username: admin\npassword: " + "9" * 5000 + "\n")
    creds.chmod(0o600)
    prof.write_text(f"bios:\n  endpoint: https://127.0.0.1:1\n  credentials_file: {creds}\n")
    line = _one_line_error(run_hwtune("--sysfs-root", tmp_path, "--state-dir", tmp_path / "s", "plan", "-p", prof), 2)
    assert "bios.credentials_file" in line and "a number of 5000 digits" in line and "99999" not in line, line


@pytest.mark.parametrize("value,why", [
    ("2023-02-30", "not a valid timestamp"), ("!!float abc", "not a valid float"), ("!!bool maybe", "not a valid bool"),
    ("!!int abc", "not a valid int"), ("!!timestamp x", "not a valid timestamp"),
    ("!!python/name:os.system", "unsupported tag"),
])
def test_a_yaml_value_its_constructor_cannot_build_is_one_line(tmp_path, value, why):
    # Before: tracebacks (ValueError: day is out of range for month, KeyError: 'maybe',
    # ConstructorError for a python/ tag) from the profile loader and the credentials file.
    sim = make_sim(tmp_path)
    prof = tmp_path / "p.yaml"
    prof.write_text(f"description: {value}\ngpu:\n  power_limit_w: 500\n")
    line = _one_line_error(run_hwtune("--sim", sim, "plan", "-p", prof), 2)
    assert f"{prof}:1: description: {why}" in line, line
    creds = tmp_path / "bmc.yaml"
    creds.write_text(f"username: admin\npassword: {value}\n")
    creds.chmod(0o600)
    prof.write_text(f"bios:\n  endpoint: https://127.0.0.1:1\n  credentials_file: {creds}\n")
    line = _one_line_error(run_hwtune("--sysfs-root", tmp_path, "--state-dir", tmp_path / "s", "plan", "-p", prof), 2)
    assert "bios.credentials_file" in line and why in line, line


@pytest.mark.parametrize("how", ["fifo", "device", "include-device", "not-utf8"])
def test_a_profile_that_is_a_fifo_a_device_or_not_utf8_is_one_line_never_a_hang(tmp_path, how):
    sim = make_sim(tmp_path)
    prof = tmp_path / "p.yaml"
    if how == "fifo":
        os.mkfifo(prof)  # nobody writes it: reading would wait forever
    elif how == "device":
        prof = Path("/dev/zero")  # never ends
    elif how == "include-device":
        prof.write_text("include: /dev/zero\ncpu:\n  governor: performance\n")
    else:
        prof.write_bytes(b"description: \"\xff\xfe\"\ncpu:\n  governor: performance\n")
    written = os.stat(sim)
    for cmd in ("plan", "apply", "verify"):
        line = _one_line_error(run_hwtune("--sim", sim, cmd, "-p", prof, timeout=30), 2)
        assert ("not a regular file" if how != "not-utf8" else "not UTF-8") in line, line
    now = os.stat(sim)
    assert (now.st_ino, now.st_mtime_ns) == (written.st_ino, written.st_mtime_ns)


# -- an unreadable sysfs file ------------------------------------------------------------

@pytest.mark.parametrize("how", ["directory", "fifo", "binary"])
def test_an_unreadable_sysfs_file_is_one_line_exit_1_and_nothing_written(tmp_path, how):
    root = build(tmp_path / "root")
    gov = root / "sys/devices/system/cpu/cpu2/cpufreq/scaling_governor"
    gov.unlink()
    if how == "directory":
        gov.mkdir()
    elif how == "fifo":
        os.mkfifo(gov)
    else:
        gov.write_bytes(b"\xff\xfe\x00")
    prof = tmp_path / "p.yaml"
    prof.write_text("cpu:\n  governor: performance\npcie:\n  select: nvidia\n  relaxed_ordering: true\n")
    before = snapshot(root)
    for cmd in (["plan", "-p", str(prof)], ["apply", "-p", str(prof)], ["verify", "-p", str(prof)]):
        r = run_hwtune("--sysfs-root", root, "--state-dir", tmp_path / "s", *cmd, timeout=30)
        line = _one_line_error(r, 1)
        assert "scaling_governor" in line and "nothing was written" in line
    assert snapshot(root) == before
    assert not (tmp_path / "s" / "journal.json").exists()


# -- a BMC that answers 401 with an odd body ---------------------------------------------

class _Odd401(http.server.BaseHTTPRequestHandler):
    body = b""
    ctype = "text/html"

    def do_GET(self):
        self.send_response(401)
        self.send_header("Content-Type", self.ctype)
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("body,ctype", [(b"<html>go away</html>", "text/html"), (b'{"error": 5}', "application/json"),
                                        (b"[1, 2]", "application/json"), (b"null", "application/json"),
                                        (b"\xff\xfe", "application/json")])
def test_a_bmc_answering_401_with_an_odd_body_is_one_line(tmp_path, body, ctype):
    handler = type("H", (_Odd401,), {"body": body, "ctype": ctype})
    server = http.server.HTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        root = build(tmp_path / "root")
        prof = tmp_path / "p.yaml"
        prof.write_text(f"bios:\n  endpoint: http://127.0.0.1:{server.server_port}\n"
                        "  expect: {PowerProfile: MaxPerf}\n")
        r = run_hwtune("--sysfs-root", root, "--state-dir", tmp_path / "s", "verify", "-p", prof, timeout=60)
        # verify reports on stdout what it could not check (a failure, exit 1): one line names the BMC
        assert r.returncode == 1 and "Traceback" not in r.stdout + r.stderr, (r.returncode, r.stdout, r.stderr)
        lines = [ln for ln in (r.stdout + r.stderr).splitlines() if "redfish" in ln]
        assert len(lines) == 1 and f"redfish http://127.0.0.1:{server.server_port}" in lines[0], r.stdout + r.stderr
        plan = run_hwtune("--sysfs-root", root, "--state-dir", tmp_path / "s", "plan", "-p", prof, timeout=60)
        assert plan.returncode == 0 and "Traceback" not in plan.stderr and "skip bios: not checked (redfish" in plan.stderr
    finally:
        server.shutdown()
        server.server_close()


# -- the Python API a transformers user calls ----------------------------------------------

def test_a_dispatch_table_path_that_is_a_directory_is_a_table_error_naming_it(tmp_path):
    # Before: IsADirectoryError "[Errno 21] Is a directory: 3" (the descriptor, not the path).
    from kernelsearch.dispatch import DispatchTable, TableError

    with pytest.raises(TableError, match=f"^{tmp_path}: not a regular file \\(a directory\\)$"):
        DispatchTable.load(tmp_path)


@pytest.mark.parametrize("model", [None, "meta-llama/Llama-3.1-8B", 5])
def test_patch_given_something_other_than_a_model_is_a_type_error(model):
    # Before: patch(None) returned a report blaming a missing dispatch table, patch("name") one
    # saying "model class str ... stays stock".
    from kernelsearch.dispatch import DispatchTable
    from kernelsearch.integrations.transformers import patch

    with pytest.raises(TypeError, match=f"^model: expected a transformers model .*got {type(model).__name__}$"):
        patch(model, table=DispatchTable.empty())


def test_a_journal_no_rollback_can_read_says_how_to_go_on(tmp_path):
    # Before: rollback said the entries 'stay in journal.json' and apply stayed refused (exit 3),
    # with nothing naming the way out.
    import shlex

    sim = make_sim(tmp_path)
    run_hwtune("--sim", sim, "apply", "-p", "throughput", check=True)
    journal = tmp_path / "host.json.state" / "journal.json"
    journal.write_text("garbage\n")
    proc = run_hwtune("--sim", sim, "rollback")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert "put those settings back by hand" in line and "`hwtune status`" in line
    mv = shlex.split(line.split("e.g. ", 1)[1].split(";", 1)[0])
    assert mv[:2] == ["mv", str(journal)]
    assert run_hwtune("--sim", sim, "apply", "-p", "throughput").returncode == 3
    os.rename(mv[1], mv[2])
    run_hwtune("--sim", sim, "apply", "-p", "throughput", check=True)


def test_sim_init_makes_only_hosts_every_command_can_read(tmp_path):
    # Before: --gpus 9 gave the ninth GPU bus 0x109, not a PCI address, so every command refused
    # the file sim init had just written; --gpus 100000 wrote 242 MB that no command would read
    # (larger than 64 MiB); demo --gpus 100 ran each step into that refusal.
    for gpus in (9, 64):
        sim = tmp_path / f"h{gpus}.json"
        run_hwtune("sim", "init", sim, "--gpus", gpus, check=True)
        status = json.loads(run_hwtune("--sim", sim, "status", "--json", check=True).stdout)
        assert len(status["gpus"]) == gpus and len({f["bdf"] for f in status["pcie"]}) == gpus + 1
    for args, why in ((("--gpus", "65"), "--gpus 65: at most 64 (a simulated host is one node)"),
                      (("--cpus", "5000"), "--cpus 5000: 1 to 4096")):
        assert _one_line_error(run_hwtune("sim", "init", tmp_path / "big.json", *args), 2) == f"hwtune sim: {why}"
        assert not (tmp_path / "big.json").exists()
    demo = run_hwtune("demo", "--gpus", "100", "--out", tmp_path / "demo")
    assert _one_line_error(demo, 2) == "hwtune demo: --gpus 100: 1 to 64" and not (tmp_path / "demo").exists()


def test_demo_gpus_that_an_earlier_demos_host_does_not_have_is_refused_not_ignored(tmp_path):
    # Before: the demo reused hwtune-demo/host.json (sim init skipped) and --gpus 4 was ignored unsaid.
    out = tmp_path / "demo"
    run_hwtune("sim", "init", out / "host.json", "--gpus", "2", check=True)
    before = (out / "host.json").read_text()
    demo = run_hwtune("demo", "--gpus", "4", "--out", out)
    assert _one_line_error(demo, 2) == (f"hwtune demo: --gpus 4: the simulated host {out / 'host.json'} has 2 "
                                        "GPU(s) and the demo uses it as it is; remove it, or choose another --out, for 4")
    assert (out / "host.json").read_text() == before and not (out / "logs").exists()
