"""kernelsearch.integrations.transformers: patch / unpatch of tiny Llama-family models on CPU.

Tiny configs (hidden 64, 2 layers, 4 query heads, 2 kv heads: GQA) of the four classes. In this
process the table routes every op to stock (no triton), which checks the patch's structure:
fused q|k|v and gate|up, RoPE, the decode path over the StaticCache, lm_head. One child process
runs the same model with tuned, harness-verified Triton kernels for every decode shape under
TRITON_INTERPRET.
"""
import inspect
import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import StaticCache  # noqa: E402

from kernelsearch import dispatch, ops  # noqa: E402
from kernelsearch.integrations.transformers import (HwtuneDecoderLayer, decode_shapes, patch,  # noqa: E402
                                                    patched_report, unpatch)

from conftest import ROOT  # noqa: E402

CLASSES = ["Llama", "Mistral", "Qwen2", "Qwen3"]
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=128, max_position_embeddings=128)
EXTRA = {"Llama": {}, "Mistral": {"sliding_window": None}, "Qwen2": {}, "Qwen3": {"head_dim": 16}}
MAX_CACHE = 16
# transformers 5.24 renamed the models' `past_key_values` argument to `cache`
CACHE = "cache" if "cache" in inspect.signature(transformers.LlamaModel.forward).parameters \
    else "past_key_values"
# transformers 4.x models compute the cache position from the cache unless told (a data-dependent
# arange that torch.compile(fullgraph=True) cannot trace)
POSITION = "cache_position" in inspect.signature(transformers.LlamaModel.forward).parameters


