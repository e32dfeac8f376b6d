"""``decode_attention``: one query token attending over packed K/V, read as codes.

Split-K flash-decoding (``butter_core.kernels.split_k``): a partials kernel over splits
of the live keys, then the shared merge kernel. The partials kernel never materialises a
dequantized key or value. Per lane, a key's ``ELEMS`` values lie in one group, so

    score = scale_k * (q . codes_k) + bias_k * sum(q)
    out   = (sum_t p_t * scale_v,t * codes_v,t) + (sum_t p_t * bias_v,t)

and each code costs two instructions to unpack (``codes.affine_unpack``) plus one FMA
per query head it serves; all arithmetic is float32 (GPU-NOTES: bf16 arithmetic gave
1e-2 errors). A threadgroup serves up to ``MAX_HEADS`` query heads of one KV head, so
K/V are read once per GQA group; each lane's stream takes ``TILE`` keys per step and,
with ``PREFETCH``, loads the next step's keys before working on the current ones. The
running softmax sums are rescaled only when the running max grows.

Supported: head_dim 64, 128 or 256; 4, 6 or 8 bits; group sizes 32, 64, 128; float32,
float16 or bfloat16 queries and scales.

It matches the float32 reference to <= 2.3e-4 (bf16). It reads fewer bytes than raw
SDPA but is slower than it at long contexts, and slower than the tensor-core kernel
(``decode_mma``), which serves 4/6/8-bit codes with float16/bfloat16 queries; this kernel
serves float32 caches and 6-bit codes at head_dim 64. It is bound by instructions, not
memory: 255 registers per thread (q and the accumulators of four query heads) leave 8
warps per multiprocessor, and every code costs an unpack plus one FMA per query head for
K and again for V. Measurements: docs/benchmarks.md,
"plugins/butter-affine/butter_affine/kernels/decode.py".
"""

from __future__ import annotations

import mlx.core as mx

from butter_core.plugin_api import (
    Kernel,
    kernel_params,
    gather_pages,
    live_mask,
    attention_inputs,
    paged_attention_inputs,
    reference_attention,
    split_k,
)

from butter_affine import codec
from butter_affine.kernels.codes import CODE_HELPERS
from butter_affine.packing import BUFFERS, PackedFormat

SUPPORTED_HEAD_DIMS = (64, 128, 256)

# Launch shape; the bench retimes each alternative (module attributes, read per call).
MAX_HEADS = 4
"""Query heads one threadgroup serves; its registers grow with this."""
ELEMS = 16
"""Values of a key each lane holds (16: a whole number of code words at 4, 6 and 8 bits)."""
WARPS = 4
TILE = {4: 4, 6: 4, 8: 2}
"""Keys each lane's stream takes per step, by code width: the most that fit in 255
registers without spilling (nvcc -Xptxas -v, sm_90a: 255/255/233 registers)."""
PREFETCH = True
"""Load the next step's keys before working on the current ones."""
MIN_KEYS_PER_SPLIT = 64
TARGET_BLOCKS = 528
"""Threadgroups the split count aims at: two waves of two per multiprocessor on an H200 (132;
``split_k.plan`` scales it to the device's multiprocessors)."""

_HELPERS = CODE_HELPERS + split_k.SPLIT_K_HELPERS + r"""
// Lane slice of TILE keys, the t-th in storage row rows[t]: code words and its group's
// scale and bias, of K and of V.
template <int TILE, int WORDS, int ROW_WORDS, int GROUPS, typename Codes, typename Scales>
BT_FUNC void affine_fetch_tile(
    Codes k_codes, Scales k_scales, Scales k_biases, Codes v_codes, Scales v_scales, Scales v_biases,
    BT_PRIVATE const int64_t* rows,
    BT_PRIVATE uint32_t* kw, BT_PRIVATE float* ks, BT_PRIVATE float* kb,
    BT_PRIVATE uint32_t* vw, BT_PRIVATE float* vs, BT_PRIVATE float* vb) {
#pragma unroll
  for (int t = 0; t < TILE; ++t) {
    const int64_t row = rows[t];
    affine_load_words<WORDS>(k_codes + row * ROW_WORDS, kw + t * WORDS);
    affine_load_words<WORDS>(v_codes + row * ROW_WORDS, vw + t * WORDS);
    ks[t] = bt_to_float(k_scales[row * GROUPS]);
    kb[t] = bt_to_float(k_biases[row * GROUPS]);
    vs[t] = bt_to_float(v_scales[row * GROUPS]);
    vb[t] = bt_to_float(v_biases[row * GROUPS]);
  }
}
"""

