"""RawCache: keys and values stored as they come, in the model's dtype or a chosen float dtype."""

from __future__ import annotations

import mlx.core as mx

from butter_core import LayerSpec, Raw, SlotCache

GROWTH_STEP = 256
"""Buffers grow by whole steps of this many positions, never per token, up to capacity."""


class RawCache(SlotCache):
    """Unquantized K/V in two buffers ``[batch, n_kv_heads, allocated, head_dim]``.

    Memory: buffers grow in steps of ``GROWTH_STEP`` positions (one copy of the live
    part per step, amortised over 256 tokens) instead of preallocating the model's
    whole context, so a short chat on a 128k-context model holds kilobytes, not
    gigabytes; at most ``GROWTH_STEP - 1`` positions are allocated but not live.
    Appends write in place through MLX slice assignment (buffer donation).
    """

    def __init__(self, spec: LayerSpec, kind: Raw):
        super().__init__(spec)
        self.dtype = spec.dtype if kind.dtype is None else getattr(mx, kind.dtype)
        self.keys: mx.array | None = None
        self.values: mx.array | None = None

    @property
    def allocated(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def _reserve(self, positions: int) -> None:
        if positions <= self.allocated:
            return
        size = min(self.capacity, -(-positions // GROWTH_STEP) * GROWTH_STEP)
        s = self.spec
        grown = [mx.zeros((s.batch_size, s.n_kv_heads, size, s.head_dim), self.dtype) for _ in range(2)]
        if self.keys is not None and self.length:
            grown[0][:, :, : self.length] = self.keys[:, :, : self.length]
            grown[1][:, :, : self.length] = self.values[:, :, : self.length]
        self.keys, self.values = grown

    def store(self, start, keys, values):
        end = start + keys.shape[2]
        self._reserve(end)
        self.keys[:, :, start:end] = keys.astype(self.dtype)
        self.values[:, :, start:end] = values.astype(self.dtype)

    def load(self, length):
        if length == 0 or self.keys is None:
            s = self.spec
            empty = mx.zeros((s.batch_size, s.n_kv_heads, 0, s.head_dim), self.dtype)
            return empty, empty
        return self.keys[:, :, :length], self.values[:, :, :length]

    def export_slots(self, length):
        keys, values = self.load(length)
        return {"keys": keys, "values": values}

    def import_slots(self, arrays, length):
        self.keys = self.values = None
        self._reserve(length)
        if length:
            self.keys[:, :, :length] = arrays["keys"].astype(self.dtype)
            self.values[:, :, :length] = arrays["values"].astype(self.dtype)

    def buffers(self):
        return [] if self.keys is None else [self.keys, self.values]

    @property
    def bytes_per_slot(self):
        s = self.spec
        return 2 * s.batch_size * s.n_kv_heads * s.head_dim * self.dtype.size
