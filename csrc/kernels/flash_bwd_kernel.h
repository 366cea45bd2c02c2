// FlashAttention backward for SM75 (Turing) tensor cores.
//
// Algorithm: FlashAttention-2 backward (Dao, arXiv:2307.08691, Algorithm 2). With the saved
// log-sum-exp L, P = exp(scale * Q K^T - L) is recomputed tile by tile, and
//   dV = P^T dO,   dP = dO V^T,   dS = P o (dP - D) with D = rowsum(dO o O),
//   dQ = scale * dS K,   dK = scale * dS^T Q.
// A gradient g of the lse output adds g_i P_ij to dS_ij; it is folded into D (D - g).
//
// Kernels (shapes in bwd_kernel_traits.h):
//  * flash_bwd_preprocess_kernel: D, one fp32 per query row.
//  * flash_bwd_dkdv_kernel: one CTA per (key block, batch, kv head); dK, dV of its Bc keys stay
//    in registers while it streams the query tiles of every q-head of the GQA group (so K/V are
//    never expanded and dK/dV come out already summed over the group). Warps compute
//    S^T = K Q^T and dP^T = V dO^T directly: accumulator rows are keys, and the fp32
//    accumulator layout of mma.m16n8k8 equals its fp16 A layout, so P^T and dS^T are packed to
//    fp16 in registers and used at once as the A operands of dV += P^T dO and dK += dS^T Q.
//    Atomic dQ mode: dS^T also goes to shared memory and the CTA adds dS K for the tile into an
//    fp32 buffer with coalesced atomicAdd (staged through shared memory).
//  * flash_bwd_convert_dq_kernel (atomic mode): dq = scale * dq_accum in fp16.
//  * flash_bwd_dq_kernel (deterministic mode): the forward's structure over query tiles,
//    recomputing S, P, dP and accumulating dQ = dS K in registers. No atomics anywhere, so
//    gradients are bitwise reproducible.
//
// SM75 specifics: only mma.sync.m16n8k8 and ldmatrix(.trans); no cp.async (global loads of the
// next tile are issued into registers before the current tile's MMAs and stored to shared memory
// after them, as in the forward); exp2 with scale * log2(e) folded in.
#pragma once

#include <cmath>
#include <cuda_fp16.h>

#include "block_info.h"
#include "bwd_block_info.h"
#include "bwd_kernel_traits.h"
#include "dropout.h"
#include "flash_bwd.h"
#include "fragment.h"
#include "score_mod.h"
#include "seq_info.h"
#include "tile_io.h"
#include "utils.h"