def tiny_model(name, dtype=torch.float32, seed=0, **overrides):
    config = getattr(transformers, name + "Config")(**{**TINY, **EXTRA[name], **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, name + "ForCausalLM")(config).eval().to(dtype)
    with torch.no_grad():   # a random model's norms are all ones: make them matter
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif n.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
    return model


def counting_table():
    """An empty table: every op runs stock, and the table counts the calls."""
    return dispatch.DispatchTable.empty()


def prefill_and_decode(model, ids, steps=3, step_fn=None):
    """Logits of the prefill and of `steps` greedy one-token steps on a StaticCache."""
    cache = StaticCache(config=model.config, max_cache_len=MAX_CACHE)
    step_fn = step_fn or model
    logits = []
    at = lambda start, n: {"cache_position": torch.arange(start, start + n)} if POSITION else {}
    with torch.no_grad():
        out = model(ids, **{CACHE: cache}, use_cache=True, **at(0, ids.shape[1]))
        logits.append(out.logits.float())
        token = out.logits[:, -1:].argmax(-1)
        for i in range(steps):
            out = step_fn(token, **{CACHE: cache}, use_cache=True, **at(ids.shape[1] + i, 1))
            logits.append(out.logits.float())
            token = out.logits[:, -1:].argmax(-1)
    return logits


def rel_err(a, b):
    return float((a - b).abs().max() / a.abs().max())


TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", CLASSES)
def test_patched_logits_match_unpatched_for_prefill_and_static_cache_decode_steps(name, dtype):
    model = tiny_model(name, dtype)
    ids = torch.randint(0, 128, (2, 5), generator=torch.Generator().manual_seed(1))
    want = prefill_and_decode(model, ids)
    table = counting_table()
    report = patch(model, table, stock_through_ops=True, fused=False)   # issue 12's patch
    assert report.stock == []
    assert report.patched == {"rms_norm": 5 + (4 if name == "Qwen3" else 0), "mlp": 2, "attention": 2,
                              "lm_head": 1}
    assert not any(isinstance(layer, HwtuneDecoderLayer) for layer in model.model.layers)
    got = prefill_and_decode(model, ids)
    for step, (w, g) in enumerate(zip(want, got)):
        assert rel_err(w, g) < TOL[dtype], (step, rel_err(w, g))
    routed = {k for k, _ in table.counts}
    # decode steps write RoPE'd k and v straight into the StaticCache (not with Qwen3's
    # q_norm / k_norm between the projection and RoPE); the prefill goes through hwtune::rope
    fused = set() if name == "Qwen3" else {"rope_kv_write"}
    assert routed == {"rmsnorm", "linear", "rope", "swiglu", "decode_attention"} | fused
    # 3 decode steps x 2 layers went through hwtune's decode attention, the prefill did not
    assert table.counts[("decode_attention", "stock")] == 3 * 2
    assert table.counts.get(("rope_kv_write", "stock"), 0) == (3 * 2 if fused else 0)
    unpatch(model)


@pytest.mark.parametrize("name", CLASSES)
def test_shapes_without_a_tuned_entry_run_the_models_own_code_by_default(name):
    """The default: only shapes the table has a tuned kernel for go through the ops (one
    opaque node each under torch.compile); the rest stays the model's own code, with q|k|v
    and gate|up still one projection each."""
    model = tiny_model(name)
    ids = torch.randint(0, 128, (2, 5), generator=torch.Generator().manual_seed(8))
    want = prefill_and_decode(model, ids)
    table = counting_table()
    report = patch(model, table)
    assert report.stock == [] and report.patched["attention"] == 2
    got = prefill_and_decode(model, ids)
    assert max(rel_err(w, g) for w, g in zip(want, got)) < 1e-5
    assert table.counts == {}


def test_a_table_for_another_device_says_so_in_one_line():
    model = tiny_model("Llama")
    table = dispatch.DispatchTable({"format": 1, "fingerprint_id": "nvidia-h200-12345678", "entries": [
        {"kernel": "rmsnorm", "dtype": "float32", "shape": {"M": 2, "N": 64}, "params": {}}]})
    report = patch(model, table)
    assert len(report.stock) == 1 and "entries are for nvidia-h200-12345678" in report.stock[0]
    assert model.model.norm._tuned == frozenset()


def test_a_table_entry_whose_kernel_changed_since_the_search_is_left_out_with_one_line():
    """An entry whose source no longer hashes to its source_hash (the kernel file edited, a
    template changed by an upgrade) runs stock in dispatch.route; the patch still counted it as a
    tuned shape and sent that shape through the op (one opaque stock node under torch.compile),
    and the report said nothing."""
    from kernelsearch.fingerprint import collect, fingerprint_id
    from kernelsearch.kernels import TEMPLATES

    model = tiny_model("Llama")
    ids = torch.randint(0, 128, (2, 5), generator=torch.Generator().manual_seed(15))
    want = prefill_and_decode(model, ids)
    row = {"kernel": "rmsnorm", "dtype": "float32", "shape": {"M": 2, "N": 64}, "params": {},
           "source": {"module": TEMPLATES["rmsnorm"]}, "source_hash": "0" * 64, "plan": {"grid": [1]}}
    table = dispatch.DispatchTable({"format": 1, "fingerprint_id": fingerprint_id(collect("cpu")),
                                    "entries": [row]})
    report = patch(model, table)
    assert "0 tuned shapes" in report.table
    assert len(report.stock) == 1 and "1 of 1 table entries left out" in report.stock[0]
    assert model.model.norm._tuned == frozenset()
    assert max(rel_err(w, g) for w, g in zip(want, prefill_and_decode(model, ids))) < 1e-5
    assert table.counts == {}


@pytest.mark.parametrize("name", CLASSES)
def test_generate_with_a_static_cache_gives_the_unpatched_tokens_and_logits(name):
    model = tiny_model(name)
    ids = torch.randint(0, 128, (2, 6), generator=torch.Generator().manual_seed(2))
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False,
              cache_implementation="static", return_dict_in_generate=True, output_logits=True)
    want = model.generate(ids, **kw)
    table = counting_table()
    patch(model, table, stock_through_ops=True)
    got = model.generate(ids, **kw)
    unpatch(model)
    assert torch.equal(want.sequences, got.sequences)
    assert max(rel_err(w, g) for w, g in zip(want.logits, got.logits)) < 1e-5
    # 5 tokens: 1 prefill + 4 steps of 2 layers; RoPE, cache write and attention one fused op
    # (Qwen2); RoPE and the cache write in the fused norm + q|k|v op, then decode_attention (Llama,
    # Mistral); Qwen3: q/k norms between projection and RoPE, so hwtune::rope + decode_attention
    kernel = "rope_kv_attention" if name == "Qwen2" else "decode_attention"
    assert table.counts[(kernel, "stock")] == 4 * 2
    if name in ("Llama", "Mistral"):
        assert table.counts[("rmsnorm_qkv_rope", "stock")] == 4 * 2


def test_eager_attention_implementation_float_mask_takes_the_decode_path_too():
    model = tiny_model("Llama", attn_implementation="eager")
    assert model.config._attn_implementation == "eager"
    ids = torch.randint(0, 128, (3, 4), generator=torch.Generator().manual_seed(3))
    want = prefill_and_decode(model, ids)
    table = counting_table()
    patch(model, table, stock_through_ops=True)
    got = prefill_and_decode(model, ids)
    assert max(rel_err(w, g) for w, g in zip(want, got)) < 1e-5
    assert table.counts[("decode_attention", "stock")] == 3 * 2   # the float mask read as lengths
    assert table.counts[("rmsnorm_qkv_rope", "stock")] == 3 * 2


