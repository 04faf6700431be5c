"""The fused decode kernels in the transformers patch (issue 13): patch(model, table, fused=True)
swaps each decoder layer for an HwtuneDecoderLayer that calls hwtune::rms_norm_linear (input norm
+ q|k|v), hwtune::linear_residual (o_proj and down_proj with the residual adds) and
hwtune::rms_norm_gate_up_swiglu (post-attention norm + gate|up + SwiGLU) where the table routes
them, each part on its own; an unrouted part runs the unfused patch (issue 12's path).

In this process the ops run stock inside (no triton): tables route shapes with entries that
carry no launch plan, so the op is called and its table counts a stock call, which shows which
path each part took. Child processes run harness-verified Triton kernels under TRITON_INTERPRET:
today's templates (rmsnorm, linear) on the unfused parts beside a fused part, and the fused
kernels' own templates once they exist (skipped, naming the missing template, until then).
"""
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kernelsearch import dispatch  # noqa: E402
from kernelsearch.fingerprint import collect, fingerprint_id  # noqa: E402
from kernelsearch.integrations.transformers import (FUSED_ATTENTION, FUSED_PARTS, HwtuneDecoderLayer,  # noqa: E402
                                                    decode_shapes, patch, unpatch)
from kernelsearch.kernels import TEMPLATES  # noqa: E402

from conftest import ROOT  # noqa: E402
from test_hf_transformers import CLASSES, TOL, prefill_and_decode, rel_err, tiny_model  # noqa: E402

FUSED = set(FUSED_PARTS)
B, T, STEPS = 2, 5, 3


def routing_table(shapes):
    """A table for this device whose entries route `shapes` [(kernel, shape)] in float32 to the
    ops; no entry has a plan, so every routed call runs stock inside and is counted. patch()
    leaves out entries that are not usable (no verified source): these are taken as usable."""
    table = dispatch.DispatchTable({"format": 1, "fingerprint_id": fingerprint_id(collect("cpu")), "entries": [
        {"kernel": k, "dtype": "float32", "shape": dict(s), "params": {}} for k, s in shapes]})
    table.usable = lambda entry: True
    return table


def counts(table):
    return {f"{k}:{r}": n for (k, r), n in sorted(table.counts.items())}


def run_both(model, steps=STEPS, seed=1, step_fn=None):
    ids = torch.randint(0, 128, (B, T), generator=torch.Generator().manual_seed(seed))
    return prefill_and_decode(model, ids, steps=steps, step_fn=step_fn)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", CLASSES)
def test_every_shape_through_the_ops_runs_the_four_fused_kernels_and_gives_the_unpatched_logits(name, dtype):
    model = tiny_model(name, dtype)
    want = run_both(model)
    table = dispatch.DispatchTable.empty()
    report = patch(model, table, stock_through_ops=True)
    assert report.stock == []
    # norm + q|k|v + RoPE + the cache write: not with Qwen2's q|k|v bias or Qwen3's q/k norms
    qkv_rope = name in ("Llama", "Mistral")
    assert {k: v for k, v in report.patched.items() if k in FUSED} == \
        {part: 2 for part in FUSED if qkv_rope or FUSED_PARTS[part] != "rmsnorm_qkv_rope"}
    assert all(isinstance(layer, HwtuneDecoderLayer) for layer in model.model.layers)
    got = run_both(model)
    for step, (w, g) in enumerate(zip(want, got)):
        assert rel_err(w, g) < TOL[dtype], (step, rel_err(w, g))
    forwards = 1 + STEPS   # the prefill and each step, 2 layers each
    c = counts(table)
    # rmsnorm_qkv_rope is asked first at a one-token step; the prefill's norm + q|k|v is rmsnorm_linear
    assert c["rmsnorm_linear:stock"] == 2 * (1 if qkv_rope else forwards)
    assert c.get("rmsnorm_qkv_rope:stock", 0) == (2 * STEPS if qkv_rope else 0)
    assert c["linear_residual:stock"] == 2 * 2 * forwards        # o_proj and down_proj
    assert c["rmsnorm_gate_up_swiglu:stock"] == 2 * forwards
    # the layers' own norms, q|k|v, o, gate|up, down and SwiGLU went into the fused kernels: what
    # is left of rmsnorm / linear is the final norm (+ Qwen3's per-head q/k norms) and lm_head
    assert "swiglu:stock" not in c
    assert c["linear:stock"] == forwards
    assert c["rmsnorm:stock"] == forwards * (1 + (2 * 2 if name == "Qwen3" else 0))
    # each decode step's RoPE, cache write and attention: in rmsnorm_qkv_rope, then decode_attention
    # (Llama, Mistral); one fused op (Qwen2); Qwen3: q/k norms between the projection and RoPE, so
    # rope_kv_write's place stays hwtune::rope + decode_attention
    attention = "rope_kv_attention:stock" if name == "Qwen2" else "decode_attention:stock"
    assert c[attention] == 2 * STEPS
    assert "rope_kv_write:stock" not in c and (name == "Qwen2" or "rope_kv_attention:stock" not in c)
    assert report.patched.get(FUSED_ATTENTION, 0) == (0 if name == "Qwen3" else 2)
    unpatch(model)


