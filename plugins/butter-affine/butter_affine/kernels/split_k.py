"""Split-K (flash-decoding) pieces that any fused single-query attention kernel shares.

A fused decode kernel splits the live keys among threadgroups; each keeps, per query
head, an online-softmax state (running max ``m`` in log2 units, sum ``l`` of
``exp2(score - m)``, accumulator ``acc`` of ``exp2(score - m) * value``), and writes it
as a partial. A second, small kernel merges the partials of every split. What is the
same for every such kernel lives here, scheme-independent:

- ``SPLIT_K_HELPERS`` (kernel-header source in butter's dialect):
  ``splitk_merge_lanes<HEADS, VEC, LANES>(m, l, acc)`` merges the states of the lanes of
  a warp that hold the same ``VEC`` dimensions (lanes ``LANES`` apart: one key slot
  each); ``splitk_write_partials<HEADS, VEC, D, WARPS>(...)`` merges the warps of a
  threadgroup through shared memory and writes the split's partials.
- ``merge_partials``: the merge kernel and its launch.
- ``heads_per_block`` and ``num_splits``: how a launch is shaped.

Partials are ``partial_acc [B, Hq, splits, D]``, ``partial_max`` and ``partial_sum``
``[B, Hq, splits]``, all float32; a split that saw no key has ``m = -inf, l = 0``.

This module is scheme-independent on purpose: butter-raw's ``sdpa_decode`` has the same
structure (its merge kernel and its in-kernel merges are this code's twin), and
butter-aura's fused kernel will need it too. It belongs in ``butter_core.kernels``;
until it moves there it lives in the first scheme that needed it twice.
"""

from __future__ import annotations

import math

import mlx.core as mx

from butter_core.kernels import Kernel

SPLIT_K_HELPERS = r"""
// ---- split-K (flash-decoding) merges ----------------------------------------------
#if defined(__METAL_VERSION__)
#define SPLITK_SHARED threadgroup
#else
#define SPLITK_SHARED
#endif

template <int HEADS, int VEC, int LANES>
BT_FUNC void splitk_merge_lanes(BT_PRIVATE float* m, BT_PRIVATE float* l, BT_PRIVATE float* acc) {
#pragma unroll
  for (int h = 0; h < HEADS; ++h) {
    float m_all = m[h];
    for (int offset = LANES; offset < BT_WARP_SIZE; offset *= 2) {
      const float other = bt_shuffle_xor(m_all, offset);
      m_all = other > m_all ? other : m_all;
    }
    const float weight = m[h] == BT_NEG_INF ? 0.0f : bt_exp2(m[h] - m_all);
    float l_all = l[h] * weight;
    for (int offset = LANES; offset < BT_WARP_SIZE; offset *= 2) {
      l_all += bt_shuffle_xor(l_all, offset);
    }
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      float a = acc[h * VEC + i] * weight;
      for (int offset = LANES; offset < BT_WARP_SIZE; offset *= 2) {
        a += bt_shuffle_xor(a, offset);
      }
      acc[h * VEC + i] = a;
    }
    m[h] = m_all;
    l[h] = l_all;
  }
}

// Every thread of the threadgroup calls this once. Lanes of key slot 0 (slot == 0) hold
// their warp's merged state for dimensions [sub * VEC, (sub + 1) * VEC). The shared
// arrays hold WARPS * HEADS (warp_m, warp_l) and WARPS * HEADS * D (warp_acc) floats.
template <int HEADS, int VEC, int D, int WARPS>
BT_FUNC void splitk_write_partials(
    const BT_PRIVATE float* m, const BT_PRIVATE float* l, const BT_PRIVATE float* acc,
    int sub, int slot, int warp, int rank, int first_q_head, int n_splits, int split,
    SPLITK_SHARED float* warp_m, SPLITK_SHARED float* warp_l, SPLITK_SHARED float* warp_acc,
    BT_GLOBAL float* partial_acc, BT_GLOBAL float* partial_max, BT_GLOBAL float* partial_sum) {
  if (slot == 0) {
#pragma unroll
    for (int h = 0; h < HEADS; ++h) {
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        warp_acc[(warp * HEADS + h) * D + sub * VEC + i] = acc[h * VEC + i];
      }
      if (sub == 0) {
        warp_m[warp * HEADS + h] = m[h];
        warp_l[warp * HEADS + h] = l[h];
      }
    }
  }
  BT_BARRIER;
  for (int e = rank; e < HEADS * D; e += WARPS * BT_WARP_SIZE) {
    const int h = e / D;
    const int d = e % D;
    float m_all = BT_NEG_INF;
    for (int w = 0; w < WARPS; ++w) {
      const float mw = warp_m[w * HEADS + h];
      m_all = mw > m_all ? mw : m_all;
    }
    float l_all = 0.0f;
    float a = 0.0f;
    for (int w = 0; w < WARPS; ++w) {
      const float mw = warp_m[w * HEADS + h];
      const float weight = mw == BT_NEG_INF ? 0.0f : bt_exp2(mw - m_all);
      l_all += weight * warp_l[w * HEADS + h];
      a += weight * warp_acc[(w * HEADS + h) * D + d];
    }
    const int64_t part = static_cast<int64_t>(first_q_head + h) * n_splits + split;
    partial_acc[part * D + d] = a;
    if (d == 0) {
      partial_max[part] = m_all;
      partial_sum[part] = l_all;
    }
  }
}
"""

