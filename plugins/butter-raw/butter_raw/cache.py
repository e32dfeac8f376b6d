"""RawCache: keys and values stored as they come, in the model's dtype or a chosen float dtype."""

from __future__ import annotations

import mlx.core as mx

from butter_core.plugin_api import BufferedSlotCache, LayerSpec, attend, default_device_is_gpu, gpu_backend
from butter_raw import kernels
from butter_raw.kind import Raw


class RawCache(BufferedSlotCache):
    """Unquantized K/V in two buffers ``[batch, n_kv_heads, allocated, head_dim]``.

    Memory: the buffers grow in steps of 256 positions instead of preallocating the
    model's whole context, so a short chat on a 128k-context model holds what it uses;
    at most 255 positions are allocated but not live. Appends write in place through
    MLX slice assignment (buffer donation); attention is MLX's fused SDPA over the live
    slice, which measured faster than a custom kernel (docs/benchmarks.md), except for a
    float32 decode step on the CPU, where MLX's SDPA has no fused kernel and
    ``butter_core.cpu_attention`` is faster (``butter_core.cache.attend`` chooses).
    """

    def __init__(self, spec: LayerSpec, kind: Raw):
        dtype = spec.dtype if kind.dtype is None else getattr(mx, kind.dtype)
        super().__init__(spec, {"keys": (spec.head_dim, dtype), "values": (spec.head_dim, dtype)})

    def attention(self, queries, *, scale, mask):
        """``attend`` over the live slice of each buffer, taken directly (not through ``load``, ``read``
        and ``unstack``: a decode step's host time is what it builds, docs/benchmarks.md, issue 32)."""
        buffers, length = self.slots.read(stacked=True), self.length
        return attend(queries, buffers["keys"][:, :, :length], buffers["values"][:, :, :length], scale=scale, mask=mask)

    def encode(self, keys, values):
        return {"keys": keys, "values": values}

    def decode(self, rows):
        return rows["keys"], rows["values"]

    def paged_decode(self, queries, buffers, table, lengths, page_size, length, scale):
        keys, values = buffers["keys"], buffers["values"]
        if not (default_device_is_gpu() and gpu_backend() is not None and queries.dtype == keys.dtype
                and keys.dtype in kernels.SUPPORTED_DTYPES and keys.shape[-1] in kernels.SUPPORTED_HEAD_DIMS):
            return None
        return kernels.paged_sdpa_decode(queries, keys, values, table, lengths, page_size, length, scale)