def test_o_proj_bias_joins_the_residual_and_an_mlp_bias_keeps_that_part_unfused_with_one_line():
    model = tiny_model("Llama", attention_bias=True, mlp_bias=True)
    assert model.model.layers[0].self_attn.o_proj.bias is not None
    want = run_both(model)
    table = dispatch.DispatchTable.empty()
    report = patch(model, table, stock_through_ops=True)
    assert "fused norm+gate_up+swiglu" not in report.patched
    assert report.patched["fused norm+qkv"] == 2 and report.patched["fused o+residual"] == 2
    assert len(report.stock) == 1 and "gate/up biases" in report.stock[0] and "2 of 2 layers" in report.stock[0]
    got = run_both(model)
    assert max(rel_err(w, g) for w, g in zip(want, got)) < 1e-5
    c = counts(table)
    assert "rmsnorm_gate_up_swiglu:stock" not in c
    assert c["swiglu:stock"] == 2 * (1 + STEPS)      # the unfused MLP: gate|up, SwiGLU, then down
    assert c["linear_residual:stock"] == 2 * 2 * (1 + STEPS)


def test_fused_false_is_issue_12s_patch_even_with_fused_entries_in_the_table():
    model = tiny_model("Qwen2")
    want = run_both(model)
    m = B   # decode rows
    table = routing_table([("rmsnorm_linear", {"M": m, "K": 64, "N": 128}),
                           ("linear_residual", {"M": m, "K": 64, "N": 64})])
    layers = list(model.model.layers)
    report = patch(model, table, fused=False)
    assert list(model.model.layers) == layers and not FUSED & set(report.patched)
    got = run_both(model)
    assert max(rel_err(w, g) for w, g in zip(want, got)) < 1e-5
    assert table.counts == {}   # no op had a route: every part the model's own code, as in issue 12


def test_each_fused_part_routes_on_its_own_and_the_unrouted_ones_take_the_unfused_path():
    """Entries route rmsnorm_linear (norm + q|k|v) and linear_residual for o_proj only, at the
    decode rows; the unfused kernels have entries for down_proj and the post-attention norm. So a
    decode step runs: rms_norm_linear, the model's attention, linear_residual (o), hwtune::rms_norm
    (post norm) + the model's gate|up and SiLU (no entry), hwtune::linear (down) + the add. The
    prefill (10 rows) has no entry anywhere: all the model's own code."""
    model = tiny_model("Llama")
    want = run_both(model)
    table = routing_table([("rmsnorm_linear", {"M": B, "K": 64, "N": 128}),
                           ("linear_residual", {"M": B, "K": 64, "N": 64}),
                           ("rmsnorm", {"M": B, "N": 64}),
                           ("linear", {"M": B, "K": 128, "N": 64})])
    report = patch(model, table)
    assert report.stock == []
    assert {k: v for k, v in report.patched.items() if k in FUSED} == \
        {"fused norm+qkv": 2, "fused o+residual": 2}
    layer = model.model.layers[0]
    assert isinstance(layer, HwtuneDecoderLayer)
    assert layer._norm_qkv == {B} and layer._o_residual == {B}
    assert layer._norm_gate_up == frozenset() and layer._down_residual == frozenset()
    got = run_both(model)
    assert max(rel_err(w, g) for w, g in zip(want, got)) < 1e-5
    n = 2 * STEPS   # decode steps x layers
    # rmsnorm: each layer's post-attention norm + the final norm (input_layernorm is fused)
    assert counts(table) == {"rmsnorm_linear:stock": n, "linear_residual:stock": n,
                             "rmsnorm:stock": n + STEPS, "linear:stock": n}
    unpatch(model)


