"""``decode_attention``: one query token over packed 4- or 8-bit K/V, on tensor cores.

The same split-K flash-decoding as ``decode`` (partials per split of the live keys,
then ``butter_core.kernels.split_k``'s merge kernel; the same ``plan`` and partials
format), but each warp computes its scores and its value sums as matrix products
(``bt_mma_16x8x16``: float16 inputs, float32 sums) in the transposed layout that
``butter_core.kernels.mma`` describes: per block of 16 keys,

    Sᵀ[16 keys, heads]  = K[16 keys, D] · Qᵀ             (D / 16 products)
    Oᵀ[16 dims, heads] += Vᵀ[16 dims, 16 keys] · Pᵀ      (D / 16 products)

with the query heads of one KV head as the 8 columns (16 with two column tiles).
Codes become float16 keys and values in registers (``codes.MMA_CODE_HELPERS``: a
magic-number AND-OR or byte permute per pair of codes, then two half2 FMAs: subtract the
magic 1024 exactly, then ``code * scale + bias`` rounded once); no dequantized key or
value is ever stored. Each lane reads whole runs of code words: for the scores, the
lane's two keys (rows g and g+8 of the block), dimensions ``[q D/4, (q+1) D/4)`` (one
16-byte load per key at 4 bits and D = 128, within one group, so one scale and bias per
key); for the values, four keys (2q, 2q+1, 2q+8, 2q+9), dimensions ``[g D/8, (g+1)
D/8)``, two keys' words interleaved by byte permutes so a half2 holds one dimension of
two keys. The permutation of dimensions this implies is folded into the query fragments
(``AffineKPerm``) and undone when the partials are written.

6-bit codes (MLX's byte packing: four codes in three bytes) come in units of three
words, 16 codes (``codes.AffineUnit``): a lane's key chunk at D = 128 is two units (24
bytes, three 8-byte loads), its value chunk one (12 bytes); each 3-byte triple is cut
into half2 pairs by shifts and the same magic-number AND-OR. So D / 8 codes must be
whole units: head_dim 128 or 256.

Supported: 4, 6 or 8 bits; head_dim 64, 128 or 256 (6 bits: 128 or 256); group sizes 32,
64, 128; float16 or bfloat16 queries and scales (float32, and 6-bit codes at head_dim 64,
use ``decode``); any GQA group (``HEADS``, a divisor of it up to ``mma.max_heads``, per
threadgroup).

Precision: queries (times softmax scale * log2 e), keys, values and probabilities are
rounded to float16 once each; everything else is float32. Dequantized values must fit
float16 (|x| < 65504); scales below 2^-14 (6.1e-5) lose relative precision as float16
subnormals.

Speed: on the H200 it is the fastest affine decode path at long contexts, well ahead of
the float32 ``decode`` kernel (also for 6-bit codes, which is why it takes them); at 4k
and 32k per-call costs dominate. The partials kernel is the whole cost: the merge
overlaps the next call's partials. A lane spends well under half of ``decode``'s
instructions per 16 keys, and the registers at the defaults (no spills) leave room for
three threadgroups of 128 threads per multiprocessor. Tried and dropped: L2 prefetch
hints ahead of each warp's loads (slower), a one-launch merge (slower: MLX fills such an
output with a separate kernel first), and loads staged through shared memory
(``cp.async``; no faster: more bytes in flight does not help, so the kernel is not bound
by load latency). Measurements: docs/benchmarks.md,
"plugins/butter-affine/butter_affine/kernels/decode_mma.py".
"""

from __future__ import annotations

import mlx.core as mx

from butter_core.plugin_api import Kernel, kernel_params, mma, split_k

from butter_affine.kernels.codes import CODE_HELPERS, MMA_CODE_HELPERS
from butter_affine.kernels.decode import (
    _check_args,
    _check_paged_args,
)
from butter_affine.packing import BUFFERS, PackedFormat, stack

SUPPORTED_BITS = (4, 6, 8)
SUPPORTED_HEAD_DIMS = (64, 128, 256)
SUPPORTED_DTYPES = (mx.float16, mx.bfloat16)

