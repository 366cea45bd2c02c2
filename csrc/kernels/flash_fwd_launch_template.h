// Grid, shared-memory opt-in and launch of the forward kernel for one instantiation.
#pragma once

#include <atomic>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "flash.h"
#include "flash_decode_kernel.h"  // flash_fwd_decode_merge_kernel: the key splits' merge
#include "flash_fwd_kernel.h"
#include "launch_plan.h"
#include "launch_utils.h"

namespace flash_sm75 {

template <typename Kt, bool Is_causal, bool Is_local, int Variant>
auto fwd_kernel() {
  auto kernel = &flash_fwd_kernel<Kt, Is_causal, Is_local, Variant>;
  set_max_dynamic_smem(kernel, Kt::kSmemSize);
  return kernel;
}

// Key splits (the extended kernels, params.num_splits > 1): num_splits copies of the grid, then
// the decode path's merge of the splits (flash_fwd_decode_merge_kernel, one warp per (b, h,
// query) row of the workspace the host allocated).
template <typename Kt, bool Is_causal, bool Is_local, int Variant>
void run_flash_fwd(Flash_fwd_params& params, cudaStream_t stream) {
  const FwdLaunchPlan plan = make_fwd_plan<Kt>(params.b, params.h, params.seqlen_q);
  auto kernel = fwd_kernel<Kt, Is_causal, Is_local, Variant>();
  const bool split = Variant == kFwdExt && params.num_splits > 1;
  const int64_t blocks = plan.num_blocks * (split ? params.num_splits : 1);
  if (blocks > INT32_MAX) {
    throw std::invalid_argument("flash_attention_sm75: the forward's key splits exceed the "
                                "2^31-1 grid limit");
  }
  Flash_fwd_params p = params;  // by value: the launch copies the parameters anyway
  if (p.l2_prefetch < 0) p.l2_prefetch = Kt::kL2PrefetchTiles;  // 'auto': the tile's own
  kernel<<<dim3(static_cast<unsigned>(blocks)), plan.num_threads, plan.smem_bytes, stream>>>(p);
  if constexpr (Variant == kFwdExt) {
    if (split) {
      const int64_t rows = static_cast<int64_t>(params.b) * params.h * params.seqlen_q;
      flash_fwd_decode_merge_kernel<decode_head_dim(Kt::kHeadDim)>
          <<<static_cast<unsigned>((rows + 3) / 4), 128, 0, stream>>>(params);
    }
  }
}

// Resident CTAs per SM of the forward kernel of Kt on the current device (occupancy API, cached
// per device), or on the planning profile (ctas_per_sm from the kernel's registers); 0 if
// unknown.
template <typename Kt, bool Is_causal, bool Is_local, int Variant>
int fwd_ctas_per_sm(const DeviceProfile* profile) {
  if (profile != nullptr) {
    cudaFuncAttributes attr;
    if (cudaFuncGetAttributes(&attr, fwd_kernel<Kt, Is_causal, Is_local, Variant>()) !=
        cudaSuccess) {
      (void)cudaGetLastError();
      return 0;
    }
    return ctas_per_sm(*profile, Kt::kNThreads, attr.numRegs,
                       Kt::kSmemSize + static_cast<int>(attr.sharedSizeBytes));
  }
  constexpr int kMaxCachedDevices = 64;
  static std::atomic<int> cache[kMaxCachedDevices];
  int device = -1;
  if (cudaGetDevice(&device) != cudaSuccess) device = -1;
  const bool cached = device >= 0 && device < kMaxCachedDevices;
  if (cached) {
    if (const int v = cache[device].load(std::memory_order_relaxed)) return v;
  }
  int ctas = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&ctas, fwd_kernel<Kt, Is_causal, Is_local, Variant>(),
                                                    Kt::kNThreads, Kt::kSmemSize) != cudaSuccess) {
    (void)cudaGetLastError();  // not sticky: clear it so the launch check does not report it
    return 0;
  }
  if (cached && ctas > 0) cache[device].store(ctas, std::memory_order_relaxed);
  return ctas;
}

template <int kHeadDim, bool Is_causal, bool Is_local, int Variant>
void run_mha_fwd_hdim(Flash_fwd_params& params, cudaStream_t stream) {
  using Config = Fwd_tile_config<kHeadDim>;
  using Kt = typename Config::Traits;
  using Ks = typename Config::SmallGridTraits;
  using Kp = typename Config::PlainFullTraits;
  if constexpr (!std::is_void_v<Kp> && Variant == kFwdPlain && !Is_local) {
    static_assert(Kp::kFullHeadDimOnly, "the plain tile runs exactly kHeadDim");
    if (params.d == kHeadDim) return run_flash_fwd<Kp, Is_causal, Is_local, Variant>(params, stream);
  }
  if constexpr (Kt::kFullHeadDimOnly) {
    static_assert(!std::is_void_v<Ks>, "a full-head-dim-only tile needs a tile for the tail");
    static_assert(!Ks::kFullHeadDimOnly, "the small-grid tile runs head dims below kHeadDim");
    if (params.d != kHeadDim) return run_flash_fwd<Ks, Is_causal, Is_local, Variant>(params, stream);
  }
  if constexpr (!std::is_void_v<Ks>) {
    bool small = params.small_grid_tile > 0;
    // Key splits were planned for the default tile's grid (plan_fwd_splits).
    const bool split = Variant == kFwdExt && params.num_splits > 1;
    if (params.small_grid_tile == 0 && params.num_sms > 0 && !split) {
      const FwdLaunchPlan pd = make_fwd_plan<Kt>(params.b, params.h, params.seqlen_q);
      const FwdLaunchPlan ps = make_fwd_plan<Ks>(params.b, params.h, params.seqlen_q);
      // A grid of at most one CTA per SM is one wave on any GPU: no occupancy queries.
      if (pd.num_blocks > params.num_sms) {
        small = prefer_small_grid_tile(
            pd.num_blocks, static_cast<int64_t>(fwd_ctas_per_sm<Kt, Is_causal, Is_local, Variant>(kDeviceProfiles[params.plan_profile])) * params.num_sms,
            ps.num_blocks, static_cast<int64_t>(fwd_ctas_per_sm<Ks, Is_causal, Is_local, Variant>(kDeviceProfiles[params.plan_profile])) * params.num_sms);
      }
    }
    if (small) return run_flash_fwd<Ks, Is_causal, Is_local, Variant>(params, stream);
  }
  run_flash_fwd<Kt, Is_causal, Is_local, Variant>(params, stream);
}

}  // namespace flash_sm75
