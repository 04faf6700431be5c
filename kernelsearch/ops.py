"""hwtune's kernels as torch custom ops (namespace `hwtune`), routed per shape by a dispatch table.

    torch.ops.hwtune.rms_norm(x, weight, eps)                 x [..., N]
    torch.ops.hwtune.add_rms_norm(x, residual, weight, eps)   -> (out, residual_out)
    torch.ops.hwtune.linear(x, weight)                        x [..., K], weight [N, K]
    torch.ops.hwtune.swiglu(gate_up)                          gate_up [..., 2I] -> [..., I]
    torch.ops.hwtune.rope(q, k, cos, sin)                     q [..., Hq, D], k [..., Hkv, D],
                                                              cos, sin [..., D] -> (q_out, k_out)
    torch.ops.hwtune.decode_attention(q, k_cache, v_cache, seq_lens, scale)
                                                              q [B, Hq, D], caches [B, Hkv, S, D]
    torch.ops.hwtune.rope_kv_write(qkv, cos, sin, positions, k_cache, v_cache) -> q_out
                                                              qkv [B, Hq + 2 Hkv, D], cos, sin [B, D]
                                                              (or [1, D]), positions int64 [B],
                                                              caches [B, Hkv, S, D] contiguous,
                                                              written in place (mutates_args)
    torch.ops.hwtune.rope_kv_attention(qkv, cos, sin, positions, k_cache, v_cache, scale) -> out
                                                              rope_kv_write, then decode_attention of
                                                              its q with seq_lens = positions + 1
                                                              -> [B, Hq, D] (caches written in place)
    torch.ops.hwtune.rms_norm_linear(x, norm_weight, weight, eps)
                                                              x [..., K], norm_weight [K], weight [N, K]
                                                              -> rms_norm(x) @ weight.T [..., N]
    torch.ops.hwtune.rms_norm_qkv_rope(x, norm_weight, weight, eps, cos, sin, positions, k_cache,
                                      v_cache) -> q_out
                                                              rms_norm_linear into q|k|v, then
                                                              rope_kv_write: x [B, K], weight
                                                              [(Hq + 2 Hkv) D, K] -> [B, Hq, D]
                                                              (caches written in place)
    torch.ops.hwtune.rms_norm_gate_up_swiglu(x, norm_weight, weight, eps)
                                                              weight [2I, K]: gate rows, then up rows
                                                              -> silu(n @ gate.T) * (n @ up.T) [..., I]
    torch.ops.hwtune.linear_residual(x, weight, residual)     x [..., K], weight [N, K],
                                                              residual [..., N] (not changed)
                                                              -> residual + x @ weight.T [..., N]

Each op has a fake (meta) implementation, so torch.compile(fullgraph=True) traces through it as
one opaque node and CUDA graphs capture whatever it launches. The real implementation flattens
the leading dimensions into the spec's rows, looks the call's shape up in the table and runs
the verified launch plan of a tuned entry there; any other shape (or dtype, device, layout)
runs the spec's `stock_call`, what a user would have run (F.rms_norm, F.linear, SDPA...).

Which table: every op takes a trailing `table` int (default 0). 0 is the table set by
`kernelsearch.dispatch.use(table)` (none set: all stock); another value is a handle from
`table_handle(table)`, which is how `integrations.transformers.patch(model, table=...)` gives a
model its own table without touching the process-wide one. Under CUDA graphs the route is
taken once, at capture.

Inference only: no autograd formula is registered.
"""
from __future__ import annotations

import itertools

import torch

from kernelsearch import dispatch
from kernelsearch.specs import get_spec

_TABLES: dict[int, dispatch.DispatchTable] = {}
_HANDLES = itertools.count(1)


def table_handle(table: dispatch.DispatchTable) -> int:
    """The op argument that selects `table` (the same handle for the same table object)."""
    for handle, known in list(_TABLES.items()):
        if known is table:
            return handle
    handle = next(_HANDLES)
    while handle in _TABLES:   # taken by adopt_table
        handle = next(_HANDLES)
    _TABLES[handle] = table
    return handle


def adopt_table(handle: int, table: dispatch.DispatchTable) -> bool:
    """Make `handle` select `table` in this process (a patched model loaded from a pickle carries
    the handles its modules were given where it was patched). False where the handle already
    selects another table with other contents (that model then routes through that table)."""
    known = _TABLES.setdefault(handle, table)
    return known is table or known.to_json() == table.to_json()


