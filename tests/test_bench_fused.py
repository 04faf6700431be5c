"""The built-in decoder's fused decode step (issue 13): rmsnorm_linear (norm + qkv, final norm +
lm_head), linear_residual (o, down + the residual add) and rmsnorm_gate_up_swiglu wherever
TunedOps routes them, exactly the unfused step everywhere else."""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from daemon.bench.model import PRESETS, Model
from daemon.bench.ops import (FUSED, ROUTED, SHAPE_OF, StockOps, TunedOps, cache_len, describe_fusions,
                              describe_kernels, fused_points, kernels_per_layer, layer_calls, step_calls)
from kernelsearch.specs import SPECS
from tests.conftest import ROOT
from tests.test_bench import RecordingTable

CFG, B, CTX = PRESETS["tiny"], 2, 16
S = cache_len(CTX)
H, D = CFG.hidden, CFG.head_dim
# The fused calls of the tiny model at batch 2, by fusion point (shapes as the dispatch table keys them)
SHAPES = {"qkv_rope": ("rmsnorm_qkv_rope", {"B": B, "K": H, "Hq": CFG.heads, "Hkv": CFG.kv_heads, "D": D, "S": S}),
          "qkv": ("rmsnorm_linear", {"M": B, "K": H, "N": CFG.qkv_heads * D}),
          "attention": ("rope_kv_attention", {"B": B, "Hq": CFG.heads, "Hkv": CFG.kv_heads, "D": D, "S": S}),
          "o": ("linear_residual", {"M": B, "K": CFG.heads * D, "N": H}),
          "gate_up": ("rmsnorm_gate_up_swiglu", {"M": B, "K": H, "I": CFG.ffn}),
          "down": ("linear_residual", {"M": B, "K": CFG.ffn, "N": H}),
          "head": ("rmsnorm_linear", {"M": B, "K": H, "N": CFG.vocab})}


def stock_through(kernel):
    """The table's call for `kernel` as the spec's own stock (what dispatch runs for stock)."""
    spec = SPECS[kernel]

    def call(*args):
        out = spec.stock_call(dict(zip(spec.arg_names, args)))
        result = tuple(out[n] for n in spec.out_names)
        return result[0] if len(result) == 1 else result
    return call


class ShapeTable(RecordingTable):
    """RecordingTable with entries only at the given (kernel, shape)s: a fused kernel routed at
    one fusion point and not at another of the same kernel (o vs down, qkv vs lm_head)."""

    def __init__(self, points):
        super().__init__({kernel: stock_through(kernel) for kernel, _ in (SHAPES[p] for p in points)})
        self.only = [SHAPES[p] for p in points]

    def _has(self, kernel, shape):
        return any(k == kernel and s == dict(shape) for k, s in self.only)

    def lookup(self, kernel, shape, dtype):
        entry = super().lookup(kernel, shape, dtype)
        return entry if self._has(kernel, shape) else None

    def route(self, kernel, *args):
        if self._has(kernel, SHAPE_OF[kernel](args)):
            return super().route(kernel, *args)
        return None, None, "no entry for shape"


