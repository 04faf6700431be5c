"""kernelsearch.stepjudge: a table entry re-timed inside the step against its leading configs from
the ledger and stock; replaced only where the step is faster beyond the current table's own
spread, and only when the timer is a speed."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kernelsearch import stepjudge
from kernelsearch.dispatch import DispatchTable
from kernelsearch.entry import Entry
from kernelsearch.ledger import Ledger
from tests.conftest import ROOT

FP = "fp-test"
SHAPE = {"M": 32, "K": 4096, "N": 4096}
OTHER = {"M": 1, "K": 4096, "N": 4096}
CUDA = "cuda_graph_replay"
CPU = "cpu_interpreter (not a speed)"


class Table(DispatchTable):
    """Every entry routes (no source to load): the judge's bookkeeping without kernels."""

    def usable(self, entry):
        return True


def entry(params, shape=SHAPE, candidate_ms=0.0166, stock_ms=0.0200, source_hash="h1"):
    return Entry.make(kernel="linear_residual", dtype="bfloat16", shape=dict(shape),
                      source={"module": "kernelsearch.kernels.linear_residual"}, source_hash=source_hash,
                      params=params, plan={"steps": []}, candidate_ms=candidate_ms, stock_ms=stock_ms,
                      speedup=round(stock_ms / candidate_ms, 4), against="cuBLAS", noise_band=0.01)


def table_of(*entries, path=None):
    return Table({"format": 1, "fingerprint_id": FP, "entries": list(entries)}, path)


def row(params, candidate_ms, stock_ms=0.0200, shape=SHAPE, accepted=True, source_hash="h1",
        fingerprint=FP, band=0.01, dtype="bfloat16"):
    return {"run_id": "r", "kernel": "linear_residual", "dtype": dtype, "shape": dict(shape),
            "strategy": "grid", "source": "{}", "source_hash": source_hash, "params": params,
            "accepted": accepted, "guard": None if accepted else "correctness", "reason": "",
            "candidate_ms": candidate_ms, "stock_ms": stock_ms, "noise_band": band, "flops": 0,
            "bytes": 0, "fingerprint": fingerprint, "fingerprint_json": {}, "code_version": "c"}


@pytest.fixture
def plans(monkeypatch):
    """The harness's verified launch plan for a ledger config (a real one needs the template's
    source; test_a_ledger_row_the_harness_rejects_is_never_run_in_the_step verifies for real)."""
    import kernelsearch.harness.verify as verify

    made = []

    def verified_plan(kernel, source_path, shape, dtype, params, device, source_hash=None):
        made.append(dict(params))
        if params.get("no_plan"):
            return None, "rejected by this host's correctness check: wrong"
        return {"steps": [{"op": "launch", "params": dict(params)}]}, None
    monkeypatch.setattr(verify, "verified_plan", verified_plan)
    return made


def step_model(times: dict, bad=()):
    """make_step and timer: the step's time is `times[label]` for the params the table holds at
    SHAPE ("stock" where it holds none), plus a fixed wobble per timing of 0.05%."""
    count = {"n": 0}

    def label_of(t):
        e = t.lookup("linear_residual", SHAPE, "bfloat16")
        return "stock" if e is None else e.params["tile"]

    def make_step(t):
        label = label_of(t)

        def fn():
            return "bad" if label in bad else "ok"
        fn.label = label
        return fn

    def timer(fn):
        count["n"] += 1
        return times[fn.label] * (1 + 0.0005 * (count["n"] % 2)), CUDA
    return make_step, timer


def judge(table, times, ledger=None, bad=(), method=CUDA, **kw):
    make_step, timer = step_model(times, bad)
    t = timer if method == CUDA else (lambda fn: (timer(fn)[0], method))
    return stepjudge.judge(table, make_step=make_step, calls=[("linear_residual", SHAPE, "bfloat16")],
                           device="cuda", ledger_path=ledger, timer=t,
                           check=lambda out: None if out == "ok" else "logits differ", **kw)


@pytest.fixture
def ledger(tmp_path):
    path = tmp_path / "ledger.sqlite"
    with Ledger(path) as led:
        led.record([row({"tile": "splitk"}, 0.0166), row({"tile": "swapab"}, 0.0167),
                    row({"tile": "wide"}, 0.0171)])
    return path


