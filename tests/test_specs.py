"""Kernel specs: registry, sweeps, references, stock fallback, cost counts."""
import math

import pytest
import torch

from kernelsearch.harness import compare
from kernelsearch.specs import SPECS, dtype_from_name

NAMES = sorted(SPECS)


def test_registry_holds_the_builtin_kernels():
    assert set(SPECS) == {"rmsnorm", "add_rmsnorm", "softmax", "matmul", "decode_attention",
                          "linear", "swiglu", "rope", "rope_kv_write", "rmsnorm_linear",
                          "rmsnorm_gate_up_swiglu", "linear_residual", "rope_kv_attention",
                          "rmsnorm_qkv_rope"}


@pytest.mark.parametrize("name", NAMES)
def test_cpu_sweep_has_odd_sizes_one_row_and_a_bf16_case(name):
    shapes = SPECS[name].shapes("cpu")
    assert any(s.get("dtype") == "bfloat16" for s in shapes)
    dims = [v for s in shapes for k, v in s.items() if k != "dtype"]
    assert any(v % 2 == 1 and v > 1 for v in dims)
    lead = "B" if name in ("decode_attention", "rope", "rope_kv_write", "rope_kv_attention",
                           "rmsnorm_qkv_rope") else "M"
    assert min(s[lead] for s in shapes) == 1 and max(s[lead] for s in shapes) >= 3


def test_cuda_sweeps_include_decode_odd_and_large_shapes():
    mm = SPECS["matmul"].shapes("cuda")
    assert {1, 16} <= {s["M"] for s in mm} and any(s["N"] % 2 for s in mm)
    rms = SPECS["rmsnorm"].shapes("cuda")
    assert {"M": 32768, "N": 8192} in rms and {"M": 16384, "N": 3000} in rms and {"M": 4096, "N": 4096} in rms
    assert max(s["S"] for s in SPECS["decode_attention"].shapes("cuda")) >= 32768
    assert all(SPECS[n].primary_dtype("cuda") == "bfloat16" for n in NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_stock_fallback_matches_the_fp64_reference_on_every_cpu_shape_and_distribution(name):
    spec = SPECS[name]
    g = torch.Generator().manual_seed(7)
    for shape in spec.shapes("cpu"):
        dims = {k: v for k, v in shape.items() if k != "dtype"}
        dtype = dtype_from_name(shape.get("dtype", "float32"))
        for dist in spec.distributions_for(dtype):
            inputs = spec.make_inputs(dims, dtype, "cpu", g, dist)
            outputs = spec.make_outputs(dims, dtype, "cpu")
            ref, written = spec.reference(inputs), spec.written(inputs)
            before = {n: inputs[n].clone() for n in spec.inout_names}
            spec.stock(inputs, outputs)
            for n in spec.inout_names:   # in place: the written rows hold the reference, the rest kept
                outputs[n] = inputs[n][written[n]]
                assert torch.equal(inputs[n][~written[n]], before[n][~written[n]])
            for out_name in spec.out_names + spec.inout_names:
                err, problem = compare.compare(out_name, outputs[out_name], ref[out_name], spec.tolerance(dtype))
                assert problem is None, (shape, dist, problem)


@pytest.mark.parametrize("name", NAMES)
def test_same_seed_draws_the_same_inputs_and_a_new_seed_different_ones(name):
    spec = SPECS[name]
    shape = {k: v for k, v in spec.shapes("cpu")[1].items() if k != "dtype"}
    draw = lambda seed: spec.make_inputs(shape, torch.float32, "cpu", torch.Generator().manual_seed(seed), "normal")
    a, b, c = draw(1), draw(1), draw(2)
    first = spec.arg_names[0]
    assert torch.equal(a[first], b[first]) and not torch.equal(a[first], c[first])


def test_flop_and_byte_counts_read_each_input_once_and_write_each_output_once():
    assert SPECS["matmul"].flops({"M": 2, "K": 3, "N": 5}) == 60
    assert SPECS["matmul"].bytes({"M": 2, "K": 3, "N": 5}, "bfloat16") == 2 * (6 + 15 + 10)
    assert SPECS["rmsnorm"].bytes({"M": 4, "N": 8}, "float32") == 4 * (2 * 32 + 8)
    assert SPECS["add_rmsnorm"].bytes({"M": 4, "N": 8}, "float32") == 4 * (4 * 32 + 8)
    dec = {"B": 2, "Hq": 8, "Hkv": 2, "S": 16, "D": 4}
    assert SPECS["decode_attention"].bytes(dec, "bfloat16") == 2 * (2 * 2 * 8 * 4 + 2 * 2 * 2 * 16 * 4) + 8


def test_decode_reference_ignores_cache_positions_past_seq_len():
    spec = SPECS["decode_attention"]
    shape = {"B": 2, "Hq": 4, "Hkv": 2, "S": 16, "D": 8}
    inputs = spec.make_inputs(shape, torch.float32, "cpu", torch.Generator().manual_seed(3), "normal")
    inputs["seq_lens"][1] = 5
    before = spec.reference(inputs)["out"]
    inputs["k_cache"][1, :, 5:] = 1e4
    inputs["v_cache"][1, :, 5:] = -1e4
    after = spec.reference(inputs)["out"]
    assert torch.equal(before, after)


def test_tolerances_are_tighter_for_wider_dtypes():
    spec = SPECS["rmsnorm"]
    assert spec.tolerance("float32") < spec.tolerance("float16") < spec.tolerance("bfloat16") <= 1e-2
    assert math.isclose(SPECS["matmul"].tolerance("float32"), 2e-3)


def test_compare_never_passes_nan_and_names_unwritten_output():
    ref = torch.ones(3, 4, dtype=torch.float64)
    out = torch.ones(3, 4)
    out[2, 1] = float("nan")
    _, problem = compare.compare("out", out, ref, 1e-2)
    assert problem.guard == "unwritten_output"
    out = torch.ones(3, 4)
    out[0] *= 1e-3  # one wrong row among correct ones
    _, problem = compare.compare("out", out, ref, 1e-2)
    assert problem.guard == "correctness" and "row 0" in problem.reason


def test_compare_counts_float32_subnormals_as_zero_and_nothing_larger():
    # silu(-100) * 1e3: 3.7e-39 in the fp64 reference, -0 in an fp32 kernel (exp(100) = inf)
    gate = torch.tensor([[-100.0], [-80.0], [2.0]], dtype=torch.float64)
    ref = gate * torch.sigmoid(gate) * 1e3
    out = (gate.float() / (1 + torch.exp(-gate.float()))) * 1e3
    assert out[0, 0] == 0 and ref[0, 0] != 0
    assert compare.compare("out", out, ref, 1e-4)[1] is None
    wrong = out.clone()
    wrong[0, 0] = 1e-30  # normal in fp32: not forgiven
    assert compare.compare("out", wrong, ref, 1e-4)[1].guard == "correctness"
    wrong = out.clone()
    wrong[1, 0] = 0.0  # -80 -> -1.4e-30, a normal fp32 value: must be written
    assert "row 1" in compare.compare("out", wrong, ref, 1e-4)[1].reason


def test_linear_cuda_sweep_holds_llama3_8b_decode_projections_at_batch_1_and_32():
    shapes = SPECS["linear"].shapes("cuda")
    for m in (1, 32):
        for k, n in [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096), (4096, 128256)]:
            assert {"M": m, "K": k, "N": n} in shapes


