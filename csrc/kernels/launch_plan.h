// Host-side launch planning: grid size, threads and shared memory for a problem. Plain C++
// (no device code) so the GoogleTest suite checks it without a GPU.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>

#include "kernel_traits.h"

namespace flash_sm75 {

// A GPU the launch decisions are planned for (FLASH_SM75_DEVICE_PROFILE, flash_api.cpp): the
// forward's tile choice (prefer_small_grid_tile) and the decode kernel's key splits
// (plan_decode) depend on the SM count and on how many CTAs of a kernel an SM holds. A Turing
// profile makes them as that GPU would on any GPU (the benchmarks' headline on the H200 runs
// exactly the launches a T4 runs, apart from how many SMs execute the grid).
struct DeviceProfile {
  const char* name;
  int num_sms;
  int smem_per_sm;       // bytes of shared memory an SM gives its CTAs (Turing: 64 KiB)
  int threads_per_sm;
  int regs_per_sm;
  int max_ctas_per_sm;
};
// Compute capability 7.5 (CUDA occupancy data): 64 KiB shared memory per SM with the opt-in,
// 1024 threads, 64K registers, 16 CTAs per SM. T4: 40 SMs; RTX 2080 Ti: 68. Inline: one object
// in the whole program (planning_profile() returns their addresses).
inline constexpr DeviceProfile kProfileT4{"t4", 40, 64 * 1024, 1024, 64 * 1024, 16};
inline constexpr DeviceProfile kProfileRtx2080Ti{"rtx2080ti", 68, 64 * 1024, 1024, 64 * 1024, 16};
// Flash_fwd_params::plan_profile indexes this: 0 = the device itself (no profile).
inline constexpr const DeviceProfile* kDeviceProfiles[] = {nullptr, &kProfileT4, &kProfileRtx2080Ti};

// Resident CTAs per SM of a kernel (threads per CTA, registers per thread, shared memory per
// CTA in bytes, static + dynamic) on `dev`, by compute capability 7.5's allocation rules:
// registers in units of 256 per warp, shared memory in units of 256 bytes, no reserved shared
// memory per CTA. 0 when the CTA does not fit at all.
inline int ctas_per_sm(const DeviceProfile& dev, int threads, int regs_per_thread,
                       int smem_per_cta) {
  if (threads <= 0) return 0;
  const int warps = (threads + 31) / 32;
  const int regs_per_warp = ((regs_per_thread > 0 ? regs_per_thread : 1) * 32 + 255) / 256 * 256;
  int n = dev.max_ctas_per_sm;
  const int by_threads = dev.threads_per_sm / (warps * 32);
  const int by_regs = dev.regs_per_sm / regs_per_warp / warps;
  n = n < by_threads ? n : by_threads;
  n = n < by_regs ? n : by_regs;
  if (smem_per_cta > 0) {
    const int by_smem = dev.smem_per_sm / ((smem_per_cta + 255) / 256 * 256);
    n = n < by_smem ? n : by_smem;
  }
  return n;
}

struct FwdLaunchPlan {
  int block_m;          // query rows per CTA
  int block_n;          // keys per K/V tile
  int num_m_blocks;     // ceil(seqlen_q / block_m)
  int64_t num_blocks;   // CTAs in the 1-D grid: num_m_blocks * b * h
  int num_threads;      // threads per CTA
  int smem_bytes;       // dynamic shared memory per CTA
};

template <typename Kt>
inline FwdLaunchPlan make_fwd_plan(int b, int h, int seqlen_q) {
  FwdLaunchPlan p;
  p.block_m = Kt::kBlockM;
  p.block_n = Kt::kBlockN;
  // In 64 bits: seqlen_q + kBlockM - 1 overflows int for seqlen_q near 2^31.
  p.num_m_blocks = static_cast<int>((static_cast<int64_t>(seqlen_q) + Kt::kBlockM - 1) / Kt::kBlockM);
  p.num_blocks = static_cast<int64_t>(p.num_m_blocks) * b * h;
  p.num_threads = Kt::kNThreads;
  p.smem_bytes = Kt::kSmemSize;
  // gridDim.x is limited to 2^31 - 1 CTAs.
  if (p.num_blocks > INT32_MAX) {
    throw std::invalid_argument("flash_attention_sm75: batch * heads * ceil(seqlen_q / " +
                                std::to_string(Kt::kBlockM) + ") = " +
                                std::to_string(p.num_blocks) + " exceeds the 2^31-1 grid limit");
  }
  return p;
}

// Forward grids just over one wave: take the small-grid tile (more CTAs per SM) when it runs
// the whole grid in one wave and the default tile needs more than one. *_slots = resident CTAs
// per SM x SMs (0 = unknown, which keeps the default tile).
inline bool prefer_small_grid_tile(int64_t default_blocks, int64_t default_slots,
                                   int64_t small_blocks, int64_t small_slots) {
  return default_slots > 0 && small_slots > 0 && default_blocks > default_slots &&
         small_blocks <= small_slots;
}

// Decode (seqlen_q == 1, flash_decode_kernel.h): one CTA of 4 warps per (batch, kv head, head
// part, key split) runs up to decode_max_heads_per_cta q-heads of the kv head together (GQA
// packing: K/V read once per CTA, so once per kv head when the group fits one part) on CUDA
// cores; the splits of a row are merged by a second kernel. The key range is cut into
// num_splits chunks of keys_per_split keys (a multiple of the 128 keys a CTA takes per step)
// so that the grid holds ~4 CTAs per SM when the keys allow it. Up to min_steps_to_split steps
// (1024 keys by default) a CTA takes all keys: the merge launch and its workspace cost more host
// time (~10 us measured on the H200) than the split saves on the GPU.
constexpr int kDecodeKeysPerStep = 128;
constexpr int kDecodeMaxSplits = 64;

// q-heads one decode CTA holds (its kR) at head-dim bucket kd: each lane keeps kR x kd / 32 fp32
// outputs and kR scores in registers. The largest power of two with 0 spills under 255
// registers (scripts/check_sm75.py): kR = 16 uses 198 / 255 registers at kd = 64 / 128, kR = 8
// 254 at kd = 256 (its P V loop not unrolled; kR = 16 there would need 128 fp32 outputs).
constexpr int decode_max_heads_per_cta(int kd) { return kd <= 128 ? 16 : 8; }

// (query, q-head) rows per kv head up to which the KV-cache op runs several query rows on the
// decode kernel (two head parts of CTAs; beyond, the CUDA-core arithmetic of the rows outgrows
// the prefill kernels' tensor cores): plan_decode's max_multi_rows.
constexpr int decode_max_multi_rows(int kd) { return 2 * decode_max_heads_per_cta(kd); }

struct DecodePlan {
  bool use;            // seqlen_q == 1 (and not disabled)
  int ratio_bucket;    // kR, q-heads per CTA (compile time): the smallest power of two >= h / h_k,
                       // at most decode_max_heads_per_cta(kd)
  int head_parts;      // CTAs per (batch, kv head, split): ceil(h / h_k / ratio_bucket)
  int num_splits;      // key splits per (batch, kv head); 1 = no merge kernel
  int keys_per_split;  // multiple of kDecodeKeysPerStep
};

// kd: the head-dim bucket that runs d (head_dims.h).
// max_multi_rows: seqlen_q > 1 takes the decode kernel's extended instantiation (its rows are
// (query, q-head) pairs) when seqlen_q * h / h_k <= max_multi_rows; 0 (the dense op): never.
inline DecodePlan plan_decode(int b, int h, int h_k, int seqlen_q, int seqlen_k, int kd,
                              int num_sms, bool enabled, int min_steps_to_split = 8,
                              int max_multi_rows = 0) {
  DecodePlan p{false, 0, 1, 1, kDecodeKeysPerStep};
  const int ratio = h_k > 0 ? h / h_k : 0;
  if (!enabled || seqlen_q < 1 || ratio < 1 || seqlen_k < 1 || kd < 1) return p;
  const int64_t rows_per_kv = static_cast<int64_t>(ratio) * seqlen_q;
  if (seqlen_q > 1 && rows_per_kv > max_multi_rows) return p;
  p.use = true;
  const int cap = decode_max_heads_per_cta(kd);
  p.ratio_bucket = 1;
  while (p.ratio_bucket < rows_per_kv && p.ratio_bucket < cap) p.ratio_bucket *= 2;
  p.head_parts = static_cast<int>((rows_per_kv + p.ratio_bucket - 1) / p.ratio_bucket);
  const int64_t rows = static_cast<int64_t>(b) * h_k * p.head_parts;
  const int64_t steps = (static_cast<int64_t>(seqlen_k) + kDecodeKeysPerStep - 1) / kDecodeKeysPerStep;
  int64_t want = num_sms > 0 && steps > min_steps_to_split
                     ? (4 * static_cast<int64_t>(num_sms) + rows - 1) / rows : 1;
  want = want < steps ? want : steps;
  want = want < kDecodeMaxSplits ? want : kDecodeMaxSplits;
  want = want > 1 ? want : 1;
  const int64_t steps_per_split = (steps + want - 1) / want;
  // One split over seqlen_k keys near 2^31 - 1: the rounded-up step count would overflow int.
  const int64_t keys = steps_per_split * kDecodeKeysPerStep;
  p.keys_per_split = static_cast<int>(keys < INT32_MAX ? keys : INT32_MAX);
  p.num_splits = static_cast<int>((steps + steps_per_split - 1) / steps_per_split);
  if (rows * p.num_splits > INT32_MAX) {
    throw std::invalid_argument("flash_attention_sm75: batch * num_heads_k * head parts * splits = " +
                                std::to_string(rows * p.num_splits) +
                                " exceeds the 2^31-1 grid limit");
  }
  return p;
}

// Key splits of the forward kernel's extended instantiations, for the KV-cache op's calls that
// the decode kernel does not take (more (query, q-head) rows per kv head than its
// decode_max_multi_rows, or a window): chunked prefill and long speculative queries against a
// long cache, where b * h * ceil(seqlen_q / Br) CTAs leave most of the GPU idle while each
// streams every key. Each CTA's key blocks (those its tile's rows see) are cut into num_splits
// equal runs (flash_fwd_kernel.h: on the device, so a long static cache holding short sequences
// splits their keys, not its capacity); the count is planned from the keys the call may hold
// (seqlen_k): none up to kFwdMinKeysToSplit keys (the merge launch and its workspace cost more
// than a split saves there) or when the grid fills a wave already; at most kDecodeMaxSplits and
// seqlen_k / kFwdMinKeysPerSplit. A split CTA takes 1 / s of the keys, so s splits run in
// ceil(ctas s / slots) / s of the unsplit time (`slots` = CTAs the GPU holds at once): its wave
// efficiency (ctas s / slots) / ceil(ctas s / slots) decides, the fewest splits within 85% of
// the best (FlashAttention-2's num_splits heuristic: a full last wave, not the most CTAs). The
// merge is the decode path's kernel. Returns the count (1: no split).
constexpr int kFwdMinKeysToSplit = 1024;
constexpr int kFwdMinKeysPerSplit = 512;
inline int plan_fwd_splits(int64_t ctas, int64_t slots, int64_t seqlen_k) {
  if (ctas <= 0 || slots <= 0 || seqlen_k <= kFwdMinKeysToSplit) return 1;
  if (ctas >= slots) return 1;  // a wave or more
  int64_t most = seqlen_k / kFwdMinKeysPerSplit;  // >= 2 past kFwdMinKeysToSplit
  most = most < kDecodeMaxSplits ? most : kDecodeMaxSplits;
  auto efficiency = [&](int64_t s) {
    const int64_t ctas_s = ctas * s;
    const int64_t waves = (ctas_s + slots - 1) / slots;
    return static_cast<double>(ctas_s) / static_cast<double>(waves * slots);
  };
  double best = 0.0;
  for (int64_t s = 1; s <= most; ++s) best = efficiency(s) > best ? efficiency(s) : best;
  int64_t want = 1;
  while (want < most && efficiency(want) < 0.85 * best) ++want;
  return static_cast<int>(want);
}

// CTAs per SM of the bucket's default forward tile in its extended instantiations on a Turing
// SM, at least: the registers ptxas was bound to (kMinBlocksPerSmMod), 64 KiB of shared memory,
// 1024 threads. The slots plan_fwd_splits fills are this times the SMs planned for.
template <typename Kt>
constexpr int fwd_ext_ctas_per_turing_sm() {
  int n = Kt::kMinBlocksPerSmMod;
  const int by_smem = (64 * 1024) / ((Kt::kSmemSize + 255) / 256 * 256);
  const int by_threads = 1024 / Kt::kNThreads;
  n = n < by_smem ? n : by_smem;
  n = n < by_threads ? n : by_threads;
  return n > 1 ? n : 1;
}

// The default tile's grid (CTAs, key splits absent) and slots on `num_sms` Turing SMs at head
// dim d: plan_fwd_splits' inputs.
inline std::pair<int64_t, int64_t> fwd_split_grid(int d, int b, int h, int seqlen_q, int num_sms) {
  auto of = [&](auto tile) {
    using Kt = decltype(tile);
    return std::pair<int64_t, int64_t>(
        make_fwd_plan<Kt>(b, h, seqlen_q).num_blocks,
        static_cast<int64_t>(fwd_ext_ctas_per_turing_sm<Kt>()) * (num_sms > 0 ? num_sms : 0));
  };
  switch (head_dim_bucket(d)) {
    case 64: return of(Fwd_tile_config<64>::Traits{});
    case 96: return of(Fwd_tile_config<96>::Traits{});
    case 128: return of(Fwd_tile_config<128>::Traits{});
    case 256: return of(Fwd_tile_config<256>::Traits{});
    default: throw_bad_head_dim(d);
  }
}

inline FwdLaunchPlan plan_fwd_launch(int d, int b, int h, int seqlen_q) {
  switch (head_dim_bucket(d)) {
    case 64: return make_fwd_plan<Fwd_tile_config<64>::Traits>(b, h, seqlen_q);
    case 96: return make_fwd_plan<Fwd_tile_config<96>::Traits>(b, h, seqlen_q);
    case 128: return make_fwd_plan<Fwd_tile_config<128>::Traits>(b, h, seqlen_q);
    case 256: return make_fwd_plan<Fwd_tile_config<256>::Traits>(b, h, seqlen_q);
    default: throw_bad_head_dim(d);
  }
}

}  // namespace flash_sm75
