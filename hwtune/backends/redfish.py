"""BIOS attributes read from the BMC over Redfish (sushy). Read only: BIOS is checked, never
written (a BIOS change needs a reboot that hwtune does not own).

Also `bios_from_config`, which turns a profile's `bios:` section into one of the BIOS
backends (Redfish here, racadm / ilorest in hwtune.backends.vendor).
"""
from __future__ import annotations

import difflib
import json
import stat
import threading
from pathlib import Path
from typing import Any, Mapping

import yaml

from hwtune import redact
from hwtune.errors import HwtuneError, UsageError

BIOS_SOURCES = ("redfish", "racadm", "ilorest")
# Keys a profile's `bios:` section may carry (the profile loader can reuse this list).
BIOS_SECTION_KEYS = ("source", "endpoint", "credentials_file", "system_id", "command", "expect", "verify_tls",
                     "allow_insecure_http")


class BiosError(HwtuneError):
    """The BIOS attributes could not be read (BMC unreachable, tool missing, bad output)."""


class RedfishBios:
    """`Bios.Attributes` of one ComputerSystem. Connects on first `attributes()` call, so
    building one (e.g. for `hwtune plan`) costs no network round trip.

    Credentials written into the URL (https://user:pass@bmc) are taken out of it: the
    endpoint kept, and named in every message, carries none. Plain http with credentials
    is refused unless allow_insecure_http (the profile's bios.allow_insecure_http: true)."""

    source = "redfish"

    def __init__(self, endpoint: str, username: str | None = None, password: str | None = None,
                 system_id: str | None = None, verify_tls: bool | str = True,
                 timeout_s: float = 30, allow_insecure_http: bool = False, deadline_s: float = 40):
        if not isinstance(endpoint, str) or "://" not in endpoint:
            raise UsageError(f"bios.endpoint={redact.text(str(endpoint))[:80]!r}: expected a URL such as "
                             "https://bmc.example")
        try:
            bare, url_user, url_password = redact.split_url(endpoint.strip())
        except ValueError:
            raise UsageError(f"bios.endpoint={redact.text(endpoint)[:80]!r}: not a valid URL") from None
        self.endpoint = bare.rstrip("/")
        username = username if username is not None else url_user
        password = password if password is not None else url_password
        self.username, self.password = username, password
        scheme = self.endpoint.split("://", 1)[0].lower()
        if scheme not in ("http", "https"):
            raise UsageError(f"bios.endpoint={self.endpoint!r}: expected an https:// URL")
        if scheme == "http" and (username or password) and not allow_insecure_http:
            raise UsageError(f"bios.endpoint={self.endpoint!r}: plain http would send the BMC credentials "
                             "in clear text; use https://, or set bios.allow_insecure_http: true")
        self.system_id = system_id
        self.verify_tls = verify_tls
        self.timeout_s = timeout_s
        self.deadline_s = deadline_s

    def __repr__(self) -> str:
        return f"RedfishBios({self.endpoint!r}, system_id={self.system_id!r})"

    def _base_url(self) -> str:
        # sushy wants the service root; accept the bare BMC address too.
        return self.endpoint if self.endpoint.endswith("/redfish/v1") else self.endpoint + "/redfish/v1"

    def _connect(self):
        import sushy

        # A BMC without authentication (a lab mockup) still gets strings: requests rejects None.
        kwargs: dict[str, Any] = dict(username=self.username or "", password=self.password or "",
                                      verify=self.verify_tls)
        # A BMC that does not answer must fail a check quickly rather than hang `hwtune plan`;
        # sushy's default retries 5xx answers 10 times, 3 s apart.
        tuning = dict(connect_timeout=min(10, self.timeout_s), read_timeout=self.timeout_s,
                      server_side_retries=1, server_side_retries_delay=1)
        try:
            return sushy.Sushy(self._base_url(), **kwargs, **tuning)
        except TypeError:
            # Older sushy without the timeout / retry arguments.
            return sushy.Sushy(self._base_url(), **kwargs)

    def _system(self, conn):
        collection = conn.get_system_collection()
        paths = sorted(collection.members_identities)
        if not paths:
            raise BiosError(f"redfish {self.endpoint}: the BMC reports no ComputerSystem")
        if self.system_id is None:
            if len(paths) > 1:
                ids = ", ".join(p.rstrip("/").rsplit("/", 1)[-1] for p in paths)
                raise BiosError(f"redfish {self.endpoint}: {len(paths)} systems ({ids}); "
                                f"set bios.system_id to the one to check")
            return conn.get_system(paths[0])
        for path in paths:
            if path.rstrip("/").rsplit("/", 1)[-1] == self.system_id or path.rstrip("/") == self.system_id.rstrip("/"):
                return conn.get_system(path)
        ids = [p.rstrip("/").rsplit("/", 1)[-1] for p in paths]
        close = difflib.get_close_matches(self.system_id, ids, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise BiosError(f"redfish {self.endpoint}: no system {self.system_id!r}{hint}; systems: {', '.join(ids)}")

    def attributes(self) -> dict[str, str | int | bool]:
        """The attributes within `deadline_s` in all: requests' read timeout is per socket
        read, so a BMC that trickles a byte a second would otherwise hold plan, apply and
        verify for ever. The reader runs in a daemon thread left behind on timeout."""
        box: dict = {}

        def read() -> None:
            try:
                box["attributes"] = self._attributes()
            except BaseException as exc:  # handed to the caller below
                box["error"] = exc

        reader = threading.Thread(target=read, name="redfish-bios", daemon=True)
        reader.start()
        reader.join(self.deadline_s)
        if reader.is_alive():
            raise BiosError(f"redfish {self.endpoint}: no complete answer within {self.deadline_s:g} s "
                            "(the BMC answers too slowly)")
        if "error" in box:
            raise box["error"]
        return box["attributes"]

    def _attributes(self) -> dict[str, str | int | bool]:
        import sushy.exceptions as sx

        try:
            conn = self._connect()
            system = self._system(conn)
            try:
                bios = system.bios
            except sx.MissingAttributeError:
                raise BiosError(f"redfish {self.endpoint}: system {system.identity} has no Bios resource") from None
            attrs = bios.attributes
        except BiosError:
            raise
        except ImportError:
            raise BiosError("redfish: the sushy package is not installed (pip install sushy)") from None
        except sx.AccessError as exc:
            raise BiosError(f"redfish {self.endpoint}: access denied (check bios.credentials_file): "
                            f"{_short(exc, secrets=(self.password,))}") from None
        except sx.ConnectionError as exc:
            raise BiosError(f"redfish {self.endpoint}: BMC unreachable: {_short(exc, secrets=(self.password,))}") from None
        except sx.SushyError as exc:
            raise BiosError(f"redfish {self.endpoint}: {type(exc).__name__}: {_short(exc, secrets=(self.password,))}") from None
        except Exception as exc:  # an odd answer (a 401 with an HTML body, a broken JSON): one line
            raise BiosError(f"redfish {self.endpoint}: unexpected answer ({type(exc).__name__}: "
                            f"{_short(exc, 200, secrets=(self.password,))})") from None
        if not isinstance(attrs, dict) and attrs is not None:
            raise BiosError(f"redfish {self.endpoint}: the Bios Attributes are not an object")
        if attrs is None:
            raise BiosError(f"redfish {self.endpoint}: the Bios resource carries no Attributes")
        try:  # Python's json took them as floats; --json output holding them is no JSON
            json.dumps(attrs, allow_nan=False)
        except ValueError:
            raise BiosError(f"redfish {self.endpoint}: the Bios Attributes hold NaN or Infinity, "
                            "which is not JSON") from None
        return dict(attrs)


def _short(exc: Exception, limit: int = 300, secrets=()) -> str:
    text = redact.text(" ".join(str(exc).split()), secrets)
    return text if len(text) <= limit else text[:limit] + "..."


def read_credentials(path: Path) -> dict[str, Any]:
    """`username`, `password`, `verify_tls` (bool or a CA bundle path) from a YAML file that
    other users cannot read (it holds the BMC password)."""
    from hwtune import yamlguard

    try:
        raw, st = yamlguard.read_input(path)
    except yamlguard.Unreadable as exc:
        raise UsageError(f"bios.credentials_file {path}: {exc.problem}") from None
    mode = stat.S_IMODE(st.st_mode)
    if mode & stat.S_IRWXO:
        raise UsageError(f"bios.credentials_file {path}: mode {mode:04o} lets every user read the BMC "
                         f"password; chmod o-rwx {path}")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise UsageError(f"bios.credentials_file {path}: not UTF-8 text") from None
    try:
        yamlguard.check(text)  # aliases, deep nesting: refused before the loader expands them
        data = yaml.safe_load(text) or {}
    except yamlguard.Refused as exc:
        where = f"{path}:{exc.line}" if exc.line else str(path)
        raise UsageError(f"bios.credentials_file {where}: {exc.problem}") from None
    except yaml.YAMLError as exc:
        raise UsageError(f"bios.credentials_file {path}: malformed YAML: {getattr(exc, 'problem', exc)}") from None
    if not isinstance(data, dict):
        raise UsageError(f"bios.credentials_file {path}: expected a mapping with username, password")
    known = ("username", "password", "verify_tls")
    for key in data:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise UsageError(f"bios.credentials_file {path}: {key}: unknown key{hint}")
    verify = data.get("verify_tls", True)
    if not isinstance(verify, (bool, str)):
        raise UsageError(f"bios.credentials_file {path}: verify_tls: expected true, false or a CA bundle path")
    return {"username": data.get("username"), "password": data.get("password"), "verify_tls": verify}


def _verify_value(value: Any) -> bool | str:
    # true/false, or a CA bundle path; profiles may spell the booleans as text.
    if isinstance(value, str) and value.strip().lower() in ("true", "yes", "on", "false", "no", "off"):
        return value.strip().lower() in ("true", "yes", "on")
    if not isinstance(value, (bool, str)):
        raise UsageError(f"bios.verify_tls={value!r}: expected true, false or a CA bundle path")
    return value


def bios_from_config(section: Any, base_dir: Path | str | None = None):
    """Build the BIOS backend a profile's `bios:` section asks for. `section` is a mapping
    (or an object with the same attributes); a relative credentials_file is taken from
    `base_dir` (the profile's directory)."""
    def get(key: str, default: Any = None) -> Any:
        if isinstance(section, Mapping):
            return section.get(key, default)
        return getattr(section, key, default)

    if isinstance(section, Mapping):
        for key in section:
            if key not in BIOS_SECTION_KEYS:
                close = difflib.get_close_matches(str(key), BIOS_SECTION_KEYS, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise UsageError(f"bios.{key}: unknown key{hint}")
    source = get("source") or "redfish"
    if source not in BIOS_SOURCES:
        close = difflib.get_close_matches(str(source), BIOS_SOURCES, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise UsageError(f"bios.source={source!r}: expected one of {', '.join(BIOS_SOURCES)}{hint}")
    if source in ("racadm", "ilorest"):
        from hwtune.backends.vendor import IloRestBios, RacadmBios

        cls = RacadmBios if source == "racadm" else IloRestBios
        return cls(command=get("command"))
    endpoint = get("endpoint")
    if not endpoint:
        raise UsageError("bios.endpoint: required for source redfish (e.g. https://bmc.example)")
    creds: dict[str, Any] = {"username": None, "password": None, "verify_tls": True}
    cred_file = get("credentials_file")
    if cred_file:
        path = Path(cred_file)
        if not path.is_absolute() and base_dir is not None:
            path = Path(base_dir) / path
        creds = read_credentials(path)
    if get("verify_tls") is not None:
        # The profile may pin it per BMC; it wins over the credentials file.
        creds["verify_tls"] = _verify_value(get("verify_tls"))
    allow_http = get("allow_insecure_http")
    if allow_http is not None and not isinstance(allow_http, bool):
        raise UsageError("bios.allow_insecure_http: expected true or false")
    return RedfishBios(str(endpoint), creds["username"], creds["password"],
                       system_id=get("system_id"), verify_tls=creds["verify_tls"],
                       allow_insecure_http=bool(allow_http))
