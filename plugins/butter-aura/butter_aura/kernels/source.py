"""Kernel-source helpers the AURA kernels share, written in butter's dialect.

* ``aura_code``: one code out of a row's packed bit stream (``packing.py``).
* ``aura_fwht_shared``: Walsh–Hadamard butterflies over values in shared memory, the
  same additions in the same order as ``rotation.fwht``, so kernel and reference rotate
  bit for bit alike; ``aura_fwht_warp`` the same over one warp's registers.
* ``aura_group_sum``: a sum over aligned groups of threads whose size is only known at
  run time (a scale group may span several warps).
* ``AuraSlotParams``, ``aura_slot_params``, ``aura_ring_index`` and ``aura_coded``: the
  partials kernels' ``params`` input (``[live, sinks, recent, recent_lo, recent_hi, base,
  tail]``, built by ``attention.live_params``), a slot's row in the recent ring
  (``layout.FullPrecisionBudget.ring_index``) and whether a slot is read from its codes.

The two shared-memory helpers contain barriers: every thread of the threadgroup must
call them.

``DENSE`` and ``PAGED`` fill the decode kernels' open expressions (``split_k.fill``) for one
cache's arrays and for batched storage's pages; ``PAGED_PREAMBLE`` opens a paged kernel.
"""

from __future__ import annotations

from butter_core.plugin_api import split_k

HELPERS = """
// The partials kernels' `params`: live slots; slots [0, sinks) held in full precision;
// the recent ring's period; the smallest and largest slot the ring holds (lo > hi: none);
// the first slot with a ring row; the first slot with a row of its own.
struct AuraSlotParams {
  int live;
  int sinks;
  int recent;
  int recent_lo;
  int recent_hi;
  int base;
  int tail;
};
template <typename In>
BT_FUNC AuraSlotParams aura_slot_params(In params) {
  return AuraSlotParams{params[0], params[1], params[2], params[3], params[4], params[5], params[6]};
}

// The recent-ring row that slot `key` (base <= key, recent > 0) may be held in.
BT_FUNC int aura_ring_index(int key, int recent, int base, int tail) {
  return key < tail ? (key - base) % recent : recent + key - tail;
}

// Whether slot `key` is read from its codes: below `end`, not a sink, not held in full
// precision by the recent ring (looked up only within the ring's slot range, which lies
// at or past `base`).
template <typename In>
BT_FUNC bool aura_coded(AuraSlotParams sp, In recent_slots, int key, int end) {
  if (key >= end || key < sp.sinks) {
    return false;
  }
  if (key >= sp.recent_lo && key <= sp.recent_hi) {
    return recent_slots[aura_ring_index(key, sp.recent, sp.base, sp.tail)] != key;
  }
  return true;
}

template <typename In>
BT_FUNC unsigned int aura_code(In words, int j, int bits) {
  // Code j of a little-endian stream of bits-bit codes; it straddles two words only
  // when bits does not divide 32.
  const int bit = j * bits;
  const int word = bit >> 5;
  const int shift = bit & 31;
  unsigned int code = words[word] >> shift;
  if (shift + bits > 32) {
    code |= words[word + 1] << (32 - shift);
  }
  return code & ((1u << bits) - 1u);
}

// Unnormalized butterflies over buf[0, n): one transform per aligned run of `span`
// values (n a multiple of span, span a power of two). Thread `rank` of `threads` owns
// elements rank, rank + threads, ... (at most PER of them).
template <int PER>
BT_FUNC void aura_fwht_shared(BT_SHARED_PTR float* buf, int n, int span, int threads, int rank) {
  for (int h = 1; h < span; h *= 2) {
    float next[PER];
    for (int k = 0; k < PER; ++k) {
      const int e = rank + k * threads;
      if (e < n) {
        const float a = buf[e];
        const float b = buf[e ^ h];
        next[k] = (e & h) ? b - a : a + b;
      }
    }
    BT_BARRIER;
    for (int k = 0; k < PER; ++k) {
      const int e = rank + k * threads;
      if (e < n) {
        buf[e] = next[k];
      }
    }
    BT_BARRIER;
  }
}

// The same butterflies over one warp's D = BT_WARP_SIZE * PER values in registers: lane
// `lane` holds elements lane * PER + [0, PER) in x. No shared memory and no barrier; the
// same additions in the same order as aura_fwht_shared.
template <int PER>
BT_FUNC void aura_fwht_warp(BT_PRIVATE float* x, int lane) {
#pragma unroll
  for (int h = 1; h < PER; h *= 2) {
    float next[PER];
#pragma unroll
    for (int j = 0; j < PER; ++j) {
      next[j] = (j & h) ? x[j ^ h] - x[j] : x[j] + x[j ^ h];
    }
#pragma unroll
    for (int j = 0; j < PER; ++j) {
      x[j] = next[j];
    }
  }
#pragma unroll
  for (int h = 1; h < BT_WARP_SIZE; h *= 2) {
#pragma unroll
    for (int j = 0; j < PER; ++j) {
      const float b = bt_shuffle_xor(x[j], h);
      x[j] = (lane & h) ? b - x[j] : x[j] + b;
    }
  }
}

// Sum of v over the aligned group of `group` consecutive threads (a power of two);
// scratch holds one float per warp of the threadgroup.
BT_FUNC float aura_group_sum(float v, int group, BT_SHARED_PTR float* scratch, int lane, int warp) {
  const int width = group < BT_WARP_SIZE ? group : BT_WARP_SIZE;
  for (int offset = 1; offset < width; offset *= 2) {
    v += bt_shuffle_xor(v, offset);
  }
  if (group > BT_WARP_SIZE) {
    if (lane == 0) {
      scratch[warp] = v;
    }
    BT_BARRIER;
    const int warps = group / BT_WARP_SIZE;
    const int first = (warp / warps) * warps;
    v = 0.0f;
    for (int w = 0; w < warps; ++w) {
      v += scratch[first + w];
    }
    BT_BARRIER;
  }
  return v;
}
"""