def test_a_table_without_fused_entries_swaps_no_layer_and_unpatch_gives_back_the_same_modules():
    model = tiny_model("Qwen3")
    modules = dict(model.named_modules())
    keys = list(model.state_dict())
    report = patch(model, routing_table([("rmsnorm", {"M": B, "N": 64})]))
    assert not FUSED & set(report.patched)
    assert not any(isinstance(layer, HwtuneDecoderLayer) for layer in model.model.layers)
    unpatch(model)
    patch(model, dispatch.DispatchTable.empty(), stock_through_ops=True)
    assert all(isinstance(layer, HwtuneDecoderLayer) for layer in model.model.layers)
    assert list(model.state_dict()) == keys      # the same parameter names while fused
    unpatch(model)
    after = dict(model.named_modules())
    assert list(after) == list(modules) and all(after[n] is m for n, m in modules.items())
    assert type(model.model.layers[0]).__name__ == "Qwen3DecoderLayer"


@pytest.mark.parametrize("name", ["Llama", "Qwen3"])
def test_fused_decode_step_compiles_with_fullgraph_and_matches(name):
    model = tiny_model(name)
    want = run_both(model)
    patch(model, dispatch.DispatchTable.empty(), stock_through_ops=True)
    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    got = run_both(model, step_fn=torch.compile(model.forward, fullgraph=True, backend=backend))
    assert max(rel_err(w, g) for w, g in zip(want, got)) < 1e-5
    # the one-token steps: norm + q|k|v + RoPE + the cache write in one op (Qwen3: its q/k norms sit
    # before RoPE, so norm + q|k|v, then hwtune::rope)
    qkv = "rms_norm_qkv_rope" if name == "Llama" else "rms_norm_linear"
    for op in (qkv, "linear_residual", "rms_norm_gate_up_swiglu", "decode_attention"):
        assert f"hwtune.{op}" in seen, op
    assert "hwtune.swiglu" not in seen   # SwiGLU is in the fused kernel's epilogue
    torch._dynamo.reset()
    got = run_both(model, step_fn=torch.compile(model.forward, fullgraph=True, backend="aot_eager"))
    assert max(rel_err(w, g) for w, g in zip(want, got)) < 1e-5
    torch._dynamo.reset()


def test_the_fused_steps_attention_lengths_come_from_the_position_not_a_reduction_over_the_mask():
    """At a one-token step through rms_norm_qkv_rope, decode_attention's lengths are the position
    + 1, made beside the step's rows: no sum over the mask's slots in every layer of the compiled
    graph (a reduction a layer). Only the layer that guards padding reads the mask."""
    model = tiny_model("Llama")
    want = run_both(model)
    patch(model, dispatch.DispatchTable.empty(), stock_through_ops=True)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append([str(n.target) for n in gm.graph.nodes if n.op in ("call_function", "call_method")])
        return gm.forward

    torch._dynamo.reset()
    got = run_both(model, step_fn=torch.compile(model.forward, fullgraph=True, backend=backend))
    torch._dynamo.reset()
    assert max(rel_err(w, g) for w, g in zip(want, got)) < 1e-5
    step = graphs[-1]
    ops = [i for i, t in enumerate(step) if t == "hwtune.rms_norm_qkv_rope"]
    assert len(ops) == model.config.num_hidden_layers == 2
    layers = [step[a:b] for a, b in zip(ops, ops[1:] + [len(step)])]
    assert all("hwtune.decode_attention" in layer for layer in layers)
    assert "sum" not in step                                   # no layer sums the mask
    assert ("all" in step[:ops[1]]) and "all" not in layers[1]  # only the guarding first layer checks it


