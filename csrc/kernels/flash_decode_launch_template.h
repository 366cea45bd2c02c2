// Launch of the decode forward (seqlen_q == 1): flash_fwd_decode_kernel with the compile-time
// head count of the plan, then (num_splits > 1) the merge of the splits.
#pragma once

#include <stdexcept>
#include <string>

#include "flash.h"
#include "flash_decode_kernel.h"
#include "launch_utils.h"

namespace flash_sm75 {

template <int kD, int kR>
void run_decode_kernels(Flash_fwd_params& params, cudaStream_t stream) {
  using T = DecodeTraits<kD, kR>;
  auto kernel = &flash_fwd_decode_kernel<kD, kR>;
  set_max_dynamic_smem(kernel, T::kSmemSize);
  const int64_t ctas = static_cast<int64_t>(params.b) * params.h_k * params.num_splits;
  kernel<<<static_cast<unsigned>(ctas), T::kThreads, T::kSmemSize, stream>>>(params);
  if (params.num_splits > 1) {
    const int64_t rows = static_cast<int64_t>(params.b) * params.h;
    flash_fwd_decode_merge_kernel<kD>
        <<<static_cast<unsigned>((rows + 3) / 4), 128, 0, stream>>>(params);
  }
}

template <int kD>
void run_mha_fwd_decode_hdim(Flash_fwd_params& params, cudaStream_t stream) {
  switch (params.decode_ratio_bucket) {
    case 1: return run_decode_kernels<kD, 1>(params, stream);
    case 2: return run_decode_kernels<kD, 2>(params, stream);
    case 4: return run_decode_kernels<kD, 4>(params, stream);
    case 8: return run_decode_kernels<kD, 8>(params, stream);
    case 16: return run_decode_kernels<kD, 16>(params, stream);
    default:
      throw std::invalid_argument("flash_attention_sm75: decode head bucket must be 1, 2, 4, 8 "
                                  "or 16, got " + std::to_string(params.decode_ratio_bucket));
  }
}

}  // namespace flash_sm75
