// butter_core.kernels.cuda_emulator: the CUDA that butter's dialect and kernels use,
// emulated in C++20 on the CPU. One fiber per CUDA thread, blocks one after another
// (emulator_threads.h); warp shuffles, votes and __syncthreads through its barriers; __half is _Float16 (GCC
// 12+), __nv_bfloat16 rounds to nearest even. __CUDA_ARCH__ is not defined, so kernels'
// inline PTX takes its portable branch; the dialect's tensor-core vocabulary is replaced
// by software (cuda_emulator.py).
#pragma once
#define BT_EMULATED_CUDA
#include <cmath>
#include <limits>
#include "emulator_threads.h"
#define __device__
#define __forceinline__ inline
#define __shared__ static  // blocks run one after another; a block's threads share statics
struct uint2 { unsigned x, y; };
struct uint3 { unsigned x, y, z; };
struct uint4 { unsigned x, y, z, w; };
inline uint3 make_uint3(unsigned x, unsigned y, unsigned z) { return {x, y, z}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
struct __half {
  _Float16 v;
  __half() = default;
  explicit __half(float f) : v(static_cast<_Float16>(f)) {}
};
struct __nv_bfloat16 {
  uint16_t bits;
};
inline float __half2float(__half h) { return static_cast<float>(h.v); }
inline __half __float2half_rn(float f) { return __half(f); }
inline float __bfloat162float(__nv_bfloat16 b) {
  uint32_t u = static_cast<uint32_t>(b.bits) << 16; float f; std::memcpy(&f, &u, 4); return f;
}
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  uint32_t u; std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffff) > 0x7f800000) return {0x7fc0};
  u += 0x7fff + ((u >> 16) & 1);  // round to nearest even
  return {static_cast<uint16_t>(u >> 16)};
}
inline float __expf(float x) { return std::exp(x); }
inline float __uint_as_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline uint32_t __byte_perm(uint32_t x, uint32_t y, uint32_t s) {
  uint32_t r = 0;
  for (int n = 0; n < 4; ++n) {
    const uint32_t i = (s >> (4 * n)) & 7u;
    r |= ((i < 4 ? x >> (8 * i) : y >> (8 * (i - 4))) & 0xFFu) << (8 * n);
  }
  return r;
}
template <typename T> inline T __ldg(const T* p) { return *p; }
template <typename T> inline T min(T a, T b) { return b < a ? b : a; }  // CUDA's device min/max
template <typename T> inline T max(T a, T b) { return a < b ? b : a; }
namespace cuda { namespace std { template <typename T> using numeric_limits = ::std::numeric_limits<T>; } }

// The running block's (blocks run one after another), and the running thread's index, from
// its place in the block.
inline uint3 blockIdx, blockDim, gridDim;
inline unsigned char* emu_dynamic_shared;
inline uint3 emu_thread_idx() {
  const unsigned t = emu_thread_index();
  return {t % blockDim.x, (t / blockDim.x) % blockDim.y, t / (blockDim.x * blockDim.y)};
}
#define threadIdx emu_thread_idx()

template <typename T> inline T __shfl_sync(unsigned, T v, int src) { return emu_exchange(v, static_cast<unsigned>(src)); }
template <typename T> inline T __shfl_xor_sync(unsigned, T v, int mask) { return emu_exchange(v, emu_lane ^ static_cast<unsigned>(mask)); }
inline bool __any_sync(unsigned, bool p) { return emu_any(p); }
inline void __syncthreads() { emu_group->arrive_and_wait(); }

// A launch as MLX makes it: `grid` counts threads; blocks of min(group, grid) threads,
// ceil(grid / group) of them along each axis; `shared` bytes of dynamic shared memory.
inline void emu_dispatch(uint3 grid, uint3 group, unsigned shared, const std::function<void()>& fn) {
  const uint3 block{std::min(group.x, grid.x), std::min(group.y, grid.y), std::min(group.z, grid.z)};
  const uint3 blocks{(grid.x + group.x - 1) / group.x, (grid.y + group.y - 1) / group.y, (grid.z + group.z - 1) / group.z};
  std::vector<uint4> dynamic((shared + 15) / 16 + 1);
  for (unsigned z = 0; z < blocks.z; ++z) for (unsigned y = 0; y < blocks.y; ++y) for (unsigned x = 0; x < blocks.x; ++x) {
    blockIdx = {x, y, z}; blockDim = block; gridDim = blocks;
    emu_dynamic_shared = reinterpret_cast<unsigned char*>(dynamic.data());
    emu_run_group(block.x * block.y * block.z, [&](int) { fn(); });
  }
}