_ROWS = """
#pragma unroll
    for (int t = 0; t < TILE; ++t) {  // key $FIRST + t * KEYS_PER_WARP, clamped to the last live one
      const int key = $FIRST + t * KEYS_PER_WARP;
      const int at = key < end - 1 ? key : (end > 0 ? end - 1 : 0);
      rows[t] = $SLOT;
    }
"""
"""Storage rows of the TILE keys a lane's stream takes from key ``$FIRST``, into ``rows``."""

_PARTIALS_BODY = """
  // One threadgroup: one (batch, kv head, group of HEADS query heads) and one split of
  // the live keys. A key's D values are spread over LANES_PER_KEY lanes, ELEMS each,
  // so a warp holds KEYS_PER_WARP keys at once. Scores are in log2 units. q and acc
  // are in affine_unpack's shifted units (q times affine_weight; acc divided by it).
  constexpr int LANES_PER_KEY = D / ELEMS;
  constexpr int KEYS_PER_WARP = BT_WARP_SIZE / LANES_PER_KEY;
  constexpr int KEYS_PER_STEP = WARPS * KEYS_PER_WARP * TILE;
  constexpr int WORDS = ELEMS * BITS / 32;
  constexpr int ROW_WORDS = D * BITS / 32;
  constexpr int GROUPS = D / GROUP;

  const SplitKBlock block = splitk_block<HEADS>(
      block_idx, grid_dim, queries_shape[1], key_codes_shape[1], $LIVE);
  const int start = block.start;
  const int end = block.end;
  const int allocated = key_codes_shape[2];
  const int sub = lane_id % LANES_PER_KEY;
  const int slot = lane_id / LANES_PER_KEY;
  const int64_t first_row = static_cast<int64_t>($KV_ROWS) * allocated;
  const int64_t code_offset = first_row * ROW_WORDS + sub * WORDS;
  const int64_t group_offset = first_row * GROUPS + (sub * ELEMS) / GROUP;

  const float q_scale = scale[0] * 1.4426950408889634f;
  float q[HEADS * ELEMS];
  float q_sum[HEADS];
  float m[HEADS];
  float l[HEADS];
  float bias_acc[HEADS];
  float acc[HEADS * ELEMS];
#pragma unroll
  for (int h = 0; h < HEADS; ++h) {
    float q_raw[ELEMS];
    bt_load<ELEMS>(queries + static_cast<int64_t>(block.first_q_head + h) * D + sub * ELEMS, q_raw);
    q_sum[h] = 0.0f;
#pragma unroll
    for (int i = 0; i < ELEMS; ++i) {
      q_sum[h] += q_raw[i] * q_scale;
      q[h * ELEMS + i] = q_raw[i] * q_scale * affine_weight<BITS>(i);
      acc[h * ELEMS + i] = 0.0f;
    }
    m[h] = BT_NEG_INF;
    l[h] = 0.0f;
    bias_acc[h] = 0.0f;
  }

  uint32_t kw[TILE * WORDS];
  uint32_t vw[TILE * WORDS];
  float ks[TILE], kb[TILE], vs[TILE], vb[TILE];
  uint32_t next_kw[TILE * WORDS];
  uint32_t next_vw[TILE * WORDS];
  float next_ks[TILE], next_kb[TILE], next_vs[TILE], next_vb[TILE];
  int64_t rows[TILE];

  // This lane's stream: keys base + t * KEYS_PER_WARP + slot for t < TILE, then the
  // next step's. The loop bound is uniform across the warp, so every lane reaches the
  // shuffles.
  int base = start + static_cast<int>(warp_id) * KEYS_PER_WARP * TILE;
  if (PREFETCH) {
""" + _ROWS.replace("$FIRST", "(base + slot)") + """
    affine_fetch_tile<TILE, WORDS, ROW_WORDS, GROUPS>(
        key_codes + code_offset, key_scales + group_offset, key_biases + group_offset,
        value_codes + code_offset, value_scales + group_offset, value_biases + group_offset,
        rows, next_kw, next_ks, next_kb, next_vw, next_vs, next_vb);
  }
  for (; base < end; base += KEYS_PER_STEP) {
    if (PREFETCH) {
#pragma unroll
      for (int t = 0; t < TILE; ++t) {
#pragma unroll
        for (int w = 0; w < WORDS; ++w) {
          kw[t * WORDS + w] = next_kw[t * WORDS + w];
          vw[t * WORDS + w] = next_vw[t * WORDS + w];
        }
        ks[t] = next_ks[t];
        kb[t] = next_kb[t];
        vs[t] = next_vs[t];
        vb[t] = next_vb[t];
      }
    }
""" + _ROWS.replace("$FIRST", "((PREFETCH ? base + KEYS_PER_STEP : base) + slot)") + """
    affine_fetch_tile<TILE, WORDS, ROW_WORDS, GROUPS>(
        key_codes + code_offset, key_scales + group_offset, key_biases + group_offset,
        value_codes + code_offset, value_scales + group_offset, value_biases + group_offset,
        rows, PREFETCH ? next_kw : kw, PREFETCH ? next_ks : ks, PREFETCH ? next_kb : kb,
        PREFETCH ? next_vw : vw, PREFETCH ? next_vs : vs, PREFETCH ? next_vb : vb);

    bool valid[TILE];
    float s[HEADS * TILE];
#pragma unroll
    for (int t = 0; t < TILE; ++t) {
      valid[t] = base + t * KEYS_PER_WARP + slot < end;
      float codes[ELEMS];
      affine_unpack<BITS, ELEMS>(kw + t * WORDS, codes);
#pragma unroll
      for (int h = 0; h < HEADS; ++h) {
        float dot = 0.0f;
#pragma unroll
        for (int i = 0; i < ELEMS; ++i) {
          dot += q[h * ELEMS + i] * codes[i];
        }
        s[h * TILE + t] = bt_group_sum<LANES_PER_KEY>(ks[t] * dot + kb[t] * q_sum[h]);
      }
    }
#pragma unroll
    for (int h = 0; h < HEADS; ++h) {
      float m_new = m[h];
#pragma unroll
      for (int t = 0; t < TILE; ++t) {
        m_new = valid[t] && s[h * TILE + t] > m_new ? s[h * TILE + t] : m_new;
      }
      if (m_new > m[h]) {  // the running max grew: rescale (rare once a stream is warm)
        const float correction = bt_exp2(m[h] - m_new);
        l[h] *= correction;
        bias_acc[h] *= correction;
#pragma unroll
        for (int i = 0; i < ELEMS; ++i) {
          acc[h * ELEMS + i] *= correction;
        }
        m[h] = m_new;
      }
    }
#pragma unroll
    for (int t = 0; t < TILE; ++t) {
      float codes[ELEMS];
      affine_unpack<BITS, ELEMS>(vw + t * WORDS, codes);
#pragma unroll
      for (int h = 0; h < HEADS; ++h) {
        const float p = valid[t] ? bt_exp2(s[h * TILE + t] - m[h]) : 0.0f;
        l[h] += p;
        bias_acc[h] += p * vb[t];
        const float pv = p * vs[t];
#pragma unroll
        for (int i = 0; i < ELEMS; ++i) {
          acc[h * ELEMS + i] += pv * codes[i];
        }
      }
    }
  }

  // Back to plain units, biases added: each lane's ELEMS values lie in one group.
#pragma unroll
  for (int h = 0; h < HEADS; ++h) {
#pragma unroll
    for (int i = 0; i < ELEMS; ++i) {
      acc[h * ELEMS + i] = acc[h * ELEMS + i] * affine_weight<BITS>(i) + bias_acc[h];
    }
  }
  splitk_merge_lanes<HEADS, ELEMS, LANES_PER_KEY>(m, l, acc);
  BT_SHARED float warp_m[WARPS * HEADS];
  BT_SHARED float warp_l[WARPS * HEADS];
  BT_SHARED float warp_acc[WARPS * HEADS * D];
  splitk_write_partials<HEADS, ELEMS, D, WARPS>(
      m, l, acc, sub, slot, warp_id, thread_rank, block,
      warp_m, warp_l, warp_acc, partial_acc, partial_max, partial_sum);
"""
"""The partials pass of both decode kernels, with three expressions left open (``split_k.fill``), as
in butter-raw's: ``$LIVE`` (this block's sequence's live keys), ``$KV_ROWS`` (which
``allocated``-row run of the buffers is this block's: its batch and KV head) and ``$SLOT`` (the row
holding key ``at``)."""


