"""Split-K (flash-decoding) pieces that every fused single-query attention kernel shares.

A fused decode kernel splits the live keys among threadgroups; each keeps, per query
head, an online-softmax state (running max ``m`` in log2 units, sum ``l`` of
``exp2(score - m)``, accumulator ``acc`` of ``exp2(score - m) * value``), and writes it
as a partial. A second, small kernel merges the partials of every split. What is the
same for every such kernel lives here, scheme-independent; a scheme's partials kernel
only reads its keys and values its own way.

The launch (``plan``): threadgroups of ``warps * 32`` threads; ``grid.y`` is the split,
``grid.x`` runs over (batch, KV head, chunk of ``HEADS`` query heads of that KV head's
GQA group), chunk fastest. ``HEADS`` and ``WARPS`` must be template arguments of the
partials kernel.

``SPLIT_K_HELPERS`` is kernel-header source in butter's dialect (append it to the
kernel's ``helpers``):

- ``splitk_block<HEADS>(block_idx, grid_dim, q_heads, kv_heads, live)``: the
  ``SplitKBlock`` this threadgroup owns: ``batch_kv_head`` (the K/V rows' flat (batch,
  KV head) index), ``kv_head``, ``first_q_head`` (flat (batch, query head) index of the
  first of its ``HEADS`` query heads), ``split`` and ``n_splits``, and its keys
  ``[start, end)`` (possibly empty).
- ``splitk_merge_lanes<HEADS, VEC, LANES>(m, l, acc)``: merges the states of the lanes
  of a warp that hold the same ``VEC`` dimensions (lanes ``LANES`` apart, one key slot
  each: lane = slot * LANES + sub). ``m``, ``l`` are ``[HEADS]``, ``acc`` is
  ``[HEADS * VEC]``, per lane; afterwards every lane holds its warp's merged state.
- ``splitk_write_partials<HEADS, VEC, D, WARPS>(m, l, acc, sub, slot, warp_id,
  thread_rank, block, warp_m, warp_l, warp_acc, partial_acc, partial_max,
  partial_sum)``: every thread of the threadgroup calls it once, after
  ``splitk_merge_lanes``; it merges the warps through three shared arrays the kernel
  declares (``BT_SHARED float warp_m[WARPS * HEADS], warp_l[WARPS * HEADS],
  warp_acc[WARPS * HEADS * D]``) and writes the split's partials.
- ``splitk_merge_warps<HEADS, D, WARPS>(thread_rank, block, warp_m, warp_l, warp_acc,
  partial_acc, partial_max, partial_sum)``: the second half of ``splitk_write_partials``,
  for kernels that store their warps' states to those shared arrays their own way (the
  tensor-core kernels of ``butter_core.kernels.mma``): every thread calls it after a
  barrier that follows the stores.

``MERGE_HELPERS`` (device functions, dialect only): the merge of one (batch, query
head)'s split partials by a threadgroup. ``splitk_fold`` (over ``splitk_fold_state``,
one state into another) folds a part's splits; ``splitk_combine`` merges the parts:
``splitk_store_part``, a barrier, ``splitk_parts_state``. The merge kernel calls
``splitk_fold`` and ``splitk_combine``; a scheme's own merge may call the pieces (AURA's
folds in full-precision rows too, and after one barrier its warp 0 merges the parts for
its own lanes' dimensions with ``splitk_parts_state``). A merge is a short chain of
dependent loads, on the critical path of every decode step (a layer's attention waits
for it), so the chain is kept short: the threadgroup runs ``parts`` threads per dimension
(``merge_threads``), each folding its share of the splits into an online-softmax state,
its loads independent of each other, and the parts' states meet in shared memory
(faster than one thread per dimension summing every split). A thread loads its splits
``SPLITK_FOLD_BATCH`` at a time before folding them, and the fold selects rather than
branches (behind a branch the compiler sank the loads, two latencies a split).

Partials are ``partial_acc [B, Hq, splits, D]``, ``partial_max`` and ``partial_sum``
``[B, Hq, splits]``, all float32 (``SplitKLaunch.output_shapes``/``output_dtypes``); a
split that saw no key has ``m = -inf, l = 0``. ``merge_partials`` merges them into the
attention output.

A one-launch merge (the last threadgroup of each head chunk merging the splits, counted
with device-wide atomics) was tried and was slower per call, because MLX fills such an
output with a separate kernel. Measurements: docs/benchmarks.md,
"butter_core/kernels/split_k.py".
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping

import attrs
import mlx.core as mx

from butter_core.kernels.backend import scaled_to_gpu
from butter_core.kernels.kernel import Kernel

SPLIT_K_HELPERS = r"""
// ---- split-K (flash-decoding), butter_core.kernels.split_k ------------------------
struct SplitKBlock {
  int batch_kv_head;  // batch * kv_heads + kv_head
  int kv_head;
  int first_q_head;   // batch * q_heads + the first of this block's HEADS query heads
  int split;
  int n_splits;
  int start;          // this split's keys: [start, end), end <= live
  int end;
};

