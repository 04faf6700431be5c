"""`hwtune bench --model hf-llama` on CPU: transformers' LlamaForCausalLM, eager, compiled, patched by
hwtune with harness-verified Triton kernels (the interpreter), and Liger Kernel's patch, through
the CLI in a child process; a local checkpoint through --model-path; the decode shapes a search
must cover are the ones the patched model looks up.
"""
import functools
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kernelsearch import dispatch  # noqa: E402
from kernelsearch.integrations.transformers import decode_shapes, patch, unpatch  # noqa: E402
from kernelsearch.kernels import TEMPLATES  # noqa: E402

from conftest import ROOT  # noqa: E402

CACHE = "cache" if "cache" in __import__("inspect").signature(transformers.LlamaModel.forward).parameters \
    else "past_key_values"


def child_env(**extra):
    return {"TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT), "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": os.environ.get("HOME", "/root"), **extra}


def hwtune(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "daemon.cli", *args], cwd=ROOT, text=True,
                          capture_output=True, timeout=timeout, env=child_env())


class RecordingTable(dispatch.DispatchTable):
    """Every op call's (kernel, shape) as the table's lookup sees it; all run stock."""

    def __init__(self):
        super().__init__({"format": 1, "fingerprint_id": "recording", "entries": []})
        self.entries = ["(not empty: the ops ask route())"]
        self.seen = []

    def route(self, kernel, *args):
        self.seen.append((kernel, dispatch.SHAPE_OF[kernel](args)))
        return None, None, "recording"


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
@pytest.mark.parametrize("name,extra", [("Llama", {}), ("Qwen3", {"head_dim": 16})])
def test_decode_shapes_are_exactly_the_shapes_the_patched_decode_step_looks_up(name, extra, fused):
    config = getattr(transformers, name + "Config")(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=80, max_position_embeddings=64, **extra)
    torch.manual_seed(0)
    model = getattr(transformers, name + "ForCausalLM")(config).eval()
    table = RecordingTable()
    patch(model, table, stock_through_ops=True, fused=fused)
    try:
        for batch, context in ((3, 12), (1, 20)):
            cache = transformers.StaticCache(config=config, max_cache_len=context)
            ids = torch.randint(0, 80, (batch, 4))
            with torch.no_grad():
                out = model(ids, **{CACHE: cache}, use_cache=True)
                table.seen.clear()   # the prefill's shapes are not decode shapes
                model(out.logits[:, -1:].argmax(-1), **{CACHE: cache}, use_cache=True)
            seen = {}
            for kernel, shape in table.seen:
                seen.setdefault(kernel, [])
                if shape not in seen[kernel]:
                    seen[kernel].append(shape)
            want = decode_shapes(config, [batch], context, fused=fused)
            if fused:   # every layer through the fused kernels: of the unfused ones the final norm
                # (the layer norms' shape too) and lm_head are left; they stay listed as the fallback
                assert len(want["linear"]) == 5 and "swiglu" in want
                want["linear"] = [{"M": batch, "K": 64, "N": 80}]
                want.pop("swiglu")
            else:
                assert not {"rmsnorm_linear", "rmsnorm_gate_up_swiglu", "linear_residual"} & set(want)
            if name == "Llama":   # every shape through the ops: the fused rope_kv_write, never rope
                assert "rope_kv_write" in want and "rope" in want
                want.pop("rope")
                if fused:         # norm, q|k|v, RoPE and the cache write as one kernel, asked first
                    want.pop("rope_kv_write")
                    want.pop("rope_kv_attention")
                    want.pop("rmsnorm_linear")
            else:                 # Qwen3's q_norm / k_norm sit before RoPE: rope, no rope_kv_write
                assert not {"rope_kv_write", "rope_kv_attention", "rmsnorm_qkv_rope"} & set(want)
            assert {k: sorted(map(str, v)) for k, v in seen.items()} == \
                {k: sorted(map(str, v)) for k, v in want.items()}
    finally:
        unpatch(model)
    both = decode_shapes(config, [1, 3], [12, 20])
    assert len(both["decode_attention"]) == 4 and len(both["linear"]) == 10 and len(both["rope"]) == 2