@pytest.mark.parametrize("name", ["linear", "swiglu", "rope", "rope_kv_write"])
def test_stock_call_is_what_a_user_runs_and_matches_the_reference(name):
    spec = SPECS[name]
    g = torch.Generator().manual_seed(11)
    for shape in spec.shapes("cpu"):
        dims = {k: v for k, v in shape.items() if k != "dtype"}
        dtype = dtype_from_name(shape.get("dtype", "float32"))
        inputs = spec.make_inputs(dims, dtype, "cpu", g, "normal")
        got = spec.stock_call(inputs)
        ref = spec.reference(inputs)
        for out_name in spec.out_names:
            assert got[out_name].dtype == dtype
            _, problem = compare.compare(out_name, got[out_name], ref[out_name], spec.tolerance(dtype))
            assert problem is None, (shape, problem)


def test_linear_is_x_times_the_transposed_nn_linear_weight():
    spec = SPECS["linear"]
    layer = torch.nn.Linear(5, 3, bias=False)
    x = torch.randn(2, 5)
    out = spec.stock_call({"x": x, "weight": layer.weight.detach()})["out"]
    assert torch.allclose(out, layer(x).detach())
    assert spec.input_meta({"M": 2, "K": 5, "N": 3}, torch.float32)["weight"][0] == (3, 5)


def test_swiglu_gates_the_second_half_with_silu_of_the_first():
    gate_up = torch.tensor([[1.0, -2.0, 3.0, 4.0]])
    out = SPECS["swiglu"].reference({"gate_up": gate_up})["out"]
    expect = torch.nn.functional.silu(gate_up[:, :2].double()) * gate_up[:, 2:].double()
    assert torch.allclose(out, expect)


