"""``decode_attention``: one query token over the coded slots, without materialising K or V.

Two launches, flash-decoding style (core's ``butter_core.kernels.split_k``: its launch
plan, block assignment and lane/warp merges; AURA writes how a key and a value are read
from codes, and its own merge):

1. **partials** — on CUDA, wherever it serves the configuration, the tensor-core kernel
   of ``attention_mma.py``; otherwise (float32 queries, other bit pairs, per-group
   scales, Metal) the SIMT kernel here: one threadgroup per (batch, KV head,
   group of ``HEADS`` query heads) and per split of the live slots. The block rotates
   its queries once (signs, then Walsh–Hadamard butterflies in shared memory) and
   pre-scales them by ``scale * log2(e)``. A key's ``D`` coordinates are spread over
   ``LANES`` lanes of ``VEC`` coordinates each; a lane reads its slice of the key's code
   words, looks each code up in the codebook (kept in shared memory) and accumulates
   ``q · level`` per query head, times the key's scale; the lanes of a key sum by
   shuffles. Values are accumulated the same way, in the rotated domain:
   ``acc += p * scale_v * level``.
   Slots kept in full precision (sinks, recent) are skipped here. Each split writes its
   running max, sum and accumulator (online softmax, scores in log2 units) through
   ``splitk_merge_lanes``/``splitk_write_partials``.
2. **merge** — one threadgroup of ``split_k.MERGE_THREADS`` threads per (batch, query
   head), ``D`` per part: issues every load that waits on no other first (the rows'
   values, the query and the keys of the rows its warp scores, its share of the
   splits), scores the full-precision rows (original domain, original query; a warp per
   row), folds each part's share of the splits and of the rows into two online-softmax
   states (``split_k``'s ``MERGE_HELPERS``), combines the parts; then one warp rotates
   the coded accumulator back once (butterflies in registers and shuffles, then signs:
   four barriers in all, where butterflies in shared memory took two per stage), adds
   the rows' and writes the output in the queries' dtype. Core's generic
   ``merge_partials`` cannot serve here: it has no full-precision rows and no rotation.

Register budget per lane: ``HEADS * VEC`` query values and as many accumulators
(128 floats for HEADS 4, VEC 16).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence

import mlx.core as mx

from butter_core.plugin_api import (
    Kernel,
    StepCall,
    compile_by_shape,
    gpu_backend,
    kernel_params,
    split_k,
    tensor_cores_available,
)

from butter_aura.codec import Codec
from butter_aura.kernels import attention_mma
from butter_aura.kernels.source import DENSE, HELPERS, PAGED, PAGED_PREAMBLE
from butter_aura.layout import FullPrecisionBudget
from butter_aura.rotation import TracedRotation
from butter_aura.stored import StoredLayer, held_range

LANES = 8
"""Lanes that share one key (each holds D / LANES coordinates)."""
WARPS = 4
"""Warps per threadgroup of the partials pass."""
TILE = 4
"""Keys each lane's stream takes per step (one softmax rescale per step)."""
MAX_HEADS_PER_BLOCK = 4
"""Query heads one partials threadgroup serves; its registers grow with this."""
MIN_KEYS_PER_SPLIT = 128
TARGET_BLOCKS = 528
"""The split count aims at this many partials threadgroups on an H200 (4 per multiprocessor;
``split_k.plan`` scales it to the device's multiprocessors)."""

