// What butter_core.kernels' CPU emulators of Metal (metal_emulator.h) and CUDA
// (cuda_emulator.h) share: a threadgroup's threads as fibers on one OS thread, each run
// until it waits at a barrier and then the next, in turn; warps (simdgroups) of 32
// exchanging values through a barrier; the threadgroup's barrier. Fibers rather than OS
// threads: a barrier of a 1024-thread group then costs a switch per thread, not a wake-up
// of each of 1024 OS threads sharing a few cores; and the order threads run in is the same
// on every run. A fiber starts through ucontext (its own stack) and switches through
// _setjmp/_longjmp, which save no signal mask: swapcontext makes a system call each switch.
#pragma once
#if defined(_FORTIFY_SOURCE) && _FORTIFY_SOURCE > 0
#error "build the emulator with -U_FORTIFY_SOURCE: glibc's checked longjmp refuses to switch stacks"
#endif
#if defined(__APPLE__) && !defined(_XOPEN_SOURCE)
#define _XOPEN_SOURCE 700  // macOS declares the ucontext functions only under it
#endif
#include <setjmp.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <vector>

// A barrier of `expected` threads, as std::barrier's arrive_and_wait and arrive_and_drop.
struct EmuBarrier {
  int expected;
  int arrived = 0;
  uint64_t phase = 0;
  explicit EmuBarrier(int n) : expected(n) {}
  void arrive_and_wait();
  void arrive_and_drop();
};
struct EmuWarp { EmuBarrier* bar; uint64_t v[32]; };

// One threadgroup being run: its threads' fibers, its barrier and its warps.
struct EmuFiber { ucontext_t context; jmp_buf resume; int index = 0; bool started = false; bool done = false; };
struct EmuGroupRun {
  ucontext_t scheduler;
  jmp_buf turn_ended;  // where a thread's turn returns to
  std::vector<EmuFiber> fibers;
  EmuBarrier group;
  std::vector<EmuBarrier> warp_barriers;
  std::vector<EmuWarp> warps;
  const std::function<void(int)>* fn;
  uint64_t arrivals = 0;  // barrier arrivals so far: a turn of every thread without one is a deadlock
  explicit EmuGroupRun(int threads) : fibers(threads), group(threads) {}
};
inline EmuGroupRun* emu_run;  // the threadgroup running now
inline EmuFiber* emu_fiber;   // its thread running now

// The running thread's place: its index in the threadgroup, lane, warp and group barrier.
inline int emu_thread_index() { return emu_fiber->index; }
#define emu_lane (static_cast<unsigned>(emu_thread_index()) % 32u)
#define emu_warp (&emu_run->warps[emu_thread_index() / 32])
#define emu_group (&emu_run->group)

// Hand the OS thread to the threadgroup's next thread (back here at this thread's next turn).
inline void emu_yield() {
  if (!_setjmp(emu_fiber->resume)) _longjmp(emu_run->turn_ended, 1);
}

inline void EmuBarrier::arrive_and_wait() {
  ++emu_run->arrivals;
  const uint64_t now = phase;
  if (++arrived == expected) {
    arrived = 0;
    ++phase;
    return;
  }
  while (phase == now) emu_yield();
}
inline void EmuBarrier::arrive_and_drop() {
  ++emu_run->arrivals;
  if (--expected > 0 && arrived == expected) {
    arrived = 0;
    ++phase;
  }
}

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

constexpr size_t EMU_STACK_BYTES = size_t(1) << 18;  // a thread's stack: its locals and the emulator's calls

// A fiber's stack, with an inaccessible page below it: a thread that overflows its stack
// faults there instead of writing over another's.
struct EmuStack {
  char* mapping;
  size_t guard;
  EmuStack() : guard(static_cast<size_t>(sysconf(_SC_PAGESIZE))) {
    void* p = mmap(nullptr, guard + EMU_STACK_BYTES, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) { std::perror("emulator: a thread's stack"); std::abort(); }
    mapping = static_cast<char*>(p);
    mprotect(mapping, guard, PROT_NONE);
  }
  ~EmuStack() { munmap(mapping, guard + EMU_STACK_BYTES); }
  EmuStack(const EmuStack&) = delete;
  EmuStack& operator=(const EmuStack&) = delete;
  char* base() const { return mapping + guard; }
};

inline void emu_fiber_main() {
  (*emu_run->fn)(emu_thread_index());
  emu_warp->bar->arrive_and_drop();
  emu_group->arrive_and_drop();
  emu_fiber->done = true;
  _longjmp(emu_run->turn_ended, 1);  // never resumed
}

// fn(t) for t = 0 .. threads - 1 as one threadgroup, its warps and its barrier in place
// (emu_lane, emu_warp, emu_group); returns when all have ended.
inline void emu_run_group(int threads, const std::function<void(int)>& fn) {
  static std::vector<std::unique_ptr<EmuStack>> stacks;  // kept for the next threadgroup
  while (stacks.size() < static_cast<size_t>(threads)) stacks.push_back(std::make_unique<EmuStack>());
  EmuGroupRun run(threads);
  const int warps = (threads + 31) / 32;
  run.warp_barriers.reserve(warps);
  for (int w = 0; w < warps; ++w) {
    run.warp_barriers.emplace_back(std::min(32, threads - 32 * w));
    run.warps.push_back(EmuWarp{&run.warp_barriers.back(), {}});
  }
  run.fn = &fn;
  for (int t = 0; t < threads; ++t) {
    EmuFiber& f = run.fibers[t];
    f.index = t;
    getcontext(&f.context);
    f.context.uc_stack.ss_sp = stacks[t]->base();
    f.context.uc_stack.ss_size = EMU_STACK_BYTES;
    f.context.uc_link = &run.scheduler;
    makecontext(&f.context, emu_fiber_main, 0);
  }
  EmuGroupRun* outer = emu_run;
  emu_run = &run;
  for (int alive = threads; alive > 0;) {
    const uint64_t arrivals = run.arrivals;
    for (EmuFiber& f : run.fibers) {
      if (f.done) continue;
      emu_fiber = &f;
      if (!_setjmp(run.turn_ended)) {
        if (f.started) _longjmp(f.resume, 1);
        f.started = true;
        swapcontext(&run.scheduler, &f.context);
      }
      alive -= f.done;
    }
    if (alive > 0 && run.arrivals == arrivals) {
      std::fprintf(stderr, "emulator: %d threads of a threadgroup wait at barriers no other thread will reach\n", alive);
      std::abort();
    }
  }
  emu_run = outer;
}
