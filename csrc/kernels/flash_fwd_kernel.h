// FlashAttention forward for SM75 (Turing) tensor cores.
//
// Algorithm: FlashAttention-2 forward (Dao, arXiv:2307.08691, Algorithm 1) with the online
// softmax of FlashAttention (Dao et al., arXiv:2205.14135): for a tile of Br query rows, stream
// the K/V tiles of Bc keys, keep the running row max m_i, the running row sum l_i and the
// unnormalised output acc_o in registers, rescale them when the max grows, and normalise once
// at the end. Names follow the Triton tutorial (m_i, l_i, acc).
//
// SM75 specifics (see DESIGN.md):
//  * mma.sync.m16n8k8 (fp16 in, fp32 accumulate) for both S = Q K^T and O += P V. The fp32
//    accumulator fragment of S has the same layout as the fp16 A fragment of the next MMA, so
//    P = exp2(S * scale_log2 - m) is packed to fp16 in registers and never touches shared memory.
//  * ldmatrix (x4) loads Q and K fragments, ldmatrix.trans loads V fragments from an XOR-swizzled
//    shared-memory layout without bank conflicts.
//  * No cp.async on SM75: the next tile's global loads are issued into registers before the
//    current tile's MMAs and written to shared memory after them (register double buffering):
//    V_j is fetched while S_j = Q K_j^T and its softmax run, K_{j+1} while O += P_j V_j runs.
#pragma once

#include <cmath>
#include <cuda_fp16.h>

#include "block_info.h"
#include "flash.h"
#include "kernel_traits.h"
#include "fragment.h"
#include "utils.h"