_PARTIALS_BODY = """
  // Template: T (query dtype), S (scale dtype), D, KB/VB (bits), KG/VG (scale groups),
  // HEADS, LANES, WARPS, TILE. params: [live, sinks, ring, recent_lo, recent_hi].
  constexpr int VEC = D / LANES;
  constexpr int KEYS_PER_WARP = BT_WARP_SIZE / LANES;
  constexpr int KEYS_PER_STEP = WARPS * KEYS_PER_WARP * TILE;
  constexpr int THREADS = WARPS * BT_WARP_SIZE;
  constexpr int KW = (D * KB + 31) / 32;
  constexpr int VW = (D * VB + 31) / 32;
  constexpr int PER = (HEADS * D + THREADS - 1) / THREADS;

  const AuraSlotParams slot_params = aura_slot_params(params + $PARAMS_AT);
  const SplitKBlock block =
      splitk_block<HEADS>(block_idx, grid_dim, queries_shape[1], key_codes_shape[1], slot_params.live);
  const int allocated = key_codes_shape[2];
  const int sub = lane_id % LANES;
  const int slot = lane_id / LANES;

  // The codebooks, and this block's queries rotated once (signs, butterflies) and
  // pre-scaled so that scores come out in log2 units.
  BT_SHARED float k_levels[1 << KB];
  BT_SHARED float v_levels[1 << VB];
  BT_SHARED float q_rot[HEADS * D];
  for (int i = thread_rank; i < (1 << KB); i += THREADS) {
    k_levels[i] = key_levels[i];
  }
  for (int i = thread_rank; i < (1 << VB); i += THREADS) {
    v_levels[i] = value_levels[i];
  }
  for (int e = thread_rank; e < HEADS * D; e += THREADS) {
    q_rot[e] = bt_to_float(queries[static_cast<int64_t>(block.first_q_head) * D + e]) * signs[block.kv_head * D + e % D];
  }
  BT_BARRIER;
  aura_fwht_shared<PER>(q_rot, HEADS * D, D, THREADS, static_cast<int>(thread_rank));
  const float q_scale = scale[0] * 1.4426950408889634f / bt_sqrt(static_cast<float>(D));
  float q[HEADS * VEC];
  float m[HEADS];
  float l[HEADS];
  float acc[HEADS * VEC];
  for (int h = 0; h < HEADS; ++h) {
    m[h] = BT_NEG_INF;
    l[h] = 0.0f;
    for (int i = 0; i < VEC; ++i) {
      q[h * VEC + i] = q_rot[h * D + sub * VEC + i] * q_scale;
      acc[h * VEC + i] = 0.0f;
    }
  }

  const int64_t rows = static_cast<int64_t>($KV_ROWS) * allocated;
  // The loop bound is uniform across the warp, so every lane reaches the shuffles.
  for (int base = block.start + static_cast<int>(warp_id) * KEYS_PER_WARP * TILE; base < block.end;
       base += KEYS_PER_STEP) {
    float s[TILE * HEADS];
    float v_scale[TILE];
    bool valid[TILE];
    int64_t row[TILE];
    for (int t = 0; t < TILE; ++t) {
      const int key = base + t * KEYS_PER_WARP + slot;
      valid[t] = aura_coded(slot_params, recent_slots + $RECENT_AT, key, block.end);
      const int at = key < block.end ? key : base;
      row[t] = rows + $SLOT;
      const auto words = key_codes + row[t] * KW;
      float partial[HEADS];
      for (int h = 0; h < HEADS; ++h) {
        partial[h] = 0.0f;
      }
      for (int i = 0; i < VEC; ++i) {
        const float level = k_levels[aura_code(words, sub * VEC + i, KB)];
        for (int h = 0; h < HEADS; ++h) {
          partial[h] += q[h * VEC + i] * level;
        }
      }
      const float k_scale = bt_to_float(key_scales[row[t] * (D / KG) + (sub * VEC) / KG]);
      v_scale[t] = bt_to_float(value_scales[row[t] * (D / VG) + (sub * VEC) / VG]);
      for (int h = 0; h < HEADS; ++h) {
        s[t * HEADS + h] = bt_group_sum<LANES>(partial[h] * k_scale);
      }
    }
    float p[TILE * HEADS];
    for (int h = 0; h < HEADS; ++h) {
      float m_new = m[h];
      for (int t = 0; t < TILE; ++t) {
        m_new = valid[t] && s[t * HEADS + h] > m_new ? s[t * HEADS + h] : m_new;
      }
      for (int t = 0; t < TILE; ++t) {
        p[t * HEADS + h] = valid[t] ? bt_exp2(s[t * HEADS + h] - m_new) : 0.0f;
      }
      if (m_new != BT_NEG_INF) {  // this stream has seen a key
        const float correction = bt_exp2(m[h] - m_new);
        l[h] *= correction;
        for (int i = 0; i < VEC; ++i) {
          acc[h * VEC + i] *= correction;
        }
        for (int t = 0; t < TILE; ++t) {
          l[h] += p[t * HEADS + h];
        }
        m[h] = m_new;
      }
    }
    // Values in the rotated domain: acc += p * value_scale * level.
    for (int t = 0; t < TILE; ++t) {
      const auto words = value_codes + row[t] * VW;
      float w[HEADS];
      for (int h = 0; h < HEADS; ++h) {
        w[h] = p[t * HEADS + h] * v_scale[t];
      }
      for (int i = 0; i < VEC; ++i) {
        const float level = v_levels[aura_code(words, sub * VEC + i, VB)];
        for (int h = 0; h < HEADS; ++h) {
          acc[h * VEC + i] += w[h] * level;
        }
      }
    }
  }

  BT_SHARED float warp_m[WARPS * HEADS];
  BT_SHARED float warp_l[WARPS * HEADS];
  BT_SHARED float warp_acc[WARPS * HEADS * D];
  splitk_merge_lanes<HEADS, VEC, LANES>(m, l, acc);
  splitk_write_partials<HEADS, VEC, D, WARPS>(
      m, l, acc, sub, slot, warp_id, thread_rank, block, warp_m, warp_l, warp_acc,
      partial_acc, partial_max, partial_sum);
"""
"""The partials pass of both decode kernels, with its sequence's expressions left open: ``$PARAMS_AT``
(where its ``params`` start), ``$RECENT_AT`` (where its ``recent_slots`` start), ``$KV_ROWS`` (which
``allocated``-slot run of the code arrays is this block's) and ``$SLOT`` (the slot holding key ``at``)."""

