"""What one AURA layer cache stores, and the design constants behind it.

Per slot and KV head: the key's codes and scales and the value's codes and scales
(``codec.Codec``). Beside them, a small full-precision budget (``FullPrecisionBudget``):
the first ``SINKS`` slots and the ``RECENT`` most recently written slots are also kept
as 16-bit copies of the original (unrotated) vectors, and attention reads those rows
instead of their codes. The
constants are the measured choice recorded in docs/aura.md.
"""

from __future__ import annotations

import attrs
import mlx.core as mx

from butter_core.config import Aura

from butter_aura.codec import Codec

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
    """How many sink and recent rows a cache of ``capacity`` slots keeps in full precision.

    Row ``i < sinks`` mirrors slot ``i``; a recent slot ``s`` lives in row
    ``sinks + (s - sinks) % recent``, and ``recent_slots[(s - sinks) % recent] == s``
    says that row holds it (a newer write to a slot with the same residue takes the
    row). ``recent`` may be 0 (tiny capacities); the arrays then keep one unused row.
    """

    sinks: int
    recent: int

    @classmethod
    def for_capacity(cls, capacity: int, sinks: int = SINKS, recent: int = RECENT) -> FullPrecisionBudget:
        kept = min(sinks, capacity)
        return cls(kept, min(recent, capacity - kept))

    @property
    def rows(self) -> int:
        """Rows the full-precision arrays hold (at least one, so no array is empty)."""
        return self.sinks + max(self.recent, 1)

    @property
    def ring(self) -> int:
        """Length of ``recent_slots`` (at least one)."""
        return max(self.recent, 1)

    def row_of(self, slot: int) -> int:
        return slot if slot < self.sinks else self.sinks + (slot - self.sinks) % self.ring
