"""Nemotron-H (Hugging Face ``NemotronHForCausalLM``): Mamba2, attention, MLP and MoE layers.

Each layer is ``x + mixer(rms_norm(x))`` with one mixer, by the config's layer pattern: a
Mamba2 mixer (``M``, the same ``Mamba2Layer`` as the Mamba2 family, through the layer's state
cache), attention without positions (``*``, NoPE, through the layer's KV cache), a squared-ReLU
MLP (``-``) or a mixture of squared-ReLU experts plus a shared one (``E``, Nemotron 3). The
pattern is ``hybrid_override_pattern`` as published ("M-M-M-M*-…") or the list transformers 5
writes (``layers_block_type``: "mamba"/"linear_attention", "attention"/"full_attention",
"mlp", "moe").

Only the Mamba2 and attention layers keep state: ``layer_specs`` lists those, each naming
its layer, and ``along_layers`` lays the caches along the layers (None at MLP and MoE layers),
so ``make_layer_caches()`` makes one cache per mixer layer, as for every family.

The MoE router is DeepSeek-V3's (``moe.grouped_sigmoid_top_k``: sigmoid scores, a correction
bias, group-limited choice, ``routed_scaling_factor``), computed in float32; an optional latent
projection (``moe_latent_size``) wraps the routed experts. Parameters carry the published
names (``backbone.layers.N.mixer.*``), the experts mlx-lm's stacked ``switch_mlp.fc1``/``fc2``
(``[E, out, in]``), so an ``mlx_lm.convert`` checkpoint, float or MLX-quantized, loads as
stored; ``checkpoint_layout`` reads the published per-expert tensors
(``experts.N.{up,down}_proj.weight``, as transformers 5 saves them too) into them, and either
layout's convolution weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import mlx.core as mx
from mlx import nn

from butter_core.cache import LayerCache, LayerSpec, Mask
from butter_core.config import Window
from butter_core.errors import ConfigError
from butter_core.loading.checkpoint import TensorEntry
from butter_core.models.base import GroupedAttention
from butter_core.models.config_values import ConfigReader
from butter_core.models.mamba2 import Mamba2Layer, Mamba2Model, Mamba2Shape, conv_weights_as_stored, read_mamba2_shape
from butter_core.models.moe import ReLU2Experts, experts_stacked, grouped_sigmoid_top_k, relu2
from butter_core.recurrent import StateSpec

ARCHITECTURES = ("NemotronHForCausalLM",)
MODEL_TYPES = ("nemotron_h",)
MAMBA, ATTENTION, MLP, MOE = "M", "*", "-", "E"
LAYER_SPELLINGS = {
    "mamba": MAMBA, "linear_attention": MAMBA, "attention": ATTENTION, "full_attention": ATTENTION,
    "mlp": MLP, "moe": MOE,
}  # fmt: skip
"""``layers_block_type`` values (published and transformers 5 spellings) as pattern characters."""
STATEFUL = (MAMBA, ATTENTION)


@attrs.frozen
class NemotronHArgs:
    """What the model reads from ``config.json``."""

    model_type: str
    vocab_size: int
    hidden_size: int
    layer_types: tuple[str, ...]
    """One pattern character per layer: MAMBA, ATTENTION, MLP or MOE."""
    norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    mlp_bias: bool
    mamba: Mamba2Shape | None
    """None when no layer is a Mamba2 layer."""
    moe: MoEShape | None
    """None when no layer is a MoE layer."""

    @property
    def num_hidden_layers(self) -> int:
        return len(self.layer_types)

    def count(self, kind: str) -> int:
        return self.layer_types.count(kind)


@attrs.frozen
class MoEShape:
    """A MoE layer's sizes and router parameters."""

    experts: int
    experts_per_token: int
    intermediate_size: int
    shared_intermediate_size: int
    latent_size: int | None
    groups: int
    top_groups: int
    normalize: bool
    scale: float


