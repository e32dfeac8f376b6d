"""Granite 4.0-H (Hugging Face ``GraniteMoeHybridForCausalLM``): Mamba2 and attention layers, MoE MLPs.

Each layer is ``h = x + mixer(norm(x))·r`` then ``h + mlp(norm(h))·r`` (``r`` the config's
``residual_multiplier``), where the mixer is a Mamba2 mixer (``mamba``, the same
``Mamba2Layer`` as the Mamba2 family, run through the layer's state cache) or attention
(``self_attn``, through the layer's KV cache), by the config's ``layer_types`` ("mamba" /
"attention" as published, "linear_attention" / "full_attention" as transformers 5 writes
them). The MLP is a top-k mixture of SwiGLU experts plus a shared SwiGLU MLP; a config with
``num_local_experts: 0`` (the dense Granite 4.0 models) has the shared MLP alone.

Granite's multipliers: embeddings are scaled by ``embedding_multiplier`` (the tied output
projection uses the raw matrix), attention scores by ``attention_multiplier`` (not
``head_dim ** -0.5``) and logits divided by ``logits_scaling``. Attention applies RoPE only
when ``position_embedding_type`` is "rope" (transformers' rule; Granite 4.0-H ships NoPE).
The router takes the top ``num_experts_per_tok`` raw logits and softmaxes over those alone.

The experts are ``moe.SwiGLUExperts`` (batched ``gather_mm`` / ``gather_qmm``, tokens sorted
by expert for a prompt's chunk), the router ``moe.top_k_softmax``. Parameters carry mlx-lm's
names (``block_sparse_moe.switch_mlp.{gate,up,down}_proj`` stacked ``[experts, out, in]``;
``mlp.*`` in a dense model), so an ``mlx_lm.convert`` checkpoint, float or MLX-quantized with
per-module overrides (the router at 8 bits), loads as stored; ``checkpoint_layout`` reads
Hugging Face's layout into them (``input_linear`` ``[E, 2I, H]`` split into the gate's and
the up projection's rows, ``output_linear`` as the down projection; a dense model's
``shared_mlp`` split likewise) and either layout's convolution weights
(``mamba2.conv_weights_as_stored``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import mlx.core as mx
from mlx import nn

from butter_core.cache import LayerCache, LayerSpec, Mask
from butter_core.loading.checkpoint import TensorEntry
from butter_core.models.base import MLP, GroupedAttention, LanguageModel, RopeConfig, read_rope
from butter_core.models.config_values import ConfigReader
from butter_core.models.mamba2 import Mamba2Layer, Mamba2Shape, conv_weights_as_stored, read_mamba2_shape
from butter_core.models.moe import SwiGLUExperts, sliced_entry, swiglu, top_k_softmax
from butter_core.recurrent import StateSpec

ARCHITECTURES = ("GraniteMoeHybridForCausalLM",)
MODEL_TYPES = ("granitemoehybrid",)
MAMBA, ATTENTION = "mamba", "attention"
LAYER_TYPE_SPELLINGS = {"mamba": MAMBA, "linear_attention": MAMBA, "attention": ATTENTION, "full_attention": ATTENTION}
"""``layer_types`` values: published checkpoints (and mlx-lm) write "mamba"/"attention", transformers 5
"linear_attention"/"full_attention"."""


@attrs.frozen
class GraniteArgs:
    """What the model reads from ``config.json``."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    rms_norm_eps: float
    layer_types: tuple[str, ...]
    embedding_multiplier: float
    residual_multiplier: float
    attention_multiplier: float
    logits_scaling: float
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    attention_bias: bool
    rope: RopeConfig | None
    num_experts: int
    """0: a dense model (the shared MLP alone)."""
    experts_per_token: int
    intermediate_size: int
    """Each expert's hidden size."""
    shared_intermediate_size: int
    mamba: Mamba2Shape | None
    """None when no layer is a Mamba2 layer."""

    def layer_indices(self, kind: str) -> list[int]:
        return [index for index, layer_type in enumerate(self.layer_types) if layer_type == kind]


