// Launch of the decode forward (seqlen_q == 1): flash_fwd_decode_kernel with the compile-time
// head count of the plan, then (num_splits > 1) the merge of the splits.
#pragma once

#include <stdexcept>
#include <string>

#include "flash.h"
#include "flash_decode_kernel.h"
#include "launch_plan.h"
#include "launch_utils.h"

namespace flash_sm75 {

template <int kD, int kR, bool Is_ext>
void run_decode_kernels(Flash_fwd_params& params, cudaStream_t stream) {
  using T = DecodeTraits<kD, kR>;
  auto kernel = &flash_fwd_decode_kernel<kD, kR, Is_ext>;
  set_max_dynamic_smem(kernel, T::kSmemSize);
  // DecodePlan::head_parts; the extended kernels' rows are (query, q-head) pairs
  const int rows_per_kv = params.h_h_k_ratio * (Is_ext ? params.seqlen_q : 1);
  const int parts = (rows_per_kv + kR - 1) / kR;
  const int64_t ctas = static_cast<int64_t>(params.b) * params.h_k * params.num_splits * parts;
  kernel<<<static_cast<unsigned>(ctas), T::kThreads, T::kSmemSize, stream>>>(params);
  if (params.num_splits > 1) {
    const int64_t rows = static_cast<int64_t>(params.b) * params.h * params.seqlen_q;
    flash_fwd_decode_merge_kernel<kD>
        <<<static_cast<unsigned>((rows + 3) / 4), 128, 0, stream>>>(params);
  }
}

// kR buckets past the head dim's register cap are not instantiated (plan_decode never picks
// them).
template <int kD, int kR, bool Is_ext>
bool run_decode_bucket(Flash_fwd_params& params, cudaStream_t stream) {
  if constexpr (kR <= decode_max_heads_per_cta(kD)) {
    if (params.decode_ratio_bucket == kR) {
      run_decode_kernels<kD, kR, Is_ext>(params, stream);
      return true;
    }
  }
  return false;
}

template <int kD, bool Is_ext>
void run_mha_fwd_decode_hdim(Flash_fwd_params& params, cudaStream_t stream) {
  if (run_decode_bucket<kD, 1, Is_ext>(params, stream) ||
      run_decode_bucket<kD, 2, Is_ext>(params, stream) ||
      run_decode_bucket<kD, 4, Is_ext>(params, stream) ||
      run_decode_bucket<kD, 8, Is_ext>(params, stream) ||
      run_decode_bucket<kD, 16, Is_ext>(params, stream)) {
    return;
  }
  throw std::invalid_argument("flash_attention_sm75: decode head bucket must be a power of two "
                              "up to " + std::to_string(decode_max_heads_per_cta(kD)) +
                              " at head dim " + std::to_string(kD) + ", got " +
                              std::to_string(params.decode_ratio_bucket));
}

}  // namespace flash_sm75
