"""``encode``: rotate and code new keys and values, one kernel launch for both.

One threadgroup of ``D`` threads per row (a head's vector at one position), one thread
per coordinate. Each thread multiplies its coordinate by the head's sign, the block
runs the Walsh–Hadamard butterflies in shared memory, and each scale group (``KG``/``VG``
coordinates) computes its RMS, the nearest codebook level of every coordinate (a binary
search over the decision boundaries), and the least-squares scale; the codes are
packed into words by the first threads. Keys and values go through the same block one
after the other.

Its outputs are stacked as the cache keeps its buffers (``layout.stacks_for``): the key
and value scales in one array ``[2, ...]``, and the codes in one ``[2, ...]`` where keys
and values have as many words, else in two. So an append writes two or three arrays,
not four (one kernel object per case: MLX fixes a kernel's outputs).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping

import mlx.core as mx

from butter_core.plugin_api import Kernel, compile_by_shape, unstack

from butter_aura.codec import SCALE_DTYPE, Codec
from butter_aura.kernels.source import HELPERS
from butter_aura.layout import BUFFERS, stacks_for
from butter_aura.rotation import Rotation, TracedRotation

_BODY = """
  // Template: T (input dtype), S (scale dtype), D, KB/VB (bits), KG/VG (scale groups).
  constexpr int KW = (D * KB + 31) / 32;
  constexpr int VW = (D * VB + 31) / 32;
  constexpr int WARPS = D / BT_WARP_SIZE;
  const int heads = keys_shape[1];
  const int tokens = keys_shape[2];
  const int64_t rows = static_cast<int64_t>(keys_shape[0]) * heads * tokens;
  // scales: [key scales, value scales], rows * (D / group) each.
  auto key_scales = scales;
  auto value_scales = scales + rows * (D / KG);
  BUTTER_AURA_CODE_OUTPUTS
  const int64_t row = block_idx.x;
  const int head = static_cast<int>((row / tokens) % heads);
  const int d = thread_idx.x;
  const float inv_sqrt_d = 1.0f / bt_sqrt(static_cast<float>(D));

  BT_SHARED float buf[D];
  BT_SHARED unsigned int indices[D];  // each coordinate's level
  BT_SHARED float scratch[WARPS];
  // Both codebooks in one array each (keys first), so a pass picks its table by offset.
  BT_SHARED float levels[(1 << KB) + (1 << VB)];
  BT_SHARED float bounds[(1 << KB) + (1 << VB)];
  for (int i = d; i < (1 << KB); i += D) {
    levels[i] = key_levels[i];
    bounds[i] = i < (1 << KB) - 1 ? key_bounds[i] : 0.0f;
  }
  for (int i = d; i < (1 << VB); i += D) {
    levels[(1 << KB) + i] = value_levels[i];
    bounds[(1 << KB) + i] = i < (1 << VB) - 1 ? value_bounds[i] : 0.0f;
  }
  const float sign = signs[head * D + d];

  for (int pass = 0; pass < 2; ++pass) {
    const int bits = pass == 0 ? KB : VB;
    const int group = pass == 0 ? KG : VG;
    const int table = pass == 0 ? 0 : (1 << KB);
    const int n_words = pass == 0 ? KW : VW;
    const auto src = pass == 0 ? keys : values;  // one shape, so one address space

    BT_BARRIER;  // the previous pass has finished with buf and indices
    buf[d] = bt_to_float(src[row * D + d]) * sign;
    BT_BARRIER;
    aura_fwht_shared<1>(buf, D, D, D, d);
    const float y = buf[d] * inv_sqrt_d;

    const float sum_sq = aura_group_sum(y * y, group, scratch, lane_id, warp_id);
    const float rms = bt_sqrt(sum_sq / static_cast<float>(group));
    const float t = y / (rms > 0.0f ? rms : 1.0f);
    int index = 0;
    for (int step = 1 << (bits - 1); step > 0; step >>= 1) {
      index += t > bounds[table + index + step - 1] ? step : 0;
    }
    const float chosen = levels[table + index];
    const float dot = aura_group_sum(y * chosen, group, scratch, lane_id, warp_id);
    const float norm = aura_group_sum(chosen * chosen, group, scratch, lane_id, warp_id);
    float scale = dot / (norm > 1e-30f ? norm : 1e-30f);
    scale = scale > 65504.0f ? 65504.0f : (scale < -65504.0f ? -65504.0f : scale);
    indices[d] = static_cast<unsigned int>(index);
    BT_BARRIER;

    if (d % group == 0) {
      const int64_t at = row * (D / group) + d / group;
      if (pass == 0) {
        key_scales[at] = bt_from_float<S>(scale);
      } else {
        value_scales[at] = bt_from_float<S>(scale);
      }
    }
    if (d < n_words) {
      // Word d holds stream bits [32 d, 32 d + 32): every code that overlaps them.
      unsigned int word = 0u;
      const int first = (32 * d) / bits;
      const int last = (32 * d + 31) / bits;
      for (int j = first; j <= last && j < D; ++j) {
        const int offset = j * bits - 32 * d;
        word |= offset >= 0 ? indices[j] << offset : indices[j] >> (-offset);
      }
      if (pass == 0) {
        key_codes[row * KW + d] = word;
      } else {
        value_codes[row * VW + d] = word;
      }
    }
  }
