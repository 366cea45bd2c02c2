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
FLASH_HOST_DEVICE MBlockRange m_block_range(int n_block, int block_m, int block_n, int seqlen_q,
                                            KeyRange kr, bool is_causal, int causal_off) {
  const int first_key = imax(n_block * block_n, kr.key_start);
  const int end_key = imin((n_block + 1) * block_n, kr.key_end);
  if (end_key <= first_key) return {0, 0};
  int m_min = 0;
  if (is_causal) {
    // Query i sees key j iff j <= i + causal_off: the block's first visible key is seen from
    // row first_key - causal_off on, and every later row sees it too.
    const int first_row = first_key - causal_off;
    if (first_row >= seqlen_q) return {0, 0};
    m_min = imax(first_row, 0) / block_m;
  }
  return {m_min, ceil_div(seqlen_q, block_m)};
}

}  // namespace flash_sm75