_MERGE_BODY = """
  // Template: T (query dtype), F (full-precision row dtype), D, ROWS (full-precision
  // rows). One threadgroup of SPLITK_MERGE_THREADS threads per (batch, query head):
  // thread t handles dimension d = t % D of part p = t / D. params: [live, ...]; the
  // sinks are the rows the recent ring does not hold (from shapes, so the ring's slots
  // load with everything else, not after params).
  constexpr int PARTS = SPLITK_MERGE_THREADS / D;
  constexpr int WARPS_HERE = SPLITK_MERGE_THREADS / BT_WARP_SIZE;
  constexpr int ROWS_PER_PART = (ROWS + PARTS - 1) / PARTS;
  constexpr int ROWS_PER_WARP = (ROWS + WARPS_HERE - 1) / WARPS_HERE;
  constexpr int LANE_DIMS = D / BT_WARP_SIZE;  // of the query, and of the output (warp 0)
  const int n_splits = partial_max_shape[2];
  const int q_heads = queries_shape[1];
  const int kv_heads = fp_keys_shape[1];
  const int64_t head = block_idx.x;
  const int sequence = static_cast<int>(head / q_heads);  // its batch row
  const int kv_head = static_cast<int>(head % q_heads) / (q_heads / kv_heads);
  const int64_t fp_base = $FP_BASE;  // row r of this head: fp_base + r * fp_stride
  const int64_t fp_stride = $FP_STRIDE;
$TOKEN_ROW
  const int t = static_cast<int>(thread_idx.x);
  const int d = t % D;
  const int p = t / D;

  BT_SHARED float fp_score[ROWS > 0 ? ROWS : 1];
  // The parts' states: the coded part's at [0, PARTS) (accumulators [0, PARTS * D)), the
  // rows' after them.
  BT_SHARED float part_m[2 * PARTS];
  BT_SHARED float part_l[2 * PARTS];
  BT_SHARED float part_a[2 * SPLITK_MERGE_THREADS];

  // Every load that waits on no other goes out first: the step's parameters, warp 0's
  // signs, this part's rows' values (rows p, p + PARTS, ...; every row lies
  // in the buffer, the unused ones are not added), and the query and keys of the rows
  // this warp scores (rows w, w + WARPS_HERE, ...).
  const int live = params[$PARAMS_AT];
  const int sinks = ROWS - $RING;
  const float q_scale = scale[0] * 1.4426950408889634f;
  float sign[LANE_DIMS];
#pragma unroll
  for (int i = 0; i < LANE_DIMS; ++i) {
    sign[i] = warp_id == 0 ? signs[kv_head * D + lane_id * LANE_DIMS + i] : 0.0f;
  }
  float v[ROWS_PER_PART > 0 ? ROWS_PER_PART : 1];
#pragma unroll
  for (int k = 0; k < ROWS_PER_PART; ++k) {
    const int r = p + k * PARTS;
    v[k] = r < ROWS ? AURA_FP_VALUE(r, d) : 0.0f;
  }
  float q[LANE_DIMS];
  float keys[ROWS_PER_WARP > 0 ? ROWS_PER_WARP * LANE_DIMS : 1];
#pragma unroll
  for (int i = 0; i < LANE_DIMS; ++i) {
    q[i] = bt_to_float(queries[head * D + lane_id + i * BT_WARP_SIZE]);
  }
#pragma unroll
  for (int k = 0; k < ROWS_PER_WARP; ++k) {
    const int r = static_cast<int>(warp_id) + k * WARPS_HERE;
#pragma unroll
    for (int i = 0; i < LANE_DIMS; ++i) {
      keys[k * LANE_DIMS + i] = r < ROWS ? AURA_FP_KEY(r, lane_id + i * BT_WARP_SIZE) : 0.0f;
    }
  }
  // The coded part: this part's share of the splits (rotated domain).
  float m, l, a;
  splitk_fold(partial_acc, partial_max, partial_sum, head, n_splits, D, d, p, PARTS, &m, &l, &a);
  // The rows' scores (original domain, original query).
#pragma unroll
  for (int k = 0; k < ROWS_PER_WARP; ++k) {
    const int r = static_cast<int>(warp_id) + k * WARPS_HERE;
    float part = 0.0f;
#pragma unroll
    for (int i = 0; i < LANE_DIMS; ++i) {
      part += q[i] * keys[k * LANE_DIMS + i];
    }
    const float sum = bt_warp_sum(part);
    if (r < ROWS && lane_id == 0) {
      const int held = r < sinks ? r : recent_slots[$RECENT_AT + r - sinks];
      const bool used = r < sinks ? r < live : (held >= 0 && held < live);
      fp_score[r] = used ? sum * q_scale : BT_NEG_INF;
    }
  }
  BT_BARRIER;
  // The full-precision part: this part's rows (original domain).
  float fm = BT_NEG_INF;
  float fl = 0.0f;
  float fa = 0.0f;
#pragma unroll
  for (int k = 0; k < ROWS_PER_PART; ++k) {
    const int r = p + k * PARTS;
    splitk_fold_state(&fm, &fl, &fa, r < ROWS ? fp_score[r] : BT_NEG_INF, 1.0f, v[k]);
  }
  splitk_store_part(m, l, a, d, p, D, part_m, part_l, part_a);
  splitk_store_part(fm, fl, fa, d, p, D, part_m + PARTS, part_l + PARTS, part_a + PARTS * D);
  BT_BARRIER;
  // Warp 0 merges the parts for its lanes' dimensions (lane i: i * LANE_DIMS + [0,
  // LANE_DIMS)), rotates the coded part back (butterflies in registers, 1/sqrt(D), signs),
  // adds the rows' and writes the output: one barrier after the parts' stores, where a
  // merge of the parts per dimension and a hand-over to warp 0 took three.
  if (warp_id == 0) {
    const int first = static_cast<int>(lane_id) * LANE_DIMS;
    float x[LANE_DIMS];
    float rows[LANE_DIMS];
    splitk_parts_state<LANE_DIMS>(first, PARTS, D, part_m, part_l, part_a, &m, &l, x);
    splitk_parts_state<LANE_DIMS>(first, PARTS, D, part_m + PARTS, part_l + PARTS, part_a + PARTS * D, &fm, &fl,
                                  rows);
    aura_fwht_warp<LANE_DIMS>(x, static_cast<int>(lane_id));
#pragma unroll
    for (int i = 0; i < LANE_DIMS; ++i) {
      float mi = m;
      float li = l;
      float xi = x[i] / bt_sqrt(static_cast<float>(D)) * sign[i];
      splitk_fold_state(&mi, &li, &xi, fm, fl, rows[i]);
      out[head * D + first + i] = bt_from_float<T>(xi / li);
    }
  }
$TOKEN_WRITE
"""
"""The merge of both decode kernels, with its sequence's expressions left open: ``$PARAMS_AT``,
``$RECENT_AT`` and ``$RING`` (its ring's length), where a head's full-precision rows lie: row ``r``
at ``$FP_BASE + r * $FP_STRIDE``, and how they are read (``READ_ROWS``, ``WRITE_TOKEN``)."""

