"""``StoredLayer``: the arrays of one layer's cache that attention and dequantization read.

Attention never needs anything else, so the pure-mx references (``reference.py``) and
the GPU kernels (``kernels/``) take exactly this bundle.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import mlx.core as mx

from butter_aura.codec import Codec
from butter_aura.rotation import Rotation


@attrs.frozen(eq=False)
class StoredLayer:
    """Coded slots ``[0, length)`` plus the full-precision rows, as one layer holds them.

    The code and scale arrays are whole ``[batch, kv_heads, allocated, width]`` buffers
    (slots past ``length`` are ignored). ``fp_keys``/``fp_values`` are
    ``[batch, kv_heads, rows, head_dim]`` copies of the original (unrotated) vectors of
    the full-precision slots: row ``s`` for a sink slot ``s < sinks``; row
    ``sinks + r`` for the recent slot ``recent_slots[r]`` (int32, -1 when empty), where
    ``r = (slot - sinks) % len(recent_slots)``.
    """

    key_codes: mx.array
    key_scales: mx.array
    value_codes: mx.array
    value_scales: mx.array
    fp_keys: mx.array
    fp_values: mx.array
    recent_slots: mx.array
    length: int
    sinks: int
    key_codec: Codec
    value_codec: Codec
    rotation: Rotation
    recent_host: tuple[int, ...] | None = None
    """``recent_slots`` as known on the host (``recent_range`` and ``full_precision_slots``
    need no read of the array); None: read from the array when needed."""

    def __attrs_post_init__(self):
        if not 0 <= self.length <= self.key_codes.shape[2]:
            raise ValueError(f"length {self.length} outside 0..{self.key_codes.shape[2]} allocated slots")
        if self.fp_keys.shape[2] != self.sinks + self.recent_slots.shape[0]:
            raise ValueError(
                f"{self.fp_keys.shape[2]} full-precision rows do not hold {self.sinks} sinks "
                f"+ {self.recent_slots.shape[0]} recent slots"
            )

    @property
    def ring(self) -> int:
        """Rows of the recent ring."""
        return self.recent_slots.shape[0]

    def full_precision_map(self, length: int | None = None) -> tuple[mx.array, mx.array]:
        """For slots ``[0, length)``: whether each is read in full precision, and its row (bool, int32)."""
        length = self.length if length is None else length
        slots = mx.arange(length, dtype=mx.int32)
        sink = slots < self.sinks
        residue = mx.where(sink, 0, slots - self.sinks) % self.ring
        member = sink | (mx.take(self.recent_slots, residue) == slots)
        return member, mx.where(sink, slots, self.sinks + residue)

    def recent_on_host(self) -> Sequence[int]:
        """``recent_slots`` as host integers: ``recent_host``, else read from the array."""
        return self.recent_host if self.recent_host is not None else self.recent_slots.tolist()

    def recent_range(self) -> tuple[int, int]:
        """Smallest and largest slot the recent ring holds, ``(1, 0)`` (an empty range) when
        it holds none: the kernels skip their ring look-up outside it."""
        held = [slot for slot in self.recent_on_host() if slot >= 0]
        return (min(held), max(held)) if held else (1, 0)

    def full_precision_slots(self) -> tuple[list[int], list[int]]:
        """``full_precision_map`` on the host: the slots of ``[0, length)`` read in full precision, and their rows."""
        sinks = min(self.sinks, self.length)
        slots, rows = list(range(sinks)), list(range(sinks))
        for residue, slot in enumerate(self.recent_on_host()):
            if self.sinks <= slot < self.length and (slot - self.sinks) % self.ring == residue:
                slots.append(slot)
                rows.append(self.sinks + residue)
        return slots, rows
