"""The CPU path is one path (issue 11): one CPU fingerprint whatever TRITON_INTERPRET says, so
the table `search --device cpu` writes is the one `bench` looks up; share without --device
works on a CPU host; the commands' defaults agree and --help shows them."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT, run_hwtune


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


@pytest.fixture(scope="module")
def searched(tmp_path_factory):
    """A tiny CPU search: its JSON result and its state directory."""
    state = tmp_path_factory.mktemp("cpu-path") / "state"
    proc = run_hwtune("--state-dir", state, "search", "rmsnorm", "--device", "cpu", "--budget", "1",
                      "--shape", "M=2,N=64", "--json", timeout=600, env={"TRITON_INTERPRET": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout), state


@pytest.mark.parametrize("interpret", ["0", None])
def test_bench_looks_up_the_table_search_wrote_whatever_triton_interpret_says(searched, interpret, tmp_path):
    doc, state = searched
    env = {"TRITON_INTERPRET": interpret} if interpret is not None else {}
    saved = os.environ.pop("TRITON_INTERPRET", None)
    try:
        proc = run_hwtune("--state-dir", state, "bench", "--device", "cpu", "--variants", "eager", "--shapes", "1x8",
                          "--prefill", "1x8", "--steps", "20", "--warmup", "1", "--json", env=env, timeout=300)
    finally:
        if saved is not None:
            os.environ["TRITON_INTERPRET"] = saved
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = json.loads(proc.stdout)["fingerprint"]["kernel_table"]
    assert table["path"] == doc["table_path"] and table["exists"] is True
    assert doc["fingerprint_id"] in table["path"]


def test_cpu_fingerprint_does_not_depend_on_triton_interpret():
    code = "from kernelsearch.fingerprint import collect, fingerprint_id; print(fingerprint_id(collect('cpu')))"
    ids = set()
    for value in ("0", "1", None):
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        env.pop("TRITON_INTERPRET", None)
        if value is not None:
            env["TRITON_INTERPRET"] = value
        ids.add(subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True,
                               text=True, check=True).stdout.strip())
    assert len(ids) == 1 and ids.pop().startswith("cpu-")


@pytest.mark.skipif(_has_cuda(), reason="a GPU host: no --device means cuda there")
def test_share_export_and_import_without_device_work_on_a_cpu_host(searched, tmp_path):
    doc, state = searched
    bundle = tmp_path / "bundle.json"
    out = run_hwtune("--state-dir", state, "share", "export", "-o", bundle, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(bundle.read_text())["fingerprint_id"] == doc["fingerprint_id"]
    got = run_hwtune("--state-dir", tmp_path / "other", "share", "import", bundle, "--json", timeout=120)
    assert got.returncode == 0, got.stderr
    assert "--force" not in got.stderr and json.loads(got.stdout)["rows_added"] >= 1


def _help(*args) -> str:
    proc = run_hwtune(*args, "--help")
    assert proc.returncode == 0, proc.stderr
    return re.sub(r"\s+", " ", proc.stdout)


def test_defaults_agree_and_help_shows_them():
    from daemon.cli import build_parser

    parser = build_parser()
    device_defaults = {}
    for command in ("search", "check-kernel", "bench"):
        p = parser.command_parsers[command]
        device_defaults[command] = next(a.default for a in p._actions if "--device" in a.option_strings)
    assert set(device_defaults.values()) == {"auto"}, device_defaults
    for args in (("search",), ("check-kernel",), ("bench",), ("share", "export"), ("share", "import")):
        assert "auto (default): cuda when torch sees a GPU, else cpu" in _help(*args), args

    sim_init, demo = _help("sim", "init"), _help("demo")
    n = re.search(r"--gpus GPUS simulated H200 GPUs \(default (\d+)", sim_init)
    m = re.search(r"--gpus GPUS GPUs of the simulated host \(default (\d+)", demo)
    assert n and m and n[1] == m[1]
    assert "FILE.state" in sim_init  # where --sim FILE keeps its state


def _all_parsers():
    from daemon.cli import build_parser

    for name, p in build_parser().command_parsers.items():
        yield name, p
        for a in p._actions:
            if a.__class__.__name__ == "_SubParsersAction":
                for sub_name, sub in a.choices.items():
                    yield f"{name} {sub_name}", sub


def test_every_option_of_every_command_has_help_text_sim_included():
    names = []
    for name, p in _all_parsers():
        names.append(name)
        missing = [a.dest for a in p._actions if a.option_strings and not a.help]
        assert not missing, (name, missing)
    assert {"sim init", "sim set", "sim show", "share export"} <= set(names)


def test_help_shows_valued_defaults():
    assert "(default 12)" in _help("tune")
    assert "(default 270.0)" in _help("bench") and "(default 50)" in _help("bench")
    assert "(default medium)" in _help("search")
    assert "--restore restore the starting settings (default" not in _help("tune")  # flags: no "default True"