# Launch shape; the bench retimes alternatives (module attributes, read per call).
WARPS = 4
KEY_BLOCKS = 2
"""Blocks of 16 keys a warp takes per step of its loop (but see ``LONG_KEY_BLOCKS``)."""
LONG_KEY_BLOCKS = {4: 3}
"""``KEY_BLOCKS`` by code bits where each warp walks at least ``LONG_RUN`` keys: fewer,
longer steps (one softmax step per 48 keys) for more registers. On long runs three blocks
speed up chained calls, as a decode step's layers run; independent calls, which overlap
on the GPU, lose, so short runs keep two blocks. affine8 with three blocks was slower in
both modes (measurements: docs/benchmarks.md,
"plugins/butter-affine/butter_affine/kernels/decode_mma.py")."""
LONG_RUN = 384
"""Keys per warp (planned keys / splits / ``WARPS``) from which ``LONG_KEY_BLOCKS`` apply:
64k and longer contexts at the default launch on an H200 (496 at 64k, 248 at 32k)."""
PREFETCH = False
"""Load a step's keys during the previous step's softmax and value product (its values
are always loaded at the top of the step, ahead of its score product); without it, both
at the top of the step."""
READ_ONLY_LOADS = True
"""Load codes, scales and biases through the read-only data path (``bt_read``: CUDA's
``ld.global.nc``): faster than plain loads (measurements: docs/benchmarks.md,
"plugins/butter-affine/butter_affine/kernels/decode_mma.py")."""
SCORE_CHAINS = {4: 1, 6: 2, 8: 2}
"""Accumulators per score product, by code bits: 2 sums even and odd k16 steps apart
(then adds them), halving the chain of dependent tensor-core instructions for 4 more
registers per block: faster for 8-bit codes, not for 4-bit; 6-bit codes keep two, as 8
(measurements: docs/benchmarks.md,
"plugins/butter-affine/butter_affine/kernels/decode_mma.py")."""
MIN_KEYS_PER_SPLIT = 64
TARGET_BLOCKS = 264
"""Threadgroups the split count aims at (H200: 132 multiprocessors, 2 per multiprocessor
although registers allow 3; ``split_k.plan`` keeps 2 per multiprocessor on other GPUs).
With the read-only loads, 264 was as fast as or faster than 396, 528 and 1584 in every
sweep, and one threadgroup per multiprocessor is as fast as two: occupancy is not what
limits this kernel (measurements: docs/benchmarks.md,
"plugins/butter-affine/butter_affine/kernels/decode_mma.py")."""

