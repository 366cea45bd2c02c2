// Grid, shared-memory opt-in and launch of the forward kernel for one instantiation.
#pragma once

#include <stdexcept>
#include <string>

#include "flash.h"
#include "flash_fwd_kernel.h"
#include "launch_plan.h"

namespace flash_sm75 {

template <typename Kt, bool Is_causal>
void run_flash_fwd(Flash_fwd_params& params, cudaStream_t stream) {
  const FwdLaunchPlan plan = make_fwd_plan<Kt>(params.b, params.h, params.seqlen_q);
  void (*kernel)(const Flash_fwd_params);
  if constexpr (Kt::kPingPong) {
    kernel = &flash_fwd_pingpong_kernel<Kt, Is_causal>;
  } else {
    kernel = &flash_fwd_kernel<Kt, Is_causal>;
  }
  if (Kt::kSmemSize > kSm75DefaultSmemPerBlock) {
    cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           Kt::kSmemSize);
    if (err != cudaSuccess) {
      throw std::runtime_error(std::string("flash_attention_sm75: cudaFuncSetAttribute failed: ") +
                               cudaGetErrorString(err));
    }
  }
  kernel<<<dim3(static_cast<unsigned>(plan.num_blocks)), plan.num_threads, plan.smem_bytes,
           stream>>>(params);
}

template <int kHeadDim, bool Is_causal>
void run_mha_fwd_hdim(Flash_fwd_params& params, cudaStream_t stream) {
  run_flash_fwd<typename Fwd_tile_config<kHeadDim>::Traits, Is_causal>(params, stream);
}

}  // namespace flash_sm75
