// Which query tiles a key block is seen by: the backward counterpart of n_block_range.
//
// Plain arithmetic usable on host and device (tests check it against key_visible).
#pragma once

#include "block_info.h"

namespace flash_sm75 {

// Range [m_block_min, m_block_max) of query tiles (size block_m) that contain at least one row
// seeing a key of key block n_block (keys n_block*block_n .. (n_block+1)*block_n - 1). Empty
// (max <= min) when no query sees any key of the block: its dK and dV are 0.
struct MBlockRange {
  int m_block_min;
  int m_block_max;
};
// Has_lower: the band's lower diagonal (block_info.h's n_block_range says why it is a template).
template <bool Has_lower = false>
FLASH_HOST_DEVICE MBlockRange m_block_range(int n_block, int block_m, int block_n, int seqlen_q,
                                            KeyRange kr, bool is_causal, int causal_off,
                                            int window_lower = kNoWindowLower) {
  const int first_key = imax(n_block * block_n, kr.key_start);
  const int end_key = imin((n_block + 1) * block_n, kr.key_end);
  if (end_key <= first_key) return {0, 0};
  int m_min = 0;
  int m_max = ceil_div(seqlen_q, block_m);
  if (is_causal) {
    // Query i sees key j iff i + window_lower <= j <= i + causal_off: the block's first visible
    // key is seen from row first_key - causal_off on (and, without a lower diagonal, by every
    // later row), its last one up to row end_key - 1 - window_lower.
    const int first_row = first_key - causal_off;
    if (first_row >= seqlen_q) return {0, 0};
    m_min = imax(first_row, 0) / block_m;
    if constexpr (Has_lower) {
      const long long last_row = static_cast<long long>(end_key) - 1 - window_lower;
      if (last_row < 0 || last_row < first_row) return {0, 0};
      if (last_row < seqlen_q) m_max = static_cast<int>(last_row) / block_m + 1;
    }
  }
  return {m_min, m_max};
}

}  // namespace flash_sm75