namespace flash_sm75 {

// Global -> registers: the Kt::kNThreads threads of the CTA fetch a kRows x d fp16 tile, 16 bytes
// per thread per step, rows [row0, row0 + kRows). Rows outside [valid_begin, valid_end) are
// zero-filled: they are never read from memory, and zero V rows keep masked keys (P = 0) from
// contributing 0 * garbage = NaN.
template <typename Kt, int kN>
__device__ __forceinline__ void load_tile_g2r(uint4 (&stage)[kN], const __half* base,
                                              index_t row_stride, int row0, int valid_begin,
                                              int valid_end, int tid) {
#pragma unroll
  for (int i = 0; i < kN; ++i) {
    const int idx = tid + i * Kt::kNThreads;
    const int r = idx / Kt::kChunksPerRow;
    const int c = idx % Kt::kChunksPerRow;
    const int grow = row0 + r;
    if (grow >= valid_begin && grow < valid_end) {
      stage[i] = __ldg(reinterpret_cast<const uint4*>(base + grow * row_stride + c * 8));
    } else {
      stage[i] = make_uint4(0u, 0u, 0u, 0u);
    }
  }
}

// Registers -> shared memory, in the swizzled layout (see swizzle_offset).
template <typename Kt, int kN>
__device__ __forceinline__ void store_tile_r2s(const uint4 (&stage)[kN], __half* smem, int tid) {
#pragma unroll
  for (int i = 0; i < kN; ++i) {
    const int idx = tid + i * Kt::kNThreads;
    const int r = idx / Kt::kChunksPerRow;
    const int c = idx % Kt::kChunksPerRow;
    *reinterpret_cast<uint4*>(smem + swizzle_offset<Kt::kChunksPerRow>(r, c)) = stage[i];
  }
}

template <typename Kt, bool Is_causal>
__global__ void __launch_bounds__(Kt::kNThreads, Kt::kMinBlocksPerSm)
    flash_fwd_kernel(const Flash_fwd_params params) {
  constexpr int kD = Kt::kHeadDim;
  constexpr int kBM = Kt::kBlockM;
  constexpr int kBN = Kt::kBlockN;
  constexpr int kCPR = Kt::kChunksPerRow;
  constexpr int kRowBytes = kD * 2;

  extern __shared__ __align__(1024) unsigned char smem_raw[];
  // kQInSmem: [sQ: Br x d][sK][sV], O staged through sQ. Otherwise [sK][sV], with the Q tile
  // (before the loop) and the O tile (after it) staged through the contiguous K+V space.
  __half* sQ = reinterpret_cast<__half*>(smem_raw);
  __half* sK = reinterpret_cast<__half*>(smem_raw + Kt::kSmemKVOffset);  // Bc x d
  __half* sV = sK + kBN * kD;                                            // Bc x d

  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int g = lane / 4;  // accumulator row within the warp's 16 rows (and g + 8)
  const int t = lane % 4;  // accumulator column pair

  // ---- which (batch, head, query tile) this CTA owns: a 1-D grid, so batch x heads is not
  // limited by gridDim.y/z. Causal: the heaviest query tiles (last rows) are scheduled first.
  const int num_m_blocks = ceil_div(params.seqlen_q, kBM);
  const int64_t num_bh = static_cast<int64_t>(params.b) * params.h;
  const int64_t linear = blockIdx.x;
  int m_block;
  int64_t bh;
  if (Is_causal) {
    bh = linear % num_bh;
    m_block = num_m_blocks - 1 - static_cast<int>(linear / num_bh);
  } else {
    m_block = static_cast<int>(linear % num_m_blocks);
    bh = linear / num_m_blocks;
  }
  const int bidb = static_cast<int>(bh / params.h);
  const int bidh = static_cast<int>(bh % params.h);
  const int bidh_k = bidh / params.h_h_k_ratio;  // GQA: no K/V copy, just index the shared head

  const __half* q_base = static_cast<const __half*>(params.q_ptr) + bidb * params.q_batch_stride +
                         bidh * params.q_head_stride;
  const __half* k_base = static_cast<const __half*>(params.k_ptr) + bidb * params.k_batch_stride +
                         bidh_k * params.k_head_stride;
  const __half* v_base = static_cast<const __half*>(params.v_ptr) + bidb * params.v_batch_stride +
                         bidh_k * params.v_head_stride;
  __half* o_base = static_cast<__half*>(params.o_ptr) + bidb * params.o_batch_stride +
                   bidh * params.o_head_stride;

  const KeyRange kr = key_range(params.seqlen_k, params.leftpad_k, params.seqused_k, bidb);
  const BlockRange nb = n_block_range(m_block, kBM, kBN, params.seqlen_q, kr, Is_causal,
                                      params.causal_offset);
  const int row0 = m_block * kBM;
  const float scale_log2 = params.scale_softmax_log2;

  float m_i[2] = {-INFINITY, -INFINITY};  // running max of raw scores, rows g and g + 8
  float l_i[2] = {0.f, 0.f};              // running sum of exp2(s * scale_log2 - m), per thread
  float acc_o[kD / 8][4];                 // unnormalised O, 16 x d per warp
  zero_acc(acc_o);

  if (nb.n_block_max > nb.n_block_min) {
    uint4 stage[Kt::kChunksPerThread];
    // ---- prologue: the Q tile and the first K tile are fetched together (one global-memory
    // round trip, not two); Q -> shared -> (unless kQInSmem) registers, then K_0 -> sK.
    const uint32_t q_lane_addr =
        smem_u32addr(sQ + swizzle_offset<kCPR>(16 * warp + (lane % 16), lane / 16));
    {
      uint4 qstage[Kt::kQChunksPerThread];
      load_tile_g2r<Kt>(qstage, q_base, params.q_row_stride, row0, 0, params.seqlen_q, tid);
      load_tile_g2r<Kt>(stage, k_base, params.k_row_stride, nb.n_block_min * kBN, kr.key_start,
                        kr.key_end, tid);
      store_tile_r2s<Kt>(qstage, sQ, tid);
    }
    // Without kQInSmem, Q stays in registers for the whole loop: q_frag[kk] holds the A
    // fragments of k-steps 2kk (regs 0, 1) and 2kk + 1 (regs 2, 3) for this warp's 16 rows.
    uint32_t q_frag[Kt::kQInSmem ? 1 : kD / 16][4];
    if (!Kt::kQInSmem) {
      __syncthreads();
#pragma unroll
      for (int kk = 0; kk < (Kt::kQInSmem ? 1 : kD / 16); ++kk) {
        ldmatrix_x4(q_frag[kk], swizzle_xor(q_lane_addr, kk));
      }
      __syncthreads();  // every warp holds its Q fragments before the space is reused
    }
    store_tile_r2s<Kt>(stage, sK, tid);
    __syncthreads();

    // Per-lane ldmatrix base addresses (chunk pair 0); swizzle_xor selects chunk pair kk.
    //  K (non-trans): matrices (keys +0..7 | +8..15) x (chunk 2kk | 2kk+1) -> B of two n-tiles
    //                 and two k-steps of S = Q K^T.
    //  V (trans):     matrices (keys +0..7 | +8..15) x (chunk 2np | 2np+1) -> B of two k-steps
    //                 and two n-tiles of O += P V.
    const int mi = lane / 8;
    const uint32_t k_lane_addr =
        smem_u32addr(sK + swizzle_offset<kCPR>((mi >> 1) * 8 + (lane % 8), mi & 1));
    const uint32_t v_lane_addr =
        smem_u32addr(sV + swizzle_offset<kCPR>((mi & 1) * 8 + (lane % 8), mi >> 1));

    for (int n_block = nb.n_block_min; n_block < nb.n_block_max; ++n_block) {
      // V_j: global loads in flight while S_j and its softmax are computed.
      load_tile_g2r<Kt>(stage, v_base, params.v_row_stride, n_block * kBN, kr.key_start,
                        kr.key_end, tid);

      // ---- S = Q K_j^T (16 x Bc per warp, fp32)
      float acc_s[kBN / 8][4];
      if constexpr (Kt::kQInSmem) {
        gemm_ss_bt<kD, kBN, kRowBytes>(acc_s, q_lane_addr, k_lane_addr);
      } else {
        gemm_rs_bt<kD, kBN, kRowBytes>(acc_s, q_frag, k_lane_addr);
      }

      // ---- mask: only tiles crossing the key range or the causal diagonal pay for it.
      if (!tile_is_unmasked(m_block, n_block, kBM, kBN, kr, Is_causal, params.causal_offset)) {
#pragma unroll
        for (int nt = 0; nt < kBN / 8; ++nt) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int row = row0 + 16 * warp + g + (e >= 2 ? 8 : 0);
            const int col = n_block * kBN + 8 * nt + 2 * t + (e & 1);
            if (!key_visible(row, col, kr, Is_causal, params.causal_offset)) {
              acc_s[nt][e] = -INFINITY;
            }
          }
        }
      }

      // ---- online softmax on the accumulator fragments (rows g and g + 8 of the warp)
      uint32_t p_frag[kBN / 8][2];
      {
        float scaled_max[2], alpha[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          float mx = m_i[r];
#pragma unroll
          for (int nt = 0; nt < kBN / 8; ++nt) {
            mx = fmaxf(mx, fmaxf(acc_s[nt][2 * r], acc_s[nt][2 * r + 1]));
          }
          mx = quad_allreduce_max(mx);
          // A row that has seen no key yet keeps m = -inf; use 0 as the shift so that
          // exp2(-inf - shift) = 0 instead of exp2(-inf + inf) = NaN.
          scaled_max[r] = (mx == -INFINITY) ? 0.f : mx * scale_log2;
          alpha[r] = exp2f(m_i[r] * scale_log2 - scaled_max[r]);
          m_i[r] = mx;
          l_i[r] *= alpha[r];
        }
        // Rescale O by alpha = exp2(m_old - m_new). (Skipping it when no max grew was measured
        // slower on the H200: the branch breaks the scheduling of the unrolled tile; DESIGN.md.)
#pragma unroll
        for (int dt = 0; dt < kD / 8; ++dt) {
          acc_o[dt][0] *= alpha[0];
          acc_o[dt][1] *= alpha[0];
          acc_o[dt][2] *= alpha[1];
          acc_o[dt][3] *= alpha[1];
        }
#pragma unroll
        for (int nt = 0; nt < kBN / 8; ++nt) {
          const float p0 = exp2f(fmaf(acc_s[nt][0], scale_log2, -scaled_max[0]));
          const float p1 = exp2f(fmaf(acc_s[nt][1], scale_log2, -scaled_max[0]));
          const float p2 = exp2f(fmaf(acc_s[nt][2], scale_log2, -scaled_max[1]));
          const float p3 = exp2f(fmaf(acc_s[nt][3], scale_log2, -scaled_max[1]));
          l_i[0] += p0 + p1;
          l_i[1] += p2 + p3;
          p_frag[nt][0] = pack_half2(p0, p1);
          p_frag[nt][1] = pack_half2(p2, p3);
        }
      }

      // Every warp finished reading sV in the previous iteration (last barrier below), so V_j
      // can be written now.
      store_tile_r2s<Kt>(stage, sV, tid);
      __syncthreads();  // V_j visible; every warp is done with K_j

      const bool has_next = n_block + 1 < nb.n_block_max;
      if (has_next) {  // K_{j+1}: global loads in flight during O += P V_j
        load_tile_g2r<Kt>(stage, k_base, params.k_row_stride, (n_block + 1) * kBN, kr.key_start,
                          kr.key_end, tid);
      }

      // ---- O += P V_j: P (16 x Bc, fp16 A fragments) times V_j (Bc x d, ldmatrix.trans)
#pragma unroll
      for (int kp = 0; kp < kBN / 16; ++kp) {
#pragma unroll
        for (int np = 0; np < kD / 16; ++np) {
          uint32_t b[4];
          ldmatrix_x4_trans(b, swizzle_xor(v_lane_addr, np) + kp * 16 * kRowBytes);
          mma_k2n2(acc_o[2 * np], acc_o[2 * np + 1], p_frag[2 * kp], p_frag[2 * kp + 1], b);
        }
      }
      if (has_next) store_tile_r2s<Kt>(stage, sK, tid);
      __syncthreads();  // K_{j+1} visible; every warp is done with V_j
    }
  }

  // ---- epilogue: O = acc_o / l, LSE = m * scale + log(l). Rows that saw no key: O = 0,
  // LSE = -inf (never NaN).
  float lse[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float l = quad_allreduce_sum(l_i[r]);
    const bool any = l > 0.f;
    const float inv_l = any ? 1.f / l : 0.f;
    lse[r] = any ? m_i[r] * params.scale_softmax + logf(l) : -INFINITY;
#pragma unroll
    for (int dt = 0; dt < kD / 8; ++dt) {
      acc_o[dt][2 * r] *= inv_l;
      acc_o[dt][2 * r + 1] *= inv_l;
    }
  }

  // Stage the fp16 O tile through shared memory so global stores are 16-byte, row-contiguous
  // and coalesced: through sQ (each warp only ever read its own 16 rows there) or the K+V space
  // (free after the loop's last barrier).
  __half* sO = Kt::kQInSmem ? sQ : sK;
  if (Kt::kQInSmem) __syncwarp();