def test_leading_configs_are_the_ledgers_kept_ones_at_the_shape_within_the_margin_fastest_first(tmp_path):
    path = tmp_path / "ledger.sqlite"
    with Ledger(path) as led:
        led.record([
            row({"tile": "own"}, 0.0150),                       # the entry's own params: left out
            row({"tile": "a"}, 0.0160), row({"tile": "a"}, 0.0170),   # the latest attempt counts: beyond top=3
            row({"tile": "b"}, 0.0168),
            row({"tile": "c"}, 0.0169),
            row({"tile": "slow"}, 0.0210),                      # outside 25% of the entry's 0.0166
            row({"tile": "rejected"}, 0.0100, accepted=False),
            row({"tile": "not-kept"}, 0.0160, stock_ms=0.0161),  # within the noise band of stock
            row({"tile": "no-band"}, 0.0160, stock_ms=0.0162, band=None),  # the default 2% band
            row({"tile": "other-shape"}, 0.0100, shape=OTHER),
            row({"tile": "other-source"}, 0.0100, source_hash="h2"),
            row({"tile": "other-device"}, 0.0100, fingerprint="fp-other"),
            row({"tile": "other-dtype"}, 0.0100, dtype="float16"),
            row({"tile": "dtype-pinned"}, 0.0167, shape=dict(SHAPE, dtype="bfloat16")),
            row({"tile": "no-stock-time"}, 0.0160, stock_ms=None),   # never compared with stock
        ])
    before = path.read_bytes()
    got = stepjudge.leading(path, entry({"tile": "own"}), FP, top=3)
    assert [r["params"]["tile"] for r in got] == ["dtype-pinned", "b", "c"]
    assert [r["params"]["tile"] for r in stepjudge.leading(path, entry({"tile": "own"}), FP, top=9)] == [
        "dtype-pinned", "b", "c", "a"]
    # only read: the file as it was, no -wal or -shm beside it
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["ledger.sqlite"]


def test_an_alternative_faster_in_the_step_replaces_the_entry_with_the_evidence(ledger, plans):
    cur = entry({"tile": "splitk"})
    result = judge(table_of(cur, entry({"tile": "x"}, shape=OTHER)), {"splitk": 1.60, "swapab": 1.56,
                                                                         "wide": 1.58, "stock": 1.70}, ledger)
    (d,) = result.decisions
    assert d.outcome == "replaced" and d.changed and result.changes_applied
    now = result.table.lookup("linear_residual", SHAPE, "bfloat16")
    assert now.params["tile"] == "swapab" and now.plan["steps"][0]["params"] == {"tile": "swapab"}
    assert now.candidate_ms == 0.0167 and now.stock_ms == 0.0200   # the harness's figures of that config
    step = now.extra["step"]
    assert step["outcome"] == "replaced" and step["before_params"] == {"tile": "splitk"}
    labels = {a["label"]: a for a in step["alternatives"]}
    assert set(labels) == {"current", '{"tile":"swapab"}', '{"tile":"wide"}', stepjudge.STOCK}
    assert all(len(a["step_ms"]) == stepjudge.ROUNDS for a in labels.values())
    assert result.table.lookup("linear_residual", OTHER, "bfloat16").params["tile"] == "x"  # untouched
    assert result.summary["speedup"] == pytest.approx(1.60 / 1.56, rel=1e-3)
    assert plans == [{"tile": "swapab"}, {"tile": "wide"}]


def test_a_gain_within_the_band_keeps_the_entry(ledger, plans):
    result = judge(table_of(entry({"tile": "splitk"})), {"splitk": 1.600, "swapab": 1.597, "wide": 1.61,
                                                         "stock": 1.7}, ledger)
    (d,) = result.decisions
    assert d.outcome == "kept" and not d.changed and d.band == stepjudge.MIN_BAND
    assert result.table.lookup("linear_residual", SHAPE, "bfloat16").params["tile"] == "splitk"
    assert result.summary is None


def test_stock_faster_in_the_step_removes_the_entry(ledger, plans):
    result = judge(table_of(entry({"tile": "splitk"})), {"splitk": 1.60, "swapab": 1.59, "wide": 1.61,
                                                         "stock": 1.50}, ledger)
    assert result.decisions[0].outcome == "removed" and result.decisions[0].after is None
    assert result.table.lookup("linear_residual", SHAPE, "bfloat16") is None


