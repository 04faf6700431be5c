import json
import os
import socket
import stat

import pytest

from hwtune.backends.redfish import BiosError, RedfishBios, bios_from_config
from hwtune.backends.vendor import IloRestBios, RacadmBios, parse_racadm, racadm_groups
from hwtune.engine import Change
from hwtune.errors import UsageError
from hwtune.knobs.bios import check, read_and_check
from tests.redfish_server import MOCKUP, redfish_server  # noqa: F401  (fixture)

SYSTEM_ID = "437XR1138R2"


def mockup_attributes() -> dict:
    path = MOCKUP / "Systems" / SYSTEM_ID / "Bios" / "index.json"
    if not path.exists():
        pytest.skip(f"Redfish mockup not found at {MOCKUP} (set HWTUNE_SHARED)")
    return json.loads(path.read_text())["Attributes"]


# -- Redfish against a real sushy-static server ---------------------------------------------

def test_redfish_reads_the_mockup_bios_attributes(redfish_server):
    bios = RedfishBios(redfish_server.url, "admin", "secret", allow_insecure_http=True)  # the test server is http
    attrs = bios.attributes()
    assert attrs == mockup_attributes()
    assert attrs["PowerProfile"] == "MaxPerf" and attrs["ProcCoreDisable"] == 0
    assert bios.source == "redfish"


def test_matching_expect_gives_no_changes(redfish_server):
    bios = RedfishBios(redfish_server.url + "/redfish/v1", system_id=SYSTEM_ID)
    expect = {"PowerProfile": "MaxPerf", "ProcTurboMode": "Enabled", "ProcCoreDisable": 0,
              "ProcHyperthreading": "Enabled"}
    assert read_and_check(bios, expect) == []


def test_mismatching_expect_lists_each_difference_old_to_new(redfish_server):
    bios = RedfishBios(redfish_server.url)
    expect = {"PowerProfile": "PerfPerWattOptimizedOs", "ProcTurboMode": "Enabled",
              "ProcHyperthreading": "Disabled"}
    changes = read_and_check(bios, expect)
    assert [c.to_json() for c in changes] == [
        {"target": "bios", "knob": "PowerProfile", "old": "MaxPerf", "new": "PerfPerWattOptimizedOs",
         "family": "bios"},
        {"target": "bios", "knob": "ProcHyperthreading", "old": "Enabled", "new": "Disabled", "family": "bios"},
    ]


def test_unknown_system_id_is_an_error_with_did_you_mean(redfish_server):
    with pytest.raises(BiosError, match=r"no system '437XR1138R3' \(did you mean '437XR1138R2'\?\)"):
        RedfishBios(redfish_server.url, system_id="437XR1138R3").attributes()


def test_unreachable_bmc_is_a_clear_error_naming_the_endpoint():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once closed
    endpoint = f"http://127.0.0.1:{port}"
    with pytest.raises(BiosError) as err:
        RedfishBios(endpoint, timeout_s=5).attributes()
    message = str(err.value)
    assert message.startswith(f"redfish {endpoint}: BMC unreachable")
    assert "Traceback" not in message and len(message) < 500


def test_a_bmc_that_trickles_its_answer_is_cut_off_at_the_deadline_not_waited_for_ever():
    # requests' read timeout is per socket read: one byte a second never trips it.
    import threading
    import time

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    stop = threading.Event()

    def trickle():
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            try:
                conn.recv(65536)
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 99999\r\n\r\n")
                while not stop.is_set():
                    conn.sendall(b" ")
                    time.sleep(0.5)
            except OSError:
                pass
            finally:
                conn.close()

    threading.Thread(target=trickle, daemon=True).start()
    endpoint = f"http://127.0.0.1:{server.getsockname()[1]}"
    started = time.monotonic()
    try:
        with pytest.raises(BiosError, match=r"no complete answer within 3 s"):
            RedfishBios(endpoint, timeout_s=2, deadline_s=3).attributes()
        assert time.monotonic() - started < 10
    finally:
        stop.set()
        server.close()


