"""What one AURA layer cache stores, and the design constants behind it.

Per slot and KV head: the key's codes and scales and the value's codes and scales
(``codec.Codec``). Beside them, a small full-precision budget (``FullPrecisionBudget``):
the first ``SINKS`` slots and the ``RECENT`` most recently written slots are also kept
as 16-bit copies of the original (unrotated) vectors, and attention reads those rows
instead of their codes. The
constants are the measured choice recorded in docs/aura.md.
"""

from __future__ import annotations

import functools

import attrs
import mlx.core as mx
import numpy as np

from butter_aura.codec import Codec
from butter_aura.kind import Aura

SCALE_GROUP: int | None = None
"""Coordinates per scale: None is one scale per vector (per head, per position). Measured
against groups of 32 and 16 in docs/aura.md: with the full-precision budget below the
per-vector scale gives the best quality per allocated bit."""

SINKS = 4
"""Leading slots (attention sinks) kept in full precision."""

RECENT = 32
"""Most recently written slots kept in full precision."""

DEFAULT_SEED = 0x41555241
"""Base seed of the rotations (``rotation.layer_seed`` mixes in the layer index)."""

BUFFERS = ("key_codes", "key_scales", "value_codes", "value_scales")
"""The slot buffers of a layer, in the order ``encode`` returns them."""


def stacks_for(key_codec: Codec, value_codec: Codec) -> dict[str, tuple[str, ...]]:
    """Which slot buffers a cache keeps in one array (``butter_core.slots.Stacks``): the two
    scale buffers always (one width: the codecs share their group), the two code buffers
    where keys and values have as many words (equal bits). An append then writes two or
    three arrays instead of four."""
    stacks = {"scales": ("key_scales", "value_scales")}
    if key_codec.words == value_codec.words:
        stacks["codes"] = ("key_codes", "value_codes")
    return stacks


def by_name(coded: tuple[mx.array, mx.array, mx.array, mx.array]) -> dict[str, mx.array]:
    """``encode``'s four arrays by slot-buffer name (``BUFFERS``)."""
    return dict(zip(BUFFERS, coded))


def codecs(kind: Aura, head_dim: int) -> tuple[Codec, Codec]:
    """The key and value codecs of ``kind`` for vectors of ``head_dim``."""
    group = head_dim if SCALE_GROUP is None else SCALE_GROUP
    return Codec(kind.key_bits, group, head_dim), Codec(kind.value_bits, group, head_dim)


def full_precision_dtype(model_dtype: mx.Dtype) -> mx.Dtype:
    """16-bit storage for the full-precision rows: bfloat16 for bfloat16 models, float16 otherwise."""
    return mx.bfloat16 if model_dtype == mx.bfloat16 else mx.float16


@attrs.frozen
class FullPrecisionBudget:
    """Which slots of a cache of ``capacity`` slots keep full-precision copies, and in which row.

    Row ``i < sinks`` mirrors slot ``i``. The recent rows (``ring`` of them, after the
    sinks) hold the newest positions: a slot ``s`` of ``[base, capacity)`` has the ring row
    ``ring_index(s)``, ``(s - base) % recent`` below ``tail`` and a row of its own from
    ``tail`` on, and ``recent_slots[ring_index(s)] == s`` says that the row holds it (the
    cache gives a row to the newer of two positions whose slots share it).

    Without eviction slot ``s`` holds position ``s``: ``base`` is ``sinks`` and there are no
    rows of their own (``tail == capacity``), so the last ``recent`` slots have distinct
    rows. Under window eviction (``LayerSpec.ring_start``) slots are reused in turn from
    ``ring_start`` on, and any ``recent`` slots that are consecutive *in turn* must have
    distinct rows, across the wrap from the last slot to the first too: ``base`` is the
    ring's first slot (or ``sinks``, if later), and the slots past the last whole run of
    ``recent`` (``tail`` on) get rows of their own. So the newest ``recent`` positions are
    always in full precision, whatever the window's size and however tokens were chunked.
    ``recent`` may be 0 (tiny capacities); the arrays then keep one unused row.
    """

    sinks: int
    recent: int
    base: int
    tail: int
    capacity: int

    @classmethod
    def for_capacity(
        cls, capacity: int, ring_start: int | None = None, sinks: int = SINKS, recent: int = RECENT
    ) -> FullPrecisionBudget:
        kept = min(sinks, capacity)
        base = kept if ring_start is None else max(kept, ring_start)
        recent = min(recent, capacity - base)
        if ring_start is None or recent == 0:
            return cls(kept, recent, base, capacity, capacity)
        return cls(kept, recent, base, base + (capacity - base) // recent * recent, capacity)

    @property
    def ring(self) -> int:
        """Rows of the recent ring, ``len(recent_slots)`` (at least one)."""
        return max(self.recent + self.capacity - self.tail, 1)

    @property
    def rows(self) -> int:
        """Rows the full-precision arrays hold."""
        return self.sinks + self.ring

    def ring_index(self, slot: int) -> int | None:
        """The recent row (index into ``recent_slots``) a slot may use; None for the sinks and for
        slots between them and ``base`` (the window's own sinks past these), which have none."""
        if slot < self.base or self.recent == 0:
            return None
        return (slot - self.base) % self.recent if slot < self.tail else self.recent + slot - self.tail

    def rows_of(self, slots: np.ndarray) -> np.ndarray:
        """The full-precision row of each slot (an integer array on the host): itself for a sink,
        ``sinks`` + its ring index for a recent slot, -1 for slots that never have one."""
        index, ringed = self._ring_indices(np.where, slots)
        return np.where(slots < self.sinks, slots, np.where(ringed, self.sinks + index, -1))

    def membership(self, recent_slots: mx.array, length: int) -> tuple[mx.array, mx.array]:
        """For slots ``[0, length)``: whether each is read in full precision (bool), and its row (int32,
        meaningful where it is). ``recent_slots`` ``[ring]`` gives ``[length]`` for both; ``[sequences,
        ring]`` (one ring per sequence, in batched storage) gives membership ``[sequences, length]``."""
        slots = mx.arange(length, dtype=mx.int32)
        sink = slots < self.sinks
        index, ringed = self._ring_indices(mx.where, slots)
        member = sink | (ringed & (mx.take(recent_slots, index, axis=-1) == slots))
        return member, mx.where(sink, slots, self.sinks + index)

    def _ring_indices(self, where, slots):
        """``ring_index`` of each of ``slots`` (0 where it has none) and whether it has one, for an
        array of slots of numpy (``where`` is ``np.where``) or MLX (``mx.where``)."""
        ringed = (slots >= self.base) & (self.recent > 0)
        index = where(slots < self.tail, (slots - self.base) % max(self.recent, 1), self.recent + slots - self.tail)
        return where(ringed, index, 0), ringed

    def params(self) -> tuple[int, int, int, int]:
        """``(sinks, recent, base, tail)``: what kernels need to find a slot's ring index."""
        return self.sinks, self.recent, self.base, self.tail


@functools.lru_cache(maxsize=64)
def ring_rows(budget: FullPrecisionBudget, slots: tuple[int, ...]) -> tuple[int, ...]:
    """The full-precision rows of recent-ring slots ``slots`` (each has a ring row), kept for the most
    recent sets: every layer of a model writes the codes of the same deferred slots at the same step
    (``AuraCache._encode_unencoded``), and ``rows_of`` costs the host ~25 µs a call."""
    return tuple(budget.sinks + budget.ring_index(slot) for slot in slots)