def test_without_a_ledger_only_stock_is_tried(plans):
    result = judge(table_of(entry({"tile": "splitk"})), {"splitk": 1.60, "stock": 1.70}, None)
    (d,) = result.decisions
    assert [a.label for a in d.alternatives] == ["current", stepjudge.STOCK] and d.outcome == "kept"


def test_an_alternative_whose_step_fails_its_check_or_has_no_plan_is_never_chosen(tmp_path, plans):
    path = tmp_path / "ledger.sqlite"
    with Ledger(path) as led:
        led.record([row({"tile": "swapab"}, 0.0167), row({"tile": "np", "no_plan": 1}, 0.0167)])
    result = judge(table_of(entry({"tile": "splitk"})), {"splitk": 1.60, "swapab": 1.40, "np": 1.3,
                                                         "stock": 1.70}, path, bad=("swapab",))
    (d,) = result.decisions
    assert d.outcome == "kept"
    problems = {a.label: a.problem for a in d.alternatives}
    assert problems['{"tile":"swapab"}'] == "step check: logits differ"
    assert problems['{"no_plan":1,"tile":"np"}'] == "rejected by this host's correctness check: wrong"
    assert all(not a.step_ms for a in d.alternatives if a.problem)


def test_a_current_step_that_fails_its_check_is_not_judged(ledger, plans):
    result = judge(table_of(entry({"tile": "splitk"})), {"splitk": 1.6, "swapab": 1.0, "wide": 1.0,
                                                         "stock": 1.0}, ledger, bad=("splitk",))
    assert result.decisions[0].outcome.startswith("not judged: the current step fails")
    assert result.table.lookup("linear_residual", SHAPE, "bfloat16").params["tile"] == "splitk"


def test_interpreter_times_change_nothing(ledger, plans):
    result = judge(table_of(entry({"tile": "splitk"})), {"splitk": 1.60, "swapab": 1.2, "wide": 1.3,
                                                         "stock": 1.1}, ledger, method=CPU)
    (d,) = result.decisions
    assert d.outcome == f"kept ({stepjudge.STOCK} timed faster, but the times are {CPU})"
    assert not result.changes_applied and not d.changed
    assert result.table.lookup("linear_residual", SHAPE, "bfloat16").params["tile"] == "splitk"


def test_a_noisy_current_step_widens_the_band(ledger, plans):
    seqs = {"splitk": iter([1.60, 1.50, 1.55]), "swapab": iter([1.52] * 3), "wide": iter([1.6] * 3),
            "stock": iter([1.7] * 3)}
    make_step, _ = step_model({})
    result = stepjudge.judge(table_of(entry({"tile": "splitk"})), make_step=make_step,
                             calls=[("linear_residual", SHAPE, "bfloat16")], device="cuda", ledger_path=ledger,
                             timer=lambda fn: (next(seqs[fn.label]), CUDA))
    (d,) = result.decisions
    assert d.band == pytest.approx((1.60 - 1.50) / 1.50)
    assert d.outcome == "kept"   # the best (1.52) is 1.9% under 1.55, inside a 6.7% band


def test_write_merges_the_decisions_and_leaves_an_entry_changed_since_alone(tmp_path, ledger, plans):
    path = tmp_path / "dispatch.json"
    cur, other = entry({"tile": "splitk"}), entry({"tile": "x"}, shape=OTHER)
    DispatchTable({"format": 1, "fingerprint_id": FP, "entries": [cur, other]}).save(path)
    result = judge(table_of(cur, other), {"splitk": 1.60, "swapab": 1.56, "wide": 1.58, "stock": 1.7}, ledger)
    n, notes = stepjudge.write(path, result)
    assert (n, notes) == (1, [])
    data = json.loads(path.read_text())
    by_m = {e["shape"]["M"]: e for e in data["entries"]}
    assert by_m[32]["params"] == {"tile": "swapab"} and by_m[32]["step"]["outcome"] == "replaced"
    assert by_m[1]["params"] == {"tile": "x"} and "step" not in by_m[1]
    assert [s["outcome"] for s in data["step_judged"]] == ["replaced"]
    # the same decisions again: the file no longer holds the judged entry
    n, notes = stepjudge.write(path, result)
    assert n == 0 and "changed in" in notes[0]
    assert json.loads(path.read_text())["entries"] == data["entries"]


