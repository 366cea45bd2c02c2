// run_mha_bwd: runtime (head dim, causal, local: as run_mha_fwd) -> one of the explicitly
// specialized instantiations in
// instantiations/flash_bwd_*.cu, each compiled in its own translation unit.
#include <stdexcept>

#include "flash_bwd.h"
#include "head_dims.h"
#include "static_switch.h"

namespace flash_sm75 {

void run_mha_bwd(Flash_bwd_params& params, cudaStream_t stream) {
  // Above kMaxBwdSeqHeadDim only a dropout's backward takes packed sequences or per-sequence
  // diagonals (its dK/dV tile has the registers, kernels/seq_info.h): mha_varlen_bwd runs the
  // others on a padded copy. Never silently.
  if (!bwd_takes_packed(head_dim_bucket(params.d), params.dropout != 0) &&
      (params.cu_seqlens_q != nullptr || params.cu_seqlens_k != nullptr ||
       params.per_seq_offset)) {
    throw std::invalid_argument(
        "flash_attention_sm75: the backward kernels above head_dim 128 take packed sequences "
        "only with dropout (internal error: the caller must pad the others)");
  }
  // Nor an attention bias (kBwdBiasMaxHeadDim: the dK/dV kernel does not read it there).
  if (head_dim_bucket(params.d) > kBwdBiasMaxHeadDim && params.bias_ptr != nullptr) {
    throw std::invalid_argument(
        "flash_attention_sm75: attn_bias has no backward above head_dim 128 (internal error: "
        "the caller must refuse it)");
  }
  const BwdVariant variant = bwd_variant(params);
  HEADDIM_SWITCH(params.d, [&] {
    if (variant == kBwdDropout) {  // never banded (bwd_variant)
      BOOL_SWITCH(params.is_causal, Is_causal, [&] {
        run_mha_bwd_<kHeadDim, Is_causal, false, kBwdDropout>(params, stream);
      });
      return;
    }
    BOOL_SWITCH(variant == kBwdExt, Is_ext, [&] {
      constexpr int kVariant = Is_ext ? kBwdExt : kBwdPlain;
      if (has_window_lower(params)) return run_mha_bwd_<kHeadDim, true, true, kVariant>(params, stream);
      BOOL_SWITCH(params.is_causal, Is_causal, [&] {
        run_mha_bwd_<kHeadDim, Is_causal, false, kVariant>(params, stream);
      });
    });
  });
}

}  // namespace flash_sm75
