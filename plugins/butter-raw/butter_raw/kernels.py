"""The raw cache's GPU kernels, each with the pure-mx reference it must match.

- ``sdpa_decode``: attention of one query token over the live prefix of a K/V buffer,
  flash-decoding split-K in two kernels: partials per split, then the merge kernel of
  ``butter_core.kernels.split_k`` (which also supplies the in-kernel merges). It ties
  MLX's ``mx.fast.scaled_dot_product_attention`` at short contexts and is slower at long
  ones, where MLX's kernel reads the live slice ``k[:, :, :L]`` without copying it, so
  the raw cache decodes through MLX's SDPA.
- ``kv_cache_update``: a K/V buffer with rows written at an offset. An MLX custom
  kernel cannot write into its input, so this kernel copies the whole buffer; MLX's
  slice assignment ``buf[..., a:b, :] = rows`` updates in place when the buffer is
  donated, far cheaper than this kernel or any full copy. Slice assignment is the append
  path; keep no other reference to the old buffer (not even a view) or MLX copies it
  whole.
- ``paged_sdpa_decode``: the same attention for many sequences at once over shared paged
  storage (``butter_core.batched``): each sequence's keys read in place through its page
  table, up to its own length; the partials pass is ``sdpa_decode``'s, with the slot of a
  key and the live length per sequence (``split_k.fill``).

``bench/gpu_raw_kernels.py`` measures the first two (docs/benchmarks.md,
"plugins/butter-raw/butter_raw/kernels.py"). ``KERNEL_CHECKS`` lists all three for the
conformance suite.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from butter_core.plugin_api import (
    Kernel,
    KernelCheck,
    attention_inputs,
    kernel_params,
    gather_pages,
    live_mask,
    paged_attention_inputs,
    reference_attention,
    split_k,
)

SUPPORTED_DTYPES = (mx.float32, mx.float16, mx.bfloat16)
SUPPORTED_HEAD_DIMS = (64, 128)

_WARPS = 4
"""Warps per threadgroup in the partials pass."""
_TILE = 4
"""Keys each lane's stream takes per step (one rescale of its running sums per step)."""
_MAX_HEADS_PER_BLOCK = 8
"""Query heads one threadgroup serves; its registers grow with this."""
_MIN_KEYS_PER_SPLIT = 64
_TARGET_BLOCKS = 512
"""The split count aims at this many threadgroups in the partials pass on an H200
(``split_k.plan`` scales it to the device's multiprocessors)."""