class Router(nn.Module):
    """Hugging Face's ``router``: top-k of the raw logits (float32), softmax over the k chosen."""

    def __init__(self, hidden: int, experts: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.layer = nn.Linear(hidden, experts, bias=False)

    def __call__(self, x: mx.array) -> tuple[mx.array, mx.array]:
        indices, weights = top_k_softmax(self.layer(x).astype(mx.float32), self.top_k)
        return indices, weights.astype(x.dtype)


class MoE(nn.Module):
    """Hugging Face's ``block_sparse_moe``: the router's k experts, weighted and summed."""

    def __init__(self, args: GraniteArgs):
        super().__init__()
        self.router = Router(args.hidden_size, args.num_experts, args.experts_per_token)
        self.switch_mlp = SwiGLUExperts(args.hidden_size, args.intermediate_size, args.num_experts)

    def __call__(self, x: mx.array) -> mx.array:
        indices, weights = self.router(x)
        return self.switch_mlp(x, indices, weights)


class SharedMLP(nn.Module):
    """The shared expert: ``input_linear`` projects to the gate then the up half."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.input_linear = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.output_linear = nn.Linear(intermediate, hidden, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        gate, up = mx.split(self.input_linear(x), 2, axis=-1)
        return self.output_linear(swiglu(gate, up))


class GraniteLayer(nn.Module):
    """One decoder layer: a Mamba2 or attention mixer, then the MoE plus shared MLP, both residuals scaled."""

    def __init__(self, args: GraniteArgs, layer_type: str):
        super().__init__()
        self.layer_type = layer_type
        self.residual_multiplier = args.residual_multiplier
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        if layer_type == MAMBA:
            self.mamba = Mamba2Layer(args.mamba)
        else:
            self.self_attn = GroupedAttention(
                args.hidden_size, args.num_attention_heads, args.num_key_value_heads, args.head_dim,
                scale=args.attention_multiplier, bias=args.attention_bias, rope=args.rope,
            )  # fmt: skip
        if args.num_experts:
            self.block_sparse_moe = MoE(args)
            self.shared_mlp = SharedMLP(args.hidden_size, args.shared_intermediate_size)
        else:
            self.mlp = MLP(args.hidden_size, args.shared_intermediate_size)

    def __call__(self, x: mx.array, cache: LayerCache | None, mask: Mask = "causal") -> mx.array:
        normed = self.input_layernorm(x)
        if self.layer_type == MAMBA:
            mixed = self.mamba(normed, cache)
        else:
            mixed = self.self_attn(normed, cache, mask)
        h = x + mixed * self.residual_multiplier
        normed = self.post_attention_layernorm(h)
        if "mlp" in self:
            out = self.mlp(normed)
        else:
            out = self.block_sparse_moe(normed) + self.shared_mlp(normed)
        return h + out * self.residual_multiplier


class GraniteMoeHybridModel(LanguageModel):
    """A Granite 4.0-H language model: a state cache per Mamba2 layer, a KV cache per attention layer."""

    def __init__(self, args: GraniteArgs):
        super().__init__(args, [GraniteLayer(args, layer_type) for layer_type in args.layer_types])

    def layer_specs(self, max_positions: int) -> list[LayerSpec | StateSpec]:
        """A Mamba2 layer's state, or an attention layer's KV cache holding up to ``max_positions``."""
        a = self.args
        return [
            a.mamba.state_spec(self.dtype, index) if layer_type == MAMBA
            else self.attention_spec(index, max_positions)
            for index, layer_type in enumerate(a.layer_types)
        ]  # fmt: skip

    def describe(self) -> str:
        a = self.args
        mambas, attentions = len(a.layer_indices(MAMBA)), len(a.layer_indices(ATTENTION))
        parts = [f"family {a.model_type}: {a.num_hidden_layers} layers ({mambas} Mamba2, {attentions} attention)",
                 f"hidden {a.hidden_size}"]  # fmt: skip
        if attentions:
            position = "NoPE" if a.rope is None else f"RoPE theta {a.rope.theta:g}"
            parts.append(f"attention {a.num_attention_heads} heads ({a.num_key_value_heads} KV) of {a.head_dim}, {position}")
        if mambas:
            m = a.mamba
            parts.append(f"Mamba2 {m.num_heads} heads of {m.head_dim}, state {m.state_size} in {m.n_groups} groups")
        if a.num_experts:
            parts.append(f"MoE top-{a.experts_per_token} of {a.num_experts} experts of {a.intermediate_size} "
                         f"+ shared MLP of {a.shared_intermediate_size}")  # fmt: skip
        else:
            parts.append(f"dense MLP of {a.shared_intermediate_size}")
        parts.append(f"vocab {a.vocab_size}, max_position_embeddings {a.max_position_embeddings}")
        return ", ".join(parts)

    def embed(self, token_ids: mx.array) -> mx.array:
        """The first layer's input: the embeddings times ``embedding_multiplier``."""
        return self.model.embed_tokens(token_ids) * self.args.embedding_multiplier

    def logits(self, hidden: mx.array) -> mx.array:
        """Vocabulary logits divided by ``logits_scaling`` (the raw tied embedding where the config ties them)."""
        return super().logits(hidden) / self.args.logits_scaling

    def checkpoint_layout(self, entries: dict[str, TensorEntry]) -> dict[str, Any]:
        """Hugging Face's MLP tensors read as mlx-lm's (this model's) names; either conv layout."""
        return hf_mlp_as_mlx(conv_weights_as_stored(entries), dense=not self.args.num_experts)


QUANTIZED_PARTS = ("weight", "scales", "biases")


def hf_mlp_as_mlx(entries: dict[str, Any], *, dense: bool) -> dict[str, Any]:
    """``entries`` with Hugging Face's ``block_sparse_moe.input_linear`` ``[E, 2I, H]`` split into
    ``switch_mlp.gate_proj`` (the first I rows) and ``up_proj``, ``output_linear`` read as
    ``switch_mlp.down_proj``; in a dense model ``shared_mlp`` as ``mlp.{gate,up,down}_proj``.
    (Rows split the same way in a quantized triplet, so ``.scales``/``.biases`` follow ``.weight``.)"""
    fused, down = ("shared_mlp.input_linear", "shared_mlp.output_linear") if dense else (
        "block_sparse_moe.input_linear", "block_sparse_moe.output_linear")  # fmt: skip
    target = "mlp" if dense else "block_sparse_moe.switch_mlp"
    adapted: dict[str, Any] = {}
    for name, entry in entries.items():
        prefix, _, part = name.rpartition(".")
        if part in QUANTIZED_PARTS and prefix.endswith(fused) and isinstance(entry, TensorEntry) and entry.shape[-2] % 2 == 0:
            layer, rows = prefix.removesuffix(fused), entry.shape[-2] // 2
            adapted[f"{layer}{target}.gate_proj.{part}"] = sliced_entry(entry, -2, 0, rows)
            adapted[f"{layer}{target}.up_proj.{part}"] = sliced_entry(entry, -2, rows, 2 * rows)
        elif part in QUANTIZED_PARTS and prefix.endswith(down):
            adapted[f"{prefix.removesuffix(down)}{target}.down_proj.{part}"] = entry
        else:
            adapted[name] = entry
    return adapted


def read_layer_types(read: ConfigReader, layers: int) -> tuple[str, ...]:
    """``layer_types`` in either spelling (or the older ``layers_block_type``); transformers' default: all Mamba2."""
    key = "layer_types" if read.config.get("layer_types") is not None else "layers_block_type"
    given = read.value(key, [MAMBA] * layers)
    if not isinstance(given, list | tuple) or len(given) != layers or any(t not in LAYER_TYPE_SPELLINGS for t in given):
        read.fail(f"{key} must list {layers} entries, each one of {', '.join(map(repr, LAYER_TYPE_SPELLINGS))}; "
                  f"got {given!r}")  # fmt: skip
    return tuple(LAYER_TYPE_SPELLINGS[t] for t in given)


MAMBA_KEYS = {
    "n_groups": ("mamba_n_groups", 1), "state_size": ("mamba_d_state", 256), "conv_kernel": ("mamba_d_conv", 4),
    "use_conv_bias": ("mamba_conv_bias", True), "use_bias": ("mamba_proj_bias", False), "norm_eps": ("rms_norm_eps", 1e-6),
    "chunk_size": ("mamba_chunk_size", 256), "num_heads": ("mamba_n_heads", 128),
}  # fmt: skip
"""Granite's keys for the Mamba2 mixers' sizes, with transformers' defaults (the head size is computed)."""


def read_mamba_shape(read: ConfigReader) -> Mamba2Shape:
    """The Mamba2 mixers' sizes from Granite's ``mamba_*`` keys (transformers' defaults where absent)."""
    hidden = read.int("hidden_size")
    heads = read.int("mamba_n_heads", 128)
    inner = int(read.float("mamba_expand", 2) * hidden)
    if read.value("mamba_d_head", "auto") == "auto":
        if inner % heads:
            read.fail(f"mamba_n_heads ({heads}) must divide mamba_expand * hidden_size ({inner})")
        head_dim = inner // heads
    else:
        head_dim = read.int("mamba_d_head")
    if heads * head_dim != inner:
        read.fail(f"mamba_n_heads * mamba_d_head ({heads} * {head_dim}) must be mamba_expand * hidden_size ({inner})")
    return read_mamba2_shape(read, MAMBA_KEYS, num_heads=heads, head_dim=head_dim)


def read_position_embedding(read: ConfigReader) -> RopeConfig | None:
    """RoPE's parameters when ``position_embedding_type`` is "rope" (else None: NoPE)."""
    if read.value("position_embedding_type", None) != "rope":
        return None
    return read_rope(read)[0]


def build(config: dict[str, Any], source: Path) -> GraniteMoeHybridModel:
    """A Granite 4.0-H model shaped by ``config`` (read from ``source``), with uninitialised weights."""
    read = ConfigReader(config, source)
    read.require_silu()
    hidden, layers = read.int("hidden_size"), read.int("num_hidden_layers")
    layer_types = read_layer_types(read, layers)
    heads = read.int("num_attention_heads", 32)
    kv_heads = read.int("num_key_value_heads", heads)
    if heads % kv_heads:
        read.fail(f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})")
    experts = read.count("num_local_experts", 8)
    top_k = read.int("num_experts_per_tok", 2)
    if experts and top_k > experts:
        read.fail(f"num_experts_per_tok ({top_k}) must be at most num_local_experts ({experts})")
    return GraniteMoeHybridModel(GraniteArgs(
        model_type=read.str("model_type"),
        vocab_size=read.int("vocab_size"),
        hidden_size=hidden,
        num_hidden_layers=layers,
        max_position_embeddings=read.int("max_position_embeddings", 2048),
        tie_word_embeddings=read.bool("tie_word_embeddings", False),
        rms_norm_eps=read.float("rms_norm_eps", 1e-6),
        layer_types=layer_types,
        embedding_multiplier=read.float("embedding_multiplier", 1.0),
        residual_multiplier=read.float("residual_multiplier", 1.0),
        attention_multiplier=read.float("attention_multiplier", 1.0),
        logits_scaling=read.float("logits_scaling", 1.0),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=read.int("head_dim", hidden // heads),
        attention_bias=read.bool("attention_bias", False),
        rope=read_position_embedding(read),
        num_experts=experts,
        experts_per_token=top_k,
        intermediate_size=read.int("intermediate_size") if experts else read.int("intermediate_size", 1),
        shared_intermediate_size=read.int("shared_intermediate_size", 1024),
        mamba=read_mamba_shape(read) if MAMBA in layer_types else None,
    ))  # fmt: skip
