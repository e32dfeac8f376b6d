"""The layer-cache contract every cache scheme honours.

* :class:`LayerCache` is what every layer's cache has in common, whatever the layer:
  positions, byte accounting, state export and import, trim, reserve. A model holds one per
  layer (``make_layer_caches``).
* :class:`AttentionCache` is what a model's attention layer talks to: one call per layer
  per forward, ``update_and_attend(queries, keys, values, scale=...)``, plus
  ``absolute_position`` for the next token's RoPE. Eviction decorators implement it.
  (A recurrent layer's cache is a ``butter_core.recurrent.StateCache``.)
* :class:`SlotCache` is what a scheme author subclasses: storage addressed by slot
  (``store`` rows, ``load`` the live slots, export/import them). The base class turns
  those primitives into the whole ``LayerCache`` API, so a scheme writes storage code
  only and may override ``attention`` with a fused kernel.

Shapes follow MLX: keys and values ``[batch, n_kv_heads, tokens, head_dim]``, queries
``[batch, n_q_heads, tokens, head_dim]`` with ``n_q_heads`` a multiple of ``n_kv_heads``.
Keys arrive with RoPE already applied at their absolute positions, so attention over
stored slots does not depend on slot order.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import ClassVar, Literal

import attrs
import mlx.core as mx

from butter_core import cpu_attention
from butter_core.compiled import traced
from butter_core.errors import ConfigError

Mask = None | Literal["causal"] | mx.array
"""Which stored slots each query sees: None (all live slots), "causal" (the last
``tokens`` slots are the queries themselves, aligned bottom-right) or a boolean array
broadcastable to ``[batch, n_q_heads, tokens, length]``."""


ATTENTION = "attention"
"""Layer type of every attention layer, full or sliding (a family's sliding layers are
attention layers under a window): what ``LayerSpec`` sizes."""


@attrs.frozen
class LayerSpec:
    """What a scheme needs to size one attention layer's cache.

    ``ring_start`` is set when an eviction decorator reuses slots: slots from ``ring_start``
    to ``max_positions`` then hold positions in turn (the window's ring: position ``p >=
    ring_start`` in slot ``ring_start + (p - ring_start) % (max_positions - ring_start)``).
    None: slot ``i`` holds position ``i``. A scheme that keeps some positions apart (AURA's
    newest rows in full precision) reads it; others need not.

    ``shard`` is ``(rank, ranks)`` under tensor parallelism (``butter_core.distributed``): the
    cache holds KV heads ``[rank * n_kv_heads, (rank + 1) * n_kv_heads)`` of the layer's ``ranks *
    n_kv_heads``. A scheme whose per-head parameters are drawn at random (AURA's rotations) draws
    the layer's whole and keeps its share, so that a rank stores what one process stores.
    """

    layer_type: ClassVar[str] = ATTENTION
    n_kv_heads: int
    head_dim: int
    max_positions: int
    dtype: mx.Dtype = mx.float16
    layer_index: int = 0
    batch_size: int = 1
    ring_start: int | None = None
    shard: tuple[int, int] = (0, 1)

    def __attrs_post_init__(self):
        for name in ("n_kv_heads", "head_dim", "max_positions", "batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"LayerSpec.{name} must be a positive integer, got {value!r}")
        start = self.ring_start
        if start is not None and (not isinstance(start, int) or not 0 <= start < self.max_positions):
            raise ConfigError(f"LayerSpec.ring_start must be None or in [0, max_positions), got {start!r}")
        rank, ranks = self.shard
        if not 0 <= rank < ranks:
            raise ConfigError(f"LayerSpec.shard must be (rank, ranks) with 0 <= rank < ranks, got {self.shard!r}")

    def with_ring(self, max_positions: int, ring_start: int) -> LayerSpec:
        """The same layer holding ``max_positions`` slots, reused in turn from ``ring_start`` on
        (what an eviction decorator gives the scheme it wraps)."""
        return attrs.evolve(self, max_positions=max_positions, ring_start=ring_start)


def check_chunk(spec: LayerSpec, keys: mx.array, values: mx.array, queries: mx.array | None = None) -> None:
    """Raise ConfigError unless ``keys`` and ``values`` are ``[batch, n_kv_heads, tokens, head_dim]``
    of the layer ``spec`` describes (and ``queries``, if given, ``[batch, n_q_heads, tokens,
    head_dim]`` with ``n_q_heads`` a multiple of ``n_kv_heads``): a chunk of another shape would
    otherwise fail inside MLX, or be stored where it does not belong."""
    batch, heads, dims = spec.batch_size, spec.n_kv_heads, spec.head_dim
    for name, array in (("keys", keys), ("values", values)):
        shape = array.shape
        if len(shape) != 4 or shape[0] != batch or shape[1] != heads or shape[3] != dims:
            raise ConfigError(f"layer {spec.layer_index}: {name} of shape {list(shape)}; this cache holds "
                              f"[batch {batch}, kv heads {heads}, tokens, head_dim {dims}]")  # fmt: skip
    if keys.shape[2] != values.shape[2]:
        raise ConfigError(f"layer {spec.layer_index}: {keys.shape[2]} keys but {values.shape[2]} values")
    if queries is not None:
        shape = queries.shape
        if len(shape) != 4 or shape[1] % heads or shape[0] != batch or shape[2] != keys.shape[2] or shape[3] != dims:
            raise ConfigError(
                f"layer {spec.layer_index}: queries of shape {list(shape)} for {keys.shape[2]} keys; expected "
                f"[batch {batch}, a multiple of {heads} heads, {keys.shape[2]} tokens, head_dim {dims}]"
            )


def reference_attention(queries: mx.array, keys: mx.array, values: mx.array, *, scale: float, mask: Mask = None) -> mx.array:
    """Plain attention in float32 with GQA, the yardstick every scheme is checked against."""
    q = queries.astype(mx.float32)
    b, n_q, t, d = q.shape
    n_kv, length = keys.shape[1], keys.shape[2]
    q = q.reshape(b, n_kv, n_q // n_kv, t, d)
    k = keys.astype(mx.float32)[:, :, None]
    v = values.astype(mx.float32)[:, :, None]
    scores = (q * scale) @ k.swapaxes(-1, -2)
    if isinstance(mask, str):
        mask = mx.arange(length)[None] <= (mx.arange(t)[:, None] + length - t)
    if mask is not None:
        mask = mx.broadcast_to(mask, (b, n_q, t, length)).reshape(b, n_kv, n_q // n_kv, t, length)
        scores = mx.where(mask, scores, -mx.inf)
    out = mx.softmax(scores, axis=-1) @ v
    return out.reshape(b, n_q, t, d)


def attend(queries: mx.array, keys: mx.array, values: mx.array, *, scale: float, mask: Mask = None) -> mx.array:
    """MLX's fused attention, computed in the wider of the query and key dtypes, returned in the queries'
    dtype; a float32 decode step on the CPU takes ``cpu_attention.decode_attention`` instead."""
    if cpu_attention.serves(queries, keys, values, mask):
        return cpu_attention.decode_attention(queries, keys, values, scale=scale)
    if keys.dtype == queries.dtype:
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)
    wide = mx.float32 if keys.dtype.size == queries.dtype.size else max(queries.dtype, keys.dtype, key=lambda d: d.size)
    out = mx.fast.scaled_dot_product_attention(
        queries.astype(wide), keys.astype(wide), values.astype(wide), scale=scale, mask=mask
    )
    return out.astype(queries.dtype)


@attrs.frozen
class StepCall:
    """A cache's decode step for one token as a pure function of arrays, for its caller to run traced
    (``SlotCache.step_call``): ``fn(queries, keys, values, *inputs)`` returns the attention's output,
    then the arrays that replace the cache's, which ``take`` is handed. ``fn`` is one object for every
    layer and step it serves (its traces are shared: ``compiled.traced``), and the cache's own
    bookkeeping for the token is done when it hands out the call, so the call must be run."""

    fn: Callable[..., tuple[mx.array, ...]]
    inputs: tuple[mx.array, ...]
    take: Callable[[Sequence[mx.array]], None]


class LayerCache(ABC):
    """One layer's cache as a model sees it, whatever the layer: what every cache has."""

    spec: LayerSpec

    @property
    @abstractmethod
    def absolute_position(self) -> int:
        """Positions appended so far, never decreasing under eviction: the next token's RoPE offset."""

    @property
    def capacity(self) -> int | None:
        """The most positions this cache can take from the start (None: no bound)."""
        return None

    @property
    @abstractmethod
    def nbytes_allocated(self) -> int:
        """Bytes of device memory this cache holds now."""

    @property
    @abstractmethod
    def nbytes_live(self) -> int:
        """Bytes that encode the live positions (equal to the nbytes of ``state()``)."""

    @abstractmethod
    def state(self) -> dict[str, mx.array]:
        """The live contents as arrays, for saving and prefix caching."""

    @abstractmethod
    def meta_state(self) -> dict[str, int | str]:
        """Scalars that go with ``state()`` (positions, window parameters...)."""

    @abstractmethod
    def restore(self, state: dict[str, mx.array], meta: dict[str, int | str]) -> None:
        """Replace the contents with an exported ``state()``/``meta_state()`` of an equal cache."""

    @abstractmethod
    def trim(self, n: int) -> int:
        """Drop the last ``n`` positions; returns how many were dropped (0 where they cannot be:
        a recurrent state, a window that has wrapped; restore a saved ``state()`` instead)."""

    @property
    def warm_up_steps(self) -> int:
        """Decode steps after which this cache's decode steps run nothing new: work a cache
        defers and does every ``n`` steps (a batch of codes written at once) first comes due
        within them. ``butter_core.warm_up`` decodes at least this many, so that the first
        such step of a generation compiles nothing."""
        return 1

    def reserve(self, positions: int) -> None:
        """Allocate room for ``positions`` positions in all (at most ``capacity``) now, so that
        appends up to there never grow the storage piece by piece. A hint: a cache without
        growable storage ignores it, and one that holds more keeps what it has."""

    def snapshot(self) -> Snapshot:
        """The contents now, to come back to with ``rewind``: multi-turn edits, prefix reuse,
        speculative rollback. MLX arrays are values, so a snapshot holds the arrays of this
        moment (a recurrent state costs nothing more; an attention cache's views of its live
        slots keep its buffers from being updated in place, so its next write copies them)."""
        return Snapshot(self.state(), self.meta_state(), self.absolute_position)

    def rewind(self, snapshot: Snapshot) -> None:
        """Return to ``snapshot``, taken of this cache or of one of equal spec and scheme."""
        self.restore(snapshot.arrays, snapshot.meta)


@attrs.frozen
class Snapshot:
    """A cache's contents at one position (``LayerCache.snapshot``)."""

    arrays: dict[str, mx.array]
    meta: dict[str, int | str]
    position: int
    """Where the cache continues after ``rewind``."""


class AttentionCache(LayerCache):
    """One attention layer's KV cache as a model sees it."""

    @property
    @abstractmethod
    def length(self) -> int:
        """Live positions: how many keys the next attention call reads."""

    @property
    def capacity(self) -> int | None:
        """The most positions this cache can take from the start (None: no bound, eviction makes room)."""
        return self.spec.max_positions

    @abstractmethod
    def update_and_attend(self, queries: mx.array, keys: mx.array, values: mx.array, *, scale: float) -> mx.array:
        """Append ``keys``/``values`` (``tokens`` new positions) and return attention for ``queries``.

        Each query token attends causally: to every live position up to and including
        its own, exactly as if the tokens had arrived one at a time.
        """

    @abstractmethod
    def prepare_for_attention(self) -> tuple[mx.array, mx.array]:
        """Keys and values of the live positions, materialised as floats (the storage's float dtype)."""

    @abstractmethod
    def append(self, keys: mx.array, values: mx.array) -> None:
        """Append ``tokens`` positions without attending (prefix filling, tests)."""


class SlotCache(AttentionCache):
    """Base for a scheme's storage: rows addressed by slot, live slots ``[0, length)``.

    A subclass implements ``store``, ``load``, ``export_slots``, ``import_slots`` and
    ``buffers``; it may override ``attention`` (a fused decode kernel),
    ``store_and_attend`` (the write and the attention of one forward in one place) and
    ``truncate``. With no eviction, slot ``i`` holds position ``i``.
    """

    def __init__(self, spec: LayerSpec):
        self.spec = spec
        self._length = 0

    # -- what a scheme implements -------------------------------------------------

    @abstractmethod
    def store(self, start: int, keys: mx.array, values: mx.array, position: int) -> None:
        """Write ``tokens`` rows into slots ``[start, start + tokens)``, re-encoding from scratch.

        The rows are positions ``[position, position + tokens)`` (``position == start``
        without eviction; a window writes its ring's slots with later positions). Only a
        scheme that keeps some positions apart needs it. ``start <= length`` and ``start +
        tokens <= capacity`` are guaranteed by the caller.
        """

    @abstractmethod
    def load(self, length: int) -> tuple[mx.array, mx.array]:
        """Keys and values of slots ``[0, length)`` as floats (the model dtype, or wider)."""

    @abstractmethod
    def export_slots(self, length: int) -> dict[str, mx.array]:
        """The encoded contents of slots ``[0, length)``, as compact arrays."""

    @abstractmethod
    def import_slots(self, arrays: dict[str, mx.array], length: int) -> None:
        """Inverse of ``export_slots``: make slots ``[0, length)`` hold ``arrays``."""

    @abstractmethod
    def buffers(self) -> list[mx.array]:
        """Every array this cache keeps allocated (for byte accounting)."""

    @property
    @abstractmethod
    def bytes_per_slot(self) -> int:
        """Encoded bytes of one position across heads and batch, K and V together."""

    def attention(self, queries: mx.array, *, scale: float, mask: Mask) -> mx.array:
        """Attention of ``queries`` over the live slots, in the queries' dtype; schemes override with fused kernels."""
        keys, values = self.load(self._length)
        return attend(queries, keys, values, scale=scale, mask=mask)

    def store_and_attend(
        self, start: int, keys: mx.array, values: mx.array, position: int, queries: mx.array, *, scale: float, mask: Mask
    ) -> mx.array:
        """Write rows of positions ``[position, position + tokens)`` at slots ``[start, start + tokens)``
        (``write``) and return attention of ``queries`` over the live slots after the write, under
        ``mask``: the one call a forward makes into a scheme per layer (``update_and_attend``, and
        the window decorator while its slots hold its positions in order or it takes one token).

        The default takes ``step_call`` for one token where the scheme has one (run traced), else
        writes, then calls ``attention``. A scheme overrides it to do both in one place for a chunk
        too: attend to a chunk from the rows as they arrived rather than decoding what it just
        encoded (butter-aura).
        """
        tokens = keys.shape[2]
        self._check_write(start, tokens)
        if mask is None and tokens == 1 and queries.shape[2] == 1:
            live = max(self._length, start + 1)
            call = self.step_call(start, position, live, scale, keys.dtype)
            if call is not None:
                out, *written = traced(call.fn)(queries, keys, values, *call.inputs)
                call.take(written)
                self._length = live
                return out
        self._store_checked(start, keys, values, position)
        return self.attention(queries, scale=scale, mask=mask)

    def step_call(self, start: int, position: int, live: int, scale: float, dtype: mx.Dtype) -> StepCall | None:
        """Optional: one token's ``store`` at slot ``start`` (position ``position``; keys and values of
        ``dtype``; the write was checked) and ``attention`` over the slots ``[0, live)`` after it, as a
        ``StepCall``, or None to take that path. A decode step on a GPU is bound by the host, so a
        scheme whose write and attention are kernels does better with them in one traced call than
        with a call and a slice assignment each: its buffers among the call's inputs and written
        there (``slots.slot_update``, or by its kernel), then replaced by the outputs
        (``SlotBuffers.replace``), which updates them in place. A decoder block traces the call
        together with its own work around the cache (``decode_call``, ``models.traced``)."""
        return None

    def decode_call(self, scale: float, dtype: mx.Dtype) -> StepCall | None:
        """``update_and_attend`` of one token (keys and values of ``dtype``) as a ``StepCall``
        (``step_call``), for a caller that traces it with work of its own (a decoder block's decode
        step, ``models.traced``); None where the scheme has none. The token is counted as the call is
        handed out."""
        if type(self).step_call is SlotCache.step_call:  # a scheme without one (raw): nothing to check or ask
            return None
        start = self._length
        self._check_write(start, 1)
        call = self.step_call(start, start, start + 1, scale, dtype)
        if call is not None:
            self._length = start + 1
        return call

    # -- the LayerCache API, built on the primitives ----------------------------

    @property
    def length(self) -> int:
        return self._length

    @property
    def absolute_position(self) -> int:
        return self._length

    def write(self, start: int, keys: mx.array, values: mx.array, position: int | None = None) -> None:
        """Store rows of positions ``[position, position + tokens)`` (default: ``start``) at slots
        ``[start, start + tokens)``; used by ``append`` and eviction decorators."""
        self._check_write(start, keys.shape[2])
        self._store_checked(start, keys, values, start if position is None else position)

    def _store_checked(self, start: int, keys: mx.array, values: mx.array, position: int) -> None:
        self.store(start, keys, values, position)
        self._length = max(self._length, start + keys.shape[2])

    def _check_write(self, start: int, tokens: int) -> None:
        if start < 0 or start > self._length:
            raise IndexError(f"write at slot {start} would leave a gap: live slots are [0, {self._length})")
        if start + tokens > self.capacity:
            raise ConfigError(
                f"layer {self.spec.layer_index}: {start + tokens} positions exceed the cache capacity "
                f"{self.capacity}; raise max_context_length or use window eviction (--kv-window-size)"
            )

    def append(self, keys, values):
        check_chunk(self.spec, keys, values)
        self.write(self._length, keys, values)

    def update_and_attend(self, queries, keys, values, *, scale):
        check_chunk(self.spec, keys, values, queries)
        mask = "causal" if queries.shape[2] > 1 else None
        return self.store_and_attend(self._length, keys, values, self._length, queries, scale=scale, mask=mask)

    def prepare_for_attention(self):
        return self.load(self._length)

    @property
    def nbytes_allocated(self) -> int:
        return sum(buffer.nbytes for buffer in self.buffers())

    @property
    def nbytes_live(self) -> int:
        return self._length * self.bytes_per_slot

    def state(self):
        return self.export_slots(self._length)

    def meta_state(self):
        return {"length": self._length}

    def restore(self, state, meta):
        length = int(meta["length"])
        if length > self.capacity:
            raise ConfigError(f"restored state holds {length} positions; this cache holds at most {self.capacity}")
        self.import_slots(state, length)
        self._length = length

    def truncate(self, length: int) -> None:
        """Forget slots ``[length, ...)``; storage may keep stale bytes there (``store`` re-encodes)."""
        self._length = length

    def trim(self, n):
        n = max(0, min(n, self._length))
        self.truncate(self._length - n)
        return n
