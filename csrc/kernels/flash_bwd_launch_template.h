// Launch sequence of the backward pass for one (head dim, causal, local) instantiation.
#pragma once

#include <type_traits>

#include "bwd_kernel_traits.h"
#include "flash_bwd.h"
#include "flash_bwd_kernel.h"
#include "launch_utils.h"

namespace flash_sm75 {

// 1. D = rowsum(dO o O) - dLSE.  2. dK/dV kernel (atomic mode: + dQ partial sums).
// 3. atomic mode: dq = scale * dq_accum; deterministic mode: the dQ kernel.
// Atomic mode expects params.dq_accum_ptr zero-filled (the host API allocates it with zeros).
// A head dim without the atomic mode (Bwd_tile_config::kAtomicDq) runs the deterministic
// kernels whatever params.dq_atomic says; its atomic kernels are not even instantiated.
// Variant: flash_bwd.h BwdVariant (kBwdDropout: the plain kernels with dropout's code).
template <int kHeadDim, bool Is_causal, bool Is_local, int Variant>
void run_mha_bwd_hdim(Flash_bwd_params& params, cudaStream_t stream) {
  constexpr bool Is_ext = Variant == kBwdExt;
  constexpr bool Drop = Variant == kBwdDropout;
  static_assert(!Drop || !Is_local, "kBwdDropout is never banded (bwd_variant)");
  using C = Bwd_tile_config<kHeadDim>;
  using Kt = typename C::Traits;
  using Kq = typename C::DqTraits;
  const BwdLaunchPlan plan = make_bwd_plan<Kt, Kq>(params.b, params.h, params.h_k,
                                                   params.seqlen_q, params.seqlen_k,
                                                   params.dq_atomic && C::kAtomicDq);
  // The row-wise kernels (D, the dQ conversion) address (batch, head, row) rows. Packed q: one
  // entry of total_q rows (batch strides are 0), which is exactly the packed (h, total_q)
  // layout of the LSE, D and dq_accum that the main kernels use (SeqInfo::lse_index).
  Flash_bwd_params rows = params;
  BwdLaunchPlan rows_plan = plan;
  if (params.cu_seqlens_q != nullptr) {
    rows.b = 1;
    rows.seqlen_q = params.total_q;
    rows_plan = make_bwd_plan<Kt, Kq>(1, params.h, params.h_k, params.total_q, params.seqlen_k,
                                      params.dq_atomic && C::kAtomicDq);
  }
  flash_bwd_preprocess_kernel<kHeadDim>
      <<<static_cast<unsigned>(rows_plan.preprocess_blocks), kBwdAuxThreads, 0, stream>>>(rows);
  // A dropout's backward never runs atomic dQ (the host's rule; the atomic kernels have no
  // register left for the mask): the dropout-only family has no atomic kernel.
  if constexpr (C::kAtomicDq && !Drop) {
    if (plan.dq_atomic) {
      auto kernel = &flash_bwd_dkdv_kernel<Kt, Is_causal, true, Is_local, Is_ext>;
      set_max_dynamic_smem(kernel, plan.dkdv_smem);
      kernel<<<static_cast<unsigned>(plan.dkdv_blocks), plan.dkdv_threads, plan.dkdv_smem,
               stream>>>(params);
      flash_bwd_convert_dq_kernel<kHeadDim>
          <<<static_cast<unsigned>(rows_plan.convert_blocks), kBwdAuxThreads, 0, stream>>>(rows);
      return;
    }
  }
  {
    // The dK/dV tile (DkdvLaunchTraits): a dropout's (Bwd_tile_config::DropoutTraits, d = 256)
    // or the K-in-registers one (KregTraits, d = 64 and 128), the same grid.
    using Dk = DkdvLaunchTraits<kHeadDim, Is_ext || Drop>;
    // The dropout-only family always has dropout on: where the dropout tile is another one, the
    // default tile's kernel would be dead code (not instantiated).
    using K0 = std::conditional_t<Drop && Dk::kDropoutTile, typename Dk::Dropout, Kt>;
    // The plain family's non-banded launches run the K-in-registers tile where the head dim has
    // one (Dk::kKregTile; same grid): the 8-warp kernel is then not instantiated for them.
    constexpr bool kKreg = Dk::template kKregTile<Is_local>;
    auto kernel = [] {
      if constexpr (kKreg) {
        return &flash_bwd_dkdv_kreg_kernel<typename Dk::Kreg, Is_causal>;
      } else {
        return &flash_bwd_dkdv_kernel<K0, Is_causal, false, Is_local, Is_ext, Drop>;
      }
    }();
    int dkdv_threads = plan.dkdv_threads, dkdv_smem = plan.dkdv_smem;
    if constexpr (kKreg) {
      dkdv_threads = Dk::Kreg::kNThreads;
      dkdv_smem = Dk::Kreg::kSmemSize;
    } else if constexpr (Drop && Dk::kDropoutTile) {
      dkdv_threads = Dk::Dropout::kNThreads;
      dkdv_smem = Dk::Dropout::kSmemSizeNoDq;
    } else if constexpr (Dk::kDropoutTile) {
      if (Dk::use_dropout_tile(params)) {
        kernel = &flash_bwd_dkdv_kernel<typename Dk::Dropout, Is_causal, false, Is_local, Is_ext,
                                        Drop>;
        dkdv_threads = Dk::Dropout::kNThreads;
        dkdv_smem = Dk::Dropout::kSmemSizeNoDq;
      }
    }
    set_max_dynamic_smem(kernel, dkdv_smem);
    // The dQ tile (DqLaunchTraits): a bias gradient's (Bwd_tile_config::DqBiasTraits), the
    // same grid and threads, also for a bias read by scalar loads (no aligned column pairs: an
    // odd Sk, a column stride), which d = 64's other tile makes one at a time (kGather).
    using Dq = DqLaunchTraits<kHeadDim, Is_local, Is_ext>;
    static_assert(Dq::Plain::kSmemSize == Kq::kSmemSize, "plan.dq_smem is the plain tile's");
    auto dq_kernel = &flash_bwd_dq_kernel<typename Dq::Plain, Is_causal, Is_local, Is_ext, Drop>;
    int dq_smem = plan.dq_smem;
    if constexpr (Dq::kBiasTile) {
      if (Dq::use_bias_tile(params)) {
        dq_kernel = &flash_bwd_dq_kernel<typename Dq::Bias, Is_causal, Is_local, Is_ext>;
        dq_smem = Dq::Bias::kSmemSize;
      }
    }
    set_max_dynamic_smem(dq_kernel, dq_smem);
    // Fork after the preprocess (both kernels read D), dK/dV launched first (launching dQ first
    // measured the same), join before returning (see Flash_bwd_params::dq_stream).
    const bool fork = params.dq_stream != nullptr;
    if (fork) {
      check_cuda(cudaEventRecord(params.dq_fork, stream), "cudaEventRecord");
      check_cuda(cudaStreamWaitEvent(params.dq_stream, params.dq_fork, 0), "cudaStreamWaitEvent");
    }
    kernel<<<static_cast<unsigned>(plan.dkdv_blocks), dkdv_threads, dkdv_smem, stream>>>(params);
    dq_kernel<<<static_cast<unsigned>(plan.dq_blocks), plan.dq_threads, dq_smem,
                fork ? params.dq_stream : stream>>>(params);
    if (fork) {
      check_cuda(cudaEventRecord(params.dq_join, params.dq_stream), "cudaEventRecord");
      check_cuda(cudaStreamWaitEvent(stream, params.dq_join, 0), "cudaStreamWaitEvent");
    }
  }
}

}  // namespace flash_sm75