def test_bios_from_config_reads_credentials_file_relative_to_the_profile(redfish_server, tmp_path):
    creds = tmp_path / "bmc.yaml"
    creds.write_text("username: admin\npassword: secret\nverify_tls: false\n")
    creds.chmod(0o600)
    bios = bios_from_config({"source": "redfish", "endpoint": redfish_server.url,
                             "credentials_file": "bmc.yaml", "expect": {"BootMode": "Uefi"},
                             "allow_insecure_http": True}, tmp_path)
    assert isinstance(bios, RedfishBios)
    assert (bios.username, bios.password, bios.verify_tls) == ("admin", "secret", False)
    assert check({"BootMode": "Uefi"}, bios.attributes()) == []


def test_world_readable_credentials_file_is_refused(tmp_path):
    creds = tmp_path / "bmc.yaml"
    creds.write_text("username: admin\npassword: secret\n")
    creds.chmod(0o644)
    with pytest.raises(UsageError, match=r"bmc.yaml: mode 0644 lets every user read the BMC password"):
        bios_from_config({"endpoint": "https://bmc.example", "credentials_file": str(creds)})


@pytest.mark.parametrize("how", ["fifo", "not-utf8", "anchors"])
def test_a_credentials_file_that_is_a_fifo_not_utf8_or_uses_anchors_is_one_line(tmp_path, how):
    from conftest import run_hwtune

    creds = tmp_path / "bmc.yaml"
    if how == "fifo":
        os.mkfifo(creds, 0o600)  # nobody writes it: reading would wait forever
    elif how == "not-utf8":
        creds.write_bytes(b"username: \"\xff\"\npassword: secret\n")
    else:
        creds.write_text("u: &u admin\nusername: *u\npassword: secret\n")
    creds.chmod(0o600)
    prof = tmp_path / "p.yaml"
    prof.write_text(f"bios:\n  endpoint: https://127.0.0.1:1\n  credentials_file: {creds}\n"
                    "  expect: {PowerProfile: MaxPerf}\n")
    r = run_hwtune("--sysfs-root", tmp_path, "--state-dir", tmp_path / "s", "plan", "-p", prof, timeout=30)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    line = r.stderr.strip().splitlines()[-1]
    assert "bios.credentials_file" in line and {"fifo": "not a regular file", "not-utf8": "not UTF-8",
                                                 "anchors": "anchors"}[how] in line, line


def test_bios_from_config_rejects_bad_sections():
    with pytest.raises(UsageError, match=r"bios.source='redfsh'.*did you mean 'redfish'"):
        bios_from_config({"source": "redfsh", "endpoint": "https://bmc"})
    with pytest.raises(UsageError, match=r"bios.endpont: unknown key \(did you mean 'endpoint'\?\)"):
        bios_from_config({"endpont": "https://bmc"})
    with pytest.raises(UsageError, match=r"bios.endpoint: required"):
        bios_from_config({"source": "redfish"})
    assert isinstance(bios_from_config({"source": "racadm"}), RacadmBios)
    assert isinstance(bios_from_config({"source": "ilorest", "command": "/opt/ilorest"}), IloRestBios)


# -- check() semantics ------------------------------------------------------------------------

def test_attribute_the_bmc_does_not_report_is_a_mismatch_with_did_you_mean():
    changes = check({"procTurboMode": "Enabled", "SriovGlobalEnable": "Enabled"}, mockup_attributes())
    assert changes[0].to_json() == {"target": "bios", "knob": "procTurboMode", "old": None, "new": "Enabled",
                                    "family": "bios",
                                    "note": "not reported by the BMC; did you mean 'ProcTurboMode'?"}
    assert isinstance(changes[0], Change)
    assert str(changes[0]).startswith("bios procTurboMode: None -> Enabled (not reported")
    assert changes[1].old is None and changes[1].note == "not reported by the BMC"


def test_values_compare_by_text_but_case_and_bool_int_stay_distinct():
    attrs = {"ProcCoreDisable": "0", "X2Apic": "On", "Flag": 1, "Mode": "maxperf"}
    assert check({"ProcCoreDisable": 0}, attrs) == []       # racadm text vs YAML int
    assert check({"X2Apic": True}, attrs) == []              # YAML 1.1 reads `On` as true
    assert len(check({"Flag": True}, attrs)) == 1
    [case] = check({"Mode": "MaxPerf"}, attrs)
    assert "differs only in letter case" in case.note


# -- vendor tools: parsers on sample outputs --------------------------------------------------