def test_patch_registers_every_hwtune_op_with_inductor_before_a_compile_reaches_it(monkeypatch):
    """Inductor's implicit fallback for an op it has no lowering for logs the op's IR arguments,
    and torch 2.11 builds that text eagerly (minutes for the patched Llama step on the H200):
    patch() registers the ops first, with the layout constraint the implicit path would pick, so
    no hwtune op takes that path. Compiled with inductor itself where a C++ compiler is here."""
    lowering = pytest.importorskip("torch._inductor.lowering")
    import torch._inductor.graph as inductor_graph
    from torch._library.utils import get_layout_constraint_tag

    from kernelsearch import ops

    model = tiny_model("Llama")
    want = run_both(model)
    patch(model, dispatch.DispatchTable.empty(), stock_through_ops=True)
    for name in ops.OPS:
        op = getattr(torch.ops.hwtune, name).default
        assert op in lowering.lowerings, name
        expected = lowering.tag_to_layout_constraint(get_layout_constraint_tag(op, with_default=True))
        assert lowering.maybe_layout_constraints(op) is expected, name
    assert ops.register_inductor_fallbacks() == []   # a second call changes nothing
    import shutil
    if shutil.which(os.environ.get("CXX", "g++")) is None:
        pytest.skip("no C++ compiler for inductor's CPU code here: registration checked, compile not")
    implicit = []
    real = inductor_graph.make_fallback

    def record(target, *args, **kwargs):   # what graph.py calls for an implicit fallback
        implicit.append(str(target))
        return real(target, *args, **kwargs)

    monkeypatch.setattr(inductor_graph, "make_fallback", record)
    torch._dynamo.reset()
    got = run_both(model, step_fn=torch.compile(model.forward, fullgraph=True))
    torch._dynamo.reset()
    assert max(rel_err(w, g) for w, g in zip(want, got)) < 1e-5
    assert not [t for t in implicit if t.startswith("hwtune")], implicit


@pytest.mark.parametrize("name,op,at", [("Qwen2", "rope_kv_attention", 1), ("Llama", "rms_norm_qkv_rope", 4)])
def test_cos_sin_and_the_position_reach_the_fused_op_as_batch_rows_made_outside_it(name, op, at):
    """Broadcast cos/sin (position_ids of batch 1) and the cache position become [B, ...] rows
    in the model's code, where torch.compile makes cos/sin once a step, not inside every layer's
    op; rows already there pass as they are. (Qwen2's q|k|v bias keeps it on rope_kv_attention.)"""
    from kernelsearch.integrations.transformers import _rows_of

    one = torch.randn(1, 8)
    rows = _rows_of(one, 3)
    assert rows.shape == (3, 8) and rows.is_contiguous() and torch.equal(rows, one.expand(3, 8))
    assert rows.data_ptr() != one.data_ptr()
    three = torch.randn(3, 8)
    assert _rows_of(three, 3) is three
    pos = torch.tensor([5])
    assert _rows_of(pos, 4).tolist() == [5, 5, 5, 5]
    model = tiny_model(name)
    patch(model, dispatch.DispatchTable.empty(), stock_through_ops=True)
    seen = []
    real = getattr(torch.ops.hwtune, op)

    class Spy:
        def __call__(self, *args):
            cos, positions = args[at], args[at + 2]
            seen.append((tuple(cos.shape), cos.is_contiguous(), tuple(positions.shape), positions.is_contiguous()))
            return real(*args)

    try:
        setattr(torch.ops.hwtune, op, Spy())
        run_both(model, steps=1)
    finally:
        setattr(torch.ops.hwtune, op, real)
    assert seen and all(s == ((B, s[0][1]), True, (B,), True) for s in seen), seen


def test_generate_with_a_static_cache_through_the_fused_layers_gives_the_unpatched_tokens():
    model = tiny_model("Mistral")
    ids = torch.randint(0, 128, (2, 6), generator=torch.Generator().manual_seed(2))
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
              cache_implementation="static", return_dict_in_generate=True, output_logits=True)
    want = model.generate(ids, **kw)
    table = dispatch.DispatchTable.empty()
    patch(model, table, stock_through_ops=True)
    got = model.generate(ids, **kw)
    unpatch(model)
    assert torch.equal(want.sequences, got.sequences)
    assert max(rel_err(w, g) for w, g in zip(want.logits, got.logits)) < 1e-5
    # the prefill's norm + q|k|v through rmsnorm_linear, the 3 one-token steps' through rmsnorm_qkv_rope
    assert table.counts[("rmsnorm_linear", "stock")] == 2 and table.counts[("rmsnorm_qkv_rope", "stock")] == 3 * 2