_PARTIALS = Kernel(
    name="butter_affine_decode_partials",
    input_names=(*("queries",), *BUFFERS, "length", "scale"),
    output_names=("partial_acc", "partial_max", "partial_sum"),
    helpers=_HELPERS,
    body=split_k.fill(_PARTIALS_BODY, {"$LIVE": "length[0]", "$KV_ROWS": "block.batch_kv_head",
                                       "$SLOT": "static_cast<int64_t>(at)"}),
)

_PAGED_PARTIALS = Kernel(
    name="butter_affine_paged_decode_partials",
    input_names=(*("queries",), *BUFFERS, "table", "lengths", "scale"),
    output_names=("partial_acc", "partial_max", "partial_sum"),
    helpers=_HELPERS,
    body=(
        split_k.paged_preamble("key_codes")
        + split_k.fill(_PARTIALS_BODY, {"$LIVE": "lengths[sequence]", "$KV_ROWS": "block.kv_head", "$SLOT": split_k.PAGED_SLOT})
    ),
)


def decode_attention(
    queries: mx.array,
    key_codes: mx.array, key_scales: mx.array, key_biases: mx.array,
    value_codes: mx.array, value_scales: mx.array, value_biases: mx.array,
    *, length: int, scale: float,
) -> mx.array:
    """Attention of one query token over the first ``length`` slots of packed K/V buffers.

    ``queries`` is ``[B, n_q_heads, 1, D]``; the six buffers are a cache's whole
    ``[B, n_kv_heads, S, *]`` arrays (no slice is taken; bits and group size are read
    from their shapes). Returns ``[B, n_q_heads, 1, D]`` in the queries' dtype.
    """
    _check_args(queries, key_codes, key_scales, value_codes, length)
    return decode_attention_live(
        queries, key_codes, key_scales, key_biases, value_codes, value_scales, value_biases,
        live=kernel_params((length,), mx.int32), scale=kernel_params((scale,), mx.float32), planned_length=length,
    )


