"""Hugging Face transformers: run a Llama-family model's decode step through hwtune's ops.

    from kernelsearch.integrations.transformers import patch, unpatch
    report = patch(model, table=DispatchTable.for_device(state_dir))   # in place
    ...                                                                 # generate, compile, ...
    unpatch(model)                                                      # the original modules back

`patch` swaps modules of LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM and
Qwen3ForCausalLM for plain modules with the same interface (as Liger Kernel does); nothing else
of the model changes:
- every RMSNorm (the decoder layers', the final norm, Qwen3's per-head q_norm / k_norm) ->
  hwtune::rms_norm;
- the MLP -> one gate|up projection (hwtune::linear on the two weights concatenated),
  hwtune::swiglu, then hwtune::linear for down;
- attention -> one q|k|v projection (biases concatenated too, Qwen2 has them), hwtune::rope on
  the model's own cos/sin (any RoPE variant the model computes arrives folded into them) and
  the cache's own update; at decode (one token) on an initialised StaticCache full-attention
  layer instead hwtune::rope_kv_write on the fused q|k|v, which writes RoPE'd k and v straight
  into the layer's own `keys` / `values` at its `cumulative_length` (advanced as
  StaticLayer.update advances it) and returns RoPE'd q (not for Qwen3: its q_norm / k_norm sit
  between the projection and RoPE; not with an offloading cache); then at decode (a StaticCache
  full-attention layer, an SDPA or eager mask) hwtune::decode_attention over the whole static
  cache with each sequence's valid length read from the mask; with `fused=True` and a
  rope_kv_attention entry, that cache write and the decode attention are one
  hwtune::rope_kv_attention (a padded row takes the unfused path eagerly, NaN when compiled);
  anywhere else (prefill, other caches) the model's own attention function; o_proj through
  hwtune::linear;
- lm_head -> hwtune::linear;
- with `fused=True` (the default), each decoder layer whose norms, attention and MLP were all
  patched -> HwtuneDecoderLayer where the table routes a fused kernel for it: input_layernorm +
  q|k|v -> hwtune::rms_norm_linear (bias added after; Qwen3's q_norm / k_norm still after the
  projection), o_proj + residual add -> hwtune::linear_residual, post_attention_layernorm +
  gate|up + SwiGLU -> hwtune::rms_norm_gate_up_swiglu (not with MLP biases), down_proj + residual
  add -> hwtune::linear_residual; and at a one-token step on a StaticCache layer (no q|k|v bias,
  no q_norm / k_norm) input_layernorm + q|k|v + RoPE + the cache write -> hwtune::rms_norm_qkv_rope,
  asked first, then the decode attention. Each part on its own, per shape: where its fused kernel is not
  routed, that part runs the unfused path above. `fused=False`: the unfused patch only (issue
  12's, the previous tuned step). PatchReport.patched counts the layers per fused part.
Routing is per shape and read from the dispatch table once, at patch time: a call whose shape
has a tuned, verified kernel for this device goes through the hwtune op (which runs it); any
other call runs the model's own code (the fused projections stay one GEMM), which
torch.compile fuses as it would unpatched, instead of an opaque op running stock inside.
`stock_through_ops=True` sends every call through the ops (stock inside where untuned).

The fused weights are the only copy: the original q/k/v (gate/up) parameters become views into
them, so memory does not grow (and stay views after `model.to(...)` or copy.deepcopy, which
fuse again); `unpatch` gives each parameter its own storage back. The
parameters, their names and state_dict keys never change. Save a model after `unpatch`
(safetensors refuses tensors that share storage).

A configuration the patch does not handle stays stock, with one line saying what and why, in the
report and in the log: no dispatch table, an unknown model class, quantized or non-float
weights, weights managed by accelerate hooks, a sliding window (those layers' attention), an
unknown RoPE type or partial rotary (the attention). Padding: the decode kernel takes one valid
length per sequence (positions 0..L-1); a padded row breaks that. Eagerly the patched attention
checks the mask and runs the model's own attention when a row is padded; under torch.compile
(no host sync) such a row's output is NaN instead of silently wrong.

torch.compile: patch() registers the ops with inductor as explicit fallbacks first
(ops.register_inductor_fallbacks: torch 2.11 spent minutes writing out their arguments' IR for
its implicit-fallback log line at the first compile).

Inference only: hwtune's ops have no backward; a module in training mode, or called where
autograd records (grad enabled and the input or a parameter requires grad: `loss.backward()` on
an eval-mode model), runs the original, so gradients reach every parameter. Run inference under
torch.no_grad() / torch.inference_mode() (generate does) to use the kernels. Under torch.autocast
the patched modules run the originals too (the ops take one dtype; cast the model instead).
Hooks: a swapped module takes over the forward and backward hooks of the module it replaces, and gives back at
unpatch the ones registered on it meanwhile (transformers 5 installs its output-recording hooks
once per model); where it runs the original, it calls the original's forward, so those hooks run
once, on the swapped module. A forward hook of the user's on a module the patched code does not
call as a module (q/k/v/o_proj, gate/up/down_proj: computed from the fused weights; a fused
layer's norms, attention and MLP) leaves that MLP, attention or layer the model's own, with one
line in the report (hooks registered there after patch() are not seen). A fused decoder layer is an instance of the model's own decoder-layer class (a
subclass made at patch time), so output_hidden_states records every layer as unpatched; so is a
patched attention, and while output_attentions is asked for, it and the fused layers run the
model's own code (hwtune's kernels compute no attention weights).
"""
from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from transformers.cache_utils import StaticLayer
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from kernelsearch import dispatch, ops

try:   # transformers 5: what the model's output_* arguments ask its recording hooks to collect
    from transformers.utils.output_capturing import _active_collector as _output_collector
except ImportError:
    _output_collector = None

log = logging.getLogger("hwtune.transformers")

SUPPORTED = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
# RoPE types whose cos/sin the model's rotary module computes at full head_dim and applies with
# rotate_half: hwtune::rope takes cos/sin as inputs, so it is right for all of them.
KNOWN_ROPE = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")
ACTIVATIONS = ("silu", "swish")
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass
class PatchReport:
    model: str
    table: str = ""
    patched: dict[str, int] = field(default_factory=dict)   # part -> modules swapped
    stock: list[str] = field(default_factory=list)          # one line per configuration left stock

    def lines(self) -> list[str]:
        done = ", ".join(f"{n} {part}" for part, n in self.patched.items()) or "nothing"
        return [f"hwtune patch {self.model}: {done}" + (f" ({self.table})" if self.table else "")] + \
            [f"  stock: {line}" for line in self.stock]

    def __str__(self) -> str:
        return "\n".join(self.lines())


@dataclass
class _Record:
    """What unpatch needs: (parent, attribute, original module) in patch order, and the
    parameters whose storage became a view of a fused weight."""
    swaps: list = field(default_factory=list)
    shared: list = field(default_factory=list)
    report: PatchReport | None = None
    table: dispatch.DispatchTable | None = None   # the table behind `handle`, the modules' op argument
    handle: int = 0

    def __setstate__(self, state):
        """A patched model loaded from a pickle (torch.save of the model) in another process: its
        modules pass the handle they were given there; it selects this table here too."""
        self.__dict__.update(state)
        if self.table is not None and not ops.adopt_table(self.handle, self.table):
            log.warning("hwtune: the loaded patched model's table handle %d selects another table in this "
                        "process; unpatch(model) and patch it again to route through its own", self.handle)


