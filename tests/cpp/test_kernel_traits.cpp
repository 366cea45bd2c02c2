// csrc/kernels/kernel_traits.h: every forward instantiation's tiles respect the Turing (sm_75)
// limits: shared memory per block, threads per block, warp/MMA tiling.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <regex>
#include <set>
#include <string>
#include <type_traits>

#include "kernels/kernel_traits.h"

namespace flash_sm75 {
namespace {

template <int D>
using Traits = typename Fwd_tile_config<D>::Traits;

// Head dims with a forward tile configuration checked below. Every generated forward
// instantiation must use one of them (see InstantiationsAreCovered).
const std::set<int> kCheckedFwdHeadDims = {64, 96, 128, 256};

template <typename Kt>
void expect_fits_sm75(int head_dim) {
  SCOPED_TRACE("head_dim " + std::to_string(head_dim));
  EXPECT_EQ(Kt::kHeadDim, head_dim);
  EXPECT_LE(Kt::kSmemSize, kSm75MaxSmemPerBlock);
  EXPECT_GT(Kt::kSmemSize, 0);
  EXPECT_LE(Kt::kNThreads, kSm75MaxThreadsPerBlock);
  EXPECT_EQ(Kt::kNThreads % 32, 0);
  EXPECT_EQ(Kt::kNThreads, 32 * Kt::kNWarps);
  // One m16 MMA row tile per warp, or per pair of warps that split the head dim.
  EXPECT_EQ(Kt::kBlockM * Kt::kDSplit, 16 * Kt::kNWarps);
  EXPECT_EQ(Kt::kDCols * Kt::kDSplit, Kt::kHeadDim);
  EXPECT_EQ(Kt::kBlockN % 16, 0);
  EXPECT_EQ(Kt::kHeadDim % 16, 0);
  // K and V tiles in fp16 (rows of d halves, or d + 8 where padded); Q and O are staged through
  // the same space unless Q has its own; a head-dim split adds one 16 x Bc fp32 exchange slot
  // per warp.
  const int row = Kt::kPaddedRows ? Kt::kHeadDim + 8 : Kt::kHeadDim;
  EXPECT_EQ(Kt::kRowHalves, row);
  EXPECT_EQ(Kt::kPaddedRows, !(head_dim == 64 || head_dim == 128 || head_dim == 256));
  EXPECT_EQ(Kt::kSmemSize,
            std::max(2 * Kt::kBlockN * row * 2, Kt::kQInSmem ? 0 : Kt::kBlockM * row * 2) +
                (Kt::kQInSmem ? Kt::kBlockM * row * 2 : 0) +
                (Kt::kDSplit > 1 ? Kt::kNWarps * 16 * Kt::kBlockN * 4 : 0));
  EXPECT_LE(Kt::kBlockM * row * 2, Kt::kSmemKVBytes);
  EXPECT_EQ(Kt::kChunksPerThread * Kt::kNThreads, Kt::kBlockN * Kt::kHeadDim / 8);
  EXPECT_EQ(Kt::kQChunksPerThread * Kt::kNThreads, Kt::kBlockM * Kt::kHeadDim / 8);
}

TEST(KernelTraits, EveryFwdConfigFitsSm75) {
  expect_fits_sm75<Traits<64>>(64);
  expect_fits_sm75<Traits<96>>(96);
  expect_fits_sm75<Flash_fwd_kernel_traits<FwdTileD96Narrow>>(96);  // the GPU A/B alternative
  expect_fits_sm75<Traits<128>>(128);
  expect_fits_sm75<Traits<256>>(256);
  // The d = 64 small-grid tile: its kMinBlocksPerSm CTAs must fit a Turing SM (64 KiB of shared
  // memory, 64K registers), or it would not raise the CTAs per SM it exists for.
  using Small = Fwd_tile_config<64>::SmallGridTraits;
  expect_fits_sm75<Small>(64);
  EXPECT_EQ(Small::kBlockM, Traits<64>::kBlockM);  // same grid as the default tile
  EXPECT_GT(Small::kMinBlocksPerSm, Traits<64>::kMinBlocksPerSm);
  EXPECT_LE(Small::kMinBlocksPerSm * Small::kSmemSize, 64 * 1024);
  EXPECT_TRUE((std::is_void_v<Fwd_tile_config<128>::SmallGridTraits>));
  // Every tile's kMinBlocksPerSm CTAs fit the shared memory of a Turing SM.
  EXPECT_LE(Traits<64>::kMinBlocksPerSm * Traits<64>::kSmemSize, 64 * 1024);
  EXPECT_LE(Traits<128>::kMinBlocksPerSm * Traits<128>::kSmemSize, 64 * 1024);
  EXPECT_LE(Traits<96>::kMinBlocksPerSm * Traits<96>::kSmemSize, 64 * 1024);
  // d = 96 runs d = 72 .. 96 in one tile (the tail predicate, no small-grid tile), under the
  // 48 KiB default; the alternative's two CTAs per SM fit a Turing SM's 64 KiB.
  EXPECT_TRUE((std::is_void_v<Fwd_tile_config<96>::SmallGridTraits>));
  EXPECT_FALSE(Traits<96>::kFullHeadDimOnly);
  EXPECT_EQ(Traits<96>::kSmemSize, 2 * 64 * 104 * 2);  // K + V, rows padded to 104 halves
  EXPECT_LE(Traits<96>::kSmemSize, kSm75DefaultSmemPerBlock);
  EXPECT_LE(2 * Flash_fwd_kernel_traits<FwdTileD96Narrow>::kSmemSize, 64 * 1024);
  EXPECT_LE(Traits<256>::kMinBlocksPerSm * Traits<256>::kSmemSize, 64 * 1024);
  // d = 256 runs every head dim of its bucket (no full-head-dim-only fast path) in one tile,
  // within the default 48 KiB.
  EXPECT_TRUE((std::is_void_v<Fwd_tile_config<256>::SmallGridTraits>));
  EXPECT_FALSE(Traits<256>::kFullHeadDimOnly);
  EXPECT_LE(Traits<256>::kSmemSize, kSm75DefaultSmemPerBlock);
  EXPECT_EQ(kSm75MaxSmemPerBlock, 64 * 1024);
  EXPECT_EQ(kSm75DefaultSmemPerBlock, 48 * 1024);
  EXPECT_EQ(kSm75MaxThreadsPerBlock, 1024);
}

// A tile names what differs from FwdTileDefaults; the traits read every field by name.
struct TestTile : FwdTileDefaults {
  static constexpr int kHeadDim = 64, kBlockM = 32, kBlockN = 32, kNWarps = 2;
  static constexpr int kRescaleThreshold = 4;
};

TEST(KernelTraits, TileFieldsByNameWithDefaults) {
  using Kt = Flash_fwd_kernel_traits<TestTile>;
  static_assert(std::is_same_v<Kt::TileConfig, TestTile>);
  EXPECT_EQ(Kt::kHeadDim, 64);
  EXPECT_EQ(Kt::kBlockM, 32);
  EXPECT_EQ(Kt::kBlockN, 32);
  EXPECT_EQ(Kt::kNWarps, 2);
  EXPECT_EQ(Kt::kNThreads, 64);
  EXPECT_EQ(Kt::kRescaleThreshold, 4);  // overridden
  EXPECT_FALSE(Kt::kQInSmem);           // defaults
  EXPECT_EQ(Kt::kMinBlocksPerSm, 1);
  EXPECT_EQ(Kt::kLoadStyle, 0);
  EXPECT_FALSE(Kt::kSplitTile);
  EXPECT_EQ(Kt::kDSplit, 1);
  EXPECT_EQ(Kt::kRowWarps, Kt::kNWarps);
  EXPECT_EQ(Kt::kDCols, Kt::kHeadDim);
  EXPECT_EQ(Kt::kSmemExchangeBytes, 0);
  // The shipped tiles' choices that differ from the defaults.
  static_assert(std::is_same_v<Traits<64>::TileConfig, FwdTileD64>);
  static_assert(std::is_same_v<Traits<128>::TileConfig, FwdTileD128>);
  static_assert(std::is_same_v<Traits<96>::TileConfig, FwdTileD96>);
  EXPECT_TRUE(Traits<96>::kSplitTile);
  EXPECT_EQ(Traits<96>::kRescaleThreshold, 8);
  EXPECT_EQ(Traits<96>::kLoadStyle, 0);  // 12 chunks per row do not divide 256 threads
  EXPECT_EQ(Traits<64>::kMinBlocksPerSm, 3);
  EXPECT_EQ(Traits<64>::kLoadStyle, 2);
  EXPECT_EQ(Traits<128>::kRescaleThreshold, 8);
  EXPECT_TRUE(Traits<128>::kSplitTile);
  static_assert(std::is_same_v<Traits<256>::TileConfig, FwdTileD256>);
  EXPECT_EQ(Traits<256>::kDSplit, 2);  // two warps per 16 rows, 128 head-dim columns each
  EXPECT_EQ(Traits<256>::kDCols, 128);
  EXPECT_EQ(Traits<256>::kRowWarps, 4);
  EXPECT_EQ(Traits<256>::kSmemSize, 48 * 1024);  // K + V 32 KiB, exchange 16 KiB
  EXPECT_EQ(Traits<256>::kSmemExchangeOffset, 32 * 1024);
  EXPECT_EQ(Traits<256>::kRescaleThreshold, 8);
  using Small = Fwd_tile_config<64>::SmallGridTraits;
  static_assert(std::is_same_v<Small::TileConfig, FwdTileD64SmallGrid>);
  EXPECT_TRUE(Small::kQInSmem);
  EXPECT_EQ(Small::kBlockN, 32);
}

#ifdef FLASH_SM75_SOURCE_DIR
// Every csrc/kernels/instantiations/flash_fwd_hdim{D}_fp16[_causal]_sm75.cu must have its head
// dim checked above, so a new instantiation cannot skip the shared-memory check.
TEST(KernelTraits, InstantiationsAreCovered) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::path(FLASH_SM75_SOURCE_DIR) / "csrc" / "kernels" / "instantiations";
  ASSERT_TRUE(fs::is_directory(dir)) << dir;
  const std::regex fwd_re("flash_fwd_hdim([0-9]+)_fp16(_causal)?_sm75\\.cu");
  std::set<std::string> seen;
  for (const auto& entry : fs::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    if (entry.path().extension() != ".cu") continue;
    std::smatch m;
    if (!std::regex_match(name, m, fwd_re)) continue;  // other directions: not checked here
    const int d = std::stoi(m[1].str());
    EXPECT_TRUE(kCheckedFwdHeadDims.count(d)) << name << " has no tile check in this test";
    seen.insert(name);
  }
  // The head-dim buckets x causal matrix is complete (a tile may be checked before its bucket
  // exists: kCheckedFwdHeadDims can run ahead of kHeadDimBuckets).
  for (int d : kHeadDimBuckets) {
    EXPECT_TRUE(kCheckedFwdHeadDims.count(d)) << "bucket " << d << " has no tile check";
    for (const char* c : {"", "_causal"}) {
      const std::string name = "flash_fwd_hdim" + std::to_string(d) + "_fp16" + c + "_sm75.cu";
      EXPECT_TRUE(seen.count(name)) << "missing instantiation " << name;
    }
  }
}
#endif

}  // namespace
}  // namespace flash_sm75