def test_a_removed_entry_is_written_as_gone_and_logged(tmp_path, ledger, plans):
    path = tmp_path / "dispatch.json"
    cur = entry({"tile": "splitk"})
    # a log of another form is started afresh
    DispatchTable({"format": 1, "fingerprint_id": FP, "entries": [cur], "step_judged": "junk"}).save(path)
    result = judge(table_of(cur), {"splitk": 1.60, "swapab": 1.59, "wide": 1.61, "stock": 1.5}, ledger)
    assert stepjudge.write(path, result) == (1, [])
    data = json.loads(path.read_text())
    assert data["entries"] == [] and data["step_judged"][0]["outcome"] == "removed"
    assert data["step_judged"][0]["after_params"] is None


def test_entries_with_a_range_or_that_do_not_route_are_not_judged(plans):
    class Stale(Table):
        def usable(self, entry):
            return False

    ranged = Entry.make(**{**entry({"tile": "splitk"}).to_json(), "range": {"M": [17, 32]}})
    made = []
    for table, why in ((table_of(ranged), "a range"), (Stale({"format": 1, "fingerprint_id": FP,
                                                               "entries": [entry({"tile": "s"})]}), "does not route")):
        result = stepjudge.judge(table, make_step=lambda t: made.append(t), calls=[("linear_residual", SHAPE, "bfloat16")],
                                 device="cuda", timer=lambda fn: (1.0, CUDA))
        assert why in result.decisions[0].outcome
    assert made == []


CHILD = r'''
import json, sys
from pathlib import Path
from kernelsearch.ledger import Ledger
from daemon.bench.model import PRESETS
from kernelsearch.kernels import load_template
from tests.tuned_tables import verified_table

kernel, table_path, state = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
cfg = PRESETS["tiny"]
# swiglu: the unfused step's; linear_residual: the fused o projection + residual add, whose
# stock is the unfused path (linear, then the add)
shape = {"swiglu": {"M": 2, "I": cfg.ffn},
         "linear_residual": {"M": 2, "K": cfg.heads * cfg.head_dim, "N": cfg.hidden}}[kernel]
configs = load_template(kernel).CONFIGS
first = configs[0]
alt = next(p for p in configs[1:] if p.get("variant") == first.get("variant")
           and p.get("num_warps") != first.get("num_warps"))
table = verified_table([(kernel, shape, "float32", first)])
table.save(table_path)
e = table.entries[0]
with Ledger(state / "ledger.sqlite") as led:
    led.record([{"run_id": "r", "kernel": kernel, "dtype": "float32", "shape": shape, "strategy": "grid",
                 "source": "{}", "source_hash": e.source_hash, "params": p, "accepted": True, "guard": None,
                 "reason": "", "candidate_ms": ms, "stock_ms": 1.0, "noise_band": 0.01, "flops": 0,
                 "bytes": 0, "fingerprint": table.data["fingerprint_id"], "fingerprint_json": {},
                 "code_version": "c"} for p, ms in ((first, 0.5), (alt, 0.51))])
print(json.dumps({"alt": alt}))
'''


@pytest.mark.parametrize("kernel, label", [("swiglu", "swiglu"), ("linear_residual", "linear_residual o")])
def test_the_bench_judges_the_tuned_step_on_the_interpreter_and_changes_nothing(tmp_path, hwtune_cli, kernel,
                                                                                label):
    """End to end on the CPU: a harness-verified entry (unfused, or fused: its stock is then the
    unfused path), one more config of it in the ledger; the sandbox plans it, both steps and
    stock's run and match stock's logits, are timed by the interpreter, and the table is left as
    it was (those times are not a speed)."""
    state, table = tmp_path / "state", tmp_path / "table.json"
    state.mkdir()
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", CHILD, kernel, str(table), str(state)], cwd=ROOT, env=env,
                          text=True, capture_output=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    alt = json.loads(proc.stdout.strip().splitlines()[-1])["alt"]
    before = table.read_text()
    proc = hwtune_cli("--state-dir", state, "bench", "--device", "cpu", "--shapes", "2x16", "--prefill", "1x8",
                      "--steps", "20", "--warmup", "1", "--variants", "tuned", "--table", table,
                      "--judge-in-step", "--json", check=True, timeout=600)
    doc = json.loads(proc.stdout)
    judged = doc["step_judge"]["2x16"]
    assert judged["status"] == "ok" and judged["changes_applied"] is False, judged
    (d,) = judged["decisions"]
    assert d["kernel"] == kernel and d["outcome"].startswith("kept")
    labels = [a["label"] for a in d["alternatives"]]
    assert labels == ["current", json.dumps(alt, sort_keys=True, separators=(",", ":")), stepjudge.STOCK]
    assert all(len(a["step_ms"]) == stepjudge.ROUNDS and not a.get("problem") for a in d["alternatives"])
    assert judged["written"] == f"not written: the judge's times are {CPU}"
    assert table.read_text() == before
    tuned = next(r for r in doc["decode"] if r["variant"] == "tuned")
    assert tuned["status"] == "ok" and tuned["kernels"][label].startswith(f"tuned kernelsearch.kernels.{kernel}")
    assert f"step judge 1/1 {kernel}" in proc.stderr
    from daemon.bench.run import format_table
    assert (f"step judge 2x16: 0 of 1 entries changed (not written: the judge's times are {CPU})"
            in format_table(doc).splitlines())