# --- the patched modules ---------------------------------------------------------------------
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class _Routes:
    """Which shapes go through hwtune's ops: those the table has a tuned entry for on this
    device (read once, at patch time), or every shape (`stock_through_ops`). A shape without an
    entry runs the model's own code, which torch.compile fuses as it would unpatched (inside an
    op, stock is one opaque node)."""

    def __init__(self, handle: int, entries: list, every_shape: bool):
        self.handle = handle
        self.every_shape = every_shape
        self.entries = [(e.kernel, e.dtype, dict(e.shape)) for e in entries]

    def tuned(self, kernel: str, dtype, fixed: dict, free: tuple):
        """The values of the `free` dims of this kernel's entries whose other dims equal `fixed`
        (a frozenset of ints, or of tuples for several free dims); None: every shape."""
        if self.every_shape:
            return None
        name = DTYPE_NAMES.get(dtype)
        found = set()
        for kernel_, dtype_, shape in self.entries:
            shape = {k: v for k, v in shape.items() if k != "dtype"}
            if kernel_ != kernel or dtype_ != name or set(shape) != set(fixed) | set(free) or \
                    any(shape[d] != v for d, v in fixed.items()):
                continue
            found.add(shape[free[0]] if len(free) == 1 else tuple(shape[d] for d in free))
        return frozenset(found)


def _uses(tuned, key) -> bool:
    return tuned is None or key in tuned


def _runs_original(module: nn.Module, x) -> bool:
    """The original module runs this call: training mode, or autograd records it (grad mode on and
    the input or a parameter requires grad). hwtune's ops have no backward and the fused q|k|v
    and gate|up weights are detached, so the patched path would give no gradients (or fail).
    Also under torch.autocast: the ops are not autocast (they take one dtype and return it), so
    a routed call saw the autocast dtype beside the weights' and failed, or computed in another
    dtype than the unpatched model."""
    return module.training or torch.is_autocast_enabled(x.device.type) or \
        (torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in module.parameters())))


def _records_attentions() -> bool:
    """output_attentions is asked for (transformers 5 records each attention module's weights with
    a hook): the model's own attention computes them, hwtune's decode kernels do not."""
    collected = None if _output_collector is None else _output_collector.get()
    return bool(collected) and "attentions" in collected


def _rows(x) -> int:
    n = 1
    for d in x.shape[:-1]:
        n *= d
    return n


def _rows_of(x, bsz: int):
    """x [1, ...] (cos, sin or the cache position, the same for every sequence) as `bsz`
    contiguous rows, made here rather than inside the op: under torch.compile the copies are
    nodes of the graph that inductor fuses (H200, batch 32: one small kernel a layer, where the
    op's own copies were three aten kernels a layer). Rows already there pass as they are."""
    if x.shape[0] == bsz:
        return x
    return x.expand(bsz, *x.shape[1:]).contiguous()


def _step_rows(layer, cos, sin, bsz: int, d: int):
    """(positions [B], cos [B, D], sin [B, D]) for hwtune::rope_kv_write / rope_kv_attention at
    a one-token step on StaticLayer `layer`: its cumulative_length, the model's cos/sin."""
    return (_rows_of(layer.cumulative_length.reshape(1), bsz), _rows_of(cos.reshape(-1, d), bsz),
            _rows_of(sin.reshape(-1, d), bsz))


def _rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def _train_with_original(self, mode: bool = True):
    """nn.Module.train, and the same mode for the original module (not a registered submodule,
    so model.train() did not reach it): where the original runs (training mode), its dropout
    (attention_dropout) must see the mode the user set."""
    nn.Module.train(self, mode)
    self._hwtune_original[0].train(mode)
    return self


class HwtuneRMSNorm(nn.Module):
    """RMSNorm through hwtune::rms_norm; same `weight` parameter and `variance_epsilon`."""

    train = _train_with_original

    def __init__(self, original: nn.Module, routes: _Routes):
        super().__init__()
        self.weight = original.weight
        self.variance_epsilon = float(original.variance_epsilon)
        self.table = routes.handle
        self._tuned = routes.tuned("rmsnorm", self.weight.dtype, {"N": self.weight.shape[0]}, ("M",))
        self._hwtune_original = [original]   # a list: not registered as a submodule

    def forward(self, hidden_states):
        if _runs_original(self, hidden_states) or hidden_states.dtype != self.weight.dtype or \
                not _uses(self._tuned, _rows(hidden_states)):
            return self._hwtune_original[0].forward(hidden_states)
        return torch.ops.hwtune.rms_norm(hidden_states, self.weight, self.variance_epsilon, self.table)

    def extra_repr(self):
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}, table={self.table}"


class _Projection:
    """One weight [N, K] (and bias) multiplied through hwtune::linear where tuned."""

    def __init__(self, weight, routes: _Routes):
        self.table = routes.handle
        self.tuned = routes.tuned("linear", weight.dtype, {"K": weight.shape[1], "N": weight.shape[0]}, ("M",))

    def __call__(self, x, weight, bias):
        if x.dtype != weight.dtype or not _uses(self.tuned, _rows(x)):
            return F.linear(x, weight, bias)
        out = torch.ops.hwtune.linear(x, weight, self.table)
        return out if bias is None else out + bias


class HwtuneLinear(nn.Module):
    """nn.Linear through hwtune::linear (the lm_head); same `weight` (and `bias`) parameters."""

    train = _train_with_original

    def __init__(self, original: nn.Linear, routes: _Routes):
        super().__init__()
        self.weight = original.weight
        self.bias = original.bias
        self.in_features, self.out_features = original.in_features, original.out_features
        self._proj = _Projection(self.weight, routes)
        self._hwtune_original = [original]

    def forward(self, x):
        if _runs_original(self, x):
            return self._hwtune_original[0].forward(x)
        return self._proj(x, self.weight, self.bias)


def _refuse(module) -> None:
    """Make the module's fused weight (and bias) the storage of its projections' parameters again
    where they no longer are: `.to()` / `.half()` / `.cuda()` and copy.deepcopy give each parameter
    and the fused buffer storage of its own, and a later in-place update of a parameter
    (load_state_dict, an optimizer step) would not reach the weight the kernels read."""
    linears, weight_name, bias_name = module._fused()
    weight = getattr(module, weight_name)
    if all(lin.weight.untyped_storage().data_ptr() == weight.untyped_storage().data_ptr() for lin in linears):
        return
    weight, bias = _fuse(linears, module._hwtune_shared)
    setattr(module, weight_name, weight)
    setattr(module, bias_name, bias)


def _refuse_after_apply(self, fn, *args, **kwargs):
    nn.Module._apply(self, fn, *args, **kwargs)
    _refuse(self)
    return self


def _refuse_after_setstate(self, state):
    nn.Module.__setstate__(self, state)
    _refuse(self)


class HwtuneMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) as hwtune::linear on gate|up, hwtune::swiglu, hwtune::linear."""

    train = _train_with_original

    def __init__(self, original: nn.Module, routes: _Routes, shared: list):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = original.gate_proj, original.up_proj, original.down_proj
        self.act_fn = original.act_fn
        for name in ("config", "hidden_size", "intermediate_size"):
            if hasattr(original, name):
                setattr(self, name, getattr(original, name))
        self._hwtune_shared = shared
        weight, bias = _fuse([self.gate_proj, self.up_proj], shared)
        self.register_buffer("gate_up_weight", weight, persistent=False)
        self.register_buffer("gate_up_bias", bias, persistent=False)
        self.table = routes.handle
        self._gate_up = _Projection(weight, routes)
        self._down = _Projection(self.down_proj.weight, routes)
        self._swiglu = routes.tuned("swiglu", weight.dtype, {"I": self.gate_proj.out_features}, ("M",))
        self._hwtune_original = [original]

    def _fused(self):
        return [self.gate_proj, self.up_proj], "gate_up_weight", "gate_up_bias"

    _apply = _refuse_after_apply
    __setstate__ = _refuse_after_setstate

    def forward(self, x):
        if _runs_original(self, x):
            return self._hwtune_original[0].forward(x)
        return self._down(self.activate(x), self.down_proj.weight, self.down_proj.bias)

    def activate(self, x):
        """silu(gate(x)) * up(x): the fused gate|up projection, then SwiGLU (what goes into down)."""
        gate_up = self._gate_up(x, self.gate_up_weight, self.gate_up_bias)
        if _uses(self._swiglu, _rows(gate_up)):
            return torch.ops.hwtune.swiglu(gate_up, self.table)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act_fn(gate) * up


class HwtuneAttention(nn.Module):
    """The model's attention with one q|k|v projection, hwtune::rope, and hwtune::decode_attention
    for one-token steps on a StaticCache full-attention layer."""

    train = _train_with_original

    def __init__(self, original: nn.Module, routes: _Routes, shared: list, attention_function,
                 guards_padding: bool, fused: bool = False):
        nn.Module.__init__(self)   # not the model's attention class's __init__ (see _own_class)
        for name, value in vars(original).items():   # config, layer_idx, head_dim, scaling, ...
            if not name.startswith("_") and name != "training":
                setattr(self, name, value)
        self.q_proj, self.k_proj, self.v_proj = original.q_proj, original.k_proj, original.v_proj
        self.o_proj = original.o_proj
        self.q_norm = getattr(original, "q_norm", None)
        self.k_norm = getattr(original, "k_norm", None)
        self.num_heads = self.q_proj.out_features // self.head_dim
        self.num_kv_heads = self.k_proj.out_features // self.head_dim
        self._hwtune_shared = shared
        weight, bias = _fuse([self.q_proj, self.k_proj, self.v_proj], shared)
        self.register_buffer("qkv_weight", weight, persistent=False)
        self.register_buffer("qkv_bias", bias, persistent=False)
        self.table = routes.handle
        heads = {"Hq": self.num_heads, "Hkv": self.num_kv_heads, "D": self.head_dim}
        self._qkv = _Projection(weight, routes)
        self._o = _Projection(self.o_proj.weight, routes)
        self._rope = routes.tuned("rope", weight.dtype, heads, ("B",))
        self._rope_kv = routes.tuned("rope_kv_write", weight.dtype, heads, ("B", "S"))
        self._decode_shapes = routes.tuned("decode_attention", weight.dtype, heads, ("B", "S"))
        # RoPE + cache write + decode attention in one kernel (patch(fused=True) only; not with
        # q_norm / k_norm between the projection and RoPE)
        self._rope_kv_attn = routes.tuned("rope_kv_attention", weight.dtype, heads, ("B", "S")) \
            if fused and self.q_norm is None else frozenset()
        # Under torch.compile a padded row is turned into NaN once, in the first patched layer
        # (NaN then flows through every later layer): one small kernel per step, not per layer.
        self._guards_padding = guards_padding
        self._hwtune_original = [original]
        self._attention_function = attention_function   # the modeling module's eager attention
        # transformers >= 5.24 names the cache argument `cache`, earlier versions `past_key_values`
        self._cache_kwarg = "cache" if "cache" in inspect.signature(original.forward).parameters \
            else "past_key_values"

    def _fused(self):
        return [self.q_proj, self.k_proj, self.v_proj], "qkv_weight", "qkv_bias"

    _apply = _refuse_after_apply
    __setstate__ = _refuse_after_setstate

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None,
                past_key_values=None, cache=None, **kwargs):
        cache = cache if cache is not None else past_key_values
        if _runs_original(self, hidden_states) or position_embeddings is None or \
                hidden_states.dtype != self.qkv_weight.dtype or _records_attentions():
            return self._hwtune_original[0].forward(hidden_states, position_embeddings, attention_mask,
                                            **{self._cache_kwarg: cache}, **kwargs)
        cache_position = kwargs.pop("cache_position", None)   # transformers 4.x passes it
        out = self.attend(self.project(hidden_states), position_embeddings, attention_mask, cache,
                          cache_position, kwargs)
        return self._o(out, self.o_proj.weight, self.o_proj.bias), None

    def project(self, hidden_states):
        """The fused q|k|v projection (bias included) of the normalised hidden states."""
        return self._qkv(hidden_states, self.qkv_weight, self.qkv_bias)

    def attend(self, qkv, position_embeddings, attention_mask, cache, cache_position, kwargs):
        """Everything between the q|k|v projection and o_proj: qkv [B, T, (Hq + 2 Hkv) D] ->
        the attention output [B, T, Hq D] that o_proj takes (q_norm / k_norm, RoPE, the cache
        write, decode or the model's attention)."""
        bsz, q_len = qkv.shape[:2]
        d, hq, hkv = self.head_dim, self.num_heads, self.num_kv_heads
        q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
        q, k, v = q.view(bsz, q_len, hq, d), k.view(bsz, q_len, hkv, d), v.view(bsz, q_len, hkv, d)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = position_embeddings
        layer = self._kv_write_layer(cache, qkv, cos, cache_position) if q_len == 1 else None
        if layer is not None and _uses(self._rope_kv_attn, (bsz, layer.keys.shape[2])) and \
                self._static_layer(cache, layer.keys, attention_mask):
            out = self._fused_decode(qkv, cos, sin, layer, attention_mask)
            if out is not None:
                return out.reshape(bsz, q_len, hq * d)
        if layer is not None and not _uses(self._rope_kv, (bsz, layer.keys.shape[2])):
            layer = None
        if layer is not None:
            # RoPE'd k and v go straight into the StaticCache layer's own tensors, at the slot
            # StaticLayer.update would write (its cumulative_length), which then advances as
            # update advances it: one launch instead of RoPE plus two index_copy_
            keys, values = layer.keys, layer.values
            positions, cos, sin = _step_rows(layer, cos, sin, bsz, d)
            q = torch.ops.hwtune.rope_kv_write(qkv.reshape(bsz, hq + 2 * hkv, d), cos, sin, positions,
                                               keys, values, self.table)
            layer.cumulative_length.add_(1)
            q = q.view(bsz, 1, hq, d)
        elif _uses(self._rope, bsz * q_len):
            # contiguous here, where torch.compile fuses the copies with the split and the bias
            cos, sin = cos.expand(bsz, q_len, d).contiguous(), sin.expand(bsz, q_len, d).contiguous()
            q, k = torch.ops.hwtune.rope(q.contiguous(), k.contiguous(), cos, sin, self.table)
        else:   # the models' apply_rotary_pos_emb, in the [B, T, H, D] layout
            c, s = cos.unsqueeze(2), sin.unsqueeze(2)
            q, k = q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s
        if layer is None:   # k and v not written yet
            k, v = k.transpose(1, 2), v.transpose(1, 2)
            if cache is None:
                keys, values = k, v
            elif cache_position is not None:
                keys, values = cache.update(k, v, self.layer_idx,
                                            {"sin": sin, "cos": cos, "cache_position": cache_position})
            else:
                keys, values = cache.update(k, v, self.layer_idx)
        out = None
        if q_len == 1 and _uses(self._decode_shapes, (bsz, keys.shape[2])) and \
                self._static_layer(cache, keys, attention_mask):
            out = self._decode(q[:, 0], keys, values, attention_mask, cache, cache_position)
        if out is None:
            out = self._model_attention(q.transpose(1, 2), keys, values, attention_mask, kwargs)
        return out.reshape(bsz, q_len, hq * d)

    def _kv_write_layer(self, cache, qkv, cos, cache_position):
        """The StaticCache layer hwtune::rope_kv_write (or rope_kv_attention) writes into at this
        one-token step, or None (today's path: RoPE, then cache.update): only where the table
        has a tuned entry of either for the shape and `_static_kv_layer` gives one."""
        layer = self._static_kv_layer(cache, qkv.shape[0], qkv.dtype, qkv.device, cos, cache_position)
        if layer is None:
            return None
        s = layer.keys.shape[2]
        if not (_uses(self._rope_kv, (qkv.shape[0], s)) or _uses(self._rope_kv_attn, (qkv.shape[0], s))):
            return None
        return layer

    def _static_kv_layer(self, cache, bsz, dtype, device, cos, cache_position):
        """The StaticCache layer a kernel may write this one-token step's k and v into, or None:
        an initialised full-attention StaticLayer of transformers 5 (keys and values are
        allocated by its first update, the prefill's), no offloading, no q/k norm between
        projection and RoPE (Qwen3), tensors of the ops' dtypes and layout. Static under
        torch.compile (types, attributes, shapes)."""
        layers = getattr(cache, "layers", None)
        if layers is None or self.q_norm is not None or cache_position is not None or \
                getattr(cache, "offloading", False):
            return None
        layer = layers[self.layer_idx]
        if type(layer) is not StaticLayer or not getattr(layer, "is_initialized", False) or \
                not isinstance(getattr(layer, "cumulative_length", None), torch.Tensor):
            return None
        keys, values = layer.keys, layer.values
        d, hkv = self.head_dim, self.num_kv_heads
        if tuple(keys.shape) != (bsz, hkv, keys.shape[2], d) or tuple(values.shape) != tuple(keys.shape) or \
                keys.dtype != dtype or values.dtype != dtype or cos.dtype != dtype or \
                not (keys.is_contiguous() and values.is_contiguous()) or keys.device != device:
            return None
        return layer

    def norm_qkv_rope_decode(self, hidden_states, norm, tuned, position_embeddings, attention_mask, cache,
                             cache_position, kwargs):
        """A one-token step through hwtune::rms_norm_qkv_rope (`norm`'s RMSNorm, the q|k|v
        projection, RoPE, and k and v written into the StaticCache layer at its
        cumulative_length, advanced as StaticLayer.update advances it), then the decode attention
        (hwtune::decode_attention where routed, else the model's own, over the cache that now
        holds the token) -> the attention output [B, 1, Hq D]; None where `tuned` does not route
        the shape or the layer is not one the kernel writes (nothing done then). `tuned` is
        HwtuneDecoderLayer's, empty for a q|k|v bias (none can be added between the projection
        and RoPE); q_norm / k_norm leave no layer to write (`_static_kv_layer`)."""
        bsz, d, hq = hidden_states.shape[0], self.head_dim, self.num_heads
        cos, sin = position_embeddings
        if hidden_states.shape[1] != 1:
            return None
        layer = self._static_kv_layer(cache, bsz, hidden_states.dtype, hidden_states.device, cos, cache_position)
        if layer is None or not _uses(tuned, (bsz, layer.keys.shape[2])):
            return None
        keys, values = layer.keys, layer.values
        positions, cos, sin = _step_rows(layer, cos, sin, bsz, d)
        attend = _uses(self._decode_shapes, (bsz, keys.shape[2])) and self._static_layer(cache, keys, attention_mask)
        if attend:   # both before the add_ below: at batch 1 `positions` is a view of cumulative_length
            # the attention's lengths, from the position as the rows above (pointwise, beside them in
            # the compiled graph), not from the mask: a sum over its S slots was a reduction a layer
            seq_lens = _rows_of((layer.cumulative_length.reshape(1) + 1).to(torch.int32), bsz)
            ok = self._mask_agrees(attention_mask, positions, keys.shape[2])
        q = torch.ops.hwtune.rms_norm_qkv_rope(hidden_states.reshape(bsz, -1), norm.weight, self.qkv_weight,
                                               norm.variance_epsilon, cos, sin, positions, keys, values,
                                               self.table)
        layer.cumulative_length.add_(1)
        out = None
        if attend:
            if ok is None or torch.compiler.is_compiling() or bool(ok.all()):
                out = _nan_rows(torch.ops.hwtune.decode_attention(q, keys, values, seq_lens, float(self.scaling),
                                                                  self.table), ok)
        if out is None:   # a padded row (eager), or no decode kernel: the model's own, on the written cache
            out = self._model_attention(q.view(bsz, 1, hq, d).transpose(1, 2), keys, values, attention_mask,
                                        kwargs)
        return out.reshape(bsz, 1, hq * d)

    def _fused_decode(self, qkv, cos, sin, layer, mask):
        """hwtune::rope_kv_attention at this one-token step: RoPE'd k and v written into the
        StaticCache layer at its cumulative_length (advanced as StaticLayer.update would), the
        attention over slots 0..that position; -> [B, Hq, D]. The kernel attends to exactly the
        slots up to the new token: a mask that says otherwise for a row (padding) sends the step
        down the unfused path eagerly (None, nothing written) and, under torch.compile (no host
        sync), makes that row NaN in the first patched layer, as _decode does."""
        bsz, d, hq, hkv = qkv.shape[0], self.head_dim, self.num_heads, self.num_kv_heads
        keys, values = layer.keys, layer.values
        positions, cos, sin = _step_rows(layer, cos, sin, bsz, d)
        ok = self._mask_agrees(mask, positions, keys.shape[2])
        if ok is not None and not torch.compiler.is_compiling() and not bool(ok.all()):
            return None
        out = torch.ops.hwtune.rope_kv_attention(qkv.reshape(bsz, hq + 2 * hkv, d), cos, sin, positions,
                                                 keys, values, float(self.scaling), self.table)
        layer.cumulative_length.add_(1)
        return _nan_rows(out, ok)

    def _mask_agrees(self, mask, positions, s_max: int):
        """[B] bool: each row's mask lets the new token see exactly slots 0..positions[b] (what
        the cache-writing kernels attend to), or None where it is not checked: no mask, or under
        torch.compile in a layer that does not guard padding (a check there would be a reduction
        over the mask's slots a layer). Eagerly a False row sends the step down the model's own
        path; compiled (no host sync) the guarding layer makes that row NaN."""
        if mask is None or not (self._guards_padding or not torch.compiler.is_compiling()):
            return None
        row = mask[:, 0, -1, :]
        valid = row if row.dtype == torch.bool else row == 0
        want = torch.arange(s_max, device=valid.device)[None, :] <= positions[:, None]
        return (valid == want).all(dim=-1)

    def _static_layer(self, cache, keys, mask) -> bool:
        """A one-token step the decode kernel handles: a StaticCache full-attention layer and a
        mask (or none) of a form read here. Static under torch.compile (types and shapes)."""
        layers = getattr(cache, "layers", None)
        if layers is None or type(layers[self.layer_idx]) is not StaticLayer:
            return False
        if self.config._attn_implementation not in ("sdpa", "eager"):
            return False
        return mask is None or (mask.dim() == 4 and mask.shape[-1] == keys.shape[2])

    def _decode(self, q, keys, values, mask, cache, cache_position):
        bsz, s_max = q.shape[0], keys.shape[2]
        prefix = None
        if mask is None:   # no padding (transformers skips the mask): every row is at one position
            if cache_position is not None:
                length = cache_position[-1:] + 1
            else:
                length = getattr(cache.layers[self.layer_idx], "cumulative_length", None)
                if length is None:
                    return None
            seq_lens = length.reshape(1).to(torch.int32).expand(bsz).contiguous()
        else:
            row = mask[:, 0, -1, :]
            valid = row if row.dtype == torch.bool else row == 0
            seq_lens = valid.sum(dim=-1, dtype=torch.int32)
            positions = torch.arange(s_max, device=valid.device)
            prefix = ((positions[None, :] < seq_lens[:, None]) == valid).all(dim=-1)
            if not torch.compiler.is_compiling() and not bool(prefix.all()):
                return None    # a padded row: the model's own attention (eager only: a host sync)
        out = torch.ops.hwtune.decode_attention(q.contiguous(), keys, values, seq_lens,
                                                float(self.scaling), self.table)
        return _nan_rows(out, prefix if self._guards_padding else None)

    def _model_attention(self, q, keys, values, mask, kwargs):
        # only full-attention layers are patched: no sliding_window argument to pass on
        impl = self.config._attn_implementation
        if impl == "eager":
            fn = self._attention_function
        elif hasattr(ALL_ATTENTION_FUNCTIONS, "get_interface"):   # transformers 5
            fn = ALL_ATTENTION_FUNCTIONS.get_interface(impl, self._attention_function)
        else:
            fn = ALL_ATTENTION_FUNCTIONS[impl]
        out, _ = fn(self, q, keys, values, mask, dropout=0.0, scaling=self.scaling, **kwargs)
        return out


def _nan_rows(out, ok):
    """out [B, ...] with the rows where ok [B] is False made NaN, under torch.compile only: there
    a mask the kernel cannot honour (padding) cannot send the step down the model's own path (a
    host sync), so the guarding layer poisons that row instead. Eagerly, or ok None: out."""
    if ok is None or not torch.compiler.is_compiling():
        return out
    return torch.where(ok[:, None, None], out, float("nan"))


# The attention modules that run RoPE + cache write + decode attention as one kernel (where the
# table routes rope_kv_attention): PatchReport.patched key.
FUSED_ATTENTION = "fused rope+kv write+attention"
# The fused parts of a decoder layer: PatchReport.patched key -> the kernel it runs.
FUSED_PARTS = {"fused norm+qkv": "rmsnorm_linear", "fused o+residual": "linear_residual",
               "fused norm+gate_up+swiglu": "rmsnorm_gate_up_swiglu", "fused down+residual": "linear_residual",
               "fused norm+qkv+rope+kv write": "rmsnorm_qkv_rope"}
DECODER_LAYERS = ("LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer")
LAYER_CHILDREN = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}


