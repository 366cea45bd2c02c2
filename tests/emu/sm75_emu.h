// A small CPU emulator for the SIMT subset the SM75 kernels use, so their index and fragment
// logic can be tested on a machine without a GPU.
//
// Every CUDA thread of a CTA runs as a cooperative fiber (ucontext) on one OS thread. Fibers
// switch only at synchronisation points: __syncthreads (block barrier) and the warp collectives
// (ldmatrix, mma.sync, shuffles; see emu_utils.h), which exchange per-lane operands through a
// per-warp buffer and a warp barrier, then compute each lane's result exactly as the PTX ISA
// specifies the fragment layouts. The order in which runnable fibers are resumed is shuffled with
// a seed, so a missing __syncthreads shows up as a wrong result for some seeds (shared memory is
// poisoned with NaNs at each CTA start).
//
// Not modelled: timing, memory-model subtleties beyond barriers, mma accumulation rounding (fp32
// FMA order here), fast-math approximations. Kernel code is compiled unchanged with a host
// compiler; only utils.h (the inline PTX) is replaced by emu_utils.h.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <vector>

// ---- CUDA keywords -> host C++ ---------------------------------------------------------------
#undef __global__
#undef __device__
#undef __host__
#undef __forceinline__
#undef __shared__
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__
#define __launch_bounds__(...)

namespace flash_sm75 {
// The kernels' `extern __shared__ unsigned char smem_raw[]` (block-scope extern declarations in
// namespace flash_sm75) refer to this buffer.
extern unsigned char smem_raw[];
}