@pytest.mark.parametrize("name", ["Llama", "Qwen3"])
def test_patched_decode_step_compiles_with_fullgraph_and_matches(name):
    model = tiny_model(name)
    ids = torch.randint(0, 128, (2, 5), generator=torch.Generator().manual_seed(4))
    want = prefill_and_decode(model, ids)
    patch(model, counting_table(), stock_through_ops=True, fused=False)
    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    got = prefill_and_decode(model, ids, step_fn=torch.compile(model.forward, fullgraph=True, backend=backend))
    assert max(rel_err(w, g) for w, g in zip(want, got)) < 1e-5
    # Llama's decode step writes the cache with the mutating hwtune::rope_kv_write, under fullgraph
    kv = "rope_kv_write" if name == "Llama" else "rope"
    for op in ("rms_norm", "linear", "swiglu", kv, "decode_attention"):
        assert f"hwtune.{op}" in seen, op
    torch._dynamo.reset()
    got = prefill_and_decode(model, ids, step_fn=torch.compile(model.forward, fullgraph=True,
                                                               backend="aot_eager"))
    assert max(rel_err(w, g) for w, g in zip(want, got)) < 1e-5
    torch._dynamo.reset()


def test_padded_rows_run_the_models_attention_eagerly_and_are_nan_when_compiled():
    model = tiny_model("Llama")
    ids = torch.randint(0, 128, (2, 6), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0   # left padding: row 1's valid positions do not start at 0
    kw = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, cache_implementation="static",
              return_dict_in_generate=True, output_logits=True)
    want = model.generate(ids, **kw)
    table = counting_table()
    patch(model, table, stock_through_ops=True)
    got = model.generate(ids, **kw)
    assert torch.equal(want.sequences, got.sequences)
    assert max(rel_err(w, g) for w, g in zip(want.logits, got.logits)) < 1e-5
    assert ("decode_attention", "stock") not in table.counts   # the model's own attention ran

    # compiled, no host sync to check the mask: the padded row comes out NaN, never wrong
    cache = StaticCache(config=model.config, max_cache_len=MAX_CACHE)
    full = torch.cat([mask, torch.zeros(2, MAX_CACHE - 6, dtype=mask.dtype)], dim=1)
    step = torch.compile(model.forward, fullgraph=True, backend="eager")
    with torch.no_grad():
        out = model(ids, attention_mask=full, **{CACHE: cache}, use_cache=True)
        full[:, 6] = 1
        out = step(out.logits[:, -1:].argmax(-1), attention_mask=full, **{CACHE: cache}, use_cache=True,
                   position_ids=torch.tensor([[6], [4]]),
                   **({"cache_position": torch.tensor([6])} if POSITION else {}))
    torch._dynamo.reset()
    assert torch.isfinite(out.logits[0]).all() and torch.isnan(out.logits[1]).all()


def test_unpatch_restores_the_same_modules_and_parameters_with_equal_values():
    model = tiny_model("Qwen2")
    modules = dict(model.named_modules())
    params = dict(model.named_parameters())
    values = {n: p.detach().clone() for n, p in params.items()}
    keys = list(model.state_dict())
    patch(model, counting_table())
    # while patched: the same parameter names, and q/k/v are views into one fused weight
    assert list(model.state_dict()) == keys
    attn = model.model.layers[0].self_attn
    assert attn.qkv_weight.data_ptr() == attn.q_proj.weight.data_ptr()
    assert attn.k_proj.weight.untyped_storage().data_ptr() == attn.qkv_weight.untyped_storage().data_ptr()
    assert attn.q_proj.weight is params["model.layers.0.self_attn.q_proj.weight"]
    assert patched_report(model).patched["attention"] == 2
    unpatch(model)
    assert patched_report(model) is None
    after = dict(model.named_modules())
    assert list(after) == list(modules) and all(after[n] is m for n, m in modules.items())
    after_params = dict(model.named_parameters())
    assert all(after_params[n] is p and torch.equal(p, values[n]) for n, p in params.items())
    storages = {p.untyped_storage().data_ptr() for p in after_params.values()}
    assert len(storages) == len(after_params)   # every parameter has its own storage again
    unpatch(model)  # a second unpatch is a no-op


