"""hwtune's torch custom ops: fake implementations that trace, stock results without a table,
and a tuned entry's verified plan where the table has the call's shape.

The tuned path runs real Triton kernels under the interpreter, in a child process
(TRITON_INTERPRET must be set before triton is imported).
"""
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from kernelsearch import dispatch, ops  # noqa: F401  (registers torch.ops.hwtune.*)

from conftest import ROOT


def _cases():
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)
    return {
        "rms_norm": (r(2, 3, 64), r(64), 1e-6),
        "add_rms_norm": (r(2, 3, 64), r(2, 3, 64), r(64), 1e-5),
        "linear": (r(2, 3, 64), r(48, 64)),
        "swiglu": (r(2, 3, 64),),
        # prefill layout [B, T, H, D] with cos/sin broadcast over the batch (position_ids [1, T])
        "rope": (r(2, 3, 4, 16), r(2, 3, 2, 16), r(1, 3, 16), r(1, 3, 16)),
        "decode_attention": (r(2, 4, 16), r(2, 2, 10, 16), r(2, 2, 10, 16),
                             torch.tensor([3, 10], dtype=torch.int32), 0.25),
        # qkv [B, Hq + 2 Hkv, D], cos/sin [B, D], positions, caches [B, Hkv, S, D]
        "rope_kv_write": (r(2, 8, 16), r(2, 16), r(2, 16), torch.tensor([7, 2]), r(2, 2, 10, 16),
                          r(2, 2, 10, 16)),
        # the same, then attention over slots 0..positions[b]
        "rope_kv_attention": (r(2, 8, 16), r(2, 16), r(2, 16), torch.tensor([7, 2]), r(2, 2, 10, 16),
                              r(2, 2, 10, 16), 0.25),
        # the fused decode kernels: x [..., K], norm_weight [K], weight [N, K] (gate|up: [2I, K])
        "rms_norm_linear": (r(2, 3, 64), r(64), r(40, 64), 1e-5),
        "rms_norm_gate_up_swiglu": (r(2, 3, 64), r(64), r(48, 64), 1e-6),
        "linear_residual": (r(2, 3, 64), r(40, 64), r(2, 3, 40)),
        # x [B, K], norm_weight [K], weight [(Hq + 2 Hkv) D, K], eps, then rope_kv_write's cos, sin,
        # positions and caches (Hq 4, Hkv 2, D 16)
        "rms_norm_qkv_rope": (r(2, 64), r(64), r(128, 64), 1e-5, r(2, 16), r(2, 16), torch.tensor([7, 2]),
                              r(2, 2, 10, 16), r(2, 2, 10, 16)),
    }


