// Compositions of the SM75 MMA primitives in utils.h that the forward and backward kernels
// share. Kept apart from utils.h (which holds the inline PTX) so the CPU emulator in tests/emu,
// which swaps utils.h for an emulated version, compiles these unchanged.
#pragma once

#include <cstdint>

#include "utils.h"

namespace flash_sm75 {

// Two k-steps x two n-tiles from one ldmatrix.x4 of B: b = {(n0, k0), (n0, k1), (n1, k0),
// (n1, k1)}; a0 / a1 are the A fragments of k-steps k0 / k1.
//   acc0 += A(k0) B(n0, k0) + A(k1) B(n0, k1),   acc1 += A(k0) B(n1, k0) + A(k1) B(n1, k1).
__device__ __forceinline__ void mma_k2n2(float (&acc0)[4], float (&acc1)[4],
                                         const uint32_t (&a0)[2], const uint32_t (&a1)[2],
                                         const uint32_t (&b)[4]) {
  mma_m16n8k8(acc0, a0, b[0]);
  mma_m16n8k8(acc0, a1, b[1]);
  mma_m16n8k8(acc1, a0, b[2]);
  mma_m16n8k8(acc1, a1, b[3]);
}

// Zero a tile of m16n8 fp32 accumulator fragments.
template <int kTiles>
__device__ __forceinline__ void zero_acc(float (&acc)[kTiles][4]) {
#pragma unroll
  for (int i = 0; i < kTiles; ++i) {
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[i][j] = 0.f;
  }
}

}  // namespace flash_sm75