namespace flash_sm75 {

constexpr float kLog2e = 1.4426950408889634f;

// Offset (floats) of element (row, col) in a row-major fp32 tile with kCols columns and rows
// padded to kCols + 8 floats (kCols a multiple of 32): float2 stores from an mma accumulator
// (8 rows x 4 column pairs per instruction) touch every bank at most twice (the minimum for
// 64-bit stores), a warp reading 32 consecutive floats of a row touches 32 distinct banks, and
// a thread's successive rows are constant offsets apart. The tile is exactly two padded fp16
// tiles of the same shape, which it aliases.
template <int kCols>
__device__ __forceinline__ int fp32_tile_offset(int row, int col) {
  return row * (kCols + 8) + col;
}

// The saved lse of a row in log2 units, as the exp2 recompute of P wants it. A row that saw no
// key in the forward (lse = -inf), or a row past seqlen_q (callers pass -inf), gets +inf:
// P = exp2(s - inf) = 0, so it contributes nothing (never NaN).
__device__ __forceinline__ float lse_log2(float lse) {
  return lse == -INFINITY ? INFINITY : lse * kLog2e;
}

// ---------------------------------------------------------------------------------------------
// D_i = sum_c dO[i][c] * O[i][c] - dlse_i, for every (batch, head, query row): one thread per
// 16-byte chunk, in groups of bwd_preprocess_threads_per_row (kHeadDim / 8 rounded up to a power
// of two) per row, reduced with shuffles. Chunks at or past the head dim d (head_dims.h; at
// kHeadDim = 96 also the 4 idle threads of a row's 16) are not read and add 0.
template <int kHeadDim>
__global__ void __launch_bounds__(kBwdAuxThreads)
    flash_bwd_preprocess_kernel(const Flash_bwd_params params) {
  constexpr int kTPR = bwd_preprocess_threads_per_row(kHeadDim);
  constexpr int kRowsPerBlock = kBwdAuxThreads / kTPR;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kTPR;
  const int c = threadIdx.x % kTPR;
  const int64_t total = static_cast<int64_t>(params.b) * params.h * params.seqlen_q;
  float acc = 0.f;
  if (row < total && c * 8 < params.d) {
    const int i = static_cast<int>(row % params.seqlen_q);
    const int64_t bh = row / params.seqlen_q;
    const int bidb = static_cast<int>(bh / params.h);
    const int bidh = static_cast<int>(bh % params.h);
    const __half* dout = static_cast<const __half*>(params.do_ptr) + bidb * params.do_batch_stride +
                         i * params.do_row_stride + bidh * params.do_head_stride + c * 8;
    const __half* o = static_cast<const __half*>(params.o_ptr) + bidb * params.o_batch_stride +
                      i * params.o_row_stride + bidh * params.o_head_stride + c * 8;
    const uint4 a = __ldg(reinterpret_cast<const uint4*>(dout));
    const uint4 b = __ldg(reinterpret_cast<const uint4*>(o));
    const uint32_t av[4] = {a.x, a.y, a.z, a.w};
    const uint32_t bv[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      __half2 ha, hb;
      *reinterpret_cast<uint32_t*>(&ha) = av[j];
      *reinterpret_cast<uint32_t*>(&hb) = bv[j];
      const float2 fa = __half22float2(ha);
      const float2 fb = __half22float2(hb);
      acc = fmaf(fa.x, fb.x, acc);
      acc = fmaf(fa.y, fb.y, acc);
    }
  }
#pragma unroll
  for (int off = kTPR / 2; off >= 1; off /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  if (row < total && c == 0) {
    if (params.dlse_ptr != nullptr) acc -= params.dlse_ptr[row];
    params.dsoftmax_sum[row] = acc;
  }
}

// ---------------------------------------------------------------------------------------------
// Atomic mode: dq (fp16, strided) = softmax_scale * dq_accum (fp32, batch x h x seqlen_q x
// kHeadDim: rows are the bucket's width, see mha_bwd). Columns at or past d are not written.
template <int kHeadDim>
__global__ void __launch_bounds__(kBwdAuxThreads)
    flash_bwd_convert_dq_kernel(const Flash_bwd_params params) {
  constexpr int kCPR = kHeadDim / 8;
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * kBwdAuxThreads + threadIdx.x;
  const int64_t total = static_cast<int64_t>(params.b) * params.h * params.seqlen_q * kCPR;
  if (idx >= total) return;
  const int c = static_cast<int>(idx % kCPR);
  if (c * 8 >= params.d) return;
  const int64_t row = idx / kCPR;  // (batch, head, query) row of dq_accum
  const int i = static_cast<int>(row % params.seqlen_q);
  const int64_t bh = row / params.seqlen_q;
  const int bidb = static_cast<int>(bh / params.h);
  const int bidh = static_cast<int>(bh % params.h);
  const float4* src = reinterpret_cast<const float4*>(params.dq_accum_ptr + row * kHeadDim + c * 8);
  const float4 x = src[0];
  const float4 y = src[1];
  const float s = params.scale_softmax;
  uint4 out;
  out.x = pack_half2(x.x * s, x.y * s);
  out.y = pack_half2(x.z * s, x.w * s);
  out.z = pack_half2(y.x * s, y.y * s);
  out.w = pack_half2(y.z * s, y.w * s);
  __half* dst = static_cast<__half*>(params.dq_ptr) + bidb * params.dq_batch_stride +
                i * params.dq_row_stride + bidh * params.dq_head_stride + c * 8;
  *reinterpret_cast<uint4*>(dst) = out;
}

// Adds the partial accumulators (16 keys x kDOut columns col0 .. per warp) of query splits
// wm = 1 .. kNWarpsM - 1 into those of wm = 0, through the fp32 buffer sRed (Bc x d). Called by
// all threads; the caller guarantees sRed is free.
template <typename Kt>
__device__ __forceinline__ void reduce_over_query_splits(float (&acc)[Kt::kDOut / 8][4],
                                                         float* sRed, int wn, int wm, int col0,
                                                         int g, int t) {
  constexpr int kD = Kt::kHeadDim;
  const int row = 16 * wn + g;
  for (int src = 1; src < Kt::kNWarpsM; ++src) {
    if (wm == src) {
#pragma unroll
      for (int dt = 0; dt < Kt::kDOut / 8; ++dt) {
        const int col = col0 + 8 * dt + 2 * t;
        *reinterpret_cast<float2*>(sRed + fp32_tile_offset<kD>(row, col)) =
            make_float2(acc[dt][0], acc[dt][1]);
        *reinterpret_cast<float2*>(sRed + fp32_tile_offset<kD>(row + 8, col)) =
            make_float2(acc[dt][2], acc[dt][3]);
      }
    }
    __syncthreads();
    if (wm == 0) {
#pragma unroll
      for (int dt = 0; dt < Kt::kDOut / 8; ++dt) {
        const int col = col0 + 8 * dt + 2 * t;
        const float2 x = *reinterpret_cast<const float2*>(sRed + fp32_tile_offset<kD>(row, col));
        const float2 y = *reinterpret_cast<const float2*>(sRed + fp32_tile_offset<kD>(row + 8, col));
        acc[dt][0] += x.x;
        acc[dt][1] += x.y;
        acc[dt][2] += y.x;
        acc[dt][3] += y.y;
      }
    }
    __syncthreads();
  }
}

// ---------------------------------------------------------------------------------------------
// Pieces of the dK/dV kernel. A warp owns 16 keys (rows of its S^T / dP^T accumulators) and
// kWC query columns qc0 .. qc0 + kWC - 1 of the current query tile.

// (key block, batch, kv head) of this CTA. Causal: the first key blocks are seen by the most
// queries, so they are scheduled first.
struct DkdvBlock {
  int n_block;
  int bidb;
  int bidh_k;
};
template <bool Is_causal>
__device__ __forceinline__ DkdvBlock dkdv_block(const Flash_bwd_params& params, int block_n) {
  const int num_n_blocks = ceil_div(params.seqlen_k, block_n);
  const int64_t num_bhk = static_cast<int64_t>(params.b) * params.h_k;
  const int64_t linear = blockIdx.x;
  int n_block;
  int64_t bhk;
  if (Is_causal) {
    const TileOrder o = causal_tile_order(linear, num_n_blocks, num_bhk);
    bhk = o.bh;
    n_block = o.rank;
  } else {
    n_block = static_cast<int>(linear % num_n_blocks);
    bhk = linear / num_n_blocks;
  }
  return {n_block, static_cast<int>(bhk / params.h_k), static_cast<int>(bhk % params.h_k)};
}

// The first row of K (kV = false) or V (true) of kv head bidh_k of batch bidb (packed sequences
// through si).
template <bool kV, typename Si>
__device__ __forceinline__ const __half* kv_rows(const Flash_bwd_params& params, const Si& si,
                                                 int bidb, int bidh_k) {
  return static_cast<const __half*>(kV ? params.v_ptr : params.k_ptr) +
         si.k_offset(bidb, kV ? params.v_batch_stride : params.k_batch_stride,
                     kV ? params.v_row_stride : params.k_row_stride) +
         bidh_k * (kV ? params.v_head_stride : params.k_head_stride);
}

// P = exp2(S * scale_log2 - lse_log2), at most 1. The clamp trims rounding noise at ordinary
// magnitudes and matters where a float32 LSE cannot resolve the row max: |lse_log2| >= 2^24
// (|q.k| * scale ~ 10^7), where the rounding error of the product exceeds 1 in the exponent.
// P is then effectively 0 or 1, so those gradients are finite but not accurate (the forward's
// output is exact, see kExactExpFrom), never inf, which would turn into NaN gradients. A NaN
// score or lse stays NaN (fminf(NaN, 0) would be 0, P = 1: a NaN input must not give finite
// gradients).
__device__ __forceinline__ float recompute_p(float s, float scale_log2, float lse_log2) {
  const float x = fmaf(s, scale_log2, -lse_log2);
  return exp2f(x > 0.f ? 0.f : x);
}

// P^T = exp2(S^T * scale_log2 - lse_log2[query]), 0 where masked, in place in acc_s, and packed
// as the fp16 A fragments of dV += P^T dO. Element (nt, e): key key_g + 8 (e >= 2), query
// m0 + qc0 + 8 nt + 2 t + (e & 1); sLse holds the tile's lse * log2(e).
// Is_ext: acc_s holds softcapped scores (softcap_scores); ALiBi is added here, and acc_s keeps
// P times the softcap's derivative (the factor dS needs; p_frag keeps P for dV).
// The raw bias bits of a lane's elements of one S^T tile (bias_gather): element (nt, e) is
// key key_g + 8 (e >= 2), query q_w + 8 nt + 2 t + (e & 1), q_w the warp's first query. A
// lane's elements are never adjacent in memory (its pairs run along queries, Sk apart), so
// these are scalar loads, all of the tile's issued before any is used.
template <int Kind, int kWC>
__device__ __forceinline__ void bias_gather_t(uint32_t (&w)[kWC / 2], const Flash_fwd_params& p,
                                              int64_t bias_off, int key_g, int q_w, int t) {
  const bool inside = q_w + kWC <= p.seqlen_q && key_g + 8 < p.seqlen_k;
  const int q0 = q_w + 2 * t;
  auto coord = [&](int i) {
    return make_int2(q0 + 8 * (i / 4) + (i & 1), key_g + ((i & 3) >= 2 ? 8 : 0));
  };
  if (inside) {  // uniform per thread: the common case without per-element bounds
    bias_gather<Kind, kWC / 2>(w, p, bias_off, true, coord);
  } else {
    bias_gather<Kind, kWC / 2>(w, p, bias_off, false, coord);
  }
}

// The fp32 pairs of a per-query shared array (lse or D) that a lane's S^T columns need:
// queries qc0 + 8 nt + 2 t and + 1. Read apart from their use where the loads can be issued well
// before it (the K-in-registers kernel: before the S^T / dP^T loop).
template <int kWC>
__device__ __forceinline__ void read_pairs(float2 (&v)[kWC / 8], const float* s, int qc0, int t) {
#pragma unroll
  for (int nt = 0; nt < kWC / 8; ++nt) {
    v[nt] = *reinterpret_cast<const float2*>(s + qc0 + 8 * nt + 2 * t);
  }
}

// probs_t without score modifiers, with the tile's lse pairs (read_pairs of sLse) given.
template <int kWC, bool Is_causal, bool Is_local>
__device__ __forceinline__ void probs_t_plain(float (&acc_s)[kWC / 8][4],
                                              uint32_t (&p_frag)[kWC / 8][2],
                                              const float2 (&lse2)[kWC / 8], int qc0, int t,
                                              float scale_log2, bool need_mask, int key_g, int m0,
                                              const KeyRange& kr, int causal_offset,
                                              int window_lower) {
#pragma unroll
  for (int nt = 0; nt < kWC / 8; ++nt) {
    const int qcol = qc0 + 8 * nt + 2 * t;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float p = recompute_p(acc_s[nt][e], scale_log2, (e & 1) ? lse2[nt].y : lse2[nt].x);
      if (need_mask) {
        const int key = key_g + (e >= 2 ? 8 : 0);
        const int query = m0 + qcol + (e & 1);
        if (!key_visible<Is_local>(query, key, kr, Is_causal, causal_offset, window_lower)) p = 0.f;
      }
      acc_s[nt][e] = p;
    }
    p_frag[nt][0] = pack_half2(acc_s[nt][0], acc_s[nt][1]);
    p_frag[nt][1] = pack_half2(acc_s[nt][2], acc_s[nt][3]);
  }
}

// Bias_ahead: the tile's bias bits were gathered one tile ahead (bias_w, bias_gather_t);
// otherwise probs_t reads them here.
template <int kWC, bool Is_causal, bool Is_local, bool Is_ext = false, bool Has_bias = false,
          bool Bias_ahead = false, bool Plain_path = false>
__device__ __forceinline__ void probs_t(float (&acc_s)[kWC / 8][4], uint32_t (&p_frag)[kWC / 8][2],
                                        const float* sLse, int qc0, int t, float scale_log2,
                                        bool need_mask, int key_g, int m0, const KeyRange& kr,
                                        int causal_offset, int window_lower,
                                        const ScoreMod& smod, const Flash_fwd_params& params,
                                        const uint32_t (&bias_w)[kWC / 2]) {
  bool plain = !Is_ext;
  if constexpr (Is_ext) {
    // The bias first, in a loop of its own (in the main loop the d = 96 / 128 / 256 kernels
    // spilled), so that the mask below overwrites what it hides (a NaN or +inf bias at a hidden
    // position must not survive as -inf + NaN, as the forward's mask overwrites it too). Added
    // before the softcap's derivative is read back from acc_s, so the host refuses a softcap
    // with a bias in the backward. Not in the d = 256 kernel (32 bytes of spill even here): the
    // host refuses a bias's backward there (kBwdBiasMaxHeadDim).
    if (Has_bias && params.bias_ptr != nullptr) {
      if constexpr (Bias_ahead) {
        with_bias_kind(params, [&](auto kind) {
          bias_add_raw<decltype(kind)::value, kWC / 2>(&acc_s[0][0], bias_w, params);
        });
      } else if constexpr (!Is_local) {
        with_bias_kind(params, [&](auto kind) {
          uint32_t w[kWC / 2];
          bias_gather_t<decltype(kind)::value, kWC>(w, params, smod.bias_off, key_g, m0 + qc0, t);
          bias_add_raw<decltype(kind)::value, kWC / 2>(&acc_s[0][0], w, params);
        });
      } else {
        // The band kernels: the form above spilled d = 128's (4 bytes); ptxas keeps fewer of
        // these loads in flight (d = 128, H200: the form above 10.2 ms, this 13.3 ms for the
        // dK/dV kernel at B 4, H 16, N 4096 with a (B, H, N, N) bias).
        const int q0 = m0 + qc0 + 2 * t;
        const bool inside = m0 + qc0 + kWC <= params.seqlen_q && key_g + 8 < params.seqlen_k;
        with_bias_kind(params, [&](auto kind) {
          bias_add_gathered<decltype(kind)::value, kWC / 2, kWC / 2>(
              acc_s, params, smod.bias_off, inside, [&](int i) {
                return make_int2(q0 + 8 * (i / 4) + (i & 1), key_g + ((i & 3) >= 2 ? 8 : 0));
              });
        });
      }
    }
    // Without a softcap or ALiBi (dropout, a bias: the extended kernel's other users) the
    // scores need neither: the plain kernel's loop below, which skips the per-score distance and
    // derivative (uniform per tile; the bias is already in acc_s, and that loop's mask
    // overwrites what it hides as the one here does). Plain_path: compiled only where both
    // loops fit in 255 registers (the kernels that run dropout; flash_bwd_dkdv_kernel).
    if constexpr (Plain_path) plain = no_score_mod(smod);
  }
  if (Is_ext && !plain) {
    // Masked scores -> -inf, in a loop of their own: with the ALiBi arithmetic in the same
    // loop the d = 256 local kernel spilled (255 registers). A masked score's derivative is
    // clamped to 0 (1 - inf^2), so P * derivative is 0, not 0 * -inf.
    if (need_mask) {
#pragma unroll
      for (int nt = 0; nt < kWC / 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = key_g + (e >= 2 ? 8 : 0);
          const int query = m0 + qc0 + 8 * nt + 2 * t + (e & 1);
          if (!key_visible<Is_local>(query, key, kr, Is_causal, causal_offset, window_lower)) {
            acc_s[nt][e] = -INFINITY;
          }
        }
      }
    }
#pragma unroll
    for (int nt = 0; nt < kWC / 8; ++nt) {
      const int qcol = qc0 + 8 * nt + 2 * t;
      const float2 lse2 = *reinterpret_cast<const float2*>(sLse + qcol);
      // ALiBi distance query + offset - key of element 0 (exact in float below 2^24).
      const float dist0 = static_cast<float>(m0 + qcol + smod.offset - key_g);
      float p[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float x = acc_s[nt][e];
        const float dcap = fmaxf(
            alibi_and_dcap(smod, x, dist0 + static_cast<float>((e & 1) - (e >= 2 ? 8 : 0))), 0.f);
        p[e] = recompute_p(x, scale_log2, (e & 1) ? lse2.y : lse2.x);
        acc_s[nt][e] = p[e] * dcap;
      }
      p_frag[nt][0] = pack_half2(p[0], p[1]);
      p_frag[nt][1] = pack_half2(p[2], p[3]);
    }
    return;
  }
  float2 lse2[kWC / 8];
  read_pairs<kWC>(lse2, sLse, qc0, t);
  probs_t_plain<kWC, Is_causal, Is_local>(acc_s, p_frag, lse2, qc0, t, scale_log2, need_mask,
                                          key_g, m0, kr, causal_offset, window_lower);
}

