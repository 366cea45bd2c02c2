// csrc/kernels/bwd_kernel_traits.h: the backward launch plan (grid, threads and shared memory of
// each kernel, per dQ mode and head dim) and the tiles' Turing limits.
#include <gtest/gtest.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "kernels/bwd_kernel_traits.h"

namespace flash_sm75 {
namespace {

int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

template <int D>
void expect_bwd_plan(int b, int h, int h_k, int sq, int sk) {
  using C = Bwd_tile_config<D>;
  using Kt = typename C::Traits;
  using Kq = typename C::DqTraits;
  SCOPED_TRACE("d=" + std::to_string(D) + " b=" + std::to_string(b) + " h=" + std::to_string(h) +
               " h_k=" + std::to_string(h_k) + " sq=" + std::to_string(sq) +
               " sk=" + std::to_string(sk));
  for (bool atomic : {false, true}) {
    SCOPED_TRACE(atomic ? "atomic dQ" : "deterministic");
    const BwdLaunchPlan p = plan_bwd_launch(D, b, h, h_k, sq, sk, atomic);
    // Both modes run the dK/dV kernel of Traits; the atomic mode adds the dS^T tile for dQ.
    EXPECT_EQ(p.num_n_blocks, cdiv(sk, Kt::kBlockN));
    EXPECT_EQ(p.dkdv_blocks, cdiv(sk, Kt::kBlockN) * b * h_k);  // one CTA per kv head: GQA summed
    EXPECT_EQ(p.dkdv_threads, Kt::kNThreads);
    EXPECT_EQ(p.dkdv_smem, atomic ? Kt::kSmemSizeAtomicDq : Kt::kSmemSizeNoDq);
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
  for (int s : {1, 15, 16, 17, 63, 64, 65, 1000, 4097}) {
    expect_bwd_plan<64>(2, 4, 2, s, 2 * s + 1);
    expect_bwd_plan<128>(2, 4, 2, s, 2 * s + 1);
    expect_bwd_plan<128>(1, 6, 1, 3 * s, s);
  }
}

// Every backward tile runs on a Turing SM (64 KiB of shared memory): one CTA of each kernel fits
// in a block's shared memory in either dQ mode, so the plan is the same on every GPU.
template <int D>
void expect_bwd_tiles_fit_turing() {
  SCOPED_TRACE("d=" + std::to_string(D));
  using Kt = typename Bwd_tile_config<D>::Traits;
  using Kq = typename Bwd_tile_config<D>::DqTraits;
  EXPECT_EQ(Kt::kHeadDim, D);
  EXPECT_EQ(Kq::kHeadDim, D);
  EXPECT_LE(Kt::kSmemSizeNoDq, Kt::kSmemSizeAtomicDq);
  EXPECT_LE(Kt::kSmemSizeAtomicDq, kSm75MaxSmemPerBlock);
  EXPECT_LE(Kq::kSmemSize, kSm75MaxSmemPerBlock);
  EXPECT_LE(Kt::kNThreads, kSm75MaxThreadsPerBlock);
  EXPECT_LE(Kq::kNThreads, kSm75MaxThreadsPerBlock);
  EXPECT_EQ(Kt::kNWarpsN * Kt::kNWarpsM, Kt::kNWarps);  // key groups x query splits
  EXPECT_EQ(Kt::kBlockN, 16 * Kt::kNWarpsN);
  EXPECT_EQ(Kq::kBlockM, 16 * Kq::kNWarps);
}

TEST(BwdLaunchPlan, EveryTileFitsATuringSm) {
  expect_bwd_tiles_fit_turing<64>();
  expect_bwd_tiles_fit_turing<128>();
}

TEST(BwdLaunchPlan, GridLimitAndHeadDim) {
  // b * h * ceil(sq / Br) beyond 2^31 - 1 CTAs must be refused, not wrapped.
  EXPECT_THROW(plan_bwd_launch(128, 1 << 16, 1 << 10, 1, 1 << 20, 64, false),
               std::invalid_argument);
  EXPECT_NO_THROW(plan_bwd_launch(128, 4, 16, 16, 1 << 16, 1 << 16, false));
  for (int d : {0, 32, 96, 256}) {
    try {
      plan_bwd_launch(d, 1, 1, 1, 64, 64, false);
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
