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
//  * Split tile (d = 128, Flash_fwd_kernel_traits::kSplitTile): each K/V tile as two halves of
//    Bc/2 keys, the softmax of one half in the same branch-free code as the MMAs of the other
//    (softmax_step), so one warp can overlap its own softmax with tensor-core work.
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
// kStyle picks the address arithmetic (same loads, different SASS; chosen per kernel by
// measurement, Flash_fwd_kernel_traits::kLoadStyle): 0 = a 64-bit row multiply per chunk;
// 1 = one row pointer per call plus a 64-bit step per chunk; 2 = as 1, with a CTA-uniform
// branch to unchecked loads when the whole tile is in range.
template <typename Kt, int kStyle = 0, int kN>
__device__ __forceinline__ void load_tile_g2r(uint4 (&stage)[kN], const __half* base,
                                              index_t row_stride, int row0, int valid_begin,
                                              int valid_end, int tid) {
  constexpr int kCPR = Kt::kChunksPerRow;
  if constexpr (kStyle == 0) {
#pragma unroll
    for (int i = 0; i < kN; ++i) {
      const int idx = tid + i * Kt::kNThreads;
      const int grow = row0 + idx / kCPR;
      if (grow >= valid_begin && grow < valid_end) {
        stage[i] = __ldg(reinterpret_cast<const uint4*>(base + grow * row_stride + idx % kCPR * 8));
      } else {
        stage[i] = make_uint4(0u, 0u, 0u, 0u);
      }
    }
    return;
  }
  constexpr int kRowsPerPass = Kt::kNThreads / kCPR;
  static_assert(Kt::kNThreads % kCPR == 0, "a pass covers whole rows");
  const int grow0 = row0 + tid / kCPR;
  const __half* p = base + grow0 * row_stride + (tid % kCPR) * 8;
  const index_t step = kRowsPerPass * row_stride;
  if (kStyle == 2 && row0 >= valid_begin && row0 + kN * kRowsPerPass <= valid_end) {
#pragma unroll
    for (int i = 0; i < kN; ++i) stage[i] = __ldg(reinterpret_cast<const uint4*>(p + i * step));
    return;
  }
#pragma unroll
  for (int i = 0; i < kN; ++i) {
    const int grow = grow0 + i * kRowsPerPass;
    if (grow >= valid_begin && grow < valid_end) {
      stage[i] = __ldg(reinterpret_cast<const uint4*>(p + i * step));
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

// Which (batch, head, query tile) a CTA owns and where its tensors start. A 1-D grid, so
// batch x heads is not limited by gridDim.y/z. Causal: the heaviest query tiles (last rows) are
// scheduled first.
struct FwdCta {
  int m_block, bidb, bidh;
  int64_t bh;
  const __half *q_base, *k_base, *v_base;
  __half* o_base;
  KeyRange kr;
  BlockRange nb;
};

template <typename Kt, bool Is_causal>
__device__ __forceinline__ FwdCta fwd_cta(const Flash_fwd_params& params) {
  FwdCta c;
  const int num_m_blocks = ceil_div(params.seqlen_q, Kt::kBlockM);
  const int64_t num_bh = static_cast<int64_t>(params.b) * params.h;
  const int64_t linear = blockIdx.x;
  if (Is_causal) {
    const TileOrder o = causal_tile_order(linear, num_m_blocks, num_bh);
    c.bh = o.bh;
    c.m_block = num_m_blocks - 1 - o.rank;
  } else {
    c.m_block = static_cast<int>(linear % num_m_blocks);
    c.bh = linear / num_m_blocks;
  }
  c.bidb = static_cast<int>(c.bh / params.h);
  c.bidh = static_cast<int>(c.bh % params.h);
  const int bidh_k = c.bidh / params.h_h_k_ratio;  // GQA: no K/V copy, just index the shared head
  c.q_base = static_cast<const __half*>(params.q_ptr) + c.bidb * params.q_batch_stride +
             c.bidh * params.q_head_stride;
  c.k_base = static_cast<const __half*>(params.k_ptr) + c.bidb * params.k_batch_stride +
             bidh_k * params.k_head_stride;
  c.v_base = static_cast<const __half*>(params.v_ptr) + c.bidb * params.v_batch_stride +
             bidh_k * params.v_head_stride;
  c.o_base = static_cast<__half*>(params.o_ptr) + c.bidb * params.o_batch_stride +
             c.bidh * params.o_head_stride;
  c.kr = key_range(params.seqlen_k, params.leftpad_k, params.seqused_k, c.bidb);
  c.nb = n_block_range(c.m_block, Kt::kBlockM, Kt::kBlockN, params.seqlen_q, c.kr, Is_causal,
                       params.causal_offset);
  return c;
}

// Set S to -inf where a key is not visible. Only tiles crossing the key range or the causal
// diagonal pay for it. row_w = first query row of this warp's 16 rows; the scores are keys
// [n_block * kBN, (n_block + 1) * kBN) (kBN: a whole K tile, or half of one with kSplitTile).
template <typename Kt, bool Is_causal, int kBN = Kt::kBlockN>
__device__ __forceinline__ void mask_scores(float (&acc_s)[kBN / 8][4], const FwdCta& c,
                                            int n_block, int row_w, int causal_off) {
  if (tile_is_unmasked(c.m_block, n_block, Kt::kBlockM, kBN, c.kr, Is_causal, causal_off)) return;
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int nt = 0; nt < kBN / 8; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int row = row_w + lane / 4 + (e >= 2 ? 8 : 0);
      const int col = n_block * kBN + 8 * nt + 2 * (lane % 4) + (e & 1);
      if (!key_visible(row, col, c.kr, Is_causal, causal_off)) acc_s[nt][e] = -INFINITY;
    }
  }
}

// Max of the running max m and row r (0: g, 1: g + 8) of the S fragments: this lane's
// elements, then over the quad (the lanes that hold the row).
template <int kBN>
__device__ __forceinline__ float row_max(const float (&acc_s)[kBN / 8][4], int r, float m) {
#pragma unroll
  for (int nt = 0; nt < kBN / 8; ++nt) {
    m = fmaxf(m, fmaxf(acc_s[nt][2 * r], acc_s[nt][2 * r + 1]));
  }
  return quad_allreduce_max(m);
}

// Move one row's running max to mx (>= m_i): l_i is rescaled, the factor alpha for O returned,
// and scaled_max set to the shift of exp2 for P.
__device__ __forceinline__ float move_max(float mx, float& m_i, float& l_i, float scale_log2,
                                          float& scaled_max) {
  // A row that has seen no key yet keeps m = -inf; use 0 as the shift so that
  // exp2(-inf - shift) = 0 instead of exp2(-inf + inf) = NaN.
  scaled_max = (mx == -INFINITY) ? 0.f : __fmul_rn(mx, scale_log2);
  // Not an FFMA: with the product rounded as scaled_max is, alpha <= 1 for any magnitude.
  const float alpha = exp2f(__fmul_rn(m_i, scale_log2) - scaled_max);
  m_i = mx;
  l_i *= alpha;
  return alpha;
}

// O (rows g and g + 8) *= alpha. Unconditional per tile: skipping it when no max grew was
// measured slower on the H200 as a per-tile branch on alpha != 1 (benchmarks/NOTES.md).
template <int kD>
__device__ __forceinline__ void rescale_o(float (&acc_o)[kD / 8][4], const float (&alpha)[2]) {
#pragma unroll
  for (int dt = 0; dt < kD / 8; ++dt) {
    acc_o[dt][0] *= alpha[0];
    acc_o[dt][1] *= alpha[0];
    acc_o[dt][2] *= alpha[1];
    acc_o[dt][3] *= alpha[1];
  }
}

// |S * scale_log2| from which P = exp2(S * scale_log2 - m) is computed from the rounded product
// (FMUL, FADD) instead of one FFMA: the FFMA subtracts the rounded m from the exact product, so
// the row max itself gets exp2(+-0.5 ulp), which is exp2(+-4096) at 2^36 (|q|, |k| ~ 10^4 at
// the default scale): inf or 0, then NaN. With both sides rounded alike P <= 1 exactly.
constexpr float kExactExpFrom = 16777216.f;  // 2^24: below it the FFMA's error is <= 0.5

// Whether a row max shifted by scaled_max (0 for a row without keys) needs the exact path,
// for any of the warp's rows (warp-uniform).
__device__ __forceinline__ bool warp_needs_exact_exp(const float (&scaled_max)[2]) {
  return warp_any(fabsf(scaled_max[0]) >= kExactExpFrom || fabsf(scaled_max[1]) >= kExactExpFrom);
}

// How exp_scores forms the exponent of a score x (c = scale_log2, sm = scaled_max = rn(m c)):
// kFfma: FFMA(x, c, -sm), exact enough while |sm| < kExactExpFrom; kExact: rn(x c) - sm (both
// sides rounded alike, P <= 1 at any magnitude); kResidual: FFMA(x, c, -sm) - res with
// res = FFMA(m, c, -sm) the exact rounding residual of the shift (softmax_step).
enum class ExpForm { kFfma, kExact, kResidual };

// P = exp2(exponent of S) for rows g, g + 8, summed into l_i and packed as the fp16 A fragments
// of O += P V. res is read only by ExpForm::kResidual.
template <int kBN, ExpForm kForm>
__device__ __forceinline__ void exp_scores(const float (&acc_s)[kBN / 8][4], float (&l_i)[2],
                                           const float (&scaled_max)[2], float scale_log2,
                                           uint32_t (&p_frag)[kBN / 8][2],
                                           const float (&res)[2]) {
#pragma unroll
  for (int nt = 0; nt < kBN / 8; ++nt) {
    float p[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float sm = scaled_max[e >> 1];
      const float x = acc_s[nt][e];
      if constexpr (kForm == ExpForm::kExact) {
        p[e] = exp2f(__fmul_rn(x, scale_log2) - sm);
      } else if constexpr (kForm == ExpForm::kResidual) {
        p[e] = exp2f(fmaf(x, scale_log2, -sm) - res[e >> 1]);
      } else {
        p[e] = exp2f(fmaf(x, scale_log2, -sm));
      }
    }
    l_i[0] += p[0] + p[1];
    l_i[1] += p[2] + p[3];
    p_frag[nt][0] = pack_half2(p[0], p[1]);
    p_frag[nt][1] = pack_half2(p[2], p[3]);
  }
}

// Whether the row max mx of row g or g + 8 grew past the running max m_i by more than kThr
// log2 units for any row of the warp (warp-uniform). NaN (both -inf: no key seen yet) and +inf
// (first key) count as growth.
template <int kThr>
__device__ __forceinline__ bool warp_max_grew(const float (&mx)[2], const float (&m_i)[2],
                                              float scale_log2) {
  return warp_any(!((mx[0] - m_i[0]) * scale_log2 <= static_cast<float>(kThr)) ||
                  !((mx[1] - m_i[1]) * scale_log2 <= static_cast<float>(kThr)));
}

// The threshold online-softmax step once the warp has decided (warp-uniform `move`) whether its
// rows move their running max to mx (row maxima; and rescale l and O) or keep the stale max;
// then P.
template <int kBN, int kD>
__device__ __forceinline__ void softmax_move_or_keep(bool move, const float (&acc_s)[kBN / 8][4],
                                                     const float (&mx)[2], float (&m_i)[2],
                                                     float (&l_i)[2], float (&acc_o)[kD / 8][4],
                                                     float scale_log2,
                                                     uint32_t (&p_frag)[kBN / 8][2],
                                                     bool& exact_exp) {
  float scaled_max[2], alpha[2];
  if (move) {  // warp-uniform branch
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      alpha[r] = move_max(mx[r], m_i[r], l_i[r], scale_log2, scaled_max[r]);
    }
    rescale_o<kD>(acc_o, alpha);
    exact_exp = warp_needs_exact_exp(scaled_max);
  } else {
    scaled_max[0] = m_i[0] * scale_log2;  // finite; P <= 2^(kThr + 0.5) (FFMA rounding)
    scaled_max[1] = m_i[1] * scale_log2;
  }
  if (exact_exp) {  // warp-uniform
    exp_scores<kBN, ExpForm::kExact>(acc_s, l_i, scaled_max, scale_log2, p_frag, scaled_max);
  } else {
    exp_scores<kBN, ExpForm::kFfma>(acc_s, l_i, scaled_max, scale_log2, p_frag, scaled_max);
  }
}