_HELPERS = CODE_HELPERS + MMA_CODE_HELPERS + split_k.SPLIT_K_HELPERS + mma.MMA_SPLIT_K_HELPERS + r"""
// The storage row of key `at`: `at` itself in a cache's own buffers (PAGE 0), else its slot
// in paged storage, through the sequence's row of the page table (`table + pages`).
template <int PAGE, typename Table>
BT_FUNC int64_t affine_mma_row(Table table, int64_t pages, int at) {
  if (PAGE == 0) {
    return at;
  }
  return static_cast<int64_t>(table[pages + at / PAGE]) * PAGE + at % PAGE;
}

// Whether keys [at, at + KEYS) lie in consecutive rows: always in a cache's own buffers, in
// paged storage where they lie in one page (every step of a split that starts on a page
// boundary, for pages a multiple of KEYS long). Such a step is read as a cache's own rows
// from its first key's row: one look-up in the page table a step, not one a key.
template <int PAGE, int KEYS>
BT_FUNC bool affine_mma_one_run(int at) {
  if constexpr (PAGE == 0) {
    return true;
  } else {
    return at % PAGE + KEYS <= PAGE;
  }
}

// A warp step's loads, lane (g, q). Keys: for key block b, keys 16 b + g + 8 r (r < 2)
// for the scores, KW words from word q KW of the row, KG groups. Values: keys 16 b + 2q +
// (v % 2) + 8 (v / 2) (v < 4), VW words from word g VW, one group. CLAMP: rows past last
// read row last instead (only the last step of a split needs it), so every value read is
// a live one; without (and PAGE 0), row offsets are constants the loads take as immediates.
template <bool CLAMP, bool RO, int PAGE, int KB, int KW, int KG, int ROW_WORDS, int GROUPS, typename S, typename Codes,
          typename Scales, typename Table>
BT_FUNC void affine_mma_fetch_keys(
    Codes codes, Scales scales, Scales biases, Table table, int64_t pages,
    int base, int last, int g, BT_PRIVATE uint32_t* words, BT_PRIVATE S* s, BT_PRIVATE S* b) {
#pragma unroll
  for (int k = 0; k < KB * 2; ++k) {
    const int offset = 16 * (k / 2) + 8 * (k % 2);
    const int64_t row = affine_mma_row<PAGE>(table, pages, CLAMP ? (base + g + offset < last ? base + g + offset : last)
                                                                 : base + g + offset);
    affine_load_words<KW, RO>(codes + row * ROW_WORDS, words + k * KW);
#pragma unroll
    for (int i = 0; i < KG; ++i) {
      s[k * KG + i] = bt_read_if<RO>(scales + row * GROUPS + i);
      b[k * KG + i] = bt_read_if<RO>(biases + row * GROUPS + i);
    }
  }
}

template <bool CLAMP, bool RO, int PAGE, int KB, int VW, int ROW_WORDS, int GROUPS, typename S, typename Codes,
          typename Scales, typename Table>
BT_FUNC void affine_mma_fetch_values(
    Codes codes, Scales scales, Scales biases, Table table, int64_t pages,
    int base, int last, int q, BT_PRIVATE uint32_t* words, BT_PRIVATE S* s, BT_PRIVATE S* b) {
#pragma unroll
  for (int k = 0; k < KB * 4; ++k) {
    const int offset = 16 * (k / 4) + (k % 2) + 8 * ((k % 4) / 2);
    const int64_t row = affine_mma_row<PAGE>(table, pages, CLAMP ? (base + 2 * q + offset < last ? base + 2 * q + offset : last)
                                                                 : base + 2 * q + offset);
    affine_load_words<VW, RO>(codes + row * ROW_WORDS, words + k * VW);
    s[k] = bt_read_if<RO>(scales + row * GROUPS);
    b[k] = bt_read_if<RO>(biases + row * GROUPS);
  }
}
"""