_PARTIALS_BODY = """
  // One threadgroup: one (batch, kv head, group of HEADS query heads) and one split of
  // the live keys. A key's D values are spread over LANES_PER_KEY lanes, VEC per lane,
  // so a warp holds KEYS_PER_WARP keys at once; each lane's stream takes TILE keys per
  // step and rescales its running sums once per step. Scores are in log2 units (the
  // query is pre-scaled by scale * log2(e)).
  constexpr int VEC = 8;
  constexpr int LANES_PER_KEY = D / VEC;
  constexpr int KEYS_PER_WARP = BT_WARP_SIZE / LANES_PER_KEY;
  constexpr int KEYS_PER_STEP = WARPS * KEYS_PER_WARP * TILE;

  const SplitKBlock block = splitk_block<HEADS>(
      block_idx, grid_dim, queries_shape[1], keys_shape[1], $LIVE);
  const int start = block.start;
  const int end = block.end;
  const int allocated = keys_shape[2];
  const int sub = lane_id % LANES_PER_KEY;
  const int slot = lane_id / LANES_PER_KEY;
  const int64_t kv_offset = static_cast<int64_t>($KV_ROWS) * allocated * D + sub * VEC;

  const float q_scale = scale[0] * 1.4426950408889634f;
  float q[HEADS][VEC];
  float m[HEADS];
  float l[HEADS];
  float acc[HEADS * VEC];
#pragma unroll
  for (int h = 0; h < HEADS; ++h) {
    bt_load<VEC>(queries + static_cast<int64_t>(block.first_q_head + h) * D + sub * VEC, q[h]);
    m[h] = BT_NEG_INF;
    l[h] = 0.0f;
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      q[h][i] *= q_scale;
      acc[h * VEC + i] = 0.0f;
    }
  }

  // The loop bound is uniform across the warp, so every lane reaches the shuffles.
  for (int base = start + static_cast<int>(warp_id) * KEYS_PER_WARP * TILE; base < end;
       base += KEYS_PER_STEP) {
    float k[TILE][VEC];
    float v[TILE][VEC];
    bool valid[TILE];
#pragma unroll
    for (int t = 0; t < TILE; ++t) {
      const int key = base + t * KEYS_PER_WARP + slot;
      valid[t] = key < end;
      const int at = valid[t] ? key : base;
      const int64_t row = kv_offset + $SLOT * D;
      bt_load<VEC>(keys + row, k[t]);
      bt_load<VEC>(values + row, v[t]);
    }
#pragma unroll
    for (int h = 0; h < HEADS; ++h) {
      float s[TILE];
      float m_new = m[h];
#pragma unroll
      for (int t = 0; t < TILE; ++t) {
        s[t] = 0.0f;
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          s[t] += q[h][i] * k[t][i];
        }
        s[t] = bt_group_sum<LANES_PER_KEY>(s[t]);
        m_new = valid[t] && s[t] > m_new ? s[t] : m_new;
      }
      if (m_new != BT_NEG_INF) {  // this stream has seen a key
        const float correction = bt_exp2(m[h] - m_new);
        l[h] *= correction;
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          acc[h * VEC + i] *= correction;
        }
#pragma unroll
        for (int t = 0; t < TILE; ++t) {
          const float p = valid[t] ? bt_exp2(s[t] - m_new) : 0.0f;
          l[h] += p;
#pragma unroll
          for (int i = 0; i < VEC; ++i) {
            acc[h * VEC + i] += p * v[t][i];
          }
        }
        m[h] = m_new;
      }
    }
  }

  // Merge the KEYS_PER_WARP streams of each warp, then the warps, and write the partials.
  splitk_merge_lanes<HEADS, VEC, LANES_PER_KEY>(m, l, acc);
  BT_SHARED float warp_m[WARPS * HEADS];
  BT_SHARED float warp_l[WARPS * HEADS];
  BT_SHARED float warp_acc[WARPS * HEADS * D];
  splitk_write_partials<HEADS, VEC, D, WARPS>(
      m, l, acc, sub, slot, warp_id, thread_rank, block,
      warp_m, warp_l, warp_acc, partial_acc, partial_max, partial_sum);
"""
"""The partials pass of both decode kernels, with three expressions left open (``split_k.fill``):
``$LIVE`` (the live keys of this block's sequence), ``$KV_ROWS`` (which ``allocated``-slot run of
the K/V arrays is this block's: its batch and KV head) and ``$SLOT`` (the slot holding key ``at``)."""


_SDPA_PARTIALS = Kernel(
    name="butter_raw_sdpa_decode_partials",
    input_names=("queries", "keys", "values", "length", "scale"),
    output_names=("partial_acc", "partial_max", "partial_sum"),
    helpers=split_k.SPLIT_K_HELPERS,
    body=split_k.fill(_PARTIALS_BODY, {"$LIVE": "length[0]", "$KV_ROWS": "block.batch_kv_head",
                                       "$SLOT": "static_cast<int64_t>(at)"}),
)

_PAGED_PARTIALS = Kernel(
    name="butter_raw_paged_decode_partials",
    input_names=("queries", "keys", "values", "table", "lengths", "scale"),
    output_names=("partial_acc", "partial_max", "partial_sum"),
    helpers=split_k.SPLIT_K_HELPERS,
    body=(
        split_k.paged_preamble("keys")
        + split_k.fill(_PARTIALS_BODY, {"$LIVE": "lengths[sequence]", "$KV_ROWS": "block.kv_head", "$SLOT": split_k.PAGED_SLOT})
    ),
)

_KV_CACHE_UPDATE = Kernel(
    name="butter_raw_kv_cache_update",
    input_names=("cache", "rows", "offset"),
    output_names=("out",),
    body="""
  // One threadgroup per (slot, batch * head), one thread per dimension of the row:
  // the new row where rows land, the old buffer's row elsewhere.
  const int dims = cache_shape[3];
  const int allocated = cache_shape[2];
  const int n_rows = rows_shape[2];
  const int position = block_idx.x;
  const int64_t batch_head = block_idx.y;
  const int d = thread_idx.x;
  const int r = position - offset[0];
  const int64_t index = (batch_head * allocated + position) * dims + d;
  out[index] = (r >= 0 && r < n_rows) ? rows[(batch_head * n_rows + r) * dims + d]
                                      : cache[index];
""",
)