def table_of(handle: int) -> dispatch.DispatchTable | None:
    if handle == 0:
        return dispatch.current()
    try:
        return _TABLES[handle]
    except KeyError:
        raise ValueError(f"hwtune ops: no table with handle {handle} (see ops.table_handle)") from None


def run(kernel: str, handle: int, *args) -> tuple:
    """One call of `kernel` on contract-shaped `args`: tuned where the table has the shape, else
    the spec's stock_call (DispatchTable.call decides and counts). Returns the outputs in the
    spec's order (new tensors)."""
    table = table_of(handle)
    if table is None:
        spec = get_spec(kernel)
        got = spec.stock_call(dict(zip(spec.arg_names, args)))
        outputs = tuple(got[n] for n in spec.out_names)
    else:
        out = table.call(kernel, *args)
        outputs = out if isinstance(out, tuple) else (out,)
    # contiguous, as the fake implementations promise (SDPA may hand back a transposed layout)
    return tuple(o.contiguous() for o in outputs)


def _same_dtype(op: str, *tensors) -> None:
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) != 1:
        raise ValueError(f"hwtune::{op}: tensors must share one dtype, got {sorted(map(str, dtypes))}")


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., N] as a contiguous [M, N] (a view when x is already contiguous)."""
    return x.reshape(-1, x.shape[-1]).contiguous()


# --- rms_norm -------------------------------------------------------------------------------
@torch.library.custom_op("hwtune::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, table: int = 0) -> torch.Tensor:
    _same_dtype("rms_norm", x, weight)
    (out,) = run("rmsnorm", table, _rows(x), weight.contiguous(), float(eps))
    return out.view(x.shape)


@rms_norm.register_fake
def _(x, weight, eps, table=0):
    _same_dtype("rms_norm", x, weight)
    return x.new_empty(x.shape)


# --- add_rms_norm ---------------------------------------------------------------------------
@torch.library.custom_op("hwtune::add_rms_norm", mutates_args=())
def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 table: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    _same_dtype("add_rms_norm", x, residual, weight)
    out, residual_out = run("add_rmsnorm", table, _rows(x), _rows(residual), weight.contiguous(),
                            float(eps))
    return out.view(x.shape), residual_out.view(x.shape)


@add_rms_norm.register_fake
def _(x, residual, weight, eps, table=0):
    _same_dtype("add_rms_norm", x, residual, weight)
    return x.new_empty(x.shape), x.new_empty(x.shape)


# --- linear ---------------------------------------------------------------------------------
@torch.library.custom_op("hwtune::linear", mutates_args=())
def linear(x: torch.Tensor, weight: torch.Tensor, table: int = 0) -> torch.Tensor:
    _same_dtype("linear", x, weight)
    (out,) = run("linear", table, _rows(x), weight.contiguous())
    return out.view(*x.shape[:-1], weight.shape[0])


@linear.register_fake
def _(x, weight, table=0):
    _same_dtype("linear", x, weight)
    torch._check(x.shape[-1] == weight.shape[1])
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


# --- swiglu ---------------------------------------------------------------------------------
def _even_last(op: str, gate_up: torch.Tensor) -> None:
    if gate_up.shape[-1] % 2:
        raise ValueError(f"hwtune::{op}: gate_up{tuple(gate_up.shape)}: its last dimension holds gate and "
                         "up side by side, so it must be even")


@torch.library.custom_op("hwtune::swiglu", mutates_args=())
def swiglu(gate_up: torch.Tensor, table: int = 0) -> torch.Tensor:
    _even_last("swiglu", gate_up)
    (out,) = run("swiglu", table, _rows(gate_up))
    return out.view(*gate_up.shape[:-1], gate_up.shape[-1] // 2)


@swiglu.register_fake
def _(gate_up, table=0):
    _even_last("swiglu", gate_up)
    return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))


# --- rope -----------------------------------------------------------------------------------
@torch.library.custom_op("hwtune::rope", mutates_args=())
def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
         table: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    _same_dtype("rope", q, k, cos, sin)
    lead, d = q.shape[:-2], q.shape[-1]
    # cos/sin may come broadcast over the batch (Hugging Face's position_ids of batch 1)
    cos = cos.expand(*lead, d).reshape(-1, d).contiguous()
    sin = sin.expand(*lead, d).reshape(-1, d).contiguous()
    q_out, k_out = run("rope", table, q.reshape(-1, q.shape[-2], d).contiguous(),
                       k.reshape(-1, k.shape[-2], d).contiguous(), cos, sin)
    return q_out.view(q.shape), k_out.view(k.shape)


@rope.register_fake
def _(q, k, cos, sin, table=0):
    _same_dtype("rope", q, k, cos, sin)
    return q.new_empty(q.shape), k.new_empty(k.shape)


# --- decode_attention -----------------------------------------------------------------------
@torch.library.custom_op("hwtune::decode_attention", mutates_args=())
def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float, table: int = 0) -> torch.Tensor:
    _same_dtype("decode_attention", q, k_cache, v_cache)
    (out,) = run("decode_attention", table, q.contiguous(), k_cache.contiguous(),
                 v_cache.contiguous(), seq_lens.to(torch.int32).contiguous(), float(scale))
    return out


@decode_attention.register_fake
def _(q, k_cache, v_cache, seq_lens, scale, table=0):
    _same_dtype("decode_attention", q, k_cache, v_cache)
    return q.new_empty(q.shape)


# --- rope_kv_write --------------------------------------------------------------------------
def _kv_args(qkv, cos, sin, positions, k_cache, v_cache):
    _same_dtype("rope_kv_write", qkv, cos, sin, k_cache, v_cache)
    b, h_all, d = qkv.shape
    hkv = k_cache.shape[1]
    if k_cache.dim() != 4 or tuple(v_cache.shape) != tuple(k_cache.shape) or k_cache.shape[0] != b or \
            k_cache.shape[3] != d or h_all <= 2 * hkv or positions.shape != (b,):
        raise ValueError(f"hwtune::rope_kv_write: qkv{tuple(qkv.shape)} k_cache{tuple(k_cache.shape)} "
                         f"v_cache{tuple(v_cache.shape)} positions{tuple(positions.shape)}")
    # written in place: a copy would take the writes away from the caller's cache
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("hwtune::rope_kv_write: k_cache and v_cache must be contiguous")
    return h_all - 2 * hkv


@torch.library.custom_op("hwtune::rope_kv_write", mutates_args=("k_cache", "v_cache"))
def rope_kv_write(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, table: int = 0) -> torch.Tensor:
    _kv_args(qkv, cos, sin, positions, k_cache, v_cache)
    b, _, d = qkv.shape
    # cos/sin may come broadcast over the batch (Hugging Face's position_ids of batch 1)
    cos = cos.reshape(-1, d).expand(b, d).contiguous()
    sin = sin.reshape(-1, d).expand(b, d).contiguous()
    (q_out,) = run("rope_kv_write", table, qkv.contiguous(), cos, sin,
                   positions.to(torch.int64).contiguous(), k_cache, v_cache)
    return q_out


@rope_kv_write.register_fake
def _(qkv, cos, sin, positions, k_cache, v_cache, table=0):
    hq = _kv_args(qkv, cos, sin, positions, k_cache, v_cache)
    return qkv.new_empty((qkv.shape[0], hq, qkv.shape[2]))


# --- rope_kv_attention ----------------------------------------------------------------------
@torch.library.custom_op("hwtune::rope_kv_attention", mutates_args=("k_cache", "v_cache"))
def rope_kv_attention(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
                      table: int = 0) -> torch.Tensor:
    _kv_args(qkv, cos, sin, positions, k_cache, v_cache)
    b, _, d = qkv.shape
    cos = cos.reshape(-1, d).expand(b, d).contiguous()
    sin = sin.reshape(-1, d).expand(b, d).contiguous()
    (out,) = run("rope_kv_attention", table, qkv.contiguous(), cos, sin,
                 positions.to(torch.int64).contiguous(), k_cache, v_cache, float(scale))
    return out


@rope_kv_attention.register_fake
def _(qkv, cos, sin, positions, k_cache, v_cache, scale, table=0):
    hq = _kv_args(qkv, cos, sin, positions, k_cache, v_cache)
    return qkv.new_empty((qkv.shape[0], hq, qkv.shape[2]))


# --- rms_norm_linear ------------------------------------------------------------------------
def _norm_linear_args(op, x, norm_weight, weight):
    _same_dtype(op, x, norm_weight, weight)
    if weight.dim() != 2 or norm_weight.shape != (x.shape[-1],) or weight.shape[1] != x.shape[-1]:
        raise ValueError(f"hwtune::{op}: x{tuple(x.shape)} norm_weight{tuple(norm_weight.shape)} "
                         f"weight{tuple(weight.shape)}: expected x [..., K], norm_weight [K], weight [N, K]")


@torch.library.custom_op("hwtune::rms_norm_linear", mutates_args=())
def rms_norm_linear(x: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor, eps: float,
                    table: int = 0) -> torch.Tensor:
    _norm_linear_args("rms_norm_linear", x, norm_weight, weight)
    (out,) = run("rmsnorm_linear", table, _rows(x), norm_weight.contiguous(), weight.contiguous(),
                 float(eps))
    return out.view(*x.shape[:-1], weight.shape[0])


@rms_norm_linear.register_fake
def _(x, norm_weight, weight, eps, table=0):
    _norm_linear_args("rms_norm_linear", x, norm_weight, weight)
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


# --- rms_norm_qkv_rope ----------------------------------------------------------------------
def _qkv_rope_args(x, norm_weight, weight, cos, sin, positions, k_cache, v_cache):
    if x.dim() != 2 or k_cache.dim() != 4 or tuple(v_cache.shape) != tuple(k_cache.shape) \
            or k_cache.shape[0] != x.shape[0] or tuple(positions.shape) != (x.shape[0],):
        raise ValueError(f"hwtune::rms_norm_qkv_rope: x{tuple(x.shape)} k_cache{tuple(k_cache.shape)} "
                         f"v_cache{tuple(v_cache.shape)} positions{tuple(positions.shape)}: expected x [B, K], "
                         "caches [B, Hkv, S, D], positions [B]")
    _norm_linear_args("rms_norm_qkv_rope", x, norm_weight, weight)
    _same_dtype("rms_norm_qkv_rope", x, cos, sin, k_cache, v_cache)
    b, hkv, d = x.shape[0], k_cache.shape[1], k_cache.shape[3]
    n = weight.shape[0]
    if d < 2 or d % 2 or n % d or n // d <= 2 * hkv:
        raise ValueError(f"hwtune::rms_norm_qkv_rope: weight{tuple(weight.shape)} is not [(Hq + 2 Hkv) D, K] "
                         f"for k_cache{tuple(k_cache.shape)} (D even)")
    for name, t in (("cos", cos), ("sin", sin)):   # [B, D], or one row for the whole batch
        if t.shape[-1:] != (d,) or t.numel() not in (d, b * d):
            raise ValueError(f"hwtune::rms_norm_qkv_rope: {name}{tuple(t.shape)}: expected [B, D] or [1, D] "
                             f"with D = {d}")
    # written in place: a copy would take the writes away from the caller's cache
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("hwtune::rms_norm_qkv_rope: k_cache and v_cache must be contiguous")
    return n // d - 2 * hkv, d


@torch.library.custom_op("hwtune::rms_norm_qkv_rope", mutates_args=("k_cache", "v_cache"))
def rms_norm_qkv_rope(x: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor, eps: float,
                      cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, table: int = 0) -> torch.Tensor:
    _, d = _qkv_rope_args(x, norm_weight, weight, cos, sin, positions, k_cache, v_cache)
    b = x.shape[0]
    cos = cos.reshape(-1, d).expand(b, d).contiguous()
    sin = sin.reshape(-1, d).expand(b, d).contiguous()
    (q_out,) = run("rmsnorm_qkv_rope", table, x.contiguous(), norm_weight.contiguous(), weight.contiguous(),
                   float(eps), cos, sin, positions.to(torch.int64).contiguous(), k_cache, v_cache)
    return q_out


@rms_norm_qkv_rope.register_fake
def _(x, norm_weight, weight, eps, cos, sin, positions, k_cache, v_cache, table=0):
    hq, d = _qkv_rope_args(x, norm_weight, weight, cos, sin, positions, k_cache, v_cache)
    return x.new_empty((x.shape[0], hq, d))


# --- rms_norm_gate_up_swiglu ----------------------------------------------------------------
def _gate_up_args(x, norm_weight, weight):
    _norm_linear_args("rms_norm_gate_up_swiglu", x, norm_weight, weight)
    if weight.shape[0] % 2:
        raise ValueError(f"hwtune::rms_norm_gate_up_swiglu: weight{tuple(weight.shape)}: expected "
                         "[2I, K] (gate rows, then up rows)")


@torch.library.custom_op("hwtune::rms_norm_gate_up_swiglu", mutates_args=())
def rms_norm_gate_up_swiglu(x: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor, eps: float,
                            table: int = 0) -> torch.Tensor:
    _gate_up_args(x, norm_weight, weight)
    (out,) = run("rmsnorm_gate_up_swiglu", table, _rows(x), norm_weight.contiguous(), weight.contiguous(),
                 float(eps))
    return out.view(*x.shape[:-1], weight.shape[0] // 2)


@rms_norm_gate_up_swiglu.register_fake
def _(x, norm_weight, weight, eps, table=0):
    _gate_up_args(x, norm_weight, weight)
    return x.new_empty((*x.shape[:-1], weight.shape[0] // 2))


# --- linear_residual ------------------------------------------------------------------------
def _residual_args(x, weight, residual):
    _same_dtype("linear_residual", x, weight, residual)
    if weight.dim() != 2 or weight.shape[1] != x.shape[-1] or \
            tuple(residual.shape) != (*x.shape[:-1], weight.shape[0]):
        raise ValueError(f"hwtune::linear_residual: x{tuple(x.shape)} weight{tuple(weight.shape)} "
                         f"residual{tuple(residual.shape)}: expected x [..., K], weight [N, K], "
                         "residual [..., N]")


@torch.library.custom_op("hwtune::linear_residual", mutates_args=())
def linear_residual(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor,
                    table: int = 0) -> torch.Tensor:
    _residual_args(x, weight, residual)
    (out,) = run("linear_residual", table, _rows(x), weight.contiguous(),
                 residual.reshape(-1, weight.shape[0]).contiguous())
    return out.view(residual.shape)


@linear_residual.register_fake
def _(x, weight, residual, table=0):
    _residual_args(x, weight, residual)
    return x.new_empty(residual.shape)


OPS = {"rms_norm": "rmsnorm", "add_rms_norm": "add_rmsnorm", "linear": "linear", "swiglu": "swiglu",
       "rope": "rope", "decode_attention": "decode_attention",
       "rope_kv_write": "rope_kv_write", "rope_kv_attention": "rope_kv_attention",
       "rms_norm_linear": "rmsnorm_linear",
       "rms_norm_qkv_rope": "rmsnorm_qkv_rope",
       "rms_norm_gate_up_swiglu": "rmsnorm_gate_up_swiglu",
       "linear_residual": "linear_residual"}  # op name -> kernel (spec) name


def register_inductor_fallbacks() -> list[str]:
    """Register every hwtune op with TorchInductor as an explicit fallback, the lowering
    inductor would give it anyway at its first compile (the op runs as the opaque call it is,
    under the layout constraint of the op's tag, else inductor's default for custom ops).
    Why: inductor 2.11 logs each implicit fallback with the text of its IR arguments, built
    whatever the log level (later releases build it lazily). For the patched Llama decode step
    that text took minutes on an H200 (torch 2.11: the first compile of hf-llama patched did not
    finish in 400 s; 10 s with the text left out). Registered, no op reaches that log line.
    Returns the ops registered by this call (an op inductor already has is left as it is);
    never raises: where inductor cannot be imported, lacks these hooks or refuses one, the ops
    left are left to inductor's own implicit fallback, as before."""
    try:
        from torch._inductor import lowering
        from torch._library.utils import get_layout_constraint_tag
        constraint_of = lowering.tag_to_layout_constraint
        make_fallback, known = lowering.make_fallback, lowering.lowerings
    except Exception:   # no inductor here, or another layout of its internals
        return []
    done = []
    for name in OPS:
        op = getattr(torch.ops.hwtune, name).default
        if op in known:
            continue
        try:
            make_fallback(op, layout_constraint=constraint_of(get_layout_constraint_tag(op, with_default=True)),
                          warn=False)
        except Exception:   # another inductor: its first compile registers the rest itself
            break
        done.append(name)
    return done


__all__ = ["rms_norm", "add_rms_norm", "linear", "swiglu", "rope", "decode_attention", "rope_kv_write",
           "rope_kv_attention", "rms_norm_linear", "rms_norm_qkv_rope", "rms_norm_gate_up_swiglu",
           "linear_residual", "table_handle", "table_of", "run", "register_inductor_fallbacks", "OPS"]
