// csrc/kernels/bwd_kernel_traits.h: the backward launch plan (grid, threads and shared memory of
// each kernel, per dQ mode and head dim) and the tiles' Turing limits.
#include <gtest/gtest.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "kernels/bwd_kernel_traits.h"
#include "kernels/flash_bwd.h"

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
  for (bool requested : {false, true}) {
    SCOPED_TRACE(requested ? "atomic dQ" : "deterministic");
    const BwdLaunchPlan p = plan_bwd_launch(D, b, h, h_k, sq, sk, requested);
    // A head dim without the atomic mode runs the deterministic kernels.
    const bool atomic = requested && C::kAtomicDq;
    EXPECT_EQ(p.dq_atomic, atomic);
    EXPECT_EQ(bwd_atomic_dq_supported(D), C::kAtomicDq);
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
    // Preprocess: every (batch, head, query) row covered by 256-thread blocks of d/8 threads per
    // row, rounded up to a power of two (d = 96: 16).
    const int64_t rows = int64_t{b} * h * sq;
    int tpr = 1;
    while (tpr < D / 8) tpr *= 2;
    EXPECT_EQ(bwd_preprocess_threads_per_row(D), tpr);
    EXPECT_GE(p.preprocess_blocks * (kBwdAuxThreads / tpr), rows);
    EXPECT_LT((p.preprocess_blocks - 1) * (kBwdAuxThreads / tpr), rows);
  }
}

TEST(BwdLaunchPlan, KernelsGridThreadsSmem) {
  for (int s : {1, 15, 16, 17, 63, 64, 65, 1000, 4097}) {
    expect_bwd_plan<64>(2, 4, 2, s, 2 * s + 1);
    expect_bwd_plan<96>(2, 4, 2, s, 2 * s + 1);
    expect_bwd_plan<96>(1, 6, 1, 3 * s, s);
    expect_bwd_plan<128>(2, 4, 2, s, 2 * s + 1);
    expect_bwd_plan<128>(1, 6, 1, 3 * s, s);
    if (head_dim_bucket(256) == 256) {
      expect_bwd_plan<256>(2, 4, 2, s, 2 * s + 1);
      expect_bwd_plan<256>(1, 6, 1, 3 * s, s);
    }
  }
}

// A head dim below a bucket runs the bucket's kernels (the tail is handled inside them).
TEST(BwdLaunchPlan, HeadDimsRunOnTheirBucket) {
  for (int d = kHeadDimMultiple; d <= kMaxHeadDim; d += kHeadDimMultiple) {
    SCOPED_TRACE("d=" + std::to_string(d));
    const int bucket = head_dim_bucket(d);
    ASSERT_GE(bucket, d);
    for (bool atomic : {false, true}) {
      const BwdLaunchPlan p = plan_bwd_launch(d, 2, 4, 2, 100, 300, atomic);
      const BwdLaunchPlan q = plan_bwd_launch(bucket, 2, 4, 2, 100, 300, atomic);
      EXPECT_EQ(p.dq_atomic, q.dq_atomic);
      EXPECT_EQ(p.dkdv_blocks, q.dkdv_blocks);
      EXPECT_EQ(p.dkdv_threads, q.dkdv_threads);
      EXPECT_EQ(p.dkdv_smem, q.dkdv_smem);
      EXPECT_EQ(p.dq_blocks, q.dq_blocks);
      EXPECT_EQ(p.dq_smem, q.dq_smem);
      EXPECT_EQ(p.preprocess_blocks, q.preprocess_blocks);
      EXPECT_EQ(p.convert_blocks, q.convert_blocks);
    }
  }
}

// d = 256 has no atomic dQ mode (its dK/dV kernel with the dQ atomics spills on sm_75): an
// atomic request plans the deterministic kernels, without the dS^T tile.
TEST(BwdLaunchPlan, HeadDim256FallsBackToDeterministicDq) {
  using C = Bwd_tile_config<256>;
  static_assert(!C::kAtomicDq, "d = 256 runs the deterministic dQ kernel");
  const BwdLaunchPlan p = make_bwd_plan<C::Traits, C::DqTraits>(2, 4, 2, 100, 300,
                                                                /*dq_atomic=*/false);
  EXPECT_FALSE(p.dq_atomic);
  EXPECT_EQ(p.dkdv_smem, C::Traits::kSmemSizeNoDq);
  if (head_dim_bucket(256) == 256) {
    for (int d : {136, 200, 248, 256}) {
      EXPECT_FALSE(bwd_atomic_dq_supported(d)) << d;
      EXPECT_FALSE(plan_bwd_launch(d, 2, 4, 2, 100, 300, /*dq_atomic=*/true).dq_atomic) << d;
    }
  }
  EXPECT_TRUE(bwd_atomic_dq_supported(64));
  EXPECT_TRUE(bwd_atomic_dq_supported(96));
  EXPECT_TRUE(bwd_atomic_dq_supported(72));
  EXPECT_TRUE(bwd_atomic_dq_supported(128));
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
  // key groups x query splits x column splits
  EXPECT_EQ(Kt::kNWarpsN * Kt::kNWarpsM * Kt::kDSplit, Kt::kNWarps);
  EXPECT_EQ(Kt::kBlockN, 16 * Kt::kNWarpsN);
  EXPECT_EQ(Kt::kDOut * Kt::kDSplit, D);
  EXPECT_EQ(Kq::kBlockM * Kq::kDSplit, 16 * Kq::kNWarps);  // 16-row groups x column splits
  EXPECT_EQ(Kq::kDOut * Kq::kDSplit, D);
}