def test_patching_twice_is_refused():
    model = tiny_model("Llama")
    patch(model, counting_table())
    with pytest.raises(ValueError, match="already patched"):
        patch(model, counting_table())


def test_a_table_path_instead_of_a_table_is_a_type_error_naming_the_loaders(tmp_path):
    model = tiny_model("Llama")
    before = list(model.modules())
    for wrong in (str(tmp_path / "table.json"), tmp_path / "table.json", {"entries": []}):
        with pytest.raises(TypeError, match=r"expected a kernelsearch.dispatch.DispatchTable, got .*DispatchTable.load"):
            patch(model, table=wrong)
    assert _unchanged(model, before) and patched_report(model) is None


def _unchanged(model, before) -> bool:
    return all(a is b for a, b in zip(before, model.modules())) and len(before) == len(list(model.modules()))


def test_without_a_table_the_model_stays_stock_with_one_line(caplog):
    model = tiny_model("Llama")
    before = list(model.modules())
    assert dispatch.current() is None
    with caplog.at_level(logging.WARNING, logger="hwtune.transformers"):
        report = patch(model)
    assert report.patched == {} and len(report.stock) == 1 and "no dispatch table" in report.stock[0]
    assert [r.getMessage() for r in caplog.records] == [f"hwtune patch LlamaForCausalLM: {report.stock[0]}"]
    assert _unchanged(model, before) and patched_report(model) is None


def test_the_process_wide_table_is_used_when_none_is_passed():
    model = tiny_model("Llama")
    table = counting_table()
    dispatch.use(table)
    try:
        report = patch(model)
    finally:
        dispatch.use(None)
    assert report.stock == [] and model.model.norm.table == ops.table_handle(table)


def test_quantized_weights_leave_the_whole_model_stock_with_one_line():
    model = tiny_model("Llama")
    model.config.quantization_config = {"quant_method": "bitsandbytes"}
    before = list(model.modules())
    report = patch(model, counting_table())
    assert report.patched == {} and len(report.stock) == 1
    assert "quantized weights (bitsandbytes)" in report.stock[0]
    assert _unchanged(model, before)

    class Int8Linear(torch.nn.Linear):
        pass

    model = tiny_model("Llama")
    old = model.model.layers[1].mlp.down_proj
    model.model.layers[1].mlp.down_proj = Int8Linear(old.in_features, old.out_features, bias=False)
    report = patch(model, counting_table())
    assert report.patched == {} and len(report.stock) == 1
    assert "model.layers.1.mlp.down_proj is Int8Linear" in report.stock[0]


def test_sliding_window_attention_stays_the_models_own_with_one_line():
    model = tiny_model("Mistral", sliding_window=4096)
    ids = torch.randint(0, 128, (2, 5), generator=torch.Generator().manual_seed(6))
    want = prefill_and_decode(model, ids)
    attn = [layer.self_attn for layer in model.model.layers]
    report = patch(model, counting_table())
    assert len(report.stock) == 1 and "sliding window 4096" in report.stock[0]
    assert "attention" not in report.patched and report.patched["mlp"] == 2
    assert [layer.self_attn for layer in model.model.layers] == attn
    got = prefill_and_decode(model, ids)
    assert max(rel_err(w, g) for w, g in zip(want, got)) < 1e-5


def test_an_unknown_rope_type_leaves_attention_stock_with_one_line():
    model = tiny_model("Llama")
    if getattr(model.config, "rope_parameters", None) is not None:   # transformers 5
        model.config.rope_parameters = dict(model.config.rope_parameters, rope_type="hwtune-unknown")
    else:
        model.config.rope_scaling = {"rope_type": "hwtune-unknown", "factor": 2.0}
    report = patch(model, counting_table())
    assert len(report.stock) == 1 and "RoPE type 'hwtune-unknown'" in report.stock[0]
    assert "attention" not in report.patched and report.patched["mlp"] == 2


def test_an_unknown_model_class_stays_stock_with_one_line():
    config = transformers.LlamaConfig(**TINY)
    model = transformers.LlamaForSequenceClassification(config).eval()
    report = patch(model, counting_table())
    assert report.patched == {} and len(report.stock) == 1 and "LlamaForSequenceClassification" in report.stock[0]


def test_a_model_compiled_before_patch_is_refused_naming_the_order():
    """patch(torch.compile(model)) said 'model class OptimizedModule: hwtune patches
    LlamaForCausalLM, ...' of a LlamaForCausalLM."""
    model = torch.compile(tiny_model("Llama"))
    report = patch(model, counting_table())
    assert report.patched == {} and len(report.stock) == 1
    assert "OptimizedModule of LlamaForCausalLM" in report.stock[0] and "before compiling" in report.stock[0]