// dS^T = P^T o (dP^T - D[query]) as fp16 A fragments, dsum = the tile's D pairs (read_pairs).
// Dropout: acc_s holds P with the sign of its keep bit (dropout_sign_p), dS^T = P^T o (Z dP^T /
// (1 - p) - D).
template <int kWC, bool Dropout = false>
__device__ __forceinline__ void dsoftmax_t(const float (&acc_s)[kWC / 8][4],
                                           const float (&acc_dp)[kWC / 8][4],
                                           uint32_t (&ds_frag)[kWC / 8][2],
                                           const float2 (&dsum)[kWC / 8], float rp = 1.f) {
#pragma unroll
  for (int nt = 0; nt < kWC / 8; ++nt) {
    const float2 dsum2 = dsum[nt];
    if constexpr (Dropout) {
      ds_frag[nt][0] = pack_half2(dropout_ds(acc_s[nt][0], acc_dp[nt][0], dsum2.x, rp),
                                  dropout_ds(acc_s[nt][1], acc_dp[nt][1], dsum2.y, rp));
      ds_frag[nt][1] = pack_half2(dropout_ds(acc_s[nt][2], acc_dp[nt][2], dsum2.x, rp),
                                  dropout_ds(acc_s[nt][3], acc_dp[nt][3], dsum2.y, rp));
      continue;
    }
    ds_frag[nt][0] = pack_half2(acc_s[nt][0] * (acc_dp[nt][0] - dsum2.x),
                                acc_s[nt][1] * (acc_dp[nt][1] - dsum2.y));
    ds_frag[nt][1] = pack_half2(acc_s[nt][2] * (acc_dp[nt][2] - dsum2.x),
                                acc_s[nt][3] * (acc_dp[nt][3] - dsum2.y));
  }
}

// The same with the tile's D read from shared memory here (sDsum).
template <int kWC, bool Dropout = false>
__device__ __forceinline__ void dsoftmax_t(const float (&acc_s)[kWC / 8][4],
                                           const float (&acc_dp)[kWC / 8][4],
                                           uint32_t (&ds_frag)[kWC / 8][2], const float* sDsum,
                                           int qc0, int t, float rp = 1.f) {
  float2 dsum2[kWC / 8];
  read_pairs<kWC>(dsum2, sDsum, qc0, t);
  dsoftmax_t<kWC, Dropout>(acc_s, acc_dp, ds_frag, dsum2, rp);
}