class HwtuneDecoderLayer(nn.Module):
    """A Llama-family decoder layer (norm, attention, residual add, norm, MLP, residual add) whose
    patched norms, attention and MLP are called with up to five fused kernels, each where the table
    routes it for the call's rows (M = batch x tokens; B and the cache length S for the first):
      input_layernorm + q|k|v + RoPE + the StaticCache write, at a one-token step (no q|k|v bias,
        no q_norm / k_norm; asked first) -> hwtune::rms_norm_qkv_rope, then the decode attention
      input_layernorm + q|k|v projection       -> hwtune::rms_norm_linear (q|k|v bias added after)
      o_proj + the residual add                -> hwtune::linear_residual (o_proj bias in the residual)
      post_attention_layernorm + gate|up + SwiGLU -> hwtune::rms_norm_gate_up_swiglu (no MLP bias)
      down_proj + the residual add             -> hwtune::linear_residual (down_proj bias likewise)
    A part not routed for a shape runs the unfused patched path (HwtuneRMSNorm, the fused
    projections, hwtune::swiglu, each where routed, else the model's own code). The children are
    the original layer's (already patched) modules, under the same names."""

    train = _train_with_original

    def __init__(self, original: nn.Module, routes: _Routes):
        nn.Module.__init__(self)   # not the model's layer class's __init__ (see _decoder_layer)
        for name, value in vars(original).items():   # hidden_size, attention_type, ...
            if not name.startswith("_") and name != "training":
                setattr(self, name, value)
        for name, child in original.named_children():   # the original's order: same state_dict keys
            setattr(self, name, child)
        attn, mlp = self.self_attn, self.mlp
        dtype = attn.qkv_weight.dtype
        hidden = attn.qkv_weight.shape[1]
        norms_ok = all(n.weight.dtype == dtype for n in (self.input_layernorm, self.post_attention_layernorm))
        none = frozenset()
        self.table = routes.handle
        self._norm_qkv = routes.tuned("rmsnorm_linear", dtype, {"K": hidden, "N": attn.qkv_weight.shape[0]},
                                      ("M",)) if norms_ok else none
        o = attn.o_proj
        self._o_residual = routes.tuned("linear_residual", dtype, {"K": o.in_features, "N": o.out_features},
                                        ("M",))
        # the fused kernel's epilogue is SwiGLU on the bare product: no room for a gate|up bias
        self._norm_gate_up = routes.tuned("rmsnorm_gate_up_swiglu", dtype,
                                          {"K": hidden, "I": mlp.gate_proj.out_features}, ("M",)) \
            if norms_ok and mlp.gate_up_bias is None else none
        down = mlp.down_proj
        self._down_residual = routes.tuned("linear_residual", dtype,
                                           {"K": down.in_features, "N": down.out_features}, ("M",))
        # norm + q|k|v + RoPE + the cache write at a one-token step: no bias or q/k norm between
        # the projection and RoPE
        self._norm_qkv_rope = routes.tuned(
            "rmsnorm_qkv_rope", dtype, {"K": hidden, "Hq": attn.num_heads, "Hkv": attn.num_kv_heads,
                                        "D": attn.head_dim}, ("B", "S")) \
            if norms_ok and attn.qkv_bias is None and attn.q_norm is None else none
        # transformers >= 5.24 names the cache argument `cache`, earlier versions `past_key_values`
        self._cache_kwarg = "cache" if "cache" in inspect.signature(original.forward).parameters \
            else "past_key_values"
        self._hwtune_original = [original]

    def parts(self) -> dict:
        """PatchReport.patched key -> routed for some shape (True) or for none (False)."""
        tuned = (self._norm_qkv, self._o_residual, self._norm_gate_up, self._down_residual, self._norm_qkv_rope)
        return {part: t is None or bool(t) for part, t in zip(FUSED_PARTS, tuned)}

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_values=None,
                use_cache=False, cache_position=None, position_embeddings=None, cache=None, **kwargs):
        cache = cache if cache is not None else past_key_values
        attn, mlp = self.self_attn, self.mlp
        if _runs_original(self, hidden_states) or position_embeddings is None or \
                hidden_states.dtype != attn.qkv_weight.dtype or _records_attentions():
            extra = {} if cache_position is None else {"cache_position": cache_position}
            return self._hwtune_original[0].forward(hidden_states, attention_mask=attention_mask,
                                            position_ids=position_ids, use_cache=use_cache,
                                            position_embeddings=position_embeddings,
                                            **{self._cache_kwarg: cache}, **extra, **kwargs)
        rows = _rows(hidden_states)
        residual = hidden_states
        norm = self.input_layernorm
        # what the original layer hands its attention besides the cache (flash attention reads
        # position_ids)
        more = {"position_ids": position_ids, "use_cache": use_cache, **kwargs}
        out = None
        if self._norm_qkv_rope is None or self._norm_qkv_rope:   # routed for some shape
            out = attn.norm_qkv_rope_decode(hidden_states, norm, self._norm_qkv_rope, position_embeddings,
                                            attention_mask, cache, cache_position, more)
        if out is None:
            if _uses(self._norm_qkv, rows):
                qkv = torch.ops.hwtune.rms_norm_linear(hidden_states, norm.weight, attn.qkv_weight,
                                                       norm.variance_epsilon, self.table)
                if attn.qkv_bias is not None:
                    qkv = qkv + attn.qkv_bias
            else:
                qkv = attn.project(norm(hidden_states))
            out = attn.attend(qkv, position_embeddings, attention_mask, cache, cache_position, more)
        hidden_states = self._plus_linear(self._o_residual, out, attn.o_proj, attn._o, residual)
        residual = hidden_states
        norm = self.post_attention_layernorm
        if _uses(self._norm_gate_up, rows):
            h = torch.ops.hwtune.rms_norm_gate_up_swiglu(hidden_states, norm.weight, mlp.gate_up_weight,
                                                         norm.variance_epsilon, self.table)
        else:
            h = mlp.activate(norm(hidden_states))
        return self._plus_linear(self._down_residual, h, mlp.down_proj, mlp._down, residual)

    def _plus_linear(self, tuned, x, linear, projection, residual):
        """residual + linear(x): hwtune::linear_residual where routed (a bias joins the residual,
        the product is added to it once in fp32), else the projection, then the add."""
        if _uses(tuned, _rows(x)):
            base = residual if linear.bias is None else residual + linear.bias
            return torch.ops.hwtune.linear_residual(x, linear.weight, base, self.table)
        return residual + projection(x, linear.weight, linear.bias)