namespace emu {

constexpr int kMaxSmem = 64 * 1024;
constexpr size_t kStackBytes = 256 * 1024;

struct Barrier {
  int n = 0;
  int count = 0;
  uint64_t gen = 0;
};

struct Fiber {
  ucontext_t ctx;
  int tid = 0;
  bool done = false;
  const Barrier* waiting_on = nullptr;  // runnable again once waiting_on->gen != wait_gen
  uint64_t wait_gen = 0;
  std::vector<char> stack;
};

struct WarpState {
  Barrier bar;
  uint32_t buf[2][32][4];
};

struct Uint3 {
  unsigned x, y, z;
};

struct Machine {
  ucontext_t sched;
  std::vector<Fiber> fibers;
  std::vector<WarpState> warps;
  Barrier block_bar;
  int cur = -1;
  Uint3 block_idx{0, 0, 0};
  const std::function<void()>* body = nullptr;
  std::mt19937 rng{12345};
  uint64_t switches = 0;
};

inline Machine& machine() {
  static Machine m;
  return m;
}

inline Fiber& self() { return machine().fibers[machine().cur]; }
inline int tid() { return self().tid; }
inline int lane() { return tid() % 32; }
inline WarpState& warp() { return machine().warps[tid() / 32]; }

inline void yield_to_scheduler() {
  Machine& m = machine();
  ++m.switches;
  swapcontext(&m.fibers[m.cur].ctx, &m.sched);
}

inline void barrier_wait(Barrier& b) {
  const uint64_t g = b.gen;
  if (++b.count == b.n) {
    b.count = 0;
    ++b.gen;
    return;
  }
  Fiber& f = self();
  f.waiting_on = &b;
  f.wait_gen = g;
  yield_to_scheduler();
  f.waiting_on = nullptr;
}

inline void syncthreads() { barrier_wait(machine().block_bar); }
inline void syncwarp() { barrier_wait(warp().bar); }

// Warp collective: each lane posts up to 4 words, waits for the whole warp, and gets a pointer
// to the 32 lanes' posts (valid until the lane's next collective).
inline const uint32_t (*warp_exchange(const uint32_t* in, int n))[4] {
  WarpState& w = warp();
  const int slot = static_cast<int>(w.bar.gen & 1);
  for (int i = 0; i < n; ++i) w.buf[slot][lane()][i] = in[i];
  barrier_wait(w.bar);
  return w.buf[slot];
}

inline void fiber_entry() {
  Machine& m = machine();
  (*m.body)();
  m.fibers[m.cur].done = true;
  swapcontext(&m.fibers[m.cur].ctx, &m.sched);
}

// Runs one CTA of `nthreads` threads executing `body`.
inline void run_block(Uint3 block_idx, int nthreads, const std::function<void()>& body) {
  Machine& m = machine();
  if (nthreads % 32 != 0) {
    std::fprintf(stderr, "emu: block size must be a multiple of 32\n");
    std::abort();
  }
  m.block_idx = block_idx;
  m.body = &body;
  m.fibers.resize(nthreads);
  m.warps.assign(nthreads / 32, WarpState{});
  for (auto& w : m.warps) w.bar.n = 32;
  m.block_bar = Barrier{};
  m.block_bar.n = nthreads;
  std::memset(flash_sm75::smem_raw, 0xff, kMaxSmem);  // fp16/fp32 NaN poison
  for (int i = 0; i < nthreads; ++i) {
    Fiber& f = m.fibers[i];
    f.tid = i;
    f.done = false;
    f.waiting_on = nullptr;
    f.stack.resize(kStackBytes);
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = f.stack.data();
    f.ctx.uc_stack.ss_size = f.stack.size();
    f.ctx.uc_link = nullptr;
    makecontext(&f.ctx, fiber_entry, 0);
  }
  // Two schedules, picked at random per CTA: round-robin over all threads in a shuffled order,
  // or "greedy warps": the warps get a random priority (redrawn at every block barrier) and
  // the highest-priority warp with a runnable thread runs until all its threads block, so one
  // warp runs as far ahead of the others as the block barriers allow. The latter exposes a
  // missing __syncthreads (a read of shared memory another warp has not written yet: NaN poison
  // or stale data).
  const bool greedy = std::uniform_int_distribution<int>(0, 1)(m.rng) == 1;
  const int nwarps = nthreads / 32;
  std::vector<int> order(nthreads), warp_order(nwarps), lane_order(32);
  for (int i = 0; i < nthreads; ++i) order[i] = i;
  for (int i = 0; i < nwarps; ++i) warp_order[i] = i;
  for (int i = 0; i < 32; ++i) lane_order[i] = i;
  uint64_t prio_gen = ~uint64_t(0);
  int remaining = nthreads;
  auto runnable = [&](const Fiber& f) {
    return !f.done && (f.waiting_on == nullptr || f.waiting_on->gen != f.wait_gen);
  };
  auto resume = [&](int i) {
    m.cur = i;
    swapcontext(&m.sched, &m.fibers[i].ctx);
    if (m.fibers[i].done) --remaining;
  };
  while (remaining > 0) {
    bool progressed = false;
    if (greedy) {
      if (m.block_bar.gen != prio_gen) {
        prio_gen = m.block_bar.gen;
        std::shuffle(warp_order.begin(), warp_order.end(), m.rng);
      }
      for (int w : warp_order) {
        std::shuffle(lane_order.begin(), lane_order.end(), m.rng);
        for (int l : lane_order) {
          if (runnable(m.fibers[w * 32 + l])) {
            resume(w * 32 + l);
            progressed = true;
          }
        }
        if (progressed) break;
      }
    } else {
      std::shuffle(order.begin(), order.end(), m.rng);
      for (int i : order) {
        if (runnable(m.fibers[i])) {
          resume(i);
          progressed = true;
        }
      }
    }
    if (!progressed) {
      std::fprintf(stderr, "emu: deadlock (a barrier some threads never reach)\n");
      std::abort();
    }
  }
  m.cur = -1;
}

// Runs a grid of CTAs in a shuffled order.
inline void launch(unsigned grid_x, int nthreads, const std::function<void()>& body) {
  std::vector<unsigned> blocks(grid_x);
  for (unsigned i = 0; i < grid_x; ++i) blocks[i] = i;
  std::shuffle(blocks.begin(), blocks.end(), machine().rng);
  for (unsigned b : blocks) run_block(Uint3{b, 0, 0}, nthreads, body);
}

inline Uint3 thread_idx() { return Uint3{static_cast<unsigned>(tid()), 0, 0}; }
inline Uint3 block_idx() { return machine().block_idx; }

inline float shfl_xor(float v, int mask) {
  uint32_t in;
  std::memcpy(&in, &v, 4);
  auto all = warp_exchange(&in, 1);
  float out;
  std::memcpy(&out, &all[lane() ^ mask][0], 4);
  return out;
}
inline uint32_t shfl_xor(uint32_t v, int mask) {
  auto all = warp_exchange(&v, 1);
  return all[lane() ^ mask][0];
}

// The L2 prefetch's allowed ranges (prefetch_l2, emu_utils.h): the K and V tensors of the
// launch being run (the harness sets them from the params; empty: no check).
struct ByteRange {
  const unsigned char* lo;
  const unsigned char* hi;
};
inline std::vector<ByteRange>& prefetch_ranges() {
  static std::vector<ByteRange> r;
  return r;
}
inline void check_prefetch(const void* p) {
  const auto* b = static_cast<const unsigned char*>(p);
  if (prefetch_ranges().empty()) return;
  for (const ByteRange& r : prefetch_ranges()) {
    if (b >= r.lo && b < r.hi) return;
  }
  std::fprintf(stderr, "emu: L2 prefetch of an address outside K and V\n");
  std::abort();
}

}  // namespace emu

#define threadIdx (::emu::thread_idx())
#define blockIdx (::emu::block_idx())
#define __syncthreads() ::emu::syncthreads()
#define __syncwarp(...) ::emu::syncwarp()
#define __shfl_xor_sync(mask, v, lanemask) ::emu::shfl_xor((v), (lanemask))

template <typename T>
inline T __ldg(const T* p) {
  return *p;
}
inline float atomicAdd(float* p, float v) {
  const float old = *p;
  *p = old + v;
  return old;
}
// Round-to-nearest product that the compiler may not fuse into an FMA (-std=c++17 keeps
// -ffp-contract=off, so a plain product is one).
inline float __fmul_rn(float a, float b) { return a * b; }
// div.approx.f32 computes a * (1 / b); 1 / inf = 0 as on the GPU.
inline float __fdividef(float a, float b) { return a * (1.f / b); }
inline float __uint_as_float(unsigned int u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