// One online-softmax step on the accumulator fragments of S (rows g and g + 8 of the warp):
// update the running max m_i and sum l_i, rescale O by exp2(m_old - m_new), and pack
// P = exp2(S * scale_log2 - m) as the fp16 A fragments of O += P V.
// kThr > 0 (Flash_fwd_kernel_traits::kRescaleThreshold; the d = 128 default uses 8): keep the
// stale max and skip the rescale while no row of the warp grew by more than kThr in log2 units.
// exact_exp (the caller's, false before the first tile) says the warp's scaled max reached
// kExactExpFrom (never at ordinary magnitudes): the exponents then take the exact path, and at
// kThr > 0 every tile moves the max (the stale-max bound P <= 2^kThr does not survive the
// rounding at that magnitude). The max only moves in the branches that recompute the flag.
template <int kBN, int kD, int kThr = 0>
__device__ __forceinline__ void softmax_rescale(const float (&acc_s)[kBN / 8][4], float (&m_i)[2],
                                                float (&l_i)[2], float (&acc_o)[kD / 8][4],
                                                float scale_log2, uint32_t (&p_frag)[kBN / 8][2],
                                                bool& exact_exp) {
  if constexpr (kThr > 0) {
    const float mx[2] = {row_max<kBN>(acc_s, 0, m_i[0]), row_max<kBN>(acc_s, 1, m_i[1])};
    softmax_move_or_keep<kBN, kD>(warp_max_grew<kThr>(mx, m_i, scale_log2) || exact_exp, acc_s,
                                  mx, m_i, l_i, acc_o, scale_log2, p_frag, exact_exp);
  } else {
    float scaled_max[2], alpha[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      alpha[r] = move_max(row_max<kBN>(acc_s, r, m_i[r]), m_i[r], l_i[r], scale_log2,
                          scaled_max[r]);
    }
    rescale_o<kD>(acc_o, alpha);
    exact_exp = warp_needs_exact_exp(scaled_max);
    if (exact_exp) {  // warp-uniform
      exp_scores<kBN, ExpForm::kExact>(acc_s, l_i, scaled_max, scale_log2, p_frag, scaled_max);
    } else {
      exp_scores<kBN, ExpForm::kFfma>(acc_s, l_i, scaled_max, scale_log2, p_frag, scaled_max);
    }
  }
}