def _stock(name, args):
    """What a user runs instead of each op."""
    if name == "rms_norm":
        x, w, eps = args
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    if name == "add_rms_norm":
        x, res, w, eps = args
        s = x + res
        return F.rms_norm(s, (s.shape[-1],), w, eps), s
    if name == "linear":
        return F.linear(*args)
    if name == "swiglu":
        g, u = args[0].chunk(2, dim=-1)
        return F.silu(g) * u
    if name == "rope":
        q, k, cos, sin = args
        rot = lambda x: torch.cat((-x[..., x.shape[-1] // 2:], x[..., :x.shape[-1] // 2]), -1)
        c, s = cos.unsqueeze(2), sin.unsqueeze(2)
        return q * c + rot(q) * s, k * c + rot(k) * s
    if name == "rms_norm_linear":
        x, nw, w, eps = args
        return F.linear(F.rms_norm(x, (x.shape[-1],), nw, eps), w)
    if name == "rms_norm_gate_up_swiglu":
        x, nw, w, eps = args
        g, u = F.linear(F.rms_norm(x, (x.shape[-1],), nw, eps), w).chunk(2, dim=-1)
        return F.silu(g) * u
    if name == "linear_residual":
        x, w, res = args
        return res + F.linear(x, w)
    if name == "rms_norm_qkv_rope":   # the norm, the q|k|v projection, then rope_kv_write's stock
        x, nw, w, eps, cos, sin, pos, kc, vc = args
        qkv = F.linear(F.rms_norm(x, (x.shape[-1],), nw, eps), w).view(x.shape[0], -1, kc.shape[3])
        return _stock("rope_kv_write", (qkv, cos, sin, pos, kc, vc))
    if name == "rope_kv_attention":   # rope_kv_write's stock, then SDPA over slots 0..positions[b]
        qkv, cos, sin, pos, kc, vc, scale = args
        q = _stock("rope_kv_write", args[:6])
        return _stock("decode_attention", (q, kc, vc, pos + 1, scale))
    if name == "rope_kv_write":   # apply_rotary_pos_emb, then StaticCache's index_copy_ per row
        qkv, cos, sin, pos, kc, vc = args
        rot = lambda x: torch.cat((-x[..., x.shape[-1] // 2:], x[..., :x.shape[-1] // 2]), -1)
        c, s = cos.unsqueeze(1), sin.unsqueeze(1)
        q, k, v = qkv[:, :4], qkv[:, 4:6], qkv[:, 6:]
        for b in range(qkv.shape[0]):
            kc[b].index_copy_(1, pos[b:b + 1], (k * c + rot(k) * s)[b].unsqueeze(1))
            vc[b].index_copy_(1, pos[b:b + 1], v[b].unsqueeze(1))
        return q * c + rot(q) * s
    q, k, v, lens, scale = args
    mask = (torch.arange(k.shape[2])[None, :] < lens[:, None])[:, None, None, :]
    out = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask, scale=scale,
                                         enable_gqa=True)
    return out.squeeze(2)


@pytest.mark.parametrize("name", sorted(ops.OPS))
def test_op_passes_torch_library_opcheck_schema_fake_and_aot_dispatch(name):
    result = torch.library.opcheck(getattr(torch.ops.hwtune, name), _cases()[name])
    assert set(result.values()) == {"SUCCESS"}, result


@pytest.mark.parametrize("name", sorted(ops.OPS))
def test_op_without_a_table_returns_exactly_what_the_stock_call_returns(name):
    assert dispatch.current() is None
    args = _cases()[name]
    got = getattr(torch.ops.hwtune, name)(*args)
    want = _stock(name, args)
    got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.is_contiguous()
        assert torch.equal(g, w)


def test_rope_kv_write_writes_each_rows_slot_of_the_callers_caches_in_place_and_nothing_else():
    args = _cases()["rope_kv_write"]
    before = [t.clone() for t in args[4:]]
    want = _cases()["rope_kv_write"]
    _stock("rope_kv_write", want)
    torch.ops.hwtune.rope_kv_write(*args)
    for got, expect, old in zip(args[4:], want[4:], before):
        assert torch.equal(got, expect)
        changed = (got != old).any(-1)                       # [B, Hkv, S]
        assert changed.sum() == 2 * 2 and changed[0, :, 7].all() and changed[1, :, 2].all()
    # cos/sin of batch 1 broadcast over the batch, as the model's rotary embedding gives them
    qkv, cos, sin, pos, kc, vc = _cases()["rope_kv_write"]
    one = torch.ops.hwtune.rope_kv_write(qkv, cos[:1], sin[:1], pos, kc, vc)
    assert torch.equal(one, torch.ops.hwtune.rope_kv_write(qkv, cos[:1].expand(2, 16), sin[:1].expand(2, 16),
                                                           pos, kc.clone(), vc.clone()))
    with pytest.raises(ValueError, match="contiguous"):
        strided = torch.randn(2, 10, 2, 16).transpose(1, 2)   # [B, Hkv, S, D], not contiguous
        torch.ops.hwtune.rope_kv_write(qkv, cos, sin, pos, strided, strided)


def test_ops_trace_under_torch_compile_fullgraph_as_one_node_each():
    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    cases = _cases()

    def block(x, w, W, gate_up_w, q, k, cos, sin, kc, vc, lens, qkv, cs, sn, pos, qkv_w, kc2, vc2, kc3, vc3,
              kc4, vc4):
        h = torch.ops.hwtune.rms_norm(x, w, 1e-6)
        h, res = torch.ops.hwtune.add_rms_norm(h, x, w, 1e-6)
        y = torch.ops.hwtune.swiglu(torch.ops.hwtune.linear(h, gate_up_w))
        y = torch.ops.hwtune.linear(y, W)
        q2, k2 = torch.ops.hwtune.rope(q, k, cos, sin)
        a = torch.ops.hwtune.decode_attention(q2[:, 0], kc, vc, lens, 0.25)
        q3 = torch.ops.hwtune.rope_kv_write(qkv, cs, sn, pos, kc2, vc2)
        a3 = torch.ops.hwtune.rope_kv_attention(qkv, cs, sn, pos, kc3, vc3, 0.25)
        # a decoder layer's fused path: norm + projection, residual epilogue, norm + gate|up + SwiGLU
        z = torch.ops.hwtune.rms_norm_linear(res, w, gate_up_w, 1e-6)
        z = torch.ops.hwtune.linear_residual(z, gate_up_w, res)
        z = torch.ops.hwtune.rms_norm_gate_up_swiglu(z, w, gate_up_w, 1e-6)
        # norm + q|k|v + RoPE + the cache write, on one token per sequence
        q4 = torch.ops.hwtune.rms_norm_qkv_rope(res[:, 0], w, qkv_w, 1e-6, cs, sn, pos, kc4, vc4)
        return y + res[..., :48].sum() + z.sum(), a, q3, a3, q4

    x, w = cases["rms_norm"][:2]
    args = (x, w, torch.randn(48, 32), torch.randn(64, 64), *cases["rope"],
            *cases["decode_attention"][1:4])
    args = list(args)
    args[4] = torch.randn(2, 1, 4, 16)        # q: decode layout [B, 1, H, D]
    args[5] = torch.randn(2, 1, 2, 16)
    args[6] = torch.randn(2, 1, 16)
    args[7] = torch.randn(2, 1, 16)
    caches = cases["rope_kv_write"][4:]
    args += list(cases["rope_kv_write"][:4]) + [torch.randn(128, 64)] + [t.clone() for t in caches * 3]
    kv = lambda a: a[:-6] + [t.clone() for t in a[-6:]]   # each run on its own caches
    compiled = torch.compile(block, fullgraph=True, backend=backend)
    eager_args, compiled_args = kv(args), kv(args)
    for got, want in zip(compiled(*compiled_args), block(*eager_args)):
        assert torch.equal(got, want)
    for op in ops.OPS:
        assert f"hwtune.{op}" in seen, (op, seen)
    aot = torch.compile(block, fullgraph=True, backend="aot_eager")
    aot_args = kv(args)
    for got, want in zip(aot(*aot_args), block(*kv(args))):
        assert torch.equal(got, want)
    # the compiled graphs wrote the caller's caches as eager did (the mutation is not lost)
    for a, b in zip(aot_args[-6:] + compiled_args[-6:], eager_args[-6:] * 2):
        assert torch.equal(a, b)
    assert all(not torch.equal(aot_args[i], args[i]) for i in range(-6, 0))


def test_rms_norm_qkv_rope_fake_gives_q_and_refuses_a_weight_that_is_not_whole_heads():
    from torch._subclasses.fake_tensor import FakeTensorMode

    args = _cases()["rms_norm_qkv_rope"]
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        assert torch.ops.hwtune.rms_norm_qkv_rope(*fake).shape == (2, 4, 16)
    for bad_weight in (torch.randn(120, 64), torch.randn(64, 64)):   # not heads of 16; no q head left
        bad = list(args)
        bad[2] = bad_weight
        with pytest.raises(ValueError, match="hwtune::rms_norm_qkv_rope"):
            torch.ops.hwtune.rms_norm_qkv_rope(*bad)
    bad = list(args)
    bad[7] = torch.randn(2, 10, 2, 16).transpose(1, 2)   # a strided cache: the writes would be lost
    with pytest.raises(ValueError, match="contiguous"):
        torch.ops.hwtune.rms_norm_qkv_rope(*bad)
    for i, t in ((0, torch.randn(2, 1, 64)), (4, torch.randn(3, 16)), (5, torch.randn(2, 8))):
        bad = list(args)   # x with a token axis; cos of 3 rows for 2; sin of another head size
        bad[i] = t
        with pytest.raises(ValueError, match="hwtune::rms_norm_qkv_rope"):
            torch.ops.hwtune.rms_norm_qkv_rope(*bad)
    # cos / sin of one row serve the whole batch (position_ids of batch 1)
    one = list(args[:4]) + [args[4][:1], args[5][:1]] + list(args[6:7]) + [t.clone() for t in args[7:]]
    full = list(args[:4]) + [args[4][:1].expand(2, 16), args[5][:1].expand(2, 16)] + list(args[6:7]) + \
        [t.clone() for t in args[7:]]
    assert torch.equal(torch.ops.hwtune.rms_norm_qkv_rope(*one), torch.ops.hwtune.rms_norm_qkv_rope(*full))


@pytest.mark.parametrize("name", ["rms_norm_linear", "rms_norm_gate_up_swiglu", "linear_residual"])
def test_fused_op_fake_gives_the_output_shape_and_refuses_mismatched_weights(name):
    from torch._subclasses.fake_tensor import FakeTensorMode

    args = _cases()[name]
    want = _stock(name, args).shape
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        assert getattr(torch.ops.hwtune, name)(*fake).shape == want
    bad = list(args)
    bad[1] = torch.randn(40, 63)          # weight [N, K] with K other than x's (norm_weight: [K+1])
    if name != "linear_residual":
        bad[1], bad[2] = torch.randn(65), args[2]
    with pytest.raises(ValueError, match=f"hwtune::{name}"):
        getattr(torch.ops.hwtune, name)(*bad)
    if name == "linear_residual":          # a residual of another shape than the output
        with pytest.raises(ValueError, match="residual"):
            torch.ops.hwtune.linear_residual(args[0], args[1], args[2][..., :39])
    if name == "rms_norm_gate_up_swiglu":  # an odd row count is no gate|up pair
        with pytest.raises(ValueError, match=r"\[2I, K\]"):
            torch.ops.hwtune.rms_norm_gate_up_swiglu(args[0], args[1], args[2][:47], 1e-6)


def test_swiglu_refuses_an_odd_gate_up_width_eager_and_fake():
    """gate and up lie side by side in the last dimension: an odd width was a raw torch shape
    error from inside the stock call."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with pytest.raises(ValueError, match=r"hwtune::swiglu: gate_up\(2, 7\)"):
        torch.ops.hwtune.swiglu(torch.randn(2, 7))
    with FakeTensorMode(), pytest.raises(ValueError, match="hwtune::swiglu"):
        torch.ops.hwtune.swiglu(torch.empty(2, 7))
    assert torch.ops.hwtune.swiglu(torch.randn(2, 8)).shape == (2, 4)


def test_linear_residual_leaves_its_residual_input_unchanged_and_routes_through_the_table():
    x, w, res = _cases()["linear_residual"]
    before = res.clone()
    table = dispatch.DispatchTable.empty()
    out = torch.ops.hwtune.linear_residual(x, w, res, ops.table_handle(table))
    assert torch.equal(res, before) and out.data_ptr() != res.data_ptr()
    assert torch.equal(out, res + F.linear(x, w))
    assert table.counts == {("linear_residual", "stock"): 1}


def test_a_table_handle_routes_through_that_table_and_counts_stock_per_shape():
    table = dispatch.DispatchTable({"format": 1, "fingerprint_id": "another-device", "entries": [
        {"kernel": "linear", "dtype": "float32", "shape": {"M": 6, "K": 64, "N": 48}, "params": {}}]})
    handle = ops.table_handle(table)
    assert ops.table_handle(table) == handle and handle != 0
    x, W = _cases()["linear"]
    assert torch.equal(torch.ops.hwtune.linear(x, W, handle), F.linear(x, W))
    assert table.counts == {("linear", "stock"): 1}   # another device's table: stock
    with pytest.raises(ValueError, match="no table with handle"):
        ops.table_of(10_000)


CHILD = textwrap.dedent('''
    import json, sys
    import torch
    import torch.nn.functional as F
    from kernelsearch import dispatch, ops
    from tests.tuned_tables import verified_table

    B, H, HKV, D, S = 2, 4, 2, 16, 24
    table = verified_table([
        ("rmsnorm", {"M": B, "N": 64}, "float32", {}),
        ("linear", {"M": B, "K": 64, "N": 96}, "float32",
         {"variant": "splitk", "BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 8,
          "SPLIT_K": 2, "FMA": 1, "num_warps": 4, "num_stages": 2, "REDUCE": "last"}),
        ("swiglu", {"M": B, "I": 48}, "float32", {}),
        ("rope", {"B": B, "Hq": H, "Hkv": HKV, "D": D}, "float32", {}),
        ("decode_attention", {"B": B, "Hq": H, "Hkv": HKV, "S": S, "D": D}, "float32",
         {"BLOCK_S": 16, "NUM_SPLITS": 2, "num_warps": 4, "num_stages": 1}),
    ])
    dispatch.use(table)          # handle 0: the process-wide table
    report = {"prepared": table.prepare("cpu")}
    persistent = lambda: {(i, k): id(t) for i, tk in enumerate(table._launch.values()) if tk is not None
                          for k, t in tk.persistent.items()}
    before = persistent()
    g = torch.Generator().manual_seed(3)
    r = lambda *s: torch.randn(*s, generator=g)
    x, w, W = r(B, 1, 64), r(64), r(96, 64)
    q, k, cos, sin = r(B, 1, H, D), r(B, 1, HKV, D), r(B, 1, D), r(B, 1, D)
    kc, vc, lens = r(B, HKV, S, D), r(B, HKV, S, D), torch.tensor([S, 5], dtype=torch.int32)

    def step(x, w, W, q, k, cos, sin, kc, vc, lens):
        h = torch.ops.hwtune.rms_norm(x, w, 1e-6)
        y = torch.ops.hwtune.swiglu(torch.ops.hwtune.linear(h, W))
        q2, k2 = torch.ops.hwtune.rope(q, k, cos, sin)
        a = torch.ops.hwtune.decode_attention(q2[:, 0], kc, vc, lens, D ** -0.5)
        return y, q2, k2, a

    def stock(x, w, W, q, k, cos, sin, kc, vc, lens):
        h = F.rms_norm(x, (64,), w, 1e-6)
        gu = F.linear(h, W)
        y = F.silu(gu[..., :48]) * gu[..., 48:]
        rot = lambda t: torch.cat((-t[..., D // 2:], t[..., :D // 2]), -1)
        c, s = cos[:, :, None], sin[:, :, None]
        q2, k2 = q * c + rot(q) * s, k * c + rot(k) * s
        mask = (torch.arange(S)[None, :] < lens[:, None])[:, None, None, :]
        a = F.scaled_dot_product_attention(q2[:, 0].unsqueeze(2), kc, vc, attn_mask=mask,
                                           scale=D ** -0.5, enable_gqa=True).squeeze(2)
        return y, q2, k2, a

    args = (x, w, W, q, k, cos, sin, kc, vc, lens)
    want = stock(*args)
    eager = step(*args)
    report["eager_counts"] = {f"{k}:{r}": n for (k, r), n in table.counts.items()}
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(*args)
    report["err"] = [max(float((a - b).abs().max()) for a, b in zip(got, want))
                     for got in (eager, compiled)]
    # the split-K counters were allocated by prepare(), before any call, and never again
    report["persistent"] = [len(before), before == persistent()]
    table.counts.clear()
    # another batch size: no entry, stock
    x3 = r(3, 1, 64)
    out = torch.ops.hwtune.linear(torch.ops.hwtune.rms_norm(x3, w, 1e-6), W)
    report["err_other"] = float((out - F.linear(F.rms_norm(x3, (64,), w, 1e-6), W)).abs().max())
    report["other_counts"] = {f"{k}:{r}": n for (k, r), n in table.counts.items()}
    print(json.dumps(report))
''')


def test_tuned_entries_run_their_verified_plans_eager_and_compiled_and_other_shapes_go_stock():
    env = {"TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT), "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
           "HOME": os.environ.get("HOME", "/root")}
    proc = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, text=True, capture_output=True,
                          timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["eager_counts"] == {f"{k}:tuned": 1 for k in
                                      ("rmsnorm", "linear", "swiglu", "rope", "decode_attention")}
    assert max(report["err"]) < 1e-4
    assert report["prepared"] == 5 and report["persistent"] == [1, True]
    assert report["other_counts"] == {"rmsnorm:stock": 1, "linear:stock": 1}
    assert report["err_other"] == 0.0
