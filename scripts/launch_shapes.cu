// Threads and dynamic shared memory per CTA of every kernel family in csrc/kernels, as the
// launch templates pass them (ptxas -v reports registers and static shared memory only).
// scripts/check_sm75.py compiles this host program with the same nvcc and attaches the values
// to each kernel of its --json output; benchmarks/t4_model.py turns them into CTAs per Turing SM.
//
// Output: a JSON list of {"pattern", "threads", "dynamic_smem"}, where pattern is a regular
// expression over check_sm75.py's short kernel names (namespace and parameter list dropped).
// Nothing here runs on a GPU: only the traits' constexpr values are read.
#include <cstdio>
#include <string>
#include <type_traits>

#include "kernels/bwd_kernel_traits.h"
#include "kernels/flash_decode_kernel.h"
#include "kernels/head_dims.h"
#include "kernels/kernel_traits.h"

namespace fs = flash_sm75;

namespace {

bool g_first = true;

void emit(const std::string& pattern, int threads, int dynamic_smem) {
  std::printf("%s\n  {\"pattern\": \"%s\", \"threads\": %d, \"dynamic_smem\": %d}",
              g_first ? "[" : ",", pattern.c_str(), threads, dynamic_smem);
  g_first = false;
}

// flash_fwd_kernel<Traits, Is_causal, Is_local, Is_ext>: launched with Kt::kNThreads threads
// and Kt::kSmemSize bytes (flash_fwd_launch_template.h).
template <typename Tile>
void emit_fwd(const char* tile_name) {
  using Kt = fs::Flash_fwd_kernel_traits<Tile>;
  emit(std::string("^flash_fwd_kernel<Flash_fwd_kernel_traits<") + tile_name + ">,",
       Kt::kNThreads, Kt::kSmemSize);
}
#define EMIT_FWD(Tile) emit_fwd<fs::Tile>(#Tile)

std::string b(bool v) { return v ? "true" : "false"; }

// flash_bwd_dq_kernel<Kq, ...>: its traits' threads and shared memory.
template <typename Kq>
void emit_dq() {
  const std::string kq = "Flash_bwd_dq_kernel_traits<" + std::to_string(Kq::kHeadDim) + ", " +
                         std::to_string(Kq::kBlockN) + ", " + std::to_string(Kq::kNWarps) +
                         ", " + std::to_string(Kq::kDSplit) + ", " + b(Kq::kQInSmem) + ", " +
                         b(Kq::kDbias) + ", " + b(Kq::kKVDoubleBuf) + ">";
  emit("^flash_bwd_dq_kernel<" + kq + ",", Kq::kNThreads, Kq::kSmemSize);
}

// flash_bwd_dkdv_kernel<Kt, Is_causal, Atomic_dq, ...> (shared memory by the dQ mode),
// flash_bwd_dq_kernel<Kq, ...>, and the 256-thread preprocess / convert kernels
// (flash_bwd_launch_template.h).
template <typename Kt>
std::string dkdv_traits() {
  return "Flash_bwd_kernel_traits<" + std::to_string(Kt::kHeadDim) + ", " +
         std::to_string(Kt::kBlockM) + ", " + std::to_string(Kt::kBlockN) + ", " +
         std::to_string(Kt::kNWarps) + ", " + std::to_string(Kt::kDSplit) + ", " +
         b(Kt::kDropout) + ">";
}

template <int kD>
void emit_bwd() {
  using C = fs::Bwd_tile_config<kD>;
  using Kt = typename C::Traits;
  using Kq = typename C::DqTraits;
  for (bool atomic : {false, true}) {
    emit("^flash_bwd_dkdv_kernel<" + dkdv_traits<Kt>() + ", (true|false), " + b(atomic) + ",",
         Kt::kNThreads, atomic ? Kt::kSmemSizeAtomicDq : Kt::kSmemSizeNoDq);
  }
  // the K-in-registers dK/dV kernel (the plain instantiations without a window), where the head
  // dim has one
  using Dp = fs::DkdvLaunchTraits<kD, false>;
  if constexpr (Dp::template kKregTile<false>) {
    using Kr = typename Dp::Kreg;
    emit("^flash_bwd_dkdv_kreg_kernel<Flash_bwd_dkdv_kreg_traits<" +
             std::to_string(Kr::kHeadDim) + ", " + std::to_string(Kr::kBlockM) + ", " +
             std::to_string(Kr::kNWarps) + ", " + std::to_string(Kr::kMinBlocksPerSm) + ", " +
             b(Kr::kVInRegs) + ">,",
         Kr::kNThreads, Kr::kSmemSize);
  }
  // a dropout's dK/dV kernel (the extended instantiations), where it has its own traits
  using Dk = fs::DkdvLaunchTraits<kD, true>;
  if constexpr (Dk::kDropoutTile) {
    using Kd = typename Dk::Dropout;
    emit("^flash_bwd_dkdv_kernel<" + dkdv_traits<Kd>() + ", (true|false), false,",
         Kd::kNThreads, Kd::kSmemSizeNoDq);
  }
  emit_dq<Kq>();
  // a bias gradient's dQ kernel (the extended instantiations), where it has its own traits,
  // and the band kernels' tile without its stores (DqLaunchTraits)
  if constexpr (!std::is_same_v<Kq, typename C::DqBiasTraits>) {
    emit_dq<typename C::DqBiasTraits>();
  }
  using Band = typename fs::DqLaunchTraits<kD, true, true>::Plain;
  if constexpr (!std::is_same_v<Band, Kq> && !std::is_same_v<Band, typename C::DqBiasTraits>) {
    emit_dq<Band>();
  }
  emit("^flash_bwd_preprocess_kernel<" + std::to_string(kD) + ">$", fs::kBwdAuxThreads, 0);
  emit("^flash_bwd_convert_dq_kernel<" + std::to_string(kD) + ">$", fs::kBwdAuxThreads, 0);
}

// flash_fwd_decode_kernel<kD, kR, Is_ext>: DecodeTraits' threads and shared memory; the split
// merge kernel: 128 threads (its __launch_bounds__ and launch, flash_decode_launch_template.h),
// no shared memory.
template <int kD, int kR>
void emit_decode_r() {
  using T = fs::DecodeTraits<kD, kR>;
  emit("^flash_fwd_decode_kernel<" + std::to_string(kD) + ", " + std::to_string(kR) + ",",
       T::kThreads, T::kSmemSize);
  if constexpr (kR < fs::decode_max_heads_per_cta(kD)) emit_decode_r<kD, 2 * kR>();
}
template <int kD>
void emit_decode() {
  emit_decode_r<kD, 1>();
  emit("^flash_fwd_decode_merge_kernel<" + std::to_string(kD) + ">$", 128, 0);
}

}  // namespace

int main() {
  EMIT_FWD(FwdTileD64);
  EMIT_FWD(FwdTileD64SmallGrid);
  EMIT_FWD(FwdTileD96);
  EMIT_FWD(FwdTileD128);
  EMIT_FWD(FwdTileD256);
  EMIT_FWD(FwdTileD256Wide);
  EMIT_FWD(FwdTileD96Narrow);  // built only in tests/cpp; listed in case it is instantiated
  static_assert(fs::kNumHeadDimBuckets == 4 && fs::kNumDecodeHeadDims == 3,
                "a new head-dim bucket: add it below");
  emit_bwd<64>();
  emit_bwd<96>();
  emit_bwd<128>();
  emit_bwd<256>();
  emit_decode<64>();
  emit_decode<128>();
  emit_decode<256>();
  std::printf("\n]\n");
  return 0;
}