_PARTIALS_BODY = r"""
  // One threadgroup: one (batch, KV head, HEADS query heads) and one split of the live
  // keys. Warp w takes key blocks w, w + WARPS, ... (KB blocks of 16 keys per step).
  constexpr int NH = (HEADS + 7) / 8;             // column tiles of 8 query heads
  constexpr int KCHUNK = D / 4;                   // dims of a key a lane holds for the scores
  constexpr int KW = KCHUNK * BITS / 32;
  constexpr int KG = KCHUNK > GROUP ? KCHUNK / GROUP : 1;
  constexpr int VCHUNK = D / 8;                   // dims of a key a lane holds for the values
  constexpr int VW = VCHUNK * BITS / 32;
  constexpr int ROW_WORDS = D * BITS / 32;
  constexpr int GROUPS = D / GROUP;
  constexpr int STEPS = D / 16;                   // k16 steps of a score product
  constexpr int DT = D / 16;                      // dimension tiles of the value product
  constexpr int KEYS = 16 * KB;
  constexpr int UNIT = AffineUnit<BITS>::WORDS;   // words per unit of codes (3 at 6 bits, else 1)
  constexpr int PAIRS = AffineUnit<BITS>::CODES / 2;  // half2 per unit of a key
  constexpr int VPAIRS = AffineUnit<BITS>::CODES;     // half2 per unit of two keys' values

  const SplitKBlock block = splitk_block<HEADS>(
      block_idx, grid_dim, queries_shape[1], key_codes_shape[1], $LIVE);
  const int g = lane_id / 4;
  const int q = lane_id % 4;
  const int allocated = key_codes_shape[2];
  const int64_t first_row = static_cast<int64_t>($KV_ROWS) * allocated;
  const int64_t k_words = first_row * ROW_WORDS + q * KW;
  const int64_t k_groups = first_row * GROUPS + (q * KCHUNK) / GROUP;
  const int64_t v_words = first_row * ROW_WORDS + g * VW;
  const int64_t v_groups = first_row * GROUPS + (g * VCHUNK) / GROUP;

  uint32_t qb[NH * STEPS * 2];
  mma_query_fragments<AffineKPerm<BITS>, NH, D>(
      queries + static_cast<int64_t>(block.first_q_head) * D, HEADS, scale[0] * 1.4426950408889634f, lane_id, qb);

  float m[NH * 2];
  float l[NH * 2];
  float o[DT * NH * 4];
#pragma unroll
  for (int i = 0; i < NH * 2; ++i) {
    m[i] = BT_NEG_INF;
    l[i] = 0.0f;
  }
#pragma unroll
  for (int i = 0; i < DT * NH * 4; ++i) {
    o[i] = 0.0f;
  }

  // The loads of one step: as consecutive rows from the first key's where the step lies in one
  // run of them (affine_mma_one_run), else row by row, clamped where the step runs past the
  // split's end.
#define AFFINE_MMA_FETCH_KEYS(at)                                                              \
  if ((at) + KEYS <= end && affine_mma_one_run<$PAGE, KEYS>(at)) {                             \
    affine_mma_fetch_keys<false, READ_ONLY, 0, KB, KW, KG, ROW_WORDS, GROUPS, S>(key_codes + k_words, \
        key_scales + k_groups, key_biases + k_groups, $TABLE, static_cast<int>(affine_mma_row<$PAGE>($TABLE, at)), \
        last, g, kw, ks, kb);                                                                  \
  } else {                                                                                     \
    affine_mma_fetch_keys<true, READ_ONLY, $PAGE, KB, KW, KG, ROW_WORDS, GROUPS, S>(                             \
        key_codes + k_words, key_scales + k_groups, key_biases + k_groups, $TABLE, at, last, g, kw, ks, kb); \
  }
#define AFFINE_MMA_FETCH_VALUES(at)                                                            \
  if ((at) + KEYS <= end && affine_mma_one_run<$PAGE, KEYS>(at)) {                             \
    affine_mma_fetch_values<false, READ_ONLY, 0, KB, VW, ROW_WORDS, GROUPS, S>(value_codes + v_words, \
        value_scales + v_groups, value_biases + v_groups, $TABLE, static_cast<int>(affine_mma_row<$PAGE>($TABLE, at)), \
        last, q, vw, vs, vb);                                                                  \
  } else {                                                                                     \
    affine_mma_fetch_values<true, READ_ONLY, $PAGE, KB, VW, ROW_WORDS, GROUPS, S>(                               \
        value_codes + v_words, value_scales + v_groups, value_biases + v_groups, $TABLE, at, last, q, vw, vs, vb); \
  }
  uint32_t kw[KB * 2 * KW], vw[KB * 4 * VW];
  S ks[KB * 2 * KG], kb[KB * 2 * KG], vs[KB * 4], vb[KB * 4];
  const int end = block.end;
  const int last = end - 1;
  int base = block.start + static_cast<int>(warp_id) * KEYS;
  // With PREFETCH, a step's keys are loaded during the previous step's value product and
  // its values during its own score product (one buffer each, no copies); without, both
  // at the top of the step.
  if (PREFETCH && base < end) {
    AFFINE_MMA_FETCH_KEYS(base)
  }
  for (; base < end; base += WARPS * KEYS) {  // uniform across the warp
    if (!PREFETCH) {
      AFFINE_MMA_FETCH_KEYS(base)
    }
    AFFINE_MMA_FETCH_VALUES(base)

    // Scores: Sᵀ = K Qᵀ, one 16-key block at a time.
    float s[KB * NH * 4];
#pragma unroll
    for (int b = 0; b < KB; ++b) {
#pragma unroll
      for (int i = 0; i < NH * 4; ++i) s[b * NH * 4 + i] = 0.0f;
      float s_odd[NH * 4];  // with SCORE_CHAINS == 2: the odd k16 steps' sums
#pragma unroll
      for (int i = 0; i < NH * 4; ++i) s_odd[i] = 0.0f;
      uint32_t scale2[2 * KG], bias2[2 * KG];  // keys g, g + 8: each group's (scale, scale), (bias, bias)
#pragma unroll
      for (int i = 0; i < 2 * KG; ++i) {
        const float sc = bt_to_float(ks[b * 2 * KG + i]);
        const float bi = bt_to_float(kb[b * 2 * KG + i]);
        scale2[i] = bt_pack_half2(sc, sc);
        bias2[i] = bt_pack_half2(bi, bi);
      }
#pragma unroll
      for (int w = 0; w < KW; w += UNIT) {
        const int grp = (w / UNIT * AffineUnit<BITS>::CODES) / GROUP;  // this unit's group within the lane's chunk
        uint32_t upper[PAIRS], lower[PAIRS];         // keys g and g + 8
        affine_key_pairs<BITS>(kw + (b * 2) * KW + w, scale2[grp], bias2[grp], upper);
        affine_key_pairs<BITS>(kw + (b * 2 + 1) * KW + w, scale2[KG + grp], bias2[KG + grp], lower);
#pragma unroll
        for (int h = 0; h < PAIRS / 2; ++h) {  // k16 step: pairs 2 h, 2 h + 1 of the unit
          const int step = w / UNIT * (PAIRS / 2) + h;
          const uint32_t a[4] = {upper[2 * h], lower[2 * h], upper[2 * h + 1], lower[2 * h + 1]};
#pragma unroll
          for (int nh = 0; nh < NH; ++nh) {
            BT_PRIVATE float* sums = SCORE_CHAINS == 2 && step % 2 ? s_odd + nh * 4 : s + (b * NH + nh) * 4;
            bt_mma_16x8x16(sums, a, qb + (nh * STEPS + step) * 2, lane_id);
          }
        }
      }
      if (SCORE_CHAINS == 2) {
#pragma unroll
        for (int i = 0; i < NH * 4; ++i) s[b * NH * 4 + i] += s_odd[i];
      }
      if (base + KEYS > end) {  // only a split's last step (uniform) reaches past its end
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          if (base + 16 * b + g + 8 * r >= end) {
#pragma unroll
            for (int nh = 0; nh < NH; ++nh) {
              s[(b * NH + nh) * 4 + 2 * r] = BT_NEG_INF;
              s[(b * NH + nh) * 4 + 2 * r + 1] = BT_NEG_INF;
            }
          }
        }
      }
    }

    if (PREFETCH && base + WARPS * KEYS < end) {  // the next step's keys, during this step's softmax and values
      AFFINE_MMA_FETCH_KEYS(base + WARPS * KEYS)
    }
    uint32_t pb[KB * NH * 2];
    mma_softmax<NH, KB, DT>(s, m, l, o, pb, lane_id);

    // Values: Oᵀ += Vᵀ Pᵀ. Dimension tile t holds dims 2t, 2t+1 of the lane's chunk.
#pragma unroll
    for (int b = 0; b < KB; ++b) {
      const uint32_t s01 = bt_pack_half2(bt_to_float(vs[b * 4]), bt_to_float(vs[b * 4 + 1]));
      const uint32_t b01 = bt_pack_half2(bt_to_float(vb[b * 4]), bt_to_float(vb[b * 4 + 1]));
      const uint32_t s89 = bt_pack_half2(bt_to_float(vs[b * 4 + 2]), bt_to_float(vs[b * 4 + 3]));
      const uint32_t b89 = bt_pack_half2(bt_to_float(vb[b * 4 + 2]), bt_to_float(vb[b * 4 + 3]));
#pragma unroll
      for (int w = 0; w < VW; w += UNIT) {
        uint32_t near[VPAIRS], far[VPAIRS];  // keys (2q, 2q+1) and (2q+8, 2q+9), per dim of the unit
        affine_value_pairs<BITS>(vw + (b * 4) * VW + w, vw + (b * 4 + 1) * VW + w, s01, b01, near);
        affine_value_pairs<BITS>(vw + (b * 4 + 2) * VW + w, vw + (b * 4 + 3) * VW + w, s89, b89, far);
#pragma unroll
        for (int u = 0; u < VPAIRS / 2; ++u) {
          const int t = w / UNIT * (VPAIRS / 2) + u;
          const uint32_t a[4] = {near[2 * u], near[2 * u + 1], far[2 * u], far[2 * u + 1]};
#pragma unroll
          for (int nh = 0; nh < NH; ++nh) {
            bt_mma_16x8x16(o + (t * NH + nh) * 4, a, pb + (b * NH + nh) * 2, lane_id);
          }
        }
      }
    }
  }

  BT_SHARED float warp_m[WARPS * HEADS];
  BT_SHARED float warp_l[WARPS * HEADS];
  BT_SHARED float warp_acc[WARPS * HEADS * D];
  mma_write_partials<HEADS, NH, D, WARPS>(
      m, l, o, lane_id, warp_id, thread_rank, block, warp_m, warp_l, warp_acc,
      partial_acc, partial_max, partial_sum);
"""
"""The partials pass of both tensor-core kernels, with open expressions (``split_k.fill``) as in
``decode``'s: ``$LIVE`` (this block's sequence's live keys), ``$KV_ROWS`` (which ``allocated``-row
run of the buffers is this block's), ``$PAGE`` (0: the cache's own rows, key ``at`` in row ``at``;
else the page size) and ``$TABLE`` (the page table and this sequence's offset into it)."""