def _fused_layer_problem(layer) -> str | None:
    """Why this decoder layer cannot run the fused kernels, or None."""
    kind = type(layer).__name__
    if kind not in DECODER_LAYERS:
        return f"{kind} is not a decoder layer hwtune fuses ({', '.join(DECODER_LAYERS)})"
    children = {name for name, _ in layer.named_children()}
    if children != LAYER_CHILDREN:
        return f"{kind} has submodules {sorted(children)}, not exactly {sorted(LAYER_CHILDREN)}"
    if "output_attentions" in inspect.signature(layer.forward).parameters:
        return f"this transformers' {kind} returns a tuple (output_attentions): hwtune's layer returns " \
               "the hidden states as transformers 5 does"
    for name in ("input_layernorm", "post_attention_layernorm"):
        if not isinstance(getattr(layer, name), HwtuneRMSNorm):
            return f"{name} is {type(getattr(layer, name)).__name__}, not a plain RMSNorm"
    if not isinstance(layer.self_attn, HwtuneAttention):
        return "its attention stays the model's own (see above)"
    if not isinstance(layer.mlp, HwtuneMLP):
        return "its MLP stays the model's own (see above)"
    hooked = _hooked(layer, sorted(LAYER_CHILDREN))
    if hooked:
        return f"forward hooks on {hooked} (the fused layer does not call it)"
    return None


