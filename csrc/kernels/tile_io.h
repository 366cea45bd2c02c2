// Tile copies between global memory, registers and shared memory, shared by the forward and
// backward kernels. SM75 has no cp.async: a tile is fetched from global memory into registers
// (16 bytes per thread per step, issued early so the loads are in flight during MMAs) and
// written to shared memory later, in the layout the kernel's ldmatrix reads expect.
//
// Kt is any kernel traits type with kNThreads and kChunksPerRow (16-byte chunks per row);
// store_tile_r2s also needs kPaddedRows, store_tile_r2s_padded kRowHalves (the padded row stride).
#pragma once

#include <cuda_fp16.h>
#include <cstdint>

#include "flash.h"
#include "smem_layout.h"
#include "utils.h"

namespace flash_sm75 {

// Global -> registers: the Kt::kNThreads threads of the CTA fetch a kRows x kD fp16 tile, 16 bytes
// per thread per step, rows [row0, row0 + kRows). Rows outside [valid_begin, valid_end) are
// zero-filled: they are never read from memory, and zero V rows keep masked keys (P = 0) from
// contributing 0 * garbage = NaN. So are the 16-byte chunks at or past col_chunks (= d / 8 for a
// head dim d below the instantiated kD, head_dims.h): columns past d belong to the next head or
// lie past the tensor, and zeros there add nothing to q.k, dO.v or P V.
// kStyle picks the address arithmetic (same loads, different SASS; chosen per kernel by
// measurement, Flash_fwd_kernel_traits::kLoadStyle): 0 = a 64-bit row multiply per chunk;
// 1 = one row pointer per call plus a 64-bit step per chunk; 2 = as 1, with a CTA-uniform
// branch to unchecked loads when the whole tile is in range.
// kPf: with pf_rows > 0, also ask L2 for the same tile pf_rows rows further on (rows below
// pf_end), from the threads whose chunk starts a 128-byte line of its row, at the address they
// load plus pf_rows rows (prefetch_l2). The loops issue a tile's loads about half a tile before
// they store it to shared memory; with the tile already in L2 those loads do not wait out a
// DRAM round trip (at small N a whole wave starts on cold K / V at once). Without kPf the code
// is the same as without the feature (token for token: computing the address outside the
// bounds branch, as kPf does, moved other kernels' register allocation and scheduling).
template <typename Kt, int kStyle = 0, bool kPf = false, int kN>
__device__ __forceinline__ void load_tile_g2r(uint4 (&stage)[kN], const __half* base,
                                              index_t row_stride, int row0, int valid_begin,
                                              int valid_end, int tid,
                                              int col_chunks = Kt::kChunksPerRow,
                                              int pf_rows = 0, int pf_end = 0) {
  constexpr int kCPR = Kt::kChunksPerRow;
  if constexpr (kStyle == 0 && kPf) {
    auto prefetch = [&](const __half* p, int chunk, int grow) {
      if (pf_rows > 0 && chunk % 8 == 0 && grow + pf_rows < pf_end) {
        prefetch_l2(p + pf_rows * row_stride);
      }
    };
#pragma unroll
    for (int i = 0; i < kN; ++i) {
      const int idx = tid + i * Kt::kNThreads;
      const int grow = row0 + idx / kCPR;
      const __half* p = base + grow * row_stride + idx % kCPR * 8;
      if (grow >= valid_begin && grow < valid_end && idx % kCPR < col_chunks) {
        stage[i] = __ldg(reinterpret_cast<const uint4*>(p));
      } else {
        stage[i] = make_uint4(0u, 0u, 0u, 0u);
      }
      prefetch(p, idx % kCPR, grow);
    }
    return;
  } else if constexpr (kStyle == 0) {
#pragma unroll
    for (int i = 0; i < kN; ++i) {
      const int idx = tid + i * Kt::kNThreads;
      const int grow = row0 + idx / kCPR;
      if (grow >= valid_begin && grow < valid_end && idx % kCPR < col_chunks) {
        stage[i] = __ldg(reinterpret_cast<const uint4*>(base + grow * row_stride + idx % kCPR * 8));
      } else {
        stage[i] = make_uint4(0u, 0u, 0u, 0u);
      }
    }
    return;
  } else {
    static_assert(!kPf, "the L2 prefetch is written for load style 0 (the tiles that use it)");
    constexpr int kRowsPerPass = Kt::kNThreads / kCPR;
    static_assert(Kt::kNThreads % kCPR == 0, "a pass covers whole rows");
    const int grow0 = row0 + tid / kCPR;
    const bool col_in = tid % kCPR < col_chunks;  // a thread's chunk column is the same each pass
    const __half* p = base + grow0 * row_stride + (tid % kCPR) * 8;
    const index_t step = kRowsPerPass * row_stride;
    if (kStyle == 2 && col_chunks == kCPR && row0 >= valid_begin &&
        row0 + kN * kRowsPerPass <= valid_end) {
#pragma unroll
      for (int i = 0; i < kN; ++i) stage[i] = __ldg(reinterpret_cast<const uint4*>(p + i * step));
      return;
    }
#pragma unroll
    for (int i = 0; i < kN; ++i) {
      const int grow = grow0 + i * kRowsPerPass;
      if (col_in && grow >= valid_begin && grow < valid_end) {
        stage[i] = __ldg(reinterpret_cast<const uint4*>(p + i * step));
      } else {
        stage[i] = make_uint4(0u, 0u, 0u, 0u);
      }
    }
  }
}

// Registers -> shared memory, in the tile layout of Kt (SmemRows<kChunksPerRow, kPaddedRows>:
// XOR-swizzled or padded rows, smem_layout.h).
template <typename Kt, int kN>
__device__ __forceinline__ void store_tile_r2s(const uint4 (&stage)[kN], __half* smem, int tid) {
#pragma unroll
  for (int i = 0; i < kN; ++i) {
    const int idx = tid + i * Kt::kNThreads;
    const int r = idx / Kt::kChunksPerRow;
    const int c = idx % Kt::kChunksPerRow;
    *reinterpret_cast<uint4*>(smem + SmemRows<Kt::kChunksPerRow, Kt::kPaddedRows>::offset(r, c)) =
        stage[i];
  }
}

// Registers -> shared memory for the dK/dV kernel's padded layout: row r of a tile starts at
// r * kRowHalves halves (d + 8: rows are an odd number of 16-byte units apart, so the 8 rows an
// ldmatrix reads hit 8 distinct bank groups). Unlike the XOR swizzle, every k-step / n-tile of a
// fragment is then a constant byte offset from one per-lane base address (an immediate in LDSM),
// which keeps the address registers out of the way of the dK/dV accumulators.
template <typename Kt, int kN>
__device__ __forceinline__ void store_tile_r2s_padded(const uint4 (&stage)[kN], __half* smem,
                                                      int tid) {
#pragma unroll
  for (int i = 0; i < kN; ++i) {
    const int idx = tid + i * Kt::kNThreads;
    const int r = idx / Kt::kChunksPerRow;
    const int c = idx % Kt::kChunksPerRow;
    *reinterpret_cast<uint4*>(smem + r * Kt::kRowHalves + c * 8) = stage[i];
  }
}

}  // namespace flash_sm75
