"""Tensor-core split-K decode attention: the scheme-independent fragment bookkeeping.

A tensor-core partials kernel computes, per warp and per block of 16 keys, the scores
and the value sum as two matrix products on the dialect's ``bt_mma_16x8x16`` (float16
inputs, float32 accumulation). It uses the *transposed* FlashAttention-2 layout:

    Sᵀ[16 keys, 8 heads]  = K[16 keys, D] · Qᵀ[D, 8 heads]        (D / 16 products)
    Oᵀ[16 dims, 8 heads] += Vᵀ[16 dims, 16 keys] · Pᵀ[16 keys, 8 heads]   (D / 16 products)

so the query heads of a GQA group are the MMA's N = 8 columns (a column tile of 8 heads;
``NH = ceil(HEADS / 8)`` of them), and keys and dimensions fill the M = 16 rows. Against
``S = Q Kᵀ`` with heads as rows, padded to 16, this halves the tensor-core work for
GQA groups up to 8 heads and keeps no zero padding in registers: the A and C operands
of ``mma.sync`` are quads of consecutive registers, so padded rows would cost registers
even when they hold zeros. The price is that ``Pᵀ`` (the B operand of the second
product) is a transpose of the score fragment: two ``bt_transpose_8x8`` per 16 keys and
column tile (``mma_softmax``; on CUDA one ``movmatrix`` each).

Per lane (``g = lane / 4``, ``q = lane % 4``; ``kb`` a key block, ``nh`` a column tile,
heads ``8 nh + 2q`` and ``8 nh + 2q + 1`` are the lane's two *state heads*):

* Scores ``s[(kb * NH + nh) * 4 + i]``: ``i = 0, 1``: key ``16 kb + g``, state heads 0,
  1; ``i = 2, 3``: key ``16 kb + g + 8`` (the C fragment of ``bt_mma_16x8x16``).
* Keys (the A operand of the first product, built by the scheme): for step ``j`` (16 of
  the D dimensions), ``a = {key g: pair 2j, key g+8: pair 2j, key g: pair 2j+1, key
  g+8: pair 2j+1}``, where *pair r* is a half2 of two dimensions of the lane's *key
  chunk*, dimensions ``[q D/4, (q+1) D/4)``: ``Perm::lo(r)`` and ``Perm::hi(r)`` within
  it. Any ``Perm`` that is a bijection onto the chunk works (``q . k`` does not care
  about the order of dimensions as long as Q uses the same), so a scheme picks the one
  its code words unpack into; ``mma_query_fragments<Perm>`` builds Qᵀ to match.
* Values (the A operand of the second product, built by the scheme): dimension tile
  ``t`` (``D / 16`` of them), rows ``g`` and ``g + 8`` are dimensions ``g D/8 + 2t`` and
  ``g D/8 + 2t + 1``: lane group ``g`` owns the *value chunk* ``[g D/8, (g+1) D/8)``,
  contiguous, and ``a = {dim 2t: keys (2q, 2q+1), dim 2t+1: keys (2q, 2q+1), dim 2t:
  keys (2q+8, 2q+9), dim 2t+1: keys (2q+8, 2q+9)}`` (two keys' values in each half2,
  lower key in the lower half; dims relative to the chunk, keys to the block).
* Accumulator ``o[(t * NH + nh) * 4 + i]``: ``i = 0, 1``: dimension ``g D/8 + 2t``,
  state heads 0, 1; ``i = 2, 3``: dimension ``g D/8 + 2t + 1``.
* State ``m[nh * 2 + e]``, ``l[nh * 2 + e]`` for state head ``e``: running max (log2
  units, equal in the 8 lanes of a ``q``) and this lane's part of the running sum.
* ``Pᵀ`` (``mma_softmax``'s output, the B operand of the second product):
  ``pb[(kb * NH + nh) * 2 + i]``.

``MMA_SPLIT_K_HELPERS`` (kernel-header source, dialect only; needs ``Kernel(...,
mma=True)`` and ``split_k.SPLIT_K_HELPERS`` before it):

- ``mma_query_fragments<Perm, NH, D>(queries, heads, q_scale, lane, qb)``: Qᵀ's B
  fragments ``qb[(nh * D/16 + j) * 2 + i]`` from ``heads`` query rows at ``queries``
  (row-major, D each), times ``q_scale``, in float16; heads past ``heads`` are zero.
- ``mma_softmax<NH, KB, DT>(s, m, l, o, pb, lane)``: one online-softmax step over ``KB``
  key blocks of scores (masked keys already ``-inf``; a head may see none for any number
  of steps, even to the end: ``m = -inf, l = 0``), in three parts that a kernel
  interleaving the blocks' value products with their ``Pᵀ`` (butter-aura) calls itself:
  ``mma_softmax_max<NH, KB, DT>(s, m, l, o)``: when any lane holds a score above its
  head's max, reduces the maxima over the lanes and rescales ``l`` and ``o`` (``DT``
  dimension tiles); ``mma_softmax_probabilities<NH, KB>(s, m, l)``: ``p = exp2(s - m)``
  in place of ``s``, added to ``l``; ``mma_softmax_pack<NH>(p, pb, lane, w_upper = 1,
  w_lower = 1)``: one block's ``p`` times a weight per key (``w_upper`` for key ``g``,
  ``w_lower`` for key ``g + 8``; butter-aura's value scales), transposed, as its ``pb``.
- ``mma_write_partials<HEADS, NH, D, WARPS>(m, l, o, lane, warp, rank, block, warp_m,
  warp_l, warp_acc, partial_acc, partial_max, partial_sum)``: after the key loop, every
  thread calls it once: it sums ``l`` over the lanes, stores each warp's state to the
  shared arrays ``split_k`` describes, then merges the warps and writes the split's
  partials (``splitk_merge_warps``). ``HEADS * D <= 2048`` keeps those arrays within
  static shared memory at 4 warps (``max_heads``).

Precision: keys, values, queries and probabilities enter the products as float16
(11-bit significands; the products are exact and summed in float32). Query-times-scale
and probabilities are rounded once each; how a scheme forms its float16 keys and values
is its own business (butter-affine rounds each dequantized value once).
"""

