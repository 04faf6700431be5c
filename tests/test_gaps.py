"""The gap breakdown: kernels per step and per layer, busy vs idle, the split of the gap to the
floor, from synthetic kernel events whose answer is known; the --from-json CLI; ncu CSV bytes;
profile() refuses a CPU."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from daemon.bench import gaps

REPO = Path(__file__).resolve().parents[1]


def _step(t0=0.0, a_us=10.0, layers=2, extra=None, drop=None):
    """One step: per layer A (a_us) then B (5 us), 1 us apart; then the head H (20 us).
    Busy 2*(a_us+5)+20, four 1-us gaps between the five kernels."""
    seq = []
    for _ in range(layers):
        seq += [("A", a_us), ("B", 5.0)]
    seq.append(("H", 20.0))
    if drop is not None:
        seq.pop(drop)
    if extra is not None:
        seq.insert(1, extra)
    out, t = [], t0
    for name, dur in seq:
        out.append({"name": name, "start_us": t, "dur_us": dur})
        t += dur + 1.0
    return out


def test_breakdown_counts_kernels_busy_idle_and_per_name_shares():
    steps = [_step(t0=1000.0 * i) for i in range(3)]
    b = gaps.breakdown(steps, step_ms=0.058, layers=2, head_kernels=["H"])
    assert b["kernels_per_step"] == 5
    assert b["kernels_outside_layers"] == 1
    assert b["kernels_per_layer"] == 2.0
    assert b["busy_ms"] == pytest.approx(0.050)
    assert b["span_ms"] == pytest.approx(0.054)
    assert b["idle_between_ms"] == pytest.approx(0.004)
    assert b["edge_ms"] == pytest.approx(0.004)
    assert b["idle_ms"] == pytest.approx(0.008)
    assert b["gap_median_us"] == pytest.approx(1.0)
    rows = {r["name"]: r for r in b["kernels"]}
    assert rows["A"]["per_step"] == 2 and rows["A"]["median_us"] == pytest.approx(10.0)
    assert rows["A"]["us_per_step"] == pytest.approx(20.0)
    assert rows["A"]["share_of_step"] == pytest.approx(20.0 / 58.0)
    assert rows["H"]["share_of_step"] == pytest.approx(20.0 / 58.0)
    assert rows["B"]["us_per_step"] == pytest.approx(10.0)
    # a count of kernels outside the layers works as well as their names
    assert gaps.breakdown(steps, 0.058, 2, head_kernels=1)["kernels_per_layer"] == 2.0
    assert gaps.breakdown(steps, 0.058, 2)["kernels_per_layer"] == 2.5


def test_floor_gap_splits_into_idle_below_own_floor_and_unattributed():
    steps = [_step(t0=1000.0 * i) for i in range(3)]
    # 1000 GB/s: 1 MB is 1 us. A moves 16 MB a step (own floor 16 us, runs 20), B 8 MB (8 vs 10).
    b = gaps.breakdown(steps, 0.058, 2, floor_ms=0.040, head_kernels=["H"],
                       bytes_by_kernel={"A": 16e6, "B": 8e6}, copy_gbs=1000.0)
    f = b["floor"]
    assert f["pct_of_floor"] == pytest.approx(40.0 / 58.0)
    assert f["gap_ms"] == pytest.approx(0.018)
    assert f["idle_ms"] == pytest.approx(0.008)
    assert f["below_own_floor_ms"] == pytest.approx(0.006)
    # H (20 us, no bytes) minus what the floor holds beyond A's and B's own floors (40 - 24 us)
    assert f["unattributed_ms"] == pytest.approx(0.004)
    assert f["named_floor_ms"] == pytest.approx(0.024)
    assert f["unnamed_kernel_ms"] == pytest.approx(0.020)
    rows = {r["name"]: r for r in b["kernels"]}
    assert rows["A"]["pct_of_own_floor"] == pytest.approx(0.8)
    assert "own_floor_us" not in rows["H"]
    assert f["bytes_unmatched"] == []
    # bytes for a name the trace does not hold are listed, not counted
    f3 = gaps.breakdown(steps, 0.058, 2, floor_ms=0.040, bytes_by_kernel={"A": 16e6, "Z": 1e9},
                        copy_gbs=1000.0)
    assert f3["floor"]["bytes_unmatched"] == ["Z"]
    assert f3["floor"]["below_own_floor_ms"] == pytest.approx(0.004)
    assert "not in the trace (left out): Z" in gaps.markdown(f3)
    # without bytes per kernel: idle and the rest
    f2 = gaps.breakdown(steps, 0.058, 2, floor_ms=0.040)["floor"]
    assert f2["kernels_above_floor_ms"] == pytest.approx(0.010)
    with pytest.raises(gaps.GapsError, match="copy_gbs"):
        gaps.breakdown(steps, 0.058, 2, bytes_by_kernel={"A": 1.0})


def test_medians_survive_an_empty_step_an_extra_and_a_missing_kernel():
    steps = [_step(0.0), [], _step(1000.0, extra=("memset", 1.0)), _step(2000.0, a_us=11.0),
             _step(3000.0, drop=3), _step(4000.0), _step(5000.0, a_us=9.0)]
    b = gaps.breakdown(steps, 0.058, 2, head_kernels=["H"])
    assert b["steps_given"] == 7 and b["steps_used"] == 6 and b["steps_dropped"] == 1
    assert b["irregular_steps"] == [2, 4]
    assert b["kernels_per_step"] == 5 and b["kernels_per_layer"] == 2.0
    assert b["busy_ms"] == pytest.approx(0.050)
    rows = {r["name"]: r for r in b["kernels"]}
    assert rows["A"]["median_us"] == pytest.approx(10.0)
    assert rows["memset"]["per_step"] == 0  # in one step of six
    with pytest.raises(gaps.GapsError, match="no kernel events"):
        gaps.breakdown([[], []], 0.05, 2)


def test_overlapping_kernels_count_once_in_busy_time():
    # two streams: B starts while A runs; busy is the union (12 us), the summed durations 15
    step = [{"name": "A", "start_us": 0.0, "dur_us": 10.0}, {"name": "B", "start_us": 7.0, "dur_us": 5.0}]
    b = gaps.breakdown([step, step], 0.012, 1)
    assert b["busy_ms"] == pytest.approx(0.012) and b["kernel_sum_ms"] == pytest.approx(0.015)
    assert b["idle_between_ms"] == pytest.approx(0.0) and b["gap_median_us"] == 0.0


def test_step_time_not_given_uses_the_traced_span():
    b = gaps.breakdown([_step(0.0), _step(500.0)], None, 2)
    assert b["step_ms_source"] == "median traced span"
    assert b["step_ms"] == pytest.approx(0.054) and b["edge_ms"] is None
    assert "not given" in gaps.markdown(b)


def _trace(steps, with_launches=True):
    ev, corr = [], 100
    for s in steps:
        corr += 1
        if with_launches:
            ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch",
                       "ts": s[0]["start_us"] - 5, "dur": 3, "args": {"correlation": corr}})
        for k in s:
            ev.append({"ph": "X", "cat": "kernel", "name": k["name"], "ts": k["start_us"],
                       "dur": k["dur_us"], "args": {"correlation": corr if with_launches else None}})
    ev.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 1})
    return ev


def test_steps_from_trace_by_graph_launch_by_gap_and_by_count():
    steps = [_step(0.0), _step(3000.0), _step(6000.0)]
    by_launch = gaps.steps_from_trace(_trace(steps))
    assert [len(s) for s in by_launch] == [5, 5, 5]
    assert by_launch[1][0]["start_us"] == 3000.0
    by_gap = gaps.steps_from_trace(_trace(steps, with_launches=False))
    assert [len(s) for s in by_gap] == [5, 5, 5]
    # back to back (no gap between steps): only a known count tells the steps apart
    glued = [_step(0.0), _step(59.0)]
    assert len(gaps.steps_from_trace(_trace(glued, with_launches=False))) == 1
    by_count = gaps.steps_from_trace(_trace(glued, with_launches=False), kernels_per_step=5)
    assert [len(s) for s in by_count] == [5, 5]
    assert by_count[1][0]["start_us"] == 59.0


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "daemon.bench.gaps", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=60)


def test_cli_from_json_prints_the_markdown_table(tmp_path):
    doc = {"format": gaps.FORMAT, "steps": [_step(1000.0 * i) for i in range(3)], "step_ms": 0.058,
           "layers": 2, "head_kernels": ["H"]}
    path = tmp_path / "events.json"
    path.write_text(json.dumps(doc))
    r = _cli("--from-json", str(path), "--floor-ms", "0.040", "--copy-gbs", "1000")
    assert r.returncode == 0, r.stderr
    assert "kernels per step 5: 2.00 per layer x 2 layers + 1 outside the layers" in r.stdout
    assert "step at 69.0% of the floor" in r.stdout
    assert "| `A` | 2 | 10.00 | 20.0 | 34.5% | - | - |" in r.stdout
    bytes_path = tmp_path / "bytes.json"
    bytes_path.write_text(json.dumps({"A": 16e6, "B": 8e6}))
    r = _cli("--from-json", str(path), "--floor-ms", "0.040", "--copy-gbs", "1000",
             "--bytes-json", str(bytes_path), "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["floor"]["below_own_floor_ms"] == pytest.approx(0.006)
    # bytes from an ncu CSV (two steps replayed): A and B at the same per-step bytes
    ncu = tmp_path / "ncu.csv"
    ncu.write_text(NCU_CSV.replace("_gemv_kernel", "A").replace("_rmsnorm_kernel", "B")
                   .replace("33,554,432", "15,991,808").replace('"8,192","8,192"', '"4,000,000","4,000,000"'))
    r = _cli("--from-json", str(path), "--floor-ms", "0.040", "--copy-gbs", "1000",
             "--ncu-csv", str(ncu), "--ncu-steps", "2", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["floor"]["below_own_floor_ms"] == pytest.approx(0.006)
    # a chrome trace works too; --layers is required when the file has none
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": _trace(doc["steps"])}))
    r = _cli("--from-json", str(trace), "--layers", "2", "--step-ms", "0.058")
    assert r.returncode == 0 and "kernels per step 5" in r.stdout
    r = _cli("--from-json", str(trace))
    assert r.returncode == 2 and "--layers" in r.stderr


NCU_CSV = '''==PROF== Connected to process 1234 (/usr/bin/python3.11)
==PROF== Profiling "_gemv_kernel": 0%....50%....100% - 1 pass
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Device","CC","dram__bytes_read.sum","dram__bytes_write.sum","gpu__time_duration.sum"
"","","","","","","","","","byte","byte","nsecond"
"0","1234","python3.11","h","_gemv_kernel","1","7","0","9.0","33,554,432","8,192","11300"
"1","1234","python3.11","h","_rmsnorm_kernel","1","7","0","9.0","8,192","8,192","2100"
"2","1234","python3.11","h","_gemv_kernel","1","7","0","9.0","33,554,432","8,192","11400"
"3","1234","python3.11","h","_rmsnorm_kernel","1","7","0","9.0","8,192","8,192","2000"
'''


def test_ncu_csv_gives_dram_bytes_per_kernel_name_per_step():
    b = gaps.bytes_from_ncu_csv(NCU_CSV, steps=2)
    assert b == {"_gemv_kernel": pytest.approx(33554432 + 8192), "_rmsnorm_kernel": pytest.approx(16384)}
    one = NCU_CSV.replace("dram__bytes_read.sum", "dram__bytes.sum")
    assert gaps.bytes_from_ncu_csv(one, steps=1)["_rmsnorm_kernel"] == pytest.approx(16384)
    with pytest.raises(gaps.GapsError, match="dram__bytes"):
        gaps.bytes_from_ncu_csv(NCU_CSV.replace("dram__bytes", "lts__bytes"))


def test_profile_refuses_a_cpu_device_with_a_clear_message():
    with pytest.raises(gaps.GapsError, match="needs a CUDA device, got 'cpu'"):
        gaps.profile(lambda: None, 2, device="cpu")
    with pytest.raises(gaps.GapsError, match="CUDA device"):
        gaps.replay_for_ncu(lambda: None, 2, device="cpu")


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this host has CUDA")
def test_profile_without_cuda_says_so():
    with pytest.raises(gaps.GapsError, match="is_available"):
        gaps.profile(lambda: None, 2)


@pytest.mark.gpu
def test_profile_sees_each_kernel_of_a_graphed_step():
    import torch
    x = torch.randn(1 << 20, device="cuda")
    y = torch.empty_like(x)

    def step():  # three elementwise kernels
        torch.mul(x, 2.0, out=y)
        y.add_(1.0)
        y.sqrt_()

    raw = gaps.profile(step, 5)
    assert len(raw["steps"]) == 5 and all(len(s) == 3 for s in raw["steps"])
    b = gaps.breakdown(raw["steps"], raw["step_ms"], layers=1)
    assert b["kernels_per_step"] == 3 and b["busy_ms"] > 0 and b["step_ms"] >= b["busy_ms"]


def test_bench_gaps_gpu_finds_each_layer_position_past_a_lazy_prologue_and_a_trailing_add():
    """bench/gaps_gpu.py's per-position table: layer 0 carries kernels the others do not (per-step
    tensors made at first use), a residual add follows the last layer; the positions come from
    layers 1..L-1 and their medians from every step."""
    import importlib.util

    from tests.conftest import ROOT as repo

    spec = importlib.util.spec_from_file_location("gaps_gpu", repo / "bench" / "gaps_gpu.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    def ev(name, us):
        return {"name": name, "dur_us": us, "start_us": 0.0}

    def layer(scale):
        return [ev("norm", 2), ev("qkv", 10 * scale), ev("attn", 60), ev("o", 12), ev("norm", 2),
                ev("gate_up", 60), ev("down", 30)]

    steps = [[ev("embed", 2), ev("rmsnorm", 2)] + layer(s)[1:3] + [ev("gather", 3)] + layer(s)[3:]
             + sum((layer(s) for _ in range(7)), []) + [ev("add", 1)] for s in (1.0, 1.2, 1.4)]
    rows = mod.layer_positions(steps, 8)
    assert [r["name"] for r in rows] == ["norm", "qkv", "attn", "o", "norm", "gate_up", "down"]
    assert rows[1]["median_us"] == 12.0 and rows[1]["n"] == 21  # 7 layers x 3 steps
    assert "| 1 | `qkv` | 12.00 |" in mod.position_table(rows)
    assert "no per-position table" in mod.position_table(mod.layer_positions([[ev("a", 1)]], 8))


def test_bench_ncu_step_runs_the_tuned_step_and_names_each_route(capsys):
    """bench/ncu_step.py (what issue13_gpu.sh's stage W runs under ncu) builds the model, runs
    the tuned step and prints each call's route; with run 14's H200 table on the CPU (fp32, no
    entry at these shapes) every call is stock, and says why."""
    import importlib.util

    from tests.conftest import ROOT as repo

    spec = importlib.util.spec_from_file_location("ncu_step", repo / "bench" / "ncu_step.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    table = repo / "bench" / "results" / "h200-issue13" / "run14" / "U" / "dispatch-judged.json"
    assert mod.main(["--table", str(table), "--device", "cpu", "--preset", "tiny",
                     "--layers", "2", "--ctx", "8", "--steps", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines and all(" stock " in line and "no table entry" in line for line in lines)
    assert any(line.startswith("linear ") for line in lines)
