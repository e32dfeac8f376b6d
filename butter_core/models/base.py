"""What the decoder-only families share: config parsing, RoPE, attention through the cache, MLP, blocks.

A family module (``llama.py``, ``qwen3.py``) parses its ``config.json`` into
:class:`ModelArgs` and assembles :class:`DecoderModel` from these parts, swapping in
its own attention projection where it differs. Parameter names follow Hugging Face
(``model.layers.N.self_attn.q_proj.weight``...), so checkpoints load without renaming.

Attention never touches K/V storage itself: with a cache it applies RoPE at
``cache.absolute_position`` and calls ``cache.update_and_attend``; without one
(``caches=None``) it recomputes the whole sequence under a causal mask, narrowed to
each layer's window if it has one — the yardstick the cached paths are checked
against.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import mlx.core as mx
import mlx.nn as nn

from butter_core.cache import AttentionCache, LayerCache, LayerSpec, Mask, StepCall
from butter_core.config import Window
from butter_core.errors import ModelLoadError
from butter_core.models import traced
from butter_core.models.config_values import MAX_SIZE
from butter_core.models.fused import fused, plus

ROPE_TYPES = ("default", "linear", "llama3")
FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"


@attrs.frozen
class RopeConfig:
    """Rotary embedding parameters: ``type`` among ROPE_TYPES plus that type's factors."""

    theta: float = 10000.0
    traditional: bool = False
    type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@attrs.frozen
class ModelArgs:
    """The hyperparameters a decoder-only family reads from ``config.json``."""

    model_type: str
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool
    attention_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()

    def layer_windows(self) -> list[Window | None]:
        """Per layer, the window its attention is bounded by (``None`` for full attention)."""
        return [
            Window(max_size=self.sliding_window, keep=0) if kind == SLIDING_ATTENTION else None
            for kind in self.layer_types
        ]