# ---- a sequence's expressions in the decode kernels' bodies (``split_k.fill``) ----

DENSE = {
    "$PAGED": "false", "$PARAMS_AT": "0", "$RECENT_AT": "0", "$RING": "recent_slots_shape[0]", "$KV_ROWS": "block.batch_kv_head",
    "$SLOT": "at", "$ONE_RUN": "true", "$FP_BASE": "(static_cast<int64_t>(sequence) * kv_heads + kv_head) * ROWS * D",
    "$FP_STRIDE": "D",
}
"""One cache's arrays: ``params`` and ``recent_slots`` shared by its batch, fp rows ``[batch, heads, ROWS, D]``;
key ``at`` in slot ``at`` (``$PAGED`` false), so any keys ``[at, at + KEYS)`` in consecutive slots (``$ONE_RUN``)."""

PAGED = {
    "$PAGED": "true", "$PARAMS_AT": "static_cast<int64_t>(sequence) * 7", "$RECENT_AT": "static_cast<int64_t>(sequence) * recent_slots_shape[1]",
    "$RING": "recent_slots_shape[1]", "$KV_ROWS": "block.kv_head",
    "$SLOT": split_k.PAGED_SLOT, "$ONE_RUN": "(at % PAGE + KEYS <= PAGE)",
    "$FP_BASE": "(static_cast<int64_t>(sequence_rows[sequence]) * ROWS * kv_heads + kv_head) * D",
    "$FP_STRIDE": "kv_heads * D",
}
"""Batched storage (``paged``): per sequence ``params`` ``[B, 7]`` and ``recent_slots`` ``[B, ring]``,
codes in pages read through ``table``, fp rows ``[sequences * ROWS, heads, D]`` at ``sequence_rows``; keys
``[at, at + KEYS)`` in consecutive slots where they lie in one page."""

PAGED_PREAMBLE = split_k.paged_preamble("key_codes")
"""What a paged partials kernel opens with: the sequence its threadgroup serves and its row of the
table (``PAGED`` reads both)."""