def test_a_layer_left_stock_is_not_fused_and_says_why_in_one_line():
    model = tiny_model("Mistral", sliding_window=4096)   # sliding window: attention stays stock
    want = run_both(model)
    report = patch(model, dispatch.DispatchTable.empty(), stock_through_ops=True)
    assert not FUSED & set(report.patched)
    lines = [line for line in report.stock if line.startswith("fused kernels")]
    assert lines == ["fused kernels in 2 of 2 layers not used: its attention stays the model's own (see above)"]
    got = run_both(model)
    assert max(rel_err(w, g) for w, g in zip(want, got)) < 1e-5


def test_training_mode_runs_the_original_layer():
    model = tiny_model("Llama")
    table = dispatch.DispatchTable.empty()
    patch(model, table, stock_through_ops=True)
    model.train()
    with torch.no_grad():
        model(torch.randint(0, 128, (1, 4)))
    assert table.counts == {}
    model.eval()
    with torch.no_grad():
        model(torch.randint(0, 128, (1, 4)))
    assert table.counts[("rmsnorm_linear", "stock")] == 2


def test_decode_shapes_list_the_fused_kernels_beside_the_unfused_ones():
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=80)
    fused, unfused = decode_shapes(config, [1, 3], 20), decode_shapes(config, [1, 3], 20, fused=False)
    assert {k: v for k, v in fused.items() if k in unfused} == unfused
    assert fused["rmsnorm_linear"] == [{"M": b, "K": 64, "N": 128} for b in (1, 3)]
    assert fused["rmsnorm_gate_up_swiglu"] == [{"M": b, "K": 64, "I": 96} for b in (1, 3)]
    assert fused["linear_residual"] == [{"M": b, "K": k, "N": 64} for b in (1, 3) for k in (64, 96)]
    assert fused["rope_kv_attention"] == [{"B": b, "Hq": 4, "Hkv": 2, "D": 16, "S": 20} for b in (1, 3)]
    assert fused["rmsnorm_qkv_rope"] == [{"B": b, "K": 64, "Hq": 4, "Hkv": 2, "D": 16, "S": 20} for b in (1, 3)]
    assert set(fused) - set(unfused) == {"rmsnorm_linear", "rmsnorm_gate_up_swiglu", "linear_residual",
                                         "rope_kv_attention", "rmsnorm_qkv_rope"}


# --- harness-verified Triton kernels (children under TRITON_INTERPRET) ------------------------
def child(code, *args, timeout=600):
    env = {"TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT), "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
           "HOME": os.environ.get("HOME", "/root")}
    proc = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, text=True, capture_output=True,
                          timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


CHILD = textwrap.dedent('''
    import json, sys
    import torch
    sys.path.insert(0, "tests")
    from test_hf_transformers import tiny_model, prefill_and_decode, rel_err
    from tuned_tables import verified_table
    from kernelsearch.kernels import load_template
    from kernelsearch.integrations.transformers import patch

    B, T = 2, 5
    tuned = json.loads(sys.argv[1])       # [(kernel, shape)] verified at their template's first config
    placeholders = json.loads(sys.argv[2])  # [(kernel, shape)] routed, without a plan (stock inside)
    compile_too = sys.argv[3] == "1"

    def params(kernel):
        configs = getattr(load_template(kernel), "CONFIGS", None) or [{}]
        return dict(configs[0])

    table = verified_table([(k, s, "float32", params(k)) for k, s in tuned])
    table.entries += table.__class__({"format": 1, "entries": [
        {"kernel": k, "dtype": "float32", "shape": s, "params": {}} for k, s in placeholders]}).entries
    table.usable = lambda entry: True   # the placeholders too (patch() leaves out unusable entries)
    model = tiny_model("Llama")
    ids = torch.randint(0, 128, (B, T), generator=torch.Generator().manual_seed(7))
    want = prefill_and_decode(model, ids, steps=2)
    report = patch(model, table)
    got = prefill_and_decode(model, ids, steps=2)
    out = {"stock": report.stock, "patched": report.patched,
           "counts": {f"{k}:{r}": n for (k, r), n in table.counts.items()},
           "err": [rel_err(w, g) for w, g in zip(want, got)]}
    if compile_too:
        table.counts.clear()
        torch._dynamo.reset()
        compiled = prefill_and_decode(model, ids, steps=2,
                                      step_fn=torch.compile(model.forward, fullgraph=True, backend="aot_eager"))
        out["compiled_counts"] = {f"{k}:{r}": n for (k, r), n in table.counts.items()}
        out["err_compiled"] = [rel_err(w, g) for w, g in zip(want, compiled)]
    print(json.dumps(out))
''')