_MERGE = Kernel(
    name="butter_affine_split_k_merge",
    input_names=("partial_acc", "partial_max", "partial_sum"),
    output_names=("out",),
    body="""
  // One threadgroup per (batch, query head), one thread per output dimension.
  const int n_splits = partial_max_shape[2];
  const int dims = partial_acc_shape[3];
  const int64_t head = block_idx.x;
  const int d = thread_idx.x;
  float m_all = BT_NEG_INF;
  for (int s = 0; s < n_splits; ++s) {
    const float ms = partial_max[head * n_splits + s];
    m_all = ms > m_all ? ms : m_all;
  }
  float l_all = 0.0f;
  float a = 0.0f;
  for (int s = 0; s < n_splits; ++s) {
    const int64_t part = head * n_splits + s;
    const float ms = partial_max[part];
    const float weight = ms == BT_NEG_INF ? 0.0f : bt_exp2(ms - m_all);
    l_all += weight * partial_sum[part];
    a += weight * partial_acc[part * dims + d];
  }
  out[head * dims + d] = bt_from_float<T>(a / l_all);
""",
)


def merge_partials(
    partial_acc: mx.array, partial_max: mx.array, partial_sum: mx.array, dtype: mx.Dtype
) -> mx.array:
    """Attention output ``[B, Hq, 1, D]`` in ``dtype`` from the partials of every split."""
    batch, q_heads, _, dims = partial_acc.shape
    (out,) = _MERGE(
        inputs=[partial_acc, partial_max, partial_sum],
        template=[("T", dtype)],
        grid=(dims * batch * q_heads, 1, 1),
        threadgroup=(dims, 1, 1),
        output_shapes=[(batch, q_heads, 1, dims)],
        output_dtypes=[dtype],
    )
    return out


def partial_shapes(batch: int, q_heads: int, n_splits: int, dims: int) -> list[tuple[int, ...]]:
    """Output shapes of a partials kernel: acc, max, sum."""
    return [(batch, q_heads, n_splits, dims), (batch, q_heads, n_splits), (batch, q_heads, n_splits)]


def heads_per_block(group: int, max_heads: int) -> int:
    """The largest divisor of the GQA group size (query heads per KV head) up to ``max_heads``:
    the query heads one threadgroup serves from one read of the keys and values."""
    return max(h for h in range(1, min(group, max_heads) + 1) if group % h == 0)


def num_splits(length: int, blocks_per_split: int, *, min_keys: int, target_blocks: int) -> int:
    """Splits of the live keys: enough threadgroups (``target_blocks``) to fill the GPU, but
    never fewer than ``min_keys`` keys per split. Chosen per call, never compiled in."""
    by_length = math.ceil(length / min_keys)
    by_occupancy = math.ceil(target_blocks / blocks_per_split)
    return max(1, min(by_length, by_occupancy))