def test_training_mode_runs_the_original_modules():
    model = tiny_model("Llama")
    ids = torch.randint(0, 128, (1, 4))
    table = counting_table()
    patch(model, table, stock_through_ops=True)
    model.train()
    with torch.no_grad():
        model(ids)
    assert table.counts == {}
    model.eval()
    with torch.no_grad():
        model(ids)
    assert table.counts



@pytest.mark.parametrize("where", ["mlp.up_proj", "mlp.down_proj", "self_attn.q_proj", "self_attn.o_proj",
                                   "mlp", "self_attn", "input_layernorm"])
def test_a_users_forward_hook_on_a_module_the_patch_bypasses_still_runs(where):
    """q/k/v/o and gate/up/down are computed from the fused weights (F.linear or hwtune::linear),
    and a fused layer calls its children's parts, not the children: a forward hook there (activation
    capture, steering) silently did not run and the logits were not the hooked model's. That part
    now stays the model's own, with one line naming the hook."""
    ids = torch.randint(0, 128, (2, 5), generator=torch.Generator().manual_seed(14))
    model = tiny_model("Llama")
    calls = []

    def double(module, args, out):
        calls.append(1)
        return (out[0] * 2, *out[1:]) if isinstance(out, tuple) else out * 2

    model.model.layers[0].get_submodule(where).register_forward_hook(double)
    want = prefill_and_decode(model, ids)
    n = len(calls)
    calls.clear()
    report = patch(model, counting_table(), stock_through_ops=True)
    got = prefill_and_decode(model, ids)
    assert len(calls) == n
    assert max(rel_err(w, g) for w, g in zip(want, got)) < 1e-5
    assert any("forward hooks on" in line and where.split(".")[-1] in line for line in report.stock), report.stock
    assert report.patched["attention"] >= 1 and report.patched["mlp"] >= 1   # the other layer is patched


def test_backward_hooks_of_swapped_modules_still_fire_in_training():
    """The swapped modules took over the forward hooks only: a full backward hook on an MLP,
    attention, norm, decoder layer or the lm_head (gradient inspection, clipping) never fired
    after patch."""
    ids = torch.randint(0, 128, (2, 5), generator=torch.Generator().manual_seed(19))
    where = ("model.layers.0.mlp", "model.layers.0.self_attn", "model.layers.1", "model.norm", "lm_head")
    seen = {}
    for patched in (False, True):
        model = tiny_model("Llama")
        calls = seen.setdefault(patched, [])
        for name in where:
            model.get_submodule(name).register_full_backward_hook(lambda m, gi, go, name=name: calls.append(name))
        if patched:
            patch(model, counting_table(), stock_through_ops=True)
        model.train()
        model(ids, labels=ids).loss.backward()
    assert sorted(seen[True]) == sorted(seen[False]) == sorted(where)
    unpatch(model)   # given back to the original modules
    seen[True].clear()
    model(ids, labels=ids).loss.backward()
    assert sorted(seen[True]) == sorted(where)


@pytest.mark.parametrize("name", ["Llama", "Qwen2"])
def test_training_mode_reaches_the_original_modules_dropout(name):
    """model.train() set the swapped modules' mode but not the originals' (not registered as
    submodules), which run in training mode: the attention's dropout (attention_dropout) stayed
    off and the patched model trained with other losses than the unpatched one."""
    import copy

    ids = torch.randint(0, 128, (2, 5), generator=torch.Generator().manual_seed(17))
    want = tiny_model(name, attention_dropout=0.5, attn_implementation="eager")
    model = copy.deepcopy(want)
    patch(model, counting_table(), stock_through_ops=True)
    losses = []
    for m in (want.train(), model.train()):
        torch.manual_seed(3)
        losses.append(float(m(ids, labels=ids).loss))
    assert losses[0] == losses[1]
    model.eval()
    assert not any(mod.training for mod in model.modules())
    unpatch(model)
    assert not any(mod.training for mod in model.modules())


