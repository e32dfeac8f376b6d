"""``dequantize_kv``: the live slots of a layer's packed K/V as floats, in one launch.

Used for multi-token (prefill) attention, whose keys and values MLX's fused SDPA then
reads. It takes the cache's whole buffers and the live length, so no slice of a buffer
is ever copied; it writes ``[B, H, length, D]`` keys and values. One thread decodes 16
consecutive values of one row: ``code * scale + bias`` in float32, rounded once.

The seed shares one working buffer between all layers of a model; MLX has none, and
how many layers' outputs of this kernel are alive at once is ``butter_core.working_set``'s subject.
"""

from __future__ import annotations

import mlx.core as mx

from butter_core.plugin_api import Kernel, kernel_params

from butter_affine import codec
from butter_affine.kernels.codes import CODE_HELPERS
from butter_affine.packing import BUFFERS, PackedFormat

_RUN = 16
"""Values one thread decodes: a whole number of words for 4, 6 and 8 bits."""
_THREADS = 256

_DEQUANTIZE = Kernel(
    name="butter_affine_dequantize_kv",
    input_names=(*BUFFERS, "length"),
    output_names=("keys", "values"),
    helpers=CODE_HELPERS,
    body="""
  constexpr int RUN = 16;
  constexpr int WORDS = RUN * BITS / 32;
  constexpr int ROW_WORDS = D * BITS / 32;
  constexpr int GROUPS = D / GROUP;
  constexpr int RUNS = D / RUN;
  const int64_t batch_heads = static_cast<int64_t>(key_codes_shape[0]) * key_codes_shape[1];
  const int allocated = key_codes_shape[2];
  const int live = length[0];
  const int64_t per_side = batch_heads * live * RUNS;
  const int64_t index = global_idx.x;
  if (index < 2 * per_side) {
    const bool is_value = index >= per_side;
    const int64_t e = is_value ? index - per_side : index;
    const int run = e % RUNS;
    const int64_t live_row = e / RUNS;  // (batch * heads + head) * live + position
    const int64_t row = (live_row / live) * allocated + live_row % live;
    uint32_t words[WORDS];
    affine_load_words<WORDS>((is_value ? value_codes : key_codes) + row * ROW_WORDS + run * WORDS, words);
    const int64_t g = row * GROUPS + run * RUN / GROUP;
    const float s = bt_to_float((is_value ? value_scales : key_scales)[g]);
    const float b = bt_to_float((is_value ? value_biases : key_biases)[g]);
    float codes[RUN];
    affine_unpack<BITS, RUN>(words, codes);
    const auto out = (is_value ? values : keys) + live_row * D + run * RUN;
#pragma unroll
    for (int i = 0; i < RUN; ++i) {
      out[i] = bt_from_float<T>(codes[i] * affine_weight<BITS>(i) * s + b);
    }
  }
""",
)


def dequantize_kv(
    key_codes: mx.array, key_scales: mx.array, key_biases: mx.array,
    value_codes: mx.array, value_scales: mx.array, value_biases: mx.array,
    *, length: int, bits: int, dtype: mx.Dtype,
) -> tuple[mx.array, mx.array]:
    """Keys and values ``[B, H, length, D]`` in ``dtype`` from whole ``[B, H, S, *]`` buffers."""
    fmt = _check_buffers(key_codes, key_scales, value_codes, length, bits)
    batch, heads = key_codes.shape[:2]
    shape = (batch, heads, length, fmt.head_dim)
    if length == 0:
        return mx.zeros(shape, dtype), mx.zeros(shape, dtype)
    keys, values = _DEQUANTIZE(
        inputs=[key_codes, key_scales, key_biases, value_codes, value_scales, value_biases,
                kernel_params((length,), mx.int32)],
        template=[("T", dtype), ("S", key_scales.dtype), ("D", fmt.head_dim), ("BITS", bits),
                  ("GROUP", fmt.group_size)],
        grid=(2 * batch * heads * length * fmt.head_dim // _RUN, 1, 1),
        threadgroup=(_THREADS, 1, 1),
        output_shapes=[shape, shape],
        output_dtypes=[dtype, dtype],
    )
    return keys, values


def dequantize_kv_reference(
    key_codes: mx.array, key_scales: mx.array, key_biases: mx.array,
    value_codes: mx.array, value_scales: mx.array, value_biases: mx.array,
    *, length: int, bits: int, dtype: mx.Dtype,
) -> tuple[mx.array, mx.array]:
    """``dequantize_kv`` through ``codec.dequantize`` on the live slices (pure mx)."""
    _check_buffers(key_codes, key_scales, value_codes, length, bits)
    live = [x[:, :, :length] for x in (key_codes, key_scales, key_biases, value_codes, value_scales, value_biases)]
    return codec.dequantize(*live[:3], bits, dtype), codec.dequantize(*live[3:], bits, dtype)


def _check_buffers(key_codes, key_scales, value_codes, length, bits) -> PackedFormat:
    if key_codes.ndim != 4 or key_codes.shape != value_codes.shape or key_codes.dtype != mx.uint32:
        raise ValueError(f"codes must be two equal uint32 [B, H, S, words] arrays; got {key_codes.shape} "
                         f"and {value_codes.shape}")
    if not 0 <= length <= key_codes.shape[2]:
        raise ValueError(f"length {length} outside 0..{key_codes.shape[2]}")
    head_dim = key_codes.shape[-1] * 32 // bits
    return PackedFormat(bits, head_dim // key_scales.shape[-1], head_dim, key_scales.dtype)


def available() -> bool:
    """Whether the kernel can run here."""
    return _DEQUANTIZE.available()
