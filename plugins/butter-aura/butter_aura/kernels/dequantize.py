"""``dequantize``: stored keys and values back in the model's domain, for prefill and windows.

One threadgroup of ``D`` threads per (batch, KV head, slot). A slot held in full
precision is copied from its row; otherwise each thread decodes one coordinate
(``level * scale``), the block runs the Walsh–Hadamard butterflies in shared memory, and
each thread scales by ``1/sqrt(D)`` and its sign. Keys, then values, in the same block.
"""

from __future__ import annotations

import mlx.core as mx

from butter_core.plugin_api import Kernel, kernel_params

from butter_aura.kernels.source import HELPERS
from butter_aura.stored import StoredLayer

_DEQUANTIZE = Kernel(
    name="butter_aura_dequantize",
    input_names=(
        "key_codes", "key_scales", "value_codes", "value_scales", "key_levels", "value_levels",
        "fp_keys", "fp_values", "recent_slots", "signs", "params",
    ),
    output_names=("keys", "values"),
    helpers=HELPERS,
    body="""
  // Template: T (output dtype), S (scale dtype), F (full-precision row dtype), D, KB/VB,
  // KG/VG. Grid: x = length * D (one block per slot), y = batch * kv_heads.
  // params: [length, sinks, recent, base, tail] (layout.FullPrecisionBudget).
  constexpr int KW = (D * KB + 31) / 32;
  constexpr int VW = (D * VB + 31) / 32;
  const int length = params[0];
  const int sinks = params[1];
  const int recent = params[2];
  const int base = params[3];
  const int tail = params[4];
  const int heads = key_codes_shape[1];
  const int allocated = key_codes_shape[2];
  const int rows_fp = fp_keys_shape[2];
  const int slot = block_idx.x;
  const int batch_head = block_idx.y;
  const int head = batch_head % heads;
  const int d = thread_idx.x;
  const int64_t row = static_cast<int64_t>(batch_head) * allocated + slot;
  const int64_t out_at = (static_cast<int64_t>(batch_head) * length + slot) * D + d;

  BT_SHARED float levels[(1 << KB) + (1 << VB)];
  BT_SHARED float buf[D];
  for (int i = d; i < (1 << KB); i += D) {
    levels[i] = key_levels[i];
  }
  for (int i = d; i < (1 << VB); i += D) {
    levels[(1 << KB) + i] = value_levels[i];
  }
  const int index = slot < base || recent == 0 ? -1 : aura_ring_index(slot, recent, base, tail);
  const bool exact = slot < sinks || (index >= 0 && recent_slots[index] == slot);
  if (exact) {
    // Uniform over the block: every thread of this slot takes this branch.
    const int64_t fp_at = (static_cast<int64_t>(batch_head) * rows_fp + (slot < sinks ? slot : sinks + index)) * D + d;
    keys[out_at] = bt_from_float<T>(bt_to_float(fp_keys[fp_at]));
    values[out_at] = bt_from_float<T>(bt_to_float(fp_values[fp_at]));
  } else {
    const float sign = signs[head * D + d];
    const float inv_sqrt_d = 1.0f / bt_sqrt(static_cast<float>(D));
    for (int pass = 0; pass < 2; ++pass) {
      BT_BARRIER;  // levels are loaded; the previous pass has finished with buf
      if (pass == 0) {
        const float scale = bt_to_float(key_scales[row * (D / KG) + d / KG]);
        buf[d] = levels[aura_code(key_codes + row * KW, d, KB)] * scale;
      } else {
        const float scale = bt_to_float(value_scales[row * (D / VG) + d / VG]);
        buf[d] = levels[(1 << KB) + aura_code(value_codes + row * VW, d, VB)] * scale;
      }
      BT_BARRIER;
      aura_fwht_shared<1>(buf, D, D, D, d);
      const float x = buf[d] * inv_sqrt_d * sign;
      if (pass == 0) {
        keys[out_at] = bt_from_float<T>(x);
      } else {
        values[out_at] = bt_from_float<T>(x);
      }
    }
  }
""",
)


def dequantize(stored: StoredLayer, dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
    """``reference.dequantize`` on the GPU: keys and values ``[batch, kv_heads, length, head_dim]`` in ``dtype``."""
    batch, heads, _, _ = stored.key_codes.shape
    dims, length = stored.key_codec.head_dim, stored.length
    if length == 0:
        empty = mx.zeros((batch, heads, 0, dims), dtype)
        return empty, empty
    if stored.rotation.permutation is not None:
        raise ValueError(f"the dequantize kernel serves power-of-two head sizes; got {dims}")
    kc, vc = stored.key_codec, stored.value_codec
    sinks, recent, base, tail = stored.budget.params()
    params = kernel_params((length, sinks, recent, base, tail), mx.int32)
    keys, values = _DEQUANTIZE(
        inputs=[
            stored.key_codes, stored.key_scales, stored.value_codes, stored.value_scales, kc.book.levels_array(),
            vc.book.levels_array(), stored.fp_keys, stored.fp_values, stored.recent_slots, stored.rotation.signs, params,
        ],
        template=[
            ("T", dtype), ("S", stored.key_scales.dtype), ("F", stored.fp_keys.dtype), ("D", dims),
            ("KB", kc.bits), ("VB", vc.bits), ("KG", kc.group), ("VG", vc.group),
        ],
        grid=(length * dims, batch * heads, 1),
        threadgroup=(dims, 1, 1),
        output_shapes=[(batch, heads, length, dims)] * 2,
        output_dtypes=[dtype, dtype],
    )
    return keys, values
