"""hwtune bench: the built-in model, the CLI, --command, --baseline report, fingerprint."""
from __future__ import annotations

import json
import sys
import textwrap

import pytest
import torch

from daemon.bench.fingerprint import detect_virtualization
from daemon.bench.model import PRESETS, Model
from daemon.bench.ops import StockOps
from daemon.bench.run import decode_floor
from daemon.bench.workload import parse_metric

FINGERPRINT_KEYS = {"host", "virtualization", "gpu", "software", "locked_clocks",
                    "hardware_status", "kernel_table", "hwtune_commit"}
SENTINEL = 777.0
TINY_ARGS = ["bench", "--device", "cpu", "--shapes", "2x16", "--prefill", "1x8",
             "--steps", "20", "--warmup", "2", "--variants", "eager,graphed,tuned"]


def _tiny_model(batch, s_max, seed=0):
    model = Model(PRESETS["tiny"], device="cpu", dtype=torch.float32, seed=seed)
    model.allocate_cache(batch, s_max)
    model.kv.fill_(SENTINEL)  # large finite garbage: unwritten slots must be masked out
    return model


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    from tests.conftest import run_hwtune
    out = tmp_path_factory.mktemp("bench")
    proc = run_hwtune("--state-dir", out / "state", *TINY_ARGS, "--out", out / "run", "--json",
                      check=True)
    return json.loads(proc.stdout), out


def test_tiny_model_bench_on_cpu_measures_prefill_and_decode_with_a_fingerprint(tiny_run):
    doc, out = tiny_run
    assert doc["label"] == "cpu"
    decode = {r["variant"]: r for r in doc["decode"]}
    for variant in ("eager", "tuned"):
        row = decode[variant]
        assert row["status"] == "ok", row
        assert row["tokens_per_s"] > 0 and row["step_ms"] > 0
        assert "tokens_per_j" not in row  # no energy on CPU
    assert decode["graphed"]["status"].startswith("skipped")
    assert {"rmsnorm", "add_rmsnorm", "matmul", "decode_attention"} <= set(decode["tuned"]["kernels"])
    assert decode["tuned"]["kernels_per_layer"]["total"] <= decode["tuned"]["kernels_per_layer_stock"]["total"]
    for variant in ("eager", "tuned"):  # the no-head step is timed too, against the no-head floor
        assert decode[variant]["step_ms_no_head"] > 0
        assert decode[variant]["rel_l2_no_head_vs_eager"] < 1e-5
    assert "no LM head" in doc["floor_note"]
    assert decode["tuned"]["rel_l2_vs_eager"] < 1e-5
    assert doc["prefill"][0]["status"] == "ok" and doc["prefill"][0]["tokens_per_s"] > 0
    assert FINGERPRINT_KEYS <= set(doc["fingerprint"])
    assert "virtualized" in doc["fingerprint"]["virtualization"]
    assert json.loads((out / "run" / "results.json").read_text())["label"] == "cpu"


@pytest.mark.parametrize("attention", ["sdpa", "bmm"])
def test_decode_with_the_kv_cache_matches_a_full_recompute(attention):
    torch.manual_seed(0)
    t_total, t_prompt, batch = 12, 5, 2
    tokens = torch.randint(1, PRESETS["tiny"].vocab, (batch, t_total))
    full = _tiny_model(batch, 16)
    expected = full.prefill(tokens, StockOps(), all_logits=True)  # [B, T, V]

    model = _tiny_model(batch, 16)
    cache = model.kv
    ptr = cache.data_ptr()
    last = model.prefill(tokens[:, :t_prompt], StockOps())
    torch.testing.assert_close(last, expected[:, t_prompt - 1], rtol=1e-4, atol=1e-4)
    for t in range(t_prompt, t_total):
        positions = torch.full((batch,), t, dtype=torch.int64)
        assert (model.kv[:, :, :, :, t] == SENTINEL).all()
        logits = model.decode_step(tokens[:, t], positions, StockOps(attention))
        assert model.kv is cache and model.kv.data_ptr() == ptr  # updated in place
        assert not (model.kv[:, :, :, :, t] == SENTINEL).any()
        torch.testing.assert_close(logits, expected[:, t], rtol=1e-4, atol=1e-4)


def test_decode_step_takes_a_position_per_sequence():
    torch.manual_seed(1)
    tokens = torch.randint(1, PRESETS["tiny"].vocab, (2, 8))
    full = _tiny_model(2, 16)
    expected = full.prefill(tokens, StockOps(), all_logits=True)
    model = _tiny_model(2, 16)
    model.prefill(tokens[:, :6], StockOps())
    logits = model.decode_step(torch.stack([tokens[0, 6], tokens[1, 3]]),
                               torch.tensor([6, 3]), StockOps())
    torch.testing.assert_close(logits[0], expected[0, 6], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits[1], expected[1, 3], rtol=1e-4, atol=1e-4)