@pytest.mark.parametrize("stock_through_ops", [False, True], ids=["routed", "every-shape"])
def test_backward_through_an_eval_mode_model_gives_the_unpatched_gradients(stock_through_ops):
    """Autograd recording (grad mode on, parameters that require grad) runs the original modules:
    the fused q|k|v and gate|up weights are detached and the ops have no backward, so the patched
    path gave q/k/v/gate/up no gradient (routed) or raised inside hwtune::linear (every shape)."""
    ids = torch.randint(0, 128, (2, 5), generator=torch.Generator().manual_seed(11))
    want, model = tiny_model("Llama"), tiny_model("Llama")
    want(ids, labels=ids).loss.backward()
    table = counting_table()
    patch(model, table, stock_through_ops=stock_through_ops)
    model(ids, labels=ids).loss.backward()
    for (name, w), (_, g) in zip(want.named_parameters(), model.named_parameters()):
        assert g.grad is not None and rel_err(w.grad, g.grad) < 1e-5, name
    assert table.counts == {}
    with torch.no_grad():   # inference still goes through the ops
        model(ids)
    assert table.counts or not stock_through_ops


@pytest.mark.parametrize("stock_through_ops", [False, True], ids=["routed", "every-shape"])
def test_autocast_runs_the_models_own_code_and_gives_the_unpatched_logits(stock_through_ops):
    """Under torch.autocast a routed call met the autocast dtype beside the fp32 weights:
    'hwtune::rope: tensors must share one dtype' from inside the op (or an fp32 result where the
    unpatched model computes in bf16)."""
    ids = torch.randint(0, 128, (2, 5), generator=torch.Generator().manual_seed(16))
    model = tiny_model("Llama")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = prefill_and_decode(model, ids)
    table = counting_table()
    patch(model, table, stock_through_ops=stock_through_ops)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = prefill_and_decode(model, ids)
    assert max(rel_err(w, g) for w, g in zip(want, got)) == 0
    assert table.counts == {}
    prefill_and_decode(model, ids)   # outside autocast the ops run again
    assert table.counts or not stock_through_ops


@pytest.mark.parametrize("move", ["to-float16", "deepcopy"])
def test_weights_loaded_after_a_dtype_move_or_a_deepcopy_reach_the_patched_model(move):
    """model.to(dtype) and copy.deepcopy gave the q/k/v and gate/up parameters storage apart from
    the fused weights: load_state_dict then changed the parameters, and the patched model kept
    computing with the old fused weights (tokens and logits of the old model)."""
    import copy

    dtype = torch.float16 if move == "to-float16" else torch.float32
    ids = torch.randint(0, 128, (2, 6), generator=torch.Generator().manual_seed(12))
    other = tiny_model("Qwen2", seed=5).to(dtype)   # q|k|v biases too
    want = prefill_and_decode(other, ids)
    model = tiny_model("Qwen2")
    patch(model, counting_table(), stock_through_ops=True)
    model = model.to(dtype) if move == "to-float16" else copy.deepcopy(model)
    model.load_state_dict(other.state_dict())
    got = prefill_and_decode(model, ids)
    assert max(rel_err(w, g) for w, g in zip(want, got)) < 3e-3
    attn = model.model.layers[0].self_attn
    assert attn.k_proj.weight.untyped_storage().data_ptr() == attn.qkv_weight.untyped_storage().data_ptr()
    unpatch(model)
    assert max(rel_err(w, g) for w, g in zip(want, prefill_and_decode(model, ids))) < 3e-3


def test_a_patched_model_pickles_and_the_copy_gives_the_same_logits():
    """torch.save(model) of a patched model raised PicklingError: the fused decoder layer's class,
    made at patch time, could not be found by name in this module."""
    import io

    ids = torch.randint(0, 128, (2, 5), generator=torch.Generator().manual_seed(13))
    model = tiny_model("Llama")
    want = prefill_and_decode(model, ids)
    patch(model, counting_table(), stock_through_ops=True)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    copy = torch.load(buf, weights_only=False)
    assert isinstance(copy.model.layers[0], HwtuneDecoderLayer)
    assert max(rel_err(w, g) for w, g in zip(want, prefill_and_decode(copy, ids))) < 1e-5
    unpatch(copy)
    assert max(rel_err(w, g) for w, g in zip(want, prefill_and_decode(copy, ids))) < 1e-5

