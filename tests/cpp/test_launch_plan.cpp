// csrc/kernels/launch_plan.h: grid/threads/smem per head dim and the errors for impossible
// launches.
#include <gtest/gtest.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "kernels/launch_plan.h"

namespace flash_sm75 {
namespace {

template <int D>
using Traits = typename Fwd_tile_config<D>::Traits;

template <int D>
void expect_plan(int b, int h, int seqlen_q) {
  using Kt = Traits<D>;
  SCOPED_TRACE("d=" + std::to_string(D) + " b=" + std::to_string(b) + " h=" + std::to_string(h) +
               " sq=" + std::to_string(seqlen_q));
  const FwdLaunchPlan p = plan_fwd_launch(D, b, h, seqlen_q);
  EXPECT_EQ(p.block_m, Kt::kBlockM);
  EXPECT_EQ(p.block_n, Kt::kBlockN);
  EXPECT_EQ(p.num_m_blocks, (seqlen_q + Kt::kBlockM - 1) / Kt::kBlockM);
  EXPECT_EQ(p.num_blocks, static_cast<int64_t>(p.num_m_blocks) * b * h);
  EXPECT_EQ(p.num_threads, Kt::kNThreads);
  EXPECT_EQ(p.smem_bytes, Kt::kSmemSize);
  EXPECT_GE(static_cast<int64_t>(p.num_m_blocks) * p.block_m, seqlen_q);  // every row covered
  EXPECT_LT(static_cast<int64_t>(p.num_m_blocks - 1) * p.block_m, seqlen_q);  // no empty CTA row
}

TEST(LaunchPlan, GridThreadsSmem) {
  for (int sq : {1, 63, 64, 65, 97, 1024, 1025, 16384}) {
    for (int bh : {1, 3, 32}) {
      expect_plan<64>(bh, 2 * bh + 1, sq);
      expect_plan<96>(bh + 1, 2 * bh, sq);
      expect_plan<128>(bh + 1, bh, sq);
      if (head_dim_bucket(256) == 256) expect_plan<256>(bh, bh + 2, sq);
    }
  }
}

// A head dim below a bucket runs its bucket's tile (head_dims.h).
TEST(LaunchPlan, HeadDimTailsUseTheBucketTile) {
  for (int d = kHeadDimMultiple; d <= kMaxHeadDim; d += kHeadDimMultiple) {
    const FwdLaunchPlan p = plan_fwd_launch(d, 2, 3, 1000);
    const FwdLaunchPlan q = plan_fwd_launch(head_dim_bucket(d), 2, 3, 1000);
    EXPECT_EQ(p.block_m, q.block_m) << d;
    EXPECT_EQ(p.block_n, q.block_n) << d;
    EXPECT_EQ(p.num_threads, q.num_threads) << d;
    EXPECT_EQ(p.smem_bytes, q.smem_bytes) << d;
  }
}

TEST(LaunchPlan, GridLimit) {
  for (int d : kHeadDimBuckets) {
    const int bm = plan_fwd_launch(d, 1, 1, 1).block_m;
    const int sq = bm * 1024;  // 1024 row tiles
    // 1024 * 2048 * 1023 = 2^31 - 2^21 CTAs: allowed.
    EXPECT_NO_THROW(plan_fwd_launch(d, 2048, 1023, sq));
    EXPECT_EQ(plan_fwd_launch(d, 2048, 1023, sq).num_blocks, (int64_t{1} << 31) - (1 << 21));
    // 1024 * 2048 * 1024 = 2^31 CTAs: one more than gridDim.x allows.
    try {
      plan_fwd_launch(d, 2048, 1024, sq);
      ADD_FAILURE() << "expected std::invalid_argument for a 2^31 CTA grid, d=" << d;
    } catch (const std::invalid_argument& e) {
      const std::string msg = e.what();
      EXPECT_EQ(msg.rfind("flash_attention_sm75:", 0), 0u) << msg;
      EXPECT_NE(msg.find("2147483648"), std::string::npos) << msg;
      EXPECT_NE(msg.find("grid"), std::string::npos) << msg;
    }
    // Far beyond: the CTA count is computed in 64 bits.
    EXPECT_THROW(plan_fwd_launch(d, 1 << 16, 1 << 10, 1 << 30), std::invalid_argument);
  }
}

TEST(LaunchPlan, SmallGridTileOnlyWhenItSavesAWave) {
  // H200-like: 132 SMs x 3 default CTAs = 396 slots, x 4 small-tile CTAs = 528.
  EXPECT_TRUE(prefer_small_grid_tile(512, 396, 512, 528));   // B=4 H=16 N=512: 1.3 -> 1 wave
  EXPECT_TRUE(prefer_small_grid_tile(528, 396, 528, 528));   // exactly one small-tile wave
  EXPECT_FALSE(prefer_small_grid_tile(529, 396, 529, 528));  // two waves either way
  EXPECT_FALSE(prefer_small_grid_tile(396, 396, 396, 528));  // the default fits one wave
  EXPECT_FALSE(prefer_small_grid_tile(1024, 396, 1024, 528));  // N=1024: measured slower
  // T4-like: 40 SMs x 3 = 120, x 4 = 160.
  EXPECT_TRUE(prefer_small_grid_tile(128, 120, 128, 160));
  EXPECT_FALSE(prefer_small_grid_tile(512, 120, 512, 160));
  // Unknown occupancy (0 slots) keeps the default tile.
  EXPECT_FALSE(prefer_small_grid_tile(512, 0, 512, 528));
  EXPECT_FALSE(prefer_small_grid_tile(512, 396, 512, 0));
}

TEST(DecodePlan, SeveralQueryRowsOnlyWhenAsked) {
  // The KV-cache op's short queries: rows = seqlen_q x h / h_k (query, q-head) pairs per kv head,
  // up to max_multi_rows (decode_max_multi_rows: two head parts).
  EXPECT_EQ(decode_max_multi_rows(128), 32);
  EXPECT_EQ(decode_max_multi_rows(256), 16);
  const DecodePlan four = plan_decode(1, 32, 8, 4, 5000, 128, 40, true, 8, 32);  // 16 rows
  EXPECT_TRUE(four.use);
  EXPECT_EQ(four.ratio_bucket, 16);
  EXPECT_EQ(four.head_parts, 1);
  const DecodePlan five = plan_decode(1, 32, 8, 5, 5000, 128, 40, true, 8, 32);  // 20 rows
  EXPECT_TRUE(five.use);
  EXPECT_EQ(five.ratio_bucket, 16);
  EXPECT_EQ(five.head_parts, 2);
  EXPECT_EQ(plan_decode(1, 8, 8, 3, 5000, 64, 40, true, 8, 32).ratio_bucket, 4);  // 3 rows
  EXPECT_FALSE(plan_decode(1, 32, 8, 9, 5000, 128, 40, true, 8, 32).use);  // 36 rows: prefill
  EXPECT_FALSE(plan_decode(1, 32, 8, 5, 5000, 256, 40, true, 8, 16).use);  // 20 rows at d=256
}

TEST(DecodePlan, OnlySingleQueryRows) {
  EXPECT_TRUE(plan_decode(1, 32, 8, 1, 100, 128, 40, true).use);
  EXPECT_FALSE(plan_decode(1, 32, 8, 2, 100, 128, 40, true).use);   // seqlen_q > 1: prefill kernel
  EXPECT_FALSE(plan_decode(1, 32, 8, 1, 100, 128, 40, false).use);  // FLASH_SM75_DECODE=never
  EXPECT_TRUE(plan_decode(1, 64, 2, 1, 100, 128, 40, true).use);    // 32 q-heads: 2 head parts
  EXPECT_TRUE(plan_decode(1, 64, 1, 1, 100, 256, 40, true).use);    // 64 q-heads: 8 head parts
}

TEST(DecodePlan, HeadCapPerHeadDim) {
  EXPECT_EQ(decode_max_heads_per_cta(64), 16);
  EXPECT_EQ(decode_max_heads_per_cta(128), 16);
  EXPECT_EQ(decode_max_heads_per_cta(256), 8);
  // Bucket 96 has no decode kernel of its own: it decodes on the 128 one (head_dims.h).
  EXPECT_EQ(decode_head_dim(64), 64);
  EXPECT_EQ(decode_head_dim(96), 128);
  EXPECT_EQ(decode_head_dim(128), 128);
  EXPECT_EQ(decode_head_dim(256), 256);
  for (int kd : kDecodeHeadDims) {
    bool is_bucket = false;
    for (int b : kHeadDimBuckets) is_bucket = is_bucket || b == kd;
    EXPECT_TRUE(is_bucket) << kd;
  }
}

// kR = the smallest power of two holding the group, up to the head dim's cap; larger groups are
// cut into ceil(ratio / kR) parts of kR heads, each part one CTA.
TEST(DecodePlan, BucketHoldsTheGroupOrItsParts) {
  for (int kd : {64, 128, 256}) {
    const int cap = decode_max_heads_per_cta(kd);
    for (int ratio = 1; ratio <= 64; ++ratio) {
      SCOPED_TRACE("kd=" + std::to_string(kd) + " ratio=" + std::to_string(ratio));
      const DecodePlan p = plan_decode(2, 2 * ratio, 2, 1, 1000, kd, 40, true);
      ASSERT_TRUE(p.use);
      int want = 1;
      while (want < ratio && want < cap) want *= 2;
      EXPECT_EQ(p.ratio_bucket, want);
      EXPECT_EQ(p.head_parts, (ratio + want - 1) / want);
      EXPECT_GE(p.head_parts * p.ratio_bucket, ratio);        // every head in a part
      EXPECT_LT((p.head_parts - 1) * p.ratio_bucket, ratio);  // no empty part
      if (ratio <= cap) EXPECT_EQ(p.head_parts, 1);           // K/V read once per kv head
    }
  }
  EXPECT_EQ(plan_decode(1, 3, 1, 1, 100, 256, 40, true).ratio_bucket, 4);
  EXPECT_EQ(plan_decode(1, 12, 1, 1, 100, 256, 40, true).head_parts, 2);  // 8 + 4 heads
  EXPECT_EQ(plan_decode(1, 32, 1, 1, 100, 128, 40, true).head_parts, 2);  // 16 + 16
}

TEST(DecodePlan, SplitsCoverTheKeysAndFillTheGpu) {
  for (int sk : {1, 127, 128, 129, 1000, 4096, 70000, INT32_MAX - 100, INT32_MAX}) {
    for (int rows : {1, 8, 64, 160, 1000}) {
      for (int sms : {0, 40, 132}) {
        const DecodePlan p = plan_decode(rows, 4, 4, 1, sk, 128, sms, true);
        const DecodePlan p1 = plan_decode(rows, 4, 4, 1, sk, 128, sms, true, 1);  // splits from 2 steps
        EXPECT_GE(p1.num_splits, p.num_splits);
        SCOPED_TRACE("sk=" + std::to_string(sk) + " rows=" + std::to_string(rows) +
                     " sms=" + std::to_string(sms));
        ASSERT_TRUE(p.use);
        EXPECT_GT(p.keys_per_split, 0);
        if (p.keys_per_split != INT32_MAX) EXPECT_EQ(p.keys_per_split % kDecodeKeysPerStep, 0);
        EXPECT_GE(p.num_splits, 1);
        EXPECT_LE(p.num_splits, kDecodeMaxSplits);
        // Every key in exactly one split, and no split empty.
        EXPECT_GE(static_cast<int64_t>(p.num_splits) * p.keys_per_split, sk);
        EXPECT_LT(static_cast<int64_t>(p.num_splits - 1) * p.keys_per_split, sk);
        // No more CTAs than ~4 per SM need (splits only where rows alone do not fill the GPU,
        // and only beyond 8 steps of 128 keys).
        if (sms == 0 || rows >= 4 * sms || sk <= 8 * kDecodeKeysPerStep) EXPECT_EQ(p.num_splits, 1);
        else EXPECT_LE(static_cast<int64_t>(rows) * (p.num_splits - 1), 4 * sms);
      }
    }
  }
}

TEST(FwdSplitPlan, SplitsShortGridsOverLongCachesIntoFullWaves) {
  for (int64_t sk : {int64_t{1}, int64_t{1024}, int64_t{1025}, int64_t{4096}, int64_t{70000},
                     int64_t{INT32_MAX}}) {
    for (int64_t ctas : {int64_t{1}, int64_t{16}, int64_t{40}, int64_t{79}, int64_t{80},
                         int64_t{5000}}) {
      for (int64_t slots : {int64_t{0}, int64_t{40}, int64_t{80}, int64_t{264}}) {
        SCOPED_TRACE("sk=" + std::to_string(sk) + " ctas=" + std::to_string(ctas) +
                     " slots=" + std::to_string(slots));
        const int n = plan_fwd_splits(ctas, slots, sk);
        if (ctas >= slots || sk <= kFwdMinKeysToSplit) {
          EXPECT_EQ(n, 1);  // a wave already, or too few keys
          continue;
        }
        EXPECT_GE(n, 1);
        EXPECT_LE(n, kDecodeMaxSplits);
        EXPECT_LE(static_cast<int64_t>(n) * kFwdMinKeysPerSplit, sk);  // >= 512 keys each
        // The fewest splits within 85% of the best wave efficiency.
        auto eff = [&](int64_t s) {
          const int64_t waves = (ctas * s + slots - 1) / slots;
          return double(ctas * s) / double(waves * slots);
        };
        double best = 0;
        const int64_t most = std::min<int64_t>(sk / kFwdMinKeysPerSplit, kDecodeMaxSplits);
        for (int64_t s = 1; s <= most; ++s) best = std::max(best, eff(s));
        EXPECT_GE(eff(n), 0.85 * best);
        for (int64_t s = 1; s < n; ++s) EXPECT_LT(eff(s), 0.85 * best);
      }
    }
  }
  // The KV-cache op's case: one sequence, 64 queries of 32 heads (d = 128: 128-row tiles, one
  // CTA per Turing SM), 32k cached keys on a T4's 40 SMs: 32 CTAs (0.8 of a wave, each over
  // every key) become 5 splits, 160 CTAs in 4 full waves of a fifth of the keys.
  const auto [ctas, slots] = fwd_split_grid(128, 1, 32, 64, 40);
  EXPECT_EQ(ctas, 32);
  EXPECT_EQ(slots, 40);
  EXPECT_EQ(plan_fwd_splits(ctas, slots, 32768), 5);
  // Full waves rather than more CTAs: 31 CTAs on 40 slots take 5 splits (155 CTAs, 97% of
  // 4 waves), not 2 (62 CTAs in 2 waves of 78%); 16 CTAs take 5 (80 CTAs: 2 full waves).
  EXPECT_EQ(plan_fwd_splits(31, 40, 32768), 5);
  EXPECT_EQ(plan_fwd_splits(16, 40, 32768), 5);
  // The splits keep at least kFwdMinKeysPerSplit keys: 2048 keys allow 4.
  EXPECT_EQ(plan_fwd_splits(1, 40, 2048), 4);
  // A grid of a full wave keeps one split.
  const auto [ctas4, slots4] = fwd_split_grid(64, 16, 32, 64, 40);
  EXPECT_EQ(plan_fwd_splits(ctas4, slots4, 32768), 1);
}

TEST(LaunchPlan, UnsupportedHeadDim) {
  for (int d : {0, 4, 12, 100, kMaxHeadDim + 8, 1024, -64}) {
    try {
      plan_fwd_launch(d, 1, 1, 128);
      ADD_FAILURE() << "expected std::invalid_argument for head_dim " << d;
    } catch (const std::invalid_argument& e) {
      const std::string msg = e.what();
      EXPECT_EQ(msg.rfind("flash_attention_sm75:", 0), 0u) << msg;
      EXPECT_NE(msg.find("head_dim"), std::string::npos) << msg;
      EXPECT_NE(msg.find(std::to_string(d)), std::string::npos) << msg;
    }
  }
}

// Compute capability 7.5's occupancy rules (CUDA occupancy calculator data): the forward kernels'
// measured resource use gives the CTAs per SM DESIGN.md states for a T4.
TEST(DeviceProfile, TuringOccupancy) {
  const DeviceProfile& t4 = kProfileT4;
  EXPECT_EQ(t4.num_sms, 40);
  EXPECT_EQ(kProfileRtx2080Ti.num_sms, 68);
  EXPECT_EQ(ctas_per_sm(t4, 128, 168, 16 * 1024), 3);   // d = 64 forward: registers
  EXPECT_EQ(ctas_per_sm(t4, 128, 250, 26 * 1024), 2);   // 4 warps at 250 registers: 2
  EXPECT_EQ(ctas_per_sm(t4, 256, 250, 32 * 1024), 1);   // d = 128 forward: 8 warps
  EXPECT_EQ(ctas_per_sm(t4, 256, 238, 48 * 1024), 1);   // d = 256 forward: 8 warps
  EXPECT_EQ(ctas_per_sm(t4, 128, 64, 40 * 1024), 1);    // shared memory bound
  EXPECT_EQ(ctas_per_sm(t4, 128, 64, 32 * 1024), 2);
  EXPECT_EQ(ctas_per_sm(t4, 128, 64, 32 * 1024 + 1), 1);  // 256-byte allocation units
  EXPECT_EQ(ctas_per_sm(t4, 1024, 32, 0), 1);           // threads bound
  EXPECT_EQ(ctas_per_sm(t4, 32, 16, 0), 16);            // the CTA cap
  EXPECT_EQ(ctas_per_sm(t4, 128, 255, 0), 2);           // 255 -> 256 per thread per warp unit
  EXPECT_EQ(ctas_per_sm(t4, 128, 64, 65 * 1024), 0);    // does not fit
}

// The decode plan of a T4 profile: splits sized for 40 SMs, not the executing GPU's.
TEST(DeviceProfile, DecodeSplitsFollowTheProfileSms) {
  const DecodePlan t4 = plan_decode(1, 8, 8, 1, 4096, 128, kProfileT4.num_sms, true);
  const DecodePlan big = plan_decode(1, 8, 8, 1, 4096, 128, 132, true);
  EXPECT_EQ(t4.num_splits, 16);   // ~4 * 40 / 8 wanted: 2 of the 32 steps each
  EXPECT_EQ(big.num_splits, 32);  // capped by the 32 steps of 128 keys
}

}  // namespace
}  // namespace flash_sm75
