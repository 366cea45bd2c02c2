// run_mha_fwd: runtime (head dim, causal, local, variant: fwd_variant) -> one of the explicitly specialized
// instantiations in instantiations/*.cu, each compiled in its own translation unit. A band with
// a lower diagonal (a sliding window's left edge) runs the local instantiation; causal alone, or
// a window with only a right edge, the causal one.
#include <stdexcept>

#include "flash.h"
#include "static_switch.h"

namespace flash_sm75 {

void run_mha_fwd(Flash_fwd_params& params, cudaStream_t stream) {
  const FwdVariant variant = fwd_variant(params);
  HEADDIM_SWITCH(params.d, [&] {
    if (variant == kFwdBias) {  // never banded (fwd_variant)
      BOOL_SWITCH(params.is_causal, Is_causal, [&] {
        run_mha_fwd_<kHeadDim, Is_causal, false, kFwdBias>(params, stream);
      });
      return;
    }
    if (variant == kFwdDropout) {  // never banded either
      BOOL_SWITCH(params.is_causal, Is_causal, [&] {
        run_mha_fwd_<kHeadDim, Is_causal, false, kFwdDropout>(params, stream);
      });
      return;
    }
    BOOL_SWITCH(variant == kFwdExt, Is_ext, [&] {
      constexpr int kVariant = Is_ext ? kFwdExt : kFwdPlain;
      if (has_window_lower(params)) return run_mha_fwd_<kHeadDim, true, true, kVariant>(params, stream);
      BOOL_SWITCH(params.is_causal, Is_causal, [&] {
        run_mha_fwd_<kHeadDim, Is_causal, false, kVariant>(params, stream);
      });
    });
  });
}

// The bucket's decode kernel (head_dims.h: bucket 96 runs the 128 one). It takes no packed
// sequences or per-sequence diagonals (its kR = 16 extended kernel has no register to spare
// for them); never silently.
void run_mha_fwd_decode(Flash_fwd_params& params, cudaStream_t stream) {
  if (params.cu_seqlens_q != nullptr || params.cu_seqlens_k != nullptr ||
      params.per_seq_offset) {
    throw std::invalid_argument(
        "flash_attention_sm75: the decode kernel takes no packed sequences (internal error)");
  }
  // Several query rows (the KV-cache op) run on the extended kernel, whose rows are (query,
  // q-head) pairs.
  HEADDIM_SWITCH(params.d, [&] {
    BOOL_SWITCH(needs_ext(params) || params.seqlen_q > 1, Is_ext, [&] {
      run_mha_fwd_decode_<decode_head_dim(kHeadDim), Is_ext>(params, stream);
    });
  });
}

}  // namespace flash_sm75