def test_floor_counts_every_weight_the_decode_step_reads():
    cfg = PRESETS["tiny"]
    model = Model(cfg, device="cpu", dtype=torch.bfloat16)
    read = sum(w.numel() for layer in model.layers for w in layer.values())
    read += model.final_norm.numel() + model.lm_head.numel()
    assert cfg.weight_bytes(2) == 2 * read
    f = decode_floor(cfg, batch=4, ctx=100, dtype_bytes=2, copy_gbs=1.0)
    per_token = 2 * cfg.layers * 2 * cfg.kv_heads * cfg.head_dim
    assert f["kv_read_bytes"] == 4 * 100 * per_token and f["kv_write_bytes"] == 4 * per_token
    assert f["floor_with_head_ms"] == pytest.approx(f["total_bytes"] / 1e9 * 1e3)
    head = 2 * (model.final_norm.numel() + model.lm_head.numel())
    assert f["total_bytes_no_head"] == f["total_bytes"] - head
    assert f["floor_ms"] == pytest.approx(f["total_bytes_no_head"] / 1e9 * 1e3)
    big = PRESETS["llama3-8b-8l"]
    assert 4.4e9 < big.weight_bytes(2) < 4.7e9  # 8 layers of Llama-3-8B + 128256-token head


def test_baseline_report_has_ratios_notes_and_a_png(tiny_run, tmp_path, hwtune_cli):
    doc, _ = tiny_run
    baseline = json.loads(json.dumps(doc))
    for row in baseline["decode"] + baseline["prefill"]:
        if row.get("tokens_per_s"):
            row["tokens_per_s"] /= 2.0
    baseline["label"] = "cloud-vm"
    baseline["fingerprint"]["virtualization"]["virtualized"] = True
    baseline["fingerprint"]["gpu"] = {"name": "NVIDIA H100 80GB HBM3", "driver": "550.54"}
    (tmp_path / "base.json").write_text(json.dumps(baseline))
    proc = hwtune_cli("--state-dir", tmp_path / "state", *TINY_ARGS,
                      "--baseline", tmp_path / "base.json", "--out", tmp_path / "cmp", check=True)
    md = (tmp_path / "cmp" / "report.md").read_text()
    assert "ratio tokens/s" in md and "| decode | eager | 2 | 16 |" in md
    assert "NVIDIA H100 80GB HBM3" in md  # fingerprint differences side by side
    assert "GPUs differ" in md
    assert "same fused weights" in md
    png = (tmp_path / "cmp" / "report.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 1000
    assert "eager" in proc.stdout  # the table for people


def test_report_from_recorded_results_compares_without_measuring(tiny_run, tmp_path, hwtune_cli):
    doc, out = tiny_run
    proc = hwtune_cli("bench", "--from-results", out / "run" / "results.json",
                      "--baseline", out / "run" / "results.json", "--out", tmp_path / "r", check=True)
    md = (tmp_path / "r" / "report.md").read_text()
    assert "| 1.00 |" in md  # a run against itself
    assert "Both runs are virtualized" in md or not doc["fingerprint"]["virtualization"]["virtualized"]
    assert (tmp_path / "r" / "report.png").read_bytes()[:4] == b"\x89PNG"
    assert proc.returncode == 0


def test_command_workload_metric_is_the_last_matching_line(tmp_path, hwtune_cli):
    script = tmp_path / "workload.py"
    script.write_text(textwrap.dedent("""\
        print("warming up")
        print("tokens/s: 99.0")
        print("done, tokens/s: 123.4")
        print("bye")
    """))
    proc = hwtune_cli("--state-dir", tmp_path / "state", "bench", "--device", "cpu",
                      "--command", f"{sys.executable} {script}", "--json", check=True)
    doc = json.loads(proc.stdout)
    assert doc["workload"]["metric"] == 123.4
    assert doc["workload"]["status"] == "ok"
    assert FINGERPRINT_KEYS <= set(doc["fingerprint"])


def test_command_that_prints_no_metric_fails(tmp_path, hwtune_cli):
    proc = hwtune_cli("--state-dir", tmp_path / "state", "bench", "--device", "cpu",
                      "--command", f"{sys.executable} -c \"print('nothing here')\"", "--json")
    assert proc.returncode == 1
    assert json.loads(proc.stdout)["workload"]["metric"] is None


def test_metric_parser_reads_json_lines_and_custom_regexes():
    assert parse_metric('{"metric": 5.5, "unit": "req/s"}\nnoise') == (5.5, '{"metric": 5.5, "unit": "req/s"}')
    assert parse_metric("tokens/s=10\n{\"metric\": 7}")[0] == 7.0
    assert parse_metric("throughput 42 req/s", r"throughput ([0-9.]+)")[0] == 42.0
    assert parse_metric("tokens/s: n/a")[0] is None


def test_bad_shapes_are_refused_with_exit_2(tmp_path, hwtune_cli):
    proc = hwtune_cli("--state-dir", tmp_path, "bench", "--device", "cpu", "--shapes", "8by2048")
    assert proc.returncode == 2 and "8by2048" in proc.stderr


def _fixture_root(tmp_path, flags, dmi):
    (tmp_path / "proc").mkdir(parents=True)
    (tmp_path / "proc" / "cpuinfo").write_text(
        f"processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: {flags}\n\nprocessor\t: 1\n")
    d = tmp_path / "sys" / "class" / "dmi" / "id"
    d.mkdir(parents=True)
    for k, v in dmi.items():
        (d / k).write_text(v + "\n")
    return tmp_path


@pytest.mark.parametrize("flags,dmi,virtualized,hint", [
    ("fpu vme sse2 hypervisor avx2", {"sys_vendor": "Amazon EC2", "product_name": "p5.48xlarge",
                                      "bios_vendor": "Amazon EC2"}, True, "amazon-ec2"),
    ("fpu sse2 hypervisor", {"sys_vendor": "QEMU", "product_name": "Standard PC (Q35 + ICH9, 2009)",
                             "bios_vendor": "SeaBIOS"}, True, "qemu"),
    ("fpu sse2 hypervisor", {}, True, None),  # Firecracker: no SMBIOS, only the CPU flag
    ("fpu vme sse2 avx2 avx512f", {"sys_vendor": "Supermicro", "product_name": "SYS-821GE-TNHR",
                                   "bios_vendor": "American Megatrends International, LLC."}, False, None),
])
def test_virtualization_is_detected_from_cpu_flag_and_dmi(tmp_path, flags, dmi, virtualized, hint):
    root = _fixture_root(tmp_path, flags, dmi)
    v = detect_virtualization(root, root, detect_virt_cmd=None)
    assert v["virtualized"] is virtualized
    assert v["dmi_hint"] == hint
    assert v["hypervisor_flag"] is ("hypervisor" in flags)
    if dmi:
        assert v["dmi"]["sys_vendor"] == dmi["sys_vendor"]


def test_systemd_detect_virt_answer_is_recorded(tmp_path):
    root = _fixture_root(tmp_path, "fpu sse2", {"sys_vendor": "Dell Inc."})
    fake = tmp_path / "systemd-detect-virt"
    fake.write_text("#!/bin/sh\necho kvm\n")
    fake.chmod(0o755)
    v = detect_virtualization(root, root, detect_virt_cmd=str(fake))
    assert v["systemd_detect_virt"] == "kvm" and v["virtualized"] is True


@pytest.mark.gpu
def test_tiny_model_variants_on_cuda(tmp_path, hwtune_cli):
    proc = hwtune_cli("--state-dir", tmp_path, "bench", "--preset", "tiny", "--shapes", "2x64",
                      "--prefill", "1x64", "--variants", "eager,graphed,tuned", "--steps", "20",
                      "--energy-window-s", "0", "--json", check=True, timeout=600)
    doc = json.loads(proc.stdout)
    rows = {r["variant"]: r for r in doc["decode"]}
    for v in ("eager", "graphed", "tuned"):
        assert rows[v]["status"] == "ok", rows[v]
        assert rows[v]["rel_l2_vs_eager"] < 5e-2


def _interpreted(request):
    """The fused kernels module under the Triton interpreter, or None when this test was run
    (and passed) in a child process instead: triton decides interpreter or not when it is
    first imported, and in a full run another module (transformers) imports it first. The
    environment variable says nothing about that, so the check looks at triton itself."""
    import os
    import subprocess

    tl = sys.modules.get("triton.language")
    if tl is not None and type(tl.zeros).__name__ != "InterpretedFunction":
        if os.environ.get("HWTUNE_TEST_CHILD"):
            pytest.fail("triton imported without the interpreter even in a fresh process")
        from conftest import ROOT

        env = dict(os.environ, TRITON_INTERPRET="1", HWTUNE_TEST_CHILD="1",
                   PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", request.node.nodeid],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
        return None
    os.environ["TRITON_INTERPRET"] = "1"
    pytest.importorskip("triton")
    from daemon.bench import fused
    return fused


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_fused_rope_kv_write_matches_stock_and_touches_only_the_written_slots(dtype, tol, request):
    fused = _interpreted(request)
    if fused is None:
        return
    cfg = PRESETS["tiny"]
    model = Model(cfg, device="cpu", dtype=dtype)
    model.allocate_cache(3, 24)
    model.fill_cache_random()
    positions = torch.tensor([0, 17, 23])
    qkv = torch.randn(3, cfg.qkv_heads, cfg.head_dim).to(dtype)
    k_s, v_s = model.kv[0, 0].clone(), model.kv[0, 1].clone()
    k_f, v_f = model.kv[0, 0].clone(), model.kv[0, 1].clone()
    stock = StockOps()
    q_s = stock.rope_kv_write(qkv, stock.rope_context(model, positions), positions, k_s, v_s, cfg.heads)
    q_f = fused.rope_kv_write(qkv, positions, model.inv_freq, k_f, v_f, cfg.heads)
    assert q_f.is_contiguous() and q_f.shape == (3, cfg.heads, cfg.head_dim)
    torch.testing.assert_close(q_f.float(), q_s.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(k_f.float(), k_s.float(), rtol=tol, atol=tol)
    rows = torch.arange(3)
    torch.testing.assert_close(v_f[rows, :, positions], qkv[:, cfg.heads + cfg.kv_heads:])
    for a, b in ((k_s, k_f), (v_s, v_f)):
        a[rows, :, positions] = 0
        b[rows, :, positions] = 0
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_fused_silu_mul_matches_stock(dtype, tol, request):
    fused = _interpreted(request)
    if fused is None:
        return
    gate_up = (3 * torch.randn(3, 2 * 1500)).to(dtype)  # F not a multiple of the block
    torch.testing.assert_close(fused.silu_mul(gate_up).float(),
                               StockOps().silu_mul(gate_up).float(), rtol=tol, atol=tol)


def test_tuned_step_with_fused_kernels_matches_stock_on_the_interpreter(request):
    if _interpreted(request) is None:
        return
    from daemon.bench.ops import TunedOps
    from daemon.bench.run import kernels_per_layer
    model = Model(PRESETS["tiny"], device="cpu", dtype=torch.float32)
    model.allocate_cache(2, 32)
    model.fill_cache_random()
    ops = TunedOps(None, "", quick_pick=1)
    used = ops.prepare(model, 2, time_it=False)
    assert used["rope_kv_write"]["impl"].startswith("fused")
    assert used["silu_mul"]["impl"].startswith("fused")
    tokens, positions = torch.tensor([3, 5]), torch.tensor([20, 7])
    before = model.kv.clone()
    ref = model.decode_step(tokens, positions, StockOps())
    kv_ref = model.kv.clone()
    model.kv.copy_(before)
    out = model.decode_step(tokens, positions, ops)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(model.kv, kv_ref, rtol=1e-5, atol=1e-5)
    assert kernels_per_layer(ops, 2)["total"] == 10  # 4 GEMVs + 2 norms + rope/kv + 2 attn + swiglu
    assert kernels_per_layer(StockOps(), 2)["total"] > 10


def test_report_never_divides_one_workload_by_another_and_notes_a_dtype_change():
    from daemon.bench import report
    from daemon.bench.run import FAIR_NOTE

    run = {"label": "workload", "dtype": "bf16", "workload": {"command": "serve-bench --model a", "metric": 200.0}}
    base = {"label": "vm", "dtype": "fp16", "workload": {"command": "serve-bench --model b", "metric": 100.0}}
    md = report.markdown(run, base, png_name=None)
    assert " 2.00 |" not in md  # no ratio between different commands
    assert "serve-bench --model a" in md and "serve-bench --model b" in md
    assert "dtypes differ (bf16 vs fp16)" in md
    same = dict(base, dtype="bf16", workload={"command": "serve-bench --model a", "metric": 100.0})
    assert " 2.00 |" in report.markdown(run, same, png_name=None)
    # The tuned variant runs a fused RoPE+KV-write kernel: the note must not say otherwise.
    assert "RoPE-as-one-bmm" not in FAIR_NOTE and "fused Triton RoPE+KV-write" in FAIR_NOTE


def test_virtualization_is_unknown_when_nothing_could_be_read(tmp_path):
    # No /proc/cpuinfo flags line (e.g. an ARM host), no DMI, no systemd-detect-virt: the
    # fingerprint must not claim bare metal.
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc" / "cpuinfo").write_text("processor\t: 0\nFeatures\t: fp asimd\n")
    v = detect_virtualization(tmp_path, tmp_path, detect_virt_cmd=None)
    assert v["virtualized"] is None
    from daemon.bench.report import notes
    doc = {"fingerprint": {"virtualization": v}}
    base = {"fingerprint": {"virtualization": {"virtualized": True}}}
    assert not any("Bare metal" in n for n in notes(doc, base))
