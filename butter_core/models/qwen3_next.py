"""Qwen3-Next (Hugging Face ``Qwen3NextForCausalLM``): gated delta rule layers and gated attention, MoE.

Most layers are linear-attention layers (Gated DeltaNet), every ``full_attention_interval``-th
one (or as ``layer_types`` says) a full attention layer; each is followed by a sparse MoE
block (or, for ``mlp_only_layers`` and off the ``decoder_sparse_step``, a dense SwiGLU MLP).

* Linear attention: ``in_proj_qkvz`` gives the queries, keys and values the causal
  convolution runs over, and the output gate ``z``; ``in_proj_ba`` the write rates ``b`` and
  decays ``a``. The convolution and the delta-rule scan run through the layer's cache
  (``butter_core.recurrent.GatedDeltaMixer``; without caches, from the zero state); then a
  gated RMSNorm per value head (normalised, times its weight, times ``silu(z)``) and
  ``out_proj``.
* Full attention: ``q_proj`` gives each head's query and an output gate side by side; RMSNorm
  on queries and keys per head, RoPE on the first ``head_dim · partial_rotary_factor`` dims
  only, attention through the layer's ``AttentionCache`` (every attention scheme and eviction
  applies), the output times ``sigmoid(gate)`` before ``o_proj``.
* MoE: a softmax router over all experts picks ``num_experts_per_tok`` (renormalised with
  ``norm_topk_prob``); SwiGLU experts (``butter_core.models.moe``) plus a shared expert
  scaled by ``sigmoid(shared_expert_gate(x))``.

Qwen3-Next's RMSNorms (the blocks', the final one, ``q_norm`` and ``k_norm``) multiply by
``1 + weight``: the model holds ``1 + weight`` and runs plain RMSNorms. Checkpoints load in
both layouts: Hugging Face's (per-expert ``mlp.experts.N.*`` tensors, or transformers' fused
``experts.gate_up_proj``, stored norm weights ``w``, ``conv1d.weight`` ``[C, 1, K]``) and
``mlx_lm.convert``'s (``mlp.switch_mlp.*`` stacked, ``1 + w`` stored, ``[C, K, 1]``,
optionally MLX-quantized). The model keeps the projections' rows in its own order: the
checkpoints interleave ``q | k | v | z`` per key head (and ``b | a``), the model holds all
queries, then keys, values and gates, so the convolution's input is a slice of the projection.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import mlx.core as mx
import mlx.nn as nn

from butter_core.cache import AttentionCache, LayerCache, LayerSpec, Mask
from butter_core.errors import ModelLoadError
from butter_core.loading.checkpoint import TensorEntry
from butter_core.models.base import MLP, LanguageModel, RoPE, RopeConfig, attend_through, read_rope
from butter_core.models.config_values import ConfigReader
from butter_core.models.moe import SwiGLUExperts, experts_stacked, sliced_entry, softmax_top_k
from butter_core.recurrent import GATED_DELTA, GatedDeltaMixer, StateCache, StateSpec

ARCHITECTURES = ("Qwen3NextForCausalLM",)
MODEL_TYPES = ("qwen3_next",)
LINEAR_ATTENTION, FULL_ATTENTION = "linear_attention", "full_attention"
LAYER_TYPES = (LINEAR_ATTENTION, FULL_ATTENTION)
ONE_PLUS_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight", ".q_norm.weight", ".k_norm.weight")
"""Norm weights Hugging Face stores as ``w`` for ``1 + w`` (with ``model.norm.weight``)."""


@attrs.frozen
class GatedDeltaShape:
    """One linear-attention layer's sizes."""

    hidden_size: int
    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int
    norm_eps: float

    @property
    def keys(self) -> int:
        return self.key_heads * self.key_dim

    @property
    def values(self) -> int:
        return self.value_heads * self.value_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.keys + self.values

    def state_spec(self, dtype: mx.Dtype, layer_index: int) -> StateSpec:
        return StateSpec(GATED_DELTA, self.conv_dim, self.conv_kernel, (self.value_heads, self.key_dim, self.value_dim),
                         dtype=dtype, layer_index=layer_index)  # fmt: skip

    def qkvz_order(self) -> mx.array:
        """Checkpoint rows of ``in_proj_qkvz`` in the model's order: per key head the checkpoint
        holds ``q (Dk) | k (Dk) | v (r·Dv) | z (r·Dv)`` (``r`` value heads per key head); the
        model all queries, then all keys, values and gates."""
        r = self.value_heads // self.key_heads
        parts = (self.key_dim, self.key_dim, r * self.value_dim, r * self.value_dim)
        return _regrouped(self.key_heads, parts)

    def ba_order(self) -> mx.array:
        """Checkpoint rows of ``in_proj_ba`` (per key head ``b (r) | a (r)``) as all ``b``, then all ``a``."""
        r = self.value_heads // self.key_heads
        return _regrouped(self.key_heads, (r, r))