class ReLU2MLP(nn.Module):
    """``down(relu(up(x))²)``: Nemotron-H's MLP layers and its MoE layers' shared expert."""

    def __init__(self, hidden: int, intermediate: int, *, bias: bool):
        super().__init__()
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(relu2(self.up_proj(x)))


class Router(nn.Module):
    """Hugging Face's ``gate``: the routing matrix and its score correction bias (float32 maths)."""

    def __init__(self, hidden: int, experts: int):
        super().__init__()
        self.weight = mx.zeros((experts, hidden))
        self.e_score_correction_bias = mx.zeros((experts,))


class MoE(nn.Module):
    """The chosen squared-ReLU experts (through the latent projection if there is one), plus the shared expert."""

    def __init__(self, args: NemotronHArgs):
        super().__init__()
        m = args.moe
        self.shape = m
        self.gate = Router(args.hidden_size, m.experts)
        width = m.latent_size or args.hidden_size
        self.switch_mlp = ReLU2Experts(width, m.intermediate_size, m.experts, bias=args.mlp_bias)
        self.shared_experts = ReLU2MLP(args.hidden_size, m.shared_intermediate_size, bias=args.mlp_bias)
        if m.latent_size is not None:
            self.fc1_latent_proj = nn.Linear(args.hidden_size, m.latent_size, bias=args.mlp_bias)
            self.fc2_latent_proj = nn.Linear(m.latent_size, args.hidden_size, bias=args.mlp_bias)

    def __call__(self, x: mx.array) -> mx.array:
        m = self.shape
        logits = x.astype(mx.float32) @ self.gate.weight.astype(mx.float32).T
        indices, weights = grouped_sigmoid_top_k(
            logits, self.gate.e_score_correction_bias, m.experts_per_token, groups=m.groups,
            top_groups=m.top_groups, normalize=m.normalize, scale=m.scale,
        )  # fmt: skip
        latent = m.latent_size is not None
        routed = self.switch_mlp(self.fc1_latent_proj(x) if latent else x, indices, weights)
        if latent:
            routed = self.fc2_latent_proj(routed)
        return routed + self.shared_experts(x)


class NemotronHBlock(nn.Module):
    """One layer: ``x + mixer(norm(x))``, the mixer by the layer's pattern character."""

    def __init__(self, args: NemotronHArgs, layer_type: str):
        super().__init__()
        self.layer_type = layer_type
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.norm_eps)
        if layer_type == MAMBA:
            self.mixer = Mamba2Layer(args.mamba)
        elif layer_type == ATTENTION:
            self.mixer = GroupedAttention(
                args.hidden_size, args.num_attention_heads, args.num_key_value_heads, args.head_dim,
                scale=args.head_dim**-0.5, bias=False, rope=None,
            )  # fmt: skip
        elif layer_type == MLP:
            self.mixer = ReLU2MLP(args.hidden_size, args.intermediate_size, bias=args.mlp_bias)
        else:
            self.mixer = MoE(args)

    def __call__(self, x: mx.array, cache: LayerCache | None, mask: Mask = "causal") -> mx.array:
        normed = self.norm(x)
        if self.layer_type == MAMBA:
            return x + self.mixer(normed, cache)
        if self.layer_type == ATTENTION:
            return x + self.mixer(normed, cache, mask)
        return x + self.mixer(normed)