READ_ROWS = {
    "$TOKEN_ROW": """#define AURA_FP_KEY(r, x) bt_to_float(fp_keys[fp_base + (r) * fp_stride + (x)])
#define AURA_FP_VALUE(r, x) bt_to_float(fp_values[fp_base + (r) * fp_stride + (x)])""",
    "$TOKEN_WRITE": "",
}
"""The merge reads the full-precision rows as they are."""

WRITE_TOKEN = {
    "$TOKEN_ROW": """  // This step's token goes to row write_row (params' eighth element): read from new_keys/new_values
  // ([B, kv_heads, 1, D]), rounded to the rows' dtype F as the row keeps it.
  const int write_row = params[7];
  const int64_t token_base = (static_cast<int64_t>(sequence) * kv_heads + kv_head) * D;
#define AURA_FP_KEY(r, x) ((r) == write_row ? bt_to_float(bt_from_float<F>(bt_to_float(new_keys[token_base + (x)]))) \\
                                            : bt_to_float(fp_keys[fp_base + (r) * fp_stride + (x)]))
#define AURA_FP_VALUE(r, x) ((r) == write_row ? bt_to_float(bt_from_float<F>(bt_to_float(new_values[token_base + (x)]))) \\
                                              : bt_to_float(fp_values[fp_base + (r) * fp_stride + (x)]))""",
    "$TOKEN_WRITE": """  // The written rows: every threadgroup copies its share of them, the token's row from the token
  // (MLX gives a kernel's outputs fresh memory, so the rows are copied whole: 2 x ROWS x D
  // elements per KV head, where two scatters would cost a decode step two more operations).
  {
    const int64_t total = static_cast<int64_t>(fp_keys_shape[0]) * kv_heads * ROWS * D;
    const int64_t stride = static_cast<int64_t>(queries_shape[0]) * q_heads * SPLITK_MERGE_THREADS;
    for (int64_t i = head * SPLITK_MERGE_THREADS + t; i < total; i += stride) {
      const bool token = static_cast<int>((i / D) % ROWS) == write_row;
      const int64_t at = i / (static_cast<int64_t>(ROWS) * D) * D + i % D;
      fp_keys_out[i] = token ? bt_from_float<F>(bt_to_float(new_keys[at])) : fp_keys[i];
      fp_values_out[i] = token ? bt_from_float<F>(bt_to_float(new_values[at])) : fp_values[i];
    }
  }""",
}
"""The merge of a decode step (``decode_step_attention``): the step's token written into row ``params[7]``
of copies of the full-precision rows (outputs ``fp_keys_out``, ``fp_values_out``) and read from there."""



