"""Tensor-core partials of ``decode_attention`` (CUDA): scores and values as ``mma.sync`` tiles.

The split-K structure is the SIMT kernel's (``attention.py``); this module replaces only
its partials kernel, for one scale per vector, aura4v2, aura4v4, aura8v4 and aura8v8,
``head_dim`` 64 or 128 and float16/bfloat16 queries (``serves``).
``attention.decode_attention`` picks it on CUDA and runs AURA's merge kernel
(full-precision rows, inverse rotation) after it.

Per warp and per block of 16 keys, with the dialect's ``bt_mma_16x8x16`` (m16n8k16,
float16 inputs, float32 sums), in the transposed layout of ``butter_core.kernels.mma``
(the GQA group's query heads are the MMA's 8 columns, keys and coordinates its 16 rows):

    Sᵀ[16 keys, heads]  = K_levels[16 keys, D] · Q_rotᵀ        (D / 16 products)
    Oᵀ[16 coords, heads] += V_levelsᵀ[16 coords, 16 keys] · P'ᵀ  (D / 16 products)

* **Scores.** B is the block's rotated query (signs, then butterflies in a warp's
  registers, ``aura_fwht_warp``; handed over in shared memory), times
  ``scale · log2(e) / √D``, in float16 (``mma_query_fragments``). A is the keys'
  codebook *levels*, without the keys' scales: the C fragment's rows (keys) are
  multiplied by their key's scale after the products. ``q · k`` does not change when
  one permutation of the coordinates is applied to both, so lane ``(g, t)`` (``g =
  lane / 4``, ``t = lane % 4``) reads one contiguous run of code words per key —
  coordinates ``[t D/4, (t+1) D/4)`` of keys ``g`` and ``g + 8`` (16 bytes per key for
  4-bit codes at D = 128) — and pair ``r`` of that run (``AuraKeyPerm``: coordinates
  ``2r, 2r + 1``, one byte of 4-bit codes) goes where the MMA wants pair ``r``.
* **Online softmax** on the C fragment, in log2 units: lane ``(g, t)`` holds the scores
  of keys ``g``, ``g + 8`` for heads ``2t``, ``2t + 1``. Only in a step where some lane
  holds a score above its head's running maximum (a warp vote; rare once the stream is
  warm) are the maxima reduced over the 8 lanes of a ``t`` (three shuffles per head) and
  the accumulators rescaled.
* **Values.** ``P' = p · (the key's value scale)``, rounded to float16, is the second
  product's B operand (a transpose of the score fragment: ``bt_transpose_8x8``, one
  ``movmatrix`` per 8 keys), so values need no per-element scale. A is the values' levels:
  lane ``(g, t)`` reads coordinates ``[g D/8, (g+1) D/8)`` of keys ``2t, 2t+1, 2t+8,
  2t+9``; an A register holds one coordinate of two keys. For 2- and 4-bit codes the
  two keys' code bytes are first interleaved nibble by nibble (two LOP3 per word), so
  that one look-up returns the pair already interleaved; 8-bit levels are paired with
  a byte permute.
* **Levels from codes**: look-up tables in shared memory, indexed a byte at a time:
  the key table holds, per byte of 4-bit codes, the half2 of its two levels (8-bit: the
  level as a half); the value table per interleaved byte the half2 of key x's and key
  y's level (2-bit: a uint2, two coordinates). The tables are 256 entries of 256 bytes
  (64 KB of dynamic shared memory): entry ``e`` holds 32 copies of the key table's 4
  bytes, then 32 copies of the value table's 4 bytes (16 of its 8 bytes for 2-bit
  codes). Lane ``l`` reads copy ``l`` (``l % 16``), so the warp's 32 data-dependent
  look-ups fall in 32 distinct banks, and a look-up's address is ``e << 8`` plus the
  copy's offset plus the tables' address: one byte permute of the code word and the
  lane's copy word (``aura_lut_address``). Where the launch can leave room for it
  without losing a threadgroup per multiprocessor (``aligned_tables``: twelve warps on
  an H200 or an A100) the tables start at a 64 KB boundary of the shared window, whose
  bits 16-31 ride in the copy word, so the permute is the whole address (faster);
  otherwise the tables' address is added to it. Built once per threadgroup from the
  codebooks (16-byte stores).

A warp takes ``BLOCKS`` blocks per step (default 2: more loads in flight, one softmax
reduction per 32 keys); the next step's key codes, scales and value codes are loaded as
soon as the scores are done, the value codes into a second buffer (``AHEAD``, see
``default_ahead``; without it they wait until the values are done, and a step with little
work waits on two load latencies). Two steps ahead, each warp's lanes fetch that step's
lines into L2 (``PREFETCH``), so the loads a step ahead wait on L2, not on memory.
Nothing that a step loads is used in that step: the scales stay float16 until the next
step converts them (a conversion next to the loads made the warp wait out the memory
latency there every step), and the loop takes two steps an iteration, the two buffers
trading roles, so no copy from one to the other waits on loads either (the register
allocator had put that copy at the loop's end). Full-precision slots (sinks, the recent
ring) are skipped as in the SIMT kernel: a step wholly inside ``[sinks, end)`` and
outside the ring's slot range takes no per-key test. After the loop each warp's state
goes to shared memory (over the tables) and ``mma_write_partials`` merges the warps and
writes the split's partials. The split count fills the GPU with one wave of threadgroups
(``num_splits``), counted from the device's multiprocessors, shared memory and registers
(``butter_core.kernels.backend.gpu_shape``). Measurements behind these choices (the
tables' alignment, ``AHEAD``, where the scales are converted, the two-step loop, and the
constants below): docs/benchmarks.md,
"plugins/butter-aura/butter_aura/kernels/attention_mma.py".

Precision: levels, query and P' are rounded to float16 once each (relative 2^-11) and
every product is summed in float32; exponentials use the hardware's ``ex2.approx``.
Measured against the pure-mx reference (CPU emulator, ``KERNEL_CHECKS``): relative
error 3.9e-4 to 5.0e-4 for float16 outputs, 1.1e-3 to 1.3e-3 for bfloat16 ones.
"""

