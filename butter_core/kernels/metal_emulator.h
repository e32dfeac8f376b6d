// butter_core.kernels.metal_emulator: the Metal that butter's dialect uses, emulated in C++20
// on the CPU. One fiber per Metal thread, threadgroups one after another (emulator_threads.h);
// simdgroup exchanges and threadgroup barriers through its barriers; half is _Float16 (GCC 12+),
// bfloat16_t rounds to nearest even as Metal 3.1's bfloat. Address spaces mean nothing here.
#pragma once
#define BT_EMULATED
#include <cmath>
#include <limits>
#include "emulator_threads.h"
typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;
struct uint2 { uint x, y; };
struct uint3 { uint x, y, z; };
struct uint4 { uint x, y, z, w; };
typedef _Float16 half;
struct half2 {
  half x, y;
  half2() = default;
  half2(half a, half b) : x(a), y(b) {}
};
typedef half float16_t;
struct bfloat16_t {
  uint16_t bits;
  bfloat16_t() = default;
  bfloat16_t(float f) {
    uint32_t u; std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffff) > 0x7f800000) { bits = 0x7fc0; return; }
    u += 0x7fff + ((u >> 16) & 1);  // round to nearest even
    bits = (uint16_t)(u >> 16);
  }
  operator float() const { uint32_t u = (uint32_t)bits << 16; float f; std::memcpy(&f, &u, 4); return f; }
};
template <typename T, typename U> T as_type(U x) {
  static_assert(sizeof(T) == sizeof(U), "as_type needs types of one size");
  T t; std::memcpy(&t, &x, sizeof(T)); return t;
}
namespace metal {
inline float exp(float x) { return std::exp(x); }
inline float exp2(float x) { return std::exp2(x); }
inline float sqrt(float x) { return std::sqrt(x); }
inline float rint(float x) { return std::rint(x); }
inline float fmax(float a, float b) { return std::fmax(a, b); }
inline float fma(float a, float b, float c) { return std::fma(a, b, c); }
inline half fma(half a, half b, half c) { return (half)((double)a * (double)b + (double)c); }  // exact, rounded once
inline half2 fma(half2 a, half2 b, half2 c) { return half2(fma(a.x, b.x, c.x), fma(a.y, b.y, c.y)); }
template <typename T> using numeric_limits = std::numeric_limits<T>;
}  // namespace metal
enum class mem_flags { mem_none, mem_device, mem_threadgroup };

// The running threadgroup's attributes (threadgroups run one after another), and the running
// thread's, from its index in the threadgroup.
inline uint3 emu_tg_pos, emu_tg_size, emu_tgs, emu_tg_origin;
inline uint3 emu_thread_pos_in_tg() {
  const uint t = emu_thread_index();
  return {t % emu_tg_size.x, (t / emu_tg_size.x) % emu_tg_size.y, t / (emu_tg_size.x * emu_tg_size.y)};
}
inline uint3 emu_thread_pos() {
  const uint3 p = emu_thread_pos_in_tg();
  return {emu_tg_origin.x + p.x, emu_tg_origin.y + p.y, emu_tg_origin.z + p.z};
}
#define emu_pos_in_tg emu_thread_pos_in_tg()
#define emu_pos emu_thread_pos()
#define emu_index static_cast<uint>(emu_thread_index())
#define emu_simd_index static_cast<uint>(emu_thread_index() / 32)

template <typename T> inline T simd_shuffle(T v, ushort src) { return emu_exchange(v, src); }
template <typename T> inline T simd_shuffle_xor(T v, ushort mask) { return emu_exchange(v, emu_lane ^ mask); }
inline float emu_reduce(float v, bool max) {
  emu_warp->v[emu_lane] = 0; std::memcpy(&emu_warp->v[emu_lane], &v, 4);
  emu_warp->bar->arrive_and_wait();
  float r = 0; bool first = true;
  for (int i = 0; i < 32; ++i) { float x; std::memcpy(&x, &emu_warp->v[i], 4); r = first ? x : (max ? std::max(r, x) : r + x); first = false; }
  emu_warp->bar->arrive_and_wait();
  return r;
}
inline float simd_sum(float v) { return emu_reduce(v, false); }
inline float simd_max(float v) { return emu_reduce(v, true); }
inline bool simd_any(bool p) { return emu_any(p); }
inline void threadgroup_barrier(mem_flags) { emu_group->arrive_and_wait(); }

// Metal's dispatchThreads(grid, group): threadgroups of `group` threads cover `grid` threads.
inline void emu_dispatch(uint3 grid, uint3 group, const std::function<void()>& fn) {
  const uint3 tgs{(grid.x + group.x - 1) / group.x, (grid.y + group.y - 1) / group.y, (grid.z + group.z - 1) / group.z};
  for (uint z = 0; z < tgs.z; ++z) for (uint y = 0; y < tgs.y; ++y) for (uint x = 0; x < tgs.x; ++x) {
    // The threadgroup at the grid's edge may be partial (non-uniform dispatch).
    const uint3 size{std::min(group.x, grid.x - x * group.x), std::min(group.y, grid.y - y * group.y), std::min(group.z, grid.z - z * group.z)};
    emu_tg_pos = {x, y, z}; emu_tg_size = size; emu_tgs = tgs;
    emu_tg_origin = {x * group.x, y * group.y, z * group.z};
    emu_run_group(size.x * size.y * size.z, [&](int) { fn(); });
  }
}
// Metal's address spaces mean nothing here (defined last: std::thread is a name).
#define device
#define constant
#define thread
#define threadgroup