_DENSE = {"$LIVE": "length[0]", "$KV_ROWS": "block.batch_kv_head", "$PAGE": "0", "$TABLE": "length, 0"}
"""The partials body's expressions for one cache's own buffers (the contiguous and stacked kernels)."""

_PARTIALS = Kernel(
    name="butter_affine_decode_mma_partials",
    input_names=("queries", *BUFFERS, "length", "scale"),
    output_names=("partial_acc", "partial_max", "partial_sum"),
    mma=True,
    helpers=_HELPERS,
    body=split_k.fill(_PARTIALS_BODY, _DENSE),
)

STACK_MEMBERS = """
  // The six buffers as members of a cache's two stacks (packing.STACKS): codes [2, B, H, S, W]
  // (keys, values), scales and biases [4, B, H, S, G] (key scales, key biases, value scales,
  // value biases), read in place, so a traced decode step takes no views of them.
  const int64_t codes_member = static_cast<int64_t>(codes_shape[1]) * codes_shape[2] * codes_shape[3] * codes_shape[4];
  const int64_t scales_member =
      static_cast<int64_t>(scales_biases_shape[1]) * scales_biases_shape[2] * scales_biases_shape[3] * scales_biases_shape[4];
  const auto key_codes = codes;
  const auto value_codes = codes + codes_member;
  const auto key_scales = scales_biases;
  const auto key_biases = scales_biases + scales_member;
  const auto value_scales = scales_biases + 2 * scales_member;
  const auto value_biases = scales_biases + 3 * scales_member;
  const auto key_codes_shape = &codes_shape[1];
"""
"""What the stacked kernel opens with: the six buffers' names bound to their stack members."""

