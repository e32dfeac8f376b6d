"""Single-token attention on MLX's CPU in float32: a decode step's attention where no GPU runs it.

MLX's ``mx.fast.scaled_dot_product_attention`` has no fused CPU kernel: on the CPU it
computes ``softmax(q kᵀ) v`` with plain ops (its result equals that of matmul, softmax,
matmul exactly), and on a 2-core x86 machine it pays for that form twice over, so this
module takes its place there (measurements: docs/benchmarks.md,
"butter_core/cpu_attention.py"):

* the query heads of one KV head are the columns of one product, keys as rows
  (``keys @ qᵀ``): BLAS's small-row products are slower the other way round;
* from ``POWER_MIN_KEYS`` keys the softmax exponentiates in base 2 with ``log2 e`` folded
  into the query scale: MLX's CPU ``mx.power(2, x)`` costs far less per element than
  ``mx.exp``.

Schemes that compute their own scores (from codes) take their softmax from
``softmax_for`` for the same saving.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import mlx.core as mx

LOG2E = math.log2(math.e)
"""Scores times this are in log2 units: ``exp(s) == 2 ** (s * LOG2E)``."""

POWER_MIN_KEYS = 512
"""From this many keys ``softmax_for`` takes ``softmax_log2``; below it, where MLX's per-op
cost outweighs its per-element cost, ``mx.softmax`` (one op, not six). 512 is where the
power form stops costing more than ``mx.softmax`` in this module's attention (measurements:
docs/benchmarks.md, "butter_core/cpu_attention.py")."""

LOWEST_EXPONENT = -126.0
"""Shifted scores are clamped here, ``2 ** -126`` being float32's smallest normal number:
below it MLX's CPU ``power`` takes a slow path, slower per element than ``mx.exp``
(docs/benchmarks.md, "butter_core/cpu_attention.py"). A clamped weight grows by at most
1.2e-38, which no float32 sum of weights (at least 1) can show."""


def softmax_log2(scores: mx.array) -> mx.array:
    """``softmax`` over the last axis of float32 ``scores`` given in log2 units (natural-log
    scores times ``LOG2E``), computed as ``2 ** (s - max) / Σ 2 ** (s - max)`` with the
    shifted scores clamped at ``LOWEST_EXPONENT`` (a score of -inf, a masked slot, weighs
    2^-126 of the largest one's weight, not 0)."""
    shifted = mx.maximum(scores - scores.max(axis=-1, keepdims=True), LOWEST_EXPONENT)
    weights = mx.power(2.0, shifted)
    return weights / weights.sum(axis=-1, keepdims=True)


def softmax_for(length: int) -> tuple[float, Callable[[mx.array], mx.array]]:
    """How to take a softmax over ``length`` keys: a factor for natural-log scores (fold it
    into the query scale) and the softmax over the last axis of scores times it:
    ``(LOG2E, softmax_log2)`` from ``POWER_MIN_KEYS`` keys, else ``(1, mx.softmax)``."""
    if length >= POWER_MIN_KEYS:
        return LOG2E, softmax_log2
    return 1.0, _softmax


def _softmax(scores: mx.array) -> mx.array:
    return mx.softmax(scores, axis=-1)


def serves(queries: mx.array, keys: mx.array, values: mx.array, mask) -> bool:
    """Whether ``decode_attention`` is the way to attend here: one query token, no mask,
    float32 throughout, on the CPU."""
    return (
        queries.shape[2] == 1
        and mask is None
        and queries.dtype == keys.dtype == values.dtype == mx.float32
        and mx.default_device().type == mx.cpu
    )


def grouped_queries(queries: mx.array, kv_heads: int, scale: float) -> mx.array:
    """One query token ``[batch, q_heads, 1, head_dim]`` times ``scale`` as ``[batch, kv_heads,
    q_heads / kv_heads, head_dim]``: the query heads that share a KV head, as the columns of
    one product with its keys (``keys @ qᵀ``)."""
    batch, q_heads, _, dims = queries.shape
    return (queries * scale).reshape(batch, kv_heads, q_heads // kv_heads, dims)


def decode_attention(queries: mx.array, keys: mx.array, values: mx.array, *, scale: float) -> mx.array:
    """``softmax(q kᵀ · scale) v`` for one query token ``[batch, q_heads, 1, head_dim]`` over
    ``[batch, kv_heads, length, head_dim]`` keys and values (``q_heads`` a multiple of
    ``kv_heads``), in float32."""
    factor, softmax = softmax_for(keys.shape[2])
    q = grouped_queries(queries, keys.shape[1], scale * factor)
    scores = (keys @ q.swapaxes(-1, -2)).swapaxes(-1, -2)
    return (softmax(scores) @ values).reshape(queries.shape)