def test_the_bench_table_names_what_the_judge_changed_and_the_steps_gain():
    from daemon.bench.run import format_table

    d = {"outcome": "replaced", "kernel": "linear_residual", "shape": SHAPE, "before_params": {"tile": "a"},
         "after_params": {"tile": "b"}}
    doc = {"decode": [], "step_judge": {
        "32x2048": {"status": "ok", "decisions": [d, dict(d, outcome="kept")], "written": "2 decision(s) written to T",
                    "summary": {"as_given": {"median_ms": 1.5636}, "as_judged": {"median_ms": 1.5512}}},
        "1x2048": {"status": "not run: under 60 s of the budget left"}}}
    lines = format_table(doc).splitlines()
    assert ("step judge 32x2048: 1 of 2 entries changed; the step as given 1.5636 ms, as judged 1.5512 ms "
            "(2 decision(s) written to T)") in lines
    assert "  linear_residual M=32 K=4096 N=4096: replaced {'tile': 'a'} -> {'tile': 'b'}" in lines
    assert "step judge 1x2048: not run: under 60 s of the budget left" in lines


@pytest.mark.parametrize("args, message", [
    (["--variants", "eager,graphed", "--judge-in-step"], "has no tuned"),
    (["--model", "hf-llama", "--variants", "hf-eager,hf-compiled", "--judge-in-step"], "has no hf-hwtune"),
    (["--model", "builtin,hf-llama", "--variants", "graphed,hf-eager", "--judge-in-step"],
     "has no tuned or hf-hwtune"),
    (["--command", "true", "--judge-in-step"], "not with --command"),
    (["--judge-top", "5"], "--judge-top is for --judge-in-step"),
    (["--judge-in-step", "--judge-top", "0"], "--judge-top 0: 1 to 32"),
    (["--judge-in-step", "--judge-top", "33"], "--judge-top 33: 1 to 32"),
])
def test_judge_in_step_without_the_built_in_tuned_step_is_refused(tmp_path, hwtune_cli, args, message):
    proc = hwtune_cli("--state-dir", tmp_path, "bench", "--device", "cpu", *args)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_a_step_that_cannot_be_timed_is_out_and_the_rest_is_judged(ledger, plans):
    make_step, timer = step_model({"splitk": 1.60, "wide": 1.50, "stock": 1.7})

    def flaky(fn):
        if fn.label == "swapab":
            raise RuntimeError("capture failed")
        return timer(fn)
    result = stepjudge.judge(table_of(entry({"tile": "splitk"})), make_step=make_step,
                             calls=[("linear_residual", SHAPE, "bfloat16")], device="cuda", ledger_path=ledger,
                             timer=flaky)
    (d,) = result.decisions
    assert d.outcome == "replaced" and d.after.params["tile"] == "wide"
    swapab = next(a for a in d.alternatives if a.label == '{"tile":"swapab"}')
    assert swapab.problem == "timing: RuntimeError: capture failed" and swapab.step_ms == []
    broken = stepjudge.judge(table_of(entry({"tile": "splitk"})), make_step=make_step,
                             calls=[("linear_residual", SHAPE, "bfloat16")], device="cuda", ledger_path=ledger,
                             timer=lambda fn: (_ for _ in ()).throw(RuntimeError("no graph")))
    assert broken.decisions[0].outcome.startswith("not judged: the current step fails (timing: RuntimeError")
    assert broken.table.lookup("linear_residual", SHAPE, "bfloat16").params["tile"] == "splitk"