// The online-softmax step of the split tile (Flash_fwd_kernel_traits::kSplitTile) for the kBN
// scores of one half: as softmax_rescale with threshold kThr > 0, but without a branch, so that
// the caller's MMAs of the other half can be interleaved with it. The rescale of O is left to
// the caller: when this returns true (warp-uniform), O must be multiplied by alpha after the
// MMAs that still use the old max have accumulated (alpha = 1 otherwise; l_i is already
// rescaled).
// Exponents: x -> exp2(FFMA(x, scale_log2, -scaled_max) - res), res = m * scale_log2 -
// scaled_max (the rounding residual of the shift, exact by FFMA). The exponent of the max m is 0
// exactly, of any x <= m at most 0, and equals (x - m) * scale_log2 up to one rounding at any
// magnitude: unlike FFMA(x, c, -rn(m c)) it does not carry the shift's rounding error (~1 ulp
// of |m c|, a visible error from |m c| ~ 2^15), and unlike rn(x c) - rn(m c) no error of the
// product either. alpha = exp2 of the same form at x = m_old. exact_exp then only forces the
// max to move (as in softmax_rescale).
template <int kBN, int kThr>
__device__ __forceinline__ bool softmax_step(const float (&acc_s)[kBN / 8][4], float (&m_i)[2],
                                             float (&l_i)[2], float scale_log2,
                                             uint32_t (&p_frag)[kBN / 8][2], float (&alpha)[2],
                                             bool& exact_exp) {
  static_assert(kThr > 0, "the split tile keeps a stale max");
  const float mx[2] = {row_max<kBN>(acc_s, 0, m_i[0]), row_max<kBN>(acc_s, 1, m_i[1])};
  const bool move = warp_max_grew<kThr>(mx, m_i, scale_log2) || exact_exp;
  float scaled_max[2], res[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float m_new = move ? mx[r] : m_i[r];
    // A row without keys keeps m = -inf: shift 0, so that exp2(-inf) = 0 (not -inf + inf).
    scaled_max[r] = (m_new == -INFINITY) ? 0.f : __fmul_rn(m_new, scale_log2);
    res[r] = (m_new == -INFINITY) ? 0.f : fmaf(m_new, scale_log2, -scaled_max[r]);
    // 1 exactly when the max stays; 0 for a row that had no key.
    alpha[r] = exp2f(fmaf(m_i[r], scale_log2, -scaled_max[r]) - res[r]);
    m_i[r] = m_new;
    l_i[r] *= alpha[r];
  }
  exact_exp = warp_needs_exact_exp(scaled_max);  // unchanged when the max stays
  exp_scores<kBN, ExpForm::kResidual>(acc_s, l_i, scaled_max, scale_log2, p_frag, res);
  return move;
}