_STACKED_PARTIALS = Kernel(
    name="butter_affine_stacked_decode_mma_partials",
    input_names=("queries", "codes", "scales_biases", "length", "scale"),
    output_names=("partial_acc", "partial_max", "partial_sum"),
    mma=True,
    helpers=_HELPERS,
    body=STACK_MEMBERS + split_k.fill(_PARTIALS_BODY, _DENSE),
)

_PAGED_PARTIALS = Kernel(
    name="butter_affine_paged_decode_mma_partials",
    input_names=("queries", "codes", "scales_biases", "table", "lengths", "scale"),
    output_names=("partial_acc", "partial_max", "partial_sum"),
    mma=True,
    helpers=_HELPERS,
    body=(
        STACK_MEMBERS
        + split_k.paged_preamble("key_codes")
        + split_k.fill(_PARTIALS_BODY, {"$LIVE": "lengths[sequence]", "$KV_ROWS": "block.kv_head", "$PAGE": "PAGE",
                                        "$TABLE": "table, pages"})
    ),
)


def decode_attention(
    queries: mx.array,
    key_codes: mx.array, key_scales: mx.array, key_biases: mx.array,
    value_codes: mx.array, value_scales: mx.array, value_biases: mx.array,
    *, length: int, scale: float, splits: int | None = None,
) -> mx.array:
    """Attention of one query token over the first ``length`` slots of packed K/V buffers,
    on tensor cores; arguments and result as ``decode.decode_attention`` (``supports``
    says which formats). ``splits`` forces the number of key splits (tests use it to
    make splits that see no key); by default ``split_k.num_splits`` chooses."""
    _check_args(queries, key_codes, key_scales, value_codes, length)
    return decode_attention_live(
        queries, key_codes, key_scales, key_biases, value_codes, value_scales, value_biases,
        live=kernel_params((length,), mx.int32), scale=kernel_params((scale,), mx.float32), planned_length=length,
        splits=splits,
    )