def _user_hooks(module: nn.Module) -> bool:
    """Whether `module` has forward (pre-)hooks besides transformers' own output recording
    (installed on decoder layers and attention modules; output_attentions / output_hidden_states
    are handled by the patched modules themselves)."""
    for attr in ("_forward_hooks", "_forward_pre_hooks"):
        for hook in (getattr(module, attr, None) or {}).values():
            if not getattr(hook, "__module__", "").startswith("transformers.utils.output_capturing"):
                return True
    return False


def _hooked(parent: nn.Module, names) -> str | None:
    """The first of `parent`'s children `names` with a user's forward hook, or None: a module the
    patched code does not call as a module (a projection computed inside a fused weight, a child
    of a fused layer), whose hooks would silently not run."""
    for name in names:
        child = getattr(parent, name, None)
        if child is not None and _user_hooks(child):
            return name
    return None


def _fuse(linears: list, shared: list):
    """One weight (and bias) for several nn.Linear: the concatenation becomes the storage and
    each original parameter a view of its rows (same Parameter object, same values)."""
    weight = torch.cat([lin.weight.detach() for lin in linears], dim=0)
    bias = None
    if any(lin.bias is not None for lin in linears):
        bias = torch.cat([lin.bias.detach() if lin.bias is not None else
                          torch.zeros(lin.out_features, dtype=weight.dtype, device=weight.device)
                          for lin in linears])
    row = 0
    for lin in linears:
        n = lin.out_features
        lin.weight.data = weight[row:row + n]
        shared.append(lin.weight)
        if lin.bias is not None:
            lin.bias.data = bias[row:row + n]
            shared.append(lin.bias)
        row += n
    # a fixed address: CUDA graphs read it in place instead of copying it in every replay
    torch._dynamo.mark_static_address(weight)
    if bias is not None:
        torch._dynamo.mark_static_address(bias)
    return weight, bias


# --- checks ----------------------------------------------------------------------------------
def _rope_problem(config) -> str | None:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default")) if isinstance(params, dict) else "default"
    if rope_type not in KNOWN_ROPE:
        return f"RoPE type {rope_type!r} is not one hwtune knows ({', '.join(KNOWN_ROPE)})"
    factor = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) \
        if isinstance(params, dict) else 1.0
    if factor not in (None, 1.0):
        return f"partial rotary (partial_rotary_factor {factor}): hwtune::rope rotates the whole head"
    return None


def _sliding_layers(config, n_layers: int) -> list[int]:
    types = getattr(config, "layer_types", None)
    if types:
        return [i for i, t in enumerate(types[:n_layers]) if t != "full_attention"]
    if getattr(config, "sliding_window", None) is not None and \
            getattr(config, "use_sliding_window", True):
        return list(range(n_layers))
    return []


def _weights_problem(model) -> str | None:
    qc = getattr(model.config, "quantization_config", None)
    if getattr(model, "hf_quantizer", None) is not None or qc:
        method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None)
        return f"quantized weights ({method or 'unknown method'}): hwtune's kernels take float weights"
    for name, module in model.named_modules():
        if hasattr(module, "_hf_hook"):
            return f"{name or 'the model'} is managed by accelerate hooks (offloaded or split " \
                   "device map): fused weights would escape them"
        if isinstance(module, nn.Linear):
            if type(module) is not nn.Linear:
                return f"{name} is {type(module).__name__}, not nn.Linear (quantized or wrapped weights)"
            if module.weight.dtype not in FLOAT_DTYPES or module.weight.device.type == "meta":
                return f"{name}.weight is {module.weight.dtype} on {module.weight.device.type}: " \
                       "hwtune's kernels take float weights on a real device"
    return None


def _is_rms_norm(module) -> bool:
    return type(module).__name__.endswith("RMSNorm") and isinstance(getattr(module, "weight", None), nn.Parameter) \
        and hasattr(module, "variance_epsilon") and module.weight.dim() == 1


def _is_gated_mlp(module, config) -> bool:
    return all(type(getattr(module, n, None)) is nn.Linear for n in ("gate_proj", "up_proj", "down_proj")) \
        and getattr(config, "hidden_act", None) in ACTIVATIONS


def _is_attention(module) -> bool:
    if not all(type(getattr(module, n, None)) is nn.Linear for n in ("q_proj", "k_proj", "v_proj", "o_proj")):
        return False
    if not all(hasattr(module, n) for n in ("head_dim", "layer_idx", "scaling", "config")):
        return False
    norms = [getattr(module, n, None) for n in ("q_norm", "k_norm")]
    return all(n is None or _is_rms_norm(n) for n in norms)


