"""The engine of the seed's API, in Python: ``model.engine.make_layer_caches()``, ``forward``
and ``forward_sample`` (``Model.load`` is in ``butter_core.model``).

The user owns the caches: make them once, keep them across calls for multi-turn or
streaming use, and every call continues at ``caches[i].absolute_position``::

    model = Model.load(None, options=LoadOptions(kv_cache=Raw()))
    caches = model.engine.make_layer_caches()
    next_id = model.engine.forward_sample(token_id, position, caches)

A prompt goes through ``forward`` in chunks of ``prefill_chunk`` tokens, each chunk one
batched pass through every layer, never one token at a time.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import attrs
import mlx.core as mx

from butter_core.cache import LayerCache, LayerSpec
from butter_core.config import LoadOptions, Window
from butter_core.errors import ButterError, ConfigError
from butter_core.layer_caches import make_layer_caches
from butter_core.models import DecoderModel
from butter_core.sampling import GREEDY, Sampler
from butter_core.window import WindowCache

PREFILL_CHUNK = 512
"""Prompt tokens per forward pass during prefill."""

TokenIds = Sequence[int] | mx.array


class PositionError(ButterError, ValueError):
    """``forward_sample`` was given a position that is not where the caches continue."""


@attrs.frozen
class LayerTiming:
    """One layer's share of a traced forward pass."""

    layer_index: int
    seconds: float
    output_shape: tuple[int, ...]


class Engine:
    """Runs a ``DecoderModel`` over per-layer KV caches."""

    def __init__(self, network: DecoderModel, options: LoadOptions, *, prefill_chunk: int = PREFILL_CHUNK):
        if prefill_chunk <= 0:
            raise ConfigError(f"prefill_chunk must be a positive integer, got {prefill_chunk!r}")
        self.network = network
        self.options = options
        self.prefill_chunk = prefill_chunk

    def layer_specs(self) -> list[LayerSpec]:
        """What each attention layer's cache must hold; capacity is ``max_context_length`` or the advertised window."""
        args = self.network.args
        max_positions = self.options.max_context_length or args.max_position_embeddings
        return [
            LayerSpec(
                n_kv_heads=args.num_key_value_heads,
                head_dim=args.head_dim,
                max_positions=max_positions,
                dtype=self.network.dtype,
                layer_index=index,
            )
            for index in range(args.num_hidden_layers)
        ]

    def make_layer_caches(self) -> list[LayerCache]:
        """One cache per layer of the configured scheme, under the configured eviction; the family's
        sliding-window layers are bounded by its window."""
        windows = self.network.args.layer_windows()
        return make_layer_caches(
            self.options.kv_cache,
            self.layer_specs(),
            self.options.kv_eviction,
            layer_windows=windows if any(windows) else None,
        )

    def forward(self, token_ids: TokenIds, caches: Sequence[LayerCache], *, all_logits: bool = False) -> mx.array:
        """Append ``token_ids`` to ``caches`` and return the next-token logits.

        Returns the last position's logits ``[vocab]``, or every position's
        ``[tokens, vocab]`` with ``all_logits``. The result is lazy (``mx.eval`` it);
        chunks before the last are evaluated as they go.
        """
        ids = self._ids(token_ids)
        self._check_caches(caches)
        outputs = []
        for start in range(0, ids.size, self.prefill_chunk):
            hidden = self.network.hidden_states(ids[None, start : start + self.prefill_chunk], caches)
            last_chunk = start + self.prefill_chunk >= ids.size
            if all_logits:
                outputs.append(self.network.logits(hidden)[0])
            elif last_chunk:
                outputs.append(self.network.logits(hidden[:, -1])[0])
            if not last_chunk:
                mx.eval(outputs, hidden)
        return mx.concatenate(outputs) if all_logits else outputs[0]

    def forward_sample(
        self, token_id: int, position: int, caches: Sequence[LayerCache], sampler: Sampler | None = None
    ) -> int:
        """Append one token at ``position`` (which must be where ``caches`` continue) and sample the next."""
        self._check_caches(caches)
        expected = caches[0].absolute_position
        if position != expected:
            raise PositionError(
                f"forward_sample: position {position} is not where the caches continue; they hold positions "
                f"0..{expected - 1}, so the next token goes at position {expected} (or make fresh caches)"
            )
        return (sampler or GREEDY)(self.forward([token_id], caches)).item()

    def layer_trace(self, token_ids: TokenIds, caches: Sequence[LayerCache]) -> list[LayerTiming]:
        """Run one forward pass layer by layer, timing each (evaluated in turn)."""
        self._check_caches(caches)
        hidden = self.network.embed(self._ids(token_ids)[None])
        mx.eval(hidden)
        timings = []
        for index, (layer, cache) in enumerate(zip(self.network.layers, caches)):
            start = time.perf_counter()
            hidden = layer(hidden, cache)
            mx.eval(hidden)
            timings.append(LayerTiming(index, time.perf_counter() - start, tuple(hidden.shape)))
        return timings

    def _ids(self, token_ids: TokenIds) -> mx.array:
        ids = (token_ids if isinstance(token_ids, mx.array) else mx.array(token_ids, dtype=mx.uint32)).reshape(-1)
        if ids.size == 0:
            raise ConfigError("forward needs at least one token id")
        return ids

    def _check_caches(self, caches: Sequence[LayerCache]) -> None:
        layers = self.network.args.num_hidden_layers
        if len(caches) != layers:
            raise ConfigError(
                f"got {len(caches)} caches for a model of {layers} layers; make them with engine.make_layer_caches()"
            )


def cache_windows(caches: Sequence[LayerCache]) -> list[Window | None]:
    """The window each cache evicts to (None where unbounded): what a full recompute must mask to match."""
    return [cache.window if isinstance(cache, WindowCache) else None for cache in caches]