def test_ledger_rows_of_another_form_are_not_alternatives(tmp_path):
    path = tmp_path / "ledger.sqlite"
    with Ledger(path) as led:
        led.record([row(["not", "a", "dict"], 0.0166), row({"tile": "ok"}, 0.0166),
                    row({"tile": "zero"}, 0.0), row({"tile": "negative"}, -1.0),
                    row({"tile": "nan"}, float("nan"))])
    assert [r["params"] for r in stepjudge.leading(path, entry({"tile": "own"}), FP)] == [{"tile": "ok"}]


def _bench_judge(tmp_path, monkeypatch, table_path, applied=True, **options):
    """Bench._judge_in_step on the tiny model with stepjudge.judge replaced by one decision that
    moves the first entry to other params (what a CUDA run decides): the bench's own glue."""
    import torch

    from daemon.bench.model import PRESETS, Model
    from daemon.bench.ops import StockOps
    from daemon.bench.run import Bench, BenchOptions

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    table = DispatchTable.load(table_path)
    before = table.entries[0]
    after = before.replace(params={"tile": "judged"})
    seen = {}

    def fake_judge(t, *, make_step, calls, device, ledger_path, check, progress, top, reps, deadline):
        seen.update(calls=calls, ledger=ledger_path, step=make_step(t), deadline=deadline, top=top)
        if applied is None:
            return stepjudge.JudgeResult(t, [], "", False)
        d = stepjudge.Decision(before.kernel, before.dtype, dict(before.shape), before, after, "replaced",
                               band=0.003, method=CUDA if applied else CPU)
        return stepjudge.JudgeResult(stepjudge.with_entry(t, before, after), [d], d.method, applied)
    monkeypatch.setattr(stepjudge, "judge", fake_judge)
    bench = Bench(BenchOptions(device="cpu", state_dir=str(tmp_path / "state"), judge_in_step=True, **options))
    model = Model(PRESETS["tiny"], device="cpu", dtype=torch.float32)
    model.allocate_cache(2, 17)
    tokens, positions = torch.tensor([3, 5]), torch.tensor([16, 16])
    doc = {}
    got = bench._judge_in_step(model, tokens, positions, StockOps(), table, "given", doc, 2, 16,
                               torch.zeros(1), 1.0)
    return got, doc["step_judge"]["2x16"], seen


def test_the_bench_writes_a_cuda_judgement_back_to_the_table_file(tmp_path, monkeypatch):
    path = tmp_path / "dispatch.json"
    DispatchTable({"format": 1, "fingerprint_id": FP, "entries": [entry({"tile": "splitk"})]}).save(path)
    got, record, seen = _bench_judge(tmp_path, monkeypatch, path)
    assert seen["calls"] == []                    # the tiny step routes nothing to this table
    assert str(seen["ledger"]).endswith("state/ledger.sqlite") and callable(seen["step"])
    import time
    assert 0 < seen["deadline"] - time.monotonic() <= 270 - 30   # the bench's --budget-s, less the rows' share
    assert seen["top"] == stepjudge.TOP == 3
    _, _, deeper = _bench_judge(tmp_path, monkeypatch, path, judge_top=7)   # --judge-top 7
    assert deeper["top"] == 7
    assert got.entries[0].params["tile"] == "judged"
    assert record["status"] == "ok" and record["written"] == f"1 decision(s) written to {path}"
    assert json.loads(path.read_text())["entries"][0]["params"] == {"tile": "judged"}


def test_the_bench_runs_on_when_the_judged_table_cannot_be_written(tmp_path, monkeypatch):
    path = tmp_path / "dispatch.json"
    DispatchTable({"format": 1, "fingerprint_id": FP, "entries": [entry({"tile": "splitk"})]}).save(path)
    before = path.read_text()

    def read_only(path, result):   # what a read-only file system answers
        raise OSError(30, "Read-only file system")
    monkeypatch.setattr(stepjudge, "write", read_only)
    got, record, _ = _bench_judge(tmp_path, monkeypatch, path)
    assert record["written"] == f"not written to {path}: Read-only file system"
    assert got.entries[0].params["tile"] == "judged" and path.read_text() == before   # rows run judged