// The sequence (batch row) a threadgroup serves: what a paged kernel needs before
// splitk_block, whose split of the live keys depends on that sequence's length.
template <int HEADS>
BT_FUNC int splitk_sequence(uint3 block_idx, int q_heads, int kv_heads) {
  return (block_idx.x / (q_heads / kv_heads / HEADS)) / kv_heads;
}

template <int HEADS>
BT_FUNC SplitKBlock splitk_block(uint3 block_idx, uint3 grid_dim, int q_heads, int kv_heads, int live) {
  const int group = q_heads / kv_heads;
  const int chunks_per_kv_head = group / HEADS;
  SplitKBlock b;
  b.n_splits = grid_dim.y;
  b.split = block_idx.y;
  const int head_chunk = block_idx.x % chunks_per_kv_head;
  b.batch_kv_head = block_idx.x / chunks_per_kv_head;
  const int batch = b.batch_kv_head / kv_heads;
  b.kv_head = b.batch_kv_head % kv_heads;
  b.first_q_head = batch * q_heads + b.kv_head * group + head_chunk * HEADS;
  const int chunk = (live + b.n_splits - 1) / b.n_splits;
  b.start = b.split * chunk;
  b.end = b.start + chunk < live ? b.start + chunk : live;
  return b;
}

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

// After a barrier that follows every warp's store of its state (m, l per head: warp_m,
// warp_l [WARPS * HEADS]; acc: warp_acc [WARPS * HEADS * D]), every thread calls this:
// it merges the warps and writes the split's partials.
template <int HEADS, int D, int WARPS>
BT_FUNC void splitk_merge_warps(
    int rank, SplitKBlock block,
    const BT_SHARED_PTR float* warp_m, const BT_SHARED_PTR float* warp_l, const BT_SHARED_PTR float* warp_acc,
    BT_GLOBAL float* partial_acc, BT_GLOBAL float* partial_max, BT_GLOBAL float* partial_sum) {
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
    const int64_t part = static_cast<int64_t>(block.first_q_head + h) * block.n_splits + block.split;
    partial_acc[part * D + d] = a;
    if (d == 0) {
      partial_max[part] = m_all;
      partial_sum[part] = l_all;
    }
  }
}

// Lanes of key slot 0 (slot == 0) hold their warp's merged state for dimensions
// [sub * VEC, (sub + 1) * VEC).
template <int HEADS, int VEC, int D, int WARPS>
BT_FUNC void splitk_write_partials(
    const BT_PRIVATE float* m, const BT_PRIVATE float* l, const BT_PRIVATE float* acc,
    int sub, int slot, int warp, int rank, SplitKBlock block,
    BT_SHARED_PTR float* warp_m, BT_SHARED_PTR float* warp_l, BT_SHARED_PTR float* warp_acc,
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
  splitk_merge_warps<HEADS, D, WARPS>(rank, block, warp_m, warp_l, warp_acc, partial_acc, partial_max, partial_sum);
}

"""

MAX_MERGE_SPLITS = 1024
"""Splits a merge takes at most (each thread loops over its share of them). Plans stay
well below (``num_splits``: some hundreds of threadgroups per launch)."""

MERGE_THREADS = 1024
"""Threads of a merge's threadgroup at most (``merge_threads``)."""

SPLITS_PER_THREAD = 4
"""Splits each thread of a merge folds, about (``merge_threads``)."""

