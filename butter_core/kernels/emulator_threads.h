// What butter_core.kernels' CPU emulators of Metal (metal_emulator.h) and CUDA
// (cuda_emulator.h) share: a threadgroup's threads as OS threads, run together; warps
// (simdgroups) of 32 exchanging values through a barrier; the threadgroup's barrier.
#pragma once
#include <algorithm>
#include <barrier>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

struct EmuWarp { std::barrier<>* bar; uint64_t v[32]; };
thread_local EmuWarp* emu_warp;
thread_local std::barrier<>* emu_group;
thread_local unsigned emu_lane;

// Lane `src`'s v, for every lane of the warp (each must call it).
template <typename T> inline T emu_exchange(T v, unsigned src) {
  static_assert(sizeof(T) <= 8, "an exchanged value fits 8 bytes");
  uint64_t bits = 0; std::memcpy(&bits, &v, sizeof(T));
  emu_warp->v[emu_lane] = bits;
  emu_warp->bar->arrive_and_wait();
  const uint64_t r = emu_warp->v[src & 31];
  emu_warp->bar->arrive_and_wait();
  T out; std::memcpy(&out, &r, sizeof(T)); return out;
}
// Whether p holds in any lane of the warp (each must call it).
inline bool emu_any(bool p) {
  emu_warp->v[emu_lane] = p;
  emu_warp->bar->arrive_and_wait();
  bool r = false;
  for (int i = 0; i < 32; ++i) r = r || emu_warp->v[i];
  emu_warp->bar->arrive_and_wait();
  return r;
}

// fn(t) for t = 0 .. threads - 1, each on its own thread, all at once: one threadgroup,
// its warps and its barrier in place (emu_warp, emu_group, emu_lane); returns when all end.
inline void emu_run_group(int threads, const std::function<void(int)>& fn) {
  std::barrier<> group(threads);
  const int warps = (threads + 31) / 32;
  std::vector<EmuWarp> ws(warps);
  std::vector<std::unique_ptr<std::barrier<>>> bars;
  for (int w = 0; w < warps; ++w) {
    bars.push_back(std::make_unique<std::barrier<>>(std::min(32, threads - 32 * w)));
    ws[w].bar = bars.back().get();
  }
  std::vector<std::thread> ts;
  for (int t = 0; t < threads; ++t) {
    ts.emplace_back([&, t] {
      emu_lane = t % 32; emu_warp = &ws[t / 32]; emu_group = &group;
      fn(t);
      emu_warp->bar->arrive_and_drop();
      emu_group->arrive_and_drop();
    });
  }
  for (auto& th : ts) th.join();
}