// Epilogue: dK * scale and dV of the warp's 16 keys key0 .. key0 + 15 (rows g, g + 8 of the
// accumulators) and kDO columns col0 .., fp16, rows past seqlen_k and columns past the head dim
// d skipped.
template <int kDO, typename Si>
__device__ __forceinline__ void store_dkdv(const Flash_bwd_params& params,
                                           const float (&acc_dk)[kDO / 8][4],
                                           const float (&acc_dv)[kDO / 8][4], int bidb, int bidh_k,
                                           int key0, int col0, int g, int t, const Si& si) {
  __half* dk_base = static_cast<__half*>(params.dk_ptr) +
                    si.k_offset(bidb, params.dk_batch_stride, params.dk_row_stride) +
                    bidh_k * params.dk_head_stride;
  __half* dv_base = static_cast<__half*>(params.dv_ptr) +
                    si.k_offset(bidb, params.dv_batch_stride, params.dv_row_stride) +
                    bidh_k * params.dv_head_stride;
  const float scale = params.scale_softmax;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int key = key0 + g + 8 * r;
    if (key < si.seqlen_k()) {
#pragma unroll
      for (int dt = 0; dt < kDO / 8; ++dt) {
        if (col0 + 8 * dt >= params.d) break;
        const int col = col0 + 8 * dt + 2 * t;
        *reinterpret_cast<uint32_t*>(dk_base + key * params.dk_row_stride + col) =
            pack_half2(acc_dk[dt][2 * r] * scale, acc_dk[dt][2 * r + 1] * scale);
        *reinterpret_cast<uint32_t*>(dv_base + key * params.dv_row_stride + col) =
            pack_half2(acc_dv[dt][2 * r], acc_dv[dt][2 * r + 1]);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// dK / dV (and, in atomic mode, dQ partial sums). See the file comment and
// Flash_bwd_kernel_traits for the work split.
// Is_local: the causal band has a lower diagonal too (a sliding window, params.window_lower).
// Is_ext: a softcap and / or ALiBi slopes modify the scores (score_mod.h).
// Drop_only: the plain kernel with dropout's code (flash_bwd.h kBwdDropout).
template <typename Kt, bool Is_causal, bool Atomic_dq, bool Is_local = false, bool Is_ext = false,
          bool Drop_only = false>
__global__ void __launch_bounds__(Kt::kNThreads, 1)
    flash_bwd_dkdv_kernel(const Flash_bwd_params params) {
  constexpr int kD = Kt::kHeadDim;
  constexpr int kBM = Kt::kBlockM;
  constexpr int kBN = Kt::kBlockN;
  constexpr int kRowH = Kt::kRowHalves;     // padded row stride of sK, sV, sQ, sdO (halves)
  constexpr int kRowB = Kt::kRowHalves * 2;  // same, bytes
  constexpr int kWC = Kt::kWarpCols;
  constexpr int kDsRow = Kt::kDsRowHalves;
  constexpr uint32_t kVfromK = Kt::kOffV - Kt::kOffK;     // byte offset sV - sK
  constexpr uint32_t kDofromQ = Kt::kOffDo - Kt::kOffQ;   // byte offset sdO - sQ
  constexpr int kDO = Kt::kDOut;  // dK / dV columns of a warp
  // Dropout (dropout.h) in the deterministic-dQ kernels of traits with kDropout: the atomic ones
  // and d = 256's plain tile have no register left for it (spills); the host runs a dropout's
  // backward with the dQ kernel, at d = 256 on Bwd_tile_config<256>::DropoutTraits.
  static_assert(!(Is_ext && Drop_only), "one family");
  constexpr bool kDropout = (Is_ext || Drop_only) && !Atomic_dq && Kt::kDropout;

  extern __shared__ __align__(1024) unsigned char smem_raw[];
  __half* sK = reinterpret_cast<__half*>(smem_raw + Kt::kOffK);    // Bc x d (padded rows)
  __half* sV = reinterpret_cast<__half*>(smem_raw + Kt::kOffV);    // Bc x d
  __half* sQ = reinterpret_cast<__half*>(smem_raw + Kt::kOffQ);    // Br x d
  __half* sdO = reinterpret_cast<__half*>(smem_raw + Kt::kOffDo);  // Br x d
  float* sLse = reinterpret_cast<float*>(smem_raw + Kt::kOffLse);  // Br: lse * log2(e)
  float* sDsum = reinterpret_cast<float*>(smem_raw + Kt::kOffDsum);  // Br: D
  __half* sdS = reinterpret_cast<__half*>(smem_raw + Kt::kOffDs);  // Bc x (Br + 8): dS^T
  float* sdQ = reinterpret_cast<float*>(smem_raw + Kt::kOffQ);     // Br x d fp32, aliases sQ+sdO
  float* sRed = reinterpret_cast<float*>(smem_raw + Kt::kOffK);    // Bc x d fp32, aliases sK+sV

  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int g = lane / 4;
  const int t = lane % 4;
  const int mi = lane / 8;             // which 8x8 matrix of an ldmatrix.x4 this lane addresses
  const int wn = warp % Kt::kNWarpsN;  // key group: keys 16 wn .. 16 wn + 15
  // query split: columns qc0 .. qc0 + kWC - 1 of a tile
  const int wm = Kt::kDSplit == 1 ? warp / Kt::kNWarpsN : (warp / Kt::kNWarpsN) % Kt::kNWarpsM;
  // column split: dK / dV columns col0 .. col0 + kDO - 1
  const int ws = Kt::kDSplit == 1 ? 0 : warp / (Kt::kNWarpsN * Kt::kNWarpsM);
  const int col0 = ws * kDO;
  const int qc0 = wm * kWC;

  const DkdvBlock blk = dkdv_block<Is_causal>(params, kBN);
  const int n_block = blk.n_block, bidb = blk.bidb, bidh_k = blk.bidh_k;
  const int ratio = params.h_h_k_ratio;
  const int n0 = n_block * kBN;

  // Packed sequences where the tile has the registers (kPackedSeq: not d = 256's plain tile).
  constexpr bool kSeq = Is_ext && Kt::kPackedSeq;
  const SeqInfo<kSeq> si(params, bidb);
  // A packed entry shorter than the grid's longest: blocks past its keys hold none of its keys
  // (their rows belong to other entries); uniform over the CTA, before any barrier.
  if constexpr (kSeq) {
    if (n0 >= si.seqlen_k()) return;
  }
  const KeyRange kr = si.keys(bidb);
  const MBlockRange mr = m_block_range<Is_local>(n_block, kBM, kBN, si.seqlen_q(), kr, Is_causal,
                                                 si.causal_off(), si.window_lower());
  const int num_m = imax(mr.m_block_max - mr.m_block_min, 0);
  const int total = num_m * ratio;  // (q head of the group, query tile) iterations
  const float scale_log2 = params.scale_softmax_log2;

  float acc_dk[kDO / 8][4];
  float acc_dv[kDO / 8][4];
#pragma unroll
  for (int i = 0; i < kDO / 8; ++i) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      acc_dk[i][j] = 0.f;
      acc_dv[i][j] = 0.f;
    }
  }

  if (total > 0) {
    // ---- K and V of the block -> shared memory, rows outside the key range zero-filled.
    {
      const __half* k_base = kv_rows<false>(params, si, bidb, bidh_k);
      const __half* v_base = kv_rows<true>(params, si, bidb, bidh_k);
      uint4 kv[Kt::kKVChunksPerThread];
      load_tile_g2r<Kt>(kv, k_base, params.k_row_stride, n0, kr.key_start, kr.key_end, tid,
                        params.d / 8);
      store_tile_r2s_padded<Kt>(kv, sK, tid);
      load_tile_g2r<Kt>(kv, v_base, params.v_row_stride, n0, kr.key_start, kr.key_end, tid,
                        params.d / 8);
      store_tile_r2s_padded<Kt>(kv, sV, tid);
    }

    // Iteration it visits q-head it / num_m of the group and query tile tile_m_block(it). Atomic
    // mode rotates the tile order by n_block: the CTAs of one head, which run concurrently, then
    // add into different dq_accum rows at any moment instead of all hitting the same addresses
    // (same-address atomics serialize in L2). The rotation is a fixed function of n_block, so
    // the dK/dV sums keep a fixed order.
    const int rotate = Atomic_dq ? n_block % num_m : 0;
    auto tile_m_block = [&](int it) {
      int m = it % num_m + rotate;
      if (m >= num_m) m -= num_m;
      return mr.m_block_min + m;
    };

    // ---- register staging of one (Q, dO, lse, D) query tile; rows past seqlen_q are zero.
    uint4 q_stage[Kt::kQChunksPerThread];
    uint4 do_stage[Kt::kQChunksPerThread];
    float lse_stage = 0.f, dsum_stage = 0.f;
    constexpr bool kLseAtStore = kD == 128;
    auto load_tile = [&](int it) {
      const int head = bidh_k * ratio + it / num_m;
      const int m0 = tile_m_block(it) * kBM;
      const __half* q_base = static_cast<const __half*>(params.q_ptr) +
                             si.q_offset(bidb, params.q_batch_stride, params.q_row_stride) +
                             head * params.q_head_stride;
      const __half* do_base = static_cast<const __half*>(params.do_ptr) +
                              si.q_offset(bidb, params.do_batch_stride, params.do_row_stride) +
                              head * params.do_head_stride;
      load_tile_g2r<Kt>(q_stage, q_base, params.q_row_stride, m0, 0, si.seqlen_q(), tid,
                        params.d / 8);
      load_tile_g2r<Kt>(do_stage, do_base, params.do_row_stride, m0, 0, si.seqlen_q(), tid,
                        params.d / 8);
      if (tid < kBM) {
        const int row = m0 + tid;
        const int64_t off = si.lse_index(bidb, head, row);
        // d = 64: converted right after the load (converting in store_tile measured 1.6-1.9%
        // slower). d = 128 (kLseAtStore): converted in store_tile, so that the conversion does
        // not wait out the load at the top of the iteration (ncu: 2.4% of the samples there).
        const float lse = row < si.seqlen_q() ? params.softmax_lse_ptr[off] : -INFINITY;
        lse_stage = kLseAtStore ? lse : lse_log2(lse);
        dsum_stage = row < si.seqlen_q() ? params.dsoftmax_sum[off] : 0.f;
      }
    };
    auto store_tile = [&]() {
      store_tile_r2s_padded<Kt>(q_stage, sQ, tid);
      store_tile_r2s_padded<Kt>(do_stage, sdO, tid);
      if (tid < kBM) {
        sLse[tid] = kLseAtStore ? lse_log2(lse_stage) : lse_stage;
        sDsum[tid] = dsum_stage;
      }
    };
    load_tile(0);
    store_tile();

    // The bias of a tile, gathered one tile ahead where registers allow (d = 64: 16 of them, the
    // kernel at ~200 of 255): issued after the previous tile's P^T, its loads are in flight
    // through that tile's dV, dP^T, dS^T, dK and this tile's S^T, where read in probs_t each
    // tile waited one memory latency (8 warps per SM on the Turing plan: too few to cover it).
    constexpr bool kBiasAhead = Is_ext && kD <= 64;
    uint32_t bias_w[kWC / 2];
    auto bias_ahead = [&](int it2) {
      if (!kBiasAhead || params.bias_ptr == nullptr) return;
      const int head2 = bidh_k * ratio + it2 / num_m;
      const int64_t off = static_cast<int64_t>(bidb) * params.bias_batch_stride +
                          static_cast<int64_t>(head2) * params.bias_head_stride;
      with_bias_kind(params, [&](auto kind) {
        bias_gather_t<decltype(kind)::value, kWC>(bias_w, params, off, n0 + 16 * wn + g,
                                                  tile_m_block(it2) * kBM + qc0, t);
      });
    };
    bias_ahead(0);
    __syncthreads();

    // Per-lane ldmatrix base addresses; k-steps / n-tiles are constant offsets from them.
    //  A of S^T / dP^T (non-trans): this warp's 16 keys of K / V, matrices (keys +0..7 | +8..15)
    //    x (chunk 2kk | 2kk+1): regs {0,1} = k-step 2kk, {2,3} = k-step 2kk+1.
    //  B of S^T / dP^T (non-trans): Q / dO rows = queries, matrices (queries +0..7 | +8..15 of
    //    the 16-query pair np) x (chunk 2kk | 2kk+1).
    //  B of dV / dK (trans): dO / Q rows = queries = the k dimension, matrices (queries +0..7 |
    //    +8..15) x (chunk col0 / 8 + 2np | + 2np+1).
    const uint32_t k_a_addr = smem_u32addr(sK + (16 * wn + (lane % 16)) * kRowH + (lane / 16) * 8);
    const uint32_t q_b_addr =
        smem_u32addr(sQ + (qc0 + (mi >> 1) * 8 + (lane % 8)) * kRowH + (mi & 1) * 8);
    const uint32_t q_t_addr =
        smem_u32addr(sQ + (qc0 + (mi & 1) * 8 + (lane % 8)) * kRowH + col0 + (mi >> 1) * 8);

    for (int it = 0; it < total; ++it) {
      const int head = bidh_k * ratio + it / num_m;
      const int m_block = tile_m_block(it);
      const int m0 = m_block * kBM;
      const bool has_next = it + 1 < total;
      // Dropout's kept elements of this tile (dropout.h), bit 4 nt + e, taken before S^T and
      // the next tile's staging registers are live.
      static_assert(!kDropout || kWC <= 64, "dropout: one 32-bit mask of the thread's elements");
      uint32_t keep = ~0u;
      if (kDropout && params.dropout) {
        keep = dropout_bits<kWC / 8, true>(dropout_rng_saved(params),
                                          static_cast<uint32_t>(bidb * params.h + head),
                                          n0 + 16 * wn, m0 + qc0, g, t,
                                          params.dropout_keep_threshold);
      }
      // Next tile's global loads in flight during this tile's MMAs. Atomic mode issues them
      // later (before dQ = dS K), where fewer registers are live.
      if (!Atomic_dq && has_next) load_tile(it + 1);

      // Order: S^T -> P^T -> dV += P^T dO -> dP^T -> dS^T -> dK += dS^T Q, so that S^T and dP^T
      // are never both being accumulated (register pressure at d = 128).
      // ---- S^T = K_w Q^T: 16 keys x kWC queries per warp, fp32.
      float acc_s[kWC / 8][4];
      zero_acc(acc_s);
#pragma unroll
      for (int kk = 0; kk < kD / 16; ++kk) {
        uint32_t a[4];
        ldmatrix_x4(a, k_a_addr + kk * 32);
        const uint32_t a_lo[2] = {a[0], a[1]};
        const uint32_t a_hi[2] = {a[2], a[3]};
#pragma unroll
        for (int np = 0; np < kWC / 16; ++np) {
          uint32_t b[4];
          ldmatrix_x4(b, q_b_addr + np * 16 * kRowB + kk * 32);
          mma_k2n2(acc_s[2 * np], acc_s[2 * np + 1], a_lo, a_hi, b);
        }
      }

      // ---- P^T = exp2(S^T * scale_log2 - lse_log2[query]), 0 where masked; kept in acc_s.
      // Element (nt, e): key 16 wn + g + 8 (e >= 2), query qc0 + 8 nt + 2 t + (e & 1).
      const bool need_mask =
          !tile_is_unmasked<Is_local>(m_block, n_block, kBM, kBN, kr, Is_causal, si.causal_off(),
                                      si.window_lower());
      ScoreMod smod{};
      if constexpr (Is_ext) {
        // The head changes with it (GQA group).
        smod = score_mod_for(params, bidb, head, si.alibi_off());
        softcap_scores<kWC>(acc_s, smod);
      }
      uint32_t p_frag[kWC / 8][2];
      // The plain-scores path where there is room for it: the kernels that run dropout (with
      // it d = 96's atomic and d = 256's default dK/dV kernels spilled 12-84 bytes).
      probs_t<kWC, Is_causal, Is_local, Is_ext, Is_ext && kD <= kBwdBiasMaxHeadDim, kBiasAhead,
              kDropout>(
          acc_s, p_frag, sLse, qc0, t, scale_log2, need_mask, n0 + 16 * wn + g, m0, kr,
          si.causal_off(), si.window_lower(), smod, params, bias_w);
      if (has_next) bias_ahead(it + 1);

      // Dropout (dropout.h): the kept P for dV (its 1 / (1 - p) at the end), the kept, scaled
      // dP for dS; the bits were taken at the top of the iteration.
      if (kDropout && params.dropout) {
        dropout_apply_bits<kWC / 8>(p_frag, keep);
        dropout_sign_p<kWC / 8>(acc_s, keep);
      }

      // ---- dV += P^T dO (16 keys x d per warp; k = this warp's queries).
      gemm_rs_t<kWC, kDO, kRowB, false>(acc_dv, p_frag, q_t_addr + kDofromQ);

      // ---- dP^T = V_w dO^T.
      float acc_dp[kWC / 8][4];
      zero_acc(acc_dp);
#pragma unroll
      for (int kk = 0; kk < kD / 16; ++kk) {
        uint32_t a[4];
        ldmatrix_x4(a, k_a_addr + kVfromK + kk * 32);
        const uint32_t a_lo[2] = {a[0], a[1]};
        const uint32_t a_hi[2] = {a[2], a[3]};
#pragma unroll
        for (int np = 0; np < kWC / 16; ++np) {
          uint32_t b[4];
          ldmatrix_x4(b, q_b_addr + kDofromQ + np * 16 * kRowB + kk * 32);
          mma_k2n2(acc_dp[2 * np], acc_dp[2 * np + 1], a_lo, a_hi, b);
        }
      }

      // ---- dS^T = P^T o (dP^T - D[query]) (fp16 A fragments; also to sdS in atomic mode).
      uint32_t ds_frag[kWC / 8][2];
      if (kDropout && params.dropout) {
        dsoftmax_t<kWC, true>(acc_s, acc_dp, ds_frag, sDsum, qc0, t, params.dropout_rp);
      } else {
        dsoftmax_t<kWC>(acc_s, acc_dp, ds_frag, sDsum, qc0, t);
      }
      if (Atomic_dq && ws == 0) {  // the column splits hold the same dS^T
#pragma unroll
        for (int nt = 0; nt < kWC / 8; ++nt) {
          __half* row_ptr = sdS + (16 * wn + g) * kDsRow + qc0 + 8 * nt + 2 * t;
          *reinterpret_cast<uint32_t*>(row_ptr) = ds_frag[nt][0];
          *reinterpret_cast<uint32_t*>(row_ptr + 8 * kDsRow) = ds_frag[nt][1];
        }
      }

      // ---- dK += dS^T Q.
      gemm_rs_t<kWC, kDO, kRowB, false>(acc_dk, ds_frag, q_t_addr);

      if constexpr (Atomic_dq) {
        __syncthreads();  // dS^T complete in smem; every warp is done with sQ and sdO
        if (has_next) load_tile(it + 1);
        // ---- dQ_tile = dS K: warp (rq, cq) computes rows 16 rq .. 16 rq + 15 and columns
        // cq * kDqCols .. of the Br x d tile, k = the Bc keys. A = dS from sdS^T (trans),
        // B = K (k = keys) from sK (trans).
        constexpr int kDqC = Kt::kDqCols;
        const int rq = warp % Kt::kDqWarpsM;
        const int cq = warp / Kt::kDqWarpsM;
        const uint32_t ds_a_addr =
            smem_u32addr(sdS + ((mi >> 1) * 8 + (lane % 8)) * kDsRow + 16 * rq + (mi & 1) * 8);
        const uint32_t k_t_addr =
            smem_u32addr(sK + ((mi & 1) * 8 + (lane % 8)) * kRowH + cq * kDqC + (mi >> 1) * 8);
        float acc_dq[kDqC / 8][4];
        zero_acc(acc_dq);
#pragma unroll
        for (int kk = 0; kk < kBN / 16; ++kk) {
          uint32_t a[4];
          ldmatrix_x4_trans(a, ds_a_addr + kk * 16 * kDsRow * 2);
          const uint32_t a_lo[2] = {a[0], a[1]};
          const uint32_t a_hi[2] = {a[2], a[3]};
#pragma unroll
          for (int np = 0; np < kDqC / 16; ++np) {
            uint32_t b[4];
            ldmatrix_x4_trans(b, k_t_addr + kk * 16 * kRowB + np * 32);
            mma_k2n2(acc_dq[2 * np], acc_dq[2 * np + 1], a_lo, a_hi, b);
          }
        }
#pragma unroll
        for (int nt = 0; nt < kDqC / 8; ++nt) {
          const int row = 16 * rq + g;
          const int col = cq * kDqC + 8 * nt + 2 * t;
          *reinterpret_cast<float2*>(sdQ + fp32_tile_offset<kD>(row, col)) =
              make_float2(acc_dq[nt][0], acc_dq[nt][1]);
          *reinterpret_cast<float2*>(sdQ + fp32_tile_offset<kD>(row + 8, col)) =
              make_float2(acc_dq[nt][2], acc_dq[nt][3]);
        }
        __syncthreads();
        // Coalesced fp32 atomics: the tile's rows are contiguous in dq_accum (b, h, sq, kD). Each
        // step covers kRowsPerStep whole rows; the thread's column is fixed, so every step is a
        // constant offset (immediates, no per-step address registers). Columns past d hold 0
        // (zero K columns) and are skipped. When kD does not divide the threads (d = 96: 2 rows
        // of 96 per 256 threads), the threads past kRowsPerStep rows idle.
        float* dq_acc = params.dq_accum_ptr + si.lse_index(bidb, head, m0) * kD + tid;
        constexpr int kRowsPerStep = Kt::kNThreads / kD;
        static_assert(kRowsPerStep >= 1 && kBM % kRowsPerStep == 0, "dQ atomics: whole rows");
        const int my_row = tid / kD;
        const float* src = sdQ + fp32_tile_offset<kD>(my_row, tid % kD);
        const bool active = Kt::kNThreads % kD == 0 || my_row < kRowsPerStep;
        const int rows_left = active && tid % kD < params.d ? si.seqlen_q() - m0 - my_row : 0;
#pragma unroll
        for (int i = 0; i < kBM / kRowsPerStep; ++i) {
          if (i * kRowsPerStep < rows_left) {
            atomicAdd(dq_acc + i * kRowsPerStep * kD, src[i * kRowsPerStep * (kD + 8)]);
          }
        }
      }

      __syncthreads();  // every warp is done with sQ, sdO, sLse, sDsum (and sdQ, sdS)
      if (has_next) {
        store_tile();
        __syncthreads();
      }
    }
  }

  if (kDropout && params.dropout) {  // dV = (P o Z)^T dO / (1 - p)
#pragma unroll
    for (int i = 0; i < kDO / 8; ++i) {
#pragma unroll
      for (int j = 0; j < 4; ++j) acc_dv[i][j] *= params.dropout_rp;
    }
  }
  // ---- epilogue: sum the kNWarpsM partial dK/dV of each key group through shared memory
  // (sRed aliases sK + sV, free now), then the wm == 0 warps write dK * scale and dV.
  if (Kt::kNWarpsM > 1) {
    __syncthreads();
    reduce_over_query_splits<Kt>(acc_dk, sRed, wn, wm, col0, g, t);
    reduce_over_query_splits<Kt>(acc_dv, sRed, wn, wm, col0, g, t);
  }
  if (wm == 0) {
    store_dkdv<kDO>(params, acc_dk, acc_dv, bidb, bidh_k, n0 + 16 * wn, col0, g, t, si);
  }
}

// ---------------------------------------------------------------------------------------------
// dK / dV with each warp's K rows in registers: the plain (no score modifier, bias, dropout,
// packed sequences), non-banded, deterministic calls of a head dim with
// Bwd_tile_config::KregTraits (Flash_bwd_dkdv_kreg_traits). Warp w owns keys 16 w .. 16 w + 15
// of the block and all kBlockM queries of each tile:
//   S^T = K_w Q^T and dP^T = V_w dO^T in one k loop (4 independent MMA chains per warp), then
//   P^T -> dV += P^T dO -> dS^T = P^T o (dP^T - D) -> dK += dS^T Q,
// with S^T's A operands from registers, V_w's from shared memory (or, with Kt::kVInRegs, from
// registers loaded once beside K's) and every B operand from shared memory. The next
// tile's Q is fetched at the top of the iteration and stored to the other Q buffer after S^T /
// dP^T (nobody reads that buffer in this iteration); its dO, lse and D are fetched then and
// stored after dK, between two barriers (one dO buffer: two CTAs of this kernel must fit a 64
// KiB Turing SM).
template <typename Kt, bool Is_causal>
__global__ void __launch_bounds__(Kt::kNThreads, Kt::kMinBlocksPerSm)
    flash_bwd_dkdv_kreg_kernel(const Flash_bwd_params params) {
  constexpr int kD = Kt::kHeadDim;
  constexpr int kBM = Kt::kBlockM;
  constexpr int kBN = Kt::kBlockN;
  constexpr int kRowH = Kt::kRowHalves;
  constexpr int kRowB = Kt::kRowHalves * 2;
  constexpr uint32_t kQBuf = Kt::kQTileBytes;            // Q buffer 1 from buffer 0 (bytes)
  constexpr uint32_t kDofromQ = Kt::kOffDo - Kt::kOffQ;  // sdO from Q buffer 0 (bytes)

  extern __shared__ __align__(1024) unsigned char smem_raw[];
  __half* sQ0 = reinterpret_cast<__half*>(smem_raw + Kt::kOffQ);     // [2] Br x d
  __half* sdO = reinterpret_cast<__half*>(smem_raw + Kt::kOffDo);    // Br x d
  float* sLse = reinterpret_cast<float*>(smem_raw + Kt::kOffLse);    // Br: lse * log2(e)
  float* sDsum = reinterpret_cast<float*>(smem_raw + Kt::kOffDsum);  // Br: D
  __half* sV = reinterpret_cast<__half*>(smem_raw + Kt::kOffV);      // Bc x d (K's staging first)

  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int g = lane / 4;
  const int t = lane % 4;
  const int mi = lane / 8;

  const DkdvBlock blk = dkdv_block<Is_causal>(params, kBN);
  const int n_block = blk.n_block, bidb = blk.bidb, bidh_k = blk.bidh_k;
  const int ratio = params.h_h_k_ratio;
  const int n0 = n_block * kBN;
  const SeqInfo<false> si(params, bidb);
  const KeyRange kr = si.keys(bidb);
  const MBlockRange mr = m_block_range(n_block, kBM, kBN, si.seqlen_q(), kr, Is_causal,
                                       si.causal_off());
  const int num_m = imax(mr.m_block_max - mr.m_block_min, 0);
  const int total = num_m * ratio;  // (q head of the group, query tile) iterations
  const float scale_log2 = params.scale_softmax_log2;

  float acc_dk[kD / 8][4];
  float acc_dv[kD / 8][4];
  zero_acc(acc_dk);
  zero_acc(acc_dv);

  if (total > 0) {
    // ---- K_w: global -> shared (V's space, padded rows, zero rows outside the key range) ->
    // registers; then V -> shared. k_frag[kk]: the A fragments of k-steps 2kk, 2kk + 1.
    uint32_t k_frag[kD / 16][4];
    uint32_t v_frag[Kt::kVInRegs ? kD / 16 : 1][4];
    const uint32_t v_a_addr =
        smem_u32addr(sV + (16 * warp + (lane % 16)) * kRowH + (lane / 16) * 8);
    {
      const __half* k_base = kv_rows<false>(params, si, bidb, bidh_k);
      const __half* v_base = kv_rows<true>(params, si, bidb, bidh_k);
      uint4 kv[Kt::kKVChunksPerThread];
      load_tile_g2r<Kt>(kv, k_base, params.k_row_stride, n0, kr.key_start, kr.key_end, tid,
                        params.d / 8);
      store_tile_r2s_padded<Kt>(kv, sV, tid);
      load_tile_g2r<Kt>(kv, v_base, params.v_row_stride, n0, kr.key_start, kr.key_end, tid,
                        params.d / 8);
      __syncthreads();
#pragma unroll
      for (int kk = 0; kk < kD / 16; ++kk) ldmatrix_x4(k_frag[kk], v_a_addr + kk * 32);
      __syncthreads();  // every warp holds its K fragments before V overwrites them
      store_tile_r2s_padded<Kt>(kv, sV, tid);
      if constexpr (Kt::kVInRegs) {  // V_w's A fragments too: the loop then reads no V
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < kD / 16; ++kk) ldmatrix_x4(v_frag[kk], v_a_addr + kk * 32);
      }
    }

    // Iterations run over (q-head of the group, query tile) pairs, query tiles inner. The
    // cursor (nx_head, nx_m) names the next tile to fetch and steps without a division.
    int nx_head = bidh_k * ratio;
    int nx_m = mr.m_block_min;
    auto advance = [&] {
      if (++nx_m == mr.m_block_max) {
        nx_m = mr.m_block_min;
        ++nx_head;
      }
    };
    constexpr int kQC = Kt::kQChunksPerThread;
    auto load_q = [&](uint4 (&st)[kQC], int head, int m) {
      load_tile_g2r<Kt>(st,
                        static_cast<const __half*>(params.q_ptr) +
                            si.q_offset(bidb, params.q_batch_stride, params.q_row_stride) +
                            head * params.q_head_stride,
                        params.q_row_stride, m * kBM, 0, si.seqlen_q(), tid, params.d / 8);
    };
    auto load_do = [&](uint4 (&st)[kQC], int head, int m) {
      load_tile_g2r<Kt>(st,
                        static_cast<const __half*>(params.do_ptr) +
                            si.q_offset(bidb, params.do_batch_stride, params.do_row_stride) +
                            head * params.do_head_stride,
                        params.do_row_stride, m * kBM, 0, si.seqlen_q(), tid, params.d / 8);
    };
    // Raw lse (-inf past seqlen_q; converted by lse_log2 where it is stored) and D of row tid
    // of tile (head, m) (threads tid < Br).
    auto load_lse = [&](float& lse_s, float& dsum_s, int head, int m) {
      const int row = m * kBM + tid;
      const int64_t off = si.lse_index(bidb, head, row);
      lse_s = row < si.seqlen_q() ? params.softmax_lse_ptr[off] : -INFINITY;
      dsum_s = row < si.seqlen_q() ? params.dsoftmax_sum[off] : 0.f;
    };

    uint4 stage[kQC];  // Q, then dO, of the next tile
    float lse_stage = 0.f, dsum_stage = 0.f;
    {  // tile 0 -> Q buffer 0, sdO, sLse, sDsum
      load_q(stage, nx_head, nx_m);
      store_tile_r2s_padded<Kt>(stage, sQ0, tid);
      load_do(stage, nx_head, nx_m);
      store_tile_r2s_padded<Kt>(stage, sdO, tid);
      if (tid < kBM) {
        load_lse(lse_stage, dsum_stage, nx_head, nx_m);
        sLse[tid] = lse_log2(lse_stage);
        sDsum[tid] = dsum_stage;
      }
      advance();
    }
    __syncthreads();

    // Per-lane ldmatrix addresses in Q buffer 0 (as flash_bwd_dkdv_kernel's, with all kBM
    // queries in one warp): B of S^T / dP^T (Q / dO rows, non-trans), B of dV / dK (trans).
    const uint32_t q_b_addr0 =
        smem_u32addr(sQ0 + ((mi >> 1) * 8 + (lane % 8)) * kRowH + (mi & 1) * 8);
    const uint32_t q_t_addr0 =
        smem_u32addr(sQ0 + ((mi & 1) * 8 + (lane % 8)) * kRowH + (mi >> 1) * 8);

    int cur_m = mr.m_block_min;  // query tile of iteration it
    for (int it = 0; it < total; ++it) {
      const uint32_t qbuf = (it & 1) * kQBuf;
      const uint32_t q_b_addr = q_b_addr0 + qbuf;
      const uint32_t q_t_addr = q_t_addr0 + qbuf;
      __half* sQn = sQ0 + ((it + 1) & 1) * (kQBuf / 2);  // the next tile's Q buffer (halves)
      const int m0 = cur_m * kBM;
      const bool has_next = it + 1 < total;
      if (has_next) {
        load_q(stage, nx_head, nx_m);
        if (tid < kBM) load_lse(lse_stage, dsum_stage, nx_head, nx_m);
      }

      const bool need_mask =
          !tile_is_unmasked(cur_m, n_block, kBM, kBN, kr, Is_causal, si.causal_off());
      // ---- S^T = K_w Q^T and dP^T = V_w dO^T (16 keys x Br queries per warp), one k loop.
      // The tile's lse pairs, read before the k loop: read right before P^T, their latency
      // stalled the P^T FFMAs (ncu, d = 128).
      float2 lse2[kBM / 8];
      read_pairs<kBM>(lse2, sLse, 0, t);
      float acc_s[kBM / 8][4];
      float acc_dp[kBM / 8][4];
      zero_acc(acc_s);
      zero_acc(acc_dp);
#pragma unroll
      for (int kk = 0; kk < kD / 16; ++kk) {
        {
          const uint32_t a_lo[2] = {k_frag[kk][0], k_frag[kk][1]};
          const uint32_t a_hi[2] = {k_frag[kk][2], k_frag[kk][3]};
#pragma unroll
          for (int np = 0; np < kBM / 16; ++np) {
            uint32_t b[4];
            ldmatrix_x4(b, q_b_addr + np * 16 * kRowB + kk * 32);
            mma_k2n2(acc_s[2 * np], acc_s[2 * np + 1], a_lo, a_hi, b);
          }
        }
        uint32_t a[4];
        if constexpr (Kt::kVInRegs) {
#pragma unroll
          for (int r = 0; r < 4; ++r) a[r] = v_frag[kk][r];
        } else {
          ldmatrix_x4(a, v_a_addr + kk * 32);
        }
        const uint32_t a_lo[2] = {a[0], a[1]};
        const uint32_t a_hi[2] = {a[2], a[3]};
#pragma unroll
        for (int np = 0; np < kBM / 16; ++np) {
          uint32_t b[4];
          ldmatrix_x4(b, q_b_addr0 + kDofromQ + np * 16 * kRowB + kk * 32);
          mma_k2n2(acc_dp[2 * np], acc_dp[2 * np + 1], a_lo, a_hi, b);
        }
      }
      if (has_next) {  // the next tile's Q to the other buffer; its dO loads in flight from here
        store_tile_r2s_padded<Kt>(stage, sQn, tid);
        load_do(stage, nx_head, nx_m);
      }

      // ---- P^T, then dV += P^T dO.
      uint32_t p_frag[kBM / 8][2];
      probs_t_plain<kBM, Is_causal, false>(acc_s, p_frag, lse2, 0, t, scale_log2, need_mask,
                                           n0 + 16 * warp + g, m0, kr, si.causal_off(),
                                           kNoWindowLower);
      float2 dsum2[kBM / 8];  // read a product ahead of their use, as lse2
      read_pairs<kBM>(dsum2, sDsum, 0, t);
      gemm_rs_t<kBM, kD, kRowB, false>(acc_dv, p_frag, q_t_addr0 + kDofromQ);

      // ---- dS^T = P^T o (dP^T - D), then dK += dS^T Q.
      uint32_t ds_frag[kBM / 8][2];
      dsoftmax_t<kBM>(acc_s, acc_dp, ds_frag, dsum2);
      gemm_rs_t<kBM, kD, kRowB, false>(acc_dk, ds_frag, q_t_addr);
      if (has_next) {
        __syncthreads();  // every warp is done with sdO, sLse and sDsum of this tile
        store_tile_r2s_padded<Kt>(stage, sdO, tid);
        if (tid < kBM) {
          sLse[tid] = lse_log2(lse_stage);
          sDsum[tid] = dsum_stage;
        }
        __syncthreads();  // the next tile's Q (stored after S^T), dO, lse and D visible
      }
      if (++cur_m == mr.m_block_max) cur_m = mr.m_block_min;
      advance();
    }
  }
  store_dkdv<kD>(params, acc_dk, acc_dv, bidb, bidh_k, n0 + 16 * warp, 0, g, t, si);
}