def decode_attention_live(
    queries: mx.array,
    key_codes: mx.array, key_scales: mx.array, key_biases: mx.array,
    value_codes: mx.array, value_scales: mx.array, value_biases: mx.array,
    *, live: mx.array, scale: mx.array, planned_length: int | None = None,
) -> mx.array:
    """``decode_attention`` with the live length and the scale as one-element device arrays
    (int32, float32), which the kernel reads when it runs: nothing in the call's graph
    depends on their values, so ``mx.compile`` can trace it once per buffer shape and
    replay it every decode step (``ops``). The split count is planned for
    ``planned_length`` keys (default: every allocated slot; splits past the live keys see
    none). ``live`` must lie in ``1..allocated``: it is not checked, being on the device."""
    fmt = _check_args(queries, key_codes, key_scales, value_codes, key_codes.shape[2])
    buffers = [key_codes, key_scales, key_biases, value_codes, value_scales, value_biases]
    return _decode(_PARTIALS, fmt, queries, buffers, [live, scale], planned_length or key_codes.shape[2])


def _decode(partials_kernel: Kernel, fmt: PackedFormat, queries: mx.array, buffers: list[mx.array],
            extra: list[mx.array], length: int, template: list | None = None) -> mx.array:
    """Either decode kernel's launch: its partials pass (inputs ``queries, *buffers, *extra``,
    split-K planned for ``length`` keys, ``template`` added to the shared one), then the merge."""
    batch, q_heads, _, dims = queries.shape
    launch = split_k.plan(
        batch=batch, q_heads=q_heads, kv_heads=buffers[0].shape[1], dims=dims, length=length, warps=WARPS,
        max_heads=MAX_HEADS, min_keys=MIN_KEYS_PER_SPLIT, target_blocks=TARGET_BLOCKS,
    )
    partials = partials_kernel(
        inputs=[queries, *buffers, *extra],
        template=[("T", queries.dtype), ("S", fmt.dtype), ("D", dims), ("BITS", fmt.bits),
                  ("GROUP", fmt.group_size), ("HEADS", launch.heads), ("ELEMS", ELEMS), ("WARPS", WARPS),
                  ("TILE", TILE[fmt.bits]), ("PREFETCH", PREFETCH), *(template or [])],
        grid=launch.grid,
        threadgroup=launch.threadgroup,
        output_shapes=launch.output_shapes,
        output_dtypes=launch.output_dtypes,
    )
    return split_k.merge_partials(*partials, queries.dtype)