class NemotronHModel(Mamba2Model):
    """A Nemotron-H language model: a state cache per Mamba2 layer, a KV cache per attention layer,
    none for MLP and MoE layers."""

    def __init__(self, args: NemotronHArgs):
        super().__init__(args, [NemotronHBlock(args, layer_type) for layer_type in args.layer_types])

    def layer_specs(self, max_positions: int) -> list[LayerSpec | StateSpec]:
        """A Mamba2 layer's state or an attention layer's KV cache (up to ``max_positions``), for
        those layers only, each naming its layer."""
        a = self.args
        return [
            a.mamba.state_spec(self.dtype, index) if layer_type == MAMBA
            else self.attention_spec(index, max_positions)
            for index, layer_type in enumerate(a.layer_types) if layer_type in STATEFUL
        ]  # fmt: skip

    def stateful_layers(self) -> list[int]:
        """The indices of the Mamba2 and attention layers, in order: those ``layer_specs`` lists."""
        return [index for index, layer_type in enumerate(self.args.layer_types) if layer_type in STATEFUL]

    def layer_windows(self) -> list[Window | None]:
        return [None] * len(self.stateful_layers())

    def along_layers(self, per_spec: Sequence[Any] | None) -> list[Any]:
        """``per_spec`` (one per Mamba2 or attention layer, in order) along the layers, None at the others."""
        along: list[Any] = [None] * len(self.layers)
        if per_spec is None:
            return along
        stateful = self.stateful_layers()
        if len(per_spec) != len(stateful):
            raise ConfigError(f"got {len(per_spec)} caches or windows for {len(stateful)} Mamba2 and attention layers")
        for index, item in zip(stateful, per_spec):
            along[index] = item
        return along

    def describe(self) -> str:
        a = self.args
        parts = [f"family {a.model_type}: {a.num_hidden_layers} layers ({a.count(MAMBA)} Mamba2, "
                 f"{a.count(ATTENTION)} attention, {a.count(MLP)} MLP, {a.count(MOE)} MoE)", f"hidden {a.hidden_size}"]  # fmt: skip
        if a.count(ATTENTION):
            parts.append(f"attention {a.num_attention_heads} heads ({a.num_key_value_heads} KV) of {a.head_dim}, NoPE")
        if a.mamba is not None:
            m = a.mamba
            parts.append(f"Mamba2 {m.num_heads} heads of {m.head_dim}, state {m.state_size} in {m.n_groups} groups")
        if a.count(MLP):
            parts.append(f"relu2 MLP of {a.intermediate_size}")
        if a.moe is not None:
            m = a.moe
            parts.append(f"MoE top-{m.experts_per_token} of {m.experts} experts of {m.intermediate_size} "
                         f"+ shared expert of {m.shared_intermediate_size}")  # fmt: skip
        parts.append(f"vocab {a.vocab_size}, max_position_embeddings {a.max_position_embeddings}")
        return ", ".join(parts)

    def checkpoint_layout(self, entries: dict[str, TensorEntry]) -> dict[str, Any]:
        """The published per-expert tensors (``mixer.experts.N.{up,down}_proj.weight``) read as the
        stacked ``switch_mlp.fc1``/``fc2``; either convolution layout."""
        marker = ".mixer.experts."
        adapted = {name: entry for name, entry in entries.items() if marker not in name}
        experts = {name: entry for name, entry in entries.items() if marker in name}
        if experts:
            count = self.args.moe.experts if self.args.moe else 0
            adapted.update(experts_stacked(experts, marker, ".mixer.switch_mlp", {"up_proj": "fc1", "down_proj": "fc2"}, count))
        return conv_weights_as_stored(adapted)


def read_layer_types(read: ConfigReader) -> tuple[str, ...]:
    """The layer pattern: ``hybrid_override_pattern`` (a string of M, *, - and E) or a list
    (``layers_block_type`` / ``layer_types``) in either spelling."""
    pattern = read.config.get("hybrid_override_pattern")
    if pattern is not None:
        if not isinstance(pattern, str) or not pattern or set(pattern) - {MAMBA, ATTENTION, MLP, MOE}:
            read.fail(f"hybrid_override_pattern must be a string of M (Mamba2), * (attention), - (MLP) and "
                      f"E (MoE), got {pattern!r}")  # fmt: skip
        return tuple(pattern)
    key = "layers_block_type" if read.config.get("layers_block_type") is not None else "layer_types"
    given = read.value(key)
    if not isinstance(given, list | tuple) or not given or any(t not in LAYER_SPELLINGS for t in given):
        read.fail(f"{key} must list the layers, each one of {', '.join(map(repr, LAYER_SPELLINGS))}; got {given!r}")
    return tuple(LAYER_SPELLINGS[t] for t in given)


