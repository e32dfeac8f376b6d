"""AURA's three operations in pure mx: the references of the kernels, and the CPU path.

* ``encode``: rotate keys and values, code them (``Codec.encode``).
* ``decode_attention``: one query token over a ``StoredLayer``, computed the way the
  kernel computes it (query rotated once, scores against decoded codes, values summed
  in the rotated domain and rotated back once, full-precision rows attended as they
  are) but by materialising the decoded vectors, which the kernel never does.
* ``dequantize``: the stored keys and values back in the model's domain, full-precision
  rows where a slot has one.
"""

from __future__ import annotations

import mlx.core as mx

from butter_aura.codec import Codec
from butter_aura.layout import by_name
from butter_aura.rotation import Rotation
from butter_aura.stored import StoredLayer


def encode(
    keys: mx.array, values: mx.array, rotation: Rotation, key_codec: Codec, value_codec: Codec
) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """Key codes, key scales, value codes, value scales of ``[batch, kv_heads, tokens, head_dim]`` rows."""
    key_codes, key_scales = key_codec.encode(rotation.apply(keys))
    value_codes, value_scales = value_codec.encode(rotation.apply(values))
    return key_codes, key_scales, value_codes, value_scales


def encode_rows(
    keys: mx.array, values: mx.array, rotation: Rotation, key_codec: Codec, value_codec: Codec
) -> dict[str, mx.array]:
    """``encode``'s rows by slot-buffer name, as ``AuraCache`` writes them."""
    return by_name(encode(keys, values, rotation, key_codec, value_codec))


def decode_attention(queries: mx.array, stored: StoredLayer, scale: float) -> mx.array:
    """``softmax(q kᵀ · scale) v`` over the live slots for ``queries`` ``[batch, q_heads, 1, head_dim]``.

    Accumulates in float32; returns the queries' dtype.
    """
    batch, q_heads, tokens, dims = queries.shape
    kv_heads, length = stored.key_codes.shape[1], stored.length
    if tokens != 1 or q_heads % kv_heads or length == 0:
        raise ValueError(f"decode attention takes one query token over >= 1 slot; got {queries.shape}, length {length}")
    group = q_heads // kv_heads
    q = queries.astype(mx.float32).reshape(batch, kv_heads, group, dims)
    q_rotated = stored.rotation.apply(q)
    keys = stored.key_codec.decode(stored.key_codes[:, :, :length], stored.key_scales[:, :, :length])
    values = stored.value_codec.decode(stored.value_codes[:, :, :length], stored.value_scales[:, :, :length])
    member, row = stored.full_precision_map()
    fp_keys = mx.take(stored.fp_keys, row, axis=2).astype(mx.float32)
    fp_values = mx.take(stored.fp_values, row, axis=2).astype(mx.float32)
    scores = mx.where(
        member,
        (q @ fp_keys.swapaxes(-1, -2)) * scale,
        (q_rotated @ keys.swapaxes(-1, -2)) * scale,
    )
    weights = mx.softmax(scores, axis=-1)
    coded = stored.rotation.invert(mx.where(member, 0.0, weights) @ values)
    exact = mx.where(member, weights, 0.0) @ fp_values
    return (coded + exact).reshape(queries.shape).astype(queries.dtype)


def dequantize(stored: StoredLayer, dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
    """Keys and values of slots ``[0, length)`` as ``[batch, kv_heads, length, head_dim]`` in ``dtype``."""
    length = stored.length
    member, row = stored.full_precision_map()
    member = member[:, None]
    keys = stored.rotation.invert(stored.key_codec.decode(stored.key_codes[:, :, :length], stored.key_scales[:, :, :length]))
    values = stored.rotation.invert(
        stored.value_codec.decode(stored.value_codes[:, :, :length], stored.value_scales[:, :, :length])
    )
    keys = mx.where(member, mx.take(stored.fp_keys, row, axis=2).astype(mx.float32), keys)
    values = mx.where(member, mx.take(stored.fp_values, row, axis=2).astype(mx.float32), values)
    return keys.astype(dtype), values.astype(dtype)