def paged_decode_attention(
    queries: mx.array,
    key_codes: mx.array, key_scales: mx.array, key_biases: mx.array,
    value_codes: mx.array, value_scales: mx.array, value_biases: mx.array,
    *, table: mx.array, lengths: mx.array, page_size: int, length: int, scale: float,
) -> mx.array:
    """Attention of one query token per sequence over its pages of shared packed storage, the codes
    read in place (never gathered nor dequantized).

    ``queries`` ``[B, n_q_heads, 1, D]``; the six buffers the paged storage ``[1, n_kv_heads, slots,
    *]`` of every sequence (``butter_core.batched``); sequence ``b``'s position ``p`` is in slot
    ``table[b, p // page_size] * page_size + p % page_size`` and it attends to its first
    ``lengths[b]`` positions (on the device; ``length``, their maximum, sizes the splits).
    """
    buffers = [key_codes, key_scales, key_biases, value_codes, value_scales, value_biases]
    fmt = _check_paged_args(queries, key_codes, key_scales, value_codes, table, lengths, page_size, length)
    extra = [table, lengths, kernel_params((scale,), mx.float32)]
    return _decode(_PAGED_PARTIALS, fmt, queries, buffers, extra, length, [("PAGE", page_size)])


def paged_decode_attention_reference(
    queries: mx.array,
    key_codes: mx.array, key_scales: mx.array, key_biases: mx.array,
    value_codes: mx.array, value_scales: mx.array, value_biases: mx.array,
    *, table: mx.array, lengths: mx.array, page_size: int, length: int, scale: float,
) -> mx.array:
    """The same through plain mx ops: each sequence's pages gathered and dequantized, its live keys
    masked, in float32."""
    buffers = [key_codes, key_scales, key_biases, value_codes, value_scales, value_biases]
    fmt = _check_paged_args(queries, key_codes, key_scales, value_codes, table, lengths, page_size, length)
    rows = [gather_pages(x, table, page_size, length) for x in buffers]
    keys = codec.dequantize(*rows[:3], fmt.bits, mx.float32)
    values = codec.dequantize(*rows[3:], fmt.bits, mx.float32)
    return reference_attention(queries, keys, values, scale=scale, mask=live_mask(lengths, length)).astype(queries.dtype)


def decode_attention_reference(
    queries: mx.array,
    key_codes: mx.array, key_scales: mx.array, key_biases: mx.array,
    value_codes: mx.array, value_scales: mx.array, value_biases: mx.array,
    *, length: int, scale: float,
) -> mx.array:
    """``softmax(q kᵀ · scale) v`` over the dequantized live slice, in float32, with plain mx ops."""
    fmt = _check_args(queries, key_codes, key_scales, value_codes, length)
    live = [x[:, :, :length] for x in (key_codes, key_scales, key_biases, value_codes, value_scales, value_biases)]
    keys = codec.dequantize(*live[:3], fmt.bits, mx.float32)
    values = codec.dequantize(*live[3:], fmt.bits, mx.float32)
    return reference_attention(queries, keys, values, scale=scale).astype(queries.dtype)


def supports(fmt: PackedFormat, queries_dtype: mx.Dtype) -> bool:
    """Whether ``decode_attention`` handles this format and query dtype."""
    return fmt.head_dim in SUPPORTED_HEAD_DIMS and queries_dtype in (mx.float32, mx.float16, mx.bfloat16)


def available() -> bool:
    """Whether the kernel can run here."""
    return _PARTIALS.available()