_PARTIALS = Kernel(
    name="butter_aura_decode_partials",
    input_names=(
        "queries", "signs", "key_codes", "key_scales", "value_codes", "value_scales",
        "key_levels", "value_levels", "recent_slots", "params", "scale",
    ),
    output_names=("partial_acc", "partial_max", "partial_sum"),
    helpers=split_k.SPLIT_K_HELPERS + HELPERS,
    body=split_k.fill(_PARTIALS_BODY, DENSE),
)

_MERGE = Kernel(
    name="butter_aura_decode_merge",
    input_names=(
        "partial_acc", "partial_max", "partial_sum", "queries", "signs",
        "fp_keys", "fp_values", "recent_slots", "params", "scale",
    ),
    output_names=("out",),
    helpers=split_k.MERGE_HELPERS + HELPERS,
    body=split_k.fill(_MERGE_BODY, DENSE | READ_ROWS),
)

_MERGE_WRITING = Kernel(
    name="butter_aura_decode_merge_writing",
    input_names=(
        "partial_acc", "partial_max", "partial_sum", "queries", "signs",
        "fp_keys", "fp_values", "recent_slots", "params", "scale", "new_keys", "new_values",
    ),
    output_names=("out", "fp_keys_out", "fp_values_out"),
    helpers=split_k.MERGE_HELPERS + HELPERS,
    body=split_k.fill(_MERGE_BODY, DENSE | WRITE_TOKEN),
)

_PAGED_PARTIALS = Kernel(
    name="butter_aura_paged_decode_partials",
    input_names=(
        "queries", "signs", "key_codes", "key_scales", "value_codes", "value_scales",
        "key_levels", "value_levels", "recent_slots", "params", "scale", "table",
    ),
    output_names=("partial_acc", "partial_max", "partial_sum"),
    helpers=split_k.SPLIT_K_HELPERS + HELPERS,
    body=PAGED_PREAMBLE + split_k.fill(_PARTIALS_BODY, PAGED),
)

_PAGED_MERGE = Kernel(
    name="butter_aura_paged_decode_merge",
    input_names=(
        "partial_acc", "partial_max", "partial_sum", "queries", "signs",
        "fp_keys", "fp_values", "recent_slots", "params", "scale", "sequence_rows",
    ),
    output_names=("out",),
    helpers=split_k.MERGE_HELPERS + HELPERS,
    body=split_k.fill(_MERGE_BODY, PAGED | READ_ROWS),
)

SUPPORTED_HEAD_DIMS = (64, 128)


def decode_attention(
    queries: mx.array,
    stored: StoredLayer,
    scale: float,
    *,
    method: str | None = None,
    splits: int | None = None,
    **tunables,
) -> mx.array:
    """``reference.decode_attention`` on the GPU.

    ``method``: ``"mma"`` (tensor-core partials, ``attention_mma``; CUDA, the configurations
    ``attention_mma.serves``) or ``"simt"`` (this module's partials kernel); None picks
    ``"mma"`` wherever it serves and the GPU has the instructions (``tensor_cores_available``:
    CUDA compute capability 8.0 or newer). ``splits`` forces the split count (tests); ``tunables``
    are the chosen partials kernel's (``lanes``/``warps``/``tile`` here, ``warps``/``blocks``/
    ``min_keys`` for MMA) for benchmarks.
    """
    _check_decode(queries, stored)
    return decode_attention_live(queries, stored, live_params(stored), kernel_params((scale,), mx.float32),
                                 method=method, splits=splits, **tunables)


def live_params(stored: StoredLayer) -> mx.array:
    """What the kernels read of a layer's state when they run, as one int32 array
    (``source.AuraSlotParams``): the live length, sinks, the recent ring's period, the
    smallest and largest slot the ring holds, and where ring rows start and stop repeating."""
    return slot_params(stored.length, stored.budget, *stored.recent_range())


