"""Mamba2 (Hugging Face ``Mamba2ForCausalLM``): a pure state-space model, no attention.

Each block is ``x + mixer(rms_norm(x))``; the mixer projects ``x`` to a gate ``z``, the
convolution's inputs ``xBC`` and time steps ``dt``, runs the causal convolution and the SSD
scan through its layer's cache (``butter_core.recurrent.Mamba2Mixer``; without caches, the
same computation from the zero state), applies the gated RMSNorm (the gate before
normalising, per group of channels) and projects back. ``Mamba2Layer`` is shared with the
hybrid families whose recurrent layers are Mamba2 mixers (Granite 4.0-H).

Checkpoints load in both layouts: Hugging Face's (``conv1d.weight`` ``[C, 1, K]``) and the
one ``mlx_lm.convert`` writes (``[C, K, 1]``, optionally MLX-quantized projections).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import attrs
import mlx.core as mx
import mlx.nn as nn

from butter_core.cache import Mask
from butter_core.loading.checkpoint import TensorEntry
from butter_core.models.base import LayerStack
from butter_core.models.config_values import ConfigReader
from butter_core.recurrent import MAMBA2, Mamba2Mixer, StateCache, StateSpec
from butter_core.recurrent_ops import gate_then_rms_norm

ARCHITECTURES = ("Mamba2ForCausalLM",)
MODEL_TYPES = ("mamba2",)
UNBOUNDED_POSITIONS = 2**31 - 1
"""What a recurrent model without positions reports as ``max_position_embeddings``."""


@attrs.frozen
class Mamba2Shape:
    """One Mamba2 mixer's sizes, as its config gives them."""

    hidden_size: int
    num_heads: int
    head_dim: int
    state_size: int
    n_groups: int
    conv_kernel: int
    use_conv_bias: bool
    use_bias: bool
    norm_eps: float
    time_step_limit: tuple[float, float]
    chunk_size: int

    @property
    def inner(self) -> int:
        """Channels of ``x`` (and of the gate): heads times head_dim."""
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.inner + 2 * self.n_groups * self.state_size

    def state_spec(self, dtype: mx.Dtype, layer_index: int) -> StateSpec:
        return StateSpec(MAMBA2, self.conv_dim, self.conv_kernel, (self.num_heads, self.head_dim, self.state_size),
                         dtype=dtype, layer_index=layer_index)  # fmt: skip


MAMBA2_KEYS = {
    "num_heads": ("num_heads", None), "head_dim": ("head_dim", None), "state_size": ("state_size", None),
    "n_groups": ("n_groups", 1), "conv_kernel": ("conv_kernel", 4), "use_conv_bias": ("use_conv_bias", True),
    "use_bias": ("use_bias", False), "norm_eps": ("layer_norm_epsilon", 1e-5), "chunk_size": ("chunk_size", 256),
}  # fmt: skip
"""``Mamba2ForCausalLM``'s config key and default (None: required) for each ``Mamba2Shape`` field;
the hybrid families spell them their own way."""


def read_mamba2_shape(read: ConfigReader, keys: dict[str, tuple[str, Any]] = MAMBA2_KEYS, **given: Any) -> Mamba2Shape:
    """A Mamba2 mixer's sizes from a config whose keys ``keys`` names (default ``Mamba2ForCausalLM``'s),
    fields in ``given`` computed by the family instead; every problem a ModelLoadError naming the
    file and key."""

    def field(name: str, kind: str) -> Any:
        if name in given:
            return given[name]
        key, default = keys[name]
        return getattr(read, kind)(key) if default is None else getattr(read, kind)(key, default)

    heads, groups = field("num_heads", "int"), field("n_groups", "int")
    if heads % groups:
        read.fail(f"{keys['num_heads'][0]} ({heads}) must be a multiple of {keys['n_groups'][0]} ({groups})")
    low, high = read.floats("time_step_limit", 2, (0.0, math.inf))
    return Mamba2Shape(
        hidden_size=read.int("hidden_size"),
        num_heads=heads,
        head_dim=field("head_dim", "int"),
        state_size=field("state_size", "int"),
        n_groups=groups,
        conv_kernel=field("conv_kernel", "int"),
        use_conv_bias=field("use_conv_bias", "bool"),
        use_bias=field("use_bias", "bool"),
        norm_eps=field("norm_eps", "float"),
        time_step_limit=(low, high),
        chunk_size=field("chunk_size", "int"),
    )


