// Compositions of the SM75 MMA primitives in utils.h that the forward and backward kernels
// share. Kept apart from utils.h (which holds the inline PTX) so the CPU emulator in tests/emu,
// which swaps utils.h for an emulated version, compiles these unchanged.
#pragma once

#include <cstdint>

#include "smem_layout.h"
#include "utils.h"

namespace flash_sm75 {

// Per-lane ldmatrix.x4 addresses of chunk pair 0 in a row-major [rows][d] tile of layout
// SmemRows<kCPR, kPadded> (chunk_pair_addr then selects chunk pair kk). Lane l addresses row (l % 8)
// of matrix l / 8.
//  lane_addr_a:   matrices (rows r0 + 0..7 | r0 + 8..15) x (chunk 0 | 1), in the order of an
//                 m16n8k8 A fragment pair: 16 rows x 2 k-steps.
//  lane_addr_b:   matrices (rows +0..7 | +8..15) x (chunk 0 | 1), ordered (n0,k0) (n0,k1) (n1,k0)
//                 (n1,k1): B of two n-tiles x two k-steps when rows are the n dimension (K in
//                 S = Q K^T).
//  lane_addr_bt:  the same four matrices ordered (k0,n0) (k1,n0) (k0,n1) (k1,n1), for
//                 ldmatrix.trans when rows are the k dimension (V in O += P V).
template <int kCPR, bool kPadded = false>
__device__ __forceinline__ uint32_t lane_addr_a(const __half* tile, int r0, int lane) {
  return smem_u32addr(tile + SmemRows<kCPR, kPadded>::offset(r0 + (lane % 16), lane / 16));
}
template <int kCPR, bool kPadded = false>
__device__ __forceinline__ uint32_t lane_addr_b(const __half* tile, int lane) {
  const int mi = lane / 8;
  return smem_u32addr(tile + SmemRows<kCPR, kPadded>::offset((mi >> 1) * 8 + (lane % 8), mi & 1));
}
template <int kCPR, bool kPadded = false>
__device__ __forceinline__ uint32_t lane_addr_bt(const __half* tile, int lane) {
  const int mi = lane / 8;
  return smem_u32addr(tile + SmemRows<kCPR, kPadded>::offset((mi & 1) * 8 + (lane % 8), mi >> 1));
}

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

// One chunk pair (two k-steps) of acc += A B^T: a = the A fragments of the pair (ldmatrix.x4
// order), b_addr = the B lane address already moved to the pair.
template <int kN, int kRowBytes>
__device__ __forceinline__ void gemm_kstep_pair(float (&acc)[kN / 8][4], const uint32_t (&a)[4],
                                                uint32_t b_addr) {
  const uint32_t a_lo[2] = {a[0], a[1]};
  const uint32_t a_hi[2] = {a[2], a[3]};
#pragma unroll
  for (int np = 0; np < kN / 16; ++np) {
    uint32_t b[4];
    ldmatrix_x4(b, b_addr + np * 16 * kRowBytes);
    mma_k2n2(acc[2 * np], acc[2 * np + 1], a_lo, a_hi, b);
  }
}

// acc (16 x kN fp32 per warp, zeroed here) = A (16 x kK, fp16 A fragments held in registers,
// a_frag[kk] = k-steps 2kk and 2kk + 1 as loaded by ldmatrix.x4) times B^T, where B is a kN x kK
// row-major tile in the shared layout SmemRows<., kPadded> and b_lane_addr is this lane's
// non-transposed ldmatrix address for chunk pair 0 (matrices: rows +0..7 | +8..15 x chunk 0 | 1).
// Used for S = Q K^T (forward and backward dQ kernel) and dP = dO V^T.
template <int kK, int kN, int kRowBytes, bool kPadded = false>
__device__ __forceinline__ void gemm_rs_bt(float (&acc)[kN / 8][4],
                                           const uint32_t (&a_frag)[kK / 16][4],
                                           uint32_t b_lane_addr) {
  zero_acc(acc);
#pragma unroll
  for (int kk = 0; kk < kK / 16; ++kk) {
    gemm_kstep_pair<kN, kRowBytes>(acc, a_frag[kk], chunk_pair_addr<kPadded>(b_lane_addr, kk));
  }
}

// gemm_rs_bt with the chunk pairs accumulated in two independent sets (even and odd pairs),
// added at the end: 4 MMA dependency chains per 16 x 16 S instead of 2, for tiles whose S is
// too narrow (Bc = 16) to cover the MMA latency with two warps per scheduler. kN / 2 more fp32
// registers; the sum is the same dot product in another order (fp32, not bitwise gemm_rs_bt's).
template <int kK, int kN, int kRowBytes, bool kPadded = false>
__device__ __forceinline__ void gemm_rs_bt_2acc(float (&acc)[kN / 8][4],
                                                const uint32_t (&a_frag)[kK / 16][4],
                                                uint32_t b_lane_addr) {
  static_assert(kK % 32 == 0, "an even number of chunk pairs");
  float acc2[kN / 8][4];
  zero_acc(acc);
  zero_acc(acc2);
#pragma unroll
  for (int kk = 0; kk < kK / 16; kk += 2) {
    gemm_kstep_pair<kN, kRowBytes>(acc, a_frag[kk], chunk_pair_addr<kPadded>(b_lane_addr, kk));
    gemm_kstep_pair<kN, kRowBytes>(acc2, a_frag[kk + 1],
                                   chunk_pair_addr<kPadded>(b_lane_addr, kk + 1));
  }
#pragma unroll
  for (int i = 0; i < kN / 8; ++i) {
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[i][j] += acc2[i][j];
  }
}

// Same as gemm_rs_bt with A (16 x kK) also read from shared memory (same layout): a_lane_addr is
// this lane's ldmatrix.x4 address of chunk pair 0 (lane_addr_a).
template <int kK, int kN, int kRowBytes, bool kPadded = false>
__device__ __forceinline__ void gemm_ss_bt(float (&acc)[kN / 8][4], uint32_t a_lane_addr,
                                           uint32_t b_lane_addr) {
  zero_acc(acc);
#pragma unroll
  for (int kk = 0; kk < kK / 16; ++kk) {
    uint32_t a[4];
    ldmatrix_x4(a, chunk_pair_addr<kPadded>(a_lane_addr, kk));
    gemm_kstep_pair<kN, kRowBytes>(acc, a, chunk_pair_addr<kPadded>(b_lane_addr, kk));
  }
}

// acc (16 x kN) += A (16 x kK, fp16 A fragments in registers: P, dS^T, P^T) times B (kK x kN),
// where B is read transposed (ldmatrix.trans) from a row-major kK x kN shared tile and bt_addr is
// this lane's address of its first 16 x 16 block (matrices: rows +0..7 | +8..15 x chunk 2np |
// 2np + 1). kSwizzled: the tile uses the XOR swizzle (the forward's V: O += P V) rather than
// padded rows (the backward's dO / Q: dV += P^T dO, dK += dS^T Q).
template <int kK, int kN, int kRowBytes, bool kSwizzled>
__device__ __forceinline__ void gemm_rs_t(float (&acc)[kN / 8][4],
                                          const uint32_t (&a)[kK / 8][2], uint32_t bt_addr) {
#pragma unroll
  for (int kp = 0; kp < kK / 16; ++kp) {
#pragma unroll
    for (int np = 0; np < kN / 16; ++np) {
      uint32_t b[4];
      const uint32_t col = kSwizzled ? swizzle_xor(bt_addr, np) : bt_addr + np * 32;
      ldmatrix_x4_trans(b, col + kp * 16 * kRowBytes);
      mma_k2n2(acc[2 * np], acc[2 * np + 1], a[2 * kp], a[2 * kp + 1], b);
    }
  }
}

}  // namespace flash_sm75
