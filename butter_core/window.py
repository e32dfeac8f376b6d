"""Sliding-window (FIFO) eviction: a decorator that bounds any scheme's cache.

Layout of the wrapped cache's slots: ``keep`` sink slots hold positions ``0..keep-1``
forever; the other ``max_size - keep`` slots are a ring, position ``p`` going to slot
``keep + (p - keep) % (max_size - keep)``. Keys were RoPE'd at their absolute positions
before they arrived, so attention over the slots needs no order.

Exactness beyond the seed: a chunk of several tokens that wraps the ring would
overwrite keys that earlier tokens of the same chunk must still see. Such a chunk is
attended over the stored window plus the chunk itself, with a mask built from absolute
positions (query ``p`` sees ``a <= p`` with ``a < keep`` or ``a > p - ring``), and only
then are the surviving tokens written. Every path leaves at most ``max_size`` live slots.
"""

from __future__ import annotations

import mlx.core as mx

from butter_core.cache import AttentionCache, SlotCache, attend, check_chunk
from butter_core.config import Window
from butter_core.errors import ConfigError
from butter_core.hookspecs import hookimpl
from butter_core.registry import EvictionPolicy


class WindowCache(AttentionCache):
    """An ``AttentionCache`` that keeps sinks plus the most recent positions of an inner ``SlotCache``."""

    def __init__(self, inner: SlotCache, window: Window):
        if inner.capacity != window.max_size:
            raise ConfigError(f"window inner cache holds {inner.capacity} slots, expected max_size={window.max_size}")
        self.inner = inner
        self.window = window
        self.spec = inner.spec
        self._position = 0

    # -- slot arithmetic --------------------------------------------------------

    def slot_positions(self) -> mx.array:
        """Absolute position held by each live slot, in slot order."""
        slots = mx.arange(self.inner.length)
        if self._position <= self.window.max_size:
            return slots
        return mx.where(slots < self.window.keep, slots, self.window.ring_position(slots, self._position - 1))

    def _survivor_runs(self, first: int, count: int) -> list[tuple[int, int, int]]:
        """(slot, chunk offset, n) runs writing positions ``first..first+count-1`` that survive."""
        placed = sorted((self.window.slot_of(p), p - first) for p in self.window.survivors(first, first + count))
        runs: list[list[int]] = []
        for slot, offset in placed:
            if runs and runs[-1][0] + runs[-1][2] == slot and runs[-1][1] + runs[-1][2] == offset:
                runs[-1][2] += 1
            else:
                runs.append([slot, offset, 1])
        return [tuple(run) for run in runs]

    def _commit(self, keys: mx.array, values: mx.array) -> None:
        for slot, offset, n in self._survivor_runs(self._position, keys.shape[2]):
            rows = slice(offset, offset + n)
            self.inner.write(slot, keys[:, :, rows], values[:, :, rows], self._position + offset)
        self._position += keys.shape[2]

    # -- AttentionCache ----------------------------------------------------------

    @property
    def length(self) -> int:
        return self.inner.length

    @property
    def absolute_position(self) -> int:
        return self._position

    @property
    def capacity(self) -> None:
        return None

    @property
    def warm_up_steps(self) -> int:
        return self.inner.warm_up_steps

    def append(self, keys, values):
        check_chunk(self.spec, keys, values)
        self._commit(keys, values)

    def update_and_attend(self, queries, keys, values, *, scale):
        check_chunk(self.spec, keys, values, queries)
        tokens, first = keys.shape[2], self._position
        if first + tokens <= self.window.max_size or tokens == 1:
            # Slots still equal positions, or one token replacing the oldest ring slot: one
            # run of slots, and the stored window is exactly what the queries may see.
            self._position += tokens
            mask = "causal" if tokens > 1 else None
            return self.inner.store_and_attend(self.window.slot_of(first), keys, values, first, queries, scale=scale, mask=mask)
        stored_k, stored_v = self.inner.load(self.inner.length)
        key_pos = mx.concatenate([self.slot_positions(), first + mx.arange(tokens)])
        visible = self.window.visible(key_pos, (first + mx.arange(tokens))[:, None])
        out = attend(
            queries,
            mx.concatenate([stored_k, keys.astype(stored_k.dtype)], axis=2),
            mx.concatenate([stored_v, values.astype(stored_v.dtype)], axis=2),
            scale=scale,
            mask=visible,
        )
        self._commit(keys, values)
        return out

    def reserve(self, positions):
        self.inner.reserve(min(positions, self.window.max_size))

    def prepare_for_attention(self):
        return self.inner.prepare_for_attention()

    @property
    def nbytes_allocated(self) -> int:
        return self.inner.nbytes_allocated

    @property
    def nbytes_live(self) -> int:
        return self.inner.nbytes_live

    def state(self):
        return self.inner.state()

    def meta_state(self):
        return {
            **self.inner.meta_state(),
            "absolute_position": self._position,
            "max_size": self.window.max_size,
            "keep": self.window.keep,
        }

    def restore(self, state, meta):
        saved = Window(int(meta["max_size"]), int(meta["keep"]))
        if saved != self.window:
            raise ConfigError(f"state was saved under {saved}; this cache uses {self.window}")
        self.inner.restore(state, meta)
        self._position = int(meta["absolute_position"])

    def trim(self, n):
        """Drop the last ``n`` positions; after the ring has wrapped nothing can be dropped (returns 0)."""
        if self._position > self.window.max_size:
            return 0
        dropped = self.inner.trim(n)
        self._position -= dropped
        return dropped


def wrap_window(window: Window, create_inner, specs):
    """Create inner caches sized to the window (slots reused from ``keep`` on) and wrap each in a ``WindowCache``."""
    inner = create_inner([spec.with_ring(window.max_size, window.keep) for spec in specs])
    for cache in inner:
        if not isinstance(cache, SlotCache):
            raise ConfigError(
                f"window eviction needs slot-addressed caches (SlotCache); the scheme made {type(cache).__name__}"
            )
    return [WindowCache(cache, window) for cache in inner]


@hookimpl
def butter_register_eviction_policies(register):
    register(EvictionPolicy(name="window", kind=Window, wrap=wrap_window))