def test_interpreter_judgements_are_not_written(tmp_path, monkeypatch):
    path = tmp_path / "dispatch.json"
    DispatchTable({"format": 1, "fingerprint_id": FP, "entries": [entry({"tile": "splitk"})]}).save(path)
    before = path.read_text()
    _, record, _ = _bench_judge(tmp_path, monkeypatch, path, applied=False)
    assert record["written"] == f"not written: the judge's times are {CPU}" and path.read_text() == before


def test_a_step_that_routes_no_entry_says_so(tmp_path, monkeypatch):
    path = tmp_path / "dispatch.json"
    DispatchTable({"format": 1, "fingerprint_id": FP, "entries": [entry({"tile": "splitk"})]}).save(path)
    _, record, _ = _bench_judge(tmp_path, monkeypatch, path, applied=None)
    assert record["written"].startswith("nothing to judge: the step routes none of the table's entries")


def test_an_unreadable_ledger_is_named_and_stock_is_still_tried(tmp_path, plans):
    path = tmp_path / "ledger.sqlite"
    path.write_bytes(b"not a database" * 100)
    lines = []
    make_step, timer = step_model({"splitk": 1.60, "stock": 1.50})
    result = stepjudge.judge(table_of(entry({"tile": "splitk"})), make_step=make_step,
                             calls=[("linear_residual", SHAPE, "bfloat16")], device="cuda", ledger_path=path,
                             timer=timer, progress=lines.append)
    assert result.notes == [f"ledger {path} not read: DatabaseError: file is not a database"]
    assert f"step judge: {result.notes[0]}" in lines
    assert result.decisions[0].outcome == "removed" and result.to_json()["notes"] == result.notes


def test_no_entry_is_started_after_the_deadline(ledger, plans):
    import time

    make_step, timer = step_model({"splitk": 1.60, "swapab": 1.0, "wide": 1.0, "stock": 1.0})
    result = stepjudge.judge(table_of(entry({"tile": "splitk"})), make_step=make_step,
                             calls=[("linear_residual", SHAPE, "bfloat16")], device="cuda", ledger_path=ledger,
                             timer=timer, deadline=time.monotonic() - 1)
    assert [d.outcome for d in result.decisions] == ["not judged: time budget"] and result.method == ""
    assert plans == []


def test_write_refuses_a_symlink_and_a_file_gone_and_leaves_both_as_they_are(tmp_path, ledger, plans):
    target = tmp_path / "real.json"
    cur = entry({"tile": "splitk"})
    DispatchTable({"format": 1, "fingerprint_id": FP, "entries": [cur]}).save(target)
    before = target.read_text()
    link = tmp_path / "link.json"
    link.symlink_to(target)
    result = judge(table_of(cur), {"splitk": 1.60, "swapab": 1.56, "wide": 1.58, "stock": 1.7}, ledger)
    with pytest.raises(OSError, match="a symbolic link"):
        stepjudge.write(link, result)
    assert link.is_symlink() and target.read_text() == before
    with pytest.raises(FileNotFoundError, match="removed since it was loaded"):
        stepjudge.write(tmp_path / "gone.json", result)
    assert not (tmp_path / "gone.json").exists()


def test_the_bench_runs_on_when_the_table_file_is_broken_at_write_time(tmp_path, monkeypatch):
    path = tmp_path / "dispatch.json"
    DispatchTable({"format": 1, "fingerprint_id": FP, "entries": [entry({"tile": "splitk"})]}).save(path)
    real_write = stepjudge.write

    def broken_meanwhile(p, result):
        p.write_text("{ not json")
        return real_write(p, result)
    monkeypatch.setattr(stepjudge, "write", broken_meanwhile)
    got, record, _ = _bench_judge(tmp_path, monkeypatch, path)
    assert record["written"].startswith(f"not written to {path}: TableError") and "JSONDecodeError" in record["written"]
    assert got.entries[0].params["tile"] == "judged" and path.read_text() == "{ not json"


