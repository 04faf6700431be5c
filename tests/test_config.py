import os
from pathlib import Path

import pytest

from daemon.config import Config, load_config
from hwtune.errors import UsageError

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="the secure-owner check needs files owned by root")


def _write(tmp_path, text, mode=0o600):
    path = tmp_path / "hwtune.yaml"
    path.write_text(text)
    os.chmod(path, mode)
    return path


def test_empty_config_gives_the_documented_defaults():
    c = Config.from_dict({}, "x.yaml")
    assert c.profile is None
    assert c.poll_interval_s == 5
    assert c.rollback == "on_exit"
    assert c.reapply_min_interval_s == 60
    assert (c.metrics.enabled, c.metrics.address, c.metrics.port) == (True, "127.0.0.1", 9835)
    assert c.dispatch_table is None
    assert c.agent_user == "nobody"
    assert c.thermal.max_temperature_c == 87
    assert c.restore_on == ("thermal", "power_brake", "xid")


@needs_root
def test_full_config_is_read_into_frozen_values(tmp_path):
    path = _write(tmp_path, """
profile: efficiency
poll_interval_s: 1.5
rollback: never
reapply_min_interval_s: 10
metrics: {enabled: false, address: 0.0.0.0, port: 0}
dispatch_table: /var/lib/hwtune/dispatch.json
agent_user: nobody
thermal: {max_temperature_c: 80}
restore_on: [xid]
""")
    c = load_config(path)
    assert c.profile == "efficiency" and c.poll_interval_s == 1.5 and c.rollback == "never"
    assert c.metrics.enabled is False and c.metrics.port == 0
    assert c.dispatch_table == Path("/var/lib/hwtune/dispatch.json")
    assert c.agent_user == "nobody" and c.thermal.max_temperature_c == 80
    assert c.restore_on == ("xid",)
    assert c.source == str(path)
    assert c.to_json()["dispatch_table"] == "/var/lib/hwtune/dispatch.json"
    with pytest.raises(AttributeError):
        c.profile = "other"


def test_unknown_key_is_refused_with_did_you_mean():
    with pytest.raises(UsageError, match=r"x.yaml: pol_interval_s: unknown key \(did you mean 'poll_interval_s'\?\)"):
        Config.from_dict({"pol_interval_s": 3}, "x.yaml")
    with pytest.raises(UsageError, match=r"metrics.prot: unknown key \(did you mean 'port'\?\)"):
        Config.from_dict({"metrics": {"prot": 1}}, "x.yaml")


def test_bad_values_are_refused_naming_the_key():
    with pytest.raises(UsageError, match=r"rollback: 'on-exit' .*did you mean 'on_exit'"):
        Config.from_dict({"rollback": "on-exit"}, "x.yaml")
    with pytest.raises(UsageError, match=r"restore_on: unknown event 'thermals'"):
        Config.from_dict({"restore_on": ["thermals"]}, "x.yaml")
    with pytest.raises(UsageError, match=r"metrics.port"):
        Config.from_dict({"metrics": {"port": 70000}}, "x.yaml")
    with pytest.raises(UsageError, match=r"poll_interval_s: expected a number"):
        Config.from_dict({"poll_interval_s": "5s"}, "x.yaml")
    with pytest.raises(UsageError, match=r"agent_user: must be an unprivileged user"):
        Config.from_dict({"agent_user": "root"}, "x.yaml")


@needs_root
@pytest.mark.parametrize("mode", [0o620, 0o602, 0o666])
def test_group_or_world_writable_config_is_refused(tmp_path, mode):
    path = _write(tmp_path, "profile: throughput\n", mode)
    with pytest.raises(UsageError) as err:
        load_config(path)
    assert str(path) in str(err.value) and f"{mode:04o}" in str(err.value)
    assert "refusing" in str(err.value)


@needs_root
def test_config_not_owned_by_root_is_refused(tmp_path):
    path = _write(tmp_path, "profile: throughput\n")
    os.chown(path, 65534, -1)
    with pytest.raises(UsageError, match=r"owned by uid 65534, must be owned by root"):
        load_config(path)


@needs_root
def test_a_user_running_hwtune_may_use_a_config_of_their_own_but_not_another_users(tmp_path, monkeypatch):
    # `hwtune --sim HOST daemon --config mine.yaml` as a user drives only that user's actions:
    # it was refused 'must be owned by root', while apply --config took the same file.
    import daemon.config

    path = _write(tmp_path, "profile: throughput\n")
    os.chown(path, 65534, -1)
    monkeypatch.setattr(daemon.config.os, "geteuid", lambda: 65534)
    assert load_config(path).profile == "throughput"
    os.chown(path, 65533, -1)
    with pytest.raises(UsageError, match=r"owned by uid 65533, must be owned by root or uid 65534"):
        load_config(path)


def test_insecure_config_is_read_when_the_check_is_off(tmp_path):
    path = _write(tmp_path, "profile: throughput\n", 0o666)
    assert load_config(path, require_secure=False).profile == "throughput"


def test_malformed_yaml_and_missing_file_are_clear_errors(tmp_path):
    path = _write(tmp_path, "profile: [unclosed\n")
    with pytest.raises(UsageError, match=r"hwtune.yaml:\d+: malformed YAML"):
        load_config(path, require_secure=False)
    with pytest.raises(UsageError, match=r"nope.yaml: config file not found"):
        load_config(tmp_path / "nope.yaml")