// A warp's dS fragments (fp16 A layout: rows row, row + 8; keys col + 8 nt, + 1) of (batch,
// head) bh into the fp32 bias gradient. Scalar stores: seqlen_k may be odd, and a warp's stores
// still fill whole 32-byte sectors (8 rows x 8 keys per pair of stores).
__device__ __forceinline__ void store_dbias(const Flash_bwd_params& params, int64_t bh, int row,
                                            int col, const float (&ds)[4]) {
  // 32-bit offsets inside the (batch, head) slice: the host keeps seqlen_q * seqlen_k < 2^31.
  float* slice = params.dbias_ptr + bh * params.seqlen_q * params.seqlen_k;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = row + 8 * half;
    if (r < params.seqlen_q) {
      if (col < params.seqlen_k) slice[r * params.seqlen_k + col] = ds[2 * half];
      if (col + 1 < params.seqlen_k) slice[r * params.seqlen_k + col + 1] = ds[2 * half + 1];
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Deterministic dQ: one CTA per (query tile, batch, head), 16 query rows per warp (row group wr),
// streaming the K/V tiles the tile sees (the forward's loop): S = Q K^T, P, dP = dO V^T, dS,
// dQ += dS K. With Kt::kDSplit > 1 the kDSplit warps of a row group (ws = 0 ..) each accumulate
// dQ columns col0 = ws * kDOut .. and recompute the same S and dP.
template <typename Kt, bool Is_causal, bool Is_local = false, bool Is_ext = false,
          bool Drop_only = false>
__global__ void __launch_bounds__(Kt::kNThreads)
    flash_bwd_dq_kernel(const Flash_bwd_params params) {
  static_assert(!(Is_ext && Drop_only), "one family");
  constexpr bool kDrop = Is_ext || Drop_only;  // dropout's code
  constexpr int kD = Kt::kHeadDim;
  constexpr int kBM = Kt::kBlockM;
  constexpr int kBN = Kt::kBlockN;
  constexpr int kCPR = Kt::kChunksPerRow;
  constexpr bool kPad = Kt::kPaddedRows;  // shared layout (smem_layout.h): padded or swizzled
  using L = SmemRows<kCPR, kPad>;
  constexpr int kRowBytes = L::kRowBytes;
  constexpr int kDO = Kt::kDOut;
  constexpr bool kQS = Kt::kQInSmem;
  // Two [K | V] buffers (Kt::kKVDoubleBuf), in the plain kernels only: the extended ones (score
  // modifiers, bias, dropout, packed sequences) keep their single buffer, whose load order the
  // dropout generator and the bias gradient's stores were fitted around (registers).
  constexpr bool kDbl = Kt::kKVDoubleBuf && !kDrop;
  // 16-byte chunks of a row that exist (head_dims.h: the tail past head_dim d).
  const int dc = params.d / 8;

  extern __shared__ __align__(1024) unsigned char smem_raw[];
  // kQInSmem: [sQ: Br x d][sdO: Br x d][sK][sV]. Otherwise [sK: Bc x d][sV] (kDbl: [sK][sV]
  // [sK'][sV'], two buffers), which also stages the Q and dO tiles before the loop. The dQ tile
  // is staged through sQ (kQInSmem) or sK.
  __half* sQ = reinterpret_cast<__half*>(smem_raw + Kt::kOffQ);
  __half* sdO = reinterpret_cast<__half*>(smem_raw + Kt::kOffDo);
  __half* sK = reinterpret_cast<__half*>(smem_raw + Kt::kOffK);
  __half* sV = sK + kBN * Kt::kRowHalves;

  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int g = lane / 4;
  const int t = lane % 4;
  const int wr = Kt::kDSplit == 1 ? warp : warp % Kt::kRowGroups;  // rows 16 wr .. 16 wr + 15
  const int ws = Kt::kDSplit == 1 ? 0 : warp / Kt::kRowGroups;     // dQ columns col0 ..
  const int col0 = ws * kDO;

  const int num_m_blocks = ceil_div(params.seqlen_q, kBM);
  const int64_t num_bh = static_cast<int64_t>(params.b) * params.h;
  const int64_t linear = blockIdx.x;
  int m_block;
  int64_t bh;
  if (Is_causal) {
    const TileOrder o = causal_tile_order(linear, num_m_blocks, num_bh);
    bh = o.bh;
    m_block = num_m_blocks - 1 - o.rank;
  } else {
    m_block = static_cast<int>(linear % num_m_blocks);
    bh = linear / num_m_blocks;
  }
  const int bidb = static_cast<int>(bh / params.h);
  const int bidh = static_cast<int>(bh % params.h);
  const int bidh_k = bidh / params.h_h_k_ratio;

  constexpr bool kSeq = Is_ext && Kt::kPackedSeq;
  const SeqInfo<kSeq> si(params, bidb);
  // A packed entry shorter than the grid's longest: its tiles past its rows have nothing to do
  // (uniform over the CTA, before any barrier).
  if constexpr (kSeq) {
    if (m_block * kBM >= si.seqlen_q()) return;
  }
  const __half* q_base = static_cast<const __half*>(params.q_ptr) +
                         si.q_offset(bidb, params.q_batch_stride, params.q_row_stride) +
                         bidh * params.q_head_stride;
  const __half* do_base = static_cast<const __half*>(params.do_ptr) +
                          si.q_offset(bidb, params.do_batch_stride, params.do_row_stride) +
                          bidh * params.do_head_stride;
  const __half* k_base = static_cast<const __half*>(params.k_ptr) +
                         si.k_offset(bidb, params.k_batch_stride, params.k_row_stride) +
                         bidh_k * params.k_head_stride;
  const __half* v_base = static_cast<const __half*>(params.v_ptr) +
                         si.k_offset(bidb, params.v_batch_stride, params.v_row_stride) +
                         bidh_k * params.v_head_stride;
  __half* dq_base = static_cast<__half*>(params.dq_ptr) +
                    si.q_offset(bidb, params.dq_batch_stride, params.dq_row_stride) +
                    bidh * params.dq_head_stride;

  const KeyRange kr = si.keys(bidb);
  const BlockRange nb = n_block_range<Is_local>(m_block, kBM, kBN, si.seqlen_q(), kr, Is_causal,
                                                si.causal_off(), si.window_lower());
  const int row0 = m_block * kBM;
  const float scale_log2 = params.scale_softmax_log2;

  // lse (log2 units; +inf for rows without keys or past seqlen_q) and D of rows g, g + 8.
  float lse_l2[2], dsum[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row0 + 16 * wr + g + 8 * r;
    int64_t off;
    if constexpr (kSeq) {
      off = si.lse_index(bidb, bidh, row);
    } else {
      off = bh * params.seqlen_q + row;
    }
    lse_l2[r] = lse_log2(row < si.seqlen_q() ? params.softmax_lse_ptr[off] : -INFINITY);
    dsum[r] = row < si.seqlen_q() ? params.dsoftmax_sum[off] : 0.f;
  }

  float acc_dq[kDO / 8][4];
  zero_acc(acc_dq);

  if (nb.n_block_max > nb.n_block_min) {
    uint4 stage[Kt::kChunksPerThread];
    // A fragments of Q and dO: in registers (loaded once, as q_frag in the forward), or the
    // lane's ldmatrix address of this row group in sQ / sdO (kQInSmem).
    uint32_t q_frag[kQS ? 1 : kD / 16][4];
    uint32_t do_frag[kQS ? 1 : kD / 16][4];
    const uint32_t q_a_addr = lane_addr_a<kCPR, kPad>(kQS ? sQ : sK, 16 * wr, lane);
    const uint32_t do_a_addr = lane_addr_a<kCPR, kPad>(sdO, 16 * wr, lane);
    {
      uint4 qstage[Kt::kQChunksPerThread];
      if constexpr (kQS) {
        load_tile_g2r<Kt>(qstage, q_base, params.q_row_stride, row0, 0, si.seqlen_q(), tid, dc);
        store_tile_r2s<Kt>(qstage, sQ, tid);
        load_tile_g2r<Kt>(qstage, do_base, params.do_row_stride, row0, 0, si.seqlen_q(), tid,
                          dc);
        store_tile_r2s<Kt>(qstage, sdO, tid);
      } else {
        load_tile_g2r<Kt>(qstage, q_base, params.q_row_stride, row0, 0, si.seqlen_q(), tid, dc);
        store_tile_r2s<Kt>(qstage, sK, tid);
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < kD / 16; ++kk) {
          ldmatrix_x4(q_frag[kk], chunk_pair_addr<kPad>(q_a_addr, kk));
        }
        __syncthreads();
        load_tile_g2r<Kt>(qstage, do_base, params.do_row_stride, row0, 0, si.seqlen_q(), tid,
                          dc);
        store_tile_r2s<Kt>(qstage, sK, tid);
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < kD / 16; ++kk) {
          ldmatrix_x4(do_frag[kk], chunk_pair_addr<kPad>(q_a_addr, kk));
        }
        __syncthreads();
      }
    }
    load_tile_g2r<Kt>(stage, k_base, params.k_row_stride, nb.n_block_min * kBN, kr.key_start,
                      kr.key_end, tid, dc);
    store_tile_r2s<Kt>(stage, sK, tid);
    if constexpr (kDbl) {
      load_tile_g2r<Kt>(stage, v_base, params.v_row_stride, nb.n_block_min * kBN, kr.key_start,
                        kr.key_end, tid, dc);
      store_tile_r2s<Kt>(stage, sV, tid);
    }
    __syncthreads();

    // B of S = Q K^T and dP = dO V^T: K / V non-trans (as in the forward);
    // B of dQ += dS K: K trans (the forward's V pattern), moved to chunk pair col0 / 16 (chunk
    // pairs col0 / 16 + np are then one XOR or add each, see the kDOut assert in the traits).
    const uint32_t k_lane_addr = lane_addr_b<kCPR, kPad>(sK, lane);
    const uint32_t v_lane_addr = lane_addr_b<kCPR, kPad>(sV, lane);
    const uint32_t kt_lane_addr =
        chunk_pair_addr<kPad>(lane_addr_bt<kCPR, kPad>(sK, lane), col0 / 16);

    // kDbl: the loop's first tile in buffer 0, then alternating (byte offset buf_off from the
    // lane addresses above).
    uint32_t buf_off = 0;
    constexpr uint32_t kBufBytes = 2 * Kt::kKVBufHalves;
    for (int n_block = nb.n_block_min; n_block < nb.n_block_max; ++n_block) {
      if constexpr (kDbl) {
        // K_{j+1}: global loads in flight while S_j is computed.
        if (n_block + 1 < nb.n_block_max) {
          load_tile_g2r<Kt>(stage, k_base, params.k_row_stride, (n_block + 1) * kBN,
                            kr.key_start, kr.key_end, tid, dc);
        }
      } else {
        // V_j: global loads in flight while S_j is computed.
        load_tile_g2r<Kt>(stage, v_base, params.v_row_stride, n_block * kBN, kr.key_start,
                          kr.key_end, tid, dc);
      }

      // A bias's block loaded before the S MMAs (BiasPrefetch, kBN / 4 + 1 registers), where
      // registers allow: d = 64's Bc = 32 tile and d = 96, not d = 64's Bc = 64 tile (254 of
      // 255 without) nor d = 128 (28-44 bytes of spill).
      constexpr bool kBiasAhead = Is_ext && (kD == 96 || (kD <= 64 && kBN <= 32));
      BiasPrefetch<kBN> pf;
      pf.ok = false;
      if (kBiasAhead && params.bias_ptr != nullptr) {
        ScoreMod at{};
        at.bias_off = static_cast<int64_t>(bidb) * params.bias_batch_stride +
                      static_cast<int64_t>(bidh) * params.bias_head_stride;
        bias_prefetch<kBN>(pf, params, at, row0 + 16 * wr, n_block * kBN);
      }
      float acc_s[kBN / 8][4];
      if constexpr (kQS) {
        gemm_ss_bt<kD, kBN, kRowBytes, kPad>(acc_s, q_a_addr, k_lane_addr);
      } else {
        gemm_rs_bt<kD, kBN, kRowBytes, kPad>(acc_s, q_frag, k_lane_addr + buf_off);
      }
      // P = exp2(S * scale_log2 - lse), 0 where masked (kept in acc_s; Is_ext: times the
      // softcap's derivative, the factor dS needs).
      const bool need_mask =
          !tile_is_unmasked<Is_local>(m_block, n_block, kBM, kBN, kr, Is_causal, si.causal_off(),
                                      si.window_lower());
      bool plain = !Is_ext;
      if constexpr (Is_ext) {
        // Per tile, not once per CTA: kept across the loop its registers pushed the kernel
        // past 255 with dropout's generator.
        const ScoreMod smod = score_mod_for(params, bidb, bidh, si.alibi_off());
        softcap_scores<kBN>(acc_s, smod);
        // The bias before the softcap's derivative is read back (the host refuses a softcap
        // with a bias in the backward); the forward's layout, so the forward's reader.
        if (params.bias_ptr != nullptr) {
          // Scalar reads (no aligned column pairs, edge tiles) 4 at a time (d = 64's Bc = 32
          // tile 8); one at a time in d = 64's Bc = 64 tile, whose causal kernel spilled with 4
          // in flight: the host runs the Bc = 32 one for a bias without column pairs.
          constexpr int kGather = kD > 64 ? 4 : (kBN == 64 ? 0 : 8);
          if constexpr (kBiasAhead) {
            bias_apply<kBN, true, kGather>(acc_s, pf, params, smod, row0 + 16 * wr,
                                           n_block * kBN);
          } else {
            bias_scores<kBN, true, kGather>(acc_s, params, smod, row0 + 16 * wr, n_block * kBN);
          }
        }
        // Without a softcap or ALiBi (dropout, a bias) the plain kernel's loop below: no
        // per-score distance or derivative (uniform per tile; the bias is already in acc_s).
        // Not in d = 64's band kernel (4 bytes of spill with both loops).
        constexpr bool kPlainPath = !(Is_local && kD <= 64);
        if constexpr (kPlainPath) plain = no_score_mod(smod);
        if (!plain) {
#pragma unroll
          for (int nt = 0; nt < kBN / 8; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int row = row0 + 16 * wr + g + (e >= 2 ? 8 : 0);
              const int col = n_block * kBN + 8 * nt + 2 * t + (e & 1);
              float x = acc_s[nt][e];
              // Clamped at 0 as in probs_t: a bias's -inf score gives x * cap_in = -inf * 0 =
              // NaN without a softcap, and P (0) times NaN would be NaN.
              const float dcap = fmaxf(
                  alibi_and_dcap(smod, x, static_cast<float>(row + smod.offset - col)), 0.f);
              float p = recompute_p(x, scale_log2, lse_l2[e >> 1]);
              if (need_mask) {
                if (!key_visible<Is_local>(row, col, kr, Is_causal, si.causal_off(),
                                           si.window_lower())) {
                  p = 0.f;
                }
              }
              acc_s[nt][e] = p * dcap;
            }
          }
        }
      }
      if (!Is_ext || plain) {
#pragma unroll
        for (int nt = 0; nt < kBN / 8; ++nt) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            float p = recompute_p(acc_s[nt][e], scale_log2, lse_l2[e >> 1]);
            if (need_mask) {
              const int row = row0 + 16 * wr + g + (e >= 2 ? 8 : 0);
              const int col = n_block * kBN + 8 * nt + 2 * t + (e & 1);
              if (!key_visible<Is_local>(row, col, kr, Is_causal, si.causal_off(),
                                         si.window_lower())) {
                p = 0.f;
              }
            }
            acc_s[nt][e] = p;
          }
        }
      }

      if constexpr (kDbl) {
        // Into the idle buffer (last read in tile j - 1, before its closing barrier); V_{j+1}'s
        // loads then in flight during dP and dQ.
        if (n_block + 1 < nb.n_block_max) {
          __half* nxt = sK + ((buf_off ^ kBufBytes) / 2);
          store_tile_r2s<Kt>(stage, nxt, tid);
          load_tile_g2r<Kt>(stage, v_base, params.v_row_stride, (n_block + 1) * kBN,
                            kr.key_start, kr.key_end, tid, dc);
        }
      } else {
        store_tile_r2s<Kt>(stage, sV, tid);
        __syncthreads();  // V_j visible
      }
      if (kDrop && params.dropout) {  // P carries its keep bit in its sign (dropout.h),
        // between V_j's store and K_{j+1}'s loads, where no staging register is live
        dropout_visit<kBN / 8, false>(dropout_rng_saved(params), static_cast<uint32_t>(bh),
                                    row0 + 16 * wr, n_block * kBN, g, t,
                                    params.dropout_keep_threshold, [&](int nt, int e, bool k) {
                                      if (!k) acc_s[nt][e] = -acc_s[nt][e];
                                    });
      }
      const bool has_next = n_block + 1 < nb.n_block_max;
      // The bias gradient is dS itself (the bias is added to the scores unscaled), stored in
      // fp32 as it is computed (fp16-rounded dS summed over broadcast rows missed
      // FlashAttention's criterion); K_{j+1}'s loads are then issued after it: with them in
      // flight the d = 128 kernel spilled. Not compiled where the host refuses a bias gradient
      // (above kBwdBiasMaxHeadDim) nor in traits without kDbias (d = 64's Bc = 64 tile, which
      // spilled: DqBiasTraits, also in a sliding window's band).
      const bool dbias_tile = Kt::kDbias && Is_ext && kD <= kBwdBiasMaxHeadDim &&
                              params.dbias_ptr != nullptr;
      if (!kDbl && has_next && !dbias_tile) {  // K_{j+1}: loads in flight during dP and dQ
        load_tile_g2r<Kt>(stage, k_base, params.k_row_stride, (n_block + 1) * kBN, kr.key_start,
                          kr.key_end, tid, dc);
      }

      // ---- dP = dO V_j^T, then dS = P o (dP - D) as fp16 A fragments.
      uint32_t ds_frag[kBN / 8][2];
      {
        float acc_dp[kBN / 8][4];
        if constexpr (kQS) {
          gemm_ss_bt<kD, kBN, kRowBytes, kPad>(acc_dp, do_a_addr, v_lane_addr);
        } else {
          gemm_rs_bt<kD, kBN, kRowBytes, kPad>(acc_dp, do_frag, v_lane_addr + buf_off);
        }
        if constexpr (kDrop) {
          // acc_s holds P with the sign of its dropout keep bit (dropout_sign_p; never negative
          // without dropout, dropout_rp = 1): dS = P o (Z dP / (1 - p) - D), one form for both.
#pragma unroll
          for (int nt = 0; nt < kBN / 8; ++nt) {
            float ds[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              ds[e] = dropout_ds(acc_s[nt][e], acc_dp[nt][e], dsum[e >> 1], params.dropout_rp);
            }
            if (dbias_tile && ws == 0) {  // column split 0 (the others recompute the same dS)
              store_dbias(params, bh, row0 + 16 * wr + g, n_block * kBN + 8 * nt + 2 * t, ds);
            }
            ds_frag[nt][0] = pack_half2(ds[0], ds[1]);
            ds_frag[nt][1] = pack_half2(ds[2], ds[3]);
          }
          if (dbias_tile) {
            if (has_next) {
              load_tile_g2r<Kt>(stage, k_base, params.k_row_stride, (n_block + 1) * kBN,
                                kr.key_start, kr.key_end, tid, dc);
            }
          }
        } else {
#pragma unroll
          for (int nt = 0; nt < kBN / 8; ++nt) {
            ds_frag[nt][0] = pack_half2(acc_s[nt][0] * (acc_dp[nt][0] - dsum[0]),
                                        acc_s[nt][1] * (acc_dp[nt][1] - dsum[0]));
            ds_frag[nt][1] = pack_half2(acc_s[nt][2] * (acc_dp[nt][2] - dsum[1]),
                                        acc_s[nt][3] * (acc_dp[nt][3] - dsum[1]));
          }
        }
      }

      // ---- dQ[:, col0 ..] += dS K_j[:, col0 ..] (k = keys).