@pytest.mark.parametrize("model", ["builtin", "hf-llama"])
@pytest.mark.parametrize("make, message", [
    (lambda d: d / "missing.json", "missing.json: no such file"),
    (lambda d: d, "a directory, not a dispatch table file"),
])
def test_a_table_that_is_not_a_file_is_refused(tmp_path, hwtune_cli, make, message, model):
    """Before any measuring, for every model: not a silent fall-back to the state directory's
    table (built-in) or to stock (hf-llama), nor a traceback at the end."""
    extra = ["--judge-in-step"] if model == "builtin" else []
    proc = hwtune_cli("--state-dir", tmp_path / "state", "bench", "--device", "cpu", "--model", model, *extra,
                      "--table", make(tmp_path))
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_the_judge_at_a_models_own_cache_judges_each_shape_and_names_one_that_fails(tmp_path, monkeypatch):
    """Bench.judge_at_cache (what `--model hf-llama --judge-in-step` runs): each (batch, ctx) on a
    cache of exactly ctx slots with the new token in the last, keyed "BxCTX (cache CTX)"; a shape
    that cannot be made (out of memory) is named and the others are still judged."""
    import torch

    from daemon.bench.model import PRESETS, Model
    from daemon.bench.run import Bench, BenchOptions

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    seen = []

    def fake(self, model, tokens, positions, stock, table, note, doc, batch, ctx, ref, tol, key=None):
        seen.append((key, model.s_max, positions.tolist(), tuple(ref.shape)))
        doc.setdefault("step_judge", {})[key] = {"status": "ok"}
        return table
    monkeypatch.setattr(Bench, "_judge_in_step", fake)
    real = Model.allocate_cache

    def allocate(self, batch, s_max):
        if batch == 3:
            raise torch.OutOfMemoryError("CUDA out of memory (test)")
        return real(self, batch, s_max)
    monkeypatch.setattr(Model, "allocate_cache", allocate)
    bench = Bench(BenchOptions(device="cpu", shapes=[(2, 16), (3, 16), (1, 40)], state_dir=str(tmp_path)))
    doc = {}
    table = object()
    assert bench.judge_at_cache(PRESETS["tiny"], table, "given", doc) is table
    assert [(k, s, p) for k, s, p, _ in seen] == [("2x16 (cache 16)", 16, [15, 15]), ("1x40 (cache 40)", 40, [39])]
    assert doc["step_judge"]["3x16 (cache 16)"]["status"].startswith("error: OutOfMemoryError: CUDA out of memory")
    assert list(doc["step_judge"]) == ["2x16 (cache 16)", "3x16 (cache 16)", "1x40 (cache 40)"]


SLOPPY_RMSNORM = '''
import triton
import triton.language as tl


@triton.jit
def _row(x_ptr, w_ptr, out_ptr, n_cols, eps, BLOCK_N: tl.constexpr, SLOPPY: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    if SLOPPY:
        inv = inv * 1.5
    tl.store(out_ptr + row * n_cols + cols, (x * inv * w).to(out_ptr.dtype.element_ty), mask=mask)


CONFIGS = [{"num_warps": 4, "SLOPPY": 0}]
SPACE = {"num_warps": [4], "SLOPPY": [0, 1]}


def launch(x, weight, eps, out, num_warps=4, SLOPPY=0):
    m, n = x.shape
    _row[(m,)](x, weight, out, n, eps, BLOCK_N=triton.next_power_of_2(n), SLOPPY=SLOPPY, num_warps=num_warps)
'''


def test_a_ledger_row_the_harness_rejects_is_never_an_alternative(tmp_path):
    """The judge made its alternatives' plans on a ledger row's word (`accepted`), and a bundle's
    rows are stored as given: a config that fails the harness's checks was timed in the step (on
    the GPU, unchecked) and could replace the entry. Each is verified by this host's harness first."""
    from kernelsearch.entry import file_sha256

    src = tmp_path / "sloppy_rmsnorm.py"
    src.write_text(SLOPPY_RMSNORM)
    shape = {"M": 4, "N": 100}
    cur = Entry.make(kernel="rmsnorm", dtype="float32", shape=shape, source={"path": str(src)},
                     source_hash=file_sha256(src), params={"num_warps": 4, "SLOPPY": 0}, plan={"steps": []},
                     candidate_ms=0.01, stock_ms=0.02, speedup=2.0, against="torch", noise_band=0.01)
    forged = {"params": {"num_warps": 4, "SLOPPY": 1}, "candidate_ms": 0.005, "stock_ms": 0.02, "noise_band": 0.01}
    alt, problem = stepjudge._alternative_entry(cur, forged, "cpu")
    assert alt is None and problem.startswith("rejected by this host's correctness check"), problem
    honest = dict(forged, params={"num_warps": 4, "SLOPPY": 0})
    alt, problem = stepjudge._alternative_entry(cur, honest, "cpu")
    assert problem is None and alt.plan["steps"], problem