from __future__ import annotations

import functools

import mlx.core as mx

from butter_core.plugin_api import GpuShape, Kernel, gpu_shape, mma, split_k

from butter_aura.kernels.source import DENSE, HELPERS, PAGED, PAGED_PREAMBLE

BITS = ((4, 2), (4, 4), (8, 4), (8, 8))
"""(key bits, value bits) served: aura4v2, aura4v4, aura8v4, aura8v8, the pairs its checks
cover (the kernel's key and value paths are independent: 4- or 8-bit keys, 2-, 4- or 8-bit
values; another pair would need its own checks)."""
HEAD_DIMS = (64, 128)
QUERY_DTYPES = (mx.float16, mx.bfloat16)

WARPS = 12
"""Warps per threadgroup (each takes its own steps of ``BLOCKS`` * 16 keys): twelve, one
threadgroup per multiprocessor (registers allow no more: 168 x 384 threads), so each
multiprocessor builds the 64 KB of tables once instead of three times and a call has a
third of the splits to merge: faster than four warps for the 4-bit-key schemes (and than
eight, for aura4v2), the same for the 8-bit ones (measurements: docs/benchmarks.md,
"plugins/butter-aura/butter_aura/kernels/attention_mma.py")."""
BLOCKS = 2
"""16-key blocks a warp takes per step: more loads in flight, one softmax reduction per step
(``default_blocks``: 1 where 2 would need more than 168 registers, the most that leave one
twelve-warp or three four-warp threadgroups per multiprocessor)."""
READ_ONLY_LOADS = True
"""Load codes and scales through the read-only data path (``bt_read``: CUDA's
``ld.global.nc``): faster for aura4v2 and aura4v4, mixed for aura8v8 (measurements:
docs/benchmarks.md, "plugins/butter-aura/butter_aura/kernels/attention_mma.py")."""
PREFETCH = 2
"""Steps ahead whose codes and scales each warp fetches into L2 (``prefetch.global.L2``, no
registers held), so that its loads a step ahead find them there; 0 or 1: none. Two is
the fastest distance measured; farther ahead the lines are evicted or contend before
they are read. aura8v4 (no second value buffer) gains most, aura8v8 (one block a step)
nothing (measurements: docs/benchmarks.md,
"plugins/butter-aura/butter_aura/kernels/attention_mma.py")."""
LUT_BYTES = 256 * 256
"""The look-up tables: 256 entries of 256 bytes (32 copies of the key table's 4 bytes, 32
copies of the value table's 4 bytes or 16 of its 8 bytes)."""
MAX_HEADS_PER_BLOCK = 8
"""Query heads one threadgroup serves: the 8 columns of the value MMA."""
MIN_KEYS_PER_SPLIT = 384
"""Keys per split at least: one twelve-warp step (12 x 32 keys), so in the short splits
of a short context no warp is left without keys. Chosen on *chained* calls (each call's
query the previous call's output), as a decode step's layers run. Each threadgroup first
builds 64 KB of look-up tables, so among independent calls, which overlap on the GPU,
long splits are cheaper, but chained calls at short contexts want the threadgroups that
short splits give (2048 keys per split, the default until 2026-12-01, left a chained 4k
call far slower than raw SDPA). At 32k and longer the value matters little; at 128k the
one-wave cap decides the split count (measurements: docs/benchmarks.md,
"plugins/butter-aura/butter_aura/kernels/attention_mma.py")."""
REGISTERS = 168
"""Registers per thread the launch is planned with: nvcc reports 128-168 for these builds."""
RESERVED_SHARED = 1024
"""Shared memory CUDA reserves per threadgroup (compute capability 8.0 and newer)."""
STATIC_SHARED = 2 * 256 * 4 + MAX_HEADS_PER_BLOCK * 128 * 4
"""The kernel's static shared arrays at most (two codebooks, the rotated queries)."""


def shared_bytes(warps: int, heads: int, dims: int, aligned: bool) -> int:
    """Dynamic shared memory: the tables (``aligned``: with room to start them at the next
    64 KB boundary of the shared window), reused after the loop for the warps' states."""
    return max(2 * LUT_BYTES if aligned else LUT_BYTES, warps * heads * (dims + 2) * 4)


@functools.lru_cache(maxsize=256)
def aligned_tables(warps: int, heads: int, dims: int, shape: GpuShape) -> bool:
    """Whether the tables start at a 64 KB boundary of the shared window (``ALIGNED``: a
    look-up's address is then one byte permute, with no base to add): wherever the room
    for it costs no threadgroup per multiprocessor. Twelve warps on an H200 or an A100,
    one threadgroup per multiprocessor either way: yes; four warps (three per H200
    multiprocessor otherwise) or an RTX 4090 (100 KB of shared memory): no. Cached: every
    decode call asks, with the same few arguments."""
    plain, aligned = shared_bytes(warps, heads, dims, False), shared_bytes(warps, heads, dims, True)
    fits = aligned + STATIC_SHARED + RESERVED_SHARED <= shape.shared_per_multiprocessor
    return fits and blocks_per_sm(aligned, warps, shape) == blocks_per_sm(plain, warps, shape)