MERGE_HELPERS = f"#define SPLITK_MERGE_THREADS {MERGE_THREADS}\n" + r"""
// ---- merging split partials, butter_core.kernels.split_k ---------------------------
// A merge of one (batch, query head) runs `parts` threads per output dimension: thread
// t of a threadgroup of dims * parts threads (split_k.merge_threads) handles dimension
// d = t % dims and folds the splits p = t / dims, p + parts, ... into one online-softmax
// state (splitk_fold), every load independent of the others; splitk_combine then merges
// the parts' states through shared memory.

// Folds one state (max ms, sum ls, accumulator as) into the state (*m, *l, *a), both
// rescaled to the larger max; a state whose max is -inf (it saw no key) adds nothing.
// Selects, not a branch: behind a branch on ms the compiler sinks the loads of ls and
// as, and a fold of loaded states waits out two memory latencies per state, not one.
BT_FUNC void splitk_fold_state(
    BT_PRIVATE float* m, BT_PRIVATE float* l, BT_PRIVATE float* a, float ms, float ls, float as) {
  const bool seen = ms != BT_NEG_INF;
  const float m_new = bt_max(ms, *m);
  const float c = *m == BT_NEG_INF ? 0.0f : bt_exp2(*m - m_new);
  const float w = seen ? bt_exp2(ms - m_new) : 0.0f;
  *l = *l * c + (seen ? w * ls : 0.0f);
  *a = *a * c + (seen ? w * as : 0.0f);
  *m = m_new;
}

// Splits a thread of a merge loads before folding any of them (splitk_fold).
#define SPLITK_FOLD_BATCH 4

// The state of splits p, p + parts, ... at dimension d: *m the largest max (-inf if none
// saw a key), *l and *a the sums and accumulators, each rescaled to it. The splits go
// SPLITK_FOLD_BATCH at a time, every load of a batch issued before the first fold, so a
// thread with at most that many splits waits out one memory latency.
template <typename Acc, typename Max, typename Sum>
BT_FUNC void splitk_fold(
    Acc partial_acc, Max partial_max, Sum partial_sum, int64_t head, int n_splits, int dims, int d, int p,
    int parts, BT_PRIVATE float* m, BT_PRIVATE float* l, BT_PRIVATE float* a) {
  float mm = BT_NEG_INF;
  float ll = 0.0f;
  float aa = 0.0f;
  for (int first = p; first < n_splits; first += SPLITK_FOLD_BATCH * parts) {
    float ms[SPLITK_FOLD_BATCH];
    float ls[SPLITK_FOLD_BATCH];
    float as[SPLITK_FOLD_BATCH];
#pragma unroll
    for (int i = 0; i < SPLITK_FOLD_BATCH; ++i) {
      const int s = first + i * parts;
      const int64_t at = head * n_splits + (s < n_splits ? s : first);  // past the last: a split already read
      ms[i] = s < n_splits ? partial_max[at] : BT_NEG_INF;
      ls[i] = partial_sum[at];
      as[i] = partial_acc[at * dims + d];
    }
#pragma unroll
    for (int i = 0; i < SPLITK_FOLD_BATCH; ++i) {
      splitk_fold_state(&mm, &ll, &aa, ms[i], ls[i], as[i]);
    }
  }
  *m = mm;
  *l = ll;
  *a = aa;
}

// Stores part p's state at dimension d for the merge of the parts (splitk_parts_state,
// after a barrier): sm and sl hold `parts` floats, sa parts * dims (shared).
BT_FUNC void splitk_store_part(
    float m, float l, float a, int d, int p, int dims,
    BT_SHARED_PTR float* sm, BT_SHARED_PTR float* sl, BT_SHARED_PTR float* sa) {
  sa[p * dims + d] = a;
  if (d == 0) {
    sm[p] = m;
    sl[p] = l;
  }
}

// The parts' stored states merged, at dimensions d0 + [0, N): *m the largest max, *l the
// sum and a[N] the accumulators rescaled to it. Any thread may ask, for any dimensions.
template <int N>
BT_FUNC void splitk_parts_state(
    int d0, int parts, int dims, const BT_SHARED_PTR float* sm, const BT_SHARED_PTR float* sl,
    const BT_SHARED_PTR float* sa, BT_PRIVATE float* m, BT_PRIVATE float* l, BT_PRIVATE float* a) {
  float mm = BT_NEG_INF;
  for (int q = 0; q < parts; ++q) {
    mm = sm[q] > mm ? sm[q] : mm;
  }
  float ll = 0.0f;
#pragma unroll
  for (int i = 0; i < N; ++i) {
    a[i] = 0.0f;
  }
  for (int q = 0; q < parts; ++q) {
    const float w = sm[q] == BT_NEG_INF ? 0.0f : bt_exp2(sm[q] - mm);
    ll += w * sl[q];
#pragma unroll
    for (int i = 0; i < N; ++i) {
      a[i] += w * sa[q * dims + d0 + i];
    }
  }
  *m = mm;
  *l = ll;
}

// Merges the states of the parts (every thread of the threadgroup calls it: it holds a
// barrier); afterwards the threads of part 0 (t < dims) hold the merged state of their
// dimension. sm and sl hold `parts` floats, sa parts * dims (shared).
BT_FUNC void splitk_combine(
    BT_PRIVATE float* m, BT_PRIVATE float* l, BT_PRIVATE float* a, int d, int p, int parts, int dims,
    BT_SHARED_PTR float* sm, BT_SHARED_PTR float* sl, BT_SHARED_PTR float* sa) {
  splitk_store_part(*m, *l, *a, d, p, dims, sm, sl, sa);
  BT_BARRIER;
  if (p == 0) {
    splitk_parts_state<1>(d, parts, dims, sm, sl, sa, m, l, a);
  }
}
"""