TABLE_CHILD = textwrap.dedent('''
    import sys
    sys.path.insert(0, "tests")
    from tuned_tables import verified_table
    from daemon.bench.hf import llama3_8b_config
    from kernelsearch.integrations.transformers import decode_shapes

    from kernelsearch.kernels import TEMPLATES

    config = llama3_8b_config(layers=1, tiny=True)
    entries = []
    for kernel, shapes in decode_shapes(config, [2], [40]).items():
        if kernel not in TEMPLATES:   # a fused kernel whose template is not merged yet: stock
            continue
        for shape in shapes:
            params = {"decode_attention": {"BLOCK_S": 16, "NUM_SPLITS": 1, "num_warps": 4, "num_stages": 1},
                      "rope_kv_write": {"HEADS_PER_PROG": 2, "num_warps": 1}}.get(kernel, {})
            entries.append((kernel, shape, "float32", params))
    verified_table(entries).save(sys.argv[1])
    print(len(entries))
''')


@pytest.fixture(scope="module")
def tiny_table(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf-table") / "table.json"
    proc = subprocess.run([sys.executable, "-c", TABLE_CHILD, str(path)], cwd=ROOT, text=True,
                          capture_output=True, timeout=300, env=child_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    return path, int(proc.stdout.split()[-1])


@functools.lru_cache(maxsize=None)
def liger_importable() -> str | None:
    proc = subprocess.run([sys.executable, "-c", "import liger_kernel.transformers"], text=True,
                          capture_output=True, timeout=120, env=child_env())
    return None if proc.returncode == 0 else (proc.stderr.strip().splitlines() or ["?"])[-1]


def test_hf_llama_on_cpu_gives_every_row_with_hwtunes_tuned_kernels_within_tolerance(tmp_path, tiny_table):
    table, n_entries = tiny_table
    state = tmp_path / "state"
    proc = hwtune("--state-dir", str(state), "bench", "--model", "hf-llama", "--device", "cpu",
                  "--layers", "1", "--shapes", "2x40", "--steps", "20", "--warmup", "1", "--check", "3",
                  "--table", str(table), "--json")
    assert proc.returncode == 0, proc.stderr[-4000:]
    doc = json.loads(proc.stdout)
    assert doc["label"] == "cpu" and doc["hf"]["model"]["layers"] == 1
    assert "interpreter" in doc["hf"]["note"]
    rows = doc["decode"]
    assert [(r["variant"], r["batch"], r["ctx"]) for r in rows] == \
        [(v, 2, 40) for v in ("hf-eager", "hf-compiled", "hf-hwtune-unfused", "hf-hwtune", "hf-liger")]
    for r in rows:
        assert r["model"] == "hf-llama" and r["interpreter_timing"] is True
        if r["status"] == "ok":   # no NVML on a CPU: n/a, never a made-up number
            assert r["tokens_per_j"] is None and r["energy_note"].startswith("n/a")
    for r in rows:
        if r["variant"] != "hf-liger":
            assert r["status"] == "ok", r
            assert r["step_ms"] > 0 and r["tokens_per_s"] == pytest.approx(r["batch"] / (r["step_ms"] * 1e-3))
            assert r["decode_err_vs_hf_eager"] < 1e-4 and r["prefill_err_vs_hf_eager"] < 1e-4
            assert r["same_token_share"] == 1.0 and "warning" not in r
            assert r["speedup_vs_hf_compiled"] > 0
    fused = {"rmsnorm_linear", "rmsnorm_gate_up_swiglu", "linear_residual", "rope_kv_attention", "rmsnorm_qkv_rope"}
    merged = fused & set(TEMPLATES)    # the fused kernels with a template (their entries are in the table)
    # rmsnorm_qkv_rope is asked first at a decode step: the norm + q|k|v and attention entries rest
    superseded = {"rmsnorm_linear", "rope_kv_attention"} if "rmsnorm_qkv_rope" in merged else set()
    unfused_kernels = {"rmsnorm", "linear", "swiglu", "rope_kv_write", "decode_attention"}
    for r in (r for r in rows if r["variant"] in ("hf-hwtune-unfused", "hf-hwtune")):
        # every decode shape of this model had a verified entry: tuned kernels ran, not stock
        head = r["patch_report"][0]
        assert head.startswith("hwtune patch LlamaForCausalLM: 3 rms_norm, 1 mlp, 1 attention, ") and \
            "1 lm_head" in head, head
        # the fused layer parts, listed only where the fused patch routed them
        assert ("fused" in head) == (r["variant"] == "hf-hwtune" and bool(merged)), head
        assert f"{n_entries} tuned shapes here" in r["patch_report"][0]
        routes = r["table_routes"]   # every decode op ran its tuned kernel, none fell back to stock
        ran = {k.split(":")[0] for k in routes if k.endswith(":tuned")}
        assert not [k for k in routes if k.endswith(":stock")], routes
        if r["variant"] == "hf-hwtune-unfused":   # issue 12's patch: no fused kernel, whatever the table
            assert ran == unfused_kernels and not fused & set(r["patched"]), routes
        else:
            assert merged - superseded <= ran <= unfused_kernels | merged, routes
            assert bool(merged) == any(k.startswith("fused ") for k in r["patched"]), r["patched"]
    hw = {r["variant"]: r for r in rows}
    assert hw["hf-hwtune"]["speedup_vs_hwtune_unfused"] == \
        pytest.approx(hw["hf-hwtune-unfused"]["step_ms"] / hw["hf-hwtune"]["step_ms"])
    assert rows[1]["speedup_vs_hf_compiled"] == 1.0
    why = liger_importable()
    for r in (r for r in rows if r["variant"] == "hf-liger"):
        if why is not None:
            assert r["status"].startswith("skipped: liger_kernel not importable: "), r
        else:   # it ran, or says exactly what failed (its kernels under the interpreter)
            assert r["status"] == "ok" or (r["status"].startswith("error: ") and r["traceback"]), r
            assert r["patch_report"][0].startswith("liger_kernel ")
    for step in ("building LlamaForCausalLM", "hf eager", "hf compiled: compiled in",
                 "hwtune unfused + compiled", "hwtune patched + compiled", "liger + compiled"):
        assert step in proc.stderr.replace("hf-compiled: compiled in", "hf compiled: compiled in"), step


def test_model_path_loads_a_local_checkpoint_next_to_the_builtin_rows_in_one_report(tmp_path):
    ckpt = tmp_path / "ckpt"
    config = transformers.LlamaConfig(hidden_size=48, intermediate_size=80, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=72,
                                      max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(1)
    transformers.LlamaForCausalLM(config).save_pretrained(ckpt)
    out = tmp_path / "out"
    proc = hwtune("--state-dir", str(tmp_path / "state"), "bench", "--model", "builtin,hf-llama",
                  "--model-path", str(ckpt), "--device", "cpu", "--variants", "eager,hf-eager,hf-compiled",
                  "--shapes", "1x30", "--prefill", "1x8", "--steps", "20", "--warmup", "1", "--check", "2",
                  "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-4000:]
    doc = json.loads((out / "results.json").read_text())
    assert doc["hf"]["model"]["source"] == f"checkpoint {ckpt}"
    assert (doc["hf"]["model"]["hidden"], doc["hf"]["model"]["vocab"]) == (48, 72)
    assert [(r.get("model", "builtin"), r["variant"]) for r in doc["decode"]] == \
        [("builtin", "eager"), ("hf-llama", "hf-eager"), ("hf-llama", "hf-compiled")]
    assert all(r["status"] == "ok" for r in doc["decode"])
    md = (out / "report.md").read_text()
    assert "## Hugging Face LlamaForCausalLM" in md and "hf compiled" in md
    assert "hf eager" in proc.stdout and "vs hf compiled" in proc.stdout   # the terminal table


def test_model_path_of_another_model_family_is_refused_in_one_line(tmp_path):
    """A Qwen2 (or GPT-2, Gemma...) checkpoint was loaded by LlamaForCausalLM.from_pretrained with
    a warning only (q|k|v biases dropped; other families' weights left random) and benched as
    'checkpoint DIR'."""
    ckpt = tmp_path / "ckpt"
    config = transformers.Qwen2Config(hidden_size=48, intermediate_size=80, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=72)
    transformers.Qwen2ForCausalLM(config).save_pretrained(ckpt)
    proc = hwtune("--state-dir", str(tmp_path / "state"), "bench", "--device", "cpu", "--model", "hf-llama",
                  "--model-path", str(ckpt), timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "model_type 'qwen2'" in lines[0], proc.stderr


@pytest.mark.parametrize("args,message", [
    (["--model", "hf-llama", "--model-path", "/nonexistent/ckpt"], "--model-path /nonexistent/ckpt: no such directory"),
    (["--model", "gpt2"], "--model gpt2: expected builtin, hf-llama"),
    (["--model", "hf-llama", "--variants", "eager"], "none for --model hf-llama"),
])
def test_bad_model_arguments_are_one_line_and_exit_2(tmp_path, args, message):
    proc = hwtune("--state-dir", str(tmp_path / "state"), "bench", "--device", "cpu", *args, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert proc.stdout == ""


LIGER_CHILD = textwrap.dedent('''
    import torch, transformers
    from transformers.models.llama import modeling_llama
    from daemon.bench.hf import liger_apply, llama3_8b_config

    model = transformers.LlamaForCausalLM(llama3_8b_config(layers=1, tiny=True)).eval()
    names = ("apply_rotary_pos_emb", "LlamaRMSNorm", "LlamaMLP")
    before = {n: getattr(modeling_llama, n) for n in names}
    dicts = [(m, dict(vars(m))) for m in model.modules()]
    ids = torch.randint(0, 256, (1, 5))
    with torch.no_grad():
        want = model(ids).logits
    undo, lines = liger_apply(model)
    assert any(getattr(modeling_llama, n) is not before[n] for n in names), "liger patched nothing"
    assert "forward" in vars(model.model.norm), "liger did not patch the instance"
    undo()
    assert all(getattr(modeling_llama, n) is before[n] for n in names)
    assert all(vars(m) == d for m, d in dicts)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, want)
    print("undone:", lines[0])
''')


def test_liger_patch_is_undone_exactly_so_that_the_next_rows_run_stock_transformers():
    why = liger_importable()
    if why is not None:
        pytest.skip(f"liger_kernel not importable: {why}")
    proc = subprocess.run([sys.executable, "-c", LIGER_CHILD], cwd=ROOT, text=True, capture_output=True,
                          timeout=120, env=child_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "undone: liger_kernel " in proc.stdout


def test_rewind_replays_the_same_cache_positions_for_the_energy_window():
    from daemon.bench.hf import llama3_8b_config, rewind

    config = llama3_8b_config(layers=1, tiny=True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    cache = transformers.StaticCache(config=config, max_cache_len=12)
    token = torch.tensor([[5], [9]])
    with torch.no_grad():
        model(torch.randint(0, 256, (2, 6)), **{CACHE: cache}, use_cache=True)
        first = model(token, **{CACHE: cache}, use_cache=True).logits
        second = model(token, **{CACHE: cache}, use_cache=True).logits   # one position later
        if not rewind(cache, 2):
            pytest.skip("this transformers' StaticCache keeps no cumulative_length tensor")
        again = model(token, **{CACHE: cache}, use_cache=True).logits
    assert not torch.equal(first, second)
    assert torch.equal(again, first)
    assert int(cache.get_seq_length()) == 7


def test_without_a_table_the_decode_shapes_are_searched_into_the_state_dir_first(tmp_path):
    state = tmp_path / "state"
    proc = hwtune("--state-dir", str(state), "bench", "--model", "hf-llama", "--device", "cpu",
                  "--layers", "1", "--shapes", "1x30", "--steps", "20", "--warmup", "1", "--check", "2",
                  "--variants", "hf-eager,hf-hwtune", "--search-evals", "1", "--budget-s", "90", "--json")
    assert proc.returncode == 0, proc.stderr[-4000:]
    doc = json.loads(proc.stdout)
    kt = doc["hf"]["kernel_table"]
    assert str(state / "dispatch") in kt["note"], kt["note"]
    from daemon.bench.hf import llama3_8b_config
    want = decode_shapes(llama3_8b_config(layers=1, tiny=True), [1], [30])
    searched = {(d["kernel"], json.dumps(d["shape"], sort_keys=True)) for d in kt["search"]}
    # what the search was asked for: this model's decode shapes (those the budget reached)
    assert searched and searched <= {(k, json.dumps(s, sort_keys=True)) for k, v in want.items() for s in v}
    assert [r["status"] for r in doc["decode"]] == ["ok", "ok"]


def test_a_long_first_compile_says_it_is_still_running_and_stops_saying_it_after(capsys):
    import time

    from daemon.bench import hf

    with hf.heartbeat("hf-llama hf-hwtune: compiling", every_s=0.05):
        time.sleep(0.3)
    during = capsys.readouterr().err
    lines = [ln for ln in during.splitlines() if "hf-llama hf-hwtune: compiling: still running after" in ln]
    assert len(lines) >= 2, during
    time.sleep(0.2)
    assert "still running" not in capsys.readouterr().err   # the thread ended with the block
    with pytest.raises(ValueError):   # an error in the block still stops the beat
        with hf.heartbeat("x", every_s=0.05):
            raise ValueError("boom")
    time.sleep(0.15)
    assert "still running" not in capsys.readouterr().err


def test_judge_in_step_judges_the_entries_the_patched_model_routes_on_its_own_cache(tmp_path, tiny_table):
    """--model hf-llama --judge-in-step: the step judge runs before the patched rows, in the built-in
    step with this model's dimensions on a cache of exactly the context (the StaticCache the patched
    model decodes on), so the S-keyed entries it judges are the model's own (S = 40 here; the
    built-in bench's cache for a context of 40 is 64 slots). Interpreter times: nothing written."""
    import shutil

    table = tmp_path / "table.json"
    shutil.copy(tiny_table[0], table)
    before = table.read_text()
    proc = hwtune("--state-dir", str(tmp_path / "state"), "bench", "--model", "hf-llama", "--device", "cpu",
                  "--layers", "1", "--shapes", "2x40", "--steps", "20", "--warmup", "1", "--check", "2",
                  "--variants", "hf-compiled,hf-hwtune", "--table", str(table), "--judge-in-step", "--json",
                  timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    doc = json.loads(proc.stdout)
    judged = doc["hf"]["step_judge"]
    assert list(judged) == ["2x40 (cache 40)"], judged
    record = judged["2x40 (cache 40)"]
    assert record["status"] == "ok" and record["changes_applied"] is False, record
    kernels = {d["kernel"]: d["shape"] for d in record["decisions"]}
    from kernelsearch.integrations.transformers import decode_shapes
    from daemon.bench.hf import llama3_8b_config
    want = decode_shapes(llama3_8b_config(layers=1, tiny=True), [2], [40])
    assert all(shape in want[k] for k, shape in kernels.items()), (kernels, want)
    s_keyed = {k: s for k, s in kernels.items() if "S" in s}
    assert s_keyed and all(s["S"] == 40 for s in s_keyed.values()), kernels   # the model's cache, not 64
    assert record["written"].startswith("not written: the judge's times are") and table.read_text() == before
    assert "hf-llama: step judge at the model's cache shapes" in proc.stderr
    assert [r["status"] for r in doc["decode"]] == ["ok", "ok"]