class Mamba2Layer(nn.Module):
    """A Mamba2 mixer (Hugging Face's ``mixer``): projections around the convolution and scan its cache runs."""

    norm_across = None
    """Where the gated norm's group spans tensor-parallel ranks: the norm that sums across them
    (``butter_core.distributed``); None: each group is held whole here."""

    def __init__(self, shape: Mamba2Shape):
        super().__init__()
        self.shape = shape
        s = shape
        self.in_proj = nn.Linear(s.hidden_size, 2 * s.inner + 2 * s.n_groups * s.state_size + s.num_heads, bias=s.use_bias)
        self.conv1d = DepthwiseConv(s.conv_dim, s.conv_kernel, bias=s.use_conv_bias)
        self.dt_bias = mx.ones((s.num_heads,))
        self.A_log = mx.zeros((s.num_heads,))
        self.D = mx.ones((s.num_heads,))
        self.norm = GatedNormWeight(s.inner)
        self.out_proj = nn.Linear(s.inner, s.hidden_size, bias=s.use_bias)

    def mixer(self) -> Mamba2Mixer:
        """This layer's parameters as the cache update takes them, made once per set of weights
        (a decode step would otherwise add ``-exp(A_log)`` and a slice to every layer's graph)."""
        weights = (self.conv1d.weight, self.conv1d.get("bias"), self.dt_bias, self.A_log, self.D)
        memo = self.__dict__.get("_memo")
        if memo is None or any(a is not b for a, b in zip(memo[0], weights)):
            s = self.shape
            mixer = Mamba2Mixer(
                self.conv1d.weight[:, 0], self.conv1d.get("bias"), self.dt_bias,
                -mx.exp(self.A_log.astype(mx.float32)), self.D, heads=s.num_heads, head_dim=s.head_dim,
                groups=s.n_groups, state_size=s.state_size, dt_limit=s.time_step_limit,
                chunk_size=min(s.chunk_size, 64),
            )  # fmt: skip
            mx.eval(mixer.conv_weight, mixer.A)
            memo = self.__dict__["_memo"] = (weights, mixer)
        return memo[1]

    def __call__(self, x: mx.array, cache: StateCache | None) -> mx.array:
        s = self.shape
        batch, tokens, _ = x.shape
        gate, xbc, dt = mx.split(self.in_proj(x), [s.inner, s.inner + s.conv_dim], axis=-1)
        mixer = self.mixer()
        y = mixer.reference(None, None, xbc, dt)[0] if cache is None else cache.update_and_mix(mixer, xbc, dt)
        y = y.reshape(batch, tokens, s.inner)
        if self.norm_across is None:
            y = gate_then_rms_norm(y, gate, self.norm.weight, eps=s.norm_eps, group_size=s.inner // s.n_groups)
        else:
            y = self.norm_across(y, gate, self.norm.weight, eps=s.norm_eps)
        return self.out_proj(y)


class DepthwiseConv(nn.Module):
    """The causal depthwise convolution's parameters, Hugging Face's shape ``[C, 1, K]``; the cache
    or the mixer's reference applies them."""

    def __init__(self, channels: int, kernel: int, *, bias: bool):
        super().__init__()
        self.weight = mx.zeros((channels, 1, kernel))
        if bias:
            self.bias = mx.zeros((channels,))


class GatedNormWeight(nn.Module):
    """The gated RMSNorm's weight (applied by ``recurrent_ops``, which knows the gate's order)."""

    def __init__(self, dims: int):
        super().__init__()
        self.weight = mx.ones((dims,))


@attrs.frozen
class Mamba2Args:
    """What the model reads from ``config.json`` beyond each mixer's sizes."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    norm_eps: float
    tie_word_embeddings: bool
    residual_in_fp32: bool
    mixer: Mamba2Shape
    max_position_embeddings: int = UNBOUNDED_POSITIONS


class Mamba2Block(nn.Module):
    def __init__(self, args: Mamba2Args):
        super().__init__()
        self.residual_in_fp32 = args.residual_in_fp32
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.norm_eps)
        self.mixer = Mamba2Layer(args.mixer)

    def __call__(self, x: mx.array, cache: StateCache | None, mask: Mask = "causal") -> mx.array:
        """``mask`` is unused: a recurrent layer sees every earlier token."""
        residual = x.astype(mx.float32) if self.residual_in_fp32 else x
        out = self.mixer(self.norm(x.astype(self.norm.weight.dtype)), cache)
        return (residual + out).astype(out.dtype)


class Backbone(nn.Module):
    """Hugging Face's ``backbone.``: embeddings, blocks, final norm (Mamba2's names, Nemotron-H's too)."""

    def __init__(self, vocab_size: int, hidden_size: int, layers: list[nn.Module], norm_eps: float):
        super().__init__()
        self.embeddings = nn.Embedding(vocab_size, hidden_size)
        self.layers = layers
        self.norm_f = nn.RMSNorm(hidden_size, eps=norm_eps)


class Mamba2Model(LayerStack):
    """A Mamba2 language model: token ids in, next-token logits out, one state cache per layer.

    The families named the Mamba way (``backbone.embeddings``, ``backbone.norm_f``) derive from
    it, passing their own ``layers``.
    """

    def __init__(self, args, layers: list[nn.Module] | None = None):
        super().__init__()
        self.args = args
        layers = [Mamba2Block(args) for _ in range(args.num_hidden_layers)] if layers is None else layers
        self.backbone = Backbone(args.vocab_size, args.hidden_size, layers, args.norm_eps)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    @property
    def layers(self) -> list[Mamba2Block]:
        return self.backbone.layers

    @property
    def dtype(self) -> mx.Dtype:
        return self.backbone.norm_f.weight.dtype

    def layer_specs(self, max_positions: int) -> list[StateSpec]:
        """Each layer's state; a recurrent model has no context bound."""
        return [self.args.mixer.state_spec(self.dtype, index) for index in range(self.args.num_hidden_layers)]

    def describe(self) -> str:
        a, m = self.args, self.args.mixer
        return (f"family {a.model_type}: {a.num_hidden_layers} Mamba2 layers, hidden {a.hidden_size}, "
                f"{m.num_heads} heads of {m.head_dim}, state {m.state_size} in {m.n_groups} groups, vocab {a.vocab_size}")  # fmt: skip

    def embed(self, token_ids: mx.array) -> mx.array:
        return self.backbone.embeddings(token_ids)

    def final_norm(self, hidden: mx.array) -> mx.array:
        return self.backbone.norm_f(hidden.astype(self.dtype))

    def logits(self, hidden: mx.array) -> mx.array:
        if self.args.tie_word_embeddings:
            return self.backbone.embeddings.as_linear(hidden)
        return self.lm_head(hidden)

    def checkpoint_layout(self, entries: dict[str, TensorEntry]) -> dict[str, Any]:
        return conv_weights_as_stored(entries)


def conv_weights_as_stored(entries: dict[str, TensorEntry]) -> dict[str, Any]:
    """``entries`` with mlx-lm's ``conv1d.weight`` ``[C, K, 1]`` read as Hugging Face's ``[C, 1, K]``."""
    from butter_core.loading.weights import Derived

    adapted: dict[str, Any] = {}
    for name, entry in entries.items():
        if name.endswith("conv1d.weight") and len(entry.shape) == 3 and entry.shape[1] != 1 and entry.shape[2] == 1:
            channels, kernel, _ = entry.shape
            seen = attrs.evolve(entry, shape=(channels, 1, kernel))
            adapted[name] = (seen, Derived((entry,), lambda arrays: arrays[0].swapaxes(1, 2)))
        else:
            adapted[name] = entry
    return adapted


def build(config: dict[str, Any], source: Path) -> Mamba2Model:
    """A Mamba2 model shaped by ``config`` (read from ``source``), with uninitialised weights."""
    read = ConfigReader(config, source)
    mixer = read_mamba2_shape(read)
    read.require_silu()
    if read.bool("norm_before_gate", False):
        read.fail("norm_before_gate true is not supported (Mamba2 checkpoints gate before the norm)")
    return Mamba2Model(Mamba2Args(
        model_type=read.str("model_type"),
        vocab_size=read.int("vocab_size"),
        hidden_size=mixer.hidden_size,
        num_hidden_layers=read.int("num_hidden_layers"),
        norm_eps=read.float("layer_norm_epsilon", 1e-5),
        tie_word_embeddings=read.bool("tie_word_embeddings", False),
        residual_in_fp32=read.bool("residual_in_fp32", True),
        mixer=mixer,
        max_position_embeddings=read.int("max_position_embeddings", UNBOUNDED_POSITIONS),
    ))  # fmt: skip