def slot_params(length: int, budget: FullPrecisionBudget, lo: int, hi: int, row: int | None = None) -> mx.array:
    """``live_params`` of a layer of ``length`` live slots whose ring holds slots ``[lo, hi]``; with
    ``row``, eighth, the full-precision row a decode step's token is written into
    (``decode_step_attention``): one input where two would cost each layer's call more."""
    sinks, recent, base, tail = budget.params()
    written = () if row is None else (row,)
    return kernel_params((length, sinks, recent, lo, hi, base, tail, *written), mx.int32)


def _check_decode(queries: mx.array, stored: StoredLayer) -> None:
    batch, q_heads, tokens, dims = queries.shape
    kv_heads, length = stored.key_codes.shape[1], stored.length
    if tokens != 1 or q_heads % kv_heads or length == 0:
        raise ValueError(f"decode attention takes one query token over >= 1 slot; got {queries.shape}, length {length}")
    if dims not in SUPPORTED_HEAD_DIMS or stored.rotation.permutation is not None:
        raise ValueError(f"the attention kernels serve head_dim {SUPPORTED_HEAD_DIMS}; got {dims}")


def decode_attention_live(
    queries: mx.array,
    stored: StoredLayer,
    params: mx.array,
    scale_array: mx.array,
    *,
    method: str | None = None,
    splits: int | None = None,
    token: tuple[mx.array, mx.array] | None = None,
    **tunables,
) -> mx.array | tuple[mx.array, mx.array, mx.array]:
    """``decode_attention`` with what changes from step to step as device arrays: ``params``
    (``live_params``) and the scale (float32, one element). The splits are planned for
    ``stored.length`` keys, which need not be the live length (``traced_decode_attention``
    plans for every allocated slot); nothing else of the call depends on the step.

    With ``token`` (keys and values ``[B, kv_heads, 1, D]``; ``params`` then has an eighth element,
    the row: ``slot_params``), ``decode_step_attention``: the token written into that full-precision
    row first; returns the output and the written ``fp_keys`` and ``fp_values``."""
    method = _method(method, queries, stored)
    if method == "mma":
        partials = attention_mma.partials(queries, stored, params, scale_array, splits=splits, **tunables)
    elif method == "simt":
        partials = _simt_partials(queries, stored, params, scale_array, splits=splits, **tunables)
    if token is None:
        return _merge(_MERGE, partials, queries, stored, params, scale_array, [], stored.fp_keys.shape[2])
    return _merge(_MERGE_WRITING, partials, queries, stored, params, scale_array, list(token), stored.fp_keys.shape[2])


def decode_step_attention(queries: mx.array, keys: mx.array, values: mx.array, row: int, stored: StoredLayer,
                          scale: float, **options) -> tuple[mx.array, mx.array, mx.array]:  # fmt: skip
    """A decode step's token written into full-precision row ``row`` (``stored.fp_keys``, ``stored.fp_values``
    hold the rows before it; ``stored.recent_slots`` says which slot each ring row holds, the token's
    among them), then ``decode_attention`` over the result, the write done by the merge kernel
    (``WRITE_TOKEN``) rather than by two scatters before it. Returns the output and the written
    ``fp_keys`` and ``fp_values``. ``options``: ``decode_attention``'s ``method`` and ``splits``."""
    _check_decode(queries, stored)
    params = slot_params(stored.length, stored.budget, *stored.recent_range(), row)
    return decode_attention_live(queries, stored, params, kernel_params((scale,), mx.float32), token=(keys, values),
                                 **options)  # fmt: skip


def _merge(kernel: Kernel, partials: list[mx.array], queries: mx.array, stored, params: mx.array, scale: mx.array,
           extra: list[mx.array], rows: int) -> mx.array | tuple[mx.array, mx.array, mx.array]:
    """Either merge kernel's launch (``stored``: a ``StoredLayer`` or a ``paged.PagedStored``), or the
    writing merge's (``_MERGE_WRITING``: also the written full-precision rows)."""
    batch, q_heads, _, dims = queries.shape
    split_k.check_merge(partials[1].shape[2], dims)
    threads = split_k.MERGE_THREADS
    writes = kernel is _MERGE_WRITING
    fp = [stored.fp_keys, stored.fp_values] if writes else []
    outputs = kernel(
        inputs=[*partials, queries, stored.rotation.signs, stored.fp_keys, stored.fp_values, stored.recent_slots,
                params, scale, *extra],
        template=[("T", queries.dtype), ("F", stored.fp_keys.dtype), ("D", dims), ("ROWS", rows)],
        grid=(threads * batch * q_heads, 1, 1),
        threadgroup=(threads, 1, 1),
        output_shapes=[queries.shape, *(a.shape for a in fp)],
        output_dtypes=[queries.dtype, *(a.dtype for a in fp)],
    )
    return tuple(outputs) if writes else outputs[0]


