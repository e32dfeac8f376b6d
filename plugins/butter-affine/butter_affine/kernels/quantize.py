"""``quantize_kv``: new K/V rows -> codes, scales and biases, on the GPU, in one launch.

One thread per (row, group), keys then values. It follows ``codec.quantize`` step for
step in float32 (MLX's choice of scale and bias, rounding to the storage dtype, codes
against the rounded pair, round half to even, MLX's packing), so it matches the
reference bit for bit. Its two outputs are the new rows only, stacked as the cache keeps
them (``packing.STACKS``: codes ``[2, ...]``, scales and biases ``[4, ...]``); the cache
writes each into its stack by one slice assignment, which updates in place.
"""

from __future__ import annotations

import mlx.core as mx

from butter_core.plugin_api import Kernel

from butter_affine import codec
from butter_affine.kernels.codes import CODE_HELPERS
from butter_affine.packing import BUFFERS, STACKS, packed_format, stack

_THREADS = 64

_QUANTIZE = Kernel(
    name="butter_affine_quantize_kv",
    input_names=("keys", "values"),
    output_names=tuple(STACKS),
    helpers=CODE_HELPERS,
    body="""
  constexpr int WORDS_PER_GROUP = GROUP * BITS / 32;
  constexpr int GROUPS = D / GROUP;
  constexpr float MAX_CODE = static_cast<float>((1 << BITS) - 1);
  const int64_t rows = static_cast<int64_t>(keys_shape[0]) * keys_shape[1] * keys_shape[2];
  const int64_t per_side = rows * GROUPS;
  const int64_t index = global_idx.x;
  if (index < 2 * per_side) {
    const bool is_value = index >= per_side;
    const int64_t g = is_value ? index - per_side : index;  // row * GROUPS + group
    const auto src = (is_value ? values : keys) + g * GROUP;

    float w_min = -BT_NEG_INF;
    float w_max = BT_NEG_INF;
    for (int j = 0; j < GROUP; ++j) {
      const float x = bt_to_float(src[j]);
      w_min = x < w_min ? x : w_min;
      w_max = x > w_max ? x : w_max;
    }
    // MLX's affine parameters: the edge of larger magnitude is exactly representable.
    const bool negative_edge = (w_min < 0.0f ? -w_min : w_min) > (w_max < 0.0f ? -w_max : w_max);
    float scale = (w_max - w_min) / MAX_CODE;
    scale = scale < 1e-7f ? 1e-7f : scale;
    scale = negative_edge ? scale : -scale;
    const float edge = negative_edge ? w_min : w_max;
    const float q0 = bt_rint(edge / scale);
    float bias = 0.0f;
    if (q0 != 0.0f) {
      scale = edge / q0;
      bias = edge;
    }
    // scales_biases: [key scales, key biases, value scales, value biases], per_side each.
    const S scale_stored = bt_from_float<S>(scale);
    const S bias_stored = bt_from_float<S>(bias);
    scales_biases[(is_value ? 2 : 0) * per_side + g] = scale_stored;
    scales_biases[(is_value ? 3 : 1) * per_side + g] = bias_stored;

    // Codes against the stored (rounded) pair, packed as a little-endian bit stream.
    const float s = bt_to_float(scale_stored);
    const float b = bt_to_float(bias_stored);
    const auto out = codes + (is_value ? per_side : 0) * WORDS_PER_GROUP + g * WORDS_PER_GROUP;
    uint32_t word = 0u;
    int filled = 0;
    int w = 0;
    for (int j = 0; j < GROUP; ++j) {
      float c = s == 0.0f ? 0.0f : bt_rint((bt_to_float(src[j]) - b) / s);
      c = c < 0.0f ? 0.0f : (c > MAX_CODE ? MAX_CODE : c);
      const uint32_t code = static_cast<uint32_t>(c);
      word |= code << filled;
      filled += BITS;
      if (filled >= 32) {
        out[w++] = word;
        filled -= 32;
        word = filled > 0 ? code >> (BITS - filled) : 0u;
      }
    }
  }
""",
)


def quantize_kv(keys: mx.array, values: mx.array, *, bits: int, group_size: int) -> dict[str, mx.array]:
    """Codes/scales/biases of ``keys`` and ``values`` ``[B, H, T, D]`` (scales in their dtype),
    stacked as ``packing.STACKS`` (``butter_core.slots.unstack`` names them as ``packing.BUFFERS``)."""
    _check_rows(keys, values)
    fmt = packed_format(bits, group_size, keys.shape[-1], keys.dtype)
    lead = keys.shape[:-1]
    groups = 2 * keys.size // group_size
    outputs = _QUANTIZE(
        inputs=[keys, values],
        template=[("T", keys.dtype), ("S", fmt.dtype), ("D", fmt.head_dim), ("BITS", bits),
                  ("GROUP", group_size)],
        grid=(groups, 1, 1),
        threadgroup=(_THREADS, 1, 1),
        output_shapes=[(2, *lead, fmt.words), (4, *lead, fmt.groups)],
        output_dtypes=[mx.uint32, fmt.dtype],
    )
    return dict(zip(STACKS, outputs))


def quantize_kv_reference(keys: mx.array, values: mx.array, *, bits: int, group_size: int) -> dict[str, mx.array]:
    """``quantize_kv`` through ``codec.quantize`` (pure mx)."""
    _check_rows(keys, values)
    packed = codec.quantize(keys, bits, group_size) + codec.quantize(values, bits, group_size)
    return stack(dict(zip(BUFFERS, packed)))


def _check_rows(keys: mx.array, values: mx.array) -> None:
    if keys.shape != values.shape or keys.ndim != 4 or keys.dtype != values.dtype:
        raise ValueError(f"keys and values must be equal [B, H, T, D] arrays; got {keys.shape} "
                         f"{keys.dtype} and {values.shape} {values.dtype}")


def available() -> bool:
    """Whether the kernel can run here."""
    return _QUANTIZE.available()