def _regrouped(groups: int, parts: Sequence[int]) -> mx.array:
    """Row indices taking ``groups`` blocks of ``parts`` (sizes) to each part's rows of every group in turn."""
    block, starts = sum(parts), [sum(parts[:i]) for i in range(len(parts))]
    return mx.array([g * block + start + i for start, size in zip(starts, parts, strict=True) for g in range(groups)
                     for i in range(size)], dtype=mx.uint32)  # fmt: skip


@attrs.frozen
class Qwen3NextArgs:
    """What the model reads from ``config.json``."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    rms_norm_eps: float
    layer_types: tuple[str, ...]
    sparse_layers: tuple[bool, ...]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rotary_dim: int
    rope: RopeConfig
    attention_bias: bool
    linear: GatedDeltaShape
    intermediate_size: int | None
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int | None
    shared_expert_intermediate_size: int | None
    norm_topk_prob: bool


@partial(mx.compile, shapeless=True)
def _sigmoid_gated(x: mx.array, gate: mx.array) -> mx.array:
    return x * mx.sigmoid(gate)


@partial(mx.compile, shapeless=True)
def _silu_gated(x: mx.array, gate: mx.array) -> mx.array:
    return x * (gate * mx.sigmoid(gate))


@partial(mx.compile, shapeless=True)
def _add_gated(x: mx.array, y: mx.array, gate: mx.array) -> mx.array:
    return x + y * mx.sigmoid(gate)


class GatedDeltaNet(nn.Module):
    """A linear-attention layer (Hugging Face's ``linear_attn``)."""

    def __init__(self, shape: GatedDeltaShape):
        super().__init__()
        s = self.shape = shape
        self.in_proj_qkvz = nn.Linear(s.hidden_size, s.conv_dim + s.values, bias=False)
        self.in_proj_ba = nn.Linear(s.hidden_size, 2 * s.value_heads, bias=False)
        self.conv1d = ConvWeight(s.conv_dim, s.conv_kernel)
        self.dt_bias = mx.ones((s.value_heads,))
        self.A_log = mx.zeros((s.value_heads,))
        self.norm = nn.RMSNorm(s.value_dim, eps=s.norm_eps)
        self.out_proj = nn.Linear(s.values, s.hidden_size, bias=False)

    def mixer(self) -> GatedDeltaMixer:
        s = self.shape
        return GatedDeltaMixer(self.conv1d.weight, None, self.A_log, self.dt_bias, key_heads=s.key_heads,
                               value_heads=s.value_heads, key_dim=s.key_dim, value_dim=s.value_dim)  # fmt: skip

    def __call__(self, x: mx.array, cache: StateCache | None) -> mx.array:
        s = self.shape
        batch, tokens, _ = x.shape
        projected = self.in_proj_qkvz(x)
        qkv, z = projected[..., : s.conv_dim], projected[..., s.conv_dim :]
        ba = self.in_proj_ba(x)
        b, a = ba[..., : s.value_heads], ba[..., s.value_heads :]
        mixer = self.mixer()
        out = mixer.reference(None, None, qkv, a, b)[0] if cache is None else cache.update_and_mix(mixer, qkv, a, b)
        out = _silu_gated(self.norm(out), z.reshape(batch, tokens, s.value_heads, s.value_dim))
        return self.out_proj(out.reshape(batch, tokens, s.values))


class ConvWeight(nn.Module):
    """The depthwise causal convolution's taps, ``weight`` ``[C, K]`` (the cache or the mixer's
    reference applies them; no bias)."""

    def __init__(self, channels: int, kernel: int):
        super().__init__()
        self.weight = mx.zeros((channels, kernel))


class GatedAttention(nn.Module):
    """Full attention with an output gate (Hugging Face's ``self_attn``), K/V through an ``AttentionCache``."""

    def __init__(self, args: Qwen3NextArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.num_attention_heads, args.num_key_value_heads, args.head_dim
        self.scale = args.head_dim**-0.5
        hidden, bias = args.hidden_size, args.attention_bias
        self.q_proj = nn.Linear(hidden, 2 * self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, hidden, bias=bias)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=args.rms_norm_eps)
        self.k_norm = nn.RMSNorm(self.head_dim, eps=args.rms_norm_eps)
        self.rope = RoPE(args.rotary_dim, args.rope)

    def __call__(self, x: mx.array, cache: AttentionCache | None, mask: Mask = "causal") -> mx.array:
        batch, tokens, _ = x.shape
        queries = self.q_proj(x).reshape(batch, tokens, self.n_heads, 2 * self.head_dim)
        queries, gate = queries[..., : self.head_dim], queries[..., self.head_dim :]
        q = self.q_norm(queries).transpose(0, 2, 1, 3)
        k = self.k_norm(self.k_proj(x).reshape(batch, tokens, self.n_kv_heads, self.head_dim)).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(batch, tokens, self.n_kv_heads, self.head_dim).transpose(0, 2, 1, 3)
        offset = 0 if cache is None else cache.absolute_position
        q, k = self.rope(q, offset), self.rope(k, offset)
        out = attend_through(cache, q, k, v, scale=self.scale, mask=mask)
        out = _sigmoid_gated(out.transpose(0, 2, 1, 3), gate)
        return self.o_proj(out.reshape(batch, tokens, -1))


class SparseMoeBlock(nn.Module):
    """Routed SwiGLU experts plus a sigmoid-gated shared expert (Hugging Face's MoE ``mlp``)."""

    def __init__(self, args: Qwen3NextArgs):
        super().__init__()
        self.top_k, self.normalize = args.num_experts_per_tok, args.norm_topk_prob
        self.gate = nn.Linear(args.hidden_size, args.num_experts, bias=False)
        self.switch_mlp = SwiGLUExperts(args.hidden_size, args.moe_intermediate_size, args.num_experts)
        self.shared_expert = MLP(args.hidden_size, args.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(args.hidden_size, 1, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        indices, weights = softmax_top_k(self.gate(x), self.top_k, normalize=self.normalize)
        routed = self.switch_mlp(x, indices, weights)
        return _add_gated(routed, self.shared_expert(x), self.shared_expert_gate(x))


class DecoderLayer(nn.Module):
    """``h = x + mixer(norm(x))``, then ``h + mlp(norm(h))``; the mixer linear or full attention."""

    def __init__(self, args: Qwen3NextArgs, index: int):
        super().__init__()
        self.layer_type = args.layer_types[index]
        if self.layer_type == LINEAR_ATTENTION:
            self.linear_attn = GatedDeltaNet(args.linear)
        else:
            self.self_attn = GatedAttention(args)
        self.mlp = SparseMoeBlock(args) if args.sparse_layers[index] else MLP(args.hidden_size, args.intermediate_size)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, cache: LayerCache | None, mask: Mask = "causal") -> mx.array:
        normed = self.input_layernorm(x)
        if self.layer_type == LINEAR_ATTENTION:
            h = x + self.linear_attn(normed, cache)
        else:
            h = x + self.self_attn(normed, cache, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class Qwen3NextModel(LanguageModel):
    """A Qwen3-Next language model: per layer an attention cache (full-attention layers) or a gated
    delta state cache (linear-attention layers)."""

    def __init__(self, args: Qwen3NextArgs):
        super().__init__(args, [DecoderLayer(args, index) for index in range(args.num_hidden_layers)])

    def layer_specs(self, max_positions: int) -> list[LayerSpec | StateSpec]:
        """A ``LayerSpec`` holding ``max_positions`` per full-attention layer, a ``StateSpec`` per linear one."""
        a = self.args
        return [
            a.linear.state_spec(self.dtype, index) if kind == LINEAR_ATTENTION
            else self.attention_spec(index, max_positions)
            for index, kind in enumerate(a.layer_types)
        ]  # fmt: skip

    def describe(self) -> str:
        a, s = self.args, self.args.linear
        full, sparse = a.layer_types.count(FULL_ATTENTION), sum(a.sparse_layers)
        mlp = f"{sparse} MoE ({a.num_experts} experts, top {a.num_experts_per_tok}, shared expert)" if sparse else ""
        if sparse < a.num_hidden_layers:
            mlp += f"{', ' if mlp else ''}{a.num_hidden_layers - sparse} dense MLP"
        return (
            f"family {a.model_type}: {a.num_hidden_layers} layers ({a.num_hidden_layers - full} gated delta, {full} "
            f"gated attention; {mlp}), hidden {a.hidden_size}, attention {a.num_attention_heads} heads "
            f"({a.num_key_value_heads} KV) of {a.head_dim} (RoPE on {a.rotary_dim}), gated delta {s.key_heads} key / "
            f"{s.value_heads} value heads of {s.key_dim}/{s.value_dim}, vocab {a.vocab_size}, "
            f"max_position_embeddings {a.max_position_embeddings}"
        )

    def checkpoint_layout(self, entries: dict[str, TensorEntry]) -> dict[str, Any]:
        return checkpoint_layout(self.args, entries)




def stored_by_mlx_lm(entries: dict[str, TensorEntry]) -> bool:
    """Whether ``entries`` are ``mlx_lm.convert``'s layout (stacked ``switch_mlp`` experts,
    ``conv1d.weight`` ``[C, K, 1]``, quantized) rather than Hugging Face's; a mix is an error."""
    signals: dict[bool, str] = {}
    for name, entry in entries.items():
        if ".switch_mlp." in name or name.endswith(".scales"):
            signals.setdefault(True, name)
        elif ".mlp.experts." in name:
            signals.setdefault(False, name)
        elif name.endswith("conv1d.weight") and len(entry.shape) == 3 and entry.shape[1:] != (1, 1):
            signals.setdefault(entry.shape[1] != 1, name)
    if len(signals) > 1:
        file = entries[signals[True]].file
        raise ModelLoadError(
            f"{file}: mixes mlx-lm's layout ({signals[True]!r}) with Hugging Face's ({signals[False]!r})"
        )
    return signals.get(True, False)


def checkpoint_layout(args: Qwen3NextArgs, entries: dict[str, TensorEntry]) -> dict[str, Any]:
    """The model's tensors from a checkpoint in either layout (see the module's docstring)."""
    from butter_core.loading.weights import Derived

    mlx_lm = stored_by_mlx_lm(entries)
    qkvz, ba = args.linear.qkvz_order(), args.linear.ba_order()
    adapted: dict[str, Any] = {}
    experts: dict[str, TensorEntry] = {}
    for name, entry in entries.items():
        if name.startswith("mtp."):  # the multi-token-prediction head, unused here
            continue
        if ".mlp.experts." in name:
            experts[name] = entry
        elif ".linear_attn.in_proj_qkvz." in name or ".linear_attn.in_proj_ba." in name:
            order = qkvz if "in_proj_qkvz" in name else ba
            adapted[name] = _rows_taken(entry, order, Derived)
        elif name.endswith("conv1d.weight") and len(entry.shape) == 3 and entry.shape[2 if mlx_lm else 1] == 1:
            seen = attrs.evolve(entry, shape=(entry.shape[0], entry.shape[1] * entry.shape[2]))
            adapted[name] = (seen, Derived((entry,), lambda arrays: arrays[0].reshape(arrays[0].shape[0], -1)))
        elif not mlx_lm and (name == "model.norm.weight" or name.endswith(ONE_PLUS_NORMS)):
            adapted[name] = (entry, Derived((entry,), _one_plus))
        else:
            adapted[name] = entry
    if experts:
        adapted.update(_stacked_experts(args, experts))
    return adapted


def _one_plus(arrays: list[mx.array]) -> mx.array:
    """``1 + w`` computed in float32, in the stored dtype."""
    return (arrays[0].astype(mx.float32) + 1.0).astype(arrays[0].dtype)


def _rows_taken(entry: TensorEntry, order: mx.array, derived) -> tuple[TensorEntry, Any]:
    """``entry`` (a projection's weight, or its quantization's scales or biases) with its rows in ``order``."""
    if entry.shape[0] != order.size:
        return entry  # the loader names the wrong shape
    return entry, derived((entry,), lambda arrays: mx.take(arrays[0], order, axis=0))


def _stacked_experts(args: Qwen3NextArgs, experts: dict[str, TensorEntry]) -> dict[str, Any]:
    """Hugging Face's experts as the model's stacked ``switch_mlp`` tensors: per expert
    ``experts.N.{gate,up,down}_proj.weight``, or transformers' fused ``experts.gate_up_proj``
    ``[E, 2I, H]`` and ``experts.down_proj`` ``[E, H, I]``."""
    marker, target = ".mlp.experts.", ".mlp.switch_mlp"
    fused: dict[str, Any] = {}
    per_expert: dict[str, TensorEntry] = {}
    for name, entry in experts.items():
        layer, rest = name.split(marker, 1)
        if rest == "gate_up_proj":
            half = entry.shape[1] // 2 if len(entry.shape) == 3 else 0
            fused[f"{layer}{target}.gate_proj.weight"] = sliced_entry(entry, 1, 0, half)
            fused[f"{layer}{target}.up_proj.weight"] = sliced_entry(entry, 1, half, 2 * half)
        elif rest == "down_proj":
            fused[f"{layer}{target}.down_proj.weight"] = entry
        else:
            per_expert[name] = entry
    names = {p: p for p in ("gate_proj", "up_proj", "down_proj")}
    stacked = experts_stacked(per_expert, marker, target, names, args.num_experts)
    both = sorted(set(stacked) & set(fused))
    if both:
        layer = both[0].split(target)[0]
        raise ModelLoadError(f"{experts[next(n for n in experts if n.startswith(layer + marker))].file}: "
                             f"'{layer}{marker.rstrip('.')}' holds both fused and per-expert tensors")  # fmt: skip
    return {**stacked, **fused}


def _read_rope(read: ConfigReader, head_dim: int) -> tuple[RopeConfig, int]:
    """The rotary embedding and how many of each head's dims it rotates, from the published spelling
    (``rope_theta``, ``partial_rotary_factor``, ``rope_scaling``) or transformers 5's
    (``rope_parameters``)."""
    rope, values = read_rope(read)
    if rope.type != "default" and "factor" not in values:
        read.fail(f"rope type {rope.type!r} needs a 'factor'")
    partial = values.get("partial_rotary_factor", read.value("partial_rotary_factor", 0.25))
    try:
        rotary_dim = int(head_dim * float(partial))
    except (TypeError, ValueError) as exc:
        read.fail(f"invalid rope parameters: {exc}")
    if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > head_dim:
        read.fail(f"partial_rotary_factor {partial!r} of head_dim {head_dim} gives {rotary_dim} rotary dims; "
                  "need an even number from 2 to head_dim")  # fmt: skip
    return rope, rotary_dim


def _read_layer_types(read: ConfigReader, layers: int) -> tuple[str, ...]:
    types = read.value("layer_types", None)
    if types is None:
        interval = read.int("full_attention_interval", 4)
        types = [FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(layers)]
    if not isinstance(types, list | tuple) or len(types) != layers or not set(types) <= {*LAYER_TYPES}:
        read.fail(f"layer_types must list {layers} entries of {' or '.join(map(repr, LAYER_TYPES))}; got {types!r}")
    return tuple(types)


def build(config: dict[str, Any], source: Path) -> Qwen3NextModel:
    """A Qwen3-Next model shaped by ``config`` (read from ``source``), with uninitialised weights."""
    read = ConfigReader(config, source)
    read.require_silu()
    hidden, layers = read.int("hidden_size"), read.int("num_hidden_layers")
    heads, kv_heads = read.int("num_attention_heads"), read.int("num_key_value_heads")
    if heads % kv_heads:
        read.fail(f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})")
    head_dim = read.int("head_dim", hidden // heads)
    rope, rotary_dim = _read_rope(read, head_dim)
    layer_types = _read_layer_types(read, layers)
    eps = read.float("rms_norm_eps", 1e-6)

    linear = GatedDeltaShape(hidden_size=hidden, key_heads=1, value_heads=1, key_dim=1, value_dim=1, conv_kernel=1,
                             norm_eps=eps)  # fmt: skip
    if LINEAR_ATTENTION in layer_types:
        linear = GatedDeltaShape(
            hidden_size=hidden,
            key_heads=read.int("linear_num_key_heads"),
            value_heads=read.int("linear_num_value_heads"),
            key_dim=read.int("linear_key_head_dim"),
            value_dim=read.int("linear_value_head_dim"),
            conv_kernel=read.int("linear_conv_kernel_dim", 4),
            norm_eps=eps,
        )
        if linear.value_heads % linear.key_heads:
            read.fail(f"linear_num_value_heads ({linear.value_heads}) must be a multiple of "
                      f"linear_num_key_heads ({linear.key_heads})")  # fmt: skip

    experts = read.count("num_experts", 0)
    step = read.int("decoder_sparse_step", 1)
    dense_only = read.value("mlp_only_layers", [])
    if not isinstance(dense_only, list | tuple) or not all(isinstance(i, int) for i in dense_only):
        read.fail(f"mlp_only_layers must be a list of layer indices, got {dense_only!r}")
    sparse = tuple(i not in dense_only and experts > 0 and (i + 1) % step == 0 for i in range(layers))
    top_k = read.int("num_experts_per_tok") if any(sparse) else 1
    if any(sparse) and top_k > experts:
        read.fail(f"num_experts_per_tok ({top_k}) exceeds num_experts ({experts})")

    return Qwen3NextModel(Qwen3NextArgs(
        model_type=read.str("model_type"),
        vocab_size=read.int("vocab_size"),
        hidden_size=hidden,
        num_hidden_layers=layers,
        max_position_embeddings=read.int("max_position_embeddings", 32768),
        tie_word_embeddings=read.bool("tie_word_embeddings", False),
        rms_norm_eps=eps,
        layer_types=layer_types,
        sparse_layers=sparse,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rotary_dim=rotary_dim,
        rope=rope,
        attention_bias=read.bool("attention_bias", False),
        linear=linear,
        intermediate_size=read.int("intermediate_size") if not all(sparse) else None,
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=read.int("moe_intermediate_size") if any(sparse) else None,
        shared_expert_intermediate_size=read.int("shared_expert_intermediate_size") if any(sparse) else None,
        norm_topk_prob=read.bool("norm_topk_prob", True),
    ))  # fmt: skip
