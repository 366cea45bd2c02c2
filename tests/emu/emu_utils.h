// Emulated replacement of csrc/kernels/utils.h (copied over it in the emulator build directory):
// the same functions, with the inline PTX (ldmatrix, mma.sync) implemented as warp collectives
// that follow the fragment layouts of the PTX ISA. The pure functions are copied verbatim and
// test_emu_utils_in_sync() (run_emu.py) checks that the real utils.h still has the same bodies.
#pragma once

#include <cuda_fp16.h>
#include <cstdint>
#include <cstring>

#include "sm75_emu.h"

namespace flash_sm75 {

template <int kChunksPerRow>
__device__ __forceinline__ int swizzle_offset(int row, int chunk) {
  return row * kChunksPerRow * 8 + ((chunk ^ (row & 7)) << 3);
}

__device__ __forceinline__ uint32_t swizzle_xor(uint32_t addr, int kk) {
  return addr ^ (static_cast<uint32_t>(kk) << 5);
}

// L2 prefetch: nothing to emulate but its address, which must lie inside the launch's K or V
// tensor (emu::check_prefetch: the ranges the harness sets; the byte is also read, so that a
// sanitizer build of the emulator sees a stray one).
__device__ __forceinline__ void prefetch_l2(const void* p) {
  emu::check_prefetch(p);
  (void)*static_cast<const volatile unsigned char*>(p);
}

// Shared "addresses" are byte offsets into smem_raw (which the kernels treat as 1024-aligned).
__device__ __forceinline__ uint32_t smem_u32addr(const void* ptr) {
  const auto* p = static_cast<const unsigned char*>(ptr);
  const std::ptrdiff_t off = p - smem_raw;
  if (off < 0 || off >= emu::kMaxSmem) {
    std::fprintf(stderr, "emu: smem_u32addr of a non-shared pointer\n");
    std::abort();
  }
  return static_cast<uint32_t>(off);
}

inline uint16_t emu_smem_u16(uint32_t addr) {
  if (addr % 2 != 0 || addr + 2 > static_cast<uint32_t>(emu::kMaxSmem)) {
    std::fprintf(stderr, "emu: bad shared address %u\n", addr);
    std::abort();
  }
  uint16_t v;
  std::memcpy(&v, smem_raw + addr, 2);
  return v;
}

inline void emu_check_ldmatrix_addr(uint32_t addr) {
  if (addr % 16 != 0 || addr + 16 > static_cast<uint32_t>(emu::kMaxSmem)) {
    std::fprintf(stderr, "emu: ldmatrix row address %u not 16-byte aligned / out of range\n", addr);
    std::abort();
  }
}

// Lane l supplies the address of row (l % 8) of matrix (l / 8); it receives, from matrix i,
// row l / 4, elements 2 (l % 4) and 2 (l % 4) + 1.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  emu_check_ldmatrix_addr(addr);
  auto all = emu::warp_exchange(&addr, 1);
  const int l = emu::lane();
  for (int i = 0; i < 4; ++i) {
    const uint32_t row_addr = all[i * 8 + l / 4][0];
    const uint32_t lo = emu_smem_u16(row_addr + 4 * (l % 4));
    const uint32_t hi = emu_smem_u16(row_addr + 4 * (l % 4) + 2);
    r[i] = lo | (hi << 16);
  }
}

// Transposed: lane l receives column l / 4, rows 2 (l % 4) and 2 (l % 4) + 1 of each matrix.
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  emu_check_ldmatrix_addr(addr);
  auto all = emu::warp_exchange(&addr, 1);
  const int l = emu::lane();
  for (int i = 0; i < 4; ++i) {
    const uint32_t row0 = all[i * 8 + 2 * (l % 4)][0];
    const uint32_t row1 = all[i * 8 + 2 * (l % 4) + 1][0];
    const uint32_t lo = emu_smem_u16(row0 + 2 * (l / 4));
    const uint32_t hi = emu_smem_u16(row1 + 2 * (l / 4));
    r[i] = lo | (hi << 16);
  }
}

inline float emu_half_lo(uint32_t x) {
  __half h;
  const uint16_t b = static_cast<uint16_t>(x & 0xffffu);
  std::memcpy(&h, &b, 2);
  return __half2float(h);
}
inline float emu_half_hi(uint32_t x) {
  __half h;
  const uint16_t b = static_cast<uint16_t>(x >> 16);
  std::memcpy(&h, &b, 2);
  return __half2float(h);
}

// D = A * B + D, mma.m16n8k8 (fp16 in, fp32 accumulate), g = lane / 4, t = lane % 4:
//   a0,a1: A[g][2t..2t+1]   a2,a3: A[g+8][2t..2t+1]   b0,b1: B[2t..2t+1][g]
//   d0,d1: D[g][2t..2t+1]   d2,d3: D[g+8][2t..2t+1]
__device__ __forceinline__ void mma_m16n8k8(float (&d)[4], const uint32_t (&a)[2], uint32_t b) {
  const uint32_t in[3] = {a[0], a[1], b};
  auto all = emu::warp_exchange(in, 3);
  float A[16][8], B[8][8];
  for (int L = 0; L < 32; ++L) {
    const int g = L / 4, t = L % 4;
    A[g][2 * t] = emu_half_lo(all[L][0]);
    A[g][2 * t + 1] = emu_half_hi(all[L][0]);
    A[g + 8][2 * t] = emu_half_lo(all[L][1]);
    A[g + 8][2 * t + 1] = emu_half_hi(all[L][1]);
    B[2 * t][g] = emu_half_lo(all[L][2]);
    B[2 * t + 1][g] = emu_half_hi(all[L][2]);
  }
  const int g = emu::lane() / 4, t = emu::lane() % 4;
  const int rows[4] = {g, g, g + 8, g + 8};
  const int cols[4] = {2 * t, 2 * t + 1, 2 * t, 2 * t + 1};
  for (int e = 0; e < 4; ++e) {
    float acc = d[e];
    for (int k = 0; k < 8; ++k) acc = std::fma(A[rows[e]][k], B[k][cols[e]], acc);
    d[e] = acc;
  }
}

__device__ __forceinline__ uint32_t pack_half2(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  uint32_t r;
  std::memcpy(&r, &h, 4);
  return r;
}

__device__ __forceinline__ float2 unpack_half2(uint32_t bits) {
  __half2 h;
  std::memcpy(&h, &bits, 4);
  return __half22float2(h);
}

__device__ __forceinline__ bool warp_any(bool pred) {
  const uint32_t in = pred ? 1u : 0u;
  auto all = emu::warp_exchange(&in, 1);
  for (int l = 0; l < 32; ++l) {
    if (all[l][0]) return true;
  }
  return false;
}

__device__ __forceinline__ float quad_allreduce_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
  return x;
}
__device__ __forceinline__ float quad_allreduce_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  x += __shfl_xor_sync(0xffffffffu, x, 2);
  return x;
}

}  // namespace flash_sm75