# --- patch / unpatch -------------------------------------------------------------------------
def patch(model, table: dispatch.DispatchTable | None = None, *,
          stock_through_ops: bool = False, fused: bool = True) -> PatchReport:
    """Swap the model's norms, MLPs, attention and lm_head for hwtune's in place (see the
    module docstring). `table`: the dispatch table to route through; None: the one set by
    kernelsearch.dispatch.use(). The table's entries are read now: a call whose shape has a
    tuned entry for this device goes through hwtune's op, any other runs the model's own code
    (fused projections still one GEMM) unless `stock_through_ops`, where every call goes through
    the ops and they run stock inside. `fused`: also swap each decoder layer for an
    HwtuneDecoderLayer where the table routes one of the fused kernels (rmsnorm_linear,
    linear_residual, rmsnorm_gate_up_swiglu) for it; False: exactly issue 12's patch (the
    separate norm / projection / SwiGLU ops). Returns what was patched and one line per part left
    stock."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a transformers model (a torch.nn.Module such as LlamaForCausalLM), "
                        f"got {type(model).__name__}")
    if getattr(model, "_hwtune_patch", None) is not None:
        raise ValueError("model is already patched by hwtune: unpatch(model) first")
    if table is not None and not isinstance(table, dispatch.DispatchTable):
        raise TypeError(f"table: expected a kernelsearch.dispatch.DispatchTable, got {type(table).__name__} "
                        "(DispatchTable.load(path) reads a table file, DispatchTable.for_device(state_dir) "
                        "this device's)")
    report = PatchReport(type(model).__name__)
    table = table if table is not None else dispatch.current()
    problem = None
    if table is None:
        problem = "no dispatch table (pass table= or call kernelsearch.dispatch.use(table)): " \
                  "the whole model stays stock"
    elif isinstance(getattr(model, "_orig_mod", None), nn.Module):   # torch.compile's OptimizedModule
        problem = f"{type(model).__name__} of {type(model._orig_mod).__name__} is torch.compile's wrapper: " \
                  "patch the model before compiling it (patch(model), then torch.compile(model)); " \
                  "the whole model stays stock"
    elif type(model).__name__ not in SUPPORTED or not hasattr(getattr(model, "model", None), "layers"):
        problem = f"model class {type(model).__name__}: hwtune patches {', '.join(SUPPORTED)}; " \
                  "the whole model stays stock"
    else:
        why = _weights_problem(model)
        if why:
            problem = why + "; the whole model stays stock"
    if problem:
        report.stock.append(problem)
        log.warning("hwtune patch %s: %s", report.model, problem)
        return report

    handle = ops.table_handle(table)
    # before any torch.compile of the model reaches the ops (see the function: minutes of a
    # first compile on torch 2.11 otherwise)
    ops.register_inductor_fallbacks()
    entries = list(table.entries)
    device_type = next(model.parameters()).device.type
    if entries:
        from kernelsearch.fingerprint import collect, fingerprint_id

        here = fingerprint_id(collect(device_type))
        if table.data.get("fingerprint_id") != here:
            report.stock.append(f"the table's entries are for {table.data.get('fingerprint_id')}, this "
                                f"{device_type} device is {here}: no tuned kernel, every op stays stock")
            entries = []
    stale = [e for e in entries if not table.usable(e)]
    if stale:
        # the op would run stock for them anyway (dispatch.route), but as one opaque node
        # under torch.compile, and the report would count them as tuned
        report.stock.append(f"{len(stale)} of {len(entries)} table entries left out: their kernel source is "
                            "missing or changed since the search (hash), or their plan does not fit it; "
                            "those shapes run the model's own code (search again to tune them)")
        entries = [e for e in entries if table.usable(e)]
    if table.invalid:
        report.stock.append(f"{len(table.invalid)} table entries did not parse and are left out "
                            f"({table.invalid[0][:120]})")
    if entries:
        # persistent workspaces (split-K arrival counters) allocated now, not inside the
        # first compiled call, where cudagraph trees would put them in their private pool
        table.prepare(next(model.parameters()).device)
    report.table = f"table {table.data.get('fingerprint_id') or '(empty)'}: {len(entries)} tuned shapes here"
    routes = _Routes(handle, entries, stock_through_ops)
    record = _Record(report=report, table=table, handle=handle)
    config = model.config
    modeling = __import__(type(model).__module__, fromlist=["eager_attention_forward"])
    attention_function = getattr(modeling, "eager_attention_forward", None)
    layers = list(model.model.layers)
    sliding = set(_sliding_layers(config, len(layers)))
    rope_problem = _rope_problem(config)
    if rope_problem:
        report.stock.append(f"attention in all {len(layers)} layers: {rope_problem}")
    elif sliding:
        window = getattr(config, "sliding_window", None)
        report.stock.append(f"attention in {len(sliding)} of {len(layers)} layers: sliding window {window} "
                            "(hwtune's decode attention has none)")
    if attention_function is None and not rope_problem:
        rope_problem = f"{type(model).__module__} has no eager_attention_forward"
        report.stock.append(f"attention: {rope_problem}")

    def swap(parent, name, new, part):
        original = getattr(parent, name)
        new.train(original.training)   # a new module starts in training mode
        _move_hooks(original, new)
        record.swaps.append((parent, name, original))
        setattr(parent, name, new)
        if part is not None:
            report.patched[part] = report.patched.get(part, 0) + 1

    skipped = {}
    for i, layer in enumerate(layers):
        for name in ("input_layernorm", "post_attention_layernorm"):
            module = getattr(layer, name, None)
            if module is not None and _is_rms_norm(module):
                swap(layer, name, HwtuneRMSNorm(module, routes), "rms_norm")
            else:
                skipped.setdefault(f"layers.*.{name}", type(module).__name__)
        mlp = getattr(layer, "mlp", None)
        hooked = mlp is not None and _hooked(mlp, ("gate_proj", "up_proj", "down_proj"))
        if hooked:
            report.stock.append(f"layers.{i}.mlp: forward hooks on {hooked}, which the fused gate|up "
                                "projection would not call; that MLP stays the model's own")
        elif mlp is not None and _is_gated_mlp(mlp, config):
            swap(layer, "mlp", HwtuneMLP(mlp, routes, record.shared), "mlp")
        else:
            skipped.setdefault("layers.*.mlp", f"{type(mlp).__name__} (act {getattr(config, 'hidden_act', '?')})")
        attn = getattr(layer, "self_attn", None)
        if rope_problem or i in sliding:
            continue
        hooked = attn is not None and _hooked(attn, ("q_proj", "k_proj", "v_proj", "o_proj"))
        if hooked:
            report.stock.append(f"layers.{i}.self_attn: forward hooks on {hooked}, which the fused q|k|v "
                                "projection would not call; that attention stays the model's own")
        elif attn is not None and _is_attention(attn):
            for norm in ("q_norm", "k_norm"):
                if getattr(attn, norm, None) is not None:
                    swap(attn, norm, HwtuneRMSNorm(getattr(attn, norm), routes), "rms_norm")
            first = "attention" not in report.patched
            new_attn = _own_class(HwtuneAttention, attn)(attn, routes, record.shared, attention_function,
                                                         guards_padding=first, fused=fused)
            swap(layer, "self_attn", new_attn, "attention")
            if new_attn._rope_kv_attn is None or new_attn._rope_kv_attn:
                report.patched[FUSED_ATTENTION] = report.patched.get(FUSED_ATTENTION, 0) + 1
        else:
            skipped.setdefault("layers.*.self_attn", type(attn).__name__)
    # the fused kernels, where the table routes any of them (or every shape goes through the ops)
    fused_kernels = set(FUSED_PARTS.values())
    if fused and (stock_through_ops or any(e.kernel in fused_kernels for e in entries)):
        not_fused: dict[str, list[int]] = {}
        for i, layer in enumerate(layers):
            why = _fused_layer_problem(layer)
            if why is None:
                new = _decoder_layer(layer, routes)
                parts = new.parts()
                if isinstance(layer.mlp, HwtuneMLP) and layer.mlp.gate_up_bias is not None:
                    not_fused.setdefault("fused norm+gate_up+swiglu: the MLP has gate/up biases "
                                         "(the kernel's SwiGLU epilogue takes none)", []).append(i)
                if any(parts.values()):
                    swap(model.model.layers, str(i), new, None)
                    for part, routed in parts.items():
                        if routed:
                            report.patched[part] = report.patched.get(part, 0) + 1
            else:
                not_fused.setdefault(why, []).append(i)
        for why, idx in not_fused.items():
            report.stock.append(f"fused kernels in {len(idx)} of {len(layers)} layers not used: {why}")
    if _is_rms_norm(getattr(model.model, "norm", None)):
        swap(model.model, "norm", HwtuneRMSNorm(model.model.norm, routes), "rms_norm")
    head = getattr(model, "lm_head", None)
    if type(head) is nn.Linear:
        swap(model, "lm_head", HwtuneLinear(head, routes), "lm_head")
    for where, what in skipped.items():
        report.stock.append(f"{where}: {what} does not match the Llama-family module hwtune replaces")
    model._hwtune_patch = record
    log.info("%s", report)
    for line in report.stock:
        log.warning("hwtune patch %s: %s", report.model, line)
    return report


_HOOK_DICTS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
               "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks")


def _move_hooks(src: nn.Module, dst: nn.Module) -> None:
    """Give `dst` the forward (pre-)hooks and backward hooks of `src` that it lacks (same handle
    ids, same order): where autograd records, the swapped module runs the original's forward,
    so a backward hook fires only where the swapped module is called."""
    for attr in _HOOK_DICTS:
        have, into = getattr(src, attr, None), getattr(dst, attr, None)
        if have is None or into is None:
            continue
        for key, hook in have.items():
            if key not in into:
                into[key] = hook
    if getattr(dst, "_is_full_backward_hook", None) is None:
        dst._is_full_backward_hook = getattr(src, "_is_full_backward_hook", None)


_LAYER_CLASSES: dict = {}


def _own_class(hwtune_cls, original: nn.Module):
    """`hwtune_cls` as a subclass of the original module's class too (transformers finds the
    layers and attention modules whose outputs it records by isinstance)."""
    return _class_of(hwtune_cls, type(original))


def _class_of(hwtune_cls, base):
    cls = _LAYER_CLASSES.get((hwtune_cls, base))
    if cls is None:
        cls = type(f"Hwtune{base.__name__}", (hwtune_cls, base), {"__module__": __name__})
        _LAYER_CLASSES[(hwtune_cls, base)] = cls
        globals()[cls.__name__] = cls   # where pickle (torch.save of the model) looks the class up
    return cls


def __getattr__(name: str):
    """A class `_own_class` makes at patch time (HwtuneLlamaDecoderLayer, HwtuneQwen2Attention...),
    looked up by pickle in a process that has patched no such model yet (torch.load of a patched
    model): made here the same way. Only for the supported models' layer and attention classes."""
    for suffix, hwtune_cls in (("DecoderLayer", HwtuneDecoderLayer), ("Attention", HwtuneAttention)):
        prefix = name[len("Hwtune"):-len(suffix)] if name.startswith("Hwtune") and name.endswith(suffix) else None
        if prefix and prefix + "ForCausalLM" in SUPPORTED:
            import importlib

            modeling = importlib.import_module(f"transformers.models.{prefix.lower()}.modeling_{prefix.lower()}")
            base = getattr(modeling, prefix + suffix, None)
            if isinstance(base, type) and issubclass(base, nn.Module):
                return _class_of(hwtune_cls, base)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _decoder_layer(original: nn.Module, routes: _Routes) -> HwtuneDecoderLayer:
    return _own_class(HwtuneDecoderLayer, original)(original, routes)


