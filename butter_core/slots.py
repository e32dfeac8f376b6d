"""``SlotBuffers``: a scheme's named per-slot arrays, grown in whole steps, never per token.

Every scheme stores a few arrays that share one slot axis (raw: keys and values;
quantized schemes: codes, scales, biases); this is that bookkeeping, written once.
"""

from __future__ import annotations

import mlx.core as mx

from butter_core.cache import LayerSpec, SlotCache
from butter_core.errors import ConfigError

GROWTH_STEP = 256
"""Buffers grow by whole steps of this many positions, up to capacity."""

Layout = dict[str, tuple[int, mx.Dtype]]
"""Buffer name -> (row width, dtype); every buffer is ``[batch, n_kv_heads, slots, width]``."""


class SlotBuffers:
    """Arrays ``[batch, n_kv_heads, allocated, width]`` sharing one slot axis.

    Memory: growing copies the live slots once per ``GROWTH_STEP`` positions, and at most
    ``GROWTH_STEP - 1`` allocated slots are not live (a short chat on a long-context
    model holds kilobytes, not the whole context). Writes use MLX slice assignment,
    which updates in place when the buffer is donated.
    """

    def __init__(self, spec: LayerSpec, capacity: int, layout: Layout, step: int = GROWTH_STEP):
        self.spec = spec
        self.capacity = capacity
        self.layout = layout
        self.step = step
        self.arrays: dict[str, mx.array] = {}

    @property
    def allocated(self) -> int:
        """Slots allocated now (0 before the first write)."""
        return next(iter(self.arrays.values())).shape[2] if self.arrays else 0

    def _empty(self, slots: int) -> dict[str, mx.array]:
        s = self.spec
        return {
            name: mx.zeros((s.batch_size, s.n_kv_heads, slots, width), dtype)
            for name, (width, dtype) in self.layout.items()
        }

    def reserve(self, slots: int, live: int) -> None:
        """Make at least ``slots`` slots allocated, keeping the contents of ``[0, live)``."""
        if slots <= self.allocated:
            return
        grown = self._empty(min(self.capacity, -(-slots // self.step) * self.step))
        if live:
            for name, array in self.arrays.items():
                grown[name][:, :, :live] = array[:, :, :live]
        self.arrays = grown

    def write(self, start: int, rows: dict[str, mx.array], live: int) -> None:
        """Write ``rows`` (one array per buffer, ``tokens`` slots each) at ``[start, start + tokens)``."""
        if set(rows) != set(self.layout):
            raise ConfigError(f"slot rows must name exactly {sorted(self.layout)}; got {sorted(rows)}")
        tokens = next(iter(rows.values())).shape[2]
        self.reserve(start + tokens, live)
        for name, array in rows.items():
            self.arrays[name][:, :, start : start + tokens] = array.astype(self.layout[name][1])

    def read(self, length: int) -> dict[str, mx.array]:
        """Views of slots ``[0, length)`` of every buffer."""
        if length == 0 or not self.arrays:
            return self._empty(0)
        return {name: array[:, :, :length] for name, array in self.arrays.items()}

    def clear(self) -> None:
        """Release every buffer."""
        self.arrays = {}


class BufferedSlotCache(SlotCache):
    """A ``SlotCache`` whose storage is one ``SlotBuffers``: subclasses write ``store`` and ``load``.

    The buffers' layout gives state export/import, byte accounting and the list of
    allocated arrays, so a scheme only says how rows are encoded and decoded.
    """

    def __init__(self, spec: LayerSpec, layout: Layout):
        super().__init__(spec)
        self.slots = SlotBuffers(spec, self.capacity, layout)

    def export_slots(self, length):
        return self.slots.read(length)

    def import_slots(self, arrays, length):
        if set(arrays) != set(self.slots.layout):
            raise ConfigError(
                f"{type(self).__name__} state holds {sorted(self.slots.layout)}; got {sorted(arrays)}: "
                "it was exported by another kind of cache"
            )
        self.slots.clear()
        if length:
            self.slots.write(0, {name: array[:, :, :length] for name, array in arrays.items()}, live=0)

    def buffers(self):
        return list(self.slots.arrays.values())

    @property
    def bytes_per_slot(self):
        s = self.spec
        row = sum(width * dtype.size for width, dtype in self.slots.layout.values())
        return s.batch_size * s.n_kv_heads * row
