"""bench/kernels_gpu.py: its candidates come from kernelsearch.search only; it times and checks
the peers and the tuned kernel (through the dispatch table) itself. CPU, Triton interpreter."""
import importlib.util
import json
import math
import os
import subprocess
import sys

import torch

from conftest import ROOT

SCRIPT = ROOT / "bench" / "kernels_gpu.py"


def _module():
    spec = importlib.util.spec_from_file_location("kernels_gpu_bench", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _env():
    return dict(os.environ, TRITON_INTERPRET="1",
                PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def test_cpu_quick_run_tables_the_searchs_shapes_with_every_column_checked(tmp_path):
    from kernelsearch.dispatch import DispatchTable
    from kernelsearch.specs import get_spec

    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--quick", "--kernels", "rmsnorm",
                           "--shapes", "1", "--max-configs", "1", "--no-liger", "--out", str(out)], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads((out / "kernels_gpu.json").read_text())
    res = doc["kernels"]["rmsnorm"]
    assert res["search"]["evaluations"] == 1          # --max-configs 1: one point, one child run
    cpu = get_spec("rmsnorm").shapes("cpu")
    assert [r["shape"] for r in res["shapes"]] == [cpu[0]] and doc["liger"] == []
    for row in res["shapes"]:
        cols = row["columns"]
        for name in ("tuned", "eager", "graph", "autotune"):
            assert isinstance(cols[name]["time_ms"], float) and not cols[name].get("wrong"), (name, cols[name])
        assert cols["stock"]["time_ms"] == row["search"]["stock_ms"]   # the harness's own stock time
        assert row["route"] in ("no entry for shape", "empty table")                   # the interpreter never beats torch
        assert cols["tuned"]["routed"]["tuned"] == 0 and cols["tuned"]["routed"]["stock"] > 0
        assert [c["status"] for c in row["configs"]] == ["ok"]
        assert cols["autotune"]["params"] == row["configs"][0]["params"] and cols["autotune"]["tried"] == 1
        for name, x in row["speedup"].items():
            assert math.isclose(x, cols[name]["time_ms"] / cols["tuned"]["time_ms"])
    table = DispatchTable.load(out / "dispatch.json")
    assert table.entries == [] and table.data["fingerprint_id"] == res["search"]["fingerprint_id"]
    text = (out / "tables.txt").read_text()
    assert "## rmsnorm" in text and "stock = torch.nn.functional.rms_norm" in text
    assert "autotune: @triton.autotune's rule" in text and text in proc.stdout


KEPT_DRIVER = r"""
import json, sys, types
from pathlib import Path
import importlib.util
from kernelsearch.harness.verdict import Verdict
from kernelsearch.search import SequentialExecutor

spec = importlib.util.spec_from_file_location("kg", sys.argv[1]); kg = importlib.util.module_from_spec(spec)
spec.loader.exec_module(kg)

class SlowStock(SequentialExecutor):
    # the real harness's verdicts, with stock made 1e6 times slower: what a GPU where the template
    # wins looks like to the keep rule (the interpreter never wins on this machine)
    def map(self, jobs):
        out = []
        for v in super().map(jobs):
            for s in v.shapes:
                s.stock_ms *= 1e6
            out.append(v)
        return out

state = Path(sys.argv[2])
args = types.SimpleNamespace(device="cpu", quick=True, shapes=1, strategy="grid", max_configs=1, no_compile=True)
ceilings = {"copy_gb_s": 10.0, "matmul_tflops": 0.1}
res = kg.run_kernel("rmsnorm", args, state, state / "dispatch.json", ceilings, {}, 120.0, executor=SlowStock())
print(json.dumps(kg.jsonable(res)))
"""


def test_a_kept_winner_is_timed_through_the_dispatch_tables_verified_plan(tmp_path):
    proc = subprocess.run([sys.executable, "-c", KEPT_DRIVER, str(SCRIPT), str(tmp_path)], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    for row in res["shapes"]:
        assert row["kept"] is True and row["route"] == "tuned"
        tuned = row["columns"]["tuned"]
        assert isinstance(tuned["time_ms"], float) and not tuned.get("wrong")
        assert tuned["routed"]["tuned"] > 0 and tuned["routed"]["stock"] == 0
    entries = json.loads((tmp_path / "dispatch.json").read_text())["entries"]
    assert len(entries) == 1 and all(e["plan"] and e["against"] == "torch.nn.functional.rms_norm" for e in entries)


def test_a_wrong_peer_is_marked_and_gets_no_speedup():
    from kernelsearch.specs import get_spec

    kg = _module()
    spec, shape, gen = get_spec("rmsnorm"), {"M": 3, "N": 40}, torch.Generator().manual_seed(0)
    right = kg.column(spec.stock_call, spec, shape, torch.float32, "cpu", gen)
    wrong = kg.column(lambda i: {"out": spec.stock_call(i)["out"] * 1.01}, spec, shape, torch.float32, "cpu", gen)
    broken = kg.column(lambda i: 1 / 0, spec, shape, torch.float32, "cpu", gen)
    assert "wrong" not in right and math.isfinite(right["time_ms"])
    assert "relative L2 error" in wrong["wrong"] and math.isfinite(wrong["time_ms"])
    assert broken["time_ms"] == math.inf and "ZeroDivisionError" in broken["error"]
    x = kg.speedups({"tuned": right, "eager": dict(right), "liger": wrong, "compile": broken})
    assert set(x) == {"eager"} and math.isclose(x["eager"], 1.0)
    assert kg.speedups({"tuned": wrong, "eager": right}) == {}          # a wrong tuned kernel wins nothing


def test_past_its_deadline_the_search_gets_budget_verdicts_and_keeps_nothing(tmp_path):
    from kernelsearch.search import search

    kg = _module()
    result = search("rmsnorm", state_dir=tmp_path, budget=3, device="cpu", shapes=[{"M": 2, "N": 64}],
                    executor=kg.DeadlineExecutor(None, 0.0), ceilings={"copy_gb_s": 1.0, "matmul_tflops": 1.0})
    rep = result.shapes[0]
    assert rep.verdicts == {"budget": 3} and rep.best is None and not rep.kept
    assert kg.ledger_configs(tmp_path, result) == {}     # budget rows are not measurements
