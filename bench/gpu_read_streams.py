"""How fast the GPU serves the reads of an affine4 decode step, by how they are laid out.

The affine tensor-core kernel reads 168 MB at 128k (affine4: 64-byte code rows and 8 bytes
each of scales and biases per K and V row) at ~2.6 TB/s, where SDPA reads raw bf16 at ~4,
and neither more warps nor deeper load queues change that (docs/benchmarks.md). This
times a kernel that only reads, with the decode kernel's threadgroups (264 of 4 warps,
each owning a contiguous run of rows, warps taking 32-row steps in turn), in three
layouts of the same bytes:

* ``six streams, 2-byte loads``: codes and the four scale/bias arrays apart, the
  scales and biases read as the decode kernel reads them (24 two-byte loads per lane
  and step);
* ``six streams, 16-byte loads``: the same arrays, scales and biases read as whole
  16-byte pieces;
* ``two streams``: each K and V row's codes, scales and biases together (80 bytes).

Side by side with raw SDPA (``gpu_timing.side_by_side``), batch 1, 8 KV heads, 131072
positions. The calls are independent, so consecutive ones overlap on the GPU, and this
light kernel (no shared memory, few registers) overlaps far more than the decode kernel:
its times compare layouts with each other, not with one decode call (docs/benchmarks.md). Usage: ``python3 bench/gpu_read_streams.py`` (on the lent H200, as the other
GPU benches).
"""

from __future__ import annotations

import mlx.core as mx

from butter_core.kernels import Kernel
from gpu_timing import CALLS, print_side_by_side, side_by_side

ROWS = 8 * 131072
"""K (and V) rows: 8 KV heads at 128k."""
CODE_WORDS, GROUPS = 16, 4
"""affine4, head_dim 128, group 32: 16 words of codes and 4 scales (and 4 biases) per row."""
THREADGROUPS, WARPS = 264, 4
MODES = {"six streams, 2-byte loads": 0, "six streams, 16-byte loads": 1, "two streams": 2}

_PROBE = Kernel(
    name="butter_bench_read_streams",
    input_names=("k_codes", "v_codes", "k_scales", "k_biases", "v_scales", "v_biases", "k_rows", "v_rows"),
    output_names=("out",),
    body="""
  // Template: MODE (0: six streams, 2-byte scale loads; 1: six streams, 16-byte loads;
  // 2: two streams of 80-byte rows), ROWS, PER_BLOCK (rows per threadgroup).
  const int g = lane_id / 4;
  const int t = lane_id % 4;
  const int64_t start = static_cast<int64_t>(block_idx.x) * PER_BLOCK;
  const int64_t end = start + PER_BLOCK < ROWS ? start + PER_BLOCK : ROWS;
  uint32_t acc = 0u;
  for (int64_t base = start + warp_id * 32; base + 32 <= end; base += 4 * 32) {
    // Codes (MODE 0, 1: 4 x 16 bytes per row) or whole rows (MODE 2: 5 x 16 bytes).
    constexpr int CHUNKS = MODE == 2 ? 5 : 4;
    const uint4* k = reinterpret_cast<const uint4*>(MODE == 2 ? k_rows : k_codes) + base * CHUNKS;
    const uint4* v = reinterpret_cast<const uint4*>(MODE == 2 ? v_rows : v_codes) + base * CHUNKS;
#pragma unroll
    for (int i = 0; i < CHUNKS; ++i) {
      const uint4 a = bt_read(k + i * 32 + lane_id);
      const uint4 b = bt_read(v + i * 32 + lane_id);
      acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w;
    }
    if (MODE == 0) {
#pragma unroll
      for (int blk = 0; blk < 2; ++blk) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {  // keys g, g + 8: group t
          const int64_t row = base + 16 * blk + 8 * h + g;
          acc ^= bt_read(k_scales + row * 4 + t) ^ (bt_read(k_biases + row * 4 + t) << 16);
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) {  // keys 2t, 2t + 1, 2t + 8, 2t + 9: group g / 2
          const int64_t row = base + 16 * blk + 2 * t + (i & 1) + 8 * (i >> 1);
          acc ^= bt_read(v_scales + row * 4 + g / 2) ^ (bt_read(v_biases + row * 4 + g / 2) << 16);
        }
      }
    } else if (MODE == 1 && lane_id < 16) {  // 4 arrays x 256 bytes: lane l takes 16 bytes of each
      const uint4 a = bt_read(reinterpret_cast<const uint4*>(k_scales + base * 4) + lane_id);
      const uint4 b = bt_read(reinterpret_cast<const uint4*>(k_biases + base * 4) + lane_id);
      const uint4 c = bt_read(reinterpret_cast<const uint4*>(v_scales + base * 4) + lane_id);
      const uint4 d = bt_read(reinterpret_cast<const uint4*>(v_biases + base * 4) + lane_id);
      acc ^= a.x ^ b.y ^ c.z ^ d.w;
    }
  }
  out[block_idx.x * (4 * 32) + thread_rank] = acc;
""",
)


def arrays(seed: int) -> list[mx.array]:
    """One copy of every input, in ``_PROBE``'s order (the two layouts hold the same bytes)."""
    sizes = [(ROWS * CODE_WORDS, mx.uint32)] * 2 + [(ROWS * GROUPS, mx.uint16)] * 4
    sizes += [(ROWS * (CODE_WORDS + GROUPS), mx.uint32)] * 2
    out = [mx.random.randint(0, 1 << 15, (n,), key=mx.random.key(8 * seed + i)).astype(dtype)
           for i, (n, dtype) in enumerate(sizes)]
    mx.eval(out)
    return out


def probe(inputs: list[mx.array], mode: int) -> mx.array:
    per_block = -(-ROWS // THREADGROUPS // 128) * 128
    (out,) = _PROBE(
        inputs=inputs,
        template=[("MODE", mode), ("ROWS", ROWS), ("PER_BLOCK", per_block)],
        grid=(THREADGROUPS * WARPS * 32, 1, 1),
        threadgroup=(WARPS * 32, 1, 1),
        output_shapes=[(THREADGROUPS * WARPS * 32,)],
        output_dtypes=[mx.uint32],
    )
    return out


def main() -> None:
    mx.set_default_device(mx.gpu)
    copies = [arrays(seed) for seed in range(2)]
    q = mx.random.normal((1, 32, 1, 128)).astype(mx.bfloat16)
    raw = [tuple(mx.random.normal((1, 8, ROWS // 8, 128)).astype(mx.bfloat16) for _ in range(2))]
    mx.eval(q, raw)
    builds = {"raw bf16 SDPA (537 MB)": lambda: [mx.fast.scaled_dot_product_attention(
        q, *raw[0], scale=0.088) for _ in range(CALLS)]}
    for label, mode in MODES.items():
        builds[f"{label} (168 MB)"] = lambda mode=mode: [probe(copies[i % 2], mode) for i in range(CALLS)]
        mx.eval(builds[f"{label} (168 MB)"]()[:1])
    print_side_by_side(side_by_side(builds, rounds=5), "128k")


if __name__ == "__main__":
    main()