_MERGE = Kernel(
    name="butter_split_k_merge",
    input_names=("partial_acc", "partial_max", "partial_sum"),
    output_names=("out",),
    helpers=MERGE_HELPERS,
    body="""
  // One threadgroup per (batch, query head), parts threads per output dimension.
  const int n_splits = partial_max_shape[2];
  const int dims = partial_acc_shape[3];
  const int parts = static_cast<int>(block_dim.x) / dims;
  const int64_t head = block_idx.x;
  const int d = static_cast<int>(thread_idx.x) % dims;
  const int p = static_cast<int>(thread_idx.x) / dims;
  BT_SHARED float sm[SPLITK_MERGE_THREADS / BT_WARP_SIZE];
  BT_SHARED float sl[SPLITK_MERGE_THREADS / BT_WARP_SIZE];
  BT_SHARED float sa[SPLITK_MERGE_THREADS];
  float m, l, a;
  splitk_fold(partial_acc, partial_max, partial_sum, head, n_splits, dims, d, p, parts, &m, &l, &a);
  splitk_combine(&m, &l, &a, d, p, parts, dims, sm, sl, sa);
  if (p == 0) {
    out[head * dims + d] = bt_from_float<T>(a / l);
  }
""",
)


def fill(body: str, expressions: Mapping[str, str]) -> str:
    """A kernel body with its open expressions (``$NAME``) filled in: how one partials body serves a
    cache's own buffers and batched storage's pages (each scheme's paged decode kernel). Raises
    ``ValueError`` where one is left open."""
    for name, expression in expressions.items():
        body = body.replace(name, expression)
    if "$" in body:
        raise ValueError(f"an expression is left open: {body[body.index('$'):][:20]}")
    return body


def paged_preamble(kv_buffer: str) -> str:
    """What a paged partials kernel opens with: ``sequence``, the batch row its threadgroup serves
    (``kv_buffer`` is an input in paged storage ``[1, kv heads, slots, width]``), and ``pages``, the
    offset of that sequence's row of ``table`` ``[B, pages]``, which ``PAGED_SLOT`` reads."""
    return (
        "  // Paged storage: buffers [1, kv heads, slots, width] shared by every sequence; sequence b's\n"
        "  // position p is in slot table[b, p / PAGE] * PAGE + p % PAGE, its live keys lengths[b].\n"
        f"  const int sequence = splitk_sequence<HEADS>(block_idx, queries_shape[1], {kv_buffer}_shape[1]);\n"
        "  const int64_t pages = static_cast<int64_t>(sequence) * table_shape[1];\n"
    )


PAGED_SLOT = "(static_cast<int64_t>(table[pages + at / PAGE]) * PAGE + at % PAGE)"
"""The storage slot of the sequence's key ``at`` in a paged kernel (after ``paged_preamble``)."""