def decode_attention_live(
    queries: mx.array,
    key_codes: mx.array, key_scales: mx.array, key_biases: mx.array,
    value_codes: mx.array, value_scales: mx.array, value_biases: mx.array,
    *, live: mx.array, scale: mx.array, planned_length: int | None = None, splits: int | None = None,
) -> mx.array:
    """``decode.decode_attention_live`` (length and scale as device arrays, for a traced
    call) on tensor cores; ``splits`` forces the split count."""
    acc, maxes, sums = partials(queries, key_codes, key_scales, key_biases, value_codes, value_scales, value_biases,
                                live=live, scale=scale, planned_length=planned_length, splits=splits)
    return split_k.merge_partials(acc, maxes, sums, queries.dtype)


def decode_attention_stacks(
    queries: mx.array, codes: mx.array, scales_biases: mx.array, *, live: mx.array, scale: mx.array,
    splits: int | None = None,
) -> mx.array:
    """``decode_attention_live`` from a cache's two stacks (``packing.STACKS``: codes ``[2, B,
    n_kv_heads, S, words]``, scales and biases ``[4, B, n_kv_heads, S, groups]``) read in place, as
    a traced decode step calls it (``ops.kernel_decode``): no view of a member is taken, so the
    step's graph holds two nodes fewer per stack member than through ``decode_attention_live``.
    The splits are planned for every allocated slot."""
    _check_stacks(codes, scales_biases)
    fmt = _check_args(queries, codes[0], scales_biases[0], codes[1], codes.shape[3])
    acc, maxes, sums = _partials(_STACKED_PARTIALS, fmt, queries, [codes, scales_biases], [live, scale],
                                 codes.shape[3], splits, kv_heads=codes.shape[2])
    return split_k.merge_partials(acc, maxes, sums, queries.dtype)


def decode_attention_stacked(
    queries: mx.array,
    key_codes: mx.array, key_scales: mx.array, key_biases: mx.array,
    value_codes: mx.array, value_scales: mx.array, value_biases: mx.array,
    *, length: int, scale: float, splits: int | None = None,
) -> mx.array:
    """``decode_attention``'s arguments through ``decode_attention_stacks`` (the buffers stacked
    first, as a cache keeps them): its check's entry."""
    stacks = stack(dict(zip(BUFFERS, (key_codes, key_scales, key_biases, value_codes, value_scales, value_biases))))
    return decode_attention_stacks(queries, stacks["codes"], stacks["scales_biases"],
                                   live=kernel_params((length,), mx.int32), scale=kernel_params((scale,), mx.float32),
                                   splits=splits)  # fmt: skip


def partials(
    queries: mx.array,
    key_codes: mx.array, key_scales: mx.array, key_biases: mx.array,
    value_codes: mx.array, value_scales: mx.array, value_biases: mx.array,
    *, live: mx.array, scale: mx.array, planned_length: int | None = None, splits: int | None = None,
) -> tuple[mx.array, mx.array, mx.array]:
    """The partials kernel's output (``split_k``'s acc, max and sum) that
    ``decode_attention_live`` merges; benchmarks time it alone."""
    fmt = _check_args(queries, key_codes, key_scales, value_codes, key_codes.shape[2])
    buffers = [key_codes, key_scales, key_biases, value_codes, value_scales, value_biases]
    return _partials(_PARTIALS, fmt, queries, buffers, [live, scale], planned_length or key_codes.shape[2], splits)


def paged_decode_attention(
    queries: mx.array,
    key_codes: mx.array, key_scales: mx.array, key_biases: mx.array,
    value_codes: mx.array, value_scales: mx.array, value_biases: mx.array,
    *, table: mx.array, lengths: mx.array, page_size: int, length: int, scale: float, splits: int | None = None,
) -> mx.array:
    """``decode.paged_decode_attention``'s arguments through ``paged_decode_attention_stacks`` (the
    buffers stacked first, as paged storage keeps them): its check's entry."""
    stacks = stack(dict(zip(BUFFERS, (key_codes, key_scales, key_biases, value_codes, value_scales, value_biases))))
    return paged_decode_attention_stacks(queries, stacks["codes"], stacks["scales_biases"], table=table,
                                         lengths=lengths, page_size=page_size, length=length, scale=scale,
                                         splits=splits)  # fmt: skip


