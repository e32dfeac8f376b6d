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

``MERGE_HELPERS`` (device functions, dialect only): ``splitk_partials_max`` and
``splitk_partials_sum``, the merge of one (batch, query head)'s split partials that the
merge kernel and a scheme's own merge (AURA's, which folds in full-precision rows) share.

Partials are ``partial_acc [B, Hq, splits, D]``, ``partial_max`` and ``partial_sum``
``[B, Hq, splits]``, all float32 (``SplitKLaunch.output_shapes``/``output_dtypes``); a
split that saw no key has ``m = -inf, l = 0``. ``merge_partials`` merges them into the
attention output.

Fused merge (opt-in: ``plan(..., fused_merge=dtype)``, ``FUSED_MERGE_HELPERS``, a kernel
built with ``Kernel(..., atomics=True)``): one launch instead of two. The partials kernel
writes its split's partials as before, then calls

- ``splitk_fused_merge<OUT_T, HEADS, D, WARPS>(rank, block, workspace, ws, last)`` (every
  thread, as the kernel's last statement; ``last`` is a ``BT_SHARED unsigned int`` the kernel
  declares): every thread fences its partial writes (``bt_fence_device``), a barrier, then
  one thread fences again, counts the threadgroup done on its (batch, KV head, head
  chunk)'s counter (``bt_atomic_add_device``) and fences again; the threadgroup that counts
  ``n_splits`` (told through ``last`` and a barrier) fences and merges every split's
  partials of its ``HEADS`` heads, with ``butter_split_k_merge``'s arithmetic (the same
  result bit for bit in the CPU emulation), and writes the output. The others return. No
  threadgroup waits for another, so it needs no co-residency; it is CUDA's
  threadFenceReduction pattern with many writers per threadgroup. The merge is out of line
  (``BT_NOINLINE``) so it does not add to the kernel's registers.
- ``splitk_workspace<OUT_T, D>(ws, rows, n_splits)``: where the partials live in the kernel's
  one output, the float32 *workspace* (``workspace_words``): the output ``[B, Hq, 1, D]`` in
  ``OUT_T`` first, then ``partial_acc``, ``partial_max``, ``partial_sum`` (each starting at a
  multiple of 16 bytes), then a *start word* and one counter per head chunk (``grid.x``
  index: one (batch, KV head, ``HEADS`` query heads); its ``n_splits`` threadgroups count on it).
  ``fused_output`` (``SplitKLaunch.finish``) views the output from it, no copy.

