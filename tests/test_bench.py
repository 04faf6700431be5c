"""hwtune bench: the built-in model, the CLI, --command, --baseline report, fingerprint."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from daemon.bench.fingerprint import detect_virtualization
from daemon.bench.model import PRESETS, Model
from daemon.bench.ops import StockOps
from daemon.bench.run import decode_floor
from tests.conftest import ROOT
from daemon.bench.workload import parse_metric

FINGERPRINT_KEYS = {"host", "virtualization", "gpu", "software", "locked_clocks",
                    "hardware_status", "kernel_table", "hwtune_commit"}
SENTINEL = 777.0
TINY_ARGS = ["bench", "--device", "cpu", "--shapes", "2x16", "--prefill", "1x8",
             "--steps", "20", "--warmup", "2", "--variants", "eager,graphed,tuned,tuned-unfused",
             "--search-evals", "1"]


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
    for variant in ("eager", "tuned", "tuned-unfused"):
        row = decode[variant]
        assert row["status"] == "ok", row
        assert row["tokens_per_s"] > 0 and row["step_ms"] > 0
        assert "tokens_per_j" not in row  # no energy on CPU
    assert decode["graphed"]["status"].startswith("skipped")
    # every substitutable call of the step says what runs: here the search (on the interpreter)
    # kept stock everywhere, and the tuned row says so per call, with the stock it ran
    kernels = decode["tuned"]["kernels"]
    assert {"rmsnorm (layer 0)", "add_rmsnorm (attention)", "linear qkv", "rope + kv write",
            "decode_attention", "swiglu", "linear down", "add_rmsnorm (final)", "lm_head"} <= set(kernels)
    assert all(impl.startswith("stock") for impl in kernels.values()), kernels
    # timed, but the stock step: the row and the table say so, not a bare "ok"
    from daemon.bench.run import ALL_STOCK, format_table
    assert decode["tuned"]["warning"] == ALL_STOCK and "warning" not in decode["eager"]
    assert any(line.startswith("tuned ") and line.endswith(f"  ok; {ALL_STOCK}")
               for line in format_table(doc).splitlines()), format_table(doc)
    assert f"- tuned 2x16: {ALL_STOCK}" in (out / "run" / "report.md").read_text()
    assert decode["tuned"]["kernels_per_layer"] == decode["tuned"]["kernels_per_layer_stock"]
    # no fused entry: both tuned variants run the unfused step, and say why per fusion point
    assert decode["tuned-unfused"]["kernels"] == kernels
    assert all(w.startswith("unfused") for w in decode["tuned"]["fusions"].values()), decode["tuned"]["fusions"]
    assert set(decode["tuned"]["fusions"]) == {"qkv_rope", "qkv", "attention", "o", "gate_up", "down", "head"}
    assert decode["eager"]["kernels_per_layer"]["total"] == decode["tuned"]["kernels_per_layer"]["total"] == 16
    # with no table in the state dir, bench searched the model's own decode shapes first
    searched = {(d["kernel"], json.dumps(d["shape"], sort_keys=True)): d for d in doc["kernel_table"]["search"]}
    assert ("linear", json.dumps({"K": 64, "M": 2, "N": 128}, sort_keys=True)) in searched  # the qkv GEMV
    assert not any(k == "matmul" for k, _ in searched)  # the model's projections are nn.Linear-shaped
    # the fused decode kernels' shapes are looked at first: searched once their template exists
    from kernelsearch.kernels import TEMPLATES
    fused_shapes = {"rmsnorm_linear": {"K": 64, "M": 2, "N": 128}, "linear_residual": {"K": 128, "M": 2, "N": 64},
                    "rmsnorm_gate_up_swiglu": {"I": 128, "K": 64, "M": 2},
                    "rmsnorm_qkv_rope": {"B": 2, "D": 16, "Hkv": 2, "Hq": 4, "K": 64, "S": 64}}
    for kernel, shape in fused_shapes.items():
        d = searched[(kernel, json.dumps(shape, sort_keys=True))]
        assert ("kept" in d) if kernel in TEMPLATES else d["result"] == "not searched: no built-in template here (stock)"
    order = [d["kernel"] for d in doc["kernel_table"]["search"] if "kept" in d]
    assert order[0] == next(k for k in ("rmsnorm_gate_up_swiglu", "rmsnorm_linear", "linear_residual", "linear")
                            if k in TEMPLATES)  # the fused kernels are searched first
    assert ("swiglu", json.dumps({"I": 128, "M": 2}, sort_keys=True)) in searched
    done = [d for d in searched.values() if "kept" in d]
    assert done and all(d["against"] for d in done) and not any(d["kept"] for d in done)
    # (not searched while this checkout has no rope_kv_write spec; searched once it has)
    assert ("rope_kv_write", json.dumps({"B": 2, "D": 16, "Hkv": 2, "Hq": 4, "S": 64}, sort_keys=True)) in searched
    assert (out / "state" / "ledger.sqlite").exists()
    assert doc["kernel_table"]["loaded"] and doc["kernel_table"]["path"].startswith(str(out / "state" / "dispatch"))
    for variant in ("eager", "tuned", "tuned-unfused"):  # the no-head step is timed too, against the no-head floor
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
    # the state dir of tiny_run: its search covered these decode shapes already
    proc = hwtune_cli("--state-dir", tiny_run[1] / "state", *TINY_ARGS,
                      "--baseline", tmp_path / "base.json", "--out", tmp_path / "cmp", check=True)
    assert "autotable: search" not in proc.stderr
    md = (tmp_path / "cmp" / "report.md").read_text()
    assert "ratio tokens/s" in md and "| decode | eager | 2 | 16 |" in md
    assert "NVIDIA H100 80GB HBM3" in md  # fingerprint differences side by side
    assert "GPUs differ" in md
    assert "same fused weights" in md
    png = (tmp_path / "cmp" / "report.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 1000
    assert "eager" in proc.stdout  # the table for people
    # the comparison on the terminal too, not only in report.md (before: the table alone)
    assert "against baseline cloud-vm" in proc.stdout and "tokens/s (" in proc.stdout, proc.stdout
    # said where the run is read too, not only in report.md (the terminal and results.json)
    assert "against " in proc.stderr and "GPUs differ" in proc.stderr and "environment fields that differ" in proc.stderr
    said = json.loads((tmp_path / "cmp" / "results.json").read_text())["baseline"]["differences"]
    assert any("GPUs differ" in line for line in said)


def test_report_from_recorded_results_compares_without_measuring(tiny_run, tmp_path, hwtune_cli):
    doc, out = tiny_run
    proc = hwtune_cli("bench", "--from-results", out / "run" / "results.json",
                      "--baseline", out / "run" / "results.json", "--out", tmp_path / "r", check=True)
    md = (tmp_path / "r" / "report.md").read_text()
    assert "| 1.00 |" in md  # a run against itself
    assert "Both runs are virtualized" in md or not doc["fingerprint"]["virtualization"]["virtualized"]
    assert (tmp_path / "r" / "report.png").read_bytes()[:4] == b"\x89PNG"
    assert proc.returncode == 0
    assert "against baseline" in proc.stdout and "decode eager B=2 ctx=16:" in proc.stdout, proc.stdout
    assert "(1.00x)" in proc.stdout


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


def test_a_metric_regex_that_does_not_compile_is_refused_before_the_command_runs(tmp_path, hwtune_cli):
    marker = tmp_path / "ran"
    proc = hwtune_cli("--state-dir", tmp_path / "state", "bench", "--device", "cpu",
                      "--command", f"touch {marker}", "--metric-regex", "tokens/s: (")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith("hwtune bench: --metric-regex 'tokens/s: (': not a regular expression")
    assert not marker.exists()


@pytest.mark.parametrize("flag", ["--from-results", "--baseline"])
@pytest.mark.parametrize("text", ["[1, 2]", "{}", '"results"'])
def test_a_json_file_that_is_not_a_results_document_is_a_usage_error(tmp_path, hwtune_cli, flag, text):
    # before: a JSON list was an AttributeError traceback, {} an exit 1 with nothing said
    doc = tmp_path / "other.json"
    doc.write_text(text)
    proc = hwtune_cli("--state-dir", tmp_path / "state", "bench", flag, doc, "--command", "true",
                      "--out", tmp_path / "report")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip() == f"hwtune bench: {flag} {doc}: not a results document of hwtune bench " \
                                  "(its results.json: decode, prefill or workload results)"
    assert not (tmp_path / "state").exists() and not (tmp_path / "report").exists()


def test_metric_parser_reads_json_lines_and_custom_regexes():
    assert parse_metric('{"metric": 5.5, "unit": "req/s"}\nnoise') == (5.5, '{"metric": 5.5, "unit": "req/s"}')
    assert parse_metric("tokens/s=10\n{\"metric\": 7}")[0] == 7.0
    assert parse_metric("throughput 42 req/s", r"throughput ([0-9.]+)")[0] == 42.0
    assert parse_metric("tokens/s: n/a")[0] is None


def test_bad_shapes_are_refused_with_exit_2(tmp_path, hwtune_cli):
    proc = hwtune_cli("--state-dir", tmp_path, "bench", "--device", "cpu", "--shapes", "8by2048")
    assert proc.returncode == 2 and "8by2048" in proc.stderr


@pytest.mark.parametrize("flag,value,why", [("--layers", "0", "at least 1"), ("--layers", "-1", "at least 1"),
                                            ("--vocab", "0", "at least 1"), ("--warmup", "-1", "at least 0"),
                                            ("--budget-s", "-1", "a positive number of seconds"),
                                            ("--budget-s", "nan", "a positive number of seconds"),
                                            ("--energy-window-s", "1", "0 (no energy) or at least 2 seconds"),
                                            ("--energy-window-s", "-3", "0 (no energy) or at least 2 seconds")])
def test_model_size_warmup_and_time_options_out_of_range_are_refused_before_measuring(tmp_path, hwtune_cli,
                                                                                     flag, value, why):
    # before: --layers 0 / --vocab 0 measured an empty model "ok", --layers -1 ended in error rows,
    # --budget-s -1 skipped every measurement (exit 1), --warmup -1 timed the first calls
    proc = hwtune_cli("--state-dir", tmp_path / "state", "bench", "--device", "cpu", "--variants", "eager",
                      flag, value, timeout=120)
    assert proc.returncode == 2 and proc.stdout == "", (proc.returncode, proc.stdout, proc.stderr)
    assert proc.stderr.strip() == f"hwtune bench: {flag} {value}: {why}"


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


class RecordingTable:
    """A dispatch table stand-in that records what TunedOps asks and, for the kernels given,
    answers with an entry and runs `impl` (the contract's reference) as the table's call."""

    def __init__(self, impls=None):
        self.impls = impls or {}
        self.lookups, self.calls = [], []

    def lookup(self, kernel, shape, dtype):
        self.lookups.append((kernel, dict(shape), dtype))
        if kernel not in self.impls:
            return None
        from kernelsearch.entry import Entry
        return Entry.make(kernel=kernel, dtype=dtype, shape=shape, source={"module": "test." + kernel},
                          params={"P": 1}, plan={"steps": [{"op": "launch"}]}, speedup=2.0,
                          against="the test's stock")

    def route(self, kernel, *args):
        return (object(), {}, "tuned") if kernel in self.impls else (None, None, "no entry for shape")

    def call(self, kernel, *args):
        self.calls.append((kernel, args))
        return self.impls[kernel](*args)


def _step_pair(ops, batch=2, ctx=16, seed=0):
    """(logits, kv) of one decode step with `ops`, and of the same step with StockOps."""
    from daemon.bench.ops import cache_len

    model = Model(PRESETS["tiny"], device="cpu", dtype=torch.float32, seed=seed)
    model.allocate_cache(batch, cache_len(ctx))
    model.fill_cache_random()
    tokens = torch.arange(1, batch + 1) * 7
    positions = torch.tensor([ctx, 3][:batch] + [ctx] * max(0, batch - 2))
    before = model.kv.clone()
    want = model.decode_step(tokens, positions, StockOps())
    kv_want = model.kv.clone()
    model.kv.copy_(before)
    got = model.decode_step(tokens, positions, ops)
    return model, (got, model.kv.clone()), (want, kv_want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_cos_sin_are_exactly_the_stock_rotation_matrices_in_the_rotate_half_convention(dtype):
    from kernelsearch.specs.rope import rope_native

    model = Model(PRESETS["tiny"], device="cpu", dtype=dtype)
    model.allocate_cache(3, 64)
    positions = torch.tensor([0, 17, 63])
    cos, sin = model.rope_cos_sin(positions)
    d, h = PRESETS["tiny"].head_dim, PRESETS["tiny"].head_dim // 2
    assert cos.shape == sin.shape == (3, d) and cos.dtype == sin.dtype == dtype
    torch.testing.assert_close(cos[:, :h], cos[:, h:], rtol=0, atol=0)  # cos = cat(c, c)
    rot = model.rope_matrices(positions)  # what the stock step multiplies by: diag(cos) + P * sin
    i = torch.arange(h)
    assert torch.equal(torch.diagonal(rot, dim1=1, dim2=2), cos)
    assert torch.equal(rot[:, i, i + h], sin[:, i + h]) and torch.equal(rot[:, i + h, i], -sin[:, i])
    x = torch.randn(3, 5, d).to(dtype)
    want = torch.bmm(x.float(), rot.float())
    got, _ = rope_native(x.float(), x[:, :1].float(), cos.float(), sin.float())  # the rope specs' stock
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_tuned_ops_ask_the_table_for_every_call_of_the_step_with_its_dispatch_shape():
    from kernelsearch.dispatch import SHAPE_OF as DISPATCH_SHAPE_OF
    from daemon.bench.ops import FUSED, SHAPE_OF, TunedOps, cache_len, decode_shapes

    table = RecordingTable()
    ops = TunedOps(table, "test table")
    model, (got, kv), (want, kv_want) = _step_pair(ops)
    assert torch.equal(got, want) and torch.equal(kv, kv_want)  # no entry anywhere: exactly stock
    asked = {(k, json.dumps(s, sort_keys=True)) for k, s, dt in table.lookups}
    assert {dt for _, _, dt in table.lookups} == {"float32"}
    expected = {(k, json.dumps(s, sort_keys=True))
                for k, shapes in decode_shapes(model.cfg, [(2, 16)]).items() for s in shapes}
    assert asked == expected  # what autotable searches is exactly what the step looks up
    assert {k for k, _ in asked} >= set(FUSED) and "matmul" not in {k for k, _ in asked}
    # the previous tuned step asks only about the unfused kernels, and autotable searches those
    unfused = RecordingTable()
    _step_pair(TunedOps(unfused, "test table", fused=False))
    expected = {(k, json.dumps(s, sort_keys=True))
                for k, shapes in decode_shapes(model.cfg, [(2, 16)], fused=False).items() for s in shapes}
    assert {(k, json.dumps(s, sort_keys=True)) for k, s, _ in unfused.lookups} == expected
    assert not {k for k, _ in expected} & set(FUSED)
    assert ("rope_kv_write", json.dumps({"B": 2, "D": 16, "Hkv": 2, "Hq": 4, "S": cache_len(16)},
                                        sort_keys=True)) in asked
    assert not table.calls
    # the shape keys are the dispatch runtime's, for every kernel it knows
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    samples = {"rmsnorm": (r(2, 64), r(64), 1e-5), "add_rmsnorm": (r(2, 64), r(2, 64), r(64), 1e-5),
               "linear": (r(2, 64), r(96, 64)), "swiglu": (r(2, 256),),
               "rmsnorm_linear": (r(2, 64), r(64), r(96, 64), 1e-5),
               "rmsnorm_gate_up_swiglu": (r(2, 64), r(64), r(256, 64), 1e-5),
               "linear_residual": (r(2, 64), r(96, 64), r(2, 96)),
               "decode_attention": (r(2, 4, 16), r(2, 2, 64, 16), r(2, 2, 64, 16),
                                    torch.tensor([5, 64], dtype=torch.int32), 0.25),
               "rope_kv_write": (r(2, 8, 16), r(2, 16), r(2, 16), torch.tensor([1, 5]),
                                 r(2, 2, 64, 16), r(2, 2, 64, 16))}
    assert SHAPE_OF is DISPATCH_SHAPE_OF  # one definition: each spec's call_shape
    assert {k: SHAPE_OF[k](a) for k, a in samples.items() if k != "rope_kv_write"} == {
        "rmsnorm": {"M": 2, "N": 64}, "add_rmsnorm": {"M": 2, "N": 64},
        "linear": {"M": 2, "K": 64, "N": 96}, "swiglu": {"M": 2, "I": 128},
        "rmsnorm_linear": {"M": 2, "K": 64, "N": 96}, "rmsnorm_gate_up_swiglu": {"M": 2, "K": 64, "I": 128},
        "linear_residual": {"M": 2, "K": 64, "N": 96},
        "decode_attention": {"B": 2, "Hq": 4, "Hkv": 2, "S": 64, "D": 16}}
    assert SHAPE_OF["rope_kv_write"](samples["rope_kv_write"]) == {"B": 2, "Hq": 4, "Hkv": 2, "D": 16, "S": 64}


def _rope_kv_write_reference(qkv, cos, sin, positions, k_cache, v_cache):
    """The rope_kv_write contract (branch ropekv's spec), written out: q_out returned, k and v
    written into the caches at each row's position."""
    from kernelsearch.specs.rope import rope_native

    hkv = k_cache.shape[1]
    hq = qkv.shape[1] - 2 * hkv
    q, k = rope_native(qkv[:, :hq], qkv[:, hq:hq + hkv], cos, sin)
    rows = torch.arange(qkv.shape[0])
    k_cache[rows, :, positions] = k
    v_cache[rows, :, positions] = qkv[:, hq + hkv:]
    return q.contiguous()


def test_rope_kv_write_goes_to_the_table_with_the_spec_contract_where_it_has_an_entry():
    from daemon.bench.ops import TunedOps, describe_kernels, kernels_per_layer

    table = RecordingTable({"rope_kv_write": _rope_kv_write_reference})
    ops = TunedOps(table, "test table")
    model, (got, kv), (want, kv_want) = _step_pair(ops)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kv, kv_want, rtol=1e-5, atol=1e-5)
    calls = [args for kernel, args in table.calls if kernel == "rope_kv_write"]
    assert len(calls) == model.cfg.layers
    cos, sin = model.rope_cos_sin(torch.tensor([16, 3]))
    for i, (qkv, c, s, positions, k_cache, v_cache) in enumerate(calls):
        assert qkv.shape == (2, model.cfg.qkv_heads, model.cfg.head_dim)
        assert torch.equal(c, cos) and torch.equal(s, sin)  # [B, D], computed once per step
        assert c is calls[0][1]                              # shared by every layer
        assert positions.dtype == torch.int64 and positions.tolist() == [16, 3]
        assert k_cache.data_ptr() == model.kv[i, 0].data_ptr() and v_cache.data_ptr() == model.kv[i, 1].data_ptr()
    used = describe_kernels(ops, model.cfg, 2, model.s_max, "float32")
    assert used["rope + kv write"]["impl"].startswith("tuned test.rope_kv_write")
    assert used["rope + kv write"]["against"] == "the test's stock" and used["rope + kv write"]["speedup"] == 2.0
    assert used["linear qkv"]["impl"] == "stock"
    counts = kernels_per_layer(ops, model.cfg, 2, model.s_max, "float32")
    stock = kernels_per_layer(StockOps(), model.cfg, 2, model.s_max, "float32")
    assert counts["rope + kv write"] == 1 and stock["rope + kv write"] == 4
    assert counts["total"] == stock["total"] - 3


def test_a_tuned_step_with_wrong_logits_is_an_error_naming_the_op_and_nothing_is_dropped():
    from daemon.bench.ops import TunedOps, cache_len
    from daemon.bench.run import Bench

    def bad_swiglu(gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return torch.sigmoid(gate) * up  # not silu

    table = RecordingTable({"swiglu": bad_swiglu, "rope_kv_write": _rope_kv_write_reference})
    ops = TunedOps(table, "test table")
    model = Model(PRESETS["tiny"], device="cpu", dtype=torch.float32)
    model.allocate_cache(2, cache_len(16))
    model.fill_cache_random()
    tokens, positions = torch.tensor([3, 5]), torch.tensor([16, 16])
    ref = model.decode_step(tokens, positions, StockOps()).float()
    problem = Bench._check_tuned(model, tokens, positions, ops, ref, 1e-3)
    assert problem and "logits differ" in problem and "swiglu" in problem and "rope_kv_write" not in problem
    assert ops.stock_only == set() and ops.tuned_kernels() == ["rope_kv_write", "swiglu"]
    good = TunedOps(RecordingTable({"rope_kv_write": _rope_kv_write_reference}), "test table")
    assert Bench._check_tuned(model, tokens, positions, good, ref, 1e-3) is None


def test_ensure_table_searches_only_the_missing_shapes_within_the_budget_and_then_covers_them(tmp_path):
    from daemon.bench.autotable import ensure_table

    state = tmp_path / "state"
    shapes = {"rmsnorm": [{"M": 2, "N": 64}], "no_such_kernel": [{"M": 1}]}
    lines, details = [], []
    table, note = ensure_table(state_dir=state, device="cpu", dtype="fp32", shapes=shapes, budget_s=0,
                               progress=lines.append, details=details)
    assert table is None and "time budget" in note and not (state / "ledger.sqlite").exists()
    assert {d["kernel"]: d["result"] for d in details} == {"rmsnorm": "not searched: time budget",
                                                           "no_such_kernel": "not searched: no spec here (stock)"}
    lines, details = [], []
    table, note = ensure_table(state_dir=state, device="cpu", dtype="fp32", shapes=shapes, budget_s=120,
                               progress=lines.append, details=details, evals=1)
    assert table is not None and table.path.parent == state / "dispatch", note
    assert any("search rmsnorm on 1 shape(s): M=2 N=64" in line for line in lines), lines
    assert "searched 1 of 2 missing decode shapes" in note and "no_such_kernel" in note
    row = next(d for d in details if d["kernel"] == "rmsnorm")
    assert row["against"] == "torch.nn.functional.rms_norm" and row["dtype"] == "float32" and "kept" in row
    lines = []
    again, note = ensure_table(state_dir=state, device="cpu", dtype="float32", shapes={"rmsnorm": shapes["rmsnorm"]},
                               budget_s=120, progress=lines.append)
    assert not any("search rmsnorm" in line for line in lines) and "covers all 1" in note
    # a table given explicitly is used as it is, never searched into
    given = tmp_path / "given.json"
    given.write_text(json.dumps({"format": 1, "entries": []}))
    lines = []
    t, note = ensure_table(state_dir=tmp_path / "other", device="cpu", dtype="float32", shapes=shapes,
                           budget_s=120, table_path=given, progress=lines.append)
    assert t is not None and t.path == given and "not searched into" in note and not lines
    assert not (tmp_path / "other").exists()


def test_ensure_table_says_when_a_given_table_was_made_for_another_device(tmp_path):
    """A table searched on an H200, given on another device: route() refuses every entry there
    (fingerprint), so the note must not read "N of M decode shapes have an entry"."""
    from daemon.bench.autotable import ensure_table
    from kernelsearch.fingerprint import collect, fingerprint_id

    given = tmp_path / "h200.json"
    here = fingerprint_id(collect("cpu"))
    for fp, routes in (("nvidia-h200-50678010", False), (here, True)):
        given.write_text(json.dumps({"format": 1, "fingerprint_id": fp, "entries": []}))
        t, note = ensure_table(state_dir=tmp_path / "s", device="cpu", dtype="float32",
                               shapes={"rmsnorm": [{"M": 2, "N": 64}]}, budget_s=120, table_path=given,
                               progress=lambda line: None)
        assert t is not None and "not searched into" in note
        if routes:
            assert "0 of 1 decode shapes have an entry" in note and "none of its" not in note, note
        else:
            assert (f"made for nvidia-h200-50678010, this device is {here}: none of its 0 entries "
                    f"for these 1 decode shapes routes here, every call runs stock") in note, note


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
    # The tuned variant may run the table's RoPE+KV-write kernel: the note must not deny it.
    assert "RoPE-as-one-bmm" not in FAIR_NOTE and "dispatch table" in FAIR_NOTE


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


VERIFIED_CHILD = textwrap.dedent('''
    import json, sys
    import torch
    from daemon.bench.model import PRESETS, Model
    from daemon.bench.ops import StockOps, TunedOps, cache_len, describe_kernels, kernels_per_layer
    from kernelsearch.dispatch import DispatchTable
    from tests.tuned_tables import verified_table

    cfg, B, CTX = PRESETS["tiny"], 2, 16
    S = cache_len(CTX)
    table = verified_table([
        ("add_rmsnorm", {"M": B, "N": cfg.hidden}, "float32", {}),
        ("swiglu", {"M": B, "I": cfg.ffn}, "float32", {}),
        ("linear", {"M": B, "K": cfg.hidden, "N": cfg.qkv_heads * cfg.head_dim}, "float32",
         {"variant": "gemv", "BLOCK_M": 8, "BLOCK_N": 32, "BLOCK_K": 64, "GROUP_M": 8,
          "SPLIT_K": 2, "FMA": 0, "num_warps": 4, "num_stages": 3, "REDUCE": "last"}),
        ("decode_attention", {"B": B, "Hq": cfg.heads, "Hkv": cfg.kv_heads, "S": S, "D": cfg.head_dim},
         "float32", {"BLOCK_S": 16, "NUM_SPLITS": 2, "num_warps": 4, "num_stages": 1}),
        ("rope_kv_write", {"B": B, "Hq": cfg.heads, "Hkv": cfg.kv_heads, "D": cfg.head_dim, "S": S},
         "float32", {}),
    ])
    table.save(sys.argv[1])
    small = DispatchTable(table.to_json())  # one cheap entry: what the CLI test runs 40+ steps of
    small.entries = [e for e in small.entries if e.kernel == "swiglu"]
    small.save(sys.argv[2])
    model = Model(cfg, device="cpu", dtype=torch.float32)
    model.allocate_cache(B, S)
    model.fill_cache_random()
    tokens, positions = torch.tensor([3, 5]), torch.tensor([CTX, 7])
    before = model.kv.clone()
    want = model.decode_step(tokens, positions, StockOps())
    kv_want = model.kv.clone()
    model.kv.copy_(before)
    ops = TunedOps(table, "verified")
    got = model.decode_step(tokens, positions, ops)
    used = describe_kernels(ops, cfg, B, S, "float32")
    print(json.dumps({
        "err": float((got - want).abs().max()), "kv_err": float((model.kv - kv_want).abs().max()),
        "counts": {f"{k}:{r}": n for (k, r), n in table.counts.items()},
        "impl": {label: u["impl"] for label, u in used.items()},
        "launches": {label: u.get("launches") for label, u in used.items()},
        "per_layer": kernels_per_layer(ops, cfg, B, S, "float32"),
        "per_layer_stock": kernels_per_layer(StockOps(), cfg, B, S, "float32")}))
''')


@pytest.fixture(scope="module")
def verified_run(tmp_path_factory):
    """A table of harness-verified template entries at the tiny model's decode shapes (made in a
    child with TRITON_INTERPRET=1), and one tuned decode step through it."""
    import os
    import subprocess

    from conftest import ROOT

    path = tmp_path_factory.mktemp("verified") / "table.json"
    small = path.with_name("swiglu-only.json")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", VERIFIED_CHILD, str(path), str(small)], cwd=ROOT, env=env,
                          text=True, capture_output=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), small


def test_tuned_step_runs_the_tables_verified_kernels_on_the_interpreter_and_stock_elsewhere(verified_run):
    report, _ = verified_run
    assert report["err"] < 1e-4 and report["kv_err"] < 1e-5
    layers = PRESETS["tiny"].layers
    # add_rmsnorm: 2 per layer but the first, plus the final norm; linear: only the qkv shape
    assert report["counts"] == {"add_rmsnorm:tuned": 2 * layers, "swiglu:tuned": layers,
                                "linear:tuned": layers, "decode_attention:tuned": layers,
                                "rope_kv_write:tuned": layers}
    impl = report["impl"]
    for label, module in (("add_rmsnorm (mlp)", "add_rmsnorm"), ("swiglu", "swiglu"), ("linear qkv", "linear"),
                          ("decode_attention", "decode_attention"), ("rope + kv write", "rope_kv_write")):
        assert impl[label].startswith(f"tuned kernelsearch.kernels.{module} "), impl
    for label in ("rmsnorm (layer 0)", "linear o", "linear gate_up", "linear down", "lm_head"):
        assert impl[label] == "stock", impl
    per_layer, stock = report["per_layer"], report["per_layer_stock"]
    assert per_layer["swiglu"] == report["launches"]["swiglu"] >= 1 and stock["swiglu"] == 2
    assert per_layer["rope + kv write"] == report["launches"]["rope + kv write"] == 1 and stock["rope + kv write"] == 4
    # q comes out of the tuned rope_kv_write contiguous: no copy before the tuned attention
    assert per_layer["decode_attention"] == report["launches"]["decode_attention"]
    assert per_layer["linear o"] == 1 and per_layer["total"] == sum(v for k, v in per_layer.items() if k != "total")


def test_bench_with_a_given_table_runs_its_entries_and_does_not_search(verified_run, tmp_path, hwtune_cli):
    _, path = verified_run
    proc = hwtune_cli("--state-dir", tmp_path / "state", "bench", "--device", "cpu", "--shapes", "2x16",
                      "--prefill", "1x8", "--steps", "20", "--warmup", "1", "--variants", "eager,tuned",
                      "--table", path, "--json", check=True, timeout=300)
    doc = json.loads(proc.stdout)
    tuned = next(r for r in doc["decode"] if r["variant"] == "tuned")
    assert tuned["status"] == "ok" and tuned["rel_l2_vs_eager"] < 1e-4, tuned
    assert tuned["kernels"]["swiglu"].startswith("tuned kernelsearch.kernels.swiglu")
    assert "warning" not in tuned   # one tuned kernel ran: not the all-stock warning
    assert "no speedup recorded" in tuned["kernels"]["swiglu"]  # the entry's own speedup field
    assert tuned["kernels"]["linear o"].startswith("stock (no table entry")
    assert "not searched into" in doc["kernel_table"]["note"] and doc["kernel_table"]["search"] == []
    assert "autotable" not in proc.stderr and not (tmp_path / "state" / "ledger.sqlite").exists()
    from daemon.bench.report import interpreted
    assert interpreted(doc, tuned)


def test_ensure_table_starts_a_kernel_only_when_its_share_of_the_budget_is_likely_to_fit(tmp_path, monkeypatch):
    import time as _time

    import kernelsearch.search as ks
    from daemon.bench.autotable import ensure_table

    calls = []

    def fake_search(kernel, *, shapes, dtype, budget, dispatch_path, device, **kw):
        calls.append({"kernel": kernel, "shapes": shapes, "dtype": dtype, "budget": budget,
                      "path": dispatch_path, "device": device, "limit": kw.get("time_limit_s")})
        _time.sleep(0.4)  # 0.4 s for one evaluation of one shape
        return type("R", (), {"shapes": [ks.ShapeReport(shape=s, dtype=dtype, stock_ms=1.0) for s in shapes],
                          "unfinished": []})()

    monkeypatch.setattr(ks, "search", fake_search)
    shapes = {"rmsnorm": [{"M": 1, "N": 64}, {"M": 2, "N": 64}], "matmul": [{"M": 1, "K": 64, "N": 64}]}
    details = []
    table, note = ensure_table(state_dir=tmp_path, device="cpu", dtype="bf16", shapes=shapes, budget_s=0.6,
                               progress=lambda line: None, evals=1, details=details)
    # matmul first (GEMMs lead); rmsnorm's two shapes would need ~0.8 s of the ~0.2 s left
    assert [c["kernel"] for c in calls] == ["matmul"]
    assert calls[0]["dtype"] == "bfloat16" and calls[0]["budget"] == 1 and calls[0]["shapes"] == shapes["matmul"]
    assert 0.5 < calls[0]["limit"] <= 0.6      # the search itself stops at what is left of the budget
    assert str(calls[0]["path"]).startswith(str(tmp_path / "dispatch"))
    assert {d["kernel"]: d["result"] for d in details}["rmsnorm"] == "not searched: time budget"
    assert table is None and "rmsnorm x2 (time budget)" in note and "searched 1 of 3" in note


def test_ensure_table_names_shapes_whose_search_the_time_budget_cut_short(tmp_path, monkeypatch):
    import kernelsearch.search as ks
    from daemon.bench.autotable import ensure_table

    shapes = {"rmsnorm": [{"M": 1, "N": 64}, {"M": 2, "N": 64}]}

    def fake_search(kernel, *, shapes, dtype, **kw):
        first, second = (ks.ShapeReport(shape=s, dtype=dtype, stock_ms=1.0) for s in shapes)
        second.speedup = 1.01
        return type("R", (), {"shapes": [first, second], "unfinished": [shapes[1]]})()

    monkeypatch.setattr(ks, "search", fake_search)
    details = []
    table, note = ensure_table(state_dir=tmp_path, device="cpu", dtype="bf16", shapes=shapes, budget_s=60,
                               progress=lambda line: None, evals=1, details=details)
    results = [d["result"] for d in details]
    assert results[0].startswith("stock kept")
    assert results[1].startswith("not finished: time budget; stock for now") and "1.01x" in results[1]
    assert "searched 1 of 2" in note and "rmsnorm x1 (cut short by the time budget" in note


def test_a_search_killed_half_way_does_not_cover_its_shapes_and_is_resumed_next_time(tmp_path):
    """A search child SIGKILLed after its first ledger rows (a bench timeout) leaves attempts but
    no finished-search record: the next ensure_table searches the shape again, taking the
    attempts the ledger holds instead of measuring them twice; once finished, the shape is covered."""
    import os
    import signal
    import sqlite3
    import subprocess
    import time as _time

    from daemon.bench.autotable import ensure_table
    from tests.conftest import ROOT as REPO

    state = tmp_path / "state"
    shapes = {"rmsnorm": [{"M": 2, "N": 64}]}
    script = ("from daemon.bench.autotable import ensure_table\n"
              f"ensure_table(state_dir={str(state)!r}, device='cpu', dtype='fp32', "
              f"shapes={shapes!r}, budget_s=600, evals=6)\n")
    env = dict(os.environ, TRITON_INTERPRET="1")
    child = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    ledger = state / "ledger.sqlite"

    def attempts():
        if not ledger.exists():
            return 0
        try:
            with sqlite3.connect(ledger) as db:
                return db.execute("SELECT COUNT(*) FROM attempts").fetchone()[0]
        except sqlite3.OperationalError:
            return 0
    deadline = _time.monotonic() + 240
    while attempts() == 0 and child.poll() is None and _time.monotonic() < deadline:
        _time.sleep(0.2)
    os.killpg(child.pid, signal.SIGKILL)
    child.wait()
    killed_rows = attempts()
    assert killed_rows >= 1, "the search child wrote no attempt before the deadline"
    with sqlite3.connect(ledger) as db:
        assert db.execute("SELECT COUNT(*) FROM searches").fetchone()[0] == 0

    lines = []
    table, note = ensure_table(state_dir=state, device="cpu", dtype="fp32", shapes=shapes, budget_s=600,
                               progress=lines.append, evals=6)
    assert any("search rmsnorm on 1 shape(s)" in line for line in lines), lines
    assert "searched 1 of 1 missing" in note, note
    with sqlite3.connect(ledger) as db:
        # the same 6 grid points as the killed search: the ones it recorded are taken from the
        # ledger, only the rest measured (whatever order its parallel children finished in)
        total, distinct = db.execute("SELECT COUNT(*), COUNT(DISTINCT shape || ' ' || params) "
                                     "FROM attempts").fetchone()
        done = db.execute("SELECT kernel, dtype, shape FROM searches").fetchall()
    assert total == distinct == 6 and killed_rows < 6, "attempts the killed search recorded were measured again"
    assert done == [("rmsnorm", "float32", '{"M":2,"N":64}')]
    lines = []
    _, note = ensure_table(state_dir=state, device="cpu", dtype="fp32", shapes=shapes, budget_s=600,
                           progress=lines.append)
    assert not any("search rmsnorm" in line for line in lines) and "covers all 1" in note


def test_a_search_of_an_older_template_does_not_cover_its_shapes(tmp_path):
    from daemon.bench.autotable import _searched
    from kernelsearch.fingerprint import collect, fingerprint_id
    from kernelsearch.kernels import template_path
    from kernelsearch.ledger import Ledger, file_hash

    fp = fingerprint_id(collect("cpu"))
    with Ledger(tmp_path / "ledger.sqlite") as ledger:
        for kernel, digest in (("rmsnorm", "0" * 16), ("swiglu", file_hash(template_path("swiglu")))):
            ledger.record_search(run_id="r", kernel=kernel, shapes=[("float32", {"M": 1, "N": 64})],
                                 strategy="grid", budget=2, source_hash=digest, fingerprint=fp,
                                 code_version="ks-x", kept=[False])
    assert _searched(tmp_path, fp, ["rmsnorm", "swiglu"]) == {("swiglu", "float32", '{"M":1,"N":64}')}
    assert _searched(tmp_path, "another-fingerprint", ["rmsnorm", "swiglu"]) == set()


def test_only_a_search_where_stock_won_covers_its_shape(tmp_path):
    """A finished search that kept a kernel covers its shape only through the table's entry: a
    table re-seeded without it must not read "stock won" there. The latest search decides, and
    a row of unknown outcome (a ledger from before `kept`) covers nothing."""
    import sqlite3

    from daemon.bench.autotable import _searched
    from kernelsearch.fingerprint import collect, fingerprint_id
    from kernelsearch.kernels import template_path
    from kernelsearch.ledger import Ledger, file_hash

    fp, digest = fingerprint_id(collect("cpu")), file_hash(template_path("rmsnorm"))
    shapes = [("float32", {"M": m, "N": 64}) for m in (1, 2, 3, 4)]
    key = lambda m: ("rmsnorm", "float32", f'{{"M":{m},"N":64}}')   # noqa: E731
    with Ledger(tmp_path / "ledger.sqlite") as ledger:
        common = dict(run_id="r", kernel="rmsnorm", strategy="grid", budget=2, source_hash=digest,
                      fingerprint=fp, code_version="ks-x")
        ledger.record_search(shapes=shapes[:3], kept=[False, True, False], **common)
        ledger.record_search(shapes=[shapes[2]], kept=[True], **common)   # M=3: kept the second time
        ledger.record_search(shapes=[shapes[3]], **common)                # M=4: outcome not known
        try:
            ledger.record_search(shapes=shapes[:2], kept=[True], **common)
        except ValueError as exc:
            assert "1 kept flag(s) for 2 shape(s)" in str(exc)
        else:
            raise AssertionError("kept flags not matching the shapes were stored")
    assert _searched(tmp_path, fp, ["rmsnorm"]) == {key(1)}

    # a ledger written before the column: opening it adds the column, its old rows cover nothing
    old = tmp_path / "old"
    old.mkdir()
    with sqlite3.connect(old / "ledger.sqlite") as db:
        db.execute("CREATE TABLE searches (id INTEGER PRIMARY KEY, run_id TEXT NOT NULL, kernel TEXT NOT NULL, "
                   "dtype TEXT NOT NULL, shape TEXT NOT NULL, strategy TEXT NOT NULL, budget INTEGER NOT NULL, "
                   "source_hash TEXT NOT NULL, fingerprint TEXT NOT NULL, code_version TEXT NOT NULL, "
                   "finished_at REAL NOT NULL)")
        db.execute("INSERT INTO searches (run_id, kernel, dtype, shape, strategy, budget, source_hash, "
                   "fingerprint, code_version, finished_at) VALUES ('r', 'rmsnorm', 'float32', "
                   "'{\"M\":1,\"N\":64}', 'grid', 2, ?, ?, 'ks-x', 0)", (digest, fp))
    assert _searched(old, fp, ["rmsnorm"]) == set()
    with Ledger(old / "ledger.sqlite") as ledger:
        ledger.record_search(shapes=[shapes[0]], kept=[False], **common)
    assert _searched(old, fp, ["rmsnorm"]) == {key(1)}


def test_a_tuned_step_makes_no_rotation_matrices_nor_mask_that_no_layer_reads():
    """Per-step tensors are made at first use: with tuned RoPE + KV write and tuned attention
    the step launches neither the rotation-matrix gather nor the mask kernels (nor a batch
    index), only the cos/sin gather; stock makes what it reads."""
    from daemon.bench.ops import TunedOps

    def attention(q, k_cache, v_cache, seq_lens, scale):
        return StockOps().decode_attention(q, k_cache, v_cache, seq_lens, scale)

    table = RecordingTable({"rope_kv_write": _rope_kv_write_reference, "decode_attention": attention})
    made = {}
    for ops in (TunedOps(table, "test table"), StockOps()):
        step = {}
        rope_context, attention_mask = ops.rope_context, ops.attention_mask
        ops.rope_context = lambda *a, f=rope_context, s=step: s.setdefault("rope", f(*a))
        ops.attention_mask = lambda *a, f=attention_mask, s=step: s.setdefault("mask", f(*a))
        model, (got, kv), (want, kv_want) = _step_pair(ops)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(kv, kv_want, rtol=1e-5, atol=1e-5)
        made[ops.name] = (step["rope"].made(), "mask" in step)
    assert made["tuned"] == (["cos", "cos_sin", "sin"], False)
    assert made["stock"] == (["batch_idx", "rot"], True)


_STALE_CHILD = r"""
import json, sys
from pathlib import Path
import kernelsearch.search as ks
from daemon.bench.autotable import ensure_table
from kernelsearch.dispatch import table_path
from kernelsearch.fingerprint import collect, fingerprint_id
from kernelsearch.kernels import rmsnorm
from tests.tuned_tables import verified_table

state = Path(sys.argv[1])
shape = {"M": 2, "N": 64}
path = table_path(state, fingerprint_id(collect("cpu")))
path.parent.mkdir(parents=True)
verified_table([("rmsnorm", shape, "float32", rmsnorm.CONFIGS[0])]).save(path)
calls = []

def fake_search(kernel, *, shapes, dtype, **kw):
    calls.append([kernel, shapes])
    return type("R", (), {"shapes": [ks.ShapeReport(shape=s, dtype=dtype, stock_ms=1.0) for s in shapes],
                          "unfinished": []})()

ks.search = fake_search
_, fresh = ensure_table(state_dir=state, device="cpu", dtype="float32", shapes={"rmsnorm": [shape]},
                        budget_s=60, progress=lambda line: None)
doc = json.loads(path.read_text())
doc["entries"][0]["source_hash"] = "0" * 16  # the template edited since this entry's search
path.write_text(json.dumps(doc))
_, stale = ensure_table(state_dir=state, device="cpu", dtype="float32", shapes={"rmsnorm": [shape]},
                        budget_s=60, progress=lambda line: None)
print(json.dumps({"fresh": fresh, "stale": stale, "calls": calls}))
"""


def test_an_entry_made_stale_by_a_template_edit_does_not_cover_its_shape(tmp_path):
    """Dispatch ignores an entry whose template changed since its search (stock runs there), so
    ensure_table must search that shape again instead of counting the stale entry as tuned."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", _STALE_CHILD, str(tmp_path / "state")], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "covers all 1 decode shapes (1 tuned" in doc["fresh"], doc
    assert doc["calls"] == [["rmsnorm", [{"M": 2, "N": 64}]]], doc
    assert "searched 1 of 1 missing" in doc["stale"], doc
