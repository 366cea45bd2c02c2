// Score masking on the MMA accumulator fragments: keys outside a batch entry's key range
// ([leftpad_k, seqused_k)) or outside the diagonal band (past the causal diagonal, before a
// sliding window's left edge) get S = -inf before the online softmax.
// The visibility rule itself, shared with the host and the tests, is in block_info.h.
#pragma once

#include <cmath>

#include "block_info.h"

namespace flash_sm75 {

// Set S to -inf where a key is not visible (block_info.h's key_visible: key range, causal
// offset) in the m16 x kBN accumulator fragments of one warp. Only tiles crossing the key range
// or the causal diagonal pay for it: the query tile m_block (kBM rows) against keys
// [n_block * kBN, (n_block + 1) * kBN) is tested once (tile_is_unmasked). Is_local: the band
// has a lower diagonal (a sliding window; block_info.h). row_w = first query row
// of this warp's 16 rows; kBN is a whole K tile, or half of one (the forward's split tile).
template <bool Is_causal, bool Is_local, int kBM, int kBN>
__device__ __forceinline__ void mask_scores(float (&acc_s)[kBN / 8][4], int m_block, int n_block,
                                            const KeyRange& kr, int row_w, int causal_off,
                                            int window_lower) {
  if (tile_is_unmasked<Is_local>(m_block, n_block, kBM, kBN, kr, Is_causal, causal_off, window_lower)) {
    return;
  }
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int nt = 0; nt < kBN / 8; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int row = row_w + lane / 4 + (e >= 2 ? 8 : 0);
      const int col = n_block * kBN + 8 * nt + 2 * (lane % 4) + (e & 1);
      if (!key_visible<Is_local>(row, col, kr, Is_causal, causal_off, window_lower)) {
        acc_s[nt][e] = -INFINITY;
      }
    }
  }
}

}  // namespace flash_sm75