RACADM_SYSPROFILE = """\
[Key=BIOS.Setup.1-1#SysProfileSettings]
#ProcPwrPerf=MaxPerf
SysProfile=PerfOptimized
ProcTurboMode=Enabled (Pending Value=Disabled)
#ProcC1E=Disabled
MemFrequency=MaxPerf

"""

RACADM_PROC = """\
Security Alert: Certificate is invalid - self signed certificate
Continuing execution. Use -S option for racadm to stop execution on certificate-related errors.
[Key=BIOS.Setup.1-1#ProcSettings]
LogicalProc=Enabled
ProcVirtualization=Enabled
ProcCores=All
"""


def test_racadm_key_value_output_is_parsed_with_current_not_pending_values():
    attrs = parse_racadm(RACADM_SYSPROFILE + RACADM_PROC)
    assert attrs == {"ProcPwrPerf": "MaxPerf", "SysProfile": "PerfOptimized", "ProcTurboMode": "Enabled",
                     "ProcC1E": "Disabled", "MemFrequency": "MaxPerf", "LogicalProc": "Enabled",
                     "ProcVirtualization": "Enabled", "ProcCores": "All"}
    bios = RacadmBios(text=RACADM_SYSPROFILE)
    assert bios.source == "racadm"
    assert check({"SysProfile": "PerfOptimized", "ProcTurboMode": "Disabled"}, bios.attributes())[0].old == "Enabled"


def test_racadm_get_bios_group_listing_is_recognised():
    listing = "BIOS.BiosBootSettings\nBIOS.ProcSettings\nBIOS.SysProfileSettings\n"
    assert racadm_groups(listing) == ["BIOS.BiosBootSettings", "BIOS.ProcSettings", "BIOS.SysProfileSettings"]
    assert parse_racadm(listing) == {}