def _method(method: str | None, queries: mx.array, stored) -> str:
    """The partials kernel a call takes: ``method`` checked, or where None ``"mma"`` wherever the
    tensor-core kernel serves and the GPU has the instructions, else ``"simt"``."""
    if method is None:
        return ("mma" if gpu_backend() == "cuda" and tensor_cores_available() and attention_mma.serves(queries, stored)
                else "simt")
    if method == "mma" and not attention_mma.serves(queries, stored):
        raise ValueError("the tensor-core kernel does not serve this configuration (attention_mma.serves)")
    if method not in ("mma", "simt"):
        raise ValueError(f"method is 'mma', 'simt' or None; got {method!r}")
    return method


def paged_decode_attention_live(queries: mx.array, paged, params: mx.array, scale: mx.array, *,
                                method: str | None = None, splits: int | None = None) -> mx.array:
    """One query token per sequence over batched storage (``paged.PagedStored``: each sequence's codes
    read in place through its page table, its full-precision rows and recent ring its own), by a
    partials kernel (``method`` as ``decode_attention_live`` chooses it) and the merge:
    ``decode_attention_live`` with ``params`` ``[B, 7]``, one row per sequence
    (``paged.PagedStored.params``); ``splits`` forces the tensor-core kernel's split count (tests)."""
    if _method(method, queries, paged) == "mma":
        partials = attention_mma.partials(queries, paged, params, scale, splits=splits, table=paged.table,
                                          page_size=paged.page_size)  # fmt: skip
    else:
        partials = _simt_partials(queries, paged, params, scale, kernel=_PAGED_PARTIALS, extra=[paged.table],
                                  template=[("PAGE", paged.page_size)])  # fmt: skip
    return _merge(_PAGED_MERGE, partials, queries, paged, params, scale, [paged.sequence_rows], paged.budget.rows)


def traced_decode_attention(queries: mx.array, stored: StoredLayer, scale: float) -> mx.array:
    """``decode_attention`` as a cache calls it every step: traced by ``mx.compile`` once per
    configuration and buffer shape (``compile_by_shape``: the splits planned for every
    allocated slot, the step's length and ring range in ``live_params``) and replayed. A
    decode step on the GPU is host-bound, and this spares the host building two kernel
    calls per layer (butter-affine's ``ops.kernel_decode`` does the same; docs/benchmarks.md).
    On Metal (never measured: no Apple GPU here) the call is built anew, as before."""
    if not traces():
        return decode_attention(queries, stored, scale)
    _check_decode(queries, stored)
    traced = _traced(stored.key_codec.fields, stored.value_codec.fields, stored.budget)
    return traced(queries, stored.rotation.signs, stored.key_codes, stored.key_scales, stored.value_codes,
                  stored.value_scales, stored.fp_keys, stored.fp_values, stored.recent_slots, live_params(stored),
                  kernel_params((scale,), mx.float32))


def traces() -> bool:
    """Whether a cache's decode calls are traced here (``traced_decode_attention``,
    ``DecodeStep``): on CUDA."""
    return gpu_backend() == "cuda"


class DecodeStep:
    """A cache's decode step where calls are traced (``traces``), for a deferred token (its codes
    written later) bound for full-precision row ``row``: ``decode_step_attention`` (the token
    written into the full-precision rows at that row by the merge kernel, and attention over the
    result) as a ``StepCall`` (``AuraCache.step_call``), which its caller runs traced: two kernels
    a layer.

    Made once per cache, so a step hands over only what changes: no ``StoredLayer`` is made and
    nothing fixed is checked again (the cache's head size is one the kernels serve: ``ops_for``;
    one query token over >= 1 live slot: ``SlotCache.store_and_attend``). A decode step on a GPU
    is bound by the host, and this preparation ran on every layer of every step."""

    def __init__(self, key_codec: Codec, value_codec: Codec, budget: FullPrecisionBudget):
        self.budget = budget
        self._fields = key_codec.fields, value_codec.fields
        self._scale, self._function = None, None

    def __call__(self, row: int, signs: mx.array, buffers: Mapping[str, mx.array], fp: Mapping[str, mx.array],
                 recent: tuple[int, ...], length: int, scale: float,
                 take: Callable[[Sequence[mx.array]], None]) -> StepCall:  # fmt: skip
        """The step's call: its function's outputs are the attention's output and the written
        ``fp_keys`` and ``fp_values``, which ``take`` gets. ``buffers``: the slot buffers by name;
        ``recent``: the slot each ring row holds, this token's among them (it is read from its row,
        never from codes)."""
        if scale != self._scale:  # the scale is a constant of the function: one input fewer a call
            self._scale, self._function = scale, step_function(*self._fields, self.budget, scale)
        inputs = (signs, buffers["key_codes"], buffers["key_scales"], buffers["value_codes"], buffers["value_scales"],
                  fp["fp_keys"], fp["fp_values"], kernel_params(recent, mx.int32),
                  slot_params(length, self.budget, *held_range(recent), row))  # fmt: skip
        return StepCall(self._function, inputs, take)