def test_rope_matches_hugging_face_rotate_half_and_uses_both_halves_of_cos_and_sin():
    spec = SPECS["rope"]
    shape = {"B": 2, "Hq": 4, "Hkv": 2, "D": 8}
    inputs = spec.make_inputs(shape, torch.float32, "cpu", torch.Generator().manual_seed(5), "normal")
    # HF: q * cos + rotate_half(q) * sin with cos/sin unsqueezed over the heads
    q, cos, sin = inputs["q"].double(), inputs["cos"].double(), inputs["sin"].double()
    rot = torch.cat((-q[..., 4:], q[..., :4]), dim=-1)
    assert torch.allclose(spec.reference(inputs)["q_out"], q * cos[:, None] + rot * sin[:, None])
    # the halves are drawn independently: a kernel reading only cos[:, :D/2] is wrong
    assert not torch.allclose(inputs["cos"][:, :4], inputs["cos"][:, 4:])
    assert spec.valid_shape({"B": 1, "Hq": 1, "Hkv": 1, "D": 7}) == "D must be even"


def test_rope_kv_write_declares_its_caches_in_out_and_writes_one_slot_per_sequence_and_head():
    spec = SPECS["rope_kv_write"]
    shape = {"B": 3, "Hq": 4, "Hkv": 2, "D": 8, "S": 5}
    sig = {a["name"]: a for a in spec.signature(shape, "float32")}
    assert [a for a in sig] == ["qkv", "cos", "sin", "positions", "k_cache", "v_cache", "q_out"]
    assert sig["k_cache"]["role"] == sig["v_cache"]["role"] == "inout"
    assert sig["q_out"]["role"] == "output" and sig["qkv"]["role"] == "input"
    assert sig["positions"]["dtype"] == "int64" and sig["qkv"]["shape"] == [3, 8, 8]
    inputs = spec.make_inputs(shape, torch.float32, "cpu", torch.Generator().manual_seed(4), "normal")
    # the cache holds random data, not zeros (a few exact ones, as in every draw)
    assert 0.9 < float((inputs["k_cache"] != 0).float().mean()) < 1
    mask = spec.written(inputs)["k_cache"]
    assert mask.shape == (3, 2, 5) and int(mask.sum()) == 3 * 2
    for b in range(3):
        assert mask[b, :, int(inputs["positions"][b])].all()
    # the written rows: rope(k) and v of each sequence, (b, head) order; HF's formula on q
    ref = spec.reference(inputs)
    x = inputs["qkv"].double()
    c, s = inputs["cos"].double()[:, None], inputs["sin"].double()[:, None]
    rot = lambda t: torch.cat((-t[..., 4:], t[..., :4]), -1)
    assert torch.allclose(ref["q_out"], x[:, :4] * c + rot(x[:, :4]) * s)
    assert torch.allclose(ref["k_cache"], (x[:, 4:6] * c + rot(x[:, 4:6]) * s).reshape(6, 8))
    assert torch.equal(ref["v_cache"], x[:, 6:].reshape(6, 8))
    assert spec.valid_shape(dict(shape, D=7)) == "D must be even"


@pytest.mark.parametrize("name", sorted(SPECS))
def test_every_spec_has_a_template_and_its_call_shape_gives_back_each_sweep_shape(name):
    """A new kernel is its spec, its template and one SPECS line: the dispatch table looks calls
    up by spec.call_shape, and kernels/<name>.py is found by its file name."""
    from kernelsearch.kernels import TEMPLATES, template_path

    assert name in TEMPLATES and template_path(name).exists()
    spec = SPECS[name]
    for shape in spec.shapes("cpu"):
        dims = {k: v for k, v in shape.items() if k != "dtype"}
        inputs = spec.make_inputs(dims, torch.float32, "cpu", torch.Generator().manual_seed(0), "normal")
        scalars = spec.draw_scalars(__import__("random").Random(0), dims)
        args = [inputs[n] if n in inputs else scalars.get(n, 1.0) for n in spec.arg_names]
        assert spec.call_shape(args) == dims, (name, shape)


def test_the_cli_help_names_every_spec():
    from daemon.commands.kernels import KERNEL_HELP
    listed = {n.strip() for n in KERNEL_HELP.split(":", 1)[1].split(",")}
    assert listed == set(SPECS)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_timed_inputs_keep_shapes_and_dtypes_and_decode_attention_is_timed_at_full_length(name):
    """Timed calls (candidate and stock) get the work the spec's bytes() counts: every decode
    sequence at the full cache length (the checked calls draw lengths at random)."""
    spec = SPECS[name]
    shape = dict(spec.shapes("cpu")[1])
    shape.pop("dtype", None)
    g = torch.Generator().manual_seed(3)
    drawn = spec.make_inputs(shape, torch.float32, "cpu", g, spec.distributions[0])
    before = {k: (v.shape, v.dtype) for k, v in drawn.items() if isinstance(v, torch.Tensor)}
    timed = spec.timed_inputs(drawn)
    assert {k: (v.shape, v.dtype) for k, v in timed.items() if isinstance(v, torch.Tensor)} == before
    if name == "decode_attention":
        assert bool((timed["seq_lens"] == shape["S"]).all())