from __future__ import annotations

from butter_core.kernels.backend import gpu_backend

MMA_SPLIT_K_HELPERS = r"""
// ---- tensor-core split-K decode attention, butter_core.kernels.mma ----------------
template <typename Perm, int NH, int D, typename In>
BT_FUNC void mma_query_fragments(In queries, int heads, float q_scale, unsigned int lane,
                                 BT_PRIVATE uint32_t* qb) {
  constexpr int CHUNK = D / 4;
  constexpr int STEPS = D / 16;
  const int g = lane / 4;
  const int q = lane % 4;
#pragma unroll
  for (int nh = 0; nh < NH; ++nh) {
    const int head = nh * 8 + g;
    float x[CHUNK];
    if (head < heads) {
      bt_load<CHUNK>(queries + static_cast<int64_t>(head) * D + q * CHUNK, x);
    } else {
#pragma unroll
      for (int i = 0; i < CHUNK; ++i) {
        x[i] = 0.0f;
      }
    }
#pragma unroll
    for (int r = 0; r < 2 * STEPS; ++r) {
      qb[nh * 2 * STEPS + r] = bt_pack_half2(x[Perm::lo(r)] * q_scale, x[Perm::hi(r)] * q_scale);
    }
  }
}

template <int NH, int KB, int DT>
BT_FUNC void mma_softmax_max(const BT_PRIVATE float* s, BT_PRIVATE float* m, BT_PRIVATE float* l,
                             BT_PRIVATE float* o) {
  // Whether any score of the step is above its head's running max, in any lane: rare
  // once the stream is warm, and only then are the heads' maxima reduced over the lanes
  // and what was summed so far rescaled (by 1 exactly for a head whose max held, and
  // for one that has seen no key: its max stays -inf, its sum 0).
  bool above = false;
#pragma unroll
  for (int kb = 0; kb < KB; ++kb) {
#pragma unroll
    for (int i = 0; i < NH * 4; ++i) {
      above = above || s[kb * NH * 4 + i] > m[(i / 4) * 2 + i % 2];
    }
  }
  if (bt_any(above)) {
    float correction[NH * 2];
#pragma unroll
    for (int c = 0; c < NH * 2; ++c) {
      // Column (head) maxima: this lane's keys, then the 8 lanes of its q.
      float x = m[c];
#pragma unroll
      for (int kb = 0; kb < KB; ++kb) {
        x = bt_max(x, bt_max(s[(kb * NH + c / 2) * 4 + c % 2], s[(kb * NH + c / 2) * 4 + 2 + c % 2]));
      }
#pragma unroll
      for (int offset = 4; offset < BT_WARP_SIZE; offset *= 2) {
        x = bt_max(x, bt_shuffle_xor(x, offset));
      }
      correction[c] = x > m[c] ? bt_exp2(m[c] - x) : 1.0f;  // 0 while m was -inf
      l[c] *= correction[c];
      m[c] = x;
    }
#pragma unroll
    for (int i = 0; i < DT * NH * 4; ++i) {
      o[i] *= correction[(i / 4 % NH) * 2 + i % 2];
    }
  }
}

template <int NH, int KB>
BT_FUNC void mma_softmax_probabilities(BT_PRIVATE float* s, const BT_PRIVATE float* m, BT_PRIVATE float* l) {
  // The probabilities, in place of the scores, and their sums. A head that has seen no
  // key subtracts 0 from its -inf scores: exp2(-inf) = 0.
#pragma unroll
  for (int kb = 0; kb < KB; ++kb) {
#pragma unroll
    for (int i = 0; i < NH * 4; ++i) {
      const float max = m[(i / 4) * 2 + i % 2];
      s[kb * NH * 4 + i] = bt_exp2(s[kb * NH * 4 + i] - (max == BT_NEG_INF ? 0.0f : max));
      l[(i / 4) * 2 + i % 2] += s[kb * NH * 4 + i];
    }
  }
}

template <int NH>
BT_FUNC void mma_softmax_pack(const BT_PRIVATE float* p, BT_PRIVATE uint32_t* pb, unsigned int lane,
                              float w_upper = 1.0f, float w_lower = 1.0f) {
  // Pᵀ: lane (g, q) needs P[key 2q (+1, +8, +9)][head g], the transpose of the packed
  // pairs (key g | g + 8, heads 2q, 2q+1) the lanes hold.
#pragma unroll
  for (int nh = 0; nh < NH; ++nh) {
    pb[nh * 2] = bt_transpose_8x8(bt_pack_half2(p[nh * 4] * w_upper, p[nh * 4 + 1] * w_upper), lane);
    pb[nh * 2 + 1] = bt_transpose_8x8(bt_pack_half2(p[nh * 4 + 2] * w_lower, p[nh * 4 + 3] * w_lower), lane);
  }
}

template <int NH, int KB, int DT>
BT_FUNC void mma_softmax(BT_PRIVATE float* s, BT_PRIVATE float* m, BT_PRIVATE float* l, BT_PRIVATE float* o,
                         BT_PRIVATE uint32_t* pb, unsigned int lane) {
  mma_softmax_max<NH, KB, DT>(s, m, l, o);
  mma_softmax_probabilities<NH, KB>(s, m, l);
#pragma unroll
  for (int kb = 0; kb < KB; ++kb) {
    mma_softmax_pack<NH>(s + kb * NH * 4, pb + kb * NH * 2, lane);
  }
}

template <int HEADS, int NH, int D, int WARPS>
BT_FUNC void mma_write_partials(
    const BT_PRIVATE float* m, BT_PRIVATE float* l, const BT_PRIVATE float* o,
    unsigned int lane, int warp, int rank, SplitKBlock block,
    BT_SHARED_PTR float* warp_m, BT_SHARED_PTR float* warp_l, BT_SHARED_PTR float* warp_acc,
    BT_GLOBAL float* partial_acc, BT_GLOBAL float* partial_max, BT_GLOBAL float* partial_sum) {
  constexpr int DT = D / 16;
  const int g = lane / 4;
  const int q = lane % 4;
#pragma unroll
  for (int i = 0; i < NH * 2; ++i) {
    for (int offset = 4; offset < BT_WARP_SIZE; offset *= 2) {
      l[i] += bt_shuffle_xor(l[i], offset);
    }
  }
#pragma unroll
  for (int nh = 0; nh < NH; ++nh) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int h = nh * 8 + 2 * q + e;
      if (h < HEADS) {
        if (g == 0) {
          warp_m[warp * HEADS + h] = m[nh * 2 + e];
          warp_l[warp * HEADS + h] = l[nh * 2 + e];
        }
#pragma unroll
        for (int t = 0; t < DT; ++t) {
          const int d = g * (D / 8) + 2 * t;
          warp_acc[(warp * HEADS + h) * D + d] = o[(t * NH + nh) * 4 + e];
          warp_acc[(warp * HEADS + h) * D + d + 1] = o[(t * NH + nh) * 4 + 2 + e];
        }
      }
    }
  }
  BT_BARRIER;
  splitk_merge_warps<HEADS, D, WARPS>(rank, block, warp_m, warp_l, warp_acc, partial_acc, partial_max, partial_sum);
}
"""


def max_heads(dims: int, warps: int = 4) -> int:
    """Query heads one threadgroup of a tensor-core kernel may serve: at most two column
    tiles (16), and few enough that the warps' shared state stays within 32 KiB — on CUDA
    the accumulators (``warps * heads * dims`` floats, of 48 KiB of static shared memory
    allowed), on Metal the accumulators and each head's running max and sum (``warps *
    heads * (dims + 2)`` floats), since 32 KiB is all the threadgroup memory Apple GPUs
    have."""
    floats_per_head = warps * (dims + 2 if gpu_backend() == "metal" else dims)
    return max(1, min(16, 8192 // floats_per_head))