"""


def _encode_kernel(stacked_codes: bool) -> Kernel:
    """The kernel whose codes are one stacked output ``codes`` (keys then values) or two."""
    if stacked_codes:
        outputs = ("codes", "scales")
        code_outputs = "auto key_codes = codes;\n  auto value_codes = codes + rows * KW;"
    else:
        outputs = ("key_codes", "value_codes", "scales")
        code_outputs = ""
    return Kernel(
        name="butter_aura_encode_stacked" if stacked_codes else "butter_aura_encode",
        input_names=("keys", "values", "signs", "key_levels", "key_bounds", "value_levels", "value_bounds"),
        output_names=outputs,
        helpers=HELPERS,
        body=_BODY.replace("BUTTER_AURA_CODE_OUTPUTS", code_outputs),
    )


_ENCODE = {stacked: _encode_kernel(stacked) for stacked in (False, True)}

SUPPORTED_HEAD_DIMS = (64, 128)
"""Head sizes the kernels serve (power-of-two; others use the pure-mx path)."""


def available() -> bool:
    """Whether the kernels can run here (a Metal or CUDA build of MLX)."""
    return _ENCODE[False].available()


def encode(
    keys: mx.array, values: mx.array, rotation: Rotation, key_codec: Codec, value_codec: Codec
) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """``reference.encode`` on the GPU: key codes, key scales, value codes, value scales."""
    named = unstack(encode_rows(keys, values, rotation, key_codec, value_codec), stacks_for(key_codec, value_codec))
    return tuple(named[name] for name in BUFFERS)


def encode_rows(
    keys: mx.array, values: mx.array, rotation: Rotation, key_codec: Codec, value_codec: Codec
) -> dict[str, mx.array]:
    """``encode``'s rows as ``AuraCache`` writes them: by stack (``layout.stacks_for``) or buffer name."""
    if keys.shape != values.shape or keys.ndim != 4:
        raise ValueError(f"keys and values must be equal [B, H, tokens, D] arrays; got {keys.shape}, {values.shape}")
    batch, heads, tokens, dims = keys.shape
    if dims not in SUPPORTED_HEAD_DIMS or rotation.permutation is not None:
        raise ValueError(f"the encode kernel serves head_dim {SUPPORTED_HEAD_DIMS}; got {dims}")
    rows = batch * heads * tokens
    lead = (batch, heads, tokens)
    values = values.astype(keys.dtype)
    stacked = "codes" in stacks_for(key_codec, value_codec)
    if stacked:
        code_shapes, names = [(2, *lead, key_codec.words)], ("codes", "scales")
    else:
        code_shapes, names = [(*lead, key_codec.words), (*lead, value_codec.words)], ("key_codes", "value_codes", "scales")
    outputs = _ENCODE[stacked](
        inputs=[
            keys,
            values,
            rotation.signs,
            key_codec.book.levels_array(),
            key_codec.book.boundaries_array(),
            value_codec.book.levels_array(),
            value_codec.book.boundaries_array(),
        ],
        template=[
            ("T", keys.dtype), ("S", SCALE_DTYPE), ("D", dims),
            ("KB", key_codec.bits), ("VB", value_codec.bits), ("KG", key_codec.group), ("VG", value_codec.group),
        ],
        grid=(rows * dims, 1, 1),
        threadgroup=(dims, 1, 1),
        output_shapes=[*code_shapes, (2, *lead, key_codec.groups)],
        output_dtypes=[mx.uint32] * len(code_shapes) + [SCALE_DTYPE],
    )
    return dict(zip(names, outputs))


def traced_encode_into(storage: Mapping[str, mx.array], fp: Mapping[str, mx.array], rows: mx.array, slots: mx.array,
                       signs: mx.array, key_codec: Codec, value_codec: Codec) -> dict[str, mx.array]:  # fmt: skip
    """The codes of full-precision rows ``rows`` (of ``fp``'s ``fp_keys`` and ``fp_values``) written at
    slots ``slots`` of ``storage`` (a cache's stacks and buffers, each whole: ``SlotBuffers.read(
    stacked=True)``), as one call traced per shape (``compile_by_shape``): two gathers, the encode
    and one scatter per stored array. What ``AuraCache`` runs on CUDA to write the codes of the
    tokens a decode step deferred (every ring's worth of steps, in every layer), where the same
    operations built one by one cost the host several times as much. ``rows`` and ``slots``: int32,
    one entry per token (slots distinct). Returns the written storage, which replaces the cache's
    (``SlotBuffers.replace``: updated in place once the cache lets go of the old arrays)."""
    traced = _traced_encode_into(key_codec.fields, value_codec.fields, tuple(storage))
    return dict(zip(storage, traced(fp["fp_keys"], fp["fp_values"], rows, slots, signs, *storage.values())))


@functools.cache
def _traced_encode_into(key_fields: tuple, value_fields: tuple, keys: tuple[str, ...]) -> Callable:
    """``traced_encode_into`` for one pair of codecs (named by their fields, so every layer of a model
    shares it) and storage keys (the stacks and buffers, in order)."""
    key_codec, value_codec = Codec(*key_fields), Codec(*value_fields)

    def graph(fp_keys, fp_values, rows, slots, signs, *stored):
        coded = encode_rows(mx.take(fp_keys, rows, axis=2), mx.take(fp_values, rows, axis=2), TracedRotation(signs),
                            key_codec, value_codec)  # fmt: skip
        written = []
        for key, array in zip(keys, stored):
            axis = array.ndim - 2  # slots: axis 2 of a buffer, 3 of a stack
            where = slots.reshape((1,) * axis + (-1, 1))
            written.append(mx.put_along_axis(array, where, coded[key].astype(array.dtype), axis=axis))
        return written

    return compile_by_shape(graph)
