"""The engine of the seed's API, in Python: ``model.engine.make_layer_caches()``, ``forward``
and ``forward_sample`` (``Model.load`` is in ``butter_core.model``).

The user owns the caches: make them once, keep them across calls for multi-turn or
streaming use, and every call continues at ``caches[i].absolute_position``::

    model = Model.load(None, options=LoadOptions(kv_cache="raw"))
    caches = model.engine.make_layer_caches()
    next_id = model.engine.forward_sample(token_id, position, caches)

A prompt goes through ``forward`` in chunks of ``prefill_chunk`` tokens (``PREFILL_CHUNK``,
by device), each chunk one batched pass through every layer, never one token at a time.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence

import attrs
import mlx.core as mx
import numpy as np

from butter_core.batched import PAGE_SIZE, BatchedCaches, SequenceHandle
from butter_core.cache import LayerCache, LayerSpec
from butter_core.config import LoadOptions, Window
from butter_core.errors import ButterError, ConfigError
from butter_core.kernels.backend import default_device_is_gpu, gpu_backend, gpu_memory
from butter_core.layer_caches import kv_cache_kind, layer_kinds, make_layer_caches, tighter
from butter_core.models import DecoderModel
from butter_core.models.fused import fuse_projections
from butter_core.recurrent import StateCache, StateSpec
from butter_core.sampling import GREEDY, Sampler
from butter_core.slots import BufferedSlotCache
from butter_core.window import WindowCache

PREFILL_CHUNK = {"cpu": 512, "gpu": 2048}
"""Prompt tokens per forward pass during prefill, by the default device. On the H200 a
Qwen3-1.7B-shaped model prefills 32k tokens 2.6x faster in chunks of 2048 than of 512, at
11-32% more peak memory (docs/benchmarks.md); on a small CPU a 512-token chunk's attention
temporaries are what fits."""
LARGE_PREFILL_CHUNK = 8192
"""The prefill chunk on a CUDA GPU of ``LARGE_PREFILL_MEMORY`` or more. Each chunk of a
compressed scheme decodes every position before it once (``BufferedSlotCache.load``), so
fewer, longer chunks do less of that, and every scheme launches fewer kernels. On an H100
(Qwen3-1.7B-shaped, 4k-128k) every scheme prefills at 1.14-1.8x mlx-lm's default of 2048,
against 0.83-1.24x at 2048, for 1-6 GiB more peak memory (docs/benchmarks.md, "Prefill
chunk by device"). Metal keeps 2048: not measured there."""
LARGE_PREFILL_MEMORY = 64 * 2**30
"""Device memory (``kernels.backend.gpu_memory``) from which a CUDA GPU takes
``LARGE_PREFILL_CHUNK``: there its extra working set is a few percent of the memory."""


def default_prefill_chunk() -> int:
    """``PREFILL_CHUNK`` for MLX's default device; ``LARGE_PREFILL_CHUNK`` on a CUDA GPU of
    ``LARGE_PREFILL_MEMORY`` or more."""
    if not default_device_is_gpu():
        return PREFILL_CHUNK["cpu"]
    if gpu_backend() == "cuda" and (gpu_memory() or 0) >= LARGE_PREFILL_MEMORY:
        return LARGE_PREFILL_CHUNK
    return PREFILL_CHUNK["gpu"]

TokenIds = Sequence[int] | mx.array


class PositionError(ButterError, ValueError):
    """``forward_sample`` was given a position that is not where the caches continue."""


class TokenIdError(ConfigError):
    """Token ids that are not one sequence of integers in the model's vocabulary."""


class ContextLengthError(ConfigError):
    """More positions than the caches can hold (checked before the work starts)."""


@attrs.frozen
class LayerTiming:
    """One layer's share of a traced forward pass."""

    layer_index: int
    seconds: float
    output_shape: tuple[int, ...]


class Engine:
    """Runs a ``DecoderModel`` over per-layer KV caches."""

    def __init__(self, network: DecoderModel, options: LoadOptions, *, prefill_chunk: int | None = None):
        """``prefill_chunk`` (default: ``options.prefill_chunk``, else ``default_prefill_chunk()``)
        is the prompt tokens each prefill forward pass takes. Fuses ``network``'s projections that
        read the same input (``fuse_projections``: fewer operations a decode step)."""
        if prefill_chunk is None:
            prefill_chunk = default_prefill_chunk() if options.prefill_chunk is None else options.prefill_chunk
        if not isinstance(prefill_chunk, int) or prefill_chunk <= 0:
            raise ConfigError(f"prefill_chunk must be a positive integer, got {prefill_chunk!r}")
        fuse_projections(network)
        self.network = network
        self.options = options
        self.prefill_chunk = prefill_chunk

    @property
    def max_context(self) -> int:
        """Positions one sequence may hold: ``max_context_length``, or the model's trained context."""
        return self.options.max_context_length or self.network.args.max_position_embeddings

    def layer_specs(self) -> list[LayerSpec | StateSpec]:
        """What each layer's cache must hold: an attention layer's capacity is ``max_context``
        or the advertised window; a recurrent layer's state is sized by the layer alone."""
        return self.network.layer_specs(self.max_context)

    def make_layer_caches(self) -> list[LayerCache]:
        """One cache per layer, of the scheme configured for its type (``kv_cache`` for attention,
        ``state_cache`` for recurrent layers); attention layers under the configured eviction,
        the family's sliding-window layers bounded by its window."""
        windows = self.network.layer_windows()
        return make_layer_caches(
            layer_kinds(self.options),
            self.layer_specs(),
            self.options.kv_eviction,
            layer_windows=windows if any(windows) else None,
        )

    def make_batched_caches(
        self, capacity_tokens: int, *, page_size: int = PAGE_SIZE, max_sequences: int | None = None
    ) -> BatchedCaches:
        """Storage for many sequences (``butter_core.batched``): pages holding ``capacity_tokens``
        positions in all for the attention layers (scheme ``kv_cache``), and for recurrent layers
        (scheme ``state_cache``) a state pool of ``max_sequences`` rows (default: one per page, at
        most 64 where there are recurrent layers). Attention layers keep the window ``kv_eviction`` gives them (or the family's
        sliding window, the smaller), per sequence; another eviction policy is refused.
        """
        specs = self.layer_specs()
        eviction = self.options.kv_eviction
        if eviction is not None and not isinstance(eviction, Window):
            raise ConfigError(f"batched caches evict by window only (--kv-window-size); got {eviction!r}")
        family = self.network.layer_windows()
        windows = [tighter(eviction, w) if isinstance(s, LayerSpec) else None for s, w in zip(specs, family)]
        prototypes = make_layer_caches(layer_kinds(self.options), [attrs.evolve(s, batch_size=1) for s in specs])
        for spec, cache in zip(specs, prototypes):
            if isinstance(spec, StateSpec):
                if not isinstance(cache, StateCache):
                    raise ConfigError(f"layer {spec.layer_index}: the state scheme's caches ({type(cache).__name__}) "
                                      "are not StateCaches, whose mix batched state pools run")  # fmt: skip
            elif not isinstance(cache, BufferedSlotCache) or type(cache).encode is BufferedSlotCache.encode:
                raise ConfigError(
                    f"layer {spec.layer_index}: the {kv_cache_kind(self.options)} scheme's caches "
                    f"({type(cache).__name__}) do not define BufferedSlotCache.encode/decode, which batched "
                    "storage writes and reads pages with"
                )
        return BatchedCaches(specs, prototypes, capacity_tokens=capacity_tokens, page_size=page_size,
                             max_sequences=max_sequences, windows=windows)  # fmt: skip

    def run_batched(self, ids: mx.array, caches: BatchedCaches, handles: Sequence[SequenceHandle],
                    counts: Sequence[int] | None = None) -> mx.array:  # fmt: skip
        """Append ``ids`` (``[sequences, tokens]``, token ids checked or sampled) to the sequences
        ``handles`` of ``caches`` and return each one's next-token logits ``[sequences, vocab]``
        (lazy). With ``counts``, sequence ``b`` takes only ``ids[b, :counts[b]]`` (the rest is padding;
        attention layers only: ``BatchedStep``). Each sequence's pages must hold the new positions
        (``caches.reserve``)."""
        step = caches.step(handles, ids.shape[1], counts)
        hidden = self.network.hidden_states(ids, caches.views(step))
        step.advance()
        if not step.ragged:
            return self.network.logits(hidden[:, -1])
        last = mx.array([n - 1 for n in step.counts], dtype=mx.int32)
        return self.network.logits(hidden[mx.arange(len(step.counts)), last])

    def forward(
        self,
        token_ids: TokenIds,
        caches: Sequence[LayerCache],
        *,
        all_logits: bool = False,
        progress: Callable[[int, int], None] | None = None,
    ) -> mx.array:
        """Append ``token_ids`` to ``caches`` and return the next-token logits.

        Returns the last position's logits ``[vocab]``, or every position's
        ``[tokens, vocab]`` with ``all_logits``. The result is lazy (``mx.eval`` it);
        chunks before the last are evaluated as they go, and ``progress(done, total)``
        is called after each of them (tokens done so far, tokens in all).

        The ids are checked first (see ``token_ids``), and so is the room the caches
        have left: nothing is appended unless all of them fit.
        """
        ids = self.token_ids(token_ids)
        self.check_caches(caches)
        self.make_room(caches, ids.size, f"{ids.size} token ids")
        return self.run(ids, caches, all_logits=all_logits, progress=progress)

    def run(
        self,
        ids: mx.array,
        caches: Sequence[LayerCache],
        *,
        all_logits: bool = False,
        progress: Callable[[int, int], None] | None = None,
    ) -> mx.array:
        """``forward`` without its checks, for ids already checked (``token_ids``, ``make_room``)
        or drawn by a ``Sampler`` from this model's logits: nothing waits for ``ids`` to be
        computed, so a decode loop queues its next step before the sampled token reaches Python."""
        ids = ids.reshape(-1)
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
                if progress is not None:
                    progress(start + self.prefill_chunk, ids.size)
        return mx.concatenate(outputs) if all_logits else outputs[0]

    def forward_sample(
        self, token_id: int, position: int, caches: Sequence[LayerCache], sampler: Sampler | None = None
    ) -> int:
        """Append one token at ``position`` (which must be where ``caches`` continue) and sample the next."""
        self.check_caches(caches)
        expected = caches[0].absolute_position
        if position != expected:
            raise PositionError(
                f"forward_sample: position {position} is not where the caches continue; they hold positions "
                f"0..{expected - 1}, so the next token goes at position {expected} (or make fresh caches)"
            )
        return (sampler or GREEDY)(self.forward([token_id], caches)).item()

    def layer_trace(self, token_ids: TokenIds, caches: Sequence[LayerCache]) -> list[LayerTiming]:
        """Run one forward pass layer by layer, timing each (evaluated in turn)."""
        self.check_caches(caches)
        ids = self.token_ids(token_ids)
        self.make_room(caches, ids.size, f"{ids.size} token ids")
        hidden = self.network.embed(ids[None])
        mx.eval(hidden)
        timings = []
        for index, (layer, cache) in enumerate(zip(self.network.layers, self.network.along_layers(caches))):
            start = time.perf_counter()
            hidden = layer(hidden, cache)
            mx.eval(hidden)
            timings.append(LayerTiming(index, time.perf_counter() - start, tuple(hidden.shape)))
        return timings

    def token_ids(self, token_ids: TokenIds) -> mx.array:
        """``token_ids`` as a flat ``uint32`` array, after checking that they are one sequence
        (a list or 1-D array; a 0-D array is one token) of integers in ``[0, vocab_size)``.

        Anything else raises ``TokenIdError``: an id outside the embedding table would be
        read from memory past it, and a float or nested list would be silently truncated
        or flattened. An ``mx.array`` is evaluated for the range check.
        """
        vocab = self.network.args.vocab_size
        if isinstance(token_ids, mx.array):
            ids, integers = token_ids, mx.issubdtype(token_ids.dtype, mx.integer)
        else:
            try:
                ids = np.asarray(token_ids)
            except (TypeError, ValueError) as exc:  # ragged nested lists
                raise TokenIdError(f"token ids must be one sequence of integers; got {_preview(token_ids)}") from exc
            integers = ids.dtype.kind in "iu"  # not bool ("b"), float, str or object
        if ids.ndim > 1:
            raise TokenIdError(
                f"token ids must be one sequence (a list or 1-D array), got shape {list(ids.shape)}; "
                "feed each sequence through its own caches"
            )
        if ids.size == 0:
            raise TokenIdError("forward needs at least one token id")
        if not integers:
            raise TokenIdError(f"token ids must be integers; got {_preview(token_ids)} ({ids.dtype})")
        low, high = (int(x.item()) for x in (ids.min(), ids.max()))
        if low < 0 or high >= vocab:
            bad = low if low < 0 else high
            raise TokenIdError(f"token id {bad} is out of range: this model's ids are 0..{vocab - 1}")
        return (ids if isinstance(ids, mx.array) else mx.array(ids)).astype(mx.uint32).reshape(-1)

    def make_room(self, caches: Sequence[LayerCache], tokens: int, what: str) -> None:
        """Have ``caches`` allocate room for ``tokens`` more positions at once (``reserve``), or
        raise ``ContextLengthError``, before any work, when they do not fit (``what`` names
        them: "the prompt's 8301 tokens and --max-tokens 256")."""
        limits = [cache.capacity for cache in caches if cache.capacity is not None]
        held = caches[0].absolute_position if caches else 0
        if not limits or held + tokens <= min(limits):
            for cache in caches:
                cache.reserve(held + tokens)
            return
        raise self.context_error(held + tokens, min(limits), what, held)

    def context_error(self, needed: int, capacity: int, what: str, held: int = 0) -> ContextLengthError:
        """The error for ``what`` needing ``needed`` positions where a cache holds ``capacity``."""
        cap = self.options.max_context_length
        source = (
            f"--max-context {cap} (max_context_length)"
            if cap
            else f"the model's max_position_embeddings, {self.network.args.max_position_embeddings}"
        )
        already = f" after the {held} positions the caches already hold" if held else ""
        return ContextLengthError(
            f"{what} need {needed} positions{already}, but the KV cache holds {capacity} ({source}): "
            "shorten the prompt, lower --max-tokens, raise --max-context, or evict old positions with "
            "--kv-window-size"
        )

    def check_caches(self, caches: Sequence[LayerCache]) -> None:
        """Raise ConfigError unless ``caches`` has one cache per layer that keeps state."""
        if len(caches) != self.cache_count:
            layers = self.network.args.num_hidden_layers
            held = "" if self.cache_count == layers else f" ({self.cache_count} of them keep state)"
            raise ConfigError(
                f"got {len(caches)} caches for a model of {layers} layers{held}; make them with "
                "engine.make_layer_caches()"
            )

    @functools.cached_property
    def cache_count(self) -> int:
        """How many caches the model's layers take: one per ``layer_specs`` entry."""
        return len(self.layer_specs())


def cache_windows(caches: Sequence[LayerCache]) -> list[Window | None]:
    """The window each cache evicts to (None where unbounded): what a full recompute must mask to match."""
    return [cache.window if isinstance(cache, WindowCache) else None for cache in caches]


def _preview(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