def _check_attention_args(
    queries: mx.array, keys: mx.array, values: mx.array, length: int
) -> None:
    if queries.ndim != 4 or queries.shape[2] != 1:
        raise ValueError(f"queries must be [B, n_q_heads, 1, D], got {queries.shape}")
    if keys.shape != values.shape or keys.ndim != 4:
        raise ValueError(f"keys and values must be equal [B, n_kv_heads, S, D], got "
                         f"{keys.shape} and {values.shape}")
    batch, q_heads, _, dims = queries.shape
    if keys.shape[0] != batch or keys.shape[3] != dims or q_heads % keys.shape[1]:
        raise ValueError(f"queries {queries.shape} do not match keys {keys.shape}")
    if not 0 < length <= keys.shape[2]:
        raise ValueError(f"length {length} outside 1..{keys.shape[2]}")


def _decode(partials_kernel: Kernel, queries: mx.array, keys: mx.array, values: mx.array, extra: list[mx.array],
            length: int, template: list | None = None) -> mx.array:
    """Either decode kernel's launch: its partials pass (inputs ``queries, keys, values, *extra``,
    split-K over ``length`` keys, ``template`` added to the shared one), then the merge."""
    dtype = queries.dtype
    if dtype not in SUPPORTED_DTYPES or keys.dtype != dtype or values.dtype != dtype:
        raise ValueError(f"dtypes must match and be one of {SUPPORTED_DTYPES}")
    batch, q_heads, _, dims = queries.shape
    if dims not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head dim {dims} not in {SUPPORTED_HEAD_DIMS}")
    launch = split_k.plan(
        batch=batch, q_heads=q_heads, kv_heads=keys.shape[1], dims=dims, length=length,
        warps=_WARPS, max_heads=_MAX_HEADS_PER_BLOCK, min_keys=_MIN_KEYS_PER_SPLIT,
        target_blocks=_TARGET_BLOCKS,
    )  # fmt: skip
    partials = partials_kernel(
        inputs=[queries, keys, values, *extra],
        template=[("T", dtype), ("D", dims), ("HEADS", launch.heads), ("WARPS", _WARPS), ("TILE", _TILE),
                  *(template or [])],  # fmt: skip
        grid=launch.grid,
        threadgroup=launch.threadgroup,
        output_shapes=launch.output_shapes,
        output_dtypes=launch.output_dtypes,
    )
    return split_k.merge_partials(*partials, dtype)


def sdpa_decode(
    queries: mx.array, keys: mx.array, values: mx.array, length: int, scale: float
) -> mx.array:
    """Attention of one query token over the first ``length`` slots of K/V buffers.

    ``queries`` is ``[B, n_q_heads, 1, D]``; ``keys`` and ``values`` are whole
    ``[B, n_kv_heads, S_alloc, D]`` buffers (no slice is taken); ``n_q_heads`` is a
    multiple of ``n_kv_heads`` (GQA). D is 64 or 128, all three share a float dtype,
    and rows must be 16-byte aligned (true of any buffer MLX allocates). Softmax and
    accumulation run in float32; the result has the queries' dtype and shape.
    """
    _check_attention_args(queries, keys, values, length)
    extra = [kernel_params((length,), mx.int32), kernel_params((scale,), mx.float32)]
    return _decode(_SDPA_PARTIALS, queries, keys, values, extra, length)