class RecordingOps(TunedOps):
    """TunedOps that records every op the model calls, in order, by method name."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.sequence = []


def _recording(name):
    def method(self, *args, **kw):
        self.sequence.append(name)
        return getattr(TunedOps, name)(self, *args, **kw)
    return method


for _name in ("rmsnorm", "add_rmsnorm", "linear", "silu_mul", "residual_add", "rope_kv_write",
              "decode_attention", "rmsnorm_linear", "rmsnorm_gate_up_swiglu", "linear_residual",
              "rope_kv_attention", "rmsnorm_qkv_rope"):
    setattr(RecordingOps, _name, _recording(_name))


def _step(ops, head=True, around=None):
    """(model, out, kv) of one decode step with `ops` (inside the context manager `around`, if
    given), and (out, kv) of the same with StockOps."""
    model = Model(CFG, device="cpu", dtype=torch.float32)
    model.allocate_cache(B, S)
    model.fill_cache_random()
    tokens, positions = torch.tensor([3, 5]), torch.tensor([CTX, 7])
    before = model.kv.clone()
    want = model.decode_step(tokens, positions, StockOps(), head=head)
    kv_want = model.kv.clone()
    model.kv.copy_(before)
    with around or contextlib.nullcontext():
        got = model.decode_step(tokens, positions, ops, head=head)
    return model, (got, model.kv.clone()), (want, kv_want)


# Today's (issue 12's) step: per layer, then the head.
OLD_LAYER = ["linear", "rope_kv_write", "decode_attention", "linear", "add_rmsnorm", "linear", "silu_mul",
             "linear"]
OLD_STEP = ["rmsnorm"] + OLD_LAYER + ["add_rmsnorm"] + OLD_LAYER + ["add_rmsnorm", "linear"]
FUSED_LAYER = ["rmsnorm_linear", "rope_kv_attention", "linear_residual", "rmsnorm_gate_up_swiglu",
               "linear_residual"]


def test_with_no_fused_entry_the_step_is_exactly_the_previous_sequence_and_stock_bitwise():
    # every unfused kernel routed (through its stock), no fused entry: nothing fuses
    unfused = {k: stock_through(k) for k in ("rmsnorm", "add_rmsnorm", "linear", "swiglu")}
    for ops in (RecordingOps(RecordingTable(unfused), "test"), RecordingOps(RecordingTable(), "test"),
                RecordingOps(None, "no table")):
        _, (got, kv), (want, kv_want) = _step(ops)
        assert ops.sequence == OLD_STEP, ops.sequence
        assert torch.equal(got, want) and torch.equal(kv, kv_want)
        assert fused_points(ops, CFG, B, "float32", S) == frozenset()
    # StockOps never fuses, whatever a table holds
    stock = StockOps()
    assert not any(stock.fuses(k) for k in FUSED)


def test_tuned_unfused_ignores_the_fused_entries_and_runs_the_previous_step():
    table = ShapeTable(list(SHAPES))
    ops = RecordingOps(table, "test", fused=False)
    _, (got, _), (want, _) = _step(ops)
    assert ops.sequence == OLD_STEP and ops.name == "tuned-unfused"
    assert not {k for k, _, _ in table.lookups} & set(FUSED) and not table.calls
    assert torch.equal(got, want)
    assert all(w == "unfused (fused kernels off in this variant)"
               for w in describe_fusions(ops, CFG, B, "float32", S).values())


# every fusion point but qkv_rope (which, routed, takes the qkv and attention points' place)
POINTS = [p for p in SHAPES if p != "qkv_rope"]


def test_every_fused_kernel_routed_gives_stocks_logits_with_the_fused_sequence():
    table = ShapeTable(POINTS)
    ops = RecordingOps(table, "test")
    model, (got, kv), (want, kv_want) = _step(ops)
    assert ops.sequence == FUSED_LAYER * CFG.layers + ["rmsnorm_linear"], ops.sequence
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kv, kv_want, rtol=1e-5, atol=1e-5)
    # the table got the contracts' arguments: the stream, the norm weight, [N, K] weights
    calls = [(k, a) for k, a in table.calls if k in FUSED]
    x, norm_w, w, eps = calls[0][1]
    assert calls[0][0] == "rmsnorm_linear" and x.shape == (B, H) and norm_w is model.layers[0]["attn_norm"]
    assert w is model.layers[0]["w_qkv"] and w.shape == (CFG.qkv_heads * D, H) and eps == CFG.eps
    qkv, cos, sin, positions, k_cache, v_cache, scale = calls[1][1]
    assert calls[1][0] == "rope_kv_attention" and qkv.shape == (B, CFG.qkv_heads, D) and scale == model.scale
    assert cos.shape == sin.shape == (B, D) and positions.tolist() == [CTX, 7]
    assert k_cache.data_ptr() == model.kv[0, 0].data_ptr() and v_cache.data_ptr() == model.kv[0, 1].data_ptr()
    x, w, residual = calls[2][1]
    assert calls[2][0] == "linear_residual" and w is model.layers[0]["w_o"] and residual.shape == (B, H)
    assert calls[-1][0] == "rmsnorm_linear" and calls[-1][1][2] is model.lm_head
    assert fused_points(ops, CFG, B, "float32", S) == frozenset(POINTS)
    used = describe_kernels(ops, CFG, B, S, "float32")
    assert [label for label in used] == ["rmsnorm_linear qkv", "rope + kv write + attention",
                                         "linear_residual o", "rmsnorm_gate_up_swiglu", "linear_residual down",
                                         "rmsnorm_linear lm_head"]
    assert used["rmsnorm_gate_up_swiglu"]["impl"].startswith("tuned test.rmsnorm_gate_up_swiglu")
    counts = kernels_per_layer(ops, CFG, B, S, "float32")
    # five fused kernels (a test entry launches once), against stock's 16
    assert counts["total"] == 5 and kernels_per_layer(StockOps(), CFG, B, S, "float32")["total"] == 16
    # the no-head step ends with the whole residual stream (nothing pending to add)
    ops = RecordingOps(ShapeTable(POINTS), "test")
    _, (got, _), (want, _) = _step(ops, head=False)
    assert ops.sequence == FUSED_LAYER * CFG.layers
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# (fused points, expected sequence): the residual is summed where a fused norm needs it
# (residual_add) or by add_rmsnorm, and a norm of an already-summed stream is a plain rmsnorm.
MIXED = {
    "o": ["rmsnorm", "linear", "rope_kv_write", "decode_attention", "linear_residual", "rmsnorm", "linear",
          "silu_mul", "linear",
          "add_rmsnorm", "linear", "rope_kv_write", "decode_attention", "linear_residual", "rmsnorm", "linear",
          "silu_mul", "linear", "add_rmsnorm", "linear"],
    "gate_up": ["rmsnorm", "linear", "rope_kv_write", "decode_attention", "linear", "residual_add",
                "rmsnorm_gate_up_swiglu", "linear",
                "add_rmsnorm", "linear", "rope_kv_write", "decode_attention", "linear", "residual_add",
                "rmsnorm_gate_up_swiglu", "linear", "add_rmsnorm", "linear"],
    "qkv": ["rmsnorm_linear", "rope_kv_write", "decode_attention", "linear", "add_rmsnorm", "linear", "silu_mul",
            "linear",
            "residual_add", "rmsnorm_linear", "rope_kv_write", "decode_attention", "linear", "add_rmsnorm",
            "linear", "silu_mul", "linear", "add_rmsnorm", "linear"],
    "down": ["rmsnorm", "linear", "rope_kv_write", "decode_attention", "linear", "add_rmsnorm", "linear",
             "silu_mul", "linear_residual",
             "rmsnorm", "linear", "rope_kv_write", "decode_attention", "linear", "add_rmsnorm", "linear",
             "silu_mul", "linear_residual", "rmsnorm", "linear"],
    "head": OLD_STEP[:-2] + ["residual_add", "rmsnorm_linear"],
    "attention": ["rmsnorm", "linear", "rope_kv_attention", "linear", "add_rmsnorm", "linear", "silu_mul",
                  "linear", "add_rmsnorm", "linear", "rope_kv_attention", "linear", "add_rmsnorm", "linear",
                  "silu_mul", "linear", "add_rmsnorm", "linear"],
    "o,down": ["rmsnorm", "linear", "rope_kv_write", "decode_attention", "linear_residual", "rmsnorm", "linear",
               "silu_mul", "linear_residual"] * 2 + ["rmsnorm", "linear"],
    "qkv,down,head": (["rmsnorm_linear", "rope_kv_write", "decode_attention", "linear", "add_rmsnorm", "linear",
                       "silu_mul", "linear_residual"] * 2 + ["rmsnorm_linear"]),
    "qkv_rope": ["rmsnorm_qkv_rope", "decode_attention", "linear", "add_rmsnorm", "linear", "silu_mul", "linear",
                 "residual_add", "rmsnorm_qkv_rope", "decode_attention", "linear", "add_rmsnorm", "linear",
                 "silu_mul", "linear", "add_rmsnorm", "linear"],
    # qkv_rope is asked first: where it runs, the qkv and attention entries are not used
    "qkv_rope,qkv,attention,o,gate_up,down": (["rmsnorm_qkv_rope", "decode_attention", "linear_residual",
                                               "rmsnorm_gate_up_swiglu", "linear_residual"] * 2
                                              + ["rmsnorm", "linear"]),
    "gate_up,down,head": (["rmsnorm", "linear", "rope_kv_write", "decode_attention", "linear", "residual_add",
                           "rmsnorm_gate_up_swiglu", "linear_residual"] * 2 + ["rmsnorm_linear"]),
}


@pytest.mark.parametrize("points", list(MIXED))
def test_mixed_fusions_give_stocks_logits_and_the_description_matches_what_ran(points):
    points = points.split(",")
    ops = RecordingOps(ShapeTable(points), "test")
    _, (got, kv), (want, kv_want) = _step(ops)
    assert ops.sequence == MIXED[",".join(points)], ops.sequence
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kv, kv_want, rtol=1e-5, atol=1e-5)
    fused = fused_points(ops, CFG, B, "float32", S)
    covered = {"qkv", "attention"} if "qkv_rope" in points else set()   # rmsnorm_qkv_rope's place
    ran = set(points) - covered
    assert fused == frozenset(ran)
    # layer_calls / step_calls describe exactly the calls that ran: the last layer, then the head
    method = {**ROUTED, None: "residual_add"}
    steps, layer = step_calls(CFG, B, S, fused), [method[k] for _, k, _ in layer_calls(CFG, B, S, fused)]
    n_head = len(steps) - len(layer) - (0 if {"qkv", "qkv_rope"} & fused else 1)
    assert ops.sequence[-n_head - len(layer):-n_head] == layer
    assert ops.sequence[-n_head:] == [method[k] for _, k, _ in steps[-n_head:]]
    counts = kernels_per_layer(ops, CFG, B, S, "float32")
    stock_counts = {"rmsnorm": 1, "add_rmsnorm": 2, "linear": 1, "rope_kv_write": 4, "decode_attention": 2,
                    "silu_mul": 2, "residual_add": 1}
    assert counts["total"] == sum(stock_counts.get(m, 1) for m in layer)  # a tuned (test) entry: 1 launch
    whys = describe_fusions(ops, CFG, B, "float32", S)
    assert {p for p, w in whys.items() if w.startswith("fused")} == ran
    assert all(w.startswith("in rmsnorm_qkv_rope") for p, w in whys.items() if p in covered), whys
    assert all("no table entry" in w for p, w in whys.items() if p not in ran | covered), whys


@pytest.mark.parametrize("points", [POINTS, list(SHAPES)], ids=["without_qkv_rope", "with_qkv_rope"])
def test_the_fused_kernels_get_the_layout_their_specs_verify(points):
    """Contiguous [M, K] streams, [N, K] weights, contiguous residuals: what TunedKernel.accepts
    requires (a strided view would silently fall back to stock at every call)."""
    table = ShapeTable(points)
    _step(TunedOps(table, "test"))
    # with qkv_rope, rope_kv_attention is never called (rmsnorm_linear still is, at the head)
    assert {k for k, _ in table.calls} == {SHAPES[p][0] for p in points} - (
        {"rope_kv_attention"} if "qkv_rope" in points else set())
    for kernel, args in table.calls:
        if kernel in FUSED:
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            assert all(t.is_contiguous() for t in tensors), kernel
            spec = SPECS[kernel]
            shape = spec.call_shape(args)
            meta = spec.input_meta(shape, "float32")
            for name, value in zip(spec.arg_names, args):
                if name in meta:
                    assert tuple(value.shape) == tuple(meta[name][0]), (kernel, name)


# ---- the real fused templates, verified by the harness, on the interpreter ------------------
FUSED_CHILD = textwrap.dedent('''
    import json, sys
    import torch
    from daemon.bench.model import PRESETS, Model
    from daemon.bench.ops import StockOps, TunedOps, cache_len, describe_kernels, fused_points, kernels_per_layer
    from kernelsearch.dispatch import DispatchTable
    from kernelsearch.kernels import load_template
    from tests.tuned_tables import verified_table

    cfg, B, CTX = PRESETS["tiny"], 2, 16
    S = cache_len(CTX)
    h, d = cfg.hidden, cfg.head_dim
    shapes = {"rmsnorm_linear": [{"M": B, "K": h, "N": cfg.qkv_heads * d}, {"M": B, "K": h, "N": cfg.vocab}],
              "linear_residual": [{"M": B, "K": cfg.heads * d, "N": h}, {"M": B, "K": cfg.ffn, "N": h}],
              "rmsnorm_gate_up_swiglu": [{"M": B, "K": h, "I": cfg.ffn}],
              "rope_kv_attention": [{"B": B, "Hq": cfg.heads, "Hkv": cfg.kv_heads, "D": d, "S": S}],
              "rmsnorm_qkv_rope": [{"B": B, "K": h, "Hq": cfg.heads, "Hkv": cfg.kv_heads, "D": d, "S": S}]}
    kernels = sys.argv[1].split(",")
    entries = []
    for kernel in kernels:
        params = dict(load_template(kernel).CONFIGS[0])  # the first config the grid walks (batch 1-8)
        entries += [(kernel, s, "float32", params) for s in shapes[kernel]]
    verified = verified_table(entries)  # each entry through the harness once; subsets reuse them
    model = Model(cfg, device="cpu", dtype=torch.float32)
    model.allocate_cache(B, S)
    model.fill_cache_random()
    tokens, positions = torch.tensor([3, 5]), torch.tensor([CTX, 7])
    before = model.kv.clone()
    want = model.decode_step(tokens, positions, StockOps())
    kv_want = model.kv.clone()
    out = {}
    for subset in [[k] for k in kernels] + ([kernels] if len(kernels) > 1 else []):
        table = DispatchTable(verified.to_json())
        table.entries = [e for e in table.entries if e.kernel in subset]
        model.kv.copy_(before)
        ops = TunedOps(table, "verified")
        got = model.decode_step(tokens, positions, ops)
        used = describe_kernels(ops, cfg, B, S, "float32")
        out[",".join(subset)] = {
            "rel": float((got - want).norm() / want.norm()), "kv_err": float((model.kv - kv_want).abs().max()),
            "counts": {f"{k}:{r}": n for (k, r), n in table.counts.items()},
            "fused": sorted(fused_points(ops, cfg, B, "float32", S)),
            "impl": {label: u["impl"] for label, u in used.items()},
            "per_layer": kernels_per_layer(ops, cfg, B, S, "float32")}
    print(json.dumps(out))
''')


@pytest.fixture(scope="module")
def real_fused():
    """The fused templates this checkout has, verified by the harness at the tiny model's decode
    shapes (a child with TRITON_INTERPRET=1), and one tuned step per template and with all."""
    from kernelsearch.kernels import TEMPLATES

    present = [k for k in FUSED if k in TEMPLATES]
    if not present:
        return {}
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", FUSED_CHILD, ",".join(present)], cwd=ROOT, env=env, text=True,
                          capture_output=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _report(real_fused, kernels):
    from kernelsearch.kernels import TEMPLATES

    missing = [k for k in kernels if k not in TEMPLATES]
    if missing:
        pytest.skip("no template yet: " + ", ".join(f"kernelsearch/kernels/{k}.py" for k in missing))
    return real_fused[",".join(kernels)] if len(kernels) == 1 else real_fused[",".join(k for k in FUSED)]


POINTS_OF = {"rmsnorm_linear": ["head", "qkv"], "linear_residual": ["down", "o"],
             "rmsnorm_gate_up_swiglu": ["gate_up"], "rope_kv_attention": ["attention"],
             "rmsnorm_qkv_rope": ["qkv_rope"]}


@pytest.mark.parametrize("kernel", FUSED)
def test_the_tuned_route_of_a_real_fused_template_gives_stocks_logits_on_the_interpreter(real_fused, kernel):
    report = _report(real_fused, [kernel])
    assert report["rel"] < 1e-4 and report["kv_err"] < 1e-5, report
    assert report["fused"] == POINTS_OF[kernel]
    calls = {"rmsnorm_linear": CFG.layers + 1, "linear_residual": 2 * CFG.layers, "rmsnorm_gate_up_swiglu": CFG.layers,
             "rope_kv_attention": CFG.layers, "rmsnorm_qkv_rope": CFG.layers}
    assert report["counts"] == {f"{kernel}:tuned": calls[kernel]}, report["counts"]
    assert any(impl.startswith(f"tuned kernelsearch.kernels.{kernel} ") for impl in report["impl"].values())


def test_the_step_with_every_real_fused_template_gives_stocks_logits_on_the_interpreter(real_fused):
    report = _report(real_fused, list(FUSED))
    assert report["rel"] < 1e-4 and report["kv_err"] < 1e-5, report
    # rmsnorm_qkv_rope is asked first: the qkv and attention points' entries are not used
    assert report["fused"] == sorted(set(SHAPES) - {"qkv", "attention"})
    assert report["counts"] == {"rmsnorm_linear:tuned": 1, "linear_residual:tuned": 2 * CFG.layers,
                                "rmsnorm_gate_up_swiglu:tuned": CFG.layers, "rmsnorm_qkv_rope:tuned": CFG.layers}
    assert set(report["impl"]) == {"rmsnorm + qkv + rope + kv write", "decode_attention", "linear_residual o",
                                   "rmsnorm_gate_up_swiglu", "linear_residual down", "rmsnorm_linear lm_head"}
    per_layer = report["per_layer"]
    assert per_layer["total"] == sum(v for k, v in per_layer.items() if k != "total")
    assert per_layer["total"] < 16  # fewer launches than the stock layer's 16 at batch 2


def test_the_fused_steps_lengths_are_one_op_made_before_the_first_fused_projection():
    """positions + 1 as int32 is one op (the add casts into its output; `.to(int32)` after it was
    a second launch in the captured step), and at layer 0 it runs before rmsnorm_qkv_rope, so no
    torch kernel sits between that PDL-launched kernel and the attention after it."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Log(TorchDispatchMode):  # int32 results of ops that compute (not allocations, not views)
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if (isinstance(out, torch.Tensor) and out.dtype == torch.int32 and not func.is_view
                    and func is not torch.ops.aten.empty_like.default):
                ops.sequence.append(f"int32 {func}")
            return out

    ops = RecordingOps(ShapeTable(list(SHAPES)), "test")
    _, (got, _), (want, _) = _step(ops, head=False, around=Log())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    made = [s for s in ops.sequence if s.startswith("int32")]
    assert made == ["int32 aten.add.out"], ops.sequence      # once a step, in one op
    assert ops.sequence.index(made[0]) < ops.sequence.index("rmsnorm_qkv_rope"), ops.sequence