#pragma unroll
      for (int kp = 0; kp < kBN / 16; ++kp) {
#pragma unroll
        for (int np = 0; np < kDO / 16; ++np) {
          uint32_t b[4];
          ldmatrix_x4_trans(
              b, chunk_pair_addr<kPad>(kt_lane_addr + buf_off, np) + kp * 16 * kRowBytes);
          mma_k2n2(acc_dq[2 * np], acc_dq[2 * np + 1], ds_frag[2 * kp], ds_frag[2 * kp + 1], b);
        }
      }
      if constexpr (kDbl) {
        if (has_next) store_tile_r2s<Kt>(stage, sV + ((buf_off ^ kBufBytes) / 2), tid);
        // Tile j + 1 visible; every warp is done with buffer j % 2 (and, after the last tile,
        // with both: the epilogue stages dQ over them).
        __syncthreads();
        buf_off ^= kBufBytes;
      } else {
        __syncthreads();  // every warp is done with K_j and V_j (and sQ, sdO)
        if (has_next) {
          store_tile_r2s<Kt>(stage, sK, tid);
          __syncthreads();
        }
      }
    }
  }

  // ---- epilogue: dq = scale * acc_dq in fp16, staged through smem for 16-byte row stores. No
  // warp reads sQ / sK any more: every loop iteration ends with a barrier.
  const float scale = params.scale_softmax;
  __half* sO = kQS ? sQ : sK;
#pragma unroll
  for (int dt = 0; dt < kDO / 8; ++dt) {
    const int row = 16 * wr + g;
    const int ch = col0 / 8 + dt;
    *reinterpret_cast<uint32_t*>(sO + L::offset(row, ch) + 2 * t) =
        pack_half2(acc_dq[dt][0] * scale, acc_dq[dt][1] * scale);
    *reinterpret_cast<uint32_t*>(sO + L::offset(row + 8, ch) + 2 * t) =
        pack_half2(acc_dq[dt][2] * scale, acc_dq[dt][3] * scale);
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < Kt::kQChunksPerThread; ++i) {
    const int idx = tid + i * Kt::kNThreads;
    const int r = idx / kCPR;
    const int c = idx % kCPR;
    const int grow = row0 + r;
    if (grow < si.seqlen_q() && c < dc) {
      *reinterpret_cast<uint4*>(dq_base + grow * params.dq_row_stride + c * 8) =
          *reinterpret_cast<const uint4*>(sO + L::offset(r, c));
    }
  }
}

}  // namespace flash_sm75
