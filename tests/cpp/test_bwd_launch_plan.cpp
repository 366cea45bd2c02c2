// csrc/kernels/bwd_kernel_traits.h: the backward launch plan (which dK/dV kernel each mode and
// head dim launches, with what grid, threads and shared memory) and the tiles' Turing limits.
#include <gtest/gtest.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "kernels/bwd_kernel_traits.h"

namespace flash_sm75 {
namespace {

int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

constexpr int kH200SmemPerSm = 228 * 1024;  // cudaDevAttrMaxSharedMemoryPerMultiprocessor
constexpr int kT4SmemPerSm = 64 * 1024;
constexpr int kSm86SmemPerSm = 100 * 1024;

template <int D>
void expect_bwd_plan(int b, int h, int h_k, int sq, int sk, int smem_per_sm) {
  using C = Bwd_tile_config<D>;
  using Kt = typename C::Traits;
  using Kq = typename C::DqTraits;
  using Kr = typename C::KregTraits;
  using Kr1 = typename C::KregTraits1;
  SCOPED_TRACE("d=" + std::to_string(D) + " b=" + std::to_string(b) + " h=" + std::to_string(h) +
               " h_k=" + std::to_string(h_k) + " sq=" + std::to_string(sq) +
               " sk=" + std::to_string(sk) + " smem/SM=" + std::to_string(smem_per_sm));
  for (bool atomic : {false, true}) {
    SCOPED_TRACE(atomic ? "atomic dQ" : "deterministic");
    const BwdLaunchPlan p = plan_bwd_launch(D, b, h, h_k, sq, sk, atomic, smem_per_sm);
    // The atomic mode always runs the query-split kernel (it holds the dS^T tile for dQ); the
    // deterministic mode runs the K-in-registers kernel where the head dim configures one and
    // two of its CTAs fit in an SM's shared memory: two query tiles per barrier (Kr) if two
    // of those fit, else one (Kr1).
    int block_n = Kt::kBlockN, threads = Kt::kNThreads;
    int smem = atomic ? Kt::kSmemSizeAtomicDq : Kt::kSmemSizeNoDq;
    bool kreg = false;
    int stages = 0;
    if constexpr (!std::is_void_v<Kr>) {
      static_assert(!std::is_void_v<Kr1>, "a head dim with Kr also has its one-stage form");
      for (int s : {2, 1}) {
        const int s_smem = s == Kr::kStages ? Kr::kSmemSize : Kr1::kSmemSize;
        if (!atomic && !kreg && 2 * s_smem <= smem_per_sm) {
          kreg = true;
          stages = s;
          block_n = Kr::kBlockN;
          threads = Kr::kNThreads;
          smem = s_smem;
        }
      }
    }
    EXPECT_EQ(p.dkdv_keys_in_regs, kreg);
    EXPECT_EQ(p.dkdv_stages, stages);
    EXPECT_EQ(p.num_n_blocks, cdiv(sk, block_n));
    EXPECT_EQ(p.dkdv_blocks, cdiv(sk, block_n) * b * h_k);  // one CTA per kv head: GQA summed
    EXPECT_EQ(p.dkdv_threads, threads);
    EXPECT_EQ(p.dkdv_smem, smem);
    EXPECT_LE(p.dkdv_smem, kSm75MaxSmemPerBlock);
    EXPECT_EQ(p.num_m_blocks_dq, cdiv(sq, Kq::kBlockM));
    EXPECT_EQ(p.dq_blocks, cdiv(sq, Kq::kBlockM) * b * h);
    EXPECT_EQ(p.dq_threads, Kq::kNThreads);
    EXPECT_EQ(p.dq_smem, Kq::kSmemSize);
    EXPECT_LE(p.dq_smem, kSm75MaxSmemPerBlock);
    // Preprocess: every (batch, head, query) row covered by 256-thread blocks of d/8 per row.
    const int64_t rows = int64_t{b} * h * sq;
    EXPECT_GE(p.preprocess_blocks * (kBwdAuxThreads / (D / 8)), rows);
    EXPECT_LT((p.preprocess_blocks - 1) * (kBwdAuxThreads / (D / 8)), rows);
  }
}

TEST(BwdLaunchPlan, KernelsGridThreadsSmem) {
  for (int smem_per_sm : {0, kT4SmemPerSm, kSm86SmemPerSm, kH200SmemPerSm}) {
    for (int s : {1, 15, 16, 17, 63, 64, 65, 1000, 4097}) {
      expect_bwd_plan<64>(2, 4, 2, s, 2 * s + 1, smem_per_sm);
      expect_bwd_plan<128>(2, 4, 2, s, 2 * s + 1, smem_per_sm);
      expect_bwd_plan<128>(1, 6, 1, 3 * s, s, smem_per_sm);
    }
  }
}

TEST(BwdLaunchPlan, D128DeterministicUsesKeysInRegistersWhereTwoCtasFit) {
  using Kr = Bwd_tile_config<128>::KregTraits;
  static_assert(!std::is_void_v<Kr>, "d = 128 configures the K-in-registers kernel");
  EXPECT_EQ(Kr::kBlockN, 16 * Kr::kNWarps);  // one warp per 16 keys, no query splits
  EXPECT_EQ(Kr::kBlockM % 16, 0);
  using Kr1 = Bwd_tile_config<128>::KregTraits1;
  EXPECT_EQ(Kr::kStages, 2);
  EXPECT_EQ(Kr1::kStages, 1);
  // Q/dO tiles in 2 x kStages buffers, then lse and D ([2 kStages][Br] each), then V (not in
  // registers).
  for (int s : {1, 2}) {
    const int off_lse = s == 2 ? Kr::kOffLse : Kr1::kOffLse;
    const int off_v = s == 2 ? Kr::kOffV : Kr1::kOffV;
    const int smem = s == 2 ? Kr::kSmemSize : Kr1::kSmemSize;
    EXPECT_EQ(off_lse, 2 * s * 2 * Kr::kBlockM * (128 + 8) * 2);
    EXPECT_EQ(off_v, off_lse + 2 * (2 * s) * Kr::kBlockM * 4);
    EXPECT_EQ(smem, off_v + Kr::kKTileBytes);
    EXPECT_LE(Kr::kKTileBytes, off_v);  // K staging before the loop stays below V's tile
    EXPECT_LE(smem, kSm75MaxSmemPerBlock);
  }
  EXPECT_EQ(Kr::kMinBlocksPerSm, Kr::kNWarps <= 4 ? 2 : 1);
  // Turing: 64 KiB of shared memory per SM hold one CTA of 4 warps of either form: the 8-warp
  // kernel. 100 KiB (sm_86, sm_89) hold two of the one-stage form only.
  EXPECT_GT(2 * Kr1::kSmemSize, kT4SmemPerSm);
  EXPECT_GT(2 * Kr::kSmemSize, kSm86SmemPerSm);
  EXPECT_LE(2 * Kr1::kSmemSize, kSm86SmemPerSm);
  const BwdLaunchPlan h200 = plan_bwd_launch(128, 4, 16, 16, 4096, 4096, false, kH200SmemPerSm);
  const BwdLaunchPlan sm86 = plan_bwd_launch(128, 4, 16, 16, 4096, 4096, false, kSm86SmemPerSm);
  const BwdLaunchPlan t4 = plan_bwd_launch(128, 4, 16, 16, 4096, 4096, false, kT4SmemPerSm);
  const BwdLaunchPlan atomic = plan_bwd_launch(128, 4, 16, 16, 4096, 4096, true, kH200SmemPerSm);
  EXPECT_TRUE(h200.dkdv_keys_in_regs);
  EXPECT_EQ(h200.dkdv_stages, 2);
  EXPECT_EQ(h200.dkdv_smem, Kr::kSmemSize);
  EXPECT_EQ(h200.dkdv_threads, Kr::kNThreads);
  EXPECT_TRUE(sm86.dkdv_keys_in_regs);
  EXPECT_EQ(sm86.dkdv_stages, 1);
  EXPECT_EQ(sm86.dkdv_smem, Kr1::kSmemSize);
  EXPECT_FALSE(t4.dkdv_keys_in_regs);
  EXPECT_EQ(t4.dkdv_stages, 0);
  EXPECT_EQ(t4.dkdv_threads, Bwd_tile_config<128>::Traits::kNThreads);
  EXPECT_FALSE(atomic.dkdv_keys_in_regs);
  EXPECT_EQ(atomic.dkdv_threads, Bwd_tile_config<128>::Traits::kNThreads);
  static_assert(std::is_void_v<Bwd_tile_config<64>::KregTraits> &&
                    std::is_void_v<Bwd_tile_config<64>::KregTraits1>,
                "d = 64 keeps one kernel");
}

TEST(BwdLaunchPlan, GridLimitAndHeadDim) {
  // b * h * ceil(sq / Br) beyond 2^31 - 1 CTAs must be refused, not wrapped.
  EXPECT_THROW(plan_bwd_launch(128, 1 << 16, 1 << 10, 1, 1 << 20, 64, false, kH200SmemPerSm),
               std::invalid_argument);
  EXPECT_NO_THROW(plan_bwd_launch(128, 4, 16, 16, 1 << 16, 1 << 16, false, kH200SmemPerSm));
  for (int d : {0, 32, 96, 256}) {
    try {
      plan_bwd_launch(d, 1, 1, 1, 64, 64, false, kH200SmemPerSm);
      ADD_FAILURE() << "expected std::invalid_argument for head_dim " << d;
    } catch (const std::invalid_argument& e) {
      const std::string msg = e.what();
      EXPECT_EQ(msg.rfind("flash_attention_sm75:", 0), 0u) << msg;
      EXPECT_NE(msg.find(std::to_string(d)), std::string::npos) << msg;
    }
  }
}

}  // namespace
}  // namespace flash_sm75