MAMBA_KEYS = {
    "num_heads": ("mamba_num_heads", 128), "head_dim": ("mamba_head_dim", 64), "state_size": ("ssm_state_size", 128),
    "n_groups": ("n_groups", 8), "conv_kernel": ("conv_kernel", 4), "use_conv_bias": ("use_conv_bias", True),
    "use_bias": ("use_bias", False), "norm_eps": ("layer_norm_epsilon", 1e-5), "chunk_size": ("chunk_size", 128),
}  # fmt: skip
"""Nemotron-H's keys for the Mamba2 mixers' sizes, with transformers' defaults."""


def read_moe_shape(read: ConfigReader) -> MoEShape:
    """A MoE layer's sizes and router parameters (transformers' defaults where absent)."""
    key = "n_routed_experts" if read.config.get("n_routed_experts") is not None else "num_local_experts"
    experts, top_k = read.int(key, 8), read.int("num_experts_per_tok", 2)
    groups, top_groups = read.int("n_group", 1), read.int("topk_group", 1)
    if top_k > experts:
        read.fail(f"num_experts_per_tok ({top_k}) must be at most {key} ({experts})")
    if experts % groups or top_groups > groups or (groups > 1 and experts // groups < 2):
        read.fail(f"n_group ({groups}) must divide {key} ({experts}) into groups of at least 2, and topk_group "
                  f"({top_groups}) be at most n_group")  # fmt: skip
    latent = read.config.get("moe_latent_size")
    return MoEShape(
        experts=experts,
        experts_per_token=top_k,
        intermediate_size=read.int("moe_intermediate_size", 7688),
        shared_intermediate_size=read.int("moe_shared_expert_intermediate_size", 7688),
        latent_size=None if latent is None else read.int("moe_latent_size"),
        groups=groups,
        top_groups=top_groups,
        normalize=read.bool("norm_topk_prob", True),
        scale=read.float("routed_scaling_factor", 1.0),
    )


def build(config: dict[str, Any], source: Path) -> NemotronHModel:
    """A Nemotron-H model shaped by ``config`` (read from ``source``), with uninitialised weights."""
    read = ConfigReader(config, source)
    layer_types = read_layer_types(read)
    stated = read.config.get("num_hidden_layers")
    if stated is not None and stated != len(layer_types):
        read.fail(f"num_hidden_layers is {stated!r} but the layer pattern lists {len(layer_types)} layers")
    if MAMBA in layer_types and read.value("mamba_hidden_act", "silu") != "silu":
        read.fail(f"mamba_hidden_act {read.config.get('mamba_hidden_act')!r} is not supported; supported: silu")
    if read.value("mlp_hidden_act", "relu2") != "relu2":
        read.fail(f"mlp_hidden_act {read.config.get('mlp_hidden_act')!r} is not supported; supported: relu2")
    if read.bool("attention_bias", False):
        read.fail("attention_bias true is not supported (Nemotron-H's attention projections have no bias)")
    heads = read.int("num_attention_heads", 32)
    kv_heads = read.int("num_key_value_heads", 8)
    if heads % kv_heads:
        read.fail(f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})")
    return NemotronHModel(NemotronHArgs(
        model_type=read.str("model_type"),
        vocab_size=read.int("vocab_size"),
        hidden_size=read.int("hidden_size"),
        layer_types=layer_types,
        norm_eps=read.float("layer_norm_epsilon", 1e-5),
        tie_word_embeddings=read.bool("tie_word_embeddings", False),
        max_position_embeddings=read.int("max_position_embeddings", 4096),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=read.int("head_dim", 128),
        intermediate_size=read.int("intermediate_size", 21504),
        mlp_bias=read.bool("mlp_bias", False),
        mamba=read_mamba2_shape(read, MAMBA_KEYS) if MAMBA in layer_types else None,
        moe=read_moe_shape(read) if MOE in layer_types else None,
    ))  # fmt: skip
