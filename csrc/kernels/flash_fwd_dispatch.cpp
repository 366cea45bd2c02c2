// run_mha_fwd: runtime (head dim, causal) -> one of the explicitly specialized instantiations in
// instantiations/*.cu, each compiled in its own translation unit.
#include "flash.h"
#include "static_switch.h"

namespace flash_sm75 {

void run_mha_fwd(Flash_fwd_params& params, cudaStream_t stream) {
  HEADDIM_SWITCH(params.d, [&] {
    BOOL_SWITCH(params.is_causal, Is_causal, [&] { run_mha_fwd_<kHeadDim, Is_causal>(params, stream); });
  });
}

// The bucket's decode kernel (head_dims.h: bucket 96 runs the 128 one).
void run_mha_fwd_decode(Flash_fwd_params& params, cudaStream_t stream) {
  HEADDIM_SWITCH(params.d, [&] { run_mha_fwd_decode_<decode_head_dim(kHeadDim)>(params, stream); });
}

}  // namespace flash_sm75