def test_racadm_runs_the_tool_per_group(tmp_path):
    # A stand-in racadm on disk: the real tool only exists on Dell hosts.
    fake = tmp_path / "racadm"
    fake.write_text("#!/bin/sh\n"
                    "if [ \"$2\" = BIOS ]; then printf 'BIOS.ProcSettings\\nBIOS.SysProfileSettings\\n'; "
                    "elif [ \"$2\" = BIOS.ProcSettings ]; then printf 'LogicalProc=Enabled\\n'; "
                    "else printf '[Key=BIOS.Setup.1-1#SysProfileSettings]\\nSysProfile=PerfOptimized\\n'; fi\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    assert RacadmBios(command=str(fake)).attributes() == {"LogicalProc": "Enabled", "SysProfile": "PerfOptimized"}


ILOREST_JSON = """\
Discovering data...Done
{
  "@odata.type": "#Bios.v1_0_4.Bios",
  "Attributes": {
    "@odata.id": "/redfish/v1/systems/1/bios/",
    "WorkloadProfile": "HighPerformanceCompute",
    "ProcHyperthreading": "Disabled",
    "ProcTurbo": "Enabled",
    "MinProcIdlePower": "NoCStates",
    "NumaGroupSizeOpt": "Clustered",
    "SriovGlobalEnable": "Enabled"
  }
}
"""


def test_ilorest_json_output_is_parsed():
    bios = IloRestBios(text=ILOREST_JSON)
    attrs = bios.attributes()
    assert attrs["WorkloadProfile"] == "HighPerformanceCompute" and "@odata.id" not in attrs
    assert check({"ProcTurbo": "Enabled", "MinProcIdlePower": "NoCStates"}, attrs) == []
    as_list = IloRestBios(text=json.dumps([{"Attributes": {"ProcTurbo": "Disabled"}}])).attributes()
    assert as_list == {"ProcTurbo": "Disabled"}


def test_ilorest_garbage_output_is_a_clear_error():
    with pytest.raises(BiosError, match="ilorest: no JSON in the output"):
        IloRestBios(text="Error: not logged in\n").attributes()


def test_missing_vendor_tool_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(BiosError, match=r"racadm: 'racadm' not found on PATH"):
        RacadmBios().attributes()
    with pytest.raises(BiosError, match=r"ilorest: 'ilorest' not found on PATH"):
        IloRestBios().attributes()


def test_failing_vendor_tool_reports_its_exit_status(tmp_path):
    fake = tmp_path / "ilorest"
    fake.write_text("#!/bin/sh\necho 'No session found' >&2\nexit 3\n")
    fake.chmod(0o755)
    with pytest.raises(BiosError, match=r"exited 3: No session found"):
        IloRestBios(command=[str(fake)]).attributes()


def test_a_loaded_profile_bios_section_builds_a_working_reader(redfish_server, tmp_path):
    from hwtune import profiles

    (tmp_path / "bmc.yaml").write_text("username: admin\npassword: secret\n")
    (tmp_path / "bmc.yaml").chmod(0o600)
    path = tmp_path / "mine.yaml"
    path.write_text(f"bios:\n  source: redfish\n  endpoint: {redfish_server.url}\n"
                    f"  credentials_file: bmc.yaml\n  verify_tls: false\n  allow_insecure_http: true\n"
                    f"  expect: {{PowerProfile: MaxPerf, ProcTurboMode: Disabled}}\n")
    profile = profiles.load(str(path))
    bios = bios_from_config(profile.bios, profile.bios.base_dir)
    assert bios.username == "admin" and bios.verify_tls is False
    changes = check(dict(profile.bios.expect), bios.attributes())
    assert [(c.knob, c.old, c.new) for c in changes] == [("ProcTurboMode", "Enabled", "Disabled")]


def _serve_bios(body: bytes):
    """A plain HTTP BMC whose Bios resource answers `body`; (endpoint, server)."""
    import http.server
    import threading

    docs = {"/redfish/v1": {"@odata.id": "/redfish/v1/", "Id": "RootService", "Name": "Root",
                            "RedfishVersion": "1.6.0", "UUID": "92384634-2938-2342-8820-489239905423",
                            "Systems": {"@odata.id": "/redfish/v1/Systems"}},
            "/redfish/v1/Systems": {"@odata.id": "/redfish/v1/Systems", "Name": "Systems",
                                    "Members": [{"@odata.id": "/redfish/v1/Systems/1"}]},
            "/redfish/v1/Systems/1": {"@odata.id": "/redfish/v1/Systems/1", "Id": "1", "Name": "s",
                                      "Bios": {"@odata.id": "/redfish/v1/Systems/1/Bios"}}}

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            path = self.path.rstrip("/")
            answer = body if path.endswith("/Bios") else json.dumps(docs.get(path, {})).encode()
            self.send_response(200 if path.endswith("/Bios") or path in docs else 404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}", server


@pytest.mark.parametrize("value", [b"NaN", b"Infinity", b"-Infinity", b'{"Deep": [NaN]}'])
def test_a_bmc_answering_nan_is_not_checked_and_json_output_stays_json(tmp_path, value):
    # Before: Python's json took the BMC's NaN as a float, so plan/apply/verify --json printed
    # `"old": NaN` -- not JSON (jq and every strict parser refuse the whole document).
    from conftest import run_hwtune
    from fixtures.sysfs_tree import build

    endpoint, server = _serve_bios(b'{"@odata.id": "/redfish/v1/Systems/1/Bios", "Id": "Bios", "Name": "b", '
                                   b'"Attributes": {"PowerProfile": ' + value + b', "ProcTurboMode": "Enabled"}}')
    try:
        build(tmp_path / "sys")
        prof = tmp_path / "p.yaml"
        prof.write_text(f"bios:\n  endpoint: {endpoint}\n  expect: {{PowerProfile: MaxPerf}}\n")
        for command in ("verify", "plan", "apply"):
            r = run_hwtune("--sysfs-root", tmp_path / "sys", "--state-dir", tmp_path / "s", command, "-p", prof,
                           "--json", timeout=60)
            assert "Traceback" not in r.stderr, r.stderr
            doc = json.loads(r.stdout, parse_constant=lambda c: pytest.fail(f"{command} --json printed {c}"))
            assert "NaN or Infinity" in json.dumps(doc), doc
            if command == "verify":
                assert r.returncode == 1 and doc["matches"] is False
    finally:
        server.shutdown()


def test_ilorest_output_holding_nan_is_a_clear_error_not_a_float():
    from hwtune.backends.vendor import parse_ilorest

    with pytest.raises(BiosError, match="not valid JSON"):
        parse_ilorest('{"Attributes": {"PowerProfile": NaN}}')
