// Launch sequence of the backward pass for one (head dim, causal) instantiation.
#pragma once

#include <cstdlib>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "bwd_kernel_traits.h"
#include "flash_bwd.h"
#include "flash_bwd_kernel.h"
#include "launch_utils.h"

namespace flash_sm75 {

// 1. D = rowsum(dO o O) - dLSE.  2. dK/dV kernel (atomic mode: + dQ partial sums).
// 3. atomic mode: dq = scale * dq_accum; deterministic mode: the dQ kernel.
// Atomic mode expects params.dq_accum_ptr zero-filled (the host API allocates it with zeros).
template <int kHeadDim, bool Is_causal>
void run_mha_bwd_hdim(Flash_bwd_params& params, cudaStream_t stream) {
  using Kt = typename Bwd_tile_config<kHeadDim>::Traits;
  using Kr = typename Bwd_tile_config<kHeadDim>::KregTraits;
  using Kr1 = typename Bwd_tile_config<kHeadDim>::KregTraits1;
  using Kq = typename Bwd_tile_config<kHeadDim>::DqTraits;
  // Shared memory per SM decides the dK/dV kernel (make_bwd_plan).
  // params.smem_per_sm_override (FLASH_SM75_BWD_SMEM_PER_SM) replaces the device's value (tests
  // run the Turing plan on newer GPUs).
  int device = 0, smem_per_sm = params.smem_per_sm_override;
  if (smem_per_sm > 0) {
    // as given
  } else if (cudaGetDevice(&device) != cudaSuccess ||
             cudaDeviceGetAttribute(&smem_per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor,
                                    device) != cudaSuccess) {
    (void)cudaGetLastError();  // not sticky: clear it so the launch check does not report it
    smem_per_sm = 0;            // unknown: the 8-warp dK/dV kernel, which fits every SM75+ GPU
  }
  const BwdLaunchPlan plan =
      make_bwd_plan<Kt, Kq, Kr, Kr1>(params.b, params.h, params.h_k, params.seqlen_q,
                                     params.seqlen_k, params.dq_atomic, smem_per_sm);
  flash_bwd_preprocess_kernel<kHeadDim>
      <<<static_cast<unsigned>(plan.preprocess_blocks), kBwdAuxThreads, 0, stream>>>(params);
  if (params.dq_atomic) {
    auto kernel = &flash_bwd_dkdv_kernel<Kt, Is_causal, true>;
    set_max_dynamic_smem(kernel, plan.dkdv_smem);
    kernel<<<static_cast<unsigned>(plan.dkdv_blocks), plan.dkdv_threads, plan.dkdv_smem,
             stream>>>(params);
    flash_bwd_convert_dq_kernel<kHeadDim>
        <<<static_cast<unsigned>(plan.convert_blocks), kBwdAuxThreads, 0, stream>>>(params);
  } else {
    auto kernel = &flash_bwd_dkdv_kernel<Kt, Is_causal, false>;
    if constexpr (!std::is_void_v<Kr> && !std::is_void_v<Kr1>) {
      static_assert(Kr::kStages != Kr1::kStages, "plan.dkdv_stages names one of the two");
    }
    bool dispatched = !plan.dkdv_keys_in_regs;
    if constexpr (!std::is_void_v<Kr>) {
      if (plan.dkdv_keys_in_regs && plan.dkdv_stages == Kr::kStages) {
        kernel = &flash_bwd_dkdv_kreg_kernel<Kr, Is_causal>;
        dispatched = true;
      }
    }
    if constexpr (!std::is_void_v<Kr1>) {
      if (plan.dkdv_keys_in_regs && plan.dkdv_stages == Kr1::kStages) {
        kernel = &flash_bwd_dkdv_kreg_kernel<Kr1, Is_causal>;
        dispatched = true;
      }
    }
    if (!dispatched) {
      throw std::logic_error("flash_attention_sm75: backward plan names a dK/dV kernel this head "
                             "dim does not have (stages " + std::to_string(plan.dkdv_stages) + ")");
    }
    set_max_dynamic_smem(kernel, plan.dkdv_smem);
    auto dq_kernel = &flash_bwd_dq_kernel<Kq, Is_causal>;
    set_max_dynamic_smem(dq_kernel, plan.dq_smem);
    // Fork after the preprocess (both kernels read D), dK/dV launched first (launching dQ first
    // measured the same), join before returning (see Flash_bwd_params::dq_stream).
    const bool fork = params.dq_stream != nullptr;
    if (fork) {
      check_cuda(cudaEventRecord(params.dq_fork, stream), "cudaEventRecord");
      check_cuda(cudaStreamWaitEvent(params.dq_stream, params.dq_fork, 0), "cudaStreamWaitEvent");
    }
    kernel<<<static_cast<unsigned>(plan.dkdv_blocks), plan.dkdv_threads, plan.dkdv_smem,
             stream>>>(params);
    dq_kernel<<<static_cast<unsigned>(plan.dq_blocks), plan.dq_threads, plan.dq_smem,
                fork ? params.dq_stream : stream>>>(params);
    if (fork) {
      check_cuda(cudaEventRecord(params.dq_join, params.dq_stream), "cudaEventRecord");
      check_cuda(cudaStreamWaitEvent(stream, params.dq_join, 0), "cudaStreamWaitEvent");
    }
  }
}

}  // namespace flash_sm75