// x limited to the finite fp16 range (NaN kept). O is a convex combination of V rows, but P is
// rounded to fp16 for P V while l sums the fp32 P, so O can exceed max |v| by ~2^-11 relative:
// from |v| ~ 65504 that rounded to inf before the clamp.
__device__ __forceinline__ float clamp_to_fp16_range(float x) {
  return x > 65504.f ? 65504.f : (x < -65504.f ? -65504.f : x);
}

// Epilogue: O = acc_o / l, LSE = m * scale + log(l); rows that saw no key get O = 0 and
// LSE = -inf (never NaN). The fp16 O tile is staged through shared memory sO (Br x d, free for
// this warp's rows when called) so the global stores are 16-byte, row-contiguous, coalesced.
template <typename Kt>
__device__ __forceinline__ void store_output(float (&acc_o)[Kt::kHeadDim / 8][4],
                                             const float (&m_i)[2], const float (&l_i)[2],
                                             const Flash_fwd_params& params, const FwdCta& c,
                                             __half* sO) {
  constexpr int kD = Kt::kHeadDim;
  constexpr int kCPR = Kt::kChunksPerRow;
  const int tid = threadIdx.x;
  const int warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  const int row0 = c.m_block * Kt::kBlockM;
  // One m16 row tile per warp. [1][2] rather than [2]: the flat array changes ptxas's register
  // assignment of this kernel (d = 64), this shape keeps the SASS it had with warps of more tiles.
  float lse[1][2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float l = quad_allreduce_sum(l_i[r]);
    // l = 0: the row saw no key (out 0, lse -inf). A NaN score makes l NaN: out and lse NaN,
    // as in PyTorch (l > 0 here would report such a row as empty, lse = -inf, and the
    // backward would then skip it, hiding the NaN from the gradients).
    const bool any = l != 0.f;
    const float inv_l = any ? 1.f / l : 0.f;
    lse[0][r] = any ? m_i[r] * params.scale_softmax + logf(l) : -INFINITY;
#pragma unroll
    for (int dt = 0; dt < kD / 8; ++dt) {
      acc_o[dt][2 * r] *= inv_l;
      acc_o[dt][2 * r + 1] *= inv_l;
    }
  }
#pragma unroll
  for (int dt = 0; dt < kD / 8; ++dt) {
    const int row = 16 * warp + g;
    *reinterpret_cast<uint32_t*>(sO + swizzle_offset<kCPR>(row, dt) + 2 * t) =
        pack_half2(clamp_to_fp16_range(acc_o[dt][0]), clamp_to_fp16_range(acc_o[dt][1]));
    *reinterpret_cast<uint32_t*>(sO + swizzle_offset<kCPR>(row + 8, dt) + 2 * t) =
        pack_half2(clamp_to_fp16_range(acc_o[dt][2]), clamp_to_fp16_range(acc_o[dt][3]));
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < Kt::kQChunksPerThread; ++i) {
    const int idx = tid + i * Kt::kNThreads;
    const int r = idx / kCPR;
    const int ch = idx % kCPR;
    const int grow = row0 + r;
    if (grow < params.seqlen_q) {
      *reinterpret_cast<uint4*>(c.o_base + grow * params.o_row_stride + ch * 8) =
          *reinterpret_cast<const uint4*>(sO + swizzle_offset<kCPR>(r, ch));
    }
  }
  if (t == 0) {
    float* lse_base = params.softmax_lse_ptr + c.bh * params.seqlen_q;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = row0 + 16 * warp + g + 8 * r;
      if (row < params.seqlen_q) lse_base[row] = lse[0][r];
    }
  }
}