@functools.cache
def _graph(key_fields: tuple, value_fields: tuple, budget: FullPrecisionBudget) -> Callable[..., mx.array]:
    """``decode_attention_live`` over a layer's arrays, for one pair of codecs and full-precision
    budget (named by their fields, so every layer of a model shares it); with a token's keys and
    values after the scale, writing it into the full-precision rows as it attends
    (``decode_step_attention``)."""
    key_codec, value_codec = Codec(*key_fields), Codec(*value_fields)

    def graph(queries, signs, key_codes, key_scales, value_codes, value_scales, fp_keys, fp_values, recent_slots,
              params, scale, *token):
        stored = StoredLayer(
            key_codes=key_codes, key_scales=key_scales, value_codes=value_codes, value_scales=value_scales,
            fp_keys=fp_keys, fp_values=fp_values, recent_slots=recent_slots, length=key_codes.shape[2],
            budget=budget, key_codec=key_codec, value_codec=value_codec, rotation=TracedRotation(signs),
        )
        return decode_attention_live(queries, stored, params, scale, token=token or None)

    return graph


@functools.cache
def _traced(key_fields: tuple, value_fields: tuple, budget: FullPrecisionBudget) -> Callable[..., mx.array]:
    """``_graph`` traced per shape (``traced_decode_attention``)."""
    return compile_by_shape(_graph(key_fields, value_fields, budget))


@functools.cache
def step_function(key_fields: tuple, value_fields: tuple, budget: FullPrecisionBudget,
                  scale: float) -> Callable[..., tuple[mx.array, mx.array, mx.array]]:  # fmt: skip
    """``DecodeStep``'s function, one for every layer of a model: ``(queries, keys, values, signs, key_codes,
    key_scales, value_codes, value_scales, fp_keys, fp_values, recent_slots, params)`` -> the output
    and the written ``fp_keys`` and ``fp_values``, at ``scale`` (a constant of its traces)."""
    graph = _graph(key_fields, value_fields, budget)
    scale_array = kernel_params((scale,), mx.float32)  # made here: a trace keeps what it captures

    def decode_step(queries, keys, values, *arrays):
        return graph(queries, *arrays, scale_array, keys, values)

    return decode_step


def _simt_partials(
    queries: mx.array,
    stored: StoredLayer,
    params: mx.array,
    scale: mx.array,
    *,
    lanes: int = LANES,
    warps: int = WARPS,
    tile: int = TILE,
    splits: int | None = None,
    kernel: Kernel = _PARTIALS,
    extra: list[mx.array] | None = None,
    template: list | None = None,
) -> list[mx.array]:
    """The SIMT partials pass over ``stored`` (a ``StoredLayer``, or with the paged kernel and its
    ``extra`` inputs and ``template`` values a ``paged.PagedStored``), split for ``stored.length``."""
    batch, q_heads, _, dims = queries.shape
    kv_heads = stored.key_codes.shape[1]
    kc, vc = stored.key_codec, stored.value_codec
    if min(kc.group, vc.group) < dims // lanes:
        raise ValueError(f"scale groups ({kc.group}, {vc.group}) must hold at least {dims // lanes} coordinates")
    launch = split_k.plan(batch=batch, q_heads=q_heads, kv_heads=kv_heads, dims=dims, length=stored.length,
                          warps=warps, max_heads=MAX_HEADS_PER_BLOCK, min_keys=MIN_KEYS_PER_SPLIT,
                          target_blocks=TARGET_BLOCKS)
    n_splits = launch.n_splits if splits is None else splits
    return kernel(
        inputs=[
            queries, stored.rotation.signs, stored.key_codes, stored.key_scales, stored.value_codes,
            stored.value_scales, kc.book.levels_array(), vc.book.levels_array(), stored.recent_slots, params, scale,
            *(extra or []),
        ],
        template=[
            ("T", queries.dtype), ("S", stored.key_scales.dtype), ("D", dims), ("KB", kc.bits), ("VB", vc.bits),
            ("KG", kc.group), ("VG", vc.group), ("HEADS", launch.heads), ("LANES", lanes), ("WARPS", warps),
            ("TILE", tile), *(template or []),
        ],
        grid=(launch.grid[0], n_splits, 1),
        threadgroup=launch.threadgroup,
        output_shapes=split_k.partial_shapes(batch, q_heads, n_splits, dims),
        output_dtypes=launch.output_dtypes,
    )