def unpatch(model) -> None:
    """Put back exactly the original modules (the same objects) and give every parameter that
    was a view of a fused weight its own storage again (same values)."""
    record = getattr(model, "_hwtune_patch", None)
    if record is None:
        return
    for parent, name, original in reversed(record.swaps):
        _move_hooks(getattr(parent, name), original)
        setattr(parent, name, original)
    for param in record.shared:
        param.data = param.data.clone()
    del model._hwtune_patch


def patched_report(model) -> PatchReport | None:
    record = getattr(model, "_hwtune_patch", None)
    return None if record is None else record.report


# --- the shapes a patched model looks up -----------------------------------------------------
def decode_shapes(config, batches, context, fused: bool = True) -> dict[str, list[dict]]:
    """Every (kernel, shape) a patched Llama-family model's one-token decode step on a StaticCache
    of `context` positions looks up in the table, per batch size: the keys of
    kernelsearch.dispatch.SHAPE_OF, what a search needs to cover. `batches` and `context`: an int
    or a list of ints. Qwen3's q_norm / k_norm add rmsnorm rows of head_dim (B*Hq and B*Hkv rows)
    and leave out rope_kv_write (the norms sit between the projection and RoPE). Both rope and
    rope_kv_write are listed: the step calls rope_kv_write where it is tuned, else rope. `fused`
    (patch(..., fused=True)): also the fused decoder-layer kernels' shapes, rmsnorm_linear
    {M, K, N} (input norm + q|k|v), rmsnorm_gate_up_swiglu {M, K, I} and linear_residual {M, K, N}
    (o_proj, down_proj), and rope_kv_attention {B, Hq, Hkv, D, S} and rmsnorm_qkv_rope {B, K, Hq,
    Hkv, D, S} (not Qwen3; the latter not with a q|k|v bias either, but listed); the unfused shapes
    stay listed (the path where a fused one loses)."""
    batches = [batches] if isinstance(batches, int) else list(batches)
    contexts = [context] if isinstance(context, int) else list(context)
    h, i = config.hidden_size, config.intermediate_size
    hq, hkv = config.num_attention_heads, config.num_key_value_heads
    d = getattr(config, "head_dim", None) or h // hq
    out: dict[str, list[dict]] = {k: [] for k in ("rmsnorm", "linear", "swiglu", "rope", "rope_kv_write",
                                                  "rope_kv_attention", "decode_attention", "rmsnorm_linear",
                                                  "rmsnorm_qkv_rope",
                                                  "rmsnorm_gate_up_swiglu", "linear_residual")}

    def add(kernel, shape):
        if shape not in out[kernel]:
            out[kernel].append(shape)

    per_head_norms = getattr(config, "model_type", "") == "qwen3"
    for b in batches:
        add("rmsnorm", {"M": b, "N": h})
        if per_head_norms:
            add("rmsnorm", {"M": b * hq, "N": d})
            add("rmsnorm", {"M": b * hkv, "N": d})
        for k, n in ((h, (hq + 2 * hkv) * d), (hq * d, h), (h, 2 * i), (i, h), (h, config.vocab_size)):
            add("linear", {"M": b, "K": k, "N": n})     # qkv, o, gate|up, down, lm_head
        add("swiglu", {"M": b, "I": i})
        if fused:
            add("rmsnorm_linear", {"M": b, "K": h, "N": (hq + 2 * hkv) * d})
            add("rmsnorm_gate_up_swiglu", {"M": b, "K": h, "I": i})
            add("linear_residual", {"M": b, "K": hq * d, "N": h})    # o_proj + residual
            add("linear_residual", {"M": b, "K": i, "N": h})         # down_proj + residual
        add("rope", {"B": b, "Hq": hq, "Hkv": hkv, "D": d})
        for s in contexts:
            if not per_head_norms:
                add("rope_kv_write", {"B": b, "Hq": hq, "Hkv": hkv, "D": d, "S": s})
                if fused:
                    add("rope_kv_attention", {"B": b, "Hq": hq, "Hkv": hkv, "D": d, "S": s})
                    add("rmsnorm_qkv_rope", {"B": b, "K": h, "Hq": hq, "Hkv": hkv, "D": d, "S": s})
            add("decode_attention", {"B": b, "Hq": hq, "Hkv": hkv, "S": s, "D": d})
    return {k: v for k, v in out.items() if v}


__all__ = ["patch", "unpatch", "patched_report", "PatchReport", "HwtuneRMSNorm", "HwtuneLinear",
           "HwtuneMLP", "HwtuneAttention", "HwtuneDecoderLayer", "FUSED_PARTS", "SUPPORTED", "KNOWN_ROPE",
           "decode_shapes"]