#pragma unroll
  for (int dt = 0; dt < kD / 8; ++dt) {
    const int row = 16 * warp + g;
    *reinterpret_cast<uint32_t*>(sO + swizzle_offset<kCPR>(row, dt) + 2 * t) =
        pack_half2(acc_o[dt][0], acc_o[dt][1]);
    *reinterpret_cast<uint32_t*>(sO + swizzle_offset<kCPR>(row + 8, dt) + 2 * t) =
        pack_half2(acc_o[dt][2], acc_o[dt][3]);
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < Kt::kQChunksPerThread; ++i) {
    const int idx = tid + i * Kt::kNThreads;
    const int r = idx / kCPR;
    const int c = idx % kCPR;
    const int grow = row0 + r;
    if (grow < params.seqlen_q) {
      *reinterpret_cast<uint4*>(o_base + grow * params.o_row_stride + c * 8) =
          *reinterpret_cast<const uint4*>(sO + swizzle_offset<kCPR>(r, c));
    }
  }
  if (t == 0) {
    float* lse_base = params.softmax_lse_ptr + bh * params.seqlen_q;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = row0 + 16 * warp + g + 8 * r;
      if (row < params.seqlen_q) lse_base[row] = lse[r];
    }
  }
}

}  // namespace flash_sm75