def paged_decode_attention_stacks(
    queries: mx.array, codes: mx.array, scales_biases: mx.array,
    *, table: mx.array, lengths: mx.array, page_size: int, length: int, scale: float, splits: int | None = None,
) -> mx.array:
    """``decode.paged_decode_attention`` on tensor cores: one query token per sequence over its pages
    of shared packed storage, read in place from the storage's two stacks as batched storage hands
    them (``packing.STACKS``: codes ``[2, 1, n_kv_heads, slots, words]``, scales and biases ``[4, 1,
    ...]``), so a decode step takes no view of a member; ``supports`` says which formats."""
    _check_stacks(codes, scales_biases)
    fmt = _check_paged_args(queries, codes[0], scales_biases[0], codes[1], table, lengths, page_size, length)
    extra = [table, lengths, kernel_params((scale,), mx.float32)]
    acc, maxes, sums = _partials(_PAGED_PARTIALS, fmt, queries, [codes, scales_biases], extra, length, splits,
                                 [("PAGE", page_size)], kv_heads=codes.shape[2])  # fmt: skip
    return split_k.merge_partials(acc, maxes, sums, queries.dtype)


def _check_stacks(codes: mx.array, scales_biases: mx.array) -> None:
    if codes.ndim != 5 or codes.shape[0] != 2 or scales_biases.ndim != 5 or scales_biases.shape[0] != 4:
        raise ValueError(f"codes must be a [2, B, heads, slots, words] stack and scales_biases a [4, ...] one; got "
                         f"{codes.shape} and {scales_biases.shape}")


def _partials(kernel: Kernel, fmt: PackedFormat, queries: mx.array, buffers: list[mx.array], extra: list[mx.array],
              planned: int, splits: int | None, template: list | None = None,
              kv_heads: int | None = None) -> tuple[mx.array, mx.array, mx.array]:
    """A partials kernel's launch (inputs ``queries, *buffers, *extra``), split-K planned for
    ``planned`` keys, ``template`` added to the shared one; ``kv_heads`` where ``buffers[0]`` is
    not ``[B, kv_heads, ...]`` (a stack)."""
    if not supports(fmt, queries.dtype):
        raise ValueError(f"the tensor-core decode kernel does not handle {fmt} with {queries.dtype} queries")
    batch, q_heads, _, dims = queries.shape
    launch = split_k.plan(
        batch=batch, q_heads=q_heads, kv_heads=kv_heads or buffers[0].shape[1], dims=dims, length=planned, warps=WARPS,
        max_heads=mma.max_heads(dims, WARPS), min_keys=MIN_KEYS_PER_SPLIT, target_blocks=TARGET_BLOCKS,
        splits=splits,
    )
    long_run = planned // (launch.n_splits * WARPS) >= LONG_RUN
    key_blocks = LONG_KEY_BLOCKS.get(fmt.bits, KEY_BLOCKS) if long_run else KEY_BLOCKS
    acc, maxes, sums = kernel(
        inputs=[queries, *buffers, *extra],
        template=[("T", queries.dtype), ("S", fmt.dtype), ("D", dims), ("BITS", fmt.bits),
                  ("GROUP", fmt.group_size), ("HEADS", launch.heads), ("WARPS", WARPS),
                  ("KB", key_blocks), ("PREFETCH", PREFETCH), ("SCORE_CHAINS", SCORE_CHAINS[fmt.bits]),
                  ("READ_ONLY", READ_ONLY_LOADS), *(template or [])],
        grid=launch.grid,
        threadgroup=launch.threadgroup,
        output_shapes=launch.output_shapes,
        output_dtypes=launch.output_dtypes,
    )
    return acc, maxes, sums


def supports(fmt: PackedFormat, queries_dtype: mx.Dtype) -> bool:
    """Whether this kernel handles this format and query dtype (6-bit codes: head_dim 128 or
    256, so that a lane's eighth of a value row is whole 3-word units)."""
    return (fmt.bits in SUPPORTED_BITS and fmt.head_dim in SUPPORTED_HEAD_DIMS
            and (fmt.bits != 6 or fmt.head_dim % 128 == 0)
            and queries_dtype in SUPPORTED_DTYPES and fmt.dtype in SUPPORTED_DTYPES)


def available() -> bool:
    """Whether the kernel can run here."""
    return _PARTIALS.available()