# tiny Llama (hidden 64, 4 / 2 heads of 16, MLP 128) at the decode rows M = B
QKV = {"M": B, "K": 64, "N": 128}
O = {"M": B, "K": 64, "N": 64}
DOWN = {"M": B, "K": 128, "N": 64}
GATE_UP = {"M": B, "K": 64, "I": 128}
QKV_ROPE = {"B": B, "K": 64, "Hq": 4, "Hkv": 2, "D": 16, "S": 16}   # S: the StaticCache's MAX_CACHE


def test_tuned_unfused_kernels_serve_the_parts_whose_fused_kernel_is_not_routed():
    """Today's templates (rmsnorm, linear) verified for the norm and down_proj shapes; only the
    o_proj + residual part has a fused route (an entry without a plan: stock inside). The input
    norm and down + residual parts run the tuned unfused kernels (issue 12's path), q|k|v and
    gate|up (no entry) the model's own code. (Compiled: the in-process fullgraph tests.)"""
    report = child(CHILD, json.dumps([("rmsnorm", {"M": B, "N": 64}), ("linear", DOWN)]),
                   json.dumps([("linear_residual", O)]), "0")
    assert report["stock"] == [] and report["patched"]["fused o+residual"] == 2
    assert "fused norm+qkv" not in report["patched"] and "fused down+residual" not in report["patched"]
    steps = 2 * 2   # 2 decode steps x 2 layers
    # rmsnorm: input and post-attention norms of each layer, the final norm once per step
    want = {"rmsnorm:tuned": 2 * steps + 2, "linear:tuned": steps, "linear_residual:stock": steps}
    assert report["counts"] == want
    assert max(report["err"]) < 1e-4
    assert report["err"][1] > 0   # tuned kernels really ran on the decode steps


@pytest.mark.parametrize("kernel,shapes,part", [
    ("rmsnorm_linear", [QKV], "fused norm+qkv"),
    ("linear_residual", [O, DOWN], "fused down+residual"),
    ("rmsnorm_gate_up_swiglu", [GATE_UP], "fused norm+gate_up+swiglu"),
    ("rmsnorm_qkv_rope", [QKV_ROPE], "fused norm+qkv+rope+kv write"),
])
def test_a_fused_kernels_tuned_template_runs_its_part_and_gives_the_unpatched_logits(kernel, shapes, part):
    if kernel not in TEMPLATES:
        pytest.skip(f"no template for {kernel} yet")
    report = child(CHILD, json.dumps([(kernel, s) for s in shapes]), "[]", "1")
    assert report["stock"] == [] and report["patched"][part] == 2
    want = {f"{kernel}:tuned": 2 * 2 * len(shapes)}   # 2 steps x 2 layers per shape; the rest: own code
    assert report["counts"] == want and report["compiled_counts"] == want
    assert max(report["err"]) < 1e-4 and max(report["err_compiled"]) < 1e-4
    assert report["err"][1] > 0