def blocks_per_sm(shared: int, warps: int, shape: GpuShape) -> int:
    """Threadgroups of the partials kernel one multiprocessor of ``shape`` holds at once
    (an H200's: one of twelve warps, three of four)."""
    by_shared = shape.shared_per_multiprocessor // (shared + STATIC_SHARED + RESERVED_SHARED)
    by_registers = shape.registers_per_multiprocessor // (REGISTERS * 32 * warps)
    return max(1, min(by_shared, by_registers, 64 // warps))


def default_blocks(key_bits: int, value_bits: int, dims: int) -> int:
    """``BLOCKS``, except 1 for 8-bit keys and values at head_dim 128 (254 registers at 2)."""
    return 1 if key_bits == 8 and value_bits == 8 and dims == 128 else BLOCKS


def default_ahead(key_bits: int, value_bits: int, dims: int) -> bool:
    """Whether the value codes are loaded a step ahead (``AHEAD``): everywhere but aura8v4 at
    head_dim 128, where the second buffer takes the build from 168 registers to 255 (nvcc
    13.0, sm_90a; every other configuration keeps its count: 127-168)."""
    return not (key_bits == 8 and value_bits == 4 and dims == 128)


def num_splits(length: int, blocks_per_split: int, resident: int, min_keys: int) -> int:
    """Splits of the live keys: at least ``min_keys`` keys each, and no more threadgroups than
    the GPU holds at once (``resident``): one wave, never a second wave of a few blocks,
    which would take as long as the first; at most what a merge takes (``split_k.MAX_MERGE_SPLITS``)."""
    return max(1, min(-(-length // min_keys), resident // blocks_per_split, split_k.MAX_MERGE_SPLITS))


_BODY = """
  // Template: T (query dtype), D, KB, VB (code bits), HEADS, WARPS, BLOCKS (16-key blocks per warp step),
  // READ_ONLY, AHEAD (value codes loaded a step ahead, into a second buffer), ALIGNED (below),
  // PREFETCH (steps ahead fetched into L2; 0 or 1: none).
  // params: [live, sinks, ring, recent_lo, recent_hi]. Scales are float16.
  constexpr int THREADS = WARPS * BT_WARP_SIZE;
  constexpr int KSTEPS = D / 16;            // k-steps of the score MMA
  constexpr int MT = D / 16;                // m-tiles (16 coordinates) of the value MMA
  constexpr int KWB = D * KB / 8;           // bytes of a key's codes
  constexpr int VWB = D * VB / 8;           // bytes of a value's codes
  constexpr int KLB = D / 4 * KB / 8;       // bytes of a key's codes one lane reads
  constexpr int VLB = D / 8 * VB / 8;       // bytes of a value's codes one lane reads
  constexpr int KLW = KLB / 4;
  constexpr int VLW = (VLB + 3) / 4;
  static_assert(HEADS <= 8, "the value MMA has 8 head columns");

  const AuraSlotParams slot_params = aura_slot_params(params + $PARAMS_AT);
  const SplitKBlock block =
      splitk_block<HEADS>(block_idx, grid_dim, queries_shape[1], key_codes_shape[1], slot_params.live);
  const int allocated = key_codes_shape[2];
  const int g = lane_id / 4;
  const int t = lane_id % 4;

  const int64_t rows = static_cast<int64_t>($KV_ROWS) * allocated;
  const unsigned char* k_rows = reinterpret_cast<const unsigned char*>(key_codes) + rows * KWB;
  const unsigned char* v_rows = reinterpret_cast<const unsigned char*>(value_codes) + rows * VWB;
  const unsigned char* k_base = k_rows + t * KLB;
  const unsigned char* v_base = v_rows + g * VLB;
  const BT_GLOBAL __half* ks_base = key_scales + rows;
  const BT_GLOBAL __half* vs_base = value_scales + rows;
  const int last = block.end - 1;
  constexpr int KEYS = 16 * BLOCKS;         // keys of one warp step
  constexpr int STEP = WARPS * KEYS;
  int base = block.start + static_cast<int>(warp_id) * KEYS;

  // Codes and scales of a step (key block b = keys base + 16 b + [0, 16)): the key codes
  // and scales are reloaded for the next step as soon as the scores are done; the value
  // codes with them into the other of two buffers (AHEAD), else as soon as the values
  // are done, into the one buffer. Value codes: keys 2t, 2t+1, 2t+8, 2t+9, this lane's
  // eighth of their codes (vn is never touched without AHEAD).
  uint32_t kc[BLOCKS][2][KLW];   // keys g and g + 8: this lane's quarter of their codes
  uint32_t vc[BLOCKS][4][VLW];
  uint32_t vn[BLOCKS][4][VLW];
  // Key scales of keys g and g + 8, and their value scales, as loaded: converted to float
  // only where a step uses them, so no instruction of the step that loads them waits for
  // the load (a conversion at the load stalled the warp there for the whole memory
  // latency; Nsight Compute put a fifth of the kernel's stall samples on it).
  __half ks[BLOCKS][2];
  __half vs[BLOCKS][2];
  // The storage slot of key `at` (itself in one cache's arrays; through the page table in
  // batched storage). A step wholly inside [start, end) whose keys lie in consecutive slots
  // ($ONE_RUN: always in one cache's arrays; in pages, where they lie in one page, as every
  // step of a split that starts on a page boundary does for pages a multiple of KEYS long)
  // reads from its first key's slot (in pages one look-up in the table a step, the same
  // address for every lane) plus constant offsets; otherwise (the last step of a split, a
  // step across pages) each key is looked up, clamped to the last one.
  auto slot_of = [&](int at) -> int64_t { return $SLOT; };
  auto load_keys = [&](int at) {
    if (at + KEYS <= block.end && $ONE_RUN) {
      const int64_t key = $PAGED ? slot_of(at) + g : static_cast<int64_t>(static_cast<uint32_t>(at + g));
      const unsigned char* codes = $PAGED ? k_base + key * KWB : k_base + static_cast<uint32_t>(key) * static_cast<uint32_t>(KWB);
      const BT_GLOBAL __half* kscales = ks_base + key;
      const BT_GLOBAL __half* vscales = vs_base + key;
#pragma unroll
      for (int b = 0; b < BLOCKS; ++b) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          aura_load_bytes<KLB, READ_ONLY>(codes + (16 * b + 8 * h) * KWB, kc[b][h]);
          ks[b][h] = bt_read_if<READ_ONLY>(kscales + 16 * b + 8 * h);
          vs[b][h] = bt_read_if<READ_ONLY>(vscales + 16 * b + 8 * h);
        }
      }
    } else {
#pragma unroll
      for (int b = 0; b < BLOCKS; ++b) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int64_t key = slot_of(min(at + 16 * b + 8 * h + g, last));
          aura_load_bytes<KLB, READ_ONLY>(k_base + key * KWB, kc[b][h]);
          ks[b][h] = bt_read_if<READ_ONLY>(ks_base + key);
          vs[b][h] = bt_read_if<READ_ONLY>(vs_base + key);
        }
      }
    }
  };
  auto load_values = [&](int at, uint32_t (&dst)[BLOCKS][4][VLW]) {
    if (at + KEYS <= block.end && $ONE_RUN) {
      const unsigned char* codes = $PAGED ? v_base + (slot_of(at) + 2 * t) * VWB
                                          : v_base + static_cast<uint32_t>(at + 2 * t) * static_cast<uint32_t>(VWB);
#pragma unroll
      for (int b = 0; b < BLOCKS; ++b) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          aura_load_bytes<VLB, READ_ONLY>(codes + (16 * b + (i & 1) + 8 * (i >> 1)) * VWB, dst[b][i]);
        }
      }
    } else {
#pragma unroll
      for (int b = 0; b < BLOCKS; ++b) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int64_t key = slot_of(min(at + 16 * b + 2 * t + (i & 1) + 8 * (i >> 1), last));
          aura_load_bytes<VLB, READ_ONLY>(v_base + key * VWB, dst[b][i]);
        }
      }
    }
  };
  // PREFETCH > 1: the step PREFETCH steps ahead is fetched into L2 (its lines spread over
  // the lanes; none past the split's end), so the loads a step ahead find it there. In
  // pages, where its keys lie in one page.
  auto prefetch = [&](int at) {
    constexpr int KEY_LINES = KEYS * KWB / 128;
    constexpr int VALUE_LINES = KEYS * VWB / 128;
    if (PREFETCH > 1 && at < block.end && $ONE_RUN) {
      const int keys = min(KEYS, block.end - at);
      const int64_t first = $PAGED ? slot_of(at) : at;
      const unsigned char* k_at = $PAGED ? k_rows + first * KWB : k_rows + static_cast<uint32_t>(at) * KWB;
      const unsigned char* v_at = $PAGED ? v_rows + first * VWB : v_rows + static_cast<uint32_t>(at) * VWB;
#pragma unroll
      for (int i = static_cast<int>(lane_id); i < KEY_LINES + VALUE_LINES + 2; i += BT_WARP_SIZE) {
        if (i < KEY_LINES) {
          if (i * 128 < keys * KWB) bt_prefetch_l2(k_at + i * 128);
        } else if (i < KEY_LINES + VALUE_LINES) {
          if ((i - KEY_LINES) * 128 < keys * VWB) bt_prefetch_l2(v_at + (i - KEY_LINES) * 128);
        } else {
          bt_prefetch_l2((i == KEY_LINES + VALUE_LINES ? ks_base : vs_base) + first);
        }
      }
    }
  };
  if (base < block.end) {  // the first step's loads overlap building the tables
    load_keys(base);
    load_values(base, vc);
  }
  for (int ahead = 1; ahead < PREFETCH; ++ahead) {
    prefetch(base + ahead * STEP);
  }

  // The look-up tables: 256 entries of 256 bytes in dynamic shared memory. Entry e holds
  // 32 copies of the key table's 32-bit value at bytes [0, 128) and the value table's
  // copies at [128, 256) (32 of 32 bits, or 16 of 64 bits for 2-bit codes); lane l reads
  // copy l (l % 16), so its byte address is one byte permute of the code word and its copy
  // word, e << 8 | the copy's offset (aura_lut_address), plus the tables' address. ALIGNED:
  // the tables start at the next 64 KB boundary of the shared window (the launch leaves
  // room) and their address rides in bits 16-31 of the copy word, so the permute makes the
  // whole address; otherwise each look-up adds it. After the loop the same memory holds
  // the warps' states.
  BT_DYNAMIC_SHARED(uint4, aura_dynamic);
#ifdef __CUDA_ARCH__
  const uint32_t dynamic_at = static_cast<uint32_t>(__cvta_generic_to_shared(aura_dynamic));
#else
  const uint32_t dynamic_at = 0;  // an emulator's shared memory: its window starts here
#endif
  const uint32_t tables_at = ALIGNED ? (dynamic_at + 0xFFFFu) & ~0xFFFFu : dynamic_at;
  const uint32_t table_high = ALIGNED ? tables_at : 0u;  // in every copy's offset, bits 16-31
  const uint32_t table_base = ALIGNED ? 0u : tables_at;  // added to every look-up's address
  uint4* aura_lut = aura_dynamic + (tables_at - dynamic_at) / 16;
  const char* window = reinterpret_cast<const char*>(aura_dynamic);  // shared address 0 where emulated
  BT_SHARED float k_lv[256];
  BT_SHARED float v_lv[256];
  alignas(16) BT_SHARED float q_rot[HEADS * D];  // 16-byte loads in mma_query_fragments
  for (int i = thread_rank; i < (1 << KB); i += THREADS) {
    k_lv[i] = key_levels[i];
  }
  for (int i = thread_rank; i < (1 << VB); i += THREADS) {
    v_lv[i] = value_levels[i];
  }
  // Warp w rotates the queries of heads w, w + WARPS, ... in registers (signs, then
  // butterflies and shuffles; lane i holds coordinates i * D / 32 + [0, D / 32)), with
  // no barrier: in shared memory the butterflies took two barriers a stage.
  for (int h = static_cast<int>(warp_id); h < HEADS; h += WARPS) {
    constexpr int LANE_DIMS = D / BT_WARP_SIZE;
    const int first = h * D + static_cast<int>(lane_id) * LANE_DIMS;
    float x[LANE_DIMS];
#pragma unroll
    for (int i = 0; i < LANE_DIMS; ++i) {
      x[i] = bt_to_float(queries[static_cast<int64_t>(block.first_q_head) * D + first + i]) *
             signs[block.kv_head * D + static_cast<int>(lane_id) * LANE_DIMS + i];
    }
    aura_fwht_warp<LANE_DIMS>(x, static_cast<int>(lane_id));
#pragma unroll
    for (int i = 0; i < LANE_DIMS; ++i) {
      q_rot[first + i] = x[i];
    }
  }
  BT_BARRIER;
  for (int i = thread_rank; i < 256 * 16; i += THREADS) {  // 16-byte stores: 16 per entry
    const int e = i / 16;
    uint32_t x, y;
    if (i % 16 < 8) {
      x = y = aura_lut_entry<KB>(k_lv, e);
    } else if constexpr (VB == 2) {
      // Two keys' two codes each, key x in the low nibble, key y in the high one:
      // .x = (x, y) at the first coordinate, .y = (x, y) at the second.
      x = bt_pack_half2(v_lv[e & 3], v_lv[(e >> 4) & 3]);
      y = bt_pack_half2(v_lv[(e >> 2) & 3], v_lv[e >> 6]);
    } else {
      x = y = aura_lut_entry<VB>(v_lv, e);
    }
    aura_lut[i] = make_uint4(x, y, x, y);
  }
  BT_BARRIER;

  // The query as B fragments of the score MMA (butter_core.kernels.mma): head g's pairs
  // 2j and 2j+1 of its key chunk, coordinates t D/4 + 4j + {0, 1} and + {2, 3}.
  const float q_scale = scale[0] * 1.4426950408889634f / bt_sqrt(static_cast<float>(D));
  uint32_t qb[KSTEPS * 2];
  // (q_rot and the tables are complete here.)
  // This lane's copies: the tables' address with the copy's byte offset in bits 0-7.
  const uint32_t k_copy = table_high | (lane_id * 4);
  const uint32_t v_copy = table_high | (128 + (VB == 2 ? (lane_id % 16) * 8 : lane_id * 4));
  mma_query_fragments<AuraKeyPerm, 1, D>(q_rot, HEADS, q_scale, lane_id, qb);

  // Online-softmax state of heads 2t and 2t+1 (the same in the 8 lanes of a t).
  const bool heads_here = 2 * t < HEADS;
  float m[2] = {BT_NEG_INF, BT_NEG_INF};
  float l[2] = {0.0f, 0.0f};  // this lane's part of the running sums
  float o[MT * 4];            // O^T: m-tile j, rows = coordinates, columns = heads 2t, 2t+1
#pragma unroll
  for (int i = 0; i < MT * 4; ++i) {
    o[i] = 0.0f;
  }

  // One warp step: keys base + [0, KEYS), their value codes in `cur`; AHEAD, the next
  // step's value codes go to `next`. Advances base.
  auto step = [&](uint32_t (&cur)[BLOCKS][4][VLW], uint32_t (&next)[BLOCKS][4][VLW]) {
    // S^T = K Q^T per key block: A = key levels (rows g and g + 8 = keys g and g + 8),
    // B = the query; C: s[b][0, 1] = key g, heads 2t, 2t+1; s[b][2, 3] = key g + 8.
    // Two accumulation chains per block (even and odd k-steps).
    prefetch(base + PREFETCH * STEP);
    float s[BLOCKS][4];
    float s_odd[BLOCKS][4];
#pragma unroll
    for (int b = 0; b < BLOCKS; ++b) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        s[b][i] = 0.0f;
        s_odd[b][i] = 0.0f;
      }
#pragma unroll
      for (int j = 0; j < KSTEPS; ++j) {
        uint32_t a[4];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          if constexpr (KB == 4) {
            a[h] = aura_lut_u32(window, kc[b][h], 2 * j, k_copy, table_base);
            a[h + 2] = aura_lut_u32(window, kc[b][h], 2 * j + 1, k_copy, table_base);
          } else {
            a[h] = bt_byte_perm(aura_lut_u32(window, kc[b][h], 4 * j, k_copy, table_base),
                                aura_lut_u32(window, kc[b][h], 4 * j + 1, k_copy, table_base), 0x5410u);
            a[h + 2] = bt_byte_perm(aura_lut_u32(window, kc[b][h], 4 * j + 2, k_copy, table_base),
                                    aura_lut_u32(window, kc[b][h], 4 * j + 3, k_copy, table_base), 0x5410u);
          }
        }
        bt_mma_16x8x16(j % 2 ? s_odd[b] : s[b], a, qb + 2 * j, lane_id);
      }
    }
    float kscale[BLOCKS][2];
    float vscale[BLOCKS][2];
#pragma unroll
    for (int b = 0; b < BLOCKS; ++b) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        kscale[b][h] = bt_to_float(ks[b][h]);
        vscale[b][h] = bt_to_float(vs[b][h]);
      }
    }
    if (base + STEP < block.end) {
      load_keys(base + STEP);
      if constexpr (AHEAD) {
        load_values(base + STEP, next);
      }
    }

    // Keys read from their codes: inside [sinks, end) and not held by the recent ring.
    // The scores' columns past HEADS are -inf too, so their P' is 0.
    const bool plain = base >= slot_params.sinks && base + KEYS <= block.end &&
                       (base + KEYS <= slot_params.recent_lo || base > slot_params.recent_hi);
#pragma unroll
    for (int b = 0; b < BLOCKS; ++b) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        bool coded = heads_here;
        if (!plain) {
          const int key = base + 16 * b + 8 * h + g;
          coded = coded && aura_coded(slot_params, recent_slots + $RECENT_AT, key, block.end);
        }
        s[b][2 * h] = coded ? (s[b][2 * h] + s_odd[b][2 * h]) * kscale[b][h] : BT_NEG_INF;
        s[b][2 * h + 1] = coded && 2 * t + 1 < HEADS ? (s[b][2 * h + 1] + s_odd[b][2 * h + 1]) * kscale[b][h]
                                                     : BT_NEG_INF;
        vscale[b][h] = coded ? vscale[b][h] : 0.0f;  // P' = 0 whatever a skipped slot's scale holds
      }
    }

    // Online softmax per head (column; butter_core.kernels.mma).
    mma_softmax_max<1, BLOCKS, MT>(&s[0][0], m, l, o);
    mma_softmax_probabilities<1, BLOCKS>(&s[0][0], m, l);
#pragma unroll
    for (int b = 0; b < BLOCKS; ++b) {
      // P' = p * the key's value scale in float16, transposed to the value MMA's B
      // fragment (keys 2t', 2t'+1 | 2t'+8, 2t'+9 of head g').
      uint32_t pb[2];
      mma_softmax_pack<1>(s[b], pb, lane_id, vscale[b][0], vscale[b][1]);
      // O^T += V_levels^T P'^T. m-tile j: row g -> coordinate g D/8 + 2j, row g+8 -> + 2j + 1;
      // A: a[0] = row g, keys 2t, 2t+1; a[1] = row g+8, same keys; a[2], a[3]: keys 2t+8, 2t+9.
      uint32_t z[2][2][VLW];  // 2- and 4-bit codes: the two keys' nibbles interleaved
      if constexpr (VB != 8) {
#pragma unroll
        for (int pair = 0; pair < 2; ++pair) {
#pragma unroll
          for (int w = 0; w < VLW; ++w) {
            const uint32_t x = cur[b][2 * pair][w];
            const uint32_t y = cur[b][2 * pair + 1][w];
            z[pair][0][w] = (x & 0x0F0F0F0Fu) | ((y << 4) & 0xF0F0F0F0u);
            z[pair][1][w] = ((x >> 4) & 0x0F0F0F0Fu) | (y & 0xF0F0F0F0u);
          }
        }
      }
#pragma unroll
      for (int j = 0; j < MT; ++j) {
        uint32_t a[4];
#pragma unroll
        for (int pair = 0; pair < 2; ++pair) {
          if constexpr (VB == 2) {
            // byte j / 2 of the low (j even) or high (j odd) nibbles: coordinates 2j, 2j + 1.
            const uint2 e = aura_lut_u64(window, z[pair][j % 2], j / 2, v_copy, table_base);
            a[2 * pair] = e.x;
            a[2 * pair + 1] = e.y;
          } else if constexpr (VB == 4) {
            a[2 * pair] = aura_lut_u32(window, z[pair][0], j, v_copy, table_base);
            a[2 * pair + 1] = aura_lut_u32(window, z[pair][1], j, v_copy, table_base);
          } else {
            const uint32_t* x = cur[b][2 * pair];
            const uint32_t* y = cur[b][2 * pair + 1];
            a[2 * pair] = bt_byte_perm(aura_lut_u32(window, x, 2 * j, v_copy, table_base),
                                       aura_lut_u32(window, y, 2 * j, v_copy, table_base), 0x5410u);
            a[2 * pair + 1] = bt_byte_perm(aura_lut_u32(window, x, 2 * j + 1, v_copy, table_base),
                                           aura_lut_u32(window, y, 2 * j + 1, v_copy, table_base), 0x5410u);
          }
        }
        bt_mma_16x8x16(o + 4 * j, a, pb, lane_id);
      }
    }
    if (!AHEAD && base + STEP < block.end) {
      load_values(base + STEP, cur);
    }
    base += STEP;
  };
  // The loop bound is uniform across the warp: every lane reaches the MMAs and shuffles.
  if constexpr (AHEAD) {
    // Two steps an iteration, the buffers trading roles. With one step an iteration and a
    // copy of the codes from the second buffer to the first, the register allocator put
    // the copy at the loop's end, where it waited for the loads just issued (Nsight
    // Compute: 13% of the kernel's stall samples on the copy's first instruction).
    while (base < block.end) {
      step(vc, vn);
      if (base >= block.end) {
        break;
      }
      step(vn, vc);
    }
  } else {
    while (base < block.end) {
      step(vc, vc);
    }
  }

  // Each warp's state to shared memory (over the tables), then merge the warps.
  BT_BARRIER;
  float* warp_m = reinterpret_cast<float*>(aura_lut);
  float* warp_l = warp_m + WARPS * HEADS;
  float* warp_acc = warp_l + WARPS * HEADS;
  mma_write_partials<HEADS, 1, D, WARPS>(m, l, o, lane_id, warp_id, thread_rank, block, warp_m, warp_l, warp_acc,
                                         partial_acc, partial_max, partial_sum);
"""

_MMA_HELPERS = r"""
// ---- AURA tensor-core decode (attention_mma.py) ----
// N bytes from global memory (N-byte aligned) into 32-bit words (N = 2: one zero-extended word).
template <int N, bool RO>
BT_FUNC void aura_load_bytes(const unsigned char* src, uint32_t* dst) {
  if constexpr (N == 32) {
    const uint4 a = bt_read_if<RO>(reinterpret_cast<const uint4*>(src));
    const uint4 b = bt_read_if<RO>(reinterpret_cast<const uint4*>(src) + 1);
    dst[0] = a.x; dst[1] = a.y; dst[2] = a.z; dst[3] = a.w;
    dst[4] = b.x; dst[5] = b.y; dst[6] = b.z; dst[7] = b.w;
  } else if constexpr (N == 16) {
    const uint4 a = bt_read_if<RO>(reinterpret_cast<const uint4*>(src));
    dst[0] = a.x; dst[1] = a.y; dst[2] = a.z; dst[3] = a.w;
  } else if constexpr (N == 8) {
    const uint2 a = bt_read_if<RO>(reinterpret_cast<const uint2*>(src));
    dst[0] = a.x; dst[1] = a.y;
  } else if constexpr (N == 4) {
    dst[0] = bt_read_if<RO>(reinterpret_cast<const uint32_t*>(src));
  } else {
    static_assert(N == 2, "2, 4, 8, 16 or 32 bytes");
    dst[0] = bt_read_if<RO>(reinterpret_cast<const unsigned short*>(src));
  }
}

// A look-up table's value for byte n of `words` (n a compile-time constant after
// unrolling), at shared address `base` + `copy` with the code byte in bits 8-15: one byte
// permute of the code word and `copy` (the copy's byte offset in bits 0-7, and with
// ALIGNED the tables' address in bits 16-31, `base` then 0). On CUDA a shared-memory load
// of that address; elsewhere the same address from `window`, the emulated shared memory.
BT_FUNC uint32_t aura_lut_address(const uint32_t* words, int n, uint32_t copy, uint32_t base) {
  return bt_byte_perm(words[n >> 2], copy, 0x7604u | static_cast<uint32_t>((n & 3) << 4)) + base;
}
BT_FUNC uint32_t aura_lut_u32(const char* window, const uint32_t* words, int n, uint32_t copy, uint32_t base) {
#ifdef __CUDA_ARCH__
  uint32_t v;
  asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(aura_lut_address(words, n, copy, base)));
  return v;
#else
  return *reinterpret_cast<const uint32_t*>(window + aura_lut_address(words, n, copy, base));
#endif
}
BT_FUNC uint2 aura_lut_u64(const char* window, const uint32_t* words, int n, uint32_t copy, uint32_t base) {
#ifdef __CUDA_ARCH__
  uint2 v;
  asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "r"(aura_lut_address(words, n, copy, base)));
  return v;
#else
  return *reinterpret_cast<const uint2*>(window + aura_lut_address(words, n, copy, base));
#endif
}

// Entry e of a 32-bit look-up table: a byte's two 4-bit codes as half2 (lower code in the
// lower half), or an 8-bit code's level as a half in the lower 16 bits.
template <int BITS>
BT_FUNC uint32_t aura_lut_entry(const float* levels, int e) {
  if constexpr (BITS == 4) {
    return bt_pack_half2(levels[e & 15], levels[e >> 4]);
  } else {
    return bt_pack_half2(levels[e], 0.0f);
  }
}

// The key chunk's pairs for the query fragments (butter_core.kernels.mma): pair r is
// coordinates 2r and 2r + 1 of the chunk, as a byte of 4-bit codes holds them.
struct AuraKeyPerm {
  static BT_FUNC constexpr int lo(int r) { return 2 * r; }
  static BT_FUNC constexpr int hi(int r) { return 2 * r + 1; }
};
"""

_KERNELS: dict[tuple[int, bool], Kernel] = {}


def partials_kernel(shared: int, paged: bool = False) -> Kernel:
    """The partials kernel with ``shared`` bytes of dynamic shared memory (one object per size), over
    one cache's arrays or (``paged``) batched storage's pages (one more input, ``table``, and template
    value, ``PAGE``; ``source.PAGED``)."""
    if (shared, paged) not in _KERNELS:
        _KERNELS[shared, paged] = Kernel(
            name=f"butter_aura{'_paged' if paged else ''}_decode_mma_partials_{shared}",
            input_names=(
                "queries", "signs", "key_codes", "key_scales", "value_codes", "value_scales",
                "key_levels", "value_levels", "recent_slots", "params", "scale", *(("table",) if paged else ()),
            ),
            output_names=("partial_acc", "partial_max", "partial_sum"),
            helpers=split_k.SPLIT_K_HELPERS + mma.MMA_SPLIT_K_HELPERS + HELPERS + _MMA_HELPERS,
            body=PAGED_PREAMBLE + split_k.fill(_BODY, PAGED) if paged else split_k.fill(_BODY, DENSE),
            shared_memory=shared,
            mma=True,
        )
    return _KERNELS[shared, paged]


def serves(queries: mx.array, stored) -> bool:
    """Whether this kernel serves these queries over ``stored`` (else the SIMT kernel does).
    Callers also check ``tensor_cores_available``: on CUDA devices older than compute
    capability 8.0 the SIMT kernel serves everything."""
    kc, vc = stored.key_codec, stored.value_codec
    dims = queries.shape[-1]
    return (
        queries.dtype in QUERY_DTYPES
        and dims in HEAD_DIMS
        and (kc.bits, vc.bits) in BITS
        and kc.group == dims
        and vc.group == dims
        and stored.rotation.permutation is None
        and stored.key_scales.dtype == mx.float16
        and stored.value_scales.dtype == mx.float16
    )


def partials(
    queries: mx.array,
    stored,
    params: mx.array,
    scale: mx.array,
    *,
    warps: int = WARPS,
    blocks: int | None = None,
    min_keys: int = MIN_KEYS_PER_SPLIT,
    read_only: bool | None = None,
    ahead: bool | None = None,
    per_sm: int | None = None,
    aligned: bool | None = None,
    prefetch: int | None = None,
    splits: int | None = None,
    table: mx.array | None = None,
    page_size: int = 0,
) -> tuple[mx.array, mx.array, mx.array]:
    """The split-K partials (``partial_acc``, ``partial_max``, ``partial_sum``) of the coded
    slots; ``splits`` forces the split count (tests), else ``num_splits`` for at most
    ``per_sm`` threadgroups per multiprocessor (default: as many as fit); ``aligned``
    forces the tables' layout (default: ``aligned_tables``). With ``table``, ``stored`` is
    batched storage (``paged.PagedStored``, ``params`` one row per sequence) read in pages of
    ``page_size`` slots, planned for its longest sequence."""
    batch, q_heads, _, dims = queries.shape
    kv_heads = stored.key_codes.shape[1]
    kc, vc = stored.key_codec, stored.value_codec
    heads = split_k.heads_per_block(q_heads // kv_heads, MAX_HEADS_PER_BLOCK)
    shape = gpu_shape()
    if aligned is None:
        aligned = aligned_tables(warps, heads, dims, shape)
    shared = shared_bytes(warps, heads, dims, aligned)
    blocks_per_split = batch * q_heads // heads
    if splits is None:
        resident = blocks_per_sm(shared, warps, shape)
        if per_sm is not None:
            resident = min(per_sm, resident)
        splits = num_splits(stored.length, blocks_per_split, shape.multiprocessors * resident, min_keys)
    if blocks is None:
        blocks = default_blocks(kc.bits, vc.bits, dims)
    threads = warps * 32
    launch = split_k.SplitKLaunch(
        heads=heads, n_splits=splits, grid=(threads * blocks_per_split, splits, 1), threadgroup=(threads, 1, 1),
        output_shapes=split_k.partial_shapes(batch, q_heads, splits, dims),
    )
    paged = table is not None
    return partials_kernel(shared, paged)(
        inputs=[
            queries, stored.rotation.signs, stored.key_codes, stored.key_scales, stored.value_codes,
            stored.value_scales, kc.book.levels_array(), vc.book.levels_array(), stored.recent_slots, params, scale,
            *((table,) if paged else ()),
        ],
        template=[
            ("T", queries.dtype), ("D", dims), ("KB", kc.bits), ("VB", vc.bits), ("HEADS", launch.heads),
            ("WARPS", warps), ("BLOCKS", blocks),
            ("READ_ONLY", READ_ONLY_LOADS if read_only is None else read_only),
            ("AHEAD", default_ahead(kc.bits, vc.bits, dims) if ahead is None else ahead), ("ALIGNED", aligned),
            ("PREFETCH", PREFETCH if prefetch is None else prefetch), *((("PAGE", page_size),) if paged else ()),
        ],
        grid=launch.grid,
        threadgroup=launch.threadgroup,
        output_shapes=launch.output_shapes,
        output_dtypes=launch.output_dtypes,
    )