TEST(BwdLaunchPlan, EveryTileFitsATuringSm) {
  expect_bwd_tiles_fit_turing<64>();
  expect_bwd_tiles_fit_turing<96>();
  expect_bwd_tiles_fit_turing<128>();
  // d = 96: dK/dV with padded rows of 104 halves, above the 48 KiB default in both modes
  // (opt-in); the dQ kernel's padded K/V tiles (Bc = 32) and Q staging, 13 KiB.
  EXPECT_EQ(Bwd_tile_config<96>::Traits::kSmemSizeNoDq, 4 * 64 * 104 * 2 + 2 * 64 * 4);
  EXPECT_EQ(Bwd_tile_config<96>::Traits::kSmemSizeAtomicDq,
            4 * 64 * 104 * 2 + 2 * 64 * 4 + 64 * 72 * 2);
  EXPECT_EQ(Bwd_tile_config<96>::DqTraits::kSmemSize, 64 * 104 * 2);
  EXPECT_TRUE(Bwd_tile_config<96>::DqTraits::kPaddedRows);
  EXPECT_FALSE(Bwd_tile_config<128>::DqTraits::kPaddedRows);
  expect_bwd_tiles_fit_turing<256>();
  // d = 256: above the 48 KiB default (opt-in through set_max_dynamic_smem).
  EXPECT_EQ(Bwd_tile_config<256>::Traits::kSmemSizeNoDq, 50816);
  EXPECT_EQ(Bwd_tile_config<256>::DqTraits::kSmemSize, 48 * 1024);
}

// The K-in-registers dK/dV tiles (d = 128: 16-query tiles, V read from shared memory; d = 64:
// 32-query tiles, V's fragments in registers too): two CTAs of each fit a Turing SM (64 KiB of
// shared memory, 64K registers at <= 255 per thread), on the default tile's grid, and only the
// plain family's non-banded launches run them.
template <int kD>
void expect_kreg_tile_fits_two_per_turing_sm() {
  using Kr = typename Bwd_tile_config<kD>::KregTraits;
  using Kt = typename Bwd_tile_config<kD>::Traits;
  EXPECT_EQ(Kr::kHeadDim, kD);
  EXPECT_EQ(Kr::kBlockN, Kt::kBlockN);
  EXPECT_EQ(Kr::kMinBlocksPerSm, 2);
  EXPECT_LE(2 * Kr::kSmemSize, 64 * 1024);
  EXPECT_LE(2 * Kr::kNThreads * 256, 64 * 1024);
  EXPECT_TRUE((DkdvLaunchTraits<kD, false>::template kKregTile<false>));
  EXPECT_FALSE((DkdvLaunchTraits<kD, false>::template kKregTile<true>));  // banded: 8-warp tile
  EXPECT_FALSE((DkdvLaunchTraits<kD, true>::template kKregTile<false>));  // extended / dropout
}

TEST(BwdLaunchPlan, KregTileFitsTwoPerTuringSm) {
  expect_kreg_tile_fits_two_per_turing_sm<64>();
  expect_kreg_tile_fits_two_per_turing_sm<128>();
  // Q x 2, dO, lse and D of 16 rows, V of 64 keys; rows padded to 136 halves.
  EXPECT_EQ(Bwd_tile_config<128>::KregTraits::kSmemSize,
            3 * 16 * 136 * 2 + 2 * 16 * 4 + 64 * 136 * 2);
  EXPECT_FALSE(Bwd_tile_config<128>::KregTraits::kVInRegs);
  // d = 64: 32 queries per tile, rows padded to 72 halves (22.75 KiB).
  EXPECT_EQ(Bwd_tile_config<64>::KregTraits::kBlockM, 32);
  EXPECT_EQ(Bwd_tile_config<64>::KregTraits::kSmemSize,
            3 * 32 * 72 * 2 + 2 * 32 * 4 + 64 * 72 * 2);
  EXPECT_TRUE(Bwd_tile_config<64>::KregTraits::kVInRegs);
  EXPECT_FALSE((DkdvLaunchTraits<96, false>::kKregTile<false>));
  EXPECT_FALSE((DkdvLaunchTraits<256, false>::kKregTile<false>));
}

