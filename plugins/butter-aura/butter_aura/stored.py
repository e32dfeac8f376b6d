"""``StoredLayer``: the arrays of one layer's cache that attention and dequantization read.

Attention never needs anything else, so the pure-mx references (``reference.py``) and
the GPU kernels (``kernels/``) take exactly this bundle.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import attrs
import mlx.core as mx

from butter_aura.codec import Codec
from butter_aura.layout import FullPrecisionBudget
from butter_aura.rotation import Rotation


@attrs.frozen(eq=False)
class StoredLayer:
    """Coded slots ``[0, length)`` plus the full-precision rows, as one layer holds them.

    The code and scale arrays are whole ``[batch, kv_heads, allocated, width]`` buffers
    (slots past ``length`` are ignored). ``fp_keys``/``fp_values`` are
    ``[batch, kv_heads, rows, head_dim]`` copies of the original (unrotated) vectors of
    the full-precision slots: row ``s`` for a sink slot ``s < sinks``; row
    ``sinks + r`` for the recent slot ``recent_slots[r]`` (int32, -1 when empty), where
    ``r = budget.ring_index(slot)`` (``layout.FullPrecisionBudget``).
    """

    key_codes: mx.array
    key_scales: mx.array
    value_codes: mx.array
    value_scales: mx.array
    fp_keys: mx.array
    fp_values: mx.array
    recent_slots: mx.array
    length: int
    budget: FullPrecisionBudget
    key_codec: Codec
    value_codec: Codec
    rotation: Rotation
    recent_host: tuple[int, ...] | None = None
    """``recent_slots`` as known on the host (``recent_range`` and ``full_precision_slots``
    need no read of the array); None: read from the array when needed."""

    def __attrs_post_init__(self):
        if not 0 <= self.length <= self.key_codes.shape[2]:
            raise ValueError(f"length {self.length} outside 0..{self.key_codes.shape[2]} allocated slots")
        if self.recent_slots.shape[0] != self.budget.ring or self.fp_keys.shape[2] != self.budget.rows:
            raise ValueError(
                f"{self.fp_keys.shape[2]} full-precision rows and {self.recent_slots.shape[0]} recent slots do not fit "
                f"{self.budget}: {self.budget.sinks} sinks + {self.budget.ring} recent rows"
            )

    @property
    def sinks(self) -> int:
        """Leading slots always held in full precision."""
        return self.budget.sinks

    def full_precision_map(self, length: int | None = None) -> tuple[mx.array, mx.array]:
        """For slots ``[0, length)``: whether each is read in full precision, and its row (bool, int32)."""
        return self.budget.membership(self.recent_slots, self.length if length is None else length)

    def recent_on_host(self) -> Sequence[int]:
        """``recent_slots`` as host integers: ``recent_host``, else read from the array."""
        return self.recent_host if self.recent_host is not None else self.recent_slots.tolist()

    def recent_range(self) -> tuple[int, int]:
        """Smallest and largest slot the recent ring holds, ``(1, 0)`` (an empty range) when
        it holds none: the kernels skip their ring look-up outside it."""
        recent = self.recent_on_host()
        return held_range(recent if isinstance(recent, tuple) else tuple(recent))

    def full_precision_slots(self) -> tuple[list[int], list[int]]:
        """``full_precision_map`` on the host: the slots of ``[0, length)`` read in full precision, and their rows."""
        sinks = min(self.sinks, self.length)
        slots, rows = list(range(sinks)), list(range(sinks))
        for index, slot in enumerate(self.recent_on_host()):
            if self.sinks <= slot < self.length and self.budget.ring_index(slot) == index:
                slots.append(slot)
                rows.append(self.sinks + index)
        return slots, rows


@functools.lru_cache(maxsize=64)
def held_range(recent: tuple[int, ...]) -> tuple[int, int]:
    """``StoredLayer.recent_range`` of a ring's slots, kept for the most recent rings: every
    layer of a decode step asks it of the same ring."""
    held = [slot for slot in recent if slot >= 0]
    return (min(held), max(held)) if held else (1, 0)
