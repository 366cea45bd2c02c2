// run_mha_bwd: runtime (head dim, causal, local: as run_mha_fwd) -> one of the explicitly
// specialized instantiations in
// instantiations/flash_bwd_*.cu, each compiled in its own translation unit.
#include "flash_bwd.h"
#include "static_switch.h"

namespace flash_sm75 {

void run_mha_bwd(Flash_bwd_params& params, cudaStream_t stream) {
  HEADDIM_SWITCH(params.d, [&] {
    BOOL_SWITCH(has_score_mod(params), Has_mod, [&] {
      if (has_window_lower(params)) return run_mha_bwd_<kHeadDim, true, true, Has_mod>(params, stream);
      BOOL_SWITCH(params.is_causal, Is_causal, [&] {
        run_mha_bwd_<kHeadDim, Is_causal, false, Has_mod>(params, stream);
      });
    });
  });
}

}  // namespace flash_sm75