def merge_threads(n_splits: int, dims: int) -> int:
    """Threads of a merge's threadgroup for ``n_splits`` splits of ``dims`` dimensions: one
    per dimension for each part, with enough parts that each thread folds about
    ``SPLITS_PER_THREAD`` splits, and at most ``MERGE_THREADS`` threads. A merge is a
    chain of dependent loads; the more threads share the splits, the shorter it is."""
    parts = max(1, min(MERGE_THREADS // dims, math.ceil(n_splits / SPLITS_PER_THREAD)))
    return dims * parts


def merge_partials(
    partial_acc: mx.array, partial_max: mx.array, partial_sum: mx.array, dtype: mx.Dtype
) -> mx.array:
    """Attention output ``[B, Hq, 1, D]`` in ``dtype`` from the partials of every split."""
    batch, q_heads, n_splits, dims = partial_acc.shape
    check_merge(n_splits, dims)
    threads = merge_threads(n_splits, dims)
    (out,) = _MERGE(
        inputs=[partial_acc, partial_max, partial_sum],
        template=[("T", dtype)],
        grid=(threads * batch * q_heads, 1, 1),
        threadgroup=(threads, 1, 1),
        output_shapes=[(batch, q_heads, 1, dims)],
        output_dtypes=[dtype],
    )
    return out


def check_merge(n_splits: int, dims: int) -> None:
    """Raise unless a merge (``MERGE_HELPERS``, threads in whole warps of dimensions) takes
    ``n_splits`` splits of ``dims`` dimensions: at most ``MAX_MERGE_SPLITS``, and whole
    warps that fit a threadgroup."""
    if not 1 <= n_splits <= MAX_MERGE_SPLITS:
        raise ValueError(f"a split-K merge takes 1 to {MAX_MERGE_SPLITS} splits; got {n_splits}")
    if dims % 32 or dims > MERGE_THREADS:
        raise ValueError(f"a split-K merge runs one thread per dimension, in whole warps of 32 and at most "
                         f"{MERGE_THREADS}; got {dims} dimensions")


@attrs.frozen
class SplitKLaunch:
    """How to launch a partials kernel: pass ``heads`` as its ``HEADS`` template argument
    and the rest as the ``Kernel`` call's arguments of the same names."""

    heads: int
    """Query heads one threadgroup serves (``HEADS``)."""
    n_splits: int
    grid: tuple[int, int, int]
    threadgroup: tuple[int, int, int]
    output_shapes: tuple[tuple[int, ...], ...]
    """``partial_acc``, ``partial_max``, ``partial_sum``."""
    output_dtypes: tuple[mx.Dtype, ...] = (mx.float32,) * 3


def plan(
    *,
    batch: int,
    q_heads: int,
    kv_heads: int,
    dims: int,
    length: int,
    warps: int,
    max_heads: int,
    min_keys: int,
    target_blocks: int,
    splits: int | None = None,
) -> SplitKLaunch:
    """The launch of a partials kernel over ``length`` live keys: ``warps`` warps per
    threadgroup (its ``WARPS``), up to ``max_heads`` query heads per threadgroup, splits
    chosen by ``num_splits`` (or ``splits``, forced). ``target_blocks`` is a count tuned
    on an H200, scaled to this GPU's multiprocessors (``backend.scaled_to_gpu``)."""
    return _plan(batch=batch, q_heads=q_heads, kv_heads=kv_heads, dims=dims, length=length, warps=warps,
                 max_heads=max_heads, min_keys=min_keys, target_blocks=scaled_to_gpu(target_blocks), splits=splits)


@functools.lru_cache(maxsize=4096)
def _plan(
    *, batch: int, q_heads: int, kv_heads: int, dims: int, length: int, warps: int, max_heads: int,
    min_keys: int, target_blocks: int, splits: int | None,
) -> SplitKLaunch:
    """``plan`` for this GPU's ``target_blocks``. Cached: a decode step asks once per layer
    with the same arguments, and the answer is an immutable ``SplitKLaunch``."""
    heads = heads_per_block(q_heads // kv_heads, max_heads)
    blocks = batch * q_heads // heads
    n_splits = splits or num_splits(length, blocks, min_keys=min_keys, target_blocks=target_blocks)
    threads = warps * 32
    return SplitKLaunch(
        heads=heads,
        n_splits=n_splits,
        grid=(threads * blocks, n_splits, 1),
        threadgroup=(threads, 1, 1),
        output_shapes=partial_shapes(batch, q_heads, n_splits, dims),
    )


def partial_shapes(batch: int, q_heads: int, n_splits: int, dims: int) -> tuple[tuple[int, ...], ...]:
    """Output shapes of a partials kernel: acc, max, sum."""
    return (batch, q_heads, n_splits, dims), (batch, q_heads, n_splits), (batch, q_heads, n_splits)


def heads_per_block(group: int, max_heads: int) -> int:
    """The largest divisor of the GQA group size (query heads per KV head) up to ``max_heads``:
    the query heads one threadgroup serves from one read of the keys and values."""
    return max(h for h in range(1, min(group, max_heads) + 1) if group % h == 0)


def num_splits(length: int, blocks_per_split: int, *, min_keys: int, target_blocks: int) -> int:
    """Splits of the live keys: enough threadgroups (``target_blocks``) to fill the GPU, but
    never fewer than ``min_keys`` keys per split. Chosen per call, never compiled in."""
    by_length = math.ceil(length / min_keys)
    by_occupancy = math.ceil(target_blocks / blocks_per_split)
    return max(1, min(by_length, by_occupancy, MAX_MERGE_SPLITS))
