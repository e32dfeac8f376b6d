"""A plain model of what a cache must do, for checking real caches against."""

from __future__ import annotations

import mlx.core as mx

from butter_core.cache import LayerSpec, reference_attention
from butter_core.config import Window
from butter_core.kernels.checks import relative_error

__all__ = ["ReferenceCache", "random_chunk", "relative_error"]


def random_chunk(spec: LayerSpec, tokens: int, n_q_heads: int, key: mx.array):
    """Queries, keys and values for ``tokens`` new positions, in the spec's dtype."""
    k1, k2, k3 = mx.random.split(key, 3)
    b, h, d = spec.batch_size, spec.n_kv_heads, spec.head_dim
    q = mx.random.normal((b, n_q_heads, tokens, d), key=k1)
    k = mx.random.normal((b, h, tokens, d), key=k2)
    v = mx.random.normal((b, h, tokens, d), key=k3)
    return q.astype(spec.dtype), k.astype(spec.dtype), v.astype(spec.dtype)


class ReferenceCache:
    """Every appended position kept in full, and the rule for which ones a query sees."""

    def __init__(self, window: Window | None = None):
        self.window = window
        self.keys: mx.array | None = None
        self.values: mx.array | None = None

    @property
    def position(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    @property
    def live(self) -> int:
        return self.position if self.window is None else min(self.position, self.window.max_size)

    @property
    def wrapped(self) -> bool:
        return self.window is not None and self.position > self.window.max_size

    def visible(self, query_positions: mx.array) -> mx.array:
        """Boolean ``[queries, positions]``: who sees whom."""
        key_pos = mx.arange(self.position)[None]
        seen = key_pos <= query_positions[:, None]
        if self.window is not None:
            recent = key_pos > query_positions[:, None] - self.window.ring_size
            seen = seen & ((key_pos < self.window.keep) | recent)
        return seen

    def update_and_attend(self, queries, keys, values, *, scale):
        first = self.position
        self.keys = keys if self.keys is None else mx.concatenate([self.keys, keys], axis=2)
        self.values = values if self.values is None else mx.concatenate([self.values, values], axis=2)
        mask = self.visible(first + mx.arange(keys.shape[2]))
        return reference_attention(queries, self.keys, self.values, scale=scale, mask=mask)

    def trim(self, n: int) -> int:
        """Mirror of ``LayerCache.trim``: nothing can be dropped once a window has wrapped."""
        if self.wrapped:
            return 0
        n = max(0, min(n, self.position))
        if n:
            self.keys, self.values = self.keys[:, :, : self.position - n], self.values[:, :, : self.position - n]
        return n
