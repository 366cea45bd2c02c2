// Device helpers: the SM75 tensor-core instructions (mma.sync m16n8k8, ldmatrix) wrapped as
// inline PTX, the shared-memory swizzle, and fp16 packing. Only sm_75 instructions are used
// (no cp.async, no m16n8k16, no bf16 MMA).
#pragma once

#include <cuda_fp16.h>
#include <cstdint>

namespace flash_sm75 {

// Offset, in halves, of 16-byte chunk `chunk` of row `row` in a row-major [rows][d] fp16 tile
// whose chunks are XOR-swizzled by (row % 8). ldmatrix reads the same logical chunk from 8
// consecutive rows; the swizzle maps them to 8 different 16-byte bank groups (conflict-free),
// while a row's 8-chunk groups stay contiguous so 16-byte stores are conflict-free too.
template <int kChunksPerRow>
__device__ __forceinline__ int swizzle_offset(int row, int chunk) {
  return row * kChunksPerRow * 8 + ((chunk ^ (row & 7)) << 3);
}

// Shared address of chunk pair (2*kk + x) given the address of chunk x (x in {0, 1}) of the same
// row: with rows of 128 or 256 bytes starting 256-byte aligned, (chunk ^ (row % 8)) << 4 only
// touches address bits 4..7 and 2*kk only bits 5..7, so moving to chunk pair kk is a single XOR
// of the address with kk << 5. This keeps one base register per operand instead of one per kk.
__device__ __forceinline__ uint32_t swizzle_xor(uint32_t addr, int kk) {
  return addr ^ (static_cast<uint32_t>(kk) << 5);
}

__device__ __forceinline__ uint32_t smem_u32addr(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

// Asks L2 for the 128-byte line holding the global address p (prefetch.global.L2: a hint; no
// register receives the data and no instruction waits for it; SM75 has no cp.async). p must
// lie inside an allocation.
__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

// Four 8x8 b16 matrices; lane l supplies the address of row (l % 8) of matrix (l / 8).
// Lane l receives, from matrix i, row l/4, elements 2*(l%4) and 2*(l%4)+1, in register r[i].
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// Same, transposed: lane l receives column l/4, rows 2*(l%4) and 2*(l%4)+1 of each matrix.
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// D = A * B + D with A 16x8 (row-major, fp16, 2 regs), B 8x8 (col-major, fp16, 1 reg),
// D 16x8 fp32 (4 regs). Fragment layout (PTX ISA, mma.m16n8k8), g = lane/4, t = lane%4:
//   a0,a1: A[g][2t..2t+1]   a2,a3: A[g+8][2t..2t+1]
//   b0,b1: B[2t..2t+1][g]
//   d0,d1: D[g][2t..2t+1]   d2,d3: D[g+8][2t..2t+1]
// The accumulator layout equals the A layout, so a fp32 S tile converts to the fp16 P operand
// of the next MMA without leaving registers.
__device__ __forceinline__ void mma_m16n8k8(float (&d)[4], const uint32_t (&a)[2], uint32_t b) {
  asm(
      "mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5}, {%6}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(b));
}

__device__ __forceinline__ uint32_t pack_half2(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

// The two fp16 halves of a 32-bit word (low half first) as floats.
__device__ __forceinline__ float2 unpack_half2(uint32_t bits) {
  return __half22float2(*reinterpret_cast<const __half2*>(&bits));
}

// True on every lane if `pred` is true on any lane of the (fully active) warp.
__device__ __forceinline__ bool warp_any(bool pred) { return __any_sync(0xffffffffu, pred); }

// Max / sum over the 4 lanes of a quad (the lanes that share one accumulator row).
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