def _check_paged_args(queries, key_codes, key_scales, value_codes, table, lengths, page_size, length) -> PackedFormat:
    if key_codes.ndim != 4 or key_codes.shape[0] != 1:
        raise ValueError(f"key codes must be paged storage [1, n_kv_heads, slots, words], got {key_codes.shape}")
    batch = queries.shape[0]
    if table.ndim != 2 or table.shape[0] != batch or lengths.shape != (batch,):
        raise ValueError(f"table must be [B, pages] and lengths [B] for B = {batch}; got {table.shape}, {lengths.shape}")
    if table.dtype != mx.int32 or lengths.dtype != mx.int32:
        raise ValueError("table and lengths must be int32")
    if not 0 < length <= table.shape[1] * page_size:
        raise ValueError(f"length {length} outside 1..{table.shape[1] * page_size} (the table's pages)")
    one = queries[:1]
    return _check_args(one, key_codes, key_scales, value_codes, key_codes.shape[2])


def _check_args(queries, key_codes, key_scales, value_codes, length) -> PackedFormat:
    if queries.ndim != 4 or queries.shape[2] != 1:
        raise ValueError(f"queries must be [B, n_q_heads, 1, D], got {queries.shape}")
    if key_codes.ndim != 4 or key_codes.shape != value_codes.shape:
        raise ValueError(f"key and value codes must be equal [B, n_kv_heads, S, words] arrays; got "
                         f"{key_codes.shape} and {value_codes.shape}")
    batch, q_heads, _, dims = queries.shape
    if key_codes.shape[0] != batch or q_heads % key_codes.shape[1]:
        raise ValueError(f"queries {queries.shape} do not match codes {key_codes.shape}")
    if not 0 < length <= key_codes.shape[2]:
        raise ValueError(f"length {length} outside 1..{key_codes.shape[2]}")
    fmt = PackedFormat.of(key_codes, key_scales, dims)
    if dims not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head dim {dims} not in {SUPPORTED_HEAD_DIMS}")
    return fmt


def make_inputs(
    seed: int,
    *,
    bits: int = 4,
    group_size: int = 32,
    batch: int = 1,
    q_heads: int = 8,
    kv_heads: int = 2,
    head_dim: int = 128,
    allocated: int = 256,
    length: int = 200,
    dtype: mx.Dtype = mx.bfloat16,
) -> dict:
    """Random ``decode_attention`` arguments (``attention_inputs``: the codes of +-1e3 in the slots
    past ``length``), quantized by the reference."""
    inputs = attention_inputs(seed, batch=batch, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim,
                              allocated=allocated, length=length, dead=(1e3, -1e3))  # fmt: skip
    buffers = _quantized(inputs, bits, group_size, dtype)
    return {**inputs, "queries": mx.array(inputs["queries"]).astype(dtype), **buffers}


def make_paged_inputs(
    seed: int,
    *,
    bits: int = 4,
    group_size: int = 32,
    batch: int = 3,
    q_heads: int = 8,
    kv_heads: int = 2,
    head_dim: int = 128,
    page_size: int = 16,
    lengths: tuple[int, ...] = (1, 40, 33),
    dtype: mx.Dtype = mx.bfloat16,
) -> dict:
    """Random ``paged_decode_attention`` arguments (``paged_attention_inputs``: pages scattered
    through the storage, the codes of +-1e3 in every slot outside a live position), quantized by
    the reference."""
    inputs = paged_attention_inputs(seed, lengths=lengths[:batch], page_size=page_size, q_heads=q_heads,
                                    kv_heads=kv_heads, head_dim=head_dim, dead=(1e3, -1e3))  # fmt: skip
    buffers = _quantized(inputs, bits, group_size, dtype)
    return {**inputs, "queries": mx.array(inputs["queries"]).astype(dtype), **buffers}


def _quantized(inputs: dict, bits: int, group_size: int, dtype: mx.Dtype) -> dict[str, mx.array]:
    """A check's float32 keys and values (taken out of ``inputs``) quantized by the reference, by buffer name."""
    keys, values = (mx.array(inputs.pop(name)).astype(dtype) for name in ("keys", "values"))
    return dict(zip(BUFFERS, codec.quantize(keys, bits, group_size) + codec.quantize(values, bits, group_size)))