// d = 128's dQ tile keeps two [K | V] buffers inside the shared memory its Q / dO staging
// takes anyway (no CTA per Turing SM lost); the other head dims keep one buffer.
TEST(BwdLaunchPlan, DqDoubleKVBufferCostsNoSharedMemory) {
  using Kq = Bwd_tile_config<128>::DqTraits;
  EXPECT_TRUE(Kq::kKVDoubleBuf);
  EXPECT_EQ(Kq::kSmemSize, Kq::kQTileBytes);  // 128 query rows x 256 bytes
  EXPECT_EQ(Kq::kSmemSize, 2 * 2 * Kq::kSmemTileBytes);  // two buffers of K and V, 32 keys
  EXPECT_EQ(2 * Kq::kKVBufHalves, 2 * Kq::kSmemTileBytes);
  EXPECT_FALSE(Bwd_tile_config<64>::DqTraits::kKVDoubleBuf);
  EXPECT_FALSE(Bwd_tile_config<96>::DqTraits::kKVDoubleBuf);
  EXPECT_FALSE(Bwd_tile_config<256>::DqTraits::kKVDoubleBuf);
  // The plain band kernel runs DqTraits (two buffers); the extended band kernels' traits
  // without the bias gradient's stores keep the flag (unused there: one buffer in Is_ext).
  EXPECT_TRUE((DqLaunchTraits<128, true, false>::Plain::kKVDoubleBuf));
  EXPECT_TRUE((DqLaunchTraits<128, true, true>::Plain::kKVDoubleBuf));
}

TEST(BwdLaunchPlan, GridLimitAndHeadDim) {
  // b * h * ceil(sq / Br) beyond 2^31 - 1 CTAs must be refused, not wrapped.
  EXPECT_THROW(plan_bwd_launch(128, 1 << 16, 1 << 10, 1, 1 << 20, 64, false),
               std::invalid_argument);
  EXPECT_NO_THROW(plan_bwd_launch(128, 4, 16, 16, 1 << 16, 1 << 16, false));
  for (int d : {0, 4, 12, kMaxHeadDim + 8}) {
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

// bwd_variant (kernels/flash_bwd.h): dropout alone runs the dropout-only family; dropout with
// any other extended feature, or any of them alone, the extended one.
TEST(BwdLaunchPlan, BwdVariant) {
  const int cu[2] = {0, 70};
  const float slopes[2] = {0.5f, 0.25f};
  unsigned char dummy = 0;
  for (bool causal : {false, true}) {
    Flash_bwd_params p{};
    p.is_causal = causal;
    EXPECT_EQ(bwd_variant(p), kBwdPlain);
    p.dropout = 1;
    EXPECT_EQ(bwd_variant(p), kBwdDropout);
    auto with = [&](auto set) {
      Flash_bwd_params r = p;
      set(r);
      return bwd_variant(r);
    };
    EXPECT_EQ(with([&](Flash_bwd_params& r) { r.bias_ptr = &dummy; }), kBwdExt);
    EXPECT_EQ(with([](Flash_bwd_params& r) { r.softcap_in = 0.1f; }), kBwdExt);
    EXPECT_EQ(with([&](Flash_bwd_params& r) { r.alibi_slopes_ptr = slopes; }), kBwdExt);
    EXPECT_EQ(with([&](Flash_bwd_params& r) { r.cu_seqlens_q = cu; }), kBwdExt);
    EXPECT_EQ(with([&](Flash_bwd_params& r) { r.cu_seqlens_k = cu; }), kBwdExt);
    EXPECT_EQ(with([](Flash_bwd_params& r) { r.per_seq_offset = true; }), kBwdExt);
    // A lower window diagonal (the local kernels) is only banded when causal.
    EXPECT_EQ(with([](Flash_bwd_params& r) { r.window_lower = -5; }),
              causal ? kBwdExt : kBwdDropout);
    Flash_bwd_params n{};
    n.is_causal = causal;
    n.softcap_in = 0.1f;
    EXPECT_EQ(bwd_variant(n), kBwdExt);
  }
}

}  // namespace
}  // namespace flash_sm75