def test_a_patched_model_saved_whole_loads_in_another_process(tmp_path):
    """torch.load of a patched model in a process that had patched none: pickle found no
    HwtuneLlamaDecoderLayer (a class made at patch time), and the modules' table handle selected
    no table there ('no table with handle 1' at the first call)."""
    ids = torch.randint(0, 128, (2, 5), generator=torch.Generator().manual_seed(18))
    model = tiny_model("Qwen2")
    want = prefill_and_decode(model, ids)
    patch(model, counting_table(), stock_through_ops=True)
    torch.save(model, tmp_path / "model.pt")
    torch.save({"ids": ids, "want": want}, tmp_path / "want.pt")
    child = textwrap.dedent(f'''
        import sys, torch
        sys.path.insert(0, "tests")
        from test_hf_transformers import prefill_and_decode, rel_err
        model = torch.load({str(tmp_path / "model.pt")!r}, weights_only=False)
        data = torch.load({str(tmp_path / "want.pt")!r})
        got = prefill_and_decode(model, data["ids"])
        from kernelsearch.integrations.transformers import HwtuneDecoderLayer, unpatch
        assert isinstance(model.model.layers[0], HwtuneDecoderLayer)
        print(max(rel_err(w, g) for w, g in zip(data["want"], got)))
        unpatch(model)
        print(max(rel_err(w, g) for w, g in zip(data["want"], prefill_and_decode(model, data["ids"]))))
    ''')
    proc = subprocess.run([sys.executable, "-c", child], cwd=ROOT, text=True, capture_output=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert all(float(line) < 1e-5 for line in proc.stdout.split()), proc.stdout


CHILD = textwrap.dedent('''
    import json, sys
    import torch
    sys.path.insert(0, "tests")
    from test_hf_transformers import tiny_model, prefill_and_decode, rel_err, MAX_CACHE
    from tests.tuned_tables import verified_table
    from kernelsearch.integrations.transformers import patch

    name = sys.argv[1]
    model = tiny_model(name)
    cfg = model.config
    B, H, HKV, D = 2, 4, 2, 16
    entries = [
        ("rmsnorm", {"M": B, "N": 64}, "float32", {}),
        ("linear", {"M": B, "K": 64, "N": (H + 2 * HKV) * D}, "float32", {}),   # q|k|v
        ("linear", {"M": B, "K": 64, "N": 64}, "float32",                      # o_proj
         {"variant": "splitk", "BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "GROUP_M": 8,
          "SPLIT_K": 2, "FMA": 0, "num_warps": 4, "num_stages": 2, "REDUCE": "last"}),
        ("linear", {"M": B, "K": 64, "N": 256}, "float32", {}),                 # gate|up
        ("linear", {"M": B, "K": 128, "N": 64}, "float32", {}),                 # down
        ("linear", {"M": B, "K": 64, "N": 128}, "float32", {}),                 # lm_head
        ("swiglu", {"M": B, "I": 128}, "float32", {}),
        ("rope", {"B": B, "Hq": H, "Hkv": HKV, "D": D}, "float32", {}),
        ("decode_attention", {"B": B, "Hq": H, "Hkv": HKV, "S": MAX_CACHE, "D": D}, "float32",
         {"BLOCK_S": 16, "NUM_SPLITS": 1, "num_warps": 4, "num_stages": 1}),
        ("rope_kv_write", {"B": B, "Hq": H, "Hkv": HKV, "D": D, "S": MAX_CACHE}, "float32", {}),
    ]
    if name == "Qwen3":
        entries += [("rmsnorm", {"M": B * H, "N": D}, "float32", {}),
                    ("rmsnorm", {"M": B * HKV, "N": D}, "float32", {})]
    table = verified_table(entries)
    ids = torch.randint(0, 128, (B, 5), generator=torch.Generator().manual_seed(7))
    want = prefill_and_decode(model, ids, steps=2)
    report = patch(model, table)
    got = prefill_and_decode(model, ids, steps=2)
    counts = {f"{k}:{r}": n for (k, r), n in table.counts.items()}
    table.counts.clear()
    torch._dynamo.reset()
    compiled = prefill_and_decode(model, ids, steps=2,
                                  step_fn=torch.compile(model.forward, fullgraph=True, backend="aot_eager"))
    print(json.dumps({"stock": report.stock, "counts": counts,
                      "compiled_counts": {f"{k}:{r}": n for (k, r), n in table.counts.items()},
                      "err": [rel_err(w, g) for w, g in zip(want, got)],
                      "err_compiled": [rel_err(w, g) for w, g in zip(want, compiled)]}))
''')


@pytest.mark.parametrize("name", ["Llama", "Qwen3"])
def test_tuned_triton_kernels_of_every_decode_op_give_the_unpatched_logits(name):
    env = {"TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT), "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
           "HOME": os.environ.get("HOME", "/root")}
    proc = subprocess.run([sys.executable, "-c", CHILD, name], cwd=ROOT, text=True, capture_output=True,
                          timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["stock"] == []
    # 2 decode steps x 2 layers; norms: 2 per layer + the final one (+ q_norm, k_norm in Qwen3)
    norms = 2 * (5 + (4 if name == "Qwen3" else 0))
    # Llama's decode steps write the cache with rope_kv_write; Qwen3 normalises q and k between
    # the projection and RoPE, so its steps keep hwtune::rope and the cache's own update
    rope = "rope:tuned" if name == "Qwen3" else "rope_kv_write:tuned"
    want = {"rmsnorm:tuned": norms, "linear:tuned": 2 * 9, "swiglu:tuned": 4, rope: 4,
            "decode_attention:tuned": 4}
    # prefill shapes have no entry: the model's own code, no op call at all
    assert report["counts"] == want and report["compiled_counts"] == want
    assert max(report["err"]) < 1e-4 and max(report["err_compiled"]) < 1e-4
    assert report["err"][1] > 0   # the decode steps really ran other kernels than stock


CHILD_KV = textwrap.dedent('''
    import json, sys
    import torch
    sys.path.insert(0, "tests")
    from transformers import StaticCache
    from test_hf_transformers import tiny_model, rel_err, MAX_CACHE, CACHE
    from tests.tuned_tables import verified_table
    from kernelsearch.integrations.transformers import patch, unpatch

    dtype = getattr(torch, sys.argv[1])
    model = tiny_model("Llama", dtype)
    B, H, HKV, D = 2, 4, 2, 16
    table = verified_table([("rope_kv_write", {"B": B, "Hq": H, "Hkv": HKV, "D": D, "S": MAX_CACHE},
                             sys.argv[1], {"HEADS_PER_PROG": 2, "num_warps": 1})])
    ids = torch.randint(0, 128, (B, 5), generator=torch.Generator().manual_seed(9))

    def run(steps=4):
        cache = StaticCache(config=model.config, max_cache_len=MAX_CACHE)
        logits = []
        with torch.no_grad():
            out = model(ids, **{CACHE: cache}, use_cache=True)
            logits.append(out.logits.float())
            for _ in range(steps):
                out = model(out.logits[:, -1:].argmax(-1), **{CACHE: cache}, use_cache=True)
                logits.append(out.logits.float())
        kv = [(layer.keys.float(), layer.values.float(), int(layer.cumulative_length)) for layer in cache.layers]
        return logits, kv

    want, want_kv = run()
    report = patch(model, table)
    got, got_kv = run()
    counts = {f"{k}:{r}": n for (k, r), n in table.counts.items()}
    unpatch(model)
    table.counts.clear()
    back, back_kv = run()
    cache_err = [max(rel_err(a[i], b[i]) for i in (0, 1)) for a, b in zip(want_kv, got_kv)]
    print(json.dumps({
        "stock": report.stock, "counts": counts, "after_unpatch": len(table.counts),
        "err": [rel_err(w, g) for w, g in zip(want, got)], "cache_err": cache_err,
        "lengths": [[a[2], b[2]] for a, b in zip(want_kv, got_kv)],
        # slots no token reached yet: zeros in both (the kernel wrote nothing else)
        "untouched_zero": all(bool((b[i][:, :, 9:] == 0).all()) for b in got_kv for i in (0, 1)),
        "unpatched_same": all(torch.equal(w, g) for w, g in zip(want, back)) and
                          all(torch.equal(a[i], b[i]) for a, b in zip(want_kv, back_kv) for i in (0, 1))}))
''')


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rope_kv_write_route_writes_the_static_cache_and_gives_the_unpatched_logits(dtype):
    """Prefill (the model's own path fills and initialises the StaticCache), then 4 decode steps
    whose k and v the tuned rope_kv_write kernel writes straight into the cache layers."""
    env = {"TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT), "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
           "HOME": os.environ.get("HOME", "/root")}
    proc = subprocess.run([sys.executable, "-c", CHILD_KV, dtype], cwd=ROOT, text=True, capture_output=True,
                          timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["stock"] == []
    assert report["counts"] == {"rope_kv_write:tuned": 4 * 2}   # 4 steps x 2 layers, nothing else
    tol = 1e-5 if dtype == "float32" else 3e-2
    assert max(report["err"]) < tol and max(report["cache_err"]) < tol, report
    assert report["lengths"] == [[9, 9], [9, 9]]    # 5 prefill tokens + 4 steps, as update counts
    assert report["untouched_zero"]
    assert report["unpatched_same"] and report["after_unpatch"] == 0