def parse_args(config: dict[str, Any], source: Path, *, defaults: dict[str, Any] | None = None) -> ModelArgs:
    """``config.json`` contents as ModelArgs; ``defaults`` fill keys a family may omit.

    Every problem raises ModelLoadError naming ``source`` and the key.
    """
    values = {**(defaults or {}), **{k: v for k, v in config.items() if v is not None}}

    def get(key: str, kind: type, default: Any = None) -> Any:
        value = values.get(key, default)
        if value is None:
            raise ModelLoadError(f"{source}: required key {key!r} is missing")
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if kind is int and (isinstance(value, bool) or not isinstance(value, int) or not 0 < value < MAX_SIZE):
            raise ModelLoadError(f"{source}: {key!r} must be a positive integer below 2**31, got {value!r}")
        if not isinstance(value, kind):
            raise ModelLoadError(f"{source}: {key!r} must be a {kind.__name__}, got {value!r}")
        return value

    activation = values.get("hidden_act", "silu")
    if activation != "silu":
        raise ModelLoadError(f"{source}: hidden_act {activation!r} is not supported; supported: silu")
    hidden, heads = get("hidden_size", int), get("num_attention_heads", int)
    kv_heads = get("num_key_value_heads", int, heads)
    if heads % kv_heads:
        raise ModelLoadError(
            f"{source}: num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})"
        )
    layers = get("num_hidden_layers", int)
    sliding_window = values.get("sliding_window")
    return ModelArgs(
        model_type=get("model_type", str),
        hidden_size=hidden,
        num_hidden_layers=layers,
        intermediate_size=get("intermediate_size", int),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=get("head_dim", int, hidden // heads),
        vocab_size=get("vocab_size", int),
        max_position_embeddings=get("max_position_embeddings", int),
        rms_norm_eps=get("rms_norm_eps", float),
        rope=_parse_rope(values, source),
        tie_word_embeddings=get("tie_word_embeddings", bool, False),
        attention_bias=get("attention_bias", bool, False),
        mlp_bias=get("mlp_bias", bool, False),
        sliding_window=sliding_window,
        layer_types=_parse_layer_types(values, layers, sliding_window, source),
    )


def _parse_rope(values: dict[str, Any], source: Path) -> RopeConfig:
    scaling = values.get("rope_scaling") or {}
    if not isinstance(scaling, dict):
        raise ModelLoadError(f"{source}: rope_scaling must be an object or null, got {scaling!r}")
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    if kind not in ROPE_TYPES:
        raise ModelLoadError(f"{source}: rope_scaling type {kind!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
    if kind != "default" and "factor" not in scaling:
        raise ModelLoadError(f"{source}: rope_scaling of type {kind!r} needs a 'factor'")
    default = RopeConfig()
    try:
        return RopeConfig(
            theta=float(values.get("rope_theta", default.theta)),
            traditional=bool(values.get("rope_traditional", default.traditional)),
            type=kind,
            factor=float(scaling.get("factor", default.factor)),
            low_freq_factor=float(scaling.get("low_freq_factor", default.low_freq_factor)),
            high_freq_factor=float(scaling.get("high_freq_factor", default.high_freq_factor)),
            original_max_position_embeddings=int(
                scaling.get("original_max_position_embeddings", default.original_max_position_embeddings)
            ),
        )
    except (TypeError, ValueError) as exc:
        raise ModelLoadError(f"{source}: invalid rope_theta or rope_scaling: {exc}") from exc


def read_rope(read) -> tuple[RopeConfig, dict[str, Any]]:
    """RoPE's parameters from transformers 5's ``rope_parameters`` or the flat ``rope_theta`` /
    ``rope_scaling`` (``read``: a ``ConfigReader``), and the merged values, for the keys a family
    reads beside them (``partial_rotary_factor``)."""
    nested, scaling = read.value("rope_parameters", {}), read.value("rope_scaling", {})
    if not isinstance(nested, dict) or not isinstance(scaling, dict):
        read.fail(f"rope_parameters and rope_scaling must be objects or null, got {nested!r} and {scaling!r}")
    values = {**scaling, **nested}
    kind = values.get("rope_type") or values.get("type") or "default"
    if kind not in ROPE_TYPES:
        read.fail(f"rope type {kind!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
    default = RopeConfig()
    try:
        return RopeConfig(
            theta=float(values.get("rope_theta", read.float("rope_theta", default.theta))),
            type=kind,
            factor=float(values.get("factor", default.factor)),
            low_freq_factor=float(values.get("low_freq_factor", default.low_freq_factor)),
            high_freq_factor=float(values.get("high_freq_factor", default.high_freq_factor)),
            original_max_position_embeddings=int(
                values.get("original_max_position_embeddings", default.original_max_position_embeddings)
            ),
        ), values
    except (TypeError, ValueError) as exc:
        read.fail(f"invalid rope parameters: {exc}")


def _parse_layer_types(values: dict[str, Any], layers: int, sliding_window: Any, source: Path) -> tuple[str, ...]:
    """``layer_types`` as given, or derived the Qwen2/3 way from ``use_sliding_window`` / ``max_window_layers``."""
    layer_types = values.get("layer_types")
    if layer_types is None:
        first_sliding = values.get("max_window_layers", 0) if values.get("use_sliding_window") else layers
        layer_types = [SLIDING_ATTENTION if i >= first_sliding else FULL_ATTENTION for i in range(layers)]
    valid = {FULL_ATTENTION, SLIDING_ATTENTION}
    if not isinstance(layer_types, list | tuple) or len(layer_types) != layers or not set(layer_types) <= valid:
        raise ModelLoadError(
            f"{source}: layer_types must list {layers} entries of {FULL_ATTENTION!r} or {SLIDING_ATTENTION!r}; "
            f"got {layer_types!r}"
        )
    if SLIDING_ATTENTION in layer_types and (not isinstance(sliding_window, int) or sliding_window <= 0):
        raise ModelLoadError(f"{source}: sliding-attention layers need a positive sliding_window, got {sliding_window!r}")
    return tuple(layer_types)


class RoPE(nn.Module):
    """Rotary position embedding at an offset, with ``linear`` and ``llama3`` frequency scaling."""

    def __init__(self, dims: int, config: RopeConfig):
        super().__init__()
        self.dims = dims
        self.traditional = config.traditional
        self.base: float | None = config.theta
        self.scale = 1 / config.factor if config.type == "linear" else 1.0
        self._freqs = None
        if config.type == "llama3":
            self.base, self._freqs = None, llama3_frequencies(dims, config)

    def __call__(self, x: mx.array, offset: int) -> mx.array:
        return mx.fast.rope(
            x, self.dims, traditional=self.traditional, base=self.base, scale=self.scale, offset=offset, freqs=self._freqs
        )


def llama3_frequencies(dims: int, config: RopeConfig) -> mx.array:
    """Llama 3.1's wavelength-dependent stretch: long wavelengths slowed by ``factor``, short ones kept."""
    old_context = config.original_max_position_embeddings
    low_freq_wavelen = old_context / config.low_freq_factor
    high_freq_wavelen = old_context / config.high_freq_factor
    freqs = config.theta ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)
    wavelens = 2 * math.pi * freqs
    freqs = mx.where(wavelens > low_freq_wavelen, freqs * config.factor, freqs)
    is_medium = (wavelens > high_freq_wavelen) & (wavelens < low_freq_wavelen)
    smooth = (old_context / wavelens - config.low_freq_factor) / (config.high_freq_factor - config.low_freq_factor)
    return mx.where(is_medium, freqs / ((1 - smooth) / config.factor + smooth), freqs)


def window_mask(length: int, window: Window | None) -> Mask:
    """Causal mask over ``length`` positions, narrowed to ``window`` (sinks plus the recent ring) if given."""
    if window is None:
        return "causal"
    positions = mx.arange(length)
    query, key = positions[:, None], positions[None]
    return (key <= query) & ((key < window.keep) | (key > query - window.ring_size))


def attend_through(
    cache: AttentionCache | None, q: mx.array, k: mx.array, v: mx.array, *, scale: float, mask: Mask
) -> mx.array:
    """Attention of ``q`` (``[batch, heads, tokens, head_dim]``, RoPE applied): through ``cache``
    (which appends ``k``/``v`` and attends over all it holds), or without one over ``k``/``v``
    alone under ``mask`` (a full recompute)."""
    if cache is None:
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    return cache.update_and_attend(q, k, v, scale=scale)


def decode_call(cache: AttentionCache, scale: float, dtype: mx.Dtype) -> StepCall | None:
    """``cache``'s step for one token as a ``StepCall`` (``SlotCache.decode_call``; the keys and values a
    block computes are in its hidden states' ``dtype``), None where the cache hands none out (a
    scheme without ``step_call``, a decorator, batched storage)."""
    hand_out = getattr(cache, "decode_call", None)
    return None if hand_out is None else hand_out(scale, dtype)


def heads(rows: mx.array, batch: int, count: int) -> mx.array:
    """Projected rows ``[batch * tokens, count * head_dim]`` as ``[batch, count, tokens, head_dim]``:
    one reshape for one token a sequence (an axis of one entry moves freely), else a reshape and
    a transpose."""
    tokens = rows.shape[0] // batch
    if tokens == 1:
        return rows.reshape(batch, count, 1, -1)
    return rows.reshape(batch, tokens, count, -1).transpose(0, 2, 1, 3)


def rows_of(out: mx.array) -> mx.array:
    """An attention's output ``[batch, heads, tokens, head_dim]`` as rows ``[batch * tokens, heads *
    head_dim]`` (``heads`` undone)."""
    batch, _, tokens, _ = out.shape
    if tokens == 1:
        return out.reshape(batch, -1)
    return out.transpose(0, 2, 1, 3).reshape(batch * tokens, -1)


class Attention(nn.Module):
    """Multi-head attention with GQA whose K/V history lives in an ``AttentionCache``.

    Once fused (``fused.fuse_projections``), a single row (one sequence's decode step) is projected
    by one matmul; more rows keep three, as their queries, keys and values would be strided
    views, which the per-head norms and RoPE on a GPU first copy."""

    fused_projections = ("q_proj", "k_proj", "v_proj")

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.num_attention_heads, args.num_key_value_heads, args.head_dim
        self.scale = args.head_dim**-0.5
        bias = args.attention_bias
        self.q_proj = nn.Linear(args.hidden_size, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(args.hidden_size, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(args.hidden_size, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, args.hidden_size, bias=bias)
        self.rope = RoPE(args.head_dim, args.rope)

    def project(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """Queries, keys and values as ``[batch, heads, tokens, head_dim]``, before RoPE."""
        batch, tokens, _ = x.shape
        rows = x.reshape(batch * tokens, -1)  # a matmul of rows needs no Flatten and Unflatten around it
        fusion = fused(self) if batch * tokens == 1 else None
        q, k, v = fusion(rows) if fusion is not None else (plus(self.q_proj, rows), plus(self.k_proj, rows),
                                                           plus(self.v_proj, rows))  # fmt: skip
        return heads(q, batch, self.n_heads), heads(k, batch, self.n_kv_heads), heads(v, batch, self.n_kv_heads)

    def __call__(self, x: mx.array, cache: AttentionCache | None, mask: Mask = "causal",
                 residual: mx.array | None = None) -> mx.array:  # fmt: skip
        """Attend ``x``'s tokens: through ``cache`` if given, else over ``x`` alone under ``mask``; added
        to ``residual`` where given (in the output projection's matmul)."""
        batch, tokens, _ = x.shape
        q, k, v = self.queries_keys_values(x, 0 if cache is None else cache.absolute_position)
        out = attend_through(cache, q, k, v, scale=self.scale, mask=mask)
        return self.output(out, None if residual is None else residual.reshape(batch * tokens, -1)).reshape(x.shape)

    def queries_keys_values(self, x: mx.array, offset: int | mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """What this attention hands its cache for ``x``: queries and keys RoPE'd at ``offset`` (as they
        are where ``rope`` is None: NoPE), values."""
        q, k, v = self.project(x)
        if self.rope is None:
            return q, k, v
        return self.rope(q, offset), self.rope(k, offset), v

    def output(self, out: mx.array, residual: mx.array | None) -> mx.array:
        """The attention's output ``[batch, heads, tokens, head_dim]`` projected as rows ``[batch *
        tokens, hidden]``, added to ``residual`` (rows too) where given."""
        return plus(self.o_proj, rows_of(out), residual)


class GroupedAttention(Attention):
    """``Attention`` made from its sizes, at a given ``scale``, RoPE'd where a ``rope`` is given (else
    NoPE), for the families whose attention differs from Llama's only in those (Granite 4.0-H,
    Nemotron-H)."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, *, scale: float, bias: bool,
                 rope: RopeConfig | None):  # fmt: skip
        nn.Module.__init__(self)
        self.n_heads, self.n_kv_heads, self.head_dim, self.scale = heads, kv_heads, head_dim, scale
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=bias)
        self.rope = None if rope is None else RoPE(head_dim, rope)


@partial(mx.compile, shapeless=True)
def swiglu(gate: mx.array, up: mx.array) -> mx.array:
    """``silu(gate) * up`` as one fused operation."""
    return nn.silu(gate) * up


class MLP(nn.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``; once fused (``fused.fuse_projections``),
    gate and up are one matmul."""

    fused_projections = ("gate_proj", "up_proj")

    def __init__(self, dims: int, hidden_dims: int, *, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(dims, hidden_dims, bias=bias)
        self.up_proj = nn.Linear(dims, hidden_dims, bias=bias)
        self.down_proj = nn.Linear(hidden_dims, dims, bias=bias)

    def __call__(self, x: mx.array, residual: mx.array | None = None) -> mx.array:
        """The feed-forward of ``x``, added to ``residual`` where given (in the down projection's matmul)."""
        fusion = fused(self)
        gate, up = fusion(x) if fusion is not None else (self.gate_proj(x), self.up_proj(x))
        return plus(self.down_proj, swiglu(gate, up), residual)


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(norm(x))``, then ``h + mlp(norm(h))`` (each sum in the
    output projection's matmul)."""

    def __init__(self, args: ModelArgs, attention: type[Attention] = Attention):
        super().__init__()
        self.self_attn = attention(args)
        self.mlp = MLP(args.hidden_size, args.intermediate_size, bias=args.mlp_bias)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, cache: AttentionCache | None, mask: Mask = "causal") -> mx.array:
        step = self.traced_decode(x, cache)
        if step is not None:
            offset = traced.rope_offset(cache.absolute_position)
            call = decode_call(cache, self.self_attn.scale, x.dtype)
            if call is not None:
                out, *written = step.with_cache(call.fn)(x, offset, *call.inputs)
                call.take(written)
                return out
            q, k, v = step.before(x, offset)
            return step.after(attend_through(cache, q, k, v, scale=self.self_attn.scale, mask=mask), x)
        return self.feed_forward(self.self_attn(self.input_layernorm(x), cache, mask, residual=x))

    def before_cache(self, x: mx.array, offset: int | mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """The block's work before its cache: the input norm, then the attention's queries, keys and values."""
        return self.self_attn.queries_keys_values(self.input_layernorm(x), offset)

    def after_cache(self, out: mx.array, x: mx.array) -> mx.array:
        """The block's work after its cache: the attention's output added to ``x``, then
        ``feed_forward``, over rows (a matmul of rows needs no Flatten, Unflatten or Broadcast)."""
        return self.feed_forward(self.self_attn.output(out, x.reshape(-1, x.shape[-1]))).reshape(x.shape)

    def feed_forward(self, h: mx.array) -> mx.array:
        """``h`` plus the feed-forward of its norm."""
        return self.mlp(self.post_attention_layernorm(h), residual=h)

    def traced_decode(self, x: mx.array, cache: AttentionCache | None) -> traced.TracedDecode | None:
        """The traced halves of this block's step (``traced.TracedDecode``) for one token per sequence
        through a cache, made afresh when a weight changed; None for other calls, where the
        attention or the feed-forward is not this module's own (a family's override), and while
        ``traced.ENABLED`` is off."""
        if cache is None or x.shape[1] != 1 or not traced.ENABLED:
            return None
        if type(self.self_attn).__call__ is not Attention.__call__ or type(self.mlp).__call__ is not MLP.__call__:
            return None
        step = self.traced_step
        if step is None or not step.current():
            step = traced.TracedDecode(self)
            # Kept out of the module's parameters, as ``fused.fuse_projections`` keeps its fusions.
            object.__setattr__(self, "_traced", step)
        return step

    @property
    def traced_step(self) -> traced.TracedDecode | None:
        """The traced halves ``traced_decode`` made last (their traces and counts), None before then."""
        return self.__dict__.get("_traced")

    def drop_traced_step(self) -> None:
        """Forget the traced halves: the next decode step makes them anew, its shapes counted from nothing."""
        self.__dict__.pop("_traced", None)


class Backbone(nn.Module):
    """Embedding, layers and final norm (Hugging Face's ``model.`` prefix)."""

    def __init__(self, vocab_size: int, hidden_size: int, layers: list[nn.Module], norm_eps: float):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_size, hidden_size)
        self.layers = layers
        self.norm = nn.RMSNorm(hidden_size, eps=norm_eps)


class LayerStack(nn.Module):
    """What every family's model shares: token ids in, next-token logits out, its ``layers`` run in turn.

    ``caches`` holds one cache per ``layer_specs`` entry (``make_layer_caches``), laid along the
    layers by ``along_layers`` (one each, unless some layers keep no state): each layer is
    called as ``layer(h, cache)``. Without caches the model recomputes the given tokens from
    scratch, each layer called as ``layer(h, None, mask)`` with the causal mask narrowed to its
    window (``windows``, one per ``layer_specs`` entry like the caches; default the family's own,
    ``layer_windows()``) — what a window-evicting cache must match. A subclass provides
    ``layers``, ``embed``, ``final_norm``, ``logits``, ``layer_specs`` and ``describe``, and
    ``checkpoint_layout`` where its checkpoints come in other layouts.
    """

    layers: list[nn.Module]
    shard: tuple[int, int] = (0, 1)
    """``(rank, ranks)``: the share of heads this process runs (``butter_core.distributed.shard_network``)."""
    kv_shard: tuple[int, int] = (0, 1)
    """``LayerSpec.shard`` of the attention layers: ``shard``, or ``(0, 1)`` where every rank keeps the
    layer's KV heads whole (fewer KV heads than ranks)."""

    def attention_spec(self, index: int, max_positions: int) -> LayerSpec:
        """The KV cache of attention layer ``index``, holding up to ``max_positions`` (from the
        family's ``args`` and ``dtype``; ``layer_specs`` asks it for each attention layer)."""
        a = self.args
        return LayerSpec(a.num_key_value_heads, a.head_dim, max_positions, dtype=self.dtype, layer_index=index,
                         shard=self.kv_shard)

    def layer_windows(self) -> list[Window | None]:
        """Per ``layer_specs`` entry, the window the family bounds its attention by (None: none).
        A family whose layers do not all keep state overrides this and ``along_layers``."""
        return [None] * len(self.layers)

    def along_layers(self, per_spec: Sequence[Any] | None) -> list[Any]:
        """``per_spec`` (caches or windows, one per ``layer_specs`` entry) along ``self.layers``,
        None at layers that keep no state (and everywhere for ``None``)."""
        return [None] * len(self.layers) if per_spec is None else list(per_spec)

    def embed(self, token_ids: mx.array) -> mx.array:
        """``[batch, tokens]`` ids to ``[batch, tokens, hidden]`` embeddings."""
        raise NotImplementedError

    def final_norm(self, hidden: mx.array) -> mx.array:
        raise NotImplementedError

    def logits(self, hidden: mx.array) -> mx.array:
        """Project hidden states onto the vocabulary."""
        raise NotImplementedError

    def hidden_states(
        self, token_ids: mx.array, caches: Sequence[LayerCache] | None = None, windows: Sequence[Window | None] | None = None
    ) -> mx.array:
        """Final-norm hidden states ``[batch, tokens, hidden]``."""
        h = self.embed(token_ids)
        if caches is None:
            windows = self.along_layers(self.layer_windows() if windows is None else windows)
            masks = {window: window_mask(h.shape[1], window) for window in set(windows)}
            for layer, window in zip(self.layers, windows, strict=True):
                h = layer(h, None, masks[window])
        else:
            for layer, cache in zip(self.layers, self.along_layers(caches), strict=True):
                h = layer(h, cache)
        return self.final_norm(h)

    def __call__(
        self, token_ids: mx.array, caches: Sequence[LayerCache] | None = None, windows: Sequence[Window | None] | None = None
    ) -> mx.array:
        return self.logits(self.hidden_states(token_ids, caches, windows))


class LanguageModel(LayerStack):
    """A family named the Llama way: ``model.embed_tokens``, ``model.layers`` and ``model.norm``
    (Hugging Face's names), then the LM head (the embedding where ``args.tie_word_embeddings``).
    A family overrides ``embed`` or ``logits`` where it scales them.
    """

    def __init__(self, args, layers: list[nn.Module]):
        super().__init__()
        self.args = args
        self.model = Backbone(args.vocab_size, args.hidden_size, layers, args.rms_norm_eps)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    @property
    def layers(self) -> list[nn.Module]:
        return self.model.layers

    @property
    def dtype(self) -> mx.Dtype:
        """The activation dtype: that of the final norm's weight."""
        return self.model.norm.weight.dtype

    def embed(self, token_ids: mx.array) -> mx.array:
        return self.model.embed_tokens(token_ids)

    def final_norm(self, hidden: mx.array) -> mx.array:
        return self.model.norm(hidden)

    def logits(self, hidden: mx.array) -> mx.array:
        """Project hidden states onto the vocabulary (the tied embedding where the config says so)."""
        if self.args.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(hidden)
        return plus(self.lm_head, hidden)

class DecoderModel(LanguageModel):
    """A Llama-shaped decoder: every layer attention, optionally a sliding window on some."""

    def __init__(self, args: ModelArgs, attention: type[Attention] = Attention):
        super().__init__(args, [Block(args, attention) for _ in range(args.num_hidden_layers)])

    def layer_specs(self, max_positions: int) -> list[LayerSpec]:
        """What each layer's cache must hold, attention layers holding up to ``max_positions``."""
        return [self.attention_spec(index, max_positions) for index in range(self.args.num_hidden_layers)]

    def layer_windows(self) -> list[Window | None]:
        return self.args.layer_windows()

    def describe(self) -> str:
        """One line for ``butter inspect``: the family and its shape."""
        a = self.args
        return (
            f"family {a.model_type}: {a.num_hidden_layers} layers, hidden {a.hidden_size}, "
            f"{a.num_attention_heads} heads ({a.num_key_value_heads} KV) of {a.head_dim}, vocab {a.vocab_size}, "
            f"max_position_embeddings {a.max_position_embeddings}"
        )