def sdpa_decode_reference(
    queries: mx.array, keys: mx.array, values: mx.array, length: int, scale: float
) -> mx.array:
    """``softmax(q kᵀ · scale) v`` over the live slice in float32, with plain mx ops."""
    _check_attention_args(queries, keys, values, length)
    batch, q_heads, _, dims = queries.shape
    kv_heads = keys.shape[1]
    q = queries.astype(mx.float32).reshape(batch, kv_heads, q_heads // kv_heads, dims)
    k = keys[:, :, :length].astype(mx.float32)
    v = values[:, :, :length].astype(mx.float32)
    weights = mx.softmax((q @ k.transpose(0, 1, 3, 2)) * scale, axis=-1)
    return (weights @ v).reshape(queries.shape).astype(queries.dtype)


def _check_paged_args(queries, keys, values, table, lengths, page_size, length) -> None:
    if queries.ndim != 4 or queries.shape[2] != 1:
        raise ValueError(f"queries must be [B, n_q_heads, 1, D], got {queries.shape}")
    if keys.shape != values.shape or keys.ndim != 4 or keys.shape[0] != 1:
        raise ValueError(f"keys and values must be equal paged storage [1, n_kv_heads, slots, D], got "
                         f"{keys.shape} and {values.shape}")
    batch, q_heads, _, dims = queries.shape
    if keys.shape[3] != dims or q_heads % keys.shape[1]:
        raise ValueError(f"queries {queries.shape} do not match keys {keys.shape}")
    if table.ndim != 2 or table.shape[0] != batch or lengths.shape != (batch,):
        raise ValueError(f"table must be [B, pages] and lengths [B] for B = {batch}; got {table.shape}, {lengths.shape}")
    if table.dtype != mx.int32 or lengths.dtype != mx.int32:
        raise ValueError("table and lengths must be int32")
    if not 0 < length <= table.shape[1] * page_size:
        raise ValueError(f"length {length} outside 1..{table.shape[1] * page_size} (the table's pages)")


def paged_sdpa_decode(
    queries: mx.array, keys: mx.array, values: mx.array, table: mx.array, lengths: mx.array,
    page_size: int, length: int, scale: float,
) -> mx.array:  # fmt: skip
    """Attention of one query token per sequence over its pages of shared K/V storage.

    ``queries`` ``[B, n_q_heads, 1, D]``; ``keys``/``values`` the paged storage ``[1, n_kv_heads,
    slots, D]`` of every sequence (read in place, never gathered); sequence ``b``'s position
    ``p`` is in slot ``table[b, p // page_size] * page_size + p % page_size`` and it attends to
    its first ``lengths[b]`` positions (``lengths`` on the device: ``length`` is their maximum,
    known to the host, which sizes the splits). Otherwise as ``sdpa_decode``.
    """
    _check_paged_args(queries, keys, values, table, lengths, page_size, length)
    extra = [table, lengths, kernel_params((scale,), mx.float32)]
    return _decode(_PAGED_PARTIALS, queries, keys, values, extra, length, [("PAGE", page_size)])


def paged_sdpa_decode_reference(
    queries: mx.array, keys: mx.array, values: mx.array, table: mx.array, lengths: mx.array,
    page_size: int, length: int, scale: float,
) -> mx.array:  # fmt: skip
    """The same through plain mx ops: each sequence's pages gathered, its live keys masked, float32."""
    _check_paged_args(queries, keys, values, table, lengths, page_size, length)
    k, v = (gather_pages(x, table, page_size, length) for x in (keys, values))
    return reference_attention(queries, k, v, scale=scale, mask=live_mask(lengths, length)).astype(queries.dtype)


def kv_cache_update(cache: mx.array, rows: mx.array, offset: int) -> mx.array:
    """A copy of ``cache`` ``[B, H, S, D]`` with ``rows`` ``[B, H, n, D]`` written at
    positions ``offset .. offset + n``. Reads and writes the whole buffer."""
    _check_update_args(cache, rows, offset)
    batch, heads, allocated, dims = cache.shape
    (out,) = _KV_CACHE_UPDATE(
        inputs=[cache, rows, kernel_params((offset,), mx.int32)],
        template=[("T", cache.dtype)],
        grid=(allocated * dims, batch * heads, 1),
        threadgroup=(dims, 1, 1),
        output_shapes=[cache.shape],
        output_dtypes=[cache.dtype],
    )
    return out


def kv_cache_update_reference(cache: mx.array, rows: mx.array, offset: int) -> mx.array:
    """The same result through ``mx.slice_update`` (what slice assignment lowers to)."""
    _check_update_args(cache, rows, offset)
    return mx.slice_update(cache, rows, mx.array([offset]), axes=(2,))


def _check_update_args(cache: mx.array, rows: mx.array, offset: int) -> None:
    if cache.ndim != 4 or rows.ndim != 4 or cache.dtype != rows.dtype:
        raise ValueError("cache and rows must be [B, H, S, D] and [B, H, n, D] of one dtype")
    if rows.shape[:2] != cache.shape[:2] or rows.shape[3] != cache.shape[3]:
        raise ValueError(f"rows {rows.shape} do not fit cache {cache.shape}")
    if not 0 <= offset <= cache.shape[2] - rows.shape[2]:
        raise ValueError(f"rows at {offset} overrun {cache.shape[2]} slots")


def make_attention_inputs(
    seed: int,
    *,
    batch: int = 1,
    q_heads: int = 8,
    kv_heads: int = 2,
    head_dim: int = 128,
    allocated: int = 256,
    length: int = 200,
    dtype: mx.Dtype = mx.bfloat16,
) -> dict:
    """Random ``sdpa_decode`` arguments (``attention_inputs``: 1e3 in the slots past ``length``)."""
    inputs = attention_inputs(seed, batch=batch, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim,
                              allocated=allocated, length=length)  # fmt: skip
    return {**inputs, **{name: mx.array(inputs[name]).astype(dtype) for name in ("queries", "keys", "values")}}


def make_update_inputs(
    seed: int,
    *,
    batch: int = 1,
    heads: int = 2,
    head_dim: int = 128,
    allocated: int = 64,
    n_rows: int = 1,
    offset: int = 17,
    dtype: mx.Dtype = mx.bfloat16,
) -> dict:
    """Random ``kv_cache_update`` arguments."""
    rng = np.random.default_rng(seed)
    cache = rng.standard_normal((batch, heads, allocated, head_dim), dtype=np.float32)
    rows = rng.standard_normal((batch, heads, n_rows, head_dim), dtype=np.float32)
    return {
        "cache": mx.array(cache).astype(dtype),
        "rows": mx.array(rows).astype(dtype),
        "offset": offset,
    }


def make_paged_inputs(
    seed: int,
    *,
    batch: int = 3,
    q_heads: int = 8,
    kv_heads: int = 2,
    head_dim: int = 128,
    page_size: int = 16,
    lengths: tuple[int, ...] = (1, 40, 33),
    dtype: mx.Dtype = mx.bfloat16,
) -> dict:
    """Random ``paged_sdpa_decode`` arguments (``paged_attention_inputs``: pages scattered through the
    storage, 1e3 in every slot outside a live position)."""
    inputs = paged_attention_inputs(seed, lengths=lengths[:batch], page_size=page_size, q_heads=q_heads,
                                    kv_heads=kv_heads, head_dim=head_dim)  # fmt: skip
    return {**inputs, **{name: mx.array(inputs[name]).astype(dtype) for name in ("queries", "keys", "values")}}


KERNEL_CHECKS: tuple[KernelCheck, ...] = (
    KernelCheck(
        name="sdpa_decode",
        kernel=sdpa_decode,
        reference=sdpa_decode_reference,
        make_inputs=make_attention_inputs,
        cases=(
            {"length": 1, "allocated": 16},
            {"length": 200, "allocated": 256, "dtype": mx.float16},
            {"length": 257, "allocated": 300, "dtype": mx.float32, "head_dim": 64},
            {"length": 1000, "allocated": 1024, "q_heads": 8, "kv_heads": 8, "head_dim": 64},
            {"length": 5000, "allocated": 6000, "q_heads": 32, "kv_heads": 8, "batch": 2},
            {"length": 777, "allocated": 800, "q_heads": 24, "kv_heads": 2,
             "dtype": mx.float16},
            {"length": 3000, "allocated": 4096, "q_heads": 28, "kv_heads": 4,
             "dtype": mx.float32},
        ),
    ),
    KernelCheck(
        name="paged_sdpa_decode",
        kernel=paged_sdpa_decode,
        reference=paged_sdpa_decode_reference,
        make_inputs=make_paged_inputs,
        cases=(
            {},
            {"lengths": (5,), "batch": 1, "dtype": mx.float16, "head_dim": 64},
            {"lengths": (700, 64, 1, 333), "batch": 4, "page_size": 64, "q_heads": 16, "kv_heads": 4,
             "dtype": mx.float32},
            {"lengths": (1200, 17), "batch": 2, "page_size": 32, "q_heads": 32, "kv_heads": 8},
        ),
    ),
    KernelCheck(
        name="kv_cache_update",
        kernel=kv_cache_update,
        reference=kv_cache_update_reference,
        make_inputs=make_update_inputs,
        cases=(
            {"n_rows": 1, "offset": 0},
            {"n_rows": 1, "offset": 63, "dtype": mx.float16},
            {"n_rows": 9, "offset": 20, "heads": 8, "batch": 2, "dtype": mx.float32},
        ),
    ),
)
"""Every raw-cache kernel with its reference, for the conformance suite."""