// The main forward kernel: all warps in lock-step, two barriers per K/V tile.
template <typename Kt, bool Is_causal>
__global__ void __launch_bounds__(Kt::kNThreads, Kt::kMinBlocksPerSm)
    flash_fwd_kernel(const Flash_fwd_params params) {
  constexpr int kD = Kt::kHeadDim;
  constexpr int kBN = Kt::kBlockN;
  constexpr int kCPR = Kt::kChunksPerRow;
  constexpr int kRowBytes = kD * 2;
  constexpr int kLs = Kt::kLoadStyle;  // load_tile_g2r address arithmetic

  extern __shared__ __align__(1024) unsigned char smem_raw[];
  // kQInSmem: [sQ: Br x d][sK][sV], O staged through sQ. Otherwise [sK][sV], with the Q tile
  // (before the loop) and the O tile (after it) staged through the contiguous K+V space.
  __half* sQ = reinterpret_cast<__half*>(smem_raw);
  __half* sK = reinterpret_cast<__half*>(smem_raw + Kt::kSmemKVOffset);  // Bc x d
  __half* sV = sK + kBN * kD;                                            // Bc x d

  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const FwdCta c = fwd_cta<Kt, Is_causal>(params);
  const int row0 = c.m_block * Kt::kBlockM;
  const float scale_log2 = params.scale_softmax_log2;

  float m_i[2] = {-INFINITY, -INFINITY};  // running max of raw scores, rows g and g + 8
  bool exact_exp = false;  // softmax_rescale: the warp's scaled max needs exact exponents
  float l_i[2] = {0.f, 0.f};              // running sum of exp2(s * scale_log2 - m), per thread
  float acc_o[kD / 8][4];                 // unnormalised O, 16 x d per warp
  zero_acc(acc_o);

  if (c.nb.n_block_max > c.nb.n_block_min) {
    uint4 stage[Kt::kChunksPerThread];
    // ---- prologue: the Q tile and the first K tile are fetched together (one global-memory
    // round trip, not two); Q -> shared -> (unless kQInSmem) registers, then K_0 -> sK.
    const uint32_t q_lane_addr = lane_addr_a<kCPR>(sQ, 16 * warp, lane);
    {
      uint4 qstage[Kt::kQChunksPerThread];
      load_tile_g2r<Kt, kLs>(qstage, c.q_base, params.q_row_stride, row0, 0, params.seqlen_q, tid);
      load_tile_g2r<Kt, kLs>(stage, c.k_base, params.k_row_stride, c.nb.n_block_min * kBN,
                             c.kr.key_start, c.kr.key_end, tid);
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

    // Per-lane ldmatrix base addresses (chunk pair 0; fragment.h): K non-transposed as B of
    // S = Q K^T, V transposed as B of O += P V.
    const uint32_t k_lane_addr = lane_addr_b<kCPR>(sK, lane);
    const uint32_t v_lane_addr = lane_addr_bt<kCPR>(sV, lane);

    if constexpr (Kt::kSplitTile) {
      for (int n_block = c.nb.n_block_min; n_block < c.nb.n_block_max; ++n_block) {
        // The split tile: halves a (keys 0 .. Bc/2 - 1) and b of K_j / V_j.
        constexpr int kHalf = kBN / 2;
        constexpr uint32_t kHalfBytes = kHalf * kRowBytes;
        load_tile_g2r<Kt, kLs>(stage, c.v_base, params.v_row_stride, n_block * kBN, c.kr.key_start,
                               c.kr.key_end, tid);
        float acc_sa[kHalf / 8][4], acc_sb[kHalf / 8][4], alpha[2];
        uint32_t p_a[kHalf / 8][2], p_b[kHalf / 8][2];
        gemm_rs_bt<kD, kHalf, kRowBytes>(acc_sa, q_frag, k_lane_addr);
        mask_scores<Kt, Is_causal, kHalf>(acc_sa, c, 2 * n_block, row0 + 16 * warp,
                                          params.causal_offset);
        // S_b = Q K_b^T beside the softmax of half a.
        gemm_rs_bt<kD, kHalf, kRowBytes>(acc_sb, q_frag, k_lane_addr + kHalfBytes);
        if (softmax_step<kHalf, Kt::kRescaleThreshold>(acc_sa, m_i, l_i, scale_log2, p_a, alpha,
                                                       exact_exp)) {
          rescale_o<kD>(acc_o, alpha);
        }
        mask_scores<Kt, Is_causal, kHalf>(acc_sb, c, 2 * n_block + 1, row0 + 16 * warp,
                                          params.causal_offset);
        store_tile_r2s<Kt>(stage, sV, tid);
        __syncthreads();  // V_j visible; every warp is done with K_j
        const bool has_next = n_block + 1 < c.nb.n_block_max;
        if (has_next) {
          load_tile_g2r<Kt, kLs>(stage, c.k_base, params.k_row_stride, (n_block + 1) * kBN,
                                 c.kr.key_start, c.kr.key_end, tid);
        }
        // O += P_a V_a beside the softmax of half b; O is rescaled for b's max only after it.
        gemm_rs_t<kHalf, kD, kRowBytes, true>(acc_o, p_a, v_lane_addr);
        if (softmax_step<kHalf, Kt::kRescaleThreshold>(acc_sb, m_i, l_i, scale_log2, p_b, alpha,
                                                       exact_exp)) {
          rescale_o<kD>(acc_o, alpha);
        }
        gemm_rs_t<kHalf, kD, kRowBytes, true>(acc_o, p_b, v_lane_addr + kHalfBytes);
        if (has_next) store_tile_r2s<Kt>(stage, sK, tid);
        __syncthreads();  // K_{j+1} visible; every warp is done with V_j
      }
    } else {
      for (int n_block = c.nb.n_block_min; n_block < c.nb.n_block_max; ++n_block) {
        // V_j: global loads in flight while S_j and its softmax are computed.
        load_tile_g2r<Kt, kLs>(stage, c.v_base, params.v_row_stride, n_block * kBN, c.kr.key_start,
                               c.kr.key_end, tid);

        // ---- S = Q K_j^T (16 x Bc per warp, fp32), masked, then the online softmax.
        float acc_s[kBN / 8][4];
        if constexpr (Kt::kQInSmem) {
          gemm_ss_bt<kD, kBN, kRowBytes>(acc_s, q_lane_addr, k_lane_addr);
        } else {
          gemm_rs_bt<kD, kBN, kRowBytes>(acc_s, q_frag, k_lane_addr);
        }
        mask_scores<Kt, Is_causal>(acc_s, c, n_block, row0 + 16 * warp, params.causal_offset);
        uint32_t p_frag[kBN / 8][2];
        softmax_rescale<kBN, kD, Kt::kRescaleThreshold>(acc_s, m_i, l_i, acc_o, scale_log2,
                                                        p_frag, exact_exp);

        // Every warp finished reading sV in the previous iteration (last barrier below), so V_j
        // can be written now.
        store_tile_r2s<Kt>(stage, sV, tid);
        __syncthreads();  // V_j visible; every warp is done with K_j

        const bool has_next = n_block + 1 < c.nb.n_block_max;
        if (has_next) {  // K_{j+1}: global loads in flight during O += P V_j
          load_tile_g2r<Kt, kLs>(stage, c.k_base, params.k_row_stride, (n_block + 1) * kBN,
                                 c.kr.key_start, c.kr.key_end, tid);
        }
        gemm_rs_t<kBN, kD, kRowBytes, true>(acc_o, p_frag, v_lane_addr);  // O += P V
        if (has_next) store_tile_r2s<Kt>(stage, sK, tid);
        __syncthreads();  // K_{j+1} visible; every warp is done with V_j
      }
    }
  }

  // O staged through sQ (each warp only ever read its own 16 rows there) or the K+V space (free
  // after the loop's last barrier).
  if (Kt::kQInSmem) __syncwarp();
  store_output<Kt>(acc_o, m_i, l_i, params, c, Kt::kQInSmem ? sQ : sK);
}

}  // namespace flash_sm75
