// csrc/kernels/block_info.h, brute force: the tile range and the unmasked-tile shortcut the kernel
// uses must agree element by element with the visibility rule of docs/CONTRACT.md.
#include <gtest/gtest.h>

#include <algorithm>
#include <climits>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "kernels/block_info.h"

namespace flash_sm75 {
namespace {

// The contract's rule, written independently of block_info.h: key j is visible to query i iff
// clamp(leftpad) <= j < clamp(seqused) and, if causal, j <= i + off.
bool contract_visible(int i, int j, int lo, int hi, bool causal, int off) {
  return j >= lo && j < hi && (!causal || j <= i + off);
}

TEST(CausalOffset, BottomRightIsSeqlenKMinusSeqlenQ) {
  EXPECT_EQ(causal_offset(5, 9, /*bottom_right=*/true), 4);
  EXPECT_EQ(causal_offset(9, 5, true), -4);
  EXPECT_EQ(causal_offset(7, 7, true), 0);
  EXPECT_EQ(causal_offset(1, 4096, true), 4095);  // decode: the one query sees every key
}

TEST(CausalOffset, TopLeftIsZero) {
  EXPECT_EQ(causal_offset(5, 9, /*bottom_right=*/false), 0);
  EXPECT_EQ(causal_offset(9, 5, false), 0);
  EXPECT_EQ(causal_offset(1, 4096, false), 0);  // decode with top-left sees key 0 only
}

TEST(CausalOffset, AlignmentSemantics) {
  for (int sq = 1; sq <= 12; ++sq) {
    for (int sk = 1; sk <= 12; ++sk) {
      const KeyRange all{0, sk};
      // Bottom-right: the last query sees every key, and query i sees sk - sq + i + 1 keys.
      const int br = causal_offset(sq, sk, true);
      for (int j = 0; j < sk; ++j) EXPECT_TRUE(key_visible(sq - 1, j, all, true, br));
      // Top-left: query i sees keys 0..i (all of them once i >= sk - 1).
      const int tl = causal_offset(sq, sk, false);
      for (int i = 0; i < sq; ++i) {
        for (int j = 0; j < sk; ++j) {
          EXPECT_EQ(key_visible(i, j, all, true, tl), j <= i) << i << "," << j;
          EXPECT_EQ(key_visible(i, j, all, true, br), j <= i + sk - sq) << i << "," << j;
        }
      }
    }
  }
}

TEST(KeyRange, DefaultsAndClamping) {
  KeyRange kr = key_range(100, nullptr, nullptr, 0);
  EXPECT_EQ(kr.key_start, 0);
  EXPECT_EQ(kr.key_end, 100);

  const int leftpad[] = {0, 7, -5, 150, 30, 10};
  const int seqused[] = {100, 60, 40, 200, 20, -3};
  const int want_start[] = {0, 7, 0, 100, 30, 10};
  const int want_end[] = {100, 60, 40, 100, 30, 10};  // end never below start, never above sk
  for (int bi = 0; bi < 6; ++bi) {
    kr = key_range(100, leftpad, seqused, bi);
    EXPECT_EQ(kr.key_start, want_start[bi]) << "batch " << bi;
    EXPECT_EQ(kr.key_end, want_end[bi]) << "batch " << bi;
    EXPECT_LE(0, kr.key_start);
    EXPECT_LE(kr.key_start, kr.key_end);
    EXPECT_LE(kr.key_end, 100);
  }
  // Only one of the two given.
  kr = key_range(50, leftpad, nullptr, 1);
  EXPECT_EQ(kr.key_start, 7);
  EXPECT_EQ(kr.key_end, 50);
  kr = key_range(50, nullptr, seqused, 4);
  EXPECT_EQ(kr.key_start, 0);
  EXPECT_EQ(kr.key_end, 20);
}

TEST(KeyVisible, MatchesContract) {
  for (int lo = 0; lo <= 6; ++lo) {
    for (int hi = lo; hi <= 8; ++hi) {
      for (int off : {-5, -1, 0, 2, 7}) {
        for (bool causal : {false, true}) {
          for (int i = 0; i < 8; ++i) {
            for (int j = 0; j < 8; ++j) {
              EXPECT_EQ(key_visible(i, j, KeyRange{lo, hi}, causal, off),
                        contract_visible(i, j, lo, hi, causal, off));
            }
          }
        }
      }
    }
  }
}

// Exhaustive check of n_block_range and tile_is_unmasked for one configuration. Returns the number
// of failures (and records them through gtest) so the sweep can stop early on a broken build.
int check_config(int seqlen_q, int seqlen_k, int block_m, int block_n, int leftpad, int seqused,
                 bool causal, bool bottom_right) {
  int failures = 0;
  const KeyRange kr = key_range(seqlen_k, &leftpad, &seqused, 0);
  // The contract's rule on the raw (unclamped) values; keys past seqlen_k do not exist, so a
  // ragged last tile is never fully visible.
  const int lo = leftpad, hi = std::min(seqused, seqlen_k);
  const int off = causal_offset(seqlen_q, seqlen_k, bottom_right);
  const int num_m = ceil_div(seqlen_q, block_m);
  const int num_n = ceil_div(seqlen_k, block_n);
  auto where = [&](int m_block) {
    std::ostringstream os;
    os << "sq=" << seqlen_q << " sk=" << seqlen_k << " Br=" << block_m << " Bc=" << block_n
       << " leftpad=" << leftpad << " seqused=" << seqused << " causal=" << causal
       << " bottom_right=" << bottom_right << " m_block=" << m_block;
    return os.str();
  };
  for (int m_block = 0; m_block < num_m; ++m_block) {
    const int row0 = m_block * block_m;
    const int row1 = std::min(seqlen_q, row0 + block_m);  // rows of the tile that exist
    const BlockRange br = n_block_range(m_block, block_m, block_n, seqlen_q, kr, causal, off);

    // Which key tiles hold at least one (row, key) pair that is visible.
    std::vector<bool> tile_has_visible(num_n, false);
    bool any_visible = false;
    for (int i = row0; i < row1; ++i) {
      for (int j = 0; j < seqlen_k; ++j) {
        if (contract_visible(i, j, lo, hi, causal, off)) {
          tile_has_visible[j / block_n] = true;
          any_visible = true;
        }
      }
    }

    // The range never leaves the key tiles that exist.
    if (br.n_block_max > br.n_block_min &&
        (br.n_block_min < 0 || br.n_block_max > num_n)) {
      ADD_FAILURE() << where(m_block) << ": range [" << br.n_block_min << ", " << br.n_block_max
                    << ") outside [0, " << num_n << ")";
      ++failures;
    }
    // Empty exactly when no row of the tile sees a key (the kernel then writes 0 / -inf).
    if ((br.n_block_max > br.n_block_min) != any_visible) {
      ADD_FAILURE() << where(m_block) << ": range [" << br.n_block_min << ", " << br.n_block_max
                    << ") but any_visible=" << any_visible;
      ++failures;
    }
    for (int n = 0; n < num_n; ++n) {
      const bool in_range = n >= br.n_block_min && n < br.n_block_max;
      // Completeness: every visible pair lies in a visited tile. Tightness (what block_info.h
      // promises: tiles entirely outside the key range or above the diagonal are skipped): a
      // visited tile holds at least one visible pair.
      if (in_range != tile_has_visible[n]) {
        ADD_FAILURE() << where(m_block) << ": key tile " << n << " in_range=" << in_range
                      << " has_visible=" << tile_has_visible[n] << " range ["
                      << br.n_block_min << ", " << br.n_block_max << ")";
        ++failures;
      }
      if (!in_range) continue;
      // tile_is_unmasked => every (row < seqlen_q, all Bc keys) in the tile is visible, and,
      // because visibility only grows with the row, the converse holds too (no needless mask).
      bool all_visible = true;
      for (int i = row0; i < row1 && all_visible; ++i) {
        for (int j = n * block_n; j < (n + 1) * block_n; ++j) {
          if (!contract_visible(i, j, lo, hi, causal, off)) {
            all_visible = false;
            break;
          }
        }
      }
      const bool unmasked = tile_is_unmasked(m_block, n, block_m, block_n, kr, causal, off);
      if (unmasked && !all_visible) {
        ADD_FAILURE() << where(m_block) << ": key tile " << n
                      << " reported unmasked but holds a masked element";
        ++failures;
      }
      if (!unmasked && all_visible) {
        ADD_FAILURE() << where(m_block) << ": key tile " << n
                      << " is fully visible but reported as needing a mask";
        ++failures;
      }
    }
    if (failures > 20) return failures;
  }
  return failures;
}

TEST(BlockRange, BruteForceSweep) {
  int configs = 0;
  int failures = 0;
  const int block_sizes[][2] = {{64, 64}, {16, 16}, {16, 32}, {32, 16}, {64, 128}, {128, 64}};
  const int seqlens[] = {1, 2, 15, 16, 17, 31, 33, 63, 64, 65, 97, 130};
  for (const auto& bs : block_sizes) {
    for (int sq : seqlens) {
      for (int sk : seqlens) {
        // Key windows: full, left padded, right truncated, both, empty, out of range values.
        std::vector<std::pair<int, int>> windows = {
            {0, sk}, {sk / 3, sk}, {0, sk - sk / 4}, {sk / 5, sk - sk / 3}, {sk / 2, sk / 2},
            {-7, sk + 9}, {sk + 3, sk + 5}, {sk / 2, 0}, {1, 2}, {sk - 1, sk}};
        for (const auto& w : windows) {
          for (bool causal : {false, true}) {
            for (bool bottom_right : {false, true}) {
              if (!causal && bottom_right) continue;  // alignment only matters when causal
              failures += check_config(sq, sk, bs[0], bs[1], w.first, w.second, causal,
                                       bottom_right);
              ++configs;
              ASSERT_LE(failures, 20) << "stopping after 20 failures";
            }
          }
        }
      }
    }
  }
  EXPECT_EQ(failures, 0);
  EXPECT_GT(configs, 8000);
}

TEST(BlockRange, KernelTileShapesLongSequences) {
  // The shapes the kernels use (Br = Bc = 64) at a few longer, ragged lengths.
  int failures = 0;
  for (int sq : {1, 200, 257, 1025}) {
    for (int sk : {1, 200, 257, 1025}) {
      for (bool causal : {false, true}) {
        for (bool bottom_right : {false, true}) {
          failures += check_config(sq, sk, 64, 64, 0, sk, causal, bottom_right);
          failures += check_config(sq, sk, 64, 64, sk / 3, sk - 17, causal, bottom_right);
          ASSERT_EQ(failures, 0);
        }
      }
    }
  }
}

TEST(BlockRange, NoncausalFullRangeVisitsEveryTile) {
  const KeyRange kr{0, 1000};
  const BlockRange br = n_block_range(3, 64, 64, 500, kr, false, 0);
  EXPECT_EQ(br.n_block_min, 0);
  EXPECT_EQ(br.n_block_max, ceil_div(1000, 64));
  // Full interior tiles need no mask; the ragged last one does.
  EXPECT_TRUE(tile_is_unmasked(3, 0, 64, 64, kr, false, 0));
  EXPECT_FALSE(tile_is_unmasked(3, 1000 / 64, 64, 64, kr, false, 0));
}

TEST(BlockRange, CausalRowsBeforeFirstKeyAreEmpty) {
  // Bottom-right with seqlen_q > seqlen_k: query rows i < sq - sk see no key at all.
  const int sq = 300, sk = 100;
  const KeyRange kr{0, sk};
  const int off = causal_offset(sq, sk, true);  // -200
  for (int m = 0; m < ceil_div(sq, 64); ++m) {
    const BlockRange br = n_block_range(m, 64, 64, sq, kr, true, off);
    const int last_row = std::min(sq, (m + 1) * 64) - 1;
    EXPECT_EQ(br.n_block_max > br.n_block_min, last_row + off >= 0) << "m_block " << m;
  }
}

// The causal launch order is a bijection of the grid onto (rank, bh); within each group of
// heads the CTAs launched earlier never get a lighter tile (a higher rank) than those launched
// later, and a group holds at least kCausalGroupCtas CTAs (or every head).
TEST(CausalTileOrder, BijectionHeaviestFirstWithinGroups) {
  for (int num_blocks : {1, 2, 3, 7, 64, 100, 300}) {
    for (long long num_bh : {1LL, 2LL, 5LL, 8LL, 9LL, 17LL, 64LL}) {
      const long long group_heads = (kCausalGroupCtas + num_blocks - 1) / num_blocks;
      EXPECT_GE(group_heads * num_blocks, kCausalGroupCtas);
      std::vector<int> hits(static_cast<size_t>(num_blocks * num_bh), 0);
      int prev_rank = -1;
      long long prev_group = -1;
      for (long long linear = 0; linear < num_blocks * num_bh; ++linear) {
        const TileOrder o = causal_tile_order(linear, num_blocks, num_bh);
        ASSERT_GE(o.rank, 0);
        ASSERT_LT(o.rank, num_blocks);
        ASSERT_GE(o.bh, 0);
        ASSERT_LT(o.bh, num_bh);
        ++hits[static_cast<size_t>(o.bh * num_blocks + o.rank)];
        const long long group = o.bh / group_heads;
        if (group == prev_group) EXPECT_GE(o.rank, prev_rank) << "linear " << linear;
        prev_group = group;
        prev_rank = o.rank;
      }
      for (int h : hits) EXPECT_EQ(h, 1) << "blocks " << num_blocks << " bh " << num_bh;
    }
  }
}

TEST(BandDiagonals, HugeWindowsHideNothing) {
  // A window side of any size (sys.maxsize included, as Python callers pass for "unbounded")
  // hides nothing beyond what the keys hide: the same band as no limit on that side. Before the
  // clamp, off - LLONG_MAX (off < 0) and off + LLONG_MAX (off > 0) overflowed and hid every key.
  const long long huge[] = {LLONG_MAX, LLONG_MAX - 1, 1LL << 62, 1LL << 40, INT_MAX};
  for (int sq : {1, 3, 5, 4096}) {
    for (int sk : {1, 3, 5, 4096}) {
      for (bool causal : {false, true}) {
        for (bool br : {false, true}) {
          const BandDiagonals none = band_diagonals(sq, sk, br, causal, -1, -1);
          for (long long w : huge) {
            const BandDiagonals left = band_diagonals(sq, sk, br, causal, w, -1);
            const BandDiagonals right = band_diagonals(sq, sk, br, causal, -1, w);
            const BandDiagonals both = band_diagonals(sq, sk, br, causal, w, w);
            SCOPED_TRACE(::testing::Message() << "sq=" << sq << " sk=" << sk << " causal="
                                              << causal << " br=" << br << " w=" << w);
            // Lower diagonal: none, or one at or below -(sq - 1) (no row loses a key).
            for (const BandDiagonals& b : {left, both}) {
              EXPECT_TRUE(b.lower == kNoWindowLower || b.lower <= -sq) << b.lower;
              EXPECT_EQ(b.upper, causal ? none.upper : (right.upper));
            }
            EXPECT_EQ(left.upper, none.upper);
            EXPECT_EQ(right.lower, none.lower);
            // Upper diagonal: the causal one, or one that lets row 0 see every key.
            if (causal) {
              EXPECT_EQ(right.upper, none.upper);
            } else {
              EXPECT_GE(right.upper, sk - 1);
            }
          }
        }
      }
    }
  }
}

TEST(BandDiagonals, AWindowThatHidesNothingIsNoLowerDiagonal) {
  // Key j is hidden from row i by the lower diagonal iff j < i + lower. A left side so wide that
  // no row loses a key must give kNoWindowLower (the causal-only kernels), and one key narrower
  // must keep its diagonal (the last row loses key 0).
  for (int sq : {1, 2, 7, 64, 1000, 4096}) {
    for (int sk : {1, 7, 64, 1000, 4096, 8192}) {
      for (bool br : {false, true}) {
        for (bool causal : {false, true}) {
          const long long off = causal_offset(sq, sk, br);
          // The narrowest left side that hides nothing: sq - 1 + off - left <= 0.
          const long long widest_hiding = sq - 2 + off;  // left = this hides key 0 from row sq-1
          SCOPED_TRACE(::testing::Message() << "sq=" << sq << " sk=" << sk << " br=" << br
                                            << " causal=" << causal);
          for (long long left : {widest_hiding + 1, widest_hiding + 2, widest_hiding + 1000}) {
            if (left < 0) continue;
            EXPECT_EQ(band_diagonals(sq, sk, br, causal, left, -1).lower, kNoWindowLower) << left;
            EXPECT_EQ(band_diagonals(sq, sk, br, causal, left, 3).lower, kNoWindowLower) << left;
          }
          if (widest_hiding >= 0 && widest_hiding - off < sk + sq) {
            const BandDiagonals b = band_diagonals(sq, sk, br, causal, widest_hiding, -1);
            EXPECT_NE(b.lower, kNoWindowLower);
            EXPECT_GT(sq - 1 + b.lower, 0);  // the last row loses at least key 0
          }
        }
      }
    }
  }
}

TEST(BlockInfo, CeilDivMinMax) {
  EXPECT_EQ(ceil_div(0, 64), 0);
  EXPECT_EQ(ceil_div(1, 64), 1);
  EXPECT_EQ(ceil_div(64, 64), 1);
  EXPECT_EQ(ceil_div(65, 64), 2);
  EXPECT_EQ(imin(-3, 2), -3);
  EXPECT_EQ(imax(-3, 2), 2);
}

}  // namespace
}  // namespace flash_sm75