def test_every_fused_kernels_tuned_template_together_gives_the_unpatched_logits():
    missing = [k for k in ("rmsnorm_linear", "rmsnorm_gate_up_swiglu", "linear_residual", "rmsnorm_qkv_rope")
               if k not in TEMPLATES]
    if missing:
        pytest.skip(f"no template for {missing[0]} yet")
    report = child(CHILD, json.dumps([("rmsnorm_linear", QKV), ("linear_residual", O), ("linear_residual", DOWN),
                                      ("rmsnorm_gate_up_swiglu", GATE_UP), ("rmsnorm_qkv_rope", QKV_ROPE)]), "[]", "1")
    assert report["stock"] == [] and {k: v for k, v in report["patched"].items() if k in FUSED} == \
        {p: 2 for p in FUSED}
    # at the decode steps rmsnorm_qkv_rope is asked first: the rmsnorm_linear entry is not used
    want = {"rmsnorm_qkv_rope:tuned": 4, "linear_residual:tuned": 8, "rmsnorm_gate_up_swiglu:tuned": 4}
    assert report["counts"] == want and report["compiled_counts"] == want
    assert max(report["err"]) < 1e-4 and max(report["err_compiled"]) < 1e-4


def _hidden_states(model, ids):
    with torch.no_grad():
        return model(ids, output_hidden_states=True).hidden_states


@pytest.mark.parametrize("before", [False, True], ids=["hooks-after-patch", "hooks-before-patch"])
def test_output_hidden_states_records_every_fused_layer_and_survives_unpatch(before):
    """transformers 5 installs its output-recording hooks once per model, on the layers that are
    instances of its decoder-layer class: the fused layer must be one, and take over (and give
    back) hooks installed before it."""
    model = tiny_model("Llama")
    ids = torch.randint(0, 128, (B, T), generator=torch.Generator().manual_seed(3))
    want = _hidden_states(model, ids) if before else None
    if not before:   # hooks not installed yet: they get installed on the patched model
        want = [h.clone() for h in _hidden_states(tiny_model("Llama"), ids)]
    patch(model, dispatch.DispatchTable.empty(), stock_through_ops=True)
    layer_cls = type(tiny_model("Llama").model.layers[0])
    assert all(isinstance(layer, HwtuneDecoderLayer) and isinstance(layer, layer_cls) for layer in model.model.layers)
    got = _hidden_states(model, ids)
    assert len(got) == len(want) == model.config.num_hidden_layers + 1
    for w, g in zip(want, got):
        assert rel_err(w, g) < TOL[torch.float32]
    unpatch(model)
    again = _hidden_states(model, ids)
    assert len(again) == len(want) and all(rel_err(w, g) < TOL[torch.float32] for w, g in zip(want, again))


def test_a_layer_running_the_original_records_each_hidden_state_once():
    """Recording hooks installed before patch stay on the original layer as well: a fused layer
    that runs the original (training mode) called it through its hooks, so every hidden state was
    recorded twice (5 for a 2-layer model instead of 3)."""
    model = tiny_model("Llama")
    ids = torch.randint(0, 128, (B, T), generator=torch.Generator().manual_seed(4))
    _hidden_states(model, ids)   # installs transformers' hooks on the unpatched layers
    patch(model, dispatch.DispatchTable.empty(), stock_through_ops=True)
    model.train()
    want = _hidden_states(tiny_model("Llama").train(), ids)
    got = _hidden_states(model, ids)
    assert len(got) == len(want) == model.config.num_hidden_layers + 1
    assert all(rel_err(w, g) < TOL[torch.float32] for w, g in zip(want, got))


@pytest.mark.parametrize("before", [False, True], ids=["hooks-after-patch", "hooks-before-patch"])
def test_output_attentions_gives_the_unpatched_attention_weights(before):
    """A patched attention was not an instance of the model's attention class (hooks installed
    after patch recorded nothing) and computes no weights: output_attentions came back empty."""
    model = tiny_model("Llama", attn_implementation="eager")
    ids = torch.randint(0, 128, (B, T), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = tiny_model("Llama", attn_implementation="eager")(ids, output_attentions=True).attentions
        if before:
            model(ids, output_attentions=True)
    patch(model, dispatch.DispatchTable.empty(), stock_through_ops=True)
    with torch.no_grad():
        got = model(ids, output_attentions=True).attentions
    assert len(got) == len(want) == model.config.num_hidden_layers
    assert all(rel_err(w, g) < TOL[torch.float32] for w, g in zip(want, got))
