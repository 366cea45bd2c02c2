// Shared-memory layouts of the row-major [rows][d] fp16 tiles that the forward and dQ kernels
// read with ldmatrix: which byte holds chunk c of row r, and how a lane's ldmatrix address
// moves to chunk pair kk (16 columns further).
//
//  * Swizzled (kPadded = false; d in {64, 128, 256}): rows of d halves, chunk c of row r stored
//    at chunk c ^ (r % 8) (swizzle_offset, utils.h). No padding, and moving to chunk pair kk is
//    one XOR of the address (swizzle_xor), which needs rows of a power of two >= 128 bytes.
//  * Padded (kPadded = true; d = 96): rows of d + 8 halves. d / 8 is even, so rows are an odd
//    number of 16-byte units apart and the 8 rows an ldmatrix reads hit 8 distinct bank groups
//    (as in the dK/dV kernel). Chunk pair kk is + 32 bytes: an immediate of the LDSM. Costs
//    8 halves per row of shared memory; works for any even d / 8 (12 chunks: no power of two,
//    which the XOR cannot map into a row).
#pragma once

#include <cstdint>

#include "utils.h"

namespace flash_sm75 {

// The shared address of chunk pair kk given a lane's address of chunk pair 0 (same row).
template <bool kPadded>
__device__ __forceinline__ uint32_t chunk_pair_addr(uint32_t addr, int kk) {
  if constexpr (kPadded) {
    return addr + static_cast<uint32_t>(kk) * 32;
  } else {
    return swizzle_xor(addr, kk);
  }
}

template <int kCPR, bool kPadded>
struct SmemRows {
  static constexpr int kRowHalves = kPadded ? kCPR * 8 + 8 : kCPR * 8;
  static constexpr int kRowBytes = 2 * kRowHalves;
  static_assert(!kPadded || kCPR % 2 == 0, "padded rows: an odd number of 16-byte units apart");

  // Offset, in halves, of chunk `chunk` of row `row`.
  static __device__ __forceinline__ int offset(int row, int chunk) {
    if constexpr (kPadded) {
      return row * kRowHalves + chunk * 8;
    } else {
      return swizzle_offset<kCPR>(row, chunk);
    }
  }
};

}  // namespace flash_sm75