Counters must start from a known value, and MLX lets a kernel write only its outputs and
sets an output's starting value only through ``init_value``, which fills *every* output
(one fill kernel each, in MLX 0.32's ``CustomKernel::eval_gpu``). So the fused kernel
has exactly one output, the workspace: one fill (the partials, which are written anyway,
are filled too: ~0.84 MB at butter-affine's timed shapes, 32 heads x 50 splits x 128
dims) and one kernel, against two kernels without fusion; a second output would be a
second fill. Counters are not zero-based: a threadgroup's ticket is the counter's old
value minus the start word, which no thread writes, so it holds the fill value too;
hence ``init_value`` may be anything, and the checks' NaN poisoning
(``SplitKLaunch.init_value``) still poisons the output and the partials. Counters in a
``__device__`` global that the last threadgroup resets were rejected: MLX's CUDA graphs
run independent kernel nodes concurrently, so two calls of one kernel could share them.

On Metal the same text builds on MSL 3.2's device-scope fences and ``atomic_uint``; it has
never been compiled or run (no Apple GPU here), and there ``BT_BARRIER`` orders
threadgroup memory only, so the hand-off between a threadgroup's threads rests on each
thread's own device fence.
"""

from __future__ import annotations

import math

import attrs
import mlx.core as mx

from butter_core.kernels.kernel import Kernel, poisoning

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

FUSED_MERGE_HELPERS = r"""
// ---- split-K fused merge ("last threadgroup merges"), butter_core.kernels.split_k ----
// Needs SPLIT_K_HELPERS before it and a kernel built with atomics=True.
struct SplitKWorkspace {
  BT_GLOBAL float* partial_acc;         // [rows, n_splits, D]
  BT_GLOBAL float* partial_max;         // [rows, n_splits]
  BT_GLOBAL float* partial_sum;         // [rows, n_splits]
  BT_GLOBAL unsigned int* counters;     // [0]: the start word; [1 + c]: threadgroup chunk c's count
};

BT_FUNC int64_t splitk_round4(int64_t n) { return (n + 3) / 4 * 4; }

// rows = batch * query heads. The output [rows, D] in OUT_T starts at ws.
template <typename OUT_T, int D>
BT_FUNC SplitKWorkspace splitk_workspace(BT_GLOBAL float* ws, int rows, int n_splits) {
  const int64_t parts = static_cast<int64_t>(rows) * n_splits;
  const int64_t out_words = splitk_round4(static_cast<int64_t>(rows) * D * static_cast<int64_t>(sizeof(OUT_T)) / 4);
  SplitKWorkspace w;
  w.partial_acc = ws + out_words;
  w.partial_max = w.partial_acc + splitk_round4(parts * D);
  w.partial_sum = w.partial_max + splitk_round4(parts);
  w.counters = (BT_GLOBAL unsigned int*)(w.partial_sum + splitk_round4(parts));
  return w;
}

// The last threadgroup's merge: butter_split_k_merge's arithmetic, four dimensions of one
// head per step. Out of line: inlined, it raised the partials kernel's registers (nvcc
// 13.0, sm_90a: 168 -> 174 for affine8's tensor-core kernel, one threadgroup per
// multiprocessor fewer).
template <typename OUT_T, int HEADS, int D, int WARPS>
BT_NOINLINE void splitk_merge_splits(int rank, SplitKBlock block, SplitKWorkspace w, BT_GLOBAL float* ws) {
  BT_GLOBAL OUT_T* out = (BT_GLOBAL OUT_T*)(ws);
  for (int e = rank; e < HEADS * D / 4; e += WARPS * BT_WARP_SIZE) {
    const int64_t head = block.first_q_head + e / (D / 4);
    const int d = (e % (D / 4)) * 4;
    const int64_t first = head * block.n_splits;
    float m_all = BT_NEG_INF;
    for (int s = 0; s < block.n_splits; ++s) {
      const float ms = w.partial_max[first + s];
      m_all = ms > m_all ? ms : m_all;
    }
    float l_all = 0.0f;
    float a[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll 4
    for (int s = 0; s < block.n_splits; ++s) {
      const float ms = w.partial_max[first + s];
      const float weight = ms == BT_NEG_INF ? 0.0f : bt_exp2(ms - m_all);
      l_all += weight * w.partial_sum[first + s];
      float acc[4];
      bt_load<4>(w.partial_acc + (first + s) * D + d, acc);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        a[i] += weight * acc[i];
      }
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      out[head * D + d + i] = bt_from_float<OUT_T>(a[i] / l_all);
    }
  }
}

// Every thread of the threadgroup calls it, as the kernel's last statement, after the
// split's partials are written to w (and nothing else of the kernel is left to write).
template <typename OUT_T, int HEADS, int D, int WARPS>
BT_FUNC void splitk_fused_merge(int rank, SplitKBlock block, SplitKWorkspace w, BT_GLOBAL float* ws,
                                BT_SHARED_PTR unsigned int* last) {
  bt_fence_device();  // each thread: its partials visible device-wide before what follows
  BT_BARRIER;         // every thread of the threadgroup has written and fenced
  if (rank == 0) {
    // Release for the whole threadgroup: a fence after the barrier, before the count, is
    // the pattern PTX's memory model makes cumulative over the other threads' writes (the
    // fences above are the CUDA guide's per-thread wording of the same).
    bt_fence_device();
    // Threadgroups of one (batch, KV head, head chunk) share first_q_head / HEADS.
    const unsigned int before = bt_atomic_add_device(w.counters + 1 + block.first_q_head / HEADS, 1u) - w.counters[0];
    bt_fence_device();  // acquire: the partials of the splits counted before this one
    *last = before + 1u == static_cast<unsigned int>(block.n_splits) ? 1u : 0u;
  }
  BT_BARRIER;  // the whole threadgroup knows whether it is last
  if (*last != 0u) {
    bt_fence_device();
    splitk_merge_splits<OUT_T, HEADS, D, WARPS>(rank, block, w, ws);
  }
}
"""

MERGE_HELPERS = r"""
// ---- merging split partials, butter_core.kernels.split_k ---------------------------
// The largest running max among the n_splits partials of one (batch, query head), and
// at least floor (a merge that folds in other states passes their max).
BT_FUNC float splitk_partials_max(const BT_GLOBAL float* partial_max, int64_t head, int n_splits, float floor) {
  float m_all = floor;
  for (int s = 0; s < n_splits; ++s) {
    const float ms = partial_max[head * n_splits + s];
    m_all = ms > m_all ? ms : m_all;
  }
  return m_all;
}

// The splits' accumulators of dimension d rescaled to m_all and summed; their rescaled
// sums are added to *l_all. A split that saw no key (max -inf) contributes nothing.
BT_FUNC float splitk_partials_sum(
    const BT_GLOBAL float* partial_acc, const BT_GLOBAL float* partial_max, const BT_GLOBAL float* partial_sum,
    int64_t head, int n_splits, int dims, int d, float m_all, BT_PRIVATE float* l_all) {
  float a = 0.0f;
  for (int s = 0; s < n_splits; ++s) {
    const int64_t part = head * n_splits + s;
    const float ms = partial_max[part];
    const float weight = ms == BT_NEG_INF ? 0.0f : bt_exp2(ms - m_all);
    *l_all += weight * partial_sum[part];
    a += weight * partial_acc[part * dims + d];
  }
  return a;
}
"""

_MERGE = Kernel(
    name="butter_split_k_merge",
    input_names=("partial_acc", "partial_max", "partial_sum"),
    output_names=("out",),
    helpers=MERGE_HELPERS,
    body="""
  // One threadgroup per (batch, query head), one thread per output dimension.
  const int n_splits = partial_max_shape[2];
  const int dims = partial_acc_shape[3];
  const int64_t head = block_idx.x;
  const int d = thread_idx.x;
  const float m_all = splitk_partials_max(partial_max, head, n_splits, BT_NEG_INF);
  float l_all = 0.0f;
  const float a = splitk_partials_sum(partial_acc, partial_max, partial_sum, head, n_splits, dims, d, m_all, &l_all);
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


def workspace_words(batch: int, q_heads: int, n_splits: int, dims: int, heads: int, dtype: mx.Dtype) -> int:
    """Float32 words of a fused-merge kernel's workspace (``splitk_workspace``'s layout): the
    output ``[batch, q_heads, 1, dims]`` in ``dtype``, the partials, the start word and one
    counter per ``heads`` query heads."""
    rows = batch * q_heads
    parts = rows * n_splits
    out_words = _round4(rows * dims * dtype.size // 4)
    return out_words + _round4(parts * dims) + 2 * _round4(parts) + 1 + rows // heads


def _round4(n: int) -> int:
    return (n + 3) // 4 * 4


def fused_output(workspace: mx.array, shape: tuple[int, ...], dtype: mx.Dtype) -> mx.array:
    """The attention output ``shape`` (``[B, Hq, 1, D]``) in ``dtype`` at the start of a
    fused-merge kernel's workspace: a view of its buffer, no copy."""
    return mx.view(workspace, dtype)[: math.prod(shape)].reshape(shape)


@attrs.frozen
class SplitKLaunch:
    """How to launch a partials kernel: pass ``heads`` as its ``HEADS`` template argument
    and the rest as the ``Kernel`` call's arguments of the same names (``init_value`` too);
    ``finish`` turns its outputs into the attention output."""

    heads: int
    """Query heads one threadgroup serves (``HEADS``)."""
    n_splits: int
    grid: tuple[int, int, int]
    threadgroup: tuple[int, int, int]
    output_shapes: tuple[tuple[int, ...], ...]
    """``partial_acc``, ``partial_max``, ``partial_sum``; with ``fused_merge``, the workspace."""
    output_dtypes: tuple[mx.Dtype, ...] = (mx.float32,) * 3
    fused_merge: mx.Dtype | None = None
    """None: the kernel writes the partials and ``merge_partials`` (a second kernel) merges
    them. A dtype: the kernel merges them itself (``splitk_fused_merge``) into the output in
    this dtype, in its one output, the workspace (``workspace_words``)."""
    merged_shape: tuple[int, ...] = ()
    """The attention output's shape ``[B, Hq, 1, D]`` (used with ``fused_merge``)."""

    @property
    def init_value(self) -> float | None:
        """The ``init_value`` to launch with: none for partials; for the fused merge, 0, or NaN
        while outputs are poisoned (its counters count from the fill value, whatever it is)."""
        if self.fused_merge is None:
            return None
        return math.nan if poisoning() else 0.0

    def finish(self, outputs: list[mx.array], dtype: mx.Dtype) -> mx.array:
        """The attention output ``[B, Hq, 1, D]`` in ``dtype`` from the kernel's outputs:
        ``merge_partials``, or with ``fused_merge`` a view of the workspace."""
        if self.fused_merge is None:
            return merge_partials(*outputs, dtype)
        if dtype != self.fused_merge:
            raise ValueError(f"the kernel merged into {self.fused_merge}, not {dtype}")
        (workspace,) = outputs
        return fused_output(workspace, self.merged_shape, dtype)


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
    fused_merge: mx.Dtype | None = None,
) -> SplitKLaunch:
    """The launch of a partials kernel over ``length`` live keys: ``warps`` warps per
    threadgroup (its ``WARPS``), up to ``max_heads`` query heads per threadgroup, splits
    chosen by ``num_splits`` (or ``splits``, forced). ``fused_merge``: the output dtype of a
    kernel that merges its partials itself (``SplitKLaunch.fused_merge``)."""
    heads = heads_per_block(q_heads // kv_heads, max_heads)
    blocks = batch * q_heads // heads
    n_splits = splits or num_splits(length, blocks, min_keys=min_keys, target_blocks=target_blocks)
    threads = warps * 32
    if fused_merge is None:
        outputs: dict = dict(output_shapes=partial_shapes(batch, q_heads, n_splits, dims))
    else:
        words = workspace_words(batch, q_heads, n_splits, dims, heads, fused_merge)
        outputs = dict(output_shapes=((words,),), output_dtypes=(mx.float32,), fused_merge=fused_merge,
                       merged_shape=(batch, q_heads, 1, dims))
    return SplitKLaunch(
        heads=heads,
        n_splits=n_splits,
        grid=(threads * blocks, n_splits, 1),
        threadgroup=(threads, 1, 1),
        **outputs,
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
    return max(1, min(by_length, by_occupancy))
